"""``Profiler``: steps, phases, data-loader waits, schedules, levels and host metrics of one rank.

Outputs under ``<dir>/<run-id>/``:

* ``rank<N>.summary.pftrace`` for the whole run (summary level: steps, phases, data-loader waits,
  host counters; small enough to leave on);
* ``rank<N>.detail.<k>.pftrace``, one file per schedule window ``k`` (0, 1, ... over the run), with
  every event of that window, summary and detail level (user ranges, captured nvtx). One file per
  window means each is complete and closed when its window ends, so ``on_trace_ready`` can hand it
  over at once, and a crash loses at most the open window's last second.

Schedule mechanics on the core session: at warmup start detail recording is turned on; when the
active part starts, pending events are flushed with ``discard_detail=True`` (warmup detail is
dropped, so start-up cost does not distort the window) and the window's sink is opened; at the
window's end detail recording is turned off and the sink closed (slices still open are left open:
"Did not end").

Steps: ``start()`` opens step 0 (``start(open_step=False)``: at the first batch wait, phase or
``step()``) and each ``step()`` ends one and opens the next, as the slice ``step <n>`` (category
``step``) on the calling thread. Its args: ``step`` on the begin, ``epoch`` and ``num_samples``
(when ``step(num_samples=...)`` gives it) on the end, where the epoch is known for sure; trace
processor merges both into the slice's args. The end's args repeat from step to step, so each
(epoch, num_samples) is an event kind of its own: one C call, encoded once per file. A step is
written once it holds work or is ended (see the note above ``Profiler.step``): when the
``prof.dataloader`` wrapper finds its loader exhausted, the step just opened is never written,
and the next step opens at the next batch wait, phase or ``step()``. So there is no empty
trailing step per epoch, however long the exhausted loader takes; that final wait is a
``dataloader.exhausted`` slice between the steps. A begin a flush overtook is written later with
its own time (readers sort by time before nesting).
Phases (category ``phase``) and data-loader waits (category ``dataloader``, name
``dataloader.next``; the first of each pass from ``iter(loader)`` on) are summary-level slices
inside the step.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import operator
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from .. import _schema as S
from .. import gpu as _gpu  # light: GpuTracing loads on first use
from .. import ranks as _ranks
from ..core import hooks
from ..core import session as _session
from ..record import recorder as rec
from ..record.rebind import Rebound
from . import options as _options
from .host_metrics import UNITS, HostSampler, SamplerCost
from .schedule import NEVER, Schedule, State, coerce
from .timer import StepTimer, TimerStats

T = TypeVar("T")

DEFAULT_SCHEDULE = Schedule(skip_first=1, wait=0, warmup=1, active=3, repeat=0)
"""Default: one detail window per epoch, batches 2-4 (batch 0 skipped, batch 1 warms up)."""

_current: Profiler | None = None

NO_STEPS_HINT = (
    "stepscope: no steps were recorded, so the tables have no per-step figures: call "
    "stepscope.step() (or prof.step()) at the end of each training step, or, under "
    "`stepscope run`, name the range that begins each step with --step-range NAME."
)


def current() -> Profiler | None:
    """The running profiler of this process, or None."""
    return _current


def _forget_in_child() -> None:
    """A forked child (e.g. a data-loader worker) has no running profiler."""
    global _current
    _current = None


os.register_at_fork(after_in_child=_forget_in_child)


def _warn(message: str) -> None:
    print(f"stepscope: {message}", file=sys.stderr)


def _samples(value: Any) -> int | float | None:
    """``step(num_samples=...)`` as a plain int or float (a numpy scalar, a 0-d array, a
    Decimal become one); anything that is no number is ignored, with one warning, rather than
    break the program or put text in the step's args."""
    if not isinstance(value, (str, bytes)):
        try:
            return operator.index(value)
        except Exception:
            pass
        try:
            return float(value)
        except Exception:
            pass
    rec.warn_once("num_samples", f"step(num_samples={_short(value)}) is not a number: ignored")
    return None


def _epoch_number(value: Any) -> int | None:
    """``step(epoch=...)`` as an int; anything else is ignored, with one warning."""
    try:
        return operator.index(value)
    except Exception:
        rec.warn_once("epoch", f"step(epoch={_short(value)}) is not an integer: ignored")
        return None


def _gate_open(hook: Any) -> bool:
    """Whether a hook's ``step_end`` is called: unless its ``step_end_gates``, (object,
    attribute) pairs, are all unset (None, False or 0; a missing attribute counts as set, and
    anything odd opens the gate: the hook decides, and its failure is caught). The C step
    reads them the same way."""
    try:
        gates = getattr(hook, "step_end_gates", None)
        return gates is None or any(getattr(obj, attr, True) for obj, attr in gates)
    except Exception:
        return True


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 40 else text[:37] + "..."


class _Phase:
    """Context manager of one phase name, cached: its begin is a C-level recorder chain."""

    __slots__ = ("begin",)

    def __init__(self, name: str) -> None:
        eid = rec.event_id(name, (S.CAT_PHASE,))
        self.begin = rec.chain(rec.code(eid, S.LEVEL_SUMMARY, rec.BEGIN))

    def __enter__(self) -> _Phase:
        if rec.ON:
            self.begin()
        return self

    def __exit__(self, *exc: object) -> None:
        if rec.ON:
            _end_summary()


class _FastPhase(_Phase):
    """A phase with a class of its own (see ``_fast_phase``): while recording, ``__enter__`` is
    the begin chain itself (no Python frame) and ``__exit__`` ends the slice without checking
    the state; otherwise both are C no-ops. ``with prof.phase(...) as x`` binds nothing useful."""

    __slots__ = ()

    def _end(self, *exc: object) -> None:
        _end_summary()

    if rec.fast is not None:  # the C chain ignores its arguments: no Python frame on exit
        _end = staticmethod(rec.end_summary)  # type: ignore[assignment]




def _bind_phase(cls: type, begin: Callable[[], Any], on: bool) -> None:
    if on:  # staticmethod: the chain is called bare, whether or not it is a descriptor (a
        # functools.partial becomes one in Python 3.14)
        cls.__enter__, cls.__exit__ = staticmethod(begin), _FastPhase._end  # type: ignore
    else:
        cls.__enter__ = cls.__exit__ = rec.noop  # type: ignore[attr-defined]


def _fast_phase(name: str) -> _FastPhase:
    """A cached phase (call with ``_phase_lock`` held, then store it in ``_phases``)."""
    ph = type("_FastPhase", (_FastPhase,), {"__slots__": ()})(name)
    _bind_phase(type(ph), ph.begin, rec.ON)
    return ph


# the cached phases by name, rebound when recording turns on or off
_fast_phases = Rebound(lambda ph, on, detail: _bind_phase(type(ph), ph.begin, on))
_phase_lock = _fast_phases.lock  # phase creation vs rebinding
rec.on_state_change(_fast_phases.rebind)


class _SyncPhase(_Phase):
    """``sync_gpu=True``: a phase ends when its device work has finished."""

    __slots__ = ()

    def __exit__(self, *exc: object) -> None:
        _sync_gpu()
        super().__exit__(*exc)


def _sync_gpu() -> None:
    hooks.sync_gpu()  # registered by stepscope.gpu (a no-op without CuPy)


_end_summary = rec.end_summary


class _StepBegin(rec.NumberedBegin):
    """``step N`` with the arg ``step: N``: the name is written inline (used once, so no table
    grows with the run); epoch and num_samples ride on the end."""

    __slots__ = ()
    eid = rec.event_id("", (S.CAT_STEP,))
    level = S.LEVEL_SUMMARY
    prefix, suffix = S.STEP_NAME.split("{step}")
    arg = S.ARG_STEP


# A step's begin is a numbered code (its number in the code: no object per step; see
# rec.NumberedBegin): rec.numbered_code(_StepBegin, n), which step() inlines as
# _STEP_CODE0 + (n << 3) while n < _STEP_CODE_MAX (step numbers are never negative).
_STEP_CODE0 = rec.register_numbered(_StepBegin)
_STEP_CODE_MAX = rec.NUMBERED_MAX


