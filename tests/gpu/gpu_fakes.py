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
    cudaGraphAddMemcpyNode_v10000 = 290  # builds a graph: launches nothing
    cudaGraphLaunch_v10000 = 311


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

    def activity_get_num_dropped_records(self, ctx, stream, dropped):
        """As cupti-python's: the count is written to the size_t at address ``dropped``."""
        ctypes.c_size_t.from_address(dropped).value = self.dropped

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

    def activity_get_num_dropped_records(self, ctx, stream, dropped):
        ctypes.c_size_t.from_address(dropped).value = self.dropped + self.lib.dropped


# --- several devices: CuPy, libcuda, NVML ------------------------------------------------------


class FakeMultiCuda(FakeCuda):
    """:class:`FakeCuda` with several devices: a current device per host thread (as in CUDA),
    per-device GPU clocks (``gpu_now + clock_offset[device]``), events that belong to the device
    current when they were created, ``get_elapsed_time`` failing across devices as
    ``cudaEventElapsedTime`` does, and PCI bus ids."""

    def __init__(self, bus_ids=("0000:1B:00.0", "0000:3D:00.0"), clock_offset=None):
        super().__init__()
        self.bus_ids = list(bus_ids)
        self.clock_offset = clock_offset or {d: 0 for d in range(len(self.bus_ids))}
        self.set_devices: list[int] = []  # setDevice calls, in order
        self._dev: dict[int, int] = {}
        cuda = self

        class Event:
            def __init__(self):
                self.device, self.t, self.done = cuda.current_device(), None, False

            def record(self, stream=None):
                assert cuda.current_device() == self.device, "recorded on another device"
                self.t = cuda.gpu_now + cuda.clock_offset[self.device]
                cuda.recorded.append(((stream or cuda.get_current_stream()).ptr, self.t))

            def synchronize(self):
                cuda.synced += 1
                self.done = True

        class Device:
            def __init__(self, i=None):
                self.id = cuda.current_device() if i is None else i

            @property
            def pci_bus_id(self):
                return cuda.bus_ids[self.id]

        self.Event, self.Device = Event, Device
        self.runtime = SimpleNamespace(
            getDeviceProperties=lambda d: {"name": f"Fake GPU {d}".encode()},
            setDevice=self.set_device,
        )

    def current_device(self):
        return self._dev.get(threading.get_ident(), 0)

    def set_device(self, d):
        self.set_devices.append(d)
        self._dev[threading.get_ident()] = d

    @staticmethod
    def get_elapsed_time(a, b):
        if a.device != b.device:
            raise RuntimeError("cudaErrorInvalidResourceHandle")
        return (b.t - a.t) / 1e6


class FakePool:
    """CuPy's default memory pool: its numbers are the current device's, as in CuPy."""

    def __init__(self, cuda: FakeMultiCuda, used: dict, total: dict):
        self.cuda, self.used, self.total = cuda, used, total

    def used_bytes(self):
        return self.used[self.cuda.current_device()]

    def total_bytes(self):
        return self.total[self.cuda.current_device()]


class FakeLibcuda:
    """The libcuda entry points read through ctypes (pointer args by ``byref``).

    ``initialized=False``: the program has not called ``cuInit``; every call answers
    CUDA_ERROR_NOT_INITIALIZED (3). ``active``: ordinals whose primary context is active.
    """

    def __init__(self, bus_ids, *, initialized=True, active=()):
        self.bus_ids, self.initialized, self.active = list(bus_ids), initialized, set(active)
        self.calls: list[str] = []

    def cuInit(self, flags):  # noqa: N802 - C name
        self.calls.append("cuInit")
        raise AssertionError("cuInit must never be called")

    def cuDeviceGetCount(self, count):  # noqa: N802
        self.calls.append("cuDeviceGetCount")
        if not self.initialized:
            return 3
        count._obj.value = len(self.bus_ids)
        return 0

    def cuDeviceGet(self, dev, ordinal):  # noqa: N802
        self.calls.append("cuDeviceGet")
        if not self.initialized:
            return 3
        dev._obj.value = 100 + ordinal  # a CUdevice handle, not the ordinal
        return 0

    def cuDeviceGetPCIBusId(self, buf, length, dev):  # noqa: N802
        self.calls.append("cuDeviceGetPCIBusId")
        buf.value = self.bus_ids[dev.value - 100].encode()[: length - 1]
        return 0

    def cuDevicePrimaryCtxGetState(self, dev, flags, active):  # noqa: N802
        self.calls.append("cuDevicePrimaryCtxGetState")
        active._obj.value = int(dev.value - 100 in self.active)
        return 0


