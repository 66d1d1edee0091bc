"""Operators of a detail window from torch's own profiler, converted in bulk at the window's end.

While a window is open, torch's profiler (Kineto through ``torch.autograd._enable_profiler``)
records every RecordFunction event of the process in C++: aten operators, autograd nodes and
engine frames, on every thread, with input shapes and dtypes (``record_shapes``). Activities are
CPU only: on a GPU the device side comes from stepscope's own CUPTI tracer, and two CUPTI
subscribers in one process fail (see :mod:`stepscope.pytorch` and the README). Outside windows
the profiler is off: RecordFunction then costs the operators nothing more than it does untraced.

At the window's end (``end()``) the result's events are read once into columns
(:mod:`.events`: by the native reader that ``stepscope build-torch`` compiles, else through
torch's Python API) and written through one emitter in numpy passes (detail level, so only the
window's file gets them):

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
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _schema as S
from ..core import native_threads
from ..core import tracks as _tracks
from ..record import recorder as rec
from . import events, native
from .events import OpColumns

_FLOW_TAG = 0x5E << 56  # operator flows: apart from the GPU converter's 0x5C/0x5D ids
_EVAL = "autograd::engine::evaluate_function: "


# where the NVIDIA kernel driver says its version (in containers too: the host's procfs)
NVIDIA_DRIVER = "/proc/driver/nvidia/version"
_kineto_started = False  # by a window of ours in this process (it reads its level once)


def quiet_kineto() -> Callable[[], object]:
    """Kineto's own lines on stderr, which our first window would make ours: on a CUDA build
    of torch (pip's default on Linux) on a machine without an NVIDIA driver, ``ERROR: ...
    gpuGetDeviceCount failed with code 35`` when it starts, though only CPU activity is asked
    for; and from torch 2.13 (CPU builds too), a ``USDT: ... profiler_start``/``profiler_stop``
    pair at every start and stop, one for each window. Kineto reads ``KINETO_LOG_LEVEL`` once,
    when it starts: where the program set none and no GPU can be traced (a CPU build, or no
    driver), it is set (6: above USDT, its highest level, 5) for that start, then removed; the
    returned function removes it. With a driver Kineto's errors may tell of CUPTI's trouble,
    and are left as they are; so is everything after the first window."""
    import torch

    global _kineto_started
    first, _kineto_started = not _kineto_started, True
    if (not first or "KINETO_LOG_LEVEL" in os.environ
            or (torch.version.cuda and os.path.exists(NVIDIA_DRIVER))):
        return lambda: None
    os.environ["KINETO_LOG_LEVEL"] = "6"
    return lambda: os.environ.pop("KINETO_LOG_LEVEL", None)


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

    def many(self, real_ns: Any) -> np.ndarray:
        """``[self(r) for r in real_ns]`` in numpy passes (the same arithmetic, the same ints)."""
        r = np.asarray(real_ns, dtype=np.int64)
        if self.o1 == self.o0:
            return r - self.o0
        k = (self.o1 - self.o0) / self.span
        m = ((r - self.o0) + k * self.m0) / (1 + k)
        out = np.rint(m).astype(np.int64)  # round half to even, as round()
        out = np.where(m <= self.m0, r - self.o0, out)
        return np.where(m >= self.m0 + self.span, r - self.o1, out)


class OperatorCapture:
    """Turns torch's profiler on for a window and writes its events at the window's end."""

    def __init__(self, sess: Any, rank: int = 0) -> None:
        self.sess = sess
        self.rank = rank
        self.skip_names: Any = None  # () -> names whose Kineto events are left out
        self.last_count = 0  # events written by the last end()
        self.last_seconds = 0.0  # time end() took
        self.last_reader = ""  # "native" (kineto_reader.cpp) or "python" (torch's Python API)
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
        restore = quiet_kineto()
        try:
            ag._prepare_profiler(cfg, acts)  # noqa: SLF001
        finally:
            restore()
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
        # tens of thousands of short-lived objects (Python reader): the cyclic GC would sweep
        # the program's whole heap over and over meanwhile (none of them form cycles)
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            reader = native.load()
            self.last_reader = "native" if reader is not None else "python"
            if reader is not None:
                reader.take()  # torch.autograd._disable_profiler, the result held in C++
                end = clock_offset()
                try:
                    cols = events.from_native(reader.columns())
                finally:
                    # freed on a native thread: longer than torch.profiler's whole JSON export
                    reader.release()
            else:
                result = ag._disable_profiler()  # noqa: SLF001
                end = clock_offset()
                cols = events.from_events(result.events())
                # freed here: 60-80 ms for 16k events. A Python thread would not help: the
                # C++ destructors hold the GIL throughout
                del result
            self.last_count = self.write(cols, _Offsets(self._start or end, end))
        finally:
            if gc_was_on:
                gc.enable()
        self.last_seconds = time.perf_counter() - t0
        return self.last_count

    def wait(self) -> None:
        """Wait for the native reader's free of the last result: the profiler's stop waits for
        it once its files are closed (a window's end mid-run does not)."""
        reader = native.load() if self.last_reader == "native" else None
        if reader is not None:
            reader.join()

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
            track = self.sess.native_thread_track(
                tid, native_threads.thread_name(tid) or f"thread {tid}")
        self._tracks[tid] = track
        return track

    def _flow_ids(self, k: int) -> list[int]:
        """``k`` new flow ids, apart from other ranks' and processes' (merged traces)."""
        import os

        base = self._flows
        self._flows += k
        head = _FLOW_TAG | ((((self.rank & 0xFFF) << 12) | (os.getpid() & 0xFFF)) << 32)
        return [head | ((base + j) & 0xFFFFFFFF) for j in range(1, k + 1)]

    def write(self, cols: OpColumns, to_mono: Any) -> int:
        """Write the window's events (:class:`~.events.OpColumns`) as slices, in numpy passes
        and one Python call per distinct (op, thread, inputs) and per flow; ``to_mono`` maps
        their Unix-time stamps onto ``time.perf_counter_ns()``."""
        if self._em is None:
            self._em = self.sess.emitter(clock="monotonic", level=S.LEVEL_DETAIL)
        self._tracks = {}  # threads may have ended and their idents been reused
        if len(cols) == 0:
            return 0
        # record_function ranges the range capture recorded already: Kineto's copies are left
        # out by name (asking each event is_user_annotation() costs 3 us)
        skip = self.skip_names() if self.skip_names is not None else ()
        kept = np.array([nm not in skip for nm in cols.names], dtype=bool)[cols.name]
        rows = np.flatnonzero(kept)
        n = len(rows)
        if n == 0:
            return 0
        name, inputs, tid = cols.name[rows], cols.inputs[rows], cols.tid[rows]
        start, seq = cols.start[rows], cols.seq[rows]
        is_eval = np.array([nm.startswith(_EVAL) for nm in cols.names], dtype=bool)
        f_out, f_in = _flow_pairs(start, cols.start_tid[rows], seq, cols.fwd_tid[rows],
                                  is_eval[name])
        em = self._em
        level = em.level
        Blob, BEGIN, END = rec.Blob, rec.BEGIN, rec.END
        threads, thread_of = np.unique(tid, return_inverse=True)
        tracks = [self._track(int(t)) for t in threads]
        cat = (S.CAT_TORCH_OP,)
        used = np.zeros(len(cols.names), dtype=bool)
        used[name] = True
        eid_of = [rec.event_id(nm, cat) if u else 0 for nm, u in zip(cols.names, used.tolist(),
                                                                       strict=True)]
        # index -1 (no typed inputs): the last entry
        args_of: list[dict | None] = [{S.ARG_INPUT_SHAPES: sh, S.ARG_INPUT_DTYPES: dt}
                                      for sh, dt in zip(cols.shapes, cols.dtypes, strict=True)]
        args_of.append(None)
        name_l, inputs_l, thread_l = name.tolist(), inputs.tolist(), thread_of.tolist()

        def begin(r: int, out: list | None = None, into: list | None = None) -> Blob:
            return Blob(BEGIN, eid_of[name_l[r]], level, tracks[thread_l[r]],
                        args_of[inputs_l[r]], out, into)

        # the same op with the same inputs on a thread, every step: one blob (encoded once);
        # an op at a flow's end has a blob of its own
        flowed = np.zeros(n, dtype=bool)
        flowed[f_out] = flowed[f_in] = True
        plain = np.flatnonzero(~flowed)
        key = ((name[plain].astype(np.int64) * len(threads) + thread_of[plain])
               * (len(cols.shapes) + 1) + inputs[plain] + 1)
        _, first, shared = np.unique(key, return_index=True, return_inverse=True)
        blobs = [begin(r) for r in plain[first].tolist()]
        bidx = np.empty(n, dtype=np.int64)
        bidx[plain] = shared
        k = len(f_out)
        flows = self._flow_ids(k)
        bidx[f_out] = np.arange(len(blobs), len(blobs) + k)
        blobs += [begin(r, [f]) for r, f in zip(f_out.tolist(), flows, strict=True)]
        bidx[f_in] = np.arange(len(blobs), len(blobs) + k)
        blobs += [begin(r, None, [f]) for r, f in zip(f_in.tolist(), flows, strict=True)]
        eidx = len(blobs) + thread_of
        blobs += [Blob(END, 0, level, t) for t in tracks]
        ts = to_mono.many(start) if hasattr(to_mono, "many") else np.array(
            [to_mono(int(t)) for t in start], dtype=np.int64)
        em.completes_indexed(ts, np.maximum(cols.dur[rows], 0), blobs, bidx, eidx)
        return n


def _flow_pairs(start: np.ndarray, start_tid: np.ndarray, seq: np.ndarray, fwd_tid: np.ndarray,
                is_eval: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Forward→backward links as (forward rows, backward rows), paired by position.

    A sequence number names the autograd node a forward op made on its thread; the backward
    op that ran the node carries the number and that forward thread's id. As Kineto links
    them (torch.profiler's ``fwdbwd`` arrows): the forward side is the *last* op of the number
    on its thread (``aten::addmm`` inside ``aten::linear``: latest start, then latest
    recorded); the backward side is the first ``autograd::engine::evaluate_function`` of the
    number and forward thread, else the first op carrying them."""
    rows = np.arange(len(start))
    f = rows[(seq >= 0) & (fwd_tid == 0)]
    f = f[np.lexsort((f, start[f], start_tid[f], seq[f]))]
    last = np.ones(len(f), dtype=bool)
    last[:-1] = (seq[f[1:]] != seq[f[:-1]]) | (start_tid[f[1:]] != start_tid[f[:-1]])
    f = f[last]
    b = rows[(seq >= 0) & (fwd_tid != 0)]
    b = b[np.lexsort((b, ~is_eval[b], fwd_tid[b], seq[b]))]
    first = np.ones(len(b), dtype=bool)
    first[1:] = (seq[b[1:]] != seq[b[:-1]]) | (fwd_tid[b[1:]] != fwd_tid[b[:-1]])
    b = b[first]
    fwd_of = dict(zip(zip(seq[f].tolist(), start_tid[f].tolist(), strict=True), f.tolist(),
                      strict=True))
    pairs = [(fwd_of[k], r) for k, r in zip(zip(seq[b].tolist(), fwd_tid[b].tolist(),
                                                 strict=True), b.tolist(), strict=True)
             if k in fwd_of]
    pairs.sort(key=lambda p: p[1])  # flow ids in the order the backward ops ran
    out = np.array([p[0] for p in pairs], dtype=np.int64)
    into = np.array([p[1] for p in pairs], dtype=np.int64)
    return out, into
