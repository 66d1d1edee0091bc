"""Profiler overhead on the example's training step: off / timer_only / summary / detail.

    python tools/bench_profiler.py [--steps 200] [--rounds 7]

Runs ``examples/train_mlp.py``'s ``train_step`` (numpy MLP, batch 128, one BLAS thread) over
in-memory batches through each mode, in interleaved rounds so drift and noise hit every mode
alike, and prints per-step time and the overhead ratio against ``off`` (best round and median of
rounds), the profiler's per-call costs, the host sampler's CPU cost and the CPU of an idle session
(the writer's periodic wakes). Targets: timer_only and summary <= 1% of step time, detail <= 3%.

Modes: ``off`` (no profiler; the example's ``stepscope.annotate`` ranges are inert),
``timer_only`` (step timer + data-loader wrapper), ``summary`` (steps, phases, loader waits, host
counters every 0.5 s; no detail windows), ``detail`` (every step in a detail window: user ranges
recorded too).
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from stepscope.profiler import ALWAYS, Profiler  # noqa: E402
from stepscope.profiler.host_metrics import HostSampler  # noqa: E402

MODES = ("off", "timer_only", "summary", "detail")
# a second "off" run in every round of the A/B: its distance from "off" is the noise floor
CONTROL = "off (again)"
AB_MODES = (*MODES, CONTROL)


def load_example():
    spec = importlib.util.spec_from_file_location("train_mlp", ROOT / "examples" / "train_mlp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_NULL = contextlib.nullcontext()  # one reusable do-nothing phase, as cheap as the old class


def _no_phase(name: str) -> contextlib.nullcontext:
    return _NULL


def _profiler(out: str, mode: str, run_id: str, host_metrics: bool) -> Profiler:
    """The profiler of a mode: timer_only, summary (no detail windows), detail (every step)."""
    return Profiler(out, run_id=run_id, timer_only=mode == "timer_only",
                    schedule=ALWAYS if mode == "detail" else None, host_metrics=host_metrics,
                    report=False, use_env=False)


def run_mode(ex, model, batches, mode: str, out: str) -> tuple[float, float]:
    """(wall seconds per step of the loop, process CPU seconds per step incl. start/stop)."""
    c0 = time.process_time()
    if mode == "off":
        t0 = time.perf_counter()
        for batch in iter(batches):
            ex.train_step(model, batch, None)
        wall = time.perf_counter() - t0
        return wall / len(batches), (time.process_time() - c0) / len(batches)
    prof = _profiler(out, mode, f"{mode}-{time.perf_counter_ns()}", mode != "timer_only")
    prof.start()
    t0 = time.perf_counter()
    for batch in prof.dataloader(batches):
        ex.train_step(model, batch, prof)
        prof.step(num_samples=len(batch[1]))
    wall = time.perf_counter() - t0
    prof.stop()  # the writer's last flush counts in the CPU figure
    return wall / len(batches), (time.process_time() - c0) / len(batches)


def _instrumented_loop(prof, n: int, user_ranges: int) -> None:
    """The example's per-step instrumentation with no work: a loader fetch, three phases with
    ``user_ranges`` user ranges in all, and ``step(num_samples)``."""
    import stepscope

    names = [f"range{i}" for i in range(user_ranges)]
    phase = prof.phase if prof is not None else _no_phase
    loader = prof.dataloader(range(n)) if prof is not None else range(n)
    for _ in loader:
        with phase("Forward"):
            for name in names[:4]:
                with stepscope.annotate(name):
                    pass
        with phase("Backward"):
            for name in names[4:]:
                with stepscope.annotate(name):
                    pass
        with phase("Optimization"):
            pass
        if prof is not None:
            prof.step(num_samples=128)


def per_step_cost(mode: str, out: str, n: int = 3000) -> tuple[float, float]:
    """(main-thread CPU us, writer+I/O CPU us) the profiler adds per instrumented step.

    Main thread: CPU time of the instrumented loop minus the same loop with no profiler.
    Writer: CPU time of encoding, compressing and writing those steps' events (one flush after
    the loop; periodic flushes are pushed out so that they all land in it).
    """
    user = 6  # the example's step has 6 user ranges (recorded at detail level only)
    c0 = time.thread_time()
    _instrumented_loop(None, n, user)
    base = time.thread_time() - c0
    prof = _profiler(out, mode, f"cost-{mode}-{time.perf_counter_ns()}", False)
    prof.start()
    sess = prof._sess  # noqa: SLF001
    if sess is not None:
        sess.flush_interval_s = 60.0
        sess.flush()
    c0 = time.thread_time()
    _instrumented_loop(prof, n, user)
    main = time.thread_time() - c0 - base
    writer = 0.0
    if sess is not None:
        c0 = time.process_time()
        sess.flush()
        writer = time.process_time() - c0
    prof.stop()
    return main / n * 1e6, writer / n * 1e6


def per_call_costs(out: str, n: int = 20000) -> dict[str, float]:
    """Microseconds per profiler call on an empty step (summary level), writer included: each
    loop ends with a flush of its own events, so no loop pays for another's backlog."""
    prof = Profiler(out, schedule=None, host_metrics=False, report=False, use_env=False,
                    run_id="calls")
    prof.start()

    def timed(loop: Callable[[], None]) -> float:
        prof._sess.flush()  # noqa: SLF001
        t0 = time.perf_counter()
        loop()
        prof._sess.flush()  # noqa: SLF001
        return (time.perf_counter() - t0) / n * 1e6

    def steps() -> None:
        for _ in range(n):
            prof.step()

    def phases() -> None:
        for _ in range(n):
            with prof.phase("Forward"):
                pass

    def loader() -> None:
        for _ in prof.dataloader(range(n)):
            pass

    costs = {"step()": timed(steps), "phase()": timed(phases), "dataloader next": timed(loader)}
    prof.stop()
    return costs


