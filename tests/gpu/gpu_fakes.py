"""A stand-in for ``cupti.cupti`` that hands recorded records to the live path."""

from __future__ import annotations

import ctypes
import enum
import threading
import time
from types import SimpleNamespace

import numpy as np


class ActivityKind(enum.IntEnum):  # CUpti_ActivityKind values
    MEMCPY = 1
    MEMSET = 2
    DRIVER = 4
    RUNTIME = 5
    CONCURRENT_KERNEL = 10
    SYNCHRONIZATION = 38


class RuntimeCbid(enum.IntEnum):
    cudaGetDevice_v3020 = 17
    cudaMemcpyAsync_v3020 = 41
    cudaMemsetAsync_v3020 = 51
    cudaStreamSynchronize_v3020 = 131
    cudaEventSynchronize_v3020 = 138
    cudaDeviceSynchronize_v3020 = 165
    cudaLaunchKernel_v7000 = 211
    cudaLaunchKernelExC_v11060 = 430


class DriverCbid(enum.IntEnum):
    cuCtxGetCurrent = 677
    cuLaunchKernel = 307


class FakeCupti:
    """Just enough of cupti-python's activity API; flush hands the records over in 3 buffers."""

    ActivityKind = ActivityKind
    runtime_api_trace_cbid = RuntimeCbid
    driver_api_trace_cbid = DriverCbid

    def __init__(self, records, *, per_api=False, dropped=2):
        self.records = records
        self.enabled: set[int] = set()
        self.api_enabled: list[tuple[str, int]] = []
        self.dropped = dropped
        if per_api:
            self.activity_enable_runtime_api = lambda c, on: self.api_enabled.append(("rt", c, on))
            self.activity_enable_driver_api = lambda c, on: self.api_enabled.append(("drv", c, on))

    def activity_register_callbacks(self, requested, completed):
        self.requested, self.completed = requested, completed

    def activity_enable(self, kind):
        self.enabled.add(int(kind))

    def activity_disable(self, kind):
        self.enabled.discard(int(kind))

    def get_timestamp(self):
        return time.time_ns() - 3000

    def activity_get_num_dropped_records(self, ctx, stream):
        return self.dropped

    def activity_flush_all(self, flag):
        size, _ = self.requested()
        assert size > 0
        objs = [
            SimpleNamespace(**{**r, "kind": int(ActivityKind[r["kind"]])}) for r in self.records
        ]
        for part in np.array_split(np.arange(len(objs)), 3):
            self.completed([objs[i] for i in part])


class FakeCuda:
    """CuPy's ``cuda`` namespace, with a GPU clock the test moves by hand.

    As in CuPy, the current stream is per host thread: :meth:`use_stream` sets the calling
    thread's; threads that set none use the default stream (``ptr`` 0x1234 here).
    """

    def __init__(self):
        self.gpu_now = 0
        self.synced = 0
        self.recorded: list[tuple[int, int]] = []  # (stream ptr, GPU time) per event record
        cuda = self

        class Event:
            def __init__(self):
                self.t, self.done = None, False

            def record(self, stream=None):
                self.t = cuda.gpu_now
                ptr = (stream or cuda.get_current_stream()).ptr
                cuda.recorded.append((ptr, self.t))

            def synchronize(self):
                cuda.synced += 1
                self.done = True

        class Stream:
            def __init__(self, ptr=0x1234):
                self.ptr = ptr

            def synchronize(self):
                cuda.synced += 1

        class Device:
            id = 0

        self.Event, self.Device, self.Stream = Event, Device, Stream
        self._default = Stream()
        self._current: dict[int, Stream] = {}
        self.runtime = SimpleNamespace(getDeviceProperties=lambda d: {"name": b"Fake GPU"})

    def use_stream(self, ptr):
        self._current[threading.get_ident()] = self.Stream(ptr)

    def get_current_stream(self):
        return self._current.get(threading.get_ident(), self._default)

    @staticmethod
    def get_elapsed_time(a, b):
        return (b.t - a.t) / 1e6  # ms, as cudaEventElapsedTime


# --- raw CUPTI buffers -------------------------------------------------------------------------

KIND_VALUES = {"MEMCPY": 1, "MEMSET": 2, "DRIVER": 4, "RUNTIME": 5, "CONCURRENT_KERNEL": 10,
               "SYNCHRONIZATION": 38}  # fmt: skip
