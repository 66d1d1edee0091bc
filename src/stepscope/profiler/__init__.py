"""Training-loop profiler: steps, phases, schedules, summary/detail levels, host metrics, ranks.

``Profiler`` and the module-level helpers are re-exported from ``stepscope``.
"""

from __future__ import annotations

from .profiler import DEFAULT_SCHEDULE, Profiler, current, dataloader, epoch, phase, step
from .schedule import ALWAYS, Schedule, State, from_range, schedule
from .timer import StepTimer, TimerStats

__all__ = [
    "ALWAYS",
    "DEFAULT_SCHEDULE",
    "Profiler",
    "Schedule",
    "State",
    "StepTimer",
    "TimerStats",
    "current",
    "dataloader",
    "epoch",
    "from_range",
    "phase",
    "schedule",
    "step",
]
