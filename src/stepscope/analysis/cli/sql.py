"""``stepscope sql PATH... "SELECT ..."`` and ``stepscope export-csv PATH...``.

The lead's ``stepscope/cli.py`` calls :func:`add_parsers` with its subparsers; each parser sets
``func`` to a handler that returns the exit status (0 ok, 1 query failed, 2 bad input or an
unreadable trace). Loading a large trace prints its progress on stderr.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sqlite3
import sys
from typing import Any

from .. import engines
from .._errors import EngineError, TraceError
from .common import add_engine_args, open_traces
from .common import fail as _fail

_FORMATS = ("text", "csv", "json")
EXPORT_TABLES = ("slice", "counter", "args", "flow", "track", "thread_track", "process_track",
                 "counter_track", "thread", "process")


def add_parsers(subparsers: Any) -> None:
    """Add the ``sql`` and ``export-csv`` subcommands to an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "sql", help="run an SQL query on traces",
        description="Run a query (PerfettoSQL / SQLite syntax) over trace processor's tables "
        "(slice, track, thread, process, counter, args, flow, ...). Several traces are loaded "
        "into one database.")
    p.add_argument("args", nargs="+", metavar="PATH... QUERY",
                   help="trace file(s) then the query (or give the query with -f)")
    p.add_argument("-f", "--file", metavar="SQL_FILE", help="read the query from this file")
    p.add_argument("--format", choices=_FORMATS, default="text")
    add_engine_args(p)
    p.set_defaults(func=run_sql, trailing="args")
    e = subparsers.add_parser(
        "export-csv", help="write the trace's tables as CSV files",
        description="Write trace processor's tables (slice, counter, args, flow, tracks, "
        "threads, processes) as one CSV file each.")
    e.add_argument("paths", nargs="+", metavar="PATH", help="trace file(s)")
    e.add_argument("-o", "--output", metavar="DIR",
                   help="directory for the CSV files (default: <first trace>_csv)")
    e.add_argument("--tables", metavar="T[,T]",
                   help="tables to write (default: " + ",".join(EXPORT_TABLES) + ")")
    add_engine_args(e)
    e.set_defaults(func=run_export_csv, trailing="paths")
    g = subparsers.add_parser(
        "get-trace-processor", help="download Perfetto's trace_processor_shell",
        description="Download the trace_processor_shell pinned by the perfetto package into its "
        "cache (~/.local/share/perfetto/prebuilts), where --engine auto finds it; prints its "
        "path. Nothing else in stepscope downloads it, but --engine trace_processor.")
    g.add_argument("--timeout", type=float, metavar="SECONDS",
                   help=f"give up after this long (default: ${engines.ENV_TIMEOUT} or "
                   f"{engines.DOWNLOAD_TIMEOUT_S:g})")
    g.set_defaults(func=run_get_trace_processor)


def run_sql(args: argparse.Namespace) -> int:
    if args.file:
        paths = list(args.args)
        try:
            with open(args.file, encoding="utf-8") as f:
                query = f.read()
        except OSError as e:
            return _fail("sql", f"cannot read {args.file}: {e.strerror or e}")
    else:
        if len(args.args) < 2:
            return _fail("sql", "give trace file(s) and then the query (or -f SQL_FILE)")
        paths, query = list(args.args[:-1]), args.args[-1]
    if not query.strip():
        return _fail("sql", "empty query")
    try:
        db = open_traces(paths, args)
    except (TraceError, EngineError, ValueError) as e:
        return _fail("sql", str(e))
    try:
        rows = db.query(query)
    except engines.QueryError as e:
        return _fail("sql", str(e), 1)
    finally:
        db.close()
    write_rows(rows, rows.columns, args.format, sys.stdout)
    return 0


