"""``stepscope run [options] -- python train.py ...``: a program under the profiler, unchanged.

The options become ``STEPSCOPE_OPTIONS`` (over any already in the environment) and the command's
Python interpreter is made to run ``-m stepscope.profiler.boot`` before the script, which starts a
``Profiler`` and stops it when the program ends. Only commands that start with a Python
interpreter can be rewritten; under a launcher put the boot module in the launcher's command
yourself (``torchrun ... -m stepscope.profiler.boot train.py``) and pass options through
``STEPSCOPE_OPTIONS``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import options as _options

BOOT = "stepscope.profiler.boot"
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?(\.exe)?$|^pypy3?$")
_FLAGS_WITH_VALUE = {"-X", "-W", "-Q"}
_LAUNCHERS = {"torch.distributed.run", "torch.distributed.launch"}  # (torchrun's modules)


def rewrite(command: Sequence[str]) -> list[str]:
    """``python [flags] (script | -m mod | -c code) args`` -> the same under the boot module."""
    if not command:
        raise ValueError("stepscope run: no command given after '--'")
    exe = os.path.basename(command[0])
    launcher = (f"Under a launcher, run the boot module yourself, e.g. "
                f"'torchrun ... -m {BOOT} train.py', with options in {_options.ENV_VAR}")
    if not _PYTHON.match(exe) and os.path.abspath(command[0]) != os.path.abspath(sys.executable):
        raise ValueError(
            f"stepscope run: the command must start with a Python interpreter, got {command[0]!r}."
            f" {launcher}"
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
    if command[i] == "-m" and i + 1 < len(command) and command[i + 1] in _LAUNCHERS:
        # (profiled, the launcher would be the run's one rank, and its workers not traced)
        raise ValueError(f"stepscope run: {command[i + 1]} is a launcher. {launcher}")
    return [*out, "-m", BOOT, *command[i:]]


def environment(opts: Mapping[str, Any], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ``opts`` over the existing ``STEPSCOPE_OPTIONS``; the stepscope
    package importable (its source directory is prepended to ``PYTHONPATH``)."""
    env = dict(os.environ if env is None else env)
    merged = dict(_options.from_env(env))
    merged.update(opts)
    if "run_id" not in merged and env.get("STEPSCOPE_RUN_ID"):  # (the program's Profiler
        # would refuse it: said here, before the program runs)
        _options.check_run_id("STEPSCOPE_RUN_ID", env["STEPSCOPE_RUN_ID"])
    env[_options.ENV_VAR] = _options.dumps(merged)
    src = str(Path(__file__).resolve().parents[2])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if src not in paths:
        env["PYTHONPATH"] = os.pathsep.join([src, *paths])
    return env


def run(command: Sequence[str], opts: Mapping[str, Any] | None = None) -> int:
    """Run ``command`` under the profiler; returns its exit status, as a shell gives it (128 +
    the signal's number for a program a signal ended).

    A signal meant for the program reaches it: SIGTERM sent to ``stepscope run`` (a job
    scheduler's or a container's stop signals the top process only) is passed on, and so are
    SIGINT and SIGHUP, unless a terminal sent them to its foreground process group, the
    program included (Ctrl-C, a hang-up: passed on too, a second one would cut the program's
    own clean-up short). The program
    then finishes its trace, and ``stepscope run`` waits for it: never a program left running,
    or killed while it writes (``subprocess.run`` kills its child a quarter second after a
    KeyboardInterrupt)."""
    cmd = rewrite(command)
    env = environment(opts or {})
    _check_interpreter(cmd, env)
    try:
        proc = subprocess.Popen(cmd, env=env, preexec_fn=_ends_with_us())
    except FileNotFoundError:
        raise ValueError(f"stepscope run: {command[0]!r} not found") from None
    restore = _pass_signals_on(proc)
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:  # (before the handlers: the terminal's, to the group)
                continue
    finally:
        restore()
    return 128 - code if code < 0 else code


def _check_interpreter(cmd: list[str], env: Mapping[str, str]) -> None:
    """Raise ValueError where the command's Python cannot import the boot module: another
    interpreter than stepscope's (a system ``python`` without numpy or psutil) printed a raw
    traceback from stepscope's imports. Checked by importing it there, with the command's
    flags and environment; the interpreter stepscope runs in, with no flags, is not checked
    (the usual case: no cost)."""
    exe = shutil.which(cmd[0], path=env.get("PATH"))
    flags = cmd[1:cmd.index("-m")]  # (rewrite: the interpreter, its flags, then -m BOOT)
    if exe is None or (os.path.abspath(exe) == os.path.abspath(sys.executable) and not flags):
        return  # (not found: Popen says so)
    try:
        r = subprocess.run([exe, *flags, "-c", f"import {BOOT}"], env=dict(env),
                           capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return  # (the run itself says what is wrong)
    if r.returncode == 0:
        return
    lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
    why = lines[-1] if lines else f"exit status {r.returncode}"
    raise ValueError(f"stepscope run: {cmd[0]} cannot import stepscope ({why}): run the "
                     f"program with the Python stepscope is installed in ({sys.executable}), "
                     f"or install stepscope for {cmd[0]}")


def _ends_with_us() -> Any:
    """What the program runs before its exec (Linux): it gets SIGTERM should ``stepscope
    run`` die (SIGKILL, the OOM killer: nothing to pass on), so it finishes its trace and ends
    (it ran on, an orphan, writing into the run's files). None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # (loaded here, not in the child)
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def ends_with_parent() -> None:
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # (it died before that)
            os.kill(os.getpid(), signal.SIGTERM)

    return ends_with_parent


def _pass_signals_on(proc: subprocess.Popen) -> Any:
    """Handlers that pass SIGTERM and (see ``run``) SIGINT and SIGHUP on to ``proc``, installed
    once it runs (a handler's disposition would not survive its exec, but an ignored signal's
    would); returns what puts the earlier ones back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def pass_on(signum: int, frame: Any) -> None:
        if signum != signal.SIGTERM and _terminal_sent_it():
            return
        with contextlib.suppress(OSError):
            proc.send_signal(signum)

    earlier = {}
    for name in ("SIGTERM", "SIGHUP", "SIGINT"):
        sig = getattr(signal, name, None)
        if sig is not None:
            with contextlib.suppress(OSError, ValueError):
                earlier[sig] = signal.signal(sig, pass_on)

    def restore() -> None:
        for sig, handler in earlier.items():
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(sig, handler)

    return restore


def _terminal_sent_it() -> bool:
    """True where this process group is the foreground one of a controlling terminal: a
    SIGINT or SIGHUP it got (Ctrl-C, a hang-up) went to the whole group, the program
    included."""
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
        except (AttributeError, OSError, ValueError):
            continue
    return False
