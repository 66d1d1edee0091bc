"""Stub of ``stepscope._fast`` (``_fast.c``): the hot recording path in C.

The pure-Python twin is ``record/recorder.py``; ``_ext.load("stepscope._fast")`` picks one. Events
are (code, ts, thread ident) triples of int64 in one process-wide buffer.
"""

from collections.abc import Callable, Iterable
from typing import Any

# the code of a thread mark (THREAD_MARK, native thread id, ident), written before each OS
# thread's first event of a recording (``_recorder.THREAD``; a build without it is stale)
THREAD_MARK: int
# ident | STEPS_IDENT: a thread's step events, a sequence and a track of their own
# (``_recorder.STEPS``; a build without it is stale)
STEPS_IDENT: int

# the protobuf tags it writes itself, from ``_wire_tags.h`` (generated from ``format/wire.py``)
TAG_TRACE_PACKET: int
TAG_PACKET_TIMESTAMP: int

class Emit:
    """``Emit(code)(*ignored)``: record (code, now, thread ident); returns None."""

    def __init__(self, code: int) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> None: ...
    @property
    def code(self) -> int: ...

class ProfilerCore:
    """The profiler's per-step state (the base of ``profiler.Profiler``); ``install_profiler``
    puts its C ``step``, ``_activity`` and ``phase`` on the class."""

    _started: Any
    _stopped: Any
    sync_gpu: Any
    hooks: Any
    _epoch: Any
    _batch: Any
    _stable_until: Any
    _in_step: Any
    timer: Any
    _step: Any
    _recording: Any
    _last_end: Any
    _plock: Any
    _tentative: Any
    _late_track: Any
    _step_begin: Any
    _pending: Any
    _active: Any
    _quiet: Any

class StepCounters:
    """The step timer's running figures (``profiler.timer.StepTimer`` derives from it)."""

    _reader: int
    @property
    def _t0(self) -> int | None: ...
    @property
    def steps(self) -> int: ...
    @property
    def _b_sum(self) -> int: ...
    @property
    def _b_max(self) -> int: ...
    @property
    def _b_min(self) -> int | float: ...
    @property
    def _r_sum(self) -> int: ...
    @property
    def _r_max(self) -> int: ...
    @property
    def _r_min(self) -> int | float: ...
    @property
    def _s_sum(self) -> float: ...
    @property
    def _s_time(self) -> int: ...
    @property
    def _s_max(self) -> float: ...
    @property
    def _s_min(self) -> float: ...
    def start(self, now: int | None = None) -> None: ...
    def step(self, num_samples: float | None = None, now: int | None = None) -> None: ...
    def add_reader(self, ns: int, /) -> None: ...
    def reset(self) -> None: ...

class Range:
    """``Range(code)``: a context manager recording a begin and an end on this thread."""

    code: int
    def __init__(self, code: int) -> None: ...
    def __enter__(self) -> Range: ...
    def __exit__(self, *exc: object) -> None: ...

class Decorated:
    """``Decorated(func, slow, code)``: ``func`` wrapped in a range (``slow`` is called instead
    while recording is delegated to Python)."""

    def __init__(self, func: Callable[..., Any], slow: Callable[..., Any], code: int) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __get__(self, obj: object, objtype: type | None = None) -> Any: ...
    @property
    def func(self) -> Callable[..., Any]: ...

class CaptureFlags:
    """The range capture's flags the ``ContextHook`` reads as struct fields (the base of
    ``pytorch.ranges.RangeCapture``)."""

    waiting: Any
    idle_prefix: Any  # where a str: a range so named does not open a quiet step (no _activity)

class ContextHook:
    """``ContextHook(which, original, rest, prof, capture, by_name, end, main, opened,
    max_open)``: a class's ``__enter__`` (``which`` 0) or ``__exit__`` (1) that calls
    ``original`` and then records the range's begin or end (``pytorch/ranges.py``; the begins
    of other cases go to ``rest``; ``__exit__`` never calls it). ``opened``: the objects whose
    range is open, shared by the pair."""

    def __init__(self, which: int, original: Callable[..., Any], rest: Callable[[Any], Any],
                 prof: Any, capture: Any, by_name: dict[str, Any], end: Callable[[], Any],
                 main: int, opened: list[Any], max_open: int, /) -> None: ...
    def __call__(self, obj: Any, *exc: Any) -> Any: ...
    def __get__(self, obj: object, objtype: type | None = None) -> Any: ...
    @property
    def __wrapped__(self) -> Callable[..., Any]: ...

def extend(triples: Iterable[int]) -> None:
    """Append whole (code, ts, ident) triples."""

def drain() -> bytes:
    """Take all recorded events as native int64 bytes."""

