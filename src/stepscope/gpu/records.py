"""Columnar model of CUPTI activity records, and their classification.

Both producers fill the same structures: the live CUPTI path (:mod:`.cupti_live`) and the fixture
adapter (:mod:`.fixture`). One numpy structured array per record kind keeps a buffer's worth of
records in a few contiguous blocks, so the converter works on columns instead of Python objects.
Kernel names are interned: ``name`` holds an index into :attr:`ActivityBatch.names`.

CUDA graphs: every kernel, memcpy and memset that one ``cudaGraphLaunch`` runs carries that call's
correlation id, plus a non-zero ``graph_id`` (the graph) and ``graph_node_id`` (its node); work
launched outside a graph has both at 0.

Classification (for the summaries, HTA's classes): a kernel whose name contains ``nccl`` (any case)
is *communication*; memcpy/memset are *memory*; every other kernel is *compute*.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _schema

KERNEL_DTYPE = np.dtype(
    [
        ("start", "i8"), ("end", "i8"), ("device", "i4"), ("context", "i4"), ("stream", "i8"),
        ("correlation", "i8"), ("grid_x", "i4"), ("grid_y", "i4"), ("grid_z", "i4"),
        ("block_x", "i4"), ("block_y", "i4"), ("block_z", "i4"), ("registers", "i4"),
        ("static_smem", "i8"), ("dynamic_smem", "i8"), ("graph_id", "i8"), ("graph_node_id", "i8"),
        ("name", "i4"),
    ]
)  # fmt: skip
MEMCPY_DTYPE = np.dtype(
    [
        ("start", "i8"), ("end", "i8"), ("device", "i4"), ("context", "i4"), ("stream", "i8"),
        ("correlation", "i8"), ("bytes", "i8"), ("copy_kind", "i4"), ("src_kind", "i4"),
        ("dst_kind", "i4"), ("graph_id", "i8"), ("graph_node_id", "i8"),
    ]
)  # fmt: skip
MEMSET_DTYPE = np.dtype(
    [
        ("start", "i8"), ("end", "i8"), ("device", "i4"), ("context", "i4"), ("stream", "i8"),
        ("correlation", "i8"), ("bytes", "i8"), ("value", "i8"), ("graph_id", "i8"),
        ("graph_node_id", "i8"),
    ]
)  # fmt: skip
SYNC_DTYPE = np.dtype(
    [
        ("start", "i8"), ("end", "i8"), ("context", "i4"), ("stream", "i8"),
        ("correlation", "i8"), ("type", "i4"), ("event", "i8"),
    ]
)  # fmt: skip
API_DTYPE = np.dtype(
    [
        ("start", "i8"), ("end", "i8"), ("correlation", "i8"), ("cbid", "i4"),
        ("process", "i8"), ("thread", "i8"),
    ]
)  # fmt: skip

INVALID_ID = 0xFFFFFFFF  # CUPTI's invalid stream/context/device id
# how far a record may start outside its window's bounds (clock calibration error, the few
# instructions between reading the clock and enabling CUPTI)
WINDOW_SLACK_NS = 1_000_000


ID_COLUMNS = ("device", "context", "stream")  # ids CUPTI gives as INVALID_ID when unknown


def signed_ids(values: Any) -> np.ndarray:
    """Ids bound for an ``i4`` column: CUPTI's unsigned invalid id (:data:`INVALID_ID`) → -1."""
    values = np.asarray(values, dtype=np.int64)  # signed first: -1 must not wrap to uint32
    return np.where(values == INVALID_ID, -1, values)


def to_table(dtype: np.dtype, columns: Mapping[str, Any], size: int) -> np.ndarray:
    """A structured array of ``dtype`` from columns by field name (fields not given: 0).

    The one conversion of every source of records (raw CUPTI buffers, cupti-python rows,
    fixture dicts): ``i4`` fields go through :func:`signed_ids`."""
    out = np.zeros(size, dtype=dtype)
    for name, values in columns.items():
        out[name] = signed_ids(values) if dtype[name] == np.dtype("i4") else values
    return out


