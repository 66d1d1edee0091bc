"""What trace processor would reject in a trace file: the check every test's traces pass.

``problems(path)`` lists, in words, what trace processor (v58) refuses or drops in a trace:

* a global clock snapshot whose clock reads less than in an earlier snapshot of the same clocks
  (the trace clock: the snapshot is refused, ``invalid_clock_snapshots``; another clock: it is
  no longer converted from);
* a global clock declared incremental;
* a TrackEvent at a negative trace time (``track_event_invalid_timestamp``), found with the
  embedded importer, which drops and counts them as trace processor does.

Files that do not decode at all are not this check's business (the robustness tests write such
files on purpose): they give no problem here.
"""

from __future__ import annotations

import os
import zlib

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from stepscope.analysis import TraceError
from stepscope.analysis.tp.importer import decode_files

# stats of the embedded importer that name what trace processor rejects
REJECTED_STATS = ("track_event_invalid_timestamp", "invalid_clock_snapshots")
MAX_BYTES = 64 << 20  # bigger files (benchmarks) are left alone: the suite stays fast


def _snapshots(data: bytes, out: list, depth: int = 0) -> None:
    trace = pb.Trace.FromString(data)
    for p in trace.packet:
        if p.HasField("clock_snapshot"):
            out.append(p.clock_snapshot)
        if p.HasField("compressed_packets") and depth == 0:
            _snapshots(zlib.decompress(p.compressed_packets), out, 1)


def problems(path: str | os.PathLike) -> list[str]:
    """What trace processor would reject in the trace at ``path`` (empty: nothing)."""
    if os.path.getsize(path) > MAX_BYTES:
        return []
    try:
        with open(path, "rb") as f:
            snaps: list = []
            _snapshots(f.read(), snaps)
    except Exception:  # not a (whole) trace: not this check's business
        return []
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
