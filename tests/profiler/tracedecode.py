"""Test helper: the profiler's view of a trace (processes, slices, instants, counters), built on
the shared official-schema decoder ``perfetto_decode`` (which resolves interning and clocks).

Timestamps are resolved to CLOCK_MONOTONIC ns: REALTIME/BOOTTIME-based sequences go through the
file's global ClockSnapshots (the first one listing the clock; merged files carry one per rank).
"""

from __future__ import annotations

import dataclasses

import perfetto_decode

MONO = 3


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
    return perfetto_decode.packets_of(open(path, "rb").read())


def decode(path) -> Decoded:
    d = perfetto_decode.decode(str(path))

    def to_mono(clock: int, value: int) -> int:
        if clock == MONO:
            return value
        for snap in d.snapshots:
            if clock in snap and MONO in snap:
                return value - snap[clock] + snap[MONO]
        raise AssertionError(f"no snapshot relates clock {clock} to MONOTONIC")

    slices, instants, counters, stacks = [], [], {}, {}
    # as trace processor: events sorted by time (file order at equal times), then nested per
    # track, so a begin written late (another sequence, a later batch) nests where it belongs
    for ts, e in sorted(((to_mono(e.clock, e.ts), e) for e in d.events), key=lambda p: p[0]):
        cat = ",".join(e.categories)
        if e.type == "B":
            s = Slice(e.name or "", cat, ts, None, e.track, dict(e.args), e.seq)
            stacks.setdefault(e.track, []).append(s)
            slices.append(s)
        elif e.type == "E":
            open_slices = stacks.get(e.track)
            if open_slices:
                s = open_slices.pop()
                s.dur = ts - s.ts
                s.args.update(e.args)  # trace processor merges end-event args into the slice
        elif e.type == "I":
            instants.append(Slice(e.name or "", cat, ts, 0, e.track, dict(e.args), e.seq))
        else:
            td = d.tracks.get(e.track)
            counters.setdefault(td.name if td else e.track, []).append((ts, e.value))
    processes = {t.process.pid: t.process.process_name for t in d.tracks.values()
                 if t.HasField("process")}
    return Decoded(d.packets, processes, d.tracks, slices, instants, counters, d.sequences,
                   d.snapshots)
