"""The embedded importer against traces built with Perfetto's official protobuf classes.

Every expected value is worked out by hand from the packets each test writes.
"""

from __future__ import annotations

import zlib

import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from stepscope.analysis import TraceError, load

TB, TE, TI, TC = (pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_SLICE_END,
                  pb.TrackEvent.TYPE_INSTANT, pb.TrackEvent.TYPE_COUNTER)
CLEARED, NEEDS = 1, 2
PROC, THREAD, CTR, GPU = 1, 2, 3, 4


def write(tmp_path, packets, name="t.pftrace", compress=False) -> str:
    t = pb.Trace()
    for p in packets:
        t.packet.add().CopyFrom(p)
    data = t.SerializeToString()
    if compress:
        outer = pb.Trace()
        outer.packet.add().compressed_packets = zlib.compress(data)
        data = outer.SerializeToString()
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def rows(conn, sql):
    cur = conn.execute(sql)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur]


def descriptors(seq=1) -> list:
    """Process 100 'proc', thread 101 'main' under it, a counter and a custom GPU track."""
    out = []
    p = pb.TracePacket(trusted_packet_sequence_id=seq)
    p.track_descriptor.uuid = PROC
    p.track_descriptor.process.pid = 100
    p.track_descriptor.process.process_name = "proc"
    out.append(p)
    p = pb.TracePacket(trusted_packet_sequence_id=seq)
    p.track_descriptor.uuid = THREAD
    p.track_descriptor.parent_uuid = PROC
    p.track_descriptor.thread.pid = 100
    p.track_descriptor.thread.tid = 101
    p.track_descriptor.thread.thread_name = "main"
    out.append(p)
    p = pb.TracePacket(trusted_packet_sequence_id=seq)
    p.track_descriptor.uuid = CTR
    p.track_descriptor.parent_uuid = PROC
    p.track_descriptor.name = "mem"
    p.track_descriptor.counter.unit = pb.CounterDescriptor.UNIT_SIZE_BYTES
    out.append(p)
    p = pb.TracePacket(trusted_packet_sequence_id=seq)
    p.track_descriptor.uuid = GPU
    p.track_descriptor.parent_uuid = PROC
    p.track_descriptor.name = "GPU 0"
    out.append(p)
    return out


def ev(ts, typ, seq=2, track=THREAD, name=None, name_iid=None, cats=(), cat_iids=(),
       flags=NEEDS, **kw) -> pb.TracePacket:
    p = pb.TracePacket(timestamp=ts, trusted_packet_sequence_id=seq, sequence_flags=flags)
    e = p.track_event
    e.type = typ
    if track is not None:
        e.track_uuid = track
    if name is not None:
        e.name = name
    if name_iid is not None:
        e.name_iid = name_iid
    e.categories.extend(cats)
    e.category_iids.extend(cat_iids)
    for k, v in kw.items():
        if k in ("flow_ids", "terminating_flow_ids"):
            getattr(e, k).extend(v)
        else:
            setattr(e, k, v)
    return p


def start(seq=2, names=(), cats=(), arg_names=()) -> pb.TracePacket:
    p = pb.TracePacket(trusted_packet_sequence_id=seq, sequence_flags=CLEARED | NEEDS)
    for iid, n in names:
        p.interned_data.event_names.add(iid=iid, name=n)
    for iid, n in cats:
        p.interned_data.event_categories.add(iid=iid, name=n)
    for iid, n in arg_names:
        p.interned_data.debug_annotation_names.add(iid=iid, name=n)
    return p


# --- slices ---------------------------------------------------------------------------------


def nesting_trace() -> list:
    return descriptors() + [
        start(names=[(1, "outer"), (2, "inner")], cats=[(1, "step"), (2, "phase")]),
        ev(1000, TB, name_iid=1, cat_iids=[1, 2]),
        ev(1100, TB, name_iid=2),
        ev(1150, TI, name="mark", cats=["user", "x"]),
        ev(1300, TE),
        ev(1400, TI, name="top-level mark"),
        ev(2000, TE),
        ev(2100, TE),  # nothing open: ignored
        ev(3000, TB, name="never ends", cat_iids=[2]),
        ev(3500, TB, track=GPU, name="kernel"),  # custom track: own stack
        ev(3600, TE, track=GPU),
    ]


