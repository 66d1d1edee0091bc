"""CUDA caching-allocator memory per device, as counter tracks sampled at step ends.

Only once the program itself has initialized CUDA (``torch.cuda.is_initialized()``): sampling
never initializes it. Per device ``d``: ``torch.cuda<d>.memory.allocated`` and ``.reserved``
(what ``torch.cuda.memory_allocated``/``memory_reserved`` return) and ``.peak``
(``max_memory_allocated``, the peak since the start or since the program last reset it: the peak
statistics are the program's, never reset here). Bytes, summary level.

Cost, measured on an H100 machine (torch 2.11): each of those three functions builds, flattens
and sorts the allocator's whole table of statistics, 390 µs for the three, a third of a
launch-bound 1 ms training step. One ``memory_stats_as_nested_dict`` per device gives all three
in 11 µs. And a step end samples only when ``INTERVAL_NS`` has passed since the last sample:
every step of 10 ms or longer, at most 100 samples a second whatever the step (at most 0.11 % of
the time); the peak counter still holds the peaks in between.
"""

from __future__ import annotations

import time
from typing import Any

from .. import _schema as S

_NAMES = (S.COUNTER_CUDA_ALLOCATED, S.COUNTER_CUDA_RESERVED, S.COUNTER_CUDA_PEAK)
INTERVAL_NS = 10_000_000  # the least time between two samples


class CudaMemory:
    """Samples the allocator of every device at ``sample()`` (the profiler's step end)."""

    def __init__(self, sess: Any) -> None:
        self.sess = sess
        self._em: Any = None
        self._tracks: dict[tuple[int, int], int] = {}
        self._last = -INTERVAL_NS - 1  # the first step end samples

    def sample(self) -> int:
        """Write one sample per device and counter, unless the last one is under
        ``INTERVAL_NS`` old; returns the devices sampled."""
        ts = time.perf_counter_ns()
        if ts - self._last < INTERVAL_NS:
            return 0
        import torch

        cuda = torch.cuda
        if not cuda.is_initialized():
            return 0
        self._last = ts
        if self._em is None:
            self._em = self.sess.emitter(clock="monotonic", level=S.LEVEL_SUMMARY)
        n = cuda.device_count()
        for d in range(n):
            stats = cuda.memory_stats_as_nested_dict(d)
            allocated = stats.get("allocated_bytes", {}).get("all", {})
            values = (allocated.get("current", 0),
                      stats.get("reserved_bytes", {}).get("all", {}).get("current", 0),
                      allocated.get("peak", 0))
            for k, v in enumerate(values):
                track = self._tracks.get((d, k))
                if track is None:
                    track = self._tracks[d, k] = self.sess.counter_track(
                        _NAMES[k].format(device=d), "bytes")
                self._em.counter(ts, track, int(v))
        return n
