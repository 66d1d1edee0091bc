"""Leaf pages of table and index B-trees: where each cell goes (a ``Layout`` per B-tree: cell
sizes, pages, offsets), the order of index entries, and writing the pages (the C loops of
``pages.native`` or numpy, same bytes)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _arrays as ar
from . import pages as page_loops
from .records import (
    ROWS,
    Strings,
    even_split,
    native_args,
    put_values,
    put_varint,
    record_bytes,
    serial_types,
    varint_len,
)
from .schema import INDEX_MAX_CELL, LEAF_HDR, PAGE, TABLE_MAX_CELL, Column, Index, Table


@dataclass
class Layout:
    """Where each cell of a B-tree's leaf pages goes."""

    cols: list[Column]
    rows: np.ndarray | None  # rows of the columns, in cell order (None: all, in order)
    rowid: np.ndarray | None  # table B-trees: the rowid of each cell
    serials: dict  # column index -> serial types (int8) of an int column, per cell
    page: np.ndarray  # leaf page (0-based) of each cell
    cell_off: np.ndarray | None  # offset of each cell in its page (numpy writer)
    pfirst: np.ndarray | None  # first cell of each page
    content_start: np.ndarray | None  # per page (numpy writer)
    n_pages: int


def _cell_sizes(cols: list[Column], st: Strings, n: int, rows, rowid) -> tuple:
    """Cell size of each row and the serial types of the int columns (kept for the numpy
    writer; none with the C extension, which recomputes them as it writes)."""
    if page_loops.native is not None:
        cell = np.empty(n, np.int32)
        page_loops.native.cell_sizes(*native_args(cols, st, rows, rowid), cell)
        return cell, {}
    cell = np.zeros(n, np.int32)
    serials = {i: np.zeros(n, np.int8) for i, c in enumerate(cols) if c.kind == "int"}
    for lo in range(0, n, ROWS):
        hi = min(n, lo + ROWS)
        r = slice(lo, hi) if rows is None else rows[lo:hi]
        hdr = np.ones(hi - lo, np.int64)
        payload = np.zeros(hi - lo, np.int64)
        for i, c in enumerate(cols):
            s, z = serial_types(c, st, r)
            if i in serials:
                serials[i][lo:hi] = s
                hdr += 1  # int serial types are one-byte varints
            else:
                hdr += varint_len(s)
            payload += z
        if int(hdr.max()) >= 128:
            raise ValueError("too many columns")
        payload += hdr
        sz = varint_len(payload) + payload
        if rowid is not None:
            sz += varint_len(rowid[lo:hi])
        cell[lo:hi] = sz
    return cell, serials


def _page_firsts(page: np.ndarray) -> np.ndarray:
    """The first cell of each page (cells in page order)."""
    return np.flatnonzero(np.r_[True, page[1:] != page[:-1]]) if len(page) else \
        np.zeros(0, np.int64)


def _place(cell: np.ndarray, page: np.ndarray, n_pages: int) -> tuple:
    """Cell offsets: each page's cells fill its end, in order."""
    n = len(cell)
    pfirst = _page_firsts(page)
    ccum = np.zeros(n, np.int64)
    if n:
        np.cumsum(cell[:-1], out=ccum[1:])
    page_bytes = np.add.reduceat(cell.astype(np.int64), pfirst) if n else np.zeros(0, np.int64)
    content_start = np.full(n_pages, PAGE, np.int64)
    content_start[:len(page_bytes)] = PAGE - page_bytes
    ccum -= ccum[pfirst][page]
    ccum += content_start[page]
    return pfirst, ccum.astype(np.int32), content_start


def table_layout(t: Table, st: Strings) -> Layout:
    n = len(t.rowid)
    rowid = t.rowid.astype(np.int64, copy=False)
    cell, serials = _cell_sizes(t.columns, st, n, None, rowid)
    if n and int(cell.max()) > TABLE_MAX_CELL:
        raise ValueError("row too large for one page (no overflow pages are written)")
    # a page takes cells while their start fits below cap - max cell size
    need = cell.astype(np.int64) + 2
    cstart = np.zeros(n, np.int64)
    if n:
        np.cumsum(need[:-1], out=cstart[1:])
    cap = PAGE - LEAF_HDR - (int(need.max()) if n else 0)
    del need
    cstart //= max(cap, 1)
    page = cstart.astype(np.int32)
    del cstart
    if 2 * cap < PAGE - LEAF_HDR:  # cells over half a page can skip a page number: close gaps
        page = np.cumsum(np.r_[0, page[1:] != page[:-1]], dtype=np.int32) if n else page
    n_pages = int(page[-1]) + 1 if n else 1
    return _finish(Layout(t.columns, None, rowid, serials, page, None, None, None, n_pages),
                   cell)


