"""The embedded engine's importer: Perfetto trace files -> SQLite tables named as trace processor's.

``load(paths)`` decodes the files (see ``decode``: vectorised protobuf scanning, trace
processor's clock / interning / nesting semantics) and writes the tables into an SQLite database
(in memory by default). Table and column names follow trace processor's
(``docs/analysis/sql-tables``), so the same SQL runs on both engines:

=================  ===========================================================================
``slice``          id, ts, dur (-1: never ended), track_id, category (comma-joined), name,
                   depth, parent_id, arg_set_id, thread_ts, thread_dur
``track``          id, name, type, classification, parent_id, dimension_arg_set_id, ...
``thread_track``   id, name, type, parent_id, utid
``process_track``  id, name, type, parent_id, upid
``counter_track``  id, name, parent_id, type, dimension_arg_set_id, source_arg_set_id,
                   machine_id, unit, description; type as trace processor's:
                   'process_counter_track_event' (under a process), 'thread_counter_track_event'
                   (under a thread), 'global_counter_track_event'
``process_counter_track``  counter tracks of a process: id, name, type, parent_id,
                   source_arg_set_id, machine_id, unit, description, upid
``thread_counter_track``   the same with utid, for counter tracks of a thread
``thread``         utid (= id), tid, name, upid, is_main_thread (utid 0: placeholder)
``process``        upid (= id), pid, name (upid 0: placeholder)
``counter``        id, ts, track_id, value, arg_set_id
``args``           id, arg_set_id, flat_key, key, int_value, string_value, real_value,
                   value_type ('int', 'uint', 'bool', 'real', 'string', 'pointer', 'json'),
                   display_value; a view over ``__intrinsic_args``, which stores no
                   display_value: it is made when read (see ARGS_VIEW)
``flow``           id, slice_out, slice_in, trace_id, arg_set_id
``stats``          name, idx, severity, source, value (decoder counters: unknown packets, ...)
=================  ===========================================================================

More tables can be laid into the same image: ``load(..., post=[PostLoad(...)])`` runs each
builder on the decoded tables before the image is written (the summaries' slice base is one:
it holds the slices, and ``slice`` is then a view over it). The importer knows nothing of what
they are for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import tempfile
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from os import PathLike, fspath

import numpy as np

from .. import sqlimage as si
from .._errors import TraceDamageWarning, TraceError
from .decode import Tables, decode, read_file
from .packets import Progress, skipped_summary

log = logging.getLogger("stepscope.analysis")

# trace processor's slice columns, in its order
SLICE_COLUMNS = (("id", "INTEGER PRIMARY KEY"), ("ts", "INTEGER"), ("dur", "INTEGER"),
                 ("track_id", "INTEGER"), ("category", "TEXT"), ("name", "TEXT"),
                 ("depth", "INTEGER"), ("parent_id", "INTEGER"), ("arg_set_id", "INTEGER"),
                 ("thread_ts", "INTEGER"), ("thread_dur", "INTEGER"))
# the index on the slices' (track, ts), on the table that holds them
SLICE_TRACK_INDEX, SLICE_TRACK_INDEX_KEYS = "slice_track_ts", ("track_id", "ts")

# Big tables: written as an SQLite file image (see sqlimage.image), no per-row Python work.
# Column names and types, kept once: the CREATE TABLE text and index key positions come from here.
BIG_COLUMNS = {
    "slice": SLICE_COLUMNS,
    "counter": (("id", "INTEGER PRIMARY KEY"), ("ts", "INTEGER"), ("track_id", "INTEGER"),
                ("value", "REAL"), ("arg_set_id", "INTEGER")),
    "__intrinsic_args": (
        ("id", "INTEGER PRIMARY KEY"), ("arg_set_id", "INTEGER"), ("flat_key", "TEXT"),
        ("key", "TEXT"), ("int_value", "INTEGER"), ("string_value", "TEXT"),
        ("real_value", "REAL"), ("value_type", "TEXT")),
    "flow": (("id", "INTEGER PRIMARY KEY"), ("slice_out", "INTEGER"), ("slice_in", "INTEGER"),
             ("trace_id", "INTEGER"), ("arg_set_id", "INTEGER")),
}
BIG_SCHEMA = {t: si.table_sql(t, cols) for t, cols in BIG_COLUMNS.items()}

# trace processor's args: display_value is made when read, as trace processor shows it (a
# string as it is, an int in decimal, a uint unsigned, a pointer in hex, a bool as 'true' or
# 'false', a real as SQLite prints it: 15 significant digits, '1.0e-05'; the last digit can
# differ where the two SQLite versions round differently), so a trace whose ranges carry a
# million distinct numbers (a step number, a sequence number) holds no million strings, and a
# string arg is stored once
ARGS_VIEW = ("CREATE VIEW args AS SELECT id, arg_set_id, flat_key, key, int_value, string_value,"
             " real_value, value_type, CASE value_type"
             " WHEN 'int' THEN CAST(int_value AS TEXT) WHEN 'uint' THEN printf('%llu', int_value)"
             " WHEN 'pointer' THEN printf('0x%llx', int_value)"
             " WHEN 'bool' THEN CASE WHEN int_value != 0 THEN 'true' ELSE 'false' END"
             " WHEN 'real' THEN CAST(real_value AS TEXT) ELSE string_value END AS display_value"
             " FROM __intrinsic_args;")

SMALL_SCHEMA = """
CREATE TABLE track(id INTEGER PRIMARY KEY, name TEXT, type TEXT, classification TEXT,
                   parent_id INTEGER, dimension_arg_set_id INTEGER, source_arg_set_id INTEGER,
                   machine_id INTEGER);
