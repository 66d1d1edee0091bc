"""The SQLite image writer: numpy columns -> the bytes of an SQLite database file.

Generic: it knows tables, indexes, records and B-tree pages, nothing of traces. What the files
share: columns as :class:`image.Column` (rowid, int, real, text ids into one string table),
the page size and record format SQLite itself writes, and the C-or-Python choice in ``pages``.

* ``schema``   -- what an image holds (``Column``, ``Table``, ``Index``) and the page limits.
* ``records``  -- SQLite's record format over whole columns: varints, serial types, strings.
* ``leaves``   -- leaf pages of table and index B-trees: layouts, entry order, writing.
* ``interior`` -- interior pages above the leaves; one B-tree page in Python.
* ``image``    -- the whole image (schema page, B-trees laid out on threads) in memory or in
  a mapped file, and opening it with SQLite.
* ``pages``    -- ``native``: the C module ``_sqlpages`` (``_sqlpages.pyi``) or None.

Exports: ``Column``, ``Table``, ``Index``, ``PAGE``, ``MAX_TEXT``, ``table_sql``,
``index_sql``, ``build``, ``build_file``, ``connect``, ``open_file``, ``file_of``.
"""

from __future__ import annotations

from .image import build, build_file, connect, file_of, open_file
from .schema import MAX_TEXT, PAGE, Column, Index, Table, index_sql, table_sql

__all__ = ["MAX_TEXT", "PAGE", "Column", "Index", "Table", "build", "build_file", "connect",
           "file_of", "index_sql", "open_file", "table_sql"]
