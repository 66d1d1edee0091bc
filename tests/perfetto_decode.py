"""An independent reading of a trace file through the official ``perfetto_trace_pb2`` schema.

Tests use this (not stepscope's own importer) as the judge of what the writer wrote: it parses
every packet with the official classes, inflates ``compressed_packets``, follows each sequence's
interning and incremental clock exactly as documented, and returns plain Python structures.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

TYPE_NAMES = {1: "B", 2: "E", 3: "I", 4: "C"}


@dataclass
class Event:
    ts: int  # in the sequence's base clock (MONOTONIC for host events)
    type: str  # B, E, I, C
    track: int
    name: str | None = None
    categories: tuple = ()
    args: dict = field(default_factory=dict)
    flows: tuple = ()
    tflows: tuple = ()
    value: float | None = None
    seq: int = 0
    clock: int = 0
    srcloc: tuple | None = None


@dataclass
class Decoded:
    packets: list
    tracks: dict  # uuid -> TrackDescriptor
    events: list  # Event, in file order
    snapshots: list  # [{clock_id: ts}]
    sequences: set

    def by_track(self, uuid: int) -> list[Event]:
        return [e for e in self.events if e.track == uuid]

    def thread_track(self, name: str) -> int:
        for uuid, d in self.tracks.items():
            if d.HasField("thread") and d.thread.thread_name == name:
                return uuid
        raise KeyError(name)

    def track_named(self, name: str) -> int:
        for uuid, d in self.tracks.items():
            if d.name == name:
                return uuid
        raise KeyError(name)

    def slices(self, uuid: int) -> list[tuple[str, int, int, int]]:
        """(name, depth, begin ts, end ts) of the slices on a track, by begin time."""
        out, stack = [], []
        for e in sorted(self.by_track(uuid), key=lambda e: e.ts):  # stable: file order at ties
            if e.type == "B":
                stack.append((e.name, len(stack), e.ts))
            elif e.type == "E":
                name, depth, t0 = stack.pop()
                out.append((name, depth, t0, e.ts))
        assert not stack, f"unterminated slices: {stack}"
        return sorted(out, key=lambda s: (s[2], s[1]))


def _value(a) -> object:
    kind = a.WhichOneof("value")
    if kind is None:
        if a.dict_entries:
            return {d.name: _value(d) for d in a.dict_entries}
        if a.array_values:
            return [_value(v) for v in a.array_values]
        return None
    return getattr(a, kind)


def packets_of(data: bytes) -> list:
    trace = pb.Trace()
    trace.ParseFromString(data)
    out = []
    for p in trace.packet:
        if p.HasField("compressed_packets"):
            inner = pb.Trace()
            inner.ParseFromString(zlib.decompress(p.compressed_packets))
            out.extend(inner.packet)
        else:
            out.append(p)
    return out


def decode(path_or_bytes) -> Decoded:
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else open(path_or_bytes, "rb").read()
    packets = packets_of(data)
    tracks, events, snapshots, seqs = {}, [], [], set()
    state: dict[int, dict] = {}
    for p in packets:
        sid = p.trusted_packet_sequence_id
        seqs.add(sid)
        st = state.setdefault(sid, {"names": {}, "cats": {}, "args": {}, "locs": {},
                                     "clock": None, "last": 0, "defaults": None})
        if p.sequence_flags & 1:
            st.update(names={}, cats={}, args={}, locs={}, clock=None, last=0, defaults=None)
        if p.HasField("trace_packet_defaults"):
            st["defaults"] = p.trace_packet_defaults
        if p.HasField("interned_data"):
            i = p.interned_data
            st["names"].update({e.iid: e.name for e in i.event_names})
            st["cats"].update({e.iid: e.name for e in i.event_categories})
            st["args"].update({e.iid: e.name for e in i.debug_annotation_names})
            st["locs"].update({e.iid: (e.file_name, e.function_name, e.line_number)
                               for e in i.source_locations})
        if p.HasField("clock_snapshot"):
            clocks = {c.clock_id: c.timestamp for c in p.clock_snapshot.clocks}
            inc = [c for c in p.clock_snapshot.clocks if c.is_incremental]
            if inc:  # a sequence-scoped incremental clock, anchored to one base clock
                base = [c for c in p.clock_snapshot.clocks if not c.is_incremental]
                assert len(base) == 1
                st["clock"] = (inc[0].clock_id, base[0].clock_id,
                               base[0].timestamp - inc[0].timestamp)
                st["last"] = inc[0].timestamp
            else:
                snapshots.append(clocks)
        if p.HasField("track_descriptor"):
            tracks[p.track_descriptor.uuid] = p.track_descriptor
        if p.HasField("track_event"):
            te = p.track_event
            d = st["defaults"]
            clock_id = p.timestamp_clock_id if p.HasField("timestamp_clock_id") else (
                d.timestamp_clock_id if d is not None else 6)
            if st["clock"] is not None and clock_id == st["clock"][0]:
                st["last"] += p.timestamp
                ts, base_clock = st["last"] + st["clock"][2], st["clock"][1]
            else:
                ts, base_clock = p.timestamp, clock_id
            track = te.track_uuid if te.HasField("track_uuid") else (
                d.track_event_defaults.track_uuid if d is not None else 0)
            value = None
            if te.HasField("counter_value"):
                value = te.counter_value
            elif te.HasField("double_counter_value"):
                value = te.double_counter_value
            events.append(Event(
                ts=ts, type=TYPE_NAMES[te.type], track=track,
                name=st["names"][te.name_iid] if te.name_iid else (te.name or None),
                categories=tuple(st["cats"][c] for c in te.category_iids) + tuple(te.categories),
                args={st["args"][a.name_iid] if a.name_iid else a.name: _value(a)
                      for a in te.debug_annotations},
                flows=tuple(te.flow_ids), tflows=tuple(te.terminating_flow_ids), value=value,
                seq=sid, clock=base_clock,
                srcloc=st["locs"].get(te.source_location_iid) if te.source_location_iid else None,
            ))
    return Decoded(packets, tracks, events, snapshots, seqs)
