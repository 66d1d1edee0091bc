"""The summary tables: which SQL file each runs, its columns, running them, post-processing.

Every table is one file under ``sql/`` whose comments define its metrics; the SQL runs
unchanged on Perfetto's trace processor and on the embedded SQLite engine (``sqlfiles`` fills
it in). Python only computes what needs math functions (stddev, percentiles, straggler flags),
shares the base CTEs between tables (``shared_base``), runs tables on several connections and
hands the rows to ``format``. Any object with ``.query(sql)`` returning rows (dicts, row
objects, or a DataFrame) works as ``db``; so does a ``sqlite3.Connection``.

Usage::

    db = stepscope.analysis.open("run.pftrace")
    print(summaries.report(db, unit="ms"))
    summaries.table(db, "kernels", sort="total").to_dataframe()
"""

from __future__ import annotations

import contextlib
import math
import re
import sqlite3
import statistics
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import SummaryError
from .._threads import cpus
from ..sqlimage import file_of, open_file
from .format import (
    BOOL,
    BYTES,
    FLOAT,
    INT,
    MEASURE,
    RATIO,
    TEXT,
    TIME,
    Column,
    Table,
    render_many,
)
from .slicebase import (
    PLACEHOLDERS,
    SS_BASE_ROWS,
    SS_COLUMNS,
    SS_INDEX_KEYS,
    SS_NAME_INDEX_KEYS,
    SS_TABLE,
)
from .sqlfiles import Filters, base_ctes, render

__all__ = [
    "DEFAULT_TABLES",
    "DETAIL_TABLES",
    "TABLES",
    "all_tables",
    "check_name",
    "counter_unit",
    "has_column",
    "operator_values",
    "percentile",
    "query_rows",
    "render_report",
    "report",
    "run_sql",
    "shared_base",
    "table",
]


def _sqlite_conn(db: Any) -> sqlite3.Connection | None:
    if isinstance(db, sqlite3.Connection):
        return db
    conn = getattr(db, "conn", None)
    return conn if isinstance(conn, sqlite3.Connection) else None


_SHARED_BASE = "WITH RECURSIVE ss_shared AS (SELECT 1)"


@contextlib.contextmanager
def shared_base(db: Any, filters: Filters):
    """On an SQLite engine, compute the base CTEs once as TEMP tables for several tables.

    Yields the ``base`` to pass to render() (the table SQL then reads the temporary tables of
    the same names), or None where this does not apply (a name already taken, an engine that
    refuses): the tables are then computed from the CTEs, with the same results. On trace
    processor the same tables are made as SQLite tables through its queries (see
    _trace_processor_base): each table would otherwise compute the base again.
    """
    conn = _sqlite_conn(db)
    made: list[tuple[str, str]] = []  # (VIEW or TABLE, name)
    base = None
    if conn is None and getattr(db, "engine", None) == "trace_processor":
        base = _trace_processor_base(db, filters, made)
    elif conn is not None:
        try:
            has_base = _has_slice_base(conn)
            views = has_base and filters == Filters()
            for name, cols, body in base_ctes(filters, PLACEHOLDERS if has_base else None):
                if views and name in _BASE_VIEWS:
                    # unfiltered, ss_slice is the slice base itself and ss_device its device
                    # rows (read through its kind index): no copy on any connection
                    sql = (f"SELECT {', '.join(SS_COLUMNS)} FROM main.{SS_TABLE} "
                           f"WHERE {SS_BASE_ROWS}") if name == "ss_slice" else body
                    conn.execute(f"CREATE TEMP VIEW {name} AS {sql}")
                    made.append(("VIEW", name))
                    continue
                if re.search(rf"\b{name}\b", body):  # recursive
                    sql = f"WITH RECURSIVE {name}{cols} AS ({body}) SELECT * FROM {name}"
                else:
                    sql = body
                _create_temp(conn, name, sql, keyed=name in _KEYED_BASE)
                made.append(("TABLE", name))
                for i, cols in enumerate(_BASE_INDEXES.get(name, ())):
                    conn.execute(f"CREATE INDEX temp.{name}_ix{i} ON {name}({cols})")
            base = _SHARED_BASE
        except sqlite3.Error:
            _drop(conn, made)
            made, base = [], None
    try:
        yield base
    finally:
        if made:
            _drop(conn if conn is not None else db, made)


