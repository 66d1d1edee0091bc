"""Decode Perfetto traces into trace processor's tables, as numpy columns.

The decoder follows trace processor's import semantics (``proto_trace_reader.cc``,
``track_event_tokenizer/parser``, ``clock_tracker``) for the TrackEvent subset of the format:

* Packets are read in file order; ``compressed_packets`` (field 50, zlib) are expanded in place.
* Per sequence, ``SEQ_INCREMENTAL_STATE_CLEARED`` starts a new generation of interned data and
  ``TracePacketDefaults``; packets that need incremental state before the first clear are skipped.
* A packet's timestamp is in ``timestamp_clock_id`` (or the defaults' clock, or the trace clock).
  Sequence-scoped clocks (64..127) declared ``is_incremental`` accumulate deltas from the value a
  ``ClockSnapshot`` on that sequence gave them; ``unit_multiplier_ns`` scales them. Timestamps are
  then converted to the trace clock (BOOTTIME unless ``primary_trace_clock`` says otherwise) hop by
  hop along the clock graph the snapshots build, each hop using the snapshot with the largest
  source value <= the timestamp (the first snapshot for earlier timestamps).
* Events are sorted by timestamp (stable: file order breaks ties) before slices are built, so
  depth / parent_id come from nesting on each track and slice ids follow time order.

Everything that scales with the number of events is done with numpy on whole arrays; Python
loops only over rare things (descriptors, interned strings, snapshots, flows, nested args).
"""

from __future__ import annotations

import gzip
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import _protoscan as ps
from ._errors import TraceError

Progress = Callable[[str, float], None]

# TracePacket fields
P_CLOCK_SNAPSHOT, P_TIMESTAMP, P_SEQ_ID, P_TRACK_EVENT, P_INTERNED = 6, 8, 10, 11, 12
P_FLAGS, P_STATE_CLEARED, P_COMPRESSED, P_CLOCK_ID = 13, 41, 50, 58
P_DEFAULTS, P_DESCRIPTOR = 59, 60
# fields that carry no data of their own for the tables (markers, bookkeeping)
_BENIGN = {36, 42, 87, 41, 13, 10, 8, 58}
_HANDLED = {P_CLOCK_SNAPSHOT, P_TRACK_EVENT, P_INTERNED, P_DEFAULTS, P_DESCRIPTOR, P_COMPRESSED}

# TrackEvent fields
TE_CAT_IIDS, TE_ANNOT, TE_TYPE, TE_NAME_IID, TE_TRACK, TE_CATS, TE_NAME = 3, 4, 9, 10, 11, 22, 23
TE_COUNTER, TE_SRCLOC, TE_SRCLOC_IID, TE_FLOW_OLD, TE_TFLOW_OLD = 30, 33, 34, 36, 42
TE_DCOUNTER, TE_FLOW, TE_TFLOW = 44, 47, 48
T_BEGIN, T_END, T_INSTANT, T_COUNTER = 1, 2, 3, 4

BOOTTIME = 6
_CHUNK = 1 << 19  # packets scanned per numpy pass (bounds temporary memory)
_I64 = np.int64
_NONE = -1


def _as_i64(u: np.ndarray) -> np.ndarray:
    return u.astype(np.uint64, copy=False).view(np.int64)


