"""The one "rebind on state change" mechanism.

Cached objects (the public API's ranges by name, the profiler's phases) each get a class of
their own whose ``__enter__``/``__exit__`` are set for the recording state: while recording, the
begin chain itself and the end; otherwise C no-ops. The hot path then checks no state. When
recording turns on or off (``recorder.set_state``), every object of each ``Rebound`` set is bound
again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Rebound:
    """Objects rebound together: ``bind(obj, on, detail)`` for each of ``objects``' values.
    Create and store objects with ``lock`` held, so that none misses a state change."""

    def __init__(self, bind: Callable[[Any, bool, bool], None]):
        self.objects: dict[Any, Any] = {}
        self.lock = threading.RLock()  # reentrant: a signal handler may stop the session meanwhile
        self._bind = bind

    def rebind(self, on: bool, detail: bool) -> None:
        # a timeout, not a plain acquire: in a forked child the lock may belong to a thread that
        # no longer exists (the child is single-threaded then, so going on without it is safe)
        locked = self.lock.acquire(timeout=1.0)
        try:
            for obj in list(self.objects.values()):
                self._bind(obj, on, detail)
        finally:
            if locked:
                self.lock.release()
