"""CNTK-style per-rank files from the hand-made two-rank trace (see test_summaries_db.scenario)."""

from __future__ import annotations

import csv
import datetime as dt
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_summaries_db import TraceDB, scenario  # noqa: E402

from stepscope.analysis.summaries import (
    SummaryError,  # noqa: E402
    cntk,  # noqa: E402
)

STAMP = "2026-01-02_03-04-05"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("cntk")
    paths = cntk.write_cntk(scenario(), out, timestamp=dt.datetime(2026, 1, 2, 3, 4, 5))
    return out, paths


def test_file_names_per_rank(files):
    out, paths = files
    assert sorted(p.name for p in paths) == [
        f"{STAMP}_detail_0.csv",
        f"{STAMP}_detail_1.csv",
        f"{STAMP}_summary_0.txt",
        f"{STAMP}_summary_1.txt",
    ]
    assert all(p.parent == out for p in paths)


def test_detail_rows_are_relative_ms(files):
    out, _ = files
    with open(out / f"{STAMP}_detail_1.csv", newline="") as f:
        rows = list(csv.reader(f))
    # origin = earliest event over all ranks (1000 ns); the unfinished slice and the
    # profiler's own 'stepscope' slice are left out
    assert rows == [
        ["name", "thread_id", "begin_ms", "end_ms"],
        ["step 1", "201", "0.0", "0.0015"],
        ["gemm", "stream 7", "0.0001", "0.0006"],
        ["ncclAllReduce", "stream 8", "0.0005", "0.001"],
        ["allreduce", "collectives", "0.0009", "0.0011"],
        ["step 2", "201", "0.0015", "0.003"],
        ["send", "collectives", "0.002", "0.00201"],
    ]
    with open(out / f"{STAMP}_detail_0.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert len(rows) - 1 == 27  # rank 0: 16 main-thread + 2 worker + 8 device + 1 collective
    assert rows[1] == ["step 1", "101", "0.0", "0.001"]


def test_summary_stats(files):
    out, _ = files
    lines = (out / f"{STAMP}_summary_1.txt").read_text().splitlines()
    assert lines[1] == "Rank: 1" and lines[2] == f"Timestamp: {STAMP}"
    table = [ln.split() for ln in lines[7:]]
    # both steps grouped as "step": avg 1500 ns, std dev 0, min/max 1500, count 2, total 3000
    assert table == [
        ["step", "0.001500", "0.000000", "0.001500", "0.001500", "2", "0.003000"],
        ["gemm", "0.000500", "0.000000", "0.000500", "0.000500", "1", "0.000500"],
        ["ncclAllReduce", "0.000500", "0.000000", "0.000500", "0.000500", "1", "0.000500"],
        ["allreduce", "0.000200", "0.000000", "0.000200", "0.000200", "1", "0.000200"],
        ["send", "0.000010", "0.000000", "0.000010", "0.000010", "1", "0.000010"],
    ]


def test_event_stats_exact():
    stats = {
        s["name"]: s
        for s in cntk.event_stats(
            [
                {"name": "matmul", "dur": 150},
                {"name": "matmul", "dur": 100},
                {"name": "matmul", "dur": 100},
                {"name": "x", "dur": 7},
            ]
        )
    }
    m = stats["matmul"]
    assert (m["count"], m["total_ns"], m["min_ns"], m["max_ns"]) == (3, 350, 100, 150)
    assert m["stddev_ns"] == pytest.approx(math.sqrt(15000 / 27))
    assert stats["x"]["stddev_ns"] == 0.0


def test_no_events_and_bad_timestamp(tmp_path):
    assert cntk.write_cntk(TraceDB(), tmp_path / "x", timestamp=STAMP) == []
    with pytest.raises(SummaryError, match="bad timestamp"):
        cntk.write_cntk(TraceDB(), tmp_path, timestamp="a/b")
