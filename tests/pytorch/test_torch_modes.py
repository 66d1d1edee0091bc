"""Steps without code changes (stepscope run, step_on="auto"), options, CUDA memory counters
and the one-CUPTI-client rule with fakes (issue 20 items 5, 6, 7)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install stepscope[torch])")

import tq  # noqa: E402

import stepscope  # noqa: E402
from stepscope.profiler import options  # noqa: E402

SCRIPT = textwrap.dedent("""
    import time, torch
    from torch.utils.data import DataLoader, TensorDataset
    time.sleep(0.3)  # start-up: no step yet
    t = time.perf_counter_ns()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(20, 4), torch.randn(20, 1)), batch_size=4)
    for epoch in range(2):
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    print("LOOP", t)
""")


def test_stepscope_run_finds_optimizer_steps_without_code_changes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), STEPSCOPE_OPTIONS=json.dumps(
        {"dir": str(tmp_path / "out"), "run_id": "z", "report": False, "host_metrics": False,
         "schedule": None}))
    out = subprocess.run([sys.executable, "-m", "stepscope.profiler.boot", str(script)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    t_loop = int(out.stdout.split("LOOP")[1])
    d = tq.db(tmp_path / "out" / "z" / "rank0.summary.pftrace")
    steps = tq.slices(d, "s.category = 'step'")
    waits = tq.slices(d, "s.name = 'dataloader.next'")
    assert len(steps) == 10  # 5 batches x 2 epochs, one step per optimizer step
    assert len(waits) == 10
    assert steps[0]["ts"] > t_loop  # at the first batch wait, not at interpreter start
    assert 0 <= waits[0]["ts"] - steps[0]["ts"] < 2_000_000
    for st, w in zip(steps, waits, strict=True):
        assert st["ts"] <= w["ts"] < st["ts"] + st["dur"]
    # each epoch's final wait, which found the loader exhausted: after its last step, before
    # the next epoch's first
    ends = tq.slices(d, "s.name = 'dataloader.exhausted'")
    assert len(ends) == 2
    assert steps[4]["ts"] + steps[4]["dur"] <= ends[0]["ts"]
    assert ends[0]["ts"] + ends[0]["dur"] <= steps[5]["ts"]
    assert steps[9]["ts"] + steps[9]["dur"] <= ends[1]["ts"]


SPAWNED_WORKERS = textwrap.dedent("""
    import sys, torch
    from torch.utils.data import DataLoader, Dataset

    class Numbers(Dataset):  # (in the script: the workers import it from __mp_main__)
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return torch.full((8,), float(i))

    def main():
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = DataLoader(Numbers(), batch_size=4, num_workers=2,
                            multiprocessing_context=sys.argv[1])
        for x in loader:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        print("DONE")

    if __name__ == "__main__":
        main()
""")


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_started_by_spawn_or_forkserver_are_traced(tmp_path, method):
    """A DataLoader with multiprocessing_context="spawn" (or "forkserver") pickles its workers'
    target, torch's _worker_loop, which stepscope replaces. Before, the replacement held torch's
    function, which pickle looks up by name and found replaced: the program died at its first
    iter() (PicklingError). Now it trains, and each worker's fetches are in its file."""
    script = tmp_path / "train.py"
    script.write_text(SPAWNED_WORKERS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), STEPSCOPE_OPTIONS=json.dumps(
        {"dir": str(tmp_path / "out"), "run_id": "z", "report": False, "host_metrics": False,
         "schedule": None}))
    out = subprocess.run([sys.executable, "-m", "stepscope.profiler.boot", str(script), method],
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["DONE"]
    run = tmp_path / "out" / "z"
    workers = sorted(run.glob("rank0.summary.worker*.pftrace"))
    assert [p.name.split("-")[0] for p in workers] == ["rank0.summary.worker0",
                                                       "rank0.summary.worker1"]
    fetched = []
    for p in workers:
        d = tq.db(p)
        assert len(tq.slices(d, "s.name = 'fetch'")) == len(tq.slices(d, "s.name = 'collate'"))
        fetched += [s["name"] for s in tq.slices(d, "s.name = '__getitem__'")]
    assert len(fetched) == 12  # 3 batches of 4 samples, each fetched once
    steps = tq.slices(tq.db(run / "rank0.summary.pftrace"), "s.category = 'step'")
    assert len(steps) == 3

ENDS_AFTER_3 = textwrap.dedent("""
    import os, sys, time, torch
    from torch.utils.data import DataLoader
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    no_loader = sys.argv[1].endswith("no loader")
    data = torch.randn(10, 4, 8) if no_loader else DataLoader(torch.randn(40, 8), batch_size=4)
    for i, x in enumerate(data):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        if i == 2:
            print("END", time.perf_counter_ns(), flush=True)
            if sys.argv[1].startswith("exception"):
                raise RuntimeError("boom")
            if sys.argv[1] == "SIGINT":
                os.kill(os.getpid(), 2)
                for _ in range(500):  # (the handler runs at a bytecode check: see
                    time.sleep(0.01)  # test_a_program_interrupted_by_sigint_exits_130)
            break
""")


@pytest.mark.parametrize("end", ["break", "exception", "SIGINT", "exception, no loader"])
def test_a_program_that_fails_after_its_optimizer_step_has_no_step_more(tmp_path, end):
    """A zero-code run that ends by an exception, or a real SIGINT, right after its 3rd
    optimizer step: 3 steps, as when the loop breaks there. The boundary after that optimizer
    step (at the next batch wait, which never comes) is made at stop(), and the step it opens
    holds nothing; without a DataLoader it was made as torch's Optimizer.step# range ended,
    and the step it opened has had no forward since (autograd's sequence number unchanged).
    Before, a 4th step of a few hundred µs was kept as "the step that failed" (the open step
    is kept on an exception), counted by the timer and the tables."""
    (tmp_path / "train.py").write_text(ENDS_AFTER_3)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), STEPSCOPE_OPTIONS=json.dumps(
        {"dir": str(tmp_path / "out"), "run_id": "z", "report": False, "host_metrics": False,
         "schedule": None}))
    out = subprocess.run([sys.executable, "-m", "stepscope.profiler.boot", "train.py", end],
                         env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert out.returncode == {"break": 0, "SIGINT": 130}.get(end, 1), out.stderr
    t_end = int(out.stdout.split("END")[1])
    d = tq.db(tmp_path / "out" / "z" / "rank0.summary.pftrace")
    steps = tq.slices(d, "s.category = 'step'")
    assert [st["name"] for st in steps] == ["step 0", "step 1", "step 2"]
    waits = tq.slices(d, "s.name = 'dataloader.next'")
    if end.endswith("no loader"):  # the last one ends as its optimizer step does
        assert not waits and steps[2]["ts"] + steps[2]["dur"] < t_end
    else:  # ... or as the program does, the boundary waiting for a batch wait
        assert len(waits) == 3 and steps[2]["ts"] + steps[2]["dur"] >= t_end


VALIDATION = textwrap.dedent("""
    import json, sys, time, torch, stepscope
    from torch.utils.data import DataLoader
    # no periodic flush: one during the first pass with gradients on would write the begin of
    # the step it is at first, and it could not be dropped (a step of its own: see
    # test_a_step_a_flush_kept_from_being_dropped_leaves_the_automatic_steps_on)
    stepscope.current().flush_interval_s = 3600
    train = DataLoader(torch.randn(16, 8), batch_size=4)  # 4 optimizer steps an epoch
    val = DataLoader(torch.randn(20, 8), batch_size=4)  # 5 batches
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    passes = []
    for epoch in range(3):
        for x in train:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.002)
        a = time.perf_counter_ns()
        if sys.argv[1] == "no_grad":  # the whole pass with gradients off
            with torch.no_grad():
                for x in val:
                    model(x)
                    time.sleep(0.005)
        else:  # gradients off around each forward only
            for x in val:
                with torch.no_grad():
                    model(x)
                time.sleep(0.005)
        passes.append((a, time.perf_counter_ns()))
    print("VAL", json.dumps(passes))
""")


@pytest.mark.parametrize("grad", ["no_grad", "grad on"])
def test_a_validation_pass_lies_between_the_steps(tmp_path, grad):
    """A zero-code run of 3 epochs of 4 optimizer steps, each followed by a 5-batch
    validation pass: 12 steps, 4 per epoch, none holding any of the validation, whose waits
    are dataloader.eval slices outside the steps, no Dataloader phase in the Model table.
    Before: 13 steps, the last the final validation with an epoch 3 that never was, and each
    epoch's first step held the validation before it (56 ms against 3). A pass under
    no_grad() evaluates from its first wait; one with gradients on is known from its end:
    its first pass is a step at first, dropped as it ends (its waits then lie outside the
    steps, dataloader.next still)."""
    (tmp_path / "train.py").write_text(VALIDATION)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), STEPSCOPE_OPTIONS=json.dumps(
        {"dir": str(tmp_path / "out"), "run_id": "z", "report": False, "host_metrics": False,
         "schedule": None}))
    out = subprocess.run([sys.executable, "-m", "stepscope.profiler.boot", "train.py", grad],
                         env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    passes = json.loads(out.stdout.split("VAL")[1])
    d = tq.db(tmp_path / "out" / "z" / "rank0.summary.pftrace")
    steps = tq.slices(d, "s.category = 'step'")
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(12)]
    assert [tq.args(d, st["arg_set_id"])["epoch"] for st in steps] == ["0"] * 4 + [
        "1"] * 4 + ["2"] * 4
    waits = tq.slices(d, "s.category = 'dataloader'")
    for st in steps:
        for a, b in passes:
            assert st["ts"] + st["dur"] <= a or st["ts"] >= b, (
                st, a, b, [(s["name"], s["ts"], s["dur"]) for s in steps + waits])
    names = [w["name"] for w in waits]
    first = 5 if grad == "grad on" else 0  # (the first pass with gradients on: next waits)
    assert names.count("dataloader.next") == 12 + first
    assert names.count("dataloader.eval") == 15 - first
    assert names.count("dataloader.exhausted") == 6
    from stepscope.analysis import summaries

    model = summaries.table(d, "model").rows
    assert [(r["phase"], r["calls"]) for r in model] == [("Dataloader", 12 + first),
                                                        ("Others", 12)]


