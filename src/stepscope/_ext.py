"""stepscope's optional C extensions (setup.py builds them where it can): the recording path's
``_fast`` and the analysis loops ``_decodeloops`` and ``_sqlpages``.

Each has a Python (or numpy) twin giving the same results; ``STEPSCOPE_PURE_PYTHON=1`` selects
the twins.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def load(name: str) -> ModuleType | None:
    """The extension module ``name`` (absolute: ``stepscope._fast``), or None when it is not
    built or not wanted."""
    if os.environ.get("STEPSCOPE_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
