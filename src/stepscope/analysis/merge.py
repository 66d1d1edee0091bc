"""``stepscope merge``: the per-rank trace files of a run as one timeline, one process per rank.

Mechanism (Perfetto's own): protobuf ``Trace`` files are concatenable, so the merged file is the
input files' packets one after the other. What must stay unique across files is
``trusted_packet_sequence_id`` (interning, incremental timestamps and sequence-scoped clocks are
keyed by it, and every rank's writer uses the same small ids), so each (file, sequence id) gets a
fresh id, also inside zlib ``compressed_packets`` batches (TracePacket field 50), which are
inflated, rewritten and deflated again. Track uuids are random per process and kept. Process ids
are kept unless two inputs share a pid (ranks on different hosts), then the later one is renumbered
in its track descriptors. Rank processes are already named ``rank <N> (<host>)`` by the writer.

Clocks: every file holds ``ClockSnapshot``s (BOOTTIME, MONOTONIC, REALTIME) and each sequence's
incremental clock is declared against MONOTONIC or REALTIME. Ranks on one host share those clocks,
so trace processor aligns them with no change ("shared clock"). Ranks on other hosts have
unrelated MONOTONIC/BOOTTIME clocks: their readings (in clock snapshots, and absolute packet
timestamps on those clocks) are shifted onto the first host's clocks by the difference of the
REALTIME readings in each file's first snapshot ("wall clock"): alignment is as good as the hosts'
NTP sync. The mode used is returned and printed. Trace processor refuses a clock snapshot whose
trace clock (BOOTTIME) reads less than in an earlier snapshot of the same clocks, and stops
converting from any other clock that goes back; each rank's file holds a snapshot at its start and
at its end, so the next rank's first snapshot (taken while the previous rank still ran) would go
back. The merged file keeps a global snapshot only when no clock in it goes back from the last one
kept with the same clocks (the rest are dropped and counted): every rank converts through the
kept ones, readings of the same clocks (shifted ones for other hosts). Sequence-scoped snapshots
(clocks 64-127, one sequence each) are kept as they are.

Memory stays bounded: files are read packet by packet and one compressed batch at a time, each
inflated within the bounds of ``stepscope._inflate`` (a decompression bomb is skipped). A damaged
packet or batch is left out with a warning (``TraceDamageWarning``: batches and bytes), the rest
is merged. The output is written to a temporary file beside it and renamed at the end: a failed
merge leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from .. import _deflate, _inflate
from .. import _schema as S
from .._clock import BOOTTIME as CLOCK_BOOTTIME
from .._clock import MONOTONIC as CLOCK_MONOTONIC
from .._clock import REALTIME as CLOCK_REALTIME
from ..format import wire as w
from ..format.wire import f_bytes, f_varint
from ..format.wire import fields as _fields
from ..format.wire import read_varint as _varint
from .tp import protoscan as ps
from .tp.packets import check_start, refuse_empty, skipped_summary

SHIFTED_CLOCKS = (CLOCK_MONOTONIC, CLOCK_BOOTTIME)

_CHUNK = 1 << 20


def iter_packets(f: BinaryIO, skipped: dict[str, int] | None = None) -> Iterator[bytes]:
    """Serialized TracePackets of a ``Trace`` stream, read in 1 MiB chunks.

    A truncated last packet (a writer killed mid-write) ends the stream, as it does in trace
    processor; it is counted in ``skipped`` (``truncated_packets``/``truncated_bytes``, what
    the analysis reader counts) so the merge can say that the file's last batch is lost.
    """

    def cut(nbytes: int) -> None:
        if skipped is not None and nbytes > 0:
            skipped["truncated_packets"] = skipped.get("truncated_packets", 0) + 1
            skipped["truncated_bytes"] = skipped.get("truncated_bytes", 0) + nbytes

    buf = b""
    pos = 0
    eof = False
    while True:
        # ensure a full key + length is buffered
        if len(buf) - pos < 20 and not eof:
            more = f.read(_CHUNK)
            eof = not more
            buf = buf[pos:] + more
            pos = 0
        if pos >= len(buf):
            return
        try:
            key, p = _varint(buf, pos)
            if key & 7 != 2:
                # not a length-delimited field: skip a varint/fixed value (no such field in Trace)
                if key & 7 == 0:
                    _, p = _varint(buf, p)
                else:
                    p += 8 if key & 7 == 1 else 4
                pos = p
                continue
            ln, p = _varint(buf, p)
        except IndexError:
            if eof:
                cut(len(buf) - pos)
                return
            more = f.read(_CHUNK)
            eof = not more
            buf = buf[pos:] + more
            pos = 0
            continue
        while len(buf) - p < ln and not eof:
            more = f.read(max(_CHUNK, ln - (len(buf) - p)))
            eof = not more
            buf = buf[pos:] + more
            p -= pos
            pos = 0
        if len(buf) - p < ln:
            cut(len(buf) - pos)
            return
        if key >> 3 == w.TRACE_PACKET:
            yield bytes(buf[p:p + ln])
        pos = p + ln


def iter_trace_bytes(data: bytes) -> Iterator[bytes]:
    """Packets of an in-memory ``Trace`` (the payload of compressed_packets)."""
    for field, wt, s, e, _ in _fields(data):
        if field == w.TRACE_PACKET and wt == w.LEN:
            yield data[s:e]


def iter_all_packets(path: str | os.PathLike[str]) -> Iterator[bytes]:
    """Every packet of a file, with compressed batches inflated (within the bounds of
    ``_inflate``); damaged packets and batches are left out."""
    budget = _inflate.Budget(os.path.getsize(path))
    with open(path, "rb") as f:
        for pkt in iter_packets(f):
            try:
                inner = _compressed_payload(pkt)
            except (ValueError, IndexError):
                continue
            if inner is None:
                yield pkt
                continue
            data, _ = _inflate.inflate(inner, budget.batch_limit(len(inner)),
                                       first=w.TAG_TRACE_PACKET)
            if data is None:
                continue
            budget.bytes -= len(data)
            try:
                yield from iter_trace_bytes(bytes(data))
            except (ValueError, IndexError):
                continue


def _compressed_payload(pkt: bytes) -> bytes | None:
    for field, wt, s, e, _ in _fields(pkt):
        if field == w.PKT_COMPRESSED_PACKETS and wt == 2:
            return pkt[s:e]
    return None


class _Damaged(Exception):
    """A packet or batch that cannot be rewritten: left out of the merge."""

    def __init__(self, kind: str, nbytes: int) -> None:
        super().__init__(kind)
        self.kind = kind  # "damaged" or "over"
        self.nbytes = nbytes  # compressed bytes of the batch


# -- inputs -------------------------------------------------------------------------------------
@dataclasses.dataclass
class InputInfo:
    """What the pre-pass learned about one input file."""

    path: Path
    rank: int | None = None
    host: str | None = None
    process_name: str | None = None
    pid: int | None = None
    snapshot: dict[int, int] | None = None  # first global ClockSnapshot: clock id -> ns
    mono_shift: int = 0
    boot_shift: int = 0
    pid_map: dict[int, int] = dataclasses.field(default_factory=dict)


_RANK_NAME = re.compile(r"^rank (\d+) \((.*)\)$")


def parse_ranks(spec: str) -> set[int]:
    """``"0,2-5"`` -> {0, 2, 3, 4, 5}; raises ValueError with the offending part."""
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"--ranks: {part!r} is not a rank or a range like 2-5")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if hi < lo:
            raise ValueError(f"--ranks: range {part!r} is empty")
        out.update(range(lo, hi + 1))
    return out


# the profiler's file roles (``_schema.rank_file``) each level merges: a DataLoader worker's file
# is part of its rank's summary
_LEVEL_ROLES = {"summary": ("summary", "worker"), "detail": ("detail",)}


def find_inputs(paths: Iterable[str | os.PathLike[str]], level: str = "summary") -> list[Path]:
    """Files to merge: explicit files as given; directories searched (recursively) for the
    profiler's files of ``level``."""
    if level not in ("summary", "detail"):
        raise ValueError(f"--level must be 'summary' or 'detail', got {level!r}")
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(q for q in p.rglob("rank*.pftrace")
                           if (S.rank_file(q.name) or ("",))[0] in _LEVEL_ROLES[level])
            dirs = sorted({q.parent for q in found})
            if len(dirs) > 1:
                raise ValueError(
                    f"{p} holds several runs ({', '.join(str(d) for d in dirs)}); "
                    "give one run directory"
                )
            if not found:
                raise ValueError(f"{p}: no rank*.{level}*.pftrace files found")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise ValueError(f"{p}: no such file or directory")
    return out


