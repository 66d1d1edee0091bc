"""Fixture adapter, columnar model, classification and clock alignment."""

from __future__ import annotations

import numpy as np
import pytest

from stepscope import _schema
from stepscope.gpu import clock
from stepscope.gpu.fixture import batch_from_records, load_fixture
from stepscope.gpu.records import (
    ActivityBatch,
    api_name,
    kernel_category,
    kernel_class,
    signed_ids,
)

MAIN, LOADER = 80499008, 1459615424  # CUPTI thread ids of the fixture's two threads


def test_fixture_record_counts(fixture, fixture_path):
    b = fixture.batch
    assert (b.kernels.size, b.memcpys.size, b.memsets.size, b.syncs.size) == (545, 36, 36, 51)
    # correlated API calls only: 75 cudaLaunchKernel + 72 cudaLaunchKernelExC + 36 memcpy +
    # 36 memset + 48 stream syncs + 2 device syncs + 1 event sync; 398 cuLaunchKernel (CuPy)
    assert b.runtime.size == 270
    assert b.driver.size == 398
    assert len(b) == 545 + 36 + 36 + 51 + 270 + 398
    assert sorted(np.unique(b.kernels["stream"]).tolist()) == [7, 13]
    assert sorted(np.unique(b.memcpys["stream"]).tolist()) == [7, 13, 14]
    everything = load_fixture(fixture_path, api="all").batch
    assert (everything.runtime.size, everything.driver.size) == (4443, 3315)


def test_every_device_record_has_its_launch_call(fixture):
    b = fixture.batch
    api = np.concatenate([b.runtime["correlation"], b.driver["correlation"]])
    for table in (b.kernels, b.memcpys, b.memsets, b.syncs):
        assert np.isin(table["correlation"], api).all()
    # in CUPTI's own clock a kernel never starts before the call that launched it
    order = np.argsort(api)
    starts = np.concatenate([b.runtime["start"], b.driver["start"]])[order]
    launch_start = starts[np.searchsorted(api[order], b.kernels["correlation"])]
    assert (b.kernels["start"] >= launch_start).all()


def test_kernel_fields_of_the_sgemm(fixture):
    b = fixture.batch
    names = b.kernel_names()
    k = b.kernels[np.array(["cutlass_80_simt_sgemm_256x128" in n for n in names])][0]
    assert (k["grid_x"], k["grid_y"], k["grid_z"]) == (64, 2, 1)
    assert (k["block_x"], k["block_y"], k["block_z"]) == (256, 1, 1)
    assert (k["registers"], k["static_smem"], k["dynamic_smem"]) == (202, 0, 49152)
    assert k["device"] == 0 and k["stream"] == 13


def test_memcpy_and_sync_fields(fixture):
    b = fixture.batch
    assert set(b.memcpys["copy_kind"].tolist()) == {2}  # DtoH
    assert sorted(set(b.memcpys["bytes"].tolist())) == [4, 320]
    # context synchronizations carry CUPTI's invalid stream id
    assert (b.syncs["stream"] == 0xFFFFFFFF).sum() == 3


def test_classification():
    assert kernel_class("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage)") == (
        "communication"
    )
    assert kernel_class("ncclKernel_AllGather_RING_LL_Sum_int8_t") == "communication"
    assert kernel_class("cupy_maximum__float32_float_float32") == "compute"
    assert kernel_category("NCCLKernel") == _schema.CAT_COMMUNICATION
    assert kernel_category("sgemm") == _schema.CAT_KERNEL
    b = batch_from_records(
        [
            {"kind": "CONCURRENT_KERNEL", "name": "ncclDevKernel_SendRecv", "start": 0, "end": 1},
            {"kind": "CONCURRENT_KERNEL", "name": "sgemm", "start": 1, "end": 2},
            {"kind": "CONCURRENT_KERNEL", "name": "ncclDevKernel_SendRecv", "start": 2, "end": 3},
        ]
    )
    assert b.kernel_is_communication().tolist() == [True, False, True]
    assert b.names == ["ncclDevKernel_SendRecv", "sgemm"]


def test_fixture_kernels_are_all_compute(fixture):
    assert not fixture.batch.kernel_is_communication().any()


def test_concat_reinterns_names():
    a = batch_from_records([{"kind": "CONCURRENT_KERNEL", "name": "x", "start": 0, "end": 1}])
    b = batch_from_records(
        [
            {"kind": "CONCURRENT_KERNEL", "name": "y", "start": 2, "end": 3},
            {"kind": "CONCURRENT_KERNEL", "name": "x", "start": 4, "end": 5},
        ]
    )
    b.dropped = 3
    c = ActivityBatch.concat([a, b])
    assert c.kernel_names().tolist() == ["x", "y", "x"]
    assert c.dropped == 3
    assert c.time_range() == (0, 5)


def test_api_names():
    assert api_name(211, driver=False) == "cudaLaunchKernel"
    assert api_name(307, driver=True) == "cuLaunchKernel"
    assert api_name(9999, driver=False) == "cudaRuntime#9999"
    assert api_name(9999, driver=True, names={9999: "cuFoo"}) == "cuFoo"


