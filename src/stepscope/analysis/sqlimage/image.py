"""Build an SQLite database file image directly from numpy columns.

Inserting rows through ``sqlite3`` costs several microseconds per row (Python objects, binding,
B-tree inserts), which dominates loading a trace with millions of slices. Instead, the big tables
are laid out in SQLite's documented file format (https://www.sqlite.org/fileformat.html) with
numpy: table B-tree leaf pages filled in rowid order, interior pages above them, and page 1
holding ``sqlite_schema``. Indexes are laid out the same way (index B-trees: entries sorted by
key, each entry stored once, in a leaf or between two leaves in the level above), which costs a
fraction of a ``CREATE INDEX`` afterwards. The image is then handed to SQLite
(``Connection.deserialize``), or laid out straight into a mapped file (``build_file``), which
SQLite reads like any database it wrote itself.

Only what the loader needs is supported: rowid tables whose ``INTEGER PRIMARY KEY`` is the rowid,
columns of integers, doubles, or UTF-8 text (each nullable), rows given in rowid order; indexes
over integer and text columns (each nullable; text in BINARY order). Integers are stored in the
smallest serial type that holds them (1..8 bytes, none for 0 and 1), as SQLite itself does: the
values read back are the same.
A table may be given fewer columns than its SQL declares: the trailing ones read as NULL.
Rows are laid out a block at a time, so temporary arrays stay small next to the columns.

The per-row loops (cell sizes, leaf pages) run in the optional C extension ``_sqlpages`` when it
is built (one pass per B-tree instead of a dozen array passes per column), else in numpy
(``STEPSCOPE_PURE_PYTHON=1`` forces numpy); both write the same bytes. ``pages.native`` holds
the choice.
"""

from __future__ import annotations

import mmap
import os
import sqlite3
import struct
import tempfile
from collections.abc import Callable
from urllib.parse import quote

import numpy as np

from .._threads import in_parallel
from .interior import btree_page, index_interior, interior_pages
from .leaves import Layout, index_layout, table_layout, write_leaves
from .records import Strings, record_bytes, varint_bytes
from .schema import PAGE, Index, Table


def build(tables: list[Table], strings: list[str | None], indexes: list[Index] | tuple = (),
          alloc: Callable[[int], np.ndarray] | None = None) -> np.ndarray:
    """The bytes (a uint8 array) of an SQLite database holding ``tables`` and ``indexes``.

    ``alloc(n)``: where to lay them out (n zero bytes, e.g. a mapped file); default: memory.
    """
    st = Strings(strings)
    if any(c.kind == "text" for ix in indexes for c in ix.key_columns()):
        st.rank()  # computed once, before the threads
    # each B-tree's leaf layout is independent of the others: laid out on several threads
    layouts = in_parallel(lambda x: table_layout(x, st) if isinstance(x, Table) else
                          index_layout(x, st), [*tables, *indexes], cost=_layout_cost)
    plans: list[tuple] = []  # (type, name, table, sql, layout, index entries between leaves)
    for t, lay in zip(tables, layouts[:len(tables)], strict=True):
        plans.append(("table", t.name, t.name, t.sql, lay, None))
    for ix, (lay, divs) in zip(indexes, layouts[len(tables):], strict=True):
        plans.append(("index", ix.name, ix.table, ix.sql, lay, divs))
    # leaves first (pages 2...), then the interior pages of every B-tree
    firsts, next_page = [], 2
    for p in plans:
        firsts.append(next_page)
        next_page += p[4].n_pages
    interior: list[bytes] = []
    schema_rows = []
    for (typ, name, tbl, sql, lay, divs), first in zip(plans, firsts, strict=True):
        children = list(range(first, first + lay.n_pages))
        if typ == "table":
            n = len(lay.page)
            keys = lay.rowid[np.r_[lay.pfirst[1:] - 1, n - 1]].tolist() if n else [0]
            while len(children) > 1:
                pages, up = interior_pages(children, keys, next_page)
                interior.extend(pages)
                next_page += len(pages)
                children, keys = [c for c, _ in up], [k for _, k in up]
        else:
            while len(children) > 1:
                pages, children, divs = index_interior(children, divs, next_page)
                interior.extend(pages)
                next_page += len(pages)
        schema_rows.append((typ, name, tbl, children[0], sql))
    cells = []
    for i, row in enumerate(schema_rows, start=1):
        rec = record_bytes(list(row))
        cells.append(varint_bytes(len(rec)) + varint_bytes(i) + rec)
    page1 = bytearray(btree_page(13, cells, offset=100))
    n_pages = next_page - 1
    page1[:100] = _header(n_pages)
    out = np.zeros(n_pages * PAGE, np.uint8) if alloc is None else alloc(n_pages * PAGE)
    out[:PAGE] = np.frombuffer(bytes(page1), np.uint8)

    def write(i: int) -> None:  # the B-trees' leaves lie in separate pages: one per thread
        typ, lay = plans[i][0], plans[i][4]
        write_leaves(out, (firsts[i] - 1) * PAGE, lay, 13 if typ == "table" else 10, st)

    in_parallel(write, range(len(plans)), cost=lambda i: _write_cost(plans[i][4]))
    pos = (next_page - 1 - len(interior)) * PAGE
    for pg in interior:
        out[pos : pos + PAGE] = np.frombuffer(pg, np.uint8)
        pos += PAGE
    return out


