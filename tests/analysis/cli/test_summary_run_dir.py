"""Issue 17 item 8: ``stepscope summary RUN_DIR`` (and ``RUN_DIR/*.pftrace``) count each step
once: the summary file gives the tables, the detail windows only the detail-only tables."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import pytest

import stepscope
from stepscope import cli
from stepscope.analysis.merge import merge
from stepscope.profiler import Profiler, schedule


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One rank, 10 batches; windows record batches 3-4 and 7-8 (skip 1, wait 1, warmup 1,
    active 2, twice), each with a user range "user <i>" in its Forward phase; then
    ``stepscope merge`` writes merged.pftrace into the run directory, as the example does."""
    root = tmp_path_factory.mktemp("prof")
    prof = Profiler(root, schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=1),
                    run_id="r", host_metrics=False, report=False)
    prof.start()
    for i, _ in enumerate(prof.dataloader(range(10))):
        with prof.phase("Forward"), stepscope.annotate(f"user {i}"):
            time.sleep(0.001)
        prof.step(num_samples=4)
    prof.stop()
    run = root / "r"
    merge([run], run / "merged.pftrace")
    names = sorted(p.name for p in run.iterdir())
    assert names == ["merged.pftrace", "rank0.detail.0.pftrace", "rank0.detail.1.pftrace",
                     "rank0.summary.pftrace"]
    return run


def summary(argv, capsys):
    rc = cli.main(["summary", "--engine", "embedded", "--format", "json", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out), err


def steps_of(data):
    return data["steps"]["notes"], [r["steps"] for r in data["distributed"]["rows"]]


def test_run_dir_counts_every_step_once(run_dir, capsys):
    data, err = summary([str(run_dir)], capsys)
    # 10 steps in the summary file; the windows' 4 steps are not added again
    assert steps_of(data) == (["10 steps"], [10])
    assert data["overview"]["rows"][0]["calls"] == 10
    # the operators come from the two windows: batches 3, 4, 7, 8, one range each
    ops = data["operators"]
    assert ops["title"] == "Operators (detail windows)"
    assert sorted((r["name"], r["calls"]) for r in ops["rows"]) == [
        ("user 3", 1), ("user 4", 1), ("user 7", 1), ("user 8", 1)]
    assert "from 2 detail window file(s)" in ops["notes"][0]
    assert err == (f"stepscope summary: left out {run_dir / 'merged.pftrace'} "
                   "(it repeats the run's rank files)\n")


def test_run_dir_files_parent_dir_and_run_dir_agree(run_dir, capsys):
    by_dir, _ = summary([str(run_dir)], capsys)
    files = sorted(str(p) for p in run_dir.glob("*.pftrace"))
    assert len(files) == 4
    assert summary(files, capsys)[0] == by_dir  # RUN_DIR/*.pftrace
    assert summary([str(run_dir.parent)], capsys)[0] == by_dir  # the profiler's dir
    assert summary([str(run_dir), files[1]], capsys)[0] == by_dir  # a file named twice


def test_detail_windows_alone_and_merged_alone(run_dir, capsys):
    data, err = summary([str(p) for p in sorted(run_dir.glob("rank0.detail.*"))], capsys)
    assert steps_of(data) == (["4 steps"], [4]) and err == ""
    assert data["operators"]["title"] == "Operators" and len(data["operators"]["rows"]) == 4
    data, err = summary([str(run_dir / "merged.pftrace")], capsys)
    assert steps_of(data) == (["10 steps"], [10]) and "operators" not in data


def test_sql_on_a_run_dir_reads_the_summary_files(run_dir, capsys):
    rc = cli.main(["sql", "--engine", "embedded", "--format", "csv", str(run_dir),
                   "select count(*) as n from slice where category = 'step'"])
    out, _ = capsys.readouterr()
    assert rc == 0 and out.splitlines()[-1] == "10"


def test_directories_without_one_run(tmp_path, capsys):
    rc = cli.main(["summary", str(tmp_path)])
    _, err = capsys.readouterr()
    assert rc == 2 and err == (
        f"stepscope summary: error: cannot read {tmp_path}: is a directory without "
        "rank<N>.summary.pftrace or rank<N>.detail.<k>.pftrace files; give trace files by "
        "name\n")
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "rank0.summary.pftrace").write_bytes(b"")
    rc = cli.main(["summary", str(tmp_path)])
    _, err = capsys.readouterr()
    assert rc == 2 and err == (
        f"stepscope summary: error: cannot read {tmp_path}: holds several runs "
        f"({tmp_path / 'a'}, {tmp_path / 'b'}); give run directories by name\n")


