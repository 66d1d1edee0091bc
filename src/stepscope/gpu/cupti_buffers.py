"""CUPTI activity buffers taken raw and decoded in bulk with numpy (no Python object per record).

Why: cupti-python (12.8 to 13.x; its user guide: "the activity records are returned through the
func_buffer_completed callback as corresponding Python objects") hands the completion callback of
``activity_register_callbacks`` a *list of Python objects*, one per record, built by the binding;
its buffer-requested callback only returns ``(size, max_num_records)``: the buffer address and
valid size never reach Python. That object per record is the cost the issue measured (+6 % to
+12 % of a launch-bound step). So this module talks to the *same* ``libcupti`` that cupti-python
loaded, through ``ctypes``: ``cuptiActivityRegisterCallbacks`` gets two C callbacks that run one
Python call per **buffer** (hand out a pre-allocated buffer; keep ``(buffer, validSize)``), and
all decoding waits for the end of the detail window:

1. walk: one pass over the buffer reading only each record's ``kind`` (a ``uint32`` at offset 0)
   and stepping by that kind's record size. Sizes differ between CUPTI versions (the kernel
   record grew from ``CUpti_ActivityKernel4``, 144 bytes, to ``…Kernel10``, 216, the newest in
   the CUDA 13.0 headers; later 13.x may write newer ones), so they are learnt from
   CUPTI itself: the first record of each kind is stepped over with
   ``cuptiActivityGetNextRecord`` and the distance kept;
2. gather: per kind and per field, one numpy fancy index into a typed view of the buffer (every
   field of these packed, 8-byte aligned structs is naturally aligned).

The layouts below are the fields' byte offsets in ``cupti_activity.h`` (records are
``__attribute__((packed, aligned(8)))``), in the prefix the record versions share. In the CUDA
13.0 headers, ``CUpti_ActivityKernel5`` … ``Kernel10`` have identical offsets up to ``graphId`` at
156 (each version appends fields), as do ``CUpti_ActivityMemcpy4`` … ``Memcpy6`` and
``CUpti_ActivityMemset3``/``Memset4`` up to ``graphId`` at 72; ``CUpti_ActivityAPI`` and
``CUpti_ActivitySynchronization`` are 40 bytes (``Synchronization2``: 56). The 13.0 headers say
CUPTI writes ``Kernel10``, ``Memcpy6``, ``Memset4``, ``Synchronization2`` and ``API``;
``tests/gpu/test_cupti_layouts.py`` checks these layouts against gcc's reading of those headers
(``tools/cupti_layouts.py``), and the newer versions CUPTI 13.4 writes (``Kernel11``-``13``,
``Memcpy7``, ``Memset5``) against cupti-python 13.4's numpy dtypes of those records. Versions
newer still are taken to append fields only, as every version so far did. A learnt size smaller
than the prefix means an unknown layout: that kind's records are counted as dropped, never
misread (older versions are all smaller than it).

Kernel names are ``const char *`` owned by CUPTI (shared by all records of one kernel and kept for
the process' life); they are read once per distinct pointer.

Without a GPU none of the ctypes side runs; :func:`decode_buffers` is tested on synthetic buffers
built with the same dtypes.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .records import (
    API_DTYPE,
    KERNEL_DTYPE,
    MEMCPY_DTYPE,
    MEMSET_DTYPE,
    SYNC_DTYPE,
    ActivityBatch,
    intern,
    to_table,
)

log = logging.getLogger("stepscope.gpu")

# CUpti_ActivityKind values
KIND_MEMCPY, KIND_MEMSET, KIND_KERNEL, KIND_DRIVER, KIND_RUNTIME = 1, 2, 3, 4, 5
KIND_CONCURRENT_KERNEL, KIND_SYNCHRONIZATION = 10, 38


def _layout(fields: list[tuple[str, str, int]], itemsize: int) -> np.dtype:
    names, formats, offsets = zip(*fields, strict=True)
    return np.dtype({"names": list(names), "formats": list(formats), "offsets": list(offsets),
                     "itemsize": itemsize})  # fmt: skip


# CUpti_ActivityKernel5..10 (and, appending only, later): the prefix up to graphId
RAW_KERNEL = _layout(
    [("kind", "<u4", 0), ("registers", "<u2", 6), ("start", "<u8", 16), ("end", "<u8", 24),
     ("device", "<u4", 40), ("context", "<u4", 44), ("stream", "<u4", 48),
     ("grid_x", "<i4", 52), ("grid_y", "<i4", 56), ("grid_z", "<i4", 60),
     ("block_x", "<i4", 64), ("block_y", "<i4", 68), ("block_z", "<i4", 72),
     ("static_smem", "<i4", 76), ("dynamic_smem", "<i4", 80), ("correlation", "<u4", 92),
     ("name", "<u8", 104), ("graph_node_id", "<u8", 144), ("graph_id", "<u4", 156)],
    160,
)  # fmt: skip
# CUpti_ActivityMemcpy4/5/6 (and later): the prefix up to graphId
RAW_MEMCPY = _layout(
    [("kind", "<u4", 0), ("copy_kind", "u1", 4), ("src_kind", "u1", 5), ("dst_kind", "u1", 6),
     ("bytes", "<u8", 8), ("start", "<u8", 16), ("end", "<u8", 24), ("device", "<u4", 32),
     ("context", "<u4", 36), ("stream", "<u4", 40), ("correlation", "<u4", 44),
     ("graph_node_id", "<u8", 64), ("graph_id", "<u4", 72)],
    76,
)  # fmt: skip
# CUpti_ActivityMemset3/4: the prefix up to graphId
RAW_MEMSET = _layout(
    [("kind", "<u4", 0), ("value", "<u4", 4), ("bytes", "<u8", 8), ("start", "<u8", 16),
     ("end", "<u8", 24), ("device", "<u4", 32), ("context", "<u4", 36), ("stream", "<u4", 40),
     ("correlation", "<u4", 44), ("graph_node_id", "<u8", 64), ("graph_id", "<u4", 72)],
    76,
)  # fmt: skip
# CUpti_ActivityAPI (runtime and driver)
RAW_API = _layout(
    [("kind", "<u4", 0), ("cbid", "<u4", 4), ("start", "<u8", 8), ("end", "<u8", 16),
     ("process", "<u4", 24), ("thread", "<u4", 28), ("correlation", "<u4", 32)],
    40,
)  # fmt: skip
# CUpti_ActivitySynchronization (…2 appends cudaEventSyncId, returnValue, pad: 56 bytes)
RAW_SYNC = _layout(
    [("kind", "<u4", 0), ("type", "<u4", 4), ("start", "<u8", 8), ("end", "<u8", 16),
     ("correlation", "<u4", 24), ("context", "<u4", 28), ("stream", "<u4", 32),
     ("event", "<u4", 36)],
    40,
)  # fmt: skip

# kind -> (batch attribute, raw layout, columnar dtype)
_TABLES: dict[int, tuple[str, np.dtype, np.dtype]] = {
    KIND_CONCURRENT_KERNEL: ("kernels", RAW_KERNEL, KERNEL_DTYPE),
    KIND_KERNEL: ("kernels", RAW_KERNEL, KERNEL_DTYPE),
    KIND_MEMCPY: ("memcpys", RAW_MEMCPY, MEMCPY_DTYPE),
    KIND_MEMSET: ("memsets", RAW_MEMSET, MEMSET_DTYPE),
    KIND_SYNCHRONIZATION: ("syncs", RAW_SYNC, SYNC_DTYPE),
    KIND_RUNTIME: ("runtime", RAW_API, API_DTYPE),
    KIND_DRIVER: ("driver", RAW_API, API_DTYPE),
}


@dataclass
class RawBuffer:
    """One completed CUPTI buffer: ``data`` supports the buffer protocol (bytes, ctypes array)."""

    data: Any
    valid: int
    own: bool = True  # one of ours, back to the pool once decoded (else a copy: dropped)


@dataclass
class WalkResult:
    """Record offsets and kinds of one buffer; ``undecoded`` counts records past a stop.
    ``end``: the end of the valid bytes. A kind not in ``RecordSizes.known`` after the walk
    can only be the last record's (any earlier one taught its size), which is at most
    ``end - offsets[-1]`` bytes."""

    offsets: np.ndarray
    kinds: np.ndarray
    undecoded: int = 0
    end: int = 0


@dataclass
class RecordSizes:
    """Record size per kind, learnt once per process from CUPTI (or given, in tests).

    ``learn(buffer_address, valid_size, offset)`` returns the offset of the record after the one
    at ``offset`` (``cuptiActivityGetNextRecord``), or ``valid_size`` after the last one.
    """

    known: dict[int, int] = field(default_factory=dict)
    learn: Callable[[int, int, int], int] | None = None

    def learn_size(self, kind: int, address: int, valid: int, offset: int) -> int | None:
        """Size of a kind not in ``known`` (:func:`walk` looks there first), or None."""
        if self.learn is None:
            return None
        try:
            s = self.learn(address, valid, offset) - offset
        except Exception as exc:
            log.debug("stepscope: cannot step over a CUPTI record of kind %d: %s", kind, exc)
            return None
        if s <= 0 or s % 8:
            return None
        if offset + s < valid:  # the last record's distance is only an upper bound
            self.known[kind] = s
        return s


def buffer_address(data: Any) -> int:
    """Address of a writable buffer (a ctypes array); 0 for read-only bytes."""
    try:
        return ctypes.addressof(data)
    except TypeError:
        return 0


def walk(buf: RawBuffer, sizes: RecordSizes) -> WalkResult:
    """Offsets and kinds of the records in a buffer, stepping by each kind's record size.

    A kind whose size is unknown (or not a multiple of 8) stops the walk: the rest of the buffer
    is counted in ``undecoded`` (estimated at the smallest known size) rather than guessed at.
    """
    mv = memoryview(buf.data).cast("B")
    valid = min(int(buf.valid), mv.nbytes)
    address = buffer_address(buf.data)
    unpack = struct.Struct("<I").unpack_from
    offsets: list[int] = []
    append, get = offsets.append, sizes.known.get
    off, undecoded = 0, 0
    while off + 4 <= valid:  # the only per-record Python: one unpack, one dict lookup
        kind = unpack(mv, off)[0]
        step = get(kind)
        if not step:
            step = sizes.learn_size(kind, address, valid, off)
        if not step or off + step > valid:
            undecoded = max(1, (valid - off) // min(sizes.known.values(), default=8))
            break
        append(off)
        off += step
    offs = np.asarray(offsets, np.int64)
    words = np.frombuffer(buf.data, dtype=np.uint8)[: valid - valid % 4].view("<u4")
    return WalkResult(offs, words[offs // 4].astype(np.uint32), undecoded, valid)


def gather(data: Any, offsets: np.ndarray, layout: np.dtype) -> np.ndarray:
    """Records at ``offsets`` as a structured array of ``layout`` (one fancy index per field)."""
    out = np.empty(offsets.size, dtype=np.dtype([(n, layout.fields[n][0]) for n in layout.names]))
    raw = np.frombuffer(data, dtype=np.uint8)
    for name in layout.names:
        ftype, foff = layout.fields[name][:2]
        width = ftype.itemsize
        usable = raw[: raw.size - raw.size % width]
        out[name] = usable.view(ftype)[(offsets + foff) // width]
    return out


MAX_NAME_BYTES = 1 << 16


def process_maps(maps: str = "/proc/self/maps") -> list[tuple[int, int, str, str]] | None:
    """(start, end, permissions, path) of each memory mapping of this process; None without
    ``/proc``."""
    out = []
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(None, 5)
                lo, hi = parts[0].split("-")
                path = parts[5].strip() if len(parts) > 5 else ""
                out.append((int(lo, 16), int(hi, 16), parts[1], path))
    except (OSError, ValueError, IndexError):
        return None
    return out


def readable_ranges(maps: str = "/proc/self/maps") -> np.ndarray | None:
    """(start, end) of this process's readable memory mappings, sorted; None without ``/proc``.

    Device files' mappings (``/dev/nvidia*``: GPU memory, registers) are left out: reading
    them may fault or have side effects, and no kernel name lives there. (Shared anonymous
    memory, shown as ``/dev/zero``, stays.)
    """
    mapped = process_maps(maps)
    if mapped is None:
        return None
    spans = sorted((lo, hi) for lo, hi, perms, path in mapped
                   if perms.startswith("r")
                   and not (path.startswith("/dev/") and not path.startswith("/dev/zero")))
    return np.array(spans, dtype=np.uint64).reshape(-1, 2)


def read_c_string(address: int, ranges: np.ndarray | None = None) -> str:
    """A NUL-terminated C string owned by CUPTI (kernel name); ``?`` for NULL.

    With ``ranges`` (:func:`readable_ranges`), a pointer outside every readable mapping also
    gives ``?``, and no read goes past its mapping's end: a record layout CUPTI changed would
    give a wrong name, never a crash of the user's program.
    """
    if not address:
        return "?"
    if ranges is None:
        return ctypes.string_at(address).decode("utf-8", "replace")
    i = int(np.searchsorted(ranges[:, 0], np.uint64(address), side="right")) - 1
    if i < 0 or address >= int(ranges[i, 1]):
        return "?"
    room = min(MAX_NAME_BYTES, int(ranges[i, 1]) - address)
    size = min(256, room)
    while True:  # growing reads up to the NUL: most names are short
        raw = ctypes.string_at(address, size)
        end = raw.find(b"\0")
        if end >= 0 or size == room:
            return raw[: end if end >= 0 else size].decode("utf-8", "replace")
        size = min(size * 4, room)


def decode_buffers(
    buffers: Iterable[RawBuffer],
    sizes: RecordSizes,
    *,
    dropped: int = 0,
) -> ActivityBatch:
    """Raw buffers → one columnar batch (the same model the per-record path fills).

    Records of kinds outside :data:`_TABLES` are skipped silently; records of a kind whose learnt
    size is below the layout's prefix are counted as dropped.
    """
    parts: dict[str, list[np.ndarray]] = {}
    names: dict[int, int] = {}  # name pointer -> interned index
    for buf in buffers:
        w = walk(buf, sizes)
        dropped += w.undecoded
        for kind in np.unique(w.kinds).tolist():
            if kind not in _TABLES:
                continue
            attr, layout, dtype = _TABLES[kind]
            offs = w.offsets[w.kinds == kind]
            if sizes.known.get(kind, w.end - int(w.offsets[-1])) < layout.itemsize:
                dropped += int(offs.size)
                continue
            raw = gather(buf.data, offs, layout)
            parts.setdefault(attr, []).append(_to_columns(raw, dtype, names))
    b = ActivityBatch(dropped=int(dropped))
    for attr, chunks in parts.items():
        setattr(b, attr, np.concatenate(chunks))
    ranges = readable_ranges() if names else None
    b.names = [read_c_string(p, ranges) for p in names]
    return b


def _to_columns(raw: np.ndarray, dtype: np.dtype, names: dict[int, int]) -> np.ndarray:
    cols = {c: raw[c] for c in dtype.names if c in raw.dtype.names}
    if "name" in cols:  # C string pointers -> kernel name ids
        cols["name"] = intern(raw["name"].tolist(), names)
    return to_table(dtype, cols, raw.size)


# --- the ctypes side: CUPTI's buffer callbacks, one Python call per buffer ----------------------

_REQUEST = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.POINTER(ctypes.c_uint8)),
                            ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
_COMPLETE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32,
                             ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t, ctypes.c_size_t)
CUPTI_SUCCESS = 0


def loaded_libcupti_path(maps: str = "/proc/self/maps") -> str | None:
    """Path of the ``libcupti`` already mapped into this process (the one cupti-python uses).

    Loading exactly that file matters: a second copy of CUPTI would be a second, competing
    subscriber. None when no libcupti is mapped, when two different copies are (which one
    cupti-python uses is unknown: registering with the other would leave the trace silently
    empty, so the per-record path is safer), or on systems without ``/proc``.
    """
    mapped = process_maps(maps)
    paths = {path for *_, path in mapped or () if "/libcupti.so" in path}
    return paths.pop() if len(paths) == 1 else None


_BUFFER_BYTES, _MAX_BUFFERS = 8 << 20, 16  # RawActivityBuffers' defaults
_PROCESS_RAW: RawActivityBuffers | None = None  # see RawActivityBuffers.open
_PROCESS_RAW_LOCK = threading.Lock()  # two tracers starting at once must not make two


class RawActivityBuffers:
    """Owns the buffers handed to CUPTI and the two C callbacks (see the module docstring).

    ``lib`` is a ``ctypes.CDLL`` of libcupti (tests pass a stand-in with the same functions).
    At most ``max_buffers`` buffers of ``buffer_bytes`` are in use at once; past that, the
    request callback hands CUPTI no buffer and CUPTI counts the records it drops.
    """

    def __init__(self, lib: Any, *, buffer_bytes: int = _BUFFER_BYTES,
                 max_buffers: int = _MAX_BUFFERS) -> None:
        self.lib = lib
        self.buffer_bytes, self.max_buffers = self._settings(
            buffer_bytes=buffer_bytes, max_buffers=max_buffers
        )
        self.sizes = RecordSizes(learn=self._next_record_offset)
        self.refused = 0  # requests answered with no buffer
        self.lost_buffers = 0  # completed to another client's callbacks (see reclaim)
        self.foreign_buffers = 0  # another client's, completed to ours (see _take_foreign)
        self._lock = threading.Lock()
        self._free: list[Any] = []
        self._in_use: dict[int, Any] = {}
        self._completed: list[RawBuffer] = []
        self._allocated = 0
        self._request_cb = _REQUEST(self._on_request)
        self._complete_cb = _COMPLETE(self._on_complete)

    @classmethod
    def open(cls, **kw: Any) -> RawActivityBuffers | None:
        """The raw path over the libcupti this process already loaded, or None.

        One instance per process, never freed: CUPTI keeps the C callbacks and the buffers it
        was handed, and may call back or write after any tracer is gone (a window that failed
        before disabling activity); freeing them would crash the program.
        """
        with _PROCESS_RAW_LOCK:
            raw = _PROCESS_RAW
            if raw is None:
                return cls._open_new(**kw)
        want = cls._settings(**kw)
        have = (raw.buffer_bytes, raw.max_buffers)
        if want != have:  # the buffers already handed to CUPTI stay as they are
            log.debug(
                "stepscope: raw CUPTI buffers already open with (buffer_bytes, max_buffers) %s;"
                " %s ignored", have, want,
            )  # fmt: skip
        return raw

    @staticmethod
    def _settings(*, buffer_bytes: int = _BUFFER_BYTES,
                  max_buffers: int = _MAX_BUFFERS) -> tuple[int, int]:
        """(buffer_bytes, max_buffers) as :meth:`__init__` would store them."""
        return (int(buffer_bytes) + 7) & ~7, int(max_buffers)

    @classmethod
    def _open_new(cls, **kw: Any) -> RawActivityBuffers | None:
        global _PROCESS_RAW
        path = loaded_libcupti_path()
        if path is None:
            return None
        try:
            lib = ctypes.CDLL(path)
            for fn in ("cuptiActivityRegisterCallbacks", "cuptiActivityGetNextRecord"):
                getattr(lib, fn)
        except (OSError, AttributeError) as exc:
            log.debug("stepscope: raw CUPTI buffers unavailable (%s)", exc)
            return None
        lib.cuptiActivityGetNextRecord.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
        lib.cuptiActivityGetNextRecord.restype = ctypes.c_int
        lib.cuptiActivityRegisterCallbacks.argtypes = [_REQUEST, _COMPLETE]
        lib.cuptiActivityRegisterCallbacks.restype = ctypes.c_int
        _PROCESS_RAW = cls(lib, **kw)
        return _PROCESS_RAW

    def register(self) -> None:
        """Make CUPTI hand its buffers to this object (replaces cupti-python's callbacks)."""
        rc = self.lib.cuptiActivityRegisterCallbacks(self._request_cb, self._complete_cb)
        if rc != CUPTI_SUCCESS:
            raise RuntimeError(f"cuptiActivityRegisterCallbacks failed ({rc})")

    # CUPTI's threads (or the thread calling cuptiActivityFlushAll) run these two
    def _on_request(self, buffer, size, max_records) -> None:
        # "no buffer" first: ctypes swallows an exception raised below (an allocation failing),
        # and CUPTI would then read whatever these outputs held
        buffer[0] = ctypes.POINTER(ctypes.c_uint8)()
        size[0] = 0
        max_records[0] = 0
        with self._lock:
            if self._free:
                buf = self._free.pop()
            elif self._allocated < self.max_buffers:
                buf = (ctypes.c_uint64 * (self.buffer_bytes // 8))()  # 8-byte aligned
                self._allocated += 1
            else:
                buf = None
                self.refused += 1
            if buf is not None:
                self._in_use[ctypes.addressof(buf)] = buf
        if buf is not None:
            buffer[0] = ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint8))
            size[0] = self.buffer_bytes

    def _on_complete(self, context, stream_id, buffer, size, valid) -> None:
        address = ctypes.cast(buffer, ctypes.c_void_p).value or 0
        with self._lock:
            buf = self._in_use.pop(address, None)
            if buf is None:
                if address and valid:
                    self._take_foreign(address, int(valid))
                return
            if valid:
                self._completed.append(RawBuffer(buf, int(valid)))
            else:
                self._free.append(buf)

    def _take_foreign(self, address: int, valid: int) -> None:
        """A buffer CUPTI had from another client's request callback, completed to ours: CUPTI
        fills one buffer until it is full or flushed, so the one Kineto was handed just before
        this window (its CPU-only session enables the API kinds; seen on an H100 with torch
        2.11) would hold the window's every record. Its records are copied (the memory is the
        other client's, never freed or reused here) and decoded with ours."""
        copy = (ctypes.c_uint64 * ((valid + 7) // 8))()  # 8-byte aligned, as CUPTI's records
        ctypes.memmove(copy, address, valid)
        self._completed.append(RawBuffer(copy, valid, own=False))
        self.foreign_buffers += 1

    def _next_record_offset(self, address: int, valid: int, offset: int) -> int:
        rec = ctypes.c_void_p(address + offset)
        rc = self.lib.cuptiActivityGetNextRecord(ctypes.c_void_p(address), valid,
                                                 ctypes.byref(rec))  # fmt: skip
        if rc != CUPTI_SUCCESS:  # CUPTI_ERROR_MAX_LIMIT_REACHED: it was the last record
            return valid
        return int(rec.value) - address

    def reclaim(self) -> int:
        """Take back, after a forced flush, the buffers CUPTI never completed to us: it returns
        every buffer then, so one still out was completed to another client that registered its
        callbacks meanwhile (a ``torch.profiler`` started inside the window). Its records are
        lost to this window (the caller says so); the buffer is ours to reuse."""
        with self._lock:
            lost = list(self._in_use.values())
            self._in_use.clear()
            self._free.extend(lost)
            self.lost_buffers += len(lost)
        return len(lost)

    def take(self) -> list[RawBuffer]:
        """The completed buffers so far (call :meth:`recycle` once they are decoded)."""
        with self._lock:
            out, self._completed = self._completed, []
        return out

    def recycle(self, buffers: Iterable[RawBuffer]) -> None:
        with self._lock:
            self._free.extend(b.data for b in buffers if b.own)

    def decode(self, *, dropped: int = 0) -> ActivityBatch:
        """Decode and recycle everything completed so far."""
        bufs = self.take()
        try:
            return decode_buffers(bufs, self.sizes, dropped=dropped)
        finally:
            self.recycle(bufs)
