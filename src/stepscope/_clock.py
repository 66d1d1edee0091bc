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


# a re-read offset within this of the last one is the same offset read again: noise
STABLE_NS = 100_000
_offsets: tuple[int, int] | None = None  # (BOOTTIME - MONOTONIC, REALTIME - MONOTONIC) in use


def snapshot() -> dict[int, int]:
    """Read BOOTTIME, MONOTONIC and REALTIME as close together as possible.

    MONOTONIC is read twice around the others and averaged, which halves the error of the
    pairing. The pairing still errs by some 100 ns, differently at each reading, and each file
    is put on the trace clock by its own snapshots: a detail window's events sat 426 ns from
    the same events in the summary file. So the offsets of the clocks to MONOTONIC are kept
    from the process's first reading while a new one comes within ``STABLE_NS`` of them; a
    larger change (a suspend, an NTP step) is taken.
    """
    global _offsets
    m0 = time.perf_counter_ns()
    boot = _boottime_ns()
    real = time.time_ns()
    m1 = time.perf_counter_ns()
    mono = (m0 + m1) // 2
    offsets = (boot - mono, real - mono)
    last = _offsets
    if last is not None and all(abs(a - b) <= STABLE_NS for a, b in zip(offsets, last,
                                                                          strict=True)):
        offsets = last
    else:
        _offsets = offsets
    return {BOOTTIME: mono + offsets[0], MONOTONIC: mono, REALTIME: mono + offsets[1]}


def base_clock_id(name: str) -> int:
    """Map an emitter's clock name to the builtin clock its timestamps are in."""
    try:
        return {"monotonic": MONOTONIC, "realtime": REALTIME, "boottime": BOOTTIME}[name]
    except KeyError:
        raise ValueError(
            f"unknown clock {name!r}: use 'monotonic' (perf_counter_ns), 'realtime' (time_ns) "
            "or 'boottime'"
        ) from None

