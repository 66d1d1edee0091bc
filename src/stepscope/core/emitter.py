"""Emitters: events with explicit timestamps and tracks from one producer (the GPU converter,
the samplers), kept in time order per emitter and taken by the session at each flush; each
emitter is one Perfetto sequence per file, on its own clock."""

from __future__ import annotations

import contextlib
import itertools

from .. import _clock
from ..record import recorder as _recorder
from ..record.recorder import BEGIN, COUNTER, END, INSTANT, Blob


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
