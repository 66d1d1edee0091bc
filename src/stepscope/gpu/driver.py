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
    """libcuda if this process has loaded it already, else None (nothing is loaded; the
    library's symbol scope stays as the program chose)."""
    try:
        return ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
    except (OSError, AttributeError):  # not loaded; no RTLD_NOLOAD on this platform
        return None


def initialized_count(lib: Any | None) -> int | None:
    """CUDA device count if the driver is initialized in this process, else None.

    Never calls ``cuInit``: ``cuDeviceGetCount`` answers CUDA_ERROR_NOT_INITIALIZED (3) before
    it. (CuPy's and the runtime's device queries would initialize CUDA.)
    """
    if lib is None:
        return None
    n = ctypes.c_int(0)
    try:
        return n.value if lib.cuDeviceGetCount(ctypes.byref(n)) == 0 else None
    except Exception:
        return None
