"""Every summary table, in every format, is the same on Perfetto's trace processor and on the
embedded engine, for the example's traces and the GPU fixture's replay (issue 17, item 14).

Runs when ``STEPSCOPE_TRACE_PROCESSOR`` names a ``trace_processor_shell`` (skipped otherwise: CI
has none). Checked against trace processor v58.2 (built from Perfetto's source).

Text and Markdown must match character for character, every integer and string exactly. A float
may differ in its last bits only (1e-9 relative): SQLite 3.43+ (trace processor v58 bundles
3.50) sums floats with Kahan-Babuska-Neumaier compensation, older ones (Python's may be 3.40) do
not, so a weighted mean such as a kernel's occupancy can end ``...0.121212`` on one engine and
``...0.12121199999999997`` on the other.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
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


def _cells(fmt: str, text: str):
    """The report's values, floats as floats (csv cells, json values)."""
    if fmt == "json":
        return json.loads(text)
    return [[float(c) if _FLOAT.fullmatch(c) else c for c in row]
            for row in csv.reader(io.StringIO(text))]


_FLOAT = re.compile(r"-?\d+\.\d*(e[-+]?\d+)?|-?\d+e[-+]?\d+")


def _equal(a, b, where: str) -> None:
    """Exactly equal, floats to 1e-9 relative (see the module's docstring)."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), (where, a, b)
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12), (where, a, b)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert list(a) == list(b), where
        for k in a:
            _equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), (where, len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


def _same(paths: list[str]) -> None:
    tp, emb = _everything(paths, "trace_processor"), _everything(paths, "embedded")
    assert list(tp) == list(emb)
    for key in emb:
        if key in ("text", "md"):
            assert tp[key] == emb[key], key
        elif key in ("csv", "json"):
            _equal(_cells(key, tp[key]), _cells(key, emb[key]), key)
        else:
            _equal(tp[key], emb[key], key)
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


def test_many_steps_on_trace_processor(tmp_path):
    """A profiler-like run of 20k steps: the same tables on both engines (their speed is
    ``tools/bench_analysis.py --engine trace_processor --steps 20000``'s to measure)."""
    path = tmp_path / "steps.pftrace"
    # in a process of its own: 20k step names would fill this process's table of cached names
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tools')!r}); from bench_analysis "
            f"import generate; generate({str(path)!r}, 0, ranges=0, steps=20_000)")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    _same([str(path)])