def intern(keys: Iterable[Any], ids: dict) -> list[int]:
    """The id of each key in ``ids`` (key → id), new keys numbered in order of appearance."""
    return [ids.setdefault(k, len(ids)) for k in keys]


# CUpti_ActivityMemcpyKind
COPY_KIND_NAMES = {
    0: "Unknown", 1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA",
    8: "DtoD", 9: "HtoH", 10: "PtoP",
}  # fmt: skip
# CUpti_ActivitySynchronizationType
SYNC_TYPE_NAMES = {
    0: "Unknown", 1: "Event synchronize", 2: "Stream wait event", 3: "Stream synchronize",
    4: "Context synchronize",
}  # fmt: skip

# Names of the CUPTI callback ids that launch device work or wait for it, for the API slices
# (cupti_runtime_cbid.h / cupti_driver_cbid.h). The live path names every id through cupti-python's
# enums; ids missing here are written as "cudaRuntime#<cbid>" / "cuDriver#<cbid>".
RUNTIME_CBID_NAMES = {
    31: "cudaMemcpy", 41: "cudaMemcpyAsync", 51: "cudaMemsetAsync", 131: "cudaStreamSynchronize",
    135: "cudaEventRecord", 165: "cudaDeviceSynchronize", 211: "cudaLaunchKernel",
    311: "cudaGraphLaunch", 312: "cudaGraphLaunch_ptsz", 430: "cudaLaunchKernelExC",
}  # fmt: skip
DRIVER_CBID_NAMES = {307: "cuLaunchKernel", 514: "cuGraphLaunch", 515: "cuGraphLaunch_ptsz"}


def api_name(cbid: int, *, driver: bool, names: dict[int, str] | None = None) -> str:
    """Display name of a runtime (or driver) API call from its CUPTI callback id."""
    if names and cbid in names:
        return names[cbid]
    table = DRIVER_CBID_NAMES if driver else RUNTIME_CBID_NAMES
    return table.get(cbid) or (f"cuDriver#{cbid}" if driver else f"cudaRuntime#{cbid}")


KERNEL_CLASS_COMPUTE = "compute"
KERNEL_CLASS_COMMUNICATION = "communication"
KERNEL_CLASS_MEMORY = "memory"
_COMM_RE = re.compile(r"nccl", re.IGNORECASE)


def kernel_class(name: str) -> str:
    """``communication`` for NCCL collective kernels, else ``compute``."""
    return KERNEL_CLASS_COMMUNICATION if _COMM_RE.search(name) else KERNEL_CLASS_COMPUTE


def kernel_category(name: str) -> str:
    """The slice category written for a kernel of this name."""
    return _schema.CAT_COMMUNICATION if _COMM_RE.search(name) else _schema.CAT_KERNEL


