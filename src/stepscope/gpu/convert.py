"""CUPTI records (columnar) → trace events through the core emitter API.

One converter per session; the live path and the fixture feed it the same
:class:`~stepscope.gpu.records.ActivityBatch`.

Tracks written:

* ``GPU <id> (<name>)`` per device, a custom track under the rank's process track, with one child
  ``stream <id>`` per CUDA stream holding its kernels, memcpys and memsets, and a child ``sync``
  holding CUDA synchronization records. Work that overlaps on one stream (programmatic dependent
  launch, graph nodes) goes on a sibling track with the same name, never a misnested slice.
* ``CUDA API`` under the launching thread's track (or, if the core cannot name a thread's track,
  ``CUDA API (thread <id>)`` under the process): the runtime/driver calls, on their own track so
  that the few µs between CUPTI's clock and the host clock can never misnest them with the user's
  ranges on the thread itself.
* Counter tracks ``GPU <id> utilization``, ``... est. SM efficiency``, ``... est. achieved
  occupancy`` (percent, one sample per bucket; definitions in :mod:`.metrics`).

Each API call that launched device work gets a flow to that work, so the UI draws the arrow. The
flow id is derived from the CUPTI correlation id, the rank and the pid. A CUDA graph launch runs
many kernels and copies under one correlation id; as Kineto does (one ``ac2g`` arrow per GPU
activity), each of them gets its own arrow from the ``cudaGraphLaunch`` slice: Perfetto flows join
two events, so the launch slice carries one flow id per record (the first record in time keeps the
correlation-derived id, the others get ids from a per-converter sequence, see
:meth:`GpuTraceConverter.flow_plan`). Timestamps are CUPTI's (CLOCK_REALTIME) plus ``offset_ns``,
written through a ``clock="realtime"`` emitter.
"""

from __future__ import annotations

import heapq
import logging
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from .. import _schema
from .metrics import BucketMetrics, bucket_edges, bucket_metrics, choose_bucket_ns
from .occupancy import DeviceLimits, KernelEstimates, kernel_estimates
from .records import (
    COPY_KIND_NAMES,
    INVALID_ID,
    SYNC_TYPE_NAMES,
    ActivityBatch,
    api_name,
)

log = logging.getLogger("stepscope.gpu")

MEMORY_KIND_NAMES = {
    0: "Unknown", 1: "Pageable", 2: "Pinned", 3: "Device", 4: "Array", 5: "Managed",
    6: "Device static", 7: "Managed static",
}  # fmt: skip

# counter buckets per window at most: the window-end work runs on the training thread
MAX_BUCKETS = 100_000
_FLOW_TAG = 0x5C << 56  # keeps GPU flow ids apart from other producers' ids
_EXTRA_FLOW_TAG = 0x5D << 56  # 2nd, 3rd, ... record of one correlation id (graph launches)


def flow_ids_for(correlation: np.ndarray, pid: int, *, rank: int = 0,
                 tag: int = _FLOW_TAG) -> np.ndarray:
    """Flow id per CUPTI correlation id: unique per process, and across the ranks of one job
    once their files are merged (ranks on different hosts may share a pid).

    Bits: tag (8) | rank (12) | pid's low 12 bits (for processes that share a rank) | id (32).
    With ``tag=_EXTRA_FLOW_TAG`` the low 32 bits are a sequence number instead (graph launches).
    """
    process = ((rank & 0xFFF) << 12) | (pid & 0xFFF)
    return (
        np.uint64(tag)
        | (np.uint64(process) << np.uint64(32))
        | (np.asarray(correlation, dtype=np.uint64) & np.uint64(0xFFFFFFFF))
    )


