"""The SQLite file image builder: what SQLite reads back is exactly what was laid out."""

from __future__ import annotations

import numpy as np
import pytest

from stepscope.analysis import _arrays as ar
from stepscope.analysis import sqlimage as si
from stepscope.analysis.sqlimage import leaves, pages, records
from stepscope.analysis.tp import decode as _decode
from stepscope.analysis.tp import importer as im
from stepscope.analysis.tp import loops
from stepscope.analysis.tp import protoscan as ps
from stepscope.analysis.tp import state as _state


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


def test_an_index_in_scattered_row_order_is_laid_out_from_gathered_columns(monkeypatch):
    """Keys in no row order (names, then random durations): the key columns are gathered into
    index order first. The image is byte for byte the one laid out row by row, and SQLite
    finds every entry."""
    n = 70_000  # above the size where gathering starts
    rng = np.random.default_rng(2)
    name, dur = rng.integers(-1, 3, n), rng.integers(0, 1 << 40, n)
    t = si.Table("t", "CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, dur INTEGER)",
                 np.arange(1, n + 1), [si.Column("rowid"), si.Column("text", name),
                                       si.Column("int", dur, dur % 11 == 0)])
    ix = si.Index("t_name", "CREATE INDEX t_name ON t(name, dur)", "t",
                  [t.columns[1], t.columns[2]], t.rowid)
    strings = ["b", "a", "ab"]
    gathered = []
    monkeypatch.setattr(leaves, "_scattered", lambda o, f=leaves._scattered: gathered.append(f(o))
                        or gathered[-1])
    image = si.build([t], strings, [ix])
    assert gathered == [True]
    monkeypatch.setattr(leaves, "_scattered", lambda o: False)
    assert (si.build([t], strings, [ix]) == image).all()
    conn = si.connect(image)
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    null = dur % 11 == 0
    for k in (int(np.flatnonzero((name == 2) & null)[0]),
              int(np.flatnonzero((name == 2) & ~null)[0])):
        same = (name == 2) & (null if null[k] else ~null & (dur == dur[k]))
        got = conn.execute("SELECT id FROM t INDEXED BY t_name WHERE name = 'ab' AND dur IS ?",
                           (None if null[k] else int(dur[k]),)).fetchall()
        assert sorted(got) == [(int(i) + 1,) for i in np.flatnonzero(same)]


def test_image_index_keys_must_be_int_or_text_columns_in_the_image(monkeypatch):
    """A real column or one left out of the records (always NULL) is refused as an index key;
    nullable integers and text are indexed as SQLite would."""
    n = 3
    z = np.zeros(n, np.int64)
    slice_t = si.Table("slice", im.BIG_SCHEMA["slice"], np.arange(1, n + 1), [
        si.Column("rowid"), si.Column("int", z), si.Column("int", z), si.Column("int", z),
        si.Column("text", z - 1), si.Column("text", z), si.Column("int", z),
        si.Column("int", z - 1, np.ones(n, bool)), si.Column("real", z.astype(float))])
    monkeypatch.setattr(im, "INDEXES", (("slice_track_ts", "slice", ("track_id", "ts")),
                                        ("slice_cat", "slice", ("category", "parent_id"))))
    ixs = im._image_indexes([slice_t])
    assert [ix.sql for ix in ixs] == ["CREATE INDEX slice_track_ts ON slice(track_id, ts)",
                                      "CREATE INDEX slice_cat ON slice(category, parent_id)"]
    for key in ("arg_set_id", "thread_ts"):
        monkeypatch.setattr(im, "INDEXES", (("bad", "slice", (key,)),))
        with pytest.raises(ValueError, match=rf"^index bad: key slice\.{key} must be an integer "
                                             r"or text column written to the image"):
            im._image_indexes([slice_t])


