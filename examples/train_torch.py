"""A small CNN trained on random data under stepscope: one process, or DDP (gloo, or NCCL on GPUs).

Single process::

    python examples/train_torch.py --dir ./stepscope

DDP (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; any launcher that does works)::

    torchrun --nproc-per-node 2 examples/train_torch.py --dir ./stepscope

On GPUs, ``--device cuda`` trains on ``cuda:LOCAL_RANK`` and DDP uses NCCL; the detail windows then
hold the kernels and copies from CUPTI too, and the summary NVML's counters.

The loop has no ``step()`` calls: ``Profiler(step_on="optimizer")`` makes a step per optimizer
step, the DataLoader's waits and its workers' fetches are recorded, the detail windows hold every
aten operator with its input shapes, and DDP's gradient allreduces are collective ranges (the
``collectives`` table).
The same script runs untouched under ``stepscope run -- python examples/train_torch.py``
(then drop the ``Profiler`` lines, or keep them: the outer profiler wins).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import stepscope


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="./stepscope", help="stepscope output root")
    p.add_argument("--run-id", default=None, help="run directory name (default: per launch)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=512, help="samples per epoch (all ranks)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--window", type=int, nargs=2, default=(2, 4), metavar=("START", "END"),
                   help="detail window: steps [START, END) of each epoch")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: one GPU per process (LOCAL_RANK), DDP over NCCL")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    ddp = "WORLD_SIZE" in os.environ  # launched by torchrun (a world of 1 is DDP too)
    if ddp:
        import torch.distributed as dist

        # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    torch.set_num_threads(1)

    n = args.samples // world
    data = TensorDataset(torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True,
                        num_workers=args.workers, persistent_workers=args.workers > 0,
                        pin_memory=device.type == "cuda")
    model: nn.Module = SmallCNN().to(device)
    if ddp:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    with stepscope.Profiler(dir=args.dir, run_id=args.run_id, schedule=tuple(args.window),
                            step_on="optimizer", report=rank == 0):
        for _epoch in range(args.epochs):
            stepscope.epoch()
            for x, y in loader:
                if device.type == "cuda":
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with stepscope.phase("Forward"):
                    loss = F.cross_entropy(model(x), y)
                with stepscope.phase("Backward"):
                    loss.backward()
                with stepscope.phase("Optimization"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
    if ddp:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
