"""``stepscope summary PATH...``: the summary tables of one or more traces on the command line.

The lead's ``stepscope/cli.py`` calls :func:`add_parsers` with its subparsers; the parser sets
``func`` to :func:`run`, which returns the exit status (0 ok, 2 bad input or unreadable trace).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import summaries
from ._cli import add_engine_args
from ._cli import fail as _fail
from ._cli import open_traces as _open  # a module global: the tests replace it
from ._errors import TraceError
from ._format import UNITS

_FORMATS = ("text", "csv", "json", "md")


def add_parsers(subparsers: Any) -> None:
    """Add the ``summary`` subcommand to an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "summary",
        help="print summary tables of traces",
        description="Summary tables (overview, model, steps, operators, kernels, memory "
        "copies, device, distributed) computed with SQL on the trace.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="trace file(s) written by stepscope")
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
    p.add_argument("--threads", metavar="T[,T]", help="thread ids or names to keep")
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
    p.set_defaults(func=run)


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
    """Handler of ``stepscope summary``: all PATHs are loaded into one database (one rank per
    file, typically), so the distributed table compares them."""
    try:
        names, kw = _options(args)
    except summaries.SummaryError as e:
        return _fail("summary", str(e))
    shown = ", ".join(args.paths)
    try:
        db = _open(list(args.paths), args)
    except TraceError as e:  # "PATH: what is wrong" (missing, a directory, corrupt)
        return _fail("summary", f"cannot read {e}")
    except Exception as e:  # the engines' own messages say what is wrong with the file
        return _fail("summary", f"cannot read {shown}: {e}")
    try:
        text = summaries.report(
            db, unit=args.unit, fmt=args.format, names=names, sort=args.sort,
            name_width=args.name_width, **kw
        )
        if args.cntk:
            from .cntk import write_cntk

            kw_f = {k: kw[k] for k in ("threads", "ranks", "steps")}
            for p in write_cntk(db, args.cntk, **kw_f):
                print(f"wrote {p}", file=sys.stderr)
    except summaries.SummaryError as e:
        return _fail("summary", f"{shown}: {e}")
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

