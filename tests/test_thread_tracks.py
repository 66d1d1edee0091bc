"""Each OS thread keeps its own thread track, although Python reuses thread idents.

A thread that has ended hands its ``threading.get_ident()`` to the next thread started, so the
ident alone cannot tell their events apart. Real threads are started here one after another (the
case that reuses idents), and the official schema judges on which track each event landed.
Runs on the C recorder and again on the pure-Python one (see test_fast.py).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

import stepscope
from perfetto_decode import decode
from stepscope.core import tracks as _tracks


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "t.pftrace")


def _owner(d, e):
    """(tid, name) of the thread track an event was drawn on."""
    td = d.tracks[e.track]
    assert td.HasField("thread"), f"event {e.name!r} is not on a thread track"
    return td.thread.tid, td.thread.thread_name


def _check_each_thread_owns_its_events(d, truth: dict[str, tuple[int, str]],
                                       events_per_thread: int) -> None:
    """Every named event "<k>-..." lies on the track of thread k; every thread track holds
    exactly its own events, begins, ends and instants alike."""
    by_track: dict[int, list] = {}
    for e in d.events:
        if d.tracks[e.track].HasField("thread"):
            by_track.setdefault(e.track, []).append(e)
    owners = {}
    for uuid, evs in by_track.items():
        names = {e.name.split("-")[0] for e in evs if e.name}
        if names <= {"main"}:
            continue
        assert len(names) == 1, f"one track holds the events of threads {sorted(names)}"
        key = names.pop()
        assert key not in owners, f"thread {key} has two tracks"
        owners[key] = uuid
        assert _owner(d, evs[0]) == truth[key]
        assert len(evs) == events_per_thread, (key, [(e.type, e.name) for e in evs])
    assert sorted(owners) == sorted(truth)


def _join_fully(th: threading.Thread) -> None:
    """Join, then wait until the OS thread is gone: only then can the next thread get its stack,
    and so its ident (glibc reuses a stack once the kernel has cleared the thread's id)."""
    th.join()
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/self/task/{th.native_id}") and time.monotonic() < deadline:
        time.sleep(0.001)


def _run_threads(n, body, names=None):
    """Start n threads one after another (each joined before the next starts)."""
    truth, idents = {}, []
    for i in range(n):
        def run(i=i):
            t = threading.current_thread()
            truth[str(i)] = (t.native_id, t.name)
            idents.append(t.ident)
            body(str(i))
        th = threading.Thread(target=run, name=(names or "worker-{}").format(i))
        th.start()
        _join_fully(th)
    return truth, idents


def _record(key):
    with stepscope.annotate(f"{key}-range"):
        stepscope.push_range(f"{key}-inner")
        stepscope.pop_range()
    stepscope.mark(f"{key}-mark")


@pytest.mark.parametrize("n", [3, 40])
def test_threads_that_reuse_an_ident_keep_their_own_tracks(path, n):
    # all of them end before the only flush (at stop): 5 events each (B B E E I)
    with stepscope.trace(path):
        truth, idents = _run_threads(n, _record)
    assert len(set(idents)) < n  # the case under test happened: idents were reused
    d = decode(path)
    _check_each_thread_owns_its_events(d, truth, 5)
    tids = [d.tracks[u].thread.tid for u in d.tracks if d.tracks[u].HasField("thread")]
    assert len(tids) == len(set(tids)) == n  # the main thread records nothing


def test_reused_ident_across_flushes_and_late_events(path):
    # A records, a flush takes that, A records more and ends; B takes A's ident and starts
    # (recording nothing yet) before the next flush: A's late events stay A's. Then B records.
    go_b, b_started = threading.Event(), threading.Event()
    truth = {}

    def a():
        t = threading.current_thread()
        truth["A"] = (t.native_id, t.name)
        stepscope.mark("A-early")
        sess.flush()
        stepscope.mark("A-late")

    def b():
        t = threading.current_thread()
        truth["B"] = (t.native_id, t.name)
        b_started.set()
        go_b.wait()
        stepscope.mark("B-1")
        stepscope.mark("B-2")

    with stepscope.trace(path) as sess:
        ta = threading.Thread(target=a, name="thread-A")
        ta.start()
        _join_fully(ta)
        tb = threading.Thread(target=b, name="thread-B")
        tb.start()
        b_started.wait()
        sess.flush()  # A's late mark is in this batch; B holds the ident now
        go_b.set()
        tb.join()
        sess.flush()
    assert ta.ident == tb.ident  # the case under test happened
    d = decode(path)
    _check_each_thread_owns_its_events(d, truth, 2)


def test_a_thread_started_before_the_session_and_its_successor(path):
    # the first thread exists before tracing starts (no start hook saw it); the second one
    # reuses its ident after it ended: each keeps its own events
    truth, ready, go = {}, threading.Event(), threading.Event()

    def first():
        t = threading.current_thread()
        truth["P"] = (t.native_id, t.name)
        ready.set()
        go.wait()
        stepscope.mark("P-mark")

    def second():
        t = threading.current_thread()
        truth["Q"] = (t.native_id, t.name)
        stepscope.mark("Q-mark")
        done.wait()

    done = threading.Event()
    tp = threading.Thread(target=first, name="pre-session")
    tp.start()
    ready.wait()
    with stepscope.trace(path):
        go.set()
        _join_fully(tp)
        tq = threading.Thread(target=second, name="in-session")
        tq.start()
        while "Q" not in truth:
            threading.Event().wait(0.001)
        # both marks are recorded and the successor is alive at the flush
    done.set()
    tq.join()
    assert tp.ident == tq.ident  # the case under test happened
    d = decode(path)
    _check_each_thread_owns_its_events(d, truth, 1)


def test_thread_names_of_ended_threads_are_not_kept_forever(path):
    # the start hook's names are dropped once a thread has ended and its events were written
    with stepscope.trace(path, flush_interval_s=60) as sess:
        _run_threads(30, lambda key: None)
        sess.flush()
        sess.flush()
        assert len(_tracks._thread_names) == 0
        _run_threads(2, _record)
        assert len(_tracks._thread_names) == 2  # not flushed yet: still needed
    assert "1-mark" in {e.name for e in decode(path).events}


def test_a_dropped_batch_still_tells_who_holds_an_ident(path):
    # the writer drops a batch it cannot keep up with; the thread marks in it still count, so
    # the next thread's later events do not land on the track of the one before
    hold, truth = threading.Event(), {}

    def a():
        t = threading.current_thread()
        truth["A"] = (t.native_id, t.name)
        stepscope.mark("A-kept")
        sess.flush()

    def b():
        t = threading.current_thread()
        truth["B"] = (t.native_id, t.name)
        stepscope.mark("B-lost")
        hold.wait()
        stepscope.mark("B-kept")

    with stepscope.trace(path) as sess:
        ta = threading.Thread(target=a, name="thread-A")
        ta.start()
        _join_fully(ta)
        tb = threading.Thread(target=b, name="thread-B")
        tb.start()
        while "B" not in truth:
            threading.Event().wait(0.001)
        with sess._lock:  # noqa: SLF001 - drop this batch as a backlog would
            io = sess._pipeline  # noqa: SLF001
            io.wait()
            # a backlog added to the I/O thread's count and taken off again, under its lock:
            # the flush may still queue a packet, whose write the I/O thread subtracts
            # (setting the count back to a saved value lost that, and the close then
            # closed the file under the write: EBADF)
            with io._io_cv:  # noqa: SLF001
                io._io_pending += sess.buffer_bytes  # noqa: SLF001
            sess._flush_locked(False)  # noqa: SLF001
            with io._io_cv:  # noqa: SLF001
                io._io_pending -= sess.buffer_bytes  # noqa: SLF001
        hold.set()
        tb.join()
    d = decode(path)
    assert sess.dropped >= 1
    kept = {e.name: _owner(d, e) for e in d.events if e.name in ("A-kept", "B-kept", "B-lost")}
    assert kept == {"A-kept": truth["A"], "B-kept": truth["B"]}
    assert ta.ident == tb.ident  # the case under test happened


def test_a_thread_that_records_nothing_gets_no_track(path):
    # the pure-Python buffer marks every thread that starts while recording (the start hook):
    # one that never records must leave no empty thread track in the file
    with stepscope.trace(path) as sess:
        idle = threading.Thread(target=time.sleep, args=(0.01,), name="idle-thread")
        idle.start()
        idle.join()
        sess.flush()
        stepscope.mark("main-1")
    d = decode(path)
    names = [d.tracks[u].thread.thread_name for u in d.tracks if d.tracks[u].HasField("thread")]
    assert names == [threading.current_thread().name]


@pytest.mark.parametrize("other_thread", [False, True], ids=["one-thread", "two-threads"])
def test_steps_go_to_the_steps_track_of_the_thread_that_makes_them(tmp_path, other_thread):
    """The profiler records step events under ``ident | STEPS``: the writer puts them on a
    ``steps`` child of that thread's track, whether a flush holds one thread and its steps (two
    masks) or other threads too (the sort by ident), and the thread's ranges stay on its own."""
    from stepscope import _schema as S
    from stepscope.profiler import Profiler

    prof = Profiler(tmp_path, schedule=None, run_id="r", host_metrics=False, report=False,
                    use_env=False, torch=False)
    prof.start()
    th = None
    if other_thread:
        go = threading.Event()

        def work() -> None:
            with stepscope.annotate("worker"), prof.phase("w"):
                go.wait(5)

        th = threading.Thread(target=work, name="other")
        th.start()
    for _ in range(3):
        with prof.phase("Forward"):
            time.sleep(0.001)
        prof.step()
    if th is not None:
        go.set()
        th.join()
    prof.stop()
    d = decode(str(tmp_path / "r" / "rank0.summary.pftrace"))
    main = next(u for u, t in d.tracks.items() if t.HasField("thread")
                and t.thread.tid == threading.get_native_id())
    (steps,) = [u for u, t in d.tracks.items() if t.name == S.STEPS_TRACK_NAME]
    assert d.tracks[steps].parent_uuid == main
    assert [e.name for e in d.events if e.track == steps and e.type == "B"] == [
        "step 0", "step 1", "step 2"]
    assert [e.name for e in d.events if e.track == main and e.type == "B"] == ["Forward"] * 3
    if other_thread:
        (w,) = [e for e in d.events if e.name == "w"]
        assert d.tracks[w.track].thread.thread_name == "other"


def test_a_thread_renamed_after_its_first_flush_is_shown_with_its_new_name(path):
    """A thread records, a flush writes its track, it renames itself, records again and ends
    before the next flush (its Thread object still held): its one track is named as it was
    last (the track kept its first name: the name was read from the running threads only)."""
    def work():
        with stepscope.annotate("before"):
            pass
        stepscope.current().flush()
        threading.current_thread().name = "renamed"
        with stepscope.annotate("after"):
            pass

    with stepscope.trace(path):
        th = threading.Thread(target=work, name="first")
        th.start()
        _join_fully(th)
    d = decode(path)
    owners = {e.name: _owner(d, e) for e in d.events if e.name}
    assert owners == {"before": (th.native_id, "renamed"), "after": (th.native_id, "renamed")}
    from stepscope import analysis

    with analysis.open(path, engine="embedded") as db:
        got = db.query("SELECT s.name, t.name AS thread FROM slice s JOIN thread_track tt "
                       "ON tt.id = s.track_id JOIN thread t USING (utid) ORDER BY s.ts")
        assert [tuple(r.values()) for r in got] == [("before", "renamed"), ("after", "renamed")]
