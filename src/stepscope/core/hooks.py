"""Where producers plug into the core without the core importing them.

The core (session, recorder, writer) sits below the producers (``profiler``, ``gpu``,
``pytorch``): it never imports them. A producer that the core must call back sets one of these
module attributes when it is imported; ``stepscope/__init__`` imports ``stepscope.gpu`` (light:
CuPy timing only, the CUPTI/NVML tracing loads on first use), so the hooks are set as soon as
the public API is.

``gpu_timer_factory(session)``: the session's CUDA-event timer for ``annotate(..., gpu=True)``
(an object with ``push``/``pop``/``poll``), or None where it cannot time (no CuPy).
``sync_gpu()``: wait for the current stream's device work (``sync_gpu=True`` ranges and phases).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _no_timer(session: Any) -> None:
    return None


def _no_sync() -> None:
    return None


gpu_timer_factory: Callable[[Any], Any | None] = _no_timer
sync_gpu: Callable[[], None] = _no_sync
