"""Instructions and estimated cycles per step that stepscope's summary level adds to a small
torch training step.

Wall-clock and CPU-time ratios of 1 % cannot be read on a shared machine (``bench_torch.py``'s
summary column moves by tens of % between identical runs). Valgrind's counts can: this script
runs itself once under callgrind with its cache simulation, marks the end of each measured block
with a call of ``zlib.adler32``, which nothing else here calls (callgrind dumps its counters
there: ``--dump-before=zlib_adler32``; not ``math.gcd``: torch calls that too), and prints each
block's counts per step, all threads together (the writer's encoding and the I/O thread's
compression included: each traced block ends with a flush that waits for both).

Blocks, ``--steps`` steps each after a warm-up of the same loop (a quarter as long where traced):

* ``MLP step``: bench_torch's MLP step (forward, backward, SGD step), untraced;
* ``MLP step, summary``: the same loop with three phases and ``step()``, profiler on (summary
  level: no detail window; torch integration on): the cost in the real step's company, whose
  work evicts the profiler's code and data from the caches between its calls;
* ``skeleton``: what of that loop reaches stepscope, with no model work: three phases,
  ``opt.step()``/``opt.zero_grad()`` of a real SGD over one scalar (torch's ``Optimizer.step#``
  and ``zero_grad#`` ranges) and ``step()``, untraced;
* ``skeleton, summary``: the same with the profiler on;
* ``zero-code, summary``: no phases and no ``step()``: ``step_on="optimizer"``;
* ``phases, zero-code``: the three phases without ``step()``, ``step_on="optimizer"`` (the
  step ends after the phase "Optimization" around the optimizer step);
* ``loader``: the skeleton's optimizer step and zero_grad, one per batch of a
  ``torch.utils.data.DataLoader`` (a tensor dataset, no worker process), untraced;
* ``loader, zero-code``: the same with ``step_on="optimizer"``: what a training loop over a
  DataLoader pays per batch (each wait for a batch recorded, the step boundary made there).

The summary level's cost is ``traced - untraced``, in % of the MLP step. Instructions are not
time: the ``est. cycles`` column adds what the simulated cache misses cost, with the weights of
callgrind's own cycle estimate (KCachegrind's ``CEst``): ``Ir + 10 x L1 misses + 100 x LL
misses`` (instruction fetch, data read and data write misses). Both columns are deterministic
and count every instruction the profiler runs, on every thread.

    python tools/bench_instructions.py [--steps 400]      (needs valgrind; about 30 minutes)
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

BLOCKS = ("MLP step", "MLP step, summary", "skeleton", "skeleton, summary",
          "zero-code, summary", "phases, zero-code", "loader", "loader, zero-code")
# callgrind's events with --cache-sim=yes, and their weights in its cycle estimate (CEst)
_WEIGHTS = {"Ir": 1, "I1mr": 10, "D1mr": 10, "D1mw": 10, "ILmr": 100, "DLmr": 100, "DLmw": 100}


def _mark() -> None:
    """The end of a measured block (see the module docstring)."""
    zlib.adler32(b"")


def child(steps: int, out: str) -> None:
    """The measured program (run under callgrind): one dump per block."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_torch as bt
    import stepscope

    torch.set_num_threads(1)
    torch.manual_seed(0)
    m, x, y = bt.mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    w = torch.zeros(1, requires_grad=True)
    w.grad = torch.zeros(1)
    sk_opt = torch.optim.SGD([w], lr=0.0)

    def mlp(n: int) -> None:
        for _ in range(n):
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()

    def traced(n: int, step_on: str | None, tag: str, run) -> None:
        prof = stepscope.Profiler(dir=Path(out) / tag, schedule=None, host_metrics=False,
                                  report=False, use_env=False, torch=True, step_on=step_on)
        prof.start()
        sess = prof._sess  # noqa: SLF001
        # no writer thread: its wakes (every 100 ms) and flushes (every second) are wall-clock
        # periodic, and valgrind runs the program some 100 times slower, so they would be
        # charged to a few steps instead of hundreds; each block's events are flushed at its
        # end instead, in this thread (counted in the block: a real run pays that once a second)
        sess._pipeline.begin_stop()  # noqa: SLF001
        sess._pipeline.stop_writer()  # noqa: SLF001
        run(max(20, n // 4), prof)  # warm-up
        sess.flush()
        _mark()  # (the warm-up and the start: not measured)
        run(n, prof)
        sess.flush()  # encoding, compression and the write of the block's events
        _mark()
        prof.stop()

    def skeleton(phases: bool, steps: bool = True):
        return lambda n, prof: bt._skeleton(sk_opt, n, prof, phases=phases, steps=steps)

    def loader(n: int, prof=None) -> None:
        for _batch in torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
                torch.zeros(n, 1))):
            sk_opt.step()
            sk_opt.zero_grad(set_to_none=False)

    mlp(max(5, steps // 10))
    _mark()
    mlp(steps)
    _mark()  # MLP step
    bt._skeleton(sk_opt, steps)
    _mark()
    bt._skeleton(sk_opt, steps)
    _mark()  # skeleton
    traced(steps, None, "mlp", lambda n, prof: bt.loop(m, x, y, n, prof))  # MLP step, summary
    traced(steps, None, "summary", skeleton(True))  # skeleton, summary
    traced(steps, "optimizer", "zero", skeleton(False))  # zero-code, summary
    traced(steps, "optimizer", "phased", skeleton(True, steps=False))  # phases, zero-code
    loader(max(20, steps // 4))
    _mark()
    loader(steps)
    _mark()  # loader
    traced(steps, "optimizer", "loader", loader)  # loader, zero-code


def _totals(path: str) -> tuple[int, int]:
    """(instructions, estimated cycles) of one callgrind dump."""
    events = None
    with open(path) as f:
        for line in f:
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith(("summary:", "totals:")) and events:
                # (a totals line may leave trailing zero counts out)
                counts = dict(zip(events, map(int, line.split()[1:]), strict=False))
                return counts["Ir"], sum(w * counts.get(e, 0) for e, w in _WEIGHTS.items())
    raise ValueError(f"{path}: no totals line")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.steps, args.child)
        return
    if shutil.which("valgrind") is None:
        sys.exit("bench_instructions: valgrind is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "cg.out")
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", "--cache-sim=yes", "--dump-before=zlib_adler32",
             f"--callgrind-out-file={prefix}", sys.executable, __file__, "--steps",
             str(args.steps), "--child", tmp], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"bench_instructions: the measured run failed:\n{proc.stderr[-2000:]}")
        dumps = sorted(glob.glob(prefix + ".*"), key=lambda p: int(p.rsplit(".", 1)[1]))
        counts = [_totals(p) for p in dumps]
    # dumps: 1 import + warm-up, 2 MLP, 3 skeleton warm-up, 4 skeleton, then per traced block
    # its warm-up (5, 7, 9, 11) and the block (6, 8, 10, 12); 13 loader warm-up, 14 loader,
    # 15 and 16 its traced warm-up and block
    want = {2: BLOCKS[0], 6: BLOCKS[1], 4: BLOCKS[2], 8: BLOCKS[3], 10: BLOCKS[4],
            12: BLOCKS[5], 14: BLOCKS[6], 16: BLOCKS[7]}
    if len(counts) != 16:
        sys.exit(f"bench_instructions: {len(counts)} dumps, expected 16 (a stray marker call?)")
    per = {name: [c / args.steps for c in counts[i - 1]] for i, name in want.items()}
    step = per[BLOCKS[0]]
    untraced = {BLOCKS[1]: BLOCKS[0], BLOCKS[3]: BLOCKS[2], BLOCKS[4]: BLOCKS[2],
                BLOCKS[5]: BLOCKS[2], BLOCKS[7]: BLOCKS[6]}
    import torch

    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, {args.steps} steps per "
          "block, per step (callgrind with its cache simulation, all threads)")
    print(f"{'block':<20} {'instructions':>13} {'added':>9} {'% of MLP':>9}"
          f" {'est. cycles':>13} {'added':>9} {'% of MLP':>9}")
    for name in BLOCKS:
        row = f"{name:<20}"
        for k in (0, 1):
            row += f" {per[name][k]:>13,.0f}"
            if name in untraced:
                added = per[name][k] - per[untraced[name]][k]
                row += f" {added:>9,.0f} {100 * added / step[k]:>8.2f}%"
            else:
                row += " " * 20
        print(row.rstrip())
    print(f"target: summary <= 1% of the step ({step[0] / 100:,.0f} instructions, "
          f"{step[1] / 100:,.0f} est. cycles)")


if __name__ == "__main__":
    main()
