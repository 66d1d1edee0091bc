"""record.rebind: the one mechanism that rebinds cached ranges and phases on a state change."""

from __future__ import annotations

import threading
import time

import stepscope
from stepscope import _api
from stepscope.profiler import profiler as _profiler
from stepscope.record import recorder as rec
from stepscope.record.rebind import Rebound


def test_every_object_is_bound_again_at_each_change():
    calls = []
    rb = Rebound(lambda obj, on, detail: calls.append((obj, on, detail)))
    rb.objects["a"], rb.objects["b"] = "A", "B"
    rb.rebind(True, False)
    rb.rebind(False, False)
    assert calls == [("A", True, False), ("B", True, False), ("A", False, False),
                     ("B", False, False)]


def test_a_lock_that_is_never_released_delays_the_rebind_one_second_not_forever():
    """As in a forked child whose parent thread held the lock: the child goes on without it."""
    calls = []
    rb = Rebound(lambda obj, on, detail: calls.append(obj))
    rb.objects[1] = "x"
    held, done = threading.Event(), threading.Event()

    def hold():
        with rb.lock:
            held.set()
            done.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    t0 = time.monotonic()
    rb.rebind(True, True)
    waited = time.monotonic() - t0
    done.set()
    t.join()
    assert calls == ["x"] and 0.9 <= waited < 5


def test_the_api_ranges_and_the_profiler_phases_use_it(tmp_path):
    assert _api._ranges is _api._cached.objects and _api._lock is _api._cached.lock
    assert _profiler._phases is _profiler._fast_phases.objects
    assert _api._on_state in rec._state_listeners
    assert _profiler._fast_phases.rebind in rec._state_listeners
    with _profiler._phase_lock:
        ph = _profiler._phases["rebind test phase"] = _profiler._fast_phase("rebind test phase")
    try:
        assert type(ph).__enter__ is rec.noop  # not recording
        with stepscope.trace(tmp_path / "t.pftrace"):
            assert type(ph).__enter__ is not rec.noop  # rebound to the begin chain
        assert type(ph).__enter__ is rec.noop
    finally:
        _profiler._phases.pop("rebind test phase", None)
