"""Per-sequence state decoded in file order: descriptors, defaults, interning, clocks.

Follows trace processor: ``SEQ_INCREMENTAL_STATE_CLEARED`` starts a new generation of interned
data and ``TracePacketDefaults``; packets needing incremental state before the first clear are
skipped. Timestamps are in ``timestamp_clock_id`` (or the defaults' clock, or the trace clock);
sequence-scoped clocks (64..127) declared ``is_incremental`` accumulate deltas from the value a
``ClockSnapshot`` of that sequence gave them, scaled by ``unit_multiplier_ns``; then each
timestamp is converted to the trace clock (BOOTTIME unless ``primary_trace_clock`` says
otherwise) hop by hop along the clock graph the snapshots build. As trace processor's
``ClockSynchronizer``, a hop belongs to one clock set (the snapshots listing exactly those
clocks) and uses, of that set's snapshots read *before* the packet (trace processor converts in
the tokenizer, in file order), the one with the largest source value <= the timestamp (the
first for earlier timestamps); the path is the one the clock graph offered at that point (a
clock that went back in a snapshot is no hop's source from there on). A packet that cannot be
converted when read is tried again at the end with every snapshot, and only then lost
(``clock_sync_failure``). Of two sets that join the same clocks, trace processor takes the one
of the lower hash; here, the first seen (our writers never write two such sets).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..._clock import BOOTTIME
from ...format import wire as w
from . import loops
from .model import Strings, Track, to_str
from .packets import (
    P_CLOCK_SNAPSHOT,
    P_DEFAULTS,
    P_DESCRIPTOR,
    P_INTERNED,
    Acc,
)

# Sequence state: generations, defaults, interning
# --------------------------------------------------------------------------------------------


def trace_pb2():
    """The official schema's module, for the rare messages decoded one by one (descriptors,
    interned data, nested annotations); lazy: protobuf's import costs, and most loads never
    need it."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2

    return perfetto_trace_pb2


def segmented_cumsum(values: np.ndarray, seg: np.ndarray, dtype=None) -> np.ndarray:
    """Cumulative sum restarting where ``seg`` (sorted group labels) changes; ``dtype``: of
    the sums (as np.cumsum's; a narrow one keeps peak memory down)."""
    if not len(values):
        return np.cumsum(values, dtype=dtype)
    return _cumsum_runs(values, np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]]), dtype=dtype)


def _cumsum_runs(values: np.ndarray, starts: np.ndarray, base: np.ndarray | None = None,
                 dtype=None) -> np.ndarray:
    """Cumulative sum restarting at each of ``starts`` (sorted, the first 0), plus ``base[k]``
    on run k when given."""
    cs = np.cumsum(values, dtype=dtype)
    shift = values[starts] - cs[starts]  # what each run adds back to start from 0
    if base is not None:
        shift += base
    if len(starts) <= 64:  # few runs: shift in place, a slice at a time
        ends = np.r_[starts[1:], len(values)]
        for a, b, v in zip(starts.tolist(), ends.tolist(), shift.tolist(), strict=True):
            if v:
                cs[a:b] += v
        return cs
    cs += np.repeat(shift, np.diff(np.r_[starts, len(values)]))  # in place: cs is ours
    return cs


