"""Step timer for ``timer_only`` mode (and every other mode): reader cost, batch cost, throughput.

Definitions (per completed step, i.e. between two ``step()`` calls, or ``start()`` and the first):

* ``batch_cost``: wall time of the step, data-loader waits included.
* ``reader_cost``: time the training thread waited inside the ``prof.dataloader(...)`` wrapper
  for the step's batch(es).
* ``ips``: steps per second; per step ``1 / batch_cost``. Its *avg* is time-weighted:
  ``steps / sum(batch_cost)``; *max* is ``1 / min(batch_cost)``, *min* is ``1 / max(batch_cost)``.
* ``samples/s``: when ``num_samples`` is given: per step ``num_samples / batch_cost``; *avg* is
  ``sum(num_samples) / sum(batch_cost)`` over steps that gave it; *max*/*min* over those steps.
* ``reader ratio``: ``sum(reader_cost) / sum(batch_cost)``, in percent.

Only running aggregates are kept (O(1) memory), updated by one C call per step where the
extension is built (``_fast.StepCounters``; ``_PyCounters`` is its pure-Python twin). The
profiler gives it the same clock readings as the trace's step and wait slices and counts the same
steps (the step open at ``stop()`` only if it holds work), so its figures and the tables agree.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..record.recorder import fast


@dataclass(frozen=True)
class Agg:
    """avg / max / min of one figure."""

    avg: float
    max: float
    min: float


@dataclass(frozen=True)
class TimerStats:
    """Figures of the completed steps; times in seconds."""

    steps: int
    reader_cost: Agg
    batch_cost: Agg
    ips: Agg  # steps/s
    samples_per_s: Agg | None
    reader_ratio: float  # percent

    def format(self) -> str:
        """Human-readable report in the style of Paddle's benchmark timer."""
        if self.steps == 0:
            return "stepscope timer: no completed steps"

        def ms(a: Agg) -> str:
            return f"avg {a.avg * 1e3:.3f} ms, max {a.max * 1e3:.3f} ms, min {a.min * 1e3:.3f} ms"

        def rate(a: Agg, unit: str) -> str:
            return f"avg {a.avg:.2f} {unit}, max {a.max:.2f} {unit}, min {a.min:.2f} {unit}"

        lines = [
            f"stepscope timer ({self.steps} steps)",
            f"  reader_cost: {ms(self.reader_cost)}",
            f"  batch_cost:  {ms(self.batch_cost)}",
            f"  ips:         {rate(self.ips, 'steps/s')}",
        ]
        if self.samples_per_s is not None:
            lines.append(f"               {rate(self.samples_per_s, 'samples/s')}")
        lines.append(f"  reader ratio: {self.reader_ratio:.2f}%")
        return "\n".join(lines)


class _PyCounters:
    """The running figures of the steps, in Python (see ``_fast.StepCounters``)."""

    __slots__ = (
        "_t0", "_reader", "steps", "_b_sum", "_b_max", "_b_min", "_r_sum", "_r_max", "_r_min",
        "_s_sum", "_s_time", "_s_max", "_s_min",
    )

    def __init__(self) -> None:
        self._t0: int | None = None
        self.reset()

    def reset(self) -> None:
        """Forget every completed step (the open step keeps its start)."""
        self._reader = 0
        self.steps = 0
        self._b_sum = 0
        self._b_max = 0
        self._b_min = math.inf
        self._r_sum = 0
        self._r_max = 0
        self._r_min = math.inf
        self._s_sum = 0.0
        self._s_time = 0
        self._s_max = 0.0
        self._s_min = math.inf

    def start(self, now: int | None = None) -> None:
        """Open the first step."""
        self._t0 = time.perf_counter_ns() if now is None else now
        self._reader = 0

    def add_reader(self, ns: int) -> None:
        """Account ``ns`` of data-loader wait to the open step."""
        self._reader += ns

    def step(self, num_samples: float | None = None, now: int | None = None) -> None:
        """Close the open step (``num_samples`` in it, if known) and open the next."""
        t = time.perf_counter_ns() if now is None else now
        if self._t0 is None:
            self._t0 = t
            self._reader = 0
            return
        b = t - self._t0
        r = self._reader
        self._t0 = t
        self._reader = 0
        self.steps += 1
        self._b_sum += b
        if b > self._b_max:
            self._b_max = b
        if b < self._b_min:
            self._b_min = b
        self._r_sum += r
        if r > self._r_max:
            self._r_max = r
        if r < self._r_min:
            self._r_min = r
        if num_samples is not None and b > 0:
            self._s_sum += num_samples
            self._s_time += b
            sps = num_samples * 1e9 / b
            if sps > self._s_max:
                self._s_max = sps
            if sps < self._s_min:
                self._s_min = sps


_Counters = fast.StepCounters if fast is not None else _PyCounters


class StepTimer(_Counters):  # type: ignore[misc,valid-type]
    """Running step statistics; ``now`` arguments (ns) exist so tests can drive exact times."""

    __slots__ = ()

    def stats(self) -> TimerStats:
        """Figures of the completed steps (see the module docstring for the definitions)."""
        n = self.steps
        if n == 0:
            zero = Agg(0.0, 0.0, 0.0)
            return TimerStats(0, zero, zero, zero, None, 0.0)
        reader = Agg(self._r_sum / n / 1e9, self._r_max / 1e9, self._r_min / 1e9)
        batch = Agg(self._b_sum / n / 1e9, self._b_max / 1e9, self._b_min / 1e9)
        inv = lambda ns: 1e9 / ns if ns > 0 else math.inf
        ips = Agg(inv(self._b_sum / n), inv(self._b_min), inv(self._b_max))
        sps = None
        if self._s_time > 0:
            sps = Agg(self._s_sum * 1e9 / self._s_time, self._s_max, self._s_min)
        ratio = 100.0 * self._r_sum / self._b_sum if self._b_sum > 0 else 0.0
        return TimerStats(n, reader, batch, ips, sps, ratio)
