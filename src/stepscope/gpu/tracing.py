"""GpuTracing: ties CUPTI activity, NVML counters and the converter to a session for the profiler
(see the package docstring for the parts)."""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
from typing import Any

from ..core import native_threads
from ..core import tracks as _tracks
from .convert import ConvertStats, GpuTraceConverter
from .cupti_live import CuptiTracer, device_limits_from_cupy
from .driver import initialized_count, loaded_libcuda
from .metrics import bucket_metrics, choose_bucket_ns
from .nvml import NvmlSampler
from .occupancy import DeviceLimits, active_blocks_per_sm, kernel_estimates
from .records import ActivityBatch, kernel_category, kernel_class

__all__ = [
    "ActivityBatch", "ConvertStats", "CuptiTracer", "DeviceLimits", "GpuTraceConverter",
    "GpuTracing", "NvmlSampler", "active_blocks_per_sm", "bucket_metrics", "choose_bucket_ns",
    "detect_devices", "kernel_category", "kernel_class", "kernel_estimates",
]  # fmt: skip

log = logging.getLogger("stepscope.gpu")

# CUdevice_attribute values (cuda.h) for the driver-API fallback of detect_devices()
_CU_ATTRS = {
    "MaxThreadsPerBlock": 1, "MaxSharedMemoryPerBlock": 8, "WarpSize": 10,
    "MaxRegistersPerBlock": 12, "MultiProcessorCount": 16, "MaxThreadsPerMultiProcessor": 39,
    "computeCapabilityMajor": 75, "computeCapabilityMinor": 76,
    "MaxSharedMemoryPerMultiprocessor": 81, "MaxRegistersPerMultiprocessor": 82,
    "MaxSharedMemoryPerBlockOptin": 97, "MaxBlocksPerMultiprocessor": 106,
    "ReservedSharedMemoryPerBlock": 111,
}  # fmt: skip


def _devices_from_driver(init: bool = True) -> dict[int, DeviceLimits]:
    """Device limits through libcuda (ctypes), no Python CUDA package needed.

    ``init=False`` reads them only where the program itself already initialized CUDA (see
    :mod:`.driver`).
    """
    if init:
        try:
            cu = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return {}
        if cu.cuInit(0) != 0:
            return {}
    else:
        cu = loaded_libcuda()
    n = initialized_count(cu)
    if n is None:
        return {}
    out = {}
    for i in range(n):
        dev = ctypes.c_int(0)
        if cu.cuDeviceGet(ctypes.byref(dev), i) != 0:
            continue
        attrs: dict[str, Any] = {}
        for key, code in _CU_ATTRS.items():
            v = ctypes.c_int(0)
            if cu.cuDeviceGetAttribute(ctypes.byref(v), code, dev) == 0:
                attrs[key] = v.value
        name = ctypes.create_string_buffer(256)
        if cu.cuDeviceGetName(name, 256, dev) == 0:
            attrs["name"] = name.value.decode(errors="replace")
        try:
            out[i] = DeviceLimits.from_attributes(attrs)
        except ValueError:
            continue
    return out


def detect_devices(init: bool = True) -> dict[int, DeviceLimits]:
    """Limits of every visible CUDA device (CuPy if imported, else the driver API); {} if none.

    ``init=False``: only where the program uses CUDA already (CuPy imported, or the driver
    initialized), see :func:`_devices_from_driver`.
    """
    try:
        if not init and initialized_count(loaded_libcuda()) is None:
            return {}  # CuPy's queries below would initialize CUDA
        cp = sys.modules.get("cupy")
        if cp is not None:
            n = cp.cuda.runtime.getDeviceCount()
            found = {i: device_limits_from_cupy(i) for i in range(n)}
            if found and all(found.values()):
                return found  # type: ignore[return-value]
        return _devices_from_driver(init)
    except Exception:
        return {}


