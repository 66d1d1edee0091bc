"""Query results, trace processor's functions and tables on the embedded engine, read-only
queries, and trace processor on several files (through a stand-in trace_processor_shell)."""

from __future__ import annotations

import os
import sys

import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from stepscope.analysis import QueryError, summaries
from stepscope.analysis import engines as eng
from stepscope.analysis.cli import sql as cli_sql

FAKE_TP = os.path.join(os.path.dirname(__file__), "fake_tp", "trace_processor_shell")
SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def _trace(path, pid=10, tid=11, slices=(("outer", 100, 200), ("inner", 120, 150)), base=0):
    """Process 10 with thread 11; a counter under the process, one under the thread, one
    global; nested slices on the thread, the first with debug annotations."""
    t = pb.Trace()
    seq = 1

    def desc(uuid, **kw):
        p = t.packet.add(trusted_packet_sequence_id=seq)
        d = p.track_descriptor
        d.uuid = uuid + base
        for k, v in kw.items():
            if k == "process":
                d.process.pid, d.process.process_name = v
            elif k == "thread":
                d.thread.pid, d.thread.tid, d.thread.thread_name = v
            elif k == "counter":
                d.counter.unit_name = v
            elif k == "parent_uuid":
                d.parent_uuid = v + base
            else:
                setattr(d, k, v)

    desc(1, process=(pid, "proc"))
    desc(2, parent_uuid=1, thread=(pid, tid, "main"))
    desc(3, parent_uuid=1, name="mem", counter="bytes")
    desc(4, parent_uuid=2, name="util", counter="%")
    desc(5, name="temp", counter="C")
    for i, (name, b, _e) in enumerate(slices):
        p = t.packet.add(timestamp=b, trusted_packet_sequence_id=seq)
        p.track_event.type, p.track_event.track_uuid, p.track_event.name = 1, 2 + base, name
        if i == 0:
            for key, kind, v in (("n", "int_value", 7), ("s", "string_value", "x"),
                                 ("r", "double_value", 2.5), ("b", "bool_value", True)):
                a = p.track_event.debug_annotations.add(name=key)
                setattr(a, kind, v)
    for _name, _b, e in reversed(slices):
        p = t.packet.add(timestamp=e, trusted_packet_sequence_id=seq)
        p.track_event.type, p.track_event.track_uuid = 2, 2 + base
    for uuid, ts, v in ((3, 110, 1000.0), (4, 130, 50.0), (5, 140, 40.0)):
        p = t.packet.add(timestamp=ts, trusted_packet_sequence_id=seq)
        p.track_event.type, p.track_event.track_uuid = 4, uuid + base
        p.track_event.double_counter_value = v
    path.write_bytes(t.SerializeToString())
    return str(path)


@pytest.fixture
def trace(tmp_path):
    return _trace(tmp_path / "t.pftrace")


PAIRS = ("SELECT p.name, c.name FROM slice c JOIN slice p ON p.id = c.parent_id")


def test_rows_keep_every_column(trace):
    with eng.open(trace, engine="embedded") as db:
        rows = db.query(PAIRS)
        assert rows.columns == ["name", "name"]
        assert len(rows) == 1
        r = rows[0]
        assert list(r) == ["outer", "inner"] and (r[0], r[1], r[-1]) == ("outer", "inner", "inner")
        assert r["name"] == "outer" and r.get("name") == "outer" and r.get("nope", 5) == 5
        assert r.keys() == ["name", "name"] and r.items() == [("name", "outer"), ("name", "inner")]
        with pytest.raises(KeyError):
            r["nope"]
        # dict-like use of earlier versions still works where names are distinct
        one = db.query("SELECT name, depth FROM slice ORDER BY ts")
        assert one == [{"name": "outer", "depth": 0}, {"name": "inner", "depth": 1}]
        assert dict(one[1]) == {"name": "inner", "depth": 1} and one[1] == ("inner", 1)
        assert rows[0] != {"name": "outer"}  # two columns never equal a one-key dict
        df = db.query_df(PAIRS)
        assert list(df.columns) == ["name", "name"]
        assert df.values.tolist() == [["outer", "inner"]]


