"""``STEPSCOPE_OPTIONS``: profiler configuration as JSON, validated with clear errors.

Example::

    STEPSCOPE_OPTIONS='{"dir": "/tmp/prof", "schedule": {"wait": 1, "warmup": 1, "active": 2},
                        "host_metrics": true, "levels": ["summary", "detail"]}'

Keys (all optional): ``dir`` (str), ``run_id`` (str: one directory name, no ``/``), ``schedule``
(object with skip_first, wait, warmup, active, repeat; or ``[start, end]``; or ``null`` for no
detail windows), ``timer_only``
(bool), ``levels`` (list of "summary", "detail": which files are written), ``host_metrics`` (bool),
``sample_interval_s`` (seconds, 0.001 to 86400), ``buffer_bytes`` (64 KiB to 1 TiB), ``rank``
(0 to 2**31 - 1), ``gpu`` (bool), ``sync_gpu`` (bool), ``gpu_bucket_ns`` (the GPU counters'
bucket, 1 ns to one hour), ``report``
(bool: print the summary at stop), ``step_range`` (str: for ``stepscope run``, the name of a user
range that delimits steps), ``torch`` (bool: the PyTorch integration; unset: on when the program
has imported torch), ``step_on`` ("optimizer": a step per optimizer step; "auto": the same until
the program calls ``stepscope.step()`` itself). Values from the environment override the
arguments given to ``Profiler(...)`` in code: the variable exists to change a run without
editing it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from ..core import session as _session
from .schedule import Schedule, coerce


def min_buffer_bytes() -> int:
    """The session's minimum (read at each call: the session owns it)."""
    return _session.MIN_BUFFER_BYTES

ENV_VAR = "STEPSCOPE_OPTIONS"
# host sampling periods accepted: a shorter one keeps a core busy, inf kills the sampler thread
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.001, 86400.0
LEVELS = ("summary", "detail")


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{ENV_VAR}: {key!r} must be true or false, got {v!r}")
    return v


def _str(key: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"{ENV_VAR}: {key!r} must be a non-empty string, got {v!r}")
    return v


def check_run_id(name: str, v: Any) -> str:
    """A run id names the run's directory under ``dir``: one plain path component. An absolute
    path, ``..``, ``a/b``, ``.`` or "" put the files outside ``dir`` or straight into it (where
    runs met). ``name``: the option as the user gave it (in the error)."""
    if (not isinstance(v, str) or v in ("", ".", "..") or "/" in v or "\0" in v
            or os.sep in v or (os.altsep and os.altsep in v)
            or len(os.fsencode(v)) > 255):
        raise ValueError(f"{name} must be one plain directory name (no '/', not '.' or '..', "
                         f"1 to 255 bytes), got {v!r}")
    return v


def _number(key: str, v: Any, low: float, high: float) -> float:
    """A finite number in [low, high]: JSON's Infinity and NaN pass ``> 0`` or fail late (an
    endless wait kills the sampler thread with OverflowError), so they are refused here."""
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            or not low <= v <= high):
        raise ValueError(f"{ENV_VAR}: {key!r} must be a finite number from {low:g} to {high:g}, "
                         f"got {v!r}")
    return float(v)


def _int(key: str, v: Any, minimum: int, maximum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
        raise ValueError(f"{ENV_VAR}: {key!r} must be an integer from {minimum} to {maximum}, "
                         f"got {v!r}")
    return v


def _levels(key: str, v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v or any(x not in LEVELS for x in v):
        raise ValueError(
            f"{ENV_VAR}: {key!r} must be a non-empty list of {list(LEVELS)}, got {v!r}"
        )
    return tuple(x for x in LEVELS if x in v)


STEP_ON = ("optimizer", "auto")


def _choice(key: str, v: Any, choices: tuple[str, ...]) -> str:
    if v not in choices:
        raise ValueError(f"{ENV_VAR}: {key!r} must be one of {list(choices)}, got {v!r}")
    return v


def _sched(key: str, v: Any) -> Schedule | None:
    try:
        return coerce(tuple(v) if isinstance(v, list) else v)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{ENV_VAR}: {key!r}: {e}") from None


_KEYS = {
    "dir": _str,
    "run_id": lambda k, v: check_run_id(f"{ENV_VAR}: {k!r}", v),
    "schedule": _sched,
    "timer_only": _bool,
    "levels": _levels,
    "host_metrics": _bool,
    "sample_interval_s": lambda k, v: _number(k, v, MIN_INTERVAL_S, MAX_INTERVAL_S),
    "buffer_bytes": lambda k, v: _int(k, v, min_buffer_bytes(), 1 << 40),
    "rank": lambda k, v: _int(k, v, 0, (1 << 31) - 1),
    "gpu": _bool,
    "sync_gpu": _bool,
    "gpu_bucket_ns": lambda k, v: _int(k, v, 1, 3600 * 10**9),
    "report": _bool,
    "step_range": _str,
    "torch": _bool,
    "step_on": lambda k, v: _choice(k, v, STEP_ON),
}


def parse(text: str) -> dict[str, Any]:
    """Validated options from a JSON object string; raises ValueError saying what is wrong."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV_VAR} is not valid JSON ({e.msg} at position {e.pos})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{ENV_VAR} must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ValueError(f"{ENV_VAR}: unknown key(s) {unknown}; known keys: {sorted(_KEYS)}")
    return {k: _KEYS[k](k, v) for k, v in raw.items()}


def from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Options from ``STEPSCOPE_OPTIONS`` (empty dict when unset or blank)."""
    env = os.environ if env is None else env
    text = env.get(ENV_VAR, "")
    return parse(text) if text.strip() else {}


def dumps(options: Mapping[str, Any]) -> str:
    """JSON for ``STEPSCOPE_OPTIONS`` (used by ``stepscope run`` to pass options on)."""
    out: dict[str, Any] = {}
    for k, v in options.items():
        if isinstance(v, Schedule):
            v = {f: getattr(v, f) for f in ("skip_first", "wait", "warmup", "active", "repeat")}
        elif isinstance(v, tuple):
            v = list(v)
        out[k] = v
    parse(json.dumps(out))  # validate what we hand on
    return json.dumps(out)
