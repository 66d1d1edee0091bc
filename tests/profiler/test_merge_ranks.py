"""4 ranks in 4 processes -> stepscope merge -> one timeline with 4 named, aligned processes."""

import multiprocessing as mp
import socket
import time

import pytest
from tracedecode import decode

from stepscope import _schema as S
from stepscope import cli
from stepscope.analysis import merge as M

RANKS = 4


def _rank(rank, out, barrier):
    import os

    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(RANKS)
    from stepscope.profiler import Profiler, schedule

    prof = Profiler(out, schedule(warmup=0, active=2), run_id="run", host_metrics=False,
                    report=False)
    prof.start()
    time.sleep(0.01 * rank)  # ranks reach the barrier at different times
    barrier.wait()
    prof.step()  # step 1 starts at the same instant on every rank
    time.sleep(0.02)
    prof.step()
    prof.stop()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(RANKS)
    procs = [ctx.Process(target=_rank, args=(r, out, barrier)) for r in range(RANKS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * RANKS
    return out / "run"


def test_four_ranks_one_timeline(run_dir, tmp_path, capsys):
    out = tmp_path / "merged.pftrace"
    assert cli.main(["merge", str(run_dir), "-o", str(out)]) == 0
    assert "clock alignment: shared clock (one host" in capsys.readouterr().out
    d = decode(out)
    host = socket.gethostname()
    assert sorted(d.processes.values()) == [f"rank {r} ({host})" for r in range(RANKS)]
    pid_of = {name: pid for pid, name in d.processes.items()}
    # every rank's sequences kept apart: 4 ranks x (main + training thread) sequences at least
    assert len(d.seq_ids) >= 2 * RANKS
    step1 = {}
    for s in d.by_category(S.CAT_STEP):
        if s.name == "step 1":
            step1[d.track_pid(s.track)] = s
    assert set(step1) == set(pid_of.values())
    starts = [s.ts for s in step1.values()]
    # released by one barrier: the same instant on the shared clock, up to scheduling noise
    assert max(starts) - min(starts) < 50_000_000
    assert all(15_000_000 <= s.dur < 500_000_000 for s in step1.values())
    # detail merge: the windows' files of every rank
    out2 = tmp_path / "detail.pftrace"
    res = M.merge([run_dir], out2, level="detail")
    assert res.ranks == [0, 1, 2, 3]
    assert len(decode(out2).processes) == RANKS


def test_rank_filter(run_dir, tmp_path):
    out = tmp_path / "some.pftrace"
    assert cli.main(["merge", str(run_dir), "-o", str(out), "--ranks", "1,3"]) == 0
    names = sorted(decode(out).processes.values())
    assert [n.split(" (")[0] for n in names] == ["rank 1", "rank 3"]
    files = sorted(run_dir.glob("rank*.summary.pftrace"))
    res = M.merge(files[2:], tmp_path / "two.pftrace", ranks="0-2")
    assert res.ranks == [2]