def test_slices_nesting_depth_parent_and_categories(tmp_path):
    conn, stats = load(write(tmp_path, nesting_trace()))
    got = rows(conn, "SELECT id, ts, dur, track_id, category, name, depth, parent_id "
                     "FROM slice ORDER BY id")
    thread_track = rows(conn, "SELECT id FROM thread_track")[0]["id"]
    gpu = rows(conn, "SELECT id FROM track WHERE name = 'GPU 0'")[0]["id"]
    t = thread_track
    assert got == [
        dict(id=0, ts=1000, dur=1000, track_id=t, category="step,phase", name="outer",
             depth=0, parent_id=None),
        dict(id=1, ts=1100, dur=200, track_id=t, category=None, name="inner", depth=1,
             parent_id=0),
        dict(id=2, ts=1150, dur=0, track_id=t, category="user,x", name="mark", depth=2,
             parent_id=1),
        dict(id=3, ts=1400, dur=0, track_id=t, category=None, name="top-level mark", depth=1,
             parent_id=0),
        dict(id=4, ts=3000, dur=-1, track_id=t, category="phase", name="never ends",
             depth=0, parent_id=None),
        dict(id=5, ts=3500, dur=100, track_id=gpu, category=None, name="kernel", depth=0,
             parent_id=None),
    ]
    assert stats["slice_end_without_begin"] == 1


def test_slices_live_once_in_the_slice_base(tmp_path):
    """``slice`` is a view over the summaries' slice base, which holds every slice: the
    unfinished one (id 4) is there without base columns; loaded without the base, ``slice`` is
    a table of the same rows."""
    from stepscope.analysis.summaries import slicebase as _slicebase

    path = write(tmp_path, nesting_trace())
    conn, _ = load(path)
    plain, _ = load(path, slice_base=False)
    cols = "id, ts, dur, track_id, category, name, depth, parent_id, arg_set_id, thread_ts, " \
           "thread_dur"
    assert [d[0] for d in conn.execute("SELECT * FROM slice").description] == cols.split(", ")
    assert rows(conn, f"SELECT {cols} FROM slice ORDER BY id") == \
        rows(plain, f"SELECT {cols} FROM slice ORDER BY id")
    assert rows(conn, "SELECT type FROM sqlite_master WHERE name = 'slice'") == \
        [dict(type="view")]
    assert rows(plain, "SELECT type FROM sqlite_master WHERE name = 'slice'") == \
        [dict(type="table")]
    base = conn.execute(f"SELECT id, end_ts, upid, kind_id, {_slicebase.SS_BASE_ROWS} "
                        f"FROM {_slicebase.SS_TABLE} ORDER BY id").fetchall()
    # "step,phase" is no 'step' for _base.sql's CASE: a user range (6), as the others; the
    # marks (instants: dur 0) have no kind
    assert [r[1:] for r in base] == [(2000, 1, 6, 1), (1300, 1, 6, 1), (1150, 1, None, 1),
                                     (1400, 1, None, 1), (None, None, None, 0), (3600, 1, 6, 1)]


def test_out_of_order_events_are_sorted_by_time(tmp_path):
    # a producer writing complete events late: the nesting comes from timestamps, not file order
    pk = descriptors() + [
        start(),
        ev(50, TB, name="b"), ev(60, TE),  # written first, happens inside "a"
        ev(10, TB, name="a"), ev(100, TE),
    ]
    conn, _ = load(write(tmp_path, pk))
    got = rows(conn, "SELECT id, name, ts, dur, depth, parent_id FROM slice ORDER BY id")
    assert got == [dict(id=0, name="a", ts=10, dur=90, depth=0, parent_id=None),
                   dict(id=1, name="b", ts=50, dur=10, depth=1, parent_id=0)]