CREATE TABLE thread_track(id INTEGER PRIMARY KEY, name TEXT, type TEXT, parent_id INTEGER,
                          utid INTEGER);
CREATE TABLE process_track(id INTEGER PRIMARY KEY, name TEXT, type TEXT, parent_id INTEGER,
                           upid INTEGER);
CREATE TABLE counter_track(id INTEGER PRIMARY KEY, name TEXT, parent_id INTEGER, type TEXT,
                           dimension_arg_set_id INTEGER, source_arg_set_id INTEGER,
                           machine_id INTEGER, unit TEXT, description TEXT);
CREATE TABLE process_counter_track(id INTEGER PRIMARY KEY, name TEXT, type TEXT,
                                   parent_id INTEGER, source_arg_set_id INTEGER,
                                   machine_id INTEGER, unit TEXT, description TEXT,
                                   upid INTEGER);
CREATE TABLE thread_counter_track(id INTEGER PRIMARY KEY, name TEXT, type TEXT,
                                  parent_id INTEGER, source_arg_set_id INTEGER,
                                  machine_id INTEGER, unit TEXT, description TEXT,
                                  utid INTEGER);
CREATE TABLE process(upid INTEGER PRIMARY KEY, id INTEGER, pid INTEGER, name TEXT,
                     start_ts INTEGER, end_ts INTEGER, parent_upid INTEGER, uid INTEGER,
                     cmdline TEXT, arg_set_id INTEGER, machine_id INTEGER);
CREATE TABLE thread(utid INTEGER PRIMARY KEY, id INTEGER, tid INTEGER, name TEXT,
                    start_ts INTEGER, end_ts INTEGER, upid INTEGER, is_main_thread INTEGER,
                    machine_id INTEGER);
