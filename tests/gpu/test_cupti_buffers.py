"""Raw CUPTI activity buffers decoded in bulk (cupti_buffers), on synthetic buffers laid out as
cupti_activity.h lays records out, and the live tracer's raw path over a stand-in libcupti."""

from __future__ import annotations

import ctypes
import gzip
import json
import threading

import numpy as np
import pytest
from gpu_fakes import (
    RAW_SIZES,
    CStrings,
    FakeLibCupti,
    FakeRawCupti,
    encode_buffers,
    encode_record,
)

from stepscope.gpu import cupti_buffers as cb
from stepscope.gpu.cupti_live import CuptiTracer
from stepscope.gpu.fixture import batch_from_records

T0 = 1_795_341_789_440_000_000


@pytest.fixture(scope="module")
def records(fixture_path):
    with gzip.open(fixture_path, "rt") as f:
        return json.load(f)["cupti_records"]


def test_fields_are_naturally_aligned():
    """``gather`` reads each field through one typed view of the buffer: every offset must be a
    multiple of its width. (The offsets themselves are checked against CUPTI's headers in
    test_cupti_layouts.py.)"""
    for layout in (cb.RAW_KERNEL, cb.RAW_MEMCPY, cb.RAW_MEMSET, cb.RAW_API, cb.RAW_SYNC):
        for name in layout.names:
            ftype, foff = layout.fields[name][:2]
            assert foff % ftype.itemsize == 0, name


def synthetic():
    names = CStrings()
    recs = [
        {"kind": "RUNTIME", "start": T0, "end": T0 + 900, "correlation_id": 41, "cbid": 211,
         "process_id": 77, "thread_id": 4242},
        {"kind": "CONCURRENT_KERNEL", "name": "sgemm", "start": T0 + 2_000, "end": T0 + 9_000,
         "device_id": 0, "context_id": 1, "stream_id": 13, "correlation_id": 41, "grid_x": 64,
         "grid_y": 2, "grid_z": 1, "block_x": 256, "block_y": 1, "block_z": 1,
         "registers_per_thread": 202, "static_shared_memory": 0,
         "dynamic_shared_memory": 49152, "graph_id": 0, "graph_node_id": 0},
        {"kind": "MEMCPY", "start": T0 + 9_500, "end": T0 + 10_500, "device_id": 0,
         "context_id": 1, "stream_id": 14, "correlation_id": 42, "bytes": 1 << 20,
         "copy_kind": 1, "src_kind": 2, "dst_kind": 3, "graph_id": 3, "graph_node_id": 9},
        {"kind": "MEMSET", "start": T0 + 11_000, "end": T0 + 11_200, "device_id": 0,
         "context_id": 1, "stream_id": 14, "correlation_id": 43, "bytes": 4096, "value": 7},
        {"kind": "SYNCHRONIZATION", "start": T0 + 12_000, "end": T0 + 15_000,
         "context_id": 1, "stream_id": 0xFFFFFFFF, "correlation_id": 44, "type": 3,
         "cuda_event_id": 0xFFFFFFFF},
        {"kind": "CONCURRENT_KERNEL", "name": "relu", "start": T0 + 16_000,
         "end": T0 + 16_800, "device_id": 0, "context_id": 1, "stream_id": 13,
         "correlation_id": 45, "grid_x": 132, "grid_y": 1, "grid_z": 1, "block_x": 128,
         "block_y": 1, "block_z": 1, "registers_per_thread": 16, "static_shared_memory": 1024,
         "dynamic_shared_memory": 0, "graph_id": 5, "graph_node_id": 12},
        {"kind": "DRIVER", "start": T0 + 1_000, "end": T0 + 1_500, "correlation_id": 46,
         "cbid": 307, "process_id": 77, "thread_id": 4242},
    ]  # fmt: skip
    data = b"".join(encode_record(r, names) for r in recs)
    return names, recs, data


