"""``record_function`` and ``torch.cuda.nvtx`` ranges as stepscope ranges (summary level).

Like :func:`stepscope.capture_nvtx` for the ``nvtx`` package: the Python entry points are
replaced by wrappers that call torch's original and record the same range:

* ``torch.autograd.profiler.record_function`` (also ``torch.profiler.record_function``, the same
  class): its ``__enter__``/``__exit__`` are patched on the class, so instances made before, the
  decorator form and ``from torch.profiler import record_function`` are all seen. torch's own
  ranges go through it too: ``Optimizer.step#SGD.step``,
  ``enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__``,
  ``DistributedDataParallel.forward``. Category ``record_function``.
* ``torch.cuda.nvtx.range_push``/``range_pop`` (and ``torch.cuda.nvtx.range``, which calls
  them) and ``mark``: category ``nvtx``, as captured ``nvtx`` calls. ``range_start``/``range_end``
  (ranges that may end on another thread) become ``stepscope.start_range``/``end_range``
  async ranges, which are detail level like every ``start_range``.

Summary level, so they are in the summary file too, and cheap: with the C buffer the wrappers
are ``_fast.ContextHook`` objects (torch's method, then a cached C chain per name for the begin
and one C call for the end, no Python frame of ours), their uncommon cases the Python
``enter_rest``/``exit_rest`` below. Counted by cachegrind (torch 2.14, CPU): a
``record_function`` enter+exit is about 50,000 instructions untraced (torch's own); the
capture adds about 3,100, the writer's encoding and compression of its two events included
(6,900 through Python wrappers); callgrind: about 1,200 of them on the program's thread (1,800
when the open range was marked with an attribute on torch's object).
On the profiler's thread a range is work of the step (like a phase): a step whose begin the
profiler has not written yet (a pending step 0, or one just opened by a step boundary) is
written first, so the range nests in it whatever the writer flushed in between. A
``record_function`` that begins inside a batch wait there (torch's own
``enumerate(DataLoader)#...`` range of every ``next()``) is not recorded: the wait's
``dataloader.next`` slice covers it, and its begins are written only once the batch comes. A
detail window's operators leave torch's copy of such a range out as well.
Ranges whose end torch defers to a future (``_call_end_callbacks_on_future``) end here at
``__exit__``. Limits: C++ ``RECORD_FUNCTION`` scopes are not seen here (they are operators,
see :mod:`.operators`); TorchScript-compiled ``record_function`` neither.
"""

from __future__ import annotations

import threading
from typing import Any

from .. import _schema as S
from ..record import recorder as rec

MAX_CACHED_NAMES = 4096  # past this, names are written inline (f"batch {i}" must not grow tables)

_chains: dict[tuple[str, str], Any] = {}
_lock = threading.Lock()


def _begin(name: Any, category: str) -> None:
    key = (name, category)
    try:
        c = _chains.get(key)
    except TypeError:
        name = rec.clean_name(name)
        key = (name, category)
        c = _chains.get(key)
    if c is None:
        if len(_chains) >= MAX_CACHED_NAMES:
            rec.record_named(rec.BEGIN, name, (category,), S.LEVEL_SUMMARY)
            return
        with _lock:
            c = _chains.get(key)
            if c is None:
                eid = rec.event_id(name, (category,))
                c = _chains[key] = rec.chain(rec.code(eid, S.LEVEL_SUMMARY, rec.BEGIN))
    c()


_end = rec.end_summary
_rf_chains: dict[str, Any] = {}  # record_function name -> its begin chain (None: not cached)
# record_function names begun inside a batch wait, so not recorded (torch's enumerate(DataLoader)
# range of every next(): the wait's own slice covers it)
_in_wait: set[str] = set()


def recorded_names() -> set:
    """Names of the ``record_function`` ranges the summary level has already (cached ones),
    or covers with a batch wait's slice: a window's operators leave torch's copies out."""
    return {name for name, cat in list(_chains) if cat == S.CAT_RECORD_FUNCTION} | _in_wait


# the name torch gives every optimizer's zero_grad() range ("Optimizer.zero_grad#SGD.zero_grad")
IDLE_RANGE_PREFIX = "Optimizer.zero_grad#"
# ... and every optimizer's step() range ("Optimizer.step#SGD.step")
OPTIMIZER_STEP_PREFIX = "Optimizer.step#"

# at most this many record_function objects open at once (entered and not exited: a program
# may enter one and drop it), else no new range begins (the C hooks get it too)
MAX_OPEN = 1024


def _take_open(opened: list[Any], obj: Any) -> bool:
    """obj's last entry out of ``opened``; False where it has none (the Python twin of the C
    hook's ``take_open``)."""
    for i in range(len(opened) - 1, -1, -1):
        if opened[i] is obj:
            del opened[i]
            return True
    return False


class _RangeIds:
    """nvtx range_start ids -> stepscope async handles (range_end may come from any thread)."""

    def __init__(self) -> None:
        self.open: dict[int, Any] = {}


def _step_gate(capture: RangeCapture) -> Any:
    """``gate()`` before a range begins: False inside a batch wait on the profiler's thread
    (``capture.waiting``, kept by the step driver's DataLoader patch: not recorded); else True,
    the step's begin written first if it was not (see above)."""
    prof = capture.prof
    main, get_ident = prof._thread, threading.get_ident  # noqa: SLF001

    def gate() -> bool:
        if (prof._quiet or capture.waiting) and get_ident() == main:  # noqa: SLF001
            if capture.waiting:  # (the step's and the wait's begins are placeholders there)
                return False
            prof._activity()  # noqa: SLF001
        return True

    return gate


