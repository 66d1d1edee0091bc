"""A tracing session: turns recording on, owns the output files and the two background threads.

* The **writer thread** wakes every 100 ms (down to 2 ms while events pour in), and every
  ``flush_interval_s`` (or when the buffer is a quarter full) drains the recorder, splits events
  by thread and level, and has each sink encode them, with short GIL turns meanwhile.
* The **I/O thread** compresses and writes what the sinks produced, so a slow disk never stalls
  encoding. When recorded events pass the buffer cap (encoding cannot keep up) or bytes waiting
  for the disk pass half of it, events are dropped instead, counted, and the count is written to
  the trace (counter track ``stepscope dropped events``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import random
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable

import numpy as np

from .. import _clock, ranks
from .._schema import (
    ARG_DROPPED,
    ASYNC_TRACK_NAME,
    CAT_STEPSCOPE,
    DROPPED_TRACK_NAME,
    LEVEL_DETAIL,
    LEVEL_SUMMARY,
    PROCESS_NAME,
)
from ..format import wire as w
from ..record import recorder as _recorder
from ..record.recorder import BEGIN, COUNTER, END, INSTANT, Blob
from ..write.sink import Sink
from . import hooks
from . import lifecycle as _lifecycle

# bytes a recorded event holds (for the buffer cap): 3 int64 words in the C buffer; list slots
# and int objects in the pure-Python one
RAW_EVENT_BYTES = 24 if _recorder.fast is not None else 88
BLOB_BYTES = 400  # a Blob with a small args dict
MIN_BUFFER_BYTES = 1 << 16  # the smallest buffer_bytes (options and Profiler check it too)
_MIN_WAKE_S = 0.002
_FLUSH_SWITCH_S = 0.0002  # GIL switch interval while the writer flushes
_WAKE_S = 0.1  # a wake costs ~100 us of CPU on small VMs: 20 ms wakes were 0.5% of a core
# While the program exits with other threads still alive (daemon threads, busy ones keep
# taking the GIL: unbounded, the last flush took 3-16 s), the flushes that finish the files
# encode for at most this long; what is left then is dropped and counted. With no thread but
# the exiting one (and stepscope's own), nothing competes: the flush writes everything.
EXIT_FLUSH_S = 1.0
_FLUSH_PIECE = 1 << 13  # events encoded between two looks at the exit deadline (~20 ms)
_current: Session | None = None


def current() -> Session | None:
    """The active session, or None."""
    return _current


@contextlib.contextmanager
def _short_gil_turns():
    """Shorten the GIL switch interval while the writer flushes.

    numpy releases the GIL inside most operations; with a program thread busy in Python, each
    release costs the writer a whole switch interval (5 ms) to get the GIL back, so a flush of a
    few dozen operations took 300 ms instead of 30 and the buffer overflowed. The program loses
    no more CPU than the flush needs; the value it had is restored after (unless it changed it
    meanwhile).
    """
    old = sys.getswitchinterval()
    sys.setswitchinterval(min(old, _FLUSH_SWITCH_S))
    short = sys.getswitchinterval()  # as stored (whole microseconds), for the comparison below
    global _switch_to_restore
    _switch_to_restore = (old, short)
    try:
        yield
    finally:
        _restore_switch()


# (value before, value set) of a flush in progress that shortened the interval
_switch_to_restore: tuple[float, float] | None = None


def _restore_switch() -> None:
    """The interval back as it was before the flush, unless the program changed it meanwhile.
    Also run in a child forked during a flush (no writer there to end it)."""
    global _switch_to_restore
    if _switch_to_restore is not None:
        old, short = _switch_to_restore
        _switch_to_restore = None
        if sys.getswitchinterval() == short:
            sys.setswitchinterval(old)


class Emitter:
    """Events with explicit timestamps and tracks, from one producer (one sequence per file)."""

    def __init__(self, clock: str, level: int):
        self.clock_id = _clock.base_clock_id(clock)
        self.level = level
        self._events: list[tuple] = []  # (ts, order, tiebreak, seq no, blob)
        self._batch: list[tuple] | None = None
        self._count = itertools.count()

    def _add(self, ts: int, order: int, tiebreak: int, blob: Blob) -> None:
        # list.append and next(count) are atomic: producers on several threads need no lock
        (self._batch if self._batch is not None else self._events).append(
            (int(ts), order, tiebreak, next(self._count), blob))

    @contextlib.contextmanager
    def batch(self):
        """Hand events over all at once (one atomic ``extend``): a flush never splits them.

        Needed when events do not arrive in time order (a converter emitting kernels, then
        copies): a flush between them would force later-stamped-earlier events to be clamped.
        Use from one thread at a time.
        """
        self._batch = []
        try:
            yield self
        finally:
            events, self._batch = self._batch, None
            self._events.extend(events)

    def begin(self, ts: int, name: str, track: int, category: str | None = None,
              args: dict | None = None, flow_ids=None, terminating_flow_ids=None) -> None:
        eid = _recorder.event_id(name, (category,) if category else ())
        self._add(ts, 1, 0, Blob(BEGIN, eid, self.level, track, args, flow_ids,
                                 terminating_flow_ids))

    def end(self, ts: int, track: int, flow_ids=None, terminating_flow_ids=None) -> None:
        self._add(ts, 0, 0, Blob(END, 0, self.level, track, None, flow_ids, terminating_flow_ids))

    def complete(self, ts: int, dur: int, name: str, track: int, category: str | None = None,
                 args: dict | None = None, flow_ids=None, terminating_flow_ids=None) -> None:
        """A whole slice; slices of one emitter may arrive in any order (sorted at flush)."""
        eid = _recorder.event_id(name, (category,) if category else ())
        ts, dur = int(ts), max(0, int(dur))
        # at equal times: ends before begins; longer slices open first and close last
        self._add(ts, 1, -(ts + dur), Blob(BEGIN, eid, self.level, track, args, flow_ids,
                                          terminating_flow_ids))
        # a zero-length slice ends after it begins, and after other slices begin there
        self._add(ts + dur, 0 if dur else 2, -ts, Blob(END, 0, self.level, track))

    def completes(self, ts: list[int], dur: list[int], begins: list[Blob],
                  ends: list[Blob]) -> None:
        """Whole slices in bulk, as ``complete`` orders them (ints, ``dur`` >= 0; one blob
        object may serve many events): a converter of thousands of events (torch's operators)
        spends its time here, not in a call per event."""
        count = self._count
        out = []
        add = out.append
        for t, d, b, e in zip(ts, dur, begins, ends, strict=True):
            add((t, 1, -(t + d), next(count), b))
            add((t + d, 0 if d else 2, -t, next(count), e))
        (self._batch if self._batch is not None else self._events).extend(out)

    def instant(self, ts: int, name: str, track: int, category: str | None = None,
                args: dict | None = None) -> None:
        eid = _recorder.event_id(name, (category,) if category else ())
        self._add(ts, 1, 0, Blob(INSTANT, eid, self.level, track, args))

    def counter(self, ts: int, track: int, value: float) -> None:
        self._add(ts, 1, 0, Blob(COUNTER, 0, self.level, track, value=value))

    def take(self) -> list[tuple]:
        n = len(self._events)
        events = self._events[:n]
        del self._events[:n]
        events.sort(key=lambda e: e[:4])
        return events


class Session:
    """Recording on/off, output files (sinks), tracks, and the writer and I/O threads."""

    def __init__(self, path: str | os.PathLike | None = None, *, detail: bool = True,
                 buffer_bytes: int = 32 << 20, flush_interval_s: float = 1.0,
                 compress: bool = True, rank: int | None = None,
                 process_name: str | None = None):
        if buffer_bytes < MIN_BUFFER_BYTES:
            raise ValueError(f"buffer_bytes={buffer_bytes} is too small (minimum 64 KiB)")
        if not 0 < flush_interval_s <= 60:
            raise ValueError(f"flush_interval_s={flush_interval_s} must be in (0, 60]")
        self.buffer_bytes = int(buffer_bytes)
        self.flush_interval_s = float(flush_interval_s)
        self.compress = compress
        self.detail = detail
        self.rank = ranks.detect().rank if rank is None else int(rank)
        self.pid = os.getpid()
        self.process_name = process_name or PROCESS_NAME.format(rank=self.rank,
                                                                host=socket.gethostname())
        self._uuid_base = random.getrandbits(40) << 20
        self._uuid_next = 1
        self.tracks: dict[int, bytes] = {}  # uuid -> TrackDescriptor bytes
        self.process_uuid = self._register(self._process_descriptor)
        self._threads: dict[int, tuple[int, int, str]] = {}  # ident -> (uuid, tid, name)
        self._native_threads: dict[int, int] = {}  # system tid -> uuid (native_thread_track)
        self._ended_before: set[int] = set()  # see _forget_ended_threads
        self._counter_tracks: dict[str, int] = {}
        self._async_free: list[int] = []
        self._emitters: list[Emitter] = []
        self.sinks: list[Sink] = []
        self._lock = threading.RLock()  # tracks, sinks, flushes
        self._io: queue.Queue = queue.Queue()
        self._io_pending = 0  # bytes queued for the disk
        self._io_cv = threading.Condition()
        self.dropped = 0
        self._dropped_written = 0
        self._lost_seen = _recorder.lost_events()
        self._dropped_track: int | None = None
        self._gpus: dict[int, int] = {}  # CUDA device -> its track (gpu_track)
        self._flush_requested = threading.Event()
        self._stopping = threading.Event()
        self._writer: threading.Thread | None = None
        self._io_thread: threading.Thread | None = None
        self._last_flush = 0.0
        self._deadline: float | None = None  # set when the program exits (see exiting)
        self.started = False
        self.stopped = False
        self.on_close: list[Callable[[Sink], None]] = []
        # run when the session starts stopping, whoever stops it (stop(), atexit, a signal, an
        # unhandled exception), while it still records and writes
        self.before_stop: list[Callable[[], None]] = []
        # run at the start of every flush, before emitters are taken (e.g. resolving CUDA events)
        self.flush_hooks: list[Callable[[], None]] = []
        self._gpu_timer = None
        self.errors: list[str] = []
        if path is not None:
            self.add_sink(path, levels=(LEVEL_SUMMARY, LEVEL_DETAIL))

    # -- tracks ------------------------------------------------------------------------------
    def _new_uuid(self) -> int:
        uuid = self._uuid_base | self._uuid_next
        self._uuid_next += 1
        return uuid

    def _register(self, make: Callable[[int], bytes]) -> int:
        uuid = self._new_uuid()
        self.tracks[uuid] = make(uuid)
        return uuid

    def _process_descriptor(self, uuid: int) -> bytes:
        return (w.f_varint(w.TD_UUID, uuid)
                + w.f_bytes(w.TD_PROCESS, w.f_varint(w.PD_PID, self.pid)
                            + w.f_str(w.PD_NAME, self.process_name)))

    def new_track(self, name: str, parent: int | None = None) -> int:
        """A custom slice track (a GPU, a stream, a queue), child of ``parent`` or the process."""
        parent = self.process_uuid if parent is None else parent
        with self._lock:
            return self._register(lambda u: w.f_varint(w.TD_UUID, u)
                                  + w.f_varint(w.TD_PARENT_UUID, parent)
                                  + w.f_str(w.TD_NAME, str(name)))

    def gpu_track(self, device: int, name: str) -> int:
        """The track of CUDA device ``device`` under the process, made once and shared by every
        GPU producer (CUPTI activity, CUDA-event ranges): one GPU in the UI holds all its tracks.
        The first producer names it."""
        with self._lock:
            t = self._gpus.get(device)
            if t is None:
                t = self._gpus[device] = self.new_track(name)
            return t

    def new_counter_track(self, name: str, unit: str | None = None,
                          parent: int | None = None) -> int:
        """A counter track; ``unit`` is "ns", "count", "bytes" or any unit name such as "%"."""
        parent = self.process_uuid if parent is None else parent
        counter = b""
        if unit in w.COUNTER_UNITS:
            counter = w.f_varint(w.CD_UNIT, w.COUNTER_UNITS[unit])
        elif unit:
            counter = w.f_str(w.CD_UNIT_NAME, unit)
        with self._lock:
            return self._register(lambda u: w.f_varint(w.TD_UUID, u)
                                  + w.f_varint(w.TD_PARENT_UUID, parent)
                                  + w.f_str(w.TD_NAME, str(name))
                                  + w.f_bytes(w.TD_COUNTER, counter))

    def counter_track(self, name: str, unit: str | None = None) -> int:
        """The process-level counter track of that name, made on first use."""
        uuid = self._counter_tracks.get(name)
        if uuid is None:
            with self._lock:
                uuid = self._counter_tracks.get(name)
                if uuid is None:
                    uuid = self._counter_tracks[name] = self.new_counter_track(name, unit)
        return uuid

    def acquire_async_track(self) -> int:
        """A track for one async range; overlapping ranges get sibling tracks of one name."""
        try:
            return self._async_free.pop()
        except IndexError:
            return self.new_track(ASYNC_TRACK_NAME)

    def release_async_track(self, uuid: int) -> None:
        self._async_free.append(uuid)

    def thread_track(self, ident: int | None = None) -> int:
        """The track of a thread (``threading.get_ident()``; default: the calling thread)."""
        with self._lock:
            return self._thread_track(threading.get_ident() if ident is None else ident)

    def native_thread_track(self, tid: int, name: str) -> int:
        """The track of a thread by its system id, for threads Python has no ``Thread`` for (a
        C++ thread such as torch's autograd engine); made once per tid, named ``name``."""
        with self._lock:
            for uuid, known_tid, _ in self._threads.values():
                if known_tid == tid:
                    return uuid
            uuid = self._native_threads.get(tid)
            if uuid is None:
                uuid = self._native_threads[tid] = self._register(
                    lambda u: w.f_varint(w.TD_UUID, u)
                    + w.f_varint(w.TD_PARENT_UUID, self.process_uuid)
                    + w.f_bytes(w.TD_THREAD, w.f_varint(w.THD_PID, self.pid)
                                + w.f_varint(w.THD_TID, int(tid)) + w.f_str(w.THD_NAME, name)))
            return uuid

    def _thread_track(self, ident: int, exclude: frozenset[int] = frozenset()) -> int:
        """The track of the thread that holds (or last held) ``ident``. ``exclude``: native ids
        of threads known not to be the one meant (those that marked their start later)."""
        known = self._threads.get(ident)
        thread = threading._active.get(ident)  # noqa: SLF001 - the only map from ident to Thread
        if thread is not None and _tid(thread, ident) not in exclude:
            tid, name = _tid(thread, ident), thread.name
        elif ident in _started_threads and _started_threads[ident][0] not in exclude:
            tid, name = _started_threads[ident]  # ended before the writer saw it
        elif known is not None and known[1] not in exclude:
            return known[0]
        else:
            thread = _find_dead_thread(ident, exclude)
            if thread is not None:
                tid, name = _tid(thread, ident), thread.name
            else:
                tid, name = ident & 0x7FFFFFFF, f"thread {ident:#x}"
        return self._set_holder(ident, tid, name)

    def _set_holder(self, ident: int, tid: int, name: str) -> int:
        """Make thread ``tid`` the holder of ``ident``: a renamed thread keeps its track, a new
        thread that reuses the ident gets its own."""
        known = self._threads.get(ident)
        if known is not None and known[1:] == (tid, name):
            return known[0]
        uuid = known[0] if known is not None and known[1] == tid else self._new_uuid()
        self._threads[ident] = (uuid, tid, name)
        self.tracks[uuid] = (w.f_varint(w.TD_UUID, uuid)
                             + w.f_varint(w.TD_PARENT_UUID, self.process_uuid)
                             + w.f_bytes(w.TD_THREAD, w.f_varint(w.THD_PID, self.pid)
                                         + w.f_varint(w.THD_TID, tid)
                                         + w.f_str(w.THD_NAME, name)))
        return uuid

    def _unmarked_track(self, ident: int, exclude: frozenset[int]) -> int:
        """The track of events of ``ident`` that follow no thread mark in this batch: those of
        the thread that held the ident at the last flush, unless a newer holder never marked
        its start (pure Python, a thread the start hook did not see). ``exclude``: native ids
        of the threads that mark their start later in this batch."""
        known = self._threads.get(ident)
        if known is not None and known[1] not in exclude:
            thread = threading._active.get(ident)  # noqa: SLF001
            tid = None if thread is None else _tid(thread, ident)
            if tid == known[1]:
                return self._set_holder(ident, tid, thread.name)  # renamed: same track
            if (thread is None or _recorder.fast is not None or tid in exclude
                    or tid in _thread_names):
                return known[0]  # the newer holder marks its own start
        return self._thread_track(ident, exclude)

    def _marked_track(self, ident: int, native_id: int) -> int:
        """The track of the thread whose start mark says (native id, ident)."""
        known = self._threads.get(ident)
        if known is not None and known[1] == native_id:
            return known[0]  # the same thread marked again (a new recording)
        thread = threading._active.get(ident)  # noqa: SLF001
        if thread is not None and _tid(thread, ident) == native_id:
            name = thread.name
        elif native_id in _thread_names:
            name = _thread_names[native_id]
        else:
            thread = _find_dead_thread(ident, native_id=native_id)
            name = thread.name if thread is not None else f"thread {native_id}"
        return self._set_holder(ident, native_id, name)

    def _forget_ended_threads(self) -> None:
        """Drop the start-hook names of threads found ended at two flushes in a row: every
        event they recorded has been drained by then (bounds the table for endless threads)."""
        if not _thread_names:
            self._ended_before = set()
            return
        alive = {_tid(t, i) for i, t in list(threading._active.items())}  # noqa: SLF001
        ended = set(_thread_names) - alive
        for native_id in ended & self._ended_before:
            _thread_names.pop(native_id, None)
        self._ended_before = ended

    # -- sinks -------------------------------------------------------------------------------
    def add_sink(self, path: str | os.PathLike,
                 levels: Iterable[int | str] = (LEVEL_SUMMARY, LEVEL_DETAIL)) -> Sink:
        lv = frozenset(LEVEL_SUMMARY if x in (LEVEL_SUMMARY, "summary") else
                       LEVEL_DETAIL if x in (LEVEL_DETAIL, "detail") else _bad_level(x)
                       for x in levels)
        directory = os.path.dirname(os.fspath(path))
        if directory:
            os.makedirs(directory, exist_ok=True)
        with self._lock:
            if self.started:  # what was recorded before belongs to the files open before
                self._flush_locked(False)
            sink = Sink(path, lv, self.compress, self._enqueue)
            sink.warn_unmatched = not self.started
            sink.clock_snapshot(_clock.snapshot())
            self.sinks.append(sink)
            if self.started:
                self._flush_sink_metadata(sink)
        return sink

    def close_sink(self, sink: Sink) -> None:
        """Flush, end open slices, write a last clock snapshot and close the file."""
        with self._lock:
            if sink not in self.sinks:
                return
            with _short_gil_turns():  # as the writer's: busy threads return the GIL sooner
                self._flush_locked(False)
            now = _clock.now()
            for seq in sink.sequences.values():
                sink.close_open_slices(seq, now)
            sink.clock_snapshot(_clock.snapshot())
            self.sinks.remove(sink)
            self._send(sink)
        self._wait_io()
        sink.close_file()
        for callback in list(self.on_close):
            try:
                callback(sink)
            except Exception as exc:
                self._error(f"on_close callback failed: {exc!r}")

    def gpu_timer(self):
        """The session's CUDA-event timer for ``annotate(..., gpu=True)`` (None without CuPy)."""
        if self._gpu_timer is None:
            with self._lock:
                if self._gpu_timer is None:
                    timer = hooks.gpu_timer_factory(self)  # registered by stepscope.gpu
                    if timer is None:
                        return None
                    self._gpu_timer = timer
                    self.flush_hooks.append(timer.poll)
        return self._gpu_timer

    def emitter(self, clock: str = "monotonic", level: int = LEVEL_DETAIL) -> Emitter:
        em = Emitter(clock, level)
        with self._lock:
            self._emitters.append(em)
        return em

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> Session:
        global _current
        if self.started:
            raise RuntimeError("this session was already started")
        if _current is not None:
            raise RuntimeError("another stepscope session is active: stop() it first")
        self.started = True
        _current = self
        _recorder.clear()  # late events of an earlier session (a race at its stop)
        _recorder.blobs.clear()
        self._last_flush = time.monotonic()
        for sink in self.sinks:
            self._flush_sink_metadata(sink)
        self._io_thread = threading.Thread(target=self._io_loop, name="stepscope-io",
                                           daemon=True)
        self._writer = threading.Thread(target=self._writer_loop, name="stepscope-writer",
                                        daemon=True)
        self._io_thread.start()
        self._writer.start()
        _recorder.set_state(True, self.detail)
        if threading.getprofile() is None:  # never displace a user's profiler
            threading.setprofile(_note_thread_start)
        _lifecycle.install(self)
        return self

    def set_detail(self, on: bool) -> None:
        self.detail = bool(on)
        if self.started and not self.stopped:
            _recorder.set_state(True, self.detail)

    def exiting(self) -> None:
        """The program is exiting (atexit, an unhandled exception, SIGTERM): from now on the
        flushes that finish the files stop encoding ``EXIT_FLUSH_S`` seconds from here, and
        drop (and count) what is left, so that busy daemon threads cannot hold the exit (only
        while such threads are alive: see ``_out_of_time``)."""
        if self._deadline is None:
            self._deadline = time.monotonic() + EXIT_FLUSH_S

    def _exit_deadline(self) -> float | None:
        """The exit deadline; set on first sight of interpreter exit (atexit handlers, which run
        in the main thread once it is no longer alive; e.g. the profiler's own)."""
        if self._deadline is None:
            main = threading.main_thread()
            if threading.current_thread() is main and not main.is_alive():
                self.exiting()
        return self._deadline

    def _out_of_time(self) -> bool:
        """Past the exit deadline while a thread other than the exiting main one (and
        stepscope's own) is still alive: only then may the exit flush drop events. Such threads
        take the GIL from the flush; a program exiting alone loses nothing, however long its
        last flush takes."""
        deadline = self._deadline
        if deadline is None or time.monotonic() <= deadline:
            return False
        skip = (threading.current_thread(), threading.main_thread())
        return any(t not in skip and t.is_alive() and not t.name.startswith("stepscope-")
                   for t in threading.enumerate())

    def stop(self) -> None:
        """Stop recording, write everything, close all files. Safe to call twice."""
        global _current
        if not self.started or self.stopped or self._stopping.is_set():
            return
        self._exit_deadline()
        self._stopping.set()
        for hook in list(self.before_stop):  # e.g. the profiler closing its open window
            try:
                hook()
            except Exception as exc:
                self._error(f"a before-stop hook failed: {exc!r}")
        self.stopped = True
        _recorder.set_state(False, False)
        self._flush_requested.set()
        try:
            if self._writer is not None and self._writer is not threading.current_thread():
                self._writer.join(timeout=30)
            with self._lock:
                for sink in list(self.sinks):
                    try:
                        self.close_sink(sink)
                    except Exception as exc:  # one bad file must not keep the others open
                        self._error(f"closing {sink.path} failed: {exc!r}")
                        sink.close_file()
            self._io.put((None, None))
            if self._io_thread is not None and self._io_thread is not threading.current_thread():
                self._io_thread.join(timeout=30)
        finally:
            if _current is self:
                _current = None
        if threading.getprofile() is _note_thread_start:
            threading.setprofile(None)
        _lifecycle.uninstall(self)

    def withdraw(self, event: tuple[int, int, int]) -> bool:
        """Undo a recorded event (from ``_recorder.record``/``begin``) that no file has taken."""
        with self._lock:
            return _recorder.withdraw(event)

    def flush(self, discard_detail: bool = False, timeout: float | None = None,
              wait: bool = True) -> bool:
        """Encode everything recorded so far and, with ``wait``, wait until it is on disk;
        ``discard_detail`` drops detail events. False if another flush held the session longer
        than ``timeout`` seconds."""
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            self._flush_locked(discard_detail)
        finally:
            self._lock.release()
        if wait:
            self._wait_io(timeout)
        return True

    # -- the writer ---------------------------------------------------------------------------
    def _writer_loop(self) -> None:
        # a shorter flush interval wakes more often (never busily)
        top = max(_MIN_WAKE_S, min(_WAKE_S, self.flush_interval_s))
        wait = top
        while not self._stopping.is_set():
            self._flush_requested.wait(wait)
            if self._stopping.is_set():
                break
            raw = (_recorder.pending_words() // 3 * RAW_EVENT_BYTES
                   + len(_recorder.blobs) * BLOB_BYTES)
            # wake often while events pour in (a burst reaches the early-flush mark between two
            # 100 ms wakes, and then the cap: drops), rarely while the program is quiet
            wait = (max(_MIN_WAKE_S, wait / 2) if raw >= self.buffer_bytes // 16
                    else min(top, wait * 2))
            due = (self._flush_requested.is_set()
                   or time.monotonic() - self._last_flush >= self.flush_interval_s
                   or raw >= self.buffer_bytes // 4)  # early: drops only for a real backlog
            self._flush_requested.clear()
            if due:
                try:
                    with self._lock, _short_gil_turns():
                        self._flush_locked(False)
                except Exception as exc:  # never let the writer die silently
                    self._error(f"flush failed: {exc!r}")

    def _error(self, message: str) -> None:
        """Report a background failure once per message; never raises (even under -W error)."""
        if message in self.errors:
            return
        if len(self.errors) < 100:
            self.errors.append(message)
        try:
            warnings.warn(f"stepscope: {message}", RuntimeWarning, stacklevel=2)
        except Exception:
            pass

    def _flush_sink_metadata(self, sink: Sink) -> None:
        sink.describe(self.tracks)
        self._send(sink)

    def _flush_locked(self, discard_detail: bool) -> None:
        self._last_flush = time.monotonic()
        for hook in list(self.flush_hooks):
            try:
                hook()
            except Exception as exc:
                self._error(f"a flush hook failed: {exc!r}")
        chunk = _recorder.drain()
        lost = _recorder.lost_events()  # events the C buffer could not store (out of memory)
        self.dropped += lost - self._lost_seen
        self._lost_seen = lost
        for sink in self.sinks:  # a failed write: its events count as dropped, files restart
            self.dropped += sink.recover()
        pending_raw = len(chunk) // 3 * RAW_EVENT_BYTES + len(_recorder.blobs) * BLOB_BYTES
        backlog = self._io_pending > self.buffer_bytes // 2 or pending_raw > self.buffer_bytes
        self._exit_deadline()
        late = self._out_of_time()  # exiting, out of time, other threads still busy
        if len(chunk) and (backlog or late):
            self._split(chunk, True, marks_only=True)  # who holds which ident, still
            self._drop(chunk)  # encoding or the disk cannot keep up: drop, count, move on
            chunk = chunk[:0]
        emitted = []
        for em in self._emitters:
            events = em.take()
            if late:
                self.dropped += len(events)
            elif events:  # one blob id per event, shared by every file that takes it
                ids = -np.array([_recorder.register_blob(e[4]) for e in events], dtype=np.int64)
                emitted.append((em, ids, np.array([e[0] for e in events], dtype=np.int64)))
        # in pieces, with a look at the exit deadline (which stop() may set meanwhile) between
        lo = 0
        while lo < len(chunk):
            if self._out_of_time():
                rest = chunk[lo:]
                self._split(rest, True, marks_only=True)
                self._drop(rest)  # out of time: counted, not written
                break
            part = chunk[lo:lo + 3 * _FLUSH_PIECE]
            lo += len(part)
            groups = self._split(part, discard_detail)
            for sink in self.sinks:
                sink.describe(self.tracks)
                for ident, uuid, codes, ts, levels in groups:
                    mask = self._level_mask(levels, sink.levels)
                    if mask is not None:
                        codes, ts = codes[mask], ts[mask]
                    seq = sink.sequence(("thread", ident, uuid), uuid, _clock.MONOTONIC)
                    sink.add_events(seq, codes, ts)
            for codes in [g[2] for g in groups]:
                for k in codes[codes < 0].tolist():
                    _recorder.blobs.pop(-k, None)
        self._forget_ended_threads()
        for sink in self.sinks:
            sink.describe(self.tracks)
            for em, codes, ts in emitted:
                if em.level not in sink.levels or (discard_detail and em.level == LEVEL_DETAIL):
                    continue
                seq = sink.sequence(("emitter", id(em)), None, em.clock_id)
                sink.add_events(seq, codes, ts, default_track_depth=False)
            self._write_dropped(sink)
        self._dropped_written = self.dropped
        for sink in self.sinks:
            self._send(sink)
        for codes in [e[1] for e in emitted]:
            for k in codes[codes < 0].tolist():
                _recorder.blobs.pop(-k, None)

    def _drop(self, chunk: np.ndarray) -> None:
        self.dropped += int(np.count_nonzero(chunk[0::3] != _recorder.THREAD))  # no marks
        for k in chunk[0::3][chunk[0::3] < 0].tolist():
            _recorder.blobs.pop(-k, None)
        now = _clock.now()
        for sink in self.sinks:  # cut open slices at the gap; their ends become unmatched
            sink.warn_unmatched = False  # ... which is expected now, not the user's mistake
            for seq in sink.sequences.values():
                sink.close_open_slices(seq, now)

    def _split(self, chunk: np.ndarray, discard_detail: bool, marks_only: bool = False):
        """Per thread: (ident, track, codes, ts, levels) in time order. Thread marks (see
        ``_recorder``) cut an ident's events where a new thread took the ident over; with
        ``marks_only``, only the marks are taken in (for a batch that is dropped)."""
        if not len(chunk):
            return []
        arr = chunk.reshape(-1, 3)
        codes, ts, tids = arr[:, 0], arr[:, 1], arr[:, 2]
        marks = codes == _recorder.THREAD
        if marks_only:
            for native_id, ident in zip(ts[marks].tolist(), tids[marks].tolist(), strict=True):
                self._marked_track(ident, native_id)
            return []
        if (codes == _recorder.NULL).any():  # withdrawn events
            keep = codes != _recorder.NULL
            codes, ts, tids, marks = codes[keep], ts[keep], tids[keep], marks[keep]
        levels = (codes >> 2) & 1
        neg = np.nonzero(codes < 0)[0]
        if len(neg):
            levels[neg] = [LEVEL_DETAIL if b is None else b.level
                           for b in map(_recorder.blobs.get, (-codes[neg]).tolist())]
        if discard_detail:
            keep = (levels == LEVEL_SUMMARY) | marks
            for k in (-codes[~keep & (codes < 0)]).tolist():  # no file takes them: freed
                _recorder.blobs.pop(k, None)
            codes, ts, tids, levels = codes[keep], ts[keep], tids[keep], levels[keep]
        if len(tids) == 0:
            return []
        if (tids == tids[0]).all():
            parts = [(int(tids[0]), slice(None))]
        else:
            order = np.argsort(tids, kind="stable")
            st = tids[order]
            cuts = np.nonzero(np.diff(st))[0] + 1
            parts = [(int(st[s]), order[s:e]) for s, e in
                     zip(np.r_[0, cuts], np.r_[cuts, len(st)], strict=True)]
        out = []
        for ident, sel in parts:
            c, t, lv = codes[sel], ts[sel], levels[sel]
            at = np.flatnonzero(c == _recorder.THREAD).tolist()
            if not at:
                out.append((ident, self._unmarked_track(ident, frozenset()), c, t, lv))
                continue
            native_ids = t[at].tolist()
            if at[0]:  # events of the thread that held the ident before the first mark
                uuid = self._unmarked_track(ident, frozenset(native_ids))
                out.append((ident, uuid, c[:at[0]], t[:at[0]], lv[:at[0]]))
            for k, (i, native_id) in enumerate(zip(at, native_ids, strict=True)):
                uuid = self._marked_track(ident, native_id)
                j = at[k + 1] if k + 1 < len(at) else len(c)
                if j > i + 1:
                    out.append((ident, uuid, c[i + 1:j], t[i + 1:j], lv[i + 1:j]))
        return out

    @staticmethod
    def _level_mask(levels: np.ndarray, wanted: frozenset[int]):
        if len(wanted) == 2:
            return None
        return levels == next(iter(wanted))

    def _write_dropped(self, sink: Sink) -> None:
        if self.dropped == self._dropped_written or LEVEL_SUMMARY not in sink.levels:
            return
        if self._dropped_track is None:
            self._dropped_track = self.new_counter_track(DROPPED_TRACK_NAME, "count")
            sink.describe(self.tracks)
        now = _clock.now()
        em_key = ("dropped",)
        seq = sink.sequence(em_key, None, _clock.MONOTONIC)
        k1 = _recorder.register_blob(Blob(COUNTER, 0, LEVEL_SUMMARY, self._dropped_track,
                                value=self.dropped))
        k2 = _recorder.register_blob(Blob(INSTANT, _recorder.event_id("stepscope dropped events",
                                                            (CAT_STEPSCOPE,)),
                                LEVEL_SUMMARY, self.process_uuid,
                                args={ARG_DROPPED: self.dropped}))
        sink.add_events(seq, np.array([-k1, -k2], dtype=np.int64),
                        np.array([max(now, seq.last_ts)] * 2, dtype=np.int64),
                        default_track_depth=False)

    # -- the I/O thread -----------------------------------------------------------------------
    def _enqueue(self, sink: Sink, data: bytes) -> None:
        with self._io_cv:
            self._io_pending += len(data)
        self._io.put((sink, data))

    def _send(self, sink: Sink) -> None:
        for data in sink.take():
            self._enqueue(sink, data)

    def _io_loop(self) -> None:
        while True:
            sink, data = self._io.get()
            if sink is None:
                break
            size = len(data)
            try:
                sink.write_chunk(data)  # a failed write is cut back and counted there
            except Exception as exc:
                self._error(f"writing {sink.path} failed: {exc!r}")
            finally:
                with self._io_cv:
                    self._io_pending -= size
                    self._io_cv.notify_all()

    def _wait_io(self, timeout: float | None = None) -> None:
        """Wait until everything queued so far is on disk (or the timeout passes)."""
        if self._io_thread is None or not self._io_thread.is_alive():
            self._drain_io_inline()
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._io_cv:
            while self._io_pending > 0 or not self._io.empty():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._io_cv.wait(0.05 if left is None else min(left, 0.05))

    def _drain_io_inline(self) -> None:
        """Write what is queued in this thread (no I/O thread: not started, or exiting)."""
        while True:
            try:
                sink, data = self._io.get_nowait()
            except queue.Empty:
                return
            if sink is None:
                continue
            self._io_pending -= len(data)
            try:
                sink.write_chunk(data)
            except OSError as exc:
                self._error(f"writing {sink.path} failed: {exc!r}")


def _bad_level(x) -> int:
    raise ValueError(f"unknown level {x!r}: use 'summary' or 'detail'")


_started_threads: dict[int, tuple[int, str]] = {}  # ident -> (native id, name) at thread start
_thread_names: dict[int, str] = {}  # native id -> name at thread start (until flushed, ended)


def _tid(thread: threading.Thread, ident: int) -> int:
    return thread.native_id or (ident & 0x7FFFFFFF)


def _note_thread_start(frame, event, arg) -> None:
    """Profile hook run once at the start of every new thread while tracing: remembers its
    name, so a thread that ends before the next flush still gets a named track, and marks its
    start (pure-Python buffer), so that it does not take the events of an earlier thread that
    had its ident."""
    t = threading.current_thread()
    native_id = _tid(t, t.ident)
    _started_threads[t.ident] = (native_id, t.name)
    _thread_names[native_id] = t.name
    _recorder.mark_thread(native_id)
    sys.setprofile(None)


def _find_dead_thread(ident: int, exclude: frozenset[int] = frozenset(),
                      native_id: int | None = None) -> threading.Thread | None:
    """A finished Thread still referenced by the user: the one with ``native_id``, else the
    newest not in ``exclude`` (idents get reused)."""
    found = None
    for t in list(getattr(threading, "_dangling", ())):
        if t.ident != ident:
            continue
        tid = t.native_id or 0
        if native_id is not None:
            if tid == native_id:
                return t
        elif tid not in exclude and (found is None or tid > (found.native_id or 0)):
            found = t
    return found


def _forget_in_child() -> None:
    """A forked child never writes into its parent's files: it starts with no session (and
    with the GIL switch interval a flush in the parent had shortened)."""
    global _current
    _restore_switch()
    sess, _current = _current, None
    if sess is not None:
        sess.stopped = True
        for sink in sess.sinks:
            sink.closed = True
            try:
                os.close(sink.fd)
            except OSError:
                pass


os.register_at_fork(after_in_child=_forget_in_child)
