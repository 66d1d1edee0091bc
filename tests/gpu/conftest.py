from __future__ import annotations

from pathlib import Path

import pytest

from stepscope.gpu.fixture import Fixture, load_fixture

FIXTURE_PATH = Path(__file__).resolve().parent.parent / "data" / "cupti_mlp_fixture.json.gz"


@pytest.fixture(scope="session")
def fixture() -> Fixture:
    return load_fixture(FIXTURE_PATH)


@pytest.fixture(scope="session")
def fixture_path() -> Path:
    return FIXTURE_PATH