class GpuTracing:
    """Ties CUPTI, the converter and NVML to one session (used by the profiler).

    ``begin_window()`` / ``end_window(steps)`` bracket a detail window: CUPTI is enabled only
    between them and its records are converted at window end. NVML samples the whole run between
    ``start()`` and ``stop()``. Every method is safe to call without a GPU.
    """

    def __init__(
        self,
        sess: Any,
        *,
        activity: bool = True,
        nvml: bool = True,
        nvml_interval_s: float | None = None,
        bucket_ns: int | None = None,
        buffer_bytes: int = 8 << 20,
        max_records: int = 2_000_000,
        devices: dict[int, DeviceLimits] | None = None,
        tracer: CuptiTracer | None = None,
        log_level: int = logging.INFO,
        init_cuda: bool = True,
    ) -> None:
        """``log_level``: level of the one line saying why GPU tracing is off (the profiler passes
        WARNING when the user asked for GPU tracing explicitly). ``init_cuda=False`` (the
        profiler's ``gpu=None``) traces only once the program uses CUDA itself, and never
        initializes it: a window that opens before then has no GPU activity, the next one may."""
        self.sess = sess
        self.init_cuda = init_cuda
        self.activity = activity
        self.bucket_ns = bucket_ns
        self.log_level = log_level
        self.tracer = tracer or CuptiTracer(
            buffer_bytes=buffer_bytes, max_records=max_records, log_level=log_level
        )
        self.sampler = (  # (None: nvml.INTERVAL_S)
            NvmlSampler(sess, interval_s=nvml_interval_s, log_level=log_level) if nvml else None
        )
        self._devices = devices
        self._conv: GpuTraceConverter | None = None
        self._window_open = False
        self.last_stats: ConvertStats | None = None
        self._off = False
        self._window_t0 = 0

    def start(self) -> None:
        if self.sampler is not None and not self.sampler.start():
            self.sampler = None

    def begin_window(self) -> bool:
        if not self.activity or self._off:
            return False
        if self._devices is None:
            found = detect_devices(init=self.init_cuda)
            if not found:
                if not self.init_cuda:  # CUDA may come into use before the next window
                    log.debug("stepscope: CUDA not in use yet; no GPU activity in this window")
                    return False
                log.log(self.log_level, "stepscope: no CUDA device found; GPU activity tracing off")
                self._off = True
                return False
            self._devices = found
        self._window_t0 = time.time_ns()  # before CUPTI is on: every record starts after it
        self._window_open = self.tracer.start()
        if not self._window_open:
            self._off = True
        return self._window_open

    def reclaim_cupti(self) -> None:
        """Another CUPTI client in the process registered its buffer callbacks while this
        window's tracing runs (see :meth:`CuptiTracer.reregister`)."""
        if self._window_open:
            self.tracer.reregister()

    def end_window(self, steps: int = 0) -> ConvertStats | None:
        if not self._window_open:
            return None
        self._window_open = False
        try:
            batch = self.tracer.stop()
            if self._conv is None:
                self._conv = GpuTraceConverter(
                    self.sess, self._devices or {}, bucket_ns=self.bucket_ns,
                    api_names=self.tracer.api_names(),
                )  # fmt: skip
            self._conv.offset_ns = self.tracer.offset_ns  # measured at this window's start
            tids = set(batch.runtime["thread"].tolist()) | set(batch.driver["thread"].tolist())
            self._conv.thread_tracks.update(self._thread_tracks(tids))
            off = self.tracer.offset_ns  # window bounds in CUPTI's clock
            window = (self._window_t0 - off, time.time_ns() - off)
            self.last_stats = self._conv.convert(batch, window=window, steps=steps)
            return self.last_stats
        except Exception as exc:  # never break the program
            log.warning("stepscope: converting GPU activity failed (%s)", exc)
            return None

    def _thread_tracks(self, tids: set[int]) -> dict[int, int]:
        """CUPTI thread id → the thread's track. CUPTI's default thread id is ``pthread_self()``
        (``threading.get_ident()``) cut to 32 bits; the system thread id is matched too. Threads
        that ended during the window are found among those the session saw start; live C++
        threads (torch's autograd threads) through their ``pthread_t`` (core.native_threads).
        A live thread wins over an ended one whose ``pthread_t`` it took over (glibc reuses
        an ended thread's stack)."""
        make = self.sess.thread_track
        alive = [(t.ident, t.native_id) for t in threading.enumerate() if t.ident is not None]
        ended = [(i, native) for i, (native, _) in list(_tracks._started_threads.items())]  # noqa: SLF001
        out: dict[int, int] = {}

        def python_threads(threads: list[tuple[int, int]]) -> None:
            for ident, native in threads:
                for key in (ident & 0xFFFFFFFF, native):
                    if key in tids and key not in out:
                        try:
                            out[key] = make(ident)
                        except Exception:
                            pass

        python_threads(alive)
        for key, tid in native_threads.tids_of_pthreads(tids - out.keys()).items():
            out[key] = self.sess.native_thread_track(tid, native_threads.thread_name(tid)
                                                     or f"thread {tid}")
        python_threads(ended)
        return out

    def stop(self) -> None:
        self.end_window()
        if self.sampler is not None:
            self.sampler.stop()
