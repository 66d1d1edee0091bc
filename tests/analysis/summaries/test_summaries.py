"""Every summary table on a hand-made two-rank trace; each number is derived in the comments.

Scenario (test_summaries_db.scenario, times in ns):
rank 0: steps [1000,2000) and [2000,3000) (32 samples each); phases Dataloader [1000,1200)
(holding a wait [1000,1150)), Forward [1200,1500), Backward [1500,1800), step-2 wait [2000,2100)
(no phase), Forward [2100,2400), Backward [2400,2700), Optimization [2700,2900); user ranges
main matmul [1250,1400) (children: launch 20 + inner 60), inner [1320,1380), matmul [2150,2250),
worker matmul [1350,1450), worker load [1900,2050); launches at 1300 -> K1 gemm [1330,1530),
1600 -> K2 gemm [1620,1720), 2750 -> M1 HtoD [2760,2800); no flow: relu [1650,1750),
nccl [2750,2950), DtoH [2850,2950), memset [2960,2980), gemm [3100,3200).
rank 1: steps [1000,2500), [2500,4000); gemm [1100,1600), nccl [1500,2000).
Frame (step union) = 2000 + 3000 = 5000. Device union: rank 0 200+130+200+20+100 = 650,
rank 1 [1100,2000) = 900 -> 1550.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sqlite3
import sys
from importlib import resources

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_summaries_db import TraceDB, live_plan, scenario  # noqa: E402

from stepscope import _schema  # noqa: E402
from stepscope.analysis import summaries  # noqa: E402
from stepscope.analysis.summaries import sharedbase  # noqa: E402
from stepscope.analysis.summaries import tables as S  # noqa: E402
from stepscope.analysis.summaries.format import Table  # noqa: E402


@pytest.fixture(scope="module")
def db():
    return scenario()


def by(rows, key):
    return {r[key]: r for r in rows}


def test_overview_unions_never_double_count(db):
    rows = by(S.table(db, "overview").rows, "kind")
    got = {k: (r["calls"], r["total_ns"]) for k, r in rows.items()}
    assert got == {
        "Step": (4, 5000),
        # phase [1000,1200) holds the wait (not a separate call) + step-2 wait [2000,2100)
        "Dataloader": (2, 300),
        "Forward": (2, 600),
        "Backward": (2, 600),
        "Optimization": (1, 200),
        # [1250,1450) (main+worker matmul, inner) + [1900,2050) + [2150,2250)
        "User ranges": (5, 450),
        "Runtime API": (3, 40),
        # rank 0: 200 + [1620,1750) 130 (gemm [3100,3200) is after its last step: outside);
        # rank 1: 500
        "Kernels": (5, 830),
        "Communication": (2, 700),
        "Memcpy": (2, 140),
        "Memset": (1, 20),
        # host side: rank 0's NCCL op [2740,2750); rank 1: [1900,2100), send [3000,3010)
        "Collectives": (3, 220),
    }
    # the time outside the steps: only rank 0's last gemm
    assert {k: r["outside_ns"] for k, r in rows.items() if r["outside_ns"]} == {"Kernels": 100}
    assert rows["Kernels"]["ratio"] == pytest.approx(830 / 5000)
    assert rows["Step"]["ratio"] == 1.0
    assert list(rows) == [
        "Step",
        "Dataloader",
        "Forward",
        "Backward",
        "Optimization",
        "User ranges",
        "Runtime API",
        "Kernels",
        "Communication",
        "Memcpy",
        "Memset",
        "Collectives",
    ]


def test_model_phases_and_others(db):
    rows = by(S.table(db, "model").rows, "phase")
    assert list(rows) == ["Dataloader", "Forward", "Backward", "Optimization", "Others"]
    cpu = {
        k: (r["calls"], r["cpu_total_ns"], r["cpu_max_ns"], r["cpu_min_ns"])
        for k, r in rows.items()
    }
    # Others per step: rank 0: 1000-800=200, 1000-900=100; rank 1: 1500, 1500 (no phases)
    assert cpu == {
        "Dataloader": (2, 300, 200, 100),
        "Forward": (2, 600, 300, 300),
        "Backward": (2, 600, 300, 300),
        "Optimization": (1, 200, 200, 200),
        "Others": (4, 3300, 1500, 100),
    }
    gpu = {k: (r["gpu_total_ns"], r["gpu_max_ns"], r["gpu_min_ns"]) for k, r in rows.items()}
    # Forward: K1 via flow; Backward: K2 (flow) U relu (starts 1650 inside) = [1620,1750);
    # Optimization: nccl [2750,2950) covers M1 and DtoH; Others: memset 20 (rank 0 step 2)
    # + rank 1 step 1 [1100,2000) = 900; the gemm at 3100 is in no step.
    assert gpu == {
        "Dataloader": (0, 0, 0),
        "Forward": (200, 200, 0),
        "Backward": (130, 130, 0),
        "Optimization": (200, 200, 200),
        "Others": (920, 900, 0),
    }
    assert rows["Others"]["cpu_avg_ns"] == 825
    assert rows["Backward"]["gpu_avg_ns"] == 65
    assert rows["Others"]["cpu_ratio"] == pytest.approx(3300 / 5000)
    assert rows["Forward"]["gpu_ratio"] == pytest.approx(200 / 1550)


def test_model_phase_without_a_name_keeps_its_gpu_time():
    t = TraceDB()
    r0 = t.process(100, "rank 0")
    main = t.thread(r0, 101, "main")
    stream = t.track("stream 7", t.track("GPU 0", t.process_track(r0)))
    step = t.slice(main, 1000, 1000, "step 1", "step", {"step": 1})
    phase = t.slice(main, 1100, 500, None, "phase", parent=step)  # [1100,1600), no name
    launch = t.slice(main, 1200, 10, "cudaLaunchKernel", "cuda_runtime", parent=phase)
    t.flow(launch, t.slice(stream, 1250, 100, "gemm", "kernel"))  # launched inside the phase
    rows = by(S.table(t, "model").rows, "phase")
    assert list(rows) == [None, "Others"]
    assert (rows[None]["calls"], rows[None]["cpu_total_ns"], rows[None]["gpu_total_ns"],
            rows[None]["gpu_min_ns"], rows[None]["gpu_ratio"]) == (1, 500, 100, 100, 1.0)
    # Others: the step less its phase, 1000 - 500; no device work outside the phase
    assert (rows["Others"]["cpu_total_ns"], rows["Others"]["gpu_total_ns"]) == (500, 0)


def test_step_times_and_stats(db):
    per = S.table(db, "step_times").rows
    assert [
        (r["rank"], r["step"], r["batch_cost_ns"], r["reader_cost_ns"], r["num_samples"])
        for r in per
    ] == [
        (0, 1, 1000, 200, 32),
        (0, 2, 1000, 100, 32),
        (1, 1, 1500, 0, None),
        (1, 2, 1500, 0, None),
    ]
    assert per[0]["reader_ratio"] == 0.2 and per[0]["samples_per_s"] == 32e6
    assert per[2]["ips"] == pytest.approx(1e9 / 1500)
    stats = by(S.table(db, "steps").rows, "stat")
    assert [stats[s]["batch_cost_ns"] for s in ("avg", "min", "max", "p50", "p90")] == [
        1250,
        1000,
        1500,
        1250,
        1500,
    ]
    # reader sorted [0, 0, 100, 200]: p50 at 1.5 -> 50, p90 at 2.7 -> 170
    assert [stats[s]["reader_cost_ns"] for s in ("avg", "min", "max", "p50", "p90")] == [
        75,
        0,
        200,
        50,
        pytest.approx(170),
    ]
    assert stats["avg"]["reader_ratio"] == pytest.approx(300 / 5000)
    assert stats["avg"]["ips"] == pytest.approx(4 / 5000e-9)
    assert stats["avg"]["samples_per_s"] == pytest.approx(64 / 2000e-9)
    assert stats["min"]["ips"] == pytest.approx(1e9 / 1500)


def test_operators_threads_merged(db):
    rows = by(S.table(db, "operators").rows, "name")
    assert list(rows) == ["matmul", "load", "inner"]  # by total, descending
    m = rows["matmul"]
    assert (m["calls"], m["total_ns"], m["max_ns"], m["min_ns"]) == (3, 350, 150, 100)
    assert m["stddev_ns"] == pytest.approx(
        math.sqrt(((150 - 350 / 3) ** 2 + 2 * (100 - 350 / 3) ** 2) / 3)
    )
    assert m["self_ns"] == (150 - 20 - 60) + 100 + 100
    assert m["ratio"] == pytest.approx(350 / 5000)
    # only the first main-thread matmul launched work (K1, 200 ns)
    assert (m["gpu_total_ns"], m["gpu_max_ns"], m["gpu_min_ns"]) == (200, 200, 0)
    assert m["gpu_ratio"] == pytest.approx(200 / 1550)
    assert (rows["inner"]["self_ns"], rows["inner"]["stddev_ns"]) == (60, 0)


def test_operator_stddev_is_exact_and_the_same_on_every_path():
    """10 ms ranges with +-10 ns jitter (10,000 calls): stddev exactly 10 (the REAL sum of
    squares gave 10.9); ranges of 2^50 ns +3 / -5: exactly 4 (it gave 0). The same bits through
    trace processor's path (a REAL sum depends on the engine's summation and row order)."""
    db = TraceDB()
    r0 = db.process(100, "rank 0 (h)")
    main = db.thread(r0, 101, "main")
    t = 0
    for i in range(10_000):
        d = 10_000_000 + (10 if i % 2 else -10)
        db.slice(main, t, d, "jitter")
        t += d
    for d in ((1 << 50) + 3, (1 << 50) - 5):
        db.slice(main, t, d, "long")
        t += d
    rows = by(S.table(db, "operators").rows, "name")
    assert rows["jitter"]["stddev_ns"] == 10.0
    assert rows["long"]["stddev_ns"] == 4.0
    tp = by(S.all_tables(_TraceProcessorLike(db.conn), names=["operators"])["operators"].rows,
            "name")
    assert tp == rows


def test_operators_by_thread(db):
    t = S.table(db, "operators", by_thread=True)
    got = {
        (r["name"], r["tid"]): (r["rank"], r["thread_name"], r["calls"], r["total_ns"])
        for r in t.rows
    }
    assert got == {
        ("matmul", 101): (0, "main", 2, 250),
        ("matmul", 102): (0, "worker", 1, 100),
        ("load", 102): (0, "worker", 1, 150),
        ("inner", 101): (0, "main", 1, 60),
    }
    assert [c.key for c in t.columns[:4]] == ["name", "rank", "tid", "thread_name"]


def test_operator_gpu_time_follows_launches_into_enclosing_ranges():
    t = TraceDB()
    up = t.process(1, "rank 0 (h)")
    main = t.thread(up, 11, "main")
    api = t.track("CUDA API", main)
    stream = t.track("stream 1", t.track("GPU 0 (X)", t.process_track(up)))
    outer = t.slice(main, 0, 1000, "outer")
    t.slice(main, 100, 100, "inner", parent=outer)
    for launch, (ks, kd) in ((300, (400, 300)), (150, (160, 100)), (1100, (1100, 100))):
        t.flow(
            t.slice(api, launch, 5, "cudaLaunchKernel", "cuda_runtime"),
            t.slice(stream, ks, kd, "k", "kernel"),
        )
    rows = by(S.table(t, "operators").rows, "name")
    # launch at 300: inner ended at 200, outer still runs -> outer only; launch at 150: both;
    # launch at 1100: after both. outer = [400,700) U [160,260) = 400; inner = 100.
    assert rows["outer"]["gpu_total_ns"] == 400
    assert rows["inner"]["gpu_total_ns"] == 100
    assert rows["outer"]["gpu_ratio"] == pytest.approx(400 / 500)


def test_kernels(db):
    rows = by(S.table(db, "kernels").rows, "name")
    assert list(rows) == ["gemm", "ncclAllReduce", "relu"]
    g = rows["gemm"]
    assert (g["calls"], g["total_ns"], g["avg_ns"], g["max_ns"], g["min_ns"]) == (
        4,
        900,
        225,
        500,
        100,
    )
    assert g["ratio"] == pytest.approx(900 / 1700)
    assert g["blocks_per_sm"] == pytest.approx((2 * 200 + 4 * 100) / 300)
    assert g["occupancy"] == pytest.approx((0.5 * 200 + 0.25 * 100) / 300)
    assert rows["relu"]["blocks_per_sm"] is None


def test_memcpy(db):
    rows = by(S.table(db, "memcpy").rows, "kind")
    got = {k: (r["calls"], r["bytes"], r["total_ns"], r["bandwidth_gbps"]) for k, r in rows.items()}
    assert got == {
        "Memcpy DtoH": (1, 2000, 100, 20.0),
        "Memcpy HtoD": (1, 4000, 40, 100.0),
        "Memset": (1, 1000, 20, 50.0),
    }


def test_device(db):
    rows = {(r["rank"], r["name"]): r for r in S.table(db, "device").rows}
    cpu = rows[(0, "host.cpu.user %")]
    # 10 holds 1000 ns, 30 holds 1000 ns; the last sample only closes the span
    assert (cpu["samples"], cpu["mean"], cpu["min"], cpu["max"]) == (3, 20.0, 10.0, 50.0)
    assert rows[(1, "host.process.cpu %")]["mean"] == 75.0
    # rank 0 kernels inside [1000,3000): 200 + 130 + nccl 200 = 530 of 2000
    assert rows[(0, "GPU 0 (H100) kernel busy %")]["mean"] == pytest.approx(26.5)
    assert rows[(1, "GPU 0 (A100) kernel busy %")]["mean"] == pytest.approx(30.0)


def test_device_rank_of_counters_as_trace_processor_lists_them():
    """Trace processor (v58) gives a counter under a process descriptor no parent_id and lists
    it in process_counter_track (not process_track): its row still has the process's rank
    (it said -1 before), as does a thread counter (thread_counter_track)."""
    db = TraceDB()
    r3 = db.process(300, "rank 3 (hostC)")
    main = db.thread(r3, 301, "main")
    mem = db.counter_track("host.rss", None, upid=r3)
    clk = db.counter_track("thread.clock", None, utid=301)
    db.slice(main, 1000, 1000, "step 0", "step", {"step": 0})
    for ts, v in ((1000, 4.0), (1500, 8.0), (2000, 8.0)):
        db.counter(mem, ts, v)
    db.counter(clk, 1200, 2.0)
    rows = [(r["rank"], r["name"], r["samples"], r["mean"]) for r in S.table(db, "device").rows]
    # 4 holds 500 ns, 8 holds 500 ns: mean 6
    assert rows == [(3, "host.rss", 3, 6.0), (3, "thread.clock", 1, 2.0)]


class _TraceProcessorLike:
    """An engine that, as trace processor, is reached only through ``query`` (here on SQLite)."""

    engine = "trace_processor"

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.sqlite, self.seen = conn, []

    def query(self, sql):
        from stepscope.analysis.engines import Rows

        self.seen.append(sql)
        cur = self.sqlite.execute(sql)
        cols = [d[0] for d in cur.description or ()]
        return Rows([dict(zip(cols, r, strict=True)) for r in cur], cols)


def test_trace_processor_computes_the_base_once_for_all_tables():
    """On trace processor the base (every slice with its rank, thread and kind; steps; frame;
    totals) is made once as temporary tables for all the tables of a report, not once per
    table; the rows are those of each table computed alone from the CTEs, and nothing stays."""
    tp = _TraceProcessorLike(scenario().conn)
    got = {n: t.rows for n, t in S.all_tables(tp, names=S.TABLES).items()}
    alone = scenario()
    assert got == {n: S.table(alone, n).rows for n in S.TABLES}
    made = [q for q in tp.seen if q.startswith("CREATE TEMP TABLE")]
    assert [q.split()[3].split("(")[0] for q in made][-4:] == [
        "ss_frame", "ss_frame_region", "ss_device", "ss_totals"]
    assert sum("ss_slice" in q.split("(")[0] for q in made) == 1
    assert tp.sqlite.execute("SELECT name FROM sqlite_temp_master").fetchall() == []


def test_distributed_and_stragglers(db):
    t = S.table(db, "distributed")
    rows = by(t.rows, "rank")
    got = {
        k: (
            r["steps"],
            r["avg_step_ns"],
            r["frame_ns"],
            r["computation_ns"],
            r["communication_ns"],
            r["overlap_ns"],
            r["other_ns"],
        )
        for k, r in rows.items()
    }
    # rank 0's NCCL op [2740,2750) ended when enqueued ('stream'): not communication time (its
    # kernel [2750,2950) is); rank 1's gloo op [1900,2100) is, with its kernel [1500,2000):
    # [1500,2100) = 600, overlap with gemm [1100,1600) 100; its send ('issued') is not
    assert got == {0: (2, 1000, 2000, 330, 200, 0, 1470), 1: (2, 1500, 3000, 500, 600, 100, 2000)}
    # median of 1000 and 1500 is 1250: rank 1 is 20% slower
    assert rows[1]["straggler"] and not rows[0]["straggler"]
    assert rows[1]["vs_median"] == pytest.approx(0.2)
    # work, the mean step outside communication: (2000 - 200) / 2 = 900 and
    # (3000 - 600) / 2 = 1200, median 1050
    assert rows[1]["work_vs_median"] == pytest.approx(1200 / 1050 - 1)
    assert rows[0]["work_vs_median"] == pytest.approx(900 / 1050 - 1)
    assert not any(r["straggler"] for r in S.table(db, "distributed", straggler_margin=0.25).rows)
    assert "stragglers" in t.notes[0] and t.notes[0].endswith(": 1")


def test_a_straggler_whose_steps_the_others_wait_out_is_flagged_by_its_work():
    """Synchronous training: the others wait for the slow rank in their collectives, so every
    rank's steps last alike (vs median 0) and the step time flagged no one. Its work (the
    mean step outside communication) is the longer: rank 0 waits 800 of its two 1000 ns
    steps, rank 1 200: work 600 and 900, median 750, rank 1 +20 %, rank 0 -20 %."""
    t = TraceDB()
    for rank, waits in ((0, (400, 400)), (1, (100, 100))):
        up = t.process(10 + rank, f"rank {rank} (h)")
        main = t.thread(up, 100 + rank, "main")
        lane = t.track("collectives", t.process_track(up))
        for k, w in enumerate(waits):
            t.slice(main, 1000 * k, 1000, f"step {k}", "step", {"step": k})
            t.slice(lane, 1000 * k + 1000 - w, w, "allreduce", "collective",
                    {"op": "allreduce", "bytes": 64})
    table = S.table(t, "distributed")
    rows = by(table.rows, "rank")
    assert [(rows[r]["avg_step_ns"], rows[r]["communication_ns"], rows[r]["vs_median"])
            for r in (0, 1)] == [(1000, 800, 0.0), (1000, 200, 0.0)]
    assert rows[1]["work_vs_median"] == pytest.approx(0.2)
    assert rows[0]["work_vs_median"] == pytest.approx(-0.2)
    assert [rows[r]["straggler"] for r in (0, 1)] == [False, True]
    assert table.notes[0] == ("stragglers (mean step, or its work outside communication, > "
                              "median by more than 10%): 1")


def test_distributed_of_ranks_without_device_time():
    """No device slices: nothing to split the time with (computation, overlap, other None);
    communication still from the collectives timed to completion, else None too: not from a
    send ended when issued, nor from a recv ended at the program's late wait ('waited', its
    completion's latest, counted apart in the collectives table)."""
    t = TraceDB()
    r0 = t.process(10, "rank 0 (h)")
    t.slice(t.thread(r0, 11, "main"), 0, 1000, "step 0", "step", {"step": 0})
    lanes = [t.track("collectives", t.process_track(r0)) for _ in range(2)]
    args = {"op": "allreduce", "bytes": 64}
    t.slice(lanes[0], 100, 200, "allreduce", "collective", args)  # [100,300)
    t.slice(lanes[1], 250, 150, "allreduce", "collective", args)  # [250,400): union 300
    t.slice(lanes[0], 500, 10, "send", "collective", {**args, "completion": "issued"})
    t.slice(lanes[1], 450, 300, "recv", "collective", {**args, "completion": "waited"})
    t.slice(lanes[0], 1100, 100, "allreduce", "collective", args)  # after the step
    t.slice(lanes[1], 700, 0, "allreduce", "collective", args)  # 0 long: adds nothing
    r1 = t.process(20, "rank 1 (h)")
    t.slice(t.thread(r1, 21, "main"), 0, 1000, "step 0", "step", {"step": 0})
    rows = by(S.table(t, "distributed").rows, "rank")
    keys = ("frame_ns", "computation_ns", "communication_ns", "overlap_ns", "other_ns")
    assert {r: tuple(rows[r][k] for k in keys) for r in rows} == {
        0: (1000, None, 300, None, None), 1: (1000, None, None, None, None)}
    # no device time anywhere: no GPU time, no kernel, no GPU busy row
    assert not S.table(t, "kernels") and not S.table(t, "device")
    by_op = by(S.table(t, "collectives").rows, "name")
    assert (by_op["allreduce"]["calls"], by_op["allreduce"]["timed"],
            by_op["allreduce"]["total_ns"], by_op["allreduce"]["bytes_per_s"]) == (
        4, 4, 450, 4 * 64 * 1e9 / 450)
    assert [(r["calls"], r["timed"], r["waited"], r["total_ns"]) for r in
            (by_op["recv"], by_op["send"])] == [(1, 0, 1, None), (1, 0, 0, None)]