@dataclass
class FlowPlan:
    """Flows of one batch as columns: the terminating id (0 for none) per device record, table
    by table; and per launching correlation id (sorted) its records' ids, in start order, as
    ``starts[offsets[j]:offsets[j + 1]]``."""

    terminating_ids: list[np.ndarray]
    launchers: np.ndarray  # correlation ids that launched linked records, sorted
    offsets: np.ndarray
    starts: np.ndarray  # uint64

    @property
    def terminating(self) -> list[list[list[int] | None]]:
        """The terminating ids as lists (None for none)."""
        return [[[f] if f else None for f in ids.tolist()] for ids in self.terminating_ids]

    @property
    def by_correlation(self) -> dict[int, list[int]]:
        """Launching correlation id → the ids its call starts."""
        ids, cuts = self.starts.tolist(), self.offsets.tolist()
        return {c: ids[a:b] for c, a, b in zip(self.launchers.tolist(), cuts[:-1], cuts[1:],
                                               strict=True)}

    @property
    def arrows(self) -> int:
        """One per linked device record (each is in exactly one launch call's list)."""
        return len(self.starts)

    def launched(self, corr: np.ndarray) -> tuple[np.ndarray, dict[int, list[int]]]:
        """For API calls of correlation ids ``corr``: the first id each starts (0 for none),
        and, for the calls that start several (graph launches), index → all of them."""
        corr = np.asarray(corr, dtype=np.int64)
        first = np.zeros(len(corr), dtype=np.uint64)
        if not len(self.launchers) or not len(corr):
            return first, {}
        j = np.minimum(np.searchsorted(self.launchers, corr), len(self.launchers) - 1)
        hit = self.launchers[j] == corr
        first[hit] = self.starts[self.offsets[j[hit]]]
        count = np.where(hit, self.offsets[j + 1] - self.offsets[j], 0)
        ids, cuts = self.starts.tolist(), self.offsets.tolist()
        several = {int(i): ids[cuts[j[i]]:cuts[j[i] + 1]] for i in np.flatnonzero(count > 1)}
        return first, several