class FakeNvmlGpu:
    """One GPU as the fake NVML reports it."""

    def __init__(self, index, bus_id, uuid, *, util, mem, power_mw, sm_mhz, gpm=True):
        self.index, self.bus_id, self.uuid = index, bus_id, uuid
        self.util, self.mem, self.power_mw, self.sm_mhz, self.gpm = util, mem, power_mw, sm_mhz, gpm


class FakePynvml:
    """Just enough of ``pynvml`` (nvidia-ml-py) for :class:`NvmlSampler`, GPM included.

    GPM metric values are ``10 * metric id + NVML index + 0.5 * (second sample's number)``;
    ``unsupported`` metric ids come back with their own error code. Samples are counted so a test
    can check every allocated one is freed.
    """

    NVML_CLOCK_SM = 1
    NVML_GPM_METRICS_GET_VERSION = 1
    NVML_GPM_METRIC_SM_UTIL = 2
    NVML_GPM_METRIC_SM_OCCUPANCY = 3
    NVML_GPM_METRIC_ANY_TENSOR_UTIL = 5
    NVML_GPM_METRIC_DRAM_BW_UTIL = 10

    def __init__(self, gpus, *, unsupported=(), fail_sample_get=(), fail_metrics_get=False):
        self.gpus = list(gpus)
        self.unsupported = set(unsupported)
        self.fail_sample_get = set(fail_sample_get)  # NVML indices
        self.fail_metrics_get = fail_metrics_get
        self.inits = self.shutdowns = 0
        self.seq = 0
        self.live: set[int] = set()  # GPM samples allocated and not freed
        self.metrics_calls: list[tuple] = []

        class c_nvmlGpmMetricsGet_t:  # noqa: N801 - pynvml's name
            def __init__(self):
                self.version = self.numMetrics = 0
                self.sample1 = self.sample2 = None
                self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0)
                                for _ in range(98)]  # fmt: skip

        self.c_nvmlGpmMetricsGet_t = c_nvmlGpmMetricsGet_t

    def nvmlInit(self):  # noqa: N802
        self.inits += 1

    def nvmlShutdown(self):  # noqa: N802
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):  # noqa: N802
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802
        return self.gpus[i]

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):  # noqa: N802  (the C _v2 symbol)
        assert isinstance(bus_id, bytes)
        (g,) = [g for g in self.gpus if g.bus_id.lower() == bus_id.decode().lower()]
        return g

    def nvmlDeviceGetHandleByUUID(self, uuid):  # noqa: N802
        assert isinstance(uuid, bytes)
        found = [g for g in self.gpus if g.uuid == uuid.decode()]
        if not found:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return found[0]

    def nvmlDeviceGetUtilizationRates(self, h):  # noqa: N802
        return SimpleNamespace(gpu=h.util, memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):  # noqa: N802
        return SimpleNamespace(used=h.mem, total=80 << 30, free=(80 << 30) - h.mem)

    def nvmlDeviceGetPowerUsage(self, h):  # noqa: N802
        if h.power_mw is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return h.power_mw

    def nvmlDeviceGetClockInfo(self, h, kind):  # noqa: N802
        assert kind == self.NVML_CLOCK_SM
        return h.sm_mhz

    def nvmlGpmQueryDeviceSupport(self, h):  # noqa: N802
        return SimpleNamespace(isSupportedDevice=int(h.gpm))

    def nvmlGpmSampleAlloc(self):  # noqa: N802
        self.seq += 1
        self.live.add(self.seq)
        return SimpleNamespace(id=self.seq, gpu=None)

    def nvmlGpmSampleFree(self, s):  # noqa: N802
        self.live.remove(s.id)

    def nvmlGpmSampleGet(self, h, s):  # noqa: N802
        if h.index in self.fail_sample_get:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        s.gpu = h

    def nvmlGpmMetricsGet(self, mg):  # noqa: N802
        if self.fail_metrics_get:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        assert mg.version == self.NVML_GPM_METRICS_GET_VERSION
        assert mg.sample1.gpu is mg.sample2.gpu and mg.sample1.id < mg.sample2.id
        assert {mg.sample1.id, mg.sample2.id} <= self.live
        self.metrics_calls.append((mg.sample2.gpu.index, mg.sample1.id, mg.sample2.id))
        for m in mg.metrics[: mg.numMetrics]:
            if m.metricId in self.unsupported:
                m.nvmlReturn = 3  # NVML_ERROR_NOT_SUPPORTED
            else:
                m.value = 10 * m.metricId + mg.sample2.gpu.index + 0.5 * mg.sample2.id