def test_decode_a_synthetic_buffer_field_by_field():
    names, recs, data = synthetic()
    assert len(data) == 40 + 200 + 88 + 88 + 48 + 200 + 40
    sizes = cb.RecordSizes(known=dict(RAW_SIZES))
    b = cb.decode_buffers([cb.RawBuffer(data, len(data))], sizes)
    k = b.kernels
    assert b.kernel_names().tolist() == ["sgemm", "relu"]
    assert k["start"].tolist() == [T0 + 2_000, T0 + 16_000]
    assert k["end"].tolist() == [T0 + 9_000, T0 + 16_800]
    assert (k["grid_x"].tolist(), k["grid_y"].tolist()) == ([64, 132], [2, 1])
    assert (k["block_x"].tolist(), k["registers"].tolist()) == ([256, 128], [202, 16])
    assert (k["static_smem"].tolist(), k["dynamic_smem"].tolist()) == ([0, 1024], [49152, 0])
    assert k["stream"].tolist() == [13, 13] and k["correlation"].tolist() == [41, 45]
    assert (k["graph_id"].tolist(), k["graph_node_id"].tolist()) == ([0, 5], [0, 12])
    (m,) = b.memcpys.tolist()
    assert m == (T0 + 9_500, T0 + 10_500, 0, 1, 14, 42, 1 << 20, 1, 2, 3, 3, 9)
    (s,) = b.memsets.tolist()
    assert s == (T0 + 11_000, T0 + 11_200, 0, 1, 14, 43, 4096, 7, 0, 0)
    (y,) = b.syncs.tolist()
    assert y == (T0 + 12_000, T0 + 15_000, 1, 0xFFFFFFFF, 44, 3, 0xFFFFFFFF)
    assert b.runtime.tolist() == [(T0, T0 + 900, 41, 211, 77, 4242)]
    assert b.driver.tolist() == [(T0 + 1_000, T0 + 1_500, 46, 307, 77, 4242)]
    assert b.dropped == 0