def test_sql_command_prints_every_column(trace, capsys):
    for fmt, want in (("csv", "name,name\nouter,inner\n"),
                      ("json", '[\n {\n  "name": "outer",\n  "name:2": "inner"\n }\n]\n'),
                      ("text", "name   name\n-----  -----\nouter  inner\n(1 row)\n")):
        assert _run("sql", trace, PAIRS, "--engine", "embedded", "--format", fmt) == 0
        assert capsys.readouterr().out == want


def _run(*argv):
    import argparse

    ap = argparse.ArgumentParser(prog="stepscope")
    cli_sql.add_parsers(ap.add_subparsers())
    args = ap.parse_args(list(argv))
    return args.func(args)


def test_extract_arg_and_counter_track_tables(trace):
    with eng.open(trace, engine="embedded") as db:
        got = db.query("SELECT EXTRACT_ARG(arg_set_id, 'debug.n') AS n,"
                       " EXTRACT_ARG(arg_set_id, 'debug.s') AS s,"
                       " EXTRACT_ARG(arg_set_id, 'debug.r') AS r,"
                       " EXTRACT_ARG(arg_set_id, 'debug.b') AS b,"
                       " EXTRACT_ARG(arg_set_id, 'debug.none') AS none"
                       " FROM slice WHERE name = 'outer'")
        assert got == [{"n": 7, "s": "x", "r": 2.5, "b": 1, "none": None}]
        assert db.query("SELECT EXTRACT_ARG(arg_set_id, 'debug.n') AS n FROM slice"
                        " WHERE name = 'inner'") == [{"n": None}]  # no arg set: NULL
        assert db.query("SELECT STR_SPLIT('a,b,c', ',', 1) AS p, STR_SPLIT('a,b', ',', 2) AS q,"
                        " STR_SPLIT(12, ',', 0) AS r, 'abc' REGEXP 'b.$' AS m,"
                        " 'abc' REGEXP '^b' AS n") \
            == [{"p": "b", "q": None, "r": None, "m": 1, "n": 0}]
        for sql, msg in (("SELECT STR_SPLIT('a', '', 0)",
                          "str_split: delimiter must be a non-empty string"),
                         ("SELECT STR_SPLIT('a', ',', -1)",
                          "str_split: field number must be a non-negative integer"),
                         ("SELECT EXTRACT_ARG('x', 'debug.n')",
                          "EXTRACT_ARG: 1st argument should be arg set id")):
            with pytest.raises(QueryError) as e:
                db.query(sql)
            assert str(e.value) == f"query failed: {msg}"
        ct = db.query("SELECT name, type, unit FROM counter_track ORDER BY name")
        assert ct == [
            {"name": "mem", "type": "process_counter_track_event", "unit": "bytes"},
            {"name": "temp", "type": "global_counter_track_event", "unit": "C"},
            {"name": "util", "type": "thread_counter_track_event", "unit": "%"}]
        assert db.query("SELECT * FROM counter_track LIMIT 0").columns == [
            "id", "name", "parent_id", "type", "dimension_arg_set_id", "source_arg_set_id",
            "machine_id", "unit", "description"]
        pct = db.query("SELECT t.name, p.pid, c.value FROM process_counter_track t"
                       " JOIN process p USING (upid) JOIN counter c ON c.track_id = t.id")
        assert pct == [{"name": "mem", "pid": 10, "value": 1000.0}]
        tct = db.query("SELECT t.name, th.tid, c.value FROM thread_counter_track t"
                       " JOIN thread th USING (utid) JOIN counter c ON c.track_id = t.id")
        assert tct == [{"name": "util", "tid": 11, "value": 50.0}]
        for table, owner in (("process_counter_track", "upid"),
                             ("thread_counter_track", "utid")):
            assert db.query(f"SELECT * FROM {table} LIMIT 0").columns == [
                "id", "name", "type", "parent_id", "source_arg_set_id", "machine_id", "unit",
                "description", owner]


