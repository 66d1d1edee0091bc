"""Build an SQLite database file image directly from numpy columns.

Inserting rows through ``sqlite3`` costs several microseconds per row (Python objects, binding,
B-tree inserts), which dominates loading a trace with millions of slices. Instead, the big tables
are laid out in SQLite's documented file format (https://www.sqlite.org/fileformat.html) with
numpy: table B-tree leaf pages filled in rowid order, interior pages above them, and page 1
holding ``sqlite_schema``. The image is then handed to SQLite (``Connection.deserialize``, or a
file), which reads it like any database it wrote itself.

Only what the loader needs is supported: rowid tables whose ``INTEGER PRIMARY KEY`` is the rowid,
columns of 64-bit integers, doubles, or UTF-8 text (each nullable), rows given in rowid order.
A table may be given fewer columns than its SQL declares: the trailing ones read as NULL.
"""

from __future__ import annotations

import sqlite3
import struct
from dataclasses import dataclass

import numpy as np

PAGE = 65536
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


_THRESH = np.array([1 << (7 * k) for k in range(1, 9)], dtype=np.uint64)


def _vlen(v: np.ndarray) -> np.ndarray:
    """SQLite varint length (1..9 bytes) of non-negative values."""
    return np.searchsorted(_THRESH, v.astype(np.uint64), side="right").astype(np.int64) + 1


def _put_varint(out: np.ndarray, pos: np.ndarray, v: np.ndarray, ln: np.ndarray) -> None:
    """SQLite varints are big-endian groups of 7 bits (values < 2**56 here)."""
    if not len(ln):
        return
    if int(ln.max()) == 1:  # the common case: one byte each
        out[pos] = v.astype(np.uint8)
        return
    v = v.astype(np.uint64)
    for k in range(int(ln.max())):
        sel = np.flatnonzero(ln > k)
        shift = (ln[sel] - 1 - k) * 7
        byte = (v[sel] >> shift.astype(np.uint64)) & np.uint64(0x7F)
        byte |= np.where(k < ln[sel] - 1, np.uint64(0x80), np.uint64(0))
        out[pos[sel] + k] = byte.astype(np.uint8)


def _put_be64(out: np.ndarray, pos: np.ndarray, v: np.ndarray) -> None:
    b = v.astype(">i8" if v.dtype.kind in "iu" else ">f8").view(np.uint8).reshape(-1, 8)
    # 8-byte windows starting at every offset of ``out``: rows are copied whole
    win = np.lib.stride_tricks.as_strided(out, shape=(len(out) - 7, 8), strides=(1, 1))
    win[pos] = b


class _Strings:
    def __init__(self, strings: list[str | None]) -> None:
        enc = [(s or "").encode("utf-8")[:MAX_TEXT] for s in strings] + [b""]  # never empty
        self.len = np.array([len(e) for e in enc], np.int64)
        self.off = np.zeros(len(enc), np.int64)
        if len(enc):
            np.cumsum(self.len[:-1], out=self.off[1:])
        self.blob = np.frombuffer(b"".join(enc) or b"\0", np.uint8)