def _zero_code(tmp_path, loop) -> tuple[Any, list[dict], list[int], list[int]]:
    """Run ``loop(marks)`` under a zero-code profiler (schedule None); returns the trace, its
    steps and their epochs. ``marks`` collects the loop's own clock readings."""
    prof = stepscope.Profiler(dir=tmp_path, run_id="r", schedule=None, step_on="optimizer",
                              host_metrics=False, report=False, use_env=False, torch=True)
    marks: list[int] = []
    with prof:
        loop(marks)
    d = tq.db(tmp_path / "r" / "rank0.summary.pftrace")
    steps = tq.slices(d, "s.category = 'step'")
    return d, steps, [int(tq.args(d, st["arg_set_id"])["epoch"]) for st in steps], marks


def _model_and_opt():
    model = torch.nn.Linear(8, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_a_validation_loader_leaves_a_loop_without_a_loader_one_step_per_iteration(tmp_path):
    """Training on tensors sliced by hand (no DataLoader), a no_grad validation DataLoader
    every 3 iterations: 9 steps, one per optimizer step, none holding a validation. Before,
    the validation's waits said "a loop with a DataLoader", and from then on each boundary
    waited for a batch wait that only the next validation brought: 3 iterations a step."""
    model, opt = _model_and_opt()
    val = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4)
    data = torch.randn(9, 4, 8)

    def loop(marks):
        for i in range(9):
            model(data[i]).sum().backward()
            opt.step()
            opt.zero_grad()
            if i % 3 == 2:
                a = time.perf_counter_ns()
                with torch.no_grad():
                    for x in val:
                        model(x)
                marks += [a, time.perf_counter_ns()]

    d, steps, epochs, marks = _zero_code(tmp_path, loop)
    got = _in_steps(d, "record_function")
    assert [[r["name"].split("#")[0] for r in inner if "zero_grad" not in r["name"]]
            for _, inner in got] == [["Optimizer.step"]] * 9
    for st in steps:
        for a, b in zip(marks[0::2], marks[1::2], strict=True):
            assert st["ts"] + st["dur"] <= a or st["ts"] >= b


def test_one_optimizer_stepped_again_without_a_forward_makes_a_step_each_time(tmp_path):
    """Gradients set by hand (no forward: autograd's sequence number never moves): one
    optimizer's steps are a step each; only another optimizer's step right after one joins
    its step. (Taken for a second optimizer, the loop made one step in all.)"""
    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([w], lr=0.1)

    def loop(marks):
        for _ in range(4):
            with stepscope.phase("Optimization"):
                w.grad = torch.ones(3)
                opt.step()

    _, steps, epochs, _ = _zero_code(tmp_path, loop)
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(4)]


@pytest.mark.parametrize("grad", ["off around the loop", "off around each forward"])
def test_a_validation_in_the_middle_of_an_epoch_starts_no_epoch(tmp_path, grad):
    """Validation every 3 of an epoch's 6 batches, gradients off around the loop or only
    around each forward (learnt from its first pass's end): 2 epochs of 6 steps, epochs 0
    and 1. Before, a pass with gradients on ended an epoch as it ran out: epochs 0, 1, 2."""
    model, opt = _model_and_opt()
    train = torch.utils.data.DataLoader(torch.randn(24, 8), batch_size=4)
    val = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4)

    def validate():
        if grad == "off around the loop":
            with torch.no_grad():
                for x in val:
                    model(x)
        else:
            for x in val:
                with torch.no_grad():
                    model(x)

    def loop(marks):
        for _ in range(2):
            for i, x in enumerate(train):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
                if i % 3 == 2:
                    validate()

    _, steps, epochs, _ = _zero_code(tmp_path, loop)
    assert epochs == [0] * 6 + [1] * 6


def test_a_range_around_each_epoch_leaves_the_epochs_counted(tmp_path):
    """record_function around each epoch's loop over a DataLoader: the range's begin opens
    the epoch's first step before its first batch wait, which starts the epoch: that step is
    batch 0 of epoch 1. Before, the epoch started only where that step was still pending:
    every step read epoch 0."""
    model, opt = _model_and_opt()
    train = torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4)

    def loop(marks):
        for e in range(2):
            with torch.autograd.profiler.record_function(f"epoch{e}"):
                for x in train:
                    model(x).sum().backward()
                    opt.step()
                    opt.zero_grad()

    _, steps, epochs, _ = _zero_code(tmp_path, loop)
    assert epochs == [0] * 4 + [1] * 4


def test_a_loader_looped_over_inside_each_step_is_the_steps_own(tmp_path):
    """A small "anchor" DataLoader looped over in full inside each training step, gradients
    on (a regularizer's batches): its waits are the step's (dataloader.next, reader cost), its
    end ends no epoch, and it is never taken for an evaluation pass. Before, its first pass
    was learnt as one, which dropped the training step it ran in, and each of its ends ended
    an epoch."""
    model, opt = _model_and_opt()
    train = torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4)
    anchor = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4)

    def loop(marks):
        for _ in range(2):
            for x in train:
                loss = model(x).sum()
                for a in anchor:
                    loss = loss + model(a).sum()
                loss.backward()
                opt.step()
                opt.zero_grad()

    d, steps, epochs, _ = _zero_code(tmp_path, loop)
    assert epochs == [0] * 4 + [1] * 4
    waits = tq.slices(d, "s.category = 'dataloader'")
    assert {w["name"] for w in waits} == {"dataloader.next", "dataloader.exhausted"}
    for st in steps:  # its batch's wait and the anchor's 2, whole in the step
        inside = [w for w in waits if st["ts"] <= w["ts"]
                  and w["ts"] + w["dur"] <= st["ts"] + st["dur"]]
        assert [w["name"] for w in inside] == ["dataloader.next"] * 3 + [
            "dataloader.exhausted"]


def test_a_persistent_validation_loader_is_learnt_across_its_passes(tmp_path):
    """A validation loader with persistent workers, gradients on: iter() resets its one
    iterator instead of making one. Its passes are passes all the same: the first, learnt at
    its end, is dropped as a step; the later ones are evaluation passes (dataloader.eval);
    none ends an epoch. Before, only the first pass was seen: later ones ran as training."""
    model, opt = _model_and_opt()
    train = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4)
    val = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4, num_workers=1,
                                      persistent_workers=True)

    def loop(marks):
        for _ in range(3):
            for x in train:
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
            for x in val:
                with torch.no_grad():
                    model(x)

    d, steps, epochs, _ = _zero_code(tmp_path, loop)
    assert epochs == [0, 0, 1, 1, 2, 2]
    names = [w["name"] for w in tq.slices(d, "s.category = 'dataloader'")]
    assert names.count("dataloader.eval") == 4  # the 2nd and 3rd passes' 2 batches each


def test_a_loader_learnt_as_an_evaluation_loader_that_trains_after_all(tmp_path):
    """A loader's first pass evaluates with gradients on (a baseline loss, no optimizer
    step): it is learnt as an evaluation loader, and its next pass begins as one. That
    pass's first optimizer step says otherwise: the rest of the pass counts, and a step
    opens there, as batch 0 of the next epoch: 4 steps an epoch, 8 in all, none of them the
    baseline's (its 4 waits lie outside the steps)."""
    prof = stepscope.Profiler(dir=tmp_path, run_id="r", schedule=None, step_on="optimizer",
                              host_metrics=False, report=False, use_env=False, torch=True)
    loader = torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with prof:
        for x in loader:
            model(x).sum()
        for _ in range(2):
            for x in loader:
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
    d = tq.db(tmp_path / "r" / "rank0.summary.pftrace")
    steps = tq.slices(d, "s.category = 'step'")
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(8)]
    assert [tq.args(d, st["arg_set_id"])["epoch"] for st in steps] == ["0"] * 4 + ["1"] * 4
    waits = tq.slices(d, "s.category = 'dataloader'")
    assert [w["name"] for w in waits] == (["dataloader.next"] * 4 + ["dataloader.exhausted"]
                                          + ["dataloader.eval"] + ["dataloader.next"] * 3
                                          + ["dataloader.exhausted"]
                                          + ["dataloader.next"] * 4
                                          + ["dataloader.exhausted"])
    assert waits[4]["ts"] + waits[4]["dur"] <= waits[5]["ts"]
    assert waits[5]["ts"] + waits[5]["dur"] < steps[0]["ts"] < waits[6]["ts"]
    for w in waits[:4]:  # the baseline's
        assert all(w["ts"] + w["dur"] <= st["ts"] for st in steps)


def test_a_window_that_ends_with_the_epoch_leaves_the_next_epochs_steps_in_place(tmp_path):
    """Zero-code, a window from batch 2 to 5 of 4-batch epochs: still open when the loader
    runs out, it ends as epoch 1's first wait starts the epoch, inside that next(). That
    wait began at iter(), before the window
    work, so its step's begin was written after the window's slice, earlier than it, on the
    steps' sequence: the writer moved it up and shifted every later step of the run by the
    window work (20 ms here: epoch 1's steps held 4, 0, 0 and 0 optimizer steps). Then the
    wait and its step started after that work, and the iterator's start-up (a multi-process
    loader's workers, tens of ms) was in no step. Now the epoch starts at iter(), before the
    iterator is made: the window work lies before that wait, which starts at iter(); each
    step holds its own optimizer step."""
    prof = stepscope.Profiler(dir=tmp_path, run_id="r", schedule=(2, 6), step_on="optimizer",
                              host_metrics=False, report=False, use_env=False, torch=True)
    loader = torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    iters = []
    with prof:
        for _ in range(2):
            iters.append(time.perf_counter_ns())
            it = iter(loader)  # (as a for loop does: the first wait starts here)
            iters.append(time.perf_counter_ns())
            for x in it:
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
    d = tq.db(tmp_path / "r" / "rank0.summary.pftrace")
    got = _in_steps(d, "record_function")
    assert [st["name"] for st, _ in got] == [f"step {k}" for k in range(8)]
    assert [[r["name"].split("#")[0] for r in inner if "zero_grad" not in r["name"]]
            for _, inner in got] == [["Optimizer.step"]] * 8
    end = tq.slices(d, "s.name = 'stepscope window end'")[0]  # (epoch 0's)
    waits = tq.slices(d, "s.name = 'dataloader.next'")
    assert iters[2] <= end["ts"] and end["ts"] + end["dur"] <= got[4][0]["ts"] <= iters[3]
    for (st, _), w in zip(got, waits, strict=True):
        assert st["ts"] <= w["ts"] < st["ts"] + st["dur"]
    for k in (0, 4):  # an epoch's first step opens with its first wait, as one record
        assert got[k][0]["ts"] == waits[k]["ts"]
    for k in range(7):  # each ends at the boundary made as the next wait starts, not later
        if k != 3:
            assert got[k][0]["ts"] + got[k][0]["dur"] <= waits[k + 1]["ts"]


