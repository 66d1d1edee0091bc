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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import quote

import numpy as np

from .. import _arrays as ar
from .._threads import in_parallel
from . import pages as page_loops

PAGE = 65536
# SQLite's largest payloads kept whole on a page (compared with whole cells: a few bytes on the
# safe side); larger ones it expects to spill into overflow pages, which this writer does not make
_TABLE_MAX_CELL = PAGE - 35
_INDEX_MAX_CELL = (PAGE - 12) * 64 // 255 - 23
MAX_TEXT = 8192  # bytes of a text value kept (keeps every cell on its page, no overflow pages)
_LEAF_HDR, _INTERIOR_HDR = 8, 12


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


_ROWS = 1 << 18  # rows laid out per numpy pass (bounds temporary memory)
# bytes of an integer value per serial type (1..6: 1, 2, 3, 4, 6, 8 bytes; 8, 9: 0 and 1)
_ISIZE = np.array([0, 1, 2, 3, 4, 6, 8, 8, 0, 0], np.int64)


def _vlen(v: np.ndarray) -> np.ndarray:
    """SQLite varint length (1..8 bytes here) of non-negative values below 2**56."""
    out = np.ones(len(v), np.int64)
    if not len(v):
        return out
    top = int(v.max())
    for k in range(1, 8):
        if top < 1 << (7 * k):
            break
        out += v >= (1 << (7 * k))
    return out


def _put_varint(out: np.ndarray, pos: np.ndarray, v: np.ndarray, ln: np.ndarray) -> None:
    """SQLite varints are big-endian groups of 7 bits (values < 2**56 here)."""
    if not len(ln):
        return
    top = int(ln.max())
    if top == 1:  # the common case: one byte each
        out[pos] = v.astype(np.uint8)
        return
    v = v.astype(np.uint64)
    for k in range(top):
        sel = np.flatnonzero(ln > k)
        shift = (ln[sel] - 1 - k) * 7
        byte = (v[sel] >> shift.astype(np.uint64)) & np.uint64(0x7F)
        byte |= np.where(k < ln[sel] - 1, np.uint64(0x80), np.uint64(0))
        out[pos[sel] + k] = byte.astype(np.uint8)


def _window(a: np.ndarray, w: int) -> np.ndarray:
    """Windows of ``w`` bytes starting at every offset of ``a``: rows are copied whole."""
    return np.lib.stride_tricks.as_strided(a, shape=(len(a) - w + 1, w), strides=(1, 1))


def _int_serial(v: np.ndarray) -> np.ndarray:
    """Smallest serial type holding each integer (as SQLite writes them: same values)."""
    m = v ^ (v >> 63)  # v for v >= 0, -v - 1 for v < 0
    s = np.ones(len(v), np.int8)
    top = int(m.max()) if len(m) else 0
    for bits in (7, 15, 23, 31, 47):
        if top < (1 << bits):
            break
        s += m >= (1 << bits)
    s[v == 0] = 8
    s[v == 1] = 9
    return s


def _text_bytes(s: str | None) -> bytes:
    """UTF-8 of a cell, cut to MAX_TEXT bytes on a character boundary (never half a character:
    SQLite would refuse to return the column)."""
    b = (s or "").encode("utf-8", "replace")
    if len(b) <= MAX_TEXT:
        return b
    return b[:MAX_TEXT].decode("utf-8", "ignore").encode("utf-8")


class _Strings:
    def __init__(self, strings: list[str | None]) -> None:
        enc = [_text_bytes(s) for s in strings] + [b""]  # never empty
        self.enc = enc
        self.len = np.array([len(e) for e in enc], np.int64)
        self.off = np.zeros(len(enc), np.int64)
        if len(enc):
            np.cumsum(self.len[:-1], out=self.off[1:])
        self.blob = np.frombuffer(b"".join(enc) + b"\0", np.uint8)
        self._rank: np.ndarray | None = None

    def rank(self) -> np.ndarray:
        """Position of each string in SQLite's BINARY order (memcmp of the stored bytes);
        strings stored as the same bytes (cut to MAX_TEXT) share one, as SQLite sees them equal
        and orders their entries by the next key."""
        if self._rank is None:
            enc = self.enc
            order = sorted(range(len(enc)), key=enc.__getitem__)
            differs = [True] + [enc[a] != enc[b] for a, b in zip(order[1:], order, strict=False)]
            r = np.zeros(len(order), np.int64)
            r[np.array(order, np.int64)] = np.cumsum(differs) - 1
            self._rank = r
        return self._rank