def test_small_sort_keys_keep_the_order():
    a = np.array([70_000, 3, 70_000, 0, 3], np.int64)
    assert ar.small_key(a).dtype == np.uint32
    assert ar.small_key(a % 7).dtype == np.uint16
    assert ar.small_key(a - 1).dtype == np.int64  # a -1 among them: kept as it is
    for k in (a, a % 7, a - 1, a << 33):
        assert np.argsort(ar.small_key(k), kind="stable").tolist() == \
            np.argsort(k, kind="stable").tolist()
    got = _state.segmented_cumsum(np.array([1, 2, 3, 4, 5]), np.array([0, 0, 1, 1, 1]),
                                   dtype=np.int32)
    assert got.dtype == np.int32 and got.tolist() == [1, 3, 3, 7, 12]
    # runs from given starts (one empty) plus a base each: 100 + [1, 3], 200 + [], 300 + [3, 7, 12]
    got = _state._cumsum_runs(np.array([1, 2, 3, 4, 5]), np.array([0, 2, 2]),
                              np.array([100, 200, 300]))
    assert got.tolist() == [101, 103, 303, 307, 312]
    ones = np.ones(200, np.int64)  # many runs (shifted all at once): 2 each, base k
    got = _state._cumsum_runs(ones, np.arange(0, 200, 2), np.arange(100))
    assert got.tolist() == [v for k in range(100) for v in (k + 1, k + 2)]


def _mixed_table(n: int) -> tuple[si.Table, list[str]]:
    """A table with every serial type: ints of each width (and 0 / 1), NULLs, doubles, text
    (empty, multi-byte, two longer than MAX_TEXT that are stored as the same bytes)."""
    rng = np.random.default_rng(7)
    widths = np.array([0, 1, 5, -100, 300, -40_000, 8_000_000, -2**31, 2**40, -2**47, 2**62])
    ival = widths[np.arange(n) % len(widths)] + rng.integers(0, 2, n) * (np.arange(n) % 2)
    strings = ["b", "a", "", "é∂", "ab", "x" * (si.MAX_TEXT + 5), "a\0b", "x" * (si.MAX_TEXT + 9)]
    ids = rng.integers(-1, len(strings), n)
    t = si.Table("t", "CREATE TABLE t(id INTEGER PRIMARY KEY, a INTEGER, s TEXT, r REAL, "
                      "k INTEGER)", np.arange(n) * 3 + 1, [
        si.Column("rowid"), si.Column("int", ival), si.Column("text", ids),
        si.Column("real", rng.normal(size=n), np.arange(n) % 3 == 0),
        si.Column("int", rng.integers(-3, 4, n), np.arange(n) % 4 == 1)])
    return t, strings


def _mixed_indexes(t: si.Table) -> list[si.Index]:
    _, a, s, _, k = t.columns
    return [si.Index("t_k_a", "CREATE INDEX t_k_a ON t(k, a)", "t", [k, a], t.rowid),
            si.Index("t_s_a", "CREATE INDEX t_s_a ON t(s, a)", "t", [s, a], t.rowid)]


@pytest.mark.skipif(pages.native is None, reason="the C extension _sqlpages is not built")
def test_c_and_numpy_writers_lay_out_the_same_bytes(monkeypatch):
    t, strings = _mixed_table(30_000)  # several pages per B-tree, interior levels
    c_image = si.build([t], strings, _mixed_indexes(t))
    monkeypatch.setattr(pages, "native", None)
    np_image = si.build([t], strings, _mixed_indexes(t))
    assert len(c_image) == len(np_image)
    assert np.flatnonzero(c_image != np_image)[:5].tolist() == []