def test_tracks_threads_processes(tmp_path):
    conn, _ = load(write(tmp_path, nesting_trace()))
    tracks = {r["name"]: r for r in rows(conn, "SELECT * FROM track")}
    proc_id = rows(conn, "SELECT id FROM process_track WHERE upid = 1 AND name IS NULL")[0]["id"]
    assert tracks["GPU 0"]["parent_id"] == proc_id
    assert tracks["mem"]["parent_id"] == proc_id
    assert rows(conn, "SELECT utid, tid, name, upid, is_main_thread FROM thread ORDER BY utid") \
        == [dict(utid=0, tid=0, name=None, upid=0, is_main_thread=None),
            dict(utid=1, tid=101, name="main", upid=1, is_main_thread=0)]
    assert rows(conn, "SELECT upid, pid, name FROM process ORDER BY upid") == [
        dict(upid=0, pid=0, name=None), dict(upid=1, pid=100, name="proc")]
    assert rows(conn, "SELECT t.utid FROM thread_track t") == [dict(utid=1)]
    # the custom GPU track belongs to the process
    assert rows(conn, "SELECT upid FROM process_track WHERE name = 'GPU 0'") == [dict(upid=1)]
    assert rows(conn, "SELECT name, unit FROM counter_track") == [dict(name="mem",
                                                                       unit="bytes")]
    # as trace processor lists it: the process's counter (the summaries take its rank so)
    assert rows(conn, "SELECT name, upid FROM process_counter_track") == [dict(name="mem",
                                                                               upid=1)]
    assert rows(conn, "SELECT COUNT(*) AS n FROM thread_counter_track") == [dict(n=0)]


# --- args -------------------------------------------------------------------------------------


def annotated(p, **values):
    for k, v in values.items():
        a = p.track_event.debug_annotations.add(name=k)
        if isinstance(v, bool):
            a.bool_value = v
        elif isinstance(v, int):
            a.int_value = v
        elif isinstance(v, float):
            a.double_value = v
        elif isinstance(v, str):
            a.string_value = v
        elif isinstance(v, dict):
            for dk, dv in v.items():
                a.dict_entries.add(name=dk, int_value=dv)
        elif isinstance(v, list):
            for x in v:
                a.array_values.add(string_value=x)
    return p


@pytest.mark.parametrize("per_pass", [None, 2], ids=["one pass", "passes of 2"])
def test_args_typed_values_and_shared_sets(tmp_path, monkeypatch, per_pass):
    """(``per_pass``: annotations scanned per numpy pass; 2 splits one event's annotations
    across passes, which must keep their order and sets.)"""
    if per_pass is not None:
        from stepscope.analysis.tp import args as args_mod

        monkeypatch.setattr(args_mod, "ANNOTATIONS_PER_PASS", per_pass)
    p1 = annotated(ev(10, TB, name="a"), n=-7, f=2.5, s="hi", ok=True)
    p1.track_event.debug_annotations.add(name="u", uint_value=2**63 + 5)
    iid = ev(20, TE)
    p3 = annotated(ev(30, TB, name="b"), d={"x": 1, "y": 2}, l=["p", "q"])
    p4 = ev(40, TE)
    p5 = annotated(ev(50, TI, name="c"), n=-7, f=2.5, s="hi", ok=True)
    p5.track_event.debug_annotations.add(name="u", uint_value=2**63 + 5)
    st = start(arg_names=[(1, "step")])
    p6 = ev(60, TI, name="d")
    p6.track_event.debug_annotations.add(name_iid=1, int_value=3)
    conn, _ = load(write(tmp_path, descriptors() + [st, p1, iid, p3, p4, p5, p6]))
    sets = {r["name"]: r["arg_set_id"] for r in rows(conn, "SELECT name, arg_set_id FROM slice")}
    assert sets["a"] == sets["c"] and len({sets["a"], sets["b"], sets["d"]}) == 3
    a = rows(conn, f"SELECT key, flat_key, int_value, string_value, real_value, value_type, "
                   f"display_value FROM args WHERE arg_set_id = {sets['a']} ORDER BY id")
    assert a == [
        dict(key="debug.n", flat_key="debug.n", int_value=-7, string_value=None,
             real_value=None, value_type="int", display_value="-7"),
        dict(key="debug.f", flat_key="debug.f", int_value=None, string_value=None,
             real_value=2.5, value_type="real", display_value="2.5"),
        dict(key="debug.s", flat_key="debug.s", int_value=None, string_value="hi",
             real_value=None, value_type="string", display_value="hi"),
        dict(key="debug.ok", flat_key="debug.ok", int_value=1, string_value=None,
             real_value=None, value_type="bool", display_value="true"),
        dict(key="debug.u", flat_key="debug.u", int_value=2**63 + 5 - 2**64,
             string_value=None, real_value=None, value_type="uint",
             display_value=str(2**63 + 5)),  # (unsigned, as trace processor shows a uint)
    ]
    b = rows(conn, f"SELECT key, flat_key, int_value, string_value FROM args "
                   f"WHERE arg_set_id = {sets['b']} ORDER BY id")
    assert b == [
        dict(key="debug.d.x", flat_key="debug.d.x", int_value=1, string_value=None),
        dict(key="debug.d.y", flat_key="debug.d.y", int_value=2, string_value=None),
        dict(key="debug.l[0]", flat_key="debug.l", int_value=None, string_value="p"),
        dict(key="debug.l[1]", flat_key="debug.l", int_value=None, string_value="q"),
    ]
    d = rows(conn, f"SELECT key, int_value FROM args WHERE arg_set_id = {sets['d']}")
    assert d == [dict(key="debug.step", int_value=3)]