STEP_RANGE = textwrap.dedent("""
    import json, time, torch
    from torch.profiler import record_function
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with record_function("setup"):
        time.sleep(0.01)
    begins = []
    for i in range(4):
        begins.append(time.perf_counter_ns())
        with record_function("train_step"):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.003)
    print("BEGINS", json.dumps(begins))
""")


def test_step_range_names_a_record_function_range(tmp_path):
    """``stepscope run --step-range train_step`` on a program that annotates with torch's
    record_function: each range of that name begins a step (the profiler starts at the first)
    and lies in it. The first is not recorded (its ``with`` took torch's own ``__exit__``
    before the profiler's range capture was installed: its end would be lost, and the later
    ranges nested in it), the torch ranges inside it are. Before: "no range named
    'train_step' began ... nothing was written"."""
    (tmp_path / "train.py").write_text(STEP_RANGE)
    out = subprocess.run([sys.executable, "-m", "stepscope.cli", "run", "--dir",
                          str(tmp_path / "out"), "--run-id", "z", "--schedule", "none",
                          "--no-host-metrics", "--no-report", "--step-range", "train_step",
                          "--", sys.executable, "train.py"],
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    begins = json.loads(out.stdout.split("BEGINS")[1])
    d = tq.db(tmp_path / "out" / "z" / "rank0.summary.pftrace")
    steps = tq.slices(d, "s.category = 'step'")
    ranges = tq.slices(d, "s.name = 'train_step'")
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(4)]
    assert len(ranges) == 3 and tq.slices(d, "s.name = 'setup'") == []  # (before the start)
    assert all(r["depth"] == 0 for r in ranges)
    assert begins[0] <= steps[0]["ts"]
    for st, rng, b in zip(steps[1:], ranges, begins[1:], strict=True):
        assert b <= st["ts"] <= rng["ts"]  # begun by the range's enter, the range in it
        assert rng["ts"] + rng["dur"] <= st["ts"] + st["dur"]
    for st in steps:  # torch's own ranges: recorded in every step, the first's too
        names = [r["name"].split("#")[0] for r in tq.slices(
            d, f"s.category = 'record_function' AND s.name != 'train_step' AND s.ts >= "
               f"{st['ts']} AND s.ts < {st['ts'] + st['dur']}")]
        assert names == ["Optimizer.step", "Optimizer.zero_grad"]


OWN_PROFILER = textwrap.dedent("""
    import sys, time, stepscope
    if sys.argv[1] == "torch first":
        import torch
    prof = stepscope.Profiler(dir="ignored", schedule=None, report=False)
    calls = []
    with prof:
        import torch  # (else the run's profiler attaches its torch parts here)
        from torch.utils.data import DataLoader
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for x in prof.dataloader(DataLoader(torch.randn(24, 8), batch_size=4)):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.005)  # after the optimizer step, before the program's step()
            a = time.perf_counter_ns()
            prof.step()
            calls.append((a, time.perf_counter_ns()))
    print("CALLS", calls)
""")


@pytest.mark.parametrize("torch_import", ["torch first", "torch later"])
def test_a_programs_own_profiler_under_stepscope_run_makes_the_steps(tmp_path, torch_import):
    """A program with a Profiler of its own (no step_on) and its own step() calls, run under
    ``stepscope run`` (whose profiler it joins, step_on="auto"): each step ends at the
    program's step() call. Before, the first optimizer step ended step 0 (before its 5 ms
    tail) and the first step() call, right after that boundary, was taken for it: step 0
    lacked the tail, and step 1 had two."""
    (tmp_path / "train.py").write_text(OWN_PROFILER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), STEPSCOPE_OPTIONS=json.dumps(
        {"dir": str(tmp_path / "out"), "run_id": "z", "report": False, "host_metrics": False,
         "schedule": None}))
    out = subprocess.run([sys.executable, "-m", "stepscope.profiler.boot", "train.py",
                          torch_import], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    calls = json.loads(out.stdout.split("CALLS")[1].replace("(", "[").replace(")", "]"))
    d = tq.db(tmp_path / "out" / "z" / "rank0.summary.pftrace")
    steps = tq.slices(d, "s.category = 'step'")
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(6)]
    for st, (a, b) in zip(steps, calls, strict=True):
        assert a <= st["ts"] + st["dur"] <= b  # where the program's step() read the clock
    for prev, st in zip(steps, steps[1:], strict=False):
        assert prev["ts"] + prev["dur"] == st["ts"]


def _loop(prof_step_calls: bool, n: int = 4) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        if prof_step_calls:
            stepscope.step()


@pytest.mark.parametrize("user_steps", [False, True])
def test_auto_mode_yields_to_the_programs_own_steps(tmp_path, user_steps):
    prof = stepscope.Profiler(dir=tmp_path, run_id="r", schedule=None, step_on="auto",
                              host_metrics=False, report=False, use_env=False, torch=True)
    prof.start()
    _loop(user_steps)
    prof.stop()
    d = tq.db(tmp_path / "r" / "rank0.summary.pftrace")
    assert len(tq.slices(d, "s.category = 'step'")) == 4  # never 8: no double count
    assert "step" not in prof.__dict__  # the instance hook is gone after stop


def _flush() -> None:
    from stepscope.core import session as _session

    _session.current().flush()  # what the writer thread does every second, made here


def _in_steps(d, inner: str) -> list[tuple[dict, list[dict]]]:
    """Each step with the ``inner`` slices at the top of its thread's track that lie whole
    inside it (the steps have a track of their own)."""
    return [(st, [i for i in tq.step_children(d, st) if i["category"] == inner
                  and i["ts"] + i["dur"] <= st["ts"] + st["dur"]])
            for st in tq.slices(d, "s.category = 'step'")]


def test_optimizer_steps_without_a_loader_hold_their_ranges_across_flushes(tmp_path):
    """A step opened at an optimizer step is written only once it has work: its first range
    (here the user's record_function) writes it, so the ranges nest in the steps even when
    a flush took the step's place in between, and step 0 opens before the first range, not
    at the first module forward inside it."""
    prof = stepscope.Profiler(dir=tmp_path, run_id="r", schedule=None, step_on="optimizer",
                              host_metrics=False, report=False, use_env=False, torch=True)
    prof.start()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        with torch.autograd.profiler.record_function("fwd"):
            loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        opt.step()
        _flush()  # step k+1 is open, its begin not written yet
    prof.stop()
    d = tq.db(tmp_path / "r" / "rank0.summary.pftrace")
    got = _in_steps(d, "record_function")
    assert [st["name"] for st, _ in got] == ["step 0", "step 1", "step 2", "step 3"]
    assert [[r["name"] for r in inner] for _, inner in got] == [
        ["fwd", "Optimizer.step#SGD.step"]] * 4
    for (a, _), (b, _) in zip(got, got[1:], strict=False):
        assert a["ts"] + a["dur"] == b["ts"]  # a step ends where the next begins
    assert prof.timer.steps == 4