def test_collectives_by_op(db):
    """Every op counts in calls and bytes; the times are those of the ops timed to their
    completion: rank 0's NCCL op ended when enqueued ('stream'), rank 1's send when issued."""
    assert S.table(db, "collectives").rows == [
        {"name": "allreduce", "calls": 2, "bytes": 4096 + 1000, "timed": 1, "waited": 0,
         "total_ns": 200, "avg_ns": 200, "max_ns": 200, "min_ns": 200,
         "bytes_per_s": 1000 * 1e9 / 200},
        {"name": "send", "calls": 1, "bytes": 8, "timed": 0, "waited": 0, "total_ns": None,
         "avg_ns": None, "max_ns": None, "min_ns": None, "bytes_per_s": None},
    ]
    text = S.table(db, "collectives").render("text", unit="ns")
    assert "4.66 GiB/s" in text  # 5e9 bytes/s = 4.657 GiB/s


def test_step_range_filter(db):
    rows = by(S.table(db, "overview", steps="2").rows, "kind")
    got = {k: (r["calls"], r["total_ns"]) for k, r in rows.items()}
    # windows: rank 0 [2000,3000), rank 1 [2500,4000); slices kept when they start inside
    assert got == {
        "Step": (2, 2500),
        "Dataloader": (1, 100),
        "Forward": (1, 300),
        "Backward": (1, 300),
        "Optimization": (1, 200),
        "User ranges": (1, 100),
        "Runtime API": (1, 10),
        "Communication": (1, 200),
        "Memcpy": (2, 140),
        "Memset": (1, 20),
        "Collectives": (2, 20),  # rank 0's at 2740, rank 1's send at 3000 (gloo's at 1900: out)
    }
    assert rows["Communication"]["ratio"] == pytest.approx(200 / 2500)
    steps = S.table(db, "step_times", steps=(1, 2)).rows
    assert [(r["rank"], r["step"]) for r in steps] == [(0, 1), (1, 1)]
    assert S.table(db, "step_times", steps="5:").rows == []


