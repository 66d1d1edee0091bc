"""Vectorised protobuf wire scanning with numpy.

Decoding a trace one packet at a time in Python costs microseconds per event, far too slow for
traces with millions of events. These helpers decode *many messages at once*: every function
takes arrays of positions into one byte buffer and works on all of them with numpy, looping only
over the number of fields in a message (a handful), never over the number of messages.

The byte buffer must be a ``uint8`` array padded with at least :data:`PAD` zero bytes, so that
reads past a message's end never leave the array (they are detected and flagged instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...format import wire as w
from . import loops

PAD = 32  # zero bytes appended to every buffer (>= the widest fixed-size read, _TPL_MAX + 8)

WT_VARINT, WT_I64, WT_LEN, WT_I32 = w.VARINT, w.FIXED64, w.LEN, w.FIXED32


def padded(data: bytes | bytearray | memoryview) -> np.ndarray:
    """A uint8 array of ``data`` followed by :data:`PAD` zero bytes."""
    out = np.zeros(len(data) + PAD, np.uint8)
    out[: len(data)] = np.frombuffer(data, np.uint8)
    return out


def varints(buf: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decode the varint starting at each position: (values as uint64, byte lengths).

    A varint longer than 10 bytes gets length -1.
    """
    pos = pos.astype(np.int64, copy=False)
    b = buf[pos]
    val = (b & 0x7F).astype(np.uint64)
    n = np.ones(len(pos), np.int64)
    cont = np.flatnonzero(b >= 0x80)
    k = 1
    while cont.size:
        if k >= 10:
            n[cont] = -1
            break
        bb = buf[pos[cont] + k]
        val[cont] |= (bb & 0x7F).astype(np.uint64) << np.uint64(7 * k)
        n[cont] += 1
        cont = cont[bb >= 0x80]
        k += 1
    return val, n


