"""Test helper: decode a stepscope/Perfetto trace with the official ``perfetto_trace_pb2`` and
resolve what trace processor would show (processes, threads, slices, counters, times).

Timestamps are resolved to CLOCK_MONOTONIC ns: sequence-scoped incremental clocks (64..127) are
followed from their sequence's ClockSnapshot; REALTIME/BOOTTIME go through the file's global
ClockSnapshot (the first one listing them, or the one of the same process for merged files).
"""

from __future__ import annotations

import dataclasses
import zlib

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

MONO, REAL, BOOT = 3, 1, 6


@dataclasses.dataclass
class Slice:
    name: str
    category: str
    ts: int
    dur: int | None
    track: int
    args: dict
    seq: int


@dataclasses.dataclass
class Decoded:
    packets: list
    processes: dict  # pid -> name
    tracks: dict  # uuid -> TrackDescriptor
    slices: list
    instants: list
    counters: dict  # track name -> [(ts, value)]
    seq_ids: set
    snapshots: list

    def track_pid(self, uuid: int) -> int | None:
        seen = set()
        while uuid in self.tracks and uuid not in seen:
            seen.add(uuid)
            td = self.tracks[uuid]
            if td.HasField("process"):
                return td.process.pid
            if td.HasField("thread"):
                return td.thread.pid
            uuid = td.parent_uuid
        return None

    def thread_name(self, uuid: int) -> str | None:
        td = self.tracks.get(uuid)
        return td.thread.thread_name if td is not None and td.HasField("thread") else None

    def by_category(self, cat: str) -> list:
        return [s for s in self.slices if s.category == cat]


def packets(path) -> list:
    trace = pb.Trace()
    with open(path, "rb") as f:
        trace.ParseFromString(f.read())
    out = []
    for p in trace.packet:
        if p.HasField("compressed_packets"):
            inner = pb.Trace()
            inner.ParseFromString(zlib.decompress(p.compressed_packets))
            out.extend(inner.packet)
        else:
            out.append(p)
    return out


def _ann_value(a):
    for f in ("int_value", "double_value", "string_value", "bool_value", "uint_value"):
        if a.HasField(f):
            return getattr(a, f)
    return None


def decode(path) -> Decoded:
    pkts = packets(path)
    tracks, processes = {}, {}
    slices, instants, counters = [], [], {}
    names, cats, ann_names = {}, {}, {}  # seq -> {iid: str}
    defaults = {}  # seq -> (clock id, track uuid)
    seq_clock = {}  # seq -> {clock_id: (base value, ref clock, ref value, incremental, last)}
    globals_ = []
    stacks = {}  # track -> [Slice]
    seqs = set()

    def to_mono(clock, value):
        if clock == MONO:
            return value
        for snap in globals_:
            if clock in snap and MONO in snap:
                return value - snap[clock] + snap[MONO]
        raise AssertionError(f"no snapshot relates clock {clock} to MONOTONIC")

    for p in pkts:
        seq = p.trusted_packet_sequence_id
        seqs.add(seq)
        if p.sequence_flags & 1:  # incremental state cleared
            names[seq], cats[seq], ann_names[seq] = {}, {}, {}
        if p.HasField("trace_packet_defaults"):
            d = p.trace_packet_defaults
            defaults[seq] = (d.timestamp_clock_id or BOOT, d.track_event_defaults.track_uuid)
        if p.HasField("interned_data"):
            i = p.interned_data
            names.setdefault(seq, {}).update({e.iid: e.name for e in i.event_names})
            cats.setdefault(seq, {}).update({e.iid: e.name for e in i.event_categories})
            ann_names.setdefault(seq, {}).update({e.iid: e.name for e in i.debug_annotation_names})
        if p.HasField("clock_snapshot"):
            clocks = {c.clock_id: c for c in p.clock_snapshot.clocks}
            scoped = [c for c in clocks if 64 <= c < 128]
            if scoped:
                ref = next(c for c in clocks if c < 64)
                for c in scoped:
                    seq_clock.setdefault(seq, {})[c] = [
                        clocks[c].timestamp, ref, clocks[ref].timestamp, clocks[c].is_incremental,
                        None]
            else:
                globals_.append({c: v.timestamp for c, v in clocks.items()})
        if p.HasField("track_descriptor"):
            td = p.track_descriptor
            tracks[td.uuid] = td
            if td.HasField("process"):
                processes[td.process.pid] = td.process.process_name
        if not p.HasField("track_event"):
            continue
        clock = p.timestamp_clock_id if p.HasField("timestamp_clock_id") else defaults.get(
            seq, (BOOT, 0))[0]
        if 64 <= clock < 128:
            st = seq_clock[seq][clock]
            if st[3]:
                st[4] = (st[0] if st[4] is None else st[4]) + p.timestamp
                raw = st[4]
            else:
                raw = p.timestamp
            ts = to_mono(st[1], raw - st[0] + st[2])
        else:
            ts = to_mono(clock, p.timestamp)
        ev = p.track_event
        track = ev.track_uuid if ev.HasField("track_uuid") else defaults.get(seq, (0, 0))[1]
        name = ev.name if ev.HasField("name") else names.get(seq, {}).get(ev.name_iid, "")
        cat = ",".join(list(ev.categories) + [cats.get(seq, {}).get(i, "?")
                                              for i in ev.category_iids])
        args = {}
        for a in ev.debug_annotations:
            key = a.name if a.HasField("name") else ann_names.get(seq, {}).get(a.name_iid)
            args[key] = _ann_value(a)
        t = ev.type
        if t == pb.TrackEvent.TYPE_SLICE_BEGIN:
            s = Slice(name, cat, ts, None, track, args, seq)
            stacks.setdefault(track, []).append(s)
            slices.append(s)
        elif t == pb.TrackEvent.TYPE_SLICE_END:
            st = stacks.get(track)
            if st:
                s = st.pop()
                s.dur = ts - s.ts
                s.args.update(args)  # trace processor merges end-event args into the slice
        elif t == pb.TrackEvent.TYPE_INSTANT:
            instants.append(Slice(name, cat, ts, 0, track, args, seq))
        elif t == pb.TrackEvent.TYPE_COUNTER:
            td = tracks.get(track)
            value = ev.double_counter_value if ev.HasField("double_counter_value") else \
                ev.counter_value
            counters.setdefault(td.name if td else track, []).append((ts, value))
    return Decoded(pkts, processes, tracks, slices, instants, counters, seqs, globals_)