def test_zero_code_step_0_opens_at_the_first_module_forward(tmp_path):
    """step_on="optimizer" in a loop with no DataLoader and no range of the program's: the
    step driver watches from start() on for the first module forward, where step 0 opens, so
    step 0 holds its forward and backward (with the driver attached after the profiler's state
    was set, it opened at torch's Optimizer.step# range instead: 0.3 ms of a 3.7 ms step)."""
    prof = stepscope.Profiler(dir=tmp_path, run_id="r", schedule=None, step_on="optimizer",
                              host_metrics=False, report=False, use_env=False, torch=True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof.start()
    time.sleep(0.02)  # the program's set-up: no step
    before = time.perf_counter_ns()
    for _ in range(3):
        loss = model(torch.randn(2, 4)).sum()
        time.sleep(0.003)
        loss.backward()
        opt.step()
        opt.zero_grad()
    prof.stop()
    d = tq.db(tmp_path / "r" / "rank0.summary.pftrace")
    steps = tq.slices(d, "s.category = 'step'")
    assert [st["name"] for st in steps] == ["step 0", "step 1", "step 2"]
    # (the trace clock's conversion: within 20 us of the program's readings)
    assert before - 20_000 <= steps[0]["ts"] <= before + 1_000_000  # at the first forward
    assert all(st["dur"] >= 3_000_000 for st in steps)


def test_zero_code_steps_run_no_python_of_the_capture_but_the_optimizer_hook(tmp_path):
    """With the C buffer, the step an optimizer step opens is begun by its first range in C
    (the ContextHook calls the profiler's _activity where Python's enter_rest did; torch's
    zero_grad range does not begin it), and the boundary is made by the C end of torch's
    Optimizer.step# range (_fast's at_top): per step, the only Python of stepscope is the
    optimizer post-hook that torch calls, and the ranges still nest in the steps they belong
    to."""
    from stepscope.record import recorder

    if recorder.fast is None:
        pytest.skip("the pure-Python buffer runs the capture in Python")
    prof = stepscope.Profiler(dir=tmp_path, run_id="z", schedule=None, step_on="optimizer",
                              host_metrics=False, report=False, use_env=False, torch=True)
    prof.start()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    package = os.path.dirname(stepscope.__file__)
    calls: dict[str, int] = {}

    def count(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls[frame.f_code.co_name] = calls.get(frame.f_code.co_name, 0) + 1

    for i in range(13):
        if i == 3:
            sys.setprofile(count)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    sys.setprofile(None)
    prof.stop()
    assert calls == {"_on_optimizer_step": 10}
    d = tq.db(tmp_path / "z" / "rank0.summary.pftrace")
    got = _in_steps(d, "record_function")
    assert [st["name"] for st, _ in got] == [f"step {k}" for k in range(13)]
    names = [[r["name"].split("#")[0] for r in inner] for _, inner in got]
    assert names == [["Optimizer.step"]] + [["Optimizer.zero_grad", "Optimizer.step"]] * 12
    # the tail after the 13th optimizer step, its zero_grad only, is no step of its own
    tail = tq.outside_steps(d)
    assert [r["name"].split("#")[0] for r in tail] == ["Optimizer.zero_grad"]
    assert tail[0]["ts"] >= got[-1][0]["ts"] + got[-1][0]["dur"]
    assert prof.timer.steps == 13


PHASED_LOOP = textwrap.dedent("""
    import contextlib, sys, torch, stepscope
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt2 = torch.optim.SGD(model[1].parameters(), lr=0.1)
    rf = torch.autograd.profiler.record_function
    loop = sys.argv[2]

    def iteration():
        with stepscope.phase("Forward"):
            loss = model(torch.randn(2, 4)).sum()
        with stepscope.phase("Backward"):
            loss.backward()
        if loop == "ranges":  # the program's own ranges around it, two deep
            with rf("update"):
                with stepscope.phase("Optimization"):
                    opt.step()
                opt.zero_grad()
        else:
            with stepscope.phase("Optimization"):
                opt.step()
                if loop == "two optimizers":
                    opt2.step()
                opt.zero_grad()
        if loop == "iteration":  # a range of the program after it, in the iteration's range
            with rf("log"):
                pass

    window = tuple(map(int, sys.argv[3].split(","))) if len(sys.argv) > 3 else None
    with stepscope.Profiler(dir=sys.argv[1], run_id="r", schedule=window, step_on="optimizer",
                            host_metrics=False, report=False, use_env=False, torch=True) as prof:
        with rf("train") if loop == "span" else contextlib.nullcontext():
            if loop == "epochs":  # a range around each epoch of two iterations
                for epoch in range(2):
                    with rf("epoch"):
                        for i in range(2):
                            iteration()
            else:
                for i in range(4):
                    with rf("iteration") if loop == "iteration" else contextlib.nullcontext():
                        iteration()
        print("STEPS", prof.timer.steps)
""")


@pytest.mark.parametrize("pure", [False, True], ids=["C", "pure-Python"])
@pytest.mark.parametrize("loop", ["phases", "ranges", "two optimizers"])
def test_an_optimizer_step_inside_the_programs_ranges_ends_its_step_after_them(tmp_path, loop,
                                                                               pure):
    """A loop without a DataLoader whose optimizer step is inside the program's ranges (the
    phase "Optimization", a record_function around it): the step ends after the end of the
    outermost, not at torch's Optimizer.step# exit, which cut the phase in two (its end closed
    the step, and the phase's end the next step: 4 steps nested in one). So 4 iterations are 4
    steps, one after another, each holding its phases whole, zero_grad included; two optimizer
    steps in one phase end one step."""
    d = _run_phased_loop(tmp_path, loop, pure)
    steps = tq.slices(d, "s.category = 'step'")
    assert [(st["name"], st["depth"]) for st in steps] == [(f"step {k}", 0) for k in range(4)]
    for a, b in zip(steps, steps[1:], strict=False):
        assert a["ts"] + a["dur"] == b["ts"]  # one after another

    def children(sl: dict) -> list[dict]:
        return tq.slices(d, f"s.parent_id = {sl['id']}")

    last = "update" if loop == "ranges" else "Optimization"
    for i, st in enumerate(steps):
        kids = tq.step_children(d, st)
        assert [k["name"] for k in kids] == ["Forward", "Backward", last]
        # the boundary: after the end of the last range, before the next Forward
        assert kids[-1]["ts"] + kids[-1]["dur"] <= st["ts"] + st["dur"]
        if i < 3:
            assert st["ts"] + st["dur"] <= tq.step_children(d, steps[i + 1])[0]["ts"]
        if loop == "ranges":
            inner = children(kids[-1])
            assert [k["name"].split("#")[0] for k in inner] == ["Optimization",
                                                                 "Optimizer.zero_grad"]
            kids = inner
        torch_ranges = children(kids[0]) if loop == "ranges" else children(kids[-1])
        names = [k["name"].split("#")[0] for k in torch_ranges]
        assert names == {"ranges": ["Optimizer.step"],
                         "phases": ["Optimizer.step", "Optimizer.zero_grad"],
                         "two optimizers": ["Optimizer.step"] * 2 + ["Optimizer.zero_grad"]}[loop]
    # every range is in a step: none was cut
    assert tq.outside_steps(d) == []


def _run_script(tmp_path, text: str, pure: bool, *args: str) -> str:
    """Run ``text`` as a script in a fresh process, its arguments ``tmp_path`` and ``args``
    (the pure-Python recorder forced where ``pure``); its stdout, once it exited cleanly with
    nothing on stderr."""
    script = tmp_path / "loop.py"
    script.write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path),
               STEPSCOPE_PURE_PYTHON="1" if pure else "0")
    out = subprocess.run([sys.executable, str(script), str(tmp_path), *args], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    return out.stdout


def _run_phased_loop(tmp_path, loop: str, pure: bool, *args: str) -> Any:
    out = _run_script(tmp_path, PHASED_LOOP, pure, loop, *args)
    assert out.split("STEPS")[1].split() == ["4"]  # the step timer's count
    return tq.db(tmp_path / "r" / "rank0.summary.pftrace")


TWO_OPTIMIZERS = textwrap.dedent("""
    import sys, time, torch, stepscope
    from torch.utils.data import DataLoader
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    o1 = torch.optim.SGD(model[0].parameters(), lr=0.1)
    o2 = torch.optim.Adam(model[1].parameters(), lr=0.1)
    loader = sys.argv[2] == "loader"
    batches = DataLoader(torch.randn(20, 4), batch_size=4) if loader else range(5)
    with stepscope.Profiler(dir=sys.argv[1], run_id="r", schedule=None, step_on="optimizer",
                            host_metrics=False, report=False, use_env=False, torch=True) as prof:
        for x in batches:
            x = x if loader else torch.randn(4, 4)
            model(x).sum().backward()
            o1.step()
            if loader:  # a GAN's: the second model's forward and backward between
                model[1](torch.randn(4, 3)).sum().backward()
            o2.step()
            model.zero_grad()
            time.sleep(0.002)
        print("STEPS", prof.timer.steps)
""")


@pytest.mark.parametrize("pure", [False, True], ids=["C", "pure-Python"])
def test_two_optimizers_stepped_one_after_another_make_one_step(tmp_path, pure):
    """Without a DataLoader, two optimizers stepped one after another (Muon's beside AdamW's):
    5 iterations are 5 steps, each ending after the second optimizer step. Before, each
    iteration was two steps, the second holding the second optimizer step alone. The first
    time, the boundary after the first optimizer step is made before anything says that
    another follows: the step it opened is dropped (the second optimizer step lies outside
    the steps, once), and the next one opens at the next forward."""
    out = _run_script(tmp_path, TWO_OPTIMIZERS, pure, "no loader")
    assert out.split("STEPS")[1].split() == ["5"]
    d = tq.db(tmp_path / "r" / "rank0.summary.pftrace")
    got = _in_steps(d, "record_function")
    assert [st["name"] for st, _ in got] == [f"step {k}" for k in range(5)]
    names = [[r["name"] for r in inner if "zero_grad" not in r["name"]] for _, inner in got]
    assert names == [["Optimizer.step#SGD.step"]] + [["Optimizer.step#SGD.step",
                                                     "Optimizer.step#Adam.step"]] * 4
    for st, inner in got[1:]:  # each ends as its second optimizer step does
        end = inner[-1]["ts"] + inner[-1]["dur"]
        assert end <= st["ts"] + st["dur"] < end + 1_000_000
    (first,) = tq.outside_steps(d)
    assert first["name"] == "Optimizer.step#Adam.step"
    assert got[0][0]["ts"] + got[0][0]["dur"] <= first["ts"] < got[1][0]["ts"]


@pytest.mark.parametrize("pure", [False, True], ids=["C", "pure-Python"])
def test_a_batchs_optimizer_steps_make_one_step_with_a_loader(tmp_path, pure):
    """With a DataLoader, a GAN's two optimizer steps, a forward and a backward between them:
    one step per batch, from batch wait to batch wait. Before, the boundary after the first
    optimizer step was made before the second one's range (the first range begun after it),
    splitting each batch in two."""
    out = _run_script(tmp_path, TWO_OPTIMIZERS, pure, "loader")
    assert out.split("STEPS")[1].split() == ["5"]
    d = tq.db(tmp_path / "r" / "rank0.summary.pftrace")
    got = _in_steps(d, "record_function")
    waits = tq.slices(d, "s.name = 'dataloader.next'")
    assert [st["name"] for st, _ in got] == [f"step {k}" for k in range(5)] and len(waits) == 5
    for (st, inner), w in zip(got, waits, strict=True):
        assert [r["name"] for r in inner if "zero_grad" not in r["name"]] == [
            "Optimizer.step#SGD.step", "Optimizer.step#Adam.step"]
        assert st["ts"] <= w["ts"] and w["ts"] + w["dur"] <= inner[0]["ts"]
    for a, b in zip(got, got[1:], strict=False):  # ... up to the next batch's wait
        assert a[0]["ts"] + a[0]["dur"] == b[0]["ts"]


LOADER_IN_A_PHASE = textwrap.dedent("""
    import contextlib, sys, time, torch, stepscope
    from torch.utils.data import DataLoader, TensorDataset
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)
    around = []
    span = sys.argv[2:] == ["span"]  # a range around the whole loop
    with stepscope.Profiler(dir=sys.argv[1], run_id="r", schedule=None, step_on="optimizer",
                            host_metrics=False, report=False, use_env=False, torch=True) as prof:
        with torch.autograd.profiler.record_function("epoch") if span else contextlib.nullcontext():
            it = iter(loader)
            time.sleep(0.05)  # (workers starting, say)
            while True:
                with stepscope.phase("Dataloader"):
                    try:
                        (x,) = next(it)
                    except StopIteration:
                        break
                t = time.perf_counter_ns()
                with stepscope.phase("Forward"):
                    around.append((t, time.perf_counter_ns()))
                    loss = model(x).sum()
                with stepscope.phase("Backward"):
                    loss.backward()
                opt.step()
                opt.zero_grad()
        print("STEPS", prof.timer.steps, "READER", prof.timer._r_max, "BATCH", prof.timer._b_max)
    print("AROUND", *(f"{a},{b}" for a, b in around))
""")


@pytest.mark.parametrize("pure", [False, True], ids=["C", "pure-Python"])
def test_a_batch_wait_inside_a_phase_opens_its_step_before_the_phase(tmp_path, pure):
    """With a DataLoader, an optimizer step's boundary was made at the next batch wait: inside
    the program's phase "Dataloader" around it, whose end then closed the step (4 steps nested
    in one). It is made before that phase begins instead (torch's zero_grad range, which comes
    first, stays in the step that ends): 4 batches are 4 steps of 4 ranges each, the wait in
    its phase; the last pass's phase, which found the loader exhausted, is in no step. The
    first wait starts at ``next()``, not at ``iter()`` 50 ms earlier: the phase was recorded
    in between, and an earlier begin shifted every later event of the thread by those 50 ms
    (the writer keeps a thread's times in order); the reader cost starts there too, as the
    slices do (it counted from ``iter()``: the timer's longest wait, over 50 ms, exceeded its
    step, which begins at the phase, and the tables' reader cost, read from the slices)."""
    out = _run_script(tmp_path, LOADER_IN_A_PHASE, pure)
    assert out.split("STEPS")[1].split()[0] == "4"
    reader_max = int(out.split("READER")[1].split()[0])
    around = [tuple(map(int, p.split(","))) for p in out.split("AROUND")[1].split()]
    d = tq.db(tmp_path / "r" / "rank0.summary.pftrace")
    fwd = tq.slices(d, "s.name = 'Forward'")
    assert len(fwd) == len(around) == 4
    for f, (before, inside) in zip(fwd, around, strict=True):
        # the clock the program read, to within the trace clock's conversion (a clock
        # snapshot's two readings are some 100 ns apart): no shift (it was 50 ms)
        assert before - 20_000 <= f["ts"] <= inside + 20_000
    steps = tq.slices(d, "s.category = 'step'")
    assert [t["name"] for t in steps] == [f"step {k}" for k in range(4)]
    (last,) = tq.outside_steps(d)  # the phase of the pass that found the loader exhausted,
    (end,) = tq.slices(d, "s.name = 'dataloader.exhausted'")  # holding that final wait
    assert last["name"] == "Dataloader" and end["parent_id"] == last["id"]
    for a, b in zip(steps, steps[1:], strict=False):
        assert a["ts"] + a["dur"] == b["ts"]
    for st in steps:
        kids = tq.step_children(d, st)
        assert [k["name"].split("#")[0] for k in kids] == [
            "Dataloader", "Forward", "Backward", "Optimizer.step", "Optimizer.zero_grad"]
        waits = tq.slices(d, f"s.parent_id = {kids[0]['id']} AND s.category = 'dataloader'")
        assert len(waits) == 1 and waits[0]["ts"] >= kids[0]["ts"]
    # the timer's reader cost is the slices' (the tables'), and within its step
    longest = max(tq.slices(d, "s.name = 'dataloader.next'"), key=lambda w: w["dur"])
    assert reader_max == longest["dur"] and reader_max < 50_000_000
    assert reader_max <= int(out.split("BATCH")[1].split()[0])


@pytest.mark.parametrize("pure", [False, True], ids=["C", "pure-Python"])
def test_a_range_around_a_loop_with_a_loader_leaves_the_loaders_phase_whole(tmp_path, pure):
    """With a DataLoader, the boundary after an optimizer step comes before the next range the
    program begins at the loop's level: its phase "Dataloader" around ``next()``. Inside
    "epoch", a range around the whole loop, that level is 1, not 0 (the fewest ranges open
    since the batch wait before); before, no begin was at 0, and every boundary came at the
    batch wait inside the phase, which then straddled two steps."""
    out = _run_script(tmp_path, LOADER_IN_A_PHASE, pure, "span")
    assert out.split("STEPS")[1].split()[0] == "4"
    d = tq.db(tmp_path / "r" / "rank0.summary.pftrace")
    steps = tq.slices(d, "s.category = 'step'")
    dl = tq.slices(d, "s.name = 'Dataloader'")
    zg = tq.slices(d, "s.name LIKE 'Optimizer.zero_grad#%'")
    assert [t["name"] for t in steps] == [f"step {k}" for k in range(4)]
    assert len(dl) == 5 and len(zg) == 4  # the fifth pass found the loader exhausted
    for k in (1, 2, 3):  # after the zero_grad before, before the phase
        assert zg[k - 1]["ts"] + zg[k - 1]["dur"] <= steps[k]["ts"] <= dl[k]["ts"]
        assert dl[k]["ts"] + dl[k]["dur"] <= steps[k]["ts"] + steps[k]["dur"]  # whole in it
        assert steps[k - 1]["ts"] + steps[k - 1]["dur"] == steps[k]["ts"]


@pytest.mark.parametrize("pure", [False, True], ids=["C", "pure-Python"])
def test_a_range_around_the_whole_loop_leaves_a_step_per_iteration(tmp_path, pure):
    """A record_function around the whole loop never closes between optimizer steps. The
    boundary waits only for the ranges begun since the last one: counted from the loop's level
    (the fewest ranges open since that boundary: "train" alone), the program's phase
    "Optimization" is the outermost, and the step ends as it ends, its next Forward phase whole
    in the next step. Before, every step ended at the next iteration's first module forward,
    inside its Forward phase (billed to the step before). The first boundary too: step 0
    opened as "train" began, so "train" is a range begun in the step, and whether it spans the
    loop is known only when the next module forward comes before its end; the boundary is then
    made back where the Optimization phase ended (before, at that forward)."""
    d = _run_phased_loop(tmp_path, "span", pure=pure)
    steps = _steps_end_with_their_optimization(d)
    (train,) = tq.slices(d, "s.name = 'train'")
    assert steps[0]["ts"] <= train["ts"] and _end(steps[-1]) <= _end(train)


@pytest.mark.parametrize("pure", [False, True], ids=["C", "pure-Python"])
def test_a_range_around_each_epoch_leaves_a_step_per_iteration(tmp_path, pure):
    """record_function("epoch") around each epoch of a loop without a DataLoader: the range
    of the second epoch begins after the last boundary of the first, in the step it belongs
    to, so it is a range begun in that step, like one around a single iteration, until the
    next module forward comes before its end. Before, the first boundary of each epoch fell
    at that forward, inside the next Forward phase (2 of the 3 boundaries here)."""
    d = _run_phased_loop(tmp_path, "epochs", pure=pure)
    steps = _steps_end_with_their_optimization(d)
    epochs = tq.slices(d, "s.name = 'epoch'")
    assert len(epochs) == 2
    for e, ep in enumerate(epochs):  # each epoch's range begins in its first step and ends
        # after its last one (the tail after the last boundary is in no step)
        first, last = steps[2 * e], steps[2 * e + 1]
        assert first["ts"] <= ep["ts"] < _end(first) and _end(last) <= _end(ep)


@pytest.mark.parametrize("pure", [False, True], ids=["C", "pure-Python"])
def test_a_range_around_each_iteration_ends_its_step_whatever_follows_the_optimizer(tmp_path,
                                                                                   pure):
    """record_function("iteration") around each iteration, and a range of the program after
    the optimizer step in it ("log"): the range begun in the step does not span the loop (it
    ends before the next module forward), so each step ends as it ends, holding it whole."""
    d = _run_phased_loop(tmp_path, "iteration", pure=pure)
    steps = tq.slices(d, "s.category = 'step'")
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(4)]
    for st in steps:
        (it,) = tq.step_children(d, st)
        assert it["name"] == "iteration"
        assert [k["name"] for k in tq.slices(d, f"s.parent_id = {it['id']}")] == [
            "Forward", "Backward", "Optimization", "log"]
        assert _end(it) <= _end(st) < _end(it) + 1_000_000
    for a, b in zip(steps, steps[1:], strict=False):
        assert _end(a) == b["ts"]
    assert tq.outside_steps(d) == []


