"""On a GPU (marked ``gpu``): torch's operators and stepscope's CUPTI tracer in one process, with
and without the program's own ``torch.profiler`` (one CUPTI client at a time).

Each scenario is a user's program in a process of its own (CUPTI's state is per process): a CUDA
MLP trained for 3 epochs of 4 steps, with detail windows over batches 1-2 of each epoch. The
kernels per step are the same every step, so each window's kernels are compared with what
torch.profiler itself records for the same steps (names and counts), never with a guessed
number.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import tq  # noqa: E402

from stepscope.analysis import summaries  # noqa: E402

pytestmark = pytest.mark.gpu

PROGRAM = r"""
import json, sys
import torch
import stepscope
from stepscope.pytorch import memory
from torch.profiler import ProfilerActivity

memory.INTERVAL_NS = 0  # GPU memory at every step end: 12 samples to check

run_dir, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256, device="cuda"), torch.randint(0, 10, (64,), device="cuda")

def train_step():
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()

def torch_kernels(p):
    # the kernels and memsets torch.profiler recorded (its GPU-side copies of CPU ranges, the
    # user annotations, left out)
    events = p.events()
    cpu = {e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU}
    return [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA
            and e.name not in cpu and not getattr(e, "is_user_annotation", False)]

out = {}
# torch.profiler alone first, before stepscope: one step's kernels as torch records them
train_step()
with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    train_step()
    torch.cuda.synchronize()
out["torch_step"] = torch_kernels(p)
prof = stepscope.Profiler(dir=run_dir, run_id="g", schedule=(1, 3), gpu=True, torch=True,
                          report=False, use_env=False, host_metrics=False)
prof.start()
for epoch in range(3):
    if mode == "user" and epoch == 1:  # the program's own profiler over this epoch's window
        with torch.profiler.profile(
                activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(4):
                train_step()
                prof.step()
            torch.cuda.synchronize()
        out["user_epoch"] = torch_kernels(p)
    else:
        for _ in range(4):
            train_step()
            prof.step()
    prof.epoch()
prof.stop()
out["cupti_path"] = prof._gpu.tracer.path if prof._gpu is not None else None
out["reader"] = [getattr(h.ops, "last_reader", None) for h in prof.hooks if hasattr(h, "ops")]
print(json.dumps(out))
"""


def _run(tmp_path: Path, mode: str) -> tuple[dict, str]:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("cupti")
    script = tmp_path / "train.py"
    script.write_text(PROGRAM)
    r = subprocess.run([sys.executable, str(script), str(tmp_path), mode], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def _window(tmp_path: Path, i: int) -> tuple[Counter, list[dict], object]:
    """Window ``i``'s kernels and memsets (torch.profiler's names: "Memset (Device)"), its
    operators, and the trace."""
    d = tq.db(tmp_path / "g" / f"rank0.detail.{i}.pftrace")
    device = Counter(s["name"] for s in tq.slices(d, "s.category = 'kernel'"))
    device["Memset (Device)"] += len(tq.slices(d, "s.category = 'memset'"))
    return +device, tq.slices(d, "s.category = 'torch_op'"), d


def _check_window(tmp_path: Path, i: int, per_step: Counter) -> None:
    """Window ``i`` (2 steps) holds two steps' kernels and memsets as torch.profiler names and
    counts them; each kernel has its launch flow, the launch lies in the window's steps and the
    kernel starts after it (host and device on one clock); and the operators: 2 Linear layers x
    2 steps of aten::addmm."""
    device, ops, d = _window(tmp_path, i)
    want = Counter({k: 2 * n for k, n in per_step.items()})
    assert device == want, (i, device - want, want - device)
    assert sum(1 for s in ops if s["name"] == "aten::addmm") == 4
    pairs = tq.rows(d, "SELECT o.ts AS launch, s.ts AS kernel FROM flow f "
                       "JOIN slice s ON s.id = f.slice_in JOIN slice o ON o.id = f.slice_out "
                       "WHERE s.category = 'kernel'")  # fmt: skip
    assert len(pairs) == sum(n for k, n in device.items() if k != "Memset (Device)")
    steps = tq.slices(d, "s.category = 'step'")
    t0, t1 = steps[0]["ts"], max(s["ts"] + s["dur"] for s in steps)
    assert all(t0 <= p["launch"] <= t1 for p in pairs), (i, "a launch outside the steps")
    assert all(p["kernel"] >= p["launch"] - 50_000 for p in pairs), (i, "kernel before launch")
    # torch's autograd device thread (C++) launches the backward kernels: its CUDA calls are on
    # its own track, under its operators, which therefore have GPU time (they had none when
    # CUPTI's id of that thread was not mapped: a process-level "CUDA API (thread N)" track)
    assert not tq.rows(d, "SELECT id FROM track WHERE name LIKE 'CUDA API (thread%'"), i
    ops = {r["name"]: r for r in summaries.table(d, "operators").records()}
    assert ops["AddmmBackward0"]["gpu_total_ms"] > 0, (i, ops["AddmmBackward0"])


def test_operators_and_cupti_kernels_in_each_window(tmp_path):
    out, err = _run(tmp_path, "ours")
    assert out["cupti_path"] == "raw"
    per_step = Counter(out["torch_step"])
    assert per_step, "torch.profiler recorded no kernel"
    for i in range(3):
        _check_window(tmp_path, i, per_step)
    assert "CUPTI_ERROR" not in err and "another CUPTI client" not in err, err[-2000:]
    d = tq.db(tmp_path / "g" / "rank0.summary.pftrace")
    mem = tq.rows(d, "SELECT c.value FROM counter c JOIN counter_track t ON t.id = c.track_id "
                     "WHERE t.name = 'torch.cuda0.memory.allocated'")  # fmt: skip
    params = (256 * 512 + 512 + 512 * 10 + 10) * 4  # the model's fp32 weights, on the GPU
    assert len(mem) == 12 and all(r["value"] >= params for r in mem)


def test_the_programs_own_profiler_keeps_its_cuda_activity(tmp_path):
    """Under the program's torch.profiler (epoch 1) stepscope's window stands down, and the
    program's profiler gets every kernel of its 4 steps; the next window is stepscope's again
    (CUPTI's buffer callbacks taken back from Kineto)."""
    out, err = _run(tmp_path, "user")
    per_step = Counter(out["torch_step"])
    assert Counter(out["user_epoch"]) == Counter({k: 4 * n for k, n in per_step.items()})
    _check_window(tmp_path, 0, per_step)
    device, ops, _ = _window(tmp_path, 1)
    assert device == Counter() and ops == []
    assert "torch.profiler is already running" in err, err[-2000:]
    _check_window(tmp_path, 2, per_step)
    assert "CUPTI_ERROR" not in err and "another CUPTI client" not in err, err[-2000:]