def test_number_args_are_shown_as_trace_processor_shows_them_without_a_string_each(tmp_path):
    """The display_value of numbers and bools is made when read (``args`` is a view): a trace
    whose events each carry distinct numbers holds no string per value, and each reads as
    trace processor shows it (a uint unsigned, a pointer in hex, a real as SQLite prints it),
    as text; with ``STEPSCOPE_TRACE_PROCESSOR``, trace processor itself is asked too."""
    import os

    from stepscope import analysis
    from stepscope.analysis.engines import ENV_BIN
    from stepscope.analysis.tp.importer import decode_files

    def trace(name, n):
        packets = descriptors() + [start()]
        for i in range(n):
            p = annotated(ev(10 + i, TI, name="x"), k=1000 * i - 7, on=i % 2 == 1,
                          f=(1e-05, 0.2 + 1e-05, 3.0)[i % 3])  # (0.20001000000000002)
            p.track_event.debug_annotations.add(name="u", uint_value=2**64 - 1 - i)
            p.track_event.debug_annotations.add(name="p", pointer_value=4096 + i)
            packets.append(p)
        return write(tmp_path, packets, name=name)

    few, many = trace("few.pftrace", 3), trace("many.pftrace", 300)
    assert len(decode_files([many]).strings.list) == len(decode_files([few]).strings.list)
    conn, _ = load(few)
    sql = "SELECT key, display_value AS v, typeof(display_value) AS t FROM args ORDER BY id"
    got = rows(conn, sql)
    expected = [
        ("debug.k", "-7"), ("debug.on", "false"), ("debug.f", "1.0e-05"),
        ("debug.u", "18446744073709551615"), ("debug.p", "0x1000"),
        ("debug.k", "993"), ("debug.on", "true"), ("debug.f", "0.20001"),
        ("debug.u", "18446744073709551614"), ("debug.p", "0x1001"),
        ("debug.k", "1993"), ("debug.on", "false"), ("debug.f", "3.0"),
        ("debug.u", "18446744073709551613"), ("debug.p", "0x1002")]
    assert [(r["key"], r["v"]) for r in got] == expected
    assert {r["t"] for r in got} == {"text"}
    if os.environ.get(ENV_BIN):
        tp = analysis.open(few, engine="trace_processor", trace_processor_bin=os.environ[ENV_BIN])
        try:
            shown = tp.query("SELECT key, display_value AS v FROM args WHERE key GLOB 'debug.*'"
                             " ORDER BY arg_set_id, id")
            assert [(r["key"], r["v"]) for r in shown] == expected
        finally:
            tp.close()


def test_source_location_args(tmp_path):
    st = start(names=[(1, "f")])
    st.interned_data.source_locations.add(iid=4, file_name="a.py", function_name="fn",
                                          line_number=12)
    p = ev(10, TI, name_iid=1, source_location_iid=4)
    conn, _ = load(write(tmp_path, descriptors() + [st, p]))
    got = rows(conn, "SELECT key, int_value, string_value FROM args ORDER BY id")
    assert got == [dict(key="source.file_name", int_value=None, string_value="a.py"),
                   dict(key="source.function_name", int_value=None, string_value="fn"),
                   dict(key="source.line_number", int_value=12, string_value=None)]


# --- counters and flows -----------------------------------------------------------------------