CREATE TABLE stats(name TEXT, idx INTEGER, severity TEXT, source TEXT, value INTEGER);
"""

# Indexes: (name, table, key columns). Built inside the file image (see sqlimage.image), as
# ``CREATE INDEX name ON table(keys)`` would build them.
INDEXES = (
    (SLICE_TRACK_INDEX, "slice", SLICE_TRACK_INDEX_KEYS),  # or on a table holding the slices
    ("counter_track_ts", "counter", ("track_id", "ts")),
    ("args_set", "__intrinsic_args", ("arg_set_id",)),
    ("flow_out", "flow", ("slice_out",)),
    ("flow_in", "flow", ("slice_in",)),
)


@dataclass
class Laid:
    """Tables a post-load builder lays into the database image beside the importer's.

    ``holds``: the importer's tables whose rows its tables hold instead (the importer then
    leaves them out of the image); ``views``: SQL run once the database is open (the views
    that stand in for them)."""

    tables: list[si.Table]
    indexes: list[si.Index]
    holds: tuple[str, ...] = ()
    views: str = ""


@dataclass(frozen=True)
class PostLoad:
    """A builder of more tables from the decoded ones, run before the image is written, so
    that the image writer lays them out with the rest (no row goes through SQL).

    ``what`` names them in the warning logged when ``build`` fails (sqlite3.Error, ValueError,
    KeyError, IndexError): they are an optional shortcut, and the load goes on without them."""

    what: str
    build: Callable[[Tables], Laid]


def _noop(stage: str, frac: float) -> None:
    pass


def paths_of(path_or_paths: str | PathLike | Iterable[str | PathLike]) -> list[str]:
    if isinstance(path_or_paths, (str, bytes, PathLike)):
        return [fspath(path_or_paths)]
    out = [fspath(p) for p in path_or_paths]
    if not out:
        raise TraceError("no trace file given")
    return out


def decode_files(path_or_paths, progress: Progress | None = None,
                 datas: list[tuple[str, bytes]] | None = None) -> Tables:
    """Decode one or several trace files (concatenable traces) into one set of tables
    (``datas``: their bytes, already read, named)."""
    progress = progress or _noop
    paths = paths_of(path_or_paths)
    if datas is None:
        datas = [(p, read_file(p)) for p in paths]
    try:
        tables = decode(datas, progress)
    except (TraceError, MemoryError):  # as they are (KeyboardInterrupt is no Exception)
        raise
    except Exception as e:  # corrupt input the checks above did not catch: still a clear error
        raise TraceError(f"{', '.join(paths)}: cannot decode the trace "
                         f"({type(e).__name__}: {e})") from e
    skipped = skipped_summary(tables.stats)
    if skipped and not len(tables.slice["ts"]) and not len(tables.counter["ts"]):
        # what is left leans on what was lost (interned names, clocks): nothing to show
        raise TraceError(f"{', '.join(paths)}: nothing readable: {skipped}")
    if skipped:  # the loss is in the stats table too, but nobody looks there
        warnings.warn(f"{', '.join(paths)}: skipped {skipped}; the rest is loaded",
                      TraceDamageWarning, stacklevel=2)
    return tables


def load(
    path_or_paths: str | PathLike | Sequence[str | PathLike],
    db: str | None = ":memory:",
    progress: Progress | None = None,
    indexes: bool = True,
    post: Sequence[PostLoad] = (),
    datas: list[tuple[str, bytes]] | None = None,
) -> tuple[sqlite3.Connection, dict[str, int]]:
    """Load trace file(s) into a new SQLite database; returns (connection, decoder stats).

    ``db``: ":memory:", a file path, or None for a new temporary file (see write_tables).
    ``post``: builders of more tables laid into the same image (see PostLoad); ``datas``: the
    files' bytes, when the caller has read (or merged) them."""
    progress = progress or _noop
    tables = decode_files(path_or_paths, progress, datas)
    conn = write_tables(tables, db, progress, indexes=indexes, post=post)
    return conn, tables.stats


def _image_tables(t: Tables, slices: bool = True) -> list[si.Table]:
    """The big tables as image tables (``slices``: with the slice table). Trailing always-NULL
    columns are left out of the records: SQLite reads columns missing from a record as NULL."""
    s, c, a = t.slice, t.counter, t.args
    out = []
    if slices:
        out.append(si.Table("slice", BIG_SCHEMA["slice"], s["id"], [
            si.Column("rowid"), si.Column("int", s["ts"]), si.Column("int", s["dur"]),
            si.Column("int", s["track_id"]), si.Column("text", s["category"]),
            si.Column("text", s["name"]), si.Column("int", s["depth"]),
            si.Column("int", s["parent_id"], s["parent_id"] < 0),
            si.Column("int", s["arg_set_id"], s["arg_set_id"] < 0)]))  # thread_ts/dur: NULL
    out.append(si.Table("counter", BIG_SCHEMA["counter"], c["id"], [
        si.Column("rowid"), si.Column("int", c["ts"]), si.Column("int", c["track_id"]),
        si.Column("real", c["value"])]))  # arg_set_id: NULL
    na = len(a.get("arg_set_id", ()))
    if na:
        cols = [si.Column("rowid"), si.Column("int", a["arg_set_id"]),
                si.Column("text", a["flat_key"]), si.Column("text", a["key"]),
                si.Column("int", a["int_value"], a["int_null"]),
                si.Column("text", a["string_value"]),
                si.Column("real", a["real_value"], a["real_null"]),
                si.Column("text", a["value_type"])]
    else:
        z = np.zeros(0, np.int64)
        cols = [si.Column("rowid")] + [si.Column("int", z)
                                       for _ in BIG_COLUMNS["__intrinsic_args"][1:]]
    out.append(si.Table("__intrinsic_args", BIG_SCHEMA["__intrinsic_args"],
                        np.arange(1, na + 1), cols))
    fl = np.array(t.flows, np.int64).reshape(-1, 2)
    out.append(si.Table("flow", BIG_SCHEMA["flow"], np.arange(1, len(fl) + 1), [
        si.Column("rowid"), si.Column("int", fl[:, 0]), si.Column("int", fl[:, 1])]))
    return out


