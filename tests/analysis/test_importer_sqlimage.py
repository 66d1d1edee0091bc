"""The SQLite file image builder: what SQLite reads back is exactly what was laid out."""

from __future__ import annotations

import numpy as np
import pytest

from stepscope.analysis import _protoscan as ps
from stepscope.analysis import _sqlimage as si
from stepscope.analysis import _state
from stepscope.analysis import importer as im


def test_image_round_trip_many_pages():
    n = 20_000  # several leaf pages and an interior page
    strings = ["forward", "", "é∂", "x" * 300]
    ids = np.arange(n) % 5 - 1  # -1 (NULL), 0..3
    ival = np.arange(n, dtype=np.int64) * 1_000_003 - 7 * 10**12
    t = si.Table("t", "CREATE TABLE t(id INTEGER PRIMARY KEY, a INTEGER, s TEXT, r REAL, "
                      "b INTEGER)", np.arange(n) + 10, [
        si.Column("rowid"), si.Column("int", ival), si.Column("text", ids),
        si.Column("real", np.arange(n) / 4, np.arange(n) % 3 == 0),
        si.Column("int", -np.arange(n), np.arange(n) % 2 == 1)])
    empty = si.Table("e", "CREATE TABLE e(id INTEGER PRIMARY KEY, v TEXT)",
                     np.zeros(0, np.int64), [si.Column("rowid"),
                                             si.Column("text", np.zeros(0, np.int64))])
    conn = si.connect(si.build([t, empty], strings))
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    got = conn.execute("SELECT id, a, s, r, b FROM t WHERE id IN (10, 11, 12, 13, 14, 20009) "
                       "ORDER BY id").fetchall()
    assert got == [
        (10, ival[0], None, None, 0),
        (11, ival[1], "forward", 0.25, None),
        (12, ival[2], "", 0.5, -2),
        (13, ival[3], "é∂", None, None),
        (14, ival[4], "x" * 300, 1.0, -4),
        (20009, ival[-1], "x" * 300, 19999 / 4, None),  # 19999 % 3 == 1; odd -> NULL
    ]
    assert conn.execute("SELECT COUNT(*), SUM(a) FROM t").fetchone() == (n, int(ival.sum()))
    assert conn.execute("SELECT COUNT(*) FROM e").fetchone() == (0,)
    conn.execute("INSERT INTO e VALUES (1, 'writable')")  # the database stays writable
    assert conn.execute("SELECT v FROM e").fetchall() == [("writable",)]


def test_image_index_keys_must_be_non_null_int_columns(monkeypatch):
    """An image index stores raw key values: a nullable, text or left-out column is refused."""
    n = 3
    z = np.zeros(n, np.int64)
    slice_t = si.Table("slice", im.BIG_SCHEMA["slice"], np.arange(1, n + 1), [
        si.Column("rowid"), si.Column("int", z), si.Column("int", z), si.Column("int", z),
        si.Column("text", z - 1), si.Column("text", z), si.Column("int", z),
        si.Column("int", z - 1, np.ones(n, bool)), si.Column("int", z)])
    monkeypatch.setattr(im, "INDEXES", (("slice_track_ts", "slice", ("track_id", "ts")),))
    (ix,) = im._image_indexes([slice_t])
    assert ix.sql == "CREATE INDEX slice_track_ts ON slice(track_id, ts)"
    for key in ("parent_id", "category", "thread_ts"):
        monkeypatch.setattr(im, "INDEXES", (("bad", "slice", (key,)),))
        with pytest.raises(ValueError, match=rf"^index bad: key slice\.{key} must be a non-NULL "
                                             r"integer column"):
            im._image_indexes([slice_t])


def test_small_sort_keys_keep_the_order():
    a = np.array([70_000, 3, 70_000, 0, 3], np.int64)
    assert ps.small_key(a).dtype == np.uint32
    assert ps.small_key(a % 7).dtype == np.uint16
    assert ps.small_key(a - 1).dtype == np.int64  # a -1 among them: kept as it is
    for k in (a, a % 7, a - 1, a << 33):
        assert np.argsort(ps.small_key(k), kind="stable").tolist() == \
            np.argsort(k, kind="stable").tolist()
    got = _state._segmented_cumsum(np.array([1, 2, 3, 4, 5]), np.array([0, 0, 1, 1, 1]),
                                   dtype=np.int32)
    assert got.dtype == np.int32 and got.tolist() == [1, 3, 3, 7, 12]
