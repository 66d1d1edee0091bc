"""The native module: the reader of torch's profiler events (``kineto_reader.cpp``), the
collectives' completion stamps (``work_done.cpp``) and the collectives noted in C++
(``collective_ops.cpp``) by process groups' hooks (``collective_hooks.cpp``) or by our kernels on
the c10d ops (``c10d_kernels.cpp``): built, found, loaded.

It is compiled against the installed torch by ``stepscope build-torch`` (a C++ compiler and
torch's headers, 20-60 s), never on import or while a program runs: a compile there would slow the
program down and write files it did not ask for. The build lands in stepscope's cache directory
(``STEPSCOPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/stepscope``, else ``~/.cache/stepscope``)
under a name keyed by the source, torch's exact build and place, and the Python ABI, so a torch
upgrade never loads a module built for another torch (that would crash the program): it falls
back to the Python reader until rebuilt. ``STEPSCOPE_PURE_PYTHON=1`` selects the Python reader too.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

MODULE = "_stepscope_kineto"
# what is compiled: the reader and the collectives' files as one unit (``c10d_unit.cpp``)
SOURCES = tuple(Path(__file__).with_name(name) for name in ("kineto_reader.cpp", "c10d_unit.cpp"))
# what that unit includes: collectives' completion stamps (``watch``/``drain``), the ops noted in
# C++ (``take_ops``) by process groups' hooks (``hook_group``) or by our kernels on the c10d ops
# (``hook_ops``), and what those four share
INCLUDED = tuple(Path(__file__).with_name(name) for name in
                 ("work_done.cpp", "collective_ops.cpp", "collective_hooks.cpp",
                  "c10d_kernels.cpp", "c10d_glue.h"))
_loaded: dict[str, ModuleType | None] = {}  # path -> module (None: it failed to load)


def cache_dir() -> Path:
    if os.environ.get("STEPSCOPE_CACHE_DIR"):
        return Path(os.environ["STEPSCOPE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stepscope"


_keys: dict[tuple[str, str], str] = {}


def _torch_key(torch: Any) -> str:
    """A hash of what the build depends on (computed once per torch)."""
    ident = (torch.__version__, str(torch.version.git_version))
    key = _keys.get(ident)
    if key is None:
        key = _keys[ident] = _hash(torch)
    return key


def _hash(torch: Any) -> str:
    # the torch install's place too: the build links its libraries there
    parts = (*(src.read_bytes() for src in SOURCES + INCLUDED), torch.__version__,
             str(torch.version.git_version),
             os.path.dirname(os.path.abspath(torch.__file__)),
             str(torch._C._GLIBCXX_USE_CXX11_ABI), sysconfig.get_config_var("EXT_SUFFIX"),  # noqa: SLF001
             sys.version)
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def module_path(torch: Any) -> Path:
    """Where the build for this torch and this Python is (or would be)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return cache_dir() / f"kineto_reader-{_torch_key(torch)}{suffix}"


def load() -> ModuleType | None:
    """The native module for the imported torch, or None (not built, not wanted, no torch)."""
    if os.environ.get("STEPSCOPE_PURE_PYTHON", "") not in ("", "0"):
        return None
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        path = str(module_path(torch))
    except Exception:
        return None
    if path in _loaded:
        return _loaded[path]
    if not os.path.exists(path):  # (not remembered: a build made meanwhile is used)
        return None
    mod: ModuleType | None = None
    try:
        loader = importlib.machinery.ExtensionFileLoader(MODULE, path)
        spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
        assert spec is not None
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        atexit.register(mod.join)  # a free still running must end before the interpreter
    except Exception as e:  # a damaged file: the Python reader, said once
        print(f"stepscope: cannot load the native torch reader {path} ({e}); "
              "reading torch's events through its Python API", file=sys.stderr)
        mod = None
    _loaded[path] = mod
    return mod


def _compile_command(torch: Any, out: str, std: str) -> list[str]:
    # torch.utils.cpp_extension's include_paths() without its import (which warns about CUDA)
    root = os.path.dirname(torch.__file__)
    lib, inc = os.path.join(root, "lib"), os.path.join(root, "include")
    # work_done.cpp and collective_hooks.cpp read torch's Python objects (Work, ProcessGroup)
    # through pybind11, whose internals must be torch's own: a torch that says how it built
    # them (before pybind11 3) has them named alike
    pybind = [f'-DPYBIND11_{k}="{getattr(torch._C, f"_PYBIND11_{k}")}"'
              for k in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI")
              if hasattr(torch._C, f"_PYBIND11_{k}")]
    return [os.environ.get("CXX", "c++"), "-O2", "-shared", "-fPIC", f"-std={std}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",  # noqa: SLF001
            *pybind, "-I", sysconfig.get_paths()["include"], "-I", inc,
            "-I", os.path.join(inc, "torch", "csrc", "api", "include"),
            *(str(src) for src in SOURCES), "-o", out, "-L", lib, "-ltorch_cpu", "-lc10",
            f"-Wl,-rpath,{lib}"]


def build(verbose: bool = False) -> Path:
    """Compile the reader for the installed torch into the cache directory; its path.
    Raises RuntimeError with the compiler's last lines when it cannot."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError("the native torch reader is built on Linux only")
    try:
        import torch
    except ImportError as e:
        raise RuntimeError("torch is not installed (pip install stepscope[torch])") from e
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx}) on PATH; set CXX")
    dest = module_path(torch)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", prefix=".build-", dir=dest.parent)
    os.close(fd)
    try:
        err = ""
        for std in ("c++20", "c++17"):  # torch's headers ask for C++20 since 2.10
            cmd = _compile_command(torch, tmp, std)
            if verbose:
                print(" ".join(cmd), file=sys.stderr)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode == 0:
                os.replace(tmp, dest)  # whole or not at all: a loader never sees a partial file
                _loaded.pop(str(dest), None)
                return dest
            err = proc.stderr
        last = [ln for ln in err.splitlines() if "error" in ln][:3] or err.splitlines()[-3:]
        raise RuntimeError("compiling the native torch reader failed: " + " | ".join(last))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
