"""The C twins of ``Profiler.step``, ``_activity`` and ``phase`` (``_fast.install_profiler``)
against the Python methods they replace: the same events, in the same order, and the same
profiler state after every call, over a script that takes each of their branches (steps with and
without phases, num_samples of each kind, a new epoch, detail windows, flushes that take the
open step's placeholder, a hook, a lock held by another thread)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from stepscope.profiler import Profiler
from stepscope.profiler import profiler as P
from stepscope.record import recorder as rec

pytestmark = pytest.mark.skipif(rec.fast is None, reason="the C buffer is not built")

STATE = ("_step", "_batch", "_epoch", "_in_step", "_pending", "_active", "_quiet",
         "_recording")


class Hook:
    def __init__(self) -> None:
        self.calls = 0

    def step_end(self) -> None:
        self.calls += 1
        if self.calls == 3:
            raise ValueError("a failing producer")  # warned, never raised into the program


class Gated:
    """A hook whose step_end is called only while ``flag`` is set (``step_end_gates``)."""

    def __init__(self) -> None:
        self.flag = None
        self.calls = 0
        self.step_end_gates = ((self, "flag"),)

    def step_end(self) -> None:
        self.calls += 1


def _script(prof: Profiler) -> list:
    """Run the script; after each call, the profiler's state and the events recorded since,
    times replaced by the order of their first appearance (the two runs read different
    clocks), parked blobs' codes (a process-wide counter) by their order and args."""
    seen: dict[int, int] = {}
    blobs: dict[int, int] = {}

    def code(c: int) -> object:
        if c >= 0:
            return c
        b = rec.blobs.get(-c)
        return ("blob", blobs.setdefault(c, len(blobs)), None if b is None else b.args)

    out = []

    def snap(label: str) -> None:
        got = rec.drain().reshape(-1, 3).tolist()
        events = [(code(c), seen.setdefault(t, len(seen))) for c, t, _ in got
                  if c != rec.THREAD]
        tent = prof._tentative  # noqa: SLF001
        out.append((label, events, tuple(getattr(prof, a) for a in STATE),
                    None if tent is None else code(tent[0]),
                    prof._late_track is not None, prof.timer.steps,  # noqa: SLF001
                    [h.calls for h in prof.hooks]))

    def phase(name: str) -> None:
        with prof.phase(name):
            time.sleep(0.0002)

    snap("start")
    for i, (ns, ep) in enumerate([(None, None), (4, None), (4.5, None), (np.int64(3), None),
                                  ("x", None), (None, 1), (8, 1), (8, None)]):
        if i % 2 == 0:
            phase("Forward")
            snap(f"phase {i}")
        if i == 3:
            prof._sess.flush()  # noqa: SLF001 - takes the open step's placeholder
            snap("flush in step")
        prof.hooks[1].flag = 1 if i in (2, 5) else (0 if i == 6 else None)
        prof.step(num_samples=ns, epoch=ep)
        snap(f"step {i}")
    prof._sess.flush()  # noqa: SLF001 - a step with no phase, its placeholder flushed
    prof.step()
    snap("step after flush")
    phase("Backward")
    snap("late activity")
    prof.step(7)
    snap("end")
    return out


def _run(tmp_path, name: str, python: bool) -> list:
    prof = Profiler(tmp_path, schedule=(2, 4), run_id=name, host_metrics=False, report=False,
                    use_env=False, torch=False)
    if python:  # the Python methods, as instance attributes
        prof.step = prof._step_py  # type: ignore[method-assign]
        prof._activity = prof._activity_py  # type: ignore[method-assign]  # noqa: SLF001
        prof.phase = prof._phase_py  # type: ignore[method-assign]
    prof.hooks += [Hook(), Gated()]
    rec.drain()
    prof.start()
    prof._sess.flush_interval_s = 60.0  # noqa: SLF001 - only the script's flushes
    out = _script(prof)
    prof.stop()
    return out


def test_c_methods_record_what_the_python_methods_record(tmp_path, capsys):
    assert type(Profiler.__dict__["step"]).__name__ == "method_descriptor"
    c_run = _run(tmp_path, "c", python=False)
    assert capsys.readouterr().err.count("Hook.step_end failed: ValueError") == 1
    py_run = _run(tmp_path, "py", python=True)
    assert capsys.readouterr().err.count("Hook.step_end failed: ValueError") == 1
    assert len(c_run) == len(py_run) == 17
    for c, py in zip(c_run, py_run, strict=True):
        assert c == py
    # the script did reach the branches: a late begin, a new epoch, the steps counted
    labels = {row[0]: row for row in c_run}
    assert labels["step 5"][2][2] == 1  # epoch 1
    assert labels["end"][5] == 10
    assert any(late for *_, late, _, _ in c_run)
    assert labels["end"][6] == [10, 2]  # ten step() calls; the gated hook at two of them


def test_a_step_waits_for_the_lock_another_thread_holds(tmp_path):
    """Where another thread holds ``_plock`` (its placeholder work in progress), the C step
    takes the Python path, which waits for it, instead of writing beside it."""
    prof = Profiler(tmp_path, schedule=None, run_id="l", host_metrics=False, report=False,
                    use_env=False, torch=False)
    prof.start()
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with prof._plock:  # noqa: SLF001
            held.set()
            release.wait(5)

    th = threading.Thread(target=holder)
    th.start()
    held.wait(5)
    threading.Timer(0.2, release.set).start()
    t0 = time.perf_counter()
    prof.step()
    waited = time.perf_counter() - t0
    th.join()
    assert waited >= 0.15
    assert prof.timer.steps == 1
    prof.stop()


def test_the_c_methods_keep_the_python_signatures_and_docs():
    import inspect

    assert str(inspect.signature(Profiler.step)) == "(self, /, num_samples=None, epoch=None)"
    assert Profiler.step.__doc__.startswith("End the step in progress")
    assert Profiler.phase.__doc__ == P.Profiler._phase_py.__doc__
    with pytest.raises(TypeError):
        Profiler.step(object())  # a method of Profilers only


@pytest.mark.parametrize("python", [False, True], ids=["c", "python"])
def test_a_gate_that_raises_opens_it_unless_it_is_an_interrupt(tmp_path, python):
    """A gate attribute that raises an ordinary error opens the gate (the hook decides); a
    KeyboardInterrupt (a signal handler that ran in the attribute's Python code) reaches the
    program, as from any Python code, on both paths."""

    class Odd:
        error: type[BaseException] = ValueError

        @property
        def flag(self):
            raise self.error("from a gate")

    odd, hook = Odd(), Gated()
    hook.step_end_gates = ((odd, "flag"),)
    prof = Profiler(tmp_path, schedule=None, run_id=str(python), host_metrics=False,
                    report=False, use_env=False, torch=False)
    if python:
        prof.step = prof._step_py  # type: ignore[method-assign]
    prof.hooks.append(hook)
    prof.start()
    prof.step()
    assert hook.calls == 1
    Odd.error = KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        prof.step()
    assert hook.calls == 1
    prof.stop()
