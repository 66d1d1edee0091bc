"""``stepscope summary PATH...``: the summary tables of one or more traces on the command line.

The lead's ``stepscope/cli.py`` calls :func:`add_parsers` with its subparsers; the parser sets
``func`` to :func:`run`, which returns the exit status (0 ok, 2 bad input or unreadable trace).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

from .. import merge as _merge
from .. import summaries
from .._errors import TraceError
from ..summaries import sharedbase
from ..summaries.cntk import write_cntk
from ..summaries.format import UNITS
from ..summaries.slicebase import PLACEHOLDERS
from ..summaries.sqlfiles import base_ctes
from .common import add_engine_args, classify
from .common import fail as _fail
from .common import open_traces as _open  # a module global: the tests replace it

_FORMATS = ("text", "csv", "json", "md")


def add_parsers(subparsers: Any) -> None:
    """Add the ``summary`` subcommand to an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "summary",
        help="print summary tables of traces",
        description="Summary tables (overview, model, steps, operators, kernels, memory "
        "copies, device, distributed) computed with SQL on the trace.",
    )
    p.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="trace files or profiler run directories (rank<N>.summary.pftrace give the "
        "tables, rank<N>.detail.<k>.pftrace windows add the operators, kernels and memcpy "
        "tables, and the device, model and distributed ones with their GPU data; nothing is "
        "counted twice)",
    )
    p.add_argument(
        "--table",
        action="append",
        metavar="NAME[,NAME]",
        help="tables to show (repeatable; default: all but step_times): "
        + ", ".join(summaries.TABLES),
    )
    p.add_argument("--sort", metavar="COLUMN", help="sort rows by this column (e.g. total, calls)")
    p.add_argument("--format", choices=_FORMATS, default="text")
    p.add_argument("--unit", choices=tuple(UNITS), default="ms", help="time unit (default ms)")
    p.add_argument("--threads", metavar="T[,T]",
                   help="thread ids or names whose host slices to keep (device slices stay; "
                        "async ranges, of no one thread, go)")
    p.add_argument("--ranks", metavar="R[,R]", help="ranks to keep")
    p.add_argument("--steps", metavar="A:B", help="steps A..B-1 (A:, :B, or N also work)")
    p.add_argument("--by-thread", action="store_true", help="operators per rank and thread")
    p.add_argument(
        "--straggler-margin",
        type=float,
        default=0.10,
        metavar="F",
        help="a rank is a straggler when its mean step exceeds the median by more than F "
        "(default 0.10)",
    )
    p.add_argument(
        "--name-width",
        type=_width,
        metavar="N",
        help="text/md: cut names longer than N characters in the middle (default: as needed "
        "to keep each table within 200 columns; 0: never; csv/json always hold full names)",
    )
    p.add_argument("--cntk", metavar="DIR", help="also write CNTK-style per-rank files to DIR")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    add_engine_args(p)
    p.set_defaults(func=run, trailing="paths")


