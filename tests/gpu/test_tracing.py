"""GpuTracing (the profiler's entry point), replaying the fixture, NVML counters, no-GPU paths."""

from __future__ import annotations

import collections
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from gpu_fakes import FakeCupti
from gpu_trace_decode import TYPE_COUNTER, TYPE_INSTANT, decode

import stepscope
from raw_thread import RawThread
from stepscope.core import session as _session
from stepscope.gpu import nvml
from stepscope.gpu import tracing as gpu
from stepscope.gpu.cupti_live import CuptiTracer
from stepscope.gpu.cupy_timing import CupyEventTimer, memory_pool_counters, sync_current_stream
from stepscope.gpu.fixture import replay_fixture
from stepscope.gpu.nvml import NvmlSampler, gpm_counters, sample_counters

REALTIME = 1
# a program of its own finds this checkout's stepscope, installed or not
CHILD_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [str(Path(__file__).resolve().parents[2] / "src")] + sys.path))


def test_import_needs_no_gpu_package():
    """In a fresh interpreter: in this one, tests before it may have imported them (on a GPU
    machine, where they are installed)."""
    code = ("import sys, stepscope, stepscope.gpu.tracing as g; "
            "print(sorted({'cupy', 'cupti', 'pynvml'} & set(sys.modules)), "
            "g.kernel_class('ncclDevKernel_AllReduce'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=CHILD_ENV)
    assert (r.returncode, r.stdout.strip()) == (0, "[] communication"), r.stderr


def test_no_gpu_switches_off_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(gpu, "detect_devices", lambda init: {})
    sess = _session.Session(tmp_path / "t.pftrace").start()
    try:
        gt = gpu.GpuTracing(sess, nvml=False, log_level=logging.WARNING)
        with caplog.at_level(logging.INFO, logger="stepscope.gpu"):
            gt.start()
            assert gt.begin_window() is False
            assert gt.end_window(steps=3) is None
            assert gt.begin_window() is False  # stays off, says it once
            gt.stop()
    finally:
        sess.stop()
    assert [(r.levelno, r.message) for r in caplog.records] == [
        (logging.WARNING, "stepscope: no CUDA device found; GPU activity tracing off")
    ]


def test_nvml_missing_is_one_line(tmp_path, caplog, monkeypatch):
    """Without nvidia-ml-py and CuPy (made missing: a GPU machine has both, and the sampler
    would start: found on an H100, where this test once left it running)."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    monkeypatch.delitem(sys.modules, "cupy", raising=False)  # (its pool counters need no NVML)
    sess = _session.Session(tmp_path / "t.pftrace").start()
    sampler = NvmlSampler(sess)
    try:
        with caplog.at_level(logging.INFO, logger="stepscope.gpu"):
            assert sampler.start() is False
    finally:
        sampler.stop()
        sess.stop()
    assert [r.message for r in caplog.records] == [
        "stepscope: nvidia-ml-py not installed; NVML counters off"]


class FakeNvml:
    """``pynvml`` failing at one step of :meth:`NvmlSampler.start`; counts init and shutdown."""

    def __init__(self, *, fail=None, count=1):
        self.fail, self.count = fail, count
        self.calls: list[str] = []

    def _step(self, name):
        self.calls.append(name)
        if name == self.fail:
            raise RuntimeError(f"{name} failed")

    def nvmlInit(self):
        self._step("init")

    def nvmlDeviceGetCount(self):
        self._step("count")
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        self._step("handle")
        return f"h{i}"

    def nvmlShutdown(self):
        self._step("shutdown")

    def nvmlGpmSampleFree(self, s):
        self._step("free")


@pytest.mark.parametrize(
    "fail, count, calls",
    [
        ("init", 1, ["init"]),  # nothing to balance
        ("count", 1, ["init", "count", "shutdown"]),
        ("handle", 1, ["init", "count", "handle", "shutdown"]),
        (None, 0, ["init", "count", "shutdown"]),  # no GPU
        ("shutdown", 0, ["init", "count", "shutdown"]),  # its error is not the caller's
    ],
)
def test_nvml_start_failures_balance_init_with_shutdown(monkeypatch, fail, count, calls):
    """(As in a process without CuPy and with CUDA not initialised: on a GPU machine, tests before
    it may have done both, and CuPy's pool counters would start the sampler.)"""
    nv = FakeNvml(fail=fail, count=count)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setattr(nvml, "cuda_bus_ids", lambda lib: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sampler = NvmlSampler(None, log_level=logging.DEBUG)
    try:
        assert sampler.start() is False
    finally:
        sampler.stop()
    assert nv.calls == calls


def test_nvml_stop_leaves_nvml_alone_while_the_sampler_is_stuck():
    """A sampler thread still inside an NVML call after the join: no free, no shutdown."""
    nv = FakeNvml()
    release = threading.Event()
    sampler = NvmlSampler(None)
    sampler._nvml, sampler._prev = nv, {0: "sample"}
    sampler._thread = threading.Thread(target=release.wait, daemon=True)
    sampler._thread.start()
    join = sampler._thread.join
    sampler._thread.join = lambda timeout=None: join(timeout=0.01)  # do not wait 5 s
    try:
        sampler.stop()
        assert nv.calls == [] and sampler._nvml is nv and sampler._prev == {0: "sample"}
    finally:
        release.set()
    join()
    sampler.stop()  # once it has ended, a later stop cleans up
    assert nv.calls == ["free", "shutdown"] and sampler._nvml is None and sampler._prev == {}


def test_window_through_a_session_puts_api_calls_under_the_thread(tmp_path, fixture):
    me = threading.get_ident() & 0xFFFFFFFF
    path = tmp_path / "w.pftrace"
    sess = _session.Session(path).start()
    try:
        t0 = time.time_ns()  # FakeCupti's clock is 3 µs behind; the window opens after this
        records = [
            {"kind": "RUNTIME", "start": t0, "end": t0 + 5000, "correlation_id": 1, "cbid": 211,
             "process_id": 1, "thread_id": me},
            {"kind": "CONCURRENT_KERNEL", "name": "k", "start": t0 + 8000, "end": t0 + 20_000,
             "stream_id": 7, "device_id": 0, "context_id": 1, "correlation_id": 1, "grid_x": 264,
             "grid_y": 1, "grid_z": 1, "block_x": 64, "block_y": 1, "block_z": 1,
             "registers_per_thread": 121, "static_shared_memory": 0,
             "dynamic_shared_memory": 9600, "graph_id": 0},
            {"kind": "CONCURRENT_KERNEL", "name": "malformed", "start": t0, "end": t0 + 1},
        ]  # fmt: skip
        gt = gpu.GpuTracing(
            sess, nvml=False, devices={0: fixture.device},
            tracer=CuptiTracer(cupti_module=FakeCupti(records, dropped=0)),
        )  # fmt: skip
        assert gt.begin_window()
        stats = gt.end_window(steps=1)
    finally:
        sess.stop()
    assert stats.kernels == 1 and stats.flows == 1
    assert stats.dropped == 1  # the record without the kernel fields is counted, not fatal
    tr = decode(path)
    (api,) = tr.tracks_named("CUDA API")
    parent = tr.tracks[tr.tracks[api].parent_uuid]
    assert parent.thread.tid == threading.get_native_id()
    (launch,) = [s for s in tr.slices if s.category == "cuda_runtime"]
    (kernel,) = [s for s in tr.slices if s.category == "kernel"]
    assert launch.name == "cudaLaunchKernel" and launch.flow_ids == kernel.terminating_flow_ids
    # 264 blocks on 132 SMs = 2 blocks/SM, 8 active (register-limited): 2 * 64 / 2048
    assert kernel.args["est_achieved_occupancy"] == pytest.approx(0.0625)
    # device slices keep CUPTI's stamps plus the calibrated offset, on the REALTIME clock
    assert kernel.clock == REALTIME
    assert kernel.ts == t0 + 8000 + gt.tracer.offset_ns


def test_replayed_fixture_lines_up_host_and_device(tmp_path, fixture):
    path = tmp_path / "replay.pftrace"
    sess = _session.Session(path).start()
    try:
        stats = replay_fixture(sess, fixture)
    finally:
        sess.stop()
    tr = decode(path)
    assert stats.kernels == 545
    steps = sorted(
        (s.ts, s.ts + s.dur) for s in tr.slices if s.name == "ProfileStep"
    )  # host ranges, mapped to REALTIME
    assert len(steps) == 12
    assert {s.clock for s in tr.slices} == {REALTIME}
    main = tr.tracks_named("CUDA API (thread 80499008)")[0]
    launches = [s for s in tr.slices if s.track == main and s.flow_ids and s.ts >= steps[0][0]]
    kernel_corr = set(fixture.batch.kernels["correlation"].tolist())
    launches = [s for s in launches if s.args["correlation_id"] in kernel_corr]
    assert len(launches) > 400
    starts = np.array([s for s, _ in steps])
    for s in launches:
        i = np.searchsorted(starts, s.ts, side="right") - 1
        assert steps[i][0] <= s.ts and s.ts + s.dur <= steps[i][1]
    # NVML: power in W from mW, sample by sample; GPM DRAM bandwidth left out where NaN
    power = tr.counter("nvml.gpu0.power W")
    assert [v for _, v in power] == [s["power_mw"] / 1000 for s in fixture.nvml_samples]
    dram = tr.counter("gpm.gpu0.dram_bw_util %")
    assert len(dram) == sum(
        1 for s in fixture.gpm_samples if s["DRAM_BW_UTIL"] == s["DRAM_BW_UTIL"]
    )
    assert len(dram) < len(fixture.gpm_samples)
    counts = collections.Counter(tr.track_name(s.track) for s in tr.slices)
    assert counts["loader"] == 12


def test_replay_is_rebased_onto_this_sessions_clocks(tmp_path, fixture):
    """The fixture was recorded on another machine: as recorded, its REALTIME stamps lie days
    before this machine's boot (negative BOOTTIME), which trace processor drops (4671 events:
    every slice and counter). Rebased, its first event is 'now' and the spacing is kept."""
    from stepscope.analysis import load

    path = tmp_path / "replay.pftrace"
    sess = _session.Session(path).start()
    try:
        before = time.time_ns()
        replay_fixture(sess, fixture)
        after = time.time_ns()
    finally:
        sess.stop()
    tr = decode(path)
    kernels = sorted(s.ts for s in tr.slices if s.category == "kernel")
    recorded = np.sort(fixture.batch.kernels["start"])
    shift = kernels[0] - int(recorded[0])
    assert kernels == (recorded + shift).tolist()  # one offset for all: spacing kept
    first = min(s.ts for s in tr.slices)
    assert before <= first <= after
    conn, stats = load([str(path)])
    assert "track_event_invalid_timestamp" not in stats
    # every slice and counter sample written is kept
    assert conn.execute("SELECT COUNT(*) FROM slice").fetchone()[0] == len(tr.slices)
    assert conn.execute("SELECT COUNT(*) FROM counter").fetchone()[0] == sum(
        1 for e in tr.events if e.type == TYPE_COUNTER)
    assert conn.execute("SELECT MIN(ts) FROM slice").fetchone()[0] > 0


def test_nvml_sample_conversion_by_hand():
    s = {"gpu_util": 37, "mem_used": 1 << 30, "power_mw": 126889, "sm_clock_mhz": 1980}
    assert sample_counters(s, 1) == [
        ("nvml.gpu1.utilization.gpu %", "%", 37),
        ("nvml.gpu1.memory.used", "bytes", 1 << 30),
        ("nvml.gpu1.power W", "W", 126.889),
        ("nvml.gpu1.clocks.sm MHz", "MHz", 1980),
    ]
    g = {"SM_UTIL": 12.5, "SM_OCCUPANCY": 3.0, "ANY_TENSOR_UTIL": 0.0, "DRAM_BW_UTIL": float("nan")}
    assert gpm_counters(g, 0) == [
        ("gpm.gpu0.sm_util %", "%", 12.5),
        ("gpm.gpu0.sm_occupancy %", "%", 3.0),
        ("gpm.gpu0.tensor_util %", "%", 0.0),
    ]


def test_cupy_helpers_without_cupy(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "cupy", raising=False)  # (imported before, on a GPU machine)
    sess = _session.Session(tmp_path / "c.pftrace").start()
    try:
        timer = CupyEventTimer(sess)
        assert not timer.available
        timer.push("x")
        timer.pop()
        assert timer.poll() == 0
        sync_current_stream()  # no-op
        assert memory_pool_counters() == []
    finally:
        sess.stop()


@pytest.mark.gpu
def test_cupy_event_ranges_on_a_gpu(tmp_path, gpu_cupy):
    cp = gpu_cupy
    path = tmp_path / "e.pftrace"
    sess = _session.Session(path).start()
    try:
        timer = CupyEventTimer(sess)
        timer.push("matmul")
        a = cp.ones((2048, 2048), dtype=cp.float32)
        (a @ a).sum()
        timer.pop()
        cp.cuda.get_current_stream().synchronize()
        assert timer.poll() == 1
    finally:
        sess.stop()
    (s,) = [s for s in decode(path).slices if s.name == "matmul"]
    assert s.dur > 0 and s.category == "gpu_range"


def test_cuda_event_ranges_resolve_later_without_waiting(tmp_path, fake_cuda):
    cuda = fake_cuda
    path = tmp_path / "ev.pftrace"
    sess = _session.Session(path).start()
    try:
        timer = CupyEventTimer(sess, host_clock=lambda: 5_000_000)
        cuda.gpu_now = 100_000  # the anchor is taken at the first begin: GPU 100 us = host 5 ms
        timer.push("outer")
        cuda.gpu_now = 150_000
        timer.push("inner")
        cuda.gpu_now = 400_000
        timer.pop()
        cuda.gpu_now = 900_000
        timer.pop()
        assert cuda.synced == 1  # only the anchor waited
        assert timer.poll() == 0  # the GPU has not reached the end events yet
        for p in timer._pending:
            p.end.done = True
        assert timer.poll() == 2
        sync_current_stream()
        assert cuda.synced == 2
    finally:
        sess.stop()
    tr = decode(path)
    got = sorted((s.name, s.ts, s.dur, s.clock) for s in tr.slices)
    # outer: begin recorded at GPU 100 us (the anchor instant) -> 5_000_000, 800 us long;
    # inner: 5_000_000 + 50 us, 250 us long
    assert got == [("inner", 5_050_000, 250_000, 3), ("outer", 5_000_000, 800_000, 3)]
    (track,) = {s.track for s in tr.slices}
    assert tr.track_name(track) == "CUDA events (stream 0x1234)"
    assert tr.track_name(tr.tracks[track].parent_uuid) == "GPU 0 (Fake GPU)"


def test_annotate_gpu_true_times_the_range_on_the_gpu_too(tmp_path, fake_cuda):
    cuda = fake_cuda
    path = tmp_path / "g.pftrace"
    with stepscope.trace(path) as sess:
        cuda.gpu_now = 100_000
        with stepscope.annotate("fwd", gpu=True):
            cuda.gpu_now = 700_000
        sess.gpu_timer()._pending[0].end.done = True  # the GPU got there
    tr = decode(path)
    host = [s for s in tr.slices if s.name == "fwd" and s.category == ""]
    gpu = [s for s in tr.slices if s.name == "fwd" and s.category == "gpu_range"]
    assert len(host) == 1 and len(gpu) == 1
    assert gpu[0].dur == 600_000  # GPU 100 us -> 700 us
    assert "gpu" not in host[0].args


def test_annotate_gpu_true_without_cupy_warns_and_times_the_host(tmp_path, monkeypatch):
    from stepscope.record import recorder as _recorder

    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    _recorder._warned.discard("gpu_range")
    path = tmp_path / "h.pftrace"
    with pytest.warns(RuntimeWarning, match="needs CuPy"):
        with stepscope.trace(path):
            with stepscope.annotate("fwd", gpu=True):
                pass
    assert [s.name for s in decode(path).slices] == ["fwd"]


def test_auto_mode_waits_for_the_program_to_use_cuda(tmp_path, monkeypatch, fixture):
    # gpu=None: a window before the program uses CUDA has no GPU activity, a later one does
    found = [{}, {0: fixture.device}]
    asked = []

    def detect(init):
        asked.append(init)
        return found.pop(0)

    monkeypatch.setattr(gpu, "detect_devices", detect)
    sess = _session.Session(tmp_path / "t.pftrace").start()
    try:
        gt = gpu.GpuTracing(sess, nvml=False, init_cuda=False,
                            tracer=CuptiTracer(cupti_module=FakeCupti([], dropped=0)))
        assert gt.begin_window() is False
        assert gt.end_window(steps=1) is None
        assert gt.begin_window() is True
        assert gt.end_window(steps=1) is not None
    finally:
        sess.stop()
    assert asked == [False, False]


def test_libcuda_is_never_loaded_or_initialized_unasked(monkeypatch):
    # looking for devices in auto mode, and synchronizing at window end, use only a libcuda the
    # program loaded itself (RTLD_NOLOAD) and never call cuInit
    import ctypes
    import os

    from stepscope.gpu.cupti_live import synchronize_context

    modes, calls = [], []

    class Lib:
        def __getattr__(self, name):
            return lambda *a: calls.append(name) or 3  # CUDA_ERROR_NOT_INITIALIZED

    def cdll(name, mode=ctypes.DEFAULT_MODE):
        modes.append((name, mode))
        if not mode & os.RTLD_NOLOAD:
            return Lib()
        raise OSError(f"{name}: not loaded")

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    assert gpu.detect_devices(init=False) == {}
    synchronize_context()
    assert [bool(m & os.RTLD_NOLOAD) for _, m in modes] == [True, True] and calls == []
    # CuPy imported but CUDA not initialized: its device queries (cuInit) are not made either
    runtime = SimpleNamespace(getDeviceCount=lambda: calls.append("cudaGetDeviceCount") or 1)
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=SimpleNamespace(runtime=runtime)))
    assert gpu.detect_devices(init=False) == {} and calls == []
    monkeypatch.delitem(sys.modules, "cupy")
    # loaded but not initialized by the program: still no cuInit
    monkeypatch.setattr(ctypes, "CDLL", lambda name, mode=0: Lib())
    assert gpu.detect_devices(init=False) == {}
    assert calls == ["cuDeviceGetCount"]
    # gpu=True: the driver is initialized on purpose
    calls.clear()
    assert gpu.detect_devices(init=True) == {}
    assert calls == ["cuInit"]


def _syncing(cuda, monkeypatch):
    """The fake CuPy's stream synchronize leaves an instant on the calling thread: the range a
    sync belongs to must still be open when it runs."""

    def synchronize(self):
        cuda.synced += 1
        stepscope.mark("synced")

    monkeypatch.setattr(cuda.Stream, "synchronize", synchronize)
    return cuda


def _inside(tr, name):
    """For each slice called ``name``: how many 'synced' instants lie within it."""
    marks = [e.ts for e in tr.events if e.type == TYPE_INSTANT and e.name == "synced"]
    return [sum(s.ts <= t <= s.ts + s.dur for t in marks)
            for s in sorted(tr.slices, key=lambda s: s.ts) if s.name == name]  # fmt: skip


def test_annotate_sync_gpu_ends_the_range_after_its_gpu_work(tmp_path, monkeypatch, fake_cuda):
    cuda = _syncing(fake_cuda, monkeypatch)
    path = tmp_path / "s.pftrace"
    with stepscope.trace(path):
        with stepscope.annotate("fwd", sync_gpu=True, batch=3):
            pass

        @stepscope.annotate("bwd", sync_gpu=True)
        def bwd():
            pass

        bwd()
        with stepscope.annotate("plain"):
            pass
    tr = decode(path)
    assert cuda.synced == 2
    assert _inside(tr, "fwd") == [1] and _inside(tr, "bwd") == [1] and _inside(tr, "plain") == [0]
    (fwd,) = [s for s in tr.slices if s.name == "fwd"]
    assert fwd.args == {"batch": 3}  # sync_gpu is an option, not an arg


def test_profiler_sync_gpu_ends_phases_and_steps_after_their_gpu_work(tmp_path, monkeypatch,
                                                                        fake_cuda):
    from stepscope.profiler import Profiler

    cuda = _syncing(fake_cuda, monkeypatch)
    prof = Profiler(tmp_path, (0, 3), run_id="r", host_metrics=False, report=False, gpu=False,
                    sync_gpu=True)  # fmt: skip
    prof.start()
    for _ in range(3):
        with prof.phase("Forward"):
            pass
        prof.step()
    prof.stop()
    tr = decode(tmp_path / "r" / "rank0.detail.0.pftrace")
    # each step holds its phase's sync and its own
    assert cuda.synced == 6
    assert _inside(tr, "Forward") == [1, 1, 1]
    assert _inside(tr, "step 0") == [2] and _inside(tr, "step 1") == [2]


def test_cupti_activity_and_cuda_event_ranges_share_one_gpu_track(tmp_path, fake_cuda):
    from stepscope.gpu.convert import GpuTraceConverter
    from stepscope.gpu.fixture import batch_from_records
    from stepscope.gpu.occupancy import DeviceLimits

    cuda = fake_cuda
    path = tmp_path / "both.pftrace"
    sess = _session.Session(path).start()
    try:
        timer = CupyEventTimer(sess, host_clock=lambda: 5_000_000)
        timer.push("fwd")
        cuda.gpu_now = 1000
        timer.pop()
        timer._pending[0].end.done = True
        assert timer.poll() == 1
        h100 = DeviceLimits.for_compute_capability(9, 0, sm_count=132, name="Fake GPU")
        conv = GpuTraceConverter(sess, {0: h100}, counters=False)
        now = time.time_ns()  # REALTIME stamps: trace processor drops times before boot
        conv.convert(batch_from_records([{
            "kind": "CONCURRENT_KERNEL", "name": "k", "start": now, "end": now + 1000,
            "stream_id": 7, "device_id": 0, "context_id": 1, "correlation_id": 1, "grid_x": 1,
            "grid_y": 1, "grid_z": 1, "block_x": 32, "block_y": 1, "block_z": 1}]))  # fmt: skip
    finally:
        sess.stop()
    tr = decode(path)
    (gpu_track,) = tr.tracks_named("GPU 0 (Fake GPU)")
    children = sorted(tr.track_name(u) for u, t in tr.tracks.items()
                      if t.parent_uuid == gpu_track)  # fmt: skip
    assert children == ["CUDA events (stream 0x1234)", "stream 7"]


def test_api_calls_of_a_thread_that_ended_go_under_that_thread(tmp_path, fixture):
    path = tmp_path / "ended.pftrace"
    sess = _session.Session(path).start()
    try:
        seen = {}
        worker = threading.Thread(
            target=lambda: seen.update(ident=threading.get_ident(),
                                       native=threading.get_native_id()),
            name="launcher",
        )  # fmt: skip
        worker.start()
        worker.join()
        del worker  # gone from threading.enumerate() and from any user reference
        _window_with_a_call_of(sess, fixture, seen["ident"])
    finally:
        sess.stop()
    assert _thread_of_the_call(path) == (seen["native"], "launcher")


def _window_with_a_call_of(sess, fixture, ident: int) -> None:
    """A window whose one CUDA runtime call CUPTI gives to the thread ``ident`` (cut to 32 bits,
    as CUPTI gives ``pthread_self()``)."""
    t0 = time.time_ns()
    records = [{"kind": "RUNTIME", "start": t0, "end": t0 + 5000, "correlation_id": 1,
                "cbid": 211, "process_id": 1, "thread_id": ident & 0xFFFFFFFF}]
    gt = gpu.GpuTracing(sess, nvml=False, devices={0: fixture.device},
                        tracer=CuptiTracer(cupti_module=FakeCupti(records, dropped=0)))
    assert gt.begin_window()
    assert gt.end_window(steps=1).api_calls == 1


def _thread_of_the_call(path) -> tuple[int, str]:
    tr = decode(path)
    (api,) = tr.tracks_named("CUDA API")
    parent = tr.tracks[tr.tracks[api].parent_uuid]
    return parent.thread.tid, parent.thread.thread_name


def test_api_calls_of_a_cpp_thread_go_under_that_thread(tmp_path, fixture):
    """A thread Python has no ``Thread`` for (torch's autograd device thread launches every
    backward kernel): its calls go on its own track, named as the system names it, where its
    operators are; not on a process-level track of its own."""
    path = tmp_path / "cpp.pftrace"
    sess = _session.Session(path).start()
    worker = RawThread(b"pt_autograd_0")
    try:
        _window_with_a_call_of(sess, fixture, worker.ident)
    finally:
        worker.end()
        sess.stop()
    assert _thread_of_the_call(path) == (worker.tid, "pt_autograd_0")


GPU_PROGRAM = """
import faulthandler, sys
import cupy as cp
from stepscope.profiler import Profiler
faulthandler.dump_traceback_later(100, exit=True)  # a hang fails with every thread's stack
w = cp.ones((512, 512), dtype=cp.float32)
prof = Profiler(sys.argv[1], {"wait": 0, "warmup": 0, "active": 5, "repeat": 1}, run_id="g",
                gpu=True, report=False, use_env=False)
prof.start()
for _ in range(6):
    with prof.phase("Forward"):
        x = cp.maximum(w @ w, 0).sum()
    cp.asnumpy(x)
    prof.step()
prof.stop()
"""


@pytest.mark.gpu
def test_profiler_on_a_gpu_end_to_end(tmp_path, gpu_cupy):
    """On a GPU, in a program of its own (as a user runs it; a test process has had fakes of
    CuPy, NVML and CUPTI): the Profiler's detail window holds a GPU track with stream tracks,
    every kernel with a launch call has its flow, launches sit inside their step on the host
    clock, kernels start after their launch, and NVML and utilization counters are written."""
    import perfetto_decode

    pytest.importorskip("cupti")
    r = subprocess.run([sys.executable, "-c", GPU_PROGRAM, str(tmp_path)], capture_output=True,
                       text=True, timeout=150, env=CHILD_ENV)  # fmt: skip
    assert r.returncode == 0, r.stderr[-5000:]
    path = next((tmp_path / "g").glob("*.detail.*"))
    tr = decode(path)
    (gpu_track,) = [u for u in tr.tracks if tr.track_name(u).startswith("GPU 0 (")]
    streams = [u for u, t in tr.tracks.items()
               if t.parent_uuid == gpu_track and tr.track_name(u).startswith("stream")]
    kernels = [s for s in tr.slices if s.category == "kernel"]
    launches = {f: s for s in tr.slices if s.category in ("cuda_runtime", "cuda_driver")
                for f in s.flow_ids}  # fmt: skip
    assert streams and len(kernels) >= 5 and {s.track for s in kernels} <= set(streams)
    assert all(k.terminating_flow_ids and k.terminating_flow_ids[0] in launches for k in kernels)
    # host (MONOTONIC) and device (REALTIME) on one clock through the file's clock snapshot
    snap = perfetto_decode.decode(str(path)).snapshots[0]
    to_mono = snap[3] - snap[1]  # builtin clocks: 1 REALTIME, 3 MONOTONIC
    steps = sorted((s.ts, s.ts + s.dur) for s in tr.slices if s.name.startswith("step "))
    for k in kernels:
        launch = launches[k.terminating_flow_ids[0]]
        t = launch.ts + to_mono
        assert any(a - 50_000 <= t <= b + 50_000 for a, b in steps), "launch outside the steps"
        assert k.ts >= launch.ts - 5_000, "kernel starts before its launch (clock misaligned)"
    assert tr.tracks_named("GPU 0 utilization")
    if importlib.util.find_spec("pynvml") is not None:
        assert tr.tracks_named("nvml.gpu0.power W")