@pytest.mark.parametrize("writer", ["c", "numpy"])
def test_image_indexes_on_nullable_and_text_keys_read_as_sqlite_built_them(monkeypatch, writer):
    """An index with NULL integer keys and text keys (BINARY order) passes SQLite's own
    integrity check and walks in the order of an index SQLite builds on the same rows."""
    if writer == "numpy":
        monkeypatch.setattr(pages, "native", None)
    elif pages.native is None:
        pytest.skip("the C extension _sqlpages is not built")
    t, strings = _mixed_table(5_000)
    conn = si.connect(si.build([t], strings, _mixed_indexes(t)))
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    conn.execute("CREATE TABLE u AS SELECT * FROM t")
    conn.execute("CREATE INDEX u_k_a ON u(k, a)")
    conn.execute("CREATE INDEX u_s_a ON u(s, a)")
    for ours, ref, cols in (("t_k_a", "u_k_a", "k, a"), ("t_s_a", "u_s_a", "s, a")):
        got = conn.execute(f"SELECT {cols}, id FROM t INDEXED BY {ours} "
                           f"WHERE {cols.split(',')[0]} IS NULL OR 1 ORDER BY {cols}").fetchall()
        want = conn.execute(f"SELECT {cols}, id FROM u INDEXED BY {ref} "
                            f"WHERE {cols.split(',')[0]} IS NULL OR 1 ORDER BY {cols}").fetchall()
        assert got == want
        assert [r[0] for r in got[:3]] == [None] * 3  # NULLs first
    # a text key compares as SQLite's BINARY collation: 'a' < 'a\0b' < 'ab' < 'b' < 'é∂'
    order = [r[0] for r in conn.execute("SELECT DISTINCT s FROM t INDEXED BY t_s_a "
                                        "WHERE s IS NOT NULL ORDER BY s")]
    assert order == ["", "a", "a\0b", "ab", "b", "x" * si.MAX_TEXT, "é∂"]


@pytest.mark.parametrize("writer", ["c", "numpy"])
def test_rows_over_half_a_page_and_entries_over_an_index_page(monkeypatch, writer):
    """Rows of five MAX_TEXT strings (40 KB: one a page, no page left empty) load; an index
    entry SQLite would spill to an overflow page is refused with a clear error."""
    if writer == "numpy":
        monkeypatch.setattr(pages, "native", None)
    elif pages.native is None:
        pytest.skip("the C extension _sqlpages is not built")
    strings = [c * si.MAX_TEXT for c in "abcde"]
    n = 6
    cols = [si.Column("text", (np.arange(n) + j) % 5) for j in range(5)]
    t = si.Table("big", "CREATE TABLE big(id INTEGER PRIMARY KEY, a TEXT, b TEXT, c TEXT, "
                        "d TEXT, e TEXT)", np.arange(1, n + 1), [si.Column("rowid"), *cols])
    conn = si.connect(si.build([t], strings))
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert conn.execute("SELECT a, e FROM big WHERE id = 3").fetchone() == (
        "c" * si.MAX_TEXT, "b" * si.MAX_TEXT)
    ix = si.Index("big_abc", "CREATE INDEX big_abc ON big(a, b, c)", "big", cols[:3], t.rowid)
    with pytest.raises(ValueError, match="index big_abc: an entry too large"):
        si.build([t], strings, [ix])


def test_a_table_of_63_nullable_columns():
    """Every column a value and a NULL mask (the C writer holds two buffers per column)."""
    n, k = 50, 63
    cols = [si.Column("int", np.arange(n) * (j + 1), np.arange(n) % (j + 2) == 0)
            for j in range(k)]
    sql = "CREATE TABLE w(id INTEGER PRIMARY KEY, " + ", ".join(f"c{j} INTEGER"
                                                                  for j in range(k)) + ")"
    conn = si.connect(si.build([si.Table("w", sql, np.arange(1, n + 1),
                                         [si.Column("rowid"), *cols])], []))
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    # row 3: c_j = 3 * (j + 1), NULL where 3 % (j + 2) == 0
    assert conn.execute("SELECT c0, c1, c62 FROM w WHERE id = 4").fetchone() == (3, None, 189)