def test_a_boundary_found_late_where_a_window_starts_is_made_where_it_is_found(tmp_path):
    """The first boundary under a range around the loop is known only at the next module
    forward. Where a detail window starts there, the profiler's window work must lie between
    the steps, after the clock reading that ends the step: so that boundary is made at the
    forward, as before (inside the Forward phase), not back where Optimization ended; the
    window's steps and every later boundary are as without a window."""
    d = _run_phased_loop(tmp_path, "span", False, "1,3")  # steps 1 and 2 in the window
    steps = tq.slices(d, "s.category = 'step'")
    fwd, opt = (tq.slices(d, f"s.name = '{n}'") for n in ("Forward", "Optimization"))
    start, end = (tq.slices(d, f"s.name = 'stepscope window {w}'")[0] for w in ("start",
                                                                                 "end"))
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(4)]
    assert fwd[1]["ts"] < _end(steps[0]) == start["ts"] < _end(fwd[1])  # at the forward
    assert _end(start) == steps[1]["ts"]  # the window's work between the steps
    assert _end(steps[2]) == end["ts"] and _end(end) == steps[3]["ts"]
    for k in (2, 3):
        assert _end(opt[k - 1]) <= _end(steps[k - 1]) <= fwd[k]["ts"]
    detail = tq.db(tmp_path / "r" / "rank0.detail.0.pftrace")
    assert [st["name"] for st in tq.slices(detail, "s.category = 'step'")] == ["step 1",
                                                                               "step 2"]


def _end(s: dict) -> int:
    return s["ts"] + s["dur"]


def _steps_end_with_their_optimization(d: Any) -> list[dict]:
    """The 4 steps of a phased loop whose every boundary falls between the end of an
    iteration's Optimization phase and the next one's Forward phase (within 1 ms of that end);
    the last step ends as its Optimization phase does (what follows is no step)."""
    steps = tq.slices(d, "s.category = 'step'")
    fwd, opt = (tq.slices(d, f"s.name = '{n}'") for n in ("Forward", "Optimization"))
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(4)]
    assert len(fwd) == len(opt) == 4
    assert steps[0]["ts"] <= fwd[0]["ts"]
    for k in (1, 2, 3):
        assert _end(opt[k - 1]) <= steps[k]["ts"] <= fwd[k]["ts"]
        assert steps[k]["ts"] - _end(opt[k - 1]) < 1_000_000
    for k in range(4):
        assert _end(opt[k]) <= _end(steps[k]) < _end(opt[k]) + 1_000_000
    return steps


