"""Merge on hand-built traces (no writer needed): sequence ids, compressed batches, clocks."""

import os
import stat
import zlib

import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
from tracedecode import decode

from stepscope.analysis import merge as M

S = 1_000_000_000


def _snapshot(boot, mono, real):
    p = pb.TracePacket()
    p.clock_snapshot.clocks.add(clock_id=6, timestamp=boot)
    p.clock_snapshot.clocks.add(clock_id=3, timestamp=mono)
    p.clock_snapshot.clocks.add(clock_id=1, timestamp=real)
    return p


def _trace(path, rank, host, pid, mono0, real0, events, compress=True, boot_off=7 * S,
           mono_end=None):
    """One rank: process+thread tracks, a global snapshot (BOOTTIME = MONOTONIC + boot_off),
    one sequence (id 1, like every rank) whose clock 64 is incremental against MONOTONIC;
    events = [(mono ns, 'B'|'E', name)]; with ``mono_end`` a last global snapshot then, as
    the writer takes one when it closes a file."""
    pkts = [_snapshot(mono0 + boot_off, mono0, real0)]
    p = pb.TracePacket()
    p.track_descriptor.uuid = 1000 + rank
    p.track_descriptor.process.pid = pid
    p.track_descriptor.process.process_name = f"rank {rank} ({host})"
    pkts.append(p)
    p = pb.TracePacket()
    p.track_descriptor.uuid = 2000 + rank
    p.track_descriptor.parent_uuid = 1000 + rank
    p.track_descriptor.thread.pid = pid
    p.track_descriptor.thread.tid = pid + 1
    p.track_descriptor.thread.thread_name = "main"
    pkts.append(p)
    body = []
    first = pb.TracePacket()
    first.trusted_packet_sequence_id = 1
    first.sequence_flags = 3
    first.trace_packet_defaults.timestamp_clock_id = 64
    first.trace_packet_defaults.track_event_defaults.track_uuid = 2000 + rank
    first.clock_snapshot.clocks.add(clock_id=64, timestamp=0, is_incremental=True)
    first.clock_snapshot.clocks.add(clock_id=3, timestamp=mono0)
    first.interned_data.event_names.add(iid=1, name="step 0")
    body.append(first)
    last = mono0
    for ts, kind, _name in events:
        e = pb.TracePacket()
        e.trusted_packet_sequence_id = 1
        e.sequence_flags = 2
        e.timestamp = ts - last
        last = ts
        if kind == "B":
            e.track_event.type = pb.TrackEvent.TYPE_SLICE_BEGIN
            e.track_event.name_iid = 1
        else:
            e.track_event.type = pb.TrackEvent.TYPE_SLICE_END
        body.append(e)
    if compress:
        inner = pb.Trace(packet=body).SerializeToString()
        c = pb.TracePacket()
        c.compressed_packets = zlib.compress(inner)
        pkts.append(c)
    else:
        pkts.extend(body)
    if mono_end is not None:
        pkts.append(_snapshot(mono_end + boot_off, mono_end, real0 + mono_end - mono0))
    with open(path, "wb") as f:
        f.write(pb.Trace(packet=pkts).SerializeToString())


def test_same_host_sequence_ids_unique_and_times_kept(tmp_path):
    for r in range(3):
        _trace(tmp_path / f"rank{r}.summary.pftrace", r, "h", 100 + r, 50 * S, 9000 * S,
               [(51 * S + r, "B", "step 0"), (52 * S + r, "E", "")], compress=r != 1)
    res = M.merge([tmp_path], tmp_path / "out.pftrace")
    assert res.ranks == [0, 1, 2] and res.alignment.startswith("shared clock")
    d = decode(tmp_path / "out.pftrace")
    assert d.processes == {100: "rank 0 (h)", 101: "rank 1 (h)", 102: "rank 2 (h)"}
    steps = sorted((d.track_pid(s.track), s.ts, s.dur) for s in d.slices)
    assert steps == [(100 + r, 51 * S + r, S) for r in range(3)]
    seqs = {p.trusted_packet_sequence_id for p in d.packets if p.trusted_packet_sequence_id}
    assert len(seqs) == 3
    # the compressed batches stayed compressed
    raw = pb.Trace()
    raw.ParseFromString((tmp_path / "out.pftrace").read_bytes())
    assert sum(p.HasField("compressed_packets") for p in raw.packet) == 2