# Base CTEs that are views over the slice base when it exists and no filter is set
_BASE_VIEWS = frozenset({"ss_slice", "ss_device"})
# Base tables looked up by their ``id`` (slice.id: unique, never NULL) in the table queries:
# stored with ``id`` as the rowid, so those lookups need no index built per query.
_KEYED_BASE = frozenset({"ss_slice", "ss_device"})
# Indexes on base tables: the union window of the overview reads its rows in this order
# (no sort), and the tables that want a few kinds of slices read just those; the operators'
# statistics per name read theirs in (name, dur) order, as from the slice base: their REAL
# sums then add in the same order on every engine and filter (the same bits).
_BASE_INDEXES = {"ss_slice": (", ".join(SS_INDEX_KEYS), ", ".join(SS_NAME_INDEX_KEYS[:3]))}


def _create_temp(conn: sqlite3.Connection, name: str, sql: str, keyed: bool) -> None:
    """``CREATE TEMP TABLE name AS sql``; ``keyed``: the same columns and declared types, with
    ``id`` as INTEGER PRIMARY KEY (a repeated id fails: shared_base then falls back)."""
    if not keyed:
        conn.execute(f"CREATE TEMP TABLE {name} AS {sql}")
        return
    conn.execute(f"CREATE TEMP TABLE {name} AS SELECT * FROM ({sql}) LIMIT 0")
    info = conn.execute(f"PRAGMA temp.table_info({name})").fetchall()
    conn.execute(f"DROP TABLE temp.{name}")
    if "id" not in [c[1] for c in info]:
        raise sqlite3.OperationalError(f"{name} has no id column")
    cols = ", ".join(f'"{c[1]}" INTEGER PRIMARY KEY' if c[1] == "id" else f'"{c[1]}" {c[2]}'
                     for c in info)
    conn.execute(f"CREATE TEMP TABLE {name}({cols})")
    began = not conn.in_transaction
    try:
        conn.execute(f"INSERT INTO temp.{name} SELECT * FROM ({sql})")
        if began:  # the INSERT opened a transaction (sqlite3's default): end it, or the
            conn.commit()  # connection looks busy (_more_connections would not share it)
    except sqlite3.Error:
        if began:  # nor left open by a failed INSERT
            conn.rollback()
        _drop(conn, [("TABLE", name)])
        raise


def _trace_processor_base(db: Any, filters: Filters, made: list[tuple[str, str]]) -> str | None:
    """The base CTEs as temporary SQLite tables in trace processor (it runs plain SQLite
    statements too), keyed and indexed as on the embedded engine; None (and nothing left
    behind) when a statement is refused."""
    try:
        for name, cols, body in base_ctes(filters):
            if re.search(rf"\b{name}\b", body):  # recursive
                sql = f"WITH RECURSIVE {name}{cols} AS ({body}) SELECT * FROM {name}"
            else:
                sql = body
            if name in _KEYED_BASE:  # id as the rowid: the table queries look rows up by id
                names = db.query(f"SELECT * FROM ({sql}) LIMIT 0").columns
                decl = ", ".join('"id" INTEGER PRIMARY KEY' if c == "id" else f'"{c}"'
                                 for c in names)
                db.query(f"CREATE TEMP TABLE {name}({decl})")
                made.append(("TABLE", name))
                db.query(f"INSERT INTO temp.{name} SELECT * FROM ({sql})")
            else:
                db.query(f"CREATE TEMP TABLE {name} AS {sql}")
                made.append(("TABLE", name))
            for i, keys in enumerate(_BASE_INDEXES.get(name, ())):
                db.query(f"CREATE INDEX temp.{name}_ix{i} ON {name}({keys})")
        return _SHARED_BASE
    except Exception:  # an engine that refuses: the tables compute their CTEs
        _drop(db, made)
        made.clear()
        return None