def test_two_runs_are_refused_by_summary_and_compared_by_sql(run_dir, tmp_path, capsys):
    """Two runs' rank 0 in one summary were one rank twice over (two "rank 0" rows in the
    distributed table, their steps pooled): refused in one line. SQL may compare them: each
    is a process of its own."""
    other = tmp_path / "r2"
    shutil.copytree(run_dir, other)
    rc = cli.main(["summary", "--engine", "embedded", str(run_dir), str(other)])
    _, err = capsys.readouterr()
    assert rc == 2 and err == (
        f"stepscope summary: error: cannot read {other}: rank 0 comes from another run too "
        f"({run_dir}): summarize one run at a time\n")
    rc = cli.main(["sql", "--engine", "embedded", "--format", "csv", str(run_dir), str(other),
                   "select count(*) as n from slice where category = 'step'"])
    out, _ = capsys.readouterr()
    assert rc == 0 and out.splitlines()[-1] == "20"


def test_analysis_open_takes_a_run_directory_as_the_cli_does(run_dir):
    """``stepscope.analysis.open(RUN_DIR)`` loads the run's rank files as ``summary RUN_DIR``
    does (the summary file: merged.pftrace and the detail windows would count steps twice)."""
    from stepscope import analysis

    sql = "SELECT COUNT(*) AS n FROM slice WHERE name GLOB 'step *' OR name = 'Forward'"
    with analysis.open(str(run_dir), engine="embedded") as db:
        assert db.paths == [str(run_dir / "rank0.summary.pftrace")]
        assert db.query(sql) == [{"n": 20}]  # 10 steps, 10 Forward phases: each once


def test_rank_file_names_read_back_as_written(tmp_path):
    """The run directory's reader and the merge take their rank files from one parser of the
    profiler's own name formats (they were two regexes that disagreed: the merge took
    ``rank0.summary.old.pftrace`` and ``backup_rank0.summary.pftrace``, the reader did not)."""
    from stepscope import _schema as S
    from stepscope.analysis.merge import find_inputs
    from stepscope.analysis.rundir import classify

    written = {S.SUMMARY_FILE.format(rank=12): ("summary", 12),
               S.DETAIL_FILE.format(rank=3, window=10): ("detail", 3),
               S.WORKER_FILE.format(rank=0, worker=1, pid=4242): ("worker", 0)}
    assert {n: S.rank_file(n) for n in written} == written
    others = ["rank0.summary.old.pftrace", "backup_rank0.summary.pftrace",
              "rank0.detail.pftrace", "rank0.detail.x.pftrace", "rank.summary.pftrace",
              "rank0.summary.worker1.pftrace", "rank0.summary.pftrace.tmp", "merged.pftrace"]
    assert [S.rank_file(n) for n in others] == [None] * len(others)
    for n in [*written, *others]:
        (tmp_path / n).write_bytes(b"")
    inputs = classify([str(tmp_path)])
    assert sorted(os.path.basename(p) for p in inputs.whole) == [
        "rank0.summary.worker1-4242.pftrace", "rank12.summary.pftrace"]
    assert [os.path.basename(p) for p in inputs.detail] == ["rank3.detail.10.pftrace"]
    assert sorted(p.name for p in find_inputs([tmp_path], "summary")) == sorted(
        os.path.basename(p) for p in inputs.whole)
    assert [p.name for p in find_inputs([tmp_path], "detail")] == ["rank3.detail.10.pftrace"]


