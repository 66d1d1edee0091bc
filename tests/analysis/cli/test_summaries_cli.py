"""``stepscope summary`` argument handling and output, on the hand-made trace database."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_summaries_db import scenario  # noqa: E402

from stepscope import cli  # noqa: E402
from stepscope.analysis.cli import summary as cli_summary  # noqa: E402


@pytest.fixture
def trace(tmp_path, monkeypatch):
    """A file that exists; opening it yields the scenario database (no importer needed)."""
    path = tmp_path / "run.pftrace"
    path.write_bytes(b"x")
    opened = []

    def fake_open(p, args):
        opened.append((p, args.engine))
        return scenario()

    monkeypatch.setattr(cli_summary, "_open", fake_open)
    return str(path), opened


def run(argv, capsys):
    rc = cli.main(["summary", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_csv_of_one_table(trace, capsys):
    path, opened = trace
    rc, out, err = run([path, "--table", "memcpy", "--format", "csv", "--unit", "us"], capsys)
    assert rc == 0 and err == ""
    assert out == (
        "# memcpy\n"
        "kind,calls,total_us,avg_us,max_us,min_us,bytes,bandwidth_gbps\n"
        "Memcpy DtoH,1,0.1,0.1,0.1,0.1,2000,20.0\n"
        "Memcpy HtoD,1,0.04,0.04,0.04,0.04,4000,100.0\n"
        "Memset,1,0.02,0.02,0.02,0.02,1000,50.0\n"
    )
    assert opened == [([path], "auto")]


def test_json_with_filters_and_sort(trace, capsys):
    path, _ = trace
    argv = [path, "--table", "overview,kernels", "--format", "json", "--unit", "ns"]
    argv += ["--ranks", "1", "--sort", "total", "--engine", "embedded"]
    rc, out, _ = run(argv, capsys)
    assert rc == 0
    data = json.loads(out)
    assert list(data) == ["overview", "kernels"]
    assert [(r["kind"], r["total_ns"]) for r in data["overview"]["rows"]] == [
        ("Step", 3000),
        ("Kernels", 500),
        ("Communication", 500),
        ("Collectives", 210),
    ]
    assert [r["name"] for r in data["kernels"]["rows"]] == ["gemm", "ncclAllReduce"]


def test_text_report_and_steps_filter(trace, capsys):
    path, _ = trace
    rc, out, _ = run([path, "--steps", "2:3", "--table", "step_times", "--unit", "ns"], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert "Step Times Summary" in lines[0]
    body = [ln.split() for ln in lines[5:7]]
    assert [b[:4] for b in body] == [["0", "2", "1000", "100"], ["1", "2", "1500", "0"]]


def test_operators_by_thread_and_threads_filter(trace, capsys):
    path, _ = trace
    argv = [path, "--table", "operators", "--by-thread", "--threads", "worker", "--format", "md"]
    rc, out, _ = run(argv, capsys)
    assert rc == 0
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and "worker" in ln]
    assert len(rows) == 2 and all("| 102 |" in r for r in rows)


def test_cntk_files_and_output_file(trace, capsys, tmp_path):
    path, _ = trace
    out_file = tmp_path / "report.txt"
    rc, out, err = run([path, "--cntk", str(tmp_path / "cntk"), "-o", str(out_file)], capsys)
    assert rc == 0 and out == ""
    assert len(os.listdir(tmp_path / "cntk")) == 4 and err.count("wrote ") == 4
    text = out_file.read_text()
    assert "Overview Summary" in text and "Distributed Summary" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--table", "nope"], "unknown table 'nope'"),
        (["--sort", "bogus"], "no selected table has a column 'bogus'"),
        (["--steps", "x"], "bad step range"),
        (["--ranks", "a"], "--ranks takes integers"),
    ],
)
def test_bad_arguments(trace, capsys, argv, message):
    path, opened = trace
    rc, out, err = run([path, *argv], capsys)
    assert rc == 2 and out == "" and message in err
    assert opened == []  # rejected before any trace is loaded


def test_missing_file_and_directory(capsys, tmp_path):
    rc, _, err = run([str(tmp_path / "absent.pftrace")], capsys)
    assert rc == 2 and "no such file" in err
    rc, _, err = run([str(tmp_path)], capsys)
    assert rc == 2 and "is a directory" in err


def test_unreadable_trace_is_one_line(monkeypatch, capsys, tmp_path):
    path = tmp_path / "bad.pftrace"
    path.write_bytes(b"\xff\xff")

    def failing_open(p, args):
        raise ValueError("not a Perfetto trace")

    monkeypatch.setattr(cli_summary, "_open", failing_open)
    rc, _, err = run([str(path)], capsys)
    assert rc == 2
    assert err == f"stepscope summary: error: cannot read {path}: not a Perfetto trace\n"


def test_several_paths_load_into_one_database(trace, capsys, tmp_path):
    path, opened = trace
    other = tmp_path / "rank1.pftrace"
    other.write_bytes(b"x")
    rc, out, _ = run([path, str(other), "--table", "distributed", "--format", "csv"], capsys)
    assert rc == 0 and opened == [([path, str(other)], "auto")]
    assert out.splitlines()[0] == "# distributed" and len(out.splitlines()) == 4


def test_engine_arguments_reach_the_loader(monkeypatch, capsys, tmp_path):
    path = tmp_path / "run.pftrace"
    path.write_bytes(b"x")
    seen = []

    def fake_open(p, args):
        seen.append((args.engine, args.trace_processor_bin, args.quiet))
        return scenario()

    monkeypatch.setattr(cli_summary, "_open", fake_open)
    argv = [str(path), "-q", "--trace-processor-bin", "/opt/tp", "--engine", "trace_processor"]
    rc, _, err = run([*argv, "--table", "overview"], capsys)
    assert rc == 0 and err == ""
    assert seen == [("trace_processor", "/opt/tp", True)]


def test_output_naming_an_input_trace_is_refused(trace, capsys, tmp_path):
    # `-o RUN/rank0.summary.pftrace` wrote the text report over the trace it had just read
    path, opened = trace
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    rank0 = run_dir / "rank0.summary.pftrace"
    rank0.write_bytes(b"trace bytes")
    for argv, target in (([path], path), ([str(run_dir)], str(rank0)),
                         ([path, str(run_dir)], os.path.join(str(tmp_path), "r1", ".",
                                                             "rank0.summary.pftrace"))):
        rc, out, err = run([*argv, "-o", target], capsys)
        assert (rc, out) == (2, "")
        assert err == (f"stepscope summary: error: -o {target}: is one of the inputs; name a "
                       "new file\n")
    assert open(path, "rb").read() == b"x" and rank0.read_bytes() == b"trace bytes"
    assert opened == []  # refused before anything is loaded
