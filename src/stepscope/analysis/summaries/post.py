"""What the summary tables compute in Python after their SQL: statistics that need math
functions (stddev, percentiles, straggler flags), per-step rates, units of counters, and GPU
columns left empty on traces without device time. ``POST`` maps a table to its step.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from typing import Any

from ... import _schema as S


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default): x[(n-1)·q]."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _per_step(rows: list[dict], **_: Any) -> tuple[list[dict], list[str]]:
    """Adds reader_ratio = reader/batch, ips = 1 / batch (s), samples_per_s = samples / batch."""
    out = []
    for r in rows:
        b = r["batch_cost_ns"]
        r = dict(r)
        r["reader_ratio"] = r["reader_cost_ns"] / b if b else None
        r["ips"] = 1e9 / b if b else None
        n = r.get("num_samples")
        r["samples_per_s"] = n * 1e9 / b if (b and n is not None) else None
        out.append(r)
    return out, []


def _step_stats(rows: list[dict], **kw: Any) -> tuple[list[dict], list[str]]:
    """avg/min/max/p50/p90 over steps.

    avg of batch and reader cost = arithmetic mean; avg reader ratio = Σ reader / Σ batch;
    avg steps/s = steps / Σ batch seconds; avg samples/s = Σ samples / Σ batch seconds (steps
    with a known batch size). min/max/p50/p90: over the per-step values.
    """
    steps, _ = _per_step(rows)
    if not steps:
        return [], []
    batch = [s["batch_cost_ns"] for s in steps]
    total_b = sum(batch)
    sampled = [s for s in steps if s["num_samples"] is not None and s["batch_cost_ns"]]
    avg = {
        "batch_cost_ns": total_b / len(steps),
        "reader_cost_ns": sum(s["reader_cost_ns"] for s in steps) / len(steps),
        "reader_ratio": (sum(s["reader_cost_ns"] for s in steps) / total_b) if total_b else None,
        "ips": len(steps) * 1e9 / total_b if total_b else None,
        "samples_per_s": (
            sum(s["num_samples"] for s in sampled) * 1e9 / sum(s["batch_cost_ns"] for s in sampled)
            if sampled
            else None
        ),
    }
    keys = list(avg)
    table_rows = [{"stat": "avg", **avg}]
    for stat, fn in (
        ("min", min),
        ("max", max),
        ("p50", lambda v: percentile(v, 0.5)),
        ("p90", lambda v: percentile(v, 0.9)),
    ):
        row: dict[str, Any] = {"stat": stat}
        for k in keys:
            vals = [s[k] for s in steps if s[k] is not None]
            row[k] = fn(vals) if vals else None
        table_rows.append(row)
    ranks = {s["rank"] for s in steps}
    note = f"{len(steps)} steps" + (f" on {len(ranks)} ranks" if len(ranks) > 1 else "")
    return table_rows, [note]


_GPU_KEYS = tuple(f"gpu_{s}" for s in ("total_ns", "avg_ns", "max_ns", "min_ns", "ratio"))


def _no_gpu(rows: list[dict], keys: Sequence[str] = _GPU_KEYS) -> list[dict]:
    """GPU values become None (shown "-", the columns left out of text) when the trace has no
    device time at all: gpu_ratio's denominator, the device slices' union, is then 0 (NULL)."""
    if any(r.get("gpu_ratio") is not None for r in rows):
        return rows
    return [{**r, **dict.fromkeys(keys)} for r in rows]


def _model(rows: list[dict], **_: Any) -> tuple[list[dict], list[str]]:
    return _no_gpu(rows), []


def _device(rows: list[dict], **_: Any) -> tuple[list[dict], list[str]]:
    """Each row gets the ``unit`` of its values (bytes, bytes/s: shown in binary units)."""
    out = [{**r, "unit": counter_unit(r.get("name") or "")} for r in rows]
    note = ("Mean (time-weighted): each sample holds until the next one of its counter, the "
            "last until the end of its rank's run (its last step's end; its last slice's without "
            "steps), none before its start; a sample after that end holds nothing (a rate over "
            "an interval is stamped at the interval's start)")
    return out, [note] if any(r.get("samples") is not None for r in rows) else []


_BYTE_COUNTERS = re.compile(
    "^(" + "|".join(re.escape(n).replace(re.escape("{device}"), r"\d+")
                    for n in S.BYTE_COUNTERS) + r")$|(^|[ .])bytes$")


def counter_unit(name: str) -> str | None:
    """The unit of a counter written by stepscope, from its name (see ``_schema``): "bytes",
    "bytes/s", or None (the number as it is, e.g. "%" or "1/s", which the names say)."""
    if name.endswith("bytes/s"):
        return "bytes/s"
    return "bytes" if _BYTE_COUNTERS.search(name) else None


_SQ_PARTS = ("sq_hh", "sq_hl", "sq_aa", "sq_ab", "sq_bb")  # see operators.sql


def _operators(rows: list[dict], **_: Any) -> tuple[list[dict], list[str]]:
    """stddev = sqrt(calls * sum(d^2) - sum(d)^2) / calls, the population standard deviation,
    with the difference computed exactly in integers from the SQL's sum of durations and the
    integer parts of the sum of their squares (sq_hh..sq_bb, see operators.sql): no cancellation,
    and the same value whatever engine summed the rows, in whatever order."""
    out = []
    for r in rows:
        r = dict(r)
        parts = [r.pop(k, None) for k in _SQ_PARTS]
        n, total = r.get("calls") or 0, r.get("total_ns")
        if n and total is not None and None not in parts:
            hh, hl, aa, ab, bb = (int(p) for p in parts)
            sumsq = (hh << 64) + (hl << 33) + (aa << 32) + (ab << 17) + bb
            var_n2 = max(n * sumsq - int(total) ** 2, 0)  # variance * n^2, exact
            r["stddev_ns"] = math.sqrt(var_n2) / n
        else:
            r["stddev_ns"] = None
        out.append(r)
    return _no_gpu(out), []


def _distributed(rows: list[dict], straggler_margin: float = 0.10, **_: Any):
    """vs_median = mean step / median of the ranks' mean steps - 1; work_vs_median likewise
    of the mean step's work, its time outside communication ((frame - communication) /
    steps); straggler when either is > margin. In synchronous training (DDP) every rank's
    steps last alike: the others wait for the slow rank in their collectives, so its steps
    are no longer, but its work is (a rank 20 ms slower a step read -3.7 / +3.7 % vs median
    and no straggler; its work reads +26 %).

    A rank without device slices (no kernel, copy or set) has computation, overlap and other
    None: the split needs GPU data; its communication is None too unless it has collectives
    timed to their completion (gloo's, on the CPU), and so is its work."""
    rows = [dict(r) for r in rows]
    for r in rows:
        timed = r.pop("collectives", None)
        if not r.pop("device_slices", None):
            r.update(computation_ns=None, overlap_ns=None, other_ns=None)
            if not timed:
                r["communication_ns"] = None
    work = {id(r): (r["frame_ns"] - r["communication_ns"]) / r["steps"] for r in rows
            if r.get("communication_ns") is not None and r.get("frame_ns") is not None
            and r.get("steps")}
    wmed = statistics.median(work.values()) if work else None
    means = [r["avg_step_ns"] for r in rows if r.get("avg_step_ns") is not None]
    med = statistics.median(means) if means else None
    for r in rows:
        a, w = r.get("avg_step_ns"), work.get(id(r))
        r["vs_median"] = (a / med - 1.0) if (a is not None and med) else None
        r["work_vs_median"] = (w / wmed - 1.0) if (w is not None and wmed) else None
        r["straggler"] = any(v is not None and v > straggler_margin
                             for v in (r["vs_median"], r["work_vs_median"]))
    notes = []
    if med is not None:
        slow = [str(r["rank"]) for r in rows if r["straggler"]]
        notes.append(
            f"stragglers (mean step, or its work outside communication, > median by more than "
            f"{straggler_margin:.0%}): " + (", ".join(slow) if slow else "none")
        )
    return rows, notes


POST = {
    "steps": _step_stats,
    "step_times": _per_step,
    "model": _model,
    "operators": _operators,
    "device": _device,
    "distributed": _distributed,
}