def _has_slice_base(conn: sqlite3.Connection) -> bool:
    """Whether the importer wrote the unfiltered ss_slice (see slicebase) into ``conn``."""
    return conn.execute("SELECT 1 FROM main.sqlite_master WHERE type = 'table' AND name = ?",
                        (SS_TABLE,)).fetchone() is not None


def _drop(conn: Any, made: list[tuple[str, str]]) -> None:
    """Drop the (VIEW or TABLE, name) temporary objects, the last made first (``conn``: a
    sqlite3 connection, or an engine with ``query``)."""
    run = conn.execute if isinstance(conn, sqlite3.Connection) else conn.query
    for kind, name in reversed(made):
        try:
            run(f"DROP {kind} IF EXISTS temp.{name}")
        except Exception:  # pragma: no cover - a closed connection
            pass


# --- running queries --------------------------------------------------------------------------


def query_rows(db: Any, sql: str) -> list[dict[str, Any]]:
    """Rows of ``sql`` as dicts, whatever ``db.query`` returns (or a sqlite3 connection)."""
    if isinstance(db, sqlite3.Connection):
        cur = db.execute(sql)
        cols = [d[0] for d in cur.description or ()]
        return [dict(zip(cols, r, strict=True)) for r in cur]
    res = db.query(sql)
    if hasattr(res, "to_dict") and hasattr(res, "columns"):  # a pandas DataFrame
        return [{k: _py(v) for k, v in r.items()} for r in res.to_dict("records")]
    rows = getattr(res, "rows", res)
    if callable(rows):
        rows = rows()
    out = []
    for r in rows:
        if isinstance(r, dict):
            out.append(r)
        elif hasattr(r, "_asdict"):
            out.append(r._asdict())
        elif hasattr(r, "keys"):
            out.append({k: r[k] for k in r.keys()})
        else:  # perfetto's QueryResultIterator rows: attributes named after the columns
            out.append({k: v for k, v in vars(r).items() if not k.startswith("_")})
    return out


def _py(v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, float) and math.isnan(v):
        return None
    return v.item() if hasattr(v, "item") else v


def run_sql(db: Any, name: str, sql: str) -> list[dict[str, Any]]:
    """The rows of table ``name``'s ``sql``; engine errors become SummaryError (which names
    the table and keeps the cause)."""
    try:
        return query_rows(db, sql)
    except SummaryError:
        raise
    except Exception as e:  # engine errors: say which table failed, keep the cause
        raise SummaryError(f"summary {name!r} failed: {type(e).__name__}: {e}") from e


# --- tables -----------------------------------------------------------------------------------

C = Column
_TIME_STATS = [
    C("calls", "Calls", INT),
    C("total_ns", "Total", TIME),
    C("avg_ns", "Avg", TIME),
    C("max_ns", "Max", TIME),
    C("min_ns", "Min", TIME),
]


def _split_stats(p: str, label: str) -> tuple[Column, ...]:
    """Total/avg/max/min time and ratio of one side (``cpu``, ``gpu``) of a split table."""
    stats = ("total", "avg", "max", "min")
    times = [C(f"{p}_{s}_ns", f"{label} {s.capitalize()}", TIME) for s in stats]
    return (*times, C(f"{p}_ratio", f"{label} Ratio", RATIO))


@dataclass(frozen=True)
class _Spec:
    title: str
    sql: str
    columns: tuple[Column, ...]


