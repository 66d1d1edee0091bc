"""Batch encoding of recorded events into TracePackets for one sequence.

Each event becomes ``TracePacket{timestamp: delta, <template bytes>}`` where the template holds
everything but the timestamp (sequence id, flags, the TrackEvent). Events of one kind share a
template, so a batch is: varint lengths and deltas computed with numpy, then one gather/scatter
of template bytes. Python runs once per distinct template, not once per event; only blobs
(events with arguments, explicit tracks, flows, counter values) are encoded one by one, and the
events of a blob series (a converter's columns) in numpy passes over their varying parts.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from ..format import wire as w
from ..record.args import DEPTH_MAX, TEXT_MAX
from ..record.recorder import (
    BEGIN,
    BLOB_ID_MASK,
    COUNTER,
    END,
    INSTANT,
    SERIES_SHIFT,
    Blob,
    BlobSeries,
    NumberedBegin,
    blobs,
    counter_value,
    fast,
    kinds,
)

_TYPE_OF_KIND = {BEGIN: w.TYPE_SLICE_BEGIN, END: w.TYPE_SLICE_END, INSTANT: w.TYPE_INSTANT,
                 COUNTER: w.TYPE_COUNTER}
_THRESHOLDS = np.array([1 << (7 * k) for k in range(1, 10)], dtype=np.uint64)
_TS_TAG = w.TAG_PACKET_TIMESTAMP
_PACKET_TAG = w.TAG_TRACE_PACKET


def varint_len(values: np.ndarray) -> np.ndarray:
    return np.searchsorted(_THRESHOLDS, values, side="right").astype(np.int64) + 1


def _put_varints(out: np.ndarray, pos: np.ndarray, values: np.ndarray, lens: np.ndarray) -> None:
    values = values.astype(np.uint64, copy=False)
    for k in range(int(lens.max())):
        if k == 0:
            sel, v, ln, p = slice(None), values, lens, pos
        else:
            sel = np.nonzero(lens > k)[0]
            v, ln, p = values[sel], lens[sel], pos[sel]
        byte = (v >> np.uint64(7 * k)) & np.uint64(0x7F)
        byte |= np.where(ln > k + 1, np.uint64(0x80), np.uint64(0))
        out[p + k] = byte


def assemble(deltas: np.ndarray, tidx: np.ndarray, templates: Sequence[bytes]) -> bytes:
    """Serialize ``Trace.packet`` entries: timestamp ``deltas[i]`` + ``templates[tidx[i]]``.

    A negative delta means "no timestamp" (metadata-only packets). One C loop when the
    extension is built (``_fast.assemble``, the same bytes), else numpy (``assemble_numpy``).
    """
    if fast is not None:
        return fast.assemble(np.ascontiguousarray(deltas, dtype=np.int64),
                             np.ascontiguousarray(tidx, dtype=np.int64), list(templates))
    return assemble_numpy(deltas, tidx, templates)


def assemble_numpy(deltas: np.ndarray, tidx: np.ndarray, templates: Sequence[bytes]) -> bytes:
    """``assemble`` with numpy only: lengths and deltas vectorized, templates broadcast."""
    n = len(deltas)
    if n == 0:
        return b""
    tpl = np.frombuffer(b"".join(templates), dtype=np.uint8)
    tlen_all = np.fromiter((len(t) for t in templates), dtype=np.int64, count=len(templates))
    toff_all = np.zeros(len(templates), dtype=np.int64)
    np.cumsum(tlen_all[:-1], out=toff_all[1:])
    tl = tlen_all[tidx]
    has_ts = deltas >= 0
    d = np.where(has_ts, deltas, 0).astype(np.uint64)
    vl = np.where(has_ts, varint_len(d), -1)  # -1: no tag, no value
    plen = 1 + vl + tl
    pl_len = varint_len(plen.astype(np.uint64))
    size = 1 + pl_len + plen
    start = np.zeros(n, dtype=np.int64)
    np.cumsum(size[:-1], out=start[1:])
    total = int(start[-1] + size[-1])
    out = np.empty(total, dtype=np.uint8)
    out[start] = _PACKET_TAG
    _put_varints(out, start + 1, plen, pl_len)
    ts_pos = start + 1 + pl_len
    if has_ts.all():
        out[ts_pos] = _TS_TAG
        _put_varints(out, ts_pos + 1, d, vl)
    elif has_ts.any():
        sel = np.nonzero(has_ts)[0]
        out[ts_pos[sel]] = _TS_TAG
        _put_varints(out, ts_pos[sel] + 1, d[sel], vl[sel])
    tp_pos = ts_pos + 1 + vl
    _put_templates(out, tp_pos, tidx, templates, tpl, tl, toff_all)
    return out.tobytes()


BROADCAST_MIN = 32  # a template used this often is written by one broadcast assignment


def _put_templates(out, tp_pos, tidx, templates, tpl, tl, toff_all) -> None:
    """Copy each event's template bytes to its packet.

    Templates shared by many events (the fast BEGIN/END/INSTANT kinds) are written with one
    broadcast assignment each; the rest (blobs) with one gather/scatter over their bytes.
    """
    counts = np.bincount(tidx, minlength=len(templates))
    rest = np.ones(len(tidx), dtype=bool) if (counts < BROADCAST_MIN).any() else None
    for t in np.nonzero(counts >= BROADCAST_MIN)[0]:
        sel = tidx == t
        if rest is not None:
            rest &= ~sel
        length = len(templates[t])
        if length:
            idx = tp_pos[sel][:, None] + np.arange(length)
            out[idx] = np.frombuffer(templates[t], dtype=np.uint8)
    if rest is None or not rest.any():
        return
    pos, ti, ln = tp_pos[rest], tidx[rest], tl[rest]
    cum = np.zeros(len(ln), dtype=np.int64)
    np.cumsum(ln[:-1], out=cum[1:])
    nbytes = int(cum[-1] + ln[-1])
    ramp = np.arange(nbytes, dtype=np.int64)
    out[np.repeat(pos - cum, ln) + ramp] = tpl[np.repeat(toff_all[ti] - cum, ln) + ramp]


def packet(*fields: bytes) -> bytes:
    """One ``Trace.packet`` entry from already-encoded TracePacket fields."""
    body = b"".join(fields)
    return w.tag(w.TRACE_PACKET, w.LEN) + w.varint(len(body)) + body


class Interner:
    """Per-sequence interning: which iids this sequence has already defined."""

    def __init__(self) -> None:
        self.names: set[int] = set()
        self.categories: dict[str, int] = {}
        self.srclocs: dict[tuple, int] = {}
        self.arg_names: dict[str, int] = {}
        self.pending: list[bytes] = []  # InternedData fields to attach to the next packet
        self.arg_cache: dict = {}  # (name, type, value) -> encoded DebugAnnotation field
        self.heads: dict = {}  # (kind, eid, track) -> encoded type/name/categories/track fields

    def _define(self, field: int, iid: int, body: bytes) -> None:
        """Queue an InternedData entry (``field``: its kind) with ``iid`` (field 1) and the
        rest of its fields."""
        self.pending.append(w.f_bytes(field, w.f_varint(1, iid) + body))

    def _iid(self, table: dict, field: int, name: str) -> int:
        """The iid of ``name`` in ``table`` (categories, arg names), defined on first use."""
        iid = table.get(name)
        if iid is None:
            iid = table[name] = len(table) + 1
            self._define(field, iid, w.f_str(2, name))
        return iid

    def event(self, eid: int) -> tuple[int, list[int], int | None]:
        """iids (name, categories, source location) of an event kind, defining new ones."""
        kind = kinds[eid]
        if eid not in self.names:
            self.names.add(eid)
            self._define(w.ID_EVENT_NAMES, eid, w.f_str(2, kind.name))
        cats = [self.category(c) for c in kind.categories]
        loc = None
        if kind.srcloc is not None:
            loc = self.srclocs.get(kind.srcloc)
            if loc is None:
                loc = self.srclocs[kind.srcloc] = len(self.srclocs) + 1
                file, func, line = kind.srcloc
                self._define(w.ID_SOURCE_LOCATIONS, loc,
                             w.f_str(2, file) + w.f_str(3, func) + w.f_varint(4, line))
        return eid, cats, loc

    def category(self, name: str) -> int:
        return self._iid(self.categories, w.ID_EVENT_CATEGORIES, name)

    def arg_name(self, name: str) -> int:
        return self._iid(self.arg_names, w.ID_DEBUG_ANNOTATION_NAMES, name)

    def take_pending(self) -> bytes:
        if not self.pending:
            return b""
        data = w.f_bytes(w.PKT_INTERNED_DATA, b"".join(self.pending))
        self.pending.clear()
        return data


_varint = w.varint
_DA_TAG = w.tag(w.TE_DEBUG_ANNOTATIONS, w.LEN)
_DA_NAME_IID_TAG = w.tag(w.DA_NAME_IID, w.VARINT)
_DA_INT_TAG = w.tag(w.DA_INT, w.VARINT)
_DA_DOUBLE_TAG = w.tag(w.DA_DOUBLE, w.FIXED64)
_pack_d = struct.Struct("<d").pack
_INT64_MIN, _INT64_END = -(1 << 63), 1 << 63


def debug_value(interner: Interner, value, depth: int = 0) -> bytes:
    """The value part of a DebugAnnotation: typed, nested for dicts and lists. The public API's
    args come snapshotted (``record.args``: plain values, new containers, text), made by the
    same tests in the same order as here: a change here is a change there."""
    t = type(value)
    if t is int:  # the common cases first: step numbers, sizes, GPU launch parameters
        if _INT64_MIN <= value < _INT64_END:
            return _DA_INT_TAG + _varint(value)
    elif t is float:
        return _DA_DOUBLE_TAG + _pack_d(value)
    if isinstance(value, bool):
        return w.f_bool(w.DA_BOOL, value)
    if isinstance(value, int):
        if _INT64_MIN <= value < _INT64_END:
            return w.f_varint(w.DA_INT, value)
        if 0 <= value < (1 << 64):
            return w.f_varint(w.DA_UINT, value)
        try:
            return w.f_str(w.DA_STRING, str(value))
        except ValueError:  # past sys.get_int_max_str_digits(): the event must not be lost
            return w.f_str(w.DA_STRING, f"<{type(value).__name__}>")
    if isinstance(value, float):
        return w.f_double(w.DA_DOUBLE, value)
    if isinstance(value, str):
        return w.f_str(w.DA_STRING, value[:TEXT_MAX])
    if depth < DEPTH_MAX and isinstance(value, dict):
        return b"".join(
            w.f_bytes(w.DA_DICT_ENTRIES, w.f_str(w.DA_NAME, str(k)) + debug_value(interner, v,
                                                                                  depth + 1))
            for k, v in value.items())
    if depth < DEPTH_MAX and isinstance(value, (list, tuple)):
        return b"".join(w.f_bytes(w.DA_ARRAY_VALUES, debug_value(interner, v, depth + 1))
                        for v in value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        try:
            return debug_value(interner, value.item(), depth + 1)
        except Exception:
            pass
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return w.f_str(w.DA_STRING, text[:TEXT_MAX])


_SCALARS = frozenset((int, float, str, bool))
ARG_CACHE_SIZE = 8192


def debug_annotations(interner: Interner, args: dict) -> bytes:
    """Encoded ``debug_annotations`` fields.

    Other scalar (name, value) pairs are cached per sequence, since GPU records repeat the same
    grid/block/register values for every kernel of a name. Ints are encoded from a cached name
    prefix instead: as cheap as a cache hit, and ever-new values (step numbers, byte counts)
    neither miss nor evict. Bytes are concatenated, not joined: cheaper for a few args.
    """
    cache = interner.arg_cache
    out = b""
    for k, v in args.items():
        t = type(v)
        if t is int and _INT64_MIN <= v < _INT64_END:
            body = _int_arg_head(interner, k) + _varint(v)
            out += _DA_TAG + _varint(len(body)) + body
            continue
        if t in _SCALARS:
            key = (k, t, v)
            data = cache.get(key)
            if data is None:
                data = _annotation(interner, k, v)
                if len(cache) >= ARG_CACHE_SIZE:
                    cache.clear()
                cache[key] = data
        else:
            data = _annotation(interner, k, v)
        out += data
    return out


def _int_arg_head(interner: Interner, k) -> bytes:
    """A DebugAnnotation's body up to its int value: the interned name, the int tag."""
    cache = interner.arg_cache
    head = cache.get((k,))
    if head is None:
        head = cache[(k,)] = _DA_NAME_IID_TAG + _varint(interner.arg_name(str(k))) + _DA_INT_TAG
    return head