def _width(text: str) -> int:
    """``--name-width``: a non-negative integer (argparse turns the error into a usage line)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"takes a number of characters >= 0, got {text!r}")
    return n


def _split(values: str | None) -> list[str] | None:
    if not values:
        return None
    return [v.strip() for v in values.split(",") if v.strip()]


def _options(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """Validated table names and filter keywords; raises SummaryError on bad input."""
    names: list[str] = []
    for group in args.table or []:
        names += _split(group) or []
    for n in names:
        summaries.check_name(n)  # before loading: SummaryError, as all_tables() would raise
    names = names or list(summaries.DEFAULT_TABLES)
    ranks = _split(args.ranks)
    if ranks is not None:
        try:
            ranks = [int(r) for r in ranks]
        except ValueError:
            raise summaries.SummaryError(f"--ranks takes integers, got {args.ranks!r}") from None
    threads = _split(args.threads)
    steps = summaries.parse_steps(args.steps) if args.steps else None
    if args.sort and not any(
        summaries.has_column(n, args.sort, by_thread=args.by_thread) for n in names
    ):
        raise summaries.SummaryError(f"no selected table has a column {args.sort!r}")
    kw = {
        "threads": threads,
        "ranks": ranks,
        "steps": steps,
        "by_thread": args.by_thread,
        "straggler_margin": args.straggler_margin,
    }
    return names, kw


def run(args: argparse.Namespace) -> int:
    """Handler of ``stepscope summary``: the whole-run files of all PATHs are loaded into one
    database (one rank per file, typically), so the distributed table compares them.

    Files by role (see ``common.classify``): the profiler's ``rank<N>.summary.pftrace`` (and any
    trace not named as a detail window) cover the whole run and give every table. Its
    ``rank<N>.detail.<k>.pftrace`` windows repeat the steps and phases of their window, so when
    whole-run files are given too they are loaded apart and only give the detail tables
    (operators, kernels, memcpy, device: events recorded in detail windows; model and
    distributed with the GPU time only windows have), titled "(detail windows)" (see
    ``_add_detail_tables``).
    Detail files alone give every table (windows never overlap)."""
    try:
        names, kw = _options(args)
        inputs = classify(list(args.paths))
        inputs.check_one_run()
    except summaries.SummaryError as e:
        return _fail("summary", str(e))
    except TraceError as e:  # a directory without rank files, or with several runs
        return _fail("summary", f"cannot read {e}")
    if args.output and _is_input(args.output, inputs):
        return _fail("summary", f"-o {args.output}: is one of the inputs; name a new file")
    if not args.quiet:
        for f in inputs.left_out:
            print(f"stepscope summary: left out {f} (it repeats the run's rank files)",
                  file=sys.stderr)
    paths = inputs.main()
    shown = ", ".join(paths)
    try:
        db = _open(paths, args)
    except TraceError as e:  # "PATH: what is wrong" (missing, a directory, corrupt)
        return _fail("summary", f"cannot read {e}")
    except Exception as e:  # the engines' own messages say what is wrong with the file
        return _fail("summary", f"cannot read {shown}: {e}")
    try:
        twice = _loaded_twice(db, paths)
        if twice:
            return _fail("summary", twice)
        _check_filters(db, args, kw, inputs.detail if inputs.whole else [])
        tables = summaries.all_tables(db, names=names, sort=args.sort, **kw)
        if inputs.whole and inputs.detail:
            _add_detail_tables(tables, inputs.detail, args, kw)
        text = summaries.render_report(
            tables.values(), fmt=args.format, unit=args.unit, name_width=args.name_width
        )
        if args.cntk:
            kw_f = {k: kw[k] for k in ("threads", "ranks", "steps")}
            for p in write_cntk(db, args.cntk, **kw_f):
                print(f"wrote {p}", file=sys.stderr)
    except summaries.SummaryError as e:
        return _fail("summary", f"{shown}: {e}")
    except TraceError as e:  # a detail file that cannot be read
        return _fail("summary", f"cannot read {e}")
    except OSError as e:  # --cntk DIR not writable, a file in the way, ...
        return _fail("summary", f"cannot write {e.filename or args.cntk}: {e.strerror or e}")
    finally:
        close = getattr(db, "close", None)
        if callable(close):
            close()
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            return _fail("summary", f"cannot write {args.output}: {e.strerror or e}")
    else:
        sys.stdout.write(text)
    return 0



def _loaded_twice(db: Any, paths: list[str]) -> str | None:
    """Why the loaded ``paths`` hold a process twice over, or None. A file given twice under
    two names (a copy), or a merged file beside one of its own rank files, has the same
    process (pid, track uuids) in both: the engines load both into one process, every step
    twice (twice the steps in the tables). ``Inputs.check_one_run`` knows ranks by file name
    only (rank<N>.summary.pftrace) and a copy is not the same path: here the loaded steps say
    it, a step of one thread at one instant counted twice."""
    conn = sharedbase.sqlite_conn(db)
    slices = PLACEHOLDERS if conn is not None and sharedbase.has_slice_base(conn) else None
    found = _base_rows(db, slices, summaries.Filters(), (
        "SELECT s.rank, p.pid, p.name FROM ss_step_all s JOIN process p ON p.upid = s.upid "
        "GROUP BY s.upid, s.utid, s.ts, s.step HAVING COUNT(*) > 1 LIMIT 1"))
    if not found:
        return None
    rank, pid, name = found[0]["rank"], found[0]["pid"], found[0]["name"]
    holders = [p for p in paths if _merge.holds_process(p, pid, name)]
    which = (f"{holders[0]} and {holders[1]} hold the same process (rank {rank}, pid {pid})"
             if len(holders) == 2 else
             f"the same process (rank {rank}, pid {pid}) is loaded twice from "
             f"{', '.join(holders if len(holders) > 2 else paths)}")
    return f"{which}: its steps would count twice; give each rank's file once"


def _base_rows(db: Any, slices: dict[str, str] | None, filters: summaries.Filters,
               sql: str) -> list[dict[str, Any]]:
    """The rows of ``sql`` after the summaries' base CTEs (``sql/_base.sql``) for ``filters``;
    ``slices``: the slice base's placeholders, where the engine has it."""
    base = ",\n".join(f"{n}{c} AS ({b})" for n, c, b in base_ctes(filters, slices))
    return summaries.run_sql(db, "filters", f"WITH RECURSIVE {base}\n{sql}")


