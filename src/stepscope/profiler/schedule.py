"""Per-epoch recording schedules (Composer semantics) and the Paddle ``(start, end)`` shorthand.

A schedule maps ``(batch index within the epoch)`` to a :class:`State`. At the start of every epoch
the first ``skip_first`` batches are not recorded; then a window of ``wait`` (not recorded),
``warmup`` (tracing runs, its data is discarded) and ``active`` (recorded) batches runs
``1 + repeat`` times; after the last window nothing is recorded until the epoch ends. ``repeat=-1``
repeats windows until the epoch ends.

Note: ``torch.profiler.schedule`` counts ``repeat`` as the *number of cycles* (``repeat=1`` is one
window, ``repeat=0`` repeats forever). Here, as in the published Composer table, ``repeat=1`` means
one window plus one repetition, i.e. two windows; ``repeat=-1`` repeats forever.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

NEVER = 1 << 63
"""A batch index no epoch reaches."""


class State(enum.Enum):
    """What the profiler does during one batch."""

    SKIP_FIRST = "skip_first"
    WAIT = "wait"
    WARMUP = "warmup"
    ACTIVE = "active"
    DISABLED = "disabled"

    @property
    def tracing(self) -> bool:
        """Detail-level tracing runs during this batch (warmup data is later discarded)."""
        return self in (State.WARMUP, State.ACTIVE)


@dataclass(frozen=True)
class Schedule:
    """A per-epoch window schedule; see the module docstring for the exact semantics."""

    skip_first: int = 0
    wait: int = 0
    warmup: int = 1
    active: int = 1
    repeat: int = 0

    def __post_init__(self) -> None:
        for name in ("skip_first", "wait", "warmup", "active"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"schedule: {name} must be an integer >= 0, got {value!r}")
        if self.active < 1:
            raise ValueError(f"schedule: active must be >= 1, got {self.active!r}")
        if not isinstance(self.repeat, int) or isinstance(self.repeat, bool) or self.repeat < -1:
            raise ValueError(
                f"schedule: repeat must be an integer >= 0, or -1 for 'until the epoch ends', "
                f"got {self.repeat!r}"
            )

    @property
    def cycle(self) -> int:
        """Batches in one window (wait + warmup + active)."""
        return self.wait + self.warmup + self.active

    def state(self, batch_in_epoch: int) -> State:
        """State of the ``batch_in_epoch``-th batch (0-based) of any epoch."""
        if batch_in_epoch < 0:
            raise ValueError(f"schedule: batch index must be >= 0, got {batch_in_epoch}")
        if batch_in_epoch < self.skip_first:
            return State.SKIP_FIRST
        pos = batch_in_epoch - self.skip_first
        window = pos // self.cycle
        if self.repeat >= 0 and window > self.repeat:
            return State.DISABLED
        in_cycle = pos % self.cycle
        if in_cycle < self.wait:
            return State.WAIT
        if in_cycle < self.wait + self.warmup:
            return State.WARMUP
        return State.ACTIVE

    def window_index(self, batch_in_epoch: int) -> int:
        """0-based window number within the epoch that ``batch_in_epoch`` falls in (or -1)."""
        if batch_in_epoch < self.skip_first:
            return -1
        return (batch_in_epoch - self.skip_first) // self.cycle

    def stable_until(self, batch_in_epoch: int) -> int:
        """The first batch after ``batch_in_epoch`` whose state or window index differs from
        its own (a huge number when none does): the profiler skips the schedule until then."""
        if batch_in_epoch < self.skip_first:
            return self.skip_first
        window, in_cycle = divmod(batch_in_epoch - self.skip_first, self.cycle)
        if self.repeat >= 0 and window > self.repeat:
            return NEVER
        start = batch_in_epoch - in_cycle
        if in_cycle < self.wait:
            return start + self.wait
        if in_cycle < self.wait + self.warmup:
            return start + self.wait + self.warmup
        return start + self.cycle

    def is_last_active(self, batch_in_epoch: int) -> bool:
        """True when this batch is the last active batch of its window."""
        return (
            self.state(batch_in_epoch) is State.ACTIVE
            and (batch_in_epoch - self.skip_first) % self.cycle == self.cycle - 1
        )

    def table(self, batches: int) -> list[State]:
        """States of batches ``0 .. batches-1`` of one epoch (for docs and tests)."""
        return [self.state(b) for b in range(batches)]


def schedule(
    skip_first: int = 0, wait: int = 0, warmup: int = 1, active: int = 1, repeat: int = 0
) -> Schedule:
    """Build a per-epoch schedule (Composer semantics: ``1 + repeat`` windows; ``-1``: forever)."""
    return Schedule(skip_first, wait, warmup, active, repeat)


def from_range(start: int, end: int) -> Schedule:
    """Paddle shorthand: record batches ``start <= batch < end``, warming up one batch before."""
    for name, value in (("start", start), ("end", end)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"schedule ({start!r}, {end!r}): {name} must be an integer >= 0")
    if end <= start:
        raise ValueError(f"schedule ({start}, {end}): end must be greater than start")
    warmup = 1 if start > 0 else 0
    return Schedule(skip_first=0, wait=start - warmup, warmup=warmup, active=end - start, repeat=0)


ALWAYS = Schedule(skip_first=0, wait=0, warmup=0, active=1 << 62, repeat=0)
"""Every batch is active: detail level for the whole run, one window (file) per epoch."""


def coerce(value: object) -> Schedule | None:
    """Accept a Schedule, a ``(start, end)`` pair, a dict of Schedule fields, or None."""
    if value is None or isinstance(value, Schedule):
        return value
    if isinstance(value, dict):
        unknown = set(value) - {"skip_first", "wait", "warmup", "active", "repeat"}
        if unknown:
            raise ValueError(
                f"schedule: unknown field(s) {sorted(unknown)}; "
                "expected skip_first, wait, warmup, active, repeat"
            )
        return Schedule(**value)  # type: ignore[arg-type]
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2:
        return from_range(value[0], value[1])  # type: ignore[arg-type]
    raise ValueError(
        f"schedule: expected stepscope.schedule(...), a (start, end) pair or a dict, got {value!r}"
    )