def idle_cost(out: str, seconds: float = 2.0) -> float:
    """Process CPU microseconds per second of a summary session with nothing to record: the
    writer's periodic wakes and flushes (not in 1), which times one flush of known steps)."""
    prof = Profiler(out, run_id=f"idle-{time.perf_counter_ns()}", schedule=None,
                    host_metrics=False, report=False, use_env=False)
    prof.start()
    time.sleep(0.2)
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    prof.stop()
    return cpu / wall * 1e6


def sampler_cost(n: int = 50) -> tuple[float, float]:
    """CPU microseconds per host sample, and % of one core at the default 0.5 s interval."""
    s = HostSampler(None, 0.5)
    s.sample()
    c0 = time.thread_time_ns()
    for _ in range(n):
        s.sample()
    us = (time.thread_time_ns() - c0) / n / 1e3
    return us, us / 0.5e6 * 100


def main() -> int:
    ap = argparse.ArgumentParser(description="stepscope profiler overhead")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    ex = load_example()
    model = ex.MLP(np)
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(128, 256)).astype(np.float32), rng.integers(0, 10, 128))
               for _ in range(args.steps)]
    with tempfile.TemporaryDirectory() as out:
        for mode in MODES:  # warm-up: caches, first sessions, imports
            run_mode(ex, model, batches[:20], mode, out)
        wall: dict[str, list[float]] = {m: [] for m in AB_MODES}
        cpu: dict[str, list[float]] = {m: [] for m in AB_MODES}
        order = list(AB_MODES)
        for _ in range(args.rounds):
            random.shuffle(order)
            for mode in order:
                w, c = run_mode(ex, model, batches, "off" if mode == CONTROL else mode, out)
                wall[mode].append(w)
                cpu[mode].append(c)
        calls = per_call_costs(out)
        costs = {m: min((per_step_cost(m, out) for _ in range(5)), key=sum) for m in MODES[1:]}
        idle = idle_cost(out)
    us_sample, pct = sampler_cost()

    step_cpu = min(cpu["off"])  # the example's step, CPU seconds
    print(f"stepscope profiler overhead on the example's step (MLP 256-512-10, batch 128, numpy, "
          f"1 BLAS thread): {step_cpu * 1e3:.3f} ms CPU per step (best round)")
    print("\n1) profiler cost per step, measured directly (CPU time, so other load on the "
          "machine does not blur it), as % of the step")
    print(f"{'mode':<11} {'main us':>8} {'writer us':>10} {'sampler %':>10} {'total %':>8} "
          f"{'target':>7}")
    targets = {"off": "", "timer_only": "<= 1%", "summary": "<= 1%", "detail": "<= 3%"}
    for mode in MODES[1:]:
        main_us, writer_us = costs[mode]
        sampler = pct if mode != "timer_only" else 0.0
        total = (main_us + writer_us) / (step_cpu * 1e6) * 100 + sampler
        print(f"{mode:<11} {main_us:>8.2f} {writer_us:>10.2f} {sampler:>10.3f} {total:>8.2f} "
              f"{targets[mode]:>7}")
    for mode, limit in (("summary", 1.0), ("detail", 3.0)):
        us = sum(costs[mode])
        print(f"  {mode}: within {limit:.0f}% for steps of {us / (limit - pct) * 100 / 1e3:.2f} ms "
              f"or longer ({us:.1f} us per step + the sampler's {pct:.2f}%)")
    print(f"\n2) A/B timing of the whole step, {args.steps} steps x {args.rounds} interleaved "
          "rounds per mode (wall: loop time per step; CPU: process CPU per step, all threads, "
          "start/stop included). Noisy on a shared machine: the row 'off (again)' is the same "
          "code as 'off', so its distance from 'off' is the noise; trust 1) for the small ratios.")
    print(f"{'mode':<12} {'wall best ms':>12} {'ovh %':>7} {'wall med ms':>12} {'ovh %':>7} "
          f"{'CPU med ms':>12} {'ovh %':>7} {'paired %':>9}")
    base = (min(wall["off"]), statistics.median(wall["off"]), statistics.median(cpu["off"]))
    for mode in AB_MODES:
        vals = (min(wall[mode]), statistics.median(wall[mode]), statistics.median(cpu[mode]))
        cells = " ".join(f"{v * 1e3:>12.3f} {(v / b - 1) * 100:>+7.2f}"
                         for v, b in zip(vals, base, strict=True))
        # each round's ratio to that round's "off" run (neighbours in time share the drift)
        paired = statistics.median(w / o for w, o in zip(wall[mode], wall["off"], strict=True))
        print(f"{mode:<12} {cells} {(paired - 1) * 100:>+9.2f}")
    best_off = base[0]
    print("\nper call (summary level, empty step):")
    for name, us in calls.items():
        print(f"  {name:<16} {us:7.2f} us  ({us / (best_off * 1e6) * 100:.3f}% of a step)")
    print(f"\nhost sampler: {us_sample:.0f} us CPU per sample = {pct:.3f}% of one core at the "
          f"default 0.5 s interval")
    print(f"idle session (writer wakes and flushes, nothing recorded): {idle:.0f} us CPU per s "
          f"= {idle / 1e4:.3f}% of one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
