"""The GPU tests' view of a written trace: events and paired slices with their flows, built on
the shared official-schema decoder ``perfetto_decode`` (no trace processor needed here)."""

from __future__ import annotations

from dataclasses import dataclass, field

import perfetto_decode

TYPE_BEGIN, TYPE_END, TYPE_INSTANT, TYPE_COUNTER = 1, 2, 3, 4
_TYPES = {"B": TYPE_BEGIN, "E": TYPE_END, "I": TYPE_INSTANT, "C": TYPE_COUNTER}


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
    tracks: dict = field(default_factory=dict)
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


def decode(path) -> Decoded:
    d = perfetto_decode.decode(str(path))
    out = Decoded(tracks=d.tracks)
    out.events = [Event(e.ts, e.clock, _TYPES[e.type], e.track, e.name, list(e.categories),
                        e.args, list(e.flows), list(e.tflows), e.value) for e in d.events]
    # pair begins and ends per track (strict nesting, as trace processor requires)
    stacks: dict[int, list[Event]] = {}
    for e in sorted(out.events, key=lambda e: e.ts):  # stable: file order within a timestamp
        if e.type == TYPE_BEGIN:
            stacks.setdefault(e.track, []).append(e)
        elif e.type == TYPE_END:
            b = stacks[e.track].pop()
            out.slices.append(Slice(b.ts, e.ts - b.ts, b.clock, b.track, b.name,
                                    ",".join(b.categories), b.args, b.flow_ids,
                                    b.terminating_flow_ids))
    assert all(not s for s in stacks.values()), "unterminated slices"
    return out
