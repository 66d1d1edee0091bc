"""Bad input, threads, fork, the buffer cap and abrupt endings: the trace stays valid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

import stepscope
from perfetto_decode import decode
from stepscope.record import recorder as _recorder
from stepscope.write.pipeline import RAW_EVENT_BYTES
from stepscope.write.sink import Sink

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


@pytest.fixture(autouse=True)
def fresh_warnings():
    _recorder._warned.clear()
    yield
    _recorder._warned.clear()


def begins(path) -> list:
    return [e.name for e in decode(path).events if e.type == "B"]


def test_unbalanced_pop_warns_and_keeps_the_trace_nested(tmp_path):
    path = str(tmp_path / "t.pftrace")
    with pytest.warns(RuntimeWarning, match="pop_range"):
        with stepscope.trace(path):
            stepscope.pop_range()
            with stepscope.annotate("ok"):
                pass
            stepscope.pop_range()
    d = decode(path)
    assert [s[:2] for s in d.slices(d.thread_track("MainThread"))] == [("ok", 0)]


def test_end_range_of_unknown_handle_warns(tmp_path):
    with stepscope.trace(str(tmp_path / "t.pftrace")):
        with pytest.warns(RuntimeWarning, match="not a range handle"):
            stepscope.end_range(12345)
        h = stepscope.start_range("r")
        stepscope.end_range(h)
        with pytest.warns(RuntimeWarning, match="twice"):
            stepscope.end_range(h)
        stepscope.end_range(None)  # start_range returns None when tracing is off


def test_odd_messages_become_valid_names(tmp_path):
    class Broken:
        def __str__(self):
            raise RuntimeError("no")

    path = str(tmp_path / "t.pftrace")
    with stepscope.trace(path), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for msg in (17, None, b"bytes\xff", "x" * 5000, "bad \udcff utf8", Broken(), ["a"]):
            with stepscope.annotate(msg):
                pass
            stepscope.push_range(msg)
            stepscope.pop_range()
    names = begins(path)
    expected = ["17", "<unnamed>", "bytes\ufffd", "x" * 1024, "bad \ufffd utf8", "<Broken>",
                "['a']"]
    assert names == [n for n in expected for _ in (0, 1)]
    text = " ".join(str(w.message) for w in caught)
    assert "not a str" in text and "cut" in text


def test_start_twice_and_stop_without_start_warn(tmp_path):
    with pytest.warns(RuntimeWarning, match="not on"):
        stepscope.stop()
    sess = stepscope.start(str(tmp_path / "a.pftrace"))
    with pytest.warns(RuntimeWarning, match="already on"):
        again = stepscope.start(str(tmp_path / "b.pftrace"))
    assert again is sess
    stepscope.stop()
    assert stepscope.current() is None and not (tmp_path / "b.pftrace").exists()


def test_many_threads_each_get_a_named_track(tmp_path):
    path = str(tmp_path / "t.pftrace")
    barrier = threading.Barrier(4)

    def work(i):
        barrier.wait()
        for k in range(200):
            with stepscope.annotate(f"t{i}"):
                if k % 50 == 0:
                    time.sleep(0)

    with stepscope.trace(path, flush_interval_s=0.05):
        threads = [threading.Thread(target=work, args=(i,), name=f"w{i}") for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    d = decode(path)
    for i in range(4):
        assert [s[0] for s in d.slices(d.thread_track(f"w{i}"))] == [f"t{i}"] * 200


def test_forked_child_never_writes_into_the_parent_file(tmp_path):
    path = str(tmp_path / "t.pftrace")
    with stepscope.trace(path):
        with stepscope.annotate("parent"):
            pid = os.fork()
            if pid == 0:  # child: tracing is off, nothing reaches the parent's file
                try:
                    ok = stepscope.current() is None
                    with stepscope.annotate("child"):
                        pass
                    stepscope.stop  # noqa: B018
                finally:
                    os._exit(0 if ok else 3)
            _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert begins(path) == ["parent"]


def test_buffer_cap_drops_count_and_records_them(tmp_path, monkeypatch):
    path = str(tmp_path / "t.pftrace")
    real_write = Sink.write_now

    def slow_write(self, data):  # a disk that cannot keep up
        time.sleep(0.2)
        real_write(self, data)

    monkeypatch.setattr(Sink, "write_now", slow_write)
    sess = stepscope.start(path, buffer_bytes=1 << 18, flush_interval_s=0.01, compress=False)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and sess.dropped == 0:
        for _ in range(200):  # bursts under the in-memory cap: the slow disk makes the drops
            with stepscope.annotate("x"):
                pass
        time.sleep(0.02)
    stepscope.stop()
    assert sess.dropped > 0
    d = decode(path)
    track = d.track_named("stepscope dropped events")
    values = [e.value for e in d.by_track(track)]
    assert values == sorted(values) and values[-1] == sess.dropped
    marks = [e for e in d.events if e.name == "stepscope dropped events"]
    assert marks[-1].args == {"dropped_events": sess.dropped}
    main = d.thread_track("MainThread")
    assert all(s[0] == "x" for s in d.slices(main))  # still well nested after the gaps


SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {src!r})
    import stepscope
    mode = sys.argv[2]
    sess = stepscope.start(sys.argv[1], flush_interval_s=0.05)
    for i in range(3):
        with stepscope.annotate("before"):
            pass
    if mode == "exception":
        raise ValueError("boom")
    if mode == "atexit":
        sys.exit(0)
    if mode == "handler":
        signal.signal(signal.SIGTERM, lambda s, f: (print("user handler", flush=True),
                                                    sys.exit(5)))
        stepscope.stop(); sess = stepscope.start(sys.argv[1], flush_interval_s=0.05)
        with stepscope.annotate("before"):
            pass
    time.sleep(0.5)  # several flushes
    stepscope.push_range("never ends")
    print("ready", flush=True)
    time.sleep(60)
""")


