"""End to end: the scenario of test_summaries_db written through stepscope's writer, read back.

Rank 0 is written by this process, rank 1 by a child process (its own pid), both with exact
timestamps through the internal emitter API (docs/internals.md) on CLOCK_MONOTONIC from a shared
origin T0. Loaded with ``stepscope.analysis.open([rank0, rank1])``, every table must equal the
table computed from the hand-made database, whose numbers test_summaries.py derives by hand.
The same tests run on trace processor when ``STEPSCOPE_TRACE_PROCESSOR`` names a binary.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_summaries_db import COLL_ARGS, live_plan, scenario  # noqa: E402

from stepscope import _schema  # noqa: E402
from stepscope.analysis import summaries  # noqa: E402
from stepscope.analysis.summaries import (
    cntk,  # noqa: E402
    sharedbase,  # noqa: E402
    sqlfiles,  # noqa: E402
)
from stepscope.analysis.summaries import tables as S  # noqa: E402
from stepscope.core import session as _session

HERE = os.path.dirname(os.path.abspath(__file__))


def write_rank(path: str, rank: int, t0: int) -> None:
    """Write one rank of the scenario (times: t0 + the scenario's ns)."""
    sess = _session.Session(path, rank=rank, process_name=f"rank {rank} (host{'AB'[rank]})")
    sess.start()
    try:
        em = sess.emitter(clock="monotonic", level=_schema.LEVEL_SUMMARY)
        main = sess.thread_track()

        def c(track, ts, dur, name, cat=None, args=None, **kw):
            em.complete(t0 + ts, dur, name, track, cat, args, **kw)

        if rank == 0:
            _rank0(sess, em, main, c, t0)
        else:
            gpu = sess.new_track("GPU 0 (A100)", parent=sess.process_uuid)
            s7 = sess.new_track("stream 7", parent=gpu)
            s8 = sess.new_track("stream 8", parent=gpu)
            c(main, 1000, 1500, "step 1", "step", {"step": 1})
            c(main, 2500, 1500, "step 2", "step", {"step": 2})
            c(s7, 1100, 500, "gemm", "kernel")
            c(s8, 1500, 500, "ncclAllReduce", "communication")
            coll = sess.new_track("collectives", parent=sess.process_uuid)
            c(coll, 1900, 200, "allreduce", "collective", dict(COLL_ARGS, bytes=1000))
            c(coll, 3000, 10, "send", "collective",
              dict(COLL_ARGS, op="send", bytes=8, completion="issued"))
            c(main, 1000, 5, "stepscope flush", "stepscope")
            ctr = sess.new_counter_track("host.process.cpu %", unit="%")
            em.counter(t0 + 1500, ctr, 75.0)
    finally:
        sess.stop()


def _rank0(sess, em, main, c, t0: int) -> None:
    ready, done = threading.Event(), threading.Event()
    th = threading.Thread(target=lambda: (ready.set(), done.wait(10)), name="worker")
    th.start()
    ready.wait(10)
    worker = sess.thread_track(th.ident)
    gpu = sess.new_track("GPU 0 (H100)", parent=sess.process_uuid)
    s7 = sess.new_track("stream 7", parent=gpu)
    s8 = sess.new_track("stream 8", parent=gpu)
    api = sess.new_track(_schema.API_TRACK_NAME, parent=main)
    c(main, 1000, 1000, "step 1", "step", {"step": 1, "num_samples": 32})
    c(main, 1000, 200, "Dataloader", "phase")
    c(main, 1000, 150, "dataloader.next", "dataloader")
    c(main, 1200, 300, "Forward", "phase")
    c(main, 1250, 150, "matmul")
    c(main, 1300, 20, "cudaLaunchKernel", "cuda_runtime", flow_ids=[1])
    c(main, 1320, 60, "inner", "mydomain")
    em.instant(t0 + 1340, "checkpoint", main)  # a mark
    c(main, 1500, 300, "Backward", "phase")
    c(api, 1600, 10, "cudaLaunchKernel", "cuda_runtime", flow_ids=[2])
    c(main, 2000, 1000, "step 2", "step", {"step": 2, "num_samples": 32})
    c(main, 2000, 100, "dataloader.next", "dataloader")
    c(main, 2100, 300, "Forward", "phase")
    c(main, 2150, 100, "matmul")
    c(main, 2400, 300, "Backward", "phase")
    c(main, 2700, 200, "Optimization", "phase")
    c(api, 2750, 10, "cudaMemcpyAsync", "cuda_runtime", flow_ids=[3])
    c(worker, 1350, 100, "matmul")
    c(worker, 1900, 150, "load")
    occ = {"blocks_per_sm": 2.0, "est_achieved_occupancy": 0.5}
    c(s7, 1330, 200, "gemm", "kernel", occ, terminating_flow_ids=[1])
    occ = {"blocks_per_sm": 4.0, "est_achieved_occupancy": 0.25}
    c(s7, 1620, 100, "gemm", "kernel", occ, terminating_flow_ids=[2])
    c(s8, 1650, 100, "relu", "kernel")
    c(s8, 2750, 200, "ncclAllReduce", "communication")
    hd = {"bytes": 4000, "copy_kind": "HtoD"}
    c(s7, 2760, 40, "Memcpy HtoD", "memcpy", hd, terminating_flow_ids=[3])
    c(s7, 2850, 100, "Memcpy DtoH", "memcpy", {"bytes": 2000, "copy_kind": "DtoH"})
    c(s7, 2960, 20, "Memset", "memset", {"bytes": 1000})
    c(s7, 3100, 100, "gemm", "kernel")
    coll = sess.new_track("collectives", parent=sess.process_uuid)
    c(coll, 2740, 10, "allreduce", "collective", dict(COLL_ARGS, completion="stream"))
    ctr = sess.new_counter_track("host.cpu.user %", unit="%")
    for ts, v in ((1000, 10.0), (2000, 30.0), (3000, 50.0)):
        em.counter(t0 + ts, ctr, v)
    done.set()
    th.join()


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    p0, p1 = str(d / "rank0.pftrace"), str(d / "rank1.pftrace")
    t0 = time.monotonic_ns()
    code = (
        f"import sys; sys.path.insert(0, {HERE!r}); "
        f"import test_summaries_e2e as m; m.write_rank({p1!r}, 1, {t0})"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    write_rank(p0, 0, t0)
    return p0, p1


@pytest.fixture(scope="module", params=["embedded", "trace_processor"])
def db(request, traces):
    if request.param == "trace_processor" and not os.environ.get("STEPSCOPE_TRACE_PROCESSOR"):
        pytest.skip("set STEPSCOPE_TRACE_PROCESSOR to a trace_processor_shell binary")
    from stepscope import analysis

    conn = analysis.open(list(traces), engine=request.param)
    yield conn
    conn.close()


# Columns that depend on the machine (real thread ids) or on absolute time.
_VOLATILE = {"ts", "tid"}


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in _VOLATILE} for r in rows]


