"""Instructions per step that stepscope's summary level adds to a small torch training step.

Wall-clock and CPU-time ratios of 1 % cannot be read on a shared machine (``bench_torch.py``'s
summary column moves by tens of % between identical runs). Instruction counts can: this script
runs itself once under valgrind's callgrind, marks the end of each measured block with a call
of ``zlib.adler32``, which nothing else here calls (callgrind dumps its counters there:
``--dump-before=zlib_adler32``; not ``math.gcd``: torch calls that too), and prints each
block's instructions per step, all threads together (the writer's encoding and the I/O thread's
compression included: each traced block ends with a flush that waits for both).

Blocks, ``--steps`` steps each after a warm-up of the same loop:

* ``MLP step``: bench_torch's MLP step (forward, backward, SGD step), untraced;
* ``skeleton``: what of that loop reaches stepscope, with no model work: three phases,
  ``opt.step()``/``opt.zero_grad()`` of a real SGD over one scalar (torch's ``Optimizer.step#``
  and ``zero_grad#`` ranges) and ``step()``, untraced;
* ``skeleton, summary``: the same with the profiler on (summary level, torch integration on);
* ``zero-code, summary``: no phases and no ``step()``: ``step_on="optimizer"``.

The summary level's cost is ``traced - untraced`` skeleton, in % of the MLP step. Instructions
are not time (cache misses and branch mispredictions are not counted), but they are
deterministic and count every instruction the profiler runs, on every thread.

    python tools/bench_instructions.py [--steps 400]      (needs valgrind; about 5 minutes)
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

BLOCKS = ("MLP step", "skeleton", "skeleton, summary", "zero-code, summary")


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

    def traced(n: int, step_on: str | None, tag: str) -> None:
        prof = stepscope.Profiler(dir=Path(out) / tag, host_metrics=False, report=False,
                                  use_env=False, torch=True, step_on=step_on)
        prof.start()
        sess = prof._sess  # noqa: SLF001
        sess.flush_interval_s = 60.0  # one flush per block, counted in it (below)
        bt._skeleton(sk_opt, n, prof, phases=step_on is None)  # warm-up
        sess.flush()
        _mark()  # (the warm-up and the start: not measured)
        bt._skeleton(sk_opt, n, prof, phases=step_on is None)
        sess.flush()  # encoding, compression and the write of the block's events
        _mark()
        prof.stop()

    mlp(max(5, steps // 10))
    _mark()
    mlp(steps)
    _mark()  # MLP step
    bt._skeleton(sk_opt, steps)
    _mark()
    bt._skeleton(sk_opt, steps)
    _mark()  # skeleton
    traced(steps, None, "summary")  # skeleton, summary
    traced(steps, "optimizer", "zero")  # zero-code, summary


def _total(path: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
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
            ["valgrind", "--tool=callgrind", "--dump-before=zlib_adler32",
             f"--callgrind-out-file={prefix}", sys.executable, __file__, "--steps",
             str(args.steps), "--child", tmp], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"bench_instructions: the measured run failed:\n{proc.stderr[-2000:]}")
        dumps = sorted(glob.glob(prefix + ".*"), key=lambda p: int(p.rsplit(".", 1)[1]))
        counts = [_total(p) for p in dumps]
    # dumps: 1 import + warm-up, 2 MLP, 3 skeleton warm-up, 4 skeleton, then per traced block
    # its warm-up (5, 7) and the block (6, 8)
    want = {2: BLOCKS[0], 4: BLOCKS[1], 6: BLOCKS[2], 8: BLOCKS[3]}
    if len(counts) != 8:
        sys.exit(f"bench_instructions: {len(counts)} dumps, expected 8 (a stray marker call?)")
    per = {name: counts[i - 1] / args.steps for i, name in want.items()}
    step, base = per[BLOCKS[0]], per[BLOCKS[1]]
    import torch

    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, {args.steps} steps per "
          "block, instructions per step (callgrind, all threads)")
    print(f"{'block':<22} {'instr/step':>12} {'added':>10} {'% of MLP step':>14}")
    for name in BLOCKS:
        added = per[name] - base if "summary" in name else None
        print(f"{name:<22} {per[name]:>12,.0f} "
              + (f"{added:>10,.0f} {100 * added / step:>13.2f}%" if added is not None else ""))
    print(f"target: summary <= 1% of the step ({step / 100:,.0f} instructions)")


if __name__ == "__main__":
    main()
