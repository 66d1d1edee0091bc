"""Fixture records → trace, decoded with the official protos: tracks, flows, clock, counters."""

from __future__ import annotations

import collections
import time

import numpy as np
import pytest
from gpu_trace_decode import TYPE_INSTANT, decode

from stepscope import _schema
from stepscope.core import session as _session
from stepscope.gpu.convert import GpuTraceConverter, assign_lanes, demangle, flow_ids_for
from stepscope.gpu.fixture import batch_from_records, rebase_shift, shifted
from stepscope.gpu.occupancy import DeviceLimits

H100 = DeviceLimits.for_compute_capability(9, 0, sm_count=132, name="H100")
REALTIME = 1
NOW = time.time_ns() // 10**9 * 10**9  # REALTIME now: trace processor drops times before boot


def run(tmp_path, batch, devices, **kw):
    path = tmp_path / "gpu.pftrace"
    sess = _session.Session(path, detail=True).start()
    try:
        convert_kw = {k: kw.pop(k) for k in ("window", "steps") if k in kw}
        conv = GpuTraceConverter(sess, devices, **kw)
        stats = conv.convert(batch, **convert_kw)
    finally:
        sess.stop()
    return decode(path), stats, sess


@pytest.fixture(scope="module")
def converted(fixture, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("conv")
    return run(tmp, fixture.batch, {0: fixture.device}, pid=407, steps=12)


def test_track_tree(converted, fixture):
    tr, _, sess = converted
    (gpu,) = tr.tracks_named("GPU 0 (NVIDIA H100 80GB HBM3)")
    assert tr.tracks[gpu].parent_uuid == sess.process_uuid
    streams = {tr.track_name(u): u for u in tr.tracks if tr.tracks[u].parent_uuid == gpu}
    assert set(streams) == {"stream 7", "stream 13", "stream 14", "sync"}
    for thread in (80499008, 1459615424):
        (api,) = tr.tracks_named(f"CUDA API (thread {thread})")
        assert tr.tracks[api].parent_uuid == sess.process_uuid
    for name in ("GPU 0 utilization", "GPU 0 est. SM efficiency", "GPU 0 est. achieved occupancy"):
        (u,) = tr.tracks_named(name)
        assert tr.tracks[u].counter.unit_name == "%"


def test_slices_per_category_and_track(converted):
    tr, stats, _ = converted
    cats = collections.Counter(s.category for s in tr.slices)
    assert cats == {
        "kernel": 545,
        "memcpy": 36,
        "memset": 36,
        "sync": 51,
        "cuda_runtime": 270,
        "cuda_driver": 398,
    }
    assert stats.records == 545 + 36 + 36 + 51 + 270 + 398
    by_track = collections.Counter(
        tr.track_name(s.track) for s in tr.slices if s.category in ("kernel", "memcpy", "memset")
    )
    # kernels: stream 7 (loader's curand, 14 + 12 + 1) and 13; memcpy/memset as in the records
    assert by_track["stream 14"] == 12
    assert sum(by_track.values()) == 545 + 36 + 36
    api = collections.Counter(
        tr.track_name(s.track) for s in tr.slices if s.category.startswith("cuda_")
    )
    assert api == {"CUDA API (thread 80499008)": 524, "CUDA API (thread 1459615424)": 144}


def test_every_launch_has_a_flow_to_its_device_work(converted, fixture):
    tr, stats, _ = converted
    api = {s.args["correlation_id"]: s for s in tr.slices if s.category.startswith("cuda_")}
    device = [s for s in tr.slices if s.category in ("kernel", "memcpy", "memset", "sync")]
    assert stats.flows == len(device) == 668
    for s in device:
        launch = api[s.args["correlation_id"]]
        assert len(s.terminating_flow_ids) == 1
        assert launch.flow_ids == s.terminating_flow_ids
        assert launch.ts <= s.ts  # launched before it ran (same CUPTI clock)
    ids = [s.terminating_flow_ids[0] for s in device]
    assert len(set(ids)) == len(ids)
    corr = fixture.batch.kernels["correlation"][0]
    # rank 0, pid 407 (0x197, under 12 bits)
    assert ids and flow_ids_for(np.array([corr]), 407)[0] == (0x5C << 56 | 407 << 32 | int(corr))


def test_kernel_args_of_the_sgemm(converted):
    tr, _, _ = converted
    sgemm = [s for s in tr.slices if "cutlass_80_simt_sgemm_256x128" in s.name]
    assert len(sgemm) == 12
    a = sgemm[0].args
    assert (a["grid_x"], a["grid_y"], a["grid_z"]) == (64, 2, 1)
    assert (a["block_x"], a["block_y"], a["block_z"]) == (256, 1, 1)
    assert a["registers_per_thread"] == 202
    assert (a["static_shared_memory"], a["dynamic_shared_memory"]) == (0, 49152)
    assert a["blocks_per_sm"] == pytest.approx(128 / 132, abs=1e-6)
    assert a["warps_per_sm"] == pytest.approx(128 / 132 * 8, abs=1e-6)
    assert a["est_achieved_occupancy"] == pytest.approx(4 / 33, abs=1e-6)
    # demangled: cutlass::Kernel2<cutlass_80_simt_sgemm_256x128_8x4_nt_align1>(...)
    assert sgemm[0].name.startswith("void cutlass::Kernel2<cutlass_80_simt_sgemm_256x128")


def test_memcpy_args(converted, fixture):
    tr, _, _ = converted
    copies = [s for s in tr.slices if s.category == "memcpy"]
    m = fixture.batch.memcpys[0]
    (s,) = [c for c in copies if c.args["correlation_id"] == m["correlation"]]
    assert s.name == "Memcpy DtoH (Device -> Pageable)"
    assert s.args["bytes"] == m["bytes"] == 4
    assert s.args["copy_kind"] == "DtoH"
    dur = int(m["end"] - m["start"])
    assert s.dur == dur
    assert s.args["bandwidth_gbps"] == pytest.approx(4 / dur, abs=1e-4)


def test_device_slices_keep_cupti_realtime_stamps(converted, fixture):
    tr, _, _ = converted
    kernels = [s for s in tr.slices if s.category == "kernel"]
    assert {s.clock for s in kernels} == {REALTIME}
    # exact (start, duration) of every record: a misnested slice would pair the wrong ends
    b = fixture.batch
    for cats, tables in (
        (("kernel",), (b.kernels,)),
        (("memcpy", "memset"), (b.memcpys, b.memsets)),
        (("sync",), (b.syncs,)),
        (("cuda_runtime", "cuda_driver"), (b.runtime, b.driver)),
    ):
        got = sorted((s.ts, s.dur) for s in tr.slices if s.category in cats)
        want = sorted((int(r["start"]), int(r["end"] - r["start"])) for t in tables for r in t)
        assert got == want, cats


def _union_ns(intervals):
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0)


