"""The summaries' slice base, laid into the embedded engine's database at load time.

It is built by ``POST_LOAD``, a post-load table builder the embedded engine hands the importer
(``tp.importer.PostLoad``): the importer runs it on the decoded columns and lays its table out
in the same database image, without knowing what it is for.

Every summary reads ``ss_slice`` (``sql/_base.sql``): the finished slices with their process
(upid), thread (utid), end and event kind (kind_id). Computed as a CTE and then indexed by
SQLite, it costs two passes over every slice (about 9 s at 5M slices). The importer holds the
slice columns in numpy already, so it computes the same values (with no filter set) and writes
them, with the indexes the overview's union window and the operators' GROUP BY read, into the
database image as table ``SS_TABLE``.

That table holds every slice once: trace processor's ``slice`` is a view over it (its columns,
in its order), and the rows of ``ss_slice`` are those with an upid (``SS_BASE_ROWS``; the others,
unfinished or on a track no process owns, have NULL base columns).
``sharedbase.shared_base`` reads that table instead of computing the CTE when no filter is set.

The rules are _base.sql's; the owner of each track comes from running _base.sql's own
``ss_track_info`` on the track tables, and the kind of each slice from its category and name
strings (``_schema``'s) as the CASE there reads them. Tests check the table against the CTE on
written traces.
"""

from __future__ import annotations

import sqlite3

import numpy as np

from ... import _schema as sc
from ..._schema import phase_of
from .. import sqlimage as si
from ..tp.importer import (
    SLICE_COLUMNS,
    SLICE_TRACK_INDEX,
    SLICE_TRACK_INDEX_KEYS,
    Laid,
    PostLoad,
    track_tables,
)
from ..tp.model import Tables
from .sqlfiles import Filters, base_ctes

SS_TABLE = "ss_slice_base"
# the columns of _base.sql's ss_slice, in its order, with their declared types
_COLUMNS = (("id", "INTEGER PRIMARY KEY"), ("ts", "INTEGER"), ("dur", "INTEGER"),
            ("end_ts", "INTEGER"), ("track_id", "INTEGER"), ("category", "TEXT"),
            ("name", "TEXT"), ("parent_id", "INTEGER"), ("arg_set_id", "INTEGER"),
            ("upid", "INTEGER"), ("utid", "INTEGER"), ("kind_id", "INTEGER"))
SS_COLUMNS = tuple(n for n, _ in _COLUMNS)
# with the slice base made, trace processor's slice (SLICE_COLUMNS) is a view over SS_TABLE,
# which has its columns after its own (depth, thread_ts, thread_dur)
SS_SCHEMA = si.table_sql(SS_TABLE, _COLUMNS + tuple(c for c in SLICE_COLUMNS
                                                    if c[0] not in SS_COLUMNS))
SLICE_VIEW = (f"CREATE VIEW slice AS SELECT {', '.join(n for n, _ in SLICE_COLUMNS)} "
              f"FROM {SS_TABLE}")
# the rows of ss_slice: those with an upid, tested on kind_id first (set only on such rows), so
# that a kind index answers it without reading the row
SS_BASE_ROWS = "kind_id IS NOT NULL OR upid IS NOT NULL"
# the order the overview's union window reads ss_slice in (summaries indexes its own copy alike)
SS_INDEX_KEYS = ("kind_id", "upid", "ts", "end_ts")
SS_INDEX = f"{SS_TABLE}_kind"
# the operators' statistics per range name read their rows in this order (no sort for the
# GROUP BY name; the index holds every column they read, upid for SS_BASE_ROWS)
SS_NAME_INDEX_KEYS = ("kind_id", "name", "dur", "upid")
SS_NAME_INDEX = f"{SS_TABLE}_name"

# kind_id by category (_base.sql's CASE); 'phase' goes by name, None = NULL, others: 6
KIND_OF_CATEGORY = {sc.CAT_STEP: 0, sc.CAT_DATALOADER: 1, sc.CAT_RUNTIME: 7, sc.CAT_DRIVER: 7,
                    sc.CAT_SYNC: 8, sc.CAT_KERNEL: 9, sc.CAT_COMMUNICATION: 10,
                    sc.CAT_MEMCPY: 11, sc.CAT_MEMSET: 12, sc.CAT_GPU_RANGE: 13,
                    sc.CAT_COLLECTIVE: 14, sc.CAT_STEPSCOPE: None}
KIND_OF_PHASE = {sc.PHASE_DATALOADER: 1, sc.PHASE_FORWARD: 2, sc.PHASE_BACKWARD: 3,
                 sc.PHASE_OPTIMIZATION: 4}  # by _schema.phase_of(name): the spellings
# _base.sql's placeholder phase_kind recognizes
_USER, _OTHER_PHASE = 6, 5
# _base.sql's placeholders that read the slices from the slice base instead of ``slice``
PLACEHOLDERS = {"slices": f"main.{SS_TABLE}",
                "step_rows": f"s.kind_id = {KIND_OF_CATEGORY[sc.CAT_STEP]}"}