def _frame_scenario() -> TraceDB:
    """One rank whose steps leave gaps: main thread steps 1 [1000,2000), 2 [2000,3000) (they
    touch), 3 [3400,4000), 4 [5000,6000); a second thread's step 5 [5500,6500) overlaps step 4.
    Frame islands [1000,3000), [3400,4000), [5000,6500): 2000 + 600 + 1500 = 4100."""
    t = TraceDB()
    up = t.process(1, "rank 0 (h)")
    main, other = t.thread(up, 11, "main"), t.thread(up, 12, "other")
    for n, (ts, end) in enumerate([(1000, 2000), (2000, 3000), (3400, 4000), (5000, 6000)], 1):
        t.slice(main, ts, end - ts, f"step {n}", "step", {"step": n})
    t.slice(other, 5500, 1000, "step 5", "step", {"step": 5})
    t.slice(main, 3000, 400, "stepscope window end", "stepscope")  # no kind: not counted
    # ranges around the loop: [500,3200) and [3300,7000) (one starts before the first
    # step, the other in the gap after the first island; both end beyond their region)
    t.slice(main, 500, 2700, "epoch", None)
    t.slice(main, 3300, 3700, "epoch", None)
    # waits: across the first island's start, in the gap [3000,3400), across the second
    # island's end, across the third island's start
    for ts in (900, 3100, 3900, 4900):
        t.slice(main, ts, 200 if ts != 3100 else 100, "dataloader.next", "dataloader")
    t.slice(main, 1200, 300, "Forward", "phase")
    t.slice(main, 2100, 300, "Forward", "phase")
    return t


