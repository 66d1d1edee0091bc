"""NvmlSampler with fake pynvml / libcuda / CuPy: CUDA ordinal -> NVML GPU, exact counter values
(NVML, GPM, CuPy's pools), CuPy's pools without NVML."""

from __future__ import annotations

import logging
import sys
import time
from types import SimpleNamespace

import pytest
from gpu_fakes import FakeLibcuda, FakeMultiCuda, FakeNvmlGpu, FakePool, FakePynvml
from gpu_trace_decode import TYPE_COUNTER, decode

from stepscope.core import session as _session
from stepscope.gpu.nvml import NvmlSampler, cuda_nvml_handles

BUS = ["0000:1B:00.0", "0000:3D:00.0", "0000:5E:00.0", "0000:9A:00.0"]


def gpus():
    """Four GPUs in NVML's (PCI) order; GPU 1 reports no power and has no GPM."""
    return [
        FakeNvmlGpu(0, BUS[0], "GPU-a", util=5, mem=1 << 30, power_mw=100_000, sm_mhz=1000),
        FakeNvmlGpu(1, BUS[1], "GPU-b", util=37, mem=3 << 30, power_mw=None, sm_mhz=1410,
                    gpm=False),
        FakeNvmlGpu(2, BUS[2], "GPU-c", util=88, mem=70 << 30, power_mw=512_250, sm_mhz=1980),
        FakeNvmlGpu(3, BUS[3], "MIG-d", util=1, mem=0, power_mw=60_000, sm_mhz=345),
    ]  # fmt: skip


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def counters(tr) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for e in tr.events:
        if e.type == TYPE_COUNTER:
            out.setdefault(tr.track_name(e.track), []).append(e.value)
    return out


def two_rounds(path, **kw):
    """Start a sampler (its thread takes round 1, then waits an hour), take round 2 here, stop."""
    sess = _session.Session(path).start()
    try:
        sampler = NvmlSampler(sess, interval_s=3600, log_level=logging.DEBUG, **kw)
        assert sampler.start()
        wait_for(lambda: sampler.samples == 1)
        sampler.sample_once()
        sampler.stop()
        assert sampler.errors == 0
    finally:
        sess.stop()
    return counters(decode(path))


def test_gpus_are_the_cuda_devices_by_pci_bus_id_with_exact_values(tmp_path, monkeypatch):
    """CUDA sees NVML's GPUs 2 and 1, in that order (e.g. CUDA_VISIBLE_DEVICES=2,1): only they
    are sampled, named by CUDA ordinal. GPM needs two samples; DRAM bandwidth (id 10) is not
    supported on this GPU and left out."""
    nv = FakePynvml(gpus(), unsupported={10})
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    lib = FakeLibcuda([BUS[2], BUS[1]])
    got = two_rounds(tmp_path / "n.pftrace", libcuda=lib)
    # GPM round 2 on NVML GPU 2: samples 1 and 2, value 10 * metric id + 2 + 0.5 * 2
    assert nv.metrics_calls == [(2, 1, 2)]
    assert got == {
        "nvml.gpu0.utilization.gpu %": [88, 88],
        "nvml.gpu0.memory.used": [70 << 30, 70 << 30],
        "nvml.gpu0.power W": [512.25, 512.25],
        "nvml.gpu0.clocks.sm MHz": [1980, 1980],
        "gpm.gpu0.sm_util %": [23.0],
        "gpm.gpu0.sm_occupancy %": [33.0],
        "gpm.gpu0.tensor_util %": [53.0],
        "nvml.gpu1.utilization.gpu %": [37, 37],
        "nvml.gpu1.memory.used": [3 << 30, 3 << 30],
        "nvml.gpu1.clocks.sm MHz": [1410, 1410],
    }
    assert nv.live == set() and (nv.inits, nv.shutdowns) == (1, 1)  # every GPM sample freed
    assert "cuInit" not in lib.calls


def test_gpm_metrics_are_stamped_at_the_start_of_their_interval(tmp_path, monkeypatch):
    """GPM metrics are rates between two GPM samples: the value of rounds 1-2 is stamped at
    round 1 (a counter holds from its timestamp to the next one, in the UI and the device
    table's time-weighted mean), NVML's instant readings at their own round."""
    nv = FakePynvml(gpus(), unsupported={10})
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    path = tmp_path / "g.pftrace"
    two_rounds(path, libcuda=FakeLibcuda([BUS[2]]))
    tr = decode(path)
    ts: dict[str, list[int]] = {}
    for e in tr.events:
        if e.type == TYPE_COUNTER:
            ts.setdefault(tr.track_name(e.track), []).append(e.ts)
    rounds = ts["nvml.gpu0.utilization.gpu %"]
    assert len(rounds) == 2 and rounds[0] < rounds[1]
    assert ts["gpm.gpu0.sm_util %"] == [rounds[0]]


def test_cupy_bus_ids_are_used_where_cupy_is_imported(tmp_path, monkeypatch):
    nv = FakePynvml(gpus())
    cuda = FakeMultiCuda(bus_ids=[BUS[3].lower()])
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=cuda))
    lib = FakeLibcuda(["unused"])
    assert [(i, g.index) for i, g in cuda_nvml_handles(nv, lib)] == [(0, 3)]
    assert lib.calls == ["cuDeviceGetCount"]  # the bus id came from CuPy