def track_owners(conn: sqlite3.Connection) -> dict[int, tuple[int, int | None]]:
    """track id -> (upid, utid) as _base.sql's ss_track_info gives them (every track)."""
    ctes = []
    for name, cols, body in base_ctes(Filters()):
        ctes.append(f"{name}{cols} AS ({body})")
        if name == "ss_track_info":
            break
    sql = f"WITH RECURSIVE {', '.join(ctes)} SELECT track_id, upid, utid FROM ss_track_info"
    return {int(t): (int(u), None if ut is None else int(ut))
            for t, u, ut in conn.execute(sql)}


def kinds(strings: list[str], category: np.ndarray, name: np.ndarray, dur: np.ndarray) -> tuple:
    """kind_id of each slice and its NULL mask, from category / name string ids (-1: NULL) and
    duration (a user range of none is an instant: no kind)."""
    n = len(strings)  # index n of the lookup arrays: a NULL string
    by_cat = np.full(n + 1, _USER, np.int64)
    null_cat = np.zeros(n + 1, bool)
    phase = -1
    # only the strings slices use as categories, then as phase names, are looked at (the
    # string table also holds every arg's and track's text: a million, in a big trace)
    for i in np.unique(category[category >= 0]).tolist():
        s = strings[i]
        if s in KIND_OF_CATEGORY:
            k = KIND_OF_CATEGORY[s]
            by_cat[i] = -1 if k is None else k
            null_cat[i] = k is None
        elif s == sc.CAT_PHASE:
            phase = i
    cat = np.where(category < 0, n, category)
    kind = by_cat[cat]
    if phase >= 0:
        is_phase = category == phase
        names = np.where(name < 0, n, name)[is_phase]
        by_name = np.full(n + 1, _OTHER_PHASE, np.int64)
        for i in np.unique(names[names < n]).tolist():
            by_name[i] = KIND_OF_PHASE.get(phase_of(strings[i]), _OTHER_PHASE)
        kind[is_phase] = by_name[names]
    return kind, null_cat[cat] | ((kind == _USER) & (dur == 0))


def image_parts(slices: dict, strings: list[str],
                owners: dict[int, tuple[int, int | None]]) -> tuple[si.Table, list[si.Index]]:
    """SS_TABLE (every slice) and its indexes, from the importer's slice columns."""
    track = slices["track_id"].astype(np.int64, copy=False)
    known = np.array(sorted(owners), np.int64)
    at = np.minimum(np.searchsorted(known, track), max(len(known) - 1, 0))
    keep = slices["dur"] >= 0  # finished slices on listed tracks: the base rows
    if len(known):
        keep &= known[at] == track
    else:
        keep[:] = False
    other = ~keep  # the other rows: no base columns
    own = [owners[k] for k in known.tolist()] or [(0, None)]
    upid_of = np.array([u for u, _ in own], np.int64)
    utid_of = np.array([0 if t is None else t for _, t in own], np.int64)
    no_utid = np.array([t is None for _, t in own], bool)
    ts, dur, cat, name = slices["ts"], slices["dur"], slices["category"], slices["name"]
    kind, kind_null = kinds(strings, cat, name, dur)
    upid, utid = upid_of[at], utid_of[at]
    parent, args = slices["parent_id"], slices["arg_set_id"]
    table = si.Table(SS_TABLE, SS_SCHEMA, slices["id"], [
        si.Column("rowid"), si.Column("int", ts), si.Column("int", dur),
        si.Column("int", ts + dur, other), si.Column("int", track), si.Column("text", cat),
        si.Column("text", name), si.Column("int", parent, parent < 0),
        si.Column("int", args, args < 0), si.Column("int", upid, other),
        si.Column("int", utid, other | no_utid[at]),
        si.Column("int", kind, other | kind_null),
        si.Column("int", slices["depth"])])  # thread_ts, thread_dur: NULL
    by_name = dict(zip(SS_COLUMNS, table.columns, strict=False))
    return table, [si.Index(ix, si.index_sql(ix, SS_TABLE, keys), SS_TABLE,
                            [by_name[k] for k in keys], table.rowid)
                   for ix, keys in ((SS_INDEX, SS_INDEX_KEYS), (SS_NAME_INDEX, SS_NAME_INDEX_KEYS),
                                    (SLICE_TRACK_INDEX, SLICE_TRACK_INDEX_KEYS))]


def build(t: Tables) -> Laid:
    """The slice base of the decoded tables ``t``, as the importer lays it (PostLoad)."""
    conn = track_tables(t)
    try:
        owners = track_owners(conn)
    finally:
        conn.close()
    table, indexes = image_parts(t.slice, t.strings.list, owners)
    return Laid([table], indexes, holds=("slice",), views=SLICE_VIEW + ";")


# The builder the embedded engine passes to the importer (see engines.load)
POST_LOAD = PostLoad("summaries' slice base", build)
