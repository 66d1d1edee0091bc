"""The live CUPTI path, driven by a stand-in for ``cupti.cupti`` that replays the fixture's records
as activity objects; and the real thing on a GPU machine (marked ``gpu``)."""

from __future__ import annotations

import gzip
import json
import logging
import threading
import time

import numpy as np
import pytest
from gpu_fakes import FakeCupti

from stepscope.gpu.cupti_live import CuptiTracer
from stepscope.gpu.fixture import batch_from_records


@pytest.fixture(scope="module")
def records(fixture_path):
    with gzip.open(fixture_path, "rt") as f:
        return json.load(f)["cupti_records"]


def _sorted(table):
    return table[np.argsort(table["correlation"], kind="stable")]


@pytest.mark.parametrize("per_api", [False, True])
def test_live_path_decodes_like_the_fixture_adapter(records, per_api):
    fake = FakeCupti(records, per_api=per_api)
    tracer = CuptiTracer(cupti_module=fake)
    assert tracer.start()
    assert fake.enabled == {1, 2, 4, 5, 10, 38}
    assert abs(tracer.offset_ns - 3000) < 1_000_000  # calibrated against time.time_ns()
    batch = tracer.stop()
    assert fake.enabled == set()
    want = batch_from_records(records, api="correlated")
    for attr in ("kernels", "memcpys", "memsets", "syncs", "runtime", "driver"):
        np.testing.assert_array_equal(_sorted(getattr(batch, attr)), _sorted(getattr(want, attr)))
    assert batch.kernel_names().tolist() == want.kernel_names().tolist()
    assert batch.dropped == 2
    names = tracer.api_names()
    assert names[(False, 211)] == "cudaLaunchKernel" and names[(True, 307)] == "cuLaunchKernel"
    assert (False, 17) not in names
    if per_api:  # every callback switched explicitly: the chosen ones on, the rest off
        on = [(d, c) for d, c, flag in fake.api_enabled if flag]
        off = [(d, c) for d, c, flag in fake.api_enabled if not flag]
        assert sorted(on) == sorted(
            [("rt", c) for c in (41, 51, 131, 138, 165, 211, 311, 430)] + [("drv", 307)]
        )
        assert sorted(off) == [("drv", 677), ("rt", 17), ("rt", 290)]


class _FakeClocks:
    """The system clock and a TSC-like CUPTI clock (2.5 ticks per ns, another origin), both
    moved by the test: each read advances the system clock 1 µs, so a bracketed CUPTI read sits
    exactly at its bracket's midpoint."""

    def __init__(self, now: int) -> None:
        self.now = now

    def time_ns(self) -> int:
        self.now += 1000
        return self.now - 1000

    def ticks(self, t: int) -> int:
        return (t - 1_700_000_000_000_000_000) * 5 // 2 + 10**12

    def get_timestamp(self) -> int:
        self.now += 1000
        return self.ticks(self.now - 1000)


def test_a_cupti_clock_in_ticks_is_mapped_onto_the_system_clock(records, monkeypatch):
    """Kineto registers a TSC timestamp callback with CUPTI whenever it profiles on a GPU
    machine, CPU-only too: records and cuptiGetTimestamp then carry ticks. A constant offset
    would spread the window's records over 2.5 times its length (the rest fell outside the window
    and was left out, as seen on an H100); the rate between the window's two clock reads maps
    every stamp back to the system clock."""
    import stepscope.gpu.clock as clock

    first = min(r["start"] for r in records)
    last = max(r["end"] for r in records)
    fake_clock = _FakeClocks(first - 1_000_000)
    monkeypatch.setattr(clock, "time", fake_clock)
    ticked = [{**r, "start": fake_clock.ticks(r["start"]), "end": fake_clock.ticks(r["end"])}
              for r in records]  # fmt: skip
    fake = FakeCupti(ticked)
    fake.get_timestamp = fake_clock.get_timestamp
    tracer = CuptiTracer(cupti_module=fake)
    assert tracer.start()
    fake_clock.now = last + 1_000_000  # the window's work, the fixture's 3.5 s
    batch = tracer.stop()
    assert tracer.offset_ns == 0  # the batch is in the system clock already
    want = batch_from_records(records, api="correlated")
    for attr in ("kernels", "memcpys", "memsets", "syncs", "runtime", "driver"):
        got, exp = _sorted(getattr(batch, attr)), _sorted(getattr(want, attr))
        assert got.size == exp.size > 0, attr
        for col in ("start", "end"):
            assert np.abs(got[col] - exp[col]).max() <= 1, (attr, col)  # tick rounding
    # a CUPTI clock in nanoseconds is left as it is, placed by the offset read at the start
    tracer = CuptiTracer(cupti_module=FakeCupti(records))
    assert tracer.start()
    batch = tracer.stop()
    np.testing.assert_array_equal(_sorted(batch.kernels), _sorted(want.kernels))


