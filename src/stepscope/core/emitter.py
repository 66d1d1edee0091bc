"""Emitters: events with explicit timestamps and tracks from one producer (the GPU converter,
the samplers), kept in time order per emitter and taken by the session at each flush; each
emitter is one Perfetto sequence per file, on its own clock."""

from __future__ import annotations

import contextlib
import itertools

import numpy as np

from .. import _clock
from ..record import recorder as _recorder
from ..record.recorder import BEGIN, COUNTER, END, INSTANT, Blob


class Emitter:
    """Events with explicit timestamps and tracks, from one producer (one sequence per file)."""

    def __init__(self, clock: str, level: int):
        self.clock_id = _clock.base_clock_id(clock)
        self.level = level
        self._events: list[tuple] = []  # (ts, order, tiebreak, seq no, blob)
        # completes_indexed() batches: (ts, order, tiebreak, seq nos, blob indices, blobs)
        self._bulk: list[tuple] = []
        self._batch: list[tuple] | None = None
        self._batch_bulk: list[tuple] = []
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
        self._batch, self._batch_bulk = [], []
        try:
            yield self
        finally:
            events, self._batch = self._batch, None
            bulk, self._batch_bulk = self._batch_bulk, []
            if not bulk:
                self._events.extend(events)
            else:  # one extend, so that a flush takes all of them or none: events as columns
                if events:
                    bulk.insert(0, _columns(events))
                self._bulk.extend(bulk)

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

    def completes_indexed(self, ts, dur, blobs: list[Blob], begin_idx, end_idx) -> None:
        """Whole slices in bulk, as ``complete`` orders them (ints, ``dur`` >= 0), each one's
        begin and end blob given as an index into ``blobs`` (one blob may serve many events,
        and is then encoded once per file and flush): a converter of thousands of events
        (torch's operators) hands them over as columns, with no Python object or call per
        event here or at the flush."""
        n = len(ts)
        if n == 0:
            return
        t = np.asarray(ts, dtype=np.int64)
        e = t + np.asarray(dur, dtype=np.int64)
        cts, order, tie, idx = (np.empty(2 * n, dtype=np.int64) for _ in range(4))
        cts[0::2], cts[1::2] = t, e
        order[0::2] = 1  # at equal times: ends before begins; longer slices open first
        order[1::2] = np.where(e > t, 0, 2)  # a zero-length slice ends after it begins
        tie[0::2], tie[1::2] = -e, -t
        idx[0::2], idx[1::2] = begin_idx, end_idx
        self._add_bulk(cts, order, tie, idx, list(blobs))

    def _add_bulk(self, ts, order, tie, idx, blobs: list) -> None:
        """One bulk chunk: its events' sequence numbers taken in one C call (atomic under the
        GIL: consecutive)."""
        m = len(ts)
        seq = np.fromiter(itertools.islice(self._count, m), dtype=np.int64, count=m)
        (self._batch_bulk if self._batch is not None else self._bulk).append(
            (ts, order, tie, seq, idx, blobs))

    def completes_columns(self, ts, dur, bases: list[tuple], base, int_args: dict | None = None,
                          flows=None, tflows=None, flow_lists: dict | None = None,
                          float_args: dict | None = None) -> None:
        """Whole slices in bulk, as ``complete`` orders them: slice ``i`` takes its name,
        category, track and args from ``bases[base[i]]`` (``(name, category, track, args)``),
        plus its own int and float args (``int_args``, ``float_args``: name → column, written
        after the base's args in that order), flow and terminating flow
        (``flows[i]``, ``tflows[i]``: 0 for none; ``flow_lists[i]``: all of slice ``i``'s
        flows, where it has several). A converter of thousands of records that repeat a few
        kinds (GPU kernels, CUDA calls) builds no object per slice; the writer encodes each
        base once per file and the rest in numpy."""
        n = len(base)
        if n == 0:
            return
        names = tuple(int_args or ())
        ints = (np.stack([np.asarray(int_args[k], dtype=np.int64) for k in names], axis=1)
                if names else None)
        fnames = tuple(float_args or ())
        floats = (np.stack([np.asarray(float_args[k], dtype=np.float64) for k in fnames],
                           axis=1) if fnames else None)
        eids = [(_recorder.event_id(name, (cat,) if cat else ()), track, args)
                for name, cat, track, args in bases]
        track_of = np.array([b[2] for b in bases], dtype=np.int64)[np.asarray(base)]
        tracks, end_of = np.unique(track_of, return_inverse=True)
        ends = [Blob(END, 0, self.level, t) for t in tracks.tolist()]
        ts = np.asarray(ts, dtype=np.int64)
        dur = np.maximum(np.asarray(dur, dtype=np.int64), 0)
        for lo in range(0, n, _recorder.SERIES_MAX):
            sl = slice(lo, lo + _recorder.SERIES_MAX)
            lists = {i - lo: v for i, v in flow_lists.items() if lo <= i < sl.stop} if (
                flow_lists) else None
            series = _recorder.BlobSeries(
                BEGIN, self.level, eids, np.asarray(base)[sl], names,
                None if ints is None else ints[sl], None,
                None if flows is None else np.asarray(flows)[sl],
                None if tflows is None else np.asarray(tflows)[sl], lists, fnames,
                None if floats is None else floats[sl])  # fmt: skip
            m = len(series)
            # the series at blob 0, event i's index carrying i + 1 above SERIES_SHIFT; ends
            begin_idx = (np.arange(1, m + 1, dtype=np.int64) << _recorder.SERIES_SHIFT)
            self.completes_indexed(ts[sl], dur[sl], [series, *ends], begin_idx,
                                   1 + end_of.ravel()[sl])

    def counters_columns(self, ts, tracks, values) -> None:
        """Counter samples in bulk (ordered as ``counter`` orders them): ``values[i]`` on
        ``tracks[i]`` at ``ts[i]``."""
        ts = np.asarray(ts, dtype=np.int64)
        uniq, base = np.unique(np.asarray(tracks, dtype=np.int64), return_inverse=True)
        bases = [(0, t, None) for t in uniq.tolist()]
        values = np.asarray(values, dtype=np.float64)
        for lo in range(0, len(ts), _recorder.SERIES_MAX):
            sl = slice(lo, lo + _recorder.SERIES_MAX)
            series = _recorder.BlobSeries(COUNTER, self.level, bases, base.ravel()[sl],
                                          values=values[sl])
            m = len(series)
            self._add_bulk(ts[sl], np.ones(m, dtype=np.int64), np.zeros(m, dtype=np.int64),
                           np.arange(1, m + 1, dtype=np.int64) << _recorder.SERIES_SHIFT,
                           [series])

    def instant(self, ts: int, name: str, track: int, category: str | None = None,
                args: dict | None = None) -> None:
        eid = _recorder.event_id(name, (category,) if category else ())
        self._add(ts, 1, 0, Blob(INSTANT, eid, self.level, track, args))

    def counter(self, ts: int, track: int, value: float) -> None:
        self._add(ts, 1, 0, Blob(COUNTER, 0, self.level, track, value=value))

    def take_columns(self) -> tuple[np.ndarray, np.ndarray, list[Blob]]:
        """The events so far in time order: (timestamps, each one's index into the blobs,
        blobs). The event ``i`` of a blob series (``*_columns``) has the series' index plus
        ``i + 1 << SERIES_SHIFT``."""
        keys, idx, blobs = self._take()
        return keys[0], idx, blobs

    def _take(self) -> tuple[np.ndarray, np.ndarray, list[Blob]]:
        """(4 x events keys: ts, order, tiebreak, seq no; blob indices; blobs), sorted."""
        n = len(self._events)
        events = self._events[:n]
        del self._events[:n]
        k = len(self._bulk)
        bulk = self._bulk[:k]
        del self._bulk[:k]
        if not bulk:  # the usual case: a sort of the tuples
            events.sort(key=lambda e: e[:4])
        keys = [np.array([e[:4] for e in events], dtype=np.int64).reshape(-1, 4).T]
        idx = [np.arange(len(events), dtype=np.int64)]
        blobs = [e[4] for e in events]
        for cts, order, tie, seq, bidx, bblobs in bulk:
            keys.append(np.stack((cts, order, tie, seq)))
            idx.append(bidx + len(blobs))
            blobs.extend(bblobs)
        if not bulk:
            return keys[0], idx[0], blobs
        allkeys = np.concatenate(keys, axis=1)
        sort = np.lexsort(allkeys[::-1])  # by ts, then order, tiebreak, seq no
        return allkeys[:, sort], np.concatenate(idx)[sort], blobs


def _columns(events: list[tuple]) -> tuple:
    """(ts, order, tiebreak, seq no, blob) tuples as a bulk chunk."""
    keys = np.array([e[:4] for e in events], dtype=np.int64).reshape(-1, 4).T
    return (*keys, np.arange(len(events), dtype=np.int64), [e[4] for e in events])