def test_bad_inputs_are_clear_errors(tmp_path):
    bad = tmp_path / "x.json.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="not a gzip'd JSON"):
        load_fixture(bad)
    with pytest.raises(ValueError, match="kind"):
        batch_from_records([{"start": 0}])
    with pytest.raises(ValueError, match="api must be"):
        batch_from_records([], api="some")


def test_cupti_clock_is_realtime_within_a_few_us(fixture):
    pairs = fixture.clock_pairs
    # each pair read cupti then time_ns back to back: 3691 ns and 3298 ns apart
    assert [p["time_ns"] - p["cupti"] for p in pairs] == [3691, 3298]
    assert abs(clock.offset_from_pairs(pairs, "cupti", "time_ns")) < 5_000
    # realtime vs monotonic drifted by 393 ns over 3.5 s
    assert clock.drift_ns(pairs, "cupti", "time_ns") == -393


def test_to_clock_interpolates_between_pairs():
    pairs = [{"a": 1000, "b": 10}, {"a": 2000, "b": 1030}]  # offsets -990, -970
    out = clock.to_clock(np.array([1000, 1500, 2000, 3000]), pairs, "a", "b")
    assert out.tolist() == [10, 520, 1030, 2030]  # 1500 - 980 = 520; 3000 - 970 = 2030
    assert clock.to_clock(np.array([5]), pairs[:1], "a", "b").tolist() == [-985]


def test_host_and_device_line_up_through_the_clock_pairs(fixture):
    b = fixture.batch
    api = np.concatenate([b.runtime, b.driver])
    start = clock.to_clock(api["start"], fixture.clock_pairs, "cupti", "perf_counter_ns")
    end = clock.to_clock(api["end"], fixture.clock_pairs, "cupti", "perf_counter_ns")

    def inside(mask, ranges):
        ok = np.zeros(mask.sum(), bool)
        for h in ranges:
            ok |= (start[mask] >= h["start"]) & (end[mask] <= h["end"])
        return ok

    loader = api["thread"] == LOADER
    produce = [h for h in fixture.host_ranges if h["name"] == "loader.produce"]
    assert loader.sum() == 144 and inside(loader, produce).all()
    steps = [h for h in fixture.host_ranges if h["name"] == "ProfileStep"]
    # every kernel launched by the main thread once the steps began is launched inside a step
    launches = np.isin(api["correlation"], b.kernels["correlation"])
    main_in_steps = launches & (api["thread"] == MAIN) & (start >= steps[0]["start"])
    assert main_in_steps.sum() > 400
    assert inside(main_in_steps, steps).all()


def test_invalid_ids_become_minus_one():
    """CUPTI's unsigned invalid id (0xFFFFFFFF) as -1, from lists and unsigned arrays alike."""
    assert signed_ids([0, 7, 0xFFFFFFFF]).tolist() == [0, 7, -1]
    got = signed_ids(np.array([0xFFFFFFFF, 3], dtype=np.uint32))
    assert got.tolist() == [-1, 3]
    assert signed_ids(np.array([0xFFFFFFFF, 0xFFFFFFFE], dtype=np.int64)).tolist() == [
        -1, 0xFFFFFFFE]  # fmt: skip
    rows = batch_from_records(
        [{"kind": "SYNCHRONIZATION", "start": 1, "end": 2, "stream_id": 0xFFFFFFFF,
          "correlation_id": 3, "type": 3}]  # no context id: CUPTI's invalid one
    ).syncs  # fmt: skip
    assert (rows["context"].tolist(), rows["stream"].tolist()) == ([-1], [0xFFFFFFFF])


def test_screened_keeps_what_a_window_can_hold():
    w0, w1 = 10_000_000, 20_000_000
    recs = [
        {"kind": "CONCURRENT_KERNEL", "name": "in", "start": w0 + 10, "end": w1 + 500_000},
        {"kind": "CONCURRENT_KERNEL", "name": "zero", "start": 0, "end": 0},
        {"kind": "MEMSET", "start": w0 + 20, "end": w0 + 10},  # incomplete: end before start
        {"kind": "MEMCPY", "start": w0 - 999_999, "end": w0 - 5},  # inside the slack
        {"kind": "MEMCPY", "start": w0 - 1_000_001, "end": w0},  # before it
        {"kind": "RUNTIME", "start": w1 + 1_000_001, "end": w1 + 1_000_002},  # after it
        {"kind": "RUNTIME", "start": w1 + 1_000_000, "end": w1 + 1_000_002},
    ]
    b = batch_from_records(recs, api="all")
    got, n = b.screened((w0, w1))
    assert n == 4
    assert got.kernels["start"].tolist() == [w0 + 10] and got.kernel_names().tolist() == ["in"]
    assert got.memsets.size == 0
    assert got.memcpys["start"].tolist() == [w0 - 999_999]
    assert got.runtime["start"].tolist() == [w1 + 1_000_000]
    # without a window only the stamps are judged; a batch with nothing to drop is itself
    assert b.screened()[1] == 2
    assert got.screened((w0, w1)) == (got, 0)