def _image_indexes(tables: list[si.Table]) -> list[si.Index]:
    """The indexes of INDEXES over the image tables' columns (integer or text keys)."""
    by_name = {t.name: t for t in tables}
    out = []
    for name, table, keys in INDEXES:
        if table not in by_name:  # held by a post-load table (see _image_parts)
            continue
        t = by_name[table]
        names = [n for n, _ in BIG_COLUMNS[table]]
        cols = []
        for k in keys:
            i = names.index(k)
            col = t.columns[i] if i < len(t.columns) else None  # missing trailing: all NULL
            if col is None or col.kind not in ("int", "text"):
                raise ValueError(f"index {name}: key {table}.{k} must be an integer or text "
                                 f"column written to the image")
            cols.append(col)
        out.append(si.Index(name, si.index_sql(name, table, keys), table, cols, t.rowid))
    return out


def write_tables(t: Tables, db: str | None = ":memory:", progress: Progress = _noop,
                 indexes: bool = True, post: Sequence[PostLoad] = ()) -> sqlite3.Connection:
    """A database holding the decoded tables: in memory, in the file ``db``, or (``db=None``) in
    a new temporary file, which the caller deletes (``remove_db_file(si.file_of(conn))``, as
    EmbeddedDB does; in memory when it cannot be written).

    A file is laid out in place and read mapped (see sqlimage.image.build_file); other connections
    can open it, which lets the summaries run on several cores. ``post``: builders of more
    tables laid into the image (see PostLoad). The big columns of ``t`` (slice, counter, args)
    are released once written.
    """
    progress("load", 0.0)
    tables, ixs, views = _image_parts(t, indexes, post)
    strings = t.strings.list
    conn = None
    if db is None:
        conn = _temp_file_db(tables, ixs, strings)
    elif db != ":memory:":
        si.build_file(db, tables, strings, ixs)
        conn = si.open_file(db)
    image = si.build(tables, strings, ixs) if conn is None else None  # in memory
    del tables, ixs
    t.slice, t.counter, t.args = {}, {}, {}  # written: free the columns (before SQLite copies
    if image is not None:  # an in-memory image)
        conn = si.connect(image)
        del image
    progress("load", 0.5)
    tmp = si.file_of(conn) if db is None else None
    try:
        conn.execute("PRAGMA synchronous=OFF")
        conn.execute("PRAGMA temp_store=MEMORY")
        conn.executescript(SMALL_SCHEMA + ARGS_VIEW + views)
        with conn:
            _write_tracks(conn, t)
            conn.executemany(
                "INSERT INTO stats(name, idx, severity, source, value)"
                " VALUES (?, NULL, 'info', 'stepscope', ?)", sorted(t.stats.items()))
        progress("load", 1.0)
    except BaseException:
        conn.close()
        if tmp is not None:
            remove_db_file(tmp)
        raise
    return conn


TEMP_PREFIX = "stepscope-"


def _temp_file_db(tables: list[si.Table], ixs: list[si.Index],
                  strings: list[str | None]) -> sqlite3.Connection | None:
    """The database laid out in a new temporary file; None (and no file left) when the file
    cannot be made or written (no temporary directory, a full disk)."""
    path = None
    try:
        fd, path = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".db")
        os.close(fd)
        si.build_file(path, tables, strings, ixs)
        return si.open_file(path)
    except (OSError, sqlite3.Error):
        if path is not None:
            remove_db_file(path)
        return None
    except BaseException:  # Ctrl-C, or SIGTERM made an exception (see _cli): no file left
        if path is not None:
            remove_db_file(path)
        raise


def remove_db_file(path: str) -> None:
    """Delete a database file and the journal a crash may have left beside it."""
    for p in (path, path + "-journal"):
        with contextlib.suppress(OSError):
            os.unlink(p)