def test_a_range_around_the_loop_leaves_the_programs_own_steps_whole(tmp_path):
    """record_function("epoch") around the loop, and the program's own step() inside it: the
    steps have a track of their own, so each is its iteration, from step() to step(), holding
    its Forward phase whole, and "epoch" is one slice around them. Before, step 0's end closed
    "epoch", and step 0 lasted the whole loop."""
    prof = stepscope.Profiler(dir=tmp_path, run_id="r", schedule=None, host_metrics=False,
                              report=False, use_env=False, torch=True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof.start()
    bounds = []
    with torch.autograd.profiler.record_function("epoch"):
        for _ in range(4):
            bounds.append(time.perf_counter_ns())
            with stepscope.phase("Forward"):
                loss = model(torch.randn(2, 4)).sum()
                time.sleep(0.002)
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    bounds.append(time.perf_counter_ns())
    prof.stop()
    d = tq.db(tmp_path / "r" / "rank0.summary.pftrace")
    steps = tq.slices(d, "s.category = 'step'")
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(4)]
    for k, st in enumerate(steps):
        # from the step() before the iteration (its first: start()) to the one after it, both
        # read between the clock readings around them
        assert st["ts"] <= bounds[k] and bounds[k + 1] - 1_000_000 <= st["ts"] + st["dur"]
        assert st["ts"] + st["dur"] <= bounds[k + 1]
        assert k == 0 or st["ts"] >= bounds[k] - 1_000_000
    (epoch,) = tq.slices(d, "s.name = 'epoch'")
    assert epoch["depth"] == 0 and epoch["ts"] < steps[1]["ts"]
    assert epoch["ts"] + epoch["dur"] > steps[3]["ts"] + steps[3]["dur"] - 1_000_000
    fwd = tq.slices(d, "s.name = 'Forward'")
    assert [f["depth"] for f in fwd] == [1] * 4  # in "epoch"
    for st, f in zip(steps, fwd, strict=True):
        assert st["ts"] <= f["ts"] and f["ts"] + f["dur"] <= st["ts"] + st["dur"]


def test_loader_waits_stay_in_their_steps_across_flushes(tmp_path):
    """A flush inside every batch wait (the dataset flushes): the waits and steps are written
    with their own times once the batch came; torch's enumerate(DataLoader) range inside the
    wait is left out (the wait's slice covers it)."""
    prof = stepscope.Profiler(dir=tmp_path, run_id="r", schedule=None, step_on="optimizer",
                              host_metrics=False, report=False, use_env=False, torch=True)

    class Flushing(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> tuple:
            _flush()
            return torch.randn(4), torch.randn(1)

    prof.start()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in torch.utils.data.DataLoader(Flushing(), batch_size=2):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    prof.stop()
    d = tq.db(tmp_path / "r" / "rank0.summary.pftrace")
    got = _in_steps(d, "dataloader")
    assert len(got) == 4  # 8 samples / 2: no step for the exhausted loader's final wait
    assert [len(inner) for _, inner in got] == [1, 1, 1, 1]
    assert got[0][0]["ts"] == got[0][1][0]["ts"]  # step 0 opens at the first batch wait
    assert len(tq.slices(d, "s.name = 'dataloader.next'")) == 4
    (end,) = tq.slices(d, "s.name = 'dataloader.exhausted'")  # the final wait: after them
    assert end["ts"] >= got[-1][0]["ts"] + got[-1][0]["dur"]
    assert tq.slices(d, "s.name LIKE 'enumerate(DataLoader)%'") == []
    assert prof.timer.steps == 4


def test_a_windows_operators_leave_the_loaders_own_range_to_the_wait(tmp_path):
    """torch's enumerate(DataLoader)#...__next__ range begins inside each batch wait, which the
    wait's own slice covers: not an operator either (it topped the windows' operators table, at
    half the window's time, in a 2-worker CNN run), while the model's operators stay."""
    prof = stepscope.Profiler(dir=tmp_path, run_id="w", schedule=(0, 100), step_on="optimizer",
                              host_metrics=False, report=False, use_env=False, torch=True)
    prof.start()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    for x, y in torch.utils.data.DataLoader(data, batch_size=2):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    prof.stop()
    d = tq.db(tmp_path / "w" / "rank0.detail.0.pftrace")
    assert len(tq.slices(d, "s.name = 'dataloader.next'")) == 4
    assert len(tq.slices(d, "s.name = 'aten::linear'")) == 4  # 4 batches, one Linear
    assert tq.slices(d, "s.name LIKE 'enumerate(DataLoader)%'") == []


def test_options_accept_torch_and_step_on():
    assert options.parse('{"torch": false, "step_on": "optimizer"}') == {
        "torch": False, "step_on": "optimizer"}
    with pytest.raises(ValueError, match="'step_on' must be one of"):
        options.parse('{"step_on": "epoch"}')
    with pytest.raises(ValueError, match="step_on must be None or one of"):
        stepscope.Profiler(step_on="sometimes", use_env=False)


def test_torch_false_and_none(tmp_path):
    p = stepscope.Profiler(dir=tmp_path, schedule=None, host_metrics=False, report=False,
                           use_env=False, torch=False)
    p.start()
    p.stop()
    assert p.hooks == []
    q = stepscope.Profiler(dir=tmp_path, schedule=None, host_metrics=False, report=False,
                           use_env=False)  # torch=None and torch is imported: on
    q.start()
    assert [type(h).__name__ for h in q.hooks] == ["TorchIntegration"]
    from torch.utils.data import dataloader as dl

    assert hasattr(dl._BaseDataLoaderIter.__next__, "__wrapped__")
    q.stop()
    assert not hasattr(dl._BaseDataLoaderIter.__next__, "__wrapped__")  # restored


def _fake_cuda_memory(monkeypatch) -> list[int]:
    """Two fake devices whose allocator statistics change from call to call (the call count is
    added to each value); returns the devices asked, in order. No real CUDA, and no GPU
    tracing: on a GPU machine NVML would add counters of its own."""
    base = {"allocated": [100, 200], "reserved": [1000, 2000], "peak": [150, 250]}
    asked: list[int] = []

    def stats(d):
        asked.append(d)
        n = len(asked)
        return {"allocated_bytes": {"all": {"current": base["allocated"][d] + n,
                                            "peak": base["peak"][d] + n, "freed": 7}},
                "reserved_bytes": {"all": {"current": base["reserved"][d] + n}},
                "num_alloc_retries": 0}

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "_initialized", True)  # what CUDA's lazy init sets (the
    # integration reads it first, and is_initialized() only then: a frame less per step)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", stats)
    return asked


def _memory_counters(path) -> dict[str, list[float]]:
    got: dict[str, list[float]] = {}
    for r in tq.rows(tq.db(path), "SELECT t.name, c.value FROM counter c JOIN counter_track t "
                                  "ON t.id = c.track_id ORDER BY c.ts, t.name"):
        got.setdefault(r["name"], []).append(r["value"])
    return got


def test_cuda_memory_counters_at_step_end(tmp_path, monkeypatch):
    """Two fake devices: allocated / reserved / peak per device, at every step end (no least
    interval), from one statistics call per device and sample."""
    from stepscope.pytorch import memory

    asked = _fake_cuda_memory(monkeypatch)
    monkeypatch.setattr(memory, "INTERVAL_NS", 0)
    prof = stepscope.Profiler(dir=tmp_path, run_id="m", schedule=None, host_metrics=False,
                              report=False, use_env=False, torch=True, gpu=False)
    prof.start()
    prof.step()
    prof.step()
    prof.stop()
    monkeypatch.undo()
    assert asked == [0, 1, 0, 1]
    # per step end: device 0's values (call 1, then 3) and device 1's (call 2, then 4)
    assert _memory_counters(tmp_path / "m" / "rank0.summary.pftrace") == {
        "torch.cuda0.memory.allocated": [101, 103], "torch.cuda0.memory.reserved": [1001, 1003],
        "torch.cuda0.memory.peak": [151, 153], "torch.cuda1.memory.allocated": [202, 204],
        "torch.cuda1.memory.reserved": [2002, 2004], "torch.cuda1.memory.peak": [252, 254]}


def test_cuda_memory_is_sampled_at_most_once_per_interval(tmp_path, monkeypatch):
    """The first step end samples; the next ones within the least interval do not (their cost
    stays off short steps); the first one after it does (the interval shortened to 0 stands for
    the time passing)."""
    from stepscope.pytorch import memory

    asked = _fake_cuda_memory(monkeypatch)
    monkeypatch.setattr(memory, "INTERVAL_NS", 3600 * 10**9)
    prof = stepscope.Profiler(dir=tmp_path, run_id="m", schedule=None, host_metrics=False,
                              report=False, use_env=False, torch=True, gpu=False)
    prof.start()
    for _ in range(3):
        prof.step()
    assert asked == [0, 1]
    memory.INTERVAL_NS = 0
    prof.step()
    prof.stop()
    monkeypatch.undo()
    assert asked == [0, 1, 0, 1]
    got = _memory_counters(tmp_path / "m" / "rank0.summary.pftrace")
    assert got["torch.cuda0.memory.allocated"] == [101, 103]
    assert got["torch.cuda1.memory.peak"] == [252, 254]


class _FakeGpu:
    """Stands in for stepscope.gpu.GpuTracing: records whether CUPTI would be enabled."""

    def __init__(self):
        self.activity = True
        self.windows = []
        self.open = False

    def begin_window(self):
        self.windows.append(("begin", self.activity, torch.autograd._profiler_enabled()))
        self.open = self.activity
        return self.activity

    def reclaim_cupti(self):  # as GpuTracing's: only while its window's tracing runs
        if self.open:
            self.windows.append(("reclaim", torch.autograd._profiler_enabled()))

    def end_window(self, steps=0):
        self.windows.append(("end",))
        self.open = False

    def stop(self):
        pass


def test_one_cupti_client(tmp_path):
    """Our Kineto is CPU-only beside our CUPTI tracer; under the user's own torch.profiler our
    CUPTI tracer stands down for the window (and our operators too)."""
    from torch._C._profiler import ProfilerActivity

    from stepscope.pytorch.operators import OperatorCapture

    assert OperatorCapture.activities() == {ProfilerActivity.CPU}
    prof = stepscope.Profiler(dir=tmp_path, run_id="c", schedule=(1, 2), host_metrics=False,
                              report=False, use_env=False, torch=True, gpu=False)
    fake = prof._gpu = _FakeGpu()
    prof.start()
    prof.step()  # window 0 opens: our Kineto (CPU only) is on when CUPTI would start
    torch.ones(3).add_(1)
    prof.step()  # window 0 closes
    prof.epoch()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        prof.step()  # window 1 opens under the user's profiler
        torch.ones(3).add_(1)
        prof.step()
    prof.stop()
    assert fake.windows == [("begin", True, True), ("end",), ("begin", False, True), ("end",)]
    assert fake.activity is True  # restored after the window
    d0 = tq.db(tmp_path / "c" / "rank0.detail.0.pftrace")
    assert len(tq.slices(d0, "s.name = 'aten::add_'")) == 1
    d1 = tq.db(tmp_path / "c" / "rank0.detail.1.pftrace")
    assert tq.slices(d1, "s.category = 'torch_op'") == []