_SPECS: dict[str, _Spec] = {
    "overview": _Spec(
        "Overview",
        "overview",
        (
            C("kind", "Event Type"),
            C("calls", "Calls", INT),
            C("total_ns", "Total", TIME),
            C("ratio", "Ratio", RATIO),
        ),
    ),
    "model": _Spec(
        "Model",
        "model",
        (
            C("phase", "Phase"),
            C("calls", "Calls", INT),
            *_split_stats("cpu", "CPU"),
            *_split_stats("gpu", "GPU"),
        ),
    ),
    "steps": _Spec(
        "Steps",
        "steps",
        (
            C("stat", "Stat"),
            C("batch_cost_ns", "Batch Cost", TIME),
            C("reader_cost_ns", "Reader Cost", TIME),
            C("reader_ratio", "Reader Ratio", RATIO),
            C("ips", "Steps/s", FLOAT),
            C("samples_per_s", "Samples/s", FLOAT),
        ),
    ),
    "step_times": _Spec(
        "Step Times",
        "steps",
        (
            C("rank", "Rank", INT),
            C("step", "Step", INT),
            C("batch_cost_ns", "Batch Cost", TIME),
            C("reader_cost_ns", "Reader Cost", TIME),
            C("reader_ratio", "Reader Ratio", RATIO),
            C("ips", "Steps/s", FLOAT),
            C("num_samples", "Samples", INT),
            C("samples_per_s", "Samples/s", FLOAT),
        ),
    ),
    "operators": _Spec(
        "Operators",
        "operators",
        (
            C("name", "Name"),
            *_TIME_STATS,
            C("stddev_ns", "StdDev", TIME),
            C("self_ns", "Self", TIME),
            C("ratio", "Ratio", RATIO),
            *_split_stats("gpu", "GPU"),
        ),
    ),
    "kernels": _Spec(
        "Kernels",
        "kernels",
        (
            C("name", "Name"),
            *_TIME_STATS,
            C("ratio", "Ratio", RATIO),
            C("blocks_per_sm", "Blocks/SM", FLOAT),
            C("occupancy", "Est. Occupancy", RATIO),
        ),
    ),
    "memcpy": _Spec(
        "Memory Copies",
        "memcpy",
        (
            C("kind", "Kind"),
            *_TIME_STATS,
            C("bytes", "Bytes", BYTES),
            C("bandwidth_gbps", "Bandwidth (GB/s)", FLOAT),
        ),
    ),
    "device": _Spec(
        "Device",
        "device",
        (
            C("rank", "Rank", INT),
            C("name", "Metric"),
            C("samples", "Samples", INT),
            C("mean", "Mean (time-weighted)", MEASURE),
            C("min", "Min", MEASURE),
            C("max", "Max", MEASURE),
        ),
    ),
    "distributed": _Spec(
        "Distributed",
        "distributed",
        (
            C("rank", "Rank", INT),
            C("steps", "Steps", INT),
            C("avg_step_ns", "Avg Step", TIME),
            C("frame_ns", "Step Total", TIME),
            C("computation_ns", "Computation", TIME),
            C("communication_ns", "Communication", TIME),
            C("overlap_ns", "Overlap", TIME),
            C("other_ns", "Other", TIME),
            C("vs_median", "vs Median", RATIO),
            C("straggler", "Straggler", BOOL),
        ),
    ),
}

#: Table names in report order.
TABLES: tuple[str, ...] = tuple(_SPECS)
#: The tables of a report when none are named: the per-step listing is left out.
DEFAULT_TABLES: tuple[str, ...] = tuple(n for n in TABLES if n != "step_times")
#: Tables of events the profiler records only in detail windows (user ranges, CUPTI activity):
#: a run's summary files leave them empty, its detail files fill them.
DETAIL_TABLES: tuple[str, ...] = ("operators", "kernels", "memcpy")

_OPERATOR_THREAD_COLS = (
    C("rank", "Rank", INT),
    C("tid", "Thread", INT),
    C("thread_name", "Thread Name", TEXT),
)