def _finish(lay: Layout, cell: np.ndarray) -> Layout:
    """Where each page's cells start (and for the numpy writer, each cell's offset)."""
    if page_loops.native is not None:
        # an empty B-tree: one page, starting at cell 0
        lay.pfirst = _page_firsts(lay.page) if len(lay.page) else np.zeros(1, np.int64)
        if len(lay.pfirst) != lay.n_pages:  # every page holds a cell (empty B-tree: one page)
            raise ValueError("a leaf page without cells")
        return lay
    lay.pfirst, lay.cell_off, lay.content_start = _place(cell, lay.page, lay.n_pages)
    return lay


def _sort_keys(c: Column, st: Strings) -> list[np.ndarray]:
    """Arrays whose lexicographic order is SQLite's order of the column (NULLs first, text in
    BINARY order), most significant first."""
    if c.kind == "text":
        return [np.where(c.values < 0, -1, st.rank()[np.maximum(c.values, 0)])]
    v = c.values.astype(np.int64, copy=False)
    if c.null is None or not c.null.any():
        return [v]
    return [(~c.null).astype(np.int8), np.where(c.null, 0, v)]


def _index_order(keys: list[np.ndarray], rowid: np.ndarray) -> np.ndarray:
    """Order of the entries by (keys..., rowid): ``keys`` as _sort_keys gives them.

    Keys are packed, most significant first, into as few int64 words as their value ranges
    allow (a stable sort per word instead of per key); rows in rowid order need no rowid key.
    """
    n = len(rowid)
    inc = n < 2 or bool((rowid[1:] > rowid[:-1]).all())
    words = _packed(keys)
    if not inc:
        words.append(rowid.astype(np.int64, copy=False))
    if len(words) == 1:
        return ar.stable_order(words[0])
    return np.lexsort(words[::-1])


def _packed(keys: list[np.ndarray]) -> list[np.ndarray]:
    """``keys`` packed into int64 words with the same lexicographic order."""
    words: list[np.ndarray] = []
    word, used = None, 0
    for k in keys:
        k = k.astype(np.int64, copy=False)
        lo = int(k.min()) if len(k) else 0
        bits = (int(k.max()) - lo).bit_length() if len(k) else 0
        if word is not None and used + bits <= 62:
            word = (word << bits) | (k - lo)
            used += bits
            continue
        if word is not None:
            words.append(word)
        word, used = (k - lo if bits <= 62 else k), bits
    if word is not None:
        words.append(word)
    return words


def _scattered(order: np.ndarray) -> bool:
    """Whether reading rows in ``order`` jumps around (mostly far apart neighbours).

    Row-by-row reads in such an order wait on memory at every row (about 200 ns); a numpy
    gather of each column first costs about 25 ns per value. Orders close to row order (an
    index on (track, ts), on (kind, upid, ts)) are read as they are. Judged on a sample."""
    pairs = ar.neighbours(order)
    return pairs is not None and bool((np.abs(pairs[1] - pairs[0]) > 64).mean() > 0.25)


def _narrow(v: np.ndarray) -> np.ndarray:
    """Integers as int32 when they fit and the C writer reads them (it takes 4-byte items):
    gathered copies are kept until their leaves are written."""
    if page_loops.native is None or v.dtype != np.int64 or not len(v):
        return v
    lo, hi = int(v.min()), int(v.max())
    return v.astype(np.int32) if -(1 << 31) <= lo and hi < (1 << 31) else v


