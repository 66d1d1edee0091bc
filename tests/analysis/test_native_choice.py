"""Each stage's C-or-Python choice is made in one module (``tp.loops``, ``sqlimage.pages``),
and ``STEPSCOPE_PURE_PYTHON=1`` makes it pick the numpy twins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stepscope.analysis.sqlimage import pages
from stepscope.analysis.tp import loops

SHOW = ("from stepscope.analysis.tp import loops; from stepscope.analysis.sqlimage import pages;"
        "print(getattr(loops.native, '__name__', None), getattr(pages.native, '__name__', None))")


def _choices(pure: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "STEPSCOPE_PURE_PYTHON"}
    if pure is not None:
        env["STEPSCOPE_PURE_PYTHON"] = pure
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True,
                         check=True)
    return out.stdout.split()


def test_pure_python_forces_the_twins():
    assert _choices("1") == ["None", "None"]


@pytest.mark.skipif(loops.native is None or pages.native is None,
                    reason="the C extensions are not built")
def test_the_c_modules_are_found_where_setup_py_builds_them():
    want = ["stepscope.analysis.tp._decodeloops", "stepscope.analysis.sqlimage._sqlpages"]
    assert _choices(None) == want
    assert _choices("0") == want

