"""The SQLite image writer: numpy columns -> the bytes of an SQLite database file.

Generic: it knows tables, indexes, records and B-tree pages, nothing of traces. What the files
share: columns as :class:`image.Column` (rowid, int, real, text ids into one string table),
the page size and record format SQLite itself writes, and the C-or-Python choice in ``pages``.

* ``image`` -- tables and indexes laid out as B-tree pages, in memory or in a mapped file.
* ``pages`` -- ``native``: the C module ``_sqlpages`` (``_sqlpages.pyi``) or None.

Exports: ``Column``, ``Table``, ``Index``, ``table_sql``, ``index_sql``, ``build``,
``build_file``, ``connect``, ``open_file``, ``file_of``.
"""

from __future__ import annotations

from .image import (
    Column,
    Index,
    Table,
    build,
    build_file,
    connect,
    file_of,
    index_sql,
    open_file,
    table_sql,
)

__all__ = ["Column", "Index", "Table", "build", "build_file", "connect", "file_of",
           "index_sql", "open_file", "table_sql"]
