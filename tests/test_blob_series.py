"""Blob series: a converter's records handed over as columns (``Emitter.completes_columns``,
``counters_columns``) are written exactly as the same events one by one would be (the GPU
converter writes its kernels, CUDA calls and counter samples this way: ~6x cheaper per record
than a blob per event, ``tools/bench_gpu.py``)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from perfetto_decode import decode
from stepscope._schema import LEVEL_DETAIL
from stepscope.core.session import Session
from stepscope.record import recorder as _recorder
from stepscope.write import encoder as _encoder

EID = _recorder.event_id("gemm", ("kernel",))
OTHER = _recorder.event_id("cudaLaunchKernel", ("cuda_runtime",))


def test_series_events_encode_as_their_blobs():
    """Byte for byte what ``blob_event`` writes for each event as a plain blob: bases with and
    without args, int args of every varint length and negative, float args, single flows,
    several flows (a graph launch's, through the per-event path), terminating flows, counter
    values."""
    bases = [(EID, 5, {"grid": 3, "occupancy": 0.5, "kind": "a"}), (OTHER, 6, None),
             (EID, 300, {"grid": 1})]
    ints = [[0, 1], [127, 128], [-2, 1 << 40], [(1 << 63) - 1, -(1 << 63)], [16384, 5]]
    s = _recorder.BlobSeries(_recorder.BEGIN, LEVEL_DETAIL, bases, [0, 1, 2, 1, 0],
                             ("correlation", "cbid"), ints,
                             flows=[0, 7, 0, (1 << 64) - 1, 3], tflows=[9, 0, 0, 0, 1 << 62],
                             flow_lists={2: [4, 5, 6]})
    floats = _recorder.BlobSeries(_recorder.BEGIN, LEVEL_DETAIL, bases[:2], [0, 1, 0],
                                  ("bytes",), [[8], [1 << 20], [0]], tflows=[0, 3, 0],
                                  float_names=("bandwidth", "ratio"),
                                  floats=[[1.5, -0.0], [float("inf"), 1e-300], [0.1, 2.0]])
    counters = _recorder.BlobSeries(_recorder.COUNTER, LEVEL_DETAIL, [(0, 5, None), (0, 7, None)],
                                    [0, 1, 1], values=[1.5, -2.0, float("nan")])
    with_args = _recorder.BlobSeries(_recorder.COUNTER, LEVEL_DETAIL, [(0, 5, {"unit": "x"})],
                                     [0, 0], values=[1.0, 2.0])
    interner = _encoder.Interner()
    for series in (s, floats, counters, with_args):
        got = _encoder.series_templates(interner, b"\x50\x07", series, np.arange(len(series)))
        want = [b"\x50\x07" + _encoder.blob_event(interner, series.blob(i))
                for i in range(len(series))]
        assert got == want
    # a subset, out of order (a flush takes some events of a series)
    got = _encoder.series_templates(interner, b"", s, np.array([4, 2, 0]))
    assert got == [_encoder.blob_event(interner, s.blob(i)) for i in (4, 2, 0)]
    assert s.blob(2).flows == [4, 5, 6] and s.blob(1).flows == [7] and s.blob(0).flows is None


def _events(path) -> list[tuple]:
    d = decode(path)
    names = {u: t.name for u, t in d.tracks.items()}
    return [(e.ts, e.type, names.get(e.track), e.name, e.categories, e.args, e.flows,
             e.tflows, e.value) for e in d.events]


def _write(path, columns: bool, now: int) -> None:
    """Slices on two tracks (ties, zero lengths, nesting, a several-flow launch) and counter
    samples, one by one or as columns."""
    ts = now + np.array([100, 100, 100, 150, 150, 400, 120], dtype=np.int64)
    dur = np.array([50, 0, 300, 0, 10, 5, 10], dtype=np.int64)
    base = np.array([0, 1, 0, 2, 1, 0, 2])
    corr = np.array([11, 12, 13, 14, 15, 1 << 33, 17])
    flows = np.array([0, 21, 0, 0, 23, 24, 0], dtype=np.uint64)
    tflows = np.array([31, 0, 0, 0, 0, 0, 37], dtype=np.uint64)
    lists = {2: [41, 42]}
    bw = dur / 7.0
    sess = Session(path).start()
    em = sess.emitter(clock="realtime", level=LEVEL_DETAIL)
    a, b = sess.new_track("stream 7"), sess.new_track("CUDA API")
    ctr = sess.new_counter_track("util", unit=None)
    bases = [("gemm", "kernel", a, {"grid": 4, "occupancy": 0.25}),
             ("cudaLaunchKernel", "cuda_runtime", b, None),
             ("relu", "kernel", a, {"grid": 1})]
    cts = now + np.array([100, 100, 300, 200], dtype=np.int64)
    values = np.array([10.0, 20.0, 0.0, 35.5])
    if columns:
        em.completes_columns(ts, dur, bases, base, {"correlation": corr}, flows=flows,
                             tflows=tflows, flow_lists=lists, float_args={"bandwidth": bw})
        em.counters_columns(cts, np.full(4, ctr), values)
    else:
        for i in range(len(ts)):
            name, cat, track, args = bases[base[i]]
            f = lists.get(i) or ([int(flows[i])] if flows[i] else None)
            em.complete(int(ts[i]), int(dur[i]), name, track, cat,
                        {**(args or {}), "correlation": int(corr[i]),
                         "bandwidth": float(bw[i])}, flow_ids=f,
                        terminating_flow_ids=[int(tflows[i])] if tflows[i] else None)
        for t, v in zip(cts.tolist(), values.tolist(), strict=True):
            em.counter(t, ctr, v)
    sess.stop()


def test_columns_write_the_trace_of_single_events(tmp_path):
    """The same events through ``complete``/``counter`` one by one and through the column
    calls: the same decoded events in the same order (each slice's end shared per track)."""
    now = time.time_ns()  # (the realtime clock: stamps near now)
    _write(tmp_path / "one.pftrace", False, now)
    _write(tmp_path / "cols.pftrace", True, now)
    one = _events(tmp_path / "one.pftrace")
    assert len([e for e in one if e[1] in "BE"]) == 14 and len([e for e in one if e[1] == "C"])
    assert _events(tmp_path / "cols.pftrace") == one
    assert not _recorder.blobs  # every series and shared end let go after the flush


def test_a_series_past_its_size_limit_is_split(tmp_path, monkeypatch):
    """Event numbers ride above ``SERIES_SHIFT`` in the code, up to ``SERIES_MAX`` a series:
    more are cut into several series, written as one; the writer encodes a series
    ``SERIES_CHUNK`` events at a time."""
    monkeypatch.setattr(_recorder, "SERIES_MAX", 3)
    monkeypatch.setattr(_encoder, "SERIES_CHUNK", 2)
    now = time.time_ns()  # (the realtime clock: stamps near now)
    _write(tmp_path / "one.pftrace", False, now)
    _write(tmp_path / "cols.pftrace", True, now)
    assert _events(tmp_path / "cols.pftrace") == _events(tmp_path / "one.pftrace")
    with pytest.raises(ValueError, match="at most 3 events"):
        _recorder.BlobSeries(_recorder.BEGIN, LEVEL_DETAIL, [(EID, 5, None)], [0] * 4)