def _double_arg_head(interner: Interner, k) -> bytes:
    """A DebugAnnotation's body up to its double value: the interned name, the double tag."""
    cache = interner.arg_cache
    head = cache.get((k, float))
    if head is None:
        head = cache[(k, float)] = (_DA_NAME_IID_TAG + _varint(interner.arg_name(str(k)))
                                    + _DA_DOUBLE_TAG)
    return head


def _annotation(interner: Interner, k, v) -> bytes:
    """One ``debug_annotations`` field: interned name, typed value."""
    body = _DA_NAME_IID_TAG + _varint(interner.arg_name(str(k))) + debug_value(interner, v)
    return _DA_TAG + _varint(len(body)) + body


HEAD_CACHE_SIZE = 65536
_TE_TAG = w.tag(w.PKT_TRACK_EVENT, w.LEN)
_FLOW_TAG = w.tag(w.TE_FLOW_IDS, w.FIXED64)
_TFLOW_TAG = w.tag(w.TE_TERMINATING_FLOW_IDS, w.FIXED64)
_NAME_TAG = w.tag(w.TE_NAME, w.LEN)
_COUNTER_TAG = w.tag(w.TE_COUNTER_VALUE, w.VARINT)
_DOUBLE_COUNTER_TAG = w.tag(w.TE_DOUBLE_COUNTER_VALUE, w.FIXED64)
_pack_q = struct.Struct("<Q").pack


