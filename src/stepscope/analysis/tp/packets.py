"""Packets of a trace file, decoded in bulk: per packet and per TrackEvent numpy columns.

``compressed_packets`` batches (field 50, zlib) are inflated and their packets put in place of
the batch. Packets that are a timestamp plus a body repeated byte for byte (the common case: same
sequence, flags and event kind) are decoded once per distinct body and copied.
"""

from __future__ import annotations

import os
import stat
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ... import _inflate
from ...format import wire as w
from .. import _arrays as ar
from .._errors import TraceError
from .._threads import map_ordered
from . import loops
from . import protoscan as ps

Progress = Callable[[str, float], None]  # (stage, fraction done)

# field numbers: the writer's own (stepscope._wire, checked against the official schema)
P_CLOCK_SNAPSHOT, P_TIMESTAMP, P_SEQ_ID = w.PKT_CLOCK_SNAPSHOT, w.PKT_TIMESTAMP, w.PKT_SEQUENCE_ID
P_TRACK_EVENT, P_INTERNED, P_FLAGS = w.PKT_TRACK_EVENT, w.PKT_INTERNED_DATA, w.PKT_SEQUENCE_FLAGS
P_STATE_CLEARED, P_COMPRESSED = w.PKT_INCREMENTAL_STATE_CLEARED, w.PKT_COMPRESSED_PACKETS
P_CLOCK_ID, P_DEFAULTS = w.DEF_TIMESTAMP_CLOCK_ID, w.PKT_DEFAULTS
P_DESCRIPTOR = w.PKT_TRACK_DESCRIPTOR
# fields that carry no data of their own for the tables (markers, bookkeeping)
_BENIGN = {36, w.PKT_PREVIOUS_PACKET_DROPPED, w.PKT_FIRST_ON_SEQUENCE, P_STATE_CLEARED, P_FLAGS,
           P_SEQ_ID, P_TIMESTAMP, P_CLOCK_ID}
_HANDLED = {P_CLOCK_SNAPSHOT, P_TRACK_EVENT, P_INTERNED, P_DEFAULTS, P_DESCRIPTOR, P_COMPRESSED}

# TrackEvent fields
TE_CAT_IIDS, TE_ANNOT, TE_TYPE = w.TE_CATEGORY_IIDS, w.TE_DEBUG_ANNOTATIONS, w.TE_TYPE
TE_NAME_IID, TE_TRACK, TE_CATS, TE_NAME = w.TE_NAME_IID, w.TE_TRACK_UUID, w.TE_CATEGORIES, w.TE_NAME
TE_COUNTER, TE_SRCLOC = w.TE_COUNTER_VALUE, w.TE_SOURCE_LOCATION
TE_SRCLOC_IID = w.TE_SOURCE_LOCATION_IID
TE_FLOW_OLD, TE_TFLOW_OLD = w.TE_FLOW_IDS_OLD, w.TE_TERMINATING_FLOW_IDS_OLD
TE_DCOUNTER, TE_FLOW = w.TE_DOUBLE_COUNTER_VALUE, w.TE_FLOW_IDS
TE_TFLOW = w.TE_TERMINATING_FLOW_IDS
T_BEGIN, T_END = w.TYPE_SLICE_BEGIN, w.TYPE_SLICE_END
T_INSTANT, T_COUNTER = w.TYPE_INSTANT, w.TYPE_COUNTER
_CHUNK = 1 << 19  # packets scanned per numpy pass (bounds temporary memory)
_PIECE = 8 << 20  # bytes of inflated batches split into packets at a time


def as_i64(u: np.ndarray) -> np.ndarray:
    return u.astype(np.uint64, copy=False).view(np.int64)


# --------------------------------------------------------------------------------------------


NONREGULAR_MAX = 1 << 30  # bytes read from a pipe or device (a regular file: its size)


def refuse_empty(paths: list[str]) -> None:
    """Every file given is empty (0 bytes): an error, before any engine or merge reads them
    (each read them as a trace with no event: "No events to summarize", a merge of 0 bytes).
    One empty rank file among others is no error: a rank that never flushed."""
    sizes = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            return  # (the read says what is wrong)
        if not stat.S_ISREG(st.st_mode):
            return  # (a pipe: its size says nothing)
        sizes.append(st.st_size)
    if sizes and not any(sizes):
        which = paths[0] if len(paths) == 1 else ", ".join(paths)
        raise TraceError(f"{which}: empty (0 bytes): no trace was written to it (a run that "
                         "ended before its first flush?)")


