"""The torch tests never read the developer's cache of native torch readers (~/.cache): each
session has an empty one, so they run the Python reader unless a test builds the native one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="session", autouse=True)
def _own_cache_dir(tmp_path_factory):
    old = os.environ.get("STEPSCOPE_CACHE_DIR")
    os.environ["STEPSCOPE_CACHE_DIR"] = str(tmp_path_factory.mktemp("stepscope-cache"))
    yield
    if old is None:
        os.environ.pop("STEPSCOPE_CACHE_DIR", None)
    else:
        os.environ["STEPSCOPE_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def native_cache(tmp_path_factory):
    """A cache directory holding a fresh build of the native module (the reader of torch's
    events and the collectives' completion stamps), made by the CLI as a user would: built once
    per session for the tests that ask for it (skipped where the pure-Python recorder is
    forced: the module is then never loaded)."""
    if os.environ.get("STEPSCOPE_PURE_PYTHON", "") not in ("", "0"):
        pytest.skip("STEPSCOPE_PURE_PYTHON=1 forces every C part off, the native module too")
    d = tmp_path_factory.mktemp("native-cache")
    env = dict(os.environ, STEPSCOPE_CACHE_DIR=str(d))
    proc = subprocess.run([sys.executable, "-m", "stepscope.cli", "build-torch"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    path = proc.stdout.strip()
    assert os.path.dirname(path) == str(d) and os.path.isfile(path)
    assert not [f for f in os.listdir(d) if f.startswith(".build-")]  # no temporary left
    return d