def test_utilization_counter_integrates_to_the_union_of_kernels(converted, fixture):
    tr, stats, _ = converted
    samples = tr.counter("GPU 0 utilization")
    k = fixture.batch.kernels
    union = _union_ns(zip(k["start"].tolist(), k["end"].tolist(), strict=True))
    # step function: value v (percent) holds from its sample to the next one
    busy = sum(v / 100 * (t1 - t0) for (t0, v), (t1, _) in zip(samples, samples[1:], strict=False))
    assert busy == pytest.approx(union, rel=1e-5)
    assert samples[-1][1] == 0.0
    assert all(0 <= v <= 100 for _, v in samples)
    # default bucket: kernels span 4.594522 s over 12 steps -> 382.9 ms per step; at most 20
    # buckets per step -> at least 19.14 ms -> 20 ms on the 1-2-5 series
    assert samples[1][0] - samples[0][0] == 20_000_000
    assert samples[0][0] % 20_000_000 == 0


def _kernel(start, end, stream=7, grid=132, corr=1, name="k"):
    return {
        "kind": "CONCURRENT_KERNEL",
        "name": name,
        "start": start,
        "end": end,
        "stream_id": stream,
        "device_id": 0,
        "context_id": 1,
        "correlation_id": corr,
        "grid_x": grid,
        "grid_y": 1,
        "grid_z": 1,
        "block_x": 128,
        "block_y": 1,
        "block_z": 1,
        "registers_per_thread": 32,
    }


def test_counters_for_two_overlapping_kernels_by_hand(tmp_path):
    # On 132 SMs: K1 66 blocks (0.5 blocks/SM) in [0, 6000); K2 99 blocks (0.75) in [4000, 9000),
    # on two streams. 128 threads, 32 regs: active blocks 16 (warp limit), so occupancy =
    # blocks/SM * 128 / 2048: K1 0.03125, K2 0.046875.
    t0 = NOW
    b = batch_from_records(
        [_kernel(t0, t0 + 6000, 7, 66, 1), _kernel(t0 + 4000, t0 + 9000, 9, 99, 2)]
    )
    tr, stats, _ = run(tmp_path, b, {0: H100}, bucket_ns=10_000, window=(t0, t0 + 10_000))
    assert tr.counter("GPU 0 utilization") == [(t0, 90.0), (t0 + 10_000, 0.0)]
    assert tr.counter("GPU 0 est. SM efficiency") == [(t0, 62.5), (t0 + 10_000, 0.0)]
    occ = tr.counter("GPU 0 est. achieved occupancy")
    assert occ[0][1] == pytest.approx(100 * (0.03125 * 6000 + 0.046875 * 5000) / 11000, abs=1e-4)
    assert stats.counter_samples == 6