_CTYPE = {"rowid": 0, "int": 1, "real": 2, "text": 3}


def _native_args(cols: list[Column], st: _Strings, rows, rowid) -> list:
    """The leading arguments of _sqlpages' functions (see _sqlpages.c)."""
    spec = []
    nrows = None
    for c in cols:
        if c.kind == "rowid":
            spec.append((0, None, None))
            continue
        if c.kind == "real":
            v = np.ascontiguousarray(c.values, np.float64)
        elif c.values.dtype in (np.int32, np.int64):  # read as they are
            v = np.ascontiguousarray(c.values)
        else:
            v = np.ascontiguousarray(c.values, np.int64)
        nl = None if c.null is None else np.ascontiguousarray(c.null, np.bool_)
        spec.append((_CTYPE[c.kind], v, nl))
        nrows = len(v) if nrows is None else min(nrows, len(v))
    if rowid is not None:
        rowid = np.ascontiguousarray(rowid, np.int64)
        nrows = len(rowid) if nrows is None else min(nrows, len(rowid))
    nrows = nrows or 0
    if rows is not None:
        rows = np.ascontiguousarray(rows, np.int64)
    ncells = nrows if rows is None else len(rows)
    return [spec, rows, rowid, nrows, ncells, st.blob, st.off, st.len, len(st.len)]


def _serial(c: Column, st: _Strings, rows, known=None) -> tuple[np.ndarray, np.ndarray]:
    """Serial types and value sizes of one column at ``rows`` (0: NULL / the rowid alias).

    ``known``: the serial types of an int column, computed before (they cost a few passes).
    """
    if known is not None:
        return known, _ISIZE[known]
    if c.kind == "rowid":
        z = np.zeros(_nrows(rows), np.int64)
        return z, z
    if c.kind == "int":
        s = _int_serial(c.values[rows].astype(np.int64, copy=False))
        if c.null is not None:
            s[c.null[rows]] = 0
        return s, _ISIZE[s]
    if c.kind == "real":
        if c.null is None:
            k = _nrows(rows)
            return np.full(k, 7, np.int64), np.full(k, 8, np.int64)
        nl = c.null[rows]
        return np.where(nl, 0, 7), np.where(nl, 0, 8)
    ids = c.values[rows]
    ln = st.len[np.maximum(ids, 0)]
    return np.where(ids < 0, 0, 2 * ln + 13), np.where(ids < 0, 0, ln)


def _nrows(rows) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else len(rows)


def _put_values(out: np.ndarray, q: np.ndarray, c: Column, s: np.ndarray, z: np.ndarray,
                rows, st: _Strings) -> None:
    """Write one column's values (serial types ``s``, sizes ``z``) at positions ``q``."""
    if c.kind == "int":
        v = c.values[rows].astype(np.int64, copy=False)
        present = np.flatnonzero(np.bincount(s, minlength=10)[1:7]) + 1
        for code in present.tolist():
            sel = np.flatnonzero(s == code)
            if len(sel):
                w = int(_ISIZE[code])
                b = v[sel].astype(">i8").view(np.uint8).reshape(-1, 8)
                _window(out, w)[q[sel]] = b[:, 8 - w:]
    elif c.kind == "real":
        sel = np.flatnonzero(z > 0) if c.null is not None else slice(None)
        b = c.values[rows].astype(">f8")[sel].view(np.uint8).reshape(-1, 8)
        _window(out, 8)[q[sel]] = b
    elif c.kind == "text":
        sel = np.flatnonzero(z > 0)
        if not len(sel):
            return
        ln = z[sel]
        src = st.off[c.values[rows][sel]]
        dst = q[sel]
        o = np.argsort(ln.astype(np.uint16), kind="stable")  # group rows by length
        ln = ln[o]
        cut = np.flatnonzero(np.r_[True, ln[1:] != ln[:-1], True])
        for a, b in zip(cut[:-1].tolist(), cut[1:].tolist(), strict=True):
            w = int(ln[a])
            g = o[a:b]
            _window(out, w)[dst[g]] = _window(st.blob, w)[src[g]]


@dataclass
class _Layout:
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