def test_record_sizes_are_learnt_from_cupti_once_per_kind():
    names, recs, data = synthetic()
    lib = FakeLibCupti([])
    raw = cb.RawActivityBuffers(lib)  # its learner calls the lib's cuptiActivityGetNextRecord
    buf = (ctypes.c_uint64 * (len(data) // 8))()
    ctypes.memmove(buf, data, len(data))
    b = cb.decode_buffers([cb.RawBuffer(buf, len(data))], raw.sizes)
    assert b.kernel_names().tolist() == ["sgemm", "relu"]
    assert b.runtime["cbid"].tolist() == [211] and b.driver["cbid"].tolist() == [307]
    # one call per kind, none for the 2nd kernel; the DRIVER record is last, so the distance to
    # the buffer's end is used but not kept
    assert lib.next_record_calls == 6
    assert raw.sizes.known == {5: 40, 10: 200, 1: 88, 2: 88, 38: 48}


def test_an_unknown_kind_stops_the_walk_and_counts_the_rest():
    names, recs, data = synthetic()
    bad = (99).to_bytes(4, "little") + bytes(36)
    data = data[:328] + bad + data[328:]  # after RUNTIME, kernel, memcpy
    sizes = cb.RecordSizes(known=dict(RAW_SIZES))  # no learner: 99 cannot be stepped over
    b = cb.decode_buffers([cb.RawBuffer(data, len(data))], sizes)
    assert (b.runtime.size, b.kernels.size, b.memcpys.size, b.memsets.size) == (1, 1, 1, 0)
    assert b.dropped == (len(data) - 328) // 40  # estimated at the smallest record size


def test_a_kind_smaller_than_its_prefix_is_dropped_not_misread():
    names, recs, data = synthetic()
    sizes = dict(RAW_SIZES)
    (memcpy,) = [r for r in recs if r["kind"] == "MEMCPY"]
    sizes[1] = 72  # an older memcpy record ending before graphId
    data = encode_record(memcpy, names)[:72] * 3
    b = cb.decode_buffers([cb.RawBuffer(data, len(data))], cb.RecordSizes(known=sizes),
                          dropped=5)  # fmt: skip
    assert b.memcpys.size == 0 and b.dropped == 5 + 3


def test_a_short_last_record_of_an_unlearnt_kind_is_dropped_not_misread():
    """A kind seen only as a buffer's last record: its size is known only as the distance to
    the buffer's end, and that bound, under the layout, drops it (it once read past the end)."""
    names, recs, _ = synthetic()
    (api,) = [r for r in recs if r["kind"] == "RUNTIME"][:1]
    (memset,) = [r for r in recs if r["kind"] == "MEMSET"]
    data = encode_record(api, names) + encode_record(memset, names)[:48]
    sizes = cb.RecordSizes(known={5: RAW_SIZES[5]}, learn=lambda address, valid, off: valid)
    b = cb.decode_buffers([cb.RawBuffer(data, len(data))], sizes)
    assert (b.runtime.size, b.memsets.size, b.dropped) == (1, 0, 1)
    assert 2 not in sizes.known  # a bound, never learnt as the kind's size
    full = encode_record(api, names) + encode_record(memset, names)  # the whole record: read
    b = cb.decode_buffers([cb.RawBuffer(full, len(full))], sizes)
    assert (b.runtime.size, b.memsets.size, b.dropped) == (1, 1, 0)


def test_raw_decoding_matches_the_per_record_adapter_on_the_fixture(records):
    """Every real record of the H100 fixture, packed as CUPTI packs it, decodes to the batch
    the fixture adapter builds from the same records (all kinds, all fields)."""
    names = CStrings()
    bufs = [cb.RawBuffer(d, len(d)) for d, _ in encode_buffers(records, names, per_buffer=3000)]
    got = cb.decode_buffers(bufs, cb.RecordSizes(known=dict(RAW_SIZES)))
    want = batch_from_records(records, api="all")
    for attr in ("kernels", "memcpys", "memsets", "syncs", "runtime", "driver"):
        g, w = getattr(got, attr), getattr(want, attr)
        assert g.size == w.size, attr
        for col in w.dtype.names:
            if col != "name":
                np.testing.assert_array_equal(g[col], w[col], err_msg=f"{attr}.{col}")
    assert got.kernel_names().tolist() == want.kernel_names().tolist()
    assert (got.kernels.size, got.runtime.size, got.driver.size) == (545, 4443, 3315)


def test_buffer_callbacks_hand_out_bounded_buffers_and_keep_completed_ones():
    names, recs, data = synthetic()
    lib = FakeLibCupti([(data, len(recs))] * 3)
    raw = cb.RawActivityBuffers(lib, buffer_bytes=4096, max_buffers=2)
    raw.register()
    lib.flush()
    assert raw.refused == 1 and lib.dropped == len(recs)  # the 3rd buffer: none left
    b = raw.decode()
    assert b.kernels.size == 4 and b.names == ["sgemm", "relu"]
    # decoded buffers go back to the pool: the next window reuses them, allocates none
    lib.buffers = [(data, len(recs))]
    lib.flush()
    assert raw._allocated == 2 and raw.decode().memcpys.size == 1


def test_loaded_libcupti_path_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f20-7f30 r-xp 00000000 08:01 2 /venv/nvidia/cu13/lib/libcupti.so.13\n"
    )
    assert cb.loaded_libcupti_path(str(maps)) == "/venv/nvidia/cu13/lib/libcupti.so.13"
    maps.write_text(  # one file mapped twice (text and data): still that one
        "7f20-7f30 r-xp 00000000 08:01 2 /venv/nvidia/cu13/lib/libcupti.so.13\n"
        "7f40-7f50 rw-p 00010000 08:01 2 /venv/nvidia/cu13/lib/libcupti.so.13\n"
    )
    assert cb.loaded_libcupti_path(str(maps)) == "/venv/nvidia/cu13/lib/libcupti.so.13"
    maps.write_text(  # two copies: which one cupti-python uses is unknown
        "7f20-7f30 r-xp 00000000 08:01 2 /venv/nvidia/cu13/lib/libcupti.so.13\n"
        "7f60-7f70 r-xp 00000000 08:01 3 /usr/local/cuda/lib64/libcupti.so.12\n"
    )
    assert cb.loaded_libcupti_path(str(maps)) is None
    maps.write_text("7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert cb.loaded_libcupti_path(str(maps)) is None
    assert cb.loaded_libcupti_path(str(tmp_path / "absent")) is None


def test_the_tracer_takes_the_raw_path_when_it_can(records):
    names = CStrings()
    lib = FakeLibCupti(encode_buffers(records, names, per_buffer=3000))
    fake = FakeRawCupti(records, lib, dropped=2)
    tracer = CuptiTracer(
        cupti_module=fake, raw_buffers=lambda **kw: cb.RawActivityBuffers(lib, **kw)
    )
    assert tracer.start() and tracer.path == "raw"
    batch = tracer.stop()
    want = batch_from_records(records, api="correlated")  # launch/copy/set/wait calls only
    for attr in ("kernels", "memcpys", "memsets", "syncs", "runtime", "driver"):
        np.testing.assert_array_equal(
            np.sort(getattr(batch, attr), order="correlation"),
            np.sort(getattr(want, attr), order="correlation"), err_msg=attr,
        )  # fmt: skip
    assert batch.dropped == 2


def test_the_tracer_takes_cuptis_callbacks_back_each_window(records, caplog):
    """CUPTI keeps one pair of buffer callbacks per process, and Kineto (torch.profiler)
    registers its own whenever it starts. Between windows: the next window registers ours again
    and gets all its records. Inside a window: the buffer CUPTI had from us goes to the other
    client, so after the window's forced flush it is taken back for reuse and reported."""
    import logging

    names = CStrings()
    lib = FakeLibCupti([])
    kineto = cb.RawActivityBuffers(lib, buffer_bytes=1 << 20, max_buffers=4)  # the other client
    tracer = CuptiTracer(cupti_module=FakeRawCupti(records, lib),
                         raw_buffers=lambda **kw: cb.RawActivityBuffers(lib, **kw))
    for window in range(2):  # the other client registers before each window
        kineto.register()
        lib.buffers = encode_buffers(records, names, per_buffer=3000)
        assert tracer.start()
        assert tracer.stop().kernels.size == 545, window
    assert kineto.take() == [] and kineto._allocated == 0
    raw = tracer._raw
    allocated = raw._allocated
    # inside a window: CUPTI holds one of our buffers when the other client registers
    assert tracer.start()
    ptr, size, most = ctypes.POINTER(ctypes.c_uint8)(), ctypes.c_size_t(0), ctypes.c_size_t(0)
    lib.request(ctypes.byref(ptr), ctypes.byref(size), ctypes.byref(most))
    kineto.register()
    lib.buffers = encode_buffers(records, names, per_buffer=3000)
    sent = sum(len(d) for d, _ in lib.buffers)
    with caplog.at_level(logging.WARNING, logger="stepscope.gpu"):
        assert tracer.stop().kernels.size == 0  # all of it went to the other client
    assert "another CUPTI client" in caplog.text
    assert raw.lost_buffers == 1 and raw._in_use == {}
    assert sum(b.valid for b in kineto.take()) == sent
    # the next window: ours again, and the lost buffer is reused rather than a new one made
    lib.buffers = encode_buffers(records, names, per_buffer=3000)
    assert tracer.start()
    assert tracer.stop().kernels.size == 545
    assert raw._allocated == allocated and raw.lost_buffers == 1
    # the other client registers inside a window, and the tracer is told to take them back
    assert tracer.start()
    kineto.register()
    tracer.reregister()
    lib.buffers = encode_buffers(records, names, per_buffer=3000)
    assert tracer.stop().kernels.size == 545 and kineto.take() == []


def test_a_buffer_another_client_was_handed_is_copied_when_completed_to_us(records):
    """Seen on an H100 with torch 2.11: Kineto's CPU-only session enables CUPTI's API kinds,
    so CUPTI hands Kineto a buffer just before the window; it then fills that one buffer with
    the window's every record and completes it, at the window's flush, to the callbacks
    registered then: ours. Its records are copied at completion (the memory stays the other
    client's: changed afterwards, the copy is not) and never enter our pool."""
    names = CStrings()
    lib = FakeLibCupti([])
    kineto = cb.RawActivityBuffers(lib, buffer_bytes=1 << 20, max_buffers=4)
    tracer = CuptiTracer(cupti_module=FakeRawCupti(records, lib),
                         raw_buffers=lambda **kw: cb.RawActivityBuffers(lib, **kw))
    kineto.register()
    ptr, size, most = ctypes.POINTER(ctypes.c_uint8)(), ctypes.c_size_t(0), ctypes.c_size_t(0)
    lib.request(ctypes.byref(ptr), ctypes.byref(size), ctypes.byref(most))  # Kineto's buffer
    assert tracer.start()  # ours registered now
    ((data, _),) = encode_buffers(records[:500], names, per_buffer=500)
    ctypes.memmove(ptr, data, len(data))  # the window's records, into Kineto's buffer
    lib.complete(None, 0, ptr, size.value, len(data))  # completed to ours at the flush
    ctypes.memset(ptr, 0, len(data))  # the other client's memory, reused by it
    batch = tracer.stop()
    want = batch_from_records(records[:500], api="correlated")
    assert want.kernels.size > 0 and want.runtime.size > 0
    for attr in ("kernels", "runtime", "driver"):
        np.testing.assert_array_equal(
            np.sort(getattr(batch, attr), order="correlation"),
            np.sort(getattr(want, attr), order="correlation"), err_msg=attr,
        )  # fmt: skip
    raw = tracer._raw
    assert raw.foreign_buffers == 1 and raw._allocated == 0 and raw._free == []


def test_the_tracer_falls_back_to_records_when_the_raw_path_fails(records):
    from gpu_fakes import FakeCupti

    def broken(**kw):
        raise OSError("libcupti.so: cannot open shared object file")

    tracer = CuptiTracer(cupti_module=FakeCupti(records), raw_buffers=broken)
    assert tracer.start() and tracer.path == "records"
    assert tracer.stop().kernels.size == 545
    tracer = CuptiTracer(cupti_module=FakeCupti(records), raw_buffers=lambda **kw: None)
    assert tracer.start() and tracer.path == "records"


def test_one_raw_buffer_owner_per_process_never_freed(monkeypatch):
    # CUPTI keeps the callbacks and buffers it was handed: a second tracer must reuse them
    from types import SimpleNamespace

    opened = []

    def fake_cdll(path):
        opened.append(path)
        return SimpleNamespace(cuptiActivityRegisterCallbacks=SimpleNamespace(),
                               cuptiActivityGetNextRecord=SimpleNamespace())

    monkeypatch.setattr(cb, "_PROCESS_RAW", None)
    monkeypatch.setattr(cb, "loaded_libcupti_path", lambda: "/x/libcupti.so.13")
    monkeypatch.setattr(cb.ctypes, "CDLL", fake_cdll)
    first = cb.RawActivityBuffers.open(max_buffers=2)
    assert first is not None and cb.RawActivityBuffers.open() is first
    assert opened == ["/x/libcupti.so.13"]


def test_a_failed_buffer_allocation_hands_cupti_no_buffer():
    """ctypes swallows an exception raised in the callback: the outputs CUPTI reads must already
    say "no buffer" when the allocation fails."""
    raw = cb.RawActivityBuffers(FakeLibCupti([]))
    raw.buffer_bytes = 1 << 62  # no such allocation can succeed
    buffer = ctypes.cast(ctypes.c_void_p(0x1000), ctypes.POINTER(ctypes.c_uint8))
    buffer_p = ctypes.pointer(buffer)
    size, max_records = ctypes.c_size_t(123), ctypes.c_size_t(7)
    with pytest.raises(MemoryError):
        raw._on_request(buffer_p, ctypes.pointer(size), ctypes.pointer(max_records))
    assert not buffer_p[0] and size.value == 0 and max_records.value == 0
    assert raw._allocated == 0 and raw._in_use == {}


def test_the_process_owner_is_made_once_and_keeps_its_settings(monkeypatch, caplog):
    import logging
    import time
    from types import SimpleNamespace

    opened = []

    def slow_cdll(path):
        opened.append(path)
        time.sleep(0.05)  # wide window for a second thread to make a second owner
        return SimpleNamespace(cuptiActivityRegisterCallbacks=SimpleNamespace(),
                               cuptiActivityGetNextRecord=SimpleNamespace())

    monkeypatch.setattr(cb, "_PROCESS_RAW", None)
    monkeypatch.setattr(cb, "loaded_libcupti_path", lambda: "/x/libcupti.so.13")
    monkeypatch.setattr(cb.ctypes, "CDLL", slow_cdll)
    got = []
    threads = [threading.Thread(target=lambda: got.append(cb.RawActivityBuffers.open(
        max_buffers=2))) for _ in range(4)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(opened) == 1 and len({id(r) for r in got}) == 1 and got[0] is not None
    with caplog.at_level(logging.DEBUG, logger="stepscope.gpu"):
        assert cb.RawActivityBuffers.open(max_buffers=2, buffer_bytes=8 << 20) is got[0]
        assert caplog.records == []  # same settings: nothing to say
        assert cb.RawActivityBuffers.open(max_buffers=4, buffer_bytes=1001) is got[0]
    assert [r.getMessage() for r in caplog.records] == [
        "stepscope: raw CUPTI buffers already open with (buffer_bytes, max_buffers) "
        "(8388608, 2); (1008, 4) ignored"
    ]
    assert (got[0].buffer_bytes, got[0].max_buffers) == (8 << 20, 2)


def test_kernel_names_are_read_only_inside_readable_memory():
    # a record layout CUPTI changed would put garbage where the name pointer was: a wrong name,
    # never a crash. A page of 'A's with no NUL, followed by a page that cannot be read.
    import mmap

    page = mmap.PAGESIZE
    m = mmap.mmap(-1, 2 * page)
    m.write(b"A" * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + page, page, 0) == 0  # PROT_NONE
    try:
        ranges = cb.readable_ranges()
        names = CStrings()
        ok = names.address("sgemm")
        assert cb.read_c_string(ok, ranges) == "sgemm"
        assert cb.read_c_string(base + page - 3, ranges) == "AAA"  # stops at the mapping's end
        assert cb.read_c_string(base + page + 8, ranges) == "?"  # not readable
        assert cb.read_c_string(0, ranges) == "?"
        assert cb.read_c_string(8, ranges) == "?"  # below every mapping
    finally:
        libc.mprotect(base + page, page, 3)  # PROT_READ | PROT_WRITE again


def test_readable_ranges_leave_out_device_mappings(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f0000000000-7f0000001000 r--p 00000000 08:01 42 /usr/lib/libcupti.so.13\n"
        "7f0000002000-7f0000003000 rw-s 00000000 00:05 7 /dev/nvidia0\n"
        "7f0000004000-7f0000005000 ---p 00000000 00:00 0\n"
        "7f0000006000-7f0000008000 rw-p 00000000 00:00 0 \n"
        "7f0000009000-7f000000a000 rw-p 00000000 00:00 0 [heap]\n"
        "7f000000b000-7f000000c000 rw-s 00000000 00:01 9 /dev/zero (deleted)\n"
    )
    got = cb.readable_ranges(str(maps)).tolist()
    assert got == [[0x7F0000000000, 0x7F0000001000], [0x7F0000006000, 0x7F0000008000],
                   [0x7F0000009000, 0x7F000000A000], [0x7F000000B000, 0x7F000000C000]]  # fmt: skip
    names = CStrings()
    long = "k" * 5000  # read in growing pieces up to its NUL
    assert cb.read_c_string(names.address(long), cb.readable_ranges()) == long