def _write_rank0(path, t0: int, window: bool) -> None:
    """Rank 0 of a GPU run, as the profiler writes it: steps [0,1000) and [1000,2000) with
    Forward/Backward phases and an NCCL all-reduce (host side, ended when enqueued) in the
    summary file; the window of step 1 repeats step 1 with its device activity (CUPTI: only
    in windows): gemm [1100,1300) and [1600,1700), an NCCL kernel [1500,1800)."""
    from stepscope import _schema
    from stepscope.core.session import Session

    sess = Session(str(path), rank=0, process_name="rank 0 (h)").start()
    try:
        em = sess.emitter(clock="monotonic", level=_schema.LEVEL_SUMMARY)
        main = sess.thread_track()
        coll = sess.new_track(_schema.COLLECTIVES_TRACK_NAME)
        nccl = {"op": "allreduce", "bytes": 64, "completion": "stream"}
        for step in (0, 1) if not window else (1,):
            base = step * 1000
            em.complete(t0 + base, 1000, f"step {step}", main, "step", {"step": step})
            em.complete(t0 + base, 400, "Forward", main, "phase")
            em.complete(t0 + base + 400, 500, "Backward", main, "phase")
            em.complete(t0 + base + 450, 10, "allreduce", coll, "collective", nccl)
        if not window:  # the host sampler's counters: summary level
            cpu = sess.new_counter_track("host.process.cpu %", unit="%")
            em.counter(t0 + 500, cpu, 40.0)
        if window:
            gpu = sess.new_track("GPU 0 (H100)", parent=sess.process_uuid)
            s7, s8 = (sess.new_track(f"stream {i}", parent=gpu) for i in (7, 8))
            em.complete(t0 + 1100, 200, "gemm", s7, "kernel")
            em.complete(t0 + 1600, 100, "gemm", s7, "kernel")
            em.complete(t0 + 1500, 300, "ncclDevKernel_AllReduce", s8, "communication")
    finally:
        sess.stop()


def test_a_gpu_runs_split_comes_from_its_windows(tmp_path, capsys):
    """Device activity is in the detail windows only: the whole run's model and distributed
    tables have no GPU time, so the windows' ones follow them. Step 1's window: computation
    [1100,1300) + [1600,1700) = 300, communication (the NCCL kernel; the host op ended when
    enqueued) [1500,1800) = 300, both [1600,1700) = 100, other 1000 - 300 - 300 + 100 = 500;
    GPU time in Forward [1000,1400): 200, in Backward [1400,1900): [1500,1800) = 300."""
    t0 = time.monotonic_ns()
    _write_rank0(tmp_path / "rank0.summary.pftrace", t0, window=False)
    _write_rank0(tmp_path / "rank0.detail.0.pftrace", t0, window=True)
    data, _ = summary([str(tmp_path)], capsys)
    whole, detail = data["distributed"], data["distributed_detail"]
    assert [(r["steps"], r["computation_ms"], r["communication_ms"]) for r in whole["rows"]] == [
        (2, None, None)]
    assert detail["title"] == "Distributed (detail windows)"
    keys = ("steps", "frame_ms", "computation_ms", "communication_ms", "overlap_ms", "other_ms")
    assert [tuple(r[k] for k in keys) for r in detail["rows"]] == [
        (1, 0.001, 0.0003, 0.0003, 0.0001, 0.0005)]
    assert all(r["gpu_total_ms"] is None for r in data["model"]["rows"])
    gpu = {r["phase"]: r["gpu_total_ms"] for r in data["model_detail"]["rows"]}
    assert gpu == {"Forward": 0.0002, "Backward": 0.0003, "Others": 0.0}
    # the GPU busy row: kernels or communication [1100,1300) + [1500,1800) of the 1000 step
    assert [r["name"] for r in data["device"]["rows"]] == ["host.process.cpu %"]
    assert [(r["name"], r["mean"]) for r in data["device_detail"]["rows"]] == [
        ("GPU 0 (H100) kernel busy %", 50.0)]


def test_a_cpu_runs_windows_add_no_gpu_tables(run_dir, capsys):
    data, _ = summary([str(run_dir)], capsys)
    assert data["model"]["title"] == "Model" and data["distributed"]["title"] == "Distributed"
    assert not {"distributed_detail", "model_detail", "device_detail"} & set(data)