@pytest.mark.skipif(pages.native is None, reason="the C extension _sqlpages is not built")
def test_c_writer_refuses_inconsistent_input():
    t, strings = _mixed_table(10)
    st = records.Strings(strings)
    args = records.native_args(t.columns, st, None, t.rowid)
    out = np.zeros(si.PAGE, np.uint8)
    bad_rows = records.native_args(t.columns, st, np.array([0, 10]), t.rowid)
    with pytest.raises(IndexError, match="rows: index out of range"):
        pages.native.cell_sizes(*bad_rows, np.zeros(2, np.int32))
    bad_text = list(args)
    bad_text[0] = [(3, np.array([len(st.len)] * 10, np.int64), None)]
    with pytest.raises(IndexError, match="text id out of range"):
        pages.native.cell_sizes(*bad_text, np.zeros(10, np.int32))
    with pytest.raises(ValueError, match="pages do not fit the image"):
        pages.native.write_leaves(*args, out, si.PAGE, si.PAGE, 13, np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="page_first: not increasing"):
        pages.native.write_leaves(*args, out, 0, si.PAGE, 13, np.array([5], np.int64))
    assert not out.any()  # nothing written on a refused call


def _packet_run(rng, n: int) -> bytes:
    """A Trace.packet run: n items (payloads full of 0x0A bytes, so stray tag bytes abound),
    lengths of 1..3 varint bytes."""
    out = bytearray()
    for _ in range(n):
        ln = int(rng.choice([0, 1, 5, 127, 128, 300, 20_000]))
        out += b"\x0a" + ps_varint(ln) + bytes(rng.choice([0x0A, 0x01, 0x80], ln))
    return bytes(out)


def ps_varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


@pytest.mark.parametrize("walker", ["c", "numpy"])
def test_split_repeated_finds_the_items_and_where_the_run_stops(monkeypatch, walker):
    if walker == "numpy":
        monkeypatch.setattr(loops, "native", None)
    elif loops.native is None:
        pytest.skip("the C extension _decodeloops is not built")
    run = b"\x0a\x02\x0a\x0a" + b"\x0a\x00" + b"\x0a\x81\x01" + b"x" * 129  # 3 items
    cases = {
        run: ([2, 6, 9], [4, 6, 138], 138),
        run + b"\x0a\x05abc": ([2, 6, 9], [4, 6, 138], 138),  # truncated last item: dropped
        run + b"\x12\x00": ([2, 6, 9], [4, 6, 138], 138),  # not the tag: stops there
        b"\x0a" + b"\xff" * 10 + b"\x01": ([], [], 0),  # an 11-byte varint: runs past the end
        b"\x12\x00" + run: ([], [], 0),
        b"": ([], [], 0),
    }
    for data, (starts, ends, stop) in cases.items():
        st, en, got_stop = ps.split_repeated(ps.padded(data), 0, len(data))
        assert (st.tolist(), en.tolist(), got_stop) == (starts, ends, stop), data[:12]
    buf = ps.padded(run * 2)  # a window of the buffer
    st, en, stop = ps.split_repeated(buf, len(run), 2 * len(run))
    assert (st.tolist(), stop) == ([len(run) + 2, len(run) + 6, len(run) + 9], 2 * len(run))


@pytest.mark.skipif(loops.native is None, reason="the C extension _decodeloops is not built")
def test_split_repeated_c_and_numpy_agree_on_random_runs(monkeypatch):
    rng = np.random.default_rng(3)
    for trial in range(60):
        data = bytearray(_packet_run(rng, int(rng.integers(0, 40))))
        if trial % 3 == 1 and data:  # damage a byte or cut the run short
            data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        elif trial % 3 == 2:
            data = data[: int(rng.integers(0, len(data) + 1))]
        buf = ps.padded(bytes(data))
        got = ps.split_repeated(buf, 0, len(data))
        with monkeypatch.context() as m:
            m.setattr(loops, "native", None)
            want = ps.split_repeated(buf, 0, len(data))
        assert (got[0].tolist(), got[1].tolist(), got[2]) == \
            (want[0].tolist(), want[1].tolist(), want[2]), trial


def _random_events(rng, k: int, tracks: int):
    """Slice events in time order on a few tracks: begins, ends (some with nothing open),
    instants, and other events (counters) that make no slice."""
    from stepscope.analysis.tp import packets as pk

    typ = rng.choice([pk.T_BEGIN, pk.T_BEGIN, pk.T_END, pk.T_END, pk.T_INSTANT, pk.T_COUNTER],
                     k).astype(np.int8)
    return typ, rng.integers(0, tracks, k).astype(np.int64), np.sort(rng.integers(0, 10**6, k))