def _cell_sizes(cols: list[Column], st: _Strings, n: int, rows, rowid) -> tuple:
    """Cell size of each row and the serial types of the int columns (kept for the numpy
    writer; none with the C extension, which recomputes them as it writes)."""
    if page_loops.native is not None:
        cell = np.empty(n, np.int32)
        page_loops.native.cell_sizes(*_native_args(cols, st, rows, rowid), cell)
        return cell, {}
    cell = np.zeros(n, np.int32)
    serials = {i: np.zeros(n, np.int8) for i, c in enumerate(cols) if c.kind == "int"}
    for lo in range(0, n, _ROWS):
        hi = min(n, lo + _ROWS)
        r = slice(lo, hi) if rows is None else rows[lo:hi]
        hdr = np.ones(hi - lo, np.int64)
        payload = np.zeros(hi - lo, np.int64)
        for i, c in enumerate(cols):
            s, z = _serial(c, st, r)
            if i in serials:
                serials[i][lo:hi] = s
                hdr += 1  # int serial types are one-byte varints
            else:
                hdr += _vlen(s)
            payload += z
        if int(hdr.max()) >= 128:
            raise ValueError("too many columns")
        payload += hdr
        sz = _vlen(payload) + payload
        if rowid is not None:
            sz += _vlen(rowid[lo:hi])
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


def _table_layout(t: Table, st: _Strings) -> _Layout:
    n = len(t.rowid)
    rowid = t.rowid.astype(np.int64, copy=False)
    cell, serials = _cell_sizes(t.columns, st, n, None, rowid)
    if n and int(cell.max()) > _TABLE_MAX_CELL:
        raise ValueError("row too large for one page (no overflow pages are written)")
    # a page takes cells while their start fits below cap - max cell size
    need = cell.astype(np.int64) + 2
    cstart = np.zeros(n, np.int64)
    if n:
        np.cumsum(need[:-1], out=cstart[1:])
    cap = PAGE - _LEAF_HDR - (int(need.max()) if n else 0)
    del need
    cstart //= max(cap, 1)
    page = cstart.astype(np.int32)
    del cstart
    if 2 * cap < PAGE - _LEAF_HDR:  # cells over half a page can skip a page number: close gaps
        page = np.cumsum(np.r_[0, page[1:] != page[:-1]], dtype=np.int32) if n else page
    n_pages = int(page[-1]) + 1 if n else 1
    return _finish(_Layout(t.columns, None, rowid, serials, page, None, None, None, n_pages),
                   cell)


def _finish(lay: _Layout, cell: np.ndarray) -> _Layout:
    """Where each page's cells start (and for the numpy writer, each cell's offset)."""
    if page_loops.native is not None:
        # an empty B-tree: one page, starting at cell 0
        lay.pfirst = _page_firsts(lay.page) if len(lay.page) else np.zeros(1, np.int64)
        if len(lay.pfirst) != lay.n_pages:  # every page holds a cell (empty B-tree: one page)
            raise ValueError("a leaf page without cells")
        return lay
    lay.pfirst, lay.cell_off, lay.content_start = _place(cell, lay.page, lay.n_pages)
    return lay


def _sort_keys(c: Column, st: _Strings) -> list[np.ndarray]:
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


def _even_split(n: int, parts: int) -> np.ndarray:
    """Sizes of ``parts`` runs holding ``n`` items as evenly as possible (the first ones get
    the remainder, one each)."""
    return n // parts + (np.arange(parts) < n % parts)


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


