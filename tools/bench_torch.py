"""Cost of the PyTorch integration on CPU, against the same untraced steps and torch.profiler.

For a small MLP step and a small CNN step (forward, backward, SGD step; one intra-op thread):

* ``summary``: stepscope at summary level (steps, phases, record_function ranges, DataLoader-free
  loop), overhead of the steps in % of the untraced step (target <= 1 %; the profiler's start
  and stop happen once per run and are not counted);
* ``detail``: every step inside a stepscope detail window with operators (torch's profiler CPU
  activity, shapes on, converted and written at the window's end) against ``torch.profiler``
  at equal settings (``activities=[CPU], record_shapes=True``) including its export to Chrome
  JSON and the freeing of its result (kept in a reference cycle: freed here, as stepscope frees
  its own at the window's end): cost per step in µs and % (target: stepscope <=
  torch.profiler);
* bytes per step: the detail window's file against torch.profiler's JSON (target >= 10x smaller).

The detail windows read torch's events with the native reader when ``stepscope build-torch``
has built it for this torch, else through torch's Python API (about 1.5x torch.profiler's cost
here); the table's title says which.

Each mode runs ``--reps`` times, alternating, and the fastest run is shown (load only ever adds
time). A busy machine makes single runs noisy: compare only numbers from one run of this script.

    python tools/bench_torch.py [--reps 3] [--steps-mlp 200] [--steps-cnn 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import stepscope

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_torch import SmallCNN  # noqa: E402


def mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    return model, torch.randn(64, 256), torch.randint(0, 10, (64,))


def cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    return SmallCNN(), torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))


def loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, prof=None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    phase = prof.phase if prof is not None else None
    for _ in range(steps):
        if phase is not None:
            with phase("Forward"):
                loss = F.cross_entropy(model(x), y)
            with phase("Backward"):
                loss.backward()
            with phase("Optimization"):
                opt.step()
                opt.zero_grad()
            prof.step()
        else:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()


def untraced(make, steps: int) -> float:
    m, x, y = make()
    loop(m, x, y, 5)
    t0 = time.perf_counter_ns()
    loop(m, x, y, steps)
    return (time.perf_counter_ns() - t0) / steps


READER: set[str] = set()  # how the detail windows read torch's events


def stepscope_run(make, steps: int, detail: bool, out: Path) -> tuple[float, int]:
    """ns per step (start to stop, window-end conversion included) and detail bytes."""
    m, x, y = make()
    loop(m, x, y, 5)
    sched = (0, steps) if detail else None
    prof = stepscope.Profiler(dir=out, schedule=sched, host_metrics=False, report=False,
                              use_env=False, torch=True)
    prof.start()
    t0 = time.perf_counter_ns()  # summary: the steps alone (start/stop are once per run)
    loop(m, x, y, steps, prof)
    t1 = time.perf_counter_ns()
    files = prof.stop()
    # detail: the window's end (conversion, file) is the last step's; stop() adds the summary
    # file's close, counted too, as torch.profiler's export is
    ns = ((time.perf_counter_ns() if detail else t1) - t0) / steps
    size = sum(os.path.getsize(f) for f in files if ".detail." in f.name)
    if detail:
        READER.add(prof.hooks[0].ops.last_reader)
    return ns, size


def torch_profiler_run(make, steps: int, out: Path) -> tuple[float, int]:
    m, x, y = make()
    loop(m, x, y, 5)
    path = out / "trace.json"
    t0 = time.perf_counter_ns()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as p:
        loop(m, x, y, steps)
    p.export_chrome_trace(str(path))
    # its result sits in a reference cycle, which a later cyclic GC pass frees on the
    # program's time; stepscope frees its own at the window's end: both counted (a timed
    # gc.collect() would add a sweep of torch's whole heap, 150+ ms here, to the profiler)
    p.profiler.kineto_results = None
    ns = (time.perf_counter_ns() - t0) / steps
    return ns, path.stat().st_size


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps-mlp", type=int, default=200)
    ap.add_argument("--steps-cnn", type=int, default=40)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for name, make, steps in (("MLP", mlp, args.steps_mlp), ("CNN", cnn, args.steps_cnn)):
        res: dict[str, list] = {"base": [], "summary": [], "detail": [], "tp": [],
                                "dbytes": [], "tbytes": []}
        for _ in range(args.reps):
            with tempfile.TemporaryDirectory() as tmp:
                res["base"].append(untraced(make, steps))
                res["summary"].append(stepscope_run(make, steps, False, Path(tmp) / "s")[0])
                ns, size = stepscope_run(make, steps, True, Path(tmp) / "d")
                res["detail"].append(ns)
                res["dbytes"].append(size / steps)
                ns, size = torch_profiler_run(make, steps, Path(tmp))
                res["tp"].append(ns)
                res["tbytes"].append(size / steps)
        # times: the fastest run (load spikes only ever add time); bytes: the median
        med = {k: (statistics.median(v) if "bytes" in k else min(v)) for k, v in res.items()}
        base = med["base"]
        rows.append((name, steps, base / 1e3,
                     100 * (med["summary"] - base) / base,
                     (med["detail"] - base) / 1e3, 100 * (med["detail"] - base) / base,
                     (med["tp"] - base) / 1e3, 100 * (med["tp"] - base) / base,
                     med["dbytes"], med["tbytes"], med["tbytes"] / max(1.0, med["dbytes"])))
    head = ("model", "steps", "step us", "summary %", "detail us", "detail %",
            "torch.prof us", "torch.prof %", "detail B/step", "json B/step", "smaller x")
    print(f"torch {torch.__version__}, CPU, 1 thread, fastest of {args.reps} runs "
          f"(cost = traced - untraced, per step); torch's events read by: "
          f"{', '.join(sorted(READER))} reader")
    print("  ".join(f"{h:>13}" for h in head))
    for r in rows:
        print("  ".join([f"{r[0]:>13}", f"{r[1]:>13}"] + [f"{v:>13.2f}" for v in r[2:8]]
                        + [f"{r[8]:>13.0f}", f"{r[9]:>13.0f}", f"{r[10]:>13.1f}"]))


if __name__ == "__main__":
    main()
