"""``record_function`` ranges through the capture's wrappers (with the C buffer:
``_fast.ContextHook``, torch's method then the range in C; else the Python wrappers): what the
file holds when the body raises, from another thread, in the decorator form, and that torch's
own methods are back after ``stop()``. Both paths run these (``STEPSCOPE_PURE_PYTHON=1``)."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install stepscope[torch])")

import tq  # noqa: E402

import stepscope  # noqa: E402
from stepscope.record import recorder as rec  # noqa: E402


def test_ranges_that_raise_thread_ranges_and_decorated_functions(tmp_path):
    rf = torch.autograd.profiler.record_function
    enter, exit_ = rf.__dict__["__enter__"], rf.__dict__["__exit__"]
    prof = stepscope.Profiler(tmp_path, schedule=None, run_id="r", host_metrics=False,
                              report=False, use_env=False, torch=True)
    prof.start()
    if rec.fast is not None:
        assert type(rf.__dict__["__enter__"]) is rec.fast.ContextHook
        assert rf.__dict__["__exit__"].__wrapped__ is exit_

    @rf("decorated")
    def work(x: int) -> int:
        return x + 1

    for i in range(3):
        with prof.phase("Forward"):
            with pytest.raises(KeyError, match="boom"):
                with rf("outer"):
                    with rf("inner"):
                        raise KeyError("boom")
            assert work(i) == i + 1
        th = threading.Thread(target=lambda: rf("thread").__enter__().__exit__(None, None, None))
        th.start()
        th.join()
        prof.step()
    prof.stop()
    assert rf.__dict__["__enter__"] is enter and rf.__dict__["__exit__"] is exit_

    d = tq.db(tmp_path / "r" / "rank0.summary.pftrace")
    got = tq.slices(d, "s.category = 'record_function'")
    by_name: dict[str, list] = {}
    for s in got:
        by_name.setdefault(s["name"], []).append(s)
    assert {n: len(v) for n, v in by_name.items()} == {
        "outer": 3, "inner": 3, "decorated": 3, "thread": 3}
    # the raising ranges ended (a duration) and nest: Forward > outer > inner (in a step, which
    # has a track of its own)
    for s in by_name["inner"]:
        assert s["dur"] >= 0 and s["depth"] == 2
        parent = tq.rows(d, f"SELECT name FROM slice WHERE id = {s['parent_id']}")[0]["name"]
        assert parent == "outer"
    assert all(s["depth"] == 1 for s in by_name["decorated"])  # in Forward
    assert tq.outside_steps(d) == []
    main_track = by_name["outer"][0]["track_id"]
    assert all(s["track_id"] != main_track and s["depth"] == 0 for s in by_name["thread"])


def test_step_end_waits_for_cuda_or_a_process_group(tmp_path, monkeypatch):
    """The integration's step_end (CUDA memory counters, new process groups) is called only
    once the program uses CUDA or has a process group (its ``step_end_gates``): a CPU run
    without torch.distributed pays no Python frame for it at each step."""
    prof = stepscope.Profiler(tmp_path, schedule=None, run_id="g", host_metrics=False,
                              report=False, use_env=False, torch=True)
    prof.start()
    hook = prof.hooks[0]
    calls: list[int] = []
    monkeypatch.setattr(hook, "step_end", lambda: calls.append(prof.step_num))
    for _ in range(3):
        prof.step()
    assert calls == []
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "_initialized", True)
        prof.step()
    assert calls == [3]
    world = hook._world  # noqa: SLF001
    if world is not None:
        with monkeypatch.context() as m:
            m.setattr(world, "_default_pg", object())
            prof.step()
        assert calls == [3, 4]
    prof.stop()


def test_an_object_entered_again_before_its_exit_ends_each_range_and_dropped_ones_stay_bounded(
        tmp_path, monkeypatch):
    """One ``record_function`` object entered again before its exit (``with r: with r:``):
    each of its ranges ends at its own exit (a mark on the object ended only the inner). Objects
    entered and never exited (a program that calls ``__enter__`` only) are kept at most
    ``MAX_OPEN`` at a time: past it no new range begins, and ranges are recorded again once
    those are gone."""
    from stepscope.pytorch import ranges

    monkeypatch.setattr(ranges, "MAX_OPEN", 3)
    rf = torch.autograd.profiler.record_function
    prof = stepscope.Profiler(tmp_path, schedule=None, run_id="rec", host_metrics=False,
                              report=False, use_env=False, torch=True)
    prof.start()
    same = rf("same")
    with prof.phase("Forward"):
        with same:
            with same:
                pass
        with rf("next"):  # after both ends: beside the outer one, not inside it
            pass
    capture = prof.hooks[0].ranges
    assert capture.opened == []
    dropped = [rf(f"dropped{i}") for i in range(4)]
    for r in dropped:
        r.__enter__()  # never exited: the fourth finds the capture full and is not recorded
    assert capture.opened == dropped[:3]
    with rf("while full"):
        pass
    capture.opened.clear()  # (as stop() does; the program's objects are gone)
    with rf("after"):
        pass
    prof.step()
    prof.stop()

    d = tq.db(tmp_path / "rec" / "rank0.summary.pftrace")
    got = tq.slices(d, "s.category = 'record_function'")
    nxt = next(s for s in got if s["name"] == "next")
    outer, inner = sorted((s for s in got if s["name"] == "same"), key=lambda s: s["depth"])
    assert (outer["depth"], inner["depth"], nxt["depth"]) == (1, 2, 1)  # in Forward
    assert inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] <= nxt["ts"]
    names = sorted(s["name"] for s in got if s["name"] not in ("same", "next"))
    assert names == ["after", "dropped0", "dropped1", "dropped2"]