def fixed64(buf: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Little-endian 64-bit words at each position, as uint64."""
    idx = pos.astype(np.int64)[:, None] + np.arange(8)
    return np.ascontiguousarray(buf[idx]).view("<u8").ravel()


def fixed32(buf: np.ndarray, pos: np.ndarray) -> np.ndarray:
    idx = pos.astype(np.int64)[:, None] + np.arange(4)
    return np.ascontiguousarray(buf[idx]).view("<u4").ravel().astype(np.uint64)


@dataclass
class Fields:
    """Every field of a set of messages, one row per field occurrence (in wire order per message).

    ``msg`` indexes the scanned messages; ``val`` holds varint / fixed values; ``off``/``ln`` locate
    a length-delimited payload in the buffer. ``bad`` flags messages that are malformed.
    """

    msg: np.ndarray
    fid: np.ndarray
    wt: np.ndarray
    val: np.ndarray
    off: np.ndarray
    ln: np.ndarray
    bad: np.ndarray

    def select(self, fid: int) -> np.ndarray:
        return np.flatnonzero(self.fid == fid)


def scan(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> Fields:
    """Scan the fields of the messages ``buf[starts[i]:ends[i]]`` all at once."""
    m = len(starts)
    starts = starts.astype(np.int64, copy=False)
    ends = ends.astype(np.int64, copy=False)
    pos = starts.copy()
    bad = np.zeros(m, bool)
    active = np.flatnonzero(pos < ends)
    parts: list[tuple] = []
    while active.size:
        p = pos[active]
        end = ends[active]
        tag, tl = varints(buf, p)
        fid = (tag >> np.uint64(3)).astype(np.int64)
        wt = (tag & np.uint64(7)).astype(np.int8)
        p2 = p + tl
        val = np.zeros(len(active), np.uint64)
        off = p2.copy()
        ln = np.zeros(len(active), np.int64)
        nxt = np.full(len(active), np.iinfo(np.int64).max, np.int64)
        err = (tl < 0) | (fid <= 0) | (fid >= 1 << 29)
        i = np.flatnonzero(wt == WT_VARINT)
        if i.size:
            v, vl = varints(buf, p2[i])
            val[i] = v
            nxt[i] = p2[i] + vl
            err[i] |= vl < 0
        i = np.flatnonzero(wt == WT_LEN)
        if i.size:
            v, vl = varints(buf, p2[i])
            big = (vl < 0) | (v > np.uint64(1 << 40))
            v = np.where(big, 0, v).astype(np.int64)
            off[i] = p2[i] + vl
            ln[i] = v
            nxt[i] = off[i] + v
            err[i] |= big
        i = np.flatnonzero(wt == WT_I64)
        if i.size:
            ok = p2[i] + 8 <= end[i]
            val[i[ok]] = fixed64(buf, p2[i[ok]])
            nxt[i] = p2[i] + 8
        i = np.flatnonzero(wt == WT_I32)
        if i.size:
            ok = p2[i] + 4 <= end[i]
            val[i[ok]] = fixed32(buf, p2[i[ok]])
            nxt[i] = p2[i] + 4
        err |= (wt != 0) & (wt != 1) & (wt != 2) & (wt != 5)
        err |= nxt > end
        good = ~err
        if not good.all():
            bad[active[err]] = True
        parts.append(
            (active[good], fid[good], wt[good], val[good], off[good], ln[good])
        )
        pos[active] = np.where(err, end, nxt)
        active = active[good & (nxt < end)]
    if parts:
        # Rows come out grouped by field position: the k-th field of every message, then the
        # (k+1)-th; so for one message they are in wire order, and later rows override earlier.
        cols = [np.concatenate(c) for c in zip(*parts, strict=True)]
    else:
        types = (np.int64, np.int64, np.int8, np.uint64, np.int64, np.int64)
        cols = [np.zeros(0, t) for t in types]
    return Fields(*cols, bad=bad)


def split_repeated(
    buf: np.ndarray, start: int, end: int, tag: int = 0x0A, window: int = 1 << 16
) -> tuple[np.ndarray, np.ndarray, int]:
    """Split ``buf[start:end]``, a run of one repeated length-delimited field, into its items.

    Used for ``Trace.packet`` (tag 0x0A). Item boundaries form a chain (each item says where the
    next starts); the chain is found for all candidate positions (tag bytes) at once: by pruning
    the candidates nothing points at, or where that does not settle, by pointer doubling.
    Returns (payload starts, payload ends, stop) where ``stop`` is the offset where the chain
    stopped: ``end`` for a clean run; an item running past ``end`` (a truncated last item) or a
    byte that does not start an item leaves ``stop`` < ``end``.
    The C extension ``_decodeloops`` walks the chain item by item instead, with the same result.
    """
    if loops.native is not None:
        st, en, stop = loops.native.split_repeated(buf, start, end, tag)
        return np.frombuffer(st, np.int64), np.frombuffer(en, np.int64), stop
    cand = np.flatnonzero(buf[start:end] == tag).astype(np.int64) + start
    if cand.size == 0 or cand[0] != start:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), start
    ln, nl = varints(buf, cand + 1)
    ln = np.where((nl < 0) | (ln > np.uint64(1 << 40)), np.uint64(1 << 40), ln).astype(np.int64)
    body = cand + 1 + np.maximum(nl, 1)
    nxt = body + ln
    j = np.searchsorted(cand, nxt)
    jc = np.minimum(j, len(cand) - 1)
    is_node = (j < len(cand)) & (cand[jc] == nxt)
    sentinel = len(cand)
    succ = np.where(is_node, j, sentinel).astype(np.int64)
    succ = np.append(succ, sentinel)
    nodes = _chain_by_pruning(succ, sentinel)
    if nodes is None:
        nodes = _chain_by_doubling(succ, sentinel, window)
    last = int(nodes[-1])
    stop = int(nxt[last])
    if stop > end:  # the last item runs past the end: drop it
        nodes = nodes[:-1]
        stop = int(cand[last])
    return body[nodes], nxt[nodes], stop


def _chain_by_pruning(succ: np.ndarray, sentinel: int, rounds: int = 32) -> np.ndarray | None:
    """The chain from candidate 0, found by dropping candidates that no live candidate points
    at (candidate 0 stays), until nothing changes: what is left is exactly the chain, as every
    survivor has a live predecessor at a smaller position. Stray candidates (tag bytes inside
    payloads) rarely form paths of more than a few hops, so this takes a few cheap passes;
    None when it has not settled after ``rounds`` passes (then pointer doubling decides)."""
    alive = np.ones(sentinel, bool)
    count = sentinel
    for _ in range(rounds):
        has_pred = np.zeros(sentinel + 1, bool)
        has_pred[succ[:-1][alive]] = True
        has_pred[0] = True
        alive &= has_pred[:-1]
        new_count = int(np.count_nonzero(alive))
        if new_count == count:
            nodes = np.flatnonzero(alive)
            if (succ[nodes[:-1]] == nodes[1:]).all() and succ[nodes[-1]] == sentinel:
                return nodes
            return None
        count = new_count
    return None


def _chain_by_doubling(succ: np.ndarray, sentinel: int, window: int) -> np.ndarray:
    """The chain from candidate 0 by pointer doubling, a window of candidates at a time."""
    chain: list[np.ndarray] = []
    node = 0
    while True:
        lo, hi = node, min(node + window, sentinel)
        loc = succ[lo:hi] - lo
        loc = np.where((loc < 0) | (loc >= hi - lo), hi - lo, loc)
        jumps = [np.append(loc, hi - lo)]
        span = 1
        while span < hi - lo:
            jumps.append(jumps[-1][jumps[-1]])
            span *= 2
        reach = np.zeros(1, np.int64)
        for jmp in reversed(jumps):
            step = jmp[reach]
            reach = np.concatenate([reach, step[step < hi - lo]])
        reach.sort()
        reach += lo
        chain.append(reach)
        last = int(reach[-1])
        nxt_node = int(succ[last])
        if nxt_node == sentinel or nxt_node < hi:
            break
        node = nxt_node
    return np.concatenate(chain)