def _global_snapshots(path):
    """(BOOTTIME, MONOTONIC) of each global clock snapshot of a file, in file order."""
    out = []

    def walk(trace):
        for p in trace.packet:
            if p.HasField("clock_snapshot"):
                c = {k.clock_id: k.timestamp for k in p.clock_snapshot.clocks}
                if 6 in c:
                    out.append((c[6], c[3]))
            if p.HasField("compressed_packets"):
                walk(pb.Trace.FromString(zlib.decompress(p.compressed_packets)))

    walk(pb.Trace.FromString(path.read_bytes()))
    return out


def test_snapshots_stay_monotonic_across_ranks(tmp_path):
    """Rank 1 started (its first snapshot, MONOTONIC 55 s) before rank 0 ended (its last, 60 s):
    concatenated, the trace clock goes back at rank 1's first snapshot, which trace processor
    refuses (invalid_clock_snapshots). Merged, that snapshot is left out and rank 1 converts
    through rank 0's (readings of the same clocks)."""
    from stepscope.analysis import load

    _trace(tmp_path / "rank0.summary.pftrace", 0, "h", 100, 50 * S, 9000 * S,
           [(51 * S, "B", ""), (52 * S, "E", "")], mono_end=60 * S)
    # rank 1's snapshots read BOOTTIME 100 ns later than rank 0's (the jitter between reads)
    _trace(tmp_path / "rank1.summary.pftrace", 1, "h", 200, 55 * S, 9005 * S,
           [(56 * S, "B", ""), (58 * S, "E", "")], boot_off=7 * S + 100, mono_end=65 * S)
    both = [str(tmp_path / f"rank{r}.summary.pftrace") for r in (0, 1)]
    cat = tmp_path / "cat.pftrace"
    cat.write_bytes(b"".join(open(p, "rb").read() for p in both))
    assert load([str(cat)])[1]["invalid_clock_snapshots"] == 1  # as trace processor counts it
    cat.unlink()
    # the two files given as files are read as their merge is (no snapshot refused)
    conn, stats = load(both)
    assert "invalid_clock_snapshots" not in stats
    assert conn.execute("SELECT ts, dur FROM slice ORDER BY ts").fetchall() == [
        (58 * S, S), (63 * S, 2 * S)]
    res = M.merge([tmp_path], tmp_path / "out.pftrace")
    assert res.snapshots_dropped == 1
    assert _global_snapshots(tmp_path / "out.pftrace") == [
        (57 * S, 50 * S), (67 * S, 60 * S), (72 * S + 100, 65 * S)]
    conn, stats = load([str(tmp_path / "out.pftrace")])
    assert "invalid_clock_snapshots" not in stats
    # MONOTONIC 51 s and 56 s: both through the snapshot at MONOTONIC 50 s (+7 s)
    assert conn.execute("SELECT ts, dur FROM slice ORDER BY ts").fetchall() == [
        (58 * S, S), (63 * S, 2 * S)]


def test_rank_filter_and_errors(tmp_path):
    for r in range(6):
        _trace(tmp_path / f"rank{r}.summary.pftrace", r, "h", 100 + r, S, S, [])
    res = M.merge([tmp_path], tmp_path / "o.pftrace", ranks="0,2-4")
    assert res.ranks == [0, 2, 3, 4]
    assert set(decode(tmp_path / "o.pftrace").processes) == {100, 102, 103, 104}
    assert M.parse_ranks("1, 3-5") == {1, 3, 4, 5}
    with pytest.raises(ValueError, match="not a rank or a range"):
        M.parse_ranks("a")
    with pytest.raises(ValueError, match="no input has a rank"):
        M.merge([tmp_path], tmp_path / "o.pftrace", ranks={9})
    with pytest.raises(ValueError, match="no rank\\*.detail"):
        M.merge([tmp_path], tmp_path / "o.pftrace", level="detail")
    with pytest.raises(ValueError, match="no such file"):
        M.merge([tmp_path / "nope"], tmp_path / "o.pftrace")


