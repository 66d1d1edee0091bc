"""The base CTEs of ``sql/_base.sql`` computed once for several summary tables.

On an SQLite engine they become TEMP tables (or, unfiltered on the embedded engine, views over
the slice base) that the tables' SQL reads by the CTEs' names; on trace processor the same
tables are made through its queries. Where that does not apply, each table computes the CTEs
itself, with the same results.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from typing import Any

from .slicebase import (
    PLACEHOLDERS,
    SS_BASE_ROWS,
    SS_COLUMNS,
    SS_INDEX_KEYS,
    SS_NAME_INDEX_KEYS,
    SS_TABLE,
)
from .sqlfiles import Filters, base_ctes


def sqlite_conn(db: Any) -> sqlite3.Connection | None:
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
    conn = sqlite_conn(db)
    made: list[tuple[str, str]] = []  # (VIEW or TABLE, name)
    base = None
    if conn is None and getattr(db, "engine", None) == "trace_processor":
        base = _trace_processor_base(db, filters, made)
    elif conn is not None:
        try:
            has_base = has_slice_base(conn)
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
                _create_temp(conn, name, sql, _KEYED_BASE.get(name))
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
# Base tables stored with a key column as the rowid (unique, never NULL): the table queries
# look slices up by ``id`` (slice.id) with no index built per query, and the overview's window
# reads the regions in ``id`` order, which SQLite then knows needs no sort.
_KEYED_BASE = {"ss_slice": "id", "ss_device": "id", "ss_frame_region": "id"}
# Indexes on base tables: the union window of the overview reads its rows in this order
# (no sort), and the tables that want a few kinds of slices read just those; the operators'
# statistics per name read theirs in (name, dur) order, as from the slice base: their REAL
# sums then add in the same order on every engine and filter (the same bits). The overview
# reads the regions of a rank in (upid, id) order and looks one up by (upid, f0).
_BASE_INDEXES = {"ss_slice": (", ".join(SS_INDEX_KEYS), ", ".join(SS_NAME_INDEX_KEYS[:3])),
                 "ss_frame_region": ("upid, id", "upid, f0")}


def _create_temp(conn: sqlite3.Connection, name: str, sql: str, key: str | None) -> None:
    """``CREATE TEMP TABLE name AS sql``; with a ``key``: the same columns and declared types,
    with that column as INTEGER PRIMARY KEY (a repeated key fails: shared_base then falls
    back)."""
    if key is None:
        conn.execute(f"CREATE TEMP TABLE {name} AS {sql}")
        return
    conn.execute(f"CREATE TEMP TABLE {name} AS SELECT * FROM ({sql}) LIMIT 0")
    try:
        info = conn.execute(f"PRAGMA temp.table_info({name})").fetchall()
        conn.execute(f"DROP TABLE temp.{name}")
    except sqlite3.Error:  # (interrupted by another thread's failure: the empty copy stayed)
        _drop(conn, [("TABLE", name)])
        raise
    if key not in [c[1] for c in info]:
        raise sqlite3.OperationalError(f"{name} has no {key} column")
    cols = ", ".join(f'"{c[1]}" INTEGER PRIMARY KEY' if c[1] == key else f'"{c[1]}" {c[2]}'
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
            key = _KEYED_BASE.get(name)
            if key is not None:  # the key as the rowid, as on the embedded engine
                names = db.query(f"SELECT * FROM ({sql}) LIMIT 0").columns
                decl = ", ".join(f'"{c}" INTEGER PRIMARY KEY' if c == key else f'"{c}"'
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


def has_slice_base(conn: sqlite3.Connection) -> bool:
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