def test_counters_int_double_and_multiplier(tmp_path):
    d = descriptors()
    d[2].track_descriptor.counter.unit_multiplier = 1024
    pk = d + [start(),
              ev(10, TC, track=CTR, counter_value=3),
              ev(20, TC, track=CTR, double_counter_value=0.5)]
    conn, _ = load(write(tmp_path, pk))
    ctr = rows(conn, "SELECT id FROM counter_track")[0]["id"]
    assert rows(conn, "SELECT id, ts, track_id, value FROM counter ORDER BY id") == [
        dict(id=0, ts=10, track_id=ctr, value=3 * 1024.0),
        dict(id=1, ts=20, track_id=ctr, value=512.0)]


def test_flows_v2(tmp_path):
    pk = descriptors() + [
        start(),
        ev(10, TB, name="launch", flow_ids=[7]), ev(20, TE),
        ev(30, TB, track=GPU, name="kernel", terminating_flow_ids=[7]), ev(40, TE, track=GPU),
        ev(50, TI, name="a", flow_ids=[9]),
        ev(60, TI, name="b", flow_ids=[9]),
        ev(70, TI, name="c", terminating_flow_ids=[9]),
        ev(80, TI, name="d", terminating_flow_ids=[9]),  # 9 ended: starts a new one, no arrow
    ]
    conn, _ = load(write(tmp_path, pk))
    ids = {r["name"]: r["id"] for r in rows(conn, "SELECT id, name FROM slice")}
    got = [(r["slice_out"], r["slice_in"]) for r in
           rows(conn, "SELECT slice_out, slice_in FROM flow ORDER BY id")]
    assert got == [(ids["launch"], ids["kernel"]), (ids["a"], ids["b"]), (ids["b"], ids["c"])]


# --- clocks -----------------------------------------------------------------------------------


def snapshot(seq, *clocks, primary=None):
    p = pb.TracePacket(trusted_packet_sequence_id=seq)
    for c in clocks:
        p.clock_snapshot.clocks.add(**c)
    if primary:
        p.clock_snapshot.primary_trace_clock = primary
    return p


def test_incremental_sequence_clock_to_boottime(tmp_path):
    boot, mono = 6, 3
    seq_start = start(seq=2)
    seq_start.trace_packet_defaults.timestamp_clock_id = 64
    seq_start.trace_packet_defaults.track_event_defaults.track_uuid = THREAD
    seq_start.clock_snapshot.clocks.add(clock_id=64, timestamp=1_000_000, is_incremental=True)
    seq_start.clock_snapshot.clocks.add(clock_id=mono, timestamp=1_000_000)
    us = start(seq=3)  # microsecond deltas
    us.trace_packet_defaults.timestamp_clock_id = 64
    us.trace_packet_defaults.track_event_defaults.track_uuid = GPU
    us.clock_snapshot.clocks.add(clock_id=64, timestamp=1000, is_incremental=True,
                                 unit_multiplier_ns=1000)
    us.clock_snapshot.clocks.add(clock_id=mono, timestamp=1_000_000)
    pk = descriptors() + [
        snapshot(1, dict(clock_id=boot, timestamp=5_000_000),
                 dict(clock_id=mono, timestamp=1_000_000)),
        snapshot(1, dict(clock_id=boot, timestamp=9_000_000),
                 dict(clock_id=mono, timestamp=2_000_000)),
        seq_start,
        ev(500, TB, seq=2, track=None, name="a"),  # clock 64 = 1_000_500 = MONO -> snapshot 1
        ev(1_000_000, TE, seq=2, track=None),  # 2_000_500 MONO -> snapshot 2 (nearest below)
        us,
        ev(2, TI, seq=3, track=None, name="k"),  # 1000 us + 2 us = 1_002_000 ns MONO
        ev(5, TI, seq=3, track=None, name="m"),  # absolute MONO 5 (clock id set below)
    ]
    # the last event carries its own clock: MONOTONIC 5, before every snapshot -> first one
    pk[-1].timestamp_clock_id = mono
    conn, _ = load(write(tmp_path, pk))
    got = {r["name"]: (r["ts"], r["dur"]) for r in rows(conn, "SELECT name, ts, dur FROM slice")}
    assert got["a"] == (5_000_500, 9_000_500 - 5_000_500)
    assert got["k"] == (5_002_000, 0)
    assert got["m"] == (5 - 1_000_000 + 5_000_000, 0)