def test_overlap_on_one_stream_goes_to_a_sibling_track(tmp_path):
    t0 = NOW
    b = batch_from_records(
        [
            _kernel(t0, t0 + 6000, corr=1),
            _kernel(t0 + 4000, t0 + 9000, corr=2),
            _kernel(t0 + 9000, t0 + 9500, corr=3),
        ]
    )
    tr, _, _ = run(tmp_path, b, {0: H100}, counters=False)
    lanes = tr.tracks_named("stream 7")
    assert len(lanes) == 2
    per = collections.Counter(s.track for s in tr.slices)
    assert sorted(per.values()) == [1, 2]


def test_dropped_records_are_written(tmp_path):
    b = batch_from_records([_kernel(NOW + 1000, NOW + 2000)])
    b.dropped = 5
    tr, stats, _ = run(tmp_path, b, {0: H100}, counters=False)
    marks = [e for e in tr.events if e.type == TYPE_INSTANT]
    assert len(marks) == 1 and marks[0].args == {_schema.ARG_DROPPED: 5}
    assert marks[0].categories == [_schema.CAT_STEPSCOPE]
    assert stats.dropped == 5


def test_assign_lanes_and_demangle():
    assert assign_lanes(np.array([0, 5, 10]), np.array([5, 10, 15])).tolist() == [0, 0, 0]
    # [0,5) lane 0; [1,3) lane 1; [2,7) finds both busy -> lane 2; [6,8) takes the lane that
    # freed first (lane 1 at 3)
    assert assign_lanes(np.array([0, 1, 2, 6]), np.array([5, 3, 7, 8])).tolist() == [0, 1, 2, 1]
    assert demangle(["_Z3fooi", "plain"]) == ["foo(int)", "plain"]


def test_converter_needs_a_device():
    class Fake:
        process_uuid = 1

        def emitter(self, **kw):
            return None

    with pytest.raises(ValueError, match="at least one device"):
        GpuTraceConverter(Fake(), {})


def test_each_device_uses_its_own_sm_count(tmp_path):
    small = DeviceLimits.for_compute_capability(8, 6, sm_count=66, name="A10")
    t0 = NOW
    k0 = _kernel(t0, t0 + 1000, grid=66, corr=1)
    k1 = {**_kernel(t0, t0 + 1000, grid=66, corr=2), "device_id": 1}
    tr, stats, _ = run(tmp_path, batch_from_records([k0, k1]), {0: H100, 1: small})
    bps = sorted(s.args["blocks_per_sm"] for s in tr.slices if s.category == "kernel")
    assert bps == [pytest.approx(0.5), pytest.approx(1.0)]  # 66/132 on the H100, 66/66 on the A10
    assert set(stats.metrics) == {0, 1}
    assert tr.tracks_named("GPU 1 (A10)") and tr.tracks_named("GPU 1 utilization")


def test_counters_reach_a_summary_only_file(tmp_path, fixture):
    path = tmp_path / "summary.pftrace"
    sess = _session.Session(tmp_path / "all.pftrace", detail=True)
    sess.add_sink(path, levels=("summary",))
    sess.start()
    try:
        batch = shifted(fixture.batch, rebase_shift(fixture.batch, []))  # recorded elsewhere
        GpuTraceConverter(sess, {0: fixture.device}).convert(batch, steps=12)
    finally:
        sess.stop()
    tr = decode(path)
    assert tr.slices == []
    assert len(tr.counter("GPU 0 utilization")) > 12


def test_empty_batch_writes_nothing(tmp_path):
    from stepscope.gpu.records import ActivityBatch

    tr, stats, _ = run(tmp_path, ActivityBatch(), {0: H100})
    assert stats.records == 0 and stats.counter_samples == 0
    assert tr.slices == [] and tr.events == []