def write_rows(rows: list, columns: list[str], fmt: str, out) -> None:
    """Rows (sequences of values in ``columns`` order, or dicts) as text, csv or json. JSON
    objects need distinct keys: a repeated column name gets ``:2``, ``:3``... there."""
    rows = [[r[c] for c in columns] if isinstance(r, dict) else list(r) for r in rows]
    if fmt == "json":
        keys = _distinct(columns)
        json.dump([dict(zip(keys, r, strict=True)) for r in rows], out, indent=1, default=str)
        out.write("\n")
    elif fmt == "csv":
        w = csv.writer(out, lineterminator="\n")
        w.writerow(columns)
        w.writerows(rows)
    else:
        cells = [[_text(v) for v in r] for r in rows]
        heads = [_escape(c) for c in columns]
        widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(heads)]
        out.write("  ".join(c.ljust(w) for c, w in zip(heads, widths, strict=True)).rstrip()
                  + "\n")
        out.write("  ".join("-" * w for w in widths) + "\n")
        for row in cells:
            out.write("  ".join(v.rjust(w) if _numeric(v) else v.ljust(w)
                                for v, w in zip(row, widths, strict=True)).rstrip() + "\n")
        out.write(f"({len(rows)} row{'s' if len(rows) != 1 else ''})\n")


def _distinct(columns: list[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for c in columns:
        k, n = c, 1
        while k in seen:
            n += 1
            k = f"{c}:{n}"
        seen.add(k)
        out.append(k)
    return out


def _text(v: Any) -> str:
    """A cell of the text table: a float as its shortest round-trip repr (``.6g`` printed
    1234567.891 as 1.23457e+06; trace processor's shell prints ``%f``, which loses small
    values), control characters in text escaped (a raw NUL or newline broke the table)."""
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return repr(float(v))  # (a numpy float's repr names its type)
    return _escape(str(v))


# C0 and C1 controls, DEL, and the Unicode line and paragraph separators
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(s: str) -> str:
    """``s`` with control characters as Python writes them (``\\x00``, ``\\n``, ``\\u2028``)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), s)


def _numeric(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def run_get_trace_processor(args: argparse.Namespace) -> int:
    if args.timeout is not None and not 0 < args.timeout < 1e6:
        return _fail("get-trace-processor", f"--timeout {args.timeout:g}: give seconds > 0")
    try:
        path = engines.find_trace_processor() or engines.download_trace_processor(args.timeout)
    except EngineError as e:
        return _fail("get-trace-processor", str(e))
    print(path)
    return 0


def run_export_csv(args: argparse.Namespace) -> int:
    tables = EXPORT_TABLES
    if args.tables:
        tables = tuple(t.strip() for t in args.tables.split(",") if t.strip())
        bad = [t for t in tables if t not in EXPORT_TABLES]
        if bad:
            return _fail("export-csv", f"unknown table {bad[0]!r}: choose from "
                         + ", ".join(EXPORT_TABLES))
    # beside the first path (a run directory given as "RUN/" too: not RUN/_csv inside it)
    out_dir = args.output or os.path.splitext(os.path.normpath(args.paths[0]))[0] + "_csv"
    try:
        db = open_traces(list(args.paths), args)
    except (TraceError, EngineError, ValueError) as e:
        return _fail("export-csv", str(e))
    try:
        os.makedirs(out_dir, exist_ok=True)
        for t in tables:
            path = os.path.join(out_dir, f"{t}.csv")
            n = export_table(db, t, path)
            print(f"{path}: {n} rows", file=sys.stderr)
    except OSError as e:
        return _fail("export-csv", f"cannot write {out_dir}: {e.strerror or e}")
    except engines.QueryError as e:  # its message says "query failed: ..." already
        return _fail("export-csv", str(e), 1)
    except sqlite3.Error as e:  # streamed from the embedded engine's connection
        return _fail("export-csv", f"query failed: {e}", 1)
    finally:
        db.close()
    return 0


def export_table(db: Any, table: str, path: str) -> int:
    """Write one table as CSV (streamed from SQLite on the embedded engine); returns rows."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        conn = getattr(db, "conn", None)
        if conn is not None:
            cur = conn.execute(f"SELECT * FROM {table}")
            w.writerow([d[0] for d in cur.description])
            n = 0
            while batch := cur.fetchmany(65536):
                w.writerows(batch)
                n += len(batch)
            return n
        rows = db.query(f"SELECT * FROM {table}")
        w.writerow(rows.columns)
        w.writerows(list(r) for r in rows)
        return len(rows)