def _probe(path: Path, max_packets: int = 2000) -> InputInfo:
    """Read the start of a file for its rank/host (process descriptor) and first clock snapshot."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    info = InputInfo(path)
    found = S.rank_file(path.name)
    if found:
        info.rank = found[1]
    for i, pkt in enumerate(_parsable(iter_all_packets(path), pb)):
        for field, wt, s, e, _ in _fields(pkt):
            if wt != 2:
                continue
            if field == w.PKT_TRACK_DESCRIPTOR and info.pid is None:
                td = pb.TrackDescriptor.FromString(pkt[s:e])
                if td.HasField("process"):
                    info.pid = td.process.pid
                    info.process_name = td.process.process_name or None
                    nm = _RANK_NAME.match(info.process_name or "")
                    if nm:
                        if info.rank is None:
                            info.rank = int(nm.group(1))
                        info.host = nm.group(2)
            elif field == w.PKT_CLOCK_SNAPSHOT and info.snapshot is None:
                snap = {c.clock_id: c.timestamp
                        for c in pb.ClockSnapshot.FromString(pkt[s:e]).clocks}
                if CLOCK_REALTIME in snap and CLOCK_MONOTONIC in snap:
                    info.snapshot = snap
        if (info.pid is not None and info.snapshot is not None) or i >= max_packets:
            break
    return info


def _parsable(packets: Iterable[bytes], pb) -> Iterator[bytes]:
    """The packets whose fields, track descriptors and clock snapshots parse (a damaged one
    is left out here; the rewrite counts it)."""
    from google.protobuf.message import DecodeError

    for pkt in packets:
        try:
            for field, wt, s, e, _ in _fields(pkt):
                if wt == 2 and field == w.PKT_TRACK_DESCRIPTOR:
                    pb.TrackDescriptor.FromString(pkt[s:e])
                elif wt == 2 and field == w.PKT_CLOCK_SNAPSHOT:
                    pb.ClockSnapshot.FromString(pkt[s:e])
        except (ValueError, IndexError, DecodeError):
            continue
        yield pkt


# -- rewriting ----------------------------------------------------------------------------------
class _SnapshotFilter:
    """Which global clock snapshots the merged file keeps (see the module docstring): shared by
    the rewriters of all inputs, in output order."""

    def __init__(self) -> None:
        self.last: dict[frozenset, dict[int, int]] = {}  # clock set -> last kept readings
        self.dropped = 0

    def keep(self, snap: bytes) -> bool:
        clocks: dict[int, int] = {}
        for field, wt, s, e, _ in _fields(snap):
            if field == w.CS_CLOCKS and wt == w.LEN:  # Clock: id, timestamp; last one wins
                c = {f: v for f, t, v, _, _ in _fields(snap[s:e]) if t == w.VARINT}
                cid = c.get(w.CLK_ID, 0)
                if cid in w.SEQUENCE_SCOPED_CLOCK_IDS:
                    return True  # sequence-scoped: that sequence's own, in its file's order
                clocks[cid] = c.get(w.CLK_TIMESTAMP, 0)
        key = frozenset(clocks)
        last = self.last.get(key)
        if last is not None and any(ts < last[cid] for cid, ts in clocks.items()):
            self.dropped += 1
            return False
        self.last[key] = clocks
        return True


class _Rewriter:
    """Rewrites one input file's packets: sequence ids, and clocks/pids where needed."""

    def __init__(self, info: InputInfo, alloc: Iterator[int],
                 snapshots: _SnapshotFilter | None = None) -> None:
        self.info = info
        self.budget = _inflate.Budget(os.path.getsize(info.path))
        self.skipped: dict[str, int] = {}  # what was left out: batches, packets, bytes
        self.snapshots = snapshots or _SnapshotFilter()
        self.alloc = alloc
        self.seq_map: dict[int, int] = {}
        self.seq_clock: dict[int, int] = {}  # sequence -> default timestamp clock id
        self.shift = info.mono_shift != 0 or info.boot_shift != 0
        self.packets = 0
        self._pending_default: int | None = None
        self._seq_bytes: dict[int, bytes] = {}

    def _new_seq(self, old: int) -> int:
        new = self.seq_map.get(old)
        if new is None:
            new = self.seq_map[old] = next(self.alloc)
        return new

    def packet(self, pkt: bytes) -> bytes | None:
        """The rewritten packet; None when nothing is left of it (a dropped clock snapshot)."""
        self.packets += 1
        out: list[bytes] | None = None
        seq = None
        ts_field = None
        clock_id = None
        last = 0
        dropped = False  # a clock snapshot left out
        other = False  # a field besides the sequence id, timestamp and a dropped snapshot
        for field, wt, s, e, start in _fields(pkt):
            rep = None
            if field == w.PKT_SEQUENCE_ID and wt == 0:
                seq = s
                rep = self._seq_field(s)
            elif field == w.PKT_CLOCK_SNAPSHOT and wt == 2:
                snap = self._snapshot(pkt[s:e]) if self.shift else pkt[s:e]
                if self.snapshots.keep(snap):
                    other = True
                    rep = f_bytes(field, snap) if self.shift else None
                else:
                    dropped, rep = True, b""
            elif field == w.PKT_COMPRESSED_PACKETS and wt == 2:
                other = True
                self.packets -= 1
                rep = f_bytes(w.PKT_COMPRESSED_PACKETS, self._batch(pkt[s:e]))
            elif wt == 2 and field == w.PKT_TRACK_DESCRIPTOR and self.info.pid_map:
                other = True
                rep = f_bytes(field, self._descriptor(pkt[s:e]))
            elif field not in (w.PKT_TIMESTAMP, w.PKT_SEQUENCE_ID):
                other = True
            if rep is None and self.shift:
                if field == w.PKT_TIMESTAMP and wt == 0:
                    ts_field = (start, e, s)
                elif field == w.DEF_TIMESTAMP_CLOCK_ID and wt == 0:
                    clock_id = s
                elif field == w.PKT_DEFAULTS and wt == 2:
                    for f2, w2, v2, _, _ in _fields(pkt[s:e]):
                        if f2 == w.DEF_TIMESTAMP_CLOCK_ID and w2 == 0:
                            self._pending_default = v2
            if rep is not None:
                if out is None:
                    out = []
                out.append(pkt[last:start])
                out.append(rep)
                last = e
        if dropped and not other:  # only a dropped snapshot (and sequence id, time): none
            self.packets -= 1
            return None
        if self.shift:
            if self._pending_default is not None and seq is not None:
                self.seq_clock[seq] = self._pending_default
            self._pending_default = None
            if ts_field is not None:
                cid = clock_id if clock_id is not None else self.seq_clock.get(seq, CLOCK_BOOTTIME)
                delta = self._delta(cid)
                if delta:
                    # the last occurrence of a scalar field wins: append the shifted timestamp
                    if out is None:
                        out = []
                    out.append(pkt[last:])
                    out.append(f_varint(w.PKT_TIMESTAMP, max(0, ts_field[2] + delta)))
                    return b"".join(out)
        if out is None:
            return pkt
        out.append(pkt[last:])
        return b"".join(out)

    def _delta(self, clock_id: int) -> int:
        if clock_id == CLOCK_MONOTONIC:
            return self.info.mono_shift
        if clock_id == CLOCK_BOOTTIME:
            return self.info.boot_shift
        return 0

    def _seq_field(self, old: int) -> bytes:
        rep = self._seq_bytes.get(old)
        if rep is None:
            rep = self._seq_bytes[old] = f_varint(w.PKT_SEQUENCE_ID, self._new_seq(old))
        return rep

    def rewrite(self, pkt: bytes) -> bytes | None:
        """``packet``, or None (counted in ``skipped``) for a packet or batch that is damaged
        or over the inflation bounds."""
        try:
            return self.packet(pkt)
        except _Damaged as e:
            over = e.kind == "over"
            kind = "compressed_batches_over_limit" if over else "corrupt_compressed_batches"
            byte_key = "compressed_bytes_over_limit" if over else "corrupt_compressed_bytes"
            nbytes = e.nbytes
        except (ValueError, IndexError, _decode_error()):  # fields that do not parse
            kind, byte_key, nbytes = "corrupt_packets", "corrupt_bytes", len(pkt)
        self.skipped[kind] = self.skipped.get(kind, 0) + 1
        self.skipped[byte_key] = self.skipped.get(byte_key, 0) + nbytes
        return None

    def _batch(self, deflated: bytes) -> bytes:
        """Rewrite one compressed batch (inflate, rewrite each packet, deflate)."""
        data, status = _inflate.inflate(deflated, self.budget.batch_limit(len(deflated)),
                                        first=w.TAG_TRACE_PACKET)
        if data is None:
            if status == _inflate.OVER:  # the work spent on it counts: bombs are slow too
                self.budget.bytes -= self.budget.batch_limit(len(deflated))
            raise _Damaged("over" if status == _inflate.OVER else "damaged", len(deflated))
        self.budget.bytes -= len(data)
        st, _, stop = ps.split_repeated(ps.padded(data), 0, len(data))
        if stop < len(data):
            raise _Damaged("damaged", len(deflated))
        if len(st) > self.budget.packets:  # tiny packets by the million
            raise _Damaged("over", len(deflated))
        self.budget.packets -= len(st)
        data = bytes(data)
        if not self.shift and not self.info.pid_map:
            patched = self._batch_in_place(data)
            if patched is not None:
                return _deflate.compress(patched)
        parts = [f_bytes(1, q) for q in map(self.packet, iter_trace_bytes(data)) if q is not None]
        return _deflate.compress(b"".join(parts))

    def _batch_in_place(self, data: bytes) -> bytes | None:
        """Fast path for the layout stepscope's writer uses, every packet being
        ``[timestamp (8)] trusted_packet_sequence_id (10) ...`` with one-byte ids: find each id
        byte with a tight scan and swap old ids for new ones with one numpy gather; lengths do
        not change. None when the batch does not have that shape or a new id needs two bytes."""
        n = len(data)
        positions = []
        add = positions.append
        pos = 0
        try:
            while pos < n:
                if data[pos] != w.TAG_TRACE_PACKET:
                    return None
                b = data[pos + 1]
                if b < 0x80:
                    ln, p = b, pos + 2
                else:
                    ln, p = _varint(data, pos + 1)
                q = p
                if data[q] == 0x40:  # timestamp varint
                    q += 1
                    while data[q] & 0x80:
                        q += 1
                    q += 1
                if data[q] == 0x50 and data[q + 2:q + 3] == b"\x32":
                    return None  # a clock snapshot (the writer's own packet): the slow path
                if data[q] != 0x50:  # rarely: other fields first (interned data); walk them
                    end = p + ln
                    while q < end:
                        key, r = _varint(data, q)
                        if key == 0x50:
                            break
                        wt = key & 7
                        if wt == 0:
                            _, q = _varint(data, r)
                        elif wt == 2:
                            fl, r = _varint(data, r)
                            q = r + fl
                        elif wt in (1, 5):
                            q = r + (8 if wt == 1 else 4)
                        else:
                            return None
                    else:
                        return None  # no sequence id in this packet
                if data[q + 1] >= 0x80:
                    return None
                add(q + 1)
                pos = p + ln
        except IndexError:
            return None
        if pos != n:
            return None
        import numpy as np

        arr = np.frombuffer(data, dtype=np.uint8).copy()
        idx = np.array(positions, dtype=np.int64)
        table = np.arange(256, dtype=np.uint8)
        for old in np.unique(arr[idx]).tolist():
            new = self._new_seq(old)
            if new >= 0x80:
                return None
            table[old] = new
        arr[idx] = table[arr[idx]]
        self.packets += len(positions)
        return arr.tobytes()

    def _snapshot(self, snap: bytes) -> bytes:
        out = []
        for field, wt, s, e, start in _fields(snap):
            if field == w.CS_CLOCKS and wt == w.LEN:  # Clock
                clock = dict((f, v) for f, t, v, _, _ in _fields(snap[s:e]) if t == w.VARINT)
                delta = self._delta(clock.get(w.CLK_ID, 0))
                if delta:
                    body = snap[s:e] + f_varint(w.CLK_TIMESTAMP,
                                                max(0, clock.get(w.CLK_TIMESTAMP, 0) + delta))
                    out.append(f_bytes(w.CS_CLOCKS, body))
                    continue
            out.append(snap[start:e])
        return b"".join(out)

    def _descriptor(self, raw: bytes) -> bytes:
        from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

        td = pb.TrackDescriptor.FromString(raw)
        changed = False
        for sub in ("process", "thread"):
            if td.HasField(sub):
                d = getattr(td, sub)
                if d.pid in self.info.pid_map:
                    d.pid = self.info.pid_map[d.pid]
                    changed = True
        return td.SerializeToString() if changed else raw


