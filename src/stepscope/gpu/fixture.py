"""Adapter from the recorded CUPTI fixture (JSON records) to the live path's columnar model.

The fixture (``tests/data/cupti_mlp_fixture.json.gz``) holds real CUPTI activity records from a
CuPy MLP on an H100, with the field names of cupti-python's activity objects. Turning them into an
:class:`~stepscope.gpu.records.ActivityBatch` lets tests and benchmarks feed the very conversion
code the live path uses, on machines without a GPU.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _schema
from .clock import to_clock
from .convert import GpuTraceConverter
from .nvml import CounterWriter, gpm_counters, sample_counters
from .occupancy import DeviceLimits
from .records import (
    API_DTYPE,
    ID_COLUMNS,
    INVALID_ID,
    KERNEL_DTYPE,
    MEMCPY_DTYPE,
    MEMSET_DTYPE,
    SYNC_DTYPE,
    ActivityBatch,
    intern,
    to_table,
)

# dtype field -> record key, per kind (same names as cupti-python's activity attributes)
_KERNEL_FIELDS = {
    "start": "start", "end": "end", "device": "device_id", "context": "context_id",
    "stream": "stream_id", "correlation": "correlation_id", "grid_x": "grid_x",
    "grid_y": "grid_y", "grid_z": "grid_z", "block_x": "block_x", "block_y": "block_y",
    "block_z": "block_z", "registers": "registers_per_thread",
    "static_smem": "static_shared_memory", "dynamic_smem": "dynamic_shared_memory",
    "graph_id": "graph_id", "graph_node_id": "graph_node_id",
}  # fmt: skip
_MEMCPY_FIELDS = {
    "start": "start", "end": "end", "device": "device_id", "context": "context_id",
    "stream": "stream_id", "correlation": "correlation_id", "bytes": "bytes",
    "copy_kind": "copy_kind", "src_kind": "src_kind", "dst_kind": "dst_kind",
    "graph_id": "graph_id", "graph_node_id": "graph_node_id",
}  # fmt: skip
_MEMSET_FIELDS = {
    "start": "start", "end": "end", "device": "device_id", "context": "context_id",
    "stream": "stream_id", "correlation": "correlation_id", "bytes": "bytes", "value": "value",
    "graph_id": "graph_id", "graph_node_id": "graph_node_id",
}  # fmt: skip
_SYNC_FIELDS = {
    "start": "start", "end": "end", "context": "context_id", "stream": "stream_id",
    "correlation": "correlation_id", "type": "type", "event": "cuda_event_id",
}  # fmt: skip
_API_FIELDS = {
    "start": "start", "end": "end", "correlation": "correlation_id", "cbid": "cbid",
    "process": "process_id", "thread": "thread_id",
}  # fmt: skip

KIND_KERNEL = "CONCURRENT_KERNEL"
KIND_MEMCPY = "MEMCPY"
KIND_MEMSET = "MEMSET"
KIND_SYNC = "SYNCHRONIZATION"
KIND_RUNTIME = "RUNTIME"
KIND_DRIVER = "DRIVER"


def _table(records: list[Mapping[str, Any]], dtype: np.dtype, fields: dict[str, str]) -> np.ndarray:
    return to_table(dtype, {col: [r.get(key, INVALID_ID if col in ID_COLUMNS else 0)
                                  for r in records] for col, key in fields.items()}, len(records))


def batch_from_records(
    records: Iterable[Mapping[str, Any]], *, api: str = "correlated"
) -> ActivityBatch:
    """Columnar batch from dict records (``kind`` + cupti-python attribute names).

    ``api`` selects the runtime/driver API records kept: ``"correlated"`` (default) keeps the calls
    that launched, copied, set or waited for device work (their correlation id appears on a device
    or synchronization record), as the live path records only those callbacks; ``"all"`` keeps all.
    """
    if api not in ("correlated", "all"):
        raise ValueError(f"api must be 'correlated' or 'all', not {api!r}")
    by_kind: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        try:
            by_kind.setdefault(r["kind"], []).append(r)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"activity record without a 'kind': {r!r}") from exc
    b = ActivityBatch()
    kernels = by_kind.get(KIND_KERNEL, [])
    names: dict[str, int] = {}
    b.kernels = _table(kernels, KERNEL_DTYPE, _KERNEL_FIELDS)
    b.kernels["name"] = intern((str(r.get("name", "?")) for r in kernels), names)
    b.names = list(names)
    b.memcpys = _table(by_kind.get(KIND_MEMCPY, []), MEMCPY_DTYPE, _MEMCPY_FIELDS)
    b.memsets = _table(by_kind.get(KIND_MEMSET, []), MEMSET_DTYPE, _MEMSET_FIELDS)
    b.syncs = _table(by_kind.get(KIND_SYNC, []), SYNC_DTYPE, _SYNC_FIELDS)
    b.runtime = _table(by_kind.get(KIND_RUNTIME, []), API_DTYPE, _API_FIELDS)
    b.driver = _table(by_kind.get(KIND_DRIVER, []), API_DTYPE, _API_FIELDS)
    if api == "correlated":
        device_corr = np.concatenate(
            [b.kernels["correlation"], b.memcpys["correlation"], b.memsets["correlation"],
             b.syncs["correlation"]]
        )  # fmt: skip
        b.runtime = b.runtime[np.isin(b.runtime["correlation"], device_corr)]
        b.driver = b.driver[np.isin(b.driver["correlation"], device_corr)]
    return b


@dataclass
class Fixture:
    """Everything the recorded fixture holds, in the shapes the GPU code consumes."""

    batch: ActivityBatch
    device: DeviceLimits
    device_attributes: dict[str, Any]
    clock_pairs: list[dict[str, int]]
    host_ranges: list[dict[str, Any]] = field(default_factory=list)
    nvml_samples: list[dict[str, Any]] = field(default_factory=list)
    gpm_samples: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


def load_fixture(path: str | os.PathLike[str], *, api: str = "correlated") -> Fixture:
    """Read the gzip'd JSON fixture; a clear ``ValueError`` if it is not one."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a gzip'd JSON CUPTI fixture ({exc})") from exc
    missing = [k for k in ("cupti_records", "device", "clock_pairs") if k not in data]
    if missing:
        raise ValueError(f"{path}: fixture lacks {', '.join(missing)}")
    attrs = dict(data["device"])
    return Fixture(
        batch=batch_from_records(data["cupti_records"], api=api),
        device=DeviceLimits.from_attributes(attrs),
        device_attributes=attrs,
        clock_pairs=list(data["clock_pairs"]),
        host_ranges=list(data.get("host_ranges", [])),
        nvml_samples=list(data.get("nvml_samples", [])),
        gpm_samples=list(data.get("gpm_samples", [])),
        meta={
            k: v
            for k, v in data.items()
            if k not in ("cupti_records", "host_ranges", "nvml_samples", "gpm_samples")
        },
    )


