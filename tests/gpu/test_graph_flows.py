"""CUDA graph launches: one cudaGraphLaunch, many device records under its correlation id, one
arrow from the launch to each of them (synthetic records shaped like CUPTI's)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from gpu_trace_decode import decode

from stepscope.analysis import engines
from stepscope.core import session as _session
from stepscope.gpu.convert import GpuTraceConverter, flow_ids_for
from stepscope.gpu.fixture import batch_from_records
from stepscope.gpu.occupancy import DeviceLimits

H100 = DeviceLimits.for_compute_capability(9, 0, sm_count=132, name="H100")
T0 = time.time_ns() // 10**9 * 10**9  # now: trace processor drops times before boot
PID = 407
THREAD = 1234


def kernel(name, corr, start, dur, graph_id=0, node=0, stream=13):
    return {"kind": "CONCURRENT_KERNEL", "name": name, "start": T0 + start,
            "end": T0 + start + dur, "stream_id": stream, "device_id": 0, "context_id": 1,
            "correlation_id": corr, "grid_x": 132, "grid_y": 1, "grid_z": 1, "block_x": 128,
            "block_y": 1, "block_z": 1, "registers_per_thread": 32, "static_shared_memory": 0,
            "dynamic_shared_memory": 0, "graph_id": graph_id, "graph_node_id": node}  # fmt: skip


def api(cbid, corr, start, dur):
    return {"kind": "RUNTIME", "start": T0 + start, "end": T0 + start + dur, "cbid": cbid,
            "correlation_id": corr, "process_id": PID, "thread_id": THREAD}  # fmt: skip


def graph_records():
    """cudaGraphLaunch (corr 50) running 3 kernels and a memcpy (listed out of time order), then
    a plain cudaLaunchKernel (corr 51) and a graph kernel whose launch is not in the batch."""
    return [
        api(311, 50, 0, 4_000),
        kernel("g_b", 50, 20_000, 3_000, graph_id=7, node=102),
        kernel("g_a", 50, 10_000, 5_000, graph_id=7, node=101),
        {"kind": "MEMCPY", "start": T0 + 25_000, "end": T0 + 26_000, "stream_id": 13,
         "device_id": 0, "context_id": 1, "correlation_id": 50, "bytes": 4096, "copy_kind": 8,
         "src_kind": 3, "dst_kind": 3, "graph_id": 7, "graph_node_id": 104},
        kernel("g_c", 50, 30_000, 2_000, graph_id=7, node=103),
        api(211, 51, 40_000, 2_000),
        kernel("plain", 51, 45_000, 1_000),
        kernel("orphan", 52, 50_000, 1_000, graph_id=7, node=101),
    ]  # fmt: skip


def convert(tmp_path, batches):
    path = tmp_path / "graph.pftrace"
    sess = _session.Session(path, detail=True).start()
    try:
        conv = GpuTraceConverter(sess, {0: H100}, pid=PID, counters=False, demangle_names=False)
        stats = [conv.convert(b) for b in batches]
    finally:
        sess.stop()
    return path, stats


def fid(corr):
    return int(flow_ids_for(np.array([corr]), PID)[0])


def extra(seq):
    return 0x5D << 56 | PID << 32 | seq  # rank 0; PID under 12 bits


@pytest.fixture(scope="module")
def graph_trace(tmp_path_factory):
    batch = batch_from_records(graph_records(), api="all")
    path, (stats,) = convert(tmp_path_factory.mktemp("graph"), [batch])
    return path, stats


def test_the_graph_launch_starts_one_flow_per_record_it_ran(graph_trace):
    path, stats = graph_trace
    tr = decode(path)
    by_name = {s.name: s for s in tr.slices}
    launch = by_name["cudaGraphLaunch"]
    # in start order: g_a (10 us) keeps the correlation's id, then g_b, the memcpy, g_c
    assert launch.flow_ids == [fid(50), extra(0), extra(1), extra(2)]
    assert by_name["g_a"].terminating_flow_ids == [fid(50)]
    assert by_name["g_b"].terminating_flow_ids == [extra(0)]
    assert by_name["Memcpy DtoD (Device -> Device)"].terminating_flow_ids == [extra(1)]
    assert by_name["g_c"].terminating_flow_ids == [extra(2)]
    assert by_name["cudaLaunchKernel"].flow_ids == [fid(51)]
    assert by_name["plain"].terminating_flow_ids == [fid(51)]
    assert by_name["orphan"].terminating_flow_ids == []  # its launch call is not in the batch
    assert stats.flows == 5


def test_graph_ids_are_kernel_and_memcpy_args(graph_trace):
    tr = decode(graph_trace[0])
    by_name = {s.name: s for s in tr.slices}
    assert (by_name["g_b"].args["graph_id"], by_name["g_b"].args["graph_node_id"]) == (7, 102)
    memcpy = by_name["Memcpy DtoD (Device -> Device)"].args
    assert (memcpy["graph_id"], memcpy["graph_node_id"]) == (7, 104)
    assert "graph_id" not in by_name["plain"].args  # only graph work carries them


def test_trace_processor_semantics_draw_every_arrow(graph_trace):
    """The embedded engine builds the ``flow`` table as trace processor does (v2 flows)."""
    db = engines.open(graph_trace[0], engine="embedded")
    try:
        rows = db.query(
            "SELECT o.name AS src, i.name AS dst FROM flow f JOIN slice o ON o.id = f.slice_out "
            "JOIN slice i ON i.id = f.slice_in ORDER BY i.ts"
        )
    finally:
        db.close()
    assert [(r["src"], r["dst"]) for r in rows] == [
        ("cudaGraphLaunch", "g_a"),
        ("cudaGraphLaunch", "g_b"),
        ("cudaGraphLaunch", "Memcpy DtoD (Device -> Device)"),
        ("cudaGraphLaunch", "g_c"),
        ("cudaLaunchKernel", "plain"),
    ]


def test_extra_ids_never_repeat_across_batches(tmp_path):
    """A second window's graph launch numbers its extra ids after the first window's."""
    first = batch_from_records(graph_records(), api="all")
    second = batch_from_records(
        [api(311, 60, 100_000, 1_000), kernel("h_a", 60, 110_000, 1_000, graph_id=8, node=1),
         kernel("h_b", 60, 120_000, 1_000, graph_id=8, node=2)], api="all",
    )  # fmt: skip
    path, stats = convert(tmp_path, [first, second])
    tr = decode(path)
    launches = [s for s in tr.slices if s.name == "cudaGraphLaunch"]
    assert [s.flow_ids for s in sorted(launches, key=lambda s: s.ts)] == [
        [fid(50), extra(0), extra(1), extra(2)],
        [fid(60), extra(3)],
    ]
    assert [s.flows for s in stats] == [5, 2]


def test_graph_launch_names():
    from stepscope.gpu.records import api_name

    assert api_name(311, driver=False) == "cudaGraphLaunch"
    assert api_name(514, driver=True) == "cuGraphLaunch"


def test_flow_plan_across_tables_and_orphan_groups(tmp_path):
    """Extra ids go, in (correlation, start) order, to every linked record after the first of
    its correlation id, across tables; records of an orphan group (launch call not in the
    batch) get no flow and use up no sequence number."""
    sess = _session.Session(tmp_path / "p.pftrace").start()
    try:
        conv = GpuTraceConverter(sess, {0: H100}, pid=PID, counters=False)
        k = np.zeros(4, dtype=[("correlation", "i8"), ("start", "i8")])
        k["correlation"], k["start"] = [70, 71, 70, 72], [300, 100, 200, 50]
        m = np.zeros(3, dtype=k.dtype)
        m["correlation"], m["start"] = [72, 70, 71], [60, 100, 400]
        empty = np.zeros(0, dtype=k.dtype)
        plan = conv.flow_plan((k, m, empty), np.array([70, 71]))
    finally:
        sess.stop()
    # corr 70: m (100) first, then k (200), k (300); corr 71: k (100), then m (400)
    assert plan.terminating == [
        [[extra(1)], [fid(71)], [extra(0)], None],
        [None, [fid(70)], [extra(2)]],
        [],
    ]
    assert plan.by_correlation == {70: [fid(70), extra(0), extra(1)], 71: [fid(71), extra(2)]}
    assert plan.arrows == 5
