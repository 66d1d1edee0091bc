"""Benchmark: load a trace with the embedded engine and run every summary.

Traces of N events are written with stepscope's own writer (the core API, compressed packets):
each training step is a ``step`` slice holding Dataloader / Forward / Backward / Optimization
phases, the phases hold nested user ranges, a second thread runs its own ranges, and a counter is
sampled every step. One *event* is one TrackEvent packet (a begin, an end, an instant or a
counter value): a range is two events.

    python tools/bench_analysis.py            # 100k and 1M events
    python tools/bench_analysis.py --10m      # and 10M events
    python tools/bench_analysis.py --sizes 200000 --keep /tmp/traces
    STEPSCOPE_TRACE_PROCESSOR=/path/to/trace_processor_shell \
        python tools/bench_analysis.py --engine trace_processor --per-table
    python tools/bench_analysis.py --steps 20000 --ranges 0 --engine trace_processor
                                              # a profiler-like run: 20k steps, no user ranges
    python tools/bench_analysis.py --collectives 4 --per-table
                                              # and 4 torch.distributed ops per step

The script puts the checkout's ``src`` first on ``sys.path`` itself (no PYTHONPATH needed).
Each size runs in a fresh subprocess (this same file, so the same ``src``) so that peak memory
(ru_maxrss) is that of one load.
The summaries are computed as a report does: ``summaries.all_tables(db)``, which computes the
shared base pieces once (``--per-table`` prints each table's share).
Targets (issue 3): 10M events loaded and summarized in <= 20 s, peak memory <= 2 GB. With
``--engine trace_processor`` (its binary from ``STEPSCOPE_TRACE_PROCESSOR`` or ``PATH``) the same
summaries run on Perfetto's trace processor; target (issue 17): all summaries within twice its
own load time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

RANGES_PER_PHASE = 8  # leaf ranges inside each phase
# events per step on the main thread: step + 4 phases + 4*R ranges (2 events each) + 1 counter
EVENTS_PER_STEP = 2 * (1 + 4 + 4 * RANGES_PER_PHASE) + 1


def generate(path: str, n_events: int, ranges: int = RANGES_PER_PHASE,
             steps: int | None = None, collectives: int = 0) -> dict:
    """Write a trace of about ``n_events`` events with the stepscope writer (``ranges`` leaf
    ranges per phase; ``steps``: that many steps, the worker thread then writing the rest;
    ``collectives``: that many torch.distributed ops per step in its Backward phase, as
    stepscope.pytorch writes them, one in four ended when enqueued on a device stream)."""
    import stepscope
    from stepscope import _schema

    per_step = 2 * (1 + 4 + 4 * ranges + collectives) + 1
    if steps is None:
        steps = max(1, n_events * 4 // (5 * per_step))  # 80 % main thread, 20 % worker
    worker_events = n_events - steps * per_step
    t0 = time.perf_counter()
    stop = threading.Event()

    def worker() -> None:
        for _ in range(max(0, worker_events // 2)):
            with stepscope.annotate("worker.prefetch"):
                pass
        stop.set()

    # a buffer large enough that the writer never drops events while we generate them
    with stepscope.trace(path, buffer_bytes=1 << 30) as sess:
        th = threading.Thread(target=worker, name="loader-worker")
        th.start()
        em = sess.emitter(clock="monotonic", level=_schema.LEVEL_SUMMARY)
        lane = sess.new_track(_schema.COLLECTIVES_TRACK_NAME)
        ops = [{_schema.ARG_OP: "allreduce", _schema.ARG_BYTES: 1 << (10 + c % 12),
                _schema.ARG_DTYPE: "float32", _schema.ARG_GROUP_SIZE: 8, _schema.ARG_GROUP: "0"}
               for c in range(collectives)]
        for c in range(0, collectives, 4):
            ops[c][_schema.ARG_COMPLETION] = _schema.COMPLETION_STREAM
        for s in range(steps):
            with stepscope.annotate(_schema.STEP_NAME.format(step=s), category=_schema.CAT_STEP,
                                    args={_schema.ARG_STEP: s} if s % 100 == 0 else None):
                for phase in _schema.PHASES:
                    with stepscope.annotate(phase, category=_schema.CAT_PHASE):
                        for r in range(ranges):
                            with stepscope.annotate(f"op{r}"):
                                pass
                        if phase == _schema.PHASE_BACKWARD:
                            for args in ops:
                                t = time.perf_counter_ns()
                                em.complete(t, 1000, args[_schema.ARG_OP], lane,
                                            _schema.CAT_COLLECTIVE, args)
                stepscope.counter("loss", 1.0 / (s + 1))
        th.join()
    return {"steps": steps, "write_s": time.perf_counter() - t0,
            "bytes": os.path.getsize(path)}


def measure(path: str, summaries_too: bool = True, engine: str = "embedded") -> dict:
    """Load + all summaries in this process; returns timings and peak memory (of this process:
    trace processor's own memory is not counted)."""
    from stepscope import analysis

    t0, c0 = time.perf_counter(), time.process_time()
    db = analysis.open(path, engine=engine)
    t1, c1 = time.perf_counter(), time.process_time()
    n_slices = db.query("SELECT COUNT(*) AS n FROM slice")[0]["n"]
    n_counters = db.query("SELECT COUNT(*) AS n FROM counter")[0]["n"]
    t2 = time.perf_counter()
    tables: dict = {}
    if summaries_too:
        _time_summaries(db, tables)
    else:  # --load-only: a few aggregate queries instead of the summaries
        for sql in ("SELECT name, COUNT(*), SUM(dur) FROM slice GROUP BY name",
                    "SELECT track_id, MAX(depth) FROM slice GROUP BY track_id",
                    "SELECT AVG(value) FROM counter"):
            db.query(sql)
    t3, c3 = time.perf_counter(), time.process_time()
    db.close()
    return {
        "load_s": t1 - t0, "summaries_s": t3 - t2, "total_s": (t1 - t0) + (t3 - t2),
        "load_cpu_s": c1 - c0, "total_cpu_s": c3 - c0,
        "slices": n_slices, "counters": n_counters, "tables": tables,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _time_summaries(db, tables: dict) -> None:
    """Run all summary tables at once (the shared base computed once, as a user's report does),
    recording each table's seconds in ``tables``."""
    from stepscope.analysis.summaries import tables as summaries

    inner = summaries._table

    def timed(db_, name, *args, **kw):
        t = time.perf_counter()
        try:
            return inner(db_, name, *args, **kw)
        finally:
            tables[name] = round(time.perf_counter() - t, 2)

    summaries._table = timed
    ts = time.perf_counter()
    try:
        summaries.all_tables(db)
        tables["all_tables"] = round(time.perf_counter() - ts, 2)
    except Exception as e:  # report, keep the load figures
        tables["all_tables"] = f"error: {type(e).__name__}: {str(e)[:80]}"
    finally:
        summaries._table = inner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[100_000, 1_000_000])
    ap.add_argument("--10m", dest="ten", action="store_true", help="also 10M events")
    ap.add_argument("--keep", help="directory to write/keep the traces in (reused if present)")
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--per-table", action="store_true", help="print each summary's seconds")
    ap.add_argument("--load-only", action="store_true",
                    help="load + three aggregate queries instead of the summaries")
    ap.add_argument("--engine", choices=("embedded", "trace_processor"), default="embedded",
                    help="the engine that loads and summarizes (trace_processor: its binary "
                         "from STEPSCOPE_TRACE_PROCESSOR or PATH)")
    ap.add_argument("--ranges", type=int, default=RANGES_PER_PHASE,
                    help=f"leaf ranges per phase in generated traces (default "
                         f"{RANGES_PER_PHASE})")
    ap.add_argument("--steps", type=int, help="steps per generated trace (default: 80%% of "
                    "the events on the main thread); the size is then at least the steps' events")
    ap.add_argument("--collectives", type=int, default=0,
                    help="torch.distributed ops per step (default 0), as stepscope.pytorch writes "
                         "them")
    a = ap.parse_args(argv)
    if a.measure:
        print(json.dumps(measure(a.measure, not a.load_only, a.engine)))
        return 0
    sizes = list(a.sizes) + ([10_000_000] if a.ten else [])
    scratch = None if a.keep else tempfile.TemporaryDirectory(prefix="stepscope-bench-")
    tmp = a.keep or scratch.name  # generated traces are removed at the end unless --keep
    try:
        os.makedirs(tmp, exist_ok=True)
        rows = _run_sizes(a, sizes, tmp)
    finally:
        if scratch is not None:
            scratch.cleanup()
    print(f"engine: {a.engine}; " + ("summaries:" if not a.load_only
                                     else "load + 3 aggregate queries (--load-only):"))
    hdr = f"{'events':>11} {'file MB':>8} {'slices':>10} {'load s':>7} {'summ. s':>8} " \
          f"{'total s':>8} {'load cpu':>8} {'tot cpu':>8} {'peak MB':>8}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['events']:>11,} {r['mb']:>8.1f} {r['slices']:>10,} {r['load_s']:>7.2f} "
              f"{r['summaries_s']:>8.2f} {r['total_s']:>8.2f} {r['load_cpu_s']:>8.2f} "
              f"{r['total_cpu_s']:>8.2f} {r['peak_rss_mb']:>8.0f}")
    print("(s: wall seconds; cpu: process CPU seconds, less sensitive to a busy machine)")
    return 0


def _run_sizes(a: argparse.Namespace, sizes: list[int], tmp: str) -> list[dict]:
    """Measure each size in a child process (this same file, ``--measure``)."""
    rows = []
    for n in sizes:
        shape = "" if (a.ranges, a.steps) == (RANGES_PER_PHASE, None) else \
            f"_r{a.ranges}_s{a.steps}"
        shape += f"_c{a.collectives}" if a.collectives else ""
        path = os.path.join(tmp, f"bench_{n}{shape}.pftrace")
        if not os.path.exists(path):
            info = generate(path, n, a.ranges, a.steps, a.collectives)
            print(f"wrote {path}: {info['bytes'] / 1e6:.1f} MB in {info['write_s']:.1f} s",
                  file=sys.stderr)
        # the child's module-level sys.path.insert finds the same src: no PYTHONPATH needed
        cmd = [sys.executable, __file__, "--measure", path, "--engine", a.engine] + (
            ["--load-only"] if a.load_only else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["events"] = n
        r["mb"] = os.path.getsize(path) / 1e6
        rows.append(r)
        if a.per_table:
            print(f"{n}: {r['tables']}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
