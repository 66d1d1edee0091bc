"""The suite's trace check (tracecheck.py) finds what trace processor rejects."""

from __future__ import annotations

import os
import tracemalloc
import zlib

import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

import stepscope
from stepscope import _inflate
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


def _batch(*packets) -> bytes:
    return zlib.compress(b"".join(_field1(p.SerializeToString()) for p in packets), 1)


def _field1(payload: bytes) -> bytes:
    return pb.Trace(packet=[pb.TracePacket.FromString(payload)]).SerializeToString()


@pytest.mark.rejected_trace_ok
def test_checks_what_follows_a_damaged_batch_and_a_cut_packet(tmp_path):
    """One damaged batch (and a cut packet at the end) does not hide the rest from the check."""
    first, later = pb.TracePacket(), pb.TracePacket()
    _snap(first, 1_000, 900)
    _snap(later, 500, 950)  # BOOTTIME back
    good = _batch(later)
    bad = bytearray(_batch(first))
    bad[len(bad) // 2] ^= 0xFF
    t = pb.Trace()
    t.packet.add(compressed_packets=bytes(bad))
    t.packet.add().CopyFrom(first)
    t.packet.add(compressed_packets=good)
    path = tmp_path / "damaged.pftrace"
    path.write_bytes(t.SerializeToString() + b"\x0a\x40\x01")  # a packet cut short
    assert problems(path)[:1] == ["snapshot 1: clock 6 goes back (500 < 1000)"]


@pytest.mark.rejected_trace_ok
def test_a_bomb_is_inflated_within_bounds(tmp_path):
    """A 512 MiB batch of one packet tag then zeros: never held whole (the check is bounded)."""
    z = zlib.compressobj(9)
    parts = [z.compress(b"\x0a")]
    block = bytes(16 << 20)
    parts += [z.compress(block) for _ in range(32)]
    parts.append(z.flush())
    t = pb.Trace()
    t.packet.add(compressed_packets=b"".join(parts))
    path = tmp_path / "bomb.pftrace"
    path.write_bytes(t.SerializeToString())
    del block, parts
    tracemalloc.start()
    try:
        problems(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    limit = _inflate.Budget(os.path.getsize(path)).batch_limit(os.path.getsize(path))
    assert peak < limit + (64 << 20) < (512 << 20)
