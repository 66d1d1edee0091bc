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
  hop along the clock graph the snapshots build, each hop using, of the snapshots of its clock set
  read before the packet, the one with the largest source value <= the timestamp (the first for
  earlier timestamps); see :mod:`.state`.
* Events are sorted by timestamp (stable: file order breaks ties) before slices are built, so
  depth / parent_id come from nesting on each track and slice ids follow time order.

Everything that scales with the number of events is done with numpy on whole arrays; Python
loops only over rare things (descriptors, interned strings, snapshots, flows, nested args).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from .. import _arrays as ar
from .._threads import beside
from . import loops
from .args import build_args
from .model import NONE, Strings, Tables, Track
from .packets import (
    T_BEGIN,
    T_COUNTER,
    T_END,
    T_INSTANT,
    Acc,
    Progress,
    as_i64,
    gather_packets,
    read_file,
    scan_packets,
)
from .state import (
    State,
    generations,
    lookup_last,
    resolve_timestamps,
    segmented_cumsum,
    utf8_at,
)

_I64 = np.int64

__all__ = ["Strings", "Tables", "Track", "decode", "read_file"]


def _per_event_single(ev: np.ndarray, val: np.ndarray, n: int, join) -> np.ndarray:
    """Collapse (event, value) rows to one value per event; events with several rows use join."""
    out = np.full(n, NONE, np.int32)
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
    files = pk.file if len(datas) > 1 else None  # the clock snapshots' files
    pk.start = pk.end = pk.file = None  # only the bytes are needed from here on
    stats["packets"] = n
    seq, flags, bad = P.pop("seq"), P.pop("flags", np.int8), P.pop("bad", bool)
    srank, gen = generations(seq, flags) if n else (np.zeros(0, _I64), np.zeros(0, _I64))
    skip = bad | (((flags & 2) != 0) & (gen < 0))
    if skip.any():
        stats["packets_skipped_no_incremental_state"] = int((skip & ~bad).sum())
    del seq, flags, bad
    progress("state", 0.0)
    st = State(buf, rare, srank, gen, stats, files)
    del files
    strings = st.strings
    epkt, etyp = E.pop("pkt"), E.pop("typ")
    m = len(epkt)
    tracks = sorted(st.tracks.values(), key=lambda t: t.id)  # track index: position here
    # the packets' timestamps (clocks) and the events' tracks and names (interned data) need
    # nothing from each other: computed side by side
    (egen, eskip, etid, ename, ecat), pts = beside(
        partial(_event_tracks_names, E, st, tracks, buf, epkt, gen, skip, n),
        partial(resolve_timestamps, P, st, srank, gen, skip, stats) if n
        else partial(np.zeros, 0, _I64))
    del P, gen, skip, srank
    progress("events", 0.0)
    ets = pts[epkt] if m else np.zeros(0, _I64)
    del pts, epkt
    known = etid >= 0
    valid = ~eskip & (ets != np.iinfo(np.int64).min)
    del eskip
    # trace processor drops a TrackEvent whose time (on the trace clock) is negative
    negative = valid & (ets < 0)
    if negative.any():
        stats["track_event_invalid_timestamp"] = int(negative.sum())
        valid &= ~negative
    del negative
    if (valid & ~known).any():
        stats["track_event_unknown_track"] = int((valid & ~known).sum())
    valid &= known
    del known
    is_counter_track = np.array([t.kind == "counter" for t in tracks] + [False])[etid]
    is_slice_ev = valid & np.isin(etyp, (T_BEGIN, T_END, T_INSTANT)) & ~is_counter_track
    is_counter_ev = valid & (etyp == T_COUNTER) & is_counter_track
    wrong = valid & ~is_slice_ev & ~is_counter_ev
    if wrong.any():
        stats["track_event_unsupported"] = int(wrong.sum())
    del wrong, valid, is_counter_track

    # ---- global time order ----------------------------------------------------------------
    order = np.argsort(ets, kind="stable")  # events are in packet order: ties keep it
    order = order[(is_slice_ev | is_counter_ev)[order]]
    tables_slice, ev_slice = _build_slices(order, etyp, ets, etid, ename, ecat, is_slice_ev, stats)
    del ename, ecat, is_slice_ev
    cval = np.zeros(m, np.float64)
    has_cval = np.zeros(m, bool)
    cv_ev = E.get("cv_ev")
    cval[cv_ev] = E.get("cv_val", np.float64)
    has_cval[cv_ev] = True
    tables_counter = _build_counters(order, ets, etid, cval, has_cval, is_counter_ev, tracks)
    del cval, has_cval, ets, etid, etyp, is_counter_ev
    progress("args", 0.0)
    flows = _build_flows(E, ev_slice, order)
    args = build_args(buf, E, st, egen, ev_slice, tables_slice, stats)
    procs, threads, track_utid, track_upid = _build_processes(tracks)
    progress("events", 1.0)
    return Tables(strings=strings, slice=tables_slice, counter=tables_counter, args=args,
                  flows=flows, tracks=tracks, processes=procs, threads=threads,
                  track_utid=track_utid, track_upid=track_upid, stats=stats)