def _write_cost(lay: Layout) -> int:
    """Rough relative cost of writing a B-tree's leaves: per cell, per value and a fixed part
    (5M cells: a table of 11 columns 0.7 s, an index of 3 to 5 values 0.45-0.6 s)."""
    return len(lay.page) * (len(lay.cols) + 2)


def _layout_cost(x: Table | Index) -> int:
    """Rough relative cost of laying out ``x`` (threads take the costliest first): a table's
    cells are sized in one pass; an index is sorted on its keys, text keys by rank and read
    out of row order (measured at 5M rows: table 0.3 s, index on (int, int) 0.3 s, on four
    ints 0.55 s, on (int, text, int) 0.65 s)."""
    if isinstance(x, Table):
        return 2 * len(x.rowid)
    return len(x.rowid) * (len(x.keys) + 3 * sum(c.kind == "text" for c in x.keys))


def _header(n_pages: int) -> bytes:
    h = bytearray(100)
    h[:16] = b"SQLite format 3\0"
    struct.pack_into(">H", h, 16, 1 if PAGE == 65536 else PAGE)
    h[18], h[19], h[20], h[21], h[22], h[23] = 1, 1, 0, 64, 32, 32
    struct.pack_into(">I", h, 24, 1)  # file change counter
    struct.pack_into(">I", h, 28, n_pages)
    struct.pack_into(">I", h, 40, 1)  # schema cookie
    struct.pack_into(">I", h, 44, 4)  # schema format
    struct.pack_into(">I", h, 56, 1)  # UTF-8
    struct.pack_into(">I", h, 92, 1)  # version-valid-for = change counter
    struct.pack_into(">I", h, 96, sqlite3.sqlite_version_info[0] * 1000000
                     + sqlite3.sqlite_version_info[1] * 1000 + sqlite3.sqlite_version_info[2])
    return bytes(h)


def build_file(path: str, tables: list[Table], strings: list[str | None],
               indexes: list[Index] | tuple = ()) -> None:
    """Lay the database out straight into the file ``path`` (mapped, so its bytes exist once:
    in the OS's file cache, which can write them out under memory pressure).

    The file's space is reserved before anything is written to the mapping: a full disk is an
    OSError here, never a signal while writing.
    """
    if not hasattr(os, "posix_fallocate"):  # no reservation to be had: write a copy instead
        image = build(tables, strings, indexes)
        with open(path, "wb") as f:
            f.write(image)
        return
    maps: list[mmap.mmap] = []
    with open(path, "w+b") as f:
        def alloc(n: int) -> np.ndarray:
            os.posix_fallocate(f.fileno(), 0, n)
            maps.append(mmap.mmap(f.fileno(), n))
            return np.frombuffer(maps[-1], np.uint8)

        try:
            build(tables, strings, indexes, alloc)
        finally:
            for m in maps:
                try:
                    m.close()
                except BufferError:  # pragma: no cover - a view still alive: closed when freed
                    pass


# SQLite maps at most its compile-time limit (2 GB by default), the rest is read as needed
MMAP_BYTES = 1 << 40


def open_file(path: str, reader: bool = False) -> sqlite3.Connection:
    """A connection to the database file ``path`` that any thread may use (``reader``:
    read-only, for another thread).

    It reads the file mapped (read through SQLite's small page cache instead, random lookups
    cost 1.6 times more): the pages count in this process's memory while mapped, as an
    in-memory copy would, and those of a second mapping count again although they are the same
    physical pages.
    """
    if reader:
        conn = sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True, check_same_thread=False)
    else:
        conn = sqlite3.connect(path, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA mmap_size={MMAP_BYTES}")
        conn.execute("PRAGMA temp_store=MEMORY")
    except BaseException:
        conn.close()
        raise
    return conn


def file_of(conn: sqlite3.Connection) -> str | None:
    """The file holding the main database of ``conn`` (None: in memory; SQLite names files by
    absolute paths, and a deserialized database "x")."""
    path = conn.execute("PRAGMA database_list").fetchone()[2]
    return path if path and os.path.isabs(path) and os.path.isfile(path) else None


def connect(image) -> sqlite3.Connection:
    """A connection to an in-memory database holding ``image``."""
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    if hasattr(conn, "deserialize"):
        conn.deserialize(image)
        return conn
    fd, tmp = tempfile.mkstemp(suffix=".db")  # Python < 3.11: go through a file
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(image)
        src = sqlite3.connect(tmp)
        src.backup(conn)
        src.close()
    finally:
        os.unlink(tmp)
    return conn