def has_column(name: str, key: str, *, by_thread: bool = False) -> bool:
    """Whether table ``name`` has a column ``key`` (key, key without ``_ns``, or header)."""
    cols = list(_SPECS[name].columns)
    if name == "operators" and by_thread:
        cols += _OPERATOR_THREAD_COLS
    return Table(name, "", cols, []).column(key) is not None


def table(
    db: Any,
    name: str,
    *,
    threads: Iterable[int | str] | None = None,
    ranks: Iterable[int] | None = None,
    steps: str | tuple[int | None, int | None] | None = None,
    sort: str | None = None,
    by_thread: bool = False,
    straggler_margin: float = 0.10,
) -> Table:
    """Compute one summary table (``name`` in :data:`TABLES`).

    ``by_thread`` splits the operators table per rank and thread (else threads are merged).
    ``straggler_margin``: a rank is a straggler when its mean step time exceeds the median of the
    ranks' mean step times by more than this fraction.
    """
    check_name(name)
    filters = Filters.make(threads, ranks, steps)
    return _table(db, name, filters, None, sort, by_thread, straggler_margin, {})


def check_name(name: str) -> None:
    """SummaryError for a name that is not a table (before a trace is loaded, say)."""
    if name not in _SPECS:
        raise SummaryError(f"unknown table {name!r}: choose from {', '.join(TABLES)}")


def operator_values(by_thread: bool) -> dict[str, str]:
    """The placeholders of ``operators.sql``: per rank and thread, or threads merged (rows
    grouped by name alone, no process or thread row read per range)."""
    keys = ("COALESCE(p.rank, s.upid)", "th.tid", "th.name") if by_thread else ("NULL",) * 3
    return {
        "op_rank": keys[0],
        "op_tid": keys[1],
        "op_thread": keys[2],
        "op_group": "per rank and thread" if by_thread else "threads merged",
        "op_join": ("LEFT JOIN ss_process p ON p.upid = s.upid "
                    "LEFT JOIN thread th ON th.utid = s.utid") if by_thread else "",
        "op_keys": "name, rank, tid, thread_name" if by_thread else "name",
    }


def _table(
    db: Any,
    name: str,
    filters: Filters,
    base: str | None,
    sort: str | None,
    by_thread: bool,
    straggler_margin: float,
    cache: dict[str, list[dict]],
) -> Table:
    spec = _SPECS[name]
    columns = list(spec.columns)
    extra: dict[str, str] = {}
    if spec.sql == "operators":
        extra = operator_values(by_thread)
        if by_thread:
            columns[1:1] = _OPERATOR_THREAD_COLS
    sql = render(spec.sql, filters, base=base, **extra)
    if sql not in cache:  # steps and step_times share one query; their post-processors copy
        cache[sql] = run_sql(db, name, sql)
    rows = cache[sql]
    notes: list[str] = []
    post = _POST.get(name)
    if post is not None:
        rows, notes = post(rows, straggler_margin=straggler_margin)
    t = Table(name, spec.title, columns, rows, notes)
    return t.sorted(sort) if sort else t