def test_incremental_clock_restarts_at_each_snapshot_of_its_sequence(tmp_path):
    boot, mono = 6, 3
    seq_start = start(seq=2)
    seq_start.trace_packet_defaults.timestamp_clock_id = 64
    seq_start.trace_packet_defaults.track_event_defaults.track_uuid = THREAD
    incr = dict(clock_id=64, is_incremental=True)
    pk = descriptors() + [
        snapshot(1, dict(clock_id=boot, timestamp=5_000_000),
                 dict(clock_id=mono, timestamp=1_000_000)),  # BOOTTIME = MONO + 4_000_000
        seq_start,
        ev(3, TI, seq=2, track=None, name="early"),  # clock 64 has no value yet: dropped
        snapshot(2, dict(**incr, timestamp=1_000_000), dict(clock_id=mono, timestamp=1_000_000)),
        ev(500, TB, seq=2, track=None, name="a"),  # 1_000_500
        ev(100, TE, seq=2, track=None),  # 1_000_600
        snapshot(2, dict(**incr, timestamp=3_000_000), dict(clock_id=mono, timestamp=3_000_000)),
        ev(7, TI, seq=2, track=None, name="b"),  # deltas start again: 3_000_007
    ]
    conn, stats = load(write(tmp_path, pk))
    got = {r["name"]: (r["ts"], r["dur"]) for r in rows(conn, "SELECT name, ts, dur FROM slice")}
    assert got == {"a": (5_000_500, 100), "b": (7_000_007, 0)}
    assert stats["clock_sync_failure"] == 1


@pytest.mark.rejected_trace_ok
def test_events_before_the_trace_clocks_zero_are_dropped_and_counted(tmp_path):
    """As trace processor: a TrackEvent whose time on the trace clock (BOOTTIME) is negative
    is dropped and counted as track_event_invalid_timestamp (it kept them before)."""
    boot, real = 6, 1
    pk = descriptors() + [
        snapshot(1, dict(clock_id=boot, timestamp=1_000), dict(clock_id=real, timestamp=10_000)),
        start(seq=2),
        ev(5_000, TI, name="early"),  # REALTIME 5_000 = BOOTTIME -4_000: dropped
        ev(8_000, TC, track=CTR, counter_value=1),  # BOOTTIME -1_000: dropped
        ev(9_500, TB, name="ok"),  # BOOTTIME 500
        ev(10_500, TE),  # 1_500
        ev(12_000, TC, track=CTR, counter_value=2),  # 3_000
    ]
    for p in pk[-5:]:
        p.timestamp_clock_id = real
    conn, stats = load(write(tmp_path, pk))
    assert [(r["name"], r["ts"], r["dur"]) for r in rows(conn, "SELECT * FROM slice")] == [
        ("ok", 500, 1_000)]
    assert [(r["ts"], r["value"]) for r in rows(conn, "SELECT * FROM counter")] == [(3_000, 2.0)]
    assert stats["track_event_invalid_timestamp"] == 2
    assert rows(conn, "SELECT value FROM stats WHERE name = 'track_event_invalid_timestamp'") \
        == [dict(value=2)]


@pytest.mark.rejected_trace_ok
def test_clock_snapshots_that_go_back_as_trace_processor_takes_them(tmp_path):
    """Trace processor refuses a snapshot whose trace clock (BOOTTIME) goes back, and converts
    no longer from another clock that goes back (MONOTONIC here): its events are dropped."""
    boot, mono, real = 6, 3, 1
    pk = descriptors() + [
        snapshot(1, dict(clock_id=boot, timestamp=5_000), dict(clock_id=real, timestamp=9_000)),
        snapshot(1, dict(clock_id=boot, timestamp=4_000), dict(clock_id=real, timestamp=9_500)),
        snapshot(1, dict(clock_id=boot, timestamp=1_000), dict(clock_id=mono, timestamp=800)),
        snapshot(1, dict(clock_id=boot, timestamp=2_000), dict(clock_id=mono, timestamp=700)),
        start(seq=2),
        ev(9_700, TI, name="real"),  # through the first snapshot only: 5_000 + 700
        ev(900, TI, name="mono"),  # MONOTONIC went back: no conversion from it, dropped
    ]
    pk[-2].timestamp_clock_id = real
    pk[-1].timestamp_clock_id = mono
    conn, stats = load(write(tmp_path, pk))
    assert [(r["name"], r["ts"]) for r in rows(conn, "SELECT * FROM slice")] == [("real", 5_700)]
    assert stats["invalid_clock_snapshots"] == 1
    assert stats["clock_sync_failure"] == 1