def read_file(path: str) -> bytes:
    """The bytes of a trace file (gzip inflated), read with a bound: a regular file's size, or
    NONREGULAR_MAX for a pipe or device (``/dev/zero`` never ends)."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            regular = stat.S_ISREG(st.st_mode) and st.st_size > 0  # not /proc's
            limit = st.st_size if regular else NONREGULAR_MAX
            data = f.read(limit) if regular else _read_stream(f, path, limit)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, not a trace file") from None
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror or e})") from None
    if data[:2] == b"\x1f\x8b":  # gzip-compressed trace file
        cap = _inflate.TOTAL_RATIO * len(data) + _inflate.TOTAL_FLOOR
        out, status = _inflate.inflate(data, cap, wbits=31)
        if status == _inflate.OVER:
            raise TraceError(f"{path}: gzip data inflates to more than {cap >> 20} MiB "
                             f"({_inflate.TOTAL_RATIO}x its {len(data)} bytes + "
                             f"{_inflate.TOTAL_FLOOR >> 20} MiB): not a trace, a decompression "
                             "bomb")
        if out is None:
            raise TraceError(f"{path}: corrupt gzip data") from None
        data = out
    return data


def _read_stream(f, path: str, limit: int) -> bytes:
    """A pipe or device, read up to ``limit`` bytes; one that does not start like a trace
    (``/dev/zero``) is refused after its first chunk."""
    out = bytearray()
    while True:
        chunk = f.read(min(16 << 20, limit + 1 - len(out)))
        if not chunk:
            return bytes(out)
        if not out and chunk[0] not in (0x0A, 0x1F):  # Trace.packet, or gzip
            raise TraceError(f"{path}: not a Perfetto protobuf trace (starts with byte "
                             f"0x{chunk[0]:02x}, not a packet)")
        out += chunk
        if len(out) > limit:
            raise TraceError(f"{path}: not a regular file and longer than {limit >> 20} MiB, "
                             "the most stepscope reads from a pipe or device; save it to a "
                             "file first")


@dataclass
class _Packets:
    buf: np.ndarray
    start: np.ndarray
    end: np.ndarray
    file: np.ndarray


def _split_checked(buf: np.ndarray, n: int, name: str, stats: dict) -> tuple:
    """Packets of a file: a truncated last packet is counted, garbage from the start is an
    error, garbage later is counted."""
    st, en, stop = ps.split_repeated(buf, 0, n)
    if stop < n:
        if buf[stop] == 0x0A and _runs_past(buf, stop, n):
            stats["truncated_packets"] = stats.get("truncated_packets", 0) + 1
            _add(stats, "truncated_bytes", n - stop)
        elif len(st) == 0:
            raise TraceError(f"{name}: not a Perfetto protobuf trace (no packet at offset 0)")
        else:
            stats["corrupt_bytes"] = stats.get("corrupt_bytes", 0) + (n - stop)
    return st, en


def check_start(head: bytes, name: str, whole: bool) -> None:
    """Raise TraceError where ``head``, the first bytes of a file (``whole``: all of it), does
    not start a Perfetto protobuf trace by the tests loading applies (``gather_packets``): no
    packet at offset 0, or a file of one packet that does not parse. For ``merge``, which
    streams its inputs and skips what it cannot read: ``/etc/passwd`` beside a rank file was
    "merged" (rank None), where loading it is an error."""
    if not head:
        return
    buf = ps.padded(head)
    st, en = _split_checked(buf, len(head), name, {})
    if whole and len(st) == 1 and len(head) > 1 and ps.scan(buf, st, en).bad[0]:
        raise TraceError(f"{name}: not a Perfetto protobuf trace (first packet is corrupt)")


def _runs_past(buf: np.ndarray, pos: int, n: int) -> bool:
    ln, nl = ps.varints(buf, np.array([pos + 1]))
    return nl[0] < 0 or pos + 1 + int(nl[0]) + int(ln[0]) > n


def _add(stats: dict, key: str, n: int) -> None:
    stats[key] = stats.get(key, 0) + n


def gather_packets(datas: list[tuple[str, bytes]], stats: dict, progress: Progress) -> _Packets:
    """All packets of all files in import order, compressed batches expanded in place.

    The bytes of every file and every inflated batch are copied once, into one growing buffer
    (no joined or padded copies); packets are split where they lie in it.
    """
    out = bytearray()
    starts, ends, files = [], [], []
    # import order of the packets, piece by piece: (first key, last key, key array or its
    # recipe); the keys are only built when the pieces are out of order
    keys: list[tuple[int, int, object]] = []
    top_base = 0  # top-level packet numbers, continued across files
    budget = _inflate.Budget(sum(len(d) for _, d in datas))
    for fidx, (name, data) in enumerate(datas):
        if not data:
            continue
        progress("read", fidx / max(len(datas), 1))
        before = dict(stats)
        buf = ps.padded(data)
        st, en = _split_checked(buf, len(data), name, stats)
        if len(st) == 0:
            continue
        f = ps.scan(buf, st, en)
        del buf
        if f.bad[0] and len(st) == 1 and len(data) > 1:
            raise TraceError(f"{name}: not a Perfetto protobuf trace (first packet is corrupt)")
        if f.bad.any():
            stats["corrupt_packets"] = stats.get("corrupt_packets", 0) + int(f.bad.sum())
        comp = f.select(P_COMPRESSED)
        comp = comp[f.wt[comp] == ps.WT_LEN]
        is_comp = np.zeros(len(st), bool)
        is_comp[f.msg[comp]] = True
        plain = np.flatnonzero(~is_comp & ~f.bad)
        budget.packets -= len(plain)
        base = len(out)
        out.extend(data)
        starts.append(st[plain] + base)
        ends.append(en[plain] + base)
        files.append((fidx, len(plain)))
        if len(plain):
            keys.append((int(plain[0]) + top_base, int(plain[-1]) + top_base, plain + top_base))
        kept = len(plain)  # packets this file gives
        # (top-level packet, inflated length, compressed length)
        inflated: list[tuple[int, int, int]] = []
        p0 = len(out)  # where the batches inflated since the last split begin

        def flush(fidx=fidx, top_base=top_base) -> None:
            """Split the batches inflated so far (a piece at a time: bounded memory)."""
            nonlocal inflated, p0, kept
            ist, ien, stop = _split_at(out, p0, len(out))
            if stop < len(out) or len(ist) > budget.packets:
                # a batch inflated to garbage, or too many packets: batch by batch, keep the
                # good ones while the packet budget lasts
                del ist, ien  # (millions of packets, maybe)
                raws, at, left = [], p0, budget.packets
                for m, ln, cl in inflated:
                    raw = bytes(out[at : at + ln])
                    at += ln
                    st_, _, stop_ = ps.split_repeated(ps.padded(raw), 0, ln)
                    n_ = len(st_)
                    del st_
                    if stop_ < ln:
                        _add(stats, "corrupt_compressed_batches", 1)
                        _add(stats, "corrupt_compressed_bytes", cl)
                    elif n_ > left:  # tiny packets by the million: memory, not data
                        _add(stats, "compressed_batches_over_limit", 1)
                        _add(stats, "compressed_bytes_over_limit", cl)
                    else:
                        left -= n_
                        raws.append((m, raw, cl))
                del out[p0:]
                for _, raw, _ in raws:
                    out.extend(raw)
                inflated = [(m, len(raw), cl) for m, raw, cl in raws]
                ist, ien, _ = _split_at(out, p0, len(out))
            if len(ist):
                budget.packets -= len(ist)
                owners = np.array([m for m, _, _ in inflated], np.int64) + top_base
                bounds = p0 + np.cumsum([0] + [ln for _, ln, _ in inflated])
                keys.append((int(owners[0]), int(owners[-1]), (owners, bounds, ist)))
            starts.append(ist)
            ends.append(ien)
            files.append((fidx, len(ist)))
            kept += len(ist)
            inflated, p0 = [], len(out)

        batches = list(zip(f.msg[comp].tolist(), f.off[comp].tolist(), f.ln[comp].tolist(),
                           strict=True))

        def inflate(b, data=data):
            return _inflate.inflate(memoryview(data)[b[1] : b[1] + b[2]],
                                    budget.batch_limit(b[2]), first=0x0A)

        # inflated on a few threads (zlib lets go of the GIL), handed over in order
        raws = map_ordered(inflate, batches)
        for k, ((m, _, cl), (raw, status)) in enumerate(zip(batches, raws, strict=True)):
            if k % 64 == 0:
                progress("inflate", k / max(len(comp), 1))
            if raw is not None and len(raw) > budget.bytes:  # others took the budget meanwhile
                raw, status = None, _inflate.OVER
            if raw is None:
                if status == _inflate.OVER:
                    _add(stats, "compressed_batches_over_limit", 1)
                    _add(stats, "compressed_bytes_over_limit", cl)
                else:
                    _add(stats, "corrupt_compressed_batches", 1)
                    _add(stats, "corrupt_compressed_bytes", cl)
                continue
            budget.bytes -= len(raw)
            out.extend(raw)
            inflated.append((int(m), len(raw), cl))
            del raw
            if len(out) - p0 >= _PIECE:
                flush()
        if inflated:
            flush()
        if kept == 0 and len(comp):  # every batch damaged or over the limits
            mine = {k: v - before.get(k, 0) for k, v in stats.items()}
            raise TraceError(f"{name}: nothing readable: {skipped_summary(mine)}")
        top_base += len(st)
    if not starts:
        z = np.zeros(0, np.int64)
        return _Packets(ps.padded(b""), z, z, z)
    out += bytes(ps.PAD)
    buf = np.frombuffer(out, np.uint8)  # the bytearray's own memory (no copy)
    start, end = np.concatenate(starts), np.concatenate(ends)
    file = np.repeat(np.array([i for i, _ in files], np.int32), [n for _, n in files])
    # packets of a compressed batch take its place; within a batch they keep their order
    if all(a[1] <= b[0] for a, b in zip(keys, keys[1:], strict=False)):
        return _Packets(buf, start, end, file)  # already in place (all batches, or none)
    key = np.concatenate([k if isinstance(k, np.ndarray) else
                          k[0][np.searchsorted(k[1], k[2], side="right") - 1]
                          for _, _, k in keys])
    order = np.argsort(key, kind="stable")
    return _Packets(buf, start[order], end[order], file[order])


def skipped_summary(stats: dict) -> str | None:
    """What the reader skipped, in words (None: nothing): damaged and over-limit compressed
    batches with their bytes, a last packet the file ends inside, and damaged bytes outside
    batches."""
    parts = []
    n, b = stats.get("corrupt_compressed_batches", 0), stats.get("corrupt_compressed_bytes", 0)
    if n:
        parts.append(f"{n} damaged compressed batch{'es' if n > 1 else ''} ({b} bytes)")
    n, b = (stats.get("compressed_batches_over_limit", 0),
            stats.get("compressed_bytes_over_limit", 0))
    if n:
        parts.append(f"{n} compressed batch{'es' if n > 1 else ''} ({b} bytes) over the "
                     "inflation limits (a decompression bomb?)")
    n = stats.get("truncated_packets", 0)
    if n:  # a writer killed mid-write: its last batch is lost, so say so
        parts.append(f"{n} cut-short last packet{'s' if n > 1 else ''} "
                     f"({stats.get('truncated_bytes', 0)} bytes: the file ends inside it)")
    if stats.get("corrupt_bytes"):
        parts.append(f"{stats['corrupt_bytes']} bytes of damaged packets")
    n = stats.get("corrupt_packets", 0)
    if n:
        parts.append(f"{n} damaged packet{'s' if n > 1 else ''}")
    return "; ".join(parts) or None


def _split_at(out: bytearray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, int]:
    """ps.split_repeated over ``out[lo:hi]`` (the packets of inflated batches), on ``out``
    itself with PAD zero bytes appended for the reads and taken off again."""
    out += bytes(ps.PAD)
    view = np.frombuffer(out, np.uint8)
    try:
        return ps.split_repeated(view, lo, hi)
    finally:
        del view  # no view left on `out`: it may grow again
        del out[hi:]


# --------------------------------------------------------------------------------------------
# Scanning packets and track events
# --------------------------------------------------------------------------------------------


def last_of(f: ps.Fields, fid: int, n: int, default=0, dtype=np.uint64) -> tuple:
    """Per message: the last value of field ``fid`` and whether it is present."""
    rows = f.select(fid)
    out = np.full(n, default, dtype)
    has = np.zeros(n, bool)
    out[f.msg[rows]] = f.val[rows].astype(dtype) if dtype != np.uint64 else f.val[rows]
    has[f.msg[rows]] = True
    return out, has


def last_len_of(f: ps.Fields, fid: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rows = f.select(fid)
    rows = rows[f.wt[rows] == ps.WT_LEN]
    off = np.full(n, -1, np.int64)
    ln = np.zeros(n, np.int64)
    off[f.msg[rows]] = f.off[rows]
    ln[f.msg[rows]] = f.ln[rows]
    return off, ln


def _repeated_varints(buf, f: ps.Fields, fid: int, base: int) -> tuple[np.ndarray, np.ndarray]:
    """(message, value) pairs of a repeated varint field, packed or not."""
    rows = f.select(fid)
    plain = rows[f.wt[rows] == ps.WT_VARINT]
    msgs, vals = [f.msg[plain] + base], [f.val[plain]]
    for r in rows[f.wt[rows] == ps.WT_LEN]:  # packed encoding (rare)
        p, e = int(f.off[r]), int(f.off[r] + f.ln[r])
        while p < e:
            v, n = ps.varints(buf, np.array([p]))
            if n[0] <= 0:
                break
            msgs.append(np.array([f.msg[r] + base]))
            vals.append(v)
            p += int(n[0])
    return np.concatenate(msgs), np.concatenate(vals)


def _repeated_fixed64(buf, f: ps.Fields, fid: int, base: int) -> tuple[np.ndarray, np.ndarray]:
    rows = f.select(fid)
    plain = rows[f.wt[rows] == ps.WT_I64]
    msgs, vals = [f.msg[plain] + base], [f.val[plain]]
    for r in rows[f.wt[rows] == ps.WT_LEN]:
        k = int(f.ln[r]) // 8
        if k:
            msgs.append(np.full(k, f.msg[r] + base))
            vals.append(ps.fixed64(buf, f.off[r] + 8 * np.arange(k)))
    return np.concatenate(msgs), np.concatenate(vals)


class Acc:
    """Column lists appended chunk by chunk, concatenated at the end."""

    def __init__(self) -> None:
        self.cols: dict[str, list[np.ndarray]] = defaultdict(list)

    def add(self, **cols: np.ndarray) -> None:
        for k, v in cols.items():
            self.cols[k].append(v)

    def get(self, k: str, dtype=np.int64) -> np.ndarray:
        parts = self.cols.get(k)
        if not parts:
            return np.zeros(0, dtype)
        if len(parts) > 1:  # concatenate once, and free the chunks
            parts[:] = [np.concatenate(parts)]
        return parts[0]

    def pop(self, k: str, dtype=np.int64) -> np.ndarray:
        out = self.get(k, dtype)
        self.cols.pop(k, None)
        return out


# event columns with one row per track event, and the multi-row arrays that point at them
_EV_COLS = ("typ", "name_iid")
# sparse per-event values (most events have none): (event row, value) arrays
_MULTI = {"cat": ("cat_ev", "cat_iid"), "catl": ("catl_ev", "catl_off", "catl_len"),
          "flow": ("flow_ev", "flow_id", "flow_term"), "ann": ("ann_ev", "ann_off", "ann_len"),
          "sl": ("sl_ev", "sl_off", "sl_len"), "nm": ("nm_ev", "nm_off", "nm_len"),
          "tr": ("tr_ev", "tr_uuid"), "cv": ("cv_ev", "cv_val"), "sli": ("sli_ev", "sli_iid")}
# packets whose body after the timestamp is at most this long are deduplicated; the reads are
# fixed-width, so protoscan.PAD must exceed it
_TPL_MAX = 24
_MASKS = np.array([(1 << (8 * k)) - 1 for k in range(9)], np.uint64)  # low k bytes of a word


def _factorize(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first index of each distinct value, the distinct value of each), distinct values
    numbered by first appearance; as ``np.unique(return_index, return_inverse)`` but without
    sorting everything: the distinct values (packet bodies) are few, so they are found in a
    sample and looked up."""
    n = len(h)
    u = np.unique(h[:: max(1, n // 4096)])
    pos = np.minimum(np.searchsorted(u, h), len(u) - 1)
    miss = u[pos] != h
    if miss.any():
        u = np.unique(np.r_[u, h[miss]])
        pos = np.searchsorted(u, h)
    rep = np.full(len(u), n, np.int64)
    np.minimum.at(rep, pos, np.arange(n))
    first = np.argsort(rep)  # renumbered by first appearance
    renum = np.empty(len(rep), np.int64)
    renum[first] = np.arange(len(rep))
    return rep[first], renum[pos]


def _scan_set(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> dict:
    """Decode the packets ``buf[starts[i]:ends[i]]``: packet columns, event columns, rare rows.

    Event rows carry ``pkt`` = index of their packet in this set; multi-row arrays point at
    event rows through ``*_ev``.
    """
    m = len(starts)
    f = ps.scan(buf, starts, ends)
    ts, has_ts = last_of(f, P_TIMESTAMP, m)
    seq, _ = last_of(f, P_SEQ_ID, m)
    flags, _ = last_of(f, P_FLAGS, m)
    cleared, _ = last_of(f, P_STATE_CLEARED, m)
    clk, _ = last_of(f, P_CLOCK_ID, m)
    te_off, te_len = last_len_of(f, P_TRACK_EVENT, m)
    out: dict = {
        "ts": as_i64(ts), "has_ts": has_ts, "seq": seq.astype(np.int64),
        "flags": flags.astype(np.int64) | np.where(cleared != 0, 1, 0),
        "clk": clk.astype(np.int64), "bad": f.bad,
    }
    sel = np.flatnonzero(np.isin(f.fid, (P_CLOCK_SNAPSHOT, P_INTERNED, P_DEFAULTS, P_DESCRIPTOR))
                         & (f.wt == ps.WT_LEN))
    out["rare"] = (f.msg[sel], f.fid[sel], f.off[sel], f.ln[sel])
    # packets holding nothing we read: their first unknown field
    known = np.zeros(m, bool)
    known[f.msg[np.isin(f.fid, list(_HANDLED))]] = True
    unknown = np.zeros(m, np.int64)
    rows = np.flatnonzero(~np.isin(f.fid, list(_HANDLED | _BENIGN)))
    rows = rows[~known[f.msg[rows]]][::-1]  # reversed: the first occurrence is written last
    unknown[f.msg[rows]] = f.fid[rows]
    out["unknown"] = unknown
    ev = np.flatnonzero(te_off >= 0)
    k = len(ev)
    g = ps.scan(buf, te_off[ev], te_off[ev] + te_len[ev])
    typ, _ = last_of(g, TE_TYPE, k, dtype=np.int8)
    name_iid, _ = last_of(g, TE_NAME_IID, k, dtype=np.int32)
    out.update(pkt=ev, typ=typ, name_iid=name_iid)

    def sparse(fid: int, wt: int) -> np.ndarray:
        rows = g.select(fid)
        return rows[g.wt[rows] == wt]

    r = sparse(TE_NAME, ps.WT_LEN)
    out.update(nm_ev=g.msg[r], nm_off=g.off[r], nm_len=g.ln[r])
    r = sparse(TE_TRACK, ps.WT_VARINT)
    out.update(tr_ev=g.msg[r], tr_uuid=as_i64(g.val[r]))
    ri, rd = sparse(TE_COUNTER, ps.WT_VARINT), sparse(TE_DCOUNTER, ps.WT_I64)
    out.update(cv_ev=np.r_[g.msg[ri], g.msg[rd]],
               cv_val=np.r_[as_i64(g.val[ri]).astype(np.float64), g.val[rd].view(np.float64)])
    r = sparse(TE_SRCLOC_IID, ps.WT_VARINT)
    out.update(sli_ev=g.msg[r], sli_iid=g.val[r].astype(np.int64))
    cm, cv = _repeated_varints(buf, g, TE_CAT_IIDS, 0)
    out.update(cat_ev=cm, cat_iid=cv.astype(np.int64))
    rows = g.select(TE_CATS)
    out.update(catl_ev=g.msg[rows], catl_off=g.off[rows], catl_len=g.ln[rows])
    fl = [_repeated_fixed64(buf, g, TE_FLOW, 0) + (0,), _repeated_fixed64(buf, g, TE_TFLOW, 0)
          + (1,), _repeated_varints(buf, g, TE_FLOW_OLD, 0) + (0,),
          _repeated_varints(buf, g, TE_TFLOW_OLD, 0) + (1,)]
    out.update(flow_ev=np.concatenate([a for a, _, _ in fl]),
               flow_id=np.concatenate([b for _, b, _ in fl]).astype(np.uint64),
               flow_term=np.concatenate([np.full(len(a), t) for a, _, t in fl]))
    for fid, name in ((TE_ANNOT, "ann"), (TE_SRCLOC, "sl")):
        rows = g.select(fid)
        rows = rows[g.wt[rows] == ps.WT_LEN]
        out.update({f"{name}_ev": g.msg[rows], f"{name}_off": g.off[rows],
                    f"{name}_len": g.ln[rows]})
    return out


def _expand(t: dict, inv: np.ndarray, ts: np.ndarray) -> dict:
    """Results for packets that are copies of template packets ``inv`` (+ their timestamps)."""
    out = {k: t[k][inv] for k in ("seq", "flags", "clk", "bad", "unknown")}
    out["ts"], out["has_ts"] = ts, np.ones(len(inv), bool)
    tev = np.full(len(t["seq"]), -1, np.int64)  # template -> its event row
    tev[t["pkt"]] = np.arange(len(t["pkt"]))
    pev = tev[inv]
    pk = np.flatnonzero(pev >= 0)  # packets with an event; new event rows in packet order
    r = pev[pk]
    out["pkt"] = pk
    for c in _EV_COLS:
        out[c] = t[c][r]
    # multi-row arrays: each template row is copied once per packet using its event
    order = np.argsort(ar.small_key(r), kind="stable")
    cnt = np.bincount(r, minlength=len(t["pkt"]))
    first = np.zeros(len(cnt), np.int64)
    np.cumsum(cnt[:-1], out=first[1:])
    for cols in _MULTI.values():
        ev = t[cols[0]]
        c = cnt[ev]
        rep = np.repeat(np.arange(len(ev)), c)
        k = np.arange(len(rep)) - np.repeat(np.cumsum(c) - c, c)
        out[cols[0]] = order[first[ev[rep]] + k]
        for col in cols[1:]:
            out[col] = t[col][rep]
    out["rare"] = tuple(np.zeros(0, np.int64) for _ in range(4))
    if len(t["rare"][0]):  # rare fields inside repeated bodies: keep every occurrence
        tm = t["rare"][0]
        users = [np.flatnonzero(inv == x) for x in tm.tolist()]
        cnts = np.array([len(u) for u in users], np.int64)
        out["rare"] = (np.concatenate(users), *(np.repeat(a, cnts) for a in t["rare"][1:]))
    return out


def _merge_parts(parts: list[tuple[np.ndarray, dict]], m: int) -> dict:
    """Results for packets ``idx`` of each part, merged into one result in packet order."""
    if len(parts) == 1 and len(parts[0][0]) == m:
        return parts[0][1]
    out: dict = {}
    for k in ("ts", "has_ts", "seq", "flags", "clk", "bad", "unknown"):
        col = np.zeros(m, parts[0][1][k].dtype)
        for idx, r in parts:
            col[idx] = r[k]
        out[k] = col
    pkt = np.concatenate([idx[r["pkt"]] for idx, r in parts])
    order = np.argsort(pkt, kind="stable")
    new_row = np.empty(len(order), np.int64)
    new_row[order] = np.arange(len(order))
    out["pkt"] = pkt[order]
    for c in _EV_COLS:
        out[c] = np.concatenate([r[c] for _, r in parts])[order]
    base = np.cumsum([0] + [len(r["pkt"]) for _, r in parts])
    for cols in _MULTI.values():
        out[cols[0]] = new_row[np.concatenate([r[cols[0]] + b for (_, r), b in
                                               zip(parts, base, strict=False)])]
        for c in cols[1:]:
            out[c] = np.concatenate([r[c] for _, r in parts])
    rare = [np.concatenate([idx[r["rare"][0]] for idx, r in parts])]
    rare += [np.concatenate([r["rare"][i] for _, r in parts]) for i in (1, 2, 3)]
    out["rare"] = tuple(rare)
    return out


def _body_groups(buf: np.ndarray, start: np.ndarray, length: np.ndarray) -> tuple:
    """Groups of equal packet bodies ``buf[start:start + length]`` (1 to _TPL_MAX bytes):
    (first body of each group, group of each body, mask of the bodies equal to their group's
    first or None: all), groups numbered by first appearance.

    The C loop compares the bytes; numpy hashes the bodies (zero-padded 8-byte words) and drops
    the rare body whose hash collides with a different one (it is then decoded on its own)."""
    if loops.native is not None:
        inv = np.empty(len(start), np.int64)
        rep = np.frombuffer(loops.native.groups(buf, start.astype(np.int64, copy=False),
                                          length.astype(np.int64, copy=False), inv), np.int64)
        return rep, inv, None
    w = _TPL_MAX
    win = np.lib.stride_tricks.sliding_window_view(buf, w)
    rows = win[start]  # (n, w) copy without an (n, w) index matrix
    words = rows.view(np.uint64).reshape(len(start), w // 8)
    if np.little_endian:  # zero the bytes past each body, a word at a time
        for j in range(w // 8):
            words[:, j] &= _MASKS[np.clip(length - 8 * j, 0, 8)]
    else:
        rows *= (np.arange(w, dtype=np.uint8)[None, :] < length[:, None])
    h = ar.mix64(length.astype(np.uint64))
    for j in range(w // 8):
        h = ar.mix64(h ^ words[:, j])
    rep, inv = _factorize(h)
    r = rep[inv]
    same = length == length[r]  # bodies equal to their group's first (hashes may collide)
    for j in range(w // 8):
        same &= words[:, j] == words[r, j]
    return rep, inv, same


def _scan_chunk(pk: _Packets, c0: int, c1: int) -> dict:
    """_scan_set's result for packets c0..c1-1, bodies repeated byte for byte decoded once."""
    buf = pk.buf
    st, en = pk.start[c0:c1], pk.end[c0:c1]
    # fast path: leading timestamp varint, short body
    lead = (buf[st] == 0x40) & (en > st + 1)  # TracePacket.timestamp tag
    tsv, tsl = ps.varints(buf, st + 1)
    bstart = st + 1 + np.maximum(tsl, 1)
    blen = en - bstart
    fast = lead & (tsl > 0) & (blen > 0) & (blen <= _TPL_MAX)
    fi = np.flatnonzero(fast)
    parts = []
    if len(fi):
        rep, inv, same = _body_groups(buf, bstart[fi], blen[fi])
        tpl = _scan_set(buf, bstart[fi][rep], en[fi][rep])
        if same is not None and not same.all():  # the others are decoded on their own
            fi, inv = fi[same], inv[same]
            fast[:] = False
            fast[fi] = True
        parts.append((fi, _expand(tpl, inv, as_i64(tsv[fi]))))
    slow = np.flatnonzero(~fast)
    if len(slow):
        parts.append((slow, _scan_set(buf, st[slow], en[slow])))
    return _merge_parts(parts, c1 - c0)


def scan_packets(pk: _Packets, stats: dict, progress: Progress):
    """Per packet and per track event columns, plus the rare packets to decode one by one.

    Most packets are ``timestamp`` + a body repeated byte for byte (same sequence, flags and
    event kind); those bodies are decoded once per distinct body and copied.
    """
    n = len(pk.start)
    P, E = Acc(), Acc()
    rare: list[tuple[int, int, int, int]] = []
    unknown = np.zeros(0, np.int64)
    nev = 0
    chunks = [(c0, min(n, c0 + _CHUNK)) for c0 in range(0, n, _CHUNK)]
    # chunks are scanned on a few threads (numpy lets go of the GIL in its big passes) and
    # gathered here in file order
    for (c0, c1), res in zip(chunks, map_ordered(lambda c: _scan_chunk(pk, *c), chunks),
                             strict=True):
        progress("decode", c0 / max(n, 1))
        gpk = np.arange(c0, c1)
        seqk = res["seq"] | (pk.file[c0:c1].astype(np.int64) << 32)
        P.add(ts=res["ts"], has_ts=res["has_ts"], seq=seqk, flags=res["flags"].astype(np.int8),
              clk=res["clk"].astype(np.int32), bad=res["bad"])
        unknown = np.r_[unknown, res["unknown"][res["unknown"] > 0]]
        rm, rf, ro, rl = res["rare"]
        rare.extend(zip(gpk[rm].tolist(), rf.tolist(), ro.tolist(), rl.tolist(), strict=True))
        E.add(pkt=gpk[res["pkt"]], **{c: res[c] for c in _EV_COLS})
        for cols in _MULTI.values():
            E.add(**{cols[0]: res[cols[0]] + nev}, **{c: res[c] for c in cols[1:]})
        nev += len(res["pkt"])
    progress("decode", 1.0)
    if len(unknown):
        stats["unknown_packets"] = int(len(unknown))
        for fid, c in zip(*np.unique(unknown, return_counts=True), strict=True):
            stats[f"unknown_packet_field_{int(fid)}"] = int(c)
    return P, E, rare


# --------------------------------------------------------------------------------------------