def all_tables(
    db: Any,
    *,
    names: Sequence[str] | None = None,
    sort: str | None = None,
    threads: Iterable[int | str] | None = None,
    ranks: Iterable[int] | None = None,
    steps: str | tuple[int | None, int | None] | None = None,
    by_thread: bool = False,
    straggler_margin: float = 0.10,
    workers: int | None = None,
) -> dict[str, Table]:
    """Every table (or ``names``), keyed by name, in report order; empty tables included.

    ``sort`` applies to the tables that have that column. Other keyword arguments as
    :func:`table`. ``workers``: how many tables are computed at once (default: one per CPU, at
    most 4), each on its own connection; above 1 this needs a database in a file (the
    embedded engine's default) and no filter, else the tables are computed one after the
    other.
    """
    wanted = list(names) if names else list(TABLES)
    for n in wanted:
        check_name(n)
    filters = Filters.make(threads, ranks, steps)
    jobs = _jobs(wanted)
    n_workers = min(len(jobs), cpus() if workers is None else max(1, workers))
    if filters != Filters():  # each connection would build its own filtered copy of every
        n_workers = 1  # slice (time and memory times the workers, for little gain)
    done: dict[str, Table] = {}

    def run(conn: Any, take: Callable[[], list[str] | None]) -> None:
        cache: dict[str, list[dict]] = {}
        with shared_base(conn, filters) as base:
            while (job := take()) is not None:
                for n in job:
                    done[n] = _table(conn, n, filters, base, None, by_thread, straggler_margin,
                                     cache)

    _run_jobs(db, jobs, n_workers, run)
    out: dict[str, Table] = {}
    for n in wanted:
        t = done[n]
        out[n] = t.sorted(sort) if sort and t.column(sort) is not None else t
    return out


# Report tables by their expected cost on a big trace, the heaviest first: with several
# workers each takes the next one when it is free, so the long ones start at once.
_COST_ORDER = ("overview", "operators", "model", "steps", "step_times", "distributed",
               "device", "kernels", "memcpy")


def _jobs(names: list[str]) -> list[list[str]]:
    """``names`` grouped by the query they read (steps and step_times share one), heaviest
    first."""
    groups: dict[str, list[str]] = {}
    for n in sorted(dict.fromkeys(names), key=_COST_ORDER.index):
        groups.setdefault(_SPECS[n].sql, []).append(n)
    return list(groups.values())


def _run_jobs(db: Any, jobs: list[list[str]], n_workers: int,
              run: Callable[[Any, Callable[[], list[str] | None]], None]) -> None:
    """``run(conn, take)`` on ``db`` in this thread and on new connections to the same
    database in ``n_workers - 1`` more threads (as many as can be opened; SQLite releases the
    GIL while it runs a query), all taking jobs from one list until it is empty.

    The first error stops the others at once (their queries are interrupted, this thread's
    too) and is raised here.
    """
    pending = list(jobs)
    lock = threading.Lock()
    errors: list[BaseException] = []
    others = _more_connections(db, n_workers - 1)
    running = [c for c in (_sqlite_conn(db), *others) if c is not None] if others else []

    def take() -> list[str] | None:
        with lock:
            return pending.pop(0) if pending and not errors else None

    def work(conn: Any) -> None:
        try:
            run(conn, take)
        except BaseException as e:  # handed to the calling thread
            with lock:
                errors.append(e)
            for c in running:
                c.interrupt()

    threads = [threading.Thread(target=work, args=(c,), daemon=True) for c in others]
    try:
        for th in threads:
            th.start()
        work(db)
    finally:
        for th in threads:
            th.join()
        for c in others:
            c.close()
    if errors:
        raise errors[0]


def _more_connections(db: Any, n: int) -> list[sqlite3.Connection]:
    """Up to ``n`` new read-only connections to the file database of ``db`` (none for other
    engines, an in-memory database, or one with uncommitted changes they would not see)."""
    conn = _sqlite_conn(db)
    if n < 1 or conn is None or conn.in_transaction:
        return []
    path = file_of(conn)
    if path is None:
        return []
    out: list[sqlite3.Connection] = []
    with contextlib.suppress(sqlite3.Error):
        while len(out) < n:
            out.append(open_file(path, reader=True))
    return out


def report(
    db: Any,
    *,
    unit: str = "ms",
    fmt: str = "text",
    names: Sequence[str] | None = None,
    name_width: int | None = None,
    **kwargs: Any,
) -> str:
    """All non-empty tables rendered one after the other (``fmt``: text, csv, json, md).

    The per-step listing (``step_times``) is left out unless named. ``name_width``: text and
    markdown cut names longer than this in the middle (None: as needed to keep each text table
    within 200 columns; 0: never); CSV and JSON hold them in full.
    """
    tables = all_tables(db, names=names or DEFAULT_TABLES, **kwargs)
    return render_report(tables.values(), fmt=fmt, unit=unit, name_width=name_width)