def test_overview_counts_the_time_inside_the_steps_and_shows_the_rest_outside():
    """A kind's time is its union clipped to the frame islands; the rest is outside_ns. Before,
    the epochs' union (6400) read 156 % of the step time (4100)."""
    t = _frame_scenario()
    want = {
        # (calls, inside, outside)
        "Step": (5, 4100, 0),
        # [900,1100): 100 in (the piece leaves its region: frame time before its ends, 100 - 0),
        # [3100,3200): 0 in (the gap), [3900,4100): 100 in, [4900,5100): 100 in (leaves its
        # region); 100 out each
        "Dataloader": (4, 300, 400),
        "Forward": (2, 600, 0),
        # union [500,3200) + [3300,7000) = 6400; inside: every island, 4100
        "User ranges": (2, 4100, 2300),
    }
    alone = by(S.table(t, "overview").rows, "kind")
    shared = by(S.all_tables(t, names=["overview"])["overview"].rows, "kind")
    tp = by(S.all_tables(_TraceProcessorLike(t.conn), names=["overview"])["overview"].rows,
            "kind")
    for rows in (alone, shared, tp):
        assert {k: (r["calls"], r["total_ns"], r["outside_ns"]) for k, r in rows.items()} == want
        assert rows["User ranges"]["ratio"] == 1.0
        assert rows["Dataloader"]["ratio"] == pytest.approx(300 / 4100)
    # steps 3 and 4: islands [3400,4000), [5000,6000); slices that start in [3400,6000) stay:
    # the waits [3900,4100) and [4900,5100), 100 in and 100 out each
    rows = by(S.table(t, "overview", steps=(3, 5)).rows, "kind")
    assert {k: (r["calls"], r["total_ns"], r["outside_ns"]) for k, r in rows.items()} == {
        "Step": (2, 1600, 0), "Dataloader": (2, 200, 200)}