def test_interning_reset_and_skipped_packets(tmp_path):
    pk = descriptors() + [
        ev(5, TI, seq=2, name_iid=1),  # needs incremental state before any clear: skipped
        start(seq=2, names=[(1, "first")]),
        ev(10, TI, seq=2, name_iid=1),
        start(seq=2, names=[(1, "second")]),  # cleared: iid 1 now means "second"
        ev(20, TI, seq=2, name_iid=1),
        start(seq=3, names=[(1, "other seq")]),  # iids are per sequence
        ev(30, TI, seq=3, name_iid=1),
    ]
    conn, stats = load(write(tmp_path, pk))
    got = [(r["ts"], r["name"]) for r in rows(conn, "SELECT ts, name FROM slice ORDER BY ts")]
    assert got == [(10, "first"), (20, "second"), (30, "other seq")]
    assert stats["packets_skipped_no_incremental_state"] == 1


# --- file handling ----------------------------------------------------------------------------


def test_compressed_packets_match_plain(tmp_path):
    pk = nesting_trace()
    plain, _ = load(write(tmp_path, pk, "a.pftrace"))
    comp, _ = load(write(tmp_path, pk, "b.pftrace", compress=True))
    q = "SELECT * FROM slice ORDER BY id"
    assert rows(plain, q) == rows(comp, q) and len(rows(plain, q)) == 6


def test_plain_packets_between_compressed_batches_keep_their_place(tmp_path):
    # batch, plain packet, batch: the plain clear sits between the two batches' events
    def batch(packets) -> bytes:
        t = pb.Trace()
        for p in packets:
            t.packet.add().CopyFrom(p)
        outer = pb.Trace()
        outer.packet.add().compressed_packets = zlib.compress(t.SerializeToString())
        return outer.SerializeToString()

    plain = pb.Trace()
    plain.packet.add().CopyFrom(start(names=[(1, "second")]))
    path = tmp_path / "mixed.pftrace"
    path.write_bytes(batch(descriptors() + [start(names=[(1, "first")]), ev(10, TI, name_iid=1)])
                     + plain.SerializeToString() + batch([ev(20, TI, name_iid=1)]))
    conn, _ = load(str(path))
    assert rows(conn, "SELECT ts, name FROM slice ORDER BY ts") == [
        {"ts": 10, "name": "first"}, {"ts": 20, "name": "second"}]


def test_truncated_last_packet(tmp_path):
    path = write(tmp_path, nesting_trace())
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:-3])  # cut into the last packet (the GPU end)
    conn, stats = load(path)
    assert stats["truncated_packets"] == 1
    assert rows(conn, "SELECT name, dur FROM slice WHERE name = 'kernel'") == [
        dict(name="kernel", dur=-1)]


def test_garbage_empty_and_missing_files(tmp_path):
    g = tmp_path / "garbage.bin"
    g.write_bytes(b"this is not a trace at all\n" * 10)
    with pytest.raises(TraceError, match="not a Perfetto protobuf trace"):
        load(str(g))
    e = tmp_path / "empty.pftrace"
    e.write_bytes(b"")
    conn, stats = load(str(e))
    assert rows(conn, "SELECT COUNT(*) AS n FROM slice") == [dict(n=0)]
    assert rows(conn, "SELECT COUNT(*) AS n FROM counter") == [dict(n=0)]
    with pytest.raises(TraceError, match="no such file"):
        load(str(tmp_path / "missing.pftrace"))


def test_unknown_packet_types_are_counted(tmp_path):
    pk = nesting_trace()
    odd = pb.TracePacket(timestamp=1, trusted_packet_sequence_id=9)
    odd.for_testing.counter = 3  # a packet type the importer does not read
    path = write(tmp_path, pk[:5] + [odd, odd] + pk[5:])
    # plus a field number no schema knows, appended by hand
    with open(path, "ab") as f:
        body = bytes([0xF8, 0xFF, 0xFF, 0x03, 0x01])  # field 1048575, varint 1
        f.write(bytes([0x0A, len(body)]) + body)
    conn, stats = load(path)
    assert stats["unknown_packets"] == 3
    assert stats["unknown_packet_field_900"] == 2  # TracePacket.for_testing
    assert stats["unknown_packet_field_1048575"] == 1
    assert rows(conn, "SELECT COUNT(*) AS n FROM slice") == [dict(n=6)]
    assert rows(conn, "SELECT value FROM stats WHERE name = 'unknown_packets'") == [
        dict(value=3)]