FAKE_TP = os.path.join(os.path.dirname(__file__), "..", "fake_tp", "trace_processor_shell")


@pytest.mark.parametrize("engine", ["embedded", "trace_processor"])
def test_a_filter_that_selects_nothing_is_an_error(run_dir, capsys, monkeypatch, engine):
    """A thread, rank or step range the run does not hold: the tables came out all but
    blank (``--threads nosuch``: the thread filter keeps the steps) or "No events to
    summarize", exit 0, with no word that the filter named nothing. Now one line naming the
    filter and what there is (on trace processor: its stand-in)."""
    engine_args = ["--engine", engine]
    if engine == "trace_processor":
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([p for p in sys.path if p]))
        engine_args += ["--trace-processor-bin", FAKE_TP]
    path = run_dir / "rank0.summary.pftrace"
    cases = [
        (["--threads", "nosuch"], "--threads: no thread 'nosuch' (threads: MainThread)"),
        (["--threads", "MainThread,999999999"],
         "--threads: no thread id '999999999' (threads: MainThread)"),
        (["--ranks", "0,7"], "--ranks: no rank 7 (ranks: 0)"),
        (["--steps", "10:20"], "--steps '10:20': no step in that range (the steps are 0 to 9)"),
    ]
    for argv, message in cases:
        rc = cli.main(["summary", *engine_args, str(path), *argv])
        out, err = capsys.readouterr()
        assert (rc, out, err) == (2, "", f"stepscope summary: error: {path}: {message}\n"), argv
    rc = cli.main(["summary", *engine_args, "-q", str(run_dir), "--threads", "nosuch"])
    out, err = capsys.readouterr()  # (the detail windows' threads read too)
    assert (rc, out, err) == (2, "", f"stepscope summary: error: {path}: --threads: no thread "
                                     "'nosuch' (threads: MainThread)\n")
    rc = cli.main(["summary", *engine_args, str(path), "--steps", "5:2"])
    out, err = capsys.readouterr()
    assert (rc, out, err) == (2, "", "stepscope summary: error: empty step range '5:2': A:B is "
                                     "steps A to B-1, give B > A\n")
    rc = cli.main(["summary", *engine_args, str(path), "--threads", "MainThread", "--ranks",
                   "0", "--steps", "9:", "--table", "steps", "--format", "json"])
    out, err = capsys.readouterr()
    assert rc == 0 and json.loads(out)["steps"]["notes"] == ["1 steps"], err


@pytest.mark.parametrize("engine", ["embedded", "trace_processor"])
def test_the_same_rank_file_twice_is_refused(run_dir, tmp_path, capsys, monkeypatch, engine):
    """A copy of a rank file beside it, or the run's merged file moved out of the run
    directory beside a rank file: the same process twice over, loaded as one with every step
    twice (20 steps for 10). The check by file name (rank<N>.summary.pftrace in two run
    directories) missed both; now one line names both files."""
    engine_args = ["--engine", engine]
    if engine == "trace_processor":
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([p for p in sys.path if p]))
        engine_args += ["--trace-processor-bin", FAKE_TP]
    rank0 = run_dir / "rank0.summary.pftrace"
    copy = tmp_path / "copy.pftrace"
    shutil.copyfile(rank0, copy)
    merged = tmp_path / "merged.pftrace"
    shutil.copyfile(run_dir / "merged.pftrace", merged)
    from stepscope import analysis

    with analysis.open(str(rank0), engine="embedded") as db:
        (pid,) = [r["pid"] for r in db.query("select pid from process where name glob 'rank *'")]
    for first, second in ((rank0, copy), (merged, rank0)):
        rc = cli.main(["summary", *engine_args, str(first), str(second)])
        out, err = capsys.readouterr()
        assert (rc, out, err) == (2, "", (
            f"stepscope summary: error: {first} and {second} hold the same process (rank 0, "
            f"pid {pid}): its steps would count twice; give each rank's file once\n"))
    assert sorted(os.listdir(tmp_path)) == ["copy.pftrace", "merged.pftrace"]