def _index_layout(ix: Index, st: _Strings) -> tuple[_Layout, list[bytes]]:
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
    if n and int(cell.max()) > _INDEX_MAX_CELL:
        raise ValueError(f"index {ix.name}: an entry too large for one page (no overflow pages)")
    cap = (PAGE - _LEAF_HDR) // (int(cell.max()) + 2) if n else 1
    n_leaves = max(1, -(-(n + 1) // (cap + 1)))
    in_leaves = n - (n_leaves - 1)
    size = _even_split(in_leaves, n_leaves)
    div_at = np.cumsum(size + 1)[:-1] - 1  # entry positions that move up
    is_div = np.zeros(n, bool)
    is_div[div_at] = True
    divs = [_record([_value(c, r, st) for c in cols]) for r in order[div_at].tolist()]
    keep = ~is_div
    rows, cell = order[keep], cell[keep]
    serials = {i: a[keep] for i, a in serials.items()}
    del order, is_div
    page = np.repeat(np.arange(n_leaves, dtype=np.int32), size)
    return _finish(_Layout(cols, rows, None, serials, page, None, None, None, n_leaves),
                   cell), divs


def _value(c: Column, r: int, st: _Strings):
    """Row ``r`` of an index key column as _record takes it (None, int, or the stored bytes)."""
    if c.kind == "text":
        i = int(c.values[r])
        return None if i < 0 else st.enc[i]
    if c.null is not None and c.null[r]:
        return None
    return int(c.values[r])


def _write_leaves(out: np.ndarray, base: int, lay: _Layout, kind: int, st: _Strings) -> None:
    """Write the leaf pages of ``lay`` into ``out`` starting at byte ``base``."""
    if page_loops.native is not None:
        page_loops.native.write_leaves(*_native_args(lay.cols, st, lay.rows, lay.rowid), out,
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
    for lo in range(0, n, _ROWS):
        hi = min(n, lo + _ROWS)
        r = slice(lo, hi) if lay.rows is None else lay.rows[lo:hi]
        pg = lay.page[lo:hi].astype(np.int64)
        co = lay.cell_off[lo:hi].astype(np.int64)
        pp = base + pg * PAGE + _LEAF_HDR + 2 * (np.arange(lo, hi) - lay.pfirst[pg])
        out[pp] = (co >> 8).astype(np.uint8)
        out[pp + 1] = (co & 0xFF).astype(np.uint8)
        p = base + pg * PAGE + co
        del pp, pg, co
        known = {i: a[lo:hi] for i, a in lay.serials.items()}
        ser = [_serial(c, st, r, known.get(i)) for i, c in enumerate(lay.cols)]
        vl = [np.ones(hi - lo, np.int64) if i in known else _vlen(s)
              for i, (s, _) in enumerate(ser)]
        hdr = 1 + sum(vl)
        payload = hdr + sum(z for _, z in ser)
        ln = _vlen(payload)
        _put_varint(out, p, payload, ln)
        p += ln
        if lay.rowid is not None:
            rid = lay.rowid[lo:hi]
            ln = _vlen(rid)
            _put_varint(out, p, rid, ln)
            p += ln
        out[p] = hdr.astype(np.uint8)
        q = p + hdr  # values start after the header
        p += 1
        for c, (s, z), sl in zip(lay.cols, ser, vl, strict=True):
            _put_varint(out, p, s, sl)
            p += sl
            if c.kind != "rowid":
                _put_values(out, q, c, s, z, r, st)
            q += z


def _interior_pages(children: list[int], keys: list[int], first_page: int) -> tuple[list, list]:
    """One level of interior pages over ``children``; returns (pages, [(page_no, max_key)])."""
    per = (PAGE - _INTERIOR_HDR) // (2 + 4 + 9)
    # spread the children evenly: a last page with a single child would hold no cell at all,
    # which SQLite reads as a malformed database
    n_pages = -(-len(children) // per)
    sizes = _even_split(len(children), n_pages).tolist()
    bounds = [sum(sizes[:j]) for j in range(n_pages + 1)]
    pages, up = [], []
    for i, j in zip(bounds[:-1], bounds[1:], strict=True):
        ch, ks = children[i:j], keys[i:j]
        cells = [struct.pack(">I", c) + _varint(k) for c, k in zip(ch[:-1], ks[:-1], strict=True)]
        pages.append(_page(5, cells, right=ch[-1]))
        up.append((first_page + len(pages) - 1, ks[-1]))
    return pages, up


def _varint(v: int) -> bytes:
    if v < 0 or v >= 1 << 56:
        raise ValueError("varint out of range")
    out = [v & 0x7F]
    v >>= 7
    while v:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    return bytes(reversed(out))


def _page(kind: int, cells: list[bytes], right: int | None = None, offset: int = 0) -> bytes:
    """A B-tree page (``offset``: 100 for page 1, after the database header)."""
    hdr_len = _INTERIOR_HDR if right is not None else _LEAF_HDR
    page = bytearray(PAGE)
    end = PAGE
    ptrs = []
    for c in cells:
        end -= len(c)
        page[end : end + len(c)] = c
        ptrs.append(end)
    if offset + hdr_len + 2 * len(cells) > end:
        raise ValueError("page overflow")
    h = offset
    page[h] = kind
    struct.pack_into(">HHHB", page, h + 1, 0, len(cells), end % PAGE, 0)
    if right is not None:
        struct.pack_into(">I", page, h + 8, right)
    for i, p in enumerate(ptrs):
        struct.pack_into(">H", page, h + hdr_len + 2 * i, p)
    return bytes(page)


def _record(values: list) -> bytes:
    types, body = [], []
    for v in values:
        if v is None:
            types.append(0)
        elif isinstance(v, int):
            types.append(6)
            body.append(struct.pack(">q", v))
        elif isinstance(v, bytes):
            types.append(2 * len(v) + 13)
            body.append(v)
        else:
            b = str(v).encode("utf-8")
            types.append(2 * len(b) + 13)
            body.append(b)
    hdr = b"".join(_varint(t) for t in types)
    hdr = _varint(len(hdr) + 1) + hdr
    return hdr + b"".join(body)


def _index_interior(children: list[int], divs: list[bytes], first_page: int) -> tuple:
    """One level of interior pages of an index B-tree: (pages, their numbers, entries that go
    up). ``divs[i]`` is the entry between ``children[i]`` and ``children[i + 1]``."""
    per = (PAGE - _INTERIOR_HDR) // (2 + 4 + 9 + max(len(d) for d in divs)) + 1  # children
    n_pages = -(-len(children) // per)
    sizes = _even_split(len(children), n_pages).tolist()
    pages, up_divs, i = [], [], 0
    for j, sz in enumerate(sizes):
        ch, dv = children[i : i + sz], divs[i : i + sz - 1]
        cells = [struct.pack(">I", c) + _varint(len(d)) + d for c, d in zip(ch[:-1], dv,
                                                                              strict=True)]
        pages.append(_page(2, cells, right=ch[-1]))
        if j < n_pages - 1:
            up_divs.append(divs[i + sz - 1])
        i += sz
    return pages, list(range(first_page, first_page + n_pages)), up_divs


def build(tables: list[Table], strings: list[str | None], indexes: list[Index] | tuple = (),
          alloc: Callable[[int], np.ndarray] | None = None) -> np.ndarray:
    """The bytes (a uint8 array) of an SQLite database holding ``tables`` and ``indexes``.

    ``alloc(n)``: where to lay them out (n zero bytes, e.g. a mapped file); default: memory.
    """
    st = _Strings(strings)
    if any(c.kind == "text" for ix in indexes for c in ix.key_columns()):
        st.rank()  # computed once, before the threads
    # each B-tree's leaf layout is independent of the others: laid out on several threads
    layouts = in_parallel(lambda x: _table_layout(x, st) if isinstance(x, Table) else
                          _index_layout(x, st), [*tables, *indexes], cost=_layout_cost)
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
                pages, up = _interior_pages(children, keys, next_page)
                interior.extend(pages)
                next_page += len(pages)
                children, keys = [c for c, _ in up], [k for _, k in up]
        else:
            while len(children) > 1:
                pages, children, divs = _index_interior(children, divs, next_page)
                interior.extend(pages)
                next_page += len(pages)
        schema_rows.append((typ, name, tbl, children[0], sql))
    cells = []
    for i, row in enumerate(schema_rows, start=1):
        rec = _record(list(row))
        cells.append(_varint(len(rec)) + _varint(i) + rec)
    page1 = bytearray(_page(13, cells, offset=100))
    n_pages = next_page - 1
    page1[:100] = _header(n_pages)
    out = np.zeros(n_pages * PAGE, np.uint8) if alloc is None else alloc(n_pages * PAGE)
    out[:PAGE] = np.frombuffer(bytes(page1), np.uint8)

    def write(i: int) -> None:  # the B-trees' leaves lie in separate pages: one per thread
        typ, lay = plans[i][0], plans[i][4]
        _write_leaves(out, (firsts[i] - 1) * PAGE, lay, 13 if typ == "table" else 10, st)

    in_parallel(write, range(len(plans)), cost=lambda i: _write_cost(plans[i][4]))
    pos = (next_page - 1 - len(interior)) * PAGE
    for pg in interior:
        out[pos : pos + PAGE] = np.frombuffer(pg, np.uint8)
        pos += PAGE
    return out


def _write_cost(lay: _Layout) -> int:
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
