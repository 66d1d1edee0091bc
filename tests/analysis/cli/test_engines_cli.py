"""``stepscope sql`` and ``stepscope export-csv`` (parsers from cli_sql, wired here by hand)."""

from __future__ import annotations

import argparse
import csv
import json
import os
import sqlite3

import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from stepscope import cli
from stepscope.analysis.cli import sql as cli_sql


def run(*argv: str) -> int:
    ap = argparse.ArgumentParser(prog="stepscope")
    cli_sql.add_parsers(ap.add_subparsers())
    args = ap.parse_args(list(argv))
    return args.func(args)


@pytest.fixture
def trace(tmp_path):
    t = pb.Trace()
    d = t.packet.add(trusted_packet_sequence_id=1).track_descriptor
    d.uuid, d.name = 5, "lane"
    for ts, typ, name in ((10, 1, "a"), (30, 2, None), (40, 1, "b"), (45, 2, None)):
        p = t.packet.add(timestamp=ts, trusted_packet_sequence_id=2)
        p.track_event.type = typ
        p.track_event.track_uuid = 5
        if name:
            p.track_event.name = name
    path = tmp_path / "x.pftrace"
    path.write_bytes(t.SerializeToString())
    return str(path)


def test_sql_text_csv_json(trace, capsys):
    q = "SELECT name, dur FROM slice ORDER BY ts"
    assert run("sql", trace, q, "--engine", "embedded") == 0
    assert capsys.readouterr().out.splitlines() == [
        "name  dur", "----  ---", "a      20", "b       5", "(2 rows)"]
    assert run("sql", trace, q, "--engine", "embedded", "--format", "csv") == 0
    assert capsys.readouterr().out == "name,dur\na,20\nb,5\n"
    assert run("sql", trace, q, "--engine", "embedded", "--format", "json") == 0
    assert json.loads(capsys.readouterr().out) == [{"name": "a", "dur": 20},
                                                   {"name": "b", "dur": 5}]


def test_paths_and_query_around_an_option(trace, capsys):
    """``stepscope sql TRACE -q QUERY``: argparse stops a list of positionals at an option and
    left the query as an unknown argument; the command's list takes it. An unknown option
    stays an error, naming what it did not know."""
    q = "SELECT name, dur FROM slice ORDER BY ts"
    assert cli.main(["sql", trace, "-q", q, "--engine", "embedded", "--format", "csv"]) == 0
    assert capsys.readouterr().out == "name,dur\na,20\nb,5\n"
    with pytest.raises(SystemExit) as e:
        cli.main(["sql", trace, "--bogus", q])
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"stepscope: error: unrecognized arguments: --bogus {q}\n")


def test_sql_errors(trace, tmp_path, capsys):
    assert run("sql", trace, "SELECT * FROM nope", "--engine", "embedded") == 1
    assert "no such table: nope" in capsys.readouterr().err
    assert run("sql", str(tmp_path / "missing.pftrace"), "SELECT 1", "--engine",
               "embedded") == 2
    assert "no such file" in capsys.readouterr().err
    assert run("sql", trace) == 2
    assert "give trace file(s) and then the query" in capsys.readouterr().err


def test_sql_query_from_file(trace, tmp_path, capsys):
    f = tmp_path / "q.sql"
    f.write_text("SELECT COUNT(*) AS n FROM slice")
    assert run("sql", trace, "-f", str(f), "--engine", "embedded", "--format", "csv") == 0
    assert capsys.readouterr().out == "n\n2\n"


def test_export_csv(trace, tmp_path, capsys):
    out = tmp_path / "csv"
    assert run("export-csv", trace, "-o", str(out), "--tables", "slice,track",
               "--engine", "embedded") == 0
    with open(out / "slice.csv") as f:
        got = list(csv.DictReader(f))
    assert [(r["name"], r["ts"], r["dur"]) for r in got] == [("a", "10", "20"), ("b", "40", "5")]
    with open(out / "track.csv") as f:
        assert [r["name"] for r in csv.DictReader(f)] == ["lane"]
    assert run("export-csv", trace, "--tables", "bogus", "--engine", "embedded") == 2
    assert "unknown table 'bogus'" in capsys.readouterr().err


def test_export_csv_query_errors_say_query_failed_once(trace, tmp_path, capsys, monkeypatch):
    """Trace processor's errors come as QueryError, whose text already says "query failed";
    the embedded engine's come straight from SQLite: both read the same way."""
    from stepscope.analysis import engines

    class NoConn:  # an engine without a SQLite connection (trace processor's shape)
        def query(self, sql):
            raise engines.QueryError("query failed: no such table: slice")

        def close(self):
            pass

    monkeypatch.setattr(cli_sql, "open_traces", lambda paths, args: NoConn())
    assert run("export-csv", trace, "-o", str(tmp_path / "a"), "--tables", "slice") == 1
    assert capsys.readouterr().err.count("query failed") == 1

    class BrokenConn(NoConn):  # the embedded engine, its table gone
        conn = sqlite3.connect(":memory:")

    monkeypatch.setattr(cli_sql, "open_traces", lambda paths, args: BrokenConn())
    assert run("export-csv", trace, "-o", str(tmp_path / "b"), "--tables", "slice") == 1
    err = capsys.readouterr().err
    assert err.count("query failed") == 1 and "no such table: slice" in err


def test_export_csv_of_a_run_directory_writes_beside_it(trace, tmp_path, monkeypatch, capsys):
    # "stepscope export-csv RUN/" (a shell's completion adds the slash) wrote RUN/_csv/ inside
    # the run directory, "RUN" wrote RUN_csv/ beside it: both now write RUN_csv/
    run_dir = tmp_path / "run1"
    run_dir.mkdir()
    os.replace(trace, run_dir / "rank0.summary.pftrace")
    monkeypatch.chdir(tmp_path)
    for arg in ("run1/", "run1"):
        assert run("export-csv", arg, "--tables", "slice", "--engine", "embedded") == 0
        assert capsys.readouterr().err == f"{os.path.join('run1_csv', 'slice.csv')}: 2 rows\n"
    assert sorted(os.listdir(tmp_path)) == ["run1", "run1_csv"]
    assert os.listdir(run_dir) == ["rank0.summary.pftrace"]


def test_sql_text_prints_floats_exactly_and_escapes_control_characters(trace, capsys):
    """Floats were printed with ``.6g`` (1234567.891 as 1.23457e+06) and a NUL or newline in a
    text value was written raw (a NUL in the terminal, a broken row). Now a float reads as
    its shortest round-trip repr and control characters as Python escapes them; CSV keeps
    the raw values."""
    q = ("SELECT 1234567.891 AS x, avg(dur) / 3.0 AS third, 1e-9 AS tiny, "
         "'a' || char(0) || 'b' || char(10) || 'c' AS t FROM slice")
    assert run("sql", trace, q, "--engine", "embedded") == 0
    assert capsys.readouterr().out.splitlines() == [
        "x            third              tiny   t",
        "-----------  -----------------  -----  ---------",
        "1234567.891  4.166666666666667  1e-09  a\\x00b\\nc",
        "(1 row)"]
    assert run("sql", trace, q, "--engine", "embedded", "--format", "csv") == 0
    assert capsys.readouterr().out == ('x,third,tiny,t\n1234567.891,4.166666666666667,1e-09,'
                                       '"a\x00b\nc"\n')
