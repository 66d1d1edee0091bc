"""The CUDA driver library (libcuda) through ctypes, only where the program loaded it itself.

Unless the user asks for GPU tracing explicitly, stepscope never brings CUDA into a process:
loading libcuda or calling ``cuInit`` there costs driver memory and breaks the children the
program forks and that then use CUDA (data-loader workers). ``RTLD_NOLOAD`` returns the library
only when it is already loaded.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any


def loaded_libcuda() -> Any | None:
    """libcuda if this process has loaded it already, else None (nothing is loaded)."""
    try:
        return ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
    except (OSError, AttributeError):  # not loaded; no RTLD_NOLOAD on this platform
        return None