def test_records_without_stamps_or_outside_the_window_are_left_out(tmp_path):
    # CUPTI writes start=end=0 where it could not collect stamps; a record flushed while still
    # running has end < start; one from before the window starts long before it. None may
    # stretch the buckets (to the 1970 epoch) or reach the trace.
    t0 = NOW
    b = batch_from_records(
        [_kernel(t0, t0 + 6000, 7, 66, 1), _kernel(t0 + 4000, t0 + 9000, 9, 99, 2),
         _kernel(0, 0, corr=3), _kernel(t0 + 5000, 0, corr=4),
         _kernel(t0 - 5_000_000, t0 - 4_000_000, corr=5)]
    )  # fmt: skip
    tr, stats, _ = run(tmp_path, b, {0: H100}, bucket_ns=10_000, window=(t0, t0 + 10_000))
    # the same counters as the two kernels alone (test_counters_for_two_overlapping_kernels)
    assert tr.counter("GPU 0 utilization") == [(t0, 90.0), (t0 + 10_000, 0.0)]
    assert tr.counter("GPU 0 est. SM efficiency") == [(t0, 62.5), (t0 + 10_000, 0.0)]
    assert stats.kernels == 2 and stats.left_out == 3 and stats.dropped == 0
    assert sorted(s.ts for s in tr.slices) == [t0, t0 + 4000]
    (mark,) = [e for e in tr.events if e.type == TYPE_INSTANT]
    assert mark.args == {_schema.ARG_DROPPED: 0, _schema.ARG_LEFT_OUT: 3}


def test_flow_ids_of_ranks_that_share_a_pid_differ(tmp_path):
    # ranks on two hosts may have the same pid; their files merge into one trace
    ids = {r: int(flow_ids_for(np.array([9]), 407, rank=r)[0]) for r in (0, 1, 300)}
    assert ids == {r: 0x5C << 56 | (r << 12 | 407) << 32 | 9 for r in (0, 1, 300)}
    sess = _session.Session(tmp_path / "r.pftrace", rank=300).start()
    try:
        conv = GpuTraceConverter(sess, {0: H100}, pid=407)
        b = batch_from_records(
            [_kernel(1000, 2000, corr=9),
             {"kind": "RUNTIME", "start": 500, "end": 900, "correlation_id": 9, "cbid": 211,
              "process_id": 407, "thread_id": 1}]
        )  # fmt: skip
        assert conv.flow_plan((b.kernels,), b.runtime["correlation"]).by_correlation == {
            9: [ids[300]]}  # fmt: skip
    finally:
        sess.stop()


def test_a_tiny_bucket_is_widened_to_a_bounded_count(tmp_path):
    t0 = NOW
    b = batch_from_records([_kernel(t0, t0 + 500_000_000)])
    tr, stats, _ = run(tmp_path, b, {0: H100}, bucket_ns=1, max_buckets=100,
                       window=(t0, t0 + 1_000_000_000))  # fmt: skip
    util = tr.counter("GPU 0 utilization")
    # 1 s over at most 100 buckets: 10 ms each; busy for the first half
    assert util[1][0] - util[0][0] == 10_000_000
    assert len(util) == 100 + 1  # one per bucket, then back to idle at the last edge
    assert [v for _, v in util] == [100.0] * 50 + [0.0] * 51


def test_every_memset_and_sync_as_its_record(converted, fixture):
    """Each memset and synchronization record, found by its correlation id: its stamps, name,
    track and args (these are written as columns, a shared base per stream and kind)."""
    from stepscope.gpu.records import INVALID_ID, SYNC_TYPE_NAMES

    tr, _, _ = converted
    b = fixture.batch
    by_corr = {(s.category, s.args["correlation_id"]): s for s in tr.slices
               if s.category in ("memset", "sync")}
    assert len(by_corr) == b.memsets.size + b.syncs.size == 36 + 51
    for r in b.memsets:
        s = by_corr["memset", int(r["correlation"])]
        assert (s.ts, s.dur, s.name) == (int(r["start"]), int(r["end"] - r["start"]), "Memset")
        assert s.args == {"bytes": int(r["bytes"]), "correlation_id": int(r["correlation"])}
        assert tr.track_name(s.track) == f"stream {int(r['stream'])}"
    for r in b.syncs:
        s = by_corr["sync", int(r["correlation"])]
        name = SYNC_TYPE_NAMES[int(r["type"])]
        assert (s.ts, s.dur, s.name) == (int(r["start"]), int(r["end"] - r["start"]), name)
        want = {"sync_type": name, "correlation_id": int(r["correlation"])}
        if r["stream"] != INVALID_ID:  # (an event's synchronization has no stream)
            want["stream"] = int(r["stream"])
        assert s.args == want
        assert tr.track_name(s.track) == "sync"
