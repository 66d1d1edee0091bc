"""Drop accounting: events the recorder could not store, failed writes and batches dropped for
a backlog are counted here, and the count is written to every summary file (counter track
``stepscope dropped events`` and an instant with the ``dropped_events`` arg)."""

from __future__ import annotations

import numpy as np

from .. import _clock
from .._schema import ARG_DROPPED, CAT_STEPSCOPE, DROPPED_TRACK_NAME, LEVEL_SUMMARY
from ..record import recorder as _recorder
from ..record.recorder import COUNTER, INSTANT, Blob
from ..write.sink import Sink, depth_changes
from .tracks import TrackRegistry


class DropAccount:
    """The session's count of lost events and what of it the files have been told."""

    def __init__(self, registry: TrackRegistry):
        self.registry = registry
        self.dropped = 0
        self._dropped_written = 0
        self._lost_seen = _recorder.lost_events()
        self._dropped_track: int | None = None

    def count_lost(self, sinks: list[Sink]) -> None:
        """Take in the events the C buffer could not store (out of memory) and those of failed
        writes (each sink's ``recover``: its files restart)."""
        lost = _recorder.lost_events()
        self.dropped += lost - self._lost_seen
        self._lost_seen = lost
        for sink in sinks:
            self.dropped += sink.recover()

    def add(self, n: int) -> None:
        """``n`` events dropped elsewhere (an emitter's, out of time at exit)."""
        self.dropped += n

    def drop(self, chunk: np.ndarray, sinks: list[Sink], groups: list) -> None:
        """Drop a drained batch (encoding or the disk cannot keep up; a burst past the cap):
        count it and free its blobs. ``groups``: the batch per thread (``TrackRegistry.split``).
        Its ends of slices begun before it are still written, at their own times, so those
        slices keep their true durations, and the slices it leaves open have their ends left
        out when they come (``Sink.rescue_ends``). (Cutting the open slices at the drop's
        time made slices end long after they did, and pushed the sequence's clock past the
        next batch's events, which were then all written at that one time.)"""
        lost = int(np.count_nonzero(chunk[0::3] != _recorder.THREAD))  # not marks
        counted = _counted(sinks)
        for sink in sinks:
            sink.warn_unmatched = False  # unmatched ends are expected now, no misuse
            one = len(sink.levels) == 1 and next(iter(sink.levels))
            for ident, uuid, codes, ts, levels in groups:
                if one is not False:
                    keep = levels == one
                    codes, ts = codes[keep], ts[keep]
                dd = depth_changes(codes)
                if not dd.any():
                    continue
                seq = sink.sequence(("thread", ident, uuid), uuid, _clock.MONOTONIC)
                written = sink.rescue_ends(seq, codes, ts, dd)
                if sink is counted:
                    lost -= written
        self.dropped += lost
        for k in chunk[0::3][chunk[0::3] < 0].tolist():
            _recorder.blobs.pop(-k, None)

    def count_lost_ends(self, sinks: list[Sink]) -> None:
        """Take in the ends a flush left out, whose begins were in a dropped batch."""
        counted = _counted(sinks)
        if counted is not None:
            self.dropped += counted.lost_ends
        for sink in sinks:
            sink.lost_ends = 0

    def write(self, sink: Sink) -> None:
        """The count, if it grew since the last flush, into a summary file."""
        if self.dropped == self._dropped_written or LEVEL_SUMMARY not in sink.levels:
            return
        if self._dropped_track is None:
            self._dropped_track = self.registry.new_counter_track(DROPPED_TRACK_NAME, "count")
            sink.describe(self.registry.tracks)
        now = _clock.now()
        em_key = ("dropped",)
        seq = sink.sequence(em_key, None, _clock.MONOTONIC)
        k1 = _recorder.register_blob(Blob(COUNTER, 0, LEVEL_SUMMARY, self._dropped_track,
                                value=self.dropped))
        k2 = _recorder.register_blob(Blob(INSTANT, _recorder.event_id("stepscope dropped events",
                                                            (CAT_STEPSCOPE,)),
                                LEVEL_SUMMARY, self.registry.process_uuid,
                                args={ARG_DROPPED: self.dropped}))
        sink.add_events(seq, np.array([-k1, -k2], dtype=np.int64),
                        np.array([max(now, seq.last_ts)] * 2, dtype=np.int64),
                        default_track_depth=False)

    def written(self) -> None:
        """Every file has been told the current count."""
        self._dropped_written = self.dropped


def _counted(sinks: list[Sink]) -> Sink | None:
    """The file whose events the count is of: the first that takes the summary level (a
    detail file takes it too, and would count its events twice)."""
    return next((s for s in sinks if LEVEL_SUMMARY in s.levels), None)
