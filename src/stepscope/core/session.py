"""A tracing session: the facade the public API and the producers use.

It turns recording on and off and composes what it owns, each in a module of its own:
the track registry (``core.tracks``), the emitters (``core.emitter``), the drop accounting
(``core.drops``), the output files (``write.sink``) and the writer/I/O threads
(``write.pipeline``). A flush (``_flush_locked``) runs, in order: the flush hooks, the drain of
the recorder (or a drop for a backlog), the emitters, the split by thread, the encoding into
each sink, the drop count, and the hand-over to the I/O thread.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable

import numpy as np

from .. import _clock, ranks
from .._schema import LEVEL_DETAIL, LEVEL_SUMMARY, PROCESS_NAME
from ..record import recorder as _recorder
from ..write.pipeline import (
    BLOB_BYTES,
    RAW_EVENT_BYTES,
    WritePipeline,
    restore_switch,
    short_gil_turns,
)
from ..write.sink import Sink
from . import hooks
from . import lifecycle as _lifecycle
from . import tracks as _tracks
from .drops import DropAccount
from .emitter import Emitter

MIN_BUFFER_BYTES = 1 << 16  # the smallest buffer_bytes (options and Profiler check it too)
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
        self.compress = compress
        self.detail = detail
        self.rank = ranks.detect().rank if rank is None else int(rank)
        self.pid = os.getpid()
        self.process_name = process_name or PROCESS_NAME.format(rank=self.rank,
                                                                host=socket.gethostname())
        self._lock = threading.RLock()  # tracks, sinks, flushes
        self.registry = _tracks.TrackRegistry(self.pid, self.process_name, self._lock)
        self.process_uuid = self.registry.process_uuid
        self.drops = DropAccount(self.registry)
        self._pipeline = WritePipeline(self._flush_for_writer, self._lock, float(flush_interval_s),
                                       self.buffer_bytes, self._error)
        self._emitters: list[Emitter] = []
        self.sinks: list[Sink] = []
        self.started = False
        self.stopped = False
        self.on_close: list[Callable[[Sink], None]] = []
        # run when the session starts stopping, whoever stops it (stop(), atexit, a signal, an
        # unhandled exception), while it still records and writes
        self.before_stop: list[Callable[[], None]] = []
        # run at the start of every flush, before emitters are taken (e.g. resolving CUDA events)
        self.flush_hooks: list[Callable[[], None]] = []
        self._gpu_timer = None
        self._deadline: float | None = None  # set when the program exits (see exiting)
        self.errors: list[str] = []
        if path is not None:
            self.add_sink(path, levels=(LEVEL_SUMMARY, LEVEL_DETAIL))

    @property
    def flush_interval_s(self) -> float:
        """Seconds between the writer's periodic flushes (the write pipeline's: set here, it
        takes effect at the writer's next wake)."""
        return self._pipeline.flush_interval_s

    @flush_interval_s.setter
    def flush_interval_s(self, seconds: float) -> None:
        self._pipeline.flush_interval_s = float(seconds)

    # -- tracks (core.tracks) -----------------------------------------------------------------
    @property
    def tracks(self) -> dict[int, bytes]:
        """uuid -> TrackDescriptor bytes of every track made so far."""
        return self.registry.tracks

    def new_track(self, name: str, parent: int | None = None) -> int:
        """A custom slice track (a GPU, a stream, a queue), child of ``parent`` or the process."""
        return self.registry.new_track(name, parent)

    def gpu_track(self, device: int, name: str) -> int:
        """The one track of CUDA device ``device``, shared by every GPU producer."""
        return self.registry.gpu_track(device, name)

    def new_counter_track(self, name: str, unit: str | None = None,
                          parent: int | None = None) -> int:
        """A counter track; ``unit`` is "ns", "count", "bytes" or any unit name such as "%"."""
        return self.registry.new_counter_track(name, unit, parent)

    def counter_track(self, name: str, unit: str | None = None) -> int:
        """The process-level counter track of that name, made on first use."""
        return self.registry.counter_track(name, unit)

    def acquire_async_track(self) -> int:
        """A track for one async range; overlapping ranges get sibling tracks of one name."""
        return self.registry.acquire_async_track()

    def release_async_track(self, uuid: int) -> None:
        self.registry.release_async_track(uuid)

    def thread_track(self, ident: int | None = None) -> int:
        """The track of a thread (``threading.get_ident()``; default: the calling thread)."""
        return self.registry.thread_track(ident)

    def steps_track(self, ident: int | None = None) -> int:
        """The track of a thread's steps, a child of the thread's (default: the calling
        thread): its step events are recorded under ``ident | record.recorder.STEPS``."""
        return self.registry.steps_track(ident)

    def native_thread_track(self, tid: int, name: str) -> int:
        """The track of a thread by its system id (a C++ thread Python has no ``Thread`` for)."""
        return self.registry.native_thread_track(tid, name)

    # -- drops (core.drops) -------------------------------------------------------------------
    @property
    def dropped(self) -> int:
        """Events lost so far (recorder out of memory, failed writes, backlog drops)."""
        return self.drops.dropped

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
            sink = Sink(path, lv, self.compress, self._pipeline.enqueue)
            sink.warn_unmatched = not self.started
            sink.clock_snapshot(_clock.snapshot())
            self.sinks.append(sink)
            if self.started:
                self._flush_sink_metadata(sink)
        return sink

    def close_sink(self, sink: Sink) -> None:
        """Flush, write a last clock snapshot and close the file. Ranges still open (a thread
        inside one at stop, a range that outlasts a detail window, a run stopped by a signal)
        are left open, as Perfetto's SDK leaves them: "Did not end" in the UI, and no call in
        the tables (ended at the close, they were calls that lasted until it: 102 ms for a
        range whose thread still slept)."""
        with self._lock:
            if sink not in self.sinks:
                return
            with short_gil_turns():  # as the writer's: busy threads return the GIL sooner
                self._flush_locked(False)
            sink.clock_snapshot(_clock.snapshot())
            self.sinks.remove(sink)
            self._pipeline.send(sink)
        self._pipeline.wait()
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
        for sink in self.sinks:
            self._flush_sink_metadata(sink)
        self._pipeline.start()
        _recorder.set_state(True, self.detail)
        if threading.getprofile() is None:  # never displace a user's profiler
            threading.setprofile(_tracks._note_thread_start)
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
        if not self.started or self.stopped or self._pipeline.stopping():
            return
        self._exit_deadline()
        self._pipeline.begin_stop()
        for hook in list(self.before_stop):  # e.g. the profiler closing its open window
            try:
                hook()
            except Exception as exc:
                self._error(f"a before-stop hook failed: {exc!r}")
        self.stopped = True
        _recorder.set_state(False, False)
        try:
            self._pipeline.stop_writer()
            with self._lock:
                for sink in list(self.sinks):
                    try:
                        self.close_sink(sink)
                    except Exception as exc:  # one bad file must not keep the others open
                        self._error(f"closing {sink.path} failed: {exc!r}")
                        sink.close_file()
            self._pipeline.shutdown()
        finally:
            if _current is self:
                _current = None
        if threading.getprofile() is _tracks._note_thread_start:
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
            self._pipeline.wait(timeout)
        return True

    # -- the flush ----------------------------------------------------------------------------
    def _flush_for_writer(self) -> None:
        self._flush_locked(False)

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
        self._pipeline.send(sink)

    def _flush_locked(self, discard_detail: bool) -> None:
        """Drain, split, encode and hand over to the I/O thread (under ``_lock``)."""
        self._pipeline.last_flush = time.monotonic()
        self._run_flush_hooks()
        chunk, late, over = self._take_recorded()
        emitted = self._take_emitted(late)
        self._encode_threads(chunk, discard_detail)
        if len(over):  # (after the events before it: the slices they leave open are cut)
            self._drop(over)
        self.registry.forget_ended_threads()
        self.drops.count_lost_ends(self.sinks)
        for sink in self.sinks:
            sink.describe(self.tracks)
            self._encode_emitted(sink, emitted, discard_detail)
            self.drops.write(sink)
        self.drops.written()
        for sink in self.sinks:
            self._pipeline.send(sink)
        for _, codes, _ in emitted:  # (a blob may serve many events; a set, not np.unique,
            # which imports numpy.ma on its first call: some 2 M instructions in a flush)
            for k in set((-codes[codes < 0] & _recorder.BLOB_ID_MASK).tolist()):
                _recorder.blobs.pop(k, None)

    def _run_flush_hooks(self) -> None:
        for hook in list(self.flush_hooks):
            try:
                hook()
            except Exception as exc:
                self._error(f"a flush hook failed: {exc!r}")

    def _take_recorded(self) -> tuple[np.ndarray, bool, np.ndarray]:
        """(what the recorder holds up to the buffer cap, whether the exit deadline has
        passed, the events past the cap: dropped once the others are encoded). Nothing when
        encoding or the disk cannot keep up, or at exit out of time: then it is dropped and
        counted."""
        chunk = _recorder.drain()
        self.drops.count_lost(self.sinks)  # a failed write: its events count, files restart
        backlog = self._pipeline.pending > self.buffer_bytes // 2
        self._exit_deadline()
        late = self._out_of_time()  # exiting, out of time, other threads still busy
        if len(chunk) and (backlog or late):
            self._drop(chunk)  # encoding or the disk cannot keep up: drop, count, move on
            return chunk[:0], late, chunk[:0]
        pending_raw = len(chunk) // 3 * RAW_EVENT_BYTES + len(_recorder.blobs) * BLOB_BYTES
        if pending_raw <= self.buffer_bytes:
            return chunk, late, chunk[:0]
        # more than the cap between two flushes (a burst): the events up to it are kept, in
        # the order recorded, and those past it dropped (the whole batch was, every event)
        codes = chunk[0::3]
        cost = np.where(codes < 0, RAW_EVENT_BYTES + BLOB_BYTES, RAW_EVENT_BYTES)
        keep = 3 * int(np.searchsorted(np.cumsum(cost), self.buffer_bytes, side="right"))
        return chunk[:keep], late, chunk[keep:]

    def _drop(self, chunk: np.ndarray) -> None:
        self.drops.drop(chunk, self.sinks, self.registry.split(chunk, False))

    def _take_emitted(self, late: bool) -> list[tuple[Emitter, np.ndarray, np.ndarray]]:
        """Per emitter with events: (emitter, blob codes, timestamps) in time order."""
        emitted = []
        for em in self._emitters:
            ts, idx, blobs = em.take_columns()
            if late:
                self.drops.add(len(ts))
            elif len(ts):  # one blob id per blob, shared by all its events and files
                ids = -np.array([_recorder.register_blob(b) for b in blobs], dtype=np.int64)
                # a series' events: its id, each one's number above SERIES_SHIFT kept
                high = (idx >> _recorder.SERIES_SHIFT) << _recorder.SERIES_SHIFT
                emitted.append((em, ids[idx & _recorder.BLOB_ID_MASK] - high, ts))
        return emitted

    def _encode_threads(self, chunk: np.ndarray, discard_detail: bool) -> None:
        """The threads' events into every sink, in pieces, with a look at the exit deadline
        (which stop() may set meanwhile) between them."""
        lo = 0
        while lo < len(chunk):
            if self._out_of_time():
                self._drop(chunk[lo:])  # out of time: counted, not written
                break
            part = chunk[lo:lo + 3 * _FLUSH_PIECE]
            lo += len(part)
            groups = self.registry.split(part, discard_detail)
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

    def _encode_emitted(self, sink: Sink, emitted, discard_detail: bool) -> None:
        for em, codes, ts in emitted:
            if em.level not in sink.levels or (discard_detail and em.level == LEVEL_DETAIL):
                continue
            seq = sink.sequence(("emitter", id(em)), None, em.clock_id)
            sink.add_events(seq, codes, ts, default_track_depth=False)

    @staticmethod
    def _level_mask(levels: np.ndarray, wanted: frozenset[int]):
        if len(wanted) == 2:
            return None
        return levels == next(iter(wanted))


def _bad_level(x) -> int:
    raise ValueError(f"unknown level {x!r}: use 'summary' or 'detail'")


def _forget_in_child() -> None:
    """A forked child never writes into its parent's files: it starts with no session (and
    with the GIL switch interval a flush in the parent had shortened)."""
    global _current
    restore_switch()
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