def _serial(c: Column, st: _Strings, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Serial types and value sizes of one column (0: NULL / the rowid alias)."""
    if c.kind == "rowid":
        z = np.zeros(n, np.int64)
        return z, z
    if c.kind in ("int", "real"):
        if c.null is None:
            return np.full(n, 6 if c.kind == "int" else 7, np.int64), np.full(n, 8, np.int64)
        return (np.where(c.null, 0, 6 if c.kind == "int" else 7),
                np.where(c.null, 0, 8))
    ids = c.values
    ln = st.len[np.maximum(ids, 0)]
    return np.where(ids < 0, 0, 2 * ln + 13), np.where(ids < 0, 0, ln)


def _leaf_pages(t: Table, st: _Strings, first_page: int) -> tuple[np.ndarray, np.ndarray]:
    """Leaf pages of a table B-tree; returns (page bytes, last rowid of each page)."""
    n = len(t.rowid)
    # pass 1: record header and body sizes (columns' serial types recomputed in pass 2, so
    # that only a few n-sized arrays are alive at a time)
    hdr = np.ones(n, np.int64)
    body = np.zeros(n, np.int64)
    for c in t.columns:
        s, z = _serial(c, st, n)
        hdr += _vlen(s)
        body += z
    payload = hdr + body
    rowid = t.rowid.astype(np.int64)
    cell = _vlen(payload) + _vlen(rowid) + payload
    if n and int(cell.max()) + 2 > PAGE - _LEAF_HDR:
        raise ValueError("row too large for one page")
    # page assignment: a page takes cells while their start fits below cap - max cell size
    need = cell + 2
    cstart = np.zeros(n, np.int64)
    if n:
        np.cumsum(need[:-1], out=cstart[1:])
    cap = PAGE - _LEAF_HDR - (int(need.max()) if n else 0)
    page = cstart // max(cap, 1)
    n_pages = int(page[-1]) + 1 if n else 1
    out = np.zeros(n_pages * PAGE, np.uint8)
    if not n:
        out[0] = 13
        return out, np.zeros(1, np.int64)
    pfirst = np.flatnonzero(np.r_[True, page[1:] != page[:-1]])
    pcount = np.diff(np.r_[pfirst, n])
    idx_in_page = np.arange(n) - np.repeat(pfirst, pcount)
    # cell contents go at the end of the page, in order
    ccum = np.zeros(n, np.int64)
    np.cumsum(cell[:-1], out=ccum[1:])
    page_bytes = np.add.reduceat(cell, pfirst)
    content_start = PAGE - page_bytes  # per page
    cell_off = content_start[page] + (ccum - ccum[pfirst][page])
    base = page * PAGE
    # page headers
    hb = np.arange(n_pages) * PAGE
    out[hb] = 13
    out[hb + 3] = (pcount >> 8).astype(np.uint8)
    out[hb + 4] = (pcount & 0xFF).astype(np.uint8)
    cs = content_start % PAGE  # 65536 is written as 0
    out[hb + 5] = (cs >> 8).astype(np.uint8)
    out[hb + 6] = (cs & 0xFF).astype(np.uint8)
    # cell pointers
    pp = base + _LEAF_HDR + 2 * idx_in_page
    out[pp] = (cell_off >> 8).astype(np.uint8)
    out[pp + 1] = (cell_off & 0xFF).astype(np.uint8)
    # cells: payload length, rowid, record header, values
    p = base + cell_off
    lp = _vlen(payload)
    _put_varint(out, p, payload, lp)
    p = p + lp
    lr = _vlen(rowid)
    _put_varint(out, p, rowid, lr)
    p = p + lr
    out[p] = hdr.astype(np.uint8)
    q = p + hdr  # values start after the header
    p = p + 1
    for c in t.columns:
        s, z = _serial(c, st, n)
        sl = _vlen(s)
        _put_varint(out, p, s, sl)
        p = p + sl
        if c.kind in ("int", "real"):
            sel = np.flatnonzero(z > 0) if c.null is not None else slice(None)
            vals = c.values.astype(np.int64 if c.kind == "int" else np.float64)
            _put_be64(out, q[sel], vals[sel])
        elif c.kind == "text":
            sel = np.flatnonzero(z > 0)
            if len(sel):
                ln = z[sel]
                total = int(ln.sum())
                cum = np.zeros(len(sel), np.int64)
                np.cumsum(ln[:-1], out=cum[1:])
                ramp = np.arange(total, dtype=np.int64)
                dst = np.repeat(q[sel] - cum, ln) + ramp
                src = np.repeat(st.off[c.values[sel]] - cum, ln) + ramp
                out[dst] = st.blob[src]
                del dst, src, ramp
        q = q + z
    last_rowid = rowid[np.r_[pfirst[1:] - 1, n - 1]]
    return out, last_rowid


def _interior_pages(children: list[int], keys: list[int], first_page: int) -> tuple[list, list]:
    """One level of interior pages over ``children``; returns (pages, [(page_no, max_key)])."""
    per = (PAGE - _INTERIOR_HDR) // (2 + 4 + 9)
    pages, up = [], []
    for i in range(0, len(children), per):
        ch, ks = children[i : i + per], keys[i : i + per]
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
        else:
            b = str(v).encode("utf-8")
            types.append(2 * len(b) + 13)
            body.append(b)
    hdr = b"".join(_varint(t) for t in types)
    hdr = _varint(len(hdr) + 1) + hdr
    return hdr + b"".join(body)


def build(tables: list[Table], strings: list[str | None]) -> bytes:
    """The bytes of an SQLite database holding ``tables`` (schema + rows)."""
    st = _Strings(strings)
    chunks: list = []
    next_page = 2
    schema_rows = []
    for t in tables:
        leaves, last = _leaf_pages(t, st, next_page)
        n_leaves = len(leaves) // PAGE
        chunks.append(leaves)
        children = list(range(next_page, next_page + n_leaves))
        keys = last.tolist()
        next_page += n_leaves
        while len(children) > 1:
            pages, up = _interior_pages(children, keys, next_page)
            chunks.extend(pages)
            next_page += len(pages)
            children, keys = [c for c, _ in up], [k for _, k in up]
        schema_rows.append(("table", t.name, t.name, children[0], t.sql))
    cells = []
    for i, row in enumerate(schema_rows, start=1):
        rec = _record(list(row))
        cells.append(_varint(len(rec)) + _varint(i) + rec)
    page1 = bytearray(_page(13, cells, offset=100))
    n_pages = next_page - 1
    page1[:100] = _header(n_pages)
    return b"".join([bytes(page1), *chunks])  # numpy pages join through the buffer protocol


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


def connect(image: bytes, path: str = ":memory:") -> sqlite3.Connection:
    """A connection to a database holding ``image`` (in memory, or written to ``path``)."""
    if path != ":memory:":
        with open(path, "wb") as f:
            f.write(image)
        return sqlite3.connect(path, check_same_thread=False)
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    if hasattr(conn, "deserialize"):
        conn.deserialize(image)
        return conn
    import os
    import tempfile

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
