"""The suite's trace check (tracecheck.py) finds what trace processor rejects."""

from __future__ import annotations

import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

import stepscope
from tracecheck import problems


def _snap(p, boot, mono):
    p.clock_snapshot.clocks.add(clock_id=6, timestamp=boot)
    p.clock_snapshot.clocks.add(clock_id=3, timestamp=mono)


@pytest.mark.rejected_trace_ok
def test_finds_snapshots_going_back_and_negative_times(tmp_path):
    t = pb.Trace()
    _snap(t.packet.add(), 1_000, 900)
    _snap(t.packet.add(), 2_000, 800)  # MONOTONIC back
    _snap(t.packet.add(), 1_500, 1_950)  # BOOTTIME back: refused
    p = t.packet.add(trusted_packet_sequence_id=1)
    p.track_descriptor.uuid = 5
    p.track_descriptor.name = "t"
    for ts in (-3, 10):  # BOOTTIME is the trace clock: -3 is dropped
        e = t.packet.add(timestamp=ts & ((1 << 64) - 1), trusted_packet_sequence_id=1)
        e.track_event.type = pb.TrackEvent.TYPE_INSTANT
        e.track_event.track_uuid = 5
        e.track_event.name = "x"
    path = tmp_path / "bad.pftrace"
    path.write_bytes(t.SerializeToString())
    assert problems(path) == [
        "snapshot 1: clock 3 goes back (800 < 900)",
        "snapshot 2: clock 6 goes back (1500 < 2000)",
        "track_event_invalid_timestamp: 1",
        "invalid_clock_snapshots: 1",
    ]


def test_a_written_trace_passes(tmp_path):
    path = tmp_path / "ok.pftrace"
    with stepscope.trace(path):
        with stepscope.annotate("x"):
            pass
    assert problems(path) == []
