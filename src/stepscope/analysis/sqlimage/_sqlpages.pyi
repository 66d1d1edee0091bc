"""Stub of ``stepscope.analysis.sqlimage._sqlpages`` (``_sqlpages.c``): the image writer's
per-row loops in C. Optional: ``sqlimage.pages.native`` is this module or None; the numpy twin
in ``sqlimage.image`` writes the same bytes.

Both functions take the same nine leading arguments, made by ``image._native_args``: ``cols``
(a list of (type, values, null) per column: 0 rowid alias, 1 int64/int32, 2 float64, 3 text
ids), ``rows`` (cell -> row, or None), ``rowid`` (table B-trees, or None), ``nrows``,
``ncells``, and the string table (``blob``, ``offsets``, ``lengths``, ``nstrings``)."""

from typing import Any

import numpy as np

def cell_sizes(cols: list[tuple[int, Any, Any]], rows: np.ndarray | None,
               rowid: np.ndarray | None, nrows: int, ncells: int, blob: Any, offsets: Any,
               lengths: Any, nstrings: int, out: np.ndarray, /) -> None:
    """The cell size of each cell (int32, into ``out``); IndexError for rows or text ids out of
    range."""

def write_leaves(cols: list[tuple[int, Any, Any]], rows: np.ndarray | None,
                 rowid: np.ndarray | None, nrows: int, ncells: int, blob: Any, offsets: Any,
                 lengths: Any, nstrings: int, out: np.ndarray, base: int, page_size: int,
                 kind: int, page_first: np.ndarray, /) -> None:
    """The leaf pages into ``out`` from byte ``base``: page k holds cells ``page_first[k]`` to
    ``page_first[k + 1] - 1``; ValueError (nothing written) when they do not fit."""