# Step ends made event kinds: a num_samples that changes every step (tokens per batch) must not
# fill the event table that range names share; past this many, step ends are blobs.
MAX_STEP_END_KINDS = 1024
# (epoch, type, num_samples) -> the chain recording that step end's fast code (its kind: see
# rec.event_id); one entry per kind made, never cleared, so its size is the count of kinds
_step_ends: dict[tuple, Callable[[], Any]] = {}


def _step_end_code(epoch: int, num_samples: Any) -> int:
    """The code of a step end with its args: the fast code of an end with those fixed args, or
    a parked blob's for an unhashable ``num_samples``, a full event table or past
    ``MAX_STEP_END_KINDS``. (A code, not a recording: the caller writes it with the time the
    step timer uses, so that the timer and the trace agree to the nanosecond.)"""
    key: tuple | None = (epoch, type(num_samples), num_samples)
    try:  # (a NaN num_samples is never found: rec.event_id makes no kind for it)
        end = _step_ends.get(key)
    except TypeError:  # an unhashable num_samples
        key, end = None, None
    if end is None:
        args: dict[str, Any] = {S.ARG_EPOCH: epoch}
        if num_samples is not None:
            args[S.ARG_NUM_SAMPLES] = num_samples
        eid = None
        if key is not None and len(_step_ends) < MAX_STEP_END_KINDS:
            eid = rec.event_id("", (), force=False, args=args)
        if eid is None:
            return -rec.register_blob(rec.Blob(rec.END, 0, S.LEVEL_SUMMARY, args=args))
        end = _step_ends[key] = rec.code(eid, S.LEVEL_SUMMARY, rec.END)
    return end


_emit = rec._ext  # noqa: SLF001 - records (code, ts, ident) triples as one atomic extend
_NULL = rec.NULL
# a thread's step events are recorded under its ident | _STEPS: their own sequence and track
_STEPS = rec.STEPS
_WAIT_EID = rec.event_id(S.DATALOADER_WAIT_NAME, (S.CAT_DATALOADER,))
_WAIT_BEGIN = rec.code(_WAIT_EID, S.LEVEL_SUMMARY, rec.BEGIN)
_EXHAUSTED_EID = rec.event_id(S.DATALOADER_EXHAUSTED_NAME, (S.CAT_DATALOADER,))
_EXHAUSTED_BEGIN = rec.code(_EXHAUSTED_EID, S.LEVEL_SUMMARY, rec.BEGIN)
_EVAL_EID = rec.event_id(S.DATALOADER_EVAL_NAME, (S.CAT_DATALOADER,))
_EVAL_BEGIN = rec.code(_EVAL_EID, S.LEVEL_SUMMARY, rec.BEGIN)


_ALL = sys.maxsize // 8  # a lookback past any buffer's start
# How far back (events) a step's placeholder is looked for; past it the begin is written late,
# as when a flush took it. Unbounded, a loop with only step() scanned each step's events under
# the lock: 10-27 ms a step() with 100k events in pure Python (0.5 ms in C).
_STEP_LOOKBACK = 4096


def _replace(old: int, ts: int, ident: int, new: int, lookback: int = _ALL) -> bool:
    """Turn the newest event ``(old, ts, ident)`` that no flush has taken yet into ``new``, in
    place (so it keeps its place among the thread's events); False if a flush took it. With the
    pure-Python buffer the caller holds the session's lock (see ``Profiler._plock``)."""
    ev = rec.events  # type: ignore[attr-defined]
    for i in range(len(ev) - len(ev) % 3 - 3, max(-1, len(ev) - 3 * lookback - 1), -3):
        if ev[i + 1] == ts and ev[i] == old and ev[i + 2] == ident:
            ev[i] = new
            return True
    return False


if rec.fast is not None:  # the same in C, called bare (callers pass the lookback)
    _replace = rec.fast.withdraw  # type: ignore[assignment]  # noqa: F811


def _py_boundary(end: int, ts: int, ident: int, begin: int, begin_ts: int, begin_ident: int,
                 null: int, lookback: int) -> bool:
    """A step boundary in the buffer: the open step's placeholder becomes its begin, then the
    end and the next step's placeholder; False (nothing written) if a flush took the
    placeholder. (``_plock`` held.)"""
    if not _replace(null, begin_ts, begin_ident, begin, lookback):
        return False
    _emit((end, ts, ident, null, ts, ident))
    return True


_boundary = rec.fast.step_boundary if rec.fast is not None else _py_boundary  # (one C call)


# The open step's begin while it is not known to be a step (Profiler._tentative): a placeholder
# (NULL, ts, ident) in the buffer, which files skip, and the begin it becomes, (code, ts, ident)
# (code: the step's numbered code, see _STEP_CODE0).
_Tentative = tuple[int, int, int]


# Threads other than the profiler's with an emitter of late begins (idents: reused by later
# threads); past this many, they share the profiler's thread's (where a begin earlier than one
# already written there is clamped forward)
MAX_LATE_THREADS = 64

_phases: dict[str, _FastPhase] = _fast_phases.objects
_sync_phases: dict[str, _Phase] = {}


class _NoPhase:
    __slots__ = ()

    def __enter__(self) -> _NoPhase:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_NO_PHASE = _NoPhase()
# With the C buffer the profiler's per-step state lives in a C base class, whose C step(),
# _activity() and phase() replace the Python ones (see _install_c_methods)
_Core: type = rec.fast.ProfilerCore if rec.fast is not None else object
_profilers_made = itertools.count()  # default run ids of later profilers get a suffix
MAX_CACHED_PHASES = 1024