class Strings:
    """Interned strings: id <-> str; id -1 means NULL."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.list: list[str] = []

    def id(self, s: str | None) -> int:
        if s is None:
            return _NONE
        i = self.ids.get(s)
        if i is None:
            i = self.ids[s] = len(self.list)
            self.list.append(s)
        return i


@dataclass
class Track:
    id: int
    uuid: int
    name: str | None = None
    parent_uuid: int | None = None
    kind: str = "track"  # "process" | "thread" | "counter" | "track"
    pid: int | None = None
    tid: int | None = None
    thread_name: str | None = None
    process_name: str | None = None
    unit: str | None = None
    multiplier: int = 1
    incremental: bool = False


@dataclass
class Tables:
    """The decoded trace: numpy columns for the big tables, small Python lists for the rest."""

    strings: Strings
    slice: dict[str, np.ndarray]
    counter: dict[str, np.ndarray]
    args: dict[str, np.ndarray]  # args columns (string ids), {} when there are none
    flows: list[tuple[int, int]]  # (slice_out, slice_in)
    tracks: list[Track]
    processes: list[tuple[int, int | None, str | None]]  # (upid, pid, name)
    threads: list[tuple[int, int | None, str | None, int | None]]  # (utid, tid, name, upid)
    track_utid: dict[int, int]
    track_upid: dict[int, int]
    stats: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# Reading packets
# --------------------------------------------------------------------------------------------


def read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, not a trace file") from None
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror or e})") from None
    if data[:2] == b"\x1f\x8b":  # gzip-compressed trace file
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise TraceError(f"{path}: corrupt gzip data ({e})") from None
    return data


@dataclass
class _Packets:
    buf: np.ndarray
    start: np.ndarray
    end: np.ndarray
    file: np.ndarray


def _split_checked(buf: np.ndarray, n: int, name: str, stats: dict, top: bool) -> tuple:
    st, en, stop = ps.split_repeated(buf, 0, n)
    if stop < n:
        truncated = buf[stop] == 0x0A and len(st) >= 0 and _runs_past(buf, stop, n)
        if truncated and top:
            stats["truncated_packets"] = stats.get("truncated_packets", 0) + 1
        elif len(st) == 0:
            raise TraceError(f"{name}: not a Perfetto protobuf trace (no packet at offset 0)")
        else:
            stats["corrupt_bytes"] = stats.get("corrupt_bytes", 0) + (n - stop)
    return st, en


def _runs_past(buf: np.ndarray, pos: int, n: int) -> bool:
    ln, nl = ps.varints(buf, np.array([pos + 1]))
    return nl[0] < 0 or pos + 1 + int(nl[0]) + int(ln[0]) > n


def gather_packets(datas: list[tuple[str, bytes]], stats: dict, progress: Progress) -> _Packets:
    """All packets of all files in import order, compressed batches expanded in place."""
    bufs: list[bytes] = []
    starts, ends, files, keys = [], [], [], []
    base = 0
    for fidx, (name, data) in enumerate(datas):
        if not data:
            continue
        progress("read", fidx / max(len(datas), 1))
        buf = ps.padded(data)
        st, en = _split_checked(buf, len(data), name, stats, top=True)
        if len(st) == 0:
            continue
        f = ps.scan(buf, st, en)
        if f.bad[0] and len(st) == 1 and len(data) > 1:
            raise TraceError(f"{name}: not a Perfetto protobuf trace (first packet is corrupt)")
        if f.bad.any():
            stats["corrupt_packets"] = stats.get("corrupt_packets", 0) + int(f.bad.sum())
        comp = f.select(P_COMPRESSED)
        comp = comp[f.wt[comp] == ps.WT_LEN]
        is_comp = np.zeros(len(st), bool)
        is_comp[f.msg[comp]] = True
        plain = np.flatnonzero(~is_comp & ~f.bad)
        bufs.append(data)
        starts.append(st[plain] + base)
        ends.append(en[plain] + base)
        files.append(np.full(len(plain), fidx))
        keys.append(np.stack([plain, np.full(len(plain), -1)], 1))
        base += len(data)
        inflated = []
        owner = []
        for k, (m, off, ln) in enumerate(zip(f.msg[comp], f.off[comp], f.ln[comp], strict=True)):
            if k % 64 == 0:
                progress("inflate", k / max(len(comp), 1))
            try:
                raw = zlib.decompress(data[off : off + ln])
            except zlib.error:
                stats["corrupt_compressed_batches"] = stats.get("corrupt_compressed_batches", 0) + 1
                continue
            inflated.append(raw)
            owner.append((int(m), len(raw)))
        if inflated:
            blob = b"".join(inflated)
            ibuf = ps.padded(blob)
            ist, ien = _split_checked(ibuf, len(blob), name, stats, top=False)
            bounds = np.cumsum([0] + [n for _, n in owner])
            batch = np.searchsorted(bounds, ist, side="right") - 1
            top_idx = np.array([m for m, _ in owner])[batch]
            bufs.append(blob)
            starts.append(ist + base)
            ends.append(ien + base)
            files.append(np.full(len(ist), fidx))
            keys.append(np.stack([top_idx, np.arange(len(ist))], 1))
            base += len(blob)
    if not bufs:
        z = np.zeros(0, np.int64)
        return _Packets(ps.padded(b""), z, z, z)
    buf = ps.padded(b"".join(bufs))
    bufs.clear()
    start, end = np.concatenate(starts), np.concatenate(ends)
    file = np.concatenate(files)
    key = np.concatenate(keys)
    order = np.lexsort((key[:, 1], key[:, 0], file))
    return _Packets(buf, start[order], end[order], file[order])


# --------------------------------------------------------------------------------------------
# Scanning packets and track events
# --------------------------------------------------------------------------------------------


def _last(f: ps.Fields, fid: int, n: int, default=0, dtype=np.uint64) -> tuple:
    """Per message: the last value of field ``fid`` and whether it is present."""
    rows = f.select(fid)
    out = np.full(n, default, dtype)
    has = np.zeros(n, bool)
    out[f.msg[rows]] = f.val[rows].astype(dtype) if dtype != np.uint64 else f.val[rows]
    has[f.msg[rows]] = True
    return out, has


def _last_len(f: ps.Fields, fid: int, n: int) -> tuple[np.ndarray, np.ndarray]:
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


class _Acc:
    """Column lists appended chunk by chunk, concatenated at the end."""

    def __init__(self) -> None:
        self.cols: dict[str, list[np.ndarray]] = defaultdict(list)

    def add(self, **cols: np.ndarray) -> None:
        for k, v in cols.items():
            self.cols[k].append(v)

    def get(self, k: str, dtype=np.int64) -> np.ndarray:
        parts = self.cols.get(k)
        return np.concatenate(parts) if parts else np.zeros(0, dtype)


# event columns with one row per track event, and the multi-row arrays that point at them
_EV_COLS = ("typ", "name_iid", "name_off", "name_len", "track", "has_track", "cval", "has_cval",
            "srcloc")
_MULTI = {"cat": ("cat_ev", "cat_iid"), "catl": ("catl_ev", "catl_off", "catl_len"),
          "flow": ("flow_ev", "flow_id", "flow_term"), "ann": ("ann_ev", "ann_off", "ann_len"),
          "sl": ("sl_ev", "sl_off", "sl_len")}
_TPL_MAX = 40  # packets whose body after the timestamp is at most this long are deduplicated


def _scan_set(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> dict:
    """Decode the packets ``buf[starts[i]:ends[i]]``: packet columns, event columns, rare rows.

    Event rows carry ``pkt`` = index of their packet in this set; multi-row arrays point at
    event rows through ``*_ev``.
    """
    m = len(starts)
    f = ps.scan(buf, starts, ends)
    ts, has_ts = _last(f, P_TIMESTAMP, m)
    seq, _ = _last(f, P_SEQ_ID, m)
    flags, _ = _last(f, P_FLAGS, m)
    cleared, _ = _last(f, P_STATE_CLEARED, m)
    clk, _ = _last(f, P_CLOCK_ID, m)
    te_off, te_len = _last_len(f, P_TRACK_EVENT, m)
    out: dict = {
        "ts": _as_i64(ts), "has_ts": has_ts, "seq": seq.astype(np.int64),
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
    typ, _ = _last(g, TE_TYPE, k, dtype=np.int64)
    name_iid, has_name_iid = _last(g, TE_NAME_IID, k, dtype=np.int64)
    name_off, name_len = _last_len(g, TE_NAME, k)
    track, has_track = _last(g, TE_TRACK, k)
    cval, has_cval = _last(g, TE_COUNTER, k)
    dval, has_dval = _last(g, TE_DCOUNTER, k)
    sl_iid, _ = _last(g, TE_SRCLOC_IID, k, dtype=np.int64)
    out.update(
        pkt=ev, typ=typ, name_iid=np.where(has_name_iid, name_iid, 0), name_off=name_off,
        name_len=name_len, track=_as_i64(track), has_track=has_track,
        cval=np.where(has_dval, dval.view(np.float64), _as_i64(cval).astype(np.float64)),
        has_cval=has_cval | has_dval, srcloc=sl_iid)
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
    order = np.argsort(r, kind="stable")
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


def scan_packets(pk: _Packets, stats: dict, progress: Progress):
    """Per packet and per track event columns, plus the rare packets to decode one by one.

    Most packets are ``timestamp`` + a body repeated byte for byte (same sequence, flags and
    event kind); those bodies are decoded once per distinct body and copied.
    """
    buf = pk.buf
    n = len(pk.start)
    P, E = _Acc(), _Acc()
    rare: list[tuple[int, int, int, int]] = []
    unknown = np.zeros(0, np.int64)
    nev = 0
    for c0 in range(0, n, _CHUNK):
        progress("decode", c0 / max(n, 1))
        c1 = min(n, c0 + _CHUNK)
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
            w = _TPL_MAX
            rows = buf[bstart[fi][:, None] + np.arange(w)]
            rows[np.arange(w)[None, :] >= blen[fi][:, None]] = 0
            words = rows.view(np.uint64).reshape(len(fi), w // 8)
            h = _mix(blen[fi].astype(np.uint64))
            for j in range(w // 8):
                h = _mix(h ^ words[:, j])
            _, rep, inv = np.unique(h, return_index=True, return_inverse=True)
            same = (rows == rows[rep[inv]]).all(axis=1) & (blen[fi] == blen[fi][rep[inv]])
            del rows, words
            fi_ok, inv = fi[same], inv[same]
            tpl = _scan_set(buf, bstart[fi][rep], en[fi][rep])
            res = _expand(tpl, inv, _as_i64(tsv[fi_ok]))
            parts.append((fi_ok, res))
            fast[:] = False
            fast[fi_ok] = True
        slow = np.flatnonzero(~fast)
        if len(slow):
            parts.append((slow, _scan_set(buf, st[slow], en[slow])))
        for idx, res in parts:
            gpk = idx + c0  # global packet index of each row of res
            seqk = res["seq"] | (pk.file[gpk].astype(np.int64) << 32)
            P.add(idx=gpk, ts=res["ts"], has_ts=res["has_ts"], seq=seqk, flags=res["flags"],
                  clk=res["clk"], bad=res["bad"])
            unknown = np.r_[unknown, res["unknown"][res["unknown"] > 0]]
            rm, rf, ro, rl = res["rare"]
            rare.extend(zip(gpk[rm].tolist(), rf.tolist(), ro.tolist(), rl.tolist(),
                            strict=True))
            E.add(pkt=gpk[res["pkt"]], **{c: res[c] for c in _EV_COLS})
            for cols in _MULTI.values():
                E.add(**{cols[0]: res[cols[0]] + nev}, **{c: res[c] for c in cols[1:]})
            nev += len(res["pkt"])
    progress("decode", 1.0)
    # packet rows came in two groups per chunk: put them (and their events) in packet order
    idx = P.get("idx")
    if len(idx) and (np.diff(idx) < 0).any():
        order = np.argsort(idx, kind="stable")
        for k in list(P.cols):
            P.cols[k] = [P.get(k, bool if k in ("has_ts", "bad") else np.int64)[order]]
        epkt = E.get("pkt")
        eorder = np.argsort(epkt, kind="stable")
        new_row = np.empty(len(eorder), np.int64)
        new_row[eorder] = np.arange(len(eorder))
        for c in ("pkt", *_EV_COLS):
            if c in E.cols:
                E.cols[c] = [E.get(c)[eorder]]
        for cols in _MULTI.values():
            if cols[0] in E.cols:
                E.cols[cols[0]] = [new_row[E.get(cols[0])]]
    if len(unknown):
        stats["unknown_packets"] = int(len(unknown))
        for fid, c in zip(*np.unique(unknown, return_counts=True), strict=True):
            stats[f"unknown_packet_field_{int(fid)}"] = int(c)
    return P, E, rare


# --------------------------------------------------------------------------------------------
# Sequence state: generations, defaults, interning
# --------------------------------------------------------------------------------------------


def _pb():
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2

    return perfetto_trace_pb2


def _segmented_cumsum(values: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Cumulative sum restarting where ``seg`` (sorted group labels) changes."""
    cs = np.cumsum(values)
    if not len(values):
        return cs
    starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
    before = cs[starts] - values[starts]
    return cs - np.repeat(before, np.diff(np.r_[starts, len(values)]))