def _check_filters(db: Any, args: argparse.Namespace, kw: dict[str, Any],
                   detail: list[str]) -> None:
    """SummaryError where a filter selects nothing in the loaded traces: a thread or rank they
    do not hold, a step range with no step in it. The tables came out empty ("No events to
    summarize", exit 0) or, as the thread filter keeps steps and device slices, all but blank,
    with no word that the filter named nothing (``--threads nosuch``, a typo). A thread may be
    in the ``detail`` windows only (loaded apart; read here only then)."""
    conn = sharedbase.sqlite_conn(db)
    slices = PLACEHOLDERS if conn is not None and sharedbase.has_slice_base(conn) else None

    def rows(sql: str, filters: summaries.Filters) -> list[dict[str, Any]]:
        return _base_rows(db, slices, filters, sql)

    if kw["threads"]:
        tids: set[int] = set()
        names: set[str] = set()

        def add_threads(d: Any) -> None:
            for r in summaries.run_sql(d, "filters", "SELECT DISTINCT tid, name FROM thread"):
                if r["tid"] is not None:
                    tids.add(r["tid"])
                if r["name"] is not None:
                    names.add(r["name"])

        def missing() -> list[str]:  # a number is a tid, else a name (as the filter reads it)
            return [t for t in kw["threads"] if not (int(t) in tids if t.isdigit()
                                                     else t in names)]

        add_threads(db)
        if missing() and detail:
            other = _open(detail, args)
            try:
                add_threads(other)
            finally:
                close = getattr(other, "close", None)
                if callable(close):
                    close()
        if missing():
            t = missing()[0]
            have = _few(sorted(names) if names else sorted(tids))
            what = "thread id" if t.isdigit() else "thread"
            raise summaries.SummaryError(f"--threads: no {what} {t!r} (threads: {have})")
    if kw["ranks"]:
        found = rows("SELECT DISTINCT rank FROM ss_track_sel WHERE upid >= 0",
                     summaries.Filters())
        have_ranks = sorted({r["rank"] for r in found if r["rank"] is not None})
        for r in kw["ranks"]:
            if r not in have_ranks:
                raise summaries.SummaryError(f"--ranks: no rank {r} (ranks: {_few(have_ranks)})")
    if kw["steps"]:
        ranks_only = summaries.Filters.make(ranks=kw["ranks"])
        (have,) = rows("SELECT MIN(step) AS lo, MAX(step) AS hi FROM ss_step_all", ranks_only)
        filters = summaries.Filters.make(ranks=kw["ranks"], steps=kw["steps"])
        (sel,) = rows("SELECT COUNT(*) AS n FROM ss_step", filters)
        if not sel["n"]:
            where = (f"the steps are {have['lo']} to {have['hi']}" if have["lo"] is not None
                     else "there are no steps")
            raise summaries.SummaryError(f"--steps {args.steps!r}: no step in that range "
                                         f"({where})")


def _few(values: list[Any], n: int = 8) -> str:
    """The first ``n`` of ``values`` and how many more."""
    more = f", ... ({len(values) - n} more)" if len(values) > n else ""
    return ", ".join(str(v) for v in values[:n]) + more if values else "none"


def _is_input(output: str, inputs: Any) -> bool:
    """Whether ``-o`` names a trace being read (the report would overwrite it)."""
    if not os.path.exists(output):  # a new file
        return False
    for f in (*inputs.whole, *inputs.detail, *inputs.left_out):
        with contextlib.suppress(OSError):  # a missing input is reported when it is read
            if os.path.samefile(output, f):
                return True
    return False


def _add_detail_tables(tables: dict[str, Any], detail: list[str], args: argparse.Namespace,
                       kw: dict[str, Any]) -> None:
    """The detail windows' part of the detail tables (``summaries.with_detail``), from the
    windows loaded into a database of their own (so their steps are not counted again)."""
    wanted = [n for n in summaries.DETAIL_TABLES if n in tables]
    if not wanted:
        return
    try:
        db = _open(detail, args)
    except TraceError:
        raise
    except Exception as e:
        raise TraceError(f"{', '.join(detail)}: {e}") from e
    try:
        extra = summaries.all_tables(db, names=wanted, sort=args.sort, **kw)
    finally:
        close = getattr(db, "close", None)
        if callable(close):
            close()
    merged = summaries.with_detail(tables, extra, len(detail))
    tables.clear()
    tables.update(merged)
