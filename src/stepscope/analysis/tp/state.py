"""Per-sequence state decoded in file order: descriptors, defaults, interning, clocks.

Follows trace processor: ``SEQ_INCREMENTAL_STATE_CLEARED`` starts a new generation of interned
data and ``TracePacketDefaults``; packets needing incremental state before the first clear are
skipped. Timestamps are in ``timestamp_clock_id`` (or the defaults' clock, or the trace clock);
sequence-scoped clocks (64..127) declared ``is_incremental`` accumulate deltas from the value a
``ClockSnapshot`` of that sequence gave them, scaled by ``unit_multiplier_ns``; then each
timestamp is converted to the trace clock (BOOTTIME unless ``primary_trace_clock`` says
otherwise) hop by hop along the clock graph the snapshots build, each hop using the snapshot with
the largest source value <= the timestamp (the first snapshot for earlier ones).
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
    """Clock snapshots and conversion to the trace clock, as trace processor's ClockTracker."""

    def __init__(self) -> None:
        self.snapshots: list[dict[int, int]] = []
        # clock sets of the snapshots (>= 2 clocks), as an insertion-ordered set: the order
        # decides which of equally short paths path() finds, so keep it as first seen
        self.groups: dict[frozenset, None] = {}
        self.incremental: dict[int, bool] = {}
        self.multiplier: dict[int, int] = {}
        self.anchors: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.trace_clock: int | None = None
        self._paths: dict[int, list | None] = {}
        self.last: dict[frozenset, dict[int, int]] = {}  # clock set -> its last snapshot
        self.invalid = 0  # snapshots refused (trace processor's invalid_clock_snapshots)
        self.non_monotonic: set[int] = set()  # clocks that went back: never a hop's source

    def add(self, pkt: int, clocks: list[tuple[int, int, int, bool]], primary: int) -> bool:
        """Take one snapshot, or refuse it as trace processor's ClockSynchronizer does: when
        its trace clock reads less than in the last snapshot of the same clock set (counted in
        ``invalid``). Another clock that goes back is kept as a target but no longer converts
        from (``non_monotonic``). Returns whether the snapshot was taken."""
        snap = {ck: ts * mult for ck, ts, mult, _ in clocks}
        group = frozenset(snap)
        tc = primary or self.trace_clock or BOOTTIME
        last = self.last.get(group)
        if last is not None and tc in snap and snap[tc] < last[tc]:
            self.invalid += 1
            return False
        if last is not None:
            self.non_monotonic.update(ck for ck, ns in snap.items() if ns < last[ck])
        self.last[group] = snap
        for ck, ts, mult, incr in clocks:
            self.multiplier[ck] = mult
            self.incremental[ck] = incr
            if incr:
                self.anchors[ck].append((pkt, ts * mult))
        if primary:
            self.trace_clock = primary
        elif BOOTTIME in snap and self.trace_clock is None:
            self.trace_clock = BOOTTIME
        if len(snap) >= 2:
            self.groups[group] = None  # a known key keeps its place
        self.snapshots.append(snap)
        return True

    def path(self, src: int) -> list | None:
        """Hops (a, b) from ``src`` to the trace clock, breadth first."""
        if src in self._paths:
            return self._paths[src]
        dst = self.trace_clock
        prev: dict[int, int | None] = {src: None}
        frontier = [src]
        while frontier and dst not in prev:
            nxt = []
            for a in frontier:
                if a in self.non_monotonic:
                    continue
                for grp in self.groups:
                    if a not in grp:
                        continue
                    for b in grp:
                        if b not in prev:
                            prev[b] = a
                            nxt.append(b)
            frontier = nxt
        if dst not in prev:
            self._paths[src] = None
            return None
        hops = []
        c = dst
        while prev[c] is not None:
            a = prev[c]
            hops.append((a, c))
            c = a
        self._paths[src] = hops[::-1]
        return self._paths[src]

    def convert(self, src: int, ns: np.ndarray) -> np.ndarray | None:
        if self.trace_clock is None or src == self.trace_clock or src == 0:
            return ns
        hops = self.path(src)
        if hops is None:
            return None
        for a, b in hops:
            # every snapshot that has both clocks, whatever else it lists (as trace processor)
            snaps = [snap for snap in self.snapshots if a in snap and b in snap]
            av = np.array([s[a] for s in snaps], np.int64)
            bv = np.array([s[b] for s in snaps], np.int64)
            order = np.argsort(av, kind="stable")
            av, bv = av[order], bv[order]
            off = bv - av
            if len(off) == 1 or (off == off[0]).all():  # one offset for every timestamp
                ns = ns + off[0]
                continue
            i = np.searchsorted(av, ns, side="right")
            i -= 1
            np.maximum(i, 0, out=i)
            ns = ns + off[i]
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

    def __init__(self, buf, rare, srank, gen, stats):
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
                    if self.clocks.add(pkt, clocks, cs.primary_trace_clock):
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
        conv = st.clocks.convert(key, ns)
        del ns
        if conv is None:
            failed += len(idx)
            continue
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
