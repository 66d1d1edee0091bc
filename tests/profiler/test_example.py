"""The README's main command, shortened: 2 ranks train, merge, summarize."""

import os
import subprocess
import sys
from pathlib import Path

from tracedecode import decode

from stepscope import _schema as S

ROOT = Path(__file__).resolve().parents[2]


def test_train_mlp_two_ranks(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("STEPSCOPE_OPTIONS", None)
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "train_mlp.py"), "--out",
                        str(tmp_path), "--epochs", "2", "--batches", "16"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "rank 0: stepscope timer (32 steps)" in r.stdout
    assert "rank 1: stepscope timer (32 steps)" in r.stdout
    # the merged trace's tables: both ranks, 32 steps each
    dist = r.stdout.split("Distributed Summary")[1].split("\n\n")[0]
    rows = [ln.split() for ln in dist.splitlines() if ln.strip()[:1] in "01"]
    assert [(row[0], row[1]) for row in rows] == [("0", "32"), ("1", "32")]
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    d = decode(run / "merged.pftrace")
    assert sorted(n.split(" (")[0] for n in d.processes.values()) == ["rank 0", "rank 1"]
    steps = d.by_category(S.CAT_STEP)
    assert len(steps) == 64
    assert {x.name for x in d.by_category(S.CAT_PHASE)} == {"Forward", "Backward",
                                                             "Optimization"}
    # schedule skip_first=5, wait=4, warmup=1, active=5: batches 10-14 of each epoch in detail,
    # the prefetch thread's ranges on their own thread track
    detail = decode(run / "rank0.detail.0.pftrace")
    steps = detail.by_category(S.CAT_STEP)
    assert [x.args["step"] for x in steps] == list(range(10, 15))
    loader_tracks = {x.track for x in detail.slices if x.name == "make_batch"}
    assert len(loader_tracks) == 1 and loader_tracks != {steps[0].track}
    assert detail.tracks[loader_tracks.pop()].HasField("thread")