class _DynamicPhase:
    """A phase whose name is one of too many to cache (``phase(f"fwd {i}")``): recorded by name,
    written inline once the name table is full, so nothing grows with the run."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> _DynamicPhase:
        rec.begin(self.name, S.CAT_PHASE, level=S.LEVEL_SUMMARY)
        return self

    def __exit__(self, *exc: object) -> None:
        rec.end(S.LEVEL_SUMMARY)


def default_run_id(info: _ranks.RankInfo, env: dict[str, str] | None = None) -> str:
    """A run id all ranks of one job agree on without talking to each other.

    ``STEPSCOPE_RUN_ID``, else the launcher's job id (torchrun ``TORCHELASTIC_RUN_ID`` unless
    "none", Slurm ``SLURM_JOB_ID[.SLURM_STEP_ID]``, Open MPI/PMIx namespace); else, for several
    ranks, the parent process (the launcher, shared by the ranks): its start time and pid; for one
    rank, this process's start time and pid.
    """
    import psutil

    env = dict(os.environ) if env is None else env
    if env.get("STEPSCOPE_RUN_ID"):
        return _options.check_run_id("STEPSCOPE_RUN_ID", env["STEPSCOPE_RUN_ID"])
    te = env.get("TORCHELASTIC_RUN_ID")
    if te and te != "none":  # (torchrun's --rdzv-id: any text, as the MPI namespace below)
        return f"torchelastic-{te}".replace("/", "_")
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID")
        return f"slurm-{env['SLURM_JOB_ID']}" + (f".{step}" if step else "")
    ns = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid")
    if ns:
        return f"mpi-{ns}".replace("/", "_")
    pid = os.getppid() if info.world_size > 1 else os.getpid()
    try:
        started = psutil.Process(pid).create_time()
    except Exception:
        started = time.time()
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(started)) + f"-{pid}"


class Profiler(_Core):  # type: ignore[misc,valid-type]
    """Training-loop profiler of one rank; see the module docstring for outputs and levels.

    ``dir``: output root (files go to ``<dir>/<run-id>/``); ``schedule``: detail windows
    (``stepscope.schedule(...)``, a ``(start, end)`` pair, or None for summary only; the default
    records batches 2-4 of every epoch); ``on_trace_ready(files)``: called with each file as soon
    as it is finished (a window's detail file at the window's end, the summary file at stop);
    ``timer_only``: step timer and data-loader wrapper only, no files; ``host_metrics`` /
    ``sample_interval_s``: psutil counters; ``gpu``: GPU tracing (None: where a GPU is found);
    ``sync_gpu``: synchronize the GPU at each phase and step end; ``gpu_bucket_ns``: the GPU
    counters' bucket (default: about 20 per step); ``buffer_bytes``: the session's
    buffer cap; ``rank``: overrides the launcher's variables; ``run_id``: the run directory name
    (default: shared by the ranks of one job, see :func:`default_run_id`); ``levels``: which files
    to write; ``report``: print the summary at stop. ``STEPSCOPE_OPTIONS`` (JSON, see
    :mod:`stepscope.profiler.options`) overrides these so a run can be reconfigured without code
    changes (``use_env=False`` ignores it). ``torch``: the PyTorch integration
    (:mod:`stepscope.pytorch`; None: on when the program has imported torch at ``start()``);
    ``step_on="optimizer"``: a step per optimizer step, no ``step()`` calls needed ("auto": the
    same until the program calls ``step()`` itself).
    """

    def __init__(
        self,
        dir: str | os.PathLike[str] = "./stepscope",
        schedule: Schedule | tuple[int, int] | None = DEFAULT_SCHEDULE,
        on_trace_ready: Callable[[list[Path]], Any] | None = None,
        timer_only: bool = False,
        host_metrics: bool = True,
        sample_interval_s: float = 0.5,
        gpu: bool | None = None,
        sync_gpu: bool = False,
        gpu_bucket_ns: int | None = None,
        buffer_bytes: int = 32 << 20,
        rank: int | None = None,
        *,
        run_id: str | None = None,
        levels: Sequence[str] = ("summary", "detail"),
        report: bool = True,
        use_env: bool = True,
        torch: bool | None = None,
        step_on: str | None = None,
    ) -> None:
        cfg: dict[str, Any] = {
            "dir": os.fspath(dir), "schedule": schedule, "timer_only": timer_only,
            "host_metrics": host_metrics, "sample_interval_s": sample_interval_s, "gpu": gpu,
            "sync_gpu": sync_gpu, "gpu_bucket_ns": gpu_bucket_ns, "buffer_bytes": buffer_bytes,
            "rank": rank, "run_id": run_id, "levels": tuple(levels), "report": report,
            "torch": torch, "step_on": step_on,
        }
        if use_env:
            cfg.update(_options.from_env())
        self.schedule: Schedule | None = coerce(cfg["schedule"])
        bad = [lv for lv in cfg["levels"] if lv not in _options.LEVELS]
        if bad or not cfg["levels"]:
            raise ValueError(f"levels must be a non-empty subset of {_options.LEVELS}, got "
                             f"{cfg['levels']!r}")
        si = cfg["sample_interval_s"]
        if not _options.MIN_INTERVAL_S <= si <= _options.MAX_INTERVAL_S:  # NaN and inf too
            raise ValueError(f"sample_interval_s must be from {_options.MIN_INTERVAL_S:g} to "
                             f"{_options.MAX_INTERVAL_S:g} seconds, got {si!r}")
        b = cfg["gpu_bucket_ns"]
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"gpu_bucket_ns must be an integer >= 1 or None, got {b!r}")
        low = _options.min_buffer_bytes()
        if not isinstance(cfg["buffer_bytes"], int) or cfg["buffer_bytes"] < low:
            raise ValueError(f"buffer_bytes must be an integer >= {low}, got "
                             f"{cfg['buffer_bytes']!r}")
        if cfg["run_id"] is not None:
            _options.check_run_id("run_id", cfg["run_id"])
        elif os.environ.get("STEPSCOPE_RUN_ID"):  # (read at start(): refused here, as options)
            _options.check_run_id("STEPSCOPE_RUN_ID", os.environ["STEPSCOPE_RUN_ID"])
        if cfg["step_on"] not in (None, *_options.STEP_ON):
            raise ValueError(f"step_on must be None or one of {_options.STEP_ON}, got "
                             f"{cfg['step_on']!r}")
        self.options = cfg
        self.timer_only = bool(cfg["timer_only"])
        self.on_trace_ready = on_trace_ready
        self.rank_info = _ranks.detect(rank=cfg["rank"])
        self.rank = self.rank_info.rank
        self.levels = tuple(cfg["levels"])
        self.gpu = cfg["gpu"]
        self.sync_gpu = bool(cfg["sync_gpu"])
        self.gpu_bucket_ns = cfg["gpu_bucket_ns"]
        self._run_id = cfg["run_id"]
        self.run_dir: Path | None = None
        self.timer = StepTimer()
        self.files: list[Path] = []
        self.sampler_cost: SamplerCost | None = None
        self.report_text: str | None = None
        self._printed: str | None = None  # the report stop() printed
        self._sess: Any = None
        self._own_session = False
        self._sink: Any = None
        self._gpu: Any = None  # stepscope.gpu.GpuTracing
        self._window_first_step = 0
        self._sampler: HostSampler | None = None
        self._emitter: Any = None
        self._tracks: dict[str, int] = {}
        self._state = State.DISABLED
        self._window_key: tuple[int, int] | None = None
        self._windows = 0
        self._own_end = 0  # the end of the last slice of the profiler's own window work
        self._window_path: Path | None = None
        self._step = 0
        self._epoch = 0
        self._batch = 0
        self._stable_until = 0  # batch from which on _enter_batch must run again
        self._in_step = False  # a step is open (the step timer runs)
        self._pending = False  # no step is open: the next batch wait, phase or step() opens one
        self._active = False  # the open step had a batch or a phase
        self._quiet = False  # pending, or a step with no phase yet: phase() has work to do
        self._tentative: _Tentative | None = None  # the open step's begin, not written yet
        self._step_begin: tuple[int, int, int] | None = None  # ... once written
        self._late_track: int | None = None  # the open step's begin was written late (see
        # _write_late), on this track: its end is written with the track too
        self._late: Any = None  # the emitter of late begins (see _write_late)
        self._main_track = 0  # the profiler's thread's track
        self._main_steps = 0  # and its steps track
        self._late_others: dict[int, Any] = {}  # thread ident -> its emitter of late begins
        self._last_end: tuple = (object(), None, 0)  # (num_samples, epoch, code) of a step end
        # guards _tentative and the placeholders in the buffer against a flush (the session's
        # own lock with the pure-Python buffer, whose drain is not one C call)
        self._plock: Any = threading.Lock()
        self._summary_sink: Any = None
        self._summary_path: Path | None = None
        self._started = False
        self._stopped = False
        self._pid = os.getpid()
        self._thread = threading.get_ident()
        self._recording = False  # a session is on: summary events are written
        # producer hooks (the torch integration): objects whose optional methods start(),
        # window_start(), window_end(), step_end(), stop() and, once every file is closed,
        # stopped() (background work of theirs that the stop waits for) the profiler calls
        self.hooks: list[Any] = []
        self._adopts_nested = False  # `stepscope run`'s: a Profiler the program starts joins it
        # ... and, having asked for no step_on, makes the steps itself (step() calls): steps
        # from optimizer steps yield to them from the start (see pytorch/steps.py)
        self._program_steps = False
        self._joined: Profiler | None = None  # the `stepscope run` profiler this one joined

    # -- life cycle ---------------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        if self._run_id is None:
            self._run_id = default_run_id(self.rank_info)
            n = next(_profilers_made)
            if n:  # a second profiler in this process (e.g. eval after train): its own files
                self._run_id += f"-{n}"
        return self._run_id

    @property
    def step_num(self) -> int:
        """Steps completed so far (the open step's number)."""
        return self._step if self._joined is None else self._joined._step

    @property
    def state(self) -> State:
        """Schedule state of the step in progress."""
        return self._state if self._joined is None else self._joined._state

    def start(self, *, open_step: bool = True) -> Profiler:
        """Start recording; the first step opens now, or, with ``open_step=False`` (what
        ``stepscope run`` does), at the first batch wait of ``prof.dataloader``, the first phase
        or the first ``step()`` (which then ends a step 0 whose start was not seen: see
        :meth:`step`), so that start-up (the interpreter, imports, model building) is no step.
        With ``step_on`` (steps from optimizer steps) step 0 always opens that way (or at the
        first module forward, see :mod:`stepscope.pytorch.steps`).
        """
        global _current
        if self._started:
            raise RuntimeError("this Profiler was already started")
        self._started = True
        self._pid = os.getpid()
        self._thread = threading.get_ident()
        outer = _current
        if outer is not None and not outer._stopped:
            if outer._adopts_nested:
                self._join(outer)
                return self
            _warn("another Profiler is running in this process; this one only times steps")
            self.timer_only = True
        _current = self
        if not self.timer_only:
            try:
                self._start_session()
            except Exception as exc:  # the user's run goes on, untraced
                _warn(f"tracing could not start ({exc!r}); timing steps only")
                sess, self._sess = self._sess, None
                if sess is not None and self._own_session:  # no writer, file left running
                    with contextlib.suppress(Exception):
                        sess.stop()
                self._recording = False
        opens_now = open_step and not self.options.get("step_on")
        if not opens_now:  # steps from optimizer steps: step 0 opens at the first batch wait
            self._pending = self._quiet = True  # or forward (the producers look at this)
        # the producers first: a window open from batch 0 starts theirs with it, before the
        # first step, whose time it is not
        self._attach_hooks()
        t = time.perf_counter_ns()
        did = self._enter_batch()
        if did and self._recording:
            t = self._own_slice(t, did)
        if opens_now:
            with self._plock:
                self._begin_step(t)
        atexit.register(self._at_exit)
        return self

    def _attach_hooks(self) -> None:
        """The torch integration (``torch=None``: once the program has imported torch)."""
        want = self.options.get("torch")
        if want is False:
            return
        try:
            from .. import pytorch

            if want is None and "torch" not in sys.modules:
                pytorch.attach_on_import(self)  # `stepscope run`: the program imports it later
                return
            hook = pytorch.attach(self)
        except Exception as exc:
            _warn(f"the torch integration could not start ({exc!r})")
            return
        if hook is not None:
            self.hooks.append(hook)
            self._hook("start")  # (before the schedule's first state: see start())

    def _hook(self, name: str) -> None:
        for h in self.hooks:
            fn = getattr(h, name, None)
            if fn is not None and (name != "step_end" or _gate_open(h)):
                try:
                    fn()
                except Exception as exc:  # a producer never breaks the user's program
                    self._hook_failed(h, name, exc)

    def _hook_failed(self, hook: Any, name: str, exc: BaseException) -> None:
        _warn(f"{type(hook).__name__}.{name} failed: {exc!r}")

    def _join(self, outer: Profiler) -> None:
        """Under ``stepscope run`` the program's own Profiler is the one it calls: its steps,
        epochs, phases and loaders go to the run's profiler (which writes the files and prints
        the report at the program's end), not to a second timer that nobody reads."""
        _warn("`stepscope run` is profiling this program: this Profiler's steps, phases and "
              "loaders are recorded by it (with the run's options)")
        self.timer_only = True
        self.options["report"] = False
        self.run_dir = outer.run_dir
        self._joined = outer
        for name in ("step", "epoch", "phase", "dataloader", "timer_stats", "summary"):
            setattr(self, name, getattr(outer, name))  # instance attributes: no cost per call
        if not self.options.get("step_on"):
            outer._program_steps = True
            outer._hook("program_steps")

    def _at_exit(self) -> None:
        """Interpreter exit without ``stop()`` (the program's end, ``sys.exit``): a ``stop()``.
        (An uncaught exception stopped the session first, in its excepthook.)"""
        if self._started and not self._stopped and self._pid == os.getpid():
            self._stop(keep_open_step=False)

    def _start_session(self) -> None:
        self.run_dir = Path(self.options["dir"]) / self.run_id
        self.run_dir.mkdir(parents=True, exist_ok=True)
        sess = _session.current()
        if sess is None:
            name = S.PROCESS_NAME.format(rank=self.rank, host=self.rank_info.host)
            sess = _session.Session(None, detail=False, buffer_bytes=self.options["buffer_bytes"],
                                    rank=self.rank, process_name=name)
            self._own_session = True
        self._sess = sess
        # if the session is stopped from elsewhere (an unhandled exception, SIGTERM, exit), the
        # open window still gets its GPU activity and a complete file
        sess.before_stop.append(self._session_stopping)
        if rec.fast is None:
            self._plock = sess._lock  # noqa: SLF001 - see __init__
        self._late = sess.emitter(clock="monotonic", level=S.LEVEL_SUMMARY)
        self._main_track = sess.thread_track()  # (the profiler's thread: see _write_late)
        self._main_steps = sess.steps_track()
        if "summary" in self.levels:
            path = self.run_dir / S.SUMMARY_FILE.format(rank=self.rank)
            self._summary_sink = sess.add_sink(path, levels=("summary",))
            self._summary_path = path
        if self._own_session:
            sess.start()
        self._recording = True
        if self.gpu is not False:
            self._start_gpu(sess)
        if self.options["host_metrics"]:
            self._emitter = sess.emitter(clock="monotonic", level=S.LEVEL_SUMMARY)
            self._sampler = HostSampler(self._emit_host, self.options["sample_interval_s"])
            self._sampler.start()

    def _start_gpu(self, sess: Any) -> None:
        """GPU tracing (``stepscope.gpu.GpuTracing``): NVML counters for the whole run, CUPTI
        activity inside the detail windows. ``gpu=None`` turns it on where the program uses CUDA
        (one INFO log line otherwise) and never initializes CUDA itself; ``gpu=True`` warns when
        it cannot run."""
        import logging

        try:
            level = logging.WARNING if self.gpu else logging.INFO
            self._gpu = _gpu.GpuTracing(sess, log_level=level, init_cuda=bool(self.gpu),
                                        bucket_ns=self.gpu_bucket_ns)  # fmt: skip
            self._gpu.start()
        except Exception as exc:
            self._gpu = None
            if self.gpu:
                _warn(f"GPU tracing could not start ({exc!r})")

    def _emit_host(self, ts: int, values: dict[str, float]) -> None:
        sess, em = self._sess, self._emitter
        if sess is None or em is None or self._stopped:
            return
        for name, value in values.items():
            track = self._tracks.get(name)
            if track is None:
                track = self._tracks[name] = sess.counter_track(name, UNITS.get(name))
            em.counter(ts, track, float(value))

    def stop(self) -> list[Path]:
        """Close every file and print the report; returns the files written.

        The step opened by the last ``step()`` is no step when nothing came into it (no batch,
        no phase: it is the time after the last step ended), so it is dropped; a step with a
        batch or a phase in it is ended here and counted. Leaving a ``with Profiler()`` block by
        an exception keeps the open step either way: it is the step that failed. The
        interpreter's exit without ``stop()`` is a ``stop()`` (a phantom last step, the
        program's tail, was counted there: the run's fastest).
        """
        return self._stop(keep_open_step=False)

    def _stop(self, keep_open_step: bool) -> list[Path]:
        global _current
        if not self._started or self._stopped:
            return list(self.files)
        try:
            self._hook("stop")  # producers first: a pending step boundary is made here
            if self._in_step and not (self._recording and not rec.ON):  # (else the session
                if keep_open_step or self._active:  # was stopped from elsewhere and ended it)
                    self._end_step(None, time.perf_counter_ns())
                else:
                    self._abandon_step()
            self._in_step = self._pending = self._quiet = False
            if self._sampler is not None:
                self.sampler_cost = self._sampler.stop()
            self._leave_window()
            if self._gpu is not None:
                self._gpu.stop()
            self._stopped = True
            if self._sess is not None:
                with contextlib.suppress(ValueError):
                    self._sess.before_stop.remove(self._session_stopping)
                if self._own_session:
                    self._sess.stop()
                elif self._summary_sink is not None:
                    self._sess.close_sink(self._summary_sink)
            if self._sess is not None and self._summary_path is not None:
                self.files.append(self._summary_path)
                self._ready([self._summary_path])
            self._hook("stopped")
        except Exception as exc:
            _warn(f"stopping the profiler failed: {exc!r}")
        finally:
            self._stopped = True
            self._recording = False
            if _current is self:
                _current = None
            atexit.unregister(self._at_exit)
        if self.options["report"]:
            try:
                text = self.summary()
                print(text.text, file=sys.stderr)
                self._printed = text.text  # a later print(prof.summary()) does not repeat it
            except Exception as exc:
                _warn(f"summary report failed: {exc!r}")
        return list(self.files)

    def __enter__(self) -> Profiler:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._stop(keep_open_step=exc_type is not None)

    def _ready(self, files: list[Path]) -> None:
        if self.on_trace_ready is None:
            return
        try:
            self.on_trace_ready(files)
        except Exception as exc:
            _warn(f"on_trace_ready failed: {exc!r}")

    # -- steps ----------------------------------------------------------------------------------
    # A step exists once step() ended it, or once it holds work (a batch, a phase) and stop()
    # ends it. Its begin is therefore written late: step() (or the first batch wait of a pending
    # step) records a placeholder with the begin's time (_Tentative), which files skip, and the
    # placeholder becomes the begin, in place, when the step gets a batch or a phase or is
    # ended. A flush may take the placeholder first (it is then simply gone); the begin is then
    # written when the step turns out to be one, at its own time, through the profiler's
    # emitter (_write_late): readers sort a track's events by time before they nest them, so it
    # encloses what the thread recorded after it, whatever a flush wrote first (detail ranges,
    # the phases of a phase object kept across steps, which record without the profiler seeing
    # them). A batch wait's begin likewise. So a step that never gets work (the tail after the
    # last step(), however long, in a detail window too; the wait for an exhausted loader, with
    # the wait itself) is in no file, table or timer figure, and a step starts where step()
    # read the clock.
    def step(self, num_samples: float | None = None, epoch: int | None = None) -> None:
        """End the step in progress (``num_samples`` in it, if known) and start the next.

        ``epoch=k`` with a new ``k`` starts epoch ``k`` (like :meth:`epoch`) for the next step.
        With no step open (``start(open_step=False)`` before the first batch or phase, or after
        ``prof.dataloader`` found its loader exhausted), the step in progress began where the
        profiler could not see it: it ends here uncounted (its number is used up, so the
        numbers still follow the program's ``step()`` calls) and the next one starts.
        """
        # (with the C buffer, _fast.install_profiler replaces this by its C twin, which runs
        # the common case and calls _step_py, _step_at and _step_write for the others)
        if not self._started or self._stopped:
            return
        if num_samples is not None and type(num_samples) is not int and type(
                num_samples) is not float:
            num_samples = _samples(num_samples)
        if epoch is not None and type(epoch) is not int:
            epoch = _epoch_number(epoch)
        self._step_ends()
        self._step_at(num_samples, epoch, time.perf_counter_ns())

    _step_py = step  # (the C step's fallback for arguments it leaves to Python)

    def _step_ends(self) -> None:
        """What a boundary does inside the step that ends, before its clock reading."""
        if self.sync_gpu:
            _sync_gpu()  # the step's device work ends inside the step
        if self.hooks:
            self._hook("step_end")  # (CUDA memory counters: inside the step that ends)

    def _step_back(self, t: int) -> None:
        """``step()`` with the boundary at ``t``, an earlier clock reading of this step: the
        step driver's, found only later (see ``pytorch/steps.py``). The steps have a track of
        their own, so what the thread recorded since moves into the next step; at now instead
        where the schedule's state changes (its window work lies between the steps)."""
        if not self._started or self._stopped:
            return
        self._step_ends()
        now = time.perf_counter_ns()
        if self._batch + 1 >= self._stable_until or not self._in_step or not t <= now:
            t = now
        self._step_at(None, None, t)

    def _step_at(self, num_samples: float | None, epoch: int | None, t: int) -> None:
        """``step()`` from the clock read at ``t`` on."""
        if epoch is not None and epoch != self._epoch or self._batch + 1 >= self._stable_until:
            if self._in_step:  # the schedule moves on: end the step before a window changes
                self._end_step(num_samples, t)
            self._step += 1
            if epoch is not None and epoch != self._epoch:
                self._epoch = epoch
                self._batch = 0
            else:
                self._batch += 1
            did = self._enter_batch()
            if did and self._recording:  # the profiler's own work lies between the steps, as
                # torch.profiler's does between its ProfilerStep ranges
                t = self._own_slice(t, did)
            with self._plock:
                self._begin_step(t)
            return
        # the common case, the schedule's state unchanged: one pass under the lock
        in_step = self._in_step
        if in_step:
            self.timer.step(num_samples, now=t)  # (which opens the next step at t)
        self._step += 1
        self._batch += 1
        if self._recording and rec.ON:
            ident = threading.get_ident() | _STEPS
            n = self._step
            begin = (_STEP_CODE0 + (n << 3) if n < _STEP_CODE_MAX
                     else rec.numbered_code(_StepBegin, n))
            # the end's code: the last step's again where epoch and num_samples are the same
            # objects (None, small ints), else looked up
            last = self._last_end
            if not in_step:
                end = 0
            elif num_samples is last[0] and self._epoch is last[1]:
                end = last[2]
            else:
                end = _step_end_code(self._epoch, num_samples)
                if end >= 0:  # (a parked blob's code is used once)
                    self._last_end = (num_samples, self._epoch, end)
            self._step_write(in_step, begin, end, t, ident, num_samples)
            if not in_step:
                self.timer.start(t)
            self._in_step, self._pending, self._active, self._quiet = True, False, False, True
        else:
            self._begin_step(t)

    def _step_write(self, in_step: bool, begin: int, end: int, t: int, ident: int,
                    num_samples: Any) -> None:
        """A step boundary's events at ``t``: the open step's begin (its placeholder, or late),
        its ``end`` (code) and the next step's placeholder (its ``begin`` tentative)."""
        with self._plock:
            tent = self._tentative
            own = self._begun_by(ident)  # (the step ends on its begin's track)
            if not in_step:
                _emit((_NULL, t, ident))
            elif tent is None and self._late_track is None:  # the begin is written
                _emit((end, t, own, _NULL, t, ident))
            elif tent is None or own != ident or not _boundary(  # a step with no phase:
                    end, t, ident, tent[0], tent[1], tent[2], _NULL, _STEP_LOOKBACK):  # its
                self._write_begin_locked()  # begin too (late: a flush took the placeholder)
                if self._late_track is not None:
                    if end < 0:  # (a parked blob's code: never recorded)
                        rec.blobs.pop(-end, None)
                    end = self._late_end(num_samples)
                _emit((end, t, own, _NULL, t, ident))
            self._tentative = (begin, t, ident)
            self._step_begin = self._late_track = None

    def epoch(self, epoch: int | None = None) -> None:
        """Start epoch ``epoch`` (default: the next one) at the step in progress, which becomes
        batch 0 of the epoch: the schedule restarts. Call it before the epoch's first batch.

        ``epoch()`` without a number while the current epoch has no completed batch is a no-op,
        so it can be called at the top of every epoch, the first included.
        """
        if not self._started or self._stopped:
            return
        if epoch is None:
            if self._batch == 0:
                return
            epoch = self._epoch + 1
        if epoch == self._epoch and self._batch == 0:
            return
        self._epoch = epoch
        self._batch = 0
        t = time.perf_counter_ns()
        did = self._enter_batch()
        if did and self._recording:  # (inside the step in progress, if one is)
            self._own_slice(t, did)

    def _own_slice(self, t: int, did: str) -> int:
        """The slice of the profiler's window work ``did`` from ``t`` to now, recorded with the
        calling thread's steps (their sequence: in time order with them, so a step that ends
        at ``t`` or begins at its end keeps its place); returns its end."""
        t1 = time.perf_counter_ns()
        if not rec.ON:
            return t1
        self._own_end = t1
        begin = rec.code(rec.event_id(S.SCHEDULE_SLICE.format(did), (S.CAT_STEPSCOPE,)),
                         S.LEVEL_SUMMARY, rec.BEGIN)
        ident = threading.get_ident() | _STEPS
        _emit((begin, t, ident, rec.END_SUMMARY, t1, ident))
        return t1

    def _begin_step(self, t: int, place: bool = True) -> None:
        """Open step ``self._step`` at ``t`` (perf_counter ns, the trace's clock), its begin
        tentative; ``place=False``: the caller records the placeholder (with ``_plock`` held
        while recording)."""
        self.timer.start(t)
        self._in_step, self._pending, self._active, self._quiet = True, False, False, True
        self._step_begin = self._late_track = None
        if self._recording and rec.ON:
            ident = threading.get_ident() | _STEPS
            self._tentative = (rec.numbered_code(_StepBegin, self._step), t, ident)
            if place:
                _emit((_NULL, t, ident))
        else:
            self._tentative = None

    def _write_begin_locked(self) -> None:
        """Write the tentative begin: in place while its placeholder is in the buffer, else
        late, with its own time (``_plock`` held)."""
        t = self._tentative
        if t is None:
            return
        self._tentative = None
        if not _replace(_NULL, t[1], t[2], t[0], _STEP_LOOKBACK):
            n = rec.numbered_number(t[0])
            if n is None:  # (a number too large for a code: a parked blob)
                b = rec.blobs.pop(-t[0], None)
                n = b.number if b is not None else self._step
            self._late_track = self._write_late(
                t[1], t[2], _StepBegin.eid, S.STEP_NAME.format(step=n), {S.ARG_STEP: n})
        self._step_begin = t

    def _write_late(self, ts: int, ident: int, eid: int, name: str | None = None,
                    args: dict | None = None) -> int:
        """Write a begin whose placeholder a flush took, at its own time ``ts``, on the thread's
        track (a step's: its steps track): through the profiler's emitter, a sequence of its own,
        since the thread's sequence may hold later events already (phases of a kept phase object,
        detail ranges), and its clock only moves forward. Trace processor (and the embedded engine)
        sort each track's events by time, file order at equal times, before they nest, so the begin
        encloses what the thread recorded after it. Returns the track: the slice's end is recorded
        in the thread's buffer, in order with its events, as an event with that explicit track (the
        thread's sequence counts only its own begins as open, and would drop an end it sees none
        for). An end at the begin's time (the previous step's) was recorded with the placeholder, so
        it is written in an earlier flush, or the same: no tie breaks wrongly. Each thread has an
        emitter of its own (a sequence's times only move forward; a thread writes its late begins in
        time order: a step's before its waits'). (``_plock`` held. The profiler's thread's track and
        emitter are known from the start: no wait for the session's lock, which a flush holds while
        it encodes.)"""
        if ident & ~_STEPS == self._thread:
            track = self._main_steps if ident & _STEPS else self._main_track
            em = self._late
        else:  # batch waits (or steps) of another thread: an emitter of its own, as a
            # sequence's times only move forward and each thread writes its late begins in
            # time order
            track = (self._sess.steps_track(ident & ~_STEPS) if ident & _STEPS
                     else self._sess.thread_track(ident))
            em = self._late_others.get(ident)
            if em is None:
                em = self._late
                if len(self._late_others) < MAX_LATE_THREADS:
                    em = self._late_others[ident] = self._sess.emitter(
                        clock="monotonic", level=S.LEVEL_SUMMARY)
        em._add(ts, 1, 0, rec.Blob(rec.BEGIN, eid, S.LEVEL_SUMMARY, track,  # noqa: SLF001
                                   args=args, name=name))
        return track

    def _late_end(self, num_samples: Any, track: int | None = None) -> int:
        """The code of the end of a slice begun by ``_write_late`` on ``track`` (default: the
        open step's, with the step end's args; else a batch wait's)."""
        args = None
        if track is None:
            track = self._late_track
            args = {S.ARG_EPOCH: self._epoch}
            if num_samples is not None:
                args[S.ARG_NUM_SAMPLES] = num_samples
        return -rec.register_blob(rec.Blob(rec.END, 0, S.LEVEL_SUMMARY, track, args=args))

    def _session_stopping(self) -> None:
        """The session stops from elsewhere (an exception, a signal, exit): the open step ends
        here, as stop() ends the step that failed (the ranges the program is inside are left
        open: "Did not end"), if its begin was written (a tentative one is no step)."""
        if self._in_step and rec.ON and (self._late_track is not None
                                         or self._tentative is None):
            # (no _plock: this may run in a signal handler on a thread that holds it; one
            # record is atomic)
            end = (self._late_end(None) if self._late_track is not None
                   else _step_end_code(self._epoch, None))
            _emit((end, time.perf_counter_ns(), self._begun_by(self._thread | _STEPS)))
            self._late_track = None
        self._leave_window()

    def _end_step(self, num_samples: float | None, t: int) -> None:
        """End the open step at ``t``: its begin is written if it was not, then its end, with
        the epoch and num_samples as args (the end is where the epoch is known for sure; trace
        processor merges them into the slice's args). The timer closes the step at the same
        ``t``, so that its batch_cost and the slice's duration are the same number.

        The end's args repeat from step to step: each (epoch, num_samples) is an event kind
        of its own, recorded by one C call and encoded once per file."""
        self.timer.step(num_samples, now=t)
        if self._recording and rec.ON:
            end = _step_end_code(self._epoch, num_samples)
            with self._plock:
                ident = self._begun_by(threading.get_ident() | _STEPS)
                self._write_begin_locked()
                if self._late_track is not None:
                    end = self._late_end(num_samples)
                    self._late_track = None
                _emit((end, t, ident))

    def _begun_by(self, ident: int) -> int:
        """The steps ident whose track holds the open step's begin (``ident``, the caller's,
        where none is known): a step ends there whichever thread ends it. (Step 0 opened by
        start() on the main thread and ended by step() on a training thread, or a step ended
        by stop() from another thread, ended on the caller's track, where it matched no begin:
        it never ended in the file, one step fewer than the timer's.)"""
        b = self._tentative if self._tentative is not None else self._step_begin
        return b[2] if b is not None else ident

    def _discard_begin_locked(self) -> bool:
        """Unrecord the open step's begin; False if a file has it already (``_plock`` held)."""
        t = self._tentative
        if t is not None:  # its placeholder stays a placeholder
            self._tentative = None
            rec.blobs.pop(-t[0], None)
            return True
        ev = self._step_begin
        if ev is None or not (self._recording and rec.ON):
            return True
        if _replace(ev[0], ev[1], ev[2], _NULL, _ALL):
            rec.blobs.pop(-ev[0], None)
            self._step_begin = None
            return True
        return False

    def _abandon_step(self) -> None:
        """The open step had no batch and no phase, and nothing more comes into it (the loader
        is exhausted, or the profiler stops): it is no step, and the next opens at the next
        batch wait, phase or ``step()``. A begin a file already has (a flush came outside a
        wait) cannot be taken back: that step is ended here, like any other."""
        with self._plock:
            gone = self._discard_begin_locked()
        if not gone:  # (the class's step(): under step_on="auto" the instance's is the
            type(self).step(self)  # program's, and a call of it turns the automatic steps off)
            with self._plock:
                self._discard_begin_locked()
        self._in_step = False
        self._pending = self._quiet = True

    def _activity(self) -> None:
        """A phase begins: its step is a step (a pending one opens now). (C twin: see step.)"""
        if not self._started or self._stopped:
            return
        with self._plock:
            if self._pending:
                self._begin_step(time.perf_counter_ns())
            self._write_begin_locked()
        self._active = True
        self._quiet = False

    _activity_py = _activity

    # -- batch waits (prof.dataloader) ------------------------------------------------------------
    def _wait_begin(self, t0: int, ident: int, main: bool) -> bool:
        """A wait for a batch starts at ``t0`` (before ``iter(loader)`` for the first batch: the
        iterator's start-up, e.g. DataLoader workers, is the first batch's reader cost). On the
        profiler's thread a pending step opens here. True if a placeholder for the wait's begin
        was recorded."""
        live = main and self._started and not self._stopped
        if not (self._recording and rec.ON):
            if live and self._pending:
                self._begin_step(t0)
            return False
        with self._plock:
            if live and self._pending:  # the step's placeholder and the wait's, as one record
                self._begin_step(t0, place=False)
                _emit((_NULL, t0, ident | _STEPS, _NULL, t0, ident))
            else:
                _emit((_NULL, t0, ident))
        return True

    def _wait_end(self, placed: bool, t0: int, t1: int, ident: int, main: bool,
                  evaluating: bool = False) -> None:
        """A batch came at ``t1`` (or the loader raised): the wait and its step are written
        (``evaluating``: a wait of an evaluation pass, in no step: ``main`` is False)."""
        if placed:
            eid, begin = (_EVAL_EID, _EVAL_BEGIN) if evaluating else (_WAIT_EID, _WAIT_BEGIN)
            with self._plock:
                tent = self._tentative if main else None
                wait_in = _replace(_NULL, t0, ident, begin, _ALL)  # the newest: the wait's
                if tent is not None:  # the step's begin first (it may be at t0 too)
                    self._write_begin_locked()
                    if wait_in and self._late_track is not None and tent[1] == t0:
                        # written late at t0, the step's begin would follow the wait's at the
                        # same time: the wait's is written late too, after it
                        _replace(begin, t0, ident, _NULL, _ALL)
                        wait_in = False
                self._end_wait_locked(t0, t1, ident, eid, wait_in)
        if main and self._in_step:
            self._active = True
            self._quiet = False

    def _wait_exhausted(self, placed: bool, t0: int, t1: int, ident: int, main: bool) -> None:
        """The loader was found exhausted at ``t1``: the open step, if that wait was all it had,
        is no step (no empty trailing step per epoch). The wait is written all the same, as
        ``dataloader.exhausted``: the time the loader took to find its end (a multi-process
        DataLoader shuts its workers down there, tens of ms) was a gap in the timeline with
        no slice, and the Overview shows it as Dataloader time outside the steps. No reader
        cost: it brought no batch."""
        if main and self._started and not self._stopped and self._in_step and not self._active:
            self._abandon_step()
        if placed:
            with self._plock:
                self._end_wait_locked(t0, t1, ident, _EXHAUSTED_EID, _replace(
                    _NULL, t0, ident, _EXHAUSTED_BEGIN, _ALL))  # the newest: the wait's

    def _end_wait_locked(self, t0: int, t1: int, ident: int, eid: int, begun: bool) -> None:
        """A wait (event ``eid``) from ``t0`` ends at ``t1``: its begin is in the buffer
        (``begun``: its placeholder turned into it), else written late, as a flush took the
        placeholder during the wait (``_plock`` held)."""
        end = rec.END_SUMMARY
        if not begun:
            end = self._late_end(None, self._write_late(t0, ident, eid))
        _emit((end, t1, ident))

    # -- schedule -------------------------------------------------------------------------------
    def _enter_batch(self) -> str | None:
        """Apply the schedule's state for the batch now starting. ``step()`` skips this until
        the batch ``_stable_until``, from which on the state or the window may change. Returns
        what it did to the windows ("window end", "window start" or both, joined by ", "), or
        None."""
        sched = self.schedule
        self._stable_until = self._batch + 1
        if sched is None or "detail" not in self.levels:
            if self._state is State.DISABLED and self._window_path is None:
                self._stable_until = NEVER
                return None
            new = State.DISABLED
            key = None
        else:
            new = sched.state(self._batch)
            key = (self._epoch, sched.window_index(self._batch))
            self._stable_until = sched.stable_until(self._batch)
        old, old_key = self._state, self._window_key
        if new is old and key == old_key:
            return None
        self._state, self._window_key = new, key
        if self._sess is None or not self._recording:
            return None
        did = []
        try:
            own = self._own_session  # a session the user started keeps its own detail setting
            if old is State.ACTIVE and (new is not State.ACTIVE or key != old_key):
                if self._window_path is not None:
                    did.append("window end")
                self._leave_window()
            elif old is State.WARMUP and not new.tracing and own:
                self._sess.set_detail(False)
                self._sess.flush(discard_detail=True)
            if new is State.WARMUP and not (old is State.WARMUP and key == old_key) and own:
                self._sess.set_detail(True)
            elif new is State.ACTIVE and self._window_path is None:
                did.append("window start")
                self._open_window()
        except Exception as exc:
            _warn(f"schedule transition failed ({exc!r}); detail tracing off")
            self.levels = tuple(lv for lv in self.levels if lv != "detail")
            self._stable_until = self._batch + 1
        return ", ".join(did) or None

    def _open_window(self) -> None:
        sess = self._sess
        if self._own_session:  # warmup's detail events are dropped here (no wait for the disk)
            sess.flush(discard_detail=True, wait=False)
        assert self.run_dir is not None
        path = self.run_dir / S.DETAIL_FILE.format(rank=self.rank, window=self._windows)
        self._windows += 1
        self._sink = sess.add_sink(path, levels=("summary", "detail"))
        self._window_path = path
        self._window_first_step = self._step
        if self._own_session:
            sess.set_detail(True)
        self._hook("window_start")  # before CUPTI: the torch profiler must not take it
        if self._gpu is not None:
            self._gpu.begin_window()

    def _leave_window(self) -> None:
        if self._window_path is None or self._sess is None:
            return
        path, sink = self._window_path, self._sink
        self._window_path = self._sink = None
        if self._gpu is not None:  # device activity of the window, into its file
            self._gpu.end_window(steps=self._step - self._window_first_step)
        self._hook("window_end")  # the window's operators, into its file
        if self._own_session:
            self._sess.set_detail(False)
        self._sess.close_sink(sink)
        if not sink.sequences:  # the window closed before anything happened in it
            with contextlib.suppress(OSError):
                os.remove(path)
            return
        self.files.append(path)
        self._ready([path])

    # -- phases and data loading ------------------------------------------------------------------
    def phase(self, name: str) -> _Phase | _NoPhase:
        """``with prof.phase("Forward"):`` — a phase slice inside the step (summary level).

        The Overview recognizes the usual names of the four step phases in any case (see
        ``stepscope._schema.PHASE_ALIASES``: forward/fwd, backward/bwd, optimizer/opt_step,
        dataloader/data, ...); any other name is an "Other phases" phase."""
        if self._quiet:
            self._activity()
        if not self._recording:
            return _NO_PHASE
        ph = (_sync_phases if self.sync_gpu else _phases).get(name)
        return ph if ph is not None else self._new_phase(name)

    _phase_py = phase

    def _new_phase(self, name: str) -> _Phase | _DynamicPhase:
        cache: dict[str, Any] = _sync_phases if self.sync_gpu else _phases
        with _phase_lock:
            ph = cache.get(name)
            if ph is None:
                if len(cache) >= MAX_CACHED_PHASES:
                    return _DynamicPhase(name)
                ph = cache[name] = _SyncPhase(name) if self.sync_gpu else _fast_phase(name)
        return ph

    def dataloader(self, loader: Iterable[T]) -> ProfiledLoader[T]:
        """``for batch in prof.dataloader(loader):`` — iterate ``loader``, timing each wait for
        the next batch (reader_cost; slice ``dataloader.next``, category ``dataloader``), the
        first one from ``iter(loader)`` on. The wrapper keeps ``len(loader)`` (progress bars
        keep their total) and passes other attributes through."""
        return ProfiledLoader(self, loader)

    def _iterate(self, loader: Iterable[T]) -> Iterator[T]:
        clock = time.perf_counter_ns
        add_reader = self.timer.add_reader
        ident = threading.get_ident()
        main = ident == self._thread
        wait_begin, wait_end = self._wait_begin, self._wait_end
        it: Iterator[T] | None = None
        while True:
            t0 = clock()
            if main and not self._pending and self._recording and rec.ON:
                with self._plock:  # the common case of _wait_begin, inline
                    _emit((_NULL, t0, ident))
                placed = True
            else:
                placed = wait_begin(t0, ident, main)
            try:
                if it is None:
                    it = iter(loader)
                batch = next(it)
            except StopIteration:
                self._wait_exhausted(placed, t0, clock(), ident, main)
                return
            except BaseException:
                wait_end(placed, t0, clock(), ident, main)
                raise
            t1 = clock()
            add_reader(t1 - t0)
            wait_end(placed, t0, t1, ident, main)
            yield batch

    # -- reports --------------------------------------------------------------------------------
    def timer_stats(self) -> TimerStats:
        """reader_cost / batch_cost / ips figures of the completed steps (any mode)."""
        return self.timer.stats()

    def summary(self, **report_options: Any) -> Report:
        """The end-of-run report: step timer, sampler cost, and the analysis summary tables of
        the summary trace (after ``stop()``, when the analysis package can open it);
        ``report_options`` go to ``stepscope.analysis.summaries.report`` (unit, fmt, names...).

        A :class:`Report`: the text itself, or one line (``.text``: the text) when ``stop()``
        has already printed that same report (``report=True``), so it is shown once."""
        if self._printed is not None and not report_options:  # stop() printed it: as it was
            return Report(self._printed, self._printed)
        return Report(self._summary_text(**report_options), self._printed)

    def _summary_text(self, **report_options: Any) -> str:
        parts = [self.timer.stats().format()]
        if self.timer.steps == 0:
            parts.append(NO_STEPS_HINT)
        if self.sampler_cost is not None:
            parts.append(self.sampler_cost.format())
        if self.files:
            parts.append("stepscope files:\n" + "\n".join(f"  {p}" for p in self.files))
        path = self._summary_path
        if self._stopped and path is not None and path.exists():
            detail = [str(f) for f in self.files if f != path and f.exists()]
            if report_options:
                parts.append(_analysis_report(path, detail, **report_options))
            else:
                if self.report_text is None:
                    self.report_text = _analysis_report(path, detail)
                if self.report_text:
                    parts.append(self.report_text)
        return "\n".join(parts)


def _install_c_methods() -> None:
    """With the C buffer, ``step``, ``_activity`` and ``phase`` are its C twins (the common case
    of every step without a Python frame; see ``_fast.install_profiler``), whose other cases call
    the Python methods kept as ``_step_py``/``_step_at``/``_step_write``, ``_activity_py`` and
    ``_new_phase``. The docstrings and signatures stay those of the Python methods."""
    sigs = (("step", ", num_samples=None, epoch=None"), ("_activity", ""), ("phase", ", name"))
    docs = tuple(f"{name}($self, /{sig})\n--\n\n{getattr(Profiler, name).__doc__}"
                 for name, sig in sigs)
    rec.fast.install_profiler(Profiler, {  # type: ignore[union-attr]
        "no_phase": _NO_PHASE, "phases": _phases, "sync_phases": _sync_phases,
        "begin_code": functools.partial(rec.numbered_code, _StepBegin),
        "end_code": _step_end_code, "code0": _STEP_CODE0, "code_max": _STEP_CODE_MAX,
        "null_code": _NULL, "lookback": _STEP_LOOKBACK, "globals": globals(), "time": time,
    }, docs)


if rec.fast is not None:
    _install_c_methods()


class Report(str):
    """The profiler's report, a ``str`` whose value is what printing it shows; ``.text`` holds
    the whole report.

    ``print(prof.summary())`` after ``stop()`` printed the report (``Profiler(report=True)``,
    the default) would show it twice: such a report's value (``str()``, f-strings, ``len``,
    ``write``, concatenation alike) is one line saying where it was printed, and its ``.text``
    is the text stop() printed (kept, not recomputed). Any other report (``report=False``,
    other options, before ``stop()``) is its whole text."""

    text: str
    printed_at_stop: bool

    def __new__(cls, text: str, printed: str | None = None) -> Report:
        at_stop = printed is not None and printed == text
        self = super().__new__(cls, _PRINTED_NOTE if at_stop else text)
        self.text = text
        self.printed_at_stop = at_stop
        return self


_PRINTED_NOTE = ("stepscope: the report was printed at stop() (on stderr); "
                 "prof.summary().text holds it, Profiler(report=False) leaves it to you")


def _analysis_report(path: Path | str, detail: list[str] | None = None, **options: Any) -> str:
    """``stepscope.analysis.summaries.report`` of the summary file, the ``detail`` windows
    adding their operators, kernels and copies; or a note why there is none."""
    try:
        from .. import analysis
        from ..analysis import summaries

        opener = getattr(analysis, "open", None)
        if opener is None:
            return ""
        db = opener(str(path))
        ddb = opener(detail) if detail else None
        try:
            return summaries.report(db, detail_db=ddb, detail_files=len(detail or ()),
                                    **options)
        finally:
            for d in (db, ddb):
                close = getattr(d, "close", None)
                if callable(close):
                    close()
    except Exception as exc:
        return f"(summary tables unavailable: {exc!r})"


# -- module-level helpers (exported from stepscope) ---------------------------------------------
def step(num_samples: float | None = None, epoch: int | None = None) -> None:
    """``stepscope.step()``: end the running profiler's step (no-op without one)."""
    p = _current
    if p is not None:
        p.step(num_samples, epoch)


def epoch(epoch: int | None = None) -> None:
    """``stepscope.epoch()``: start a new epoch on the running profiler (no-op without one)."""
    p = _current
    if p is not None:
        p.epoch(epoch)


def phase(name: str) -> _Phase | _NoPhase:
    """``with stepscope.phase("Forward"):`` on the running profiler (no-op without one)."""
    p = _current
    return p.phase(name) if p is not None else _NO_PHASE


def dataloader(loader: Iterable[T]) -> Iterable[T]:
    """``for b in stepscope.dataloader(loader):`` on the running profiler (plain without one)."""
    p = _current
    return p.dataloader(loader) if p is not None else loader


class ProfiledLoader(Generic[T]):
    """What ``prof.dataloader(loader)`` returns: iterating it times each wait for a batch;
    ``len()`` and other attributes are the loader's. Each ``iter()`` starts a new pass over the
    loader (``next()`` on the wrapper itself also works, as on the generator it once was)."""

    __slots__ = ("loader", "_prof", "_it")

    def __init__(self, prof: Profiler, loader: Iterable[T]) -> None:
        self.loader = loader
        self._prof = prof
        self._it: Iterator[T] | None = None

    def __iter__(self) -> Iterator[T]:
        if self._it is not None:  # next() was called on the wrapper: go on from there, once
            it, self._it = self._it, None  # (a later iter() starts a new pass)
            return it
        return self._prof._iterate(self.loader)  # noqa: SLF001

    def __next__(self) -> T:
        if self._it is None:
            self._it = self._prof._iterate(self.loader)  # noqa: SLF001
        return next(self._it)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  # TypeError without one, as len() says

    def __getattr__(self, name: str) -> Any:
        if name in ProfiledLoader.__slots__:  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        return f"<stepscope.ProfiledLoader of {self.loader!r}>"

