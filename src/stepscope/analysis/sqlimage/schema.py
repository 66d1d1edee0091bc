"""What an image holds -- tables and indexes given as numpy columns -- and the limits of the
page format this writer keeps to (64 KiB pages, no overflow pages)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PAGE = 65536
# SQLite's largest payloads kept whole on a page (compared with whole cells: a few bytes on the
# safe side); larger ones it expects to spill into overflow pages, which this writer does not make
TABLE_MAX_CELL = PAGE - 35
INDEX_MAX_CELL = (PAGE - 12) * 64 // 255 - 23
MAX_TEXT = 8192  # bytes of a text value kept (keeps every cell on its page, no overflow pages)
LEAF_HDR, INTERIOR_HDR = 8, 12


@dataclass
class Column:
    """One column: ``kind`` is "rowid", "int", "real" or "text".

    ``values``: int64 / float64 array, or for text an int64 array of ids into ``strings``
    (-1: NULL). ``null``: optional bool mask of NULLs for int / real columns.
    """

    kind: str
    values: np.ndarray | None = None
    null: np.ndarray | None = None


@dataclass
class Table:
    name: str
    sql: str
    rowid: np.ndarray
    columns: list[Column]


@dataclass
class Index:
    """An index over columns of a table: entries (keys..., rowid).

    A key is a ``Column`` of kind "int" (nullable) or "text". Built as SQLite's own index B-tree
    would be, so no ``CREATE INDEX`` pass is needed.
    """

    name: str
    sql: str
    table: str
    keys: list[Column]
    rowid: np.ndarray

    def key_columns(self) -> list[Column]:
        for c in self.keys:
            if c.kind not in ("int", "text"):
                raise ValueError(f"index {self.name}: keys must be int or text columns")
        return list(self.keys)


def table_sql(name: str, columns: Sequence[tuple[str, str]]) -> str:
    """``CREATE TABLE name(column type, ...)`` from (column, type) pairs."""
    return f"CREATE TABLE {name}({', '.join(f'{c} {t}' for c, t in columns)})"


def index_sql(name: str, table: str, keys: Sequence[str]) -> str:
    return f"CREATE INDEX {name} ON {table}({', '.join(keys)})"
