"""Phase names: the usual spellings of Forward/Backward/Optimization/Dataloader, in any case,
are those kinds in the Overview (on the importer's slice base and on the SQL CTE alike)."""

from __future__ import annotations

import pytest

from stepscope import _schema as S
from stepscope import analysis
from stepscope.analysis import summaries
from stepscope.profiler import Profiler

# per step: (name, kind it is); "warm-up" and "forwarding" are nobody's spelling
PHASES = [("forward", "Forward"), ("FWD", "Forward"), ("bwd", "Backward"),
          ("Backward", "Backward"), ("optimizer_step", "Optimization"), ("opt", "Optimization"),
          ("Optimizer.Step", "Optimization"), ("data", "Dataloader"),
          ("warm-up", "Other phases"), ("forwarding", "Other phases")]


def test_phase_of_knows_the_aliases_in_any_ascii_case():
    assert [S.phase_of(n) for n, _ in PHASES] == [
        None if k == "Other phases" else k for _, k in PHASES]
    assert S.phase_of("FORWARD") == "Forward" and S.phase_of(None) is None
    assert S.phase_of("\u0130forward") is None  # non-ASCII case folding: as SQL's lower()


@pytest.mark.parametrize("steps", [None, "0:"], ids=["slice-base", "sql-cte"])
def test_overview_counts_every_spelling_as_its_phase(tmp_path, steps):
    prof = Profiler(tmp_path, schedule=None, run_id="r", host_metrics=False, report=False,
                    use_env=False)
    prof.start()
    for _ in range(2):
        for name, _kind in PHASES:
            with prof.phase(name):
                pass
        prof.step()
    prof.stop()
    db = analysis.open(str(tmp_path / "r" / "rank0.summary.pftrace"), engine="embedded")
    try:
        rows = summaries.table(db, "overview", steps=steps).rows
    finally:
        db.close()
    calls = {r["kind"]: r["calls"] for r in rows}
    # by hand: 2 steps x (2 Forward, 2 Backward, 3 Optimization, 1 Dataloader, 2 other)
    assert calls == {"Step": 2, "Forward": 4, "Backward": 4, "Optimization": 6, "Dataloader": 2,
                     "Other phases": 4}


def test_the_sql_test_is_made_from_the_aliases():
    sql = summaries.PHASE_KIND_SQL
    assert sql.startswith("CASE lower(s.name) WHEN 'dataloader' THEN 1") and "ELSE 5 END" in sql
    n = sum(len(v) for v in S.PHASE_ALIASES.values())
    assert sql.count(" WHEN ") == n
    assert "lower(s.name)" in summaries.render("overview")  # the placeholder is filled
