from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from gpu_fakes import FakeCuda

from stepscope.gpu.fixture import Fixture, load_fixture

FIXTURE_PATH = Path(__file__).resolve().parent.parent / "data" / "cupti_mlp_fixture.json.gz"


@pytest.fixture(scope="session")
def fixture() -> Fixture:
    return load_fixture(FIXTURE_PATH)


@pytest.fixture(scope="session")
def fixture_path() -> Path:
    return FIXTURE_PATH


@pytest.fixture
def gpu_cupy():
    """CuPy on a real GPU (for the tests marked ``gpu``); the test is skipped without one."""
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no GPU")
    except Exception:
        pytest.skip("no GPU")
    return cp


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    """A stand-in for CuPy's ``cuda`` namespace, installed as the imported ``cupy``."""
    cuda = FakeCuda()
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=cuda))
    return cuda