def track_event(interner: Interner, kind: int, eid: int = 0, track: int | None = None,
                args: dict | None = None, flows=None, tflows=None, value=None,
                name: str | None = None) -> bytes:
    """The TrackEvent field of a packet (name/categories interned in this sequence).

    ``name`` is written inline instead of interned: for names used once (``step 123``), so
    that no table grows with the length of the run. The type/name/category/track fields of
    each (kind, eid, track) are encoded once per sequence; only the parts that vary per event
    are encoded here.
    """
    key = (kind, eid, track, name is None)
    head = interner.heads.get(key)
    if head is None:
        head = _event_head(interner, kind, eid, track, name is None)
    body = head
    if name is not None:
        text = w.utf8(name)  # lone surrogates become U+FFFD
        body += _NAME_TAG + _varint(len(text)) + text
    if value is not None:
        if isinstance(value, float):
            body += _DOUBLE_COUNTER_TAG + _pack_d(value)
        else:
            body += _COUNTER_TAG + _varint(int(value))
    if args:
        body += debug_annotations(interner, args)
    if flows:
        body += b"".join([_FLOW_TAG + _pack_q(f & 0xFFFFFFFFFFFFFFFF) for f in flows])
    if tflows:
        body += b"".join([_TFLOW_TAG + _pack_q(f & 0xFFFFFFFFFFFFFFFF) for f in tflows])
    return _TE_TAG + _varint(len(body)) + body