def test_a_window_open_at_start_starts_kineto_before_cupti(tmp_path):
    """A schedule from batch 0 opens the first window inside start(), after the integration is
    attached: our Kineto session is on before CUPTI starts, as in any window, so none of the
    window's CUPTI buffers can go to Kineto's callbacks."""
    prof = stepscope.Profiler(dir=tmp_path, run_id="s", schedule=(0, 1), host_metrics=False,
                              report=False, use_env=False, torch=True, gpu=False)
    fake = prof._gpu = _FakeGpu()
    prof.start()
    torch.ones(3).add_(1)
    prof.step()
    prof.stop()
    assert fake.windows == [("begin", True, True), ("end",)]
    d = tq.db(tmp_path / "s" / "rank0.detail.0.pftrace")
    assert len(tq.slices(d, "s.name = 'aten::add_'")) == 1


def test_torch_imported_inside_a_window_takes_cuptis_callbacks_back_from_kineto(tmp_path):
    """The integration attached inside an open window (``stepscope run``: the program imports
    torch there): CUPTI is on before our Kineto session starts, and Kineto registers its own
    CUPTI buffer callbacks even CPU-only, so the integration has the GPU tracer take them back
    (seen on an H100: that window had no GPU activity at all). attach_on_import's own steps,
    torch being imported in this process already."""
    from stepscope.pytorch import TorchIntegration

    prof = stepscope.Profiler(dir=tmp_path, run_id="s", schedule=(0, 1), host_metrics=False,
                              report=False, use_env=False, torch=False, gpu=False)
    fake = prof._gpu = _FakeGpu()
    prof.start()
    hook = TorchIntegration(prof)
    prof.hooks.append(hook)
    hook.start()
    hook.window_start()
    torch.ones(3).add_(1)
    prof.step()
    prof.stop()
    assert fake.windows == [("begin", True, False), ("reclaim", True), ("end",)]
    d = tq.db(tmp_path / "s" / "rank0.detail.0.pftrace")
    assert len(tq.slices(d, "s.name = 'aten::add_'")) == 1


def test_torch_profiler_started_inside_a_window_takes_over(tmp_path, capsys):
    prof = stepscope.Profiler(dir=tmp_path, run_id="t", schedule=(1, 3), host_metrics=False,
                              report=False, use_env=False, torch=True)
    prof.start()
    prof.step()  # batch 1: our window opens, Kineto on
    assert torch.autograd._profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        torch.ones(3).add_(1)
        prof.step()
        prof.step()  # our window closes while the program's profiler runs
        assert torch.autograd._profiler_enabled()  # not stopped by us
        torch.ones(3).mul_(2)
    prof.stop()
    assert {"aten::add_", "aten::mul_"} <= {e.name for e in p.events()}
    assert "torch.profiler took over this window's operators" in capsys.readouterr().err
    d = tq.db(tmp_path / "t" / "rank0.detail.0.pftrace")
    assert tq.slices(d, "s.category = 'torch_op'") == []


def test_the_first_wait_of_each_pass_starts_at_iter(tmp_path):
    """iter(loader) (which starts the worker processes and hands them the first indices) is
    the first batch's reader cost: a sampler whose iter() takes 0.3 s, run there, makes each
    pass's first wait at least 0.3 s long (it was left out: the waits began at next())."""
    import time

    class SlowStart(torch.utils.data.Sampler):
        def __init__(self) -> None:
            self.made = []

        def __iter__(self):
            self.made.append(time.perf_counter_ns())
            time.sleep(0.3)
            return iter(range(4))

        def __len__(self) -> int:
            return 4

    prof = stepscope.Profiler(dir=tmp_path, run_id="r", schedule=None, step_on="optimizer",
                              host_metrics=False, report=False, use_env=False, torch=True)
    sampler = SlowStart()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)),
                                         batch_size=2, sampler=sampler, num_workers=1)
    prof.start()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    firsts = []
    for _ in range(2):
        t0 = time.perf_counter_ns()
        for i, (x,) in enumerate(loader):
            if i == 0:
                firsts.append((t0, time.perf_counter_ns()))
            model(x).sum().backward()
            opt.step()
    prof.stop()
    waits = tq.slices(tq.db(tmp_path / "r" / "rank0.summary.pftrace"),
                      "s.name = 'dataloader.next'")
    assert len(waits) == 4 and prof.timer.steps == 4
    for k, (t0, t1) in enumerate(firsts):  # the pass's first wait: from iter() to the batch
        w = waits[2 * k]
        assert t0 <= w["ts"] <= sampler.made[k] and w["ts"] + w["dur"] <= t1
        assert w["dur"] >= 300_000_000
        # the second batch's wait begins after the first batch came, so holds no iter(), and
        # is the shorter (the worker had its indices since iter(); an absolute bound of 0.3 s
        # failed on a loaded machine, where the worker itself can take that long)
        second = waits[2 * k + 1]
        assert second["ts"] >= w["ts"] + w["dur"] and second["dur"] < w["dur"]
    # the timer's reader cost: the same readings as the slices
    assert prof.timer.stats().reader_cost.max == max(w["dur"] for w in waits) / 1e9


WINDOW = textwrap.dedent("""
    import os, sys, torch, stepscope
    prof = stepscope.Profiler(dir=sys.argv[1], run_id="k", schedule=(0, 1), report=False,
                              use_env=False, host_metrics=False, torch=True)
    prof.start()
    torch.ones(4).sum()
    prof.step()
    prof.stop()
    print("LEVEL", os.environ.get("KINETO_LOG_LEVEL"))
""")


def test_kineto_says_nothing_of_its_own_for_our_window(tmp_path):
    """pip's torch on Linux is a CUDA build: on a machine without the NVIDIA driver Kineto logs
    an ERROR line (gpuGetDeviceCount) when our first window starts it, and torch 2.13's and
    2.14's a USDT line at each profiler start and stop, CPU builds too (the suites of a fresh
    README install failed on them: 2.14's CUDA build, then 2.13's CPU build). Quiet there,
    unless the program set Kineto's log level itself (then left as it is); the variable is not
    left set."""
    from stepscope.pytorch import operators

    if torch.version.cuda and os.path.exists(operators.NVIDIA_DRIVER):
        pytest.skip("a machine with the NVIDIA driver: Kineto's lines are left as they are")
    script = tmp_path / "w.py"
    script.write_text(WINDOW)
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    for level, noisy in ((None, False), ("0", True)):
        if level is not None:
            env["KINETO_LOG_LEVEL"] = level
        out = subprocess.run([sys.executable, str(script), str(tmp_path / str(level))], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert ("gpuGetDeviceCount" in out.stderr) == (noisy and bool(torch.version.cuda)), \
            out.stderr
        if not noisy:  # (nor torch 2.13's and 2.14's USDT profiler_start/profiler_stop pair)
            assert out.stderr == "", out.stderr
        assert out.stdout.split("LEVEL")[1].strip() == str(level)
        d = tq.db(tmp_path / str(level) / "k" / "rank0.detail.0.pftrace")
        assert tq.slices(d, "s.name = 'aten::sum'")  # the window has its operators


@pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"), reason="torch.amp.GradScaler: 2.3+")
def test_an_optimizer_step_the_grad_scaler_skips_still_ends_its_step(tmp_path):
    """Mixed precision: GradScaler.step skips the optimizer step where gradients overflowed
    (no optimizer hook fires). Overflows in iteration 1 and in epoch 0's last iteration: 2
    epochs of 4 steps, each step one iteration. Before: 6 steps, one holding iterations 1
    and 2, and one holding epoch 0's last iteration, the exhausted wait and epoch 1's
    first."""
    model, opt = _model_and_opt()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    loader = torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4)

    def loop(marks):
        for epoch in range(2):
            for i, x in enumerate(loader):
                scaler.scale(model(x).sum()).backward()
                if (epoch, i) in ((0, 1), (0, 3)):
                    model.weight.grad[0, 0] = float("inf")
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                marks.append(time.perf_counter_ns())  # the iteration's end

    d, steps, epochs, marks = _zero_code(tmp_path, loop)
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(8)]
    assert epochs == [0] * 4 + [1] * 4
    _one_iteration_each(steps, marks)


def _one_iteration_each(steps, marks) -> None:
    """Step k ends after iteration k's end mark, and step k + 1 begins there, before
    iteration k + 1 ends."""
    assert len(steps) == len(marks)
    for k in range(len(steps) - 1):
        end = steps[k]["ts"] + steps[k]["dur"]
        assert marks[k] <= end <= steps[k + 1]["ts"] < marks[k + 1], (k, steps, marks)


def test_an_iterator_made_during_set_up_leaves_the_set_up_out_of_step_0(tmp_path):
    """``it = iter(loader)`` during set-up, 50 ms more set-up, then ``next(it)`` in a loop of
    4 iterations (torchtitan's and step-based loops' way): step 0 starts at the first next(),
    and so does its wait, its reader cost. Before, the first wait was dated back to iter(), as
    in a for loop: step 0 held the set-up, all of it reader cost (2.4 s of 2.4 s in the
    audit's nanoGPT-like script)."""
    model, opt = _model_and_opt()
    loader = torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4)
    set_up = []

    def loop(marks):
        it = iter(loader)
        time.sleep(0.05)
        set_up.append(time.perf_counter_ns())
        for _ in range(4):
            model(next(it)).sum().backward()
            opt.step()
            opt.zero_grad()
            marks.append(time.perf_counter_ns())

    d, steps, epochs, marks = _zero_code(tmp_path, loop)
    waits = tq.slices(d, "s.name = 'dataloader.next'")
    assert len(steps) == len(waits) == 4
    assert set_up[0] <= waits[0]["ts"] and set_up[0] <= steps[0]["ts"] <= waits[0]["ts"]
    assert waits[0]["dur"] < 10_000_000  # (a tensor batch: the 50 ms are not in it)
    _one_iteration_each(steps, marks)


