"""CupyEventTimer on several devices (one anchor each) and its dropped ranges in the trace."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from gpu_fakes import FakeMultiCuda
from gpu_trace_decode import TYPE_INSTANT, decode

from stepscope.core import session as _session
from stepscope.gpu.cupy_timing import DROPPED_NAME, CupyEventTimer


@pytest.fixture
def cuda(monkeypatch):
    # device 1's GPU clock is 7 ms ahead of device 0's: an anchor of the wrong device would show
    fake = FakeMultiCuda(clock_offset={0: 0, 1: 7_000_000})
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=fake))
    return fake


class HostClock:
    """Host ns read by the timer, one value per read, in order."""

    def __init__(self, *values):
        self.values = list(values)

    def __call__(self):
        return self.values.pop(0)


def run(path, cuda, steps, *, clock, max_pending=100):
    """Run ``(device, gpu_time, "push name" | "pop")`` steps, mark every end event done, poll."""
    sess = _session.Session(path).start()
    try:
        timer = CupyEventTimer(sess, host_clock=clock, max_pending=max_pending)
        for device, gpu_ns, op in steps:
            cuda.set_device(device)
            cuda.gpu_now = gpu_ns
            if op == "pop":
                timer.pop()
            else:
                timer.push(op.split()[1])
        for p in timer._pending:
            p.end.done = True
        n = timer.poll()
    finally:
        sess.stop()
    return decode(path), timer, n


def test_ranges_on_two_devices_each_resolve_against_their_own_anchor(tmp_path, cuda):
    clock = HostClock(5_000_000, 6_000_000)  # read after the anchor of device 0, then device 1
    tr, timer, n = run(tmp_path / "d.pftrace", cuda, [
        (0, 100_000, "push a"),
        (1, 300_000, "push b"),  # device 1's anchor: GPU 300 us = host 6 ms
        (1, 500_000, "pop"),
        (0, 600_000, "pop"),
    ], clock=clock)  # fmt: skip
    assert n == 2 and timer.dropped == 0 and cuda.synced == 2
    got = sorted(
        (tr.track_name(tr.tracks[s.track].parent_uuid), s.name, s.ts, s.dur) for s in tr.slices
    )
    assert got == [
        ("GPU 0 (Fake GPU 0)", "a", 5_000_000, 500_000),
        ("GPU 1 (Fake GPU 1)", "b", 6_000_000, 200_000),
    ]
    assert not [e for e in tr.events if e.type == TYPE_INSTANT]


def instants(tr):
    return sorted(
        (tr.track_name(e.track), e.name, e.ts, e.categories, e.args)
        for e in tr.events
        if e.type == TYPE_INSTANT
    )


def test_dropped_ranges_are_written_per_device(tmp_path, cuda):
    clock = HostClock(5_000_000, 6_000_000, 9_000_000)  # anchors 0 and 1, then the drops
    tr, timer, n = run(tmp_path / "x.pftrace", cuda, [
        (0, 100_000, "push a"),
        (0, 200_000, "pop"),
        (1, 300_000, "push c"),
        (0, 400_000, "pop"),  # ends on device 0: no elapsed time from device 1's anchor
        (0, 500_000, "push b"),
        (0, 600_000, "pop"),  # over max_pending
    ], clock=clock, max_pending=2)  # fmt: skip
    assert n == 1 and timer.dropped == 2
    assert [(s.name, s.ts, s.dur) for s in tr.slices] == [("a", 5_000_000, 100_000)]
    assert instants(tr) == [
        ("GPU 0 (Fake GPU 0)", DROPPED_NAME, 9_000_000, ["stepscope"], {"dropped_events": 1}),
        ("GPU 1 (Fake GPU 1)", DROPPED_NAME, 9_000_000, ["stepscope"], {"dropped_events": 1}),
    ]


def test_drops_are_written_once_each_even_with_nothing_pending(tmp_path, cuda):
    """max_pending=0: every range is dropped at pop, so no range is pending at poll time; each
    poll writes only the drops since the previous one."""
    path = tmp_path / "z.pftrace"
    sess = _session.Session(path).start()
    try:
        timer = CupyEventTimer(sess, host_clock=HostClock(5_000_000, 8_000_000), max_pending=0)
        for _ in range(3):
            timer.push("r")
            timer.pop()
        assert timer._pending == [] and timer.dropped == 3
        assert timer.poll() == 0
        assert timer.poll() == 0  # nothing new: no second instant
    finally:
        sess.stop()
    assert instants(decode(path)) == [
        ("GPU 0 (Fake GPU 0)", DROPPED_NAME, 8_000_000, ["stepscope"], {"dropped_events": 3}),
    ]