def _event_head(interner: Interner, kind: int, eid: int, track: int | None,
                interned_name: bool) -> bytes:
    """Type, name iid (unless the name is inline: a oneof), categories, source location and
    track of an event kind in this sequence, cached in ``interner.heads``."""
    parts = [w.f_varint(w.TE_TYPE, _TYPE_OF_KIND[kind])]
    if eid:
        name_iid, cats, loc = interner.event(eid)
        if interned_name:
            parts.append(w.f_varint(w.TE_NAME_IID, name_iid))
        parts.extend(w.f_varint(w.TE_CATEGORY_IIDS, c) for c in cats)
        if loc is not None:
            parts.append(w.f_varint(w.TE_SOURCE_LOCATION_IID, loc))
    if track is not None:
        parts.append(w.f_varint(w.TE_TRACK_UUID, track))
    head = b"".join(parts)
    if len(interner.heads) >= HEAD_CACHE_SIZE:
        interner.heads.clear()
    interner.heads[(kind, eid, track, interned_name)] = head
    return head


def _numbered_parts(interner: Interner, cls: type[NumberedBegin]) -> tuple:
    """The C encoder's parts of ``cls``'s events in this sequence (cached with the heads)."""
    parts = interner.heads.get(cls)
    if parts is None:
        parts = interner.heads[cls] = (
            _TE_TAG, _event_head(interner, BEGIN, cls.eid, None, False), _NAME_TAG,
            cls.prefix, cls.suffix, _DA_TAG, _int_arg_head(interner, cls.arg))
    return parts


def numbered_event(interner: Interner, cls: type[NumberedBegin], n: int) -> bytes | None:
    """The TrackEvent field of ``cls(n)`` by one C call (None where the C path cannot: no
    extension, a number past int64, lone surrogates)."""
    if fast is None or type(n) is not int or not _INT64_MIN <= n < _INT64_END:
        return None
    try:
        return fast.numbered_event(*_numbered_parts(interner, cls), n)
    except UnicodeEncodeError:
        return None