def test_rank_and_thread_filters(db):
    rows = by(S.table(db, "overview", ranks=[1]).rows, "kind")
    assert {k: r["total_ns"] for k, r in rows.items()} == {
        "Step": 3000,
        "Kernels": 500,
        "Communication": 500,
        "Collectives": 210,
    }
    rows = by(S.table(db, "overview", threads=["worker"]).rows, "kind")
    # host slices of other threads go; device slices stay; ratios still refer to the steps
    assert rows["User ranges"]["calls"] == 2 and rows["User ranges"]["total_ns"] == 250
    assert rows["User ranges"]["ratio"] == pytest.approx(250 / 5000)
    assert "Step" not in rows and rows["Kernels"]["total_ns"] == 830  # and 100 outside
    assert rows["Kernels"]["outside_ns"] == 100
    assert by(S.table(db, "overview", threads=[102]).rows, "kind")["User ranges"]["total_ns"] == 250


def test_the_thread_filter_leaves_out_the_async_ranges():
    """Async ranges (start_range, async def) lie on the process's "async ranges" tracks, of no
    one thread: a thread filter leaves them out (they were kept, as device slices are).
    Step [0, 1000) on main; "a" [100, 300) on main, "w" [200, 500) on worker, "fetch"
    [150, 650) async, a kernel [400, 500)."""
    db = TraceDB()
    r0 = db.process(100, "rank 0 (hostA)")
    main, worker = db.thread(r0, 101, "main"), db.thread(r0, 102, "worker")
    db.slice(main, 0, 1000, "step 1", "step", {"step": 1})
    db.slice(main, 100, 200, "a")
    db.slice(worker, 200, 300, "w")
    db.slice(db.track(_schema.ASYNC_TRACK_NAME, db.process_track(r0)), 150, 500, "fetch")
    gpu = db.track("GPU 0 (H100)", db.process_track(r0))
    db.slice(db.track("stream 7", gpu), 400, 100, "gemm", "kernel")
    rows = by(S.table(db, "overview").rows, "kind")
    assert rows["User ranges"]["calls"] == 3 and rows["User ranges"]["total_ns"] == 550
    rows = by(S.table(db, "overview", threads=["worker"]).rows, "kind")
    assert rows["User ranges"]["calls"] == 1 and rows["User ranges"]["total_ns"] == 300
    assert rows["Kernels"]["total_ns"] == 100  # device slices stay
    ops = S.table(db, "operators", threads=[101]).rows
    assert [(r["name"], r["calls"]) for r in ops] == [("a", 1)]


