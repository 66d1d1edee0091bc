"""The embedded engine's importer: Perfetto trace files -> SQLite tables named as trace processor's.

``load(paths)`` decodes the files (see ``_decode``: vectorised protobuf scanning, trace
processor's clock / interning / nesting semantics) and writes the tables into an SQLite database
(in memory by default). Table and column names follow trace processor's
(``docs/analysis/sql-tables``), so the same SQL runs on both engines:

=================  ===========================================================================
``slice``          id, ts, dur (-1: never ended), track_id, category (comma-joined), name,
                   depth, parent_id, arg_set_id, thread_ts, thread_dur
``track``          id, name, type, classification, parent_id, dimension_arg_set_id, ...
``thread_track``   id, name, type, parent_id, utid
``process_track``  id, name, type, parent_id, upid
``counter_track``  id, name, type, parent_id, unit, description
``thread``         utid (= id), tid, name, upid, is_main_thread (utid 0: placeholder)
``process``        upid (= id), pid, name (upid 0: placeholder)
``counter``        id, ts, track_id, value, arg_set_id
``args``           id, arg_set_id, flat_key, key, int_value, string_value, real_value,
                   value_type ('int', 'uint', 'bool', 'real', 'string', 'pointer', 'json'),
                   display_value
``flow``           id, slice_out, slice_in, trace_id, arg_set_id
``stats``          name, idx, severity, source, value (decoder counters: unknown packets, ...)
=================  ===========================================================================
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Sequence
from os import PathLike, fspath

import numpy as np

from ._decode import Tables, decode, read_file
from ._errors import TraceError

Progress = Callable[[str, float], None]

SCHEMA = """
CREATE TABLE track(id INTEGER PRIMARY KEY, name TEXT, type TEXT, classification TEXT,
                   parent_id INTEGER, dimension_arg_set_id INTEGER, source_arg_set_id INTEGER,
                   machine_id INTEGER);
CREATE TABLE thread_track(id INTEGER PRIMARY KEY, name TEXT, type TEXT, parent_id INTEGER,
                          utid INTEGER);
CREATE TABLE process_track(id INTEGER PRIMARY KEY, name TEXT, type TEXT, parent_id INTEGER,
                           upid INTEGER);
CREATE TABLE counter_track(id INTEGER PRIMARY KEY, name TEXT, type TEXT, parent_id INTEGER,
                           unit TEXT, description TEXT);
CREATE TABLE process(upid INTEGER PRIMARY KEY, id INTEGER, pid INTEGER, name TEXT,
                     start_ts INTEGER, end_ts INTEGER, parent_upid INTEGER, uid INTEGER,
                     cmdline TEXT, arg_set_id INTEGER, machine_id INTEGER);
CREATE TABLE thread(utid INTEGER PRIMARY KEY, id INTEGER, tid INTEGER, name TEXT,
                    start_ts INTEGER, end_ts INTEGER, upid INTEGER, is_main_thread INTEGER,
                    machine_id INTEGER);
CREATE TABLE slice(id INTEGER PRIMARY KEY, ts INTEGER, dur INTEGER, track_id INTEGER,
                   category TEXT, name TEXT, depth INTEGER, parent_id INTEGER,
                   arg_set_id INTEGER, thread_ts INTEGER, thread_dur INTEGER);
CREATE TABLE counter(id INTEGER PRIMARY KEY, ts INTEGER, track_id INTEGER, value REAL,
                     arg_set_id INTEGER);
CREATE TABLE args(id INTEGER PRIMARY KEY, arg_set_id INTEGER, flat_key TEXT, key TEXT,
                  int_value INTEGER, string_value TEXT, real_value REAL, value_type TEXT,
                  display_value TEXT);
CREATE TABLE flow(id INTEGER PRIMARY KEY, slice_out INTEGER, slice_in INTEGER,
                  trace_id INTEGER, arg_set_id INTEGER);