def test_several_files_load_into_one_database(tmp_path):
    a = write(tmp_path, nesting_trace(), "a.pftrace")
    d = descriptors()
    for p, (uuid, tid) in zip(d, ((11, None), (12, 201), (13, None), (14, None)), strict=True):
        p.track_descriptor.uuid = uuid
        if p.track_descriptor.HasField("parent_uuid"):
            p.track_descriptor.parent_uuid = 11
        if tid:
            p.track_descriptor.thread.pid = 200
            p.track_descriptor.thread.tid = tid
        elif p.track_descriptor.HasField("process"):
            p.track_descriptor.process.pid = 200
    b = write(tmp_path, d + [start(names=[(1, "x")]), ev(7, TI, track=12, name_iid=1)],
              "b.pftrace")
    conn, _ = load([a, b])
    assert rows(conn, "SELECT COUNT(*) AS n FROM slice") == [dict(n=7)]
    assert rows(conn, "SELECT t.tid FROM slice s JOIN thread_track tt ON tt.id = s.track_id "
                      "JOIN thread t USING (utid) WHERE s.name = 'x'") == [dict(tid=201)]
    assert rows(conn, "PRAGMA integrity_check") == [dict(integrity_check="ok")]


def test_gzip_compressed_file(tmp_path):
    import gzip

    path = write(tmp_path, nesting_trace())
    gz = tmp_path / "t.pftrace.gz"
    gz.write_bytes(gzip.compress(open(path, "rb").read()))
    conn, _ = load(str(gz))
    assert rows(conn, "SELECT COUNT(*) AS n FROM slice") == [dict(n=6)]


def test_damaged_bytes_load_or_fail_cleanly(tmp_path):
    """Random byte damage: the load succeeds or raises TraceError, never an internal error."""
    import random

    rnd = random.Random(5)
    good = [open(write(tmp_path, nesting_trace(), "p.pftrace"), "rb").read(),
            open(write(tmp_path, nesting_trace(), "c.pftrace", compress=True), "rb").read()]
    outcomes = {"ok": 0, "error": 0}
    for i in range(120):
        data = bytearray(good[i % 2])
        for _ in range(rnd.randint(1, 3)):
            data[rnd.randrange(len(data))] = rnd.randrange(256)
        if i % 5 == 0:
            data = data[: rnd.randrange(1, len(data))]
        if i % 4 == 3:  # damaged first byte: not a trace any more
            data[0] = rnd.choice([0x00, 0x08, 0x12, 0xFF])
        p = tmp_path / "d.pftrace"
        p.write_bytes(bytes(data))
        try:
            conn, _ = load(str(p))
            conn.execute("SELECT COUNT(*) FROM slice").fetchall()
            outcomes["ok"] += 1
        except TraceError as e:
            assert e.__cause__ is None, f"internal error on damaged input: {e}"
            outcomes["error"] += 1
    assert outcomes["ok"] > 0 and outcomes["error"] > 0


def test_repeated_packet_bodies_decode_like_the_general_path(tmp_path, monkeypatch):
    """Packets sharing a body are decoded once and copied: same tables as decoding each."""
    import stepscope
    from stepscope.analysis.tp import packets as _packets

    path = str(tmp_path / "w.pftrace")
    with stepscope.trace(path):
        for i in range(300):
            with stepscope.annotate("step", category="step", args={"step": i} if i % 7 else None):
                with stepscope.annotate(f"op{i % 3}"):
                    stepscope.mark("m")
            stepscope.counter("c", i % 5)
    fast, _ = load(path)
    monkeypatch.setattr(_packets, "_TPL_MAX", 0)  # every packet through the general scanner
    slow, _ = load(path)
    for table in ("slice", "counter", "args", "thread", "track"):
        q = f"SELECT * FROM {table} ORDER BY 1"
        assert rows(fast, q) == rows(slow, q), table
    assert rows(fast, "SELECT COUNT(*) AS n FROM slice") == [dict(n=900)]