def test_a_prefetch_threads_waits_are_no_reader_cost_of_the_steps():
    """A loader iterated on a prefetch thread (prefetch_generator's "DataLoaderX"): the steps'
    thread waits on a queue, not on the loader. Steps [0,1000), [1000,2000) on main, which
    waits [0,100); the prefetch thread's waits [50,450) and [1100,1900). Reader cost 100 and
    0 (the timer's), the Model's Dataloader 1 call of 100 and Others 900 + 1000. Before: 450
    and 800, and Dataloader (1300) + Others (1800) came to 3100 of 2000."""
    db = TraceDB()
    r0 = db.process(100, "rank 0 (hostA)")
    main, prefetch = db.thread(r0, 101, "MainThread"), db.thread(r0, 102, "Thread-1")
    db.slice(main, 0, 1000, "step 1", "step", {"step": 1})
    db.slice(main, 1000, 1000, "step 2", "step", {"step": 2})
    db.slice(main, 0, 100, "dataloader.next", "dataloader")
    db.slice(prefetch, 50, 400, "dataloader.next", "dataloader")
    db.slice(prefetch, 1100, 800, "dataloader.next", "dataloader")
    assert [(r["step"], r["reader_cost_ns"]) for r in S.table(db, "step_times").rows] == [
        (1, 100), (2, 0)]
    rows = by(S.table(db, "model").rows, "phase")
    assert (rows["Dataloader"]["calls"], rows["Dataloader"]["cpu_total_ns"]) == (1, 100)
    assert (rows["Others"]["calls"], rows["Others"]["cpu_total_ns"]) == (2, 1900)
    # a rank without steps: its waits are its Dataloader time, whichever thread
    db = TraceDB()
    r0 = db.process(100, "rank 0 (hostA)")
    db.slice(db.thread(r0, 102, "Thread-1"), 50, 400, "dataloader.next", "dataloader")
    assert by(S.table(db, "model").rows, "phase")["Dataloader"]["cpu_total_ns"] == 400


def test_process_scoped_stream_tracks_give_the_same_tables(db):
    """Trace processor lists tracks under a process descriptor in process_track too."""
    other = scenario(streams_as_process_tracks=True)
    for name in S.TABLES:
        assert S.table(other, name).rows == S.table(db, name).rows, name


def test_no_steps_frame_is_the_span():
    t = TraceDB()
    up = t.process(7, "trainer")  # no "rank N": rank = pid
    th = t.thread(up, 8, "main")
    t.slice(th, 100, 50, "a")
    t.slice(th, 300, 100, "a")
    rows = by(S.table(t, "overview").rows, "kind")
    assert rows["User ranges"]["total_ns"] == 150
    assert rows["User ranges"]["ratio"] == pytest.approx(150 / 300)  # span [100, 400)
    assert S.table(t, "distributed").rows[0]["rank"] == 7
    assert S.table(t, "model").rows == [] and S.table(t, "steps").rows == []


def test_sort_and_formats(db):
    t = S.table(db, "kernels", sort="calls")
    assert [r["name"] for r in t.rows] == ["gemm", "ncclAllReduce", "relu"]
    assert [r["name"] for r in S.table(db, "kernels", sort="name").rows] == [
        "gemm",
        "ncclAllReduce",
        "relu",
    ]
    assert [r["name"] for r in S.table(db, "kernels", sort="Min").rows][0] == "ncclAllReduce"
    with pytest.raises(KeyError, match="no column 'bogus'"):
        S.table(db, "kernels", sort="bogus")
    t = S.table(db, "memcpy")
    csv_text = t.to_csv("us")
    assert csv_text.splitlines()[0] == (
        "kind,calls,total_us,avg_us,max_us,min_us,bytes,bandwidth_gbps"
    )
    assert csv_text.splitlines()[2] == "Memcpy HtoD,1,0.04,0.04,0.04,0.04,4000,100.0"
    data = json.loads(t.to_json("ns"))
    assert data["rows"][0]["total_ns"] == 100 and data["unit"] == "ns"
    text = t.to_text("us")
    assert "Memory Copies Summary" in text and "Total (us)" in text
    assert "Memcpy HtoD      1       0.040" in text
    md = t.to_markdown("ms")
    assert md.splitlines()[2].startswith("| Kind | Calls | Total (ms)")
    df = t.to_dataframe("ns")
    assert list(df["total_ns"]) == [100, 40, 20]
    with pytest.raises(ValueError, match="unknown time unit"):
        t.to_text("hours")


def test_report_and_all_tables(db):
    tables = S.all_tables(db, sort="total")
    assert list(tables) == list(S.TABLES)
    assert [r["name"] for r in tables["operators"].rows][0] == "matmul"
    text = S.report(db, unit="us")
    for title in (
        "Overview",
        "Model",
        "Steps",
        "Operators",
        "Kernels",
        "Memory Copies",
        "Device",
        "Distributed",
    ):
        assert f"{title} Summary" in text
    assert "Step Times Summary" not in text
    empty = TraceDB()
    assert S.report(empty) == "No events to summarize.\n"
    assert (
        json.loads(S.report(db, fmt="json", names=["kernels"]))["kernels"]["rows"][0]["name"]
        == "gemm"
    )


def test_shared_base_gives_the_same_tables_and_cleans_up():
    db = scenario()
    for kw in ({}, {"steps": "2"}, {"threads": ["worker"], "ranks": [0]}, {"by_thread": True}):
        shared = S.all_tables(db, **kw)
        for name, t in shared.items():
            assert t.rows == S.table(db, name, **kw).rows, (name, kw)
    with S.shared_base(db, summaries.Filters()) as base:
        assert base is not None
        # rank 0: 28 slices (a mark among them); rank 1: 2 steps, 2 device, 2 collectives,
        # 1 bookkeeping (the unfinished one: out)
        assert db.query("SELECT COUNT(*) AS n FROM temp.ss_slice") == [{"n": 35}]
    assert db.query("SELECT name FROM sqlite_temp_master") == []
    db.conn.execute("CREATE TEMP TABLE ss_frame(x)")  # a taken name: the CTEs are used
    with S.shared_base(db, summaries.Filters()) as base:
        assert base is None
    assert db.query("SELECT name FROM sqlite_temp_master") == [{"name": "ss_frame"}]
    assert S.all_tables(db)["model"].rows == S.table(db, "model").rows