@pytest.mark.skipif(loops.native is None, reason="the C extension _decodeloops is not built")
def test_nesting_c_and_numpy_agree(monkeypatch):
    from stepscope.analysis.tp import packets as pk

    rng = np.random.default_rng(11)
    for trial in range(40):
        k = int(rng.integers(0, 300))
        typ, trk, ts = _random_events(rng, k, int(rng.integers(1, 5)) * 3)
        order = rng.permutation(k)
        order = order[np.argsort(ts[order], kind="stable")]  # time order, ties in any order
        is_slice_ev = typ != pk.T_COUNTER
        args = (order, typ, ts, trk, np.arange(k) % 7, np.arange(k) % 3 - 1, is_slice_ev)
        got_stats, want_stats = {}, {}
        got, got_ev = _decode._build_slices(*args, got_stats)
        with monkeypatch.context() as m:
            m.setattr(loops, "native", None)
            want, want_ev = _decode._build_slices(*args, want_stats)
        assert got_ev.tolist() == want_ev.tolist(), trial
        assert {c: v.tolist() for c, v in got.items()} == \
            {c: v.tolist() for c, v in want.items()}, trial
        assert got_stats == want_stats, trial


def _random_owners(rng):
    """n packets, ng generations, and owners (packets in order, ties included; their
    generations, -1 included) for the C walks' twin tests."""
    n, ng, no = int(rng.integers(1, 60)), int(rng.integers(1, 5)), int(rng.integers(0, 8))
    return n, ng, np.sort(rng.integers(0, n, no)), rng.integers(-1, ng, no)


def _c_and_numpy(monkeypatch, fn, *args):
    """fn(*args) with the _state C loops, and with its numpy paths."""
    got = fn(*args)
    with monkeypatch.context() as m:
        m.setattr(loops, "native", None)
        return got, fn(*args)


def test_last_owner_of_a_hand_made_sequence():
    # owners (defaults packets): #0 at packet 2 of generation 1, #1 at 5 of generation 2,
    # #2 at 7 of generation 1 (replaces #0 from there on)
    og, op = np.array([1, 2, 1]), np.array([2, 5, 7])
    gen = np.array([1, 1, 2, 2, 1, 1, -1, 3])
    pkt = np.array([1, 2, 4, 5, 6, 7, 8, 9])
    assert _state.lookup_last(og, op, gen, pkt, 10).tolist() == [-1, 0, -1, 1, 0, 2, -1, -1]
    back = slice(None, None, -1)  # queries out of packet order: the same answers
    assert _state.lookup_last(og, op, gen[back], pkt[back], 10).tolist() == \
        [-1, 0, -1, 1, 0, 2, -1, -1][::-1]


@pytest.mark.skipif(loops.native is None, reason="the C extension _decodeloops is not built")
def test_last_owner_c_and_numpy_agree(monkeypatch):
    rng = np.random.default_rng(5)
    for trial in range(200):
        n, ng, op, og = _random_owners(rng)
        pkt = np.sort(rng.integers(0, n, int(rng.integers(0, 40))))
        gen = rng.integers(-1, ng + 2, len(pkt))  # also generations without an owner
        got, want = _c_and_numpy(monkeypatch, _state.lookup_last, og, op, gen, pkt, n)
        assert got.tolist() == want.tolist(), trial
    with pytest.raises(ValueError, match="packet order"):  # the C walk checks its inputs
        loops.native.last_owner(*(np.array(a, np.int64) for a in ([0], [1], [0], [0, 0], [3, 2])),
                                 np.zeros(2, np.int64))


