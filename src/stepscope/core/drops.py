"""Drop accounting: events the recorder could not store, failed writes and batches dropped for
a backlog are counted here, and the count is written to every summary file (counter track
``stepscope dropped events`` and an instant with the ``dropped_events`` arg)."""

from __future__ import annotations

import numpy as np

from .. import _clock
from .._schema import ARG_DROPPED, CAT_STEPSCOPE, DROPPED_TRACK_NAME, LEVEL_SUMMARY
from ..record import recorder as _recorder
from ..record.recorder import COUNTER, INSTANT, Blob
from ..write.sink import Sink
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

    def drop(self, chunk: np.ndarray, sinks: list[Sink]) -> None:
        """Drop a drained batch (encoding or the disk cannot keep up): count it, free its
        blobs, and cut the open slices at the gap."""
        self.dropped += int(np.count_nonzero(chunk[0::3] != _recorder.THREAD))  # not marks
        for k in chunk[0::3][chunk[0::3] < 0].tolist():
            _recorder.blobs.pop(-k, None)
        now = _clock.now()
        for sink in sinks:  # cut open slices at the gap; their ends become unmatched
            sink.warn_unmatched = False  # ... which is expected now, not the user's mistake
            for seq in sink.sequences.values():
                sink.close_open_slices(seq, now)

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
