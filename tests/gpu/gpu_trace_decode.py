"""Decode a written trace with Perfetto's official protos (no trace processor needed here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

TYPE_BEGIN = pb.TrackEvent.TYPE_SLICE_BEGIN
TYPE_END = pb.TrackEvent.TYPE_SLICE_END
TYPE_INSTANT = pb.TrackEvent.TYPE_INSTANT
TYPE_COUNTER = pb.TrackEvent.TYPE_COUNTER


@dataclass
class Event:
    ts: int  # absolute, in the sequence's base clock
    clock: int  # builtin clock id of that base (1 REALTIME, 3 MONOTONIC, 6 BOOTTIME)
    type: int
    track: int
    name: str | None
    categories: list[str]
    args: dict
    flow_ids: list[int]
    terminating_flow_ids: list[int]
    value: float | None


@dataclass
class Slice:
    ts: int
    dur: int
    clock: int
    track: int
    name: str
    category: str
    args: dict
    flow_ids: list[int]
    terminating_flow_ids: list[int]


@dataclass
class Decoded:
    tracks: dict[int, pb.TrackDescriptor] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    slices: list[Slice] = field(default_factory=list)

    def track_name(self, uuid: int) -> str:
        td = self.tracks[uuid]
        if td.HasField("thread"):
            return td.thread.thread_name
        if td.HasField("process"):
            return td.process.process_name
        return td.name

    def tracks_named(self, name: str) -> list[int]:
        return [u for u in self.tracks if self.track_name(u) == name]

    def counter(self, name: str) -> list[tuple[int, float]]:
        (uuid,) = self.tracks_named(name)
        return [(e.ts, e.value) for e in self.events if e.type == TYPE_COUNTER and e.track == uuid]


def _packets(data: bytes):
    trace = pb.Trace.FromString(data)
    for p in trace.packet:
        if p.HasField("compressed_packets"):
            import zlib

            yield from _packets(zlib.decompress(p.compressed_packets))
        else:
            yield p


def _arg(da, names) -> tuple[str, object]:
    name = names.get(da.name_iid) if da.HasField("name_iid") else da.name
    for f in ("int_value", "uint_value", "double_value", "string_value", "bool_value"):
        if da.HasField(f):
            return name, getattr(da, f)
    return name, None


def decode(path) -> Decoded:
    out = Decoded()
    seqs: dict[int, dict] = {}
    with open(path, "rb") as f:
        data = f.read()
    for p in _packets(data):
        if p.HasField("track_descriptor"):
            out.tracks[p.track_descriptor.uuid] = p.track_descriptor
        sid = p.trusted_packet_sequence_id
        st = seqs.setdefault(
            sid, {"names": {}, "cats": {}, "args": {}, "base": None, "ts": 0, "track": None}
        )
        if p.sequence_flags & 1:
            st.update(names={}, cats={}, args={})
        if p.HasField("trace_packet_defaults"):
            d = p.trace_packet_defaults
            if d.HasField("track_event_defaults"):
                st["track"] = d.track_event_defaults.track_uuid
        if p.HasField("clock_snapshot") and sid:
            for c in p.clock_snapshot.clocks:
                if c.clock_id == 64:
                    st["ts"] = c.timestamp
                else:
                    st["base"] = c.clock_id
        if p.HasField("interned_data"):
            i = p.interned_data
            st["names"].update({e.iid: e.name for e in i.event_names})
            st["cats"].update({e.iid: e.name for e in i.event_categories})
            st["args"].update({e.iid: e.name for e in i.debug_annotation_names})
        if p.HasField("track_event"):
            te = p.track_event
            st["ts"] += p.timestamp
            name = (
                st["names"].get(te.name_iid)
                if te.HasField("name_iid")
                else (te.name if te.HasField("name") else None)
            )
            cats = [st["cats"][c] for c in te.category_iids] + list(te.categories)
            args = dict(_arg(da, st["args"]) for da in te.debug_annotations)
            value = None
            if te.HasField("counter_value"):
                value = te.counter_value
            elif te.HasField("double_counter_value"):
                value = te.double_counter_value
            track = te.track_uuid if te.HasField("track_uuid") else st["track"]
            out.events.append(
                Event(
                    st["ts"],
                    st["base"],
                    te.type,
                    track,
                    name,
                    cats,
                    args,
                    list(te.flow_ids),
                    list(te.terminating_flow_ids),
                    value,
                )
            )
    # pair begins and ends per track (strict nesting, as trace processor requires)
    stacks: dict[int, list[Event]] = {}
    for e in sorted(out.events, key=lambda e: e.ts):  # stable: file order within a timestamp
        if e.type == TYPE_BEGIN:
            stacks.setdefault(e.track, []).append(e)
        elif e.type == TYPE_END:
            b = stacks[e.track].pop()
            out.slices.append(
                Slice(
                    b.ts,
                    e.ts - b.ts,
                    b.clock,
                    b.track,
                    b.name,
                    ",".join(b.categories),
                    b.args,
                    b.flow_ids,
                    b.terminating_flow_ids,
                )
            )
    assert all(not s for s in stacks.values()), "unterminated slices"
    return out
