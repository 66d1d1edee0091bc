"""GPU tracing benchmark: overhead on a launch-bound step, conversion throughput, trace size.

Two modes, one table each:

* ``--mode fixture`` (works anywhere): the recorded CUPTI fixture (12 steps of a CuPy MLP on an
  H100) through the same conversion the live path uses: records/s of ``GpuTraceConverter.convert``
  alone and with encoding + writing (session flush), and trace bytes per kernel; plus the window-end
  decode of the raw-buffer path (the fixture's records packed as CUPTI packs them, decoded by
  ``cupti_buffers.decode_buffers``) against the per-record path's (one cupti-python-like object per
  record through ``CuptiTracer``'s buffer callback and decode).
* ``--mode live`` (needs an NVIDIA GPU with CuPy; cupti-python for the stepscope row, torch for the
  Kineto row): a launch-bound MLP training step (small matrices: a few dozen kernels and a few
  hundred CUDA calls per step), timed as ratios to no tracing: the Profiler at detail level with
  everything GPU on (CUPTI, NVML, CuPy pool), and torch.profiler (CPU + CUDA activities) when
  torch is installed; plus records per step and trace bytes per kernel. Each tracer runs in a
  process of its own, against untraced steps timed in that process first. Without a GPU it says
  so and exits 0.

``--mode auto`` (default) runs live when a GPU is there, and always the fixture table.

    python tools/bench_gpu.py [--mode auto|fixture|live] [--steps 300] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from stepscope.core import session as _session  # noqa: E402
from stepscope.gpu.convert import GpuTraceConverter  # noqa: E402
from stepscope.gpu.fixture import load_fixture  # noqa: E402

FIXTURE = ROOT / "tests" / "data" / "cupti_mlp_fixture.json.gz"


def table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    print("-" * (width + 24))
    for k, v in rows:
        print(f"{k:<{width}}  {v:>20}")


# --- fixture mode ---------------------------------------------------------------------------------
def bench_fixture(repeat: int) -> None:
    fx = load_fixture(FIXTURE)
    batch = fx.batch
    n = len(batch)
    convert_s, total_s, sizes = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeat):
            path = os.path.join(tmp, f"gpu{i}.pftrace")
            sess = _session.Session(path).start()
            conv = GpuTraceConverter(sess, {0: fx.device}, pid=407)
            t0 = time.perf_counter()
            conv.convert(batch, steps=12)
            t1 = time.perf_counter()
            sess.stop()  # encode + write what the converter emitted
            t2 = time.perf_counter()
            convert_s.append(t1 - t0)
            total_s.append(t2 - t0)
            sizes.append(os.path.getsize(path))
    k = batch.kernels.size
    med_c, med_t = statistics.median(convert_s), statistics.median(total_s)
    table(
        f"GPU conversion from the CUPTI fixture ({n} records, {k} kernels, 12 steps; median of "
        f"{repeat})",
        [
            ("records per step", f"{n / 12:.0f}"),
            ("convert (records/s)", f"{n / med_c:,.0f}"),
            ("convert + encode + write (records/s)", f"{n / med_t:,.0f}"),
            ("convert + write per step (ms)", f"{med_t / 12 * 1e3:.2f}"),
            ("trace bytes (compressed)", f"{statistics.median(sizes):,.0f}"),
            ("trace bytes per kernel", f"{statistics.median(sizes) / k:.1f}"),
        ],
    )
    bench_decode(repeat)


def bench_decode(repeat: int) -> None:
    """Window-end decode cost per record: raw buffers (bulk numpy) vs per-record objects."""
    import gzip
    import json
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    from gpu_fakes import RAW_SIZES, CStrings, FakeCupti, encode_buffers  # noqa: E402

    from stepscope.gpu import cupti_buffers as cb  # noqa: E402
    from stepscope.gpu.cupti_live import CuptiTracer  # noqa: E402

    with gzip.open(FIXTURE, "rt") as f:
        records = json.load(f)["cupti_records"]
    n = len(records)
    names = CStrings()
    bufs = [cb.RawBuffer(d, len(d)) for d, _ in encode_buffers(records, names, per_buffer=4000)]
    raw_s, obj_s = [], []
    fake = FakeCupti(records)
    kinds = fake.ActivityKind
    # as cupti-python's objects: every attribute of the record's class present
    objs = [SimpleNamespace(**{"graph_node_id": 0, **r, "kind": int(kinds[r["kind"]])})
            for r in records]  # fmt: skip
    for _ in range(repeat):
        t0 = time.perf_counter()
        cb.decode_buffers(bufs, cb.RecordSizes(known=dict(RAW_SIZES)))
        raw_s.append(time.perf_counter() - t0)
        tracer = CuptiTracer(cupti_module=FakeCupti(records), raw=False)
        tracer.start()
        t0 = time.perf_counter()  # what the callback and the window-end decode do per record
        tracer._buffer_completed(objs)
        with tracer._lock:
            rows, tracer._rows = tracer._rows, {}
        tracer.decode(rows)
        obj_s.append(time.perf_counter() - t0)
    raw, obj = min(raw_s), min(obj_s)  # best of: the least disturbed by other load
    table(
        f"Window-end decode of {n} CUPTI records (best of {repeat}; the per-record path also "
        f"pays cupti-python building one object per record, not counted here)",
        [
            ("raw buffers, bulk numpy (ns/record)", f"{raw / n * 1e9:.0f}"),
            ("per-record objects (ns/record)", f"{obj / n * 1e9:.0f}"),
        ],
    )


# --- live mode ------------------------------------------------------------------------------------
def gpu_present() -> str | None:
    """None if a GPU can run the live benchmark, else why not."""
    try:
        import cupy as cp  # type: ignore[import-not-found]
    except Exception:
        return "CuPy is not installed"
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:
        return f"no usable CUDA device ({exc})"
    return None


def make_step():
    """A small MLP training step in CuPy: launch-bound (tiny matrices, many kernels)."""
    import cupy as cp

    rng = cp.random.default_rng(0)
    sizes = [256, 256, 256, 10]
    ws = [
        rng.standard_normal((a, b), dtype=cp.float32) * 0.05
        for a, b in zip(sizes[:-1], sizes[1:], strict=True)
    ]
    x = rng.standard_normal((64, sizes[0]), dtype=cp.float32)
    y = cp.zeros((64, sizes[-1]), dtype=cp.float32)
    y[:, 0] = 1

    def step():
        acts = [x]
        for w in ws[:-1]:
            acts.append(cp.maximum(acts[-1] @ w, 0))
        out = acts[-1] @ ws[-1]
        grad = (out - y) / out.shape[0]
        for i in range(len(ws) - 1, -1, -1):
            gw = acts[i].T @ grad
            if i:
                grad = (grad @ ws[i].T) * (acts[i] > 0)
            ws[i] -= 0.01 * gw
        cp.cuda.get_current_stream().synchronize()

    return step


def time_steps(step, steps: int, after=None) -> float:
    """Seconds per step over ``steps`` steps (``after()`` runs after each, untimed it is not)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
        if after is not None:
            after()
    return (time.perf_counter() - t0) / steps