def index_layout(ix: Index, st: Strings) -> tuple[Layout, list[bytes]]:
    """Leaf layout of an index B-tree and the entries between its leaves (to go up a level).

    In an index B-tree every entry is stored once: the leaves hold runs of entries and each
    entry between two runs moves to the parent page.
    """
    cols = ix.key_columns()
    order = _index_order([a for c in cols for a in _sort_keys(c, st)], ix.rowid)
    cols.append(Column("int", ix.rowid))
    n = len(order)
    if _scattered(order):  # read in key order, the rows are all over the columns: gather them
        cols = [Column(c.kind, _narrow(c.values[order]), None if c.null is None else
                       c.null[order]) for c in cols]  # one numpy pass each, not row by row
        order = np.arange(n)
    cell, serials = _cell_sizes(cols, st, n, order, None)
    if n and int(cell.max()) > INDEX_MAX_CELL:
        raise ValueError(f"index {ix.name}: an entry too large for one page (no overflow pages)")
    cap = (PAGE - LEAF_HDR) // (int(cell.max()) + 2) if n else 1
    n_leaves = max(1, -(-(n + 1) // (cap + 1)))
    in_leaves = n - (n_leaves - 1)
    size = even_split(in_leaves, n_leaves)
    div_at = np.cumsum(size + 1)[:-1] - 1  # entry positions that move up
    is_div = np.zeros(n, bool)
    is_div[div_at] = True
    divs = [record_bytes([_value(c, r, st) for c in cols]) for r in order[div_at].tolist()]
    keep = ~is_div
    rows, cell = order[keep], cell[keep]
    serials = {i: a[keep] for i, a in serials.items()}
    del order, is_div
    page = np.repeat(np.arange(n_leaves, dtype=np.int32), size)
    return _finish(Layout(cols, rows, None, serials, page, None, None, None, n_leaves),
                   cell), divs


def _value(c: Column, r: int, st: Strings):
    """Row ``r`` of an index key column as record_bytes takes it (None, int, or the stored
    bytes)."""
    if c.kind == "text":
        i = int(c.values[r])
        return None if i < 0 else st.enc[i]
    if c.null is not None and c.null[r]:
        return None
    return int(c.values[r])


def write_leaves(out: np.ndarray, base: int, lay: Layout, kind: int, st: Strings) -> None:
    """Write the leaf pages of ``lay`` into ``out`` starting at byte ``base``."""
    if page_loops.native is not None:
        page_loops.native.write_leaves(*native_args(lay.cols, st, lay.rows, lay.rowid), out,
                                       base, PAGE, kind,
                                       np.ascontiguousarray(lay.pfirst, np.int64))
        return
    n = len(lay.page)
    hb = base + np.arange(lay.n_pages, dtype=np.int64) * PAGE
    pcount = np.bincount(lay.page, minlength=lay.n_pages) if n else np.zeros(lay.n_pages, int)
    out[hb] = kind
    out[hb + 3] = (pcount >> 8).astype(np.uint8)
    out[hb + 4] = (pcount & 0xFF).astype(np.uint8)
    cs = lay.content_start % PAGE  # 65536 is written as 0
    out[hb + 5] = (cs >> 8).astype(np.uint8)
    out[hb + 6] = (cs & 0xFF).astype(np.uint8)
    for lo in range(0, n, ROWS):
        hi = min(n, lo + ROWS)
        r = slice(lo, hi) if lay.rows is None else lay.rows[lo:hi]
        pg = lay.page[lo:hi].astype(np.int64)
        co = lay.cell_off[lo:hi].astype(np.int64)
        pp = base + pg * PAGE + LEAF_HDR + 2 * (np.arange(lo, hi) - lay.pfirst[pg])
        out[pp] = (co >> 8).astype(np.uint8)
        out[pp + 1] = (co & 0xFF).astype(np.uint8)
        p = base + pg * PAGE + co
        del pp, pg, co
        known = {i: a[lo:hi] for i, a in lay.serials.items()}
        ser = [serial_types(c, st, r, known.get(i)) for i, c in enumerate(lay.cols)]
        vl = [np.ones(hi - lo, np.int64) if i in known else varint_len(s)
              for i, (s, _) in enumerate(ser)]
        hdr = 1 + sum(vl)
        payload = hdr + sum(z for _, z in ser)
        ln = varint_len(payload)
        put_varint(out, p, payload, ln)
        p += ln
        if lay.rowid is not None:
            rid = lay.rowid[lo:hi]
            ln = varint_len(rid)
            put_varint(out, p, rid, ln)
            p += ln
        out[p] = hdr.astype(np.uint8)
        q = p + hdr  # values start after the header
        p += 1
        for c, (s, z), sl in zip(lay.cols, ser, vl, strict=True):
            put_varint(out, p, s, sl)
            p += sl
            if c.kind != "rowid":
                put_values(out, q, c, s, z, r, st)
            q += z
