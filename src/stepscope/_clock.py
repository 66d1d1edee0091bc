"""Clocks: what the hot path reads and how a trace says how its clocks relate.

Host events are stamped with ``time.perf_counter_ns()`` (CLOCK_MONOTONIC on Linux and macOS), the
cheapest clock Python offers. A ``ClockSnapshot`` of BOOTTIME, MONOTONIC and REALTIME, taken at
session start and at every sink close, lets trace processor put them on its BOOTTIME trace clock
and line up other ranks (same host: same MONOTONIC) and CUPTI records (REALTIME).
"""

from __future__ import annotations

import time

# Perfetto BuiltinClock ids
REALTIME = 1
MONOTONIC = 3
BOOTTIME = 6
SEQUENCE_CLOCK = 64  # sequence-scoped incremental clock each writer declares

now = time.perf_counter_ns

_CLOCK_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def _boottime_ns() -> int:
    if _CLOCK_BOOTTIME is None:  # not Linux: BOOTTIME is MONOTONIC as far as we can tell
        return time.monotonic_ns()
    return time.clock_gettime_ns(_CLOCK_BOOTTIME)


def snapshot() -> dict[int, int]:
    """Read BOOTTIME, MONOTONIC and REALTIME as close together as possible.

    MONOTONIC is read twice around the others and averaged, which halves the error of the pairing.
    """
    m0 = time.perf_counter_ns()
    boot = _boottime_ns()
    real = time.time_ns()
    m1 = time.perf_counter_ns()
    mono = (m0 + m1) // 2
    return {BOOTTIME: boot, MONOTONIC: mono, REALTIME: real}


def base_clock_id(name: str) -> int:
    """Map an emitter's clock name to the builtin clock its timestamps are in."""
    try:
        return {"monotonic": MONOTONIC, "realtime": REALTIME, "boottime": BOOTTIME}[name]
    except KeyError:
        raise ValueError(
            f"unknown clock {name!r}: use 'monotonic' (perf_counter_ns), 'realtime' (time_ns) "
            "or 'boottime'"
        ) from None

