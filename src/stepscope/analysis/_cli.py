"""Helpers shared by the analysis subcommands (``summary``, ``sql``, ``export-csv``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from . import engines

_PROGRESS_BYTES = 8 << 20  # show loading progress for inputs bigger than this (a few seconds)


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
    large enough to take a few seconds (and not with ``-q``)."""
    size = sum(os.path.getsize(p) for p in paths if os.path.isfile(p))
    progress = None if args.quiet or size < _PROGRESS_BYTES else engines.print_progress()
    return engines.open(paths, engine=args.engine, trace_processor_bin=args.trace_processor_bin,
                        progress=progress)