# record sizes used by the synthetic buffers: larger than the decoder's prefixes, multiples of 8,
# as newer CUPTI versions append fields (the decoder must step by these, not by its prefix)
RAW_SIZES = {10: 200, 1: 88, 2: 88, 38: 48, 5: 40, 4: 40}
# layout field -> fixture record key (cupti-python attribute names)
_RAW_KEYS = {
    "device": "device_id", "context": "context_id", "stream": "stream_id",
    "correlation": "correlation_id", "registers": "registers_per_thread",
    "static_smem": "static_shared_memory", "dynamic_smem": "dynamic_shared_memory",
    "process": "process_id", "thread": "thread_id", "event": "cuda_event_id",
}  # fmt: skip


class CStrings:
    """Kernel names as C strings that outlive the buffers (as CUPTI's do)."""

    def __init__(self):
        self._keep: dict[str, ctypes.Array] = {}

    def address(self, name: str) -> int:
        buf = self._keep.get(name)
        if buf is None:
            buf = self._keep[name] = ctypes.create_string_buffer(name.encode())
        return ctypes.addressof(buf)


def encode_record(rec: dict, names: CStrings, sizes=RAW_SIZES) -> bytes:
    """One fixture record as the bytes CUPTI writes (layouts of ``cupti_buffers``)."""
    from stepscope.gpu import cupti_buffers as cb
    from stepscope.gpu.records import ID_COLUMNS, INVALID_ID

    kind = KIND_VALUES[rec["kind"]]
    layout = cb._TABLES[kind][1]
    padded = np.dtype({"names": layout.names,
                       "formats": [layout.fields[n][0] for n in layout.names],
                       "offsets": [layout.fields[n][1] for n in layout.names],
                       "itemsize": sizes[kind]})  # fmt: skip
    row = np.zeros(1, dtype=padded)
    for col in layout.names:
        if col == "kind":
            row[col] = kind
        elif col == "name":
            row[col] = names.address(rec.get("name", "?"))
        else:
            default = INVALID_ID if col in ID_COLUMNS else 0
            row[col] = rec.get(_RAW_KEYS.get(col, col), default)
    return row.tobytes()


def encode_buffers(
    records, names: CStrings, per_buffer: int, sizes=RAW_SIZES
) -> list[tuple[bytes, int]]:
    """Records packed back to back into buffers of ``per_buffer`` records: (bytes, count)."""
    out = []
    for i in range(0, len(records), per_buffer):
        part = records[i : i + per_buffer]
        out.append((b"".join(encode_record(r, names, sizes) for r in part), len(part)))
    return out


class FakeLibCupti:
    """The three libcupti entry points the raw path calls, over synthetic buffers: on flush it
    asks the registered request callback for buffers, copies the records in and completes them."""

    def __init__(self, buffers: list[tuple[bytes, int]], sizes=RAW_SIZES):
        self.buffers = buffers
        self.sizes = sizes
        self.next_record_calls = 0
        self.dropped = 0
        self.request = self.complete = None

    def cuptiActivityRegisterCallbacks(self, request, complete):  # noqa: N802 - C name
        self.request, self.complete = request, complete
        return 0

    def cuptiActivityGetNextRecord(self, buffer, valid, record):  # noqa: N802 - C name
        self.next_record_calls += 1
        rec = record._obj  # the c_void_p passed by reference
        off = rec.value - buffer.value
        kind = int.from_bytes(ctypes.string_at(rec.value, 4), "little")
        nxt = off + self.sizes[kind]
        if nxt >= valid:
            return 1  # CUPTI_ERROR_MAX_LIMIT_REACHED
        rec.value = buffer.value + nxt
        return 0

    def flush(self):
        for data, count in self.buffers:
            ptr = ctypes.POINTER(ctypes.c_uint8)()
            size, maxrec = ctypes.c_size_t(0), ctypes.c_size_t(0)
            self.request(ctypes.byref(ptr), ctypes.byref(size), ctypes.byref(maxrec))
            if not ptr:  # no buffer: CUPTI drops (and counts) what it would have written
                self.dropped += count
                continue
            assert size.value >= len(data)
            ctypes.memmove(ptr, data, len(data))
            self.complete(None, 0, ptr, size.value, len(data))
        self.buffers = []


class FakeRawCupti(FakeCupti):
    """cupti-python stand-in whose flush goes through :class:`FakeLibCupti` (the raw path)."""

    def __init__(self, records, lib: FakeLibCupti, **kw):
        super().__init__(records, **kw)
        self.lib = lib
        self.requested = self.completed = None

    def activity_flush_all(self, flag):
        assert self.requested is None, "the raw path must not register cupti-python's callbacks"
        self.lib.flush()

    def activity_get_num_dropped_records(self, ctx, stream):
        return self.dropped + self.lib.dropped
