"""CNTK-profiler-style files, one pair per rank, for tools and habits built around that format.

* ``<timestamp>_summary_<rank>.txt``: per event name: average, std dev, min, max, count, total.
* ``<timestamp>_detail_<rank>.csv``: one line per event: name, thread id, begin ms, end ms.

Events are the finished slices of the selection (sql/cntk_detail.sql; the profiler's own
'stepscope' bookkeeping slices are left out). The summary groups all step slices ("step <n>")
under one name, "step"; the detail file keeps each slice's own name. Times are milliseconds;
begin/end are relative to the earliest event of the selection over all ranks, so the files of
different ranks line up.
Std dev is the population standard deviation (divide by the count).
"""

from __future__ import annotations

import csv
import datetime as _dt
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._errors import SummaryError
from .sqlfiles import Filters, render
from .tables import run_sql

TIMESTAMP_FORMAT = "%Y-%m-%d_%H-%M-%S"
_NS_PER_MS = 1_000_000


def write_cntk(
    db: Any,
    out_dir: str | Path,
    *,
    timestamp: str | _dt.datetime | None = None,
    threads: Iterable[int | str] | None = None,
    ranks: Iterable[int] | None = None,
    steps: str | tuple[int | None, int | None] | None = None,
) -> list[Path]:
    """Write the summary and detail file of every rank in ``out_dir``; returns their paths.

    ``timestamp`` (default: now, UTC) names the files; a datetime is formatted as
    ``YYYY-MM-DD_HH-MM-SS``.
    """
    if timestamp is None:
        timestamp = _dt.datetime.now(_dt.timezone.utc)
    stamp = (
        timestamp.strftime(TIMESTAMP_FORMAT)
        if isinstance(timestamp, _dt.datetime)
        else str(timestamp)
    )
    if not stamp or any(c in stamp for c in "/\\"):
        raise SummaryError(f"bad timestamp for file names: {stamp!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = run_sql(db, "cntk", render("cntk_detail", Filters.make(threads, ranks, steps)))
    if not rows:
        return []
    origin = min(r["ts"] for r in rows)
    by_rank: dict[Any, list[dict]] = {}
    for r in rows:
        by_rank.setdefault(r["rank"], []).append(r)
    paths = []
    for rank, events in by_rank.items():
        detail = out / f"{stamp}_detail_{rank}.csv"
        with open(detail, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(["name", "thread_id", "begin_ms", "end_ms"])
            for e in events:
                begin, end = _ms(e["ts"] - origin), _ms(e["end_ts"] - origin)
                w.writerow([e["name"], e["thread"], begin, end])
        summary = out / f"{stamp}_summary_{rank}.txt"
        summary.write_text(summary_text(events, rank=rank, timestamp=stamp), encoding="utf-8")
        paths += [summary, detail]
    return paths


def event_stats(events: Iterable[dict]) -> list[dict[str, Any]]:
    """Per name: count, total, avg, stddev (population), min, max in ns; by total, descending.

    Sums are exact Python integers, so the variance has no rounding error before the division.
    """
    acc: dict[str, list[int]] = {}
    for e in events:
        d = int(e["dur"])
        key = e.get("stat_name") or e["name"]
        a = acc.get(key)
        if a is None:
            acc[key] = [1, d, d * d, d, d]
        else:
            a[0] += 1
            a[1] += d
            a[2] += d * d
            a[3] = min(a[3], d)
            a[4] = max(a[4], d)
    out = []
    for name, (n, total, sq, lo, hi) in acc.items():
        var = (n * sq - total * total) / (n * n)
        out.append(
            {
                "name": name,
                "count": n,
                "total_ns": total,
                "avg_ns": total / n,
                "stddev_ns": math.sqrt(max(var, 0.0)),
                "min_ns": lo,
                "max_ns": hi,
            }
        )
    out.sort(key=lambda s: (-s["total_ns"], s["name"]))
    return out


def summary_text(events: Iterable[dict], *, rank: Any, timestamp: str) -> str:
    """The summary file's text for one rank's events."""
    stats = event_stats(events)
    width = max([len("Event name")] + [len(s["name"]) for s in stats])
    cols = ("Average", "Std dev", "Min", "Max", "Count", "Total")
    head = f"{'Event name':<{width}}" + "".join(f"  {c:>14}" for c in cols)
    lines = [
        "stepscope performance profile summary (CNTK format)",
        f"Rank: {rank}",
        f"Timestamp: {timestamp}",
        "Times in ms",
        "",
        head,
        "-" * len(head),
    ]
    for s in stats:
        nums = [_ms(s["avg_ns"]), _ms(s["stddev_ns"]), _ms(s["min_ns"]), _ms(s["max_ns"])]
        cells = [f"{v:>14.6f}" for v in nums]
        cells += [f"{s['count']:>14d}", f"{_ms(s['total_ns']):>14.6f}"]
        lines.append(f"{s['name']:<{width}}" + "".join(f"  {c}" for c in cells))
    return "\n".join(lines) + "\n"


def _ms(ns: float) -> float:
    return ns / _NS_PER_MS