def test_bounded_buffers_count_what_they_drop(records):
    tracer = CuptiTracer(cupti_module=FakeCupti(records, dropped=0), max_records=3000)
    assert tracer.start()
    batch = tracer.stop()
    # three buffers of 2809, 2809, 2808 records: the first fits, the other two are dropped
    assert batch.dropped == 2809 + 2808
    assert len(batch) > 0


def test_without_cupti_it_switches_off_with_one_log_line(caplog, monkeypatch):
    import stepscope.gpu.cupti_live as live

    monkeypatch.setattr(live, "_import_cupti", lambda: None)
    tracer = CuptiTracer()
    with caplog.at_level(logging.INFO, logger="stepscope.gpu"):
        assert tracer.start() is False
    assert [r.message for r in caplog.records] == [
        "stepscope: cupti-python not installed; GPU activity tracing off"
    ]
    assert len(tracer.stop()) == 0
    ok, why = tracer.available()
    assert not ok and "cupti-python" in why


def test_a_failing_cupti_switches_off_cleanly(records, caplog):
    fake = FakeCupti(records)

    def boom(kind):
        raise RuntimeError("CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED")

    fake.activity_enable = boom
    with caplog.at_level(logging.INFO, logger="stepscope.gpu"):
        assert CuptiTracer(cupti_module=fake).start() is False
    assert "GPU activity tracing off" in caplog.records[-1].message


@pytest.mark.gpu
def test_real_cupti_records_a_cupy_kernel(gpu_cupy):
    cp = gpu_cupy
    pytest.importorskip("cupti")
    tracer = CuptiTracer()
    assert tracer.start()
    x = cp.arange(1 << 20, dtype=cp.float32)
    (x * 2).sum()
    cp.cuda.get_current_stream().synchronize()
    batch = tracer.stop()
    assert batch.kernels.size >= 1
    api = np.concatenate([batch.runtime["correlation"], batch.driver["correlation"]])
    assert np.isin(batch.kernels["correlation"], api).all()
    assert abs(tracer.offset_ns) < 1_000_000


def _traced(cp, **kw):
    tracer = CuptiTracer(**kw)
    assert tracer.start()
    x = cp.arange(1 << 20, dtype=cp.float32)
    for _ in range(5):
        x = (x * 2).sum() + x
    cp.asnumpy(x[:1024])  # a 4 KiB copy device -> host
    cp.zeros(4096, dtype=cp.float32)  # a 16 KiB memset
    cp.cuda.get_current_stream().synchronize()
    return tracer, tracer.stop()


@pytest.mark.gpu
def test_real_cupti_raw_and_record_paths_agree(gpu_cupy):
    """On a GPU: the raw-buffer path is the one taken, and it decodes what cupti-python's
    per-record objects give for the same work (kernel names and launch configurations)."""
    cp = gpu_cupy
    pytest.importorskip("cupti")
    _traced(cp, raw=False)  # warm-up: module loads, first-launch records
    raw_tracer, raw = _traced(cp)
    rec_tracer, rec = _traced(cp, raw=False)
    assert raw_tracer.path == "raw" and rec_tracer.path == "records"

    def shape(b):
        k = b.kernels
        cols = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "registers",
                "static_smem", "dynamic_smem")  # fmt: skip
        return sorted(zip(b.kernel_names().tolist(), *(k[c].tolist() for c in cols),
                          strict=True))  # fmt: skip

    assert raw.kernels.size > 0 and shape(raw) == shape(rec)
    assert (raw.kernels["end"] > raw.kernels["start"]).all()
    api = np.concatenate([raw.runtime["correlation"], raw.driver["correlation"]])
    assert np.isin(raw.kernels["correlation"], api).all()
    # the other record kinds, field by field where two runs of the same work agree
    for table, cols in (("memcpys", ("bytes", "copy_kind", "src_kind", "dst_kind", "device")),
                        ("memsets", ("bytes", "value", "device"))):  # fmt: skip
        a, b = getattr(raw, table), getattr(rec, table)
        assert a.size > 0 and sorted(a[list(cols)].tolist()) == sorted(b[list(cols)].tolist())
        assert (a["end"] >= a["start"]).all() and np.isin(a["correlation"], api).all()
    assert sorted(raw.runtime["cbid"].tolist()) == sorted(rec.runtime["cbid"].tolist())
    me = {threading.get_ident() & 0xFFFFFFFF, threading.get_native_id()}
    assert set(raw.runtime["thread"].tolist()) <= me