def test_unsupported_perfetto_sql_says_so_in_one_line(trace):
    with eng.open(trace, engine="embedded") as db:
        with pytest.raises(QueryError) as e:
            db.query("INCLUDE PERFETTO MODULE slices.with_context;\nSELECT 1")
        assert str(e.value) == (
            "query failed: INCLUDE PERFETTO MODULE slices.with_context: PerfettoSQL the "
            "embedded engine does not run; trace processor runs it (--engine trace_processor)")
        with pytest.raises(QueryError) as e:
            db.query("SELECT ANCESTOR_SLICE_DEPTH(id) FROM slice")
        assert str(e.value) == (
            "query failed: no such function: ANCESTOR_SLICE_DEPTH (not provided by the "
            "embedded engine; trace processor runs it (--engine trace_processor))")
        assert "\n" not in str(e.value)
        # the words inside a string or a comment are not a statement
        assert db.query("SELECT 'INCLUDE PERFETTO MODULE x' AS s -- CREATE PERFETTO TABLE\n") \
            == [{"s": "INCLUDE PERFETTO MODULE x"}]


def test_queries_write_no_file(trace, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    with eng.open(trace, engine="embedded") as db:
        for sql in (f"ATTACH DATABASE '{target / 'a.db'}' AS a",
                    f"VACUUM INTO '{target / 'copy.db'}'",
                    "DETACH DATABASE temp",
                    "PRAGMA journal_mode=WAL"):
            with pytest.raises(QueryError, match="not authorized: queries are read-only"):
                db.query(sql)
        assert db.query("PRAGMA journal_mode") != [{"journal_mode": "wal"}]
        assert db.query("SELECT COUNT(*) AS n FROM pragma_table_info('slice')")[0]["n"] > 0
    assert os.listdir(target) == []


def test_queries_write_nothing_and_the_summaries_still_work(trace):
    """A user query changes no table: the engine's own ss_* tables and a later report stay."""
    with eng.open(trace, engine="embedded") as db:
        before = summaries.report(db)
        ss = db.query("SELECT name FROM sqlite_master WHERE name LIKE 'ss_%' AND type = 'table'")
        assert len(ss) > 0
        victim = ss[0]["name"]
        rows = db.query(f"SELECT rowid AS r FROM {victim}")
        for sql in ("CREATE TABLE foo(x)", "CREATE TEMP TABLE mine AS SELECT name FROM slice",
                    f"INSERT INTO {victim} DEFAULT VALUES", f"UPDATE {victim} SET rowid = -rowid",
                    f"DELETE FROM {victim}", f"DROP TABLE {victim}",
                    f"ALTER TABLE {victim} RENAME TO gone", f"CREATE INDEX ix ON {victim}(rowid)",
                    "CREATE VIEW v AS SELECT 1", "CREATE TEMP VIEW v AS SELECT 1"):
            with pytest.raises(QueryError, match="not authorized: queries are read-only"):
                db.query(sql)
        assert sorted(r["name"] for r in db.query("SELECT name FROM slice")) == ["inner", "outer"]
        assert db.query(f"SELECT rowid AS r FROM {victim}") == rows
        assert db.query("SELECT count(*) AS n FROM sqlite_temp_master") == [{"n": 0}]
        assert summaries.report(db) == before


def test_sql_command_refuses_attach(trace, tmp_path, capsys):
    dest = tmp_path / "x.db"
    assert _run("sql", trace, f"ATTACH '{dest}' AS x", "--engine", "embedded") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "read-only" in err
    assert not dest.exists()


@pytest.fixture
def fake_tp(monkeypatch):
    """The stand-in trace_processor_shell, able to import stepscope and perfetto."""
    paths = [os.path.abspath(SRC), *[p for p in sys.path if p]]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    if not os.access(FAKE_TP, os.X_OK):
        pytest.skip("fake trace_processor_shell is not executable")
    return FAKE_TP


def test_trace_processor_on_several_files(tmp_path, fake_tp):
    """Several files are streamed into one trace processor (this failed: the module's own
    open() shadowed the builtin, "unknown engine 'rb'"); rows keep duplicate names there too."""
    a = _trace(tmp_path / "a.pftrace")
    b = _trace(tmp_path / "b.pftrace", pid=20, tid=21, slices=(("x", 300, 400),),
               base=100)
    with eng.open([a, b], engine="trace_processor", trace_processor_bin=fake_tp) as db:
        assert db.engine == "trace_processor"
        got = db.query("SELECT s.name, t.tid FROM slice s JOIN thread_track tt"
                       " ON tt.id = s.track_id JOIN thread t USING (utid) ORDER BY s.ts")
        assert [tuple(r) for r in got] == [("outer", 11), ("inner", 11), ("x", 21)]
        assert [tuple(r) for r in db.query(PAIRS)] == [("outer", "inner")]
        assert db.query("SELECT COUNT(*) AS n FROM process WHERE pid IN (10, 20)") == [{"n": 2}]


def test_several_statements_run_and_the_last_ones_rows_come_back(trace):
    """As trace processor: every statement runs, the rows are the last one's; a semicolon
    in a string, identifier or comment does not end a statement."""
    with eng.open(trace, engine="embedded") as db:
        assert db.query("SELECT 1 AS a; SELECT name, ';' AS s FROM slice WHERE name = 'outer';"
                        " -- done; really") == [{"name": "outer", "s": ";"}]
        assert db.query('SELECT 2 AS "x;y"; /* ; */ SELECT 3 AS b') == [{"b": 3}]
        with pytest.raises(QueryError, match="no such table: nope"):
            db.query("SELECT * FROM nope; SELECT 1")


def _rank_file(path, boot0, mono0, events):
    """A rank's summary file as the writer lays it out: a global snapshot (BOOTTIME 6,
    MONOTONIC 3) at the start and one 2000 ns later, a sequence-scoped incremental clock (64)
    declared against MONOTONIC on sequence 1, and slices whose times are deltas on it."""
    t = pb.Trace()

    def snap(boot, mono):
        s = t.packet.add(trusted_packet_sequence_id=1).clock_snapshot
        s.clocks.add(clock_id=6, timestamp=boot)
        s.clocks.add(clock_id=3, timestamp=mono)

    snap(boot0, mono0)
    p = t.packet.add(trusted_packet_sequence_id=1, sequence_flags=1)  # incremental state cleared
    p.trace_packet_defaults.timestamp_clock_id = 64
    s = p.clock_snapshot
    s.clocks.add(clock_id=64, timestamp=mono0, is_incremental=True)
    s.clocks.add(clock_id=3, timestamp=mono0)
    d = t.packet.add(trusted_packet_sequence_id=1, sequence_flags=2).track_descriptor
    d.uuid, d.thread.pid, d.thread.tid, d.thread.thread_name = 7, 10, 11, "main"
    last = mono0
    for name, b, e in events:
        for ts, typ in ((b, 1), (e, 2)):
            p = t.packet.add(timestamp=ts - last, trusted_packet_sequence_id=1, sequence_flags=2)
            p.track_event.type, p.track_event.track_uuid = typ, 7
            if typ == 1:
                p.track_event.name = name
            last = ts
    snap(boot0 + 2000, mono0 + 2000)
    path.write_bytes(t.SerializeToString())
    return str(path)


def test_trace_processor_reads_rank_files_as_merged(tmp_path, fake_tp):
    """Two ranks' files, both on sequence 1, the second started before the first (its snapshots
    read earlier times). Concatenated as they are, trace processor shares the sequence's clock
    64 between them, sees MONOTONIC go back in it and converts no event of either file after
    that (clock_sync_failure_no_path). Streamed as ``stepscope merge`` writes them, every slice
    lands at MONOTONIC + 500 (BOOTTIME - MONOTONIC on this host), as on the embedded engine."""
    a = _rank_file(tmp_path / "rank0.summary.pftrace", 1000, 500, [("a", 600, 700)])
    b = _rank_file(tmp_path / "rank1.summary.pftrace", 900, 400, [("b", 450, 550)])
    want = [("b", 950, 100), ("a", 1100, 100)]
    sql = "SELECT name, ts, dur FROM slice ORDER BY ts"
    for engine in ("trace_processor", "embedded"):
        with eng.open([a, b], engine=engine, trace_processor_bin=fake_tp) as db:
            assert [tuple(r) for r in db.query(sql)] == want, engine
            # the second file's snapshots go back: left out as the merge leaves them out,
            # neither refused (invalid_clock_snapshots) nor a clock made unusable
            assert db.query("SELECT COUNT(*) AS n FROM stats WHERE value > 0 AND (name LIKE"
                            " 'clock_sync%' OR name = 'invalid_clock_snapshots')") == [{"n": 0}]