def _event_tracks_names(E: Acc, st: State, tracks: list[Track], buf, epkt: np.ndarray,
                        gen: np.ndarray, skip: np.ndarray, n: int) -> tuple:
    """Per event: its generation, whether its packet is skipped, its track's index in
    ``tracks`` (-1: unknown), its name and category string ids."""
    strings = st.strings
    m = len(epkt)
    egen = gen[epkt] if m else np.zeros(0, _I64)
    eskip = skip[epkt] if m else np.zeros(0, bool)
    uuids = np.array([t.uuid for t in tracks], np.int64)
    uorder = np.argsort(uuids).astype(np.int32)
    su = uuids[uorder]

    def track_index(u: np.ndarray) -> np.ndarray:  # of each uuid (int32; -1: no such track)
        if not len(su):
            return np.full(len(u), -1, np.int32)
        pos = np.minimum(np.searchsorted(su, u), len(su) - 1)
        return np.where(su[pos] == u, uorder[pos], -1).astype(np.int32)

    if len(st.def_pkt) and m:  # the defaults' track (mapped once per default), unless the
        d = lookup_last(gen[st.def_pkt], st.def_pkt, egen, epkt, n)  # event names its own
        def_tid = np.where(st.def_track == -1, -1, track_index(st.def_track)).astype(np.int32)
        etid = np.r_[def_tid, np.int32(-1)][d]  # d = -1 (no defaults yet): the -1 at the end
        del d
    else:
        etid = np.full(m, -1, np.int32)
    tr_ev = E.pop("tr_ev")
    etid[tr_ev] = track_index(E.pop("tr_uuid"))
    del tr_ev
    # generation ids < clears + sequences <= 2 * packets (see generations), not < packets
    egen = egen.astype(np.int32) if 2 * n < (1 << 31) - 1 else egen

    # ---- names and categories -----------------------------------------------------------
    name_idx = st.interned.lookup("name", egen, E.pop("name_iid"))
    name_vals = np.array(st.interned.vals.get("name", []) + [NONE], np.int32)
    ename = name_vals[name_idx]  # string ids (int32)
    del name_idx
    for i, o, ln in zip(E.get("nm_ev").tolist(), E.get("nm_off").tolist(),
                        E.get("nm_len").tolist(), strict=True):
        ename[i] = strings.id(utf8_at(buf, o, ln))
    cat_vals = np.array(st.interned.vals.get("cat", []) + [NONE], np.int64)
    cev = E.get("cat_ev")
    csid = cat_vals[st.interned.lookup("cat", egen[cev], E.get("cat_iid"))] if len(cev) else cev
    keep = csid >= 0
    cev, csid = cev[keep], csid[keep]
    lev = E.get("catl_ev")
    if len(lev):  # literal categories, for events that have no interned ones
        loff, llen = E.get("catl_off"), E.get("catl_len")
        lit = np.array([strings.id(utf8_at(buf, int(o), int(ln)))
                        for o, ln in zip(loff.tolist(), llen.tolist(), strict=True)], np.int64)
        use = ~np.isin(lev, cev)
        cev, csid = np.r_[cev, lev[use]], np.r_[csid, lit[use]]

    def join_cats(ids):
        return strings.id(",".join(strings.list[i] for i in ids))

    ecat = _per_event_single(cev, csid, m, join_cats)
    return egen, eskip, etid, ename, ecat