def part_stepscope(step, steps: int, repeat: int) -> dict:
    """The Profiler at detail level for the timed steps, GPU all on (CUPTI, NVML, CuPy pool): the
    window opens before the warm-up steps and closes after the timed ones, so its window-end
    conversion is not timed (as Kineto's export is not)."""
    from stepscope.profiler import Profiler

    out: dict = {"traced": [], "records": 0, "kernels": 0, "bytes": 0, "path": "?"}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeat):
            window = {"wait": 0, "warmup": 0, "active": steps + 60, "repeat": 1}
            prof = Profiler(tmp, window, run_id=f"r{r}", gpu=True, report=False, use_env=False)
            prof.start()
            time_steps(step, 20, prof.step)
            out["traced"].append(time_steps(step, steps, prof.step))
            time_steps(step, 40, prof.step)  # the window ends at the last of these
            gt = prof._gpu  # noqa: SLF001
            stats = None if gt is None else gt.last_stats
            prof.stop()
            if stats is None:
                out["error"] = "CUPTI could not be enabled (see the log)"
                return out
            n = steps + 60  # the window's steps
            detail = next(Path(tmp, f"r{r}").glob("*.detail.*"))
            out.update(records=stats.records / n, kernels=stats.kernels / n,
                       bytes=detail.stat().st_size / max(stats.kernels, 1),
                       path=getattr(gt.tracer, "path", "?"))  # fmt: skip
    return out