def size() -> int:
    """int64 words recorded and not yet drained (3 per event)."""

def lost() -> int:
    """Events not stored for lack of memory."""

def clear() -> None:
    """Forget everything recorded."""

def thread_last_ts() -> int:
    """The latest timestamp the calling thread recorded (0: none): a time read earlier and
    given for an event now must not precede it (each thread's events stay in time order)."""

def summary_depth() -> int:
    """The summary ranges open on the calling thread, as its ``Emit`` calls began and ended
    them (an end with none counted leaves 0)."""

def summary_low() -> int:
    """The lowest ``summary_depth`` of the calling thread since its last ``mark_low`` (or
    ``at_top`` call): the level of the loop, whose spanning ranges stay open across steps."""

def mark_low() -> None:
    """Start ``summary_low`` again at the calling thread's ``summary_depth`` (a boundary)."""

def at_top(fn: Callable[[], Any] | None, base: int = 0, /) -> Callable[[], Any] | None:
    """Call ``fn`` (once) after the ``Emit`` end that brings the calling thread's
    ``summary_depth`` down to ``base`` (0: closes its outermost summary range), and start
    ``summary_low`` again there; an Exception it raises is one line on stderr. None: no call.
    Returns the call it replaces, if that was still to come."""

def before_top(fn: Callable[[int], Any] | None, base: int = 0, /) -> Callable[[int], Any] | None:
    """Call ``fn(code)`` before each ``Emit`` begin (of that code) made with ``base`` summary
    ranges open on the calling thread (0: none), until it returns True; an Exception it raises
    is one line on stderr. None: no call. Returns the call it replaces."""

def reset_depth() -> None:
    """Every thread's ``summary_depth`` and ``summary_low`` to 0 (at its next ``Emit``); the
    calls of ``at_top`` and ``before_top`` dropped."""

def withdraw(code: int, ts: int, ident: int, null_code: int, lookback: int, /) -> bool:
    """Turn the recorded event (code, ts, ident) into ``null_code``, searching the last
    ``lookback`` events; True if found."""

def set_recording(on: bool, /) -> None:
    """``recorder.ON`` (set by ``recorder.set_state``), read by the profiler's C methods."""
def set_mode(mode: int, /) -> None:
    """0 off, 1 record, 2 delegate (to the Python callables given to ``configure``)."""

def configure(end_code: int, by_message: dict[Any, Range], push_codes: dict[Any, int],
              annotate_slow: Callable[..., Any], push_slow: Callable[..., Any],
              pop_slow: Callable[..., Any], /) -> None: ...
def assemble(deltas: Any, tidx: Any, templates: list[bytes], /) -> bytes:
    """Trace.packet entries (see ``_encoder.assemble``); deltas and tidx: int64 buffers."""

def numbered_event(te_tag: bytes, head: bytes, name_tag: bytes, prefix: str, suffix: str,
                   da_tag: bytes, da_head: bytes, n: int, /) -> bytes: ...
def numbered_events(te_tag: bytes, head: bytes, name_tag: bytes, prefix: str, suffix: str,
                    da_tag: bytes, da_head: bytes, pkt_prefix: bytes, numbers: Any, /
                    ) -> list[bytes]:
    """``pkt_prefix + numbered_event(..., n)`` for each int64 ``n`` of the buffer ``numbers``."""
def step_boundary(end: int, ts: int, ident: int, begin: int, begin_ts: int, begin_ident: int,
                  null_code: int, lookback: int, /) -> bool:
    """The placeholder (null_code, begin_ts, begin_ident) in the last ``lookback`` events
    becomes ``begin``, then (end, ts, ident) and (null_code, ts, ident) are appended; False,
    with nothing changed, if the placeholder is gone."""
def install_profiler(cls: type, config: dict[str, Any], docs: tuple[str, str, str], /) -> None:
    """Set ``cls.step``, ``cls._activity`` and ``cls.phase`` (profiler.Profiler) to their C
    twins, with ``docs`` as their docstrings; ``config``: the objects and codes they use (see
    ``profiler._install_c_methods``)."""
def annotate(message: Any = None, color: Any = None, domain: Any = None,
             category: Any = None, payload: Any = None, **args: Any) -> Any:
    """A range, as ``with annotate("x"):`` or ``@annotate("x")`` / ``@annotate``."""

def push_range(message: Any = None, color: Any = None, domain: Any = None,
               category: Any = None, payload: Any = None) -> None:
    """Open a range on this thread; close it with ``pop_range``."""

def pop_range(domain: Any = None) -> None:
    """Close the innermost range opened by ``push_range``."""

def noop(*args: Any, **kwargs: Any) -> None:
    """Does nothing, as cheaply as a C call can."""