@pytest.mark.parametrize("replay", ["itertools.cycle", "a list of the batches"])
def test_batches_replayed_without_a_wait_make_a_step_each(tmp_path, replay):
    """10 iterations over a 4-batch loader's batches replayed (itertools.cycle replays its
    first pass; a list is made of one pass): 10 steps, one per iteration. Before: after the
    loader's first pass no batch wait came to make the boundary: 10 iterations made 5
    steps with cycle, 1 with the list."""
    model, opt = _model_and_opt()
    loader = torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4)

    def loop(marks):
        batches = itertools.cycle(loader) if replay == "itertools.cycle" else list(loader)
        for i in range(10):
            x = next(batches) if replay == "itertools.cycle" else batches[i % 4]
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():  # (a forward without grad: the iteration's own)
                model(x)
            marks.append(time.perf_counter_ns())

    d, steps, epochs, marks = _zero_code(tmp_path, loop)
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(10)]
    _one_iteration_each(steps, marks)


def test_zip_of_loaders_of_different_lengths_makes_no_phantom_step(tmp_path):
    """Two epochs over zip(a, b), b of 3 batches, a of 4: zip takes a's 4th batch, then b
    runs out. 6 steps, 3 per epoch, each one iteration. Before: 7, the last a phantom (a's
    extra batch and b's end, no forward), and epoch 1's first step held epoch 0's extra
    batch."""
    model, opt = _model_and_opt()
    a = torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4)
    b = torch.utils.data.DataLoader(torch.randn(12, 8), batch_size=4)

    def loop(marks):
        for _ in range(2):
            for xa, xb in zip(a, b, strict=False):
                model(torch.cat([xa, xb])).sum().backward()
                opt.step()
                opt.zero_grad()
                marks.append(time.perf_counter_ns())

    d, steps, epochs, marks = _zero_code(tmp_path, loop)
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(6)]
    assert epochs == [0, 0, 0, 1, 1, 1]
    _one_iteration_each(steps, marks)


def test_a_loop_left_by_a_break_ends_its_last_step_before_the_workers_shut_down(tmp_path):
    """max_steps: 3 iterations of a 2-worker loader's 6 batches, a break, then a validation
    pass under no_grad: 3 steps, the last ending before the abandoned iterator shuts its
    workers down (as the loop is left). Before: it ran on to the validation's first wait,
    holding the shutdown and the validation loader's iter()."""
    model, opt = _model_and_opt()
    loader = torch.utils.data.DataLoader(torch.randn(24, 8), batch_size=4, num_workers=2)
    val = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4)
    left = []

    def loop(marks):
        for i, x in enumerate(loader):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            marks.append(time.perf_counter_ns())
            if i == 2:
                break
        left.append(time.perf_counter_ns())  # the iterator (and its workers) went
        with torch.no_grad():
            for x in val:
                model(x)

    d, steps, epochs, marks = _zero_code(tmp_path, loop)
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(3)]
    _one_iteration_each(steps, marks)
    assert marks[2] <= steps[2]["ts"] + steps[2]["dur"] < left[0]


def test_a_peek_at_one_batch_before_the_loop_is_no_step(tmp_path):
    """``x = next(iter(loader))`` to size the model, 30 ms of set-up, then 2 epochs of 3
    batches: 6 steps, step 0 from the loop's first wait on; the peek's wait lies before the
    steps. Before: step 0 opened at the peek and held the set-up and the first iteration."""
    loader = torch.utils.data.DataLoader(torch.randn(12, 8), batch_size=4)
    set_up = []

    def loop(marks):
        width = next(iter(loader)).shape[1]
        model = torch.nn.Linear(width, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        time.sleep(0.03)
        set_up.append(time.perf_counter_ns())
        for _ in range(2):
            for x in loader:
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
                marks.append(time.perf_counter_ns())

    d, steps, epochs, marks = _zero_code(tmp_path, loop)
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(6)]
    assert epochs == [0, 0, 0, 1, 1, 1]
    _one_iteration_each(steps, marks)
    waits = tq.slices(d, "s.name = 'dataloader.next'")
    assert len(waits) == 7  # the peek's and the loop's 6
    assert waits[0]["ts"] + waits[0]["dur"] < set_up[0] < steps[0]["ts"] == waits[1]["ts"]


def test_passes_left_by_a_break_are_epochs_and_the_next_step_waits_for_its_batch(tmp_path):
    """3 of a 2-worker loader's 6 batches per epoch, then a break (steps per epoch capped), 2
    epochs, 20 ms of the program's own between them: 6 steps, epochs 0, 0, 0, 1, 1, 1; the
    second epoch's first step starts at its first batch wait, after the workers' shutdown and
    the 20 ms. Before: every step was epoch 0 (only an exhausted pass ended an epoch), and the
    step opened as the loop was left held the shutdown and the 20 ms."""
    model, opt = _model_and_opt()
    loader = torch.utils.data.DataLoader(torch.randn(24, 8), batch_size=4, num_workers=2)
    between = []

    def loop(marks):
        for epoch in range(2):
            for i, x in enumerate(loader):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
                marks.append(time.perf_counter_ns())
                if i == 2:
                    break
            if not epoch:
                time.sleep(0.02)
                between.append(time.perf_counter_ns())

    d, steps, epochs, marks = _zero_code(tmp_path, loop)
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(6)]
    assert epochs == [0, 0, 0, 1, 1, 1]
    _one_iteration_each(steps, marks)
    waits = tq.slices(d, "s.name = 'dataloader.next'")
    assert len(waits) == 6
    assert between[0] < steps[3]["ts"] == waits[3]["ts"]


def test_a_range_after_the_optimizer_step_stays_in_its_iterations_step(tmp_path):
    """record_function("save") after every second optimizer step (a checkpoint), 2 epochs of
    4 batches: each save lies in its own iteration's step, the epoch's last too. Before, a
    range begun after the optimizer step ended the step before it: each save was the next
    step's, and an epoch's last one in no step."""
    model, opt = _model_and_opt()
    loader = torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4)

    def loop(marks):
        for _ in range(2):
            for i, x in enumerate(loader):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
                if i % 2 == 1:
                    with torch.autograd.profiler.record_function("save"):
                        time.sleep(0.002)
                marks.append(time.perf_counter_ns())

    d, steps, epochs, marks = _zero_code(tmp_path, loop)
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(8)]
    _one_iteration_each(steps, marks)
    saves = tq.slices(d, "s.name = 'save'")
    assert [next(k for k, st in enumerate(steps)
                 if st["ts"] <= s["ts"] and s["ts"] + s["dur"] <= st["ts"] + st["dur"])
            for s in saves] == [1, 3, 5, 7]


def test_a_step_a_flush_kept_from_being_dropped_leaves_the_automatic_steps_on(tmp_path):
    """step_on="auto" (as under stepscope run): a validation pass with gradients on is a step
    at first, dropped at its end; where a flush wrote its begin meanwhile (the writer, on a
    loaded machine) it is ended instead, a step of its own. That end called the instance's
    step(), under "auto" the program's, taken as its first step() call: the automatic steps
    stopped there (the run's 8 later optimizer steps made 1 step, seen in a loaded suite)."""
    prof = stepscope.Profiler(dir=tmp_path, run_id="r", schedule=None, step_on="auto",
                              host_metrics=False, report=False, use_env=False, torch=True)
    model, opt = _model_and_opt()
    train = torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4)
    val = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4)
    with prof:
        for epoch in range(3):
            for x in train:
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
            for i, x in enumerate(val):
                with torch.no_grad():
                    model(x)
                if epoch == 0 and i == 0:
                    stepscope.current().flush()  # (as the writer may meanwhile)
    d = tq.db(tmp_path / "r" / "rank0.summary.pftrace")
    steps = tq.slices(d, "s.category = 'step'")
    # epoch 0's 4, its validation (kept: its begin was written), epochs 1 and 2's 4 each
    assert [st["name"] for st in steps] == [f"step {k}" for k in range(13)]
    assert prof.timer.steps == 13


def test_a_compiled_module_gets_no_warning_of_our_forward_watch(tmp_path):
    """torch.compile(module)'s wrapper warns of global module hooks at each call made while one
    is registered: our forward watch (step 0's start, each new epoch) made that UserWarning
    at the first forward of each epoch. Now none, with a step per iteration; a global hook of
    the program's own still gets torch's warning; after stop() the wrapper is torch's own."""
    from torch._dynamo.eval_frame import OptimizedModule

    before = OptimizedModule.__call__
    model, opt = _model_and_opt()
    compiled = torch.compile(model, backend="eager")
    loader = torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4)

    def loop(marks):
        for _epoch in range(2):
            for x in loader:
                compiled(x).sum().backward()
                opt.step()
                opt.zero_grad()
                marks.append(time.perf_counter_ns())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d, steps, epochs, marks = _zero_code(tmp_path / "ours", loop)
    assert [str(w.message)[:40] for w in caught] == []
    assert epochs == [0] * 4 + [1] * 4
    _one_iteration_each(steps, marks)
    assert OptimizedModule.__call__ is before
    calls = []
    own = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, a: calls.append(type(m).__name__))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, steps, _, marks = _zero_code(tmp_path / "theirs", loop)
    finally:
        own.remove()
    assert len(caught) == 8 and all("global hooks" in str(w.message) for w in caught)
    assert calls.count("OptimizedModule") == 8  # (the program's hook: as torch calls it)
    _one_iteration_each(steps, marks)


COMPILED_LATE = textwrap.dedent("""
    import sys, warnings, torch, stepscope
    warnings.simplefilter("always")
    prof = stepscope.Profiler(dir=sys.argv[1], run_id="c", schedule=None, report=False,
                              use_env=False, host_metrics=False, torch=True, step_on="optimizer")
    prof.start()
    assert "torch._dynamo.eval_frame" not in sys.modules  # (torch.compile imports it)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model, backend="eager")
    loader = torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4)
    for epoch in range(2):
        for x in loader:
            compiled(x).sum().backward()
            opt.step()
            opt.zero_grad()
    prof.stop()
    watchers = [f for f in sys.meta_path if type(f).__module__.startswith("stepscope")]
    print("STEPS", prof.timer.steps, type(compiled).__call__.__module__, len(watchers))
""")


def test_a_module_compiled_after_start_gets_no_warning_either(tmp_path):
    """torch.compile first imported after the profiler started (its wrapper's module is
    watched for): no warning on stderr, 8 steps, torch's own wrapper back after stop() and no
    import watcher left."""
    out = _run_script(tmp_path, COMPILED_LATE, False)
    assert out.split("STEPS")[1].split() == ["8", "torch._dynamo.eval_frame", "0"]