def part_kineto(step, steps: int, repeat: int) -> dict:
    """torch.profiler with CPU and CUDA activities (Kineto's CUPTI) around the timed steps."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except Exception as exc:
        return {"error": f"torch not installed ({exc.__class__.__name__})"}
    traced = []
    for _ in range(repeat):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            time_steps(step, 20)
            traced.append(time_steps(step, steps))
    return {"traced": traced}


PARTS = {"stepscope": part_stepscope, "kineto": part_kineto}


def run_part(name: str, steps: int, repeat: int, step=None) -> dict:
    """One tracer in this process: untraced steps first, then traced ones (JSON-able result).

    Each tracer runs in a process of its own: two CUPTI clients in one process (stepscope's and
    Kineto's, which may even load another libcupti) could fail or take each other's buffers.
    """
    step = step or make_step()
    warm_until = time.perf_counter() + 1.0  # a second of steps first: an idle GPU's clocks
    while time.perf_counter() < warm_until:  # ramp up under load (345 -> 1980 MHz on an H100)
        step()
    base = [time_steps(step, steps) for _ in range(repeat)]
    return {"base": base, **PARTS[name](step, steps, repeat)}


def bench_live(steps: int, repeat: int) -> bool:
    why = gpu_present()
    if why:
        print(f"\nlive GPU benchmark: no GPU ({why}); skipped")
        return False
    res = {}
    for name in PARTS:
        proc = subprocess.run(
            [sys.executable, __file__, "--part", name, "--steps", str(steps),
             "--repeat", str(repeat)], capture_output=True, text=True, check=False,
        )  # fmt: skip
        try:
            res[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            res[name] = {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    table(f"GPU tracing overhead, launch-bound CuPy MLP step ({steps} steps, median of {repeat}; "
          "each tracer in its own process, against its own untraced steps)",
          live_rows(res))  # fmt: skip
    return True


def live_rows(res: dict) -> list[tuple[str, str]]:
    """The live table's rows from the parts' results."""
    rows = []
    for name, label in (("stepscope", "stepscope detail + GPU / none"),
                        ("kineto", "torch.profiler (Kineto) / none")):  # fmt: skip
        r = res.get(name, {})
        if r.get("traced") and "error" not in r:
            b = statistics.median(r["base"])
            rows.append((f"{name}: step time, no tracing (ms)", f"{b * 1e3:.3f}"))
            rows.append((label, f"{statistics.median(r['traced']) / b:.4f}"))
        else:
            rows.append((label, r.get("error", "not run")))
    s = res.get("stepscope", {})
    if s.get("traced") and "error" not in s:
        rows += [
            ("CUPTI activity path (raw / records)", str(s["path"])),
            ("records per step", f"{s['records']:.0f}"),
            ("kernels per step", f"{s['kernels']:.0f}"),
            ("trace bytes per kernel", f"{s['bytes']:.1f}"),
        ]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("auto", "fixture", "live"), default="auto")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)  # one live tracer
    a = p.parse_args(argv)
    if a.part:
        print(json.dumps(run_part(a.part, a.steps, a.repeat)))
        return 0
    if a.mode in ("auto", "live"):
        bench_live(a.steps, a.repeat)
    if a.mode in ("auto", "fixture"):
        bench_fixture(a.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
