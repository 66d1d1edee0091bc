"""A thread started below ``threading``, as a C++ library starts one (torch's autograd threads)."""

from __future__ import annotations

import _thread
import ctypes


class RawThread:
    """A thread started below ``threading`` (as a C++ library starts one): Python has no
    ``Thread`` for it. It notes its ids and name, then waits until ``end()``."""

    def __init__(self, name: bytes = b"") -> None:
        self._ready, self._go = _thread.allocate_lock(), _thread.allocate_lock()
        self._ready.acquire()
        self._go.acquire()
        self._done = _thread.allocate_lock()
        self._done.acquire()
        self.name = name
        _thread.start_new_thread(self._run, ())
        assert self._ready.acquire(timeout=5)

    def _run(self) -> None:
        if self.name:
            libc = ctypes.CDLL(None)
            libc.pthread_setname_np(ctypes.c_ulong(_thread.get_ident()), self.name)
        self.ident, self.tid = _thread.get_ident(), _thread.get_native_id()
        self._ready.release()
        self._go.acquire()
        self._done.release()

    def end(self) -> None:
        self._go.release()
        assert self._done.acquire(timeout=5)