def generations(seq: np.ndarray, flags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per packet: its sequence rank and its generation id (-1 before the first clear).

    Generation ids are unique per (sequence, number of clears so far); not dense.
    """
    n = len(seq)
    # sequence ranks: runs of equal ids are long, so factorise the run heads only
    heads = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    useq, hrank = np.unique(seq[heads], return_inverse=True)
    srank = np.repeat(hrank, np.diff(np.r_[heads, n])).astype(np.int64)
    if loops.native is not None:  # one pass to count the clears per sequence, one to number them
        gen = np.empty(n, np.int64)
        loops.native.generations(srank, np.ascontiguousarray(flags, np.int8),
                           np.empty(2 * len(useq), np.int64), gen)
        return srank, gen
    clear = (flags & 1) != 0
    per_seq = np.zeros(len(useq), np.int64)  # clears per sequence
    gl = np.zeros(n, np.int64)  # clears so far on the packet's sequence
    cpos = np.flatnonzero(clear)  # clears are rare: count them per sequence at the clears only
    if len(cpos):
        cs = srank[cpos]
        o = np.argsort(cs, kind="stable")
        cpos, cs = cpos[o], cs[o]
        first = np.searchsorted(cs, np.arange(len(useq)))
        per_seq[:] = np.diff(np.r_[first, len(cs)])
        # gl = clears of the same sequence at or before the packet
        key = cs * (n + 1) + cpos
        q = srank * (n + 1) + np.arange(n)
        gl = np.searchsorted(key, q, side="right") - first[srank]
        del q
    base = np.zeros(len(useq), np.int64)
    np.cumsum(per_seq[:-1] + 1, out=base[1:])
    gen = np.where(gl > 0, base[srank] + gl, -1)
    return srank, gen


def _owner_walk(walk, owner_gen: np.ndarray, owner_pkt: np.ndarray, inputs: tuple,
                out: np.ndarray) -> bool:
    """A C owner walk (_decodeloops.last_owner, packet_clocks: the owners, a scratch slot per
    owner generation, the inputs as int64, then ``out``, written in place). False when the
    owners or queries are not in packet order (``out`` then untouched: the numpy path)."""
    last = np.empty(max(int(owner_gen.max()) + 1, 0) if len(owner_gen) else 0, np.int64)
    args = [np.ascontiguousarray(a, np.int64) for a in (owner_gen, owner_pkt, *inputs)]
    try:
        walk(*args[:2], last, *args[2:], out)
    except ValueError:
        return False
    return True


def lookup_last(owner_gen: np.ndarray, owner_pkt: np.ndarray, gen: np.ndarray,
                 pkt: np.ndarray, n: int) -> np.ndarray:
    """Index into owners of the last owner in the same generation at or before each packet."""
    if not len(owner_pkt):
        return np.full(len(pkt), -1, np.int64)
    if loops.native is not None:  # one merged walk, when owners and queries are in packet order
        out = np.empty(len(pkt), np.int64)
        if _owner_walk(loops.native.last_owner, owner_gen, owner_pkt, (gen, pkt), out):
            return out
    comb = owner_gen.astype(np.int64) * (n + 1) + owner_pkt
    order = np.argsort(comb, kind="stable")
    sc = comb[order]
    sgen = owner_gen[order]
    out = np.empty(len(pkt), np.int64)
    step = 1 << 20  # queries per pass: bounded temporaries
    for lo in range(0, len(pkt), step):
        g = gen[lo : lo + step].astype(np.int64)
        pos = np.searchsorted(sc, g * (n + 1) + pkt[lo : lo + step], side="right") - 1
        ok = (pos >= 0) & (g >= 0)
        np.maximum(pos, 0, out=pos)
        ok &= sgen[pos] == g
        out[lo : lo + step] = np.where(ok, order[pos], -1)
    return out


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
        out = np.full(len(iid), -1, np.int64)
        if not len(uk):
            return out
        step = 1 << 20  # queries per pass: bounded temporaries (it runs beside the clocks)
        for lo in range(0, len(iid), step):
            g, i = gen[lo : lo + step], iid[lo : lo + step]
            q = (g.astype(np.int64) << 32) | i.astype(np.int64)
            pos = np.minimum(np.searchsorted(uk, q), len(uk) - 1)
            ok = (uk[pos] == q) & (g >= 0) & (i > 0)
            out[lo : lo + step][ok] = idx[pos[ok]]
        return out


# --------------------------------------------------------------------------------------------
# Clocks
# --------------------------------------------------------------------------------------------


class _Clocks:
    """Clock snapshots and conversion to the trace clock, as trace processor's ClockSynchronizer
    (``util/clock_synchronizer.cc``), which converts each packet in the tokenizer, in file order:
    a packet sees only the snapshots, clock sets and non-monotonic marks read before it."""

    def __init__(self) -> None:
        self.snapshots: list[tuple[int, frozenset, dict[int, int]]] = []  # (packet, set, snap)
        # clock sets of the snapshots (>= 2 clocks) -> the packet that brought each, in
        # insertion order: the order decides which of equally short paths path() finds
        self.groups: dict[frozenset, int] = {}
        self.incremental: dict[int, bool] = {}
        self.multiplier: dict[int, int] = {}
        self.anchors: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.trace_clock: int | None = None
        self._paths: dict[tuple[int, int], list | None] = {}
        self.last: dict[frozenset, dict[int, int]] = {}  # clock set -> its last snapshot
        self.last_file: dict[frozenset, int] = {}  # clock set -> the file of that snapshot
        self.invalid = 0  # snapshots refused (trace processor's invalid_clock_snapshots)
        # clock -> the packet of the snapshot where it went back: from there on never a hop's
        # source (trace processor erases its edges)
        self.non_monotonic: dict[int, int] = {}
        self._changes: list[int] = []  # packets after which the graph differs, ascending

    def add(self, pkt: int, clocks: list[tuple[int, int, int, bool]], primary: int,
            file: int = 0) -> bool:
        """Take one snapshot, or refuse it as trace processor's ClockSynchronizer does: when
        its trace clock reads less than in the last snapshot of the same clock set (counted in
        ``invalid``). Another clock that goes back is kept as a target but no longer converts
        from (``non_monotonic``). Returns whether the snapshot was taken.

        Several files are read as ``stepscope merge`` joins them (trace processor is given
        that merge): a snapshot in which any clock reads less than in the last one of its set
        from an earlier file (the next rank's start, while the previous rank still ran) is
        left out, not counted."""
        snap = {ck: ts * mult for ck, ts, mult, _ in clocks}
        group = frozenset(snap)
        tc = primary or self.trace_clock or BOOTTIME
        last = self.last.get(group)
        if (last is not None and self.last_file[group] != file
                and any(ns < last[ck] for ck, ns in snap.items())):
            return False
        if last is not None and tc in snap and snap[tc] < last[tc]:
            self.invalid += 1
            return False
        if last is not None:
            for ck, ns in snap.items():
                if ns < last[ck] and ck not in self.non_monotonic:
                    self.non_monotonic[ck] = pkt
                    self._changes.append(pkt)
        self.last[group] = snap
        self.last_file[group] = file
        for ck, ts, mult, incr in clocks:
            self.multiplier[ck] = mult
            self.incremental[ck] = incr
            if incr:
                self.anchors[ck].append((pkt, ts * mult))
        if primary:
            self.trace_clock = primary
        elif BOOTTIME in snap and self.trace_clock is None:
            self.trace_clock = BOOTTIME
        if len(snap) >= 2 and group not in self.groups:
            self.groups[group] = pkt
            self._changes.append(pkt)
        self.snapshots.append((pkt, group, snap))
        return True

    def path(self, src: int, pkt: int) -> list | None:
        """Hops (a, b, clock set) from ``src`` to the trace clock for packet ``pkt``, breadth
        first over the graph as it stood when the packet was read."""
        era = int(np.searchsorted(np.array(self._changes, np.int64), pkt, side="left"))
        key = (src, era)
        if key in self._paths:
            return self._paths[key]
        dst = self.trace_clock
        prev: dict[int, tuple | None] = {src: None}
        frontier = [src]
        while frontier and dst not in prev:
            nxt = []
            for a in frontier:
                if self.non_monotonic.get(a, pkt) < pkt:
                    continue
                for grp, since in self.groups.items():
                    if since >= pkt or a not in grp:
                        continue
                    for b in grp:
                        if b not in prev:
                            prev[b] = (a, grp)
                            nxt.append(b)
            frontier = nxt
        hops = None
        if dst in prev:
            hops = []
            c = dst
            while prev[c] is not None:
                a, grp = prev[c]
                hops.append((a, c, grp))
                c = a
            hops.reverse()
        self._paths[key] = hops
        return hops

    def convert(self, src: int, ns: np.ndarray, pkts: np.ndarray) -> np.ndarray:
        """``ns`` (of packets ``pkts``, in packet order) on the trace clock; INT64_MIN where no
        path joins ``src`` to it, neither when the packet was read nor at the trace's end."""
        if self.trace_clock is None or src == self.trace_clock or src == 0:
            return ns
        out = np.full(len(ns), np.iinfo(np.int64).min, np.int64)
        # runs of packets read while the graph stood still (usually one run)
        cuts = np.searchsorted(pkts, np.array(self._changes, np.int64), side="right")
        bounds = np.unique(np.r_[0, cuts, len(pkts)])
        for b0, b1 in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            if b1 > b0:
                hops = self.path(src, int(pkts[b0]))
                if hops is not None:
                    out[b0:b1] = self._along(hops, ns[b0:b1], pkts[b0:b1])
        # a packet that could not be converted when read is deferred to the end of the trace
        # and tried again with every snapshot (ProtoTraceReader's eof_deferred_packets_)
        late = np.flatnonzero(out == np.iinfo(np.int64).min)
        if len(late):
            end = np.iinfo(np.int64).max
            hops = self.path(src, end)
            if hops is not None:
                out[late] = self._along(hops, ns[late], np.full(len(late), end, np.int64))
        return out

    def _along(self, hops: list, ns: np.ndarray, pkts: np.ndarray) -> np.ndarray:
        lost = None
        for a, b, grp in hops:
            snaps = [(pkt, snap) for pkt, g, snap in self.snapshots if g == grp]
            spkt = np.array([p for p, _ in snaps], np.int64)
            av = np.array([s[a] for _, s in snaps], np.int64)  # ascending while a is a source
            off = np.array([s[b] - s[a] for _, s in snaps], np.int64)
            # the snapshots read before each packet: a prefix of the set's (file order)
            seen = np.searchsorted(spkt, pkts, side="left")
            if seen.min() == len(snaps) and (off == off[0]).all():
                ns = ns + off[0]  # one offset for every timestamp
                continue
            i = np.minimum(np.searchsorted(av[:seen.max()], ns, side="right"), seen) - 1
            none = seen == 0
            if none.any():
                lost = none if lost is None else lost | none
            np.maximum(i, 0, out=i)
            ns = ns + off[i]
        if lost is not None:
            ns[lost] = np.iinfo(np.int64).min
        return ns


def _clock_key(clock_id: int, srank: int) -> int:
    """Sequence-scoped clocks (64..127) are distinct per sequence."""
    if 64 <= clock_id <= 127:
        return ((srank + 1) << 8) | clock_id
    return clock_id


# --------------------------------------------------------------------------------------------
# The decoder
# --------------------------------------------------------------------------------------------

_UNITS = {v: k for k, v in w.COUNTER_UNITS.items()}  # CounterDescriptor.Unit -> name


def utf8_at(buf: np.ndarray, off: int, ln: int) -> str:
    return buf[off : off + ln].tobytes().decode("utf-8", "replace")


class State:
    """Rare packets decoded in file order: descriptors, defaults, interning, snapshots."""

    def __init__(self, buf, rare, srank, gen, stats, files=None):
        pb = trace_pb2()
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
                    file = 0 if files is None else int(files[pkt])
                    if self.clocks.add(pkt, clocks, cs.primary_trace_clock, file):
                        self.snapshot_pkts.append(pkt)
            except Exception:  # a corrupt message: count it, never fail the load
                stats["corrupt_messages"] = stats.get("corrupt_messages", 0) + 1
        if self.clocks.invalid:
            stats["invalid_clock_snapshots"] = self.clocks.invalid
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
            t.name = to_str(d.name)
        elif d.HasField("static_name"):
            t.name = to_str(d.static_name)
        if d.HasField("parent_uuid"):
            p = d.parent_uuid
            t.parent_uuid = p if p < (1 << 63) else p - (1 << 64)
        if d.HasField("thread"):
            t.kind, t.pid, t.tid = "thread", d.thread.pid, d.thread.tid
            if d.thread.HasField("thread_name"):
                t.thread_name = to_str(d.thread.thread_name)
        elif d.HasField("process"):
            t.kind, t.pid = "process", d.process.pid
            if d.process.HasField("process_name"):
                t.process_name = to_str(d.process.process_name)
        elif d.HasField("counter"):
            c = d.counter
            t.kind = "counter"
            t.unit = to_str(c.unit_name) or _UNITS.get(c.unit)
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


def _packet_clocks(clk: np.ndarray, gen: np.ndarray, srank: np.ndarray, st: State) -> np.ndarray:
    """Each packet's clock key (int64): its own clock id, else (0) the clock of the last
    defaults packet of its generation at or before it, else 0; sequence-scoped clocks (64..127)
    made distinct per sequence as _clock_key does."""
    clock = clk.astype(np.int64)
    def_gen = gen[st.def_pkt]
    if loops.native is not None and _owner_walk(loops.native.packet_clocks, def_gen, st.def_pkt,
                                          (st.def_clock, gen, srank), clock):
        return clock  # one pass (else, defaults out of packet order: numpy, clock untouched)
    if len(st.def_pkt):
        need = np.flatnonzero(clock == 0)
        d = lookup_last(def_gen, st.def_pkt, gen[need], need, len(clock))
        clock[need] = np.where(d >= 0, st.def_clock[np.maximum(d, 0)], 0)
        del need, d
    seqclk = (clock >= 64) & (clock <= 127)
    if seqclk.any():
        clock[seqclk] |= (srank[seqclk] + 1) << 8
    return clock


def resolve_timestamps(P: Acc, st: State, srank, gen, skip, stats) -> np.ndarray:
    """Trace-clock timestamp of every packet (INT64_MIN where it cannot be resolved).

    The packet columns ts / has_ts / clk are taken out of ``P`` (the result reuses ts).
    """
    n = len(skip)
    lo = np.iinfo(np.int64).min
    out, has_ts = P.pop("ts"), P.pop("has_ts", bool)
    clock = _packet_clocks(P.pop("clk"), gen, srank, st)
    elig = has_ts & ~skip
    elig[st.snapshot_pkts] = False
    # group the eligible packets by clock: rank the (long) runs of equal clocks, radix sort
    idx_all = np.flatnonzero(elig)
    ce = clock[idx_all]
    del clock
    heads = np.flatnonzero(np.r_[True, ce[1:] != ce[:-1]]) if len(ce) else np.zeros(0, int)
    ukeys, hrank = np.unique(ce[heads], return_inverse=True)
    del ce
    if len(ukeys) != 1:
        rank = np.repeat(hrank.astype(np.uint16 if len(ukeys) < (1 << 16) else np.int64),
                         np.diff(np.r_[heads, len(idx_all)]))
        order = np.argsort(rank, kind="stable")
        bounds = np.r_[0, np.cumsum(np.bincount(rank, minlength=len(ukeys)))]
        del rank
    else:  # one clock (the usual case): its packets are all of them, in order
        order, bounds = None, np.array([0, len(idx_all)])
    del heads, hrank
    done = np.zeros(n, bool)
    failed = 0
    for key, b0, b1 in zip(ukeys.tolist(), bounds[:-1].tolist(), bounds[1:].tolist(),
                           strict=True):
        idx = idx_all if order is None else idx_all[order[b0:b1]]
        mult = st.clocks.multiplier.get(key, 1)
        raw = out[idx]
        if mult != 1:
            raw *= mult
        if st.clocks.incremental.get(key, False):
            anc = st.clocks.anchors[key]
            apkt = np.array([a for a, _ in anc], np.int64)
            aval = np.array([v for _, v in anc], np.int64)
            # idx is in packet order: anchor k's run of packets starts at start[k] (up to the
            # next run); anchors after the last packet have none
            start = np.searchsorted(idx, apkt, side="left")
            if start[0]:  # packets before the first anchor have no value to add to
                failed += int(start[0])
                idx, raw = idx[start[0]:], raw[start[0]:]
                start -= start[0]
            some = start < len(idx)
            ns = _cumsum_runs(raw, start[some], aval[some])
            del raw, start, some
        elif 64 <= (key & 0xFF) <= 127 and key > 0xFF and key not in st.clocks.multiplier:
            failed += len(idx)  # a sequence clock never declared by a snapshot
            continue
        else:
            ns = raw
        conv = st.clocks.convert(key, ns, idx)
        del ns
        ok = conv != lo
        if not ok.all():
            failed += int((~ok).sum())
            idx, conv = idx[ok], conv[ok]
        out[idx] = conv
        done[idx] = True
        del conv, idx
    del order, idx_all
    out[~done] = lo
    if failed:
        stats["clock_sync_failure"] = failed
    # packets without a timestamp take the latest timestamp seen so far (as trace processor)
    notime = ~has_ts & ~skip
    if notime.any():
        sel = np.flatnonzero(notime)
        latest = np.maximum.accumulate(out)[sel]
        latest[latest == lo] = 0
        out[sel] = latest
    return out