CREATE TABLE stats(name TEXT, idx INTEGER, severity TEXT, source TEXT, value INTEGER);
"""

# Indexes created after loading (cheaper than maintaining them row by row).
INDEXES = """
CREATE INDEX slice_track_ts ON slice(track_id, ts);
CREATE INDEX slice_parent ON slice(parent_id);
CREATE INDEX counter_track_ts ON counter(track_id, ts);
CREATE INDEX args_set ON args(arg_set_id);
CREATE INDEX flow_out ON flow(slice_out);
CREATE INDEX flow_in ON flow(slice_in);
"""

_ROWS_PER_BATCH = 1 << 18


def _noop(stage: str, frac: float) -> None:
    pass


def _paths(path_or_paths: str | PathLike | Iterable[str | PathLike]) -> list[str]:
    if isinstance(path_or_paths, (str, bytes, PathLike)):
        return [fspath(path_or_paths)]
    out = [fspath(p) for p in path_or_paths]
    if not out:
        raise TraceError("no trace file given")
    return out


def decode_files(path_or_paths, progress: Progress | None = None) -> Tables:
    """Decode one or several trace files (concatenable traces) into one set of tables."""
    progress = progress or _noop
    datas = [(p, read_file(p)) for p in _paths(path_or_paths)]
    return decode(datas, progress)


def load(
    path_or_paths: str | PathLike | Sequence[str | PathLike],
    db: str = ":memory:",
    progress: Progress | None = None,
    indexes: bool = True,
) -> tuple[sqlite3.Connection, dict[str, int]]:
    """Load trace file(s) into a new SQLite database; returns (connection, decoder stats)."""
    progress = progress or _noop
    tables = decode_files(path_or_paths, progress)
    conn = sqlite3.connect(db, check_same_thread=False)
    try:
        write_tables(conn, tables, progress, indexes=indexes)
    except BaseException:
        conn.close()
        raise
    return conn, tables.stats


def _nullable(a: np.ndarray) -> list:
    """Column as a Python list with -1 -> None."""
    lst = a.tolist()
    if (a < 0).any():
        lst = [None if v < 0 else v for v in lst]
    return lst


def write_tables(conn: sqlite3.Connection, t: Tables, progress: Progress = _noop,
                 indexes: bool = True) -> None:
    conn.execute("PRAGMA journal_mode=OFF")
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("PRAGMA temp_store=MEMORY")
    conn.execute("PRAGMA cache_size=-262144")
    conn.executescript(SCHEMA)
    strs = t.strings.list + [None]  # index -1 -> NULL
    with conn:
        _write_tracks(conn, t)
        _write_slices(conn, t, strs, progress)
        c = t.counter
        conn.executemany(
            "INSERT INTO counter(id, ts, track_id, value) VALUES (?, ?, ?, ?)",
            zip(c["id"].tolist(), c["ts"].tolist(), c["track_id"].tolist(),
                c["value"].tolist(), strict=True),
        )
        conn.executemany(
            "INSERT INTO args(arg_set_id, flat_key, key, int_value, string_value, real_value,"
            " value_type, display_value) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            ((*r, _display(r)) for r in t.args),
        )
        conn.executemany("INSERT INTO flow(slice_out, slice_in) VALUES (?, ?)", t.flows)
        conn.executemany(
            "INSERT INTO stats(name, idx, severity, source, value) VALUES (?, NULL, ?, ?, ?)",
            ((k, "info", "stepscope", v) for k, v in sorted(t.stats.items())),
        )
    if indexes:
        progress("index", 0.0)
        conn.executescript(INDEXES)
        progress("index", 1.0)


def _display(r: tuple) -> str | None:
    _, _, _, iv, sv, rv, vt = r
    if vt == "bool":
        return "true" if iv else "false"
    for v in (sv, iv, rv):
        if v is not None:
            return str(v)
    return None


def _write_tracks(conn: sqlite3.Connection, t: Tables) -> None:
    by_uuid = {tr.uuid: tr for tr in t.tracks}
    for tr in t.tracks:
        parent = by_uuid.get(tr.parent_uuid) if tr.parent_uuid is not None else None
        pid = parent.id if parent is not None else None
        kind = {"track": "track_event", "counter": "counter"}.get(tr.kind, tr.kind)
        name = tr.name
        conn.execute(
            "INSERT INTO track(id, name, type, classification, parent_id) VALUES (?,?,?,?,?)",
            (tr.id, name, kind, kind, pid),
        )
        if tr.kind == "thread":
            conn.execute("INSERT INTO thread_track VALUES (?,?,?,?,?)",
                         (tr.id, name, kind, pid, t.track_utid[tr.id]))
        elif tr.id in t.track_upid:
            conn.execute("INSERT INTO process_track VALUES (?,?,?,?,?)",
                         (tr.id, name, kind, pid, t.track_upid[tr.id]))
        if tr.kind == "counter":
            conn.execute("INSERT INTO counter_track(id, name, type, parent_id, unit)"
                         " VALUES (?,?,?,?,?)", (tr.id, name, kind, pid, tr.unit))
    conn.executemany("INSERT INTO process(upid, id, pid, name) VALUES (?,?,?,?)",
                     ((u, u, p, n) for u, p, n in t.processes))
    pid_of = {u: p for u, p, _ in t.processes}
    conn.executemany(
        "INSERT INTO thread(utid, id, tid, name, upid, is_main_thread) VALUES (?,?,?,?,?,?)",
        ((u, u, tid, n, up, None if u == 0 else int(pid_of.get(up) == tid))
         for u, tid, n, up in t.threads),
    )


def _write_slices(conn: sqlite3.Connection, t: Tables, strs: list, progress: Progress) -> None:
    s = t.slice
    n = len(s["id"])
    for b0 in range(0, n, _ROWS_PER_BATCH):
        progress("load", b0 / max(n, 1))
        b1 = min(n, b0 + _ROWS_PER_BATCH)
        cat = s["category"][b0:b1].tolist()
        name = s["name"][b0:b1].tolist()
        conn.executemany(
            "INSERT INTO slice(id, ts, dur, track_id, category, name, depth, parent_id,"
            " arg_set_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            zip(range(b0, b1), s["ts"][b0:b1].tolist(), s["dur"][b0:b1].tolist(),
                s["track_id"][b0:b1].tolist(), [strs[i] for i in cat],
                [strs[i] for i in name], s["depth"][b0:b1].tolist(),
                _nullable(s["parent_id"][b0:b1]), _nullable(s["arg_set_id"][b0:b1]),
                strict=True),
        )
    progress("load", 1.0)