def test_shared_base_keys_slices_by_id_and_orders_the_overview_window():
    db = scenario()
    with S.shared_base(db, summaries.Filters()) as base:
        plan = db.query("EXPLAIN QUERY PLAN SELECT ts FROM ss_slice WHERE id = 3")
        assert ["INTEGER PRIMARY KEY" in r["detail"] for r in plan] == [True]
        sql = "EXPLAIN QUERY PLAN " + summaries.render("overview", base=base)
        full = [r["detail"] for r in db.query(sql)]
        plan = live_plan(db.query(sql))
        # the union window reads the frame regions in (upid, id) order and each one's slices
        # from (kind_id, upid, ts, end_ts); a piece that leaves its region looks the frame up
        # by (upid, f0): the one sort left is the final ORDER BY of the kinds (the arm for the
        # CTEs alone, which sorts, is planned and skipped)
        assert "MATERIALIZE x" in full and "MATERIALIZE x" not in plan
        assert "SCAN r USING INDEX ss_frame_region_ix0" in plan
        assert ("SEARCH s USING COVERING INDEX ss_slice_ix0 (kind_id=? AND upid=? AND ts>? "
                "AND ts<?)") in plan
        assert plan.count("SEARCH c USING INDEX ss_frame_region_ix1 (upid=? AND f0<?)") == 2
        # the two GROUP BY sorts group the kinds (at most 15 rows; two aggregates, so that the
        # pass runs once); the slices are counted in index order
        assert [d for d in plan if "TEMP B-TREE" in d] == [
            "USE TEMP B-TREE FOR GROUP BY", "USE TEMP B-TREE FOR GROUP BY",
            "USE TEMP B-TREE FOR ORDER BY"]
        assert "SEARCH ss_slice USING COVERING INDEX ss_slice_ix0 (kind_id>?)" in plan
        # threads merged, the operators read no process or thread row per range
        for by_thread in (False, True):
            sql = summaries.render("operators", base=base, **S.operator_values(by_thread))
            plan = [r["detail"].split() for r in db.query("EXPLAIN QUERY PLAN " + sql)]
            joined = {d[1] for d in plan if d[0] in ("SCAN", "SEARCH")} & {"p", "th"}
            assert joined == ({"p", "th"} if by_thread else set())
    conn = db.conn  # a repeated id: the keyed table is refused and removed
    with pytest.raises(sqlite3.IntegrityError):
        sharedbase._create_temp(conn, "dup", "SELECT 1 AS id, 2 AS x UNION ALL SELECT 1, 3",
                                "id")
    assert db.query("SELECT name FROM sqlite_temp_master") == []
    assert not conn.in_transaction  # other connections can still be opened on it


def test_bad_input_is_explained(db):
    with pytest.raises(summaries.SummaryError, match="unknown table 'nope'"):
        S.table(db, "nope")
    with pytest.raises(summaries.SummaryError, match="bad step range"):
        S.table(db, "overview", steps="a:b")
    broken = TraceDB()
    broken.conn.execute("DROP TABLE flow")
    with pytest.raises(summaries.SummaryError, match="summary 'model' failed"):
        S.table(broken, "model")


def test_query_rows_accepts_engine_results():
    class Row:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class RowObjects:  # like perfetto's QueryResultIterator
        def query(self, sql):
            return iter([Row(a=1, b="x")])

    class Frame:
        def query(self, sql):
            import pandas as pd

            return pd.DataFrame([{"a": 1, "b": None}])

    assert S.query_rows(RowObjects(), "q") == [{"a": 1, "b": "x"}]
    assert S.query_rows(Frame(), "q") == [{"a": 1, "b": None}]


def test_parse_steps():
    assert summaries.parse_steps("3:7") == (3, 7)
    assert summaries.parse_steps("3:") == (3, None)
    assert summaries.parse_steps(":7") == (None, 7)
    assert summaries.parse_steps("4") == (4, 5)
    for empty in ("5:2", "5:5"):  # selected nothing: "No events to summarize", exit 0
        with pytest.raises(summaries.SummaryError) as e:
            summaries.parse_steps(empty)
        assert str(e.value) == (f"empty step range {empty!r}: A:B is steps A to B-1, give "
                                "B > A")


# every SQL file the package ships (not a hand-kept list that could miss a new one)
SQL_FILES = sorted(p.name[:-4] for p in resources.files("stepscope.analysis.summaries")
                   .joinpath("sql").iterdir() if p.name.endswith(".sql"))


def test_sql_literals_are_schema_names():
    """The SQL matches on the literal values of _schema: check none drifted."""
    import re

    cats = {v for k, v in vars(_schema).items() if k.startswith("CAT_")}
    keys = {
        f"debug.{v}"
        for k, v in vars(_schema).items()
        if k.startswith("ARG_") and isinstance(v, str)
    }
    phases = set(_schema.PHASES)
    used = set()
    for name in SQL_FILES:
        used |= set(re.findall(r"'([^']*)'", summaries.sql_text(name)))
    assert {
        "step",
        "phase",
        "dataloader",
        "kernel",
        "communication",
        "memcpy",
        "memset",
        "cuda_runtime",
        "cuda_driver",
        "sync",
        "gpu_range",
        "stepscope",
    } <= cats
    debug_keys = {u for u in used if u.startswith("debug.")}
    assert debug_keys and debug_keys <= keys
    assert phases <= used
    # every category literal compared in SQL is a schema category
    cat_literals = set()
    for name in SQL_FILES:
        text = summaries.sql_text(name)
        cat_literals |= set(re.findall(r"category\s*(?:=|<>)\s*'([^']*)'", text))
        for m in re.finditer(r"category\s+IN\s*\(([^)]*)\)", text):
            cat_literals |= set(re.findall(r"'([^']*)'", m.group(1)))
    assert cat_literals and cat_literals <= cats | {""}
    assert _schema.STEP_NAME.startswith("step ")  # the SQL parses "step <n>" from char 6


def test_rendered_sql_has_no_placeholders():
    f = summaries.Filters.make(threads=[1, "x'y"], ranks=[0], steps="1:3")
    sqls = [summaries.render(n, f) for n in SQL_FILES if n not in ("_base", "operators")]
    sqls += [summaries.render("operators", f, **S.operator_values(b)) for b in (False, True)]
    for sql in sqls:
        code = [ln for ln in sql.splitlines() if ln.strip() and not ln.lstrip().startswith("--")]
        assert "{{" not in sql and code[0] == "WITH RECURSIVE"
        assert "'x''y'" in sql


