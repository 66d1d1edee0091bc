"""CUPTI timestamps and the trace's clocks.

CUPTI stamps activity in CLOCK_REALTIME ns (``cuptiGetTimestamp``) on Linux, unless a timestamp
callback was registered in the process: torch's Kineto registers one that returns TSC ticks
(``getApproximateTime``) as soon as it profiles on a machine with a GPU, even with CPU activity
only, and ``cuptiGetTimestamp`` then reads that clock too. The converter writes device slices
through a ``clock="realtime"`` emitter, so trace processor maps them onto the trace's clock
through the session's ``ClockSnapshot``s; ``offset_ns`` (added to every CUPTI stamp) corrects what
is left between CUPTI's clock and ``time.time_ns()``, read by :func:`read_clocks` at each window's
start. A clock that runs at another rate (:func:`rate` between two such reads) is mapped onto
``time.time_ns()`` linearly instead (``ActivityBatch.retimed``).

A *clock pair* is one reading of several clocks taken back to back: ``{"cupti": ..., "time_ns":
..., "perf_counter_ns": ..., "monotonic_ns": ...}`` (the fixture records two of them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np


def read_clocks(cupti_timestamp: Callable[[], int], rounds: int = 5) -> tuple[int, int]:
    """(CUPTI stamp, ``time.time_ns()``) read back to back: the tightest of ``rounds`` brackets,
    the system clock at its midpoint."""
    best = None
    for _ in range(max(1, rounds)):
        t0 = time.time_ns()
        c = int(cupti_timestamp())
        t1 = time.time_ns()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, c, (t0 + t1) // 2)
    assert best is not None
    return best[1], best[2]


# a CUPTI clock whose rate differs from time.time_ns()'s by more than this is not in nanoseconds
RATE_TOLERANCE = 1e-3


def rate(first: tuple[int, int] | None, last: tuple[int, int] | None) -> float | None:
    """Nanoseconds of ``time.time_ns()`` per CUPTI tick between two :func:`read_clocks` reads, or
    None where they cannot be in one clock (CUPTI's clock source changed between them)."""
    if first is None or last is None or last[0] <= first[0]:
        return None
    r = (last[1] - first[1]) / (last[0] - first[0])
    return r if 0.05 < r < 20 else None


def offset_from_pairs(pairs: Sequence[Mapping[str, int]], src: str, dst: str) -> int:
    """Mean ``dst - src`` over clock pairs (e.g. src="cupti", dst="perf_counter_ns")."""
    if not pairs:
        raise ValueError("no clock pairs")
    try:
        diffs = [int(p[dst]) - int(p[src]) for p in pairs]
    except KeyError as exc:
        raise ValueError(f"clock pair lacks {exc}") from exc
    return int(round(sum(diffs) / len(diffs)))


def drift_ns(pairs: Sequence[Mapping[str, int]], src: str, dst: str) -> int:
    """How much ``dst - src`` changed between the first and last pair (ns)."""
    if len(pairs) < 2:
        return 0
    return (int(pairs[-1][dst]) - int(pairs[-1][src])) - (int(pairs[0][dst]) - int(pairs[0][src]))


def to_clock(ts: np.ndarray, pairs: Sequence[Mapping[str, int]], src: str, dst: str) -> np.ndarray:
    """Map stamps from clock ``src`` to ``dst`` by linear interpolation between the pairs.

    With one pair it is a constant offset; with several, drift between them is spread linearly
    (and extrapolated with the end segments' offsets).
    """
    ts = np.asarray(ts, dtype=np.int64)
    if len(pairs) < 2:
        return ts + offset_from_pairs(pairs, src, dst)
    xs = np.array([int(p[src]) for p in pairs], dtype=np.int64)
    offs = np.array([int(p[dst]) - int(p[src]) for p in pairs], dtype=np.int64)
    order = np.argsort(xs)
    xs, offs = xs[order], offs[order]
    # interpolate the offset in float relative to the first pair (keeps ns precision)
    rel = (ts - xs[0]).astype(np.float64)
    off = np.interp(rel, (xs - xs[0]).astype(np.float64), offs.astype(np.float64))
    return ts + np.rint(off).astype(np.int64)
