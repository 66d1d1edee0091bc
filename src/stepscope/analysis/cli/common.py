"""Helpers shared by the analysis subcommands (``summary``, ``sql``, ``export-csv``)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

from .. import engines
from ..rundir import classify  # noqa: F401 - the subcommands' name for it

_PROGRESS_BYTES = 8 << 20  # show loading progress for inputs bigger than this (a few seconds)
# The profiler's file names (_schema.SUMMARY_FILE, DETAIL_FILE) say each file's role.
def add_engine_args(p: argparse.ArgumentParser) -> None:
    """``--engine``, ``--trace-processor-bin`` and ``-q``: how the traces are loaded."""
    p.add_argument("--engine", choices=engines.ENGINES, default="auto")
    p.add_argument("--trace-processor-bin", metavar="PATH",
                   help=f"trace_processor_shell to use (else ${engines.ENV_BIN}, PATH)")
    p.add_argument("-q", "--quiet", action="store_true", help="no loading progress")


def fail(cmd: str, msg: str, code: int = 2) -> int:
    """Print ``stepscope CMD: error: MSG`` on stderr; return the exit status ``code``."""
    print(f"stepscope {cmd}: error: {msg}", file=sys.stderr)
    return code


def open_traces(paths: list[str], args: argparse.Namespace) -> Any:
    """Load ``paths`` into one database as the engine arguments say; progress only for inputs
    large enough to take a few seconds (and not with ``-q``). A run directory stands for its
    whole-run files (see :func:`classify`), so nothing is loaded twice."""
    exit_on_sigterm()
    if any(os.path.isdir(p) for p in paths):
        paths = classify(paths).main()
    size = sum(os.path.getsize(p) for p in paths if os.path.isfile(p))
    progress = None if args.quiet or size < _PROGRESS_BYTES else engines.print_progress()
    return engines.open(paths, engine=args.engine, trace_processor_bin=args.trace_processor_bin,
                        progress=progress)


def exit_on_sigterm() -> None:
    """SIGTERM (kill, a job scheduler) as an exception in the main thread, so the temporary
    database is removed as on Ctrl-C (its default action would end the process on the spot).
    Exit status 143, as the signal would give."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # someone else's handler (or ignored): theirs

    def on_term(signum: int, frame: Any) -> None:
        engines.note_termination(signum)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