@pytest.fixture(scope="module")
def expected():
    return scenario()


@pytest.mark.parametrize("name", S.TABLES)
def test_every_table_matches_the_hand_checked_database(db, expected, name):
    got, want = S.table(db, name), S.table(expected, name)
    assert _strip(got.rows) == _strip(want.rows), name


def test_exact_numbers_from_the_writer(db):
    rows = {r["kind"]: (r["calls"], r["total_ns"]) for r in S.table(db, "overview").rows}
    # Kernels: 930 ns of kernels, 100 of them after rank 0's last step (outside)
    assert rows["User ranges"] == (5, 450) and rows["Kernels"] == (5, 830)
    dist = {r["rank"]: r for r in S.table(db, "distributed").rows}
    assert (dist[1]["overlap_ns"], dist[1]["straggler"]) == (100, True)
    ops = {
        (r["name"], r["thread_name"]): r["total_ns"]
        for r in S.table(db, "operators", by_thread=True).rows
    }
    assert ops[("matmul", "worker")] == 100 and ops[("matmul", "MainThread")] == 250


def test_filters_match(db, expected):
    for kw in ({"steps": "2"}, {"ranks": [1]}, {"threads": ["worker"]}):
        for name in ("overview", "model", "step_times", "operators"):
            assert _strip(S.table(db, name, **kw).rows) == _strip(
                S.table(expected, name, **kw).rows
            ), (name, kw)


