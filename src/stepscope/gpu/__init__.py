"""GPU tracing: CUPTI activity, stream tracks, launch→kernel flows, utilization counters.

Everything here is optional (extra ``gpu``: ``cupy-cuda13x``, ``cupti-python``,
``nvidia-ml-py``; ``gpu-cuda12`` for CUDA 12); importing this package needs none of them.
Without a GPU or CUPTI each part switches itself off with one log line and never raises into the
user's program.

Parts: :mod:`.occupancy` (CUDA occupancy calculator), :mod:`.metrics` (utilization, est. SM
efficiency, est. achieved occupancy per bucket), :mod:`.records` (columnar records and kernel
classes), :mod:`.convert` (records → trace), :mod:`.cupti_live` (live CUPTI collection, through
:mod:`.cupti_buffers`' raw buffers decoded in bulk where possible),
:mod:`.fixture` (the recorded fixture through the same path), :mod:`.nvml` (NVML/GPM counters),
:mod:`.cupy_timing` (CUDA-event ranges and ``sync_gpu``), and :mod:`.tracing`'s
:class:`GpuTracing`, which ties them to a session for the profiler.

Importing the package is light (the CuPy-timing module only): ``stepscope/__init__`` imports it
so that it registers ``annotate(gpu=True)``'s timer and ``sync_gpu`` with the core's hooks
(``stepscope.core.hooks``). The CUPTI/NVML side (``tracing`` and what it imports, about 250 ms
of imports) loads on first use of one of its names.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..core import hooks
from .cupy_timing import CupyEventTimer, cupy_module, sync_current_stream

__all__ = [
    "ActivityBatch", "ConvertStats", "CuptiTracer", "DeviceLimits", "GpuTraceConverter",
    "GpuTracing", "NvmlSampler", "active_blocks_per_sm", "bucket_metrics", "choose_bucket_ns",
    "detect_devices", "kernel_category", "kernel_class", "kernel_estimates",
]  # fmt: skip


def _gpu_timer(session: Any) -> CupyEventTimer | None:
    """The CUDA-event timer of ``session`` (None while the program has not imported CuPy)."""
    return CupyEventTimer(session) if cupy_module() is not None else None


hooks.gpu_timer_factory = _gpu_timer
hooks.sync_gpu = sync_current_stream


def __getattr__(name: str) -> Any:
    # the CUPTI/NVML names load on first use (import cost, not a loop: tracing imports nothing
    # that imports this package's __init__ back)
    if name in __all__:
        value = getattr(importlib.import_module(".tracing", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