def render_report(
    tables: Iterable[Table], *, fmt: str = "text", unit: str = "ms", name_width: int | None = None
) -> str:
    """The non-empty ``tables`` rendered one after the other, as :func:`report` does."""
    shown = [t for t in tables if t]
    if not shown:
        return "No events to summarize.\n" if fmt == "text" else render_many([], fmt, unit)
    return render_many(shown, fmt, unit, name_width)


# --- post-processing in Python ----------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default): x[(n-1)·q]."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _per_step(rows: list[dict], **_: Any) -> tuple[list[dict], list[str]]:
    """Adds reader_ratio = reader/batch, ips = 1 / batch (s), samples_per_s = samples / batch."""
    out = []
    for r in rows:
        b = r["batch_cost_ns"]
        r = dict(r)
        r["reader_ratio"] = r["reader_cost_ns"] / b if b else None
        r["ips"] = 1e9 / b if b else None
        n = r.get("num_samples")
        r["samples_per_s"] = n * 1e9 / b if (b and n is not None) else None
        out.append(r)
    return out, []


def _step_stats(rows: list[dict], **kw: Any) -> tuple[list[dict], list[str]]:
    """avg/min/max/p50/p90 over steps.

    avg of batch and reader cost = arithmetic mean; avg reader ratio = Σ reader / Σ batch;
    avg steps/s = steps / Σ batch seconds; avg samples/s = Σ samples / Σ batch seconds (steps
    with a known batch size). min/max/p50/p90: over the per-step values.
    """
    steps, _ = _per_step(rows)
    if not steps:
        return [], []
    batch = [s["batch_cost_ns"] for s in steps]
    total_b = sum(batch)
    sampled = [s for s in steps if s["num_samples"] is not None and s["batch_cost_ns"]]
    avg = {
        "batch_cost_ns": total_b / len(steps),
        "reader_cost_ns": sum(s["reader_cost_ns"] for s in steps) / len(steps),
        "reader_ratio": (sum(s["reader_cost_ns"] for s in steps) / total_b) if total_b else None,
        "ips": len(steps) * 1e9 / total_b if total_b else None,
        "samples_per_s": (
            sum(s["num_samples"] for s in sampled) * 1e9 / sum(s["batch_cost_ns"] for s in sampled)
            if sampled
            else None
        ),
    }
    keys = list(avg)
    table_rows = [{"stat": "avg", **avg}]
    for stat, fn in (
        ("min", min),
        ("max", max),
        ("p50", lambda v: percentile(v, 0.5)),
        ("p90", lambda v: percentile(v, 0.9)),
    ):
        row: dict[str, Any] = {"stat": stat}
        for k in keys:
            vals = [s[k] for s in steps if s[k] is not None]
            row[k] = fn(vals) if vals else None
        table_rows.append(row)
    ranks = {s["rank"] for s in steps}
    note = f"{len(steps)} steps" + (f" on {len(ranks)} ranks" if len(ranks) > 1 else "")
    return table_rows, [note]


_GPU_KEYS = tuple(f"gpu_{s}" for s in ("total_ns", "avg_ns", "max_ns", "min_ns", "ratio"))


def _no_gpu(rows: list[dict], keys: Sequence[str] = _GPU_KEYS) -> list[dict]:
    """GPU values become None (shown "-", the columns left out of text) when the trace has no
    device time at all: gpu_ratio's denominator, the device slices' union, is then 0 (NULL)."""
    if any(r.get("gpu_ratio") is not None for r in rows):
        return rows
    return [{**r, **dict.fromkeys(keys)} for r in rows]


