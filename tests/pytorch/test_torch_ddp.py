"""Two processes, DDP over gloo on CPU, each with two DataLoader workers: collectives from DDP's
C++ reducer, worker files, the distributed summary (issue 20 items 3 and 4), through the example
script run as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install stepscope[torch])")

import tq  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_torch.py"
SAMPLES, BATCH = 128, 16  # per run: 64 samples per rank, 4 steps of 16 per rank
STEPS = 4
PARAM_BYTES = 4 * (8 * 1 * 9 + 8 + 16 * 8 * 9 + 16 + 16 * 7 * 7 * 10 + 10)  # SmallCNN, float32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=os.pathsep.join(sys.path),
                   # rank 1 without detail windows: one Kineto start-up less (seconds)
                   STEPSCOPE_OPTIONS=json.dumps({"report": False, "host_metrics": False,
                                                 **({"schedule": None} if rank else {})}))
        procs.append(subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--dir", str(out), "--run-id", "ddp", "--epochs", "1",
             "--samples", str(SAMPLES), "--batch-size", str(BATCH), "--workers", "2",
             "--window", "1", "3"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    return out / "ddp"


def test_every_file_of_both_ranks_and_their_workers(run):
    names = sorted(p.name for p in run.iterdir())
    assert "rank0.detail.0.pftrace" in names
    for rank in (0, 1):
        assert f"rank{rank}.summary.pftrace" in names
        workers = [n for n in names if n.startswith(f"rank{rank}.summary.worker")]
        assert sorted(n.split(".")[2].split("-")[0] for n in workers) == ["worker0", "worker1"]


@pytest.mark.parametrize("rank", [0, 1])
def test_ddp_allreduce_from_cpp_as_collective_ranges(run, rank):
    """Seen through the process groups' hooks, or on a torch without them (2.11) through our
    kernel on the c10d ops' BackendSelect key; the last step's all-reduce too, whose done
    callback may come after the program's stop() began."""
    d = tq.db(run / f"rank{rank}.summary.pftrace")
    steps = tq.slices(d, "s.category = 'step'")
    assert len(steps) == STEPS
    comm = tq.slices(d, "s.category = 'collective'")
    allreduce = [c for c in comm if c["name"] == "allreduce"]
    assert len(allreduce) == STEPS  # one gradient bucket per step, from DDP's C++ reducer
    for c in allreduce:
        assert tq.args(d, c["arg_set_id"]) == {
            "op": "allreduce", "bytes": str(PARAM_BYTES), "dtype": "float32",
            "group_size": "2", "group": "0"}
        assert c["dur"] > 0
    tracks = tq.rows(d, "SELECT DISTINCT t.name FROM slice s JOIN track t ON t.id = s.track_id "
                        "WHERE s.category = 'collective'")
    assert tracks == [{"name": "collectives"}]
    # the distributed summary's communication column is the union of those ranges in the steps
    from stepscope.analysis import summaries

    row = summaries.table(d, "distributed").rows[0]
    spans = sorted((max(c["ts"], st["ts"]), min(c["ts"] + c["dur"], st["ts"] + st["dur"]))
                   for c in comm for st in steps)
    covered, end = 0, None
    for a, b in spans:
        if b <= a:
            continue
        if end is None or a >= end:
            covered += b - a
            end = b
        elif b > end:
            covered += b - end
            end = b
    assert row["communication_ns"] == covered > 0
    # host activity, not the device's: no GPU split, no GPU time, no kernels on a CPU run
    assert (row["computation_ns"], row["overlap_ns"], row["other_ns"]) == (None, None, None)
    assert all(r["gpu_total_ns"] is None for r in summaries.table(d, "model").rows)
    assert not summaries.table(d, "kernels")
    assert not any("busy" in r["name"] for r in summaries.table(d, "device").rows)
    by_op = {r["name"]: r for r in summaries.table(d, "collectives").rows}
    durs = [c["dur"] for c in allreduce]
    assert {k: by_op["allreduce"][k] for k in ("calls", "bytes", "timed", "total_ns", "max_ns",
                                                "min_ns")} == {
        "calls": STEPS, "bytes": STEPS * PARAM_BYTES, "timed": STEPS, "total_ns": sum(durs),
        "max_ns": max(durs), "min_ns": min(durs)}
    assert by_op["allreduce"]["bytes_per_s"] == pytest.approx(STEPS * PARAM_BYTES * 1e9
                                                              / sum(durs), rel=1e-12)