def test_cntk_from_the_writer(db, tmp_path):
    paths = cntk.write_cntk(db, tmp_path, timestamp="t")
    assert sorted(p.name for p in paths) == [
        "t_detail_0.csv",
        "t_detail_1.csv",
        "t_summary_0.txt",
        "t_summary_1.txt",
    ]
    # the ranks name two hosts: rank 1's MONOTONIC is moved onto rank 0's by the REALTIME
    # readings of their first snapshots (the merge's wall-clock alignment, on both engines),
    # which on one machine is off by however far apart the reads of one snapshot were
    (r0, m0), (r1, m1) = (_first_snapshot(p, (1, 3)) for p in db.paths)
    shift = (m0 - r0) - (m1 - r1)
    shift -= min(0, shift)  # the earliest event of both ranks is the origin
    lines = (tmp_path / "t_detail_1.csv").read_text().splitlines()
    main = lines[1].split(",")[1]
    assert lines[1:] == [f"{name},{thread or main},{(b + shift) / 1e6},{(e + shift) / 1e6}"
                         for name, thread, b, e in (("step 1", None, 0, 1500),
                                                    ("gemm", "stream 7", 100, 600),
                                                    ("ncclAllReduce", "stream 8", 500, 1000),
                                                    ("allreduce", "collectives", 900, 1100),
                                                    ("step 2", None, 1500, 3000),
                                                    ("send", "collectives", 2000, 2010))]


def _first_snapshot(path: str, clocks: tuple[int, ...]) -> tuple[int, ...]:
    """The readings of ``clocks`` in the file's first clock snapshot (official parser)."""
    import zlib

    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    def packets(data: bytes):
        for p in pb.Trace.FromString(data).packet:
            if p.HasField("compressed_packets"):
                yield from packets(zlib.decompress(p.compressed_packets))
            else:
                yield p

    with open(path, "rb") as f:
        for p in packets(f.read()):
            if p.HasField("clock_snapshot"):
                got = {c.clock_id: c.timestamp for c in p.clock_snapshot.clocks}
                return tuple(got[c] for c in clocks)
    raise AssertionError(f"{path}: no clock snapshot")


