"""Every summary table, in every format, is the same on Perfetto's trace processor and on the
embedded engine, for the example's traces and the GPU fixture's replay (issue 17, item 14).

Runs when ``STEPSCOPE_TRACE_PROCESSOR`` names a ``trace_processor_shell`` (skipped otherwise: CI
has none). Written for trace processor v58.2 (built from Perfetto's source).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stepscope import analysis
from stepscope.analysis import summaries as S
from stepscope.analysis.engines import ENV_BIN
from stepscope.core import session as _session

ROOT = Path(__file__).resolve().parents[3]
TP = os.environ.get(ENV_BIN)
pytestmark = pytest.mark.skipif(not TP, reason=f"{ENV_BIN} names no trace_processor_shell")
FILTERS = ({}, {"steps": "3:9"}, {"ranks": [1]}, {"threads": ["MainThread"]},
           {"by_thread": True})


@pytest.fixture(scope="module")
def example_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("example")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("STEPSCOPE_OPTIONS", None)
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "train_mlp.py"), "--out",
                        str(out), "--epochs", "2", "--batches", "16"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


@pytest.fixture(scope="module")
def gpu_trace(tmp_path_factory) -> Path:
    from stepscope.gpu.fixture import load_fixture, replay_fixture

    path = tmp_path_factory.mktemp("gpu") / "gpu.pftrace"
    fx = load_fixture(ROOT / "tests" / "data" / "cupti_mlp_fixture.json.gz")
    sess = _session.Session(path).start()
    try:
        replay_fixture(sess, fx)
    finally:
        sess.stop()
    return path


def _everything(paths: list[str], engine: str) -> dict:
    """Every table's rows under each filter, and the report in every format."""
    out: dict = {}
    with analysis.open(paths, engine=engine) as db:
        for kw in FILTERS:
            tables = S.all_tables(db, names=S.TABLES, **kw)
            out[repr(kw)] = {n: t.rows for n, t in tables.items()}
        for fmt in ("text", "csv", "json", "md"):
            out[fmt] = S.report(db, fmt=fmt, unit="us")
        out["rejected"] = {r["name"]: r["value"] for r in db.query(
            "SELECT name, value FROM stats WHERE name IN "
            "('track_event_invalid_timestamp', 'invalid_clock_snapshots') AND value > 0")}
    return out


def _same(paths: list[str]) -> None:
    tp, emb = _everything(paths, "trace_processor"), _everything(paths, "embedded")
    for key in emb:
        assert tp[key] == emb[key], key
    # the traces hold data: the comparison is not between empty tables
    assert tp["{}"]["overview"]


@pytest.mark.parametrize("name", ["merged.pftrace", "rank0.summary.pftrace",
                                  "rank1.detail.0.pftrace"])
def test_example_traces(example_run, name):
    _same([str(example_run / name)])


def test_example_rank_files_together(example_run):
    """Both ranks' summary files as one input (a concatenation on trace processor)."""
    _same([str(example_run / f"rank{r}.summary.pftrace") for r in (0, 1)])


def test_gpu_fixture_trace(gpu_trace):
    _same([str(gpu_trace)])


def test_summaries_scale_with_steps_on_trace_processor(tmp_path):
    """A profiler-like run of 20k steps (100k slices): every summary on trace processor within
    twice its own load time (the model table alone took 143 s, growing with the square of the
    steps, when it joined phases to steps on computed ordinals)."""
    import time

    sys.path.insert(0, str(ROOT / "tools"))
    from bench_analysis import generate

    path = tmp_path / "steps.pftrace"
    generate(str(path), 0, ranges=0, steps=20_000)
    t0 = time.perf_counter()
    with analysis.open(str(path), engine="trace_processor") as db:
        load = time.perf_counter() - t0
        t1 = time.perf_counter()
        tables = S.all_tables(db)
        took = time.perf_counter() - t1
    assert len(tables["step_times"].rows) == 20_000
    assert took <= 2 * load + 1.0, (took, load)
