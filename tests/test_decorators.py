"""Decorated functions: every decorator form names the function, no slice is nameless, and
coroutines that interleave on one thread keep their own durations.

Runs on the C recorder and again on the pure-Python one (see test_fast.py).
"""

from __future__ import annotations

import asyncio
import time

import pytest

import stepscope
from perfetto_decode import decode


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "t.pftrace")


def _all_slices(d):
    return [s for u in d.tracks for s in d.slices(u)]


def test_every_decorator_form_names_the_function(path):
    @stepscope.annotate
    def bare():
        pass

    @stepscope.annotate()
    def parens():
        pass

    @stepscope.annotate(domain="io")
    def with_domain():
        pass

    @stepscope.annotate(category="cat")
    def with_category():
        pass

    @stepscope.annotate(color="red")
    def with_color():
        pass

    @stepscope.annotate(domain="io", step=3)
    def with_args():
        pass

    @stepscope.annotate(payload=1.5)
    def with_payload():
        pass

    @stepscope.annotate("")
    def empty_message():
        pass

    @stepscope.annotate("given")
    def named():
        pass

    funcs = [bare, parens, with_domain, with_category, with_color, with_args, with_payload,
             empty_message, named]
    with stepscope.trace(path):
        for f in funcs:
            f()
    d = decode(path)
    begins = [(e.name, e.categories, e.args) for e in d.events if e.type == "B"]
    q = "test_every_decorator_form_names_the_function.<locals>."
    assert begins == [
        (q + "bare", (), {}),
        (q + "parens", (), {}),
        (q + "with_domain", ("io",), {}),
        (q + "with_category", ("cat",), {}),
        (q + "with_color", (), {}),
        (q + "with_args", ("io",), {"step": 3}),
        (q + "with_payload", (), {"payload": 1.5}),
        (q + "empty_message", (), {}),
        ("given", (), {}),
    ]
    assert [f.__name__ for f in funcs] == [n.rsplit(".", 1)[1] for n, _, _ in begins[:-1]] + [
        "named"]


def test_no_range_or_mark_is_written_without_a_name(path):
    with stepscope.trace(path):
        with stepscope.annotate():
            pass
        with stepscope.annotate(domain="io"):
            pass
        with stepscope.annotate(""):
            pass
        stepscope.push_range()
        stepscope.pop_range()
        stepscope.push_range("", domain="io")
        stepscope.pop_range()
        stepscope.end_range(stepscope.start_range())
        stepscope.mark()
        stepscope.mark("", x=1)
    d = decode(path)
    named = [(e.type, e.name) for e in d.events if e.type in "BI"]
    assert named == [("B", "<unnamed>")] * 6 + [("I", "<unnamed>")] * 2
    assert len(_all_slices(d)) == 6


def test_concurrent_coroutines_keep_their_own_durations(path):
    # three tasks interleave on one thread; each one's slice lies inside the window measured by
    # hand around its call, and lasts at least its sleep (asyncio may wake 1 ms early)
    @stepscope.annotate
    async def short():
        await asyncio.sleep(0.05)

    @stepscope.annotate(domain="io")
    async def long():
        await asyncio.sleep(0.3)

    @stepscope.annotate("middle")
    async def middle():
        await asyncio.sleep(0.15)

    async def timed(fn):
        t0 = time.perf_counter_ns()
        await fn()
        return fn.__qualname__.rsplit(".", 1)[1], t0, time.perf_counter_ns()

    async def main():
        return await asyncio.gather(timed(short), timed(long), timed(middle))

    with stepscope.trace(path):
        hand = {n: (t0, t1) for n, t0, t1 in asyncio.run(main())}
    d = decode(path)
    slices = {s[0].rsplit(".", 1)[-1]: s for s in _all_slices(d)}
    assert sorted(slices) == ["long", "middle", "short"]
    for name, sleep_ms in (("short", 50), ("long", 300), ("middle", 150)):
        _, depth, b, e = slices[name]
        t0, t1 = hand[name]
        assert t0 <= b <= e <= t1, name
        assert e - b >= (sleep_ms - 1) * 1_000_000, (name, (e - b) / 1e6)
    cats = {e.name.rsplit(".", 1)[-1]: e.categories for e in d.events if e.type == "B"}
    assert cats == {"short": (), "long": ("io",), "middle": ()}


def test_nested_and_failing_coroutines_end_their_ranges(path):
    @stepscope.annotate
    async def inner(fail):
        await asyncio.sleep(0.01)
        if fail:
            raise ValueError("boom")

    @stepscope.annotate
    async def outer():
        await inner(False)
        try:
            await inner(True)
        except ValueError:
            pass
        return 7

    with stepscope.trace(path):
        assert asyncio.run(outer()) == 7
    d = decode(path)
    got = sorted((s[0].rsplit(".", 1)[-1], s[3] - s[2] >= 9_000_000) for s in _all_slices(d))
    assert got == [("inner", True), ("inner", True), ("outer", True)]
    outer_slice = next(s for s in _all_slices(d) if s[0].endswith("outer"))
    for s in _all_slices(d):  # both inner calls lie inside the outer one
        assert outer_slice[2] <= s[2] <= s[3] <= outer_slice[3]


def test_a_coroutine_outliving_its_session_does_not_write_into_the_next(tmp_path):
    @stepscope.annotate
    async def slow(ev):
        await ev.wait()

    async def main():
        ev = asyncio.Event()
        task = asyncio.ensure_future(slow(ev))
        await asyncio.sleep(0.01)
        stepscope.stop()  # the session ends while the coroutine runs
        stepscope.start(str(tmp_path / "b.pftrace"))
        ev.set()
        await task

    stepscope.start(str(tmp_path / "a.pftrace"))
    asyncio.run(main())
    stepscope.stop()
    assert [e.type for e in decode(str(tmp_path / "b.pftrace")).events] == []
    # its range was open when the first file closed: left open there ("Did not end"), as
    # open thread ranges are
    assert [e.type for e in decode(str(tmp_path / "a.pftrace")).events] == ["B"]
