"""``stepscope run [options] -- python train.py ...``: a program under the profiler, unchanged.

The options become ``STEPSCOPE_OPTIONS`` (over any already in the environment) and the command's
Python interpreter is made to run ``-m stepscope.profiler.boot`` before the script, which starts a
``Profiler`` and stops it when the program ends. Only commands that start with a Python
interpreter can be rewritten; under a launcher put the boot module in the launcher's command
yourself (``torchrun ... -m stepscope.profiler.boot train.py``) and pass options through
``STEPSCOPE_OPTIONS``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import options as _options

BOOT = "stepscope.profiler.boot"
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?(\.exe)?$|^pypy3?$")
_FLAGS_WITH_VALUE = {"-X", "-W", "-Q"}


def rewrite(command: Sequence[str]) -> list[str]:
    """``python [flags] (script | -m mod | -c code) args`` -> the same under the boot module."""
    if not command:
        raise ValueError("stepscope run: no command given after '--'")
    exe = os.path.basename(command[0])
    if not _PYTHON.match(exe) and os.path.abspath(command[0]) != os.path.abspath(sys.executable):
        raise ValueError(
            f"stepscope run: the command must start with a Python interpreter, got {command[0]!r}."
            f" Under a launcher, run the boot module yourself, e.g. "
            f"'torchrun ... -m {BOOT} train.py', with options in {_options.ENV_VAR}"
        )
    out = [command[0]]
    i = 1
    while i < len(command):
        a = command[i]
        if a in ("-m", "-c"):
            break
        if a in _FLAGS_WITH_VALUE:
            out.extend(command[i:i + 2])
            i += 2
            continue
        if a.startswith("-") and a != "-":
            out.append(a)
            i += 1
            continue
        break
    if i >= len(command):
        raise ValueError("stepscope run: the Python command has no script, -m or -c to run")
    return [*out, "-m", BOOT, *command[i:]]


def environment(opts: Mapping[str, Any], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ``opts`` over the existing ``STEPSCOPE_OPTIONS``; the stepscope
    package importable (its source directory is prepended to ``PYTHONPATH``)."""
    env = dict(os.environ if env is None else env)
    merged = dict(_options.from_env(env))
    merged.update(opts)
    env[_options.ENV_VAR] = _options.dumps(merged)
    src = str(Path(__file__).resolve().parents[2])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if src not in paths:
        env["PYTHONPATH"] = os.pathsep.join([src, *paths])
    return env


def run(command: Sequence[str], opts: Mapping[str, Any] | None = None) -> int:
    """Run ``command`` under the profiler; returns its exit status."""
    cmd = rewrite(command)
    env = environment(opts or {})
    try:
        proc = subprocess.run(cmd, env=env, check=False)
    except FileNotFoundError:
        raise ValueError(f"stepscope run: {command[0]!r} not found") from None
    except KeyboardInterrupt:
        return 130
    return proc.returncode
