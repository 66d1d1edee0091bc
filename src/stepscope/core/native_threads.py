"""System thread ids of threads that Python has no ``Thread`` for, and their names.

CUPTI names the thread of each CUDA call by ``pthread_self()`` cut to 32 bits. A Python thread
maps through ``threading`` (its ident is that ``pthread_t``, beside its native id), but a C++
thread is unknown there: torch's autograd device threads, which launch every backward kernel on a
GPU. Left unmapped, their calls sat on a process-level track, apart from the thread's operators,
so the operators summary gave backward operators no GPU time.

How a ``pthread_t`` becomes a tid (Linux, x86-64, glibc): ``pthread_t`` is the address of the
thread's ``struct pthread``, which begins with the TCB header whose ``tcb`` and ``self`` words both
point to the struct, and which holds the kernel's tid at a fixed offset. That offset is learnt once
from two threads whose pair is known (this one and a probe thread; the main thread's tid equals
the pid, so it alone could match other fields). A 32-bit id is then looked for in each private
anonymous writable mapping (where thread stacks and their structs are): the address there that
ends in those 32 bits is taken where its two TCB words point to it and its tid is a task of this
process; an id that more than one address answers stays unresolved. Memory is read through
``/proc/self/mem``, where an unmapped address is an error and never a crash. Elsewhere (another
OS, processor or C library, an unreadable ``/proc``) nothing is resolved, and such calls stay on
the process-level track, named after the id.
"""

from __future__ import annotations

import _thread
import os
import platform
import struct
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

_LOW32 = 0xFFFFFFFF
_SCAN = 0x800  # bytes of a struct pthread searched for the tid (glibc 2.3x: at 0x2d0)
_UNLEARNT = -1
_offset = _UNLEARNT  # the tid's offset in struct pthread; None where it cannot be learnt
_lock = threading.Lock()


def thread_name(tid: int) -> str:
    """A system thread's name from /proc (empty if it has ended or /proc is missing)."""
    try:
        with open(f"/proc/self/task/{int(tid)}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _read(fd: int, addr: int, n: int) -> bytes | None:
    try:
        b = os.pread(fd, n, addr)
    except (OSError, OverflowError, ValueError):
        return None
    return b if len(b) == n else None


def _offsets_here(fd: int) -> set[int]:
    """Offsets in the calling thread's struct pthread that hold its tid (empty: no TCB there)."""
    ident, tid = threading.get_ident(), threading.get_native_id()
    b = _read(fd, ident, _SCAN)
    if b is None or struct.unpack_from("<QQQ", b)[0::2] != (ident, ident):
        return set()
    return {k for k in range(0x18, _SCAN, 4) if struct.unpack_from("<i", b, k)[0] == tid}


def _learn_offset(fd: int) -> int | None:
    """The offset, from this thread and a probe thread; returns once the probe has left the
    process's tasks: glibc gives a new thread the struct pthread of one that ended, so the
    probe may hold the ``pthread_t`` that an ended thread's calls name, and until the kernel
    clears its tid there (at its exit) the scan would give those calls to the probe."""
    here = _offsets_here(fd)
    probe: list[Any] = []
    done = _thread.allocate_lock()
    done.acquire()

    def run() -> None:
        try:
            probe.append(threading.get_native_id())
            probe.append(_offsets_here(fd))
        finally:
            done.release()

    try:
        _thread.start_new_thread(run, ())
    except RuntimeError:
        return None
    if not done.acquire(timeout=5) or len(probe) < 2:
        return None
    for _ in range(2000):  # (a thread leaves within microseconds of its function's return)
        if not os.path.exists(f"/proc/self/task/{probe[0]}"):
            break
        time.sleep(0.0005)
    both = here & probe[1]
    return both.pop() if len(both) == 1 else None


def supported() -> bool:
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


def tids_of_pthreads(ids: Iterable[int]) -> dict[int, int]:
    """``pthread_self()`` values cut to 32 bits (CUPTI's thread ids) → the system ids of this
    process's live threads that have them; the ids not found are left out."""
    global _offset
    wanted = {int(i) & _LOW32 for i in ids}
    if not wanted or not supported():
        return {}
    try:
        fd = os.open("/proc/self/mem", os.O_RDONLY)
    except OSError:
        return {}
    try:
        with _lock:
            if _offset == _UNLEARNT:
                _offset = _learn_offset(fd)
            off = _offset
        if off is None:
            return {}
        tasks = {int(t) for t in os.listdir("/proc/self/task")}
        found: dict[int, set[int]] = {}
        for lo, hi in _stack_like_mappings():
            for high in range(lo >> 32, ((hi - 1) >> 32) + 1):
                for low in wanted:
                    addr = (high << 32) | low
                    if addr < lo or addr + off + 4 > hi:
                        continue
                    b = _read(fd, addr, off + 4)
                    if b is None or struct.unpack_from("<QQQ", b)[0::2] != (addr, addr):
                        continue
                    tid = struct.unpack_from("<i", b, off)[0]
                    if tid in tasks:
                        found.setdefault(low, set()).add(tid)
        return {low: tids.pop() for low, tids in found.items() if len(tids) == 1}
    except OSError:
        return {}
    finally:
        os.close(fd)


def _stack_like_mappings() -> list[tuple[int, int]]:
    """The private anonymous writable mappings of at most 1 GiB, where glibc puts a thread's
    stack and its struct pthread. Device files' mappings (a GPU driver's, CUDA's managed memory,
    which a read could migrate) are never read."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 5 or fields[1] != "rw-p" or fields[4] != "0":
                continue
            if len(fields) > 5 and fields[5] not in ("[heap]", "[stack]"):
                continue
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if hi - lo <= 1 << 30:
                out.append((lo, hi))
    return out
