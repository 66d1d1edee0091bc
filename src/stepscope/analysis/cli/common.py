"""Helpers shared by the analysis subcommands (``summary``, ``sql``, ``export-csv``)."""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from .. import engines
from .._errors import TraceError

_PROGRESS_BYTES = 8 << 20  # show loading progress for inputs bigger than this (a few seconds)
# The profiler's file names (_schema.SUMMARY_FILE, DETAIL_FILE) say each file's role.
_SUMMARY_FILE = re.compile(r"^rank\d+\.summary\.pftrace$")
_DETAIL_FILE = re.compile(r"^rank\d+\.detail\.\d+\.pftrace$")


@dataclass
class Inputs:
    """Trace files by role. ``whole``: files that cover the whole run (the profiler's
    ``rank<N>.summary.pftrace``, or any trace not named as a detail window); ``detail``: the
    profiler's ``rank<N>.detail.<k>.pftrace`` windows, which repeat the summary-level events
    (steps, phases) of their window; ``left_out``: files found in a run directory that repeat
    its rank files (``merged.pftrace``, other traces)."""

    whole: list[str] = field(default_factory=list)
    detail: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)

    def main(self) -> list[str]:
        """The files that give every table without counting anything twice: the whole-run
        files, or the detail windows when there is none (windows never overlap)."""
        return self.whole or self.detail


def classify(paths: list[str]) -> Inputs:
    """Sort PATHs (files and run directories) by role; a file named twice counts once.

    A directory stands for its ``rank<N>.summary.pftrace`` and ``rank<N>.detail.<k>.pftrace``
    files, or, when it has none, for those of the one run directory inside it (the profiler's
    ``<dir>``); other traces in it (``merged.pftrace``) are left out, as are other traces given
    beside rank files of their directory (``RUN_DIR/*.pftrace``). Raises TraceError for a
    directory without such files or with several runs."""
    out = Inputs()
    seen: set[str] = set()

    def add(path: str) -> None:
        key = os.path.realpath(path)
        if key in seen:
            return
        seen.add(key)
        (out.detail if _DETAIL_FILE.match(os.path.basename(path)) else out.whole).append(path)

    for p in paths:
        if not os.path.isdir(p):
            add(p)  # missing files fail when loaded, with the engine's message
            continue
        runs = [p] if _rank_files(p) else sorted(
            d for d in (os.path.join(p, n) for n in _listdir(p))
            if os.path.isdir(d) and _rank_files(d))
        if not runs:
            raise TraceError(f"{p}: is a directory without rank<N>.summary.pftrace or "
                             "rank<N>.detail.<k>.pftrace files; give trace files by name")
        if len(runs) > 1:
            raise TraceError(f"{p}: holds several runs ({', '.join(runs)}); give run "
                             "directories by name")
        for name in sorted(_listdir(runs[0])):
            f = os.path.join(runs[0], name)
            if _rank_files(runs[0], name):
                add(f)
            elif name.endswith(".pftrace") and os.path.isfile(f):
                out.left_out.append(f)
    # RUN_DIR/*.pftrace as RUN_DIR: a trace beside rank files that are given too is a merge
    # of them (stepscope merge writes into the run directory), so it would count them twice
    run_dirs = {os.path.dirname(os.path.realpath(f)) for f in out.whole + out.detail
                if _is_rank_file(f)}
    for f in [f for f in out.whole if not _is_rank_file(f)]:
        if os.path.dirname(os.path.realpath(f)) in run_dirs:
            out.whole.remove(f)
            out.left_out.append(f)
    return out


def _is_rank_file(path: str) -> bool:
    name = os.path.basename(path)
    return bool(_SUMMARY_FILE.match(name) or _DETAIL_FILE.match(name))


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except OSError as e:
        raise TraceError(f"{d}: {e.strerror or e}") from None


def _rank_files(d: str, name: str | None = None) -> bool:
    """Whether ``name`` (else any entry of ``d``) is a profiler rank file."""
    names = [name] if name is not None else _listdir(d)
    return any((_SUMMARY_FILE.match(n) or _DETAIL_FILE.match(n))
               and os.path.isfile(os.path.join(d, n)) for n in names)


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