def replay_fixture(sess: Any, fx: Fixture, *, host_ranges: bool = True, counters: bool = True,
                   rebase: bool = True):
    """Write the whole fixture into a session, as if it had been recorded live.

    Everything goes on the REALTIME clock so that it lines up regardless of this machine's clocks:
    device records as recorded (CUPTI stamps REALTIME), host ranges and NVML/GPM samples mapped
    from the recording machine's ``perf_counter_ns`` to its ``time_ns`` through the clock pairs.
    ``rebase`` (default) then moves all of it by one offset so that its first event is now
    (``time.time_ns()``): recorded on another machine, it would otherwise lie before this
    machine's boot, at negative trace (BOOTTIME) times, which trace processor drops. Host ranges
    go on one custom track per recorded thread name. Returns the converter's stats.
    """
    def realtime(values: list[int]) -> np.ndarray:
        return to_clock(np.array(values, dtype=np.int64), fx.clock_pairs, "perf_counter_ns",
                        "time_ns")

    starts = realtime([h["start"] for h in fx.host_ranges]) if fx.host_ranges else None
    ends = realtime([h["end"] for h in fx.host_ranges]) if fx.host_ranges else None
    sample_ts = [realtime([s["perf_counter_ns"] for s in samples]) if samples else None
                 for samples in (fx.nvml_samples, fx.gpm_samples)]
    shift = rebase_shift(fx.batch, [a for a in (starts, *sample_ts) if a is not None]) \
        if rebase else 0
    batch = shifted(fx.batch, shift)
    pid = int(fx.meta.get("pid", 0)) or None
    conv = GpuTraceConverter(sess, {0: fx.device}, pid=pid)
    steps = len({h.get("step") for h in fx.host_ranges if h.get("name") == "ProfileStep"})
    stats = conv.convert(batch, steps=steps)
    if host_ranges and fx.host_ranges:
        em = sess.emitter(clock="realtime", level=_schema.LEVEL_DETAIL)
        starts, ends = starts + shift, ends + shift
        tracks: dict[str, int] = {}
        for h, s, e in zip(fx.host_ranges, starts.tolist(), ends.tolist(), strict=True):
            t = tracks.get(h["thread"])
            if t is None:
                t = tracks[h["thread"]] = sess.new_track(h["thread"], parent=sess.process_uuid)
            em.complete(s, e - s, h["name"], t, args={_schema.ARG_STEP: h.get("step", -1)})
    if counters:
        w = CounterWriter(sess, clock="realtime")
        for samples, fn, ts in ((fx.nvml_samples, sample_counters, sample_ts[0]),
                                (fx.gpm_samples, gpm_counters, sample_ts[1])):
            if not samples:
                continue
            for s, t in zip(samples, (ts + shift).tolist(), strict=True):
                w.write(t, fn(s, 0))
    return stats


def rebase_shift(batch: ActivityBatch, others: Iterable[np.ndarray], now: int | None = None) -> int:
    """The offset that moves the earliest of the batch's records and ``others`` (REALTIME
    stamps) to ``now`` (default: ``time.time_ns()``); 0 when there is nothing."""
    firsts = [int(a.min()) for a in others if len(a)]
    span = batch.time_range()
    if span is not None:
        firsts.append(span[0])
    if not firsts:
        return 0
    return (time.time_ns() if now is None else now) - min(firsts)


def shifted(batch: ActivityBatch, shift: int) -> ActivityBatch:
    """A copy of ``batch`` with every record's start and end moved by ``shift`` ns (the batch
    itself is left as it is: fixtures are shared)."""
    if not shift:
        return batch
    moved = {}
    for attr in ActivityBatch.TABLES:
        a = getattr(batch, attr).copy()
        if a.size:
            a["start"] += shift
            a["end"] += shift
        moved[attr] = a
    return dataclasses.replace(batch, **moved)