def test_table_is_falsy_when_empty():
    assert not Table("x", "X", [], [])


def test_device_mean_holds_the_last_sample_to_the_end_of_the_run():
    """Issue 17 item 10: with two samples the mean was the first one (the last held 0 ns).

    Steps [0,1000) and [1000,4000): the run ends at 4000. rss 100 at 1000 holds 2000 ns,
    300 at 3000 holds the last 1000 ns: (100*2000 + 300*1000) / 3000 = 500000 / 3000.
    A sample after the run's end (cpu 7 at 5000) holds nothing: (10*4000 + 7*0) / 4000 = 10.
    With steps 1: (the window [1000,4000)), only the two rss samples, held as before."""
    db = TraceDB()
    up = db.process(100, "rank 0 (h)")
    main = db.thread(up, 101, "main")
    db.slice(main, 0, 1000, "step 0", "step", {"step": 0})
    db.slice(main, 1000, 3000, "step 1", "step", {"step": 1})
    rss = db.counter_track("host.process.rss", db.process_track(up))
    db.counter(rss, 1000, 100.0)
    db.counter(rss, 3000, 300.0)
    cpu = db.counter_track("host.cpu.user %", db.process_track(up))
    db.counter(cpu, 0, 10.0)
    db.counter(cpu, 5000, 7.0)
    rows = by(S.table(db, "device").rows, "name")
    assert rows["host.process.rss"]["mean"] == pytest.approx(500000 / 3000)
    assert (rows["host.process.rss"]["min"], rows["host.process.rss"]["max"]) == (100.0, 300.0)
    assert rows["host.cpu.user %"]["mean"] == pytest.approx(10.0)
    rows = by(S.table(db, "device", steps="1:").rows, "name")
    assert rows["host.process.rss"]["mean"] == pytest.approx(500000 / 3000)
    assert "host.cpu.user %" not in rows


def test_device_mean_stops_every_sample_at_the_end_of_the_run():
    """A sample before the run's end holds until the end, not until a next sample after it,
    and samples after the end hold nothing (a PyTorch run's host.cpu.user %: 81.07 printed,
    81.26 by hand over its steps).

    Steps [0,4000). cpu 10 at 0 holds 2000 ns, 20 at 2000 holds 2000 (to 4000, not to the
    next sample at 5000), 7 at 5000 and 9 at 6000 hold nothing: (10*2000 + 20*2000) / 4000."""
    db = TraceDB()
    up = db.process(100, "rank 0 (h)")
    main = db.thread(up, 101, "main")
    db.slice(main, 0, 4000, "step 0", "step", {"step": 0})
    cpu = db.counter_track("host.cpu.user %", db.process_track(up))
    for ts, v in ((0, 10.0), (2000, 20.0), (5000, 7.0), (6000, 9.0)):
        db.counter(cpu, ts, v)
    row = by(S.table(db, "device").rows, "name")["host.cpu.user %"]
    assert row["mean"] == pytest.approx((10 * 2000 + 20 * 2000) / 4000)
    assert (row["samples"], row["min"], row["max"]) == (4, 7.0, 20.0)


def test_device_mean_starts_every_sample_at_the_start_of_the_run():
    """A sample before the run's start holds from the start on, until its next sample: host
    rates are stamped at the start of their interval, the first at the sampler's first
    reading, before the first step (under ``stepscope run``, at interpreter start).

    Steps [2000,5000). cpu 50 at 0 holds nothing (its next sample, at 1000, is before the
    start too), 10 at 1000 holds [2000,3000), 20 at 3000 holds [3000,5000):
    (10*1000 + 20*2000) / 3000. Before, 50 held 1000 ns and 10 held 2000."""
    db = TraceDB()
    up = db.process(100, "rank 0 (h)")
    main = db.thread(up, 101, "main")
    db.slice(main, 2000, 3000, "step 0", "step", {"step": 0})
    cpu = db.counter_track("host.process.cpu %", db.process_track(up))
    for ts, v in ((0, 50.0), (1000, 10.0), (3000, 20.0)):
        db.counter(cpu, ts, v)
    row = by(S.table(db, "device").rows, "name")["host.process.cpu %"]
    assert row["mean"] == pytest.approx((10 * 1000 + 20 * 2000) / 3000)
    assert (row["samples"], row["min"], row["max"]) == (3, 10.0, 50.0)


def test_every_sql_file_states_its_algorithm_in_a_header():
    """As Perfetto's stdlib documents each table: every SQL file opens with a comment block
    (at least three lines) saying what it computes, and each summary table's file opens with
    the table's title."""
    for name in SQL_FILES:
        lines = summaries.sql_text(name).splitlines()
        header = list(itertools.takewhile(lambda line: line.startswith("--"), lines))
        assert len(header) >= 3, name
    for name in summaries.TABLES:
        spec = S._SPECS[name]
        first = summaries.sql_text(spec.sql).splitlines()[0]
        assert first.lower().startswith(f"-- {spec.title.split()[0].lower()}"), (name, first)


class _InterruptedOnce(sqlite3.Connection):
    """A connection whose statement starting with ``fail`` fails once, as interrupted."""

    fail: str | None = None

    def execute(self, sql, *args):
        if self.fail is not None and sql.startswith(self.fail):
            self.fail = None
            raise sqlite3.OperationalError("interrupted")
        return super().execute(sql, *args)


def test_a_shared_base_interrupted_while_it_makes_a_table_leaves_no_table():
    """all_tables on several connections interrupts the others' queries at the first error:
    an interrupt that hit the statement dropping a keyed table's empty first copy (inside
    _create_temp) left ss_frame_region behind (a race a README test run met once)."""
    db = scenario()
    conn = sqlite3.connect(":memory:", factory=_InterruptedOnce)
    db.conn.backup(conn)
    db.conn = conn
    conn.fail = "DROP TABLE temp.ss_frame_region"
    with S.shared_base(db, summaries.Filters()) as base:
        assert base is None and conn.fail is None  # it failed there, and fell back
    assert db.query("SELECT name FROM sqlite_temp_master") == []
    assert S.table(db, "steps").rows  # the tables from the CTEs