def run_child(tmp_path, mode, sig=None):
    path = str(tmp_path / f"{mode}.pftrace")
    script = tmp_path / "child.py"
    script.write_text(SCRIPT.format(src=os.path.abspath(SRC)))
    proc = subprocess.Popen([sys.executable, str(script), path, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if sig is not None:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    return path, proc.returncode, out, err


def test_sigkill_leaves_a_trace_with_everything_flushed(tmp_path):
    path, code, _, _ = run_child(tmp_path, "kill", signal.SIGKILL)
    assert code == -signal.SIGKILL
    got = begins(path)
    # "never ends" begins just before the kill: a flush may or may not have taken it
    assert got in (["before"] * 3, ["before"] * 3 + ["never ends"])


def test_sigterm_finishes_the_file_and_still_dies_by_the_signal(tmp_path):
    path, code, _, _ = run_child(tmp_path, "term", signal.SIGTERM)
    assert code == -signal.SIGTERM
    d = decode(path)
    # the range the program was inside when the signal came is left open ("Did not end")
    assert [(e.type, e.name) for e in d.by_track(d.thread_track("MainThread"))] == [
        ("B", "before"), ("E", None)] * 3 + [("B", "never ends")]
    assert len(d.snapshots) == 2  # the closing snapshot was written


def test_sigterm_chains_to_the_users_handler(tmp_path):
    path, code, out, _ = run_child(tmp_path, "handler", signal.SIGTERM)
    assert "user handler" in out and code == 5
    assert begins(path)[:1] == ["before"]


def test_unhandled_exception_and_plain_exit_finish_the_file(tmp_path):
    for mode, want in (("exception", 1), ("atexit", 0)):
        path, code, _, err = run_child(tmp_path, mode)
        assert code == want
        assert begins(path) == ["before"] * 3
        assert len(decode(path).snapshots) == 2
        if mode == "exception":
            assert "ValueError: boom" in err


def test_ranges_beyond_the_cache_stop_recording_with_the_session(tmp_path, monkeypatch):
    from stepscope import _api

    monkeypatch.setattr(_api, "MAX_CACHED_RANGES", len(_api._ranges))  # the cache is full
    path = str(tmp_path / "t.pftrace")
    with stepscope.trace(path):
        kept = stepscope.annotate("uncached name")
        with kept:
            pass
    with kept:  # tracing is off: nothing may be recorded any more
        pass
    assert _recorder.pending_words() == 0
    assert begins(path) == ["uncached name"]


def test_endless_distinct_names_do_not_grow_the_name_table(tmp_path, monkeypatch):
    from stepscope import _api

    monkeypatch.setattr(_recorder, "MAX_EVENT_KINDS", len(_recorder.kinds))  # the table is full
    monkeypatch.setattr(_api, "MAX_CACHED_RANGES", 0)  # and so are the range caches
    path = str(tmp_path / "t.pftrace")
    before = len(_recorder.kinds)
    with stepscope.trace(path):
        for i in range(3):
            with stepscope.annotate(f"batch {i}"):
                stepscope.mark(f"m{i}")
            stepscope.push_range(f"p{i}")
            stepscope.pop_range()
    assert len(_recorder.kinds) <= before + 1  # at most the nameless carrier of inline names
    d = decode(path)
    assert [e.name for e in d.events if e.type in "BI"] == [
        n for i in range(3) for n in (f"batch {i}", f"m{i}", f"p{i}")]


def test_in_memory_cap_drops_when_encoding_cannot_keep_up(tmp_path):
    path = str(tmp_path / "t.pftrace")
    sess = stepscope.start(path, buffer_bytes=1 << 16, flush_interval_s=60)
    io = sess._pipeline  # noqa: SLF001
    with sess._lock:  # the writer is busy (holds the session): recording piles up
        stepscope.push_range("open across the gap")
        for _ in range(5000):
            with stepscope.annotate("x"):
                pass
        io.wait()
        with io._io_cv:  # noqa: SLF001  (and the disk is behind: a backlog)
            io._io_pending += sess.buffer_bytes  # noqa: SLF001
        sess._flush_locked(False)  # noqa: SLF001  (all 10001 pending events dropped here)
        with io._io_cv:  # noqa: SLF001
            io._io_pending -= sess.buffer_bytes  # noqa: SLF001
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the pop's begin was dropped: expected, no warning
        stepscope.pop_range()
        stepscope.stop()
    assert sess.dropped == 10002  # and the pop's end, left out
    d = decode(path)
    assert [e.value for e in d.by_track(d.track_named("stepscope dropped events"))] == [
        10001, 10002]


def test_a_burst_past_the_cap_keeps_the_events_before_it(tmp_path):
    """5000 ranges between two flushes, some 4 times the 64 KiB cap, no backlog: the events
    up to the cap are in the file, in order, the rest dropped and counted. Before: the whole
    batch was dropped (an empty trace where the cap was to keep 64 KiB)."""
    path = str(tmp_path / "t.pftrace")
    sess = stepscope.start(path, buffer_bytes=1 << 16, flush_interval_s=60)
    with sess._lock:  # no flush meanwhile
        stepscope.push_range("open across the gap")
        for _ in range(5000):
            with stepscope.annotate("x"):
                pass
    sess.flush()
    stepscope.pop_range()
    stepscope.stop()
    d = decode(path)
    xs = [e for e in d.events if e.name == "x" and e.type == "B"]
    assert [e.name for e in d.events if e.type == "B"][0] == "open across the gap"
    kept = 10001 - sess.dropped  # the gap's begin and the x's, the last one whole: where the
    assert kept == 1 + 2 * len(xs)  # cap fell inside it, its end is written from the dropped
    # part (one event past the cap)
    assert (kept - 1) * RAW_EVENT_BYTES <= 1 << 16 < (kept + 2) * RAW_EVENT_BYTES  # (+ a mark)
    assert [e.value for e in d.by_track(d.track_named("stepscope dropped events"))] == [
        sess.dropped]


def test_a_dropped_burst_leaves_the_times_around_it_exact(tmp_path, monkeypatch):
    """A range begun before a burst past the cap and ended in its dropped part ends at its own
    time, and the events recorded while that flush ran keep theirs. Before, the slices open at
    the drop were ended at the flush's time ("step" 20 ms too long here: 292 ms for a 40 ns
    range in the audit's 3M-range burst), which pushed the sequence's clock past the events
    recorded meanwhile: all written at that one time (487,680 of them, in the audit)."""
    path = str(tmp_path / "t.pftrace")
    sess = stepscope.start(path, buffer_bytes=1 << 16, flush_interval_s=60)
    real_drain, during = _recorder.drain, []

    def drain():  # the program records while the writer encodes what it drained
        chunk = real_drain()
        if not during:
            for _ in range(3):
                during.append(time.monotonic_ns())
                with stepscope.annotate("meanwhile"):
                    time.sleep(0.001)
            time.sleep(0.02)
        return chunk

    with sess._lock:  # no flush meanwhile
        stepscope.push_range("outer")
        stepscope.push_range("step")
        for _ in range(3000):  # 6000 events: some 5 times the 64 KiB cap
            with stepscope.annotate("x"):
                pass
        stepscope.pop_range()  # "step" ends in the dropped part ...
        ended = time.monotonic_ns()
        for _ in range(1000):
            with stepscope.annotate("x"):
                pass
        stepscope.push_range("open")  # ... and "open" begins there, ending after the drop
    monkeypatch.setattr(_recorder, "drain", drain)
    sess.flush()
    monkeypatch.setattr(_recorder, "drain", real_drain)
    stepscope.pop_range()  # "open"'s end: left out (its begin was dropped), not "outer"'s
    stepscope.pop_range()  # "outer"'s
    stepscope.stop()
    d = decode(path)
    slices = {name: (depth, t0, t1) for name, depth, t0, t1 in d.slices(
        d.thread_track("MainThread")) if name != "x"}
    assert slices["outer"][0] == 0 and slices["step"][0] == 1
    assert slices["step"][1] < slices["step"][2] <= ended  # its own end, before the flush
    meanwhile = [(t0, t1) for name, depth, t0, t1 in d.slices(d.thread_track("MainThread"))
                 if name == "meanwhile"]
    assert len(meanwhile) == 3 and "open" not in slices
    for (t0, t1), at in zip(meanwhile, during, strict=True):
        assert at <= t0 and t1 - t0 >= 1_000_000  # each at its time, 1 ms long
    assert slices["outer"][2] > meanwhile[-1][1]  # "outer" ends last, at its own end
    # every recorded event is in the file or counted: outer, step and 4000 x's (2 each),
    # open's two, 3 meanwhile
    written = sum(1 for e in d.events if e.type in "BE" and e.track == d.thread_track(
        "MainThread"))
    assert written + sess.dropped == 2 + 2 + 8000 + 2 + 6


def test_huge_counter_values_never_break_the_trace(tmp_path):
    path = str(tmp_path / "t.pftrace")
    with stepscope.trace(path):
        stepscope.counter("big", 1 << 70)
        stepscope.counter("big", -(1 << 70))
        stepscope.counter("big", 5)
    d = decode(path)
    assert [e.value for e in d.by_track(d.track_named("big"))] == [2.0**70, -(2.0**70), 5]
    assert stepscope.current() is None


def test_nested_trace_leaves_the_outer_session_running(tmp_path):
    with pytest.warns(RuntimeWarning, match="already on"):
        with stepscope.trace(str(tmp_path / "outer.pftrace")) as outer:
            with stepscope.trace(str(tmp_path / "inner.pftrace")) as inner:
                assert inner is outer
            assert stepscope.current() is outer
            with stepscope.annotate("after inner"):
                pass
    assert begins(str(tmp_path / "outer.pftrace")) == ["after inner"]


def test_warnings_as_errors_never_stop_the_writer(tmp_path):
    path = str(tmp_path / "t.pftrace")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with stepscope.trace(path):
            stepscope.pop_range()  # unmatched: warns from the writer
            with stepscope.annotate("kept"):
                pass
    assert begins(path) == ["kept"]