@dataclass
class ActivityBatch:
    """Records of one flush (a detail window), one structured array per kind."""

    kernels: np.ndarray = field(default_factory=lambda: np.empty(0, KERNEL_DTYPE))
    memcpys: np.ndarray = field(default_factory=lambda: np.empty(0, MEMCPY_DTYPE))
    memsets: np.ndarray = field(default_factory=lambda: np.empty(0, MEMSET_DTYPE))
    syncs: np.ndarray = field(default_factory=lambda: np.empty(0, SYNC_DTYPE))
    runtime: np.ndarray = field(default_factory=lambda: np.empty(0, API_DTYPE))
    driver: np.ndarray = field(default_factory=lambda: np.empty(0, API_DTYPE))
    names: list[str] = field(default_factory=list)
    dropped: int = 0  # records CUPTI or our bounded buffers dropped

    TABLES = ("kernels", "memcpys", "memsets", "syncs", "runtime", "driver")  # the record arrays

    def tables(self) -> list[np.ndarray]:
        return [getattr(self, attr) for attr in self.TABLES]

    def __len__(self) -> int:
        return sum(a.size for a in self.tables())

    def kernel_names(self) -> np.ndarray:
        """Kernel names as an object array aligned with :attr:`kernels`."""
        table = np.asarray(self.names, dtype=object)
        return table[self.kernels["name"]] if self.kernels.size else np.empty(0, dtype=object)

    def kernel_is_communication(self) -> np.ndarray:
        """Boolean per kernel: NCCL collective (classified once per distinct name)."""
        per_name = np.fromiter(
            (bool(_COMM_RE.search(n)) for n in self.names), dtype=bool, count=len(self.names)
        )
        return per_name[self.kernels["name"]] if self.kernels.size else np.zeros(0, bool)

    def time_range(self) -> tuple[int, int] | None:
        """(min start, max end) over device activity and API calls, or None if empty."""
        lo, hi = None, None
        for a in self.tables():
            if a.size:
                s, e = int(a["start"].min()), int(a["end"].max())
                lo = s if lo is None else min(lo, s)
                hi = e if hi is None else max(hi, e)
        return None if lo is None else (lo, hi)

    def screened(self, window: tuple[int, int] | None = None,
                 slack_ns: int = WINDOW_SLACK_NS) -> tuple[ActivityBatch, int]:
        """This batch without the records no timeline can place, and how many were left out.

        Left out: a start stamp of 0 (CUPTI could not collect the stamps), an end before the
        start (a record still incomplete when it was flushed), and, with ``window`` (CUPTI ns),
        a start outside it widened by ``slack_ns`` (work from before the window). Work that
        starts in the window and ends after it stays. Kineto drops out-of-window records alike.
        """
        out = ActivityBatch(names=self.names, dropped=self.dropped)
        left_out = 0
        for attr, a in zip(self.TABLES, self.tables(), strict=True):
            ok = (a["start"] > 0) & (a["end"] >= a["start"])
            if window is not None:
                ok &= (a["start"] >= window[0] - slack_ns) & (a["start"] <= window[1] + slack_ns)
            n = int(a.size - np.count_nonzero(ok))
            setattr(out, attr, a[ok] if n else a)
            left_out += n
        return (out, left_out) if left_out else (self, 0)

    def retimed(self, cupti0: int, time0: int, ns_per_tick: float) -> ActivityBatch:
        """This batch with every stamp mapped linearly onto ``time.time_ns()``: ``cupti0`` reads
        ``time0``, and each tick is ``ns_per_tick`` ns (a CUPTI clock in other units than ns,
        see :mod:`.clock`). Stamps of 0 (none collected) stay 0."""
        out = ActivityBatch(names=self.names, dropped=self.dropped)
        for attr, a in zip(self.TABLES, self.tables(), strict=True):
            a = a.copy()
            for col in ("start", "end"):
                v = a[col]
                mapped = time0 + np.rint((v - cupti0) * ns_per_tick).astype(np.int64)
                a[col] = np.where(v > 0, mapped, v)
            setattr(out, attr, a)
        return out

    @staticmethod
    def concat(batches: list[ActivityBatch]) -> ActivityBatch:
        """One batch from several, re-interning kernel names."""
        out = ActivityBatch()
        names: dict[str, int] = {}
        kernels = []
        for b in batches:
            remap = np.array(intern(b.names, names), dtype=np.int32)
            k = b.kernels.copy()
            if k.size:
                k["name"] = remap[k["name"]]
            kernels.append(k)
        out.names = list(names)
        out.kernels = np.concatenate(kernels) if kernels else out.kernels
        for attr in ActivityBatch.TABLES[1:]:  # the kernels, re-interned, are above
            parts = [getattr(b, attr) for b in batches]
            if parts:
                setattr(out, attr, np.concatenate(parts))
        out.dropped = sum(b.dropped for b in batches)
        return out