def assign_lanes(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Lane per interval so that intervals in one lane never overlap (greedy, earliest free lane).

    Fast path when nothing overlaps (the usual case for one stream): all zeros, vectorised.
    """
    n = starts.size
    lanes = np.zeros(n, dtype=np.int64)
    if n < 2:
        return lanes
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    if np.all(s[1:] >= np.maximum.accumulate(e)[:-1]):
        return lanes
    free: list[tuple[int, int]] = []  # (end, lane)
    nlanes = 0
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        if free and free[0][0] <= s[i]:
            _, lane = heapq.heappop(free)
        else:
            lane = nlanes
            nlanes += 1
        out[i] = lane
        heapq.heappush(free, (int(e[i]), lane))
    lanes[order] = out
    return lanes


def distinct_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the first row of each distinct row, each row's distinct number) of an int matrix: one
    stable lexsort of its columns (``np.unique(axis=0)`` sorts the rows as opaque bytes, several
    times slower)."""
    n = len(rows)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    order = np.lexsort(rows.T[::-1])
    s = rows[order]
    new = np.ones(n, dtype=bool)
    new[1:] = (s[1:] != s[:-1]).any(axis=1)
    inv = np.empty(n, dtype=np.int64)
    inv[order] = np.cumsum(new) - 1
    return order[new], inv  # (stable: the first of each group is its earliest row)


_demangled: dict[str, str] = {}


def demangle(names: list[str]) -> list[str]:
    """Demangle C++ kernel names in one ``c++filt`` call (cached); names unchanged without it."""
    todo = [n for n in names if n.startswith("_Z") and n not in _demangled]
    if todo:
        tool = shutil.which("c++filt")
        out: list[str] = []
        if tool:
            try:
                res = subprocess.run(
                    [tool], input="\n".join(todo) + "\n", capture_output=True, text=True,
                    timeout=10, check=False,
                )  # fmt: skip
                out = res.stdout.splitlines()
            except (OSError, subprocess.SubprocessError):
                out = []
        if len(out) != len(todo):
            out = todo
        _demangled.update(zip(todo, out, strict=False))
    return [_demangled.get(n, n) for n in names]


@dataclass
class ConvertStats:
    """What one ``convert`` call wrote."""

    kernels: int = 0
    memcpys: int = 0
    memsets: int = 0
    syncs: int = 0
    api_calls: int = 0
    flows: int = 0
    dropped: int = 0
    left_out: int = 0  # records with no usable stamps, or from outside the window
    counter_samples: int = 0
    metrics: dict[int, BucketMetrics] = field(default_factory=dict)

    @property
    def records(self) -> int:
        return self.kernels + self.memcpys + self.memsets + self.syncs + self.api_calls


class GpuTraceConverter:
    """Writes activity batches into a session (see the module docstring for the layout).

    ``devices`` maps CUPTI device ids to their limits. ``bucket_ns`` fixes the counter bucket;
    by default it is chosen per batch so that ``steps`` steps (or the batch's span, if not given)
    get about ``buckets_per_step`` buckets each. A bucket that would give a window more than
    ``max_buckets`` buckets is widened.
    """

    def __init__(
        self,
        sess: Any,
        devices: Mapping[int, DeviceLimits],
        *,
        offset_ns: int = 0,
        bucket_ns: int | None = None,
        buckets_per_step: int = 20,
        max_buckets: int = MAX_BUCKETS,
        level: int = _schema.LEVEL_DETAIL,
        api_names: Mapping[tuple[bool, int], str] | None = None,
        thread_tracks: Mapping[int, int] | None = None,
        pid: int | None = None,
        demangle_names: bool = True,
        counters: bool = True,
    ) -> None:
        if not devices:
            raise ValueError("GpuTraceConverter needs the limits of at least one device")
        self.sess = sess
        self.devices = dict(devices)
        self.offset_ns = int(offset_ns)
        self.bucket_ns = bucket_ns
        self.buckets_per_step = buckets_per_step
        self.max_buckets = max_buckets
        self.api_names = dict(api_names or {})
        self.thread_tracks = dict(thread_tracks or {})
        self.pid = os.getpid() if pid is None else int(pid)
        self.rank = int(getattr(sess, "rank", 0) or 0)
        self.demangle_names = demangle_names
        self.counters = counters
        self.level = level
        self._em = sess.emitter(clock="realtime", level=level)
        # counters also feed the run's summaries: written at summary level
        self._cem = sess.emitter(clock="realtime", level=_schema.LEVEL_SUMMARY)
        self._streams: dict[tuple[int, int, int], int] = {}
        self._sync: dict[int, int] = {}
        self._api: dict[tuple[int, int], int] = {}
        self._ctr: dict[tuple[int, str], int] = {}
        self._extra_flows = 0  # sequence of the extra ids of graph launches (see flow_plan)

    # --- tracks --------------------------------------------------------------------------------
    def gpu_track(self, device: int) -> int:
        """The session's track of ``device`` (made once, shared with other GPU producers)."""
        dev = self.devices.get(device) or next(iter(self.devices.values()))
        name = _schema.GPU_TRACK_NAME.format(device=device, name=dev.name)
        return self.sess.gpu_track(device, name)

    def stream_track(self, device: int, stream: int, lane: int = 0) -> int:
        key = (device, stream, lane)
        t = self._streams.get(key)
        if t is None:
            name = _schema.STREAM_TRACK_NAME.format(stream=stream)
            t = self._streams[key] = self.sess.new_track(name, parent=self.gpu_track(device))
        return t

    def sync_track(self, device: int) -> int:
        t = self._sync.get(device)
        if t is None:
            t = self._sync[device] = self.sess.new_track(
                _schema.SYNC_TRACK_NAME, parent=self.gpu_track(device)
            )
        return t

    def api_track(self, thread: int, lane: int = 0) -> int:
        key = (thread, lane)
        t = self._api.get(key)
        if t is None:
            parent = self.thread_tracks.get(thread)
            if parent is None:
                parent = self.sess.process_uuid
                name = f"{_schema.API_TRACK_NAME} (thread {thread})"
            else:
                name = _schema.API_TRACK_NAME
            t = self._api[key] = self.sess.new_track(name, parent=parent)
        return t

    def counter_track(self, device: int, which: str) -> int:
        key = (device, which)
        t = self._ctr.get(key)
        if t is None:
            t = self._ctr[key] = self.sess.new_counter_track(
                which.format(device=device), unit=_schema.GPU_COUNTER_UNIT
            )
        return t

    # --- conversion ----------------------------------------------------------------------------
    def convert(
        self, batch: ActivityBatch, *, window: tuple[int, int] | None = None, steps: int = 0
    ) -> ConvertStats:
        """Write one batch. ``window`` (CUPTI ns) bounds the counter buckets; ``steps`` is the
        number of steps it covers (for the default bucket size)."""
        # kernels, copies, syncs and API calls are emitted kind by kind, out of time order: hand
        # them to the writer in one piece so that no flush falls between them
        with self._em.batch(), self._cem.batch():
            return self._convert(batch, window, steps)

    def _convert(self, batch: ActivityBatch, window: tuple[int, int] | None,
                 steps: int) -> ConvertStats:
        batch, left_out = batch.screened(window)
        st = ConvertStats(dropped=int(batch.dropped), left_out=left_out)
        em, off = self._em, self.offset_ns
        api_corr = np.concatenate([batch.runtime["correlation"], batch.driver["correlation"]])
        plan = self.flow_plan(
            (batch.kernels, batch.memcpys, batch.memsets, batch.syncs), api_corr
        )
        st.flows = plan.arrows
        context_device = self._context_devices(batch)

        # kernels
        k = batch.kernels
        if k.size:
            st.kernels = int(k.size)
            names = batch.names
            if self.demangle_names:
                names = demangle(names)
            cats = np.where(batch.kernel_is_communication(), 1, 0)
            cat_names = (_schema.CAT_KERNEL, _schema.CAT_COMMUNICATION)
            est = self._estimates(k)
            tracks = np.asarray(self._device_tracks(k), dtype=np.int64)
            # a kernel's name, place and args but its correlation id repeat every step: one
            # base per distinct set (the estimates follow from the launch and the device)
            fixed = np.stack([k["name"], tracks, cats, k["grid_x"], k["grid_y"], k["grid_z"],
                              k["block_x"], k["block_y"], k["block_z"], k["registers"],
                              k["static_smem"], k["dynamic_smem"], k["graph_id"],
                              k["graph_node_id"]], axis=1).astype(np.int64)  # fmt: skip
            first, base = distinct_rows(fixed)
            bps, wps, occ = (np.round(a[first], 6).tolist() for a in (
                est.blocks_per_sm, est.warps_per_sm, est.est_achieved_occupancy))
            gx, gy, gz = _schema.ARG_GRID
            bx, by, bz = _schema.ARG_BLOCK
            bases = []
            for j, row in enumerate(fixed[first].tolist()):
                nid, trk, cat, x, y, z, u, v, w, regs, ss, ds, gid, gnode = row
                args = {gx: x, gy: y, gz: z, bx: u, by: v, bz: w, _schema.ARG_REGISTERS: regs,
                        _schema.ARG_SHARED_STATIC: ss, _schema.ARG_SHARED_DYNAMIC: ds,
                        _schema.ARG_BLOCKS_PER_SM: bps[j], _schema.ARG_WARPS_PER_SM: wps[j],
                        _schema.ARG_OCCUPANCY: occ[j]}  # fmt: skip
                if gid:
                    args[_schema.ARG_GRAPH_ID], args[_schema.ARG_GRAPH_NODE_ID] = gid, gnode
                bases.append((names[nid], cat_names[cat], trk, args))
            em.completes_columns(k["start"] + off, k["end"] - k["start"], bases, base,
                                 {_schema.ARG_CORRELATION: k["correlation"]},
                                 tflows=plan.terminating_ids[0])  # fmt: skip

        # memcpy: one base per (stream, kinds, graph node); bytes, bandwidth, correlation vary
        m = batch.memcpys
        if m.size:
            st.memcpys = int(m.size)
            dur = m["end"] - m["start"]
            keys = np.stack([np.asarray(self._device_tracks(m), dtype=np.int64),
                             m["copy_kind"], m["src_kind"], m["dst_kind"], m["graph_id"],
                             m["graph_node_id"]], axis=1).astype(np.int64)  # fmt: skip
            first, base = distinct_rows(keys)
            bases = []
            for trk, ck, sk, dk, gid, gnode in keys[first].tolist():
                kind = COPY_KIND_NAMES.get(ck, str(ck))
                src = MEMORY_KIND_NAMES.get(sk, str(sk))
                dst = MEMORY_KIND_NAMES.get(dk, str(dk))
                args = {_schema.ARG_COPY_KIND: kind, _schema.ARG_SRC_KIND: src,
                        _schema.ARG_DST_KIND: dst}  # fmt: skip
                if gid:
                    args[_schema.ARG_GRAPH_ID], args[_schema.ARG_GRAPH_NODE_ID] = gid, gnode
                bases.append((f"Memcpy {kind} ({src} -> {dst})", _schema.CAT_MEMCPY, trk, args))
            em.completes_columns(
                m["start"] + off, dur, bases, base,
                {_schema.ARG_BYTES: m["bytes"], _schema.ARG_CORRELATION: m["correlation"]},
                tflows=plan.terminating_ids[1],
                float_args={_schema.ARG_BANDWIDTH:  # bytes/ns == GB/s
                            np.round(m["bytes"] / np.maximum(dur, 1), 4)},
            )  # fmt: skip

        # memset
        s = batch.memsets
        if s.size:
            st.memsets = int(s.size)
            keys = np.stack([np.asarray(self._device_tracks(s), dtype=np.int64), s["graph_id"],
                             s["graph_node_id"]], axis=1).astype(np.int64)  # fmt: skip
            first, base = distinct_rows(keys)
            bases = [("Memset", _schema.CAT_MEMSET, trk,
                      {_schema.ARG_GRAPH_ID: gid, _schema.ARG_GRAPH_NODE_ID: gnode} if gid
                      else None) for trk, gid, gnode in keys[first].tolist()]
            em.completes_columns(
                s["start"] + off, s["end"] - s["start"], bases, base,
                {_schema.ARG_BYTES: s["bytes"], _schema.ARG_CORRELATION: s["correlation"]},
                tflows=plan.terminating_ids[2],
            )  # fmt: skip

        # synchronization
        y = batch.syncs
        if y.size:
            st.syncs = int(y.size)
            dev = np.array([context_device.get(c, -1) for c in y["context"].tolist()])
            dev = np.where(dev < 0, min(self.devices), dev)
            lanes = np.zeros(y.size, dtype=np.int64)
            for d in np.unique(dev).tolist():
                sel = dev == d
                lanes[sel] = assign_lanes(y["start"][sel], y["end"][sel])
            keys = np.stack([dev, lanes, y["type"], y["stream"]], axis=1).astype(np.int64)
            first, base = distinct_rows(keys)
            bases = []
            for d, lane, typ, stream in keys[first].tolist():
                args = {_schema.ARG_SYNC_TYPE: SYNC_TYPE_NAMES.get(typ, str(typ))}
                if stream != INVALID_ID:
                    args[_schema.ARG_STREAM] = stream
                bases.append((SYNC_TYPE_NAMES.get(typ, "Synchronize"), _schema.CAT_SYNC,
                              self._lane_track(self.sync_track(d), d, lane), args))
            em.completes_columns(
                y["start"] + off, y["end"] - y["start"], bases, base,
                {_schema.ARG_CORRELATION: y["correlation"]}, tflows=plan.terminating_ids[3],
            )  # fmt: skip

        # runtime / driver API calls on the launching thread
        for table, driver, cat in (
            (batch.runtime, False, _schema.CAT_RUNTIME),
            (batch.driver, True, _schema.CAT_DRIVER),
        ):
            if not table.size:
                continue
            st.api_calls += int(table.size)
            tracks = np.asarray(self._api_tracks(table), dtype=np.int64)
            keys = np.stack([tracks, table["cbid"].astype(np.int64)], axis=1)
            first, base = distinct_rows(keys)
            bases = [(self.api_names.get((driver, cbid)) or api_name(cbid, driver=driver), cat,
                      trk, {_schema.ARG_CBID: cbid}) for trk, cbid in keys[first].tolist()]
            first, several = plan.launched(table["correlation"])
            em.completes_columns(
                table["start"] + off, table["end"] - table["start"], bases, base,
                {_schema.ARG_CORRELATION: table["correlation"]}, flows=first,
                flow_lists=several,
            )  # fmt: skip

        if batch.dropped or left_out:
            rng = batch.time_range()
            ts = (rng[1] if rng else window[1] if window else 0) + off
            args = {_schema.ARG_DROPPED: int(batch.dropped)}
            if left_out:
                args[_schema.ARG_LEFT_OUT] = left_out
            for d in sorted(self.devices):
                em.instant(ts, "CUPTI dropped records", self.gpu_track(d), _schema.CAT_STEPSCOPE,
                           args)  # fmt: skip
            log.log(logging.WARNING if batch.dropped else logging.INFO,
                    "stepscope: CUPTI dropped %d activity records; %d more had no usable "
                    "timestamps or lay outside the window", batch.dropped, left_out)  # fmt: skip

        if self.counters and k.size:
            st.counter_samples, st.metrics = self._write_counters(batch, window, steps)
        return st

    # --- helpers -------------------------------------------------------------------------------
    def _estimates(self, k: np.ndarray) -> KernelEstimates:
        """Per-kernel estimates, each kernel with its own device's limits."""
        fallback = next(iter(self.devices.values()))
        parts = []
        devs = np.unique(k["device"]).tolist()
        for d in devs:
            sel = k["device"] == d if len(devs) > 1 else slice(None)
            kk = k[sel]
            e = kernel_estimates(
                self.devices.get(d, fallback), (kk["grid_x"], kk["grid_y"], kk["grid_z"]),
                (kk["block_x"], kk["block_y"], kk["block_z"]),
                kk["registers"], kk["static_smem"], kk["dynamic_smem"],
            )  # fmt: skip
            if len(devs) == 1:
                return e
            parts.append((sel, e))
        merged = {f.name: np.zeros(k.size) for f in fields(KernelEstimates)}
        for sel, e in parts:
            for name, arr in merged.items():
                arr[sel] = getattr(e, name)
        return KernelEstimates(**merged)

    def flow_plan(self, tables: tuple[np.ndarray, ...], api_corr: np.ndarray) -> FlowPlan:
        """One arrow from the launching API call to every device record it launched.

        Records are grouped by correlation id across all tables (a graph launch may run kernels,
        copies and memsets), ordered by start time. The first of a group keeps the id of
        :func:`flow_ids_for`; the others get ``_EXTRA_FLOW_TAG`` ids numbered by a sequence that
        runs over the converter's life, so ids never repeat within a process. Records whose
        launch call is not in the batch get no flow.
        """
        corr = np.concatenate([t["correlation"] for t in tables]).astype(np.int64)
        start = np.concatenate([t["start"] for t in tables]).astype(np.int64)
        linked = np.isin(corr, api_corr)
        fids = flow_ids_for(corr, self.pid, rank=self.rank)
        order = np.lexsort((start, corr))  # by correlation, then start
        sc, lo = corr[order], linked[order]
        # in that order: linked records after the first of their correlation id
        extra = np.zeros(sc.size, dtype=bool)
        extra[1:] = sc[1:] == sc[:-1]
        extra &= lo
        n_extra = int(extra.sum())
        if n_extra:
            seq = (self._extra_flows + np.arange(n_extra)) & 0xFFFFFFFF
            fids[order[extra]] = flow_ids_for(seq, self.pid, rank=self.rank, tag=_EXTRA_FLOW_TAG)
            self._extra_flows += n_extra
        lc, lf = sc[lo], fids[order][lo]  # linked, by correlation then start
        head = np.ones(lc.size, dtype=bool)
        head[1:] = lc[1:] != lc[:-1]
        offsets = np.append(np.flatnonzero(head), lc.size).astype(np.int64)
        bounds = np.cumsum([0] + [t.size for t in tables]).tolist()
        ids = np.where(linked, fids, np.uint64(0))
        return FlowPlan([ids[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)],
                        lc[head], offsets, lf.astype(np.uint64))

    def _context_devices(self, batch: ActivityBatch) -> dict[int, int]:
        out: dict[int, int] = {}
        for t in (batch.kernels, batch.memcpys, batch.memsets):
            if t.size:
                pairs = np.unique(np.stack([t["context"], t["device"]], axis=1), axis=0)
                out.update({int(c): int(d) for c, d in pairs.tolist()})
        return out

    def _lane_track(self, base: int, device: int, lane: int) -> int:
        if lane == 0:
            return base
        key = (device, -2, lane)  # extra sync lanes
        t = self._streams.get(key)
        if t is None:
            t = self._streams[key] = self.sess.new_track(
                _schema.SYNC_TRACK_NAME, parent=self.gpu_track(device)
            )
        return t

    def _device_tracks(self, t: np.ndarray) -> list[int]:
        """Track per record of a device table, with lanes for overlap on a stream."""
        out = np.zeros(t.size, dtype=np.int64)
        key = t["device"].astype(np.int64) << 40 | (t["stream"].astype(np.int64) & 0xFFFFFFFFFF)
        for kv in np.unique(key).tolist():
            sel = key == kv
            device, stream = int(kv >> 40), int(kv & 0xFFFFFFFFFF)
            lanes = assign_lanes(t["start"][sel], t["end"][sel])
            ids = [self.stream_track(device, stream, lane) for lane in range(int(lanes.max()) + 1)]
            out[sel] = np.asarray(ids, dtype=np.int64)[lanes]
        return out.tolist()

    def _api_tracks(self, t: np.ndarray) -> list[int]:
        out = np.zeros(t.size, dtype=np.int64)
        for th in np.unique(t["thread"]).tolist():
            sel = t["thread"] == th
            lanes = assign_lanes(t["start"][sel], t["end"][sel])
            ids = [self.api_track(int(th), lane) for lane in range(int(lanes.max()) + 1)]
            out[sel] = np.asarray(ids, dtype=np.int64)[lanes]
        return out.tolist()

    def _write_counters(
        self, batch: ActivityBatch, window: tuple[int, int] | None, steps: int
    ) -> tuple[int, dict[int, BucketMetrics]]:
        k = batch.kernels
        t0, t1 = int(k["start"].min()), int(k["end"].max())
        if window:  # the window's idle edges count too; kernels outside it are never cut off
            t0, t1 = min(t0, int(window[0])), max(t1, int(window[1]))
        if self.bucket_ns:
            bucket = self.bucket_ns
        elif steps > 0:  # tens of buckets per step
            bucket = choose_bucket_ns((t1 - t0) // steps, target_buckets=self.buckets_per_step)
        else:  # the TensorBoard plugin's rule: a round bucket, at most 100 over the window
            bucket = choose_bucket_ns(t1 - t0, target_buckets=100)
        if (t1 - t0) // bucket > self.max_buckets:  # a bucket far too small for this window
            bucket = -(-(t1 - t0) // self.max_buckets)
            log.debug("stepscope: GPU counter bucket widened to %d ns (%d buckets at most)",
                      bucket, self.max_buckets)  # fmt: skip
        edges = bucket_edges(t0, t1, bucket)
        est = self._estimates(k)
        n = 0
        out: dict[int, BucketMetrics] = {}
        sample_ts: list[np.ndarray] = []
        sample_values: list[np.ndarray] = []
        sample_tracks: list[np.ndarray] = []
        for d in np.unique(k["device"]).tolist():
            sel = k["device"] == d
            bm = bucket_metrics(
                k["start"][sel], k["end"][sel], est.blocks_per_sm[sel],
                est.est_achieved_occupancy[sel], edges,
            )  # fmt: skip
            out[d] = bm
            ts = edges + self.offset_ns
            for which, values in (
                (_schema.COUNTER_GPU_UTILIZATION, bm.utilization),
                (_schema.COUNTER_GPU_SM_EFFICIENCY, bm.sm_efficiency),
                (_schema.COUNTER_GPU_OCCUPANCY, np.nan_to_num(bm.achieved_occupancy)),
            ):
                trk = self.counter_track(d, which)
                m = min(len(values), len(ts))
                sample_ts.append(np.append(ts[:m], ts[-1]))  # back to idle after the window
                sample_values.append(np.append(values[:m] * 100.0, 0.0))
                sample_tracks.append(np.full(m + 1, trk, dtype=np.int64))
                n += len(ts)
        self._cem.counters_columns(np.concatenate(sample_ts), np.concatenate(sample_tracks),
                                   np.concatenate(sample_values))
        return n, out
