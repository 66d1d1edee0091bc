"""Run directories and the roles of the files in them, for every way in (CLI and ``open``).

The profiler writes ``rank<N>.summary.pftrace`` (the whole run) and ``rank<N>.detail.<k>.pftrace``
(windows that repeat their steps) into a run directory; ``classify`` says which files give the
tables and which only add detail, so nothing is counted twice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .. import _schema as S
from ._errors import TraceError


def _role(name: str) -> str | None:
    """The profiler's role of a file name (``_schema.rank_file``): "summary", "detail", or
    "worker" (a DataLoader worker's file: its tracks are threads of its rank's process, so it is
    part of that rank's whole run, never a repeat of it)."""
    found = S.rank_file(name)
    return found[0] if found else None


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

    def check_one_run(self) -> None:
        """Raise TraceError where a rank's whole-run file comes from two runs: the summary
        tables would hold both as one rank twice over (two "rank 0" rows in the distributed
        table, their steps pooled). (SQL may compare runs: each is a process of its own.)"""
        by_rank: dict[int, str] = {}
        for f in self.whole:
            found = S.rank_file(os.path.basename(f))
            if found is None or found[0] != "summary":
                continue
            d = os.path.dirname(os.path.realpath(f))
            other = by_rank.setdefault(found[1], d)
            if other != d:
                raise TraceError(f"{d}: rank {found[1]} comes from another run too ({other}): "
                                 "summarize one run at a time")

    def main(self) -> list[str]:
        """The files that give every table without counting anything twice: the whole-run
        files, or the detail windows when there is none (windows never overlap)."""
        return self.whole or self.detail


def classify(paths: list[str]) -> Inputs:
    """Sort PATHs (files and run directories) by role; a file named twice counts once.

    A directory stands for its ``rank<N>.summary.pftrace`` and ``rank<N>.detail.<k>.pftrace``
    files (and its DataLoader workers' ``rank<N>.summary.worker<W>-<pid>.pftrace``, whole-run
    files of their rank), or, when it has none, for those of the one run directory inside it
    (the profiler's ``<dir>``); other traces in it (``merged.pftrace``) are left out, as are
    other traces given beside rank files of their directory (``RUN_DIR/*.pftrace``). Raises
    TraceError for a directory without such files or with several runs."""
    out = Inputs()
    seen: set[str] = set()

    def add(path: str) -> None:
        key = os.path.realpath(path)
        if key in seen:
            return
        seen.add(key)
        (out.detail if _role(os.path.basename(path)) == "detail" else out.whole).append(path)

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
            if _rank_files(runs[0], name) or _role(name) == "worker" and os.path.isfile(f):
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
    return _role(os.path.basename(path)) is not None


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except OSError as e:
        raise TraceError(f"{d}: {e.strerror or e}") from None


def _rank_files(d: str, name: str | None = None) -> bool:
    """Whether ``name`` (else any entry of ``d``) is a profiler rank file."""
    names = [name] if name is not None else _listdir(d)
    return any(_role(n) in ("summary", "detail") and os.path.isfile(os.path.join(d, n))
               for n in names)