def numbered_events(interner: Interner, cls: type[NumberedBegin], numbers: np.ndarray,
                    prefix: bytes) -> list[bytes]:
    """``prefix`` + the TrackEvent field of ``cls(n)`` for each int64 ``n`` of ``numbers`` (a
    batch's numbered codes): one C call for the batch."""
    if fast is not None:
        try:
            return fast.numbered_events(*_numbered_parts(interner, cls), prefix,
                                        np.ascontiguousarray(numbers, dtype=np.int64))
        except UnicodeEncodeError:
            pass
    return [prefix + blob_event(interner, cls(n)) for n in numbers.tolist()]


SERIES_CHUNK = 16384  # events of a series encoded per numpy pass


def blob_templates(interner: Interner, prefix: bytes, keys: np.ndarray) -> list[bytes]:
    """``prefix`` + the TrackEvent field of each blob event, by its code's magnitude (blob id,
    or series event: see ``recorder.SERIES_SHIFT``); a blob that is gone or cannot be encoded
    gives ``prefix`` alone: an empty packet, never a corrupt or lost file."""
    keys = np.asarray(keys, dtype=np.int64)
    k = keys & BLOB_ID_MASK
    item = (keys >> SERIES_SHIFT) - 1
    out = [prefix] * len(keys)
    plain = np.flatnonzero(item < 0)
    for p, b in zip(plain.tolist(), map(blobs.get, k[plain].tolist()), strict=True):
        if b is not None:
            try:
                out[p] = prefix + blob_event(interner, b)
            except Exception:
                pass
    at = np.flatnonzero(item >= 0)
    if at.size:
        for key in sorted(set(k[at].tolist())):  # (np.unique imports numpy.ma at first use)
            sel = at[k[at] == key]
            s = blobs.get(key)
            if s is None:
                continue
            for lo in range(0, len(sel), SERIES_CHUNK):  # (bounded scratch memory)
                part = sel[lo:lo + SERIES_CHUNK]
                try:
                    bodies = series_templates(interner, prefix, s, item[part])
                except Exception:
                    continue
                for p, t in zip(part.tolist(), bodies, strict=True):
                    out[p] = t
    return out


def _scatter(out: np.ndarray, pos: np.ndarray, seg: bytes) -> None:
    """``seg`` at each position ``pos`` of ``out``."""
    if seg and len(pos):
        out[pos[:, None] + np.arange(len(seg))] = np.frombuffer(seg, dtype=np.uint8)


def _put_fixed64(out: np.ndarray, pos: np.ndarray, values: np.ndarray) -> None:
    if len(pos):
        out[pos[:, None] + np.arange(8)] = values.astype("<u8" if values.dtype.kind in "iu"
                                                         else "<f8").view(np.uint8).reshape(-1, 8)