def test_dataloader_worker_fetches_in_their_own_files(run):
    fetches = getitems = collates = 0
    host = socket.gethostname()
    for path in sorted(run.glob("rank0.summary.worker*.pftrace")):
        d = tq.db(path)
        worker, pid = path.name.split(".")[2].removeprefix("worker").split("-")
        # the worker's thread is a thread of the rank's process
        assert tq.rows(d, "SELECT p.name AS process, t.name AS thread, t.tid FROM thread t "
                          "JOIN process p USING(upid) WHERE t.tid != 0") == [
            {"process": f"rank 0 ({host})", "thread": f"DataLoader worker {worker} (pid {pid})",
             "tid": int(pid)}]
        sl = tq.slices(d)
        fetch = [s for s in sl if s["name"] == "fetch"]
        fetches += len(fetch)
        getitems += sum(s["name"] == "__getitem__" for s in sl)
        collates += sum(s["name"] == "collate" for s in sl)
        assert all(s["depth"] == 0 for s in fetch)
        assert {s["category"] for s in sl} == {"dataloader_worker"}
        cpu = tq.rows(d, "SELECT COUNT(*) AS n FROM counter c JOIN counter_track t ON "
                         "t.id = c.track_id WHERE t.name = "
                         f"'DataLoader worker {worker} (pid {pid}).cpu %'")
        assert cpu[0]["n"] >= 1
    # every range survives the workers' os._exit: one fetch and collate per batch, a
    # __getitem__ per sample of the rank
    assert (fetches, collates, getitems) == (STEPS, STEPS, SAMPLES // 2)


def test_merge_takes_the_workers_into_their_ranks(run, tmp_path):
    from stepscope.analysis import merge, summaries

    out = tmp_path / "merged.pftrace"
    merge.merge([run], out)
    d = tq.db(out)
    host = socket.gethostname()
    names = sorted(r["name"] for r in tq.rows(d, "SELECT name FROM process WHERE name IS NOT NULL"))
    assert names == [f"rank 0 ({host})", f"rank 1 ({host})"]
    dist = summaries.table(d, "distributed").rows
    assert [(r["rank"], r["steps"]) for r in dist] == [(0, STEPS), (1, STEPS)]
    overview = {r["kind"]: r for r in summaries.table(d, "overview").rows}
    assert overview["Step"]["ratio"] == 1.0  # the workers' spans add no frame time
    assert len(tq.slices(d, "s.name = '__getitem__'")) == SAMPLES


def test_summary_of_the_run_directory_takes_the_workers_into_their_ranks(run, tmp_path, capsys):
    """`stepscope summary RUN_DIR` reads the workers' files with their ranks (it left them out,
    saying they repeated the rank files): each worker's CPU counter in the device table, the
    fetches among the ranges, and still two ranks of 4 steps."""
    import json

    from stepscope.cli import main

    out = tmp_path / "s.json"
    assert main(["summary", str(run), "--format", "json", "-o", str(out),
                 "--table", "device,operators,distributed"]) == 0
    assert "left out" not in capsys.readouterr().err
    tables = {name: t["rows"] for name, t in json.loads(out.read_text()).items()}
    assert [(r["rank"], r["steps"]) for r in tables["distributed"]] == [(0, STEPS), (1, STEPS)]
    workers = sorted((r["rank"], r["name"].split(" (pid")[0]) for r in tables["device"]
                     if r["name"].startswith("DataLoader worker"))
    assert workers == [(0, "DataLoader worker 0"), (0, "DataLoader worker 1"),
                       (1, "DataLoader worker 0"), (1, "DataLoader worker 1")]
    calls = {r["name"]: r["calls"] for r in tables["operators"]}
    assert (calls["fetch"], calls["collate"], calls["__getitem__"]) == (
        2 * STEPS, 2 * STEPS, SAMPLES)  # both ranks: a fetch per batch, a __getitem__ a sample


def test_operators_of_the_window(run):
    d = tq.db(run / "rank0.detail.0.pftrace")
    conv = tq.slices(d, "s.name = 'aten::conv2d'")
    assert len(conv) == 2 * 2  # two convolutions, batches 1 and 2
    shapes = tq.args(d, conv[0]["arg_set_id"])["input_shapes"]
    assert shapes.startswith("[[16, 1, 28, 28], [8, 1, 3, 3], [8]")
