"""Issue 17 item 10 (c)-(e): binary byte units, "-" and no columns for absent GPU data, long
names cut in the middle to keep text tables within 200 columns (full in CSV/JSON)."""

from __future__ import annotations

import csv
import io
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_summaries_db import TraceDB, scenario  # noqa: E402

from stepscope import cli  # noqa: E402
from stepscope.analysis.cli import summary as cli_summary  # noqa: E402
from stepscope.analysis.summaries import post  # noqa: E402
from stepscope.analysis.summaries import tables as S  # noqa: E402
from stepscope.analysis.summaries.format import MAX_WIDTH, cut_middle, format_bytes  # noqa: E402


def widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


@pytest.mark.parametrize(("value", "shown"), [
    (0, "0 B"), (512, "512 B"), (1536, "1.50 KiB"),
    # the raw float: 1532476956.61 / 2**30 = 1.4272...
    (1532476956.61, "1.43 GiB"), (3 * 2**40, "3.00 TiB"),
])
def test_format_bytes(value, shown):
    assert format_bytes(value) == shown


def cpu_only_trace() -> TraceDB:
    """One rank, steps [0,1000) and [1000,3000) with a Forward phase each, rss and disk
    counters, no device slice."""
    db = TraceDB()
    up = db.process(100, "rank 0 (h)")
    main = db.thread(up, 101, "main")
    s0 = db.slice(main, 0, 1000, "step 0", "step", {"step": 0})
    db.slice(main, 100, 400, "Forward", "phase", parent=s0)
    s1 = db.slice(main, 1000, 2000, "step 1", "step", {"step": 1})
    db.slice(main, 1100, 600, "Forward", "phase", parent=s1)
    rss = db.counter_track("host.process.rss", db.process_track(up))
    db.counter(rss, 0, 1532476956.61)
    db.counter(rss, 2000, 2 * 2**30)
    disk = db.counter_track("host.disk.write bytes/s", db.process_track(up))
    db.counter(disk, 0, 1024.0)
    pct = db.counter_track("host.cpu.user %", db.process_track(up))
    db.counter(pct, 0, 12.5)
    cuda = db.counter_track("torch.cuda1.memory.reserved", db.process_track(up))
    db.counter(cuda, 0, 94371840)  # (torch's counters showed as 94371840.00 on an H100)
    return db


def test_device_values_in_binary_units_and_raw_in_csv():
    t = S.table(cpu_only_trace(), "device")
    text = t.to_text()
    rows = {line.split()[1]: line.split() for line in text.splitlines()
            if line.startswith("   0")}
    # rss: 1532476956.61 held 2000 ns, 2 GiB held to the run's end (3000) 1000 ns:
    # mean (2 * 1532476956.61 + 2147483648) / 3 = 1737479187.07 = 1.618... GiB
    assert rows["host.process.rss"][2:] == ["2", "1.62", "GiB", "1.43", "GiB", "2.00", "GiB"]
    assert rows["host.disk.write"][3:] == ["1", "1.00", "KiB/s", "1.00", "KiB/s", "1.00",
                                           "KiB/s"]
    assert rows["host.cpu.user"][3:] == ["1", "12.50", "12.50", "12.50"]
    assert rows["torch.cuda1.memory.reserved"][2:] == ["1", "90.00", "MiB"] + ["90.00", "MiB"] * 2
    assert "Mean (time-weighted)" in text and "Time unit" not in text
    assert "holds until the next one" in text
    recs = {r["name"]: r for r in csv.DictReader(io.StringIO(t.to_csv()))}
    assert float(recs["host.process.rss"]["min"]) == 1532476956.61
    assert float(recs["host.process.rss"]["mean"]) == pytest.approx(
        (2 * 1532476956.61 + 2**31) / 3)


def test_memcpy_bytes_in_binary_units(capsys):
    text = S.table(scenario(), "memcpy").to_text()
    # HtoD 4000 B = 3.90625 KiB, DtoH 2000 B = 1.953 KiB, memset 1000 B
    assert "3.91 KiB" in text and "1.95 KiB" in text and "1000 B" in text


def test_no_gpu_data_shows_no_gpu_columns():
    db = cpu_only_trace()
    model = S.table(db, "model")
    assert all(r[k] is None for r in model.rows for k in post._GPU_KEYS)
    text = model.to_text("ns")
    assert "GPU" not in text
    # Forward: 400 + 600 of 3000; Others: the steps less their phases, 600 and 1400
    lines = {line.split()[0]: line.split() for line in text.splitlines()[5:7]}
    assert lines == {"Forward": ["Forward", "2", "1000", "500", "600", "400", "33.33"],
                     "Others": ["Others", "2", "2000", "1000", "1400", "600", "66.67"]}
    # the columns left out of text stay in CSV (empty) and JSON (null)
    assert json.loads(model.to_json())["rows"][0]["gpu_total_ms"] is None
    assert model.to_csv().splitlines()[0].count("gpu_") == 5
    dist = S.table(db, "distributed")
    assert [(r["steps"], r["computation_ns"], r["other_ns"]) for r in dist.rows] == [
        (2, None, None)]
    assert "Computation" not in dist.to_text() and "Other" not in dist.to_text()
    ops = S.table(scenario(), "operators")  # with device data: GPU columns kept
    assert "GPU Total (ms)" in ops.to_text()


def long_name_trace(name: str) -> TraceDB:
    db = TraceDB()
    up = db.process(100, "rank 0 (h)")
    main = db.thread(up, 101, "main")
    s0 = db.slice(main, 0, 1000, "step 0", "step", {"step": 0})
    db.slice(main, 100, 300, name, "user", parent=s0)
    db.slice(main, 500, 100, "short", "user", parent=s0)
    return db


def test_long_names_cut_in_the_middle_to_keep_tables_within_200_columns(tmp_path, monkeypatch,
                                                                         capsys):
    name = "void cutlass::Kernel<" + "x" * 770 + ">(Params)"  # 800 characters
    assert len(name) == 800
    db = long_name_trace(name)
    t = S.table(db, "operators")
    before = t.to_text(name_width=0)
    # the numeric columns (no GPU ones: no device data), each as wide as its header, and the
    # gaps of two: 5+10+8+8+8+11+9+9 + 8*2 = 84
    others = sum(len(h) + 2 for h in ("Calls", "Total (ms)", "Avg (ms)", "Max (ms)",
                                      "Min (ms)", "StdDev (ms)", "Self (ms)", "Ratio (%)"))
    assert others == 84
    assert widest(before) == 800 + 84
    text = t.to_text()
    assert widest(text) == MAX_WIDTH
    cell = next(line for line in text.splitlines() if line.startswith("void"))
    cut = cell[: cell.index(">(Params)") + len(">(Params)")]
    # 200 - 84 = 116 characters of name
    assert len(cut) == 116 and cut == cut_middle(name, 116)
    assert cut.startswith("void cutlass::Kernel<xxx") and "..." in cut
    assert name in t.to_csv() and name in t.to_json()
    assert cut_middle(name, 11) == "void...ams)"  # 4 from the front, 4 from the end
    # the CLI option, on the same database
    monkeypatch.setattr(cli_summary, "_open", lambda p, a: db)
    path = tmp_path / "t.pftrace"
    path.write_bytes(b"x")
    assert cli.main(["summary", str(path), "--table", "operators", "--name-width", "30"]) == 0
    out = capsys.readouterr().out
    assert cut_middle(name, 30) + "  " in out and widest(out) == 30 + 84
    assert cli.main(["summary", str(path), "--table", "operators", "--format", "csv",
                     "--name-width", "30"]) == 0
    assert name in capsys.readouterr().out
