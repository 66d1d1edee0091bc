"""Train a small MLP on synthetic data on 2 ranks under the stepscope profiler, merge, summarize.

    python examples/train_mlp.py            # 2 ranks -> ./stepscope/<run-id>/ + merged.pftrace

Each rank is its own process (RANK / WORLD_SIZE set as a launcher would) and trains with numpy
(CuPy when a GPU is present) on its own synthetic shard. A background thread prefetches batches;
the training loop marks phases (Forward / Backward / Optimization) and steps, and a schedule
records batches 10-14 and 20-24 of each epoch in detail. The parent then merges the ranks' summary
traces into one timeline (open it in ui.perfetto.dev) and prints the summaries.
"""

from __future__ import annotations

import argparse
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

try:  # src layout without installation: make `stepscope` importable
    import stepscope
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import stepscope

from stepscope.profiler import Profiler, schedule

BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def array_module():
    """CuPy when a GPU is usable, else numpy."""
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception:
        return np


class MLP:
    """in -> hidden (ReLU) -> classes, softmax cross-entropy, plain SGD."""

    def __init__(self, xp, n_in=256, n_hidden=512, n_out=10, lr=0.05, seed=0):
        rng = np.random.default_rng(seed)
        self.xp = xp
        self.w1 = xp.asarray(rng.normal(0, (2 / n_in) ** 0.5, (n_in, n_hidden)), np.float32)
        self.b1 = xp.zeros(n_hidden, np.float32)
        self.w2 = xp.asarray(rng.normal(0, (2 / n_hidden) ** 0.5, (n_hidden, n_out)), np.float32)
        self.b2 = xp.zeros(n_out, np.float32)
        self.lr = lr

    def forward(self, x, y):
        xp = self.xp
        with stepscope.annotate("linear1"):
            h = x @ self.w1 + self.b1
        with stepscope.annotate("relu"):
            a = xp.maximum(h, 0)
        with stepscope.annotate("linear2"):
            logits = a @ self.w2 + self.b2
        with stepscope.annotate("softmax_xent"):
            z = logits - logits.max(axis=1, keepdims=True)
            p = xp.exp(z)
            p /= p.sum(axis=1, keepdims=True)
            loss = -xp.log(p[xp.arange(len(y)), y] + 1e-9).mean()
        return loss, (x, h, a, p, y)

    def backward(self, cache):
        x, h, a, p, y = cache
        xp = self.xp
        n = len(y)
        d = p.copy()
        d[xp.arange(n), y] -= 1
        d /= n
        with stepscope.annotate("grad_linear2"):
            gw2, gb2 = a.T @ d, d.sum(axis=0)
            da = d @ self.w2.T
        with stepscope.annotate("grad_linear1"):
            dh = da * (h > 0)
            gw1, gb1 = x.T @ dh, dh.sum(axis=0)
        return gw1, gb1, gw2, gb2

    def update(self, grads):
        for name, g in zip(("w1", "b1", "w2", "b2"), grads, strict=True):
            getattr(self, name)[...] -= self.lr * g


class PrefetchLoader:
    """Synthetic batches made on a background thread, ``depth`` batches ahead."""

    def __init__(self, xp, batches, batch_size=128, n_in=256, n_out=10, depth=4, seed=0,
                 make_cost_s=0.0):
        self.xp, self.batches, self.bs, self.n_in = xp, batches, batch_size, n_in
        rng = np.random.default_rng(1234)  # the same teacher on every rank
        self.teacher = rng.normal(size=(n_in, n_out)).astype(np.float32)
        self.seed, self.depth, self.make_cost_s = seed, depth, make_cost_s

    def __iter__(self):
        q: queue.Queue = queue.Queue(self.depth)
        rng = np.random.default_rng(self.seed)

        def produce():
            for _ in range(self.batches):
                with stepscope.annotate("make_batch"):
                    x = rng.normal(size=(self.bs, self.n_in)).astype(np.float32)
                    y = (x @ self.teacher).argmax(axis=1)
                    if self.make_cost_s:
                        time.sleep(self.make_cost_s)
                q.put((self.xp.asarray(x), self.xp.asarray(y)))
            q.put(None)

        threading.Thread(target=produce, name="prefetch", daemon=True).start()
        while (item := q.get()) is not None:
            yield item


def train_step(model, batch, prof):
    """One training step with its phases (``prof`` may be None: no profiler)."""
    phase = prof.phase if prof is not None else _no_phase
    x, y = batch
    with phase("Forward"):
        loss, cache = model.forward(x, y)
    with phase("Backward"):
        grads = model.backward(cache)
    with phase("Optimization"):
        model.update(grads)
    return loss


class _NoPhase:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _no_phase(name):
    return _NoPhase()


def worker(out: str, epochs: int, batches: int) -> None:
    """One rank: RANK / WORLD_SIZE / STEPSCOPE_RUN_ID come from the environment."""
    xp = array_module()
    rank = int(os.environ.get("RANK", "0"))
    model = MLP(xp, seed=rank)
    sched = schedule(skip_first=5, wait=4, warmup=1, active=5, repeat=1)
    # report=False: each rank prints its step timer only; the parent prints the merged summary
    with Profiler(out, sched, sample_interval_s=0.25, report=False) as prof:
        for epoch in range(epochs):
            prof.epoch(epoch)
            loader = PrefetchLoader(xp, batches, seed=rank * 1000 + epoch, make_cost_s=0.001)
            for batch in prof.dataloader(loader):
                loss = train_step(model, batch, prof)
                prof.step(num_samples=len(batch[1]))
            print(f"rank {rank} epoch {epoch}: loss {float(loss):.3f}", flush=True)
    print(f"rank {rank}: " + prof.timer_stats().format(), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="./stepscope")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batches", type=int, default=50, help="batches per epoch")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.out, args.epochs, args.batches)
        return 0

    run_id = time.strftime("mlp-%Y%m%d-%H%M%S")
    procs = []
    for rank in range(args.ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank),
                   STEPSCOPE_RUN_ID=run_id)
        for var in BLAS_THREADS:  # one core per rank: BLAS thread pools would oversubscribe
            env.setdefault(var, "1")
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", "--out", args.out, "--epochs",
             str(args.epochs), "--batches", str(args.batches)], env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        print(f"a rank failed: exit codes {codes}", file=sys.stderr)
        return 1
    from stepscope.analysis.merge import merge

    run_dir = Path(args.out) / run_id
    merged = merge([run_dir], run_dir / "merged.pftrace")
    print(merged.format())
    from stepscope import analysis
    from stepscope.analysis import summaries

    with analysis.open(str(merged.output)) as db:  # the summary tables of all ranks
        print(summaries.report(db))
    print(f"open {merged.output} in https://ui.perfetto.dev")
    return 0


if __name__ == "__main__":
    sys.exit(main())
