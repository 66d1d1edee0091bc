"""NVML sampler: utilization.gpu, memory used, power, SM clock, and GPM metrics on Hopper+.

The counters sit on tracks beside the CUPTI-based estimates so users can compare the driver's
coarse ``utilization.gpu`` (fraction of time *any* kernel ran, over NVML's own sample period) and
the hardware GPM SM utilization / occupancy with the estimates computed from kernel records.

A background thread samples every ``interval_s`` (``INTERVAL_S``, 1 s, by default) and writes
counters through a ``clock="monotonic"`` emitter at summary level (they cover the whole run).
Each round costs a launch-bound training thread far more than its calls' own few µs: on an H100
(a torch MLP step of 1.5 ms, ``Profiler(gpu=True)`` at summary level, pairs of blocks) sampling
every 0.1 s added 5-8 % to the step (3.9 % without GPM), every 1 s 0.4 %, none at all -1.4 %
(noise): hence 1 s, as ``nvidia-smi`` and DCGM sample. ``nvidia-ml-py``
(``import pynvml``) is optional: without it, or without a GPU, :meth:`NvmlSampler.start` logs one
line, and returns False unless CuPy is imported (its pool counters need no NVML).

GPM (``nvmlGpmMetricsGet``) needs two samples; each metric is the average over the interval
between them, stamped at the interval's end. Values are percentages (0..100) as NVML gives them.

GPUs are named by their CUDA ordinal (``nvml.gpu0`` is CUDA's ``GPU 0``, beside the converter's
``GPU 0 ...`` tracks), and only the GPUs this process sees are sampled: NVML numbers every GPU of
the host in PCI order, while CUDA ordinals follow ``CUDA_VISIBLE_DEVICES`` (one GPU per rank).
:func:`cuda_nvml_handles` maps ordinals to NVML handles by PCI bus id where CUDA is already
initialised (exact), else from ``CUDA_VISIBLE_DEVICES``; the latter assumes CUDA's order is PCI
order, true with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and on hosts of identical GPUs, but CUDA's
default ``FASTEST_FIRST`` may differ on mixed-GPU hosts.

CuPy's memory-pool counters (``cupy.gpu<N>.pool.used/total``) are written by the same thread, with
or without NVML.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from .. import _schema
from .cupy_timing import memory_pool_counters
from .driver import initialized_count, loaded_libcuda

log = logging.getLogger("stepscope.gpu")

# NVML sample field -> (counter name, unit, divisor)
NVML_FIELDS: dict[str, tuple[str, str, int]] = {
    "gpu_util": (_schema.COUNTER_NVML_UTILIZATION, "%", 1),
    "mem_used": (_schema.COUNTER_NVML_MEMORY_USED, "bytes", 1),
    "power_mw": (_schema.COUNTER_NVML_POWER, "W", 1000),
    "sm_clock_mhz": (_schema.COUNTER_NVML_SM_CLOCK, "MHz", 1),
}
# GPM metric name (pynvml NVML_GPM_METRIC_<name>, fallback id) -> counter name
GPM_METRICS: dict[str, tuple[int, str]] = {
    "SM_UTIL": (2, _schema.COUNTER_GPM_SM_UTIL),
    "SM_OCCUPANCY": (3, _schema.COUNTER_GPM_SM_OCCUPANCY),
    "ANY_TENSOR_UTIL": (5, _schema.COUNTER_GPM_TENSOR_UTIL),
    "DRAM_BW_UTIL": (10, _schema.COUNTER_GPM_DRAM_BW_UTIL),
}


def sample_counters(sample: Mapping[str, Any], device: int) -> list[tuple[str, str, float]]:
    """(counter name, unit, value) for one NVML sample dict; missing/NaN fields are left out."""
    out = []
    for key, (name, unit, divisor) in NVML_FIELDS.items():
        v = sample.get(key)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        out.append((name.format(device=device), unit, v / divisor if divisor != 1 else v))
    return out


def gpm_counters(sample: Mapping[str, Any], device: int) -> list[tuple[str, str, float]]:
    """(counter name, "%", value) for one GPM sample dict (keys as in :data:`GPM_METRICS`)."""
    out = []
    for key, (_, name) in GPM_METRICS.items():
        v = sample.get(key)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        out.append((name.format(device=device), "%", float(v)))
    return out


class CounterWriter:
    """Writes named counters through one emitter, making each counter track once."""

    def __init__(self, sess: Any, *, clock: str = "monotonic", level: int | None = None) -> None:
        self.sess = sess
        lvl = _schema.LEVEL_SUMMARY if level is None else level
        self.em = sess.emitter(clock=clock, level=lvl)
        self.tracks: dict[str, int] = {}

    def write(self, ts: int, values: Iterable[tuple[str, str, float]]) -> int:
        n = 0
        for name, unit, value in values:
            t = self.tracks.get(name)
            if t is None:
                t = self.tracks[name] = self.sess.new_counter_track(name, unit=unit)
            self.em.counter(ts, t, value)
            n += 1
        return n


def cuda_bus_ids(lib: Any | None) -> list[bytes] | None:
    """PCI bus ids of the CUDA devices by ordinal (CuPy's if imported, else libcuda's); None when
    CUDA is not initialised in this process (CuPy's calls would initialise it)."""
    n = initialized_count(lib)
    if n is None:
        return None
    cp = sys.modules.get("cupy")
    if cp is not None:
        return [str(cp.cuda.Device(i).pci_bus_id).encode() for i in range(n)]
    out = []
    for i in range(n):
        dev, buf = ctypes.c_int(0), ctypes.create_string_buffer(32)
        if lib.cuDeviceGet(ctypes.byref(dev), i) or lib.cuDeviceGetPCIBusId(buf, 32, dev):
            raise RuntimeError(f"no PCI bus id for CUDA device {i}")
        out.append(buf.value)
    return out


def cuda_nvml_handles(nv: Any, lib: Any | None = None) -> list[tuple[int, Any]]:
    """(CUDA ordinal, NVML handle) of every GPU this process sees.

    By PCI bus id where CUDA is initialised (exact); else from ``CUDA_VISIBLE_DEVICES``: integers
    are NVML indices (CUDA's order taken as PCI order, see the module docstring), ``GPU-``/``MIG-``
    entries UUIDs, and, as in CUDA, an invalid entry ends the list; unset: every NVML GPU.
    """
    bus_ids = cuda_bus_ids(lib)
    if bus_ids is not None:
        return [(i, nv.nvmlDeviceGetHandleByPciBusId(b)) for i, b in enumerate(bus_ids)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = nv.nvmlDeviceGetCount()
    if visible is None:
        return [(i, nv.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
    out: list[tuple[int, Any]] = []
    for entry in visible.split(","):
        entry = entry.strip()
        try:
            if entry.startswith(("GPU-", "MIG-")):
                h = nv.nvmlDeviceGetHandleByUUID(entry.encode())
            elif 0 <= int(entry) < count:
                h = nv.nvmlDeviceGetHandleByIndex(int(entry))
            else:
                break
        except Exception:
            break
        out.append((len(out), h))
    return out


def active_devices(lib: Any | None) -> list[int]:
    """CUDA ordinals whose primary context is active (the program uses them); [] when CUDA is not
    initialised here. Creates nothing."""
    out = []
    for i in range(initialized_count(lib) or 0):
        dev, flags, active = ctypes.c_int(0), ctypes.c_uint(0), ctypes.c_int(0)
        if (
            lib.cuDeviceGet(ctypes.byref(dev), i) == 0
            and lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
            and active.value
        ):
            out.append(i)
    return out


def _shutdown(nv: Any) -> None:
    """``nvmlShutdown``, balancing one ``nvmlInit`` (NVML counts them); errors ignored."""
    try:
        nv.nvmlShutdown()
    except Exception:
        pass


INTERVAL_S = 1.0  # default sampling period (the module docstring says why)


class NvmlSampler:
    """Background sampler of NVML/GPM counters and CuPy's memory pool, per CUDA device.

    ``devices``: the CUDA ordinals to sample (default: all this process sees). ``libcuda``: the
    driver library to ask (default: libcuda where the process has loaded it; for tests).
    """

    def __init__(
        self, sess: Any, devices: list[int] | None = None, *, interval_s: float | None = None,
        gpm: bool = True, log_level: int = logging.INFO, libcuda: Any | None = None,
    ) -> None:  # fmt: skip
        interval_s = INTERVAL_S if interval_s is None else interval_s
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.sess = sess
        self.devices = devices
        self.interval_s = interval_s
        self.gpm = gpm
        self.log_level = log_level
        self._libcuda = libcuda
        self._nvml: Any = None
        self._handles: list[tuple[int, Any]] = []
        self._gpm_ok: dict[int, bool] = {}
        self._prev: dict[int, Any] = {}
        self._gpm_ts: dict[int, int] = {}  # the time of each GPU's last GPM sample
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples = 0  # sampling rounds done
        self.errors = 0

    def start(self) -> bool:
        """Start sampling; False (and one log line) when neither NVML with a GPU nor CuPy is
        there. CuPy's pool counters need no NVML."""
        self._handles = self._open_nvml()
        if not self._handles and "cupy" not in sys.modules:
            return False
        self._writer = CounterWriter(self.sess)
        self._thread = threading.Thread(target=self._run, name="stepscope-nvml", daemon=True)
        self._thread.start()
        return True

    def _lib(self) -> Any | None:
        if self._libcuda is None:
            self._libcuda = loaded_libcuda()  # kept once loaded: libcuda is never unloaded
        return self._libcuda

    def _open_nvml(self) -> list[tuple[int, Any]]:
        """NVML initialised and the handles of the sampled GPUs; [] (one log line) without."""
        try:
            import pynvml  # type: ignore[import-not-found]
        except ImportError:
            log.log(self.log_level, "stepscope: nvidia-ml-py not installed; NVML counters off")
            return []
        inited = False
        try:
            pynvml.nvmlInit()  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            inited = True
            handles = cuda_nvml_handles(pynvml, self._lib())
        except Exception as exc:
            log.log(self.log_level, "stepscope: NVML unavailable (%s); NVML counters off", exc)
            if inited:
                _shutdown(pynvml)
            return []
        if self.devices is not None:
            handles = [(i, h) for i, h in handles if i in self.devices]
        if not handles:
            log.log(self.log_level, "stepscope: no NVIDIA GPU found; NVML counters off")
            _shutdown(pynvml)
            return []
        self._nvml = pynvml
        if self.gpm:
            for i, h in handles:
                self._gpm_ok[i] = self._gpm_supported(h)
        return handles

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                # still inside an NVML call: freeing its samples or shutting NVML down under it
                # could crash; leave both to the process' exit
                log.debug("stepscope: NVML sampler thread did not stop; NVML left initialised")
                return
            self._thread = None
        if self._nvml is not None:
            for s in self._prev.values():
                try:
                    self._nvml.nvmlGpmSampleFree(s)
                except Exception:
                    pass
            self._prev.clear()
            self._gpm_ts.clear()
            _shutdown(self._nvml)
            self._nvml = None

    def _gpm_supported(self, handle: Any) -> bool:
        nv = self._nvml
        try:
            return bool(nv.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
        except Exception:
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                self.sample_once()
            except Exception as exc:  # never let a sampler error reach the program
                self.errors += 1
                if self.errors == 1:
                    log.warning("stepscope: NVML sampling failed (%s)", exc)
            self._stop.wait(max(0.0, self.interval_s - (time.perf_counter() - t0)))

    def sample_once(self) -> None:
        """One round: NVML (and GPM) of each sampled GPU, then CuPy's pools. Run by the sampler
        thread: reading the pools switches the calling thread's current CUDA device."""
        nv = self._nvml
        for i, h in self._handles:
            ts = time.perf_counter_ns()
            sample: dict[str, Any] = {}
            for key, fn in (
                ("gpu_util", lambda h=h: nv.nvmlDeviceGetUtilizationRates(h).gpu),
                ("mem_used", lambda h=h: nv.nvmlDeviceGetMemoryInfo(h).used),
                ("power_mw", lambda h=h: nv.nvmlDeviceGetPowerUsage(h)),
                ("sm_clock_mhz", lambda h=h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
            ):
                try:
                    sample[key] = fn()
                except Exception:
                    pass
            if self._gpm_ok.get(i):  # over the interval since the last GPM sample: stamped
                # at its start (a counter holds from its timestamp to the next one)
                gpm, start = self._gpm_sample(i, h), self._gpm_ts.get(i)
                self._gpm_ts[i] = ts
                if start is not None:
                    self._writer.write(start, gpm_counters(gpm, i))
            self._writer.write(ts, sample_counters(sample, i))
        self._writer.write(time.perf_counter_ns(), self._pool_counters())
        self.samples += 1

    def _pool_counters(self) -> list[tuple[str, str, int]]:
        """CuPy's pool of each CUDA device in use. CuPy reports only the current device's pool, so
        this thread makes each device current in turn, but only one whose context is already
        active: ``cudaSetDevice`` creates a context (CUDA 12), costing memory on a GPU the program
        does not use. Nothing without libcuda loaded (CuPy has allocated nothing then)."""
        cp = sys.modules.get("cupy")
        if cp is None:
            return []
        out: list[tuple[str, str, int]] = []
        for d in active_devices(self._lib()):
            if self.devices is None or d in self.devices:
                cp.cuda.runtime.setDevice(d)
                out += memory_pool_counters(d)
        return out

    def _gpm_sample(self, i: int, handle: Any) -> dict[str, float]:
        nv = self._nvml
        cur = nv.nvmlGpmSampleAlloc()
        try:
            nv.nvmlGpmSampleGet(handle, cur)
        except Exception:  # free what we allocated; no more GPM on this GPU
            nv.nvmlGpmSampleFree(cur)
            self._gpm_ok[i] = False
            log.info("stepscope: GPM sampling failed on GPU %d; GPM counters off", i)
            return {}
        prev = self._prev.get(i)
        self._prev[i] = cur
        if prev is None:
            return {}
        try:
            mg = nv.c_nvmlGpmMetricsGet_t()
            mg.version = nv.NVML_GPM_METRICS_GET_VERSION
            mg.numMetrics = len(GPM_METRICS)
            mg.sample1 = prev
            mg.sample2 = cur
            names = list(GPM_METRICS)
            for j, key in enumerate(names):
                mg.metrics[j].metricId = getattr(nv, f"NVML_GPM_METRIC_{key}", GPM_METRICS[key][0])
            nv.nvmlGpmMetricsGet(mg)
            # a metric this GPU lacks has its own error code (its value is meaningless)
            return {
                key: float(mg.metrics[j].value)
                for j, key in enumerate(names)
                if not mg.metrics[j].nvmlReturn
            }
        except Exception:
            self._gpm_ok[i] = False
            log.info("stepscope: GPM metrics unavailable on GPU %d; GPM counters off", i)
            return {}
        finally:
            nv.nvmlGpmSampleFree(prev)
