"""Live CUPTI activity collection through ``cupti-python``, for detail windows only.

Cost model (the reason for the design): a launch-bound step issues hundreds of CUDA calls per
millisecond, so nothing may run per call or per record on the training thread beyond what CUPTI
itself does.

* Only the API callbacks that launch, copy, set or wait for device work are enabled (per callback
  id, ``activity_enable_runtime_api`` / ``activity_enable_driver_api``), selected by name from
  cupti-python's callback-id enums; where those calls are missing, every API record is collected
  and the others are dropped when decoding.
* Raw buffers first (:mod:`.cupti_buffers`): where the libcupti that cupti-python loaded can be
  reached through ctypes, CUPTI's buffers are registered directly; the buffer callbacks cost one
  Python call per *buffer* and the records are decoded in bulk with numpy at window end. No Python
  object is built per record.
* Per-record fallback (cupti-python's own callbacks, which hand over one Python object per
  record; used when the raw path cannot be set up): the buffer callback takes one C-level
  ``operator.attrgetter`` tuple per record (no Python frame per record) into a per-kind list;
  turning those into numpy columns happens once per window. :attr:`CuptiTracer.path` says which
  path runs (``"raw"`` or ``"records"``).
* Buffers are bounded: ``buffer_bytes`` each and at most ``max_records`` decoded records per
  window on the per-record path (``max_buffers`` buffers on the raw path); the rest are counted as
  dropped (with CUPTI's own dropped count) and written to the trace by the converter.
* Everything is enabled at window start and disabled after ``activity_flush_all`` at window end.

Without ``cupti-python`` or a GPU, :meth:`CuptiTracer.start` logs one line and returns False.
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading
from collections.abc import Callable
from operator import attrgetter
from typing import Any

import numpy as np

from .clock import RATE_TOLERANCE, rate, read_clocks
from .cupti_buffers import RawActivityBuffers
from .driver import loaded_libcuda
from .occupancy import DeviceLimits
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

# API calls kept: launches, copies, sets and waits (matched on cupti-python's cbid enum names),
# but not the graph-building calls that only name them (cudaGraphAddMemcpyNode, ...)
API_NAME_RE = re.compile(r"Launch|Memcpy|Memset|Synchronize|WaitEvent|EventRecord")
GRAPH_BUILD_RE = re.compile(r"cu(da)?Graph(?!Launch)")

_KERNEL_ATTRS = (
    "start", "end", "device_id", "context_id", "stream_id", "correlation_id", "grid_x", "grid_y",
    "grid_z", "block_x", "block_y", "block_z", "registers_per_thread", "static_shared_memory",
    "dynamic_shared_memory", "graph_id", "graph_node_id", "name",
)  # fmt: skip
_MEMCPY_ATTRS = (
    "start", "end", "device_id", "context_id", "stream_id", "correlation_id", "bytes",
    "copy_kind", "src_kind", "dst_kind", "graph_id", "graph_node_id",
)  # fmt: skip
_MEMSET_ATTRS = (
    "start", "end", "device_id", "context_id", "stream_id", "correlation_id", "bytes", "value",
    "graph_id", "graph_node_id",
)  # fmt: skip
_SYNC_ATTRS = ("start", "end", "context_id", "stream_id", "correlation_id", "type", "cuda_event_id")
_API_ATTRS = ("start", "end", "correlation_id", "cbid", "process_id", "thread_id")
_OPTIONAL_ATTR = "graph_node_id"  # read as 0 from a binding whose records lack it


class _Getter:
    """Row tuple of one record kind: ``row`` is one C-level attrgetter, so the buffer callback
    runs no Python frame per record. A binding whose records lack the optional attribute (an
    older one) makes ``row`` switch, once, to a getter without it; ``widen`` puts its 0 back at
    window end."""

    __slots__ = ("key", "width", "pos", "reduced", "row")

    def __init__(self, key: str, attrs: tuple[str, ...]) -> None:
        self.key = key
        self.width = len(attrs)
        self.row = attrgetter(*attrs)
        self.pos = attrs.index(_OPTIONAL_ATTR) if _OPTIONAL_ATTR in attrs else -1
        rest = tuple(a for a in attrs if a != _OPTIONAL_ATTR)
        self.reduced = attrgetter(*rest) if self.pos >= 0 else None

    def row_after_error(self, a: Any) -> tuple | None:
        """The row of a record ``row`` failed on, switching to the reduced getter the first
        time; None for a record of a layout we do not know."""
        if self.reduced is None or self.row is self.reduced or hasattr(a, _OPTIONAL_ATTR):
            return None  # not the optional attribute missing: this record's layout is unknown
        try:
            r = self.reduced(a)
        except AttributeError:  # more than the optional one missing: unknown, no switch
            return None
        self.row = self.reduced
        return r

    def widen(self, rows: list[tuple]) -> list[tuple]:
        """Rows with the optional attribute as 0 where the reduced getter read them."""
        if self.row is not self.reduced:
            return rows
        p = self.pos
        return [r if len(r) == self.width else r[:p] + (0,) + r[p:] for r in rows]


def _import_cupti() -> Any | None:
    try:
        from cupti import cupti  # type: ignore[import-not-found]
    except Exception:  # ImportError, or a broken CUDA install raising at import
        return None
    return cupti


def _enum(cupti: Any, *names: str) -> Any | None:
    for n in names:
        e = getattr(cupti, n, None)
        if e is not None:
            return e
    return None


def api_cbids(cupti: Any) -> tuple[dict[int, str], dict[int, str]]:
    """(runtime, driver) callback ids worth recording → display names (version suffix cut)."""
    out: list[dict[int, str]] = []
    for names in (
        ("runtime_api_trace_cbid", "Runtime_api_trace_cbid", "RuntimeApiTraceCbid"),
        ("driver_api_trace_cbid", "Driver_api_trace_cbid", "DriverApiTraceCbid"),
    ):
        enum = _enum(cupti, *names)
        table: dict[int, str] = {}
        if enum is not None:
            for member in enum:
                if API_NAME_RE.search(member.name) and not GRAPH_BUILD_RE.match(member.name):
                    table[int(member)] = re.sub(r"_v\d+$", "", member.name)
        out.append(table)
    return out[0], out[1]


def cupti_dropped(cupti: Any) -> int:
    """Records CUPTI dropped (no buffer space) since the last call, global queue; 0 on error.

    cupti-python (12.8 and 13.x) mirrors the C call: the count is written to a ``size_t`` at
    the address passed as the third argument.
    """
    out = ctypes.c_size_t(0)
    try:
        cupti.activity_get_num_dropped_records(0, 0, ctypes.addressof(out))
    except Exception as exc:
        log.debug("stepscope: CUPTI's dropped-record count unavailable (%s)", exc)
        return 0
    return int(out.value)


def synchronize_context() -> None:
    """``cuCtxSynchronize`` on the calling thread's CUDA context, through the libcuda the program
    already loaded; nothing when it loaded none or the thread has no context.

    The window ends on the thread that drives the steps, whose context runs the step's work.
    Loading libcuda here (or calling ``cuInit``) would initialize CUDA in a process that does not
    use it.
    """
    cu = loaded_libcuda()
    if cu is not None:
        cu.cuCtxSynchronize()  # CUDA_ERROR_INVALID_CONTEXT without a context: nothing to wait for


class CuptiTracer:
    """Collects activity records between :meth:`start` and :meth:`stop` (one detail window)."""

    def __init__(
        self,
        *,
        buffer_bytes: int = 8 << 20,
        max_records: int = 2_000_000,
        driver_api: bool = True,
        cupti_module: Any = None,
        log_level: int = logging.INFO,
        raw: bool = True,
        max_buffers: int = 16,
        raw_buffers: Any = None,
        synchronize: Callable[[], Any] | None = None,
    ) -> None:
        """``cupti_module`` replaces ``cupti.cupti`` (tests drive the path with a stand-in).

        ``synchronize`` waits for the window's device work before :meth:`stop` flushes (default
        :func:`synchronize_context`; tests pass a recorder).

        ``raw`` tries the raw-buffer path (only with the real module, unless ``raw_buffers``, a
        callable returning a :class:`RawActivityBuffers` or None, is given: tests use it).
        """
        self.buffer_bytes = int(buffer_bytes)
        self.max_records = int(max_records)
        self.max_buffers = int(max_buffers)
        self._raw_factory = raw_buffers
        self._synchronize = synchronize or synchronize_context
        if raw and raw_buffers is None and cupti_module is None:
            self._raw_factory = RawActivityBuffers.open
        elif not raw:
            self._raw_factory = None
        self._raw: RawActivityBuffers | None = None
        self.path = ""
        self.driver_api = driver_api
        self._cupti: Any = cupti_module
        self.log_level = log_level
        self._registered = False
        self._active = False
        self._lock = threading.Lock()
        self._rows: dict[str, list[tuple]] = {}
        self._count = 0
        self._dropped = 0
        self._kinds: list[Any] = []
        self.offset_ns = 0
        self._pair0: tuple[int, int] | None = None  # (CUPTI, time_ns) at the window's start
        self.runtime_names: dict[int, str] = {}
        self.driver_names: dict[int, str] = {}
        self._getters: dict[int, _Getter] = {}

    # --- setup ---------------------------------------------------------------------------------
    def available(self) -> tuple[bool, str]:
        cupti = self._cupti or _import_cupti()
        if cupti is None:
            return False, "cupti-python is not installed (pip install 'stepscope[gpu]')"
        return True, ""

    def start(self) -> bool:
        """Enable collection; False (one log line, no exception) when CUPTI is unusable."""
        if self._active:
            return True
        cupti = self._cupti or _import_cupti()
        if cupti is None:
            log.log(
                self.log_level, "stepscope: cupti-python not installed; GPU activity tracing off"
            )
            return False
        try:
            if not self._registered:
                self._setup(cupti)
            else:
                self._register(cupti)
            self._rows = {k: [] for k in ("kernel", "memcpy", "memset", "sync", "rt", "drv")}
            self._count = self._dropped = 0
            if self._raw is not None:  # nothing from before this window
                self._raw.recycle(self._raw.take())
            for kind in self._kinds:
                cupti.activity_enable(kind)
            self._enable_api_filter(cupti)
            self._calibrate(cupti)  # in the clock this window's records carry
        except Exception as exc:  # no GPU, no driver, CUPTI in use by another tool, ...
            log.log(
                self.log_level, "stepscope: CUPTI unavailable (%s); GPU activity tracing off", exc
            )
            self._disable_all(cupti)
            return False
        self._active = True
        return True

    def _setup(self, cupti: Any) -> None:
        self._cupti = cupti
        kinds = cupti.ActivityKind
        self._kinds = [kinds.CONCURRENT_KERNEL, kinds.MEMCPY, kinds.MEMSET,
                       kinds.SYNCHRONIZATION, kinds.RUNTIME]  # fmt: skip
        if self.driver_api:
            self._kinds.append(kinds.DRIVER)
        self._getters = {
            int(kinds.CONCURRENT_KERNEL): _Getter("kernel", _KERNEL_ATTRS),
            int(kinds.MEMCPY): _Getter("memcpy", _MEMCPY_ATTRS),
            int(kinds.MEMSET): _Getter("memset", _MEMSET_ATTRS),
            int(kinds.SYNCHRONIZATION): _Getter("sync", _SYNC_ATTRS),
            int(kinds.RUNTIME): _Getter("rt", _API_ATTRS),
            int(kinds.DRIVER): _Getter("drv", _API_ATTRS),
        }
        self.runtime_names, self.driver_names = api_cbids(cupti)
        self._calibrate(cupti)  # also makes cupti-python load libcupti, which the raw path needs
        self._raw = self._open_raw()
        self.path = "records" if self._raw is None else "raw"
        if self._raw is None:
            self._register(cupti)
        log.debug("stepscope: CUPTI activity through the %s path", self.path)
        self._registered = True

    def reregister(self) -> None:
        """Take CUPTI's buffer callbacks back in the middle of a window, after another client in
        the process registered its own (Kineto, when torch's profiler starts after this window's
        tracing did); records already in a buffer that client was handed still reach us when
        that buffer completes (see ``RawActivityBuffers``)."""
        if self._active and self._cupti is not None:
            try:
                self._register(self._cupti)
            except Exception as exc:
                log.warning("stepscope: taking CUPTI's buffer callbacks back failed (%s)", exc)

    def _register(self, cupti: Any) -> None:
        """Make CUPTI hand its buffers to this tracer, again at every window: CUPTI keeps one
        pair of buffer callbacks per process, and another client in it (Kineto, for a
        ``torch.profiler`` with CUDA activity, even a CPU-only one on a CUDA build) registers its
        own whenever it starts; this window's records would go there."""
        if self._raw is not None:
            self._raw.register()
        else:
            cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)

    def _calibrate(self, cupti: Any) -> None:
        """CUPTI's clock against ``time.time_ns()``, measured anew each window: the system clock
        may be stepped (NTP) between windows of a long run, and another CUPTI client may have
        changed CUPTI's clock source (see :mod:`.clock`)."""
        self._pair0 = self._clock_pair(cupti)
        if self._pair0 is not None:
            self.offset_ns = self._pair0[1] - self._pair0[0]  # else the last offset, or 0

    @staticmethod
    def _clock_pair(cupti: Any) -> tuple[int, int] | None:
        try:
            return read_clocks(cupti.get_timestamp)
        except Exception:
            return None

    def _placed(self, batch: ActivityBatch, mid: tuple[int, int] | None,
                end: tuple[int, int] | None) -> ActivityBatch:
        """The window's batch in a clock the converter places: CUPTI's nanoseconds as they come
        (``offset_ns``), or mapped onto ``time.time_ns()`` (``offset_ns`` 0) where CUPTI's clock
        runs at another rate: Kineto's TSC ticks. The rate is read between the window's start
        and its end, or, where CUPTI's clock source changed in between, between this stop's
        entry (``mid``) and its end."""
        for first in (self._pair0, mid):
            r = rate(first, end)
            if r is not None and first is not None:
                break
        else:
            log.debug("stepscope: CUPTI's clock changed during this window")
            return batch
        self.offset_ns = first[1] - first[0]
        if abs(r - 1.0) <= RATE_TOLERANCE:
            return batch
        log.debug("stepscope: CUPTI's clock runs at %.4f ns per tick (a timestamp callback, "
                  "e.g. Kineto's TSC clock): mapped onto the system clock", r)
        self.offset_ns = 0
        return batch.retimed(first[0], first[1], r)

    def _open_raw(self) -> RawActivityBuffers | None:
        """The raw-buffer path, registered with CUPTI, or None (then the per-record path)."""
        if self._raw_factory is None:
            return None
        try:
            raw = self._raw_factory(buffer_bytes=self.buffer_bytes, max_buffers=self.max_buffers)
            if raw is not None:
                raw.register()
            return raw
        except Exception as exc:
            log.debug("stepscope: raw CUPTI buffers unavailable (%s); per-record path", exc)
            return None

    def _enable_api_filter(self, cupti: Any) -> None:
        """Record only the launch/copy/set/wait callbacks where CUPTI lets us choose.

        Every callback id of the enums is switched explicitly (on for the chosen ones, off for the
        rest), whatever CUPTI's default for a kind that is enabled. Decoding filters again, so a
        CUPTI without these calls only costs more records, never wrong ones.
        """
        rt = getattr(cupti, "activity_enable_runtime_api", None)
        drv = getattr(cupti, "activity_enable_driver_api", None)
        for fn, enum_names, chosen in (
            (rt, ("runtime_api_trace_cbid", "Runtime_api_trace_cbid"), self.runtime_names),
            (drv if self.driver_api else None,
             ("driver_api_trace_cbid", "Driver_api_trace_cbid"), self.driver_names),
        ):  # fmt: skip
            enum = _enum(cupti, *enum_names)
            if fn is None or enum is None:
                continue
            failed = 0
            for member in enum:
                cbid = int(member)
                if cbid > 0 and not member.name.endswith(("INVALID", "SIZE", "FORCE_INT")):
                    try:  # one id CUPTI rejects (an API gone from this CUDA) leaves the rest
                        fn(cbid, 1 if cbid in chosen else 0)
                    except Exception:
                        failed += 1
            if failed:
                log.debug("stepscope: CUPTI rejected %d per-callback API enables", failed)

    def _disable_all(self, cupti: Any, only: tuple[str, ...] | None = None) -> None:
        """Disable the kinds enabled (``only``: those of these names)."""
        for kind in self._kinds:
            if only is None or getattr(kind, "name", None) in only:
                try:
                    cupti.activity_disable(kind)
                except Exception:
                    pass

    # --- CUPTI callbacks (CUPTI's thread, or the thread calling flush) -------------------------
    def _buffer_requested(self) -> tuple[int, int]:
        return self.buffer_bytes, 0

    def _buffer_completed(self, activities: list) -> None:
        n = len(activities)
        with self._lock:
            if not self._active or self._count + n > self.max_records:
                self._dropped += n
                return
            self._count += n
            rows, getters = self._rows, self._getters
            for a in activities:
                g = getters.get(a.kind)
                if g is not None:
                    try:
                        rows[g.key].append(g.row(a))
                    except AttributeError:  # an older binding, or a layout we do not know
                        row = g.row_after_error(a)
                        if row is None:
                            self._dropped += 1
                        else:
                            rows[g.key].append(row)

    # --- window end ----------------------------------------------------------------------------
    def stop(self) -> ActivityBatch:
        """Synchronize, disable, flush and decode everything of this window into one batch.

        CUPTI's flush does not synchronize: a kernel still running would come back as an
        incomplete record (no end stamp). API and synchronization records are off before that
        wait, so it does not appear as the program's; disabling everything before the flush keeps
        work launched after the window out of it. Only the calling thread's context is waited
        for: another GPU's work still running at that moment is left out (and counted).
        """
        cupti = self._cupti
        if not self._active or cupti is None:
            return ActivityBatch()
        mid = self._clock_pair(cupti)
        # the host-side kinds first: the profiler's own synchronize is not the program's
        self._disable_all(cupti, only=("RUNTIME", "DRIVER", "SYNCHRONIZATION"))
        try:
            self._synchronize()
        except Exception as exc:
            log.debug("stepscope: synchronizing before the CUPTI flush failed (%s)", exc)
        self._disable_all(cupti)
        try:
            cupti.activity_flush_all(1)  # forced: CUPTI hands back every buffer, partial ones too
            if self._raw is not None and self._raw.reclaim():
                log.warning("stepscope: another CUPTI client in this process (a torch.profiler "
                            "with CUDA activity?) took part of this window's GPU activity")
        except Exception as exc:
            log.warning("stepscope: CUPTI flush failed (%s)", exc)
        with self._lock:
            self._active = False
            rows, self._rows = self._rows, {}
            dropped = self._dropped
        dropped += cupti_dropped(cupti)
        if self._raw is not None:
            batch = self._filter_api(self._raw.decode(dropped=dropped))
        else:
            batch = self.decode(rows, dropped)
        return self._placed(batch, mid, self._clock_pair(cupti))

    def decode(self, rows: dict[str, list[tuple]], dropped: int = 0) -> ActivityBatch:
        """Per-kind row tuples (attribute order as above) → columnar batch, in bulk."""
        rows = dict(rows)  # the caller's lists stay as they are
        for g in self._getters.values():
            if g.key in rows:
                rows[g.key] = g.widen(rows[g.key])
        b = ActivityBatch(dropped=dropped)
        kernels = rows.get("kernel", [])
        if kernels:  # the name (a string) comes last: interned, the other fields as ints
            names: dict[str, int] = {}
            b.kernels = _to_table([r[:-1] for r in kernels], KERNEL_DTYPE,
                                  name=intern((r[-1] for r in kernels), names))
            b.names = list(names)
        b.memcpys = _to_table(rows.get("memcpy", []), MEMCPY_DTYPE)
        b.memsets = _to_table(rows.get("memset", []), MEMSET_DTYPE)
        b.syncs = _to_table(rows.get("sync", []), SYNC_DTYPE)
        b.runtime = _to_table(rows.get("rt", []), API_DTYPE)
        b.driver = _to_table(rows.get("drv", []), API_DTYPE)
        return self._filter_api(b)

    def _filter_api(self, b: ActivityBatch) -> ActivityBatch:
        """Keep the launch/copy/set/wait API calls (CUPTI may have recorded every call)."""
        if self.runtime_names:
            b.runtime = b.runtime[np.isin(b.runtime["cbid"], list(self.runtime_names))]
        if self.driver_names:
            b.driver = b.driver[np.isin(b.driver["cbid"], list(self.driver_names))]
        return b

    def api_names(self) -> dict[tuple[bool, int], str]:
        """Names for the converter's API slices: {(is_driver, cbid): name}."""
        out = {(False, k): v for k, v in self.runtime_names.items()}
        out.update({(True, k): v for k, v in self.driver_names.items()})
        return out


def _to_table(rows: list[tuple], dtype: np.dtype, **more: Any) -> np.ndarray:
    """Rows of ints, in ``dtype``'s field order (``more``: the last fields, given as columns)
    → structured array."""
    wide = np.array(rows, dtype=np.int64).reshape(len(rows), -1) if rows else np.zeros((0, 0))
    cols = {name: wide[:, i] for i, name in enumerate(dtype.names[:wide.shape[1]])}
    return to_table(dtype, {**cols, **more}, len(rows))


def device_limits_from_cupy(device: int = 0) -> DeviceLimits | None:
    """The device's limits from CuPy's ``getDeviceProperties`` when CuPy is imported."""
    import sys

    cp = sys.modules.get("cupy")
    if cp is None:
        return None
    try:
        return DeviceLimits.from_attributes(cp.cuda.runtime.getDeviceProperties(device))
    except Exception:
        return None
