"""CUDA caching-allocator memory per device, as counter tracks sampled at each step end.

Only once the program itself has initialized CUDA (``torch.cuda.is_initialized()``): sampling
never initializes it. Per device ``d``: ``torch.cuda<d>.memory.allocated`` and ``.reserved``
(``torch.cuda.memory_allocated``/``memory_reserved``) and ``.peak``
(``max_memory_allocated``, the peak since the start or since the program last reset it: the peak
statistics are the program's, never reset here). Bytes, summary level.
"""

from __future__ import annotations

import time
from typing import Any

from .. import _schema as S

_NAMES = (S.COUNTER_CUDA_ALLOCATED, S.COUNTER_CUDA_RESERVED, S.COUNTER_CUDA_PEAK)


class CudaMemory:
    """Samples the allocator of every device at ``sample()`` (the profiler's step end)."""

    def __init__(self, sess: Any) -> None:
        self.sess = sess
        self._em: Any = None
        self._tracks: dict[tuple[int, int], int] = {}

    def sample(self) -> int:
        """Write one sample per device and counter; returns the devices sampled."""
        import torch

        cuda = torch.cuda
        if not cuda.is_initialized():
            return 0
        if self._em is None:
            self._em = self.sess.emitter(clock="monotonic", level=S.LEVEL_SUMMARY)
        ts = time.perf_counter_ns()
        n = cuda.device_count()
        for d in range(n):
            values = (cuda.memory_allocated(d), cuda.memory_reserved(d),
                      cuda.max_memory_allocated(d))
            for k, v in enumerate(values):
                track = self._tracks.get((d, k))
                if track is None:
                    track = self._tracks[d, k] = self.sess.counter_track(
                        _NAMES[k].format(device=d), "bytes")
                self._em.counter(ts, track, int(v))
        return n