def series_templates(interner: Interner, prefix: bytes, s: BlobSeries, items: np.ndarray
                     ) -> list[bytes]:
    """``prefix`` + the TrackEvent field of events ``items`` of ``s``: the bytes
    ``blob_event`` gives for ``s.blob(i)`` (field for field: type, name, categories, track;
    counter value; the base's args, the event's int then float args; flows; terminating
    flows). Each base is encoded once; the rest are numpy passes over the events, whose index
    arrays take about (longest base) x 8 bytes per event: ``blob_templates`` passes at most
    ``SERIES_CHUNK`` events at a time. Events with several flows (a graph launch's), or a base
    with args beside counter values, go through ``blob_event``."""
    items = np.asarray(items, dtype=np.int64)
    kind = s.kind
    ub, inv = np.unique(s.base[items], return_inverse=True)
    inv = inv.ravel()
    values = None if s.values is None else s.values[items]
    head_of: list[bytes] = []
    args_of: list[bytes] = []
    for b in ub.tolist():
        eid, track, args = s.bases[b]
        key = (kind, eid, track, True)
        head_of.append(interner.heads.get(key) or _event_head(interner, kind, eid, track, True))
        args_of.append(debug_annotations(interner, args) if args else b"")
    slow = np.zeros(len(items), dtype=bool)
    if s.flow_lists is not None:
        slow = np.isin(items, np.fromiter(s.flow_lists, dtype=np.int64))
    if values is not None and any(args_of):
        slow[:] = True
    fast = np.flatnonzero(~slow)
    out: list[bytes] = [b""] * len(items)
    for p in np.flatnonzero(slow).tolist():
        out[p] = prefix + blob_event(interner, s.blob(int(items[p])))
    if not fast.size:
        return out
    it, binv = items[fast], inv[fast]
    n = len(it)
    base_bytes = [h + a for h, a in zip(head_of, args_of, strict=True)]
    base_len = np.array([len(x) for x in base_bytes], dtype=np.int64)
    body = base_len[binv]
    if values is not None:
        body += len(_DOUBLE_COUNTER_TAG) + 8
    heads = [_int_arg_head(interner, k) for k in s.int_names]
    ints = s.ints[it].astype(np.uint64) if heads else None
    arg_len = []
    for j, h in enumerate(heads):
        a = len(h) + varint_len(ints[:, j])
        arg_len.append(a)
        body += len(_DA_TAG) + varint_len(a.astype(np.uint64)) + a
    fheads = [_double_arg_head(interner, k) for k in s.float_names]
    for h in fheads:
        body += len(_DA_TAG) + len(_varint(len(h) + 8)) + len(h) + 8
    fl = None if s.flows is None else s.flows[it]
    tf = None if s.tflows is None else s.tflows[it]
    if fl is not None:
        body += (len(_FLOW_TAG) + 8) * (fl != 0)
    if tf is not None:
        body += (len(_TFLOW_TAG) + 8) * (tf != 0)
    blen = varint_len(body.astype(np.uint64))
    size = len(prefix) + len(_TE_TAG) + blen + body
    start = np.zeros(n, dtype=np.int64)
    np.cumsum(size[:-1], out=start[1:])
    buf = np.empty(int(start[-1] + size[-1]), dtype=np.uint8)
    _scatter(buf, start, prefix + _TE_TAG)
    pos = start + len(prefix) + len(_TE_TAG)
    _put_varints(buf, pos, body, blen)
    pos = pos + blen
    base_off = np.zeros(len(base_bytes), dtype=np.int64)
    np.cumsum(base_len[:-1], out=base_off[1:])
    _put_templates(buf, pos, binv, base_bytes, np.frombuffer(b"".join(base_bytes), np.uint8),
                   base_len[binv], base_off)
    pos = pos + base_len[binv]
    if values is not None:  # (a counter's value comes before its args: it has none here)
        _scatter(buf, pos, _DOUBLE_COUNTER_TAG)
        _put_fixed64(buf, pos + len(_DOUBLE_COUNTER_TAG), values[fast])
        pos = pos + len(_DOUBLE_COUNTER_TAG) + 8
    for j, h in enumerate(heads):
        a = arg_len[j]
        al = varint_len(a.astype(np.uint64))
        _scatter(buf, pos, _DA_TAG)
        _put_varints(buf, pos + len(_DA_TAG), a, al)
        pos = pos + len(_DA_TAG) + al
        _scatter(buf, pos, h)
        _put_varints(buf, pos + len(h), ints[:, j], a - len(h))
        pos = pos + a
    for j, h in enumerate(fheads):
        seg = _DA_TAG + _varint(len(h) + 8) + h
        _scatter(buf, pos, seg)
        _put_fixed64(buf, pos + len(seg), s.floats[it, j])
        pos = pos + len(seg) + 8
    for col, tag in ((fl, _FLOW_TAG), (tf, _TFLOW_TAG)):
        if col is not None:
            sel = np.flatnonzero(col != 0)
            _scatter(buf, pos[sel], tag)
            _put_fixed64(buf, pos[sel] + len(tag), col[sel])
            pos = pos + (len(tag) + 8) * (col != 0)
    data = buf.tobytes()
    ends = (start + size).tolist()
    for p, a, e in zip(fast.tolist(), start.tolist(), ends, strict=True):
        out[p] = data[a:e]
    return out


def blob_event(interner: Interner, blob: Blob) -> bytes:
    """The TrackEvent field of a blob."""
    if type(blob) is not Blob and isinstance(blob, NumberedBegin):
        body = numbered_event(interner, type(blob), blob.number)  # once per step: one C call
        if body is not None:
            return body
    value = blob.value
    return track_event(interner, blob.kind, blob.eid, blob.track, blob.args, blob.flows,
                       blob.tflows, None if value is None else counter_value(value), blob.name)