def _generations(seq: np.ndarray, flags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per packet: its sequence rank and its generation id (-1 before the first clear)."""
    n = len(seq)
    _, srank = np.unique(seq, return_inverse=True)
    order = np.argsort(srank, kind="stable")
    clear = ((flags & 1) != 0).astype(np.int64)
    gl = np.empty(n, np.int64)
    gl[order] = _segmented_cumsum(clear[order], srank[order])
    key = srank.astype(np.int64) * (n + 1) + gl
    _, gen = np.unique(key, return_inverse=True)
    gen = np.where(gl > 0, gen, -1)
    return srank.astype(np.int64), gen.astype(np.int64)


def _lookup_last(owner_gen: np.ndarray, owner_pkt: np.ndarray, gen: np.ndarray,
                 pkt: np.ndarray, n: int) -> np.ndarray:
    """Index into owners of the last owner in the same generation at or before each packet."""
    if not len(owner_pkt):
        return np.full(len(pkt), -1, np.int64)
    comb = owner_gen * (n + 1) + owner_pkt
    order = np.argsort(comb, kind="stable")
    sc = comb[order]
    q = gen * (n + 1) + pkt
    pos = np.searchsorted(sc, q, side="right") - 1
    ok = (pos >= 0) & (gen >= 0)
    posc = np.maximum(pos, 0)
    ok &= owner_gen[order][posc] == gen
    return np.where(ok, order[posc], -1)


class _Interned:
    """(generation, iid) -> value tables, looked up for whole arrays at once."""

    def __init__(self) -> None:
        self.keys: dict[str, list[int]] = defaultdict(list)
        self.vals: dict[str, list] = defaultdict(list)
        self._sorted: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def add(self, kind: str, gen: int, iid: int, value) -> None:
        self.keys[kind].append((gen << 32) | iid)
        self.vals[kind].append(value)

    def lookup(self, kind: str, gen: np.ndarray, iid: np.ndarray) -> np.ndarray:
        """Index into ``vals[kind]`` for each (gen, iid), -1 where undefined."""
        if kind not in self._sorted:
            k = np.array(self.keys.get(kind, []), np.int64)
            # the last definition of a key wins
            order = np.argsort(k, kind="stable")[::-1]
            uk, first = np.unique(k[order], return_index=True)
            self._sorted[kind] = (uk, order[first])
        uk, idx = self._sorted[kind]
        if not len(uk):
            return np.full(len(iid), -1, np.int64)
        q = (gen.astype(np.int64) << 32) | iid.astype(np.int64)
        pos = np.minimum(np.searchsorted(uk, q), len(uk) - 1)
        ok = (uk[pos] == q) & (gen >= 0) & (iid > 0)
        return np.where(ok, idx[pos], -1)


# --------------------------------------------------------------------------------------------
# Clocks
# --------------------------------------------------------------------------------------------


class _Clocks:
    """Clock snapshots and conversion to the trace clock, as trace processor's ClockTracker."""

    def __init__(self) -> None:
        self.snapshots: list[dict[int, int]] = []
        self.groups: dict[frozenset, list[int]] = {}
        self.incremental: dict[int, bool] = {}
        self.multiplier: dict[int, int] = {}
        self.anchors: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.trace_clock: int | None = None
        self._paths: dict[int, list | None] = {}

    def add(self, pkt: int, clocks: list[tuple[int, int, int, bool]], primary: int) -> None:
        snap = {}
        for ck, ts, mult, incr in clocks:
            ns = ts * mult
            snap[ck] = ns
            self.multiplier[ck] = mult
            self.incremental[ck] = incr
            if incr:
                self.anchors[ck].append((pkt, ns))
        if primary:
            self.trace_clock = primary
        elif BOOTTIME in snap and self.trace_clock is None:
            self.trace_clock = BOOTTIME
        if len(snap) >= 2:
            self.groups.setdefault(frozenset(snap), []).append(len(self.snapshots))
        self.snapshots.append(snap)

    def path(self, src: int) -> list | None:
        """Hops (a, b, snapshot group) from ``src`` to the trace clock, breadth first."""
        if src in self._paths:
            return self._paths[src]
        dst = self.trace_clock
        prev: dict[int, tuple] = {src: None}
        frontier = [src]
        while frontier and dst not in prev:
            nxt = []
            for a in frontier:
                for grp in self.groups:
                    if a not in grp:
                        continue
                    for b in grp:
                        if b not in prev:
                            prev[b] = (a, grp)
                            nxt.append(b)
            frontier = nxt
        if dst not in prev:
            self._paths[src] = None
            return None
        hops = []
        c = dst
        while prev[c] is not None:
            a, grp = prev[c]
            hops.append((a, c, grp))
            c = a
        self._paths[src] = hops[::-1]
        return self._paths[src]

    def convert(self, src: int, ns: np.ndarray) -> np.ndarray | None:
        if self.trace_clock is None or src == self.trace_clock or src == 0:
            return ns
        hops = self.path(src)
        if hops is None:
            return None
        for a, b, grp in hops:
            snaps = [self.snapshots[i] for i in self.groups[grp]]
            av = np.array([s[a] for s in snaps], np.int64)
            bv = np.array([s[b] for s in snaps], np.int64)
            order = np.argsort(av, kind="stable")
            av, bv = av[order], bv[order]
            i = np.maximum(np.searchsorted(av, ns, side="right") - 1, 0)
            ns = ns - av[i] + bv[i]
        return ns


def _clock_key(clock_id: int, srank: int) -> int:
    """Sequence-scoped clocks (64..127) are distinct per sequence."""
    if 64 <= clock_id <= 127:
        return ((srank + 1) << 8) | clock_id
    return clock_id


# --------------------------------------------------------------------------------------------
# The decoder
# --------------------------------------------------------------------------------------------

_UNITS = {1: "ns", 2: "count", 3: "bytes"}


def _text(buf: np.ndarray, off: int, ln: int) -> str:
    return buf[off : off + ln].tobytes().decode("utf-8", "replace")


class _State:
    """Rare packets decoded in file order: descriptors, defaults, interning, snapshots."""

    def __init__(self, buf, rare, srank, gen, stats):
        pb = _pb()
        self.interned = _Interned()
        self.clocks = _Clocks()
        self.tracks: dict[int, Track] = {}
        self.strings = Strings()
        def_pkt, def_clock, def_track = [], [], []
        self.snapshot_pkts: list[int] = []
        for pkt, fid, off, ln in sorted(rare):
            raw = buf[off : off + ln].tobytes()
            try:
                if fid == P_DESCRIPTOR:
                    self._descriptor(pb.TrackDescriptor.FromString(raw))
                elif fid == P_DEFAULTS:
                    if gen[pkt] < 0:
                        continue
                    d = pb.TracePacketDefaults.FromString(raw)
                    te = d.track_event_defaults
                    def_pkt.append(pkt)
                    def_clock.append(d.timestamp_clock_id)
                    def_track.append(te.track_uuid if te.HasField("track_uuid") else -1)
                elif fid == P_INTERNED:
                    if gen[pkt] < 0:
                        stats["interned_data_skipped"] = stats.get("interned_data_skipped", 0) + 1
                        continue
                    self._interned(int(gen[pkt]), pb.InternedData.FromString(raw))
                elif fid == P_CLOCK_SNAPSHOT:
                    cs = pb.ClockSnapshot.FromString(raw)
                    clocks = [(_clock_key(c.clock_id, int(srank[pkt])), c.timestamp,
                               c.unit_multiplier_ns or 1, c.is_incremental) for c in cs.clocks]
                    self.clocks.add(pkt, clocks, cs.primary_trace_clock)
                    self.snapshot_pkts.append(pkt)
            except Exception:  # a corrupt message: count it, never fail the load
                stats["corrupt_messages"] = stats.get("corrupt_messages", 0) + 1
        self.def_pkt = np.array(def_pkt, np.int64)
        self.def_clock = np.array(def_clock, np.int64)
        self.def_track = np.array([t if t < (1 << 63) else t - (1 << 64) for t in def_track],
                                  np.int64)

    def _descriptor(self, d) -> None:
        uuid = d.uuid if d.uuid < (1 << 63) else d.uuid - (1 << 64)
        t = self.tracks.get(uuid)
        if t is None:
            t = self.tracks[uuid] = Track(id=len(self.tracks), uuid=uuid)
        if d.HasField("name"):
            t.name = d.name
        elif d.HasField("static_name"):
            t.name = d.static_name
        if d.HasField("parent_uuid"):
            p = d.parent_uuid
            t.parent_uuid = p if p < (1 << 63) else p - (1 << 64)
        if d.HasField("thread"):
            t.kind, t.pid, t.tid = "thread", d.thread.pid, d.thread.tid
            if d.thread.HasField("thread_name"):
                t.thread_name = d.thread.thread_name
        elif d.HasField("process"):
            t.kind, t.pid = "process", d.process.pid
            if d.process.HasField("process_name"):
                t.process_name = d.process.process_name
        elif d.HasField("counter"):
            c = d.counter
            t.kind = "counter"
            t.unit = c.unit_name or _UNITS.get(c.unit)
            t.multiplier = c.unit_multiplier or 1
            t.incremental = c.is_incremental

    def _interned(self, g: int, d) -> None:
        s = self.strings
        for e in d.event_names:
            self.interned.add("name", g, e.iid, s.id(e.name))
        for e in d.event_categories:
            self.interned.add("cat", g, e.iid, s.id(e.name))
        for e in d.debug_annotation_names:
            self.interned.add("arg", g, e.iid, s.id(e.name))
        for e in d.debug_annotation_string_values:
            self.interned.add("argstr", g, e.iid, s.id(e.str.decode("utf-8", "replace")))
        for e in d.source_locations:
            self.interned.add("srcloc", g, e.iid, (e.file_name, e.function_name, e.line_number))


def _resolve_timestamps(P: _Acc, st: _State, srank, gen, skip, stats) -> np.ndarray:
    """Trace-clock timestamp of every packet (INT64_MIN where it cannot be resolved)."""
    n = len(skip)
    lo = np.iinfo(np.int64).min
    ts, has_ts, clk = P.get("ts"), P.get("has_ts", bool), P.get("clk")
    d = _lookup_last(gen[st.def_pkt] if len(st.def_pkt) else st.def_pkt, st.def_pkt, gen,
                     np.arange(n), n)
    dclk = np.where(d >= 0, st.def_clock[np.maximum(d, 0)] if len(st.def_clock) else 0, 0)
    clock = np.where(clk != 0, clk, dclk)
    is_snap = np.zeros(n, bool)
    is_snap[st.snapshot_pkts] = True
    elig = has_ts & ~skip & ~is_snap
    seqclk = (clock >= 64) & (clock <= 127)
    ck = np.where(seqclk, ((srank + 1) << 8) | clock, clock)
    out = np.full(n, lo, np.int64)
    ce = ck[elig]
    idx_all = np.flatnonzero(elig)
    order = np.argsort(ce, kind="stable")
    ce_sorted = ce[order]
    bounds = np.flatnonzero(np.r_[True, ce_sorted[1:] != ce_sorted[:-1], True])
    failed = 0
    for b0, b1 in zip(bounds[:-1], bounds[1:], strict=True):
        key = int(ce_sorted[b0])
        idx = idx_all[order[b0:b1]]
        mult = st.clocks.multiplier.get(key, 1)
        raw = ts[idx] * mult
        if st.clocks.incremental.get(key, False):
            anc = st.clocks.anchors[key]
            apkt = np.array([a for a, _ in anc], np.int64)
            aval = np.array([v for _, v in anc], np.int64)
            a = np.searchsorted(apkt, idx, side="right") - 1
            ok = a >= 0
            failed += int((~ok).sum())
            idx, raw, a = idx[ok], raw[ok], a[ok]
            ns = _segmented_cumsum(raw, a) + aval[a]
        elif 64 <= (key & 0xFF) <= 127 and key > 0xFF and key not in st.clocks.multiplier:
            failed += len(idx)  # a sequence clock never declared by a snapshot
            continue
        else:
            ns = raw
        conv = st.clocks.convert(key, ns)
        if conv is None:
            failed += len(idx)
            continue
        out[idx] = conv
    if failed:
        stats["clock_sync_failure"] = failed
    # packets without a timestamp take the latest timestamp seen so far (as trace processor)
    notime = ~has_ts & ~skip
    if notime.any():
        latest = np.maximum.accumulate(out)
        out = np.where(notime, np.where(latest == lo, 0, latest), out)
    return out


def _per_event_single(ev: np.ndarray, val: np.ndarray, n: int, join) -> np.ndarray:
    """Collapse (event, value) rows to one value per event; events with several rows use join."""
    out = np.full(n, _NONE, np.int64)
    if not len(ev):
        return out
    order = np.argsort(ev, kind="stable")
    ev, val = ev[order], val[order]
    first = np.r_[True, ev[1:] != ev[:-1]]
    counts = np.diff(np.r_[np.flatnonzero(first), len(ev)])
    starts = np.flatnonzero(first)
    single = counts == 1
    out[ev[starts[single]]] = val[starts[single]]
    for s, c in zip(starts[~single].tolist(), counts[~single].tolist(), strict=True):
        out[ev[s]] = join(val[s : s + c].tolist())
    return out


def decode(datas: list[tuple[str, bytes]], progress: Progress | None = None) -> Tables:
    """Decode the named trace byte strings into one set of tables."""
    progress = progress or (lambda stage, frac: None)
    stats: dict[str, int] = {}
    pk = gather_packets(datas, stats, progress)
    P, E, rare = scan_packets(pk, stats, progress)
    buf = pk.buf
    n = len(pk.start)
    stats["packets"] = n
    seq, flags, bad = P.get("seq"), P.get("flags"), P.get("bad", bool)
    srank, gen = _generations(seq, flags) if n else (np.zeros(0, _I64), np.zeros(0, _I64))
    skip = bad | (((flags & 2) != 0) & (gen < 0))
    if skip.any():
        stats["packets_skipped_no_incremental_state"] = int((skip & ~bad).sum())
    progress("state", 0.0)
    st = _State(buf, rare, srank, gen, stats)
    strings = st.strings
    pts = _resolve_timestamps(P, st, srank, gen, skip, stats) if n else np.zeros(0, _I64)

    # ---- events: timestamp, track, type -------------------------------------------------
    progress("events", 0.0)
    epkt = E.get("pkt")
    m = len(epkt)
    etyp = E.get("typ")
    ets = pts[epkt] if m else np.zeros(0, _I64)
    egen = gen[epkt] if m else np.zeros(0, _I64)
    etrack = E.get("track")
    has_track = E.get("has_track", bool)
    if len(st.def_pkt) and m:
        d = _lookup_last(gen[st.def_pkt], st.def_pkt, egen, epkt, n)
        dtrack = np.where(d >= 0, st.def_track[np.maximum(d, 0)], -1)
        etrack = np.where(has_track, etrack, dtrack)
        has_track = has_track | (d >= 0) & (dtrack != -1)
    tracks = sorted(st.tracks.values(), key=lambda t: t.id)
    uuids = np.array([t.uuid for t in tracks], np.int64)
    uorder = np.argsort(uuids)
    su = uuids[uorder]
    if len(su):
        pos = np.minimum(np.searchsorted(su, etrack), len(su) - 1)
        known = has_track & (su[pos] == etrack)
        etid = np.where(known, uorder[pos], -1)
    else:
        known = np.zeros(m, bool)
        etid = np.full(m, -1, np.int64)
    valid = ~skip[epkt] & (ets != np.iinfo(np.int64).min) if m else np.zeros(0, bool)
    if (valid & ~known).any():
        stats["track_event_unknown_track"] = int((valid & ~known).sum())
    valid &= known
    is_counter_track = np.array([t.kind == "counter" for t in tracks] + [False])[etid]
    is_slice_ev = valid & np.isin(etyp, (T_BEGIN, T_END, T_INSTANT)) & ~is_counter_track
    is_counter_ev = valid & (etyp == T_COUNTER) & is_counter_track
    wrong = valid & ~is_slice_ev & ~is_counter_ev
    if wrong.any():
        stats["track_event_unsupported"] = int(wrong.sum())

    # ---- names and categories -----------------------------------------------------------
    name_idx = st.interned.lookup("name", egen, E.get("name_iid"))
    name_vals = np.array(st.interned.vals.get("name", []) + [_NONE], np.int64)
    ename = name_vals[name_idx]
    noff, nlen = E.get("name_off"), E.get("name_len")
    for i in np.flatnonzero(noff >= 0).tolist():
        ename[i] = strings.id(_text(buf, int(noff[i]), int(nlen[i])))
    cat_vals = np.array(st.interned.vals.get("cat", []) + [_NONE], np.int64)
    cev = E.get("cat_ev")
    csid = cat_vals[st.interned.lookup("cat", egen[cev], E.get("cat_iid"))] if len(cev) else cev
    keep = csid >= 0
    cev, csid = cev[keep], csid[keep]
    lev = E.get("catl_ev")
    if len(lev):  # literal categories, for events that have no interned ones
        loff, llen = E.get("catl_off"), E.get("catl_len")
        lit = np.array([strings.id(_text(buf, int(o), int(ln)))
                        for o, ln in zip(loff.tolist(), llen.tolist(), strict=True)], np.int64)
        use = ~np.isin(lev, cev)
        cev, csid = np.r_[cev, lev[use]], np.r_[csid, lit[use]]

    def join_cats(ids):
        return strings.id(",".join(strings.list[i] for i in ids))

    ecat = _per_event_single(cev, csid, m, join_cats)

    # ---- global time order ----------------------------------------------------------------
    order = np.lexsort((epkt, ets))
    order = order[is_slice_ev[order] | is_counter_ev[order]]
    tables_slice, ev_slice = _build_slices(order, etyp, ets, etid, ename, ecat, is_slice_ev, stats)
    tables_counter = _build_counters(order, ets, etid, E.get("cval", np.float64),
                                     E.get("has_cval", bool), is_counter_ev, tracks)
    progress("args", 0.0)
    flows = _build_flows(E, ev_slice, order)
    args = _build_args(buf, E, st, egen, ev_slice, tables_slice, stats)
    procs, threads, track_utid, track_upid = _build_processes(tracks)
    progress("events", 1.0)
    return Tables(strings=strings, slice=tables_slice, counter=tables_counter, args=args,
                  flows=flows, tracks=tracks, processes=procs, threads=threads,
                  track_utid=track_utid, track_upid=track_upid, stats=stats)


def _build_slices(order, etyp, ets, etid, ename, ecat, is_slice_ev, stats):
    """Slices from begin/end/instant events: depth and parent from nesting per track.

    Returns the slice columns (in id order) and, per event, the id of its slice (-1: none).
    """
    m = len(etyp)
    ev = order[is_slice_ev[order]]  # slice events in global time order
    k = len(ev)
    ev_slice = np.full(m, -1, np.int64)
    typ = etyp[ev]
    is_open = (typ == T_BEGIN) | (typ == T_INSTANT)
    sid = np.cumsum(is_open) - 1  # slice id of begin/instant events (time order)
    ev_slice[ev[is_open]] = sid[is_open]
    # per track, in time order
    trk = etid[ev]
    o = np.argsort(trk, kind="stable")
    t_o = trk[o]
    delta = np.where(typ == T_BEGIN, 1, np.where(typ == T_END, -1, 0))[o].astype(np.int64)
    raw = _segmented_cumsum(delta, t_o)
    # ends with nothing open are ignored (as trace processor): running minimum per track
    seg_no = np.cumsum(np.r_[True, t_o[1:] != t_o[:-1]]) - 1 if k else np.zeros(0, np.int64)
    big = np.int64(1 << 40)
    runmin = np.minimum.accumulate(np.minimum(raw, 0) - seg_no * big) + seg_no * big
    runmin = np.minimum(runmin, 0)
    prev_min = np.r_[0, runmin[:-1]]
    prev_min[np.r_[True, t_o[1:] != t_o[:-1]] if k else []] = 0
    eff = raw - runmin  # open slices after each event
    typ_o = typ[o]
    unmatched_end = (typ_o == T_END) & (runmin < prev_min)
    if unmatched_end.any():
        stats["slice_end_without_begin"] = int(unmatched_end.sum())
    depth_o = np.where(typ_o == T_BEGIN, eff - 1, eff)  # begin/instant: depth; end: its level
    pos_o = np.arange(k)
    # pair each begin with the next end at the same level on the same track
    pair = (typ_o == T_BEGIN) | ((typ_o == T_END) & ~unmatched_end)
    pi = np.flatnonzero(pair)
    po = pi[np.lexsort((pi, depth_o[pi], t_o[pi]))]
    nxt_is_end = np.zeros(len(po), bool)
    if len(po) > 1:
        same = (t_o[po[1:]] == t_o[po[:-1]]) & (depth_o[po[1:]] == depth_o[po[:-1]])
        nxt_is_end[:-1] = same & (typ_o[po[1:]] == T_END) & (typ_o[po[:-1]] == T_BEGIN)
    b_o = po[nxt_is_end]
    e_o = po[1:][nxt_is_end[:-1]] if len(po) > 1 else po[:0]
    ts_o = ets[ev][o]
    sid_o = sid[o]
    n_sl = int(is_open.sum())
    dur = np.full(n_sl, -1, np.int64)
    dur[sid_o[b_o]] = ts_o[e_o] - ts_o[b_o]
    ev_slice[ev[o][e_o]] = sid_o[b_o]
    # parents: the latest begin one level up on the same track
    opn = np.flatnonzero((typ_o == T_BEGIN) | (typ_o == T_INSTANT))
    depth = np.zeros(n_sl, np.int64)
    depth[sid_o[opn]] = depth_o[opn]
    parent = np.full(n_sl, -1, np.int64)
    bi = np.flatnonzero(typ_o == T_BEGIN)
    kid = opn[depth_o[opn] > 0]
    if len(bi) and len(kid):
        span = np.int64(k + 1)
        bkey = (t_o[bi] * (int(depth_o.max()) + 2) + depth_o[bi]) * span + pos_o[bi]
        bord = np.argsort(bkey)
        bkey = bkey[bord]
        q = (t_o[kid] * (int(depth_o.max()) + 2) + depth_o[kid] - 1) * span + pos_o[kid]
        j = np.searchsorted(bkey, q, side="right") - 1
        parent[sid_o[kid]] = sid_o[bi[bord[np.maximum(j, 0)]]]
    opened = ev[is_open]
    cols = {
        "id": np.arange(n_sl, dtype=np.int64),
        "ts": ets[opened],
        "dur": np.where(typ[is_open] == T_INSTANT, 0, dur),
        "track_id": etid[opened],
        "category": ecat[opened],
        "name": ename[opened],
        "depth": depth,
        "parent_id": parent,
        "arg_set_id": np.full(n_sl, -1, np.int64),
    }
    if (cols["dur"] < 0).any():
        stats["slices_unfinished"] = int((cols["dur"] < 0).sum())
    return cols, ev_slice


def _build_counters(order, ets, etid, cval, has_cval, is_counter_ev, tracks):
    ev = order[is_counter_ev[order]]
    ev = ev[has_cval[ev]]
    trk = etid[ev]
    val = cval[ev].copy()
    mult = np.array([t.multiplier for t in tracks] + [1], np.float64)
    val *= mult[trk]
    incr = np.array([t.incremental for t in tracks] + [False])
    if incr[trk].any():  # incremental counters accumulate per track, in time order
        sel = np.flatnonzero(incr[trk])
        o = sel[np.argsort(trk[sel], kind="stable")]
        val[o] = _segmented_cumsum(val[o], trk[o])
    return {"id": np.arange(len(ev), dtype=np.int64), "ts": ets[ev], "track_id": trk,
            "value": val}


def _build_flows(E: _Acc, ev_slice: np.ndarray, order: np.ndarray) -> list[tuple[int, int]]:
    """flow_ids / terminating_flow_ids -> (slice_out, slice_in), as trace processor's v2 flows.

    An id seen for the first time starts a flow at its slice; seen again, it links the previous
    slice to this one (and, for a terminating id, ends the flow).
    """
    fev = E.get("flow_ev")
    if not len(fev):
        return []
    fid = _as_i64(E.get("flow_id", np.uint64))
    term = E.get("flow_term")
    rank = np.empty(len(ev_slice), np.int64)
    rank[order] = np.arange(len(order))
    ok = np.isin(fev, order) & (ev_slice[fev] >= 0)
    fev, fid, term = fev[ok], fid[ok], term[ok]
    o = np.lexsort((term, rank[fev]))
    active: dict[int, int] = {}
    out = []
    for e, f, t in zip(fev[o].tolist(), fid[o].tolist(), term[o].tolist(), strict=True):
        s = int(ev_slice[e])
        prev = active.get(f)
        if prev is None:
            active[f] = s
            continue
        out.append((prev, s))
        if t:
            del active[f]
        else:
            active[f] = s
    return out


# value types of args rows
V_INT, V_UINT, V_BOOL, V_REAL, V_STRING, V_POINTER, V_JSON = range(7)
VALUE_TYPES = ("int", "uint", "bool", "real", "string", "pointer", "json")
_COMPLEX = (8, 9, 11, 12, 13, 14, 16)  # nested / dict / array / proto values: decoded in Python


def _mix(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _flatten(pb_ann, key: str, flat: str, rows: list, strings: Strings, argname) -> None:
    """Rows for one (possibly nested) DebugAnnotation, keys as trace processor writes them."""
    which = pb_ann.WhichOneof("value")
    if pb_ann.dict_entries:
        for e in pb_ann.dict_entries:
            nm = e.name or argname(e.name_iid)
            _flatten(e, f"{key}.{nm}", f"{flat}.{nm}", rows, strings, argname)
        return
    if pb_ann.array_values:
        for i, e in enumerate(pb_ann.array_values):
            _flatten(e, f"{key}[{i}]", flat, rows, strings, argname)
        return
    k, fk = strings.id(key), strings.id(flat)
    if which == "bool_value":
        rows.append((k, fk, V_BOOL, int(pb_ann.bool_value), -1, 0.0))
    elif which == "uint_value":
        v = pb_ann.uint_value
        rows.append((k, fk, V_UINT, v if v < (1 << 63) else v - (1 << 64), -1, 0.0))
    elif which == "int_value":
        rows.append((k, fk, V_INT, pb_ann.int_value, -1, 0.0))
    elif which == "double_value":
        rows.append((k, fk, V_REAL, 0, -1, pb_ann.double_value))
    elif which == "pointer_value":
        rows.append((k, fk, V_POINTER, pb_ann.pointer_value & ((1 << 63) - 1), -1, 0.0))
    elif which == "legacy_json_value":
        rows.append((k, fk, V_JSON, 0, strings.id(pb_ann.legacy_json_value), 0.0))
    elif which == "string_value":
        rows.append((k, fk, V_STRING, 0, strings.id(pb_ann.string_value), 0.0))
    elif which is not None:
        rows.append((k, fk, V_STRING, 0, strings.id(str(getattr(pb_ann, which))), 0.0))


def _build_args(buf, E: _Acc, st: _State, egen, ev_slice, sl: dict, stats) -> dict:
    """Debug annotations and source locations -> args rows, identical arg sets shared."""
    strings = st.strings
    cols: dict[str, list] = defaultdict(list)

    def add(slice_ids, order, key, flat, vtype, ival, sval, rval):
        cols["slice"].append(slice_ids)
        cols["order"].append(order)
        cols["key"].append(key)
        cols["flat"].append(flat)
        cols["type"].append(vtype)
        cols["ival"].append(ival)
        cols["sval"].append(sval)
        cols["rval"].append(rval)

    aev = E.get("ann_ev")
    keep = ev_slice[aev] >= 0 if len(aev) else np.zeros(0, bool)
    aev = aev[keep]
    if len(aev):
        aoff, alen = E.get("ann_off")[keep], E.get("ann_len")[keep]
        f = ps.scan(buf, aoff, aoff + alen)
        na = len(aev)
        name_iid, _ = _last(f, 1, na, dtype=np.int64)
        nidx = st.interned.lookup("arg", egen[aev], name_iid)
        names = np.array(st.interned.vals.get("arg", []) + [_NONE], np.int64)[nidx]
        noff, nlen = _last_len(f, 10, na)
        for i in np.flatnonzero(noff >= 0).tolist():
            names[i] = strings.id(_text(buf, int(noff[i]), int(nlen[i])))
        # "debug.<name>" keys
        uniq = np.unique(names[names >= 0])
        keymap = np.full(len(strings.list) + 1, _NONE, np.int64)
        for u in uniq.tolist():
            keymap[u] = strings.id("debug." + strings.list[u])
        keys = np.where(names >= 0, keymap[np.maximum(names, 0)], _NONE)
        vtype = np.full(na, -1, np.int64)
        ival = np.zeros(na, np.int64)
        sval = np.full(na, _NONE, np.int64)
        rval = np.zeros(na, np.float64)
        for fid, vt in ((2, V_BOOL), (3, V_UINT), (4, V_INT), (7, V_POINTER)):
            rows = f.select(fid)
            vtype[f.msg[rows]] = vt
            ival[f.msg[rows]] = _as_i64(f.val[rows])
        rows = f.select(5)
        vtype[f.msg[rows]] = V_REAL
        rval[f.msg[rows]] = f.val[rows].view(np.float64)
        rows = f.select(6)
        rows = rows[f.wt[rows] == ps.WT_LEN]
        vtype[f.msg[rows]] = V_STRING
        for r in rows.tolist():
            sval[f.msg[r]] = strings.id(_text(buf, int(f.off[r]), int(f.ln[r])))
        rows = f.select(17)
        if len(rows):
            vals = np.array(st.interned.vals.get("argstr", []) + [_NONE], np.int64)
            idx = st.interned.lookup("argstr", egen[aev[f.msg[rows]]],
                                     _as_i64(f.val[rows]))
            vtype[f.msg[rows]] = V_STRING
            sval[f.msg[rows]] = vals[idx]
        cx = np.zeros(na, bool)
        cx[f.msg[np.isin(f.fid, _COMPLEX)]] = True
        simple = ~cx & (vtype >= 0) & (keys >= 0)
        slices = ev_slice[aev]
        add(slices[simple], np.flatnonzero(simple), keys[simple], keys[simple], vtype[simple],
            ival[simple], sval[simple], rval[simple])
        if cx.any():
            pb = _pb()

            crow = []
            for i in np.flatnonzero(cx & (names >= 0)).tolist():
                try:
                    ann = pb.DebugAnnotation.FromString(
                        buf[aoff[i] : aoff[i] + alen[i]].tobytes())
                except Exception:
                    stats["corrupt_messages"] = stats.get("corrupt_messages", 0) + 1
                    continue
                g = int(egen[aev[i]])

                def argname(iid, g=g):
                    j = st.interned.lookup("arg", np.array([g]), np.array([iid]))[0]
                    return strings.list[st.interned.vals["arg"][j]] if j >= 0 else str(iid)

                rows_i: list = []
                key = "debug." + strings.list[int(names[i])]
                _flatten(ann, key, key, rows_i, strings, argname)
                crow.extend((int(slices[i]), i) + r for r in rows_i)
            if crow:
                a = list(zip(*crow, strict=True))
                add(*(np.array(c) for c in a[:6]), np.array(a[6], np.int64),
                    np.array(a[7], np.float64))
    # source locations: interned (by iid) or inline
    siid = E.get("srcloc")
    sev = np.flatnonzero((siid > 0) & (ev_slice >= 0)) if len(siid) else np.zeros(0, np.int64)
    locs: list[tuple[int, tuple]] = []
    if len(sev):
        idx = st.interned.lookup("srcloc", egen[sev], siid[sev])
        vals = st.interned.vals.get("srcloc", [])
        locs.extend((int(ev_slice[e]), vals[j]) for e, j in zip(sev.tolist(), idx.tolist(),
                                                                 strict=True) if j >= 0)
    lev = E.get("sl_ev")
    if len(lev):
        pb = _pb()
        for e, o, ln in zip(lev.tolist(), E.get("sl_off").tolist(), E.get("sl_len").tolist(),
                            strict=True):
            if ev_slice[e] >= 0:
                s = pb.SourceLocation.FromString(buf[o : o + ln].tobytes())
                locs.append((int(ev_slice[e]), (s.file_name, s.function_name, s.line_number)))
    if locs:
        uniq = {v: i for i, v in enumerate(dict.fromkeys(v for _, v in locs))}
        ut = list(uniq)
        fsid = np.array([strings.id(v[0]) for v in ut], np.int64)
        gsid = np.array([strings.id(v[1]) for v in ut], np.int64)
        line = np.array([v[2] for v in ut], np.int64)
        li = np.array([uniq[v] for _, v in locs], np.int64)
        ls = np.array([s for s, _ in locs], np.int64)
        k = len(ls)
        big = np.int64(1 << 40)
        for j, (key, vt, iv, sv) in enumerate((
            ("source.file_name", V_STRING, np.zeros(k, np.int64), fsid[li]),
            ("source.function_name", V_STRING, np.zeros(k, np.int64), gsid[li]),
            ("source.line_number", V_INT, line[li], np.full(k, _NONE, np.int64)),
        )):
            kid = strings.id(key)
            add(ls, np.full(k, big + j), np.full(k, kid), np.full(k, kid), np.full(k, vt), iv,
                sv, np.zeros(k))
    if not cols:
        return {}
    c = {k: np.concatenate(v) for k, v in cols.items()}
    o = np.lexsort((c["order"], c["slice"]))
    c = {k: v[o] for k, v in c.items()}
    s = c["slice"]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    pos = np.arange(len(s)) - np.repeat(starts, np.diff(np.r_[starts, len(s)]))
    h = _mix(c["key"].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             ^ _mix(c["type"] + (c["flat"] << 8)) ^ _mix(c["ival"]) * np.uint64(3)
             ^ _mix(c["sval"]) * np.uint64(5) ^ _mix(c["rval"].view(np.int64)) * np.uint64(7)
             ^ _mix(pos) * np.uint64(11))
    set_hash = np.add.reduceat(h, starts) if len(starts) else h
    set_hash = _mix(set_hash ^ _mix(np.diff(np.r_[starts, len(s)])))
    uh, first, inv = np.unique(set_hash, return_index=True, return_inverse=True)
    rank = np.empty(len(uh), np.int64)
    rank[np.argsort(first)] = np.arange(len(uh))  # arg set ids in slice order, from 1
    set_id = rank[inv] + 1
    sl["arg_set_id"][s[starts]] = set_id
    rep = np.zeros(len(s), bool)
    rep_slices = s[starts[first]]
    rep[np.isin(s, rep_slices)] = True
    srow = np.repeat(set_id, np.diff(np.r_[starts, len(s)]))
    vt = c["type"][rep]
    ival, sval, rval = c["ival"][rep], c["sval"][rep], c["rval"][rep]
    is_str = (vt == V_STRING) | (vt == V_JSON)
    is_real = vt == V_REAL
    is_int = ~is_str & ~is_real
    # display_value: the value as text (trace processor's args.display_value)
    disp = np.where(is_str, sval, _NONE)
    if is_int.any():
        u, inv = np.unique(ival[is_int], return_inverse=True)
        ids = np.array([strings.id(str(v)) for v in u.tolist()], np.int64)
        disp[is_int] = ids[inv]
        b = vt == V_BOOL
        disp[b] = np.where(ival[b] != 0, strings.id("true"), strings.id("false"))
    if is_real.any():
        u, inv = np.unique(rval[is_real], return_inverse=True)
        ids = np.array([strings.id(repr(v)) for v in u.tolist()], np.int64)
        disp[is_real] = ids[inv]
    vt_ids = np.array([strings.id(v) for v in VALUE_TYPES], np.int64)
    o = np.argsort(srow[rep], kind="stable")
    cols_out = {
        "arg_set_id": srow[rep], "flat_key": c["flat"][rep], "key": c["key"][rep],
        "int_value": ival, "int_null": ~is_int, "string_value": np.where(is_str, sval, _NONE),
        "real_value": rval, "real_null": ~is_real, "value_type": vt_ids[vt],
        "display_value": disp,
    }
    return {k: v[o] for k, v in cols_out.items()}


def _build_processes(tracks: list[Track]):
    """process / thread rows from track descriptors (upid 0 and utid 0 are placeholders)."""
    procs: dict[int, list] = {}
    threads: dict[tuple[int, int], list] = {}
    by_uuid = {t.uuid: t for t in tracks}

    def proc(pid: int) -> int:
        if pid not in procs:
            procs[pid] = [len(procs) + 1, pid, None]
        return procs[pid][0]

    for t in tracks:
        if t.kind == "process":
            p = procs.get(t.pid) or procs.setdefault(t.pid, [len(procs) + 1, t.pid, None])
            p[2] = t.process_name or p[2]
        elif t.kind == "thread":
            up = proc(t.pid)
            th = threads.setdefault((t.pid, t.tid), [len(threads) + 1, t.tid, None, up])
            th[2] = t.thread_name or th[2]
    track_utid = {t.id: threads[(t.pid, t.tid)][0] for t in tracks if t.kind == "thread"}
    track_upid: dict[int, int] = {}
    for t in tracks:
        if t.kind == "process":
            track_upid[t.id] = procs[t.pid][0]
        elif t.kind == "track":  # custom tracks under a process belong to it
            p, seen = t, set()
            while p is not None and p.parent_uuid is not None and p.uuid not in seen:
                seen.add(p.uuid)
                p = by_uuid.get(p.parent_uuid)
                if p is not None and p.kind == "process":
                    track_upid[t.id] = procs[p.pid][0]
                    break
    plist = [(0, 0, None)] + [tuple(v) for v in procs.values()]
    tlist = [(0, 0, None, 0)] + [tuple(v) for v in threads.values()]
    return plist, tlist, track_utid, track_upid