# with the C buffer, the two flags the C hooks read on every range are struct fields of a C base
_Flags: Any = rec.fast.CaptureFlags if rec.fast is not None else object


class RangeCapture(_Flags):
    """Installs the wrappers at ``start()`` and puts torch's originals back at ``stop()``;
    ``prof``: the profiler whose steps the ranges nest in."""

    def __init__(self, prof: Any) -> None:
        self.prof = prof
        self.waiting = False  # the profiler's thread is inside a DataLoader next() (steps.py)
        # a range whose name starts so does not make a quiet step a step: torch's
        # "Optimizer.zero_grad#" after an optimizer step, in a loop without a DataLoader, is
        # no work of the step that opens there, so the last one leaves no step of its own
        self.idle_prefix = IDLE_RANGE_PREFIX
        self._patched: list[tuple[Any, str, Any]] = []
        self._ids = _RangeIds()
        # the record_function objects whose range is open, in the order they were entered
        # (see _fast.c, ContextHook, and _take_open)
        self.opened: list[Any] = []
        self.installed = False

    def idle(self, name: Any) -> bool:
        """A range so named is no work of the step it falls in (see ``idle_prefix``; the C
        hook's twin is _fast.c's idle_range)."""
        prefix = self.idle_prefix
        return type(name) is str and type(prefix) is str and name.startswith(prefix)

    def start(self) -> None:
        import torch.autograd.profiler as ap

        rf = ap.record_function
        o_enter, o_exit = rf.__enter__, rf.__exit__
        cat = S.CAT_RECORD_FUNCTION
        capture = self

        by_name = _rf_chains
        recorder = rec
        prof = self.prof
        main, get_ident = prof._thread, threading.get_ident  # noqa: SLF001
        opened = self.opened

        def enter_rest(self: Any) -> None:
            """After torch's ``__enter__``, while recording: the step gate, then the begin."""
            name = self.name
            if len(opened) >= MAX_OPEN:
                return  # (objects entered and never exited: see _fast.c, ContextHook)
            # the step gate (see _step_gate), inlined (the C hook checks it first: this runs
            # for the ranges it leaves to Python, and for every range without the C buffer)
            if (prof._quiet or capture.waiting) and get_ident() == main:  # noqa: SLF001
                if capture.waiting:
                    if len(_in_wait) < MAX_CACHED_NAMES and type(name) is str:
                        _in_wait.add(name)
                    return
                if not capture.idle(name):
                    prof._activity()  # noqa: SLF001
            c = by_name.get(name) if type(name) is str else None
            if c is not None:
                c()
            else:
                _begin(name, cat)
                if len(by_name) < MAX_CACHED_NAMES and type(name) is str:
                    by_name[name] = _chains.get((name, cat))
            opened.append(self)

        if recorder.fast is not None:  # the common case of both in C (_fast.ContextHook)
            hook = recorder.fast.ContextHook
            args = (prof, capture, by_name, _end, main, opened, MAX_OPEN)
            __enter__ = hook(0, o_enter, enter_rest, *args)
            __exit__ = hook(1, o_exit, recorder.noop, *args)  # (its rest is never called)
        else:
            def __enter__(self: Any) -> Any:
                result = o_enter(self)
                if recorder.ON:
                    enter_rest(self)
                return result

            def __exit__(self: Any, *exc: Any) -> Any:
                try:
                    return o_exit(self, *exc)
                finally:
                    if _take_open(opened, self) and recorder.ON:
                        _end()

        self._patch(rf, "__enter__", __enter__)
        self._patch(rf, "__exit__", __exit__)
        self._patch_nvtx()
        self.installed = True

    def _patch_nvtx(self) -> None:
        try:
            import torch.cuda.nvtx as nv
        except Exception:
            return
        o_push, o_pop = nv.range_push, nv.range_pop
        o_start, o_end, o_mark = nv.range_start, nv.range_end, nv.mark
        cat = S.CAT_NVTX
        ids = self._ids
        gate = _step_gate(self)

        def range_push(msg: Any) -> Any:
            result = o_push(msg)  # raises where torch has no NVTX: nothing recorded then
            if rec.ON:
                gate()  # (recorded even inside a wait: its range_pop must find it)
                _begin(msg, cat)
            return result

        def range_pop() -> Any:
            result = o_pop()
            if rec.ON:
                _end()
            return result

        def range_start(msg: Any) -> Any:
            rid = o_start(msg)
            if rec.ON:
                import stepscope

                ids.open[rid] = stepscope.start_range(msg, domain=cat)
            return rid

        def range_end(range_id: Any) -> None:
            o_end(range_id)
            handle = ids.open.pop(range_id, None)
            if handle is not None:
                import stepscope

                stepscope.end_range(handle)

        def mark(msg: Any) -> Any:
            result = o_mark(msg)
            if rec.ON:
                rec.record_named(rec.INSTANT, msg, (cat,), S.LEVEL_SUMMARY)
            return result

        for name, fn in (("range_push", range_push), ("range_pop", range_pop),
                         ("range_start", range_start), ("range_end", range_end),
                         ("mark", mark)):
            fn.__wrapped__ = getattr(nv, name)  # type: ignore[attr-defined]
            fn.__doc__ = getattr(nv, name).__doc__
            self._patch(nv, name, fn)

    def _patch(self, owner: Any, name: str, fn: Any) -> None:
        self._patched.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, fn)

    def stop(self) -> None:
        self.installed = False
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()
        self.opened.clear()  # (their exits, after this, end nothing)
