"""Operators of a detail window from torch's own profiler, converted in bulk at the window's end.

While a window is open, torch's profiler (Kineto through ``torch.autograd._enable_profiler``)
records every RecordFunction event of the process in C++: aten operators, autograd nodes and
engine frames, on every thread, with input shapes and dtypes (``record_shapes``). Activities are
CPU only: on a GPU the device side comes from stepscope's own CUPTI tracer, and two CUPTI
subscribers in one process fail (see :mod:`stepscope.pytorch` and the README). Outside windows
the profiler is off: RecordFunction then costs the operators nothing more than it does untraced.

At the window's end (``end()``) the result's events are read once and written through one
emitter (detail level, so only the window's file gets them):

* each event is a slice on its thread's track: the system thread id (Kineto's
  ``device_resource_id`` of a CPU event) is matched to the Python thread with that native id,
  else (a C++ thread, e.g. the autograd engine's ``pt_autograd_N`` on GPUs) to a thread track of
  its own named from ``/proc/self/task/<tid>/comm``;
* args ``input_shapes`` and ``input_dtypes`` where the op has inputs;
* forward→backward flows: the last forward op of a sequence number on its thread (the one that
  made the autograd node: ``aten::addmm`` inside ``aten::linear``; as Kineto links) starts a flow
  that the backward's ``autograd::engine::evaluate_function`` of that sequence number and
  forward thread terminates (what torch.profiler's Chrome trace draws as ``fwdbwd``).

Clock: torch stamps events with the Unix time (its approximate clock converted to
``CLOCK_REALTIME``; measured to lie within 0.4 µs of ``time.time_ns()`` reads bracketing the op).
Host events are on ``time.perf_counter_ns()``, so the offset REALTIME − MONOTONIC is read at the
window's start and end (tightest of a few paired reads) and interpolated linearly over the
window: an op lands inside the user range that encloses its call.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from typing import Any

import numpy as np

from .. import _schema as S
from ..core import tracks as _tracks
from ..record import recorder as rec

_FLOW_TAG = 0x5E << 56  # operator flows: apart from the GPU converter's 0x5C/0x5D ids
_EVAL = "autograd::engine::evaluate_function: "


def clock_offset(samples: int = 7) -> tuple[int, int]:
    """(monotonic ns, REALTIME − MONOTONIC ns) from the tightest of ``samples`` paired reads."""
    best = None
    for _ in range(samples):
        m0 = time.perf_counter_ns()
        r = time.time_ns()
        m1 = time.perf_counter_ns()
        if best is None or m1 - m0 < best[0]:
            best = (m1 - m0, (m0 + m1) // 2, r)
    assert best is not None
    return best[1], best[2] - best[1]


class _Offsets:
    """REALTIME → MONOTONIC by linear interpolation between two measured offsets."""

    def __init__(self, start: tuple[int, int], end: tuple[int, int]) -> None:
        (self.m0, self.o0), (m1, self.o1) = start, end
        self.span = max(1, m1 - self.m0)

    def __call__(self, real_ns: int) -> int:
        if self.o1 == self.o0:
            return real_ns - self.o0
        # m = real - (o0 + k (m - m0)), k the offset's slope, solved for m; clamped to the window
        k = (self.o1 - self.o0) / self.span
        m = (real_ns - self.o0 + k * self.m0) / (1 + k)
        if m <= self.m0:
            return real_ns - self.o0
        if m >= self.m0 + self.span:
            return real_ns - self.o1
        return round(m)

    def many(self, real_ns: list[int]) -> list[int]:
        """``[self(r) for r in real_ns]`` in numpy passes (the same arithmetic, the same ints)."""
        r = np.asarray(real_ns, dtype=np.int64)
        if self.o1 == self.o0:
            return (r - self.o0).tolist()
        k = (self.o1 - self.o0) / self.span
        m = ((r - self.o0) + k * self.m0) / (1 + k)
        out = np.rint(m).astype(np.int64)  # round half to even, as round()
        out = np.where(m <= self.m0, r - self.o0, out)
        out = np.where(m >= self.m0 + self.span, r - self.o1, out)
        return out.tolist()


def thread_name(tid: int) -> str:
    """A system thread's name from /proc (empty if it has ended or /proc is missing)."""
    try:
        with open(f"/proc/self/task/{int(tid)}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _op_args(shapes: str | None, dtypes: str | None) -> dict | None:
    return None if shapes is None else {S.ARG_INPUT_SHAPES: shapes, S.ARG_INPUT_DTYPES: dtypes}


class OperatorCapture:
    """Turns torch's profiler on for a window and writes its events at the window's end."""

    def __init__(self, sess: Any, rank: int = 0) -> None:
        self.sess = sess
        self.rank = rank
        self.skip_names: Any = None  # () -> names whose Kineto events are left out
        self.last_count = 0  # events written by the last end()
        self.last_seconds = 0.0  # time end() took
        self._on = False
        self._start: tuple[int, int] | None = None
        self._em: Any = None
        self._flows = 0
        self._warned = False
        self._tracks: dict[int, int] = {}

    # -- torch's profiler ---------------------------------------------------------------------
    @staticmethod
    def foreign_profiler_active() -> bool:
        """torch's profiler is on and it is not ours (the user's torch.profiler.profile)."""
        import torch

        return bool(torch.autograd._profiler_enabled())  # noqa: SLF001

    @staticmethod
    def user_profiler_running() -> bool:
        """torch.profiler.profile (or torch.autograd.profiler.profile) is on: its Python flag,
        which our direct ``_enable_profiler`` calls leave alone."""
        import torch.autograd.profiler as ap

        return bool(getattr(ap, "_is_profiler_enabled", False))

    def warn_foreign(self) -> None:
        if not self._warned:
            self._warned = True
            print("stepscope: torch.profiler is already running; this window has no stepscope "
                  "operators (and no stepscope CUPTI activity)", file=sys.stderr)

    @staticmethod
    def activities() -> set:
        """CPU only, always: the device side is stepscope's CUPTI tracer's (one CUPTI client)."""
        from torch._C._profiler import ProfilerActivity

        return {ProfilerActivity.CPU}

    @staticmethod
    def config() -> Any:
        from torch._C._profiler import ProfilerConfig, ProfilerState, _ExperimentalConfig

        # state, report_input_shapes, profile_memory, with_stack, with_flops, with_modules
        return ProfilerConfig(ProfilerState.KINETO, True, False, False, False, False,
                              _ExperimentalConfig())

    def begin(self) -> bool:
        import torch.autograd as ag

        if self._on or self.foreign_profiler_active():
            return False
        cfg, acts = self.config(), self.activities()
        ag._prepare_profiler(cfg, acts)  # noqa: SLF001
        self._start = clock_offset()
        ag._enable_profiler(cfg, acts)  # noqa: SLF001
        self._on = True
        return True

    def end(self) -> int:
        """Stop torch's profiler and write the window's events; returns how many."""
        import torch.autograd as ag

        if not self._on:
            return 0
        self._on = False
        if self.user_profiler_running() or not ag._profiler_enabled():  # noqa: SLF001
            # the program started torch.profiler inside the window: Kineto cancelled our
            # trace for it; never stop the program's own profiler
            print("stepscope: torch.profiler took over this window's operators; none written",
                  file=sys.stderr)
            return 0
        t0 = time.perf_counter()
        # tens of thousands of short-lived objects: the cyclic GC would sweep the program's
        # whole heap over and over meanwhile (none of them form cycles)
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            result = ag._disable_profiler()  # noqa: SLF001
            end = clock_offset()
            events = result.events()
            to_mono = _Offsets(self._start or end, end)
            self.last_count = self.write(events, to_mono)
            # freed here: 60-80 ms for 16k events (torch.profiler's result goes with its
            # reference cycle, at a later cyclic GC pass: 200+ ms). A thread would not help:
            # the C++ destructors hold the GIL throughout
            del events, result
        finally:
            if gc_was_on:
                gc.enable()
        self.last_seconds = time.perf_counter() - t0
        return self.last_count

    # -- conversion ---------------------------------------------------------------------------
    def _track(self, tid: int) -> int:
        track = self._tracks.get(tid)
        if track is not None:
            return track
        ident = None
        for t in threading.enumerate():
            if t.native_id == tid:
                ident = t.ident
                break
        if ident is None:
            for i, (native, _name) in list(_tracks._started_threads.items()):  # noqa: SLF001
                if native == tid:
                    ident = i
        if ident is not None:
            track = self.sess.thread_track(ident)
        else:
            track = self.sess.native_thread_track(tid, thread_name(tid) or f"thread {tid}")
        self._tracks[tid] = track
        return track

    def _flow_id(self) -> int:
        self._flows += 1
        import os

        process = ((self.rank & 0xFFF) << 12) | (os.getpid() & 0xFFF)
        return _FLOW_TAG | (process << 32) | (self._flows & 0xFFFFFFFF)

    def write(self, events: Any, to_mono: Any) -> int:
        """Write torch profiler events (``_KinetoEvent``-like objects) as slices; the clock
        converter ``to_mono`` maps their Unix-time stamps onto ``time.perf_counter_ns()``."""
        if self._em is None:
            self._em = self.sess.emitter(clock="monotonic", level=S.LEVEL_DETAIL)
        self._tracks = {}  # threads may have ended and their idents been reused
        rows = []
        fwd: dict[tuple[int, int], int] = {}  # (sequence nr, thread) -> row of the node's op
        bwd: dict[tuple[int, int], int] = {}  # (sequence nr, forward thread) -> backward row
        # record_function ranges the range capture recorded already: Kineto's copies are left
        # out by name (a set lookup; asking each event is_user_annotation() costs 3 us)
        skip = self.skip_names() if self.skip_names is not None else ()
        for e in events:  # CPU activity only: every event is a CPU op or a user annotation
            try:
                name = e.name()
                if name in skip:
                    continue
                start = e.start_ns()
                dur = e.duration_ns()
                tid = e.device_resource_id()
                seq = e.sequence_nr()
            except Exception:
                continue
            i = len(rows)
            rows.append((start, dur, name, tid, e))
            if seq >= 0:
                fwd_tid = e.fwd_thread_id()
                if fwd_tid == 0:
                    key = (seq, e.start_thread_id())
                    j = fwd.get(key)
                    if j is None or start >= rows[j][0]:
                        fwd[key] = i  # the last op of the number made the node (as Kineto)
                else:
                    k = (seq, fwd_tid)
                    j = bwd.get(k)
                    if j is None or name.startswith(_EVAL) and not rows[j][2].startswith(_EVAL):
                        bwd[k] = i
        starts: dict[int, int] = {}
        ends_at: dict[int, int] = {}
        for key, j in bwd.items():
            i = fwd.get(key)
            if i is not None:
                fid = self._flow_id()
                starts[i] = fid
                ends_at[j] = fid
        em = self._em
        cat = (S.CAT_TORCH_OP,)
        level = em.level
        ts = to_mono.many([r[0] for r in rows]) if hasattr(to_mono, "many") else [
            to_mono(r[0]) for r in rows]
        Blob, BEGIN, END = rec.Blob, rec.BEGIN, rec.END
        # the same op with the same inputs on a thread, every step: one blob (encoded once);
        # blobs go to the emitter by index
        blobs: list = []
        begin_of: dict[tuple, int] = {}  # (name, tid, shapes, dtypes) -> its begin blob
        end_of: dict[int, int] = {}  # tid -> its end blob
        flowed = starts.keys() | ends_at.keys()
        bidx, eidx = [], []
        for i, (_start, _dur, name, tid, e) in enumerate(rows):
            shapes = dtypes = None
            try:
                dt = e.dtypes()
                if dt and any(dt):
                    shapes, dtypes = str(e.shapes()), ", ".join(dt)
            except Exception:
                pass
            if i in flowed:
                f_out, f_in = starts.get(i), ends_at.get(i)
                bidx.append(len(blobs))
                blobs.append(Blob(BEGIN, rec.event_id(name, cat), level, self._track(tid),
                                  _op_args(shapes, dtypes), None if f_out is None else [f_out],
                                  None if f_in is None else [f_in]))
            else:
                key = (name, tid, shapes, dtypes)
                k = begin_of.get(key)
                if k is None:
                    k = begin_of[key] = len(blobs)
                    blobs.append(Blob(BEGIN, rec.event_id(name, cat), level, self._track(tid),
                                      _op_args(shapes, dtypes)))
                bidx.append(k)
            k = end_of.get(tid)
            if k is None:
                k = end_of[tid] = len(blobs)
                blobs.append(Blob(END, 0, level, self._track(tid)))
            eidx.append(k)
        durs = np.maximum(np.array([r[1] for r in rows], dtype=np.int64), 0)
        em.completes_indexed(ts, durs, blobs, bidx, eidx)
        return len(rows)
