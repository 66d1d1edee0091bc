"""Engine selection, the query API, and traces written by stepscope's own writer."""

from __future__ import annotations

import os
import threading

import pytest

import stepscope
from stepscope import analysis
from stepscope.analysis import EngineError, QueryError, TraceError
from stepscope.analysis import engines as eng


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A trace from the core writer: nested ranges, a mark, a counter, a second thread."""
    path = str(tmp_path_factory.mktemp("w") / "run.pftrace")

    def worker():
        with stepscope.annotate("work"):
            pass

    with stepscope.trace(path):
        with stepscope.annotate("outer", domain="d", category="c"):
            with stepscope.annotate("inner"):
                stepscope.mark("m")
        stepscope.counter("loss", 0.5)
        stepscope.counter("loss", 0.25)
        t = threading.Thread(target=worker, name="helper")
        t.start()
        t.join()
    return path


def test_embedded_engine_reads_the_writer_trace(written):
    with analysis.open(written, engine="embedded") as db:
        assert db.engine == "embedded"
        got = db.query("SELECT s.name, s.category, s.depth, p.name AS parent, t.name AS thread "
                       "FROM slice s JOIN thread_track tt ON tt.id = s.track_id "
                       "JOIN thread t USING (utid) LEFT JOIN slice p ON p.id = s.parent_id "
                       "ORDER BY s.ts")
        assert [tuple(r.values()) for r in got] == [
            ("outer", "d,c", 0, None, "MainThread"),
            ("inner", None, 1, "outer", "MainThread"),
            ("m", None, 2, "inner", "MainThread"),
            ("work", None, 0, None, "helper"),
        ]
        assert got.columns == ["name", "category", "depth", "parent", "thread"]
        # nesting holds in time: each child inside its parent, the mark is an instant
        spans = {r["name"]: r for r in db.query("SELECT name, ts, dur FROM slice")}
        o, i, m = spans["outer"], spans["inner"], spans["m"]
        assert o["ts"] <= i["ts"] and i["ts"] + i["dur"] <= o["ts"] + o["dur"]
        assert m["dur"] == 0 and i["ts"] <= m["ts"] <= i["ts"] + i["dur"]
        vals = db.query("SELECT c.value FROM counter c JOIN counter_track t ON t.id = c.track_id"
                        " WHERE t.name = 'loss' ORDER BY c.ts")
        assert [r["value"] for r in vals] == [0.5, 0.25]
        procs = db.query("SELECT name FROM process WHERE upid > 0")
        assert len(procs) == 1 and procs[0]["name"].startswith("rank 0 (")


def test_a_threads_steps_are_its_own_in_thread_track_as_trace_processor_has_them(tmp_path):
    """The profiler's steps are on a track of their own under the thread's: trace processor
    lists it in thread_track with the thread's utid, so a query that joins slice,
    thread_track and thread finds the steps under the thread. The embedded engine listed it
    in process_track only: that query found no step. (Asked of trace processor too with
    STEPSCOPE_TRACE_PROCESSOR.)"""
    prof = stepscope.Profiler(dir=tmp_path, run_id="r", schedule=None, host_metrics=False,
                              report=False, use_env=False)
    with prof:
        for _ in prof.dataloader(range(3)):
            with prof.phase("Forward"):
                pass
            prof.step()
    path = str(tmp_path / "r" / "rank0.summary.pftrace")
    sql = ("SELECT t.name AS thread, COUNT(*) AS n FROM slice s JOIN thread_track tt "
           "ON tt.id = s.track_id JOIN thread t USING (utid) WHERE s.category = 'step' "
           "GROUP BY 1")
    engines = [("embedded", None)]
    if os.environ.get(eng.ENV_BIN):
        engines.append(("trace_processor", os.environ[eng.ENV_BIN]))
    for engine, binary in engines:
        with analysis.open(path, engine=engine, trace_processor_bin=binary) as db:
            assert [tuple(r.values()) for r in db.query(sql)] == [("MainThread", 3)], engine
            steps = db.query("SELECT COUNT(*) AS n FROM process_track pt JOIN track t "
                             "ON t.id = pt.id WHERE t.name = 'steps'")
            assert steps[0]["n"] == 0, engine


def test_query_df_and_errors(written):
    pd = pytest.importorskip("pandas")
    db = analysis.open(written, engine="embedded")
    df = db.query_df("SELECT name, dur FROM slice ORDER BY ts")
    assert isinstance(df, pd.DataFrame) and list(df["name"]) == ["outer", "inner", "m", "work"]
    with pytest.raises(QueryError, match="no such table"):
        db.query("SELECT * FROM no_such_table")
    db.close()
    db.close()  # idempotent


def test_auto_falls_back_with_one_line(written, monkeypatch, capsys):
    monkeypatch.setenv(eng.ENV_BIN, "/nonexistent/trace_processor_shell")
    db = analysis.open(written)
    assert db.engine == "embedded"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "trace processor unavailable" in err[0] and "embedded engine" in err[0]
    assert "/nonexistent/trace_processor_shell" in err[0]


def test_explicit_trace_processor_raises(written, monkeypatch):
    monkeypatch.delenv(eng.ENV_BIN, raising=False)
    with pytest.raises(EngineError, match="not an executable"):
        analysis.open(written, engine="trace_processor",
                      trace_processor_bin="/nonexistent/trace_processor_shell")


def test_a_crashing_binary_is_an_engine_error(written, tmp_path, monkeypatch):
    shell = tmp_path / "trace_processor_shell"
    shell.write_text("#!/bin/sh\nexit 3\n")
    shell.chmod(0o755)
    with pytest.raises(EngineError, match="^trace_processor_shell failed: "):
        analysis.open(written, engine="trace_processor", trace_processor_bin=str(shell))


def test_bad_arguments(written, tmp_path):
    with pytest.raises(ValueError, match="unknown engine"):
        analysis.open(written, engine="duckdb")
    with pytest.raises(TraceError, match="no such file"):
        analysis.open(str(tmp_path / "nope.pftrace"), engine="embedded")
    for engine in ("auto", "trace_processor", "embedded"):  # refused before any engine starts
        with pytest.raises(TraceError, match=r": is a directory without rank<N>.summary.pftrace "
                                             r"or rank<N>.detail.<k>.pftrace files; give trace "
                                             r"files by name$"):
            analysis.open(str(tmp_path), engine=engine)
    bad = tmp_path / "bad.pftrace"
    bad.write_bytes(b"\x00\x01garbage" * 50)
    with pytest.raises(TraceError, match="not a Perfetto"):
        analysis.open(str(bad), engine="embedded")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_a_pipe_opens_with_the_embedded_engine(written, tmp_path):
    """Not only regular files: a FIFO (as /dev/stdin or ``<(...)`` would be) is read too."""
    fifo = str(tmp_path / "trace.fifo")
    os.mkfifo(fifo)
    with open(written, "rb") as f:
        data = f.read()

    def feed():
        with open(fifo, "wb") as w:  # blocks until the reader opens the pipe
            w.write(data)

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    try:
        with analysis.open(fifo, engine="embedded") as db:
            got = db.query("SELECT name FROM slice ORDER BY ts")
            assert [r["name"] for r in got] == ["outer", "inner", "m", "work"]
    finally:
        if t.is_alive():  # the open failed before reading: unblock the writer
            with open(fifo, "rb") as r:
                r.read()
        t.join(5)


def test_progress_callback(written):
    seen = []
    analysis.open(written, engine="embedded", progress=lambda s, f: seen.append((s, f))).close()
    stages = [s for s, _ in seen]
    assert "decode" in stages and "load" in stages
    assert ("load", 1.0) in seen


def test_same_answers_on_trace_processor(written):
    """Runs only where a trace_processor_shell is available (env var or PATH)."""
    try:
        binary = eng.find_trace_processor()
    except EngineError:
        binary = None
    if not binary or not os.access(binary, os.X_OK):
        pytest.skip("no trace_processor_shell available")
    q = ("SELECT s.name, s.category, s.depth, s.dur >= 0 AS ended FROM slice s "
         "ORDER BY s.ts")
    with analysis.open(written, engine="trace_processor", trace_processor_bin=binary) as tp:
        with analysis.open(written, engine="embedded") as em:
            assert tp.query(q) == em.query(q)
            q2 = "SELECT ts, dur FROM slice ORDER BY ts"
            assert tp.query(q2) == em.query(q2)
