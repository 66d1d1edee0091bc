"""What trace processor would reject in a trace file: the check every test's traces pass.

``problems(path)`` lists, in words, what trace processor (v58) refuses or drops in a trace:

* a global clock snapshot whose clock reads less than in an earlier snapshot of the same clocks
  (the trace clock: the snapshot is refused, ``invalid_clock_snapshots``; another clock: it is
  no longer converted from);
* a global clock declared incremental;
* a TrackEvent at a negative trace time (``track_event_invalid_timestamp``), found with the
  embedded importer, which drops and counts them as trace processor does.

Damaged parts are not this check's business (the robustness tests write such files on purpose):
what is readable is checked, the rest (a cut packet, a damaged batch, a decompression bomb:
inflated within ``stepscope._inflate``'s bounds, never whole) gives no problem here.
"""

from __future__ import annotations

import os

from google.protobuf.message import DecodeError
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from stepscope import _inflate
from stepscope.analysis import TraceError
from stepscope.analysis.tp.importer import decode_files

# stats of the embedded importer that name what trace processor rejects
REJECTED_STATS = ("track_event_invalid_timestamp", "invalid_clock_snapshots")
MAX_BYTES = 64 << 20  # bigger files (benchmarks) are left alone: the suite stays fast


def _packets(data: bytes):
    """The whole ``TracePacket``s of a ``Trace`` up to the first damaged or cut one."""
    at, end = 0, len(data)
    while at < end:
        key, at = _varint(data, at)
        size, at = _varint(data, at) if key & 7 == 2 else (0, end + 1)
        if key != 0x0A or at + size > end:
            return
        try:
            yield pb.TracePacket.FromString(data[at:at + size])
        except DecodeError:
            return
        at += size


def _varint(data: bytes, at: int) -> tuple[int, int]:
    v = shift = 0
    while at < len(data):
        b = data[at]
        at += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return v, at
    return -1, len(data) + 1


def _snapshots(data: bytes, out: list, budget: _inflate.Budget, depth: int = 0) -> None:
    for p in _packets(data):
        if p.HasField("clock_snapshot"):
            out.append(p.clock_snapshot)
        if p.HasField("compressed_packets") and depth == 0:
            inner = p.compressed_packets
            raw, _ = _inflate.inflate(inner, budget.batch_limit(len(inner)), first=0x0A)
            if raw is not None:  # a damaged batch or a bomb is skipped, the rest checked
                budget.bytes -= len(raw)
                _snapshots(bytes(raw), out, budget, 1)


def problems(path: str | os.PathLike) -> list[str]:
    """What trace processor would reject in the trace at ``path`` (empty: nothing)."""
    if os.path.getsize(path) > MAX_BYTES:
        return []
    with open(path, "rb") as f:
        data = f.read()
    snaps: list = []
    _snapshots(data, snaps, _inflate.Budget(len(data)))
    out = []
    last: dict[frozenset, dict[int, int]] = {}
    for i, cs in enumerate(snaps):
        clocks = {c.clock_id: c.timestamp * (c.unit_multiplier_ns or 1) for c in cs.clocks}
        if any(64 <= c <= 127 for c in clocks):
            continue  # sequence-scoped: its own sequence's
        out += [f"snapshot {i}: global clock {c.clock_id} is incremental"
                for c in cs.clocks if c.is_incremental]
        key = frozenset(clocks)
        prev = last.get(key)
        if prev is not None:
            out += [f"snapshot {i}: clock {c} goes back ({v} < {prev[c]})"
                    for c, v in clocks.items() if v < prev[c]]
        last[key] = clocks
    try:
        stats = decode_files([os.fspath(path)]).stats
    except (TraceError, MemoryError):
        return out
    out += [f"{k}: {stats[k]}" for k in REJECTED_STATS if stats.get(k)]
    return out
