"""What the summary level costs a launch-bound CUDA training step, GPU tracing on and off, in
wall-clock µs per step, read in pairs.

On a GPU the summary level runs NVML's sampler thread (``gpu=True``; every ``nvml.INTERVAL_S``)
beside the host metrics and torch's CUDA memory counters. Single runs per configuration (as
``bench_torch.py --device cuda``'s table 1) cannot show a cost of 1 %: its summary column moved
from 2 % to 20 % between models of the same ~1 ms step. Here each configuration runs in one
process, with the profiler started once, as ``PAIRS`` pairs of blocks of ``--steps`` steps,
untraced and traced back to back (which one first alternates), so drift and load spikes hit both
blocks of a pair alike; the table gives the median of the pairs' differences and their
interquartile range (a median inside that range's noise says nothing). Configurations:

* ``gpu=False``: host metrics and torch's memory counters, no NVML;
* ``gpu=True``: the same with NVML's sampler (its default interval);
* ``gpu=True, no NVML``: NVML's sampler kept from starting (``NvmlSampler.start`` patched), to
  split NVML's share from the rest of ``gpu=True``.

    python tools/bench_gpu_summary.py [--pairs 31] [--steps 200] [--device cuda]

``--device cpu`` runs the same on the CPU (a check of the script; there is no NVML there).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = {"gpu=False": {"gpu": False}, "gpu=True": {"gpu": True},
           "gpu=True, no NVML": {"gpu": True, "no_nvml": True}}


def measure(config: str, pairs: int, steps: int, device: str) -> tuple[float, list[float]]:
    """(median untraced µs per step, each pair's traced - untraced µs per step)."""
    import torch

    import bench_torch as bt  # its MLP and its loop (three phases and step(), or untraced)
    import stepscope
    from stepscope.gpu import nvml

    kw = dict(CONFIGS[config])
    if kw.pop("no_nvml", False):
        nvml.NvmlSampler.start = lambda self: False  # type: ignore[method-assign]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    bt.DEVICE = device
    model, x, y = bt.mlp()

    def block(n: int, prof: object | None = None) -> float:
        t0 = time.perf_counter_ns()
        bt.loop(model, x, y, n, prof)  # (synchronized with the GPU at its end)
        return (time.perf_counter_ns() - t0) / n / 1e3

    t = time.monotonic()
    while time.monotonic() - t < 2:  # warm-up: kernels, allocator, clocks
        block(20)
    with tempfile.TemporaryDirectory() as tmp:
        prof = stepscope.Profiler(dir=tmp, schedule=None, report=False, use_env=False,
                                  torch=True, **kw)
        prof.start()
        block(steps // 3, prof)
        bases, diffs = [], []
        for r in range(pairs):
            if r % 2:
                a = block(steps)
                b = block(steps, prof)
            else:
                b = block(steps, prof)
                a = block(steps)
            bases.append(a)
            diffs.append(b - a)
        prof.stop()
    return statistics.median(bases), diffs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=31)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--config", choices=sorted(CONFIGS), help=argparse.SUPPRESS)  # one process
    args = ap.parse_args(argv)
    if args.config:
        base, diffs = measure(args.config, args.pairs, args.steps, args.device)
        print(base, *diffs)
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu_summary: --device cuda needs a CUDA device")
    print(f"torch {torch.__version__}, {args.device}, {args.pairs} pairs of {args.steps} steps "
          "per configuration, each in its own process; µs per step")
    print(f"{'configuration':>20} {'untraced':>10} {'added':>9} {'%':>7} "
          f"{'pairs q1':>9} {'pairs q3':>9}")
    for config in CONFIGS:
        r = subprocess.run([sys.executable, __file__, "--config", config, "--pairs",
                            str(args.pairs), "--steps", str(args.steps), "--device", args.device],
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"bench_gpu_summary: {config} failed:\n{r.stderr[-3000:]}")
        base, *diffs = (float(v) for v in r.stdout.split())
        q1, med, q3 = statistics.quantiles(diffs, n=4)
        print(f"{config:>20} {base:>10.1f} {med:>9.1f} {100 * med / base:>6.2f}% "
              f"{q1:>9.1f} {q3:>9.1f}")


if __name__ == "__main__":
    main()
