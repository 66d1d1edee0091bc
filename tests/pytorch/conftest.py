"""The torch tests never read the developer's cache of native torch readers (~/.cache): each
session has an empty one, so they run the Python reader unless a test builds the native one."""

from __future__ import annotations

import os

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