def test_a_binding_without_graph_node_ids_switches_getters_once():
    from types import SimpleNamespace

    from stepscope.gpu.cupti_live import _Getter

    g = _Getter("memset", ("start", "graph_node_id", "bytes"))
    full = g.row
    odd = SimpleNamespace(start=0, graph_node_id=1)  # it has the optional one: another layout
    assert g.row_after_error(odd) is None and g.row is full  # dropped, no switch
    assert g.row(SimpleNamespace(start=1, graph_node_id=9, bytes=4)) == (1, 9, 4)
    # more than the optional one missing: dropped, and the getter keeps reading graph ids
    assert g.row_after_error(SimpleNamespace(start=1)) is None and g.row is full
    assert g.row(SimpleNamespace(start=2, graph_node_id=7, bytes=4)) == (2, 7, 4)
    old = SimpleNamespace(start=2, bytes=5)  # an older binding: no graph_node_id
    with pytest.raises(AttributeError):
        g.row(old)
    assert g.row_after_error(old) == (2, 5) and g.row is not full  # switched
    assert g.row(SimpleNamespace(start=3, bytes=6)) == (3, 6)  # C getter, no retry
    assert g.row_after_error(SimpleNamespace(start=4)) is None  # unknown layout: dropped
    assert g.widen([(1, 9, 4), (2, 5), (3, 6)]) == [(1, 9, 4), (2, 0, 5), (3, 0, 6)]
    plain = _Getter("sync", ("start", "end"))
    assert plain.row_after_error(SimpleNamespace(start=1)) is None
    assert plain.widen([(1, 2)]) == [(1, 2)]


def test_decode_puts_back_the_optional_attribute_of_switched_rows(records):
    """``decode`` (public: the benchmark calls it) widens the rows a switched getter read, as
    the window end does: mixed rows make one table, the missing graph node id read as 0."""
    tracer = CuptiTracer(cupti_module=FakeCupti(records))
    assert tracer.start()
    tracer.stop()
    (g,) = [g for g in tracer._getters.values() if g.key == "memset"]
    assert g.row is g.reduced  # the fixture's memsets have no graph node id (older binding)
    full = (1, 2, 0, 0, 7, 11, 64, 0, 5, 6)  # start, end, device, ..., graph_id, graph_node_id
    rows = {"memset": [full, full[:-1]]}
    b = tracer.decode(rows)
    assert b.memsets["graph_node_id"].tolist() == [6, 0]
    assert b.memsets["graph_id"].tolist() == [5, 5]
    assert rows["memset"][1] == full[:-1]  # the caller's rows are left as they were


def test_window_end_synchronizes_then_disables_then_flushes(records):
    # CUPTI's flush does not synchronize: without the wait, kernels still running come back
    # incomplete; disabled first, work launched after the window stays out of it
    fake = FakeCupti(records)
    calls = []
    flush = fake.activity_flush_all

    def flushing(flag):
        calls.append(("flush", flag, sorted(fake.enabled)))
        flush(flag)

    fake.activity_flush_all = flushing
    tracer = CuptiTracer(cupti_module=fake,
                         synchronize=lambda: calls.append(("sync", sorted(fake.enabled))))
    assert tracer.start()
    tracer.stop()
    # the API and synchronization kinds are off first: the wait is the profiler's, not the
    # program's; memcpy, memset and kernels stay on until it is over
    assert calls == [("sync", [1, 2, 10]), ("flush", 1, [])]


def test_one_rejected_callback_id_leaves_the_others_switched(records):
    fake = FakeCupti(records, per_api=True)
    enable = fake.activity_enable_runtime_api

    def rejecting(cbid, on):
        if cbid == 17:  # the first id: an API this CUDA no longer has
            raise RuntimeError("CUPTI_ERROR_INVALID_PARAMETER")
        enable(cbid, on)

    fake.activity_enable_runtime_api = rejecting
    tracer = CuptiTracer(cupti_module=fake)
    assert tracer.start()
    tracer.stop()
    assert sorted(c for d, c, on in fake.api_enabled if d == "rt" and on) == [
        41, 51, 131, 138, 165, 211, 311, 430]  # fmt: skip


def test_clock_offset_is_measured_each_window(records, monkeypatch):
    fake = FakeCupti(records)
    tracer = CuptiTracer(cupti_module=fake)
    assert tracer.start()
    tracer.stop()
    assert abs(tracer.offset_ns - 3000) < 1_000_000
    # the system clock was stepped by 5 s between the windows
    monkeypatch.setattr(fake, "get_timestamp", lambda: time.time_ns() - 5_000_003_000)
    assert tracer.start()
    tracer.stop()
    assert abs(tracer.offset_ns - 5_000_003_000) < 1_000_000
