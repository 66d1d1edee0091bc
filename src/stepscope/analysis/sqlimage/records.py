"""SQLite's record format, with numpy over whole columns: varints, the serial type of each
value, the string table (UTF-8, cut to MAX_TEXT), writing one column's values into cells; and
the few records made one at a time in Python (schema rows, index dividers)."""

from __future__ import annotations

import struct

import numpy as np

from .schema import MAX_TEXT, Column

ROWS = 1 << 18  # rows laid out per numpy pass (bounds temporary memory)
# bytes of an integer value per serial type (1..6: 1, 2, 3, 4, 6, 8 bytes; 8, 9: 0 and 1)
_ISIZE = np.array([0, 1, 2, 3, 4, 6, 8, 8, 0, 0], np.int64)


def varint_len(v: np.ndarray) -> np.ndarray:
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


def put_varint(out: np.ndarray, pos: np.ndarray, v: np.ndarray, ln: np.ndarray) -> None:
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


class Strings:
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


def native_args(cols: list[Column], st: Strings, rows, rowid) -> list:
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


def serial_types(c: Column, st: Strings, rows, known=None) -> tuple[np.ndarray, np.ndarray]:
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


def put_values(out: np.ndarray, q: np.ndarray, c: Column, s: np.ndarray, z: np.ndarray,
                rows, st: Strings) -> None:
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


def even_split(n: int, parts: int) -> np.ndarray:
    """Sizes of ``parts`` runs holding ``n`` items as evenly as possible (the first ones get
    the remainder, one each)."""
    return n // parts + (np.arange(parts) < n % parts)


def varint_bytes(v: int) -> bytes:
    if v < 0 or v >= 1 << 56:
        raise ValueError("varint out of range")
    out = [v & 0x7F]
    v >>= 7
    while v:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    return bytes(reversed(out))


def record_bytes(values: list) -> bytes:
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
    hdr = b"".join(varint_bytes(t) for t in types)
    hdr = varint_bytes(len(hdr) + 1) + hdr
    return hdr + b"".join(body)