@pytest.mark.parametrize(
    "visible, expected",
    [
        (None, [0, 1, 2, 3]),
        ("2", [2]),
        ("GPU-c, 1", [2, 1]),
        ("MIG-d", [3]),
        ("1,7,2", [1]),  # as in CUDA, an invalid entry ends the list
        ("0,GPU-zz,2", [0]),
        ("", []),
    ],
)
def test_cuda_visible_devices_where_cuda_is_not_initialised(monkeypatch, visible, expected):
    nv = FakePynvml(gpus())
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    for lib in (FakeLibcuda(BUS, initialized=False), None):
        got = cuda_nvml_handles(nv, lib)
        assert [(i, g.index) for i, g in got] == list(enumerate(expected))
        if lib is not None:
            assert lib.calls == ["cuDeviceGetCount"]  # answered "not initialised"; no cuInit


def test_devices_selects_cuda_ordinals(tmp_path, monkeypatch):
    nv = FakePynvml(gpus())
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2")
    got = two_rounds(
        tmp_path / "s.pftrace", devices=[1], gpm=False, libcuda=FakeLibcuda(BUS, initialized=False)
    )
    assert got == {
        "nvml.gpu1.utilization.gpu %": [88, 88],
        "nvml.gpu1.memory.used": [70 << 30, 70 << 30],
        "nvml.gpu1.power W": [512.25, 512.25],
        "nvml.gpu1.clocks.sm MHz": [1980, 1980],
    }


@pytest.mark.parametrize("fail", ["sample_get", "metrics_get"])
def test_gpm_failure_turns_gpm_off_and_frees_every_sample(tmp_path, monkeypatch, caplog, fail):
    nv = FakePynvml(
        gpus()[2:3], fail_sample_get={2} if fail == "sample_get" else (),
        fail_metrics_get=fail == "metrics_get",
    )  # fmt: skip
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with caplog.at_level(logging.INFO, logger="stepscope.gpu"):
        got = two_rounds(tmp_path / "g.pftrace", libcuda=FakeLibcuda([], initialized=False))
    assert sorted(got) == [
        "nvml.gpu0.clocks.sm MHz", "nvml.gpu0.memory.used", "nvml.gpu0.power W",
        "nvml.gpu0.utilization.gpu %",
    ]  # fmt: skip
    assert nv.live == set() and nv.shutdowns == 1
    assert [r.message for r in caplog.records if "GPM" in r.message] == [
        "stepscope: GPM sampling failed on GPU 0; GPM counters off"
        if fail == "sample_get"
        else "stepscope: GPM metrics unavailable on GPU 0; GPM counters off"
    ]


def cupy_with_pools(monkeypatch):
    cuda = FakeMultiCuda(bus_ids=BUS[:3])
    pool = FakePool(cuda, used={0: 1 << 20, 1: 7, 2: 3 << 20}, total={0: 2 << 20, 1: 9, 2: 4 << 20})
    cp = SimpleNamespace(cuda=cuda, get_default_memory_pool=lambda: pool)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    return cuda


def test_cupy_pools_per_device_without_nvml(tmp_path, monkeypatch, caplog):
    """No pynvml: the sampler still runs for CuPy's pools, one pair of counters per device whose
    context is active (1 has none: never made current, which would create one)."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml fails
    cuda = cupy_with_pools(monkeypatch)
    lib = FakeLibcuda(BUS[:3], active={0, 2})
    with caplog.at_level(logging.DEBUG, logger="stepscope.gpu"):
        got = two_rounds(tmp_path / "p.pftrace", libcuda=lib)
    assert got == {
        "cupy.gpu0.pool.used": [1 << 20, 1 << 20],
        "cupy.gpu0.pool.total": [2 << 20, 2 << 20],
        "cupy.gpu2.pool.used": [3 << 20, 3 << 20],
        "cupy.gpu2.pool.total": [4 << 20, 4 << 20],
    }
    assert cuda.set_devices == [0, 2, 0, 2] and "cuInit" not in lib.calls
    assert [r.message for r in caplog.records] == [
        "stepscope: nvidia-ml-py not installed; NVML counters off"
    ]


def test_cupy_pools_wait_for_cuda_to_be_initialised(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    cuda = cupy_with_pools(monkeypatch)
    got = two_rounds(tmp_path / "w.pftrace", libcuda=FakeLibcuda(BUS[:3], initialized=False))
    assert got == {} and cuda.set_devices == []


def test_cupy_pools_beside_nvml(tmp_path, monkeypatch):
    nv = FakePynvml(gpus())
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    cupy_with_pools(monkeypatch)
    got = two_rounds(tmp_path / "b.pftrace", gpm=False, libcuda=FakeLibcuda(BUS[:3], active={1}))
    assert {k: v for k, v in got.items() if k.startswith("cupy.")} == {
        "cupy.gpu1.pool.used": [7, 7],
        "cupy.gpu1.pool.total": [9, 9],
    }
    assert sorted({k.split(".")[1] for k in got if k.startswith("nvml.")}) == [
        "gpu0",
        "gpu1",
        "gpu2",
    ]
