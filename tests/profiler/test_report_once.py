"""Issue 17 item 10 (a): ``print(prof.summary())`` after ``stop()`` shows the report once."""

from __future__ import annotations

import pytest

from stepscope import analysis
from stepscope.analysis import engines
from stepscope.profiler import Profiler


@pytest.fixture(autouse=True)
def embedded(monkeypatch):
    """The report's tables on the embedded engine (no trace processor download)."""
    monkeypatch.setattr(analysis, "open", lambda path: engines.open(path, engine="embedded"))


def run(tmp_path, report):
    prof = Profiler(tmp_path, schedule=None, run_id="r", host_metrics=False, report=report)
    prof.start()
    for _ in prof.dataloader(range(3)):
        prof.step(num_samples=2)
    prof.stop()
    return prof


def test_stop_prints_and_print_summary_does_not_repeat(tmp_path, capsys):
    prof = run(tmp_path, report=True)
    out, at_stop = capsys.readouterr()
    assert out == "" and at_stop.count("Steps Summary") == 1
    assert "stepscope timer (3 steps)" in at_stop and "Note: 3 steps" in at_stop
    report = prof.summary()
    print(report)
    out, err = capsys.readouterr()
    assert err == "" and out == (
        "stepscope: the report was printed at stop() (on stderr); prof.summary().text holds "
        "it, Profiler(report=False) leaves it to you\n")
    assert report.printed_at_stop
    # the value is the whole report: the text stop() printed (and str methods see it)
    assert "Steps Summary" in report.text and report.text + "\n" in at_stop
    assert report == report.text and "Note: 3 steps" in report
    # another report (other options) was never printed: print shows it in full
    print(prof.summary(unit="us"))
    out, _ = capsys.readouterr()
    assert "Time unit: us" in out and out.count("Steps Summary") == 1


@pytest.mark.parametrize("when", ["after stop", "before stop"])
def test_without_report_at_stop_print_shows_it(tmp_path, capsys, when):
    if when == "after stop":
        prof = run(tmp_path, report=False)
        assert capsys.readouterr() == ("", "")
        print(prof.summary())
        out, _ = capsys.readouterr()
        assert out.count("Steps Summary") == 1 and "stepscope timer (3 steps)" in out
    else:
        prof = Profiler(tmp_path, schedule=None, run_id="r", host_metrics=False)
        prof.start()
        prof.step()
        print(prof.summary())  # before stop: the timer only, in full
        out, _ = capsys.readouterr()
        prof.stop()
        capsys.readouterr()
        assert out.startswith("stepscope timer") and "Summary" not in out
        assert prof.summary().printed_at_stop