def _build_slices(order, etyp, ets, etid, ename, ecat, is_slice_ev, stats):
    """Slices from begin/end/instant events: depth and parent from nesting per track.

    Returns the slice columns (in id order) and, per event, the id of its slice (-1: none).
    Working arrays are int32 where the values fit (event counts < 2**31): peak memory.
    The C loop ``_decodeloops.nest`` does the nesting with a stack per track when built; the
    numpy passes below give the same columns.
    """
    m = len(etyp)
    ev = order[is_slice_ev[order]]  # slice events in global time order
    k = len(ev)
    typ = etyp[ev]
    is_open = (typ == T_BEGIN) | (typ == T_INSTANT)
    n_sl = int(is_open.sum())
    ix = np.int32 if k < (1 << 31) - 1 else np.int64
    if loops.native is not None and ix is np.int32:  # (track indexes: the C loop checks them)
        return _slice_columns(ev, typ, is_open, ets, etid, ename, ecat, stats,
                              *_nest_c(ev, typ, etid[ev], ets, m, n_sl))
    ev_slice = np.full(m, -1, ix)
    sid = np.cumsum(is_open, dtype=ix)
    sid -= 1  # slice id of begin/instant events (time order)
    ev_slice[ev[is_open]] = sid[is_open]
    # per track, in time order
    trk = etid[ev]
    o = np.argsort(ar.small_key(trk), kind="stable")
    t_o, typ_o, sid_o, ev_o = trk[o], typ[o], sid[o], ev[o]
    del trk, sid, o
    newseg = np.r_[True, t_o[1:] != t_o[:-1]] if k else np.zeros(0, bool)
    delta = (typ_o == T_BEGIN).astype(ix)
    delta -= typ_o == T_END
    raw = segmented_cumsum(delta, t_o, dtype=ix)  # open slices after each event, per track
    del delta
    if k and int(raw.min()) < 0:
        # ends with nothing open are ignored (as trace processor): running minimum per track
        seg_no = np.cumsum(newseg) - 1
        big = np.int64(1 << 40)
        runmin = np.minimum.accumulate(np.minimum(raw, 0) - seg_no * big) + seg_no * big
        del seg_no
        runmin = np.minimum(runmin, 0)
        prev_min = np.r_[0, runmin[:-1]]
        prev_min[newseg] = 0
        unmatched_end = (typ_o == T_END) & (runmin < prev_min)
        raw -= runmin.astype(ix)  # open slices after each event
        del runmin, prev_min
        unmatched = int(unmatched_end.sum())
    else:
        unmatched_end, unmatched = None, 0
    del newseg
    depth_o = raw
    depth_o -= typ_o == T_BEGIN  # begin/instant: depth; end: the level it closes
    del raw
    # events grouped by (track, depth), in time order within a group
    dmax = int(depth_o.max()) + 2 if k else 2
    key = t_o.astype(np.int64) * dmax + depth_o
    del t_o
    po = np.argsort(ar.small_key(key), kind="stable")
    # pair each begin with the next end at the same level on the same track
    is_begin = typ_o == T_BEGIN
    pair = is_begin | (typ_o == T_END)
    if unmatched_end is not None:
        pair &= ~unmatched_end
        del unmatched_end
    pp = po[pair[po]]
    del pair
    nxt_is_end = np.zeros(len(pp), bool)
    if len(pp) > 1:
        nxt_is_end[:-1] = ((key[pp[1:]] == key[pp[:-1]]) & (typ_o[pp[1:]] == T_END)
                           & is_begin[pp[:-1]])
    b_o = pp[nxt_is_end]
    e_o = pp[1:][nxt_is_end[:-1]] if len(pp) > 1 else pp[:0]
    del pp, nxt_is_end
    dur = np.full(n_sl, -1, np.int64)
    b_ev = ev_o[b_o]
    e_ev = ev_o[e_o]
    dur[sid_o[b_o]] = ets[e_ev] - ets[b_ev]
    ev_slice[e_ev] = sid_o[b_o]
    del b_o, e_o, b_ev, e_ev, ev_o
    # parents: the latest begin one level up on the same track
    opn = np.flatnonzero(is_begin | (typ_o == T_INSTANT))
    depth = np.zeros(n_sl, ix)
    depth[sid_o[opn]] = depth_o[opn]
    parent = np.full(n_sl, -1, ix)
    kid = opn[depth_o[opn] > 0]
    del opn, depth_o
    pb = po[is_begin[po]]  # begins by (track, depth), then position: sorted keys below
    del po, is_begin
    if len(pb) and len(kid):
        span = np.int64(k + 1)
        bkey = key[pb] * span + pb
        q = (key[kid] - 1) * span + kid
        j = np.searchsorted(bkey, q, side="right") - 1
        del bkey, q
        parent[sid_o[kid]] = sid_o[pb[np.maximum(j, 0)]]
        del j
    del key, kid, pb, sid_o, typ_o
    dur[typ[is_open] == T_INSTANT] = 0
    return _slice_columns(ev, typ, is_open, ets, etid, ename, ecat, stats, ev_slice, dur, depth,
                          parent, unmatched)


