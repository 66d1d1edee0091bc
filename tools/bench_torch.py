"""Cost of the PyTorch integration on CPU, against the same untraced steps and torch.profiler.

For a small MLP step and a small CNN step (forward, backward, SGD step; one intra-op thread):

* ``summary``: stepscope at summary level (steps, phases, record_function ranges, DataLoader-free
  loop), overhead of the steps in % of the untraced step (target <= 1 %; the profiler's start
  and stop happen once per run and are not counted). That wall-clock ratio moves by tens of %
  between identical runs on a shared machine, so the summary cost is also measured directly,
  in CPU time (table 2): the loop's work is left out and what reaches stepscope each step is
  kept (the phases and ``step()``, torch's ``Optimizer.step#``/``zero_grad#`` ranges through
  a real optimizer over one scalar parameter), in pairs of blocks with and without the
  profiler, in three fresh processes (the main thread's figure differs by up to 2x between
  processes of the same code here), plus the writer's CPU for those steps (forced flushes of
  two sizes: a cost per step and one per flush, which a run pays once a second); also for
  ``step_on="optimizer"`` (no code changes: steps from optimizer steps, no phases). Even so
  this moves by several µs between runs here: ``bench_instructions.py`` counts instructions;
* ``detail``: every step inside a stepscope detail window with operators (torch's profiler CPU
  activity, shapes on, converted and written at the window's end) against ``torch.profiler``
  at equal settings (``activities=[CPU], record_shapes=True``) including its export to Chrome
  JSON and the freeing of its result (kept in a reference cycle: freed here, as stepscope frees
  its own at the window's end): cost per step in µs and % (target: stepscope <=
  torch.profiler);
* bytes per step: the detail window's file against torch.profiler's JSON (target >= 10x smaller);
* ``--device cuda`` (on a GPU): table 1 alone, with the models on the GPU, stepscope's detail
  windows with its CUPTI tracer on (``gpu=True``: kernels, memcpys, launches) and torch.profiler
  with CPU and CUDA activities: the same comparison where both record the device too (steps
  are launch-bound; each timed block ends with a device synchronize); and table 1b, the same
  runs' parts: operators alone (stepscope without CUPTI, torch.profiler with CPU activity only);
* table 3: CPU time (all threads) stepscope adds per gloo all-reduce (world size 1, 16 floats,
  waited for), through the process groups' hooks, in C++ (the native module) and in Python
  (``collectives.USE_STAMPS = False``: Python hooks and done callbacks), and, as on a torch
  without the hooks (2.11), through our kernel on the c10d op, in C++ and in Python, called as
  the program calls ``dist.all_reduce`` and as DDP's reducer calls the process group's method
  from C++ (``ProcessGroup.allreduce``, "pg method");
  pairs of blocks with and without the profiler in a fresh process each.

The detail windows read torch's events with the native reader when ``stepscope build-torch``
has built it for this torch, else through torch's Python API (about 1.5x torch.profiler's cost
here); the table's title says which.

Each mode runs ``--reps`` times, alternating, and the fastest run is shown (load only ever adds
time). A busy machine makes single runs noisy: compare only numbers from one run of this script.

    python tools/bench_torch.py [--reps 3] [--steps-mlp 200] [--steps-cnn 40] [--direct-only]
                                [--device cpu|cuda]
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

import torch
import torch.nn as nn
import torch.nn.functional as F

import stepscope

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_torch import SmallCNN  # noqa: E402

DEVICE = "cpu"  # --device: where table 1's models run


def mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    return (model.to(DEVICE), torch.randn(64, 256, device=DEVICE),
            torch.randint(0, 10, (64,), device=DEVICE))


def cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    return (SmallCNN().to(DEVICE), torch.randn(32, 1, 28, 28, device=DEVICE),
            torch.randint(0, 10, (32,), device=DEVICE))


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
    if x.is_cuda:  # the block's time includes its GPU work
        torch.cuda.synchronize()


def untraced(make, steps: int) -> float:
    m, x, y = make()
    loop(m, x, y, 5)
    t0 = time.perf_counter_ns()
    loop(m, x, y, steps)
    return (time.perf_counter_ns() - t0) / steps


# table 1b's runs → labels (the last three on a GPU only)
PARTS = {"ss": "stepscope", "tp": "torch.profiler", "ss_ops": "ss ops only",
         "ss_cupti": "ss CUPTI only", "tp_cpu": "torch CPU only"}
READER: set[str] = set()  # how the detail windows read torch's events


def stepscope_run(make, steps: int, detail: bool, out: Path, gpu: bool | None = None,
                  ops: bool = True) -> tuple[float, int, float]:
    """ns per step (start to stop, window-end conversion included), detail bytes, and ns per
    step of the loop alone (the window's end left out). ``gpu``: CUPTI on (None: where the
    models run on the GPU); ``ops``: the torch integration on."""
    m, x, y = make()
    loop(m, x, y, 5)
    # a window past the loop's last step: it ends in stop(), apart from the loop's time
    sched = (0, steps + 1) if detail else None
    prof = stepscope.Profiler(dir=out, schedule=sched, host_metrics=False, report=False,
                              use_env=False, torch=ops,
                              gpu=DEVICE == "cuda" if gpu is None else gpu)
    prof.start()
    t0 = time.perf_counter_ns()  # summary: the steps alone (start/stop are once per run)
    loop(m, x, y, steps, prof)
    t1 = time.perf_counter_ns()
    files = prof.stop()
    # detail: the window's end (conversion, file) is the last step's; stop() adds the summary
    # file's close, counted too, as torch.profiler's export is
    ns = ((time.perf_counter_ns() if detail else t1) - t0) / steps
    size = sum(os.path.getsize(f) for f in files if ".detail." in f.name)
    if detail and ops:
        READER.add(next(h.ops.last_reader for h in prof.hooks if hasattr(h, "ops")))
    return ns, size, (t1 - t0) / steps


def torch_profiler_run(make, steps: int, out: Path, cuda: bool | None = None
                       ) -> tuple[float, int, float]:
    """ns per step, JSON bytes, and ns per step of the loop alone (the profiler's stop, export
    and free left out); ``cuda``: CUDA activity on (None: where the models run on the GPU)."""
    m, x, y = make()
    loop(m, x, y, 5)
    path = out / "trace.json"
    t0 = time.perf_counter_ns()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if DEVICE == "cuda" if cuda is None else cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts, record_shapes=True) as p:
        loop(m, x, y, steps)
        t1 = time.perf_counter_ns()
    p.export_chrome_trace(str(path))
    # its result sits in a reference cycle, which a later cyclic GC pass frees on the
    # program's time; stepscope frees its own at the window's end: both counted (a timed
    # gc.collect() would add a sweep of torch's whole heap, 150+ ms here, to the profiler)
    p.profiler.kineto_results = None
    ns = (time.perf_counter_ns() - t0) / steps
    return ns, path.stat().st_size, (t1 - t0) / steps


PROCESSES, PAIRS = 3, 11  # table 2: pairs of blocks in each of several fresh processes


def _skeleton(opt: torch.optim.Optimizer, n: int, prof=None, phases: bool = True,
              steps: bool = True) -> None:
    """The bench loop's calls that reach stepscope at summary level, with no model work
    (``steps=False``: phases without ``step()``, the optimizer's hook makes the steps)."""
    phase = prof.phase if prof is not None and phases else None
    for _ in range(n):
        if phase is not None:
            with phase("Forward"):
                pass
            with phase("Backward"):
                pass
            with phase("Optimization"):
                opt.step()
                opt.zero_grad(set_to_none=False)
            if steps:
                prof.step()
        else:
            opt.step()
            opt.zero_grad(set_to_none=False)


def summary_cost(out: Path, step_on: str | None, n: int = 300, pairs: int = PAIRS
                 ) -> tuple[float, float, float]:
    """(main-thread CPU µs per step, writer CPU µs per step, writer CPU µs per flush) that
    stepscope's summary level adds.

    The summary level alone (``schedule=None``: no detail window). Main: the median over
    ``pairs`` pairs of blocks of ``n`` steps run back to back (which one first alternates), the
    skeleton with the profiler minus without: drift and load spikes on
    a shared machine hit both blocks of a pair alike. Each traced block follows a warm-up of
    ``n // 3`` traced steps (the profiler's start and first steps are not the steady state).
    Writer (encoding, and the I/O thread's compression): the CPU of a forced flush of the
    warm-up's events and of the block's (periodic flushes pushed out); the two sizes split it
    into a cost per step and a fixed cost per flush (medians), which a real run pays once per
    ``flush_interval_s`` (1 s)."""
    w = torch.zeros(1, requires_grad=True)
    w.grad = torch.zeros(1)
    opt = torch.optim.SGD([w], lr=0.0)
    _skeleton(opt, 50)
    mains, slopes, fixed = [], [], []
    warm = n // 3
    for r in range(pairs):
        prof = stepscope.Profiler(dir=out / f"cost{step_on}{r}", schedule=None,
                                  host_metrics=False, report=False, use_env=False, torch=True,
                                  step_on=step_on)
        base = traced = 0
        for traced_turn in ((True, False) if r % 2 else (False, True)):
            if traced_turn:
                prof.start()
                sess = prof._sess  # noqa: SLF001
                sess.flush_interval_s = 60.0
                sess.flush()
                _skeleton(opt, warm, prof, phases=step_on is None)
                c0 = time.process_time_ns()
                sess.flush()
                w_small = time.process_time_ns() - c0
                c0 = time.thread_time_ns()
                _skeleton(opt, n, prof, phases=step_on is None)
                traced = time.thread_time_ns() - c0
                c0 = time.process_time_ns()
                sess.flush()
                w_big = time.process_time_ns() - c0
                slope = (w_big - w_small) / (n - warm)
                slopes.append(slope / 1e3)
                fixed.append((w_big - n * slope) / 1e3)
                prof.stop()
            else:
                c0 = time.thread_time_ns()
                _skeleton(opt, n)
                base = time.thread_time_ns() - c0
        mains.append((traced - base) / n / 1e3)
    return statistics.median(mains), statistics.median(slopes), statistics.median(fixed)


def summary_cost_in_processes(step_on: str | None) -> tuple[list[float], float, float]:
    """``summary_cost`` in ``PROCESSES`` fresh processes of ``PAIRS`` pairs each: (each one's
    main-thread µs, median writer µs per step, median µs per flush). The main thread's figure
    differs by up to 2x between processes of the same code here (10-19 µs: it is the
    profiler's cache misses, whose price follows the machine), more than between the pairs of
    one process; each process is shown, and their median counts."""
    runs = []
    for _ in range(PROCESSES):
        r = subprocess.run([sys.executable, __file__, "--summary-cost", str(step_on)],
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"bench_torch: the table-2 process failed:\n{r.stderr[-3000:]}")
        runs.append(json.loads(r.stdout.splitlines()[-1]))
    return ([r[0] for r in runs], statistics.median(r[1] for r in runs),
            statistics.median(r[2] for r in runs))


COLLECTIVE_PAIRS = 7  # table 3


def collective_cost(out: Path, pg_hooks: bool, stamps: bool = True, via_group: bool = False,
                    n: int = 2000, pairs: int = COLLECTIVE_PAIRS) -> tuple[float, float, str]:
    """(untraced CPU µs per all-reduce, the median over ``pairs`` pairs of blocks of ``n`` ops
    of what the profiler adds, what the native module did: "C++ hooks", "C++ kernels",
    "stamped in C++" or "" for nothing): the process's CPU time, so what runs on gloo's thread
    counts. ``pg_hooks=False`` takes the path of a torch without process-group hooks;
    ``stamps=False``, Python's done callbacks (and kernels); ``via_group``: the op issued by
    the process group's method, not ``dist.all_reduce``."""
    import torch.distributed as dist

    from stepscope.pytorch import collectives

    collectives.USE_PG_HOOKS = None if pg_hooks else False
    collectives.USE_STAMPS = None if stamps else False
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=0, world_size=1)
    t = torch.ones(16)
    group = dist.distributed_c10d._get_default_group()  # noqa: SLF001

    def block(k: int) -> int:
        c0 = time.process_time_ns()
        if via_group:
            for _ in range(k):
                group.allreduce([t]).wait()
        else:
            for _ in range(k):
                dist.all_reduce(t)
        return time.process_time_ns() - c0

    block(n // 4)
    bases, adds, native = [], [], ""
    for r in range(pairs):
        prof = stepscope.Profiler(dir=out / f"c{r}", schedule=None, host_metrics=False,
                                  report=False, use_env=False, torch=True)
        base = traced = 0
        for traced_turn in ((True, False) if r % 2 else (False, True)):
            if traced_turn:
                prof.start()
                block(n // 4)
                traced = block(n)
                tracer = prof.hooks[0].collectives
                native = ("C++ hooks" if tracer._native_hooks  # noqa: SLF001
                          else "C++ kernels" if tracer._native_kernels  # noqa: SLF001
                          else "stamped in C++" if tracer._stamps is not None  # noqa: SLF001
                          else "")
                prof.stop()
            else:
                base = block(n)
        bases.append(base / n / 1e3)
        adds.append((traced - base) / n / 1e3)
    dist.destroy_process_group()
    return statistics.median(bases), statistics.median(adds), native


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps-mlp", type=int, default=200)
    ap.add_argument("--steps-cnn", type=int, default=40)
    ap.add_argument("--direct-only", action="store_true",
                    help="only the untraced steps and table 2 (the summary level's direct cost)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where table 1's models run (cuda: table 1 alone, CUPTI on)")
    ap.add_argument("--summary-cost", metavar="STEP_ON", help=argparse.SUPPRESS)
    ap.add_argument("--collective-cost", metavar="PATH", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and (args.direct_only or not torch.cuda.is_available()):
        sys.exit("bench_torch: --device cuda needs a CUDA device and runs table 1 alone")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.summary_cost:  # one process of table 2 (see summary_cost_in_processes)
        with tempfile.TemporaryDirectory() as tmp:
            step_on = None if args.summary_cost == "None" else args.summary_cost
            print(json.dumps(summary_cost(Path(tmp), step_on)))
        return
    if args.collective_cost:  # one process of table 3
        with tempfile.TemporaryDirectory() as tmp:
            path, completion, via = (args.collective_cost + "::").split(":")[:3]
            print(json.dumps(collective_cost(Path(tmp), path == "hooks",
                                             stamps=completion != "callback",
                                             via_group=via == "group")))
        return
    rows, part_rows = [], []
    for name, make, steps in (("MLP", mlp, args.steps_mlp), ("CNN", cnn, args.steps_cnn)):
        res: dict[str, list] = {"base": [], "summary": [], "detail": [], "tp": [],
                                "dbytes": [], "tbytes": []}
        for _ in range(args.reps):
            with tempfile.TemporaryDirectory() as tmp:
                res["base"].append(untraced(make, steps))
                if args.direct_only:
                    continue
                res["summary"].append(stepscope_run(make, steps, False, Path(tmp) / "s")[0])
                ns, size, loop_ns = stepscope_run(make, steps, True, Path(tmp) / "d")
                res["detail"].append(ns)
                res["dbytes"].append(size / steps)
                parts = res.setdefault("parts", {k: [] for k in PARTS})
                parts["ss"].append((ns, loop_ns))
                ns, size, loop_ns = torch_profiler_run(make, steps, Path(tmp))
                res["tp"].append(ns)
                res["tbytes"].append(size / steps)
                parts["tp"].append((ns, loop_ns))
                if DEVICE == "cuda":  # the parts: operators alone, CUPTI alone, torch's CPU
                    run = stepscope_run(make, steps, True, Path(tmp) / "o", gpu=False)
                    parts["ss_ops"].append((run[0], run[2]))
                    run = stepscope_run(make, steps, True, Path(tmp) / "c", ops=False)
                    parts["ss_cupti"].append((run[0], run[2]))
                    run = torch_profiler_run(make, steps, Path(tmp), cuda=False)
                    parts["tp_cpu"].append((run[0], run[2]))
        # times: the fastest run (load spikes only ever add time); bytes: the median
        if args.direct_only:
            res = {k: v or [0.0] for k, v in res.items()}
        parts = res.pop("parts", {})
        med = {k: (statistics.median(v) if "bytes" in k else min(v)) for k, v in res.items()}
        base = med["base"]
        # each part: (µs the loop adds per step, µs of the stop/window end per step), fastest
        part_rows.append((name, *(((min(r[1] for r in v) - base) / 1e3,
                                   min(r[0] - r[1] for r in v) / 1e3)
                                  for k in PARTS if (v := parts.get(k)))))
        rows.append((name, steps, base / 1e3,
                     100 * (med["summary"] - base) / base,
                     (med["detail"] - base) / 1e3, 100 * (med["detail"] - base) / base,
                     (med["tp"] - base) / 1e3, 100 * (med["tp"] - base) / base,
                     med["dbytes"], med["tbytes"], med["tbytes"] / max(1.0, med["dbytes"])))
    head = ("model", "steps", "step us", "summary %", "detail us", "detail %",
            "torch.prof us", "torch.prof %", "detail B/step", "json B/step", "smaller x")
    where = ("CPU" if DEVICE == "cpu" else
             f"{torch.cuda.get_device_name()} (stepscope: CUPTI on; torch.profiler: CPU + CUDA)")
    print(f"torch {torch.__version__}, {where}, 1 thread, fastest of {args.reps} runs "
          f"(cost = traced - untraced, per step); torch's events read by: "
          f"{', '.join(sorted(READER))} reader")
    print("  ".join(f"{h:>13}" for h in head))
    for r in rows if not args.direct_only else ():
        print("  ".join([f"{r[0]:>13}", f"{r[1]:>13}"] + [f"{v:>13.2f}" for v in r[2:8]]
                        + [f"{r[8]:>13.0f}", f"{r[9]:>13.0f}", f"{r[10]:>13.1f}"]))
    if not args.direct_only:
        labels = [PARTS[k] for k in PARTS if DEVICE == "cuda" or k in ("ss", "tp")]
        print("\n1b) where a window's cost lies: µs added per step by the loop (recording) and "
              "by the window's end or the profiler's stop (conversion, file or export, free), "
              "fastest of the same runs" + ("; stepscope's parts: operators alone (gpu=False), "
                                            "CUPTI alone (torch=False); torch.profiler's: CPU "
                                            "activity alone" if DEVICE == "cuda" else ""))
        print(f"{'model':>6}" + "".join(f"{lb + ' loop/end':>26}" for lb in labels))
        for r in part_rows:
            print(f"{r[0]:>6}" + "".join(f"{f'{a:.1f} / {b:.1f}':>26}" for a, b in r[1:]))
    if DEVICE == "cuda":  # tables 2 and 3 are CPU-side costs: measured without a GPU
        return
    steps_us = {r[0]: r[2] for r in rows}
    print(f"\n2) summary level measured directly: CPU µs stepscope adds per step (main thread: "
          f"in each of {PROCESSES} fresh processes the median of {PAIRS} pairs of 300-step "
          "blocks, with and without, back to back, and the median of the processes; writer: "
          "per step, and per flush, paid once a second), in % of each untraced step above")
    head = ("summary mode", "main us", "processes", "writer us", "flush us",
            *(f"% of {m}" for m in steps_us), "target")
    print("  ".join(f"{h:>13}" for h in head))
    for label, step_on in (("phases+step()", None), ("step_on=optim", "optimizer")):
        mains, writer_us, flush_us = summary_cost_in_processes(step_on)
        main_us = statistics.median(mains)
        print("  ".join([f"{label:>13}", f"{main_us:>13.2f}",
                         f"{'/'.join(f'{m:.1f}' for m in mains):>13}", f"{writer_us:>13.2f}",
                         f"{flush_us:>13.0f}"]
                        + [f"{100 * (main_us + writer_us + flush_us * us / 1e6) / us:>13.2f}"
                           for us in steps_us.values()]
                        + [f"{'<= 1%':>13}"]))

    import torch.distributed as dist

    if not dist.is_available():
        return
    print(f"\n3) collectives: CPU µs (all threads) per gloo all-reduce of 16 floats, world size 1, "
          f"waited for; the median of {COLLECTIVE_PAIRS} pairs of 2000-op blocks, with and "
          "without, in a fresh process per path")
    head = ("path", "how", "untraced us", "stepscope us")
    print("  ".join(f"{h:>24}" for h in head))
    hooks = hasattr(dist.ProcessGroup, "register_pre_hook")
    for label, path in (("process-group hooks", "hooks"),
                        ("process-group hooks", "hooks:callback"),
                        ("c10d kernel", "python"),
                        ("c10d kernel", "python:callback"),
                        ("c10d kernel, pg method", "python::group"),
                        ("c10d kernel, pg method", "python:callback:group")):
        if path.startswith("hooks") and not hooks:
            continue  # (this torch has none)
        r = subprocess.run([sys.executable, __file__, "--collective-cost", path],
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"bench_torch: the table-3 process failed:\n{r.stderr[-3000:]}")
        base, added, native = json.loads(r.stdout.splitlines()[-1])
        how = native or ("Python hooks" if path.startswith("hooks") else "Python kernels")
        how += "" if "callback" in path or native else " (not built)"
        print("  ".join([f"{label:>24}", f"{how:>24}", f"{base:>24.1f}", f"{added:>24.1f}"]))


if __name__ == "__main__":
    main()