def _model(rows: list[dict], **_: Any) -> tuple[list[dict], list[str]]:
    return _no_gpu(rows), []


def _device(rows: list[dict], **_: Any) -> tuple[list[dict], list[str]]:
    """Each row gets the ``unit`` of its values (bytes, bytes/s: shown in binary units)."""
    out = [{**r, "unit": counter_unit(r.get("name") or "")} for r in rows]
    note = ("Mean (time-weighted): each sample holds until the next one of its counter, the "
            "last until the end of its rank's run (its last step's end; its last slice's without "
            "steps); a sample after that end holds nothing")
    return out, [note] if any(r.get("samples") is not None for r in rows) else []


_BYTE_COUNTERS = re.compile(
    r"^(host\.process\.rss|host\.memory\.used|nvml\.gpu\d+\.memory\.used"
    r"|cupy\.gpu\d+\.pool\.(used|total))$|(^|[ .])bytes$"
)


def counter_unit(name: str) -> str | None:
    """The unit of a counter written by stepscope, from its name (see ``_schema``): "bytes",
    "bytes/s", or None (the number as it is, e.g. "%" or "1/s", which the names say)."""
    if name.endswith("bytes/s"):
        return "bytes/s"
    return "bytes" if _BYTE_COUNTERS.search(name) else None


_SQ_PARTS = ("sq_hh", "sq_hl", "sq_aa", "sq_ab", "sq_bb")  # see operators.sql


def _operators(rows: list[dict], **_: Any) -> tuple[list[dict], list[str]]:
    """stddev = sqrt(calls * sum(d^2) - sum(d)^2) / calls, the population standard deviation,
    with the difference computed exactly in integers from the SQL's sum of durations and the
    integer parts of the sum of their squares (sq_hh..sq_bb, see operators.sql): no cancellation,
    and the same value whatever engine summed the rows, in whatever order."""
    out = []
    for r in rows:
        r = dict(r)
        parts = [r.pop(k, None) for k in _SQ_PARTS]
        n, total = r.get("calls") or 0, r.get("total_ns")
        if n and total is not None and None not in parts:
            hh, hl, aa, ab, bb = (int(p) for p in parts)
            sumsq = (hh << 64) + (hl << 33) + (aa << 32) + (ab << 17) + bb
            var_n2 = max(n * sumsq - int(total) ** 2, 0)  # variance * n^2, exact
            r["stddev_ns"] = math.sqrt(var_n2) / n
        else:
            r["stddev_ns"] = None
        out.append(r)
    return _no_gpu(out), []


def _distributed(rows: list[dict], straggler_margin: float = 0.10, **_: Any):
    """vs_median = mean step / median of the ranks' mean steps - 1; straggler when > margin.

    Without any device time (no kernel, copy or set on any rank) computation, communication,
    overlap and other are None: the split needs GPU data."""
    keys = ("computation_ns", "communication_ns", "overlap_ns", "other_ns")
    if not any(r.get(k) for r in rows for k in keys[:3]):
        rows = [{**r, **dict.fromkeys(keys)} for r in rows]
    means = [r["avg_step_ns"] for r in rows if r.get("avg_step_ns") is not None]
    med = statistics.median(means) if means else None
    out = []
    for r in rows:
        r = dict(r)
        a = r.get("avg_step_ns")
        r["vs_median"] = (a / med - 1.0) if (a is not None and med) else None
        r["straggler"] = bool(r["vs_median"] is not None and r["vs_median"] > straggler_margin)
        out.append(r)
    notes = []
    if med is not None:
        slow = [str(r["rank"]) for r in out if r["straggler"]]
        notes.append(
            f"stragglers (mean step > median by more than {straggler_margin:.0%}): "
            + (", ".join(slow) if slow else "none")
        )
    return out, notes


_POST = {
    "steps": _step_stats,
    "step_times": _per_step,
    "model": _model,
    "operators": _operators,
    "device": _device,
    "distributed": _distributed,
}