def test_several_hosts_aligned_by_wall_clock(tmp_path):
    # host a: MONOTONIC 1000 s <-> REALTIME 5000 s; host b: MONOTONIC 200 s <-> REALTIME 5000.5 s
    _trace(tmp_path / "rank0.summary.pftrace", 0, "a", 7, 1000 * S, 5000 * S,
           [(1001 * S, "B", ""), (1002 * S, "E", "")])
    _trace(tmp_path / "rank1.summary.pftrace", 1, "b", 7, 200 * S, 5000 * S + S // 2,
           [(201 * S, "B", ""), (203 * S, "E", "")])
    res = M.merge([tmp_path], tmp_path / "o.pftrace")
    assert res.alignment.startswith("wall clock (REALTIME) across hosts a, b")
    d = decode(tmp_path / "o.pftrace")
    # rank 1's pid collided with rank 0's: renumbered, thread track too
    assert sorted(d.processes.values()) == ["rank 0 (a)", "rank 1 (b)"]
    assert len(d.processes) == 2
    by_name = {d.processes[d.track_pid(s.track)]: (s.ts, s.dur) for s in d.slices}
    # b's event at MONOTONIC 201 s = REALTIME 5001.5 s = a's MONOTONIC 1001.5 s
    assert by_name == {"rank 0 (a)": (1001 * S, S), "rank 1 (b)": (1001 * S + S // 2, 2 * S)}


def test_truncated_file_merges_its_complete_packets(tmp_path):
    _trace(tmp_path / "rank0.summary.pftrace", 0, "h", 5, S, S,
           [(2 * S, "B", ""), (3 * S, "E", "")], compress=False)
    data = (tmp_path / "rank0.summary.pftrace").read_bytes()
    (tmp_path / "rank0.summary.pftrace").write_bytes(data[:-3])  # cut inside the last packet
    M.merge([tmp_path / "rank0.summary.pftrace"], tmp_path / "o.pftrace")
    d = decode(tmp_path / "o.pftrace")
    assert [(s.ts, s.dur) for s in d.slices] == [(2 * S, None)]


def test_pids_are_renumbered_only_between_different_processes():
    from stepscope.analysis.merge import InputInfo, _dedupe_pids

    window0 = InputInfo(path="a", rank=0, host="h1", pid=100)
    window1 = InputInfo(path="b", rank=0, host="h1", pid=100)  # same process, second window
    other = InputInfo(path="c", rank=1, host="h2", pid=100)  # another host, same pid
    _dedupe_pids([window0, window1, other])
    assert window0.pid_map == {} and window1.pid_map == {}
    assert other.pid_map == {100: 100 + (1 << 22)}


def test_merge_leaves_the_process_umask_alone(tmp_path, monkeypatch):
    """Merge may run inside a training process: it never sets the umask (for a moment 0, any
    thread's new file would be world-writable); its output still follows the umask."""
    _trace(tmp_path / "rank0.summary.pftrace", 0, "h", 100, 50 * S, 9000 * S,
           [(51 * S, "B", "step 0"), (52 * S, "E", "")])
    calls = []
    real = os.umask
    monkeypatch.setattr(os, "umask", lambda m: calls.append(m) or real(m))
    old = real(0o027)
    try:
        M.merge([tmp_path], tmp_path / "out.pftrace")
    finally:
        real(old)
    assert calls == []
    assert stat.S_IMODE(os.stat(tmp_path / "out.pftrace").st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.pftrace", "rank0.summary.pftrace"]
