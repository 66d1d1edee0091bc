"""Profiler edge cases: several profilers per process, empty windows, endless phase names."""

from __future__ import annotations

from tracedecode import decode

import stepscope
from stepscope.profiler import profiler as profiler_mod


def _run(tmp_path, steps, sched, phase_names=("Forward",)):
    prof = stepscope.Profiler(dir=tmp_path, schedule=sched, host_metrics=False, report=False,
                              gpu=False)
    with prof:
        for i in range(steps):
            for name in phase_names:
                with prof.phase(name.format(i=i)):
                    pass
            prof.step()
    return prof


def test_a_second_profiler_in_the_process_writes_its_own_files(tmp_path):
    first = _run(tmp_path, 2, None)
    second = _run(tmp_path, 3, None)
    assert first.run_dir != second.run_dir
    steps = [len(decode(p).by_category("step")) for p in (first.files[-1], second.files[-1])]
    assert steps == [2, 3]


def test_a_window_closed_before_any_event_leaves_no_file(tmp_path):
    prof = stepscope.Profiler(dir=tmp_path, schedule=stepscope.schedule(active=2),
                              host_metrics=False, report=False, gpu=False)
    with prof:
        for _ in range(2):
            with prof.phase("Forward"):
                pass
            prof.step()
        prof.epoch()  # opens the next epoch's window at once; nothing happens in it
    details = sorted(p.name for p in prof.run_dir.iterdir() if "detail" in p.name)
    assert details == ["rank0.detail.0.pftrace"]
    assert all(p.exists() for p in prof.files)


def test_endless_phase_names_are_recorded_without_caching(tmp_path, monkeypatch):
    monkeypatch.setattr(profiler_mod, "MAX_CACHED_PHASES", 0)
    prof = _run(tmp_path, 3, None, phase_names=("fwd {i}",))
    names = [s.name for s in decode(prof.files[-1]).by_category("phase")]
    assert names == ["fwd 0", "fwd 1", "fwd 2"]
    assert not any(k.startswith("fwd") for k in profiler_mod._phases)


def test_a_session_stopped_from_elsewhere_closes_the_open_window_first(tmp_path):
    prof = stepscope.Profiler(dir=tmp_path, schedule=stepscope.schedule(active=5),
                              host_metrics=False, report=False, gpu=False)
    prof.start()
    try:
        for _ in range(2):
            with prof.phase("Forward"):
                with stepscope.annotate("inside the window"):
                    pass
            prof.step()
        stepscope.current().stop()  # what the exception hook or SIGTERM does
    except BaseException:
        prof.stop()
        raise
    (detail,) = [p for p in prof.files if "detail" in p.name]
    names = [s.name for s in decode(detail).slices]
    assert "inside the window" in names
    prof.stop()
    assert any("summary" in p.name for p in prof.files)


_SIGTERM_IN_PHASE = """
import os, signal, sys, tempfile
from stepscope.profiler import Profiler
from stepscope.profiler import profiler as P
prof = Profiler(tempfile.mkdtemp(), schedule=None, run_id="r", host_metrics=False,
                report=False, use_env=False)
prof.start()


class Watched:  # says when the handler's rebinding had to give up waiting for the lock
    def __init__(self, lock):
        self.lock = lock
    def acquire(self, *a, **k):
        got = self.lock.acquire(*a, **k)
        if not got:
            sys.stderr.write("phase lock timed out\\n")
        return got
    def release(self):
        self.lock.release()
    def __enter__(self):
        self.lock.acquire()
    def __exit__(self, *exc):
        self.lock.release()


P._phase_lock = Watched(P._phase_lock)
orig = P.rec.event_id
def event_id(*a, **k):  # runs while prof.phase() creates the phase, its lock held
    P.rec.event_id = orig
    os.kill(os.getpid(), signal.SIGTERM)  # the handler stops the session right here
    return orig(*a, **k)
P.rec.event_id = event_id
with prof.phase("Forward"):
    pass
print("SIGTERM was not delivered")
"""


def test_sigterm_while_a_phase_is_made_ends_the_program():
    # the handler's stop() rebinds phases under the same lock: once a deadlock (hung job)
    import os
    import signal
    import subprocess
    import sys

    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env = dict(os.environ, PYTHONPATH=src)
    proc = subprocess.run([sys.executable, "-c", _SIGTERM_IN_PHASE], env=env, timeout=30,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    assert "phase lock timed out" not in proc.stderr  # the rebinding took the lock it holds


def test_an_async_range_open_when_its_window_closes_is_left_open_there(tmp_path):
    """start_range in a window, end_range after it: the window's file leaves the range open
    ("Did not end": no call in its tables), as it leaves a thread's open ranges (it was ended
    where the window closed, a call as long as what was left of the window)."""
    import time

    prof = stepscope.Profiler(dir=tmp_path, schedule=(1, 3), host_metrics=False, report=False,
                              gpu=False, use_env=False)
    prof.start()
    marks = {}
    for i in range(6):
        if i == 2:
            marks["begin"] = time.perf_counter_ns()
            handle = stepscope.start_range("async op")
        if i == 3:
            marks["after close"] = time.perf_counter_ns()  # the window closed at step()
        if i == 4:
            stepscope.end_range(handle)
        prof.step()
    prof.stop()
    window = decode(prof.run_dir / "rank0.detail.0.pftrace")
    (op,) = [s for s in window.slices if s.name == "async op"]
    assert op.dur is None and marks["begin"] <= op.ts <= marks["after close"]
    from stepscope import analysis

    with analysis.open(str(prof.run_dir / "rank0.detail.0.pftrace"), engine="embedded") as db:
        ops = analysis.summaries.table(db, "operators").rows
        assert "async op" not in {r["name"] for r in ops}
