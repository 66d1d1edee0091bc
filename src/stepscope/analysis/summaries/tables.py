"""The summary tables: which SQL file each runs, its columns, running them, the report.

Every table is one file under ``sql/`` whose comments define its metrics; the SQL runs
unchanged on Perfetto's trace processor and on the embedded SQLite engine (``sqlfiles`` fills
it in). Here: each table's spec (SQL file, title, columns), running the tables (the base CTEs
shared through ``sharedbase``, several tables at once on their own connections), the Python
step of ``post`` and the rendering of ``format``. Any object with ``.query(sql)`` returning
rows (dicts, row objects, or a DataFrame) works as ``db``; so does a ``sqlite3.Connection``.

Usage::

    db = stepscope.analysis.open("run.pftrace")
    print(summaries.report(db, unit="ms"))
    summaries.table(db, "kernels", sort="total").to_dataframe()
"""

from __future__ import annotations

import contextlib
import math
import sqlite3
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
    BYTES_PER_S,
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
from .post import POST
from .sharedbase import shared_base, sqlite_conn
from .sqlfiles import Filters, render

__all__ = [
    "DEFAULT_TABLES",
    "DETAIL_TABLES",
    "with_detail",
    "TABLES",
    "all_tables",
    "check_name",
    "has_column",
    "operator_values",
    "query_rows",
    "render_report",
    "report",
    "run_sql",
    "table",
]


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
            C("outside_ns", "Outside Steps", TIME),
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
    "collectives": _Spec(
        "Collectives",
        "collectives",
        (
            C("name", "Op"),
            C("calls", "Calls", INT),
            C("bytes", "Bytes", BYTES),
            C("timed", "Timed", INT),
            C("waited", "Waited", INT),
            *_TIME_STATS[1:],
            C("bytes_per_s", "Bandwidth", BYTES_PER_S),
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
            C("work_vs_median", "Work vs Median", RATIO),
            C("straggler", "Straggler", BOOL),
        ),
    ),
}

#: Table names in report order.
TABLES: tuple[str, ...] = tuple(_SPECS)
#: The tables of a report when none are named: the per-step listing is left out.
DEFAULT_TABLES: tuple[str, ...] = tuple(n for n in TABLES if n != "step_times")
#: Tables of events the profiler records only in detail windows (user ranges, CUPTI activity):
#: a run's summary files leave them empty, its detail files fill them; the device table's GPU
#: busy rows, made from CUPTI's kernels; and the tables whose GPU columns only the windows'
#: CUPTI activity fills (the model's GPU time per phase, the distributed split into
#: computation, communication and overlap).
DETAIL_TABLES: tuple[str, ...] = ("operators", "kernels", "memcpy", "device", "model",
                                  "distributed")
# those of the second kind, and the column of theirs that only device activity fills
_GPU_SPLIT = {"model": "gpu_total_ns", "distributed": "computation_ns"}

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
    ``straggler_margin``: a rank is a straggler when its mean step time, or its mean step's
    work (time outside communication), exceeds the median of the ranks' by more than this
    fraction.
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
    post = POST.get(name)
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
               "device", "kernels", "memcpy", "collectives")


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
    running = [c for c in (sqlite_conn(db), *others) if c is not None] if others else []

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
    conn = sqlite_conn(db)
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
    detail_db: Any = None,
    detail_files: int = 0,
    **kwargs: Any,
) -> str:
    """All non-empty tables rendered one after the other (``fmt``: text, csv, json, md).

    The per-step listing (``step_times``) is left out unless named. ``name_width``: text and
    markdown cut names longer than this in the middle (None: as needed to keep each text table
    within 200 columns; 0: never); CSV and JSON hold them in full. ``detail_db``: the run's
    ``detail_files`` detail windows, for the detail tables (:func:`with_detail`).
    """
    tables = all_tables(db, names=names or DEFAULT_TABLES, **kwargs)
    if detail_db is not None:
        wanted = [n for n in DETAIL_TABLES if n in tables]
        tables = with_detail(tables, all_tables(detail_db, names=wanted, **kwargs), detail_files)
    return render_report(tables.values(), fmt=fmt, unit=unit, name_width=name_width)


def with_detail(tables: dict[str, Table], detail: dict[str, Table],
                files: int) -> dict[str, Table]:
    """Whole-run ``tables`` with the detail tables (:data:`DETAIL_TABLES`) of a run's ``files``
    detail windows, computed apart (``detail``: their steps are not counted again).

    A table the whole-run files left empty is replaced by the windows' one. A table they did
    fill (summary-level ranges: the user's, torch's ``record_function`` ones) keeps its
    whole-run rows, and the windows' table follows it as ``<name>_detail`` when the windows
    hold names it lacks (detail-level ranges, torch's operators): else a run with
    ``record_function`` ranges would never show its operators (nor a GPU run the GPU busy rows
    of its device table). The model and distributed
    tables follow so when the windows have the GPU time that the whole run lacks (device
    activity is recorded in windows only): else a GPU run would never show its phases' GPU
    time or its ranks' computation/communication split. Either way titled "(detail
    windows)"."""
    note = (f"from {files} detail window file(s); the other tables cover the whole run "
            "(the summary files)")
    out: dict[str, Table] = {}
    for n, whole in tables.items():
        out[n] = whole
        t = detail.get(n)
        if not t:
            continue
        gpu = _GPU_SPLIT.get(n)
        if gpu is not None:
            if (any(r.get(gpu) is not None for r in whole.rows)
                    or all(r.get(gpu) is None for r in t.rows)):
                continue  # the whole run has GPU time, or the windows have none either
        elif whole and {r.get("name") for r in t.rows} <= {r.get("name") for r in whole.rows}:
            continue  # nothing the whole-run table does not show
        t.title += " (detail windows)"
        t.notes.append(note)
        if whole:
            t.name = f"{n}_detail"
            out[t.name] = t
        else:
            out[n] = t
    return out


def render_report(
    tables: Iterable[Table], *, fmt: str = "text", unit: str = "ms", name_width: int | None = None
) -> str:
    """The non-empty ``tables`` rendered one after the other, as :func:`report` does."""
    shown = [t for t in tables if t]
    if not shown:
        return "No events to summarize.\n" if fmt == "text" else render_many([], fmt, unit)
    return render_many(shown, fmt, unit, name_width)
