"""The track registry: track uuids and their TrackDescriptors (process, threads, counters,
custom and async tracks), and the split of recorded events by thread.

Every descriptor is kept as bytes in ``tracks`` (uuid -> TrackDescriptor); each sink writes the
ones it has not written yet before any event that uses them. Uuids are random in their top bits
(per session) so that the ranks' files merge without clashes.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable

import numpy as np

from .._schema import ASYNC_TRACK_NAME, LEVEL_DETAIL, LEVEL_SUMMARY, STEPS_TRACK_NAME
from ..format import wire as w
from ..record import recorder as _recorder


class TrackRegistry:
    """Track uuids and descriptors of one session; ``lock`` is the session's (tracks are made
    by program threads while the writer reads them)."""

    def __init__(self, pid: int, process_name: str, lock: threading.RLock):
        self.pid = pid
        self.process_name = process_name
        self._lock = lock
        self._uuid_base = random.getrandbits(40) << 20
        self._uuid_next = 1
        self.tracks: dict[int, bytes] = {}  # uuid -> TrackDescriptor bytes
        # threads known only from their start mark (the pure-Python buffer marks every thread
        # that starts while recording, one that never records too): their descriptors wait
        # here until the thread has an event or its track is asked for (_activate)
        self._dormant: dict[int, bytes] = {}
        self.process_uuid = self._register(self._process_descriptor)
        self._threads: dict[int, tuple[int, int, str]] = {}  # ident -> (uuid, tid, name)
        self._ended_before: set[int] = set()  # see forget_ended_threads
        self._native_threads: dict[int, int] = {}  # system tid -> uuid (native_thread_track)
        self._counter_tracks: dict[str, int] = {}
        self._async_free: list[int] = []
        self._gpus: dict[int, int] = {}  # CUDA device -> its track (gpu_track)
        self._steps: dict[int, int] = {}  # a thread's track -> its steps track (steps_track)

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

    def thread_uuid(self, ident: int) -> int:
        """The track of the thread last seen holding ``ident``."""
        return self._activate(self._threads[ident][0])

    def thread_track(self, ident: int | None = None) -> int:
        """The track of a thread (``threading.get_ident()``; default: the calling thread)."""
        with self._lock:
            return self._activate(
                self._thread_track(threading.get_ident() if ident is None else ident))

    def steps_track(self, ident: int | None = None) -> int:
        """The steps track of a thread (``threading.get_ident()``; default: the calling thread):
        where the events recorded under ``ident | _recorder.STEPS`` go."""
        with self._lock:
            base = threading.get_ident() if ident is None else ident
            return self._steps_of(self._activate(self._thread_track(base)))

    def _steps_of(self, thread_uuid: int) -> int:
        uuid = self._steps.get(thread_uuid)
        if uuid is None:
            uuid = self._steps[thread_uuid] = self._register(
                lambda u: w.f_varint(w.TD_UUID, u) + w.f_varint(w.TD_PARENT_UUID, thread_uuid)
                + w.f_str(w.TD_NAME, STEPS_TRACK_NAME))
        return uuid

    def _activate(self, uuid: int) -> int:
        """A dormant thread track is used: its descriptor is written from now on."""
        desc = self._dormant.pop(uuid, None)
        if desc is not None:
            self.tracks[uuid] = desc
        return uuid

    def native_thread_track(self, tid: int, name: str) -> int:
        """The track of a thread by its system id, for threads Python has no ``Thread`` for (a
        C++ thread such as torch's autograd engine); made once per tid, named ``name``."""
        with self._lock:
            for uuid, known_tid, _ in self._threads.values():
                if known_tid == tid:
                    return self._activate(uuid)
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

    def _set_holder(self, ident: int, tid: int, name: str, dormant: bool = False) -> int:
        """Make thread ``tid`` the holder of ``ident``: a renamed thread keeps its track, a new
        thread that reuses the ident gets its own (``dormant``: known from its start mark
        only, not written until used; see ``_activate``)."""
        known = self._threads.get(ident)
        if known is not None and known[1:] == (tid, name):
            return known[0]
        uuid = known[0] if known is not None and known[1] == tid else self._new_uuid()
        self._threads[ident] = (uuid, tid, name)
        desc = (w.f_varint(w.TD_UUID, uuid) + w.f_varint(w.TD_PARENT_UUID, self.process_uuid)
                + w.f_bytes(w.TD_THREAD, w.f_varint(w.THD_PID, self.pid)
                            + w.f_varint(w.THD_TID, tid) + w.f_str(w.THD_NAME, name)))
        if dormant and uuid not in self.tracks:
            self._dormant[uuid] = desc
        else:
            self._dormant.pop(uuid, None)
            self.tracks[uuid] = desc
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
            if thread is None:  # ended since: renamed before it ended? (its Thread object,
                dead = _find_dead_thread(ident, native_id=known[1])  # if still referenced)
                if dead is not None:
                    return self._set_holder(ident, known[1], dead.name)
            if (thread is None or _recorder.fast is not None or tid in exclude
                    or tid in _thread_names):
                return known[0]  # the newer holder marks its own start
        return self._thread_track(ident, exclude)

    def _marked_track(self, ident: int, native_id: int, dormant: bool = False) -> int:
        """The track of the thread whose start mark says (native id, ident) (``dormant``: no
        event of it follows yet)."""
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
        return self._set_holder(ident, native_id, name, dormant)

    def forget_ended_threads(self) -> None:
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

    def split(self, chunk: np.ndarray, discard_detail: bool):
        """Per thread: (ident, track, codes, ts, levels) in time order. Thread marks (see
        ``_recorder``) cut an ident's events where a new thread took the ident over."""
        if not len(chunk):
            return []
        arr = chunk.reshape(-1, 3)
        codes, ts, tids = arr[:, 0], arr[:, 1], arr[:, 2]
        marks = codes == _recorder.THREAD
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
        one = tids == tids[0]
        if one.all():
            parts = [(int(tids[0]), slice(None))]
        elif (tids == (int(tids[0]) ^ _recorder.STEPS))[~one].all():  # one thread and its
            # steps (the common case): two masks, no sort
            a, b = sorted((int(tids[0]), int(tids[0]) ^ _recorder.STEPS))
            first = one if a == int(tids[0]) else ~one
            parts = [(a, np.flatnonzero(first)), (b, np.flatnonzero(~first))]
        else:
            order = np.argsort(tids, kind="stable")
            st = tids[order]
            cuts = np.nonzero(np.diff(st))[0] + 1
            parts = [(int(st[s]), order[s:e]) for s, e in
                     zip(np.r_[0, cuts], np.r_[cuts, len(st)], strict=True)]
        out = []
        for ident, sel in parts:
            c, t, lv = codes[sel], ts[sel], levels[sel]
            if ident & _recorder.STEPS:  # a thread's steps (after its own events: a larger
                # ident), on the steps track of the thread that holds the ident now
                base = ident & ~_recorder.STEPS
                known = self._threads.get(base)
                thread = known[0] if known is not None else self._unmarked_track(base,
                                                                                 frozenset())
                out.append((ident, self._steps_of(self._activate(thread)), c, t, lv))
                continue
            at = np.flatnonzero(c == _recorder.THREAD).tolist()
            if not at:
                uuid = self._activate(self._unmarked_track(ident, frozenset()))
                out.append((ident, uuid, c, t, lv))
                continue
            native_ids = t[at].tolist()
            if at[0]:  # events of the thread that held the ident before the first mark
                uuid = self._activate(self._unmarked_track(ident, frozenset(native_ids)))
                out.append((ident, uuid, c[:at[0]], t[:at[0]], lv[:at[0]]))
            for k, (i, native_id) in enumerate(zip(at, native_ids, strict=True)):
                j = at[k + 1] if k + 1 < len(at) else len(c)
                uuid = self._marked_track(ident, native_id, dormant=j == i + 1)
                if j > i + 1:
                    out.append((ident, self._activate(uuid), c[i + 1:j], t[i + 1:j],
                                lv[i + 1:j]))
        return out


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