def _nest_c(ev, typ, trk, ets, m: int, n_sl: int) -> tuple:
    """ev_slice, dur, depth, parent by the C loop (int32 ids)."""
    out = np.empty(len(ev), np.int32)
    dur = np.empty(n_sl, np.int64)
    depth = np.empty(n_sl, np.int32)
    parent = np.empty(n_sl, np.int32)
    top = np.empty(int(trk.max()) + 1 if len(trk) else 1, np.int32)
    unmatched = loops.native.nest(np.ascontiguousarray(typ, np.int8),
                                  np.ascontiguousarray(trk, np.int32),
                                  ets[ev].astype(np.int64, copy=False), T_BEGIN, T_END,
                                  T_INSTANT, out, dur, depth, parent, top)
    ev_slice = np.full(m, -1, np.int32)
    ev_slice[ev] = out
    return ev_slice, dur, depth, parent, unmatched


def _slice_columns(ev, typ, is_open, ets, etid, ename, ecat, stats, ev_slice, dur, depth,
                   parent, unmatched: int = 0) -> tuple[dict, np.ndarray]:
    """The slice table's columns from the nesting results (either loop's)."""
    if unmatched:
        stats["slice_end_without_begin"] = unmatched
    opened = ev[is_open]
    n_sl = len(opened)
    ix = depth.dtype
    cols = {
        "id": np.arange(n_sl, dtype=np.int64),
        "ts": ets[opened],
        "dur": dur,
        "track_id": etid[opened],
        "category": ecat[opened],
        "name": ename[opened],
        "depth": depth,
        "parent_id": parent,
        "arg_set_id": np.full(n_sl, -1, ix),
    }
    if (dur < 0).any():
        stats["slices_unfinished"] = int((dur < 0).sum())
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
        val[o] = segmented_cumsum(val[o], trk[o])
    return {"id": np.arange(len(ev), dtype=np.int64), "ts": ets[ev], "track_id": trk,
            "value": val}


def _build_flows(E: Acc, ev_slice: np.ndarray, order: np.ndarray) -> list[tuple[int, int]]:
    """flow_ids / terminating_flow_ids -> (slice_out, slice_in), as trace processor's v2 flows.

    An id seen for the first time starts a flow at its slice; seen again, it links the previous
    slice to this one (and, for a terminating id, ends the flow).
    """
    fev = E.get("flow_ev")
    if not len(fev):
        return []
    fid = as_i64(E.get("flow_id", np.uint64))
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
            proc(t.pid)
            p = procs[t.pid]
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
        elif t.kind == "track":  # custom tracks under a thread are its (trace processor's
            # thread_merged_track_event: a thread's steps track), else under a process, its
            p, seen = t, set()
            while p is not None and p.parent_uuid is not None and p.uuid not in seen:
                seen.add(p.uuid)
                p = by_uuid.get(p.parent_uuid)
                if p is not None and p.kind == "thread":
                    track_utid[t.id] = threads[(p.pid, p.tid)][0]
                    break
                if p is not None and p.kind == "process":
                    track_upid[t.id] = procs[p.pid][0]
                    break
    plist = [(0, 0, None)] + [tuple(v) for v in procs.values()]
    tlist = [(0, 0, None, 0)] + [tuple(v) for v in threads.values()]
    return plist, tlist, track_utid, track_upid