def test_cli_on_written_traces(traces, tmp_path, capsys):
    from stepscope import cli

    argv = ["summary", *traces, "--engine", "embedded", "--table", "kernels", "--unit", "ns"]
    assert cli.main([*argv, "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["kernels"]["rows"]
    assert [(r["name"], r["calls"], r["total_ns"]) for r in rows] == [
        ("gemm", 4, 900),
        ("ncclAllReduce", 2, 700),
        ("relu", 1, 100),
    ]
    garbage = tmp_path / "garbage.pftrace"
    garbage.write_bytes(b"\x0f\xff\xfe not a trace \x00" * 10)
    assert cli.main(["summary", str(garbage), "--engine", "embedded"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"stepscope summary: error: cannot read {garbage}: ")
    assert len(err.splitlines()) == 1


def test_loaded_slice_base_is_the_cte_and_gives_the_same_tables(traces, expected):
    """The importer's ss_slice_base (_slicebase, numpy) holds exactly the rows and values of
    _base.sql's ss_slice CTE; all_tables reads it (no filter) and gives every table as the CTEs
    do, and as the hand-checked database does."""
    from stepscope import analysis
    from stepscope.analysis.summaries import slicebase as _slicebase

    with analysis.open(list(traces), engine="embedded") as db:
        ctes = [f"{n}{c} AS ({b})" for n, c, b in sqlfiles.base_ctes(summaries.Filters())]
        cte = db.conn.execute(f"WITH RECURSIVE {', '.join(ctes)} "
                              "SELECT * FROM ss_slice ORDER BY id").fetchall()
        loaded = db.conn.execute(f"SELECT {', '.join(_slicebase.SS_COLUMNS)} "
                                 f"FROM {_slicebase.SS_TABLE} WHERE {_slicebase.SS_BASE_ROWS} "
                                 "ORDER BY id").fetchall()
        assert len(cte) == 35 and loaded == cte  # as test_summaries counts
        assert db.query("SELECT type FROM sqlite_master WHERE name = 'slice'") == \
            [{"type": "view"}]  # over the slice base (test_importer: its other rows)
        kinds = dict(db.conn.execute(f"SELECT name, kind_id FROM {_slicebase.SS_TABLE} "
                                     "WHERE name IN ('step 1', 'Forward', 'matmul', 'gemm', "
                                     "'checkpoint')"))
        assert kinds == {"step 1": 0, "Forward": 2, "matmul": 6, "gemm": 9, "checkpoint": None}
        with S.shared_base(db, summaries.Filters()) as base:
            assert base is not None
            assert db.query("SELECT type FROM sqlite_temp_master WHERE name = 'ss_slice'") == \
                [{"type": "view"}]
            # the step rows come from the base's kind index, and are those of the CTE
            on_base = sqlfiles.base_ctes(summaries.Filters(), _slicebase.PLACEHOLDERS)
            body = dict((n, b) for n, _, b in on_base)["ss_step_all"]
            assert f"FROM main.{_slicebase.SS_TABLE} s" in body and "s.kind_id = 0" in body
            steps = db.conn.execute("SELECT * FROM temp.ss_step_all ORDER BY id").fetchall()
            assert len(steps) == 4 and steps == db.conn.execute(
                f"WITH RECURSIVE {', '.join(ctes)} SELECT * FROM ss_step_all ORDER BY id"
            ).fetchall()
            # the overview's windows read the loaded index in order: no sort but the final
            # ORDER BY
            plan = live_plan(
                db.query("EXPLAIN QUERY PLAN " + summaries.render("overview", base=base)))
            assert any("COVERING INDEX ss_slice_base_kind" in d for d in plan)
            assert [d for d in plan if "TEMP B-TREE" in d] == [  # (the kinds' GROUP BYs: see
                "USE TEMP B-TREE FOR GROUP BY", "USE TEMP B-TREE FOR GROUP BY",  # test_summaries)
                "USE TEMP B-TREE FOR ORDER BY"]
            # the operators' per-name statistics read the name index: no sort for that GROUP BY
            ops = summaries.render("operators", base=base, **S.operator_values(False))
            plan = [r["detail"] for r in db.query("EXPLAIN QUERY PLAN " + ops)]
            assert any("COVERING INDEX ss_slice_base_name (kind_id=?)" in d for d in plan)
        for kw in ({}, {"by_thread": True}, {"steps": "2"}):  # the last: the CTE path
            for name, t in S.all_tables(db, **kw).items():
                assert t.rows == S.table(db, name, **kw).rows, (name, kw)
                if "by_thread" not in kw:  # the written main thread is named MainThread
                    want = S.table(expected, name, **kw).rows
                    assert _strip(t.rows) == _strip(want), (name, kw)
        assert db.query("SELECT name FROM sqlite_temp_master") == []


def test_slice_kinds_follow_the_base_sql_case():
    from stepscope.analysis.summaries import slicebase as _slicebase

    strings = ["step", "phase", "Forward", "Custom", "stepscope", "nvtx", "Step", "kernel",
               "cuda_driver", "dataloader", "Dataloader", "memset", "gpu_range"]
    cat = [-1, 0, 1, 1, 1, 1, 4, 5, 6, 7, 8, 9, 1, 11, 12]
    name = [0, 6, 2, 3, -1, 10, 2, 2, 2, 2, 2, 2, 6, 2, 2]
    dur = [5] * len(cat)
    kind, null = _slicebase.kinds(strings, np.array(cat), np.array(name), np.array(dur))
    assert np.where(null, -1, kind).tolist() == [6, 0, 2, 5, 5, 1, -1, 6, 6, 9, 7, 1, 5, 12, 13]
    # of no duration: the user ranges (no category, 'nvtx', 'Step' as a category) are instants
    kind, null = _slicebase.kinds(strings, np.array(cat), np.array(name), np.zeros(len(cat)))
    assert np.where(null, -1, kind).tolist() == [-1, 0, 2, 5, 5, 1, -1, -1, -1, 9, 7, 1, 5, 12,
                                                 13]


def test_slice_kinds_are_those_of_the_base_sql_case_for_every_category():
    """Every category _slicebase knows (and 'phase' with every phase name, NULLs, others), each
    lasting and of no duration: kinds() gives what _base.sql's CASE gives on the same slices."""
    from stepscope.analysis.summaries import slicebase as _slicebase
    from stepscope.analysis.tp import importer

    cats = [*_slicebase.KIND_OF_CATEGORY, "phase", "nvtx", None]
    names = [*_slicebase.KIND_OF_PHASE, "Custom", None]
    pairs = [(c, n, d) for c in cats for n in names for d in (0, 1)]
    conn = sqlite3.connect(":memory:")
    conn.executescript(importer.SMALL_SCHEMA + ";" + importer.BIG_SCHEMA["slice"])
    conn.executescript("INSERT INTO process(upid, pid) VALUES (0, 1);"
                       "INSERT INTO thread(utid, tid, upid) VALUES (0, 1, 0);"
                       "INSERT INTO track(id) VALUES (0);"
                       "INSERT INTO thread_track(id, utid) VALUES (0, 0);")
    conn.executemany("INSERT INTO slice(id, ts, dur, track_id, category, name) "
                     "VALUES (?, 0, ?, 0, ?, ?)",
                     [(i, d, c, n) for i, (c, n, d) in enumerate(pairs)])
    ctes = [f"{n}{c} AS ({b})" for n, c, b in sqlfiles.base_ctes(summaries.Filters())]
    want = [k for (k,) in conn.execute(f"WITH RECURSIVE {', '.join(ctes)} "
                                       "SELECT kind_id FROM ss_slice ORDER BY id")]
    strings = sorted({x for c, n, _ in pairs for x in (c, n) if x is not None})
    ids = {s: i for i, s in enumerate(strings)}
    kind, null = _slicebase.kinds(strings, np.array([ids.get(c, -1) for c, _, _ in pairs]),
                                  np.array([ids.get(n, -1) for _, n, _ in pairs]),
                                  np.array([d for _, _, d in pairs]))
    assert len(want) == len(pairs) and np.where(null, None, kind).tolist() == want
    # stepscope's slices, and the instants of no category and of 'nvtx'
    assert want.count(None) == 4 * len(names)


def test_a_failing_slice_base_leaves_the_summaries_to_the_ctes(traces, expected, monkeypatch,
                                                               caplog):
    from stepscope import analysis
    from stepscope.analysis.summaries import slicebase as _slicebase

    def broken(conn):
        raise sqlite3.OperationalError("no such table: track")

    monkeypatch.setattr(_slicebase, "track_owners", broken)
    with analysis.open(list(traces), engine="embedded") as db:
        assert not sharedbase.has_slice_base(db.conn)
        assert "no summaries' slice base (OperationalError: no such table: track)" in caplog.text
        got = S.all_tables(db, names=["overview"])["overview"].rows
        assert _strip(got) == _strip(S.table(expected, "overview").rows)


def test_all_tables_on_several_connections_give_what_one_gives(traces, monkeypatch):
    """With workers=2 the tables are shared between this thread (the db's connection) and a
    second thread on its own read-only connection to the same file; the rows are those of a
    run on one connection, and nothing is left behind."""
    from stepscope import analysis

    seen: dict[str, tuple[int, object]] = {}
    inner = S._table
    meet: list[threading.Barrier] = []  # with two workers: each waits at its first table until
    started: set[int] = set()  # the other has one too (neither can take every table)

    def spy(db_, name, *args):
        me = threading.get_ident()
        seen[name] = (me, db_)
        if meet and me not in started:
            started.add(me)
            meet[0].wait(10)
        return inner(db_, name, *args)

    def two_workers() -> None:
        seen.clear()
        started.clear()
        meet[:] = [threading.Barrier(2)]

    monkeypatch.setattr(S, "_table", spy)
    with analysis.open(list(traces), engine="embedded") as db:
        one = S.all_tables(db, workers=1)
        assert {t for t, _ in seen.values()} == {threading.get_ident()}
        two_workers()
        two = S.all_tables(db, workers=2)
        assert len({t for t, _ in seen.values()}) == 2
        readers = [d for _, d in seen.values() if isinstance(d, sqlite3.Connection)]
        assert readers and all(d is not db.conn for d in readers)
        with pytest.raises(sqlite3.ProgrammingError):  # closed once the tables are done
            readers[0].execute("SELECT 1")
        assert list(two) == list(one) == list(S.TABLES)  # report order, whoever ran them
        for name in S.TABLES:
            assert two[name].rows == one[name].rows, name
        assert db.query("SELECT name FROM sqlite_temp_master") == []
        assert not db.conn.in_transaction  # so the next report shares the work again
        two_workers()
        S.all_tables(db, workers=2, names=["overview", "operators", "model"])
        assert len({t for t, _ in seen.values()}) == 2


def test_a_table_failing_on_another_thread_fails_the_call(traces, monkeypatch):
    from stepscope import analysis

    inner = S._table
    opened: list[sqlite3.Connection] = []
    more = S._more_connections

    def spy_more(db_, n):
        got = more(db_, n)
        opened.extend(got)
        return got

    other_took_one = threading.Event()

    def failing(db_, name, *args):
        if isinstance(db_, sqlite3.Connection):  # the second thread's connection
            other_took_one.set()
            raise summaries.SummaryError(f"summary {name!r} failed: boom")
        other_took_one.wait(10)  # or this thread could take every table before the other
        return inner(db_, name, *args)

    monkeypatch.setattr(S, "_more_connections", spy_more)
    monkeypatch.setattr(S, "_table", failing)
    with analysis.open(list(traces), engine="embedded") as db:
        with pytest.raises(summaries.SummaryError, match="failed: boom"):
            S.all_tables(db, workers=2)
        assert len(opened) == 1
        with pytest.raises(sqlite3.ProgrammingError):
            opened[0].execute("SELECT 1")
        assert db.query("SELECT name FROM sqlite_temp_master") == []
        assert S.all_tables(db, workers=1, names=["overview"])["overview"].rows


def test_no_second_connection_without_a_file_or_with_pending_changes(traces, tmp_path):
    from stepscope import analysis

    mem, _ = analysis.load(list(traces))  # in memory: nothing else can open it
    assert S._more_connections(mem, 3) == []
    mem.close()
    path = str(tmp_path / "kept.db")
    conn, _ = analysis.load(list(traces), db=path)
    others = S._more_connections(conn, 2)
    assert len(others) == 2
    assert [c.execute("SELECT COUNT(*) FROM slice").fetchone() for c in others] == \
        [conn.execute("SELECT COUNT(*) FROM slice").fetchone()] * 2
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        others[0].execute("DELETE FROM counter")
    for c in others:
        c.close()
    conn.execute("DELETE FROM counter WHERE id = 1")  # uncommitted: another connection would
    assert conn.in_transaction                      # not see it
    assert S._more_connections(conn, 2) == []
    conn.rollback()
    conn.close()
    assert os.path.exists(path)  # a file the caller named is the caller's


def test_every_table_has_a_place_in_the_cost_order():
    # a table missing there would make all_tables fail; a stale name would never be computed
    assert sorted(S._COST_ORDER) == sorted(S.TABLES)
    assert [n for job in S._jobs(list(S.TABLES)) for n in job] == list(S._COST_ORDER)


def test_filtered_tables_stay_on_one_connection(traces, monkeypatch):
    """A filter materializes the filtered slices per connection: no second one is opened."""
    from stepscope import analysis

    asked = []
    more = S._more_connections
    monkeypatch.setattr(S, "_more_connections", lambda db_, n: asked.append(n) or more(db_, n))
    with analysis.open(list(traces), engine="embedded") as db:
        S.all_tables(db, workers=2, steps="1:")
        S.all_tables(db, workers=2)
    assert asked == [0, 1]
