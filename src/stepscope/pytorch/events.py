"""torch profiler events as columns: what the operator converter reads, from either reader.

The native reader (``kineto_reader.cpp``, see :mod:`.native`) fills them in C++; the Python
reader below asks each ``_KinetoEvent`` through torch's Python API (about 4 µs an event). Both
give the same columns, so the conversion has one implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class OpColumns:
    """A window's events; ``len()``: how many."""

    names: list[str]  # each distinct name once
    shapes: list[str]  # each distinct (input shapes, dtypes) once, as str() of the shape lists
    dtypes: list[str]  # ... and the dtypes joined with ", "
    name: np.ndarray  # int32 index into names
    inputs: np.ndarray  # int32 index into shapes/dtypes; -1: no typed inputs
    start: np.ndarray  # int64 ns, Unix time
    dur: np.ndarray  # int64 ns
    tid: np.ndarray  # int64 system thread id (Kineto's device resource id of a CPU event)
    start_tid: np.ndarray  # int64 torch's id of the thread (what forward thread ids name)
    seq: np.ndarray  # int64 sequence number; -1: none
    fwd_tid: np.ndarray  # int64 forward thread id of a backward op; 0: a forward op
    # (start_tid and fwd_tid are 0 where seq is -1: only flows use them)

    def __len__(self) -> int:
        return len(self.start)


def from_native(parts: tuple) -> OpColumns:
    """The native reader's ``columns()`` tuple (lists, then raw arrays)."""
    names, shapes, dtypes = parts[:3]
    arrays = [np.frombuffer(b, dtype=np.int32) for b in parts[3:5]]
    arrays += [np.frombuffer(b, dtype=np.int64) for b in parts[5:]]
    return OpColumns(names, shapes, dtypes, *arrays)


def from_events(events: Any, cpu_only: bool | None = None) -> OpColumns:
    """Columns of ``_KinetoEvent``-like objects, through their accessors (an event whose
    accessors raise is left out).

    ``cpu_only``: leave device events out, as the native reader does (they reach Kineto only
    where its CUPTI callbacks got records). ``None``: where the program has initialized CUDA,
    since asking each event costs about 1 µs (15 % more for this reader)."""
    name_of: dict[str, int] = {}
    input_of: dict[tuple[str, str], int] = {}
    rows = []
    cpu = _cpu_device_type() if (_cuda_in_use() if cpu_only is None else cpu_only) else None
    for e in events:
        try:
            if cpu is not None and e.device_type() != cpu:
                continue
            name = e.name()
            start, dur, tid, seq = e.start_ns(), e.duration_ns(), e.device_resource_id(), \
                e.sequence_nr()
            # thread ids matter only where there is a sequence number (flows)
            stid, fwd = (e.start_thread_id(), e.fwd_thread_id()) if seq >= 0 else (0, 0)
            dt = e.dtypes()
            inp = -1
            if dt and any(dt):
                key = (str(e.shapes()), ", ".join(dt))
                inp = input_of.get(key, -1)
                if inp < 0:
                    inp = input_of[key] = len(input_of)
        except Exception:
            continue
        k = name_of.get(name)
        if k is None:
            k = name_of[name] = len(name_of)
        rows.append((k, inp, start, dur, tid, stid, seq, fwd))
    cols = np.array(rows, dtype=np.int64).reshape(-1, 8).T
    return OpColumns(list(name_of), [s for s, _ in input_of], [d for _, d in input_of],
                     cols[0].astype(np.int32), cols[1].astype(np.int32), *cols[2:])


def _cpu_device_type() -> Any:
    """What ``_KinetoEvent.device_type()`` returns for a CPU event."""
    from torch._C._autograd import DeviceType

    return DeviceType.CPU


def _cuda_in_use() -> bool:
    import torch

    return bool(torch.cuda.is_initialized())
