"""Debug annotations and source locations -> rows of ``args``, identical arg sets shared.

Keys are as trace processor writes them: ``debug.<name>``, ``debug.<dict>.<key>``,
``debug.<array>[i]`` (flat_key without the index), ``source.file_name`` / ``function_name`` /
``line_number``. value_type is 'int', 'uint', 'bool', 'real', 'string', 'pointer' or 'json'.
Slices whose args are equal share one arg_set_id (found by hashing whole sets with numpy).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ...format import wire as w
from .. import _arrays as ar
from . import protoscan as ps
from .model import NONE, Strings
from .packets import Acc, as_i64, last_len_of, last_of
from .state import State, trace_pb2, utf8_at

# value types of args rows
V_INT, V_UINT, V_BOOL, V_REAL, V_STRING, V_POINTER, V_JSON = range(7)
VALUE_TYPES = ("int", "uint", "bool", "real", "string", "pointer", "json")
_COMPLEX = (8, 9, 11, 12, 13, 14, 16)  # nested / dict / array / proto values: decoded in Python
# debug annotations scanned per numpy pass (the scan's temporaries are some 250 bytes each)
ANNOTATIONS_PER_PASS = 1 << 18


def _flatten(pb_ann, key: str, flat: str, rows: list, strings: Strings, argname) -> None:
    """Rows for one (possibly nested) DebugAnnotation, keys as trace processor writes them."""
    which = pb_ann.WhichOneof("value")
    if pb_ann.dict_entries:
        for e in pb_ann.dict_entries:
            nm = e.name or argname(e.name_iid)
            _flatten(e, f"{key}.{nm}", f"{flat}.{nm}", rows, strings, argname)
        return
    if pb_ann.array_values:
        for i, e in enumerate(pb_ann.array_values):
            _flatten(e, f"{key}[{i}]", flat, rows, strings, argname)
        return
    k, fk = strings.id(key), strings.id(flat)
    if which == "bool_value":
        rows.append((k, fk, V_BOOL, int(pb_ann.bool_value), -1, 0.0))
    elif which == "uint_value":
        v = pb_ann.uint_value
        rows.append((k, fk, V_UINT, v if v < (1 << 63) else v - (1 << 64), -1, 0.0))
    elif which == "int_value":
        rows.append((k, fk, V_INT, pb_ann.int_value, -1, 0.0))
    elif which == "double_value":
        rows.append((k, fk, V_REAL, 0, -1, pb_ann.double_value))
    elif which == "pointer_value":  # the same two's-complement reading as flat annotations
        v = pb_ann.pointer_value
        rows.append((k, fk, V_POINTER, v if v < (1 << 63) else v - (1 << 64), -1, 0.0))
    elif which == "legacy_json_value":
        rows.append((k, fk, V_JSON, 0, strings.id(pb_ann.legacy_json_value), 0.0))
    elif which == "string_value":
        rows.append((k, fk, V_STRING, 0, strings.id(pb_ann.string_value), 0.0))
    elif which is not None:
        rows.append((k, fk, V_STRING, 0, strings.id(str(getattr(pb_ann, which))), 0.0))


def _annotations(buf, aev, aoff, alen, lo: int, st: State, egen, ev_slice, stats: dict,
                 add) -> None:
    """Rows of the debug annotations ``aev`` (the ``lo``-th on: their order in a set)."""
    strings = st.strings
    f = ps.scan(buf, aoff, aoff + alen)
    na = len(aev)
    name_iid, _ = last_of(f, w.DA_NAME_IID, na, dtype=np.int64)
    nidx = st.interned.lookup("arg", egen[aev], name_iid)
    names = np.array(st.interned.vals.get("arg", []) + [NONE], np.int64)[nidx]
    noff, nlen = last_len_of(f, w.DA_NAME, na)
    for i in np.flatnonzero(noff >= 0).tolist():
        names[i] = strings.id(utf8_at(buf, int(noff[i]), int(nlen[i])))
    # "debug.<name>" keys
    uniq = np.unique(names[names >= 0])
    keymap = np.full(len(strings.list) + 1, NONE, np.int64)
    for u in uniq.tolist():
        keymap[u] = strings.id("debug." + strings.list[u])
    keys = np.where(names >= 0, keymap[np.maximum(names, 0)], NONE)
    vtype = np.full(na, -1, np.int64)
    ival = np.zeros(na, np.int64)
    sval = np.full(na, NONE, np.int64)
    rval = np.zeros(na, np.float64)
    for fid, vt in ((w.DA_BOOL, V_BOOL), (w.DA_UINT, V_UINT), (w.DA_INT, V_INT),
                    (w.DA_POINTER, V_POINTER)):
        rows = f.select(fid)
        vtype[f.msg[rows]] = vt
        ival[f.msg[rows]] = as_i64(f.val[rows])
    rows = f.select(w.DA_DOUBLE)
    vtype[f.msg[rows]] = V_REAL
    rval[f.msg[rows]] = f.val[rows].view(np.float64)
    rows = f.select(w.DA_STRING)
    rows = rows[f.wt[rows] == ps.WT_LEN]
    vtype[f.msg[rows]] = V_STRING
    for r in rows.tolist():
        sval[f.msg[r]] = strings.id(utf8_at(buf, int(f.off[r]), int(f.ln[r])))
    rows = f.select(w.DA_STRING_IID)
    if len(rows):
        vals = np.array(st.interned.vals.get("argstr", []) + [NONE], np.int64)
        idx = st.interned.lookup("argstr", egen[aev[f.msg[rows]]],
                                 as_i64(f.val[rows]))
        vtype[f.msg[rows]] = V_STRING
        sval[f.msg[rows]] = vals[idx]
    cx = np.zeros(na, bool)
    cx[f.msg[np.isin(f.fid, _COMPLEX)]] = True
    simple = ~cx & (vtype >= 0) & (keys >= 0)
    slices = ev_slice[aev]
    add(slices[simple], lo + np.flatnonzero(simple), keys[simple], keys[simple], vtype[simple],
        ival[simple], sval[simple], rval[simple])
    if cx.any():
        pb = trace_pb2()

        crow = []
        for i in np.flatnonzero(cx & (names >= 0)).tolist():
            try:
                ann = pb.DebugAnnotation.FromString(
                    buf[aoff[i] : aoff[i] + alen[i]].tobytes())
            except Exception:
                stats["corrupt_messages"] = stats.get("corrupt_messages", 0) + 1
                continue
            g = int(egen[aev[i]])

            def argname(iid, g=g):
                j = st.interned.lookup("arg", np.array([g]), np.array([iid]))[0]
                return strings.list[st.interned.vals["arg"][j]] if j >= 0 else str(iid)

            rows_i: list = []
            key = "debug." + strings.list[int(names[i])]
            _flatten(ann, key, key, rows_i, strings, argname)
            crow.extend((int(slices[i]), lo + i) + r for r in rows_i)
        if crow:
            a = list(zip(*crow, strict=True))
            add(*(np.array(c) for c in a[:6]), np.array(a[6], np.int64),
                np.array(a[7], np.float64))


def build_args(buf, E: Acc, st: State, egen, ev_slice, sl: dict, stats) -> dict:
    """Debug annotations and source locations -> args rows, identical arg sets shared."""
    strings = st.strings
    cols: dict[str, list] = defaultdict(list)

    def add(slice_ids, order, key, flat, vtype, ival, sval, rval):
        cols["slice"].append(slice_ids)
        cols["order"].append(order)
        cols["key"].append(key)
        cols["flat"].append(flat)
        cols["type"].append(vtype)
        cols["ival"].append(ival)
        cols["sval"].append(sval)
        cols["rval"].append(rval)

    aev = E.get("ann_ev")
    keep = ev_slice[aev] >= 0 if len(aev) else np.zeros(0, bool)
    aev = aev[keep]
    if len(aev):
        aoff, alen = E.get("ann_off")[keep], E.get("ann_len")[keep]
        for lo in range(0, len(aev), ANNOTATIONS_PER_PASS):
            hi = lo + ANNOTATIONS_PER_PASS
            _annotations(buf, aev[lo:hi], aoff[lo:hi], alen[lo:hi], lo, st, egen, ev_slice,
                         stats, add)
    # source locations: interned (by iid) or inline
    sev, siid = E.get("sli_ev"), E.get("sli_iid")
    keep = (siid > 0) & (ev_slice[sev] >= 0) if len(sev) else np.zeros(0, bool)
    sev, siid = sev[keep], siid[keep]
    locs: list[tuple[int, tuple]] = []
    if len(sev):
        idx = st.interned.lookup("srcloc", egen[sev], siid)
        vals = st.interned.vals.get("srcloc", [])
        locs.extend((int(ev_slice[e]), vals[j]) for e, j in zip(sev.tolist(), idx.tolist(),
                                                                 strict=True) if j >= 0)
    lev = E.get("sl_ev")
    if len(lev):
        pb = trace_pb2()
        for e, o, ln in zip(lev.tolist(), E.get("sl_off").tolist(), E.get("sl_len").tolist(),
                            strict=True):
            if ev_slice[e] >= 0:
                try:
                    s = pb.SourceLocation.FromString(buf[o : o + ln].tobytes())
                except Exception:  # a corrupt location loses itself, not the trace
                    stats["corrupt_source_locations"] = (
                        stats.get("corrupt_source_locations", 0) + 1)
                    continue
                locs.append((int(ev_slice[e]), (s.file_name, s.function_name, s.line_number)))
    if locs:
        uniq = {v: i for i, v in enumerate(dict.fromkeys(v for _, v in locs))}
        ut = list(uniq)
        fsid = np.array([strings.id(v[0]) for v in ut], np.int64)
        gsid = np.array([strings.id(v[1]) for v in ut], np.int64)
        line = np.array([v[2] for v in ut], np.int64)
        li = np.array([uniq[v] for _, v in locs], np.int64)
        ls = np.array([s for s, _ in locs], np.int64)
        k = len(ls)
        big = np.int64(1 << 40)
        for j, (key, vt, iv, sv) in enumerate((
            ("source.file_name", V_STRING, np.zeros(k, np.int64), fsid[li]),
            ("source.function_name", V_STRING, np.zeros(k, np.int64), gsid[li]),
            ("source.line_number", V_INT, line[li], np.full(k, NONE, np.int64)),
        )):
            kid = strings.id(key)
            add(ls, np.full(k, big + j), np.full(k, kid), np.full(k, kid), np.full(k, vt), iv,
                sv, np.zeros(k))
    if not cols:
        return {}
    c = {}
    for k in list(cols):  # (each column's parts freed as it is joined: one row set at a time)
        c[k] = np.concatenate(cols.pop(k))
    if len(c["slice"]) == 0:  # every annotation was dropped (e.g. unresolved names)
        return {}
    o = np.lexsort((c["order"], c["slice"]))
    for k in c:
        c[k] = c[k][o]
    s = c["slice"]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    pos = np.arange(len(s)) - np.repeat(starts, np.diff(np.r_[starts, len(s)]))
    m = ar.mix64
    h = m(c["key"].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
          ^ m(c["type"] + (c["flat"] << 8)) ^ m(c["ival"]) * np.uint64(3)
          ^ m(c["sval"]) * np.uint64(5) ^ m(c["rval"].view(np.int64)) * np.uint64(7)
          ^ m(pos) * np.uint64(11))
    set_hash = np.add.reduceat(h, starts) if len(starts) else h
    set_hash = ar.mix64(set_hash ^ ar.mix64(np.diff(np.r_[starts, len(s)])))
    uh, first, inv = np.unique(set_hash, return_index=True, return_inverse=True)
    rank = np.empty(len(uh), np.int64)
    rank[np.argsort(first)] = np.arange(len(uh))  # arg set ids in slice order, from 1
    set_id = rank[inv] + 1
    sl["arg_set_id"][s[starts]] = set_id
    rep = np.zeros(len(s), bool)
    rep_slices = s[starts[first]]
    rep[np.isin(s, rep_slices)] = True
    srow = np.repeat(set_id, np.diff(np.r_[starts, len(s)]))
    vt = c["type"][rep]
    ival, sval, rval = c["ival"][rep], c["sval"][rep], c["rval"][rep]
    is_str = (vt == V_STRING) | (vt == V_JSON)
    is_real = vt == V_REAL
    is_int = ~is_str & ~is_real
    # (no display_value: the args view makes it when read, see importer.ARGS_VIEW)
    vt_ids = np.array([strings.id(v) for v in VALUE_TYPES], np.int64)
    o = np.argsort(srow[rep], kind="stable")
    cols_out = {
        "arg_set_id": srow[rep], "flat_key": c["flat"][rep], "key": c["key"][rep],
        "int_value": ival, "int_null": ~is_int, "string_value": np.where(is_str, sval, NONE),
        "real_value": rval, "real_null": ~is_real, "value_type": vt_ids[vt],
    }
    del c, ival, sval, rval, vt
    for k in cols_out:
        cols_out[k] = cols_out[k][o]
    return cols_out