@dataclasses.dataclass
class MergeResult:
    """What ``merge`` wrote."""

    output: Path
    inputs: list[InputInfo]
    ranks: list[int | None]
    alignment: str  # "shared clock (host X)" or "wall clock (REALTIME) across hosts ..."
    packets: int
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)  # left out: counts
    snapshots_dropped: int = 0  # global clock snapshots that went back in time (see above)

    def format(self) -> str:
        return (
            f"merged {len(self.inputs)} file(s), ranks {self.ranks}, into {self.output}\n"
            f"clock alignment: {self.alignment}"
        )


def merge(
    inputs: Iterable[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    ranks: set[int] | str | None = None,
    level: str = "summary",
) -> MergeResult:
    """Merge rank trace files (or a run directory) into ``output``; see the module docstring."""
    if isinstance(ranks, str):
        ranks = parse_ranks(ranks)
    files = find_inputs(inputs, level)
    refuse_empty([str(f) for f in files])
    for f in files:
        _check_trace(f)
    _check_output(Path(output), files)
    infos = probe(files)
    if ranks is not None:
        missing = [str(i.path) for i in infos if i.rank is None]
        if missing:
            raise ValueError(f"--ranks: cannot tell the rank of {', '.join(missing)}")
        infos = [i for i in infos if i.rank in ranks]
        if not infos:
            raise ValueError(f"--ranks: no input has a rank in {sorted(ranks)}")
    infos.sort(key=lambda i: (i.rank if i.rank is not None else 1 << 30, str(i.path)))
    alignment = _align(infos)
    _dedupe_pids(infos)
    snapshots = _SnapshotFilter()
    out_path = Path(output)
    counts = {"packets": 0}
    skipped: dict[str, int] = {}
    # a temporary file beside the output (same file system: the rename is atomic), removed
    # whatever goes wrong, Ctrl-C included
    fd, tmp = _create_temp(out_path)
    try:
        # (the damage warnings held back: where nothing is readable, the error says it all;
        # "the rest is merged" before it said the opposite)
        with os.fdopen(fd, "wb") as out, warnings.catch_warnings(record=True) as damage:
            warnings.simplefilter("always")
            for framed in _merged(infos, snapshots, skipped, counts):
                out.write(framed)
        if counts["packets"] == 0 and skipped:
            raise ValueError(f"nothing readable in {', '.join(str(i.path) for i in infos)}: "
                             f"{_inflate_summary(skipped)}")
        for d in damage:
            warnings.warn(d.message, d.category, stacklevel=2)
        os.replace(tmp, out_path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return MergeResult(out_path, infos, [i.rank for i in infos], alignment, counts["packets"],
                       skipped, snapshots.dropped)


def probe(paths: Iterable[str | os.PathLike[str]]) -> list[InputInfo]:
    """Each file's rank, host, pid and first clock snapshot (read from its start)."""
    return [_probe(Path(p)) for p in paths]


def holds_process(path: str | os.PathLike[str], pid: int, name: str | None) -> bool:
    """Whether a file declares the process ``pid`` named ``name`` in any of its track
    descriptors (all of the file is read: in a merged file, each rank's come after the ranks
    before it). For naming the files that hold a process twice over."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    for pkt in _parsable(iter_all_packets(path), pb):
        for field, wt, s, e, _ in _fields(pkt):
            if wt == 2 and field == w.PKT_TRACK_DESCRIPTOR:
                td = pb.TrackDescriptor.FromString(pkt[s:e])
                if (td.HasField("process") and td.process.pid == pid
                        and (td.process.process_name or None) == name):
                    return True
    return False


def across_hosts(infos: list[InputInfo]) -> bool:
    """Whether the files come from ranks on several hosts: only then does their merge differ
    from reading them one after the other with sequences kept apart and snapshots that go back
    left out (it shifts clocks, and renumbers pids that collide)."""
    return len({i.host for i in infos if i.host is not None}) > 1


def merged_stream(infos: list[InputInfo]) -> Iterator[bytes]:
    """The probed files' merge as it would be written, packet by packet and in the order given
    (for trace processor, which reads several files as one stream: concatenated as they are,
    their sequence ids would collide and each rank's first clock snapshot would go back)."""
    _align(infos)
    _dedupe_pids(infos)
    yield from _merged(infos, _SnapshotFilter(), {}, {"packets": 0})


def _merged(infos: list[InputInfo], snapshots: _SnapshotFilter, skipped: dict[str, int],
            counts: dict[str, int]) -> Iterator[bytes]:
    """Each input's packets rewritten (see the module docstring), framed as ``Trace.packet``;
    a damaged part is left out with a warning and counted in ``skipped``."""

    def ids() -> Iterator[int]:
        n = 1
        while True:
            yield n
            n += 1

    alloc = ids()
    for info in infos:
        rw = _Rewriter(info, alloc, snapshots)
        with open(info.path, "rb") as f:
            for pkt in iter_packets(f, rw.skipped):
                new = rw.rewrite(pkt)
                if new is not None:
                    yield f_bytes(1, new)
        counts["packets"] += rw.packets
        what = _inflate_summary(rw.skipped)
        if what:
            warnings.warn(f"{info.path}: skipped {what}; the rest is merged",
                          _inflate.TraceDamageWarning, stacklevel=3)
        for k, v in rw.skipped.items():
            skipped[k] = skipped.get(k, 0) + v


def _decode_error() -> type[Exception]:
    from google.protobuf.message import DecodeError

    return DecodeError


def _create_temp(out_path: Path) -> tuple[int, str]:
    """A new file beside ``out_path`` with the mode open() would give it (0666 less the
    umask), made without touching the process umask (other threads may create files)."""
    parent = out_path.parent if str(out_path.parent) else Path(".")
    for _ in range(100):
        tmp = os.fspath(parent / f".{out_path.name}.{os.urandom(6).hex()}.tmp")
        try:
            return os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {out_path}")


def _inflate_summary(skipped: dict[str, int]) -> str | None:
    return skipped_summary(skipped)


def _check_trace(path: Path) -> None:
    """Refuse a file that loading would refuse (``packets.check_start``), before anything is
    written: the merge skipped its bytes as damage and wrote the rest, exit 0. Also a gzip file,
    which the merge cannot read (the loader inflates it). Reads the first MiB."""
    try:
        with open(path, "rb") as f:
            head = f.read(_CHUNK + 1)
    except OSError:
        return  # (the merge's read says what is wrong)
    if head[:2] == b"\x1f\x8b":
        raise ValueError(f"{path}: gzip-compressed; merge reads uncompressed traces: gunzip it "
                         "first")
    check_start(head[:_CHUNK], str(path), whole=len(head) <= _CHUNK)


def _check_output(out: Path, inputs: list[Path]) -> None:
    """Refuse an output that is a directory or one of the inputs (read while it is replaced)."""
    if out.is_dir():
        raise ValueError(f"-o {out}: is a directory; name the merged .pftrace file to write")
    if not out.exists():
        return
    for p in inputs:
        with contextlib.suppress(OSError):
            if os.path.samefile(p, out):
                raise ValueError(f"-o {out}: is one of the inputs; name a new file")


def _align(infos: list[InputInfo]) -> str:
    hosts = [i.host for i in infos]
    known = sorted({h for h in hosts if h is not None})
    if len(known) <= 1:
        return f"shared clock (one host: {known[0] if known else 'unknown'})"
    ref = next(i for i in infos if i.snapshot is not None and i.host is not None)
    rs = ref.snapshot or {}
    for i in infos:
        if i.host == ref.host or i.snapshot is None:
            continue
        s = i.snapshot
        if CLOCK_MONOTONIC in s and CLOCK_MONOTONIC in rs:
            i.mono_shift = (rs[CLOCK_MONOTONIC] - rs[CLOCK_REALTIME]) - (
                s[CLOCK_MONOTONIC] - s[CLOCK_REALTIME])
        if CLOCK_BOOTTIME in s and CLOCK_BOOTTIME in rs:
            i.boot_shift = (rs[CLOCK_BOOTTIME] - rs[CLOCK_REALTIME]) - (
                s[CLOCK_BOOTTIME] - s[CLOCK_REALTIME])
    return (
        f"wall clock (REALTIME) across hosts {', '.join(known)}: "
        f"MONOTONIC/BOOTTIME of other hosts shifted onto {ref.host}'s"
    )


def _dedupe_pids(infos: list[InputInfo]) -> None:
    """Renumber a pid only when two different processes share it (ranks on different hosts):
    files of one process (a rank's several detail windows) keep its pid."""
    owner: dict[int, tuple] = {}  # pid -> (host, rank) of the process that has it
    taken: dict[tuple, int] = {}  # (host, rank, pid) -> pid used in the output
    for i in infos:
        if i.pid is None:
            continue
        proc = (i.host, i.rank, i.pid)
        if proc in taken:
            new = taken[proc]
        elif owner.get(i.pid, proc[:2]) == proc[:2]:
            new = i.pid
        else:
            new = i.pid
            while new in owner:
                new += 1 << 22  # above Linux's pid_max default
        owner.setdefault(new, proc[:2])
        taken[proc] = new
        if new != i.pid:
            i.pid_map[i.pid] = new