def _image_parts(t: Tables, indexes: bool,
                 post: Sequence[PostLoad]) -> tuple[list[si.Table], list[si.Index], str]:
    """The image's tables and indexes and the views run after: the post-load tables first,
    then the big tables they do not hold. ``indexes`` False leaves out the importer's indexes
    (INDEXES), wherever they are, not the post-load tables' own."""
    laid = []
    for p in post:
        try:
            laid.append(p.build(t))
        except (sqlite3.Error, ValueError, KeyError, IndexError) as e:
            # an optional shortcut (what they hold can be computed from the tables), but said
            log.warning("stepscope: no %s (%s: %s)", p.what, type(e).__name__, e)
    held = {h for part in laid for h in part.holds}
    tables = _image_tables(t, slices="slice" not in held)
    ixs = _image_indexes(tables) if indexes else []
    own = {name for name, _, _ in INDEXES}
    for part in reversed(laid):
        tables[:0] = part.tables
    for part in laid:
        ixs.extend(ix for ix in part.indexes if indexes or ix.name not in own)
    return tables, ixs, "".join(part.views for part in laid)


def track_tables(t: Tables) -> sqlite3.Connection:
    """A new in-memory database holding the small tables (tracks, threads, processes, stats'
    schema) of ``t``: what a post-load builder reads with SQL. The caller closes it."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.executescript(SMALL_SCHEMA)
        _write_tracks(conn, t)
    except BaseException:
        conn.close()
        raise
    return conn


def _counter_owner(tr, by_uuid: dict):
    """The nearest thread or process track above a counter track (None: a global counter), as
    trace processor scopes TrackEvent counter tracks."""
    p, seen = tr, set()
    while p.parent_uuid is not None and p.uuid not in seen:
        seen.add(p.uuid)
        p = by_uuid.get(p.parent_uuid)
        if p is None:
            return None
        if p.kind in ("thread", "process"):
            return p
    return None


def _write_tracks(conn: sqlite3.Connection, t: Tables) -> None:
    by_uuid = {tr.uuid: tr for tr in t.tracks}
    for tr in t.tracks:
        parent = by_uuid.get(tr.parent_uuid) if tr.parent_uuid is not None else None
        pid = parent.id if parent is not None else None
        owner = _counter_owner(tr, by_uuid) if tr.kind == "counter" else None
        kind = {"track": "track_event"}.get(tr.kind, tr.kind)
        if tr.kind == "counter":
            kind = f"{owner.kind if owner is not None else 'global'}_counter_track_event"
        name = tr.name
        conn.execute(
            "INSERT INTO track(id, name, type, classification, parent_id) VALUES (?,?,?,?,?)",
            (tr.id, name, kind, kind, pid),
        )
        if tr.id in t.track_utid:  # (a thread's track, or a track of its own under it)
            conn.execute("INSERT INTO thread_track VALUES (?,?,?,?,?)",
                         (tr.id, name, kind, pid, t.track_utid[tr.id]))
        elif tr.id in t.track_upid:
            conn.execute("INSERT INTO process_track VALUES (?,?,?,?,?)",
                         (tr.id, name, kind, pid, t.track_upid[tr.id]))
        if tr.kind == "counter":
            conn.execute("INSERT INTO counter_track(id, name, type, parent_id, unit)"
                         " VALUES (?,?,?,?,?)", (tr.id, name, kind, pid, tr.unit))
            if owner is not None and owner.kind == "thread":
                conn.execute("INSERT INTO thread_counter_track(id, name, type, parent_id, unit,"
                             " utid) VALUES (?,?,?,?,?,?)",
                             (tr.id, name, kind, pid, tr.unit, t.track_utid[owner.id]))
            elif owner is not None and owner.id in t.track_upid:
                conn.execute("INSERT INTO process_counter_track(id, name, type, parent_id,"
                             " unit, upid) VALUES (?,?,?,?,?,?)",
                             (tr.id, name, kind, pid, tr.unit, t.track_upid[owner.id]))
    conn.executemany("INSERT INTO process(upid, id, pid, name) VALUES (?,?,?,?)",
                     ((u, u, p, n) for u, p, n in t.processes))
    pid_of = {u: p for u, p, _ in t.processes}
    conn.executemany(
        "INSERT INTO thread(utid, id, tid, name, upid, is_main_thread) VALUES (?,?,?,?,?,?)",
        ((u, u, tid, n, up, None if u == 0 else int(pid_of.get(up) == tid))
         for u, tid, n, up in t.threads),
    )