def test_generations_of_a_hand_made_trace():
    # sequences 7 and 3 (ranks 1 and 0, by id) interleaved; 7 clears at packets 1 and 4, 3 at
    # packet 3. Generations: sequence 3 (rank 0) has base 0 and one clear -> 1; sequence 7
    # has base 0 + (1 + 1) = 2, its clears -> 3, then 4. Flag 2 (needs state) is not a clear.
    seq = np.array([7, 7, 3, 3, 7, 7, 3])
    flags = np.array([2, 1, 0, 3, 1, 2, 2])
    srank, gen = _state.generations(seq, flags)
    assert srank.tolist() == [1, 1, 0, 0, 1, 1, 0]
    assert gen.tolist() == [-1, 3, -1, 1, 4, 4, 1]


@pytest.mark.skipif(loops.native is None, reason="the C extension _decodeloops is not built")
def test_generations_c_and_numpy_agree(monkeypatch):
    rng = np.random.default_rng(13)
    for trial in range(200):
        n = int(rng.integers(1, 80))
        seq = np.repeat(rng.integers(0, 5, n), rng.integers(1, 4, n))  # runs of one sequence
        flags = rng.choice([0, 0, 0, 1, 2, 3], len(seq)).astype(np.int8)
        got, want = _c_and_numpy(monkeypatch, _state.generations, seq, flags)
        assert [a.tolist() for a in got] == [a.tolist() for a in want], trial
    with pytest.raises(ValueError, match="srank"):  # the C loop checks its sequence ranks
        loops.native.generations(np.array([0, 2], np.int64), np.zeros(2, np.int8),
                                  np.zeros(4, np.int64), np.zeros(2, np.int64))


def test_body_groups_of_hand_made_bodies():
    from stepscope.analysis.tp import packets as pk

    buf = ps.padded(b"abcXabcYabcdZab")
    # "abc" at 0, 4, 8; "abcd" at 8; "ab" at 13; "abc" at 4 again: groups by first appearance
    start, length = np.array([0, 4, 8, 8, 13, 4]), np.array([3, 3, 4, 3, 2, 3])
    rep, inv, same = pk._body_groups(buf, start, length)
    assert rep.tolist() == [0, 2, 4] and inv.tolist() == [0, 0, 1, 0, 2, 0]
    assert same is None or same.all()


@pytest.mark.skipif(loops.native is None, reason="the C extension _decodeloops is not built")
def test_body_groups_c_and_numpy_agree(monkeypatch):
    from stepscope.analysis.tp import packets as pk

    rng = np.random.default_rng(17)
    for trial in range(100):
        # bodies drawn from a few words (repeats) and random bytes (mostly distinct)
        words = [rng.integers(0, 256, int(rng.integers(1, 25))).astype(np.uint8).tobytes()
                 for _ in range(int(rng.integers(1, 6)))]
        bodies = [words[int(rng.integers(0, len(words)))] if rng.random() < 0.8 else
                  rng.integers(0, 4, int(rng.integers(1, 25))).astype(np.uint8).tobytes()
                  for _ in range(int(rng.integers(1, 200)))]
        start = np.cumsum([0] + [len(b) for b in bodies[:-1]])
        buf = ps.padded(b"".join(bodies))
        length = np.array([len(b) for b in bodies])
        got = pk._body_groups(buf, start, length)
        with monkeypatch.context() as m:
            m.setattr(loops, "native", None)
            want = pk._body_groups(buf, start, length)
        assert got[2] is None and want[2].all(), trial
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist(), trial
        assert [bodies[i] for i in got[0][got[1]]] == bodies, trial
    with pytest.raises(ValueError, match="outside buf"):
        loops.native.groups(ps.padded(b"ab"), np.array([30]), np.array([8]), np.zeros(1, np.int64))


class _Defaults:  # the part of _state.State that _packet_clocks reads
    def __init__(self, pkt, clock):
        self.def_pkt, self.def_clock = np.array(pkt, np.int64), np.array(clock, np.int64)


