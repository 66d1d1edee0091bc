"""CupyEventTimer with several host threads: one push/pop stack per thread (fake CuPy)."""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
from types import SimpleNamespace

import pytest
from gpu_fakes import FakeCuda
from gpu_trace_decode import decode

from stepscope.core import session as _session
from stepscope.gpu.cupy_timing import CupyEventTimer

HOST_ANCHOR = 5_000_000  # host ns read right after the anchor event (GPU 100 us)


class Worker:
    """A thread that runs the functions it is given one at a time, each to completion, so a test
    can interleave two threads' calls in an exact order."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()
        self.native_id = self.call(threading.get_native_id)

    def _loop(self):
        while (fn := self._jobs.get()) is not None:
            try:
                self._done.put((True, fn()))
            except BaseException as exc:  # re-raised in the test's thread
                self._done.put((False, exc))

    def call(self, fn):
        self._jobs.put(fn)
        ok, value = self._done.get(timeout=10)
        if not ok:
            raise value
        return value

    def stop(self):
        self._jobs.put(None)
        self._t.join(timeout=10)


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=fake))
    return fake


@pytest.fixture
def workers():
    a, b = Worker(), Worker()
    yield a, b
    a.stop()
    b.stop()


@contextlib.contextmanager
def timer_session(path):
    """A session writing ``path`` and a CUDA-event timer on it; the session stops on exit."""
    sess = _session.Session(path).start()
    try:
        yield CupyEventTimer(sess, host_clock=lambda: HOST_ANCHOR)
    finally:
        sess.stop()


def run_script(tmp_path, cuda, steps):
    """Run ``(worker, gpu_time, "push name" | "pop")`` steps, then resolve every range."""
    path = tmp_path / "threads.pftrace"
    with timer_session(path) as timer:
        for worker, gpu_ns, op in steps:
            cuda.gpu_now = gpu_ns
            if op == "pop":
                worker.call(timer.pop)
            else:
                name = op.split()[1]
                worker.call(lambda name=name: timer.push(name))
        for p in timer._pending:
            p.end.done = True
        n = timer.poll()
    return decode(path), timer, n


def test_interleaved_threads_close_their_own_ranges(tmp_path, cuda, workers):
    a, b = workers
    a.call(lambda: cuda.use_stream(0xA0))
    b.call(lambda: cuda.use_stream(0xB0))
    tr, timer, n = run_script(tmp_path, cuda, [
        (a, 100_000, "push a_outer"),
        (b, 200_000, "push b"),
        (a, 300_000, "push a_inner"),
        (b, 400_000, "pop"),  # one shared stack would have closed a_inner here
        (a, 500_000, "pop"),
        (a, 600_000, "pop"),
    ])  # fmt: skip
    assert n == 3 and cuda.synced == 1 and timer.dropped == 0
    got = sorted((tr.track_name(s.track), s.name, s.ts, s.dur) for s in tr.slices)
    # GPU t -> host HOST_ANCHOR + (t - 100 us)
    assert got == [
        ("CUDA events (stream 0xa0)", "a_inner", 5_200_000, 200_000),
        ("CUDA events (stream 0xa0)", "a_outer", 5_000_000, 500_000),
        ("CUDA events (stream 0xb0)", "b", 5_100_000, 200_000),
    ]


def test_two_threads_on_one_stream_get_two_tracks(tmp_path, cuda, workers):
    """Their ranges overlap without nesting (a: 100-300 us, b: 200-400 us): one track could not
    hold them, so the second thread on the stream gets its own."""
    a, b = workers
    tr, _, n = run_script(tmp_path, cuda, [
        (a, 100_000, "push a"),
        (b, 200_000, "push b"),
        (a, 300_000, "pop"),
        (b, 400_000, "pop"),
    ])  # fmt: skip
    assert n == 2
    got = sorted((tr.track_name(s.track), s.name, s.ts, s.dur) for s in tr.slices)
    assert got == [
        ("CUDA events (stream 0x1234)", "a", 5_000_000, 200_000),
        (f"CUDA events (stream 0x1234, thread {b.native_id})", "b", 5_100_000, 200_000),
    ]
    parents = {tr.tracks[s.track].parent_uuid for s in tr.slices}
    assert [tr.track_name(p) for p in parents] == ["GPU 0 (Fake GPU)"]


def test_a_pop_without_a_range_on_its_thread_is_ignored(tmp_path, cuda, workers):
    a, b = workers
    path = tmp_path / "p.pftrace"
    with timer_session(path) as timer:
        cuda.gpu_now = 100_000
        a.call(lambda: timer.push("a"))
        b.call(timer.pop)  # b has nothing open: a's range stays open
        assert a.call(timer.open_ranges) == ["a"]
        assert b.call(timer.open_ranges) == []
        assert timer._pending == []
        cuda.gpu_now = 250_000
        a.call(timer.pop)
        assert a.call(timer.open_ranges) == [] and timer._stacks == {}
        timer._pending[0].end.done = True
        assert timer.poll() == 1
    (s,) = decode(path).slices
    assert (s.name, s.ts, s.dur) == ("a", 5_000_000, 150_000)


def test_ranges_popped_while_polling_are_kept(tmp_path, cuda, workers):
    """poll() takes the pending list under the lock; a range that is not done yet goes back in
    front of ranges popped meanwhile, and the next poll emits both."""
    a, _ = workers
    path = tmp_path / "k.pftrace"
    with timer_session(path) as timer:
        cuda.gpu_now = 100_000
        a.call(lambda: timer.push("first"))
        cuda.gpu_now = 200_000
        a.call(timer.pop)
        assert timer.poll() == 0  # not done yet: kept
        a.call(lambda: timer.push("second"))
        cuda.gpu_now = 300_000
        a.call(timer.pop)
        assert [p.name for p in timer._pending] == ["first", "second"]
        for p in timer._pending:
            p.end.done = True
        assert timer.poll() == 2
    got = sorted((s.name, s.ts, s.dur) for s in decode(path).slices)
    assert got == [("first", 5_000_000, 100_000), ("second", 5_100_000, 100_000)]


class _EndWhilePolling:
    """An end event not done yet whose first ``done`` check runs ``fn`` (other threads' pops
    landing while poll() has the pending list out)."""

    def __init__(self, fn):
        self.fn = fn

    @property
    def done(self):
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()
        return False


def test_kept_ranges_merged_back_respect_max_pending(tmp_path, cuda, workers):
    a, _ = workers
    sess = _session.Session(tmp_path / "m.pftrace").start()
    try:
        timer = CupyEventTimer(sess, max_pending=2, host_clock=lambda: HOST_ANCHOR)
        cuda.gpu_now = 100_000
        a.call(lambda: timer.push("first"))
        a.call(timer.pop)

        def two_more():
            for name in ("x", "y"):
                a.call(lambda name=name: timer.push(name))
                a.call(timer.pop)

        timer._pending[0].end = _EndWhilePolling(two_more)
        assert timer.poll() == 0
        # "first" goes back in front; the list is over its cap by one: the newest is dropped
        assert [p.name for p in timer._pending] == ["first", "x"] and timer.dropped == 1
    finally:
        sess.stop()


def test_ranges_that_cannot_be_timed_are_counted_as_dropped(tmp_path, cuda, workers):
    a, _ = workers
    path = tmp_path / "f.pftrace"
    with timer_session(path) as timer:
        cuda.gpu_now = 100_000
        for name in ("bad", "good"):
            a.call(lambda name=name: timer.push(name))
            cuda.gpu_now += 50_000
            a.call(timer.pop)
        for p in timer._pending:
            p.end.done = True
        timer._pending[0].begin = object()  # no GPU time: the elapsed time raises
        assert timer.poll() == 1
        assert timer.dropped == 1 and timer._pending == []
    (s,) = decode(path).slices
    assert (s.name, s.ts, s.dur) == ("good", 5_050_000, 50_000)
