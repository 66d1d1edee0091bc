"""What the program hands the profiler never raises into the program (issue 18, item 9).

Objects whose ``__str__`` (or ``__repr__``, or a domain's ``.name``) raises, and units that are
not text, become a placeholder ``<TypeName>`` in the trace, with one warning per kind of value.
"""

from __future__ import annotations

import warnings

import pytest

import stepscope
from perfetto_decode import decode
from stepscope import _nvtx
from stepscope.record import recorder as _recorder


class Broken:
    def __str__(self):
        raise RuntimeError("no str")

    __repr__ = __str__


class BrokenName:
    @property
    def name(self):
        raise RuntimeError("no name")

    def __str__(self):
        return "named by str"


@pytest.mark.parametrize("forward", [False, True])
def test_values_whose_str_raises_become_placeholders(tmp_path, monkeypatch, forward):
    if forward and not _nvtx.available():
        pytest.skip("nvtx is not installed")
    monkeypatch.setattr(_recorder, "_warned", set())  # "once" counted from here
    path = str(tmp_path / "t.pftrace")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with stepscope.trace(path, nvtx=forward):
            for _ in range(2):  # the second round warns no more
                with stepscope.annotate("a", domain=Broken()):
                    pass
                with stepscope.annotate("b", domain=BrokenName(), category=Broken()):
                    pass
                stepscope.push_range("c", domain=Broken())
                stepscope.pop_range()
                stepscope.mark(Broken())
                stepscope.mark("d", domain=Broken(), x=Broken())
                stepscope.end_range(stepscope.start_range(Broken(), category=Broken()))
                stepscope.annotate(domain=Broken())(lambda: None)()
                stepscope.counter(Broken(), 1)
                stepscope.counter("c", Broken())
                stepscope.counter("u", 2, unit=object())
                stepscope.counter("v", 3, unit=Broken())
    d = decode(path)
    got = [(e.type, e.name, e.categories, e.args) for e in d.events if e.type in "BI"]
    lam = "test_values_whose_str_raises_become_placeholders.<locals>.<lambda>"
    assert got == 2 * [
        ("B", "a", ("<Broken>",), {}),
        ("B", "b", ("named by str", "<Broken>"), {}),
        ("B", "c", ("<Broken>",), {}),
        ("I", "<Broken>", (), {}),
        ("I", "d", ("<Broken>",), {"x": "<Broken>"}),
        ("B", "<Broken>", ("<Broken>",), {}),
        ("B", lam, ("<Broken>",), {}),
    ]
    counters = {d.tracks[e.track].name: e.value for e in d.events if e.type == "C"}
    assert counters == {"<Broken>": 1, "u": 2, "v": 3}
    units = {d.tracks[u].name: d.tracks[u].counter.unit_name for u in d.tracks
             if d.tracks[u].HasField("counter") and d.tracks[u].name in ("u", "v")}
    assert units == {"u": "<object>", "v": "<Broken>"}
    texts = sorted(str(w.message) for w in caught if "stepscope" in str(w.message)
                   and "forwarding to nvtx" not in str(w.message))  # nvtx refuses the domain
    assert texts == sorted([
        "stepscope: str() of the Broken given as domain failed (RuntimeError); using '<Broken>'",
        "stepscope: str() of the Broken given as category failed (RuntimeError); "
        "using '<Broken>'",
        "stepscope: str() of the Broken given as counter name failed (RuntimeError); "
        "using '<Broken>'",
        "stepscope: range message Broken is not a str; using str()",
        "stepscope: counter 'c': a value of type Broken is not a number; ignored",
        "stepscope: counter 'u': a unit of type object is not a str; using '<object>'",
    ]), texts


def test_step_arguments_that_are_no_numbers_are_ignored_with_one_warning(tmp_path, monkeypatch):
    """``step(num_samples="x")`` once raised TypeError into the program from the step timer,
    half-way through the step; ``epoch="e"`` became the epoch. Now: numpy scalars, 0-d arrays
    and Decimals count as their number, anything else is left out with one warning, and the
    step counts either way."""
    from decimal import Decimal

    import numpy as np

    from stepscope import _schema as S
    from stepscope.profiler import Profiler

    monkeypatch.setattr(_recorder, "_warned", set())
    prof = Profiler(tmp_path, run_id="r", host_metrics=False, report=False, use_env=False)
    prof.start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for v in ("x", np.int64(8), [1], np.array(4.5), Decimal("2.5"), Broken(), None):
            prof.step(num_samples=v)
        prof.step(epoch="e")  # ignored: still epoch 0
        prof.step(epoch=np.int64(3))
        prof.step()
    prof.stop()
    assert [str(w.message) for w in caught] == [
        "stepscope: step(num_samples='x') is not a number: ignored",
        "stepscope: step(epoch='e') is not an integer: ignored"]
    assert prof.timer.steps == 10
    ends = [e.args for e in decode(tmp_path / "r" / "rank0.summary.pftrace").events
            if e.type == "E" and e.args and S.ARG_EPOCH in e.args]
    assert ends == [{"epoch": 0}, {"epoch": 0, "num_samples": 8}, {"epoch": 0},
                    {"epoch": 0, "num_samples": 4.5}, {"epoch": 0, "num_samples": 2.5},
                    {"epoch": 0}, {"epoch": 0}, {"epoch": 0}, {"epoch": 0}, {"epoch": 3}]
    assert type(ends[1]["num_samples"]) is int