def test_packet_clocks_of_a_hand_made_sequence():
    # defaults: packet 1 (generation 0) says clock 64, packet 4 (generation 1) says 3;
    # packets 6 and 7 name their own clocks (64, 6), packet 0 is before any defaults, packet 3
    # before its generation's, packet 8 has no generation; sequence ranks 0 / 2 scope clock 64
    # as (1 << 8) | 64 = 320 and (3 << 8) | 64 = 832
    st = _Defaults([1, 4], [64, 3])
    gen = np.array([0, 0, 0, 1, 1, 0, 1, 1, -1])
    srank = np.array([0, 0, 0, 2, 2, 0, 2, 2, 2])
    clk = np.array([0, 0, 0, 0, 0, 0, 64, 6, 0])
    want = [0, 320, 320, 0, 3, 320, 832, 6, 0]
    assert _state._packet_clocks(clk, gen, srank, st).tolist() == want


@pytest.mark.skipif(loops.native is None, reason="the C extension _decodeloops is not built")
def test_packet_clocks_c_and_numpy_agree(monkeypatch):
    rng = np.random.default_rng(11)
    for trial in range(200):
        n, ng, op, og = _random_owners(rng)
        st = _Defaults(op, rng.choice([0, 3, 6, 64, 100, 127, 128], len(op)))
        gen = rng.integers(-1, ng, n)
        gen[op] = og  # a defaults packet's generation is its owner generation
        srank = rng.integers(0, 4, n)
        clk = rng.choice([0, 0, 0, 1, 64, 70, 127, 128], n).astype(np.uint32)
        got, want = _c_and_numpy(monkeypatch, _state._packet_clocks, clk, gen, srank, st)
        assert got.tolist() == want.tolist(), trial
    with pytest.raises(ValueError, match="packet order"):  # the C walk checks its owners
        loops.native.packet_clocks(*(np.array(a, np.int64) for a in (
            [0, 0], [3, 1], [0], [64, 64], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0])))


def test_stable_order_is_a_stable_argsort():
    rng = np.random.default_rng(9)
    for a in (rng.integers(0, 1 << 40, 5000),  # packed with positions
              rng.integers(-(1 << 40), 1 << 40, 5000), rng.integers(0, 50, 5000) << 30,
              rng.integers(0, 7, 5000), 10**9 + rng.integers(0, 9, 5000),  # radix
              rng.integers(-(1 << 62), 1 << 62, 500),  # too wide to pack: two passes
              (rng.integers(0, 4, 5000) << 58) | rng.integers(0, 9, 5000),  # ties, two passes
              np.cumsum(rng.integers(0, 1 << 20, 1 << 17)) - rng.integers(0, 2, 1 << 17),
              (rng.integers(0, 5, 1 << 17) << 40) | rng.integers(0, 3, 1 << 17),  # shuffled
              np.array([5, -(1 << 63), (1 << 62) + 7, 3, (1 << 62) + 1, -(1 << 62)]),  # 2**63+
              np.array([4]), np.zeros(0, np.int64)):
        assert ar.stable_order(a).tolist() == np.argsort(a, kind="stable").tolist()


def test_nesting_of_a_hand_made_track():
    """begin A, end (nothing else open: closes A), end with nothing open (ignored), begin B,
    instant I inside B, begin C, end C, (B never ends); another track: begin D, end D."""
    from stepscope.analysis.tp import packets as pk

    B, E, In = pk.T_BEGIN, pk.T_END, pk.T_INSTANT
    typ = np.array([B, E, E, B, In, B, B, E, E, E], np.int8)
    trk = np.array([0, 0, 0, 0, 0, 5, 0, 0, 5, 5])
    ts = np.array([0, 10, 11, 20, 25, 26, 30, 35, 40, 41])
    stats = {}
    cols, ev_slice = _decode._build_slices(np.arange(10), typ, ts, trk, np.zeros(10, int),
                                           np.zeros(10, int), np.ones(10, bool), stats)
    # slices: A(0) B(1) I(2) D(3) C(4)
    assert cols["dur"].tolist() == [10, -1, 0, 14, 5]
    assert cols["depth"].tolist() == [0, 0, 1, 0, 1]
    assert cols["parent_id"].tolist() == [-1, -1, 1, -1, 1]
    assert ev_slice.tolist() == [0, 0, -1, 1, 2, 3, 4, 4, 3, -1]
    assert stats == {"slice_end_without_begin": 2, "slices_unfinished": 1}
