"""stepscope: a framework-free, Perfetto-native tracing SDK for ML training and inference.

Instrument like ``nvtx`` (``annotate``, ``push_range``/``pop_range``, ``start_range``/``end_range``,
``mark``, ``counter``), trace with ``stepscope.trace(path)`` or ``start``/``stop``, and open the
``.pftrace`` file in ui.perfetto.dev.
"""

from __future__ import annotations

import sys

from . import _nvtx
from . import gpu as _gpu  # noqa: F401 - registers the GPU hooks with the core (light)
from ._api import (
    RangeHandle,
    annotate,
    counter,
    end_range,
    mark,
    pop_range,
    push_range,
    set_forwarding,
    start,
    start_range,
    stop,
    trace,
)
from .core.session import Session, current
from .profiler import (
    ALWAYS,
    Profiler,
    Schedule,
    dataloader,
    epoch,
    phase,
    schedule,
    step,
)

__version__ = "0.1.0"


_nvtx.set_api(sys.modules[__name__])  # captured nvtx calls go through the public names


def capture_nvtx():
    """Record the ``nvtx`` calls user code and libraries already make (see ``_nvtx``)."""
    return _nvtx.capture_nvtx()


def release_nvtx() -> None:
    _nvtx.release_nvtx()


__all__ = [
    "ALWAYS",
    "Profiler",
    "RangeHandle",
    "Schedule",
    "Session",
    "annotate",
    "capture_nvtx",
    "counter",
    "current",
    "dataloader",
    "end_range",
    "epoch",
    "mark",
    "phase",
    "pop_range",
    "push_range",
    "release_nvtx",
    "schedule",
    "set_forwarding",
    "start",
    "start_range",
    "step",
    "stop",
    "trace",
]
