"""The analysis package's optional C extensions (setup.py builds them where it can).

Each has a numpy twin giving the same results; ``STEPSCOPE_PURE_PYTHON=1`` selects the twins, as
it does for the recording path.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def load(name: str) -> ModuleType | None:
    """``stepscope.analysis.<name>``, or None when it is not built or not wanted."""
    if os.environ.get("STEPSCOPE_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        return importlib.import_module(f".{name}", __package__)
    except ImportError:
        return None
