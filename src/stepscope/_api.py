"""The public instrumentation API, with the ``nvtx`` package's names and semantics.

Fast path: ``annotate("x")`` returns a range object cached per message. With the C extension
(``_fast``), ``annotate``, ``push_range``, ``pop_range``, the cached ranges and decorated
functions are C objects that read one global mode (off / record / delegate to the Python path
here, e.g. to forward to NVTX), so a range runs no Python frame at all. Without it, a cached
range's class gets a C-composed ``__enter__`` (see ``_recorder.chain``) and a small Python
``__exit__``, both swapped for a C no-op while recording is off.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from . import _nvtx
from ._schema import LEVEL_DETAIL
from .core import hooks
from .core import session as _session
from .record import recorder as rec
from .record.args import PLAIN, snapshot
from .record.rebind import Rebound
from .record.recorder import BEGIN, END, INSTANT, Blob, code, event_id, warn_once

MAX_CACHED_RANGES = 4096

_on = False  # detail-level recording (what user ranges need)
_forward = False  # also send ranges to NVTX


class _Range:
    """A user range: context manager and decorator. Begins/ends on the calling thread.
    ``message`` is what the user gave (None when nothing: a decorator then names the function),
    ``name`` what the slice is called."""

    __slots__ = ("message", "name", "color", "domain", "category", "payload", "args", "begin")

    def __call__(self, func: Callable) -> Callable:
        return _decorate(func, self.message, self.color, self.domain, self.category,
                         self.payload, self.args)

    def _enter_forwarding(self):
        self.begin()
        _nvtx.forward_push(self.name, self.color, self.domain, self.category)

    def _exit(self, exc_type, exc, tb, _end=rec.end_detail):
        _end()

    def _exit_forwarding(self, exc_type, exc, tb):
        rec.end_detail()
        _nvtx.forward_pop(self.domain)

    __enter__ = __exit__ = rec.noop  # switched by _bind_class


if rec.fast is not None:
    class _CRange(rec.fast.Range):
        """A cached range in C: ``__enter__``/``__exit__`` record, do nothing, or delegate to
        ``_enter_slow``/``_exit_slow`` (forwarding), as the global mode says."""

        __slots__ = ("message", "name", "color", "domain", "category", "payload", "args",
                     "begin")
        __call__ = _Range.__call__

        def _enter_slow(self):  # mode "delegate": detail recording and forwarding are on
            _Range._enter_forwarding(self)

        def _exit_slow(self):
            _Range._exit_forwarding(self, None, None, None)


# cached ranges, rebound when recording turns on or off (pure-Python recorder only: the C
# objects read one mode); (message, domain, category) -> _CRange, or a _Range subclass
_cached = Rebound(lambda r, on, detail: type(r) is _SlowRange or _bind_class(type(r), r.begin))
_ranges: dict = _cached.objects
_by_message: dict = {}  # message -> _Range with no domain/category (the fast lookup)
_lock = _cached.lock


def _categories(domain, category) -> tuple[str, ...]:
    if domain is None and category is None:  # (the common case, per range with args or mark)
        return ()
    cats = []
    if domain is not None:
        cats.append(_domain_name(domain))
    if category is not None:
        cats.append(rec.clean_text(category, "category"))
    return tuple(cats)


def _domain_name(domain) -> str:
    """A domain's name (an nvtx Domain's ``.name``, else its str); never raises."""
    if type(domain) is str:
        return domain
    try:
        domain = getattr(domain, "name", domain)
    except Exception:  # a broken property: its str() then
        pass
    return rec.clean_text(domain, "domain")


def _kwargs(args: dict) -> dict:
    """Keyword args as meant: ``args={...}`` alone means those args, ``args=None`` none (not an
    arg named "args")."""
    if "args" in args:
        v = args["args"]
        if v is None:
            return {k: x for k, x in args.items() if k != "args"}
        if isinstance(v, dict) and len(args) == 1:
            return v
    return args


def _args_data(payload, args) -> dict | None:
    """The typed args of a range (keyword args as _kwargs gives them), plus ``payload``; None
    when there are none. Taken now (``snapshot``, values not plain): the writer encodes them
    later, and must write them as they are at the call, without running the program's code."""
    data = ({str(k): v if type(v) in PLAIN else snapshot(v) for k, v in args.items()}
            if args else {})
    if payload is not None:
        data["payload"] = payload if type(payload) in PLAIN else snapshot(payload)
    return data or None


def _make_range(message, color, domain, category, payload, args, fast=False) -> Any:
    """``fast`` (cached ranges only): a C ``_CRange`` reading the global mode, or without the
    extension a class of its own whose enter/exit ``_on_state`` rebinds; otherwise a
    ``_SlowRange``, which checks the state on every call."""
    name = _name(message)
    cats = _categories(domain, category)
    if fast and rec.fast is not None:
        begin_code = code(event_id(name, cats), LEVEL_DETAIL, BEGIN)
        r = _CRange(begin_code)
        r.begin = rec.chain(begin_code)
    elif fast:
        cls = type("annotate", (_Range,), {"__slots__": ()})
        r = cls()
        r.begin = rec.chain(code(event_id(name, cats), LEVEL_DETAIL, BEGIN))
        _bind_class(cls, r.begin)
    else:  # by name: interned while the table has room, else written inline
        r = _SlowRange()
        data = _args_data(payload, args)
        r.begin = functools.partial(rec.record_named, BEGIN, name, cats, LEVEL_DETAIL, data)
        payload, args = None, data  # as the call gave them (payload among them), for __call__
    r.message, r.name, r.color, r.domain, r.category = message, name, color, domain, category
    r.payload, r.args = payload, args
    return r


class _SlowRange(_Range):
    """A range with arguments or a payload, or one of too many names to cache: checks the state
    on every call (a Python frame on enter)."""

    __slots__ = ()

    def __enter__(self):
        if _on:
            self.begin()
            if _forward:
                _nvtx.forward_push(self.name, self.color, self.domain, self.category)
        return self

    def __exit__(self, exc_type, exc, tb):
        if _on:
            rec.end_detail()
            if _forward:
                _nvtx.forward_pop(self.domain)


def _bind_class(cls: type, begin) -> None:
    """Set a fast range class's enter/exit for the current recording state."""
    if not _on:
        cls.__enter__ = cls.__exit__ = rec.noop
    elif _forward:
        cls.__enter__, cls.__exit__ = _Range._enter_forwarding, _Range._exit_forwarding
    else:
        # staticmethod: a partial (the pure-Python chain) binds like a method from Python 3.14
        cls.__enter__, cls.__exit__ = staticmethod(begin), _Range._exit


def _on_state(on: bool, detail: bool) -> None:
    global _on
    _on = detail
    if rec.fast is not None:  # the C objects read one mode; nothing to rebind
        rec.fast.set_mode(0 if not detail else 2 if _forward else 1)
        return
    _cached.rebind(on, detail)


rec.on_state_change(_on_state)


def annotate(message: Any = None, color: Any = None, domain: Any = None, category: Any = None,
             payload: Any = None, **args: Any):
    """A range, as ``with annotate("x"):`` or ``@annotate("x")`` / ``@annotate``.

    ``domain`` becomes the slice's category (``domain,category`` when both are given), keyword
    arguments become typed args (``debug.<name>``), ``payload`` the arg ``debug.payload``; ``color``
    is passed to NVTX when forwarding. As a decorator the message defaults to the function's
    qualified name, and the source location is the function's definition. Two keywords are
    options, not args (both need CuPy): ``gpu=True`` also times the range on the GPU with CUDA
    events, without waiting; ``sync_gpu=True`` ends the range once the current stream has
    finished, so that it includes its GPU work (costs the CPU/GPU overlap).
    """
    if color is None and domain is None and category is None and payload is None and not args:
        try:
            return _by_message[message]
        except (KeyError, TypeError):
            pass
    return _annotate_slow(message, color, domain, category, payload, args)


_annotate_py = annotate


class _Wrapping:
    """A range around the host range; as a decorator, it wraps the function in itself."""

    __slots__ = ("host",)

    def __call__(self, func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(*a, **k):
            with self:
                return func(*a, **k)
        return wrapper


class _GpuRange(_Wrapping):
    """``annotate(..., gpu=True)``: the host range plus a GPU-side range timed with CUDA events
    on the current CuPy stream (resolved later, without synchronizing; see gpu/cupy_timing)."""

    __slots__ = ("name",)

    def __init__(self, host: Any, name: str):
        self.host, self.name = host, name

    def __enter__(self):
        self.host.__enter__()
        sess = _session.current()
        timer = sess.gpu_timer() if _on and sess is not None else None
        if timer is not None:
            timer.push(self.name)
        return self

    def __exit__(self, exc_type, exc, tb):
        sess = _session.current()
        timer = sess._gpu_timer if sess is not None else None  # noqa: SLF001
        if timer is not None:
            timer.pop()
        return self.host.__exit__(exc_type, exc, tb)


class _SyncRange(_Wrapping):
    """``annotate(..., sync_gpu=True)`` (CNTK's profilerSyncGpu): the range ends once the current
    CuPy stream has finished, so it includes the GPU work it launched. Costs the CPU/GPU overlap
    at every range end: for attribution runs, not for measuring throughput."""

    __slots__ = ()

    def __init__(self, host: Any):
        self.host = host

    def __enter__(self):
        self.host.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        if _on:
            hooks.sync_gpu()  # registered by stepscope.gpu
        return self.host.__exit__(exc_type, exc, tb)


def _annotate_slow(message, color, domain, category, payload, args):
    gpu = sync = False
    if "gpu" in args or "sync_gpu" in args:  # options, not args of the slice
        args = dict(args)
        gpu = args.pop("gpu", False)  # also time the range on the GPU
        sync = args.pop("sync_gpu", False)  # end the range once its GPU work has finished
    args = _kwargs(args)  # once, options taken out (args={...} alone is then those args)
    host = _host_range(message, color, domain, category, payload, args)
    if sync and "cupy" not in sys.modules:
        warn_once("sync_gpu", "annotate(sync_gpu=True) needs CuPy; the range is not synchronized")
    elif sync and hasattr(host, "__enter__"):
        host = _SyncRange(host)
    if not gpu:
        return host
    if "cupy" not in sys.modules:
        warn_once("gpu_range", "annotate(gpu=True) needs CuPy; timing the host only")
        return host
    return _GpuRange(host, rec.clean_name(_name(message)))


def _host_range(message, color, domain, category, payload, args):
    """The range (or decorator) annotate gives for these arguments, args as meant."""
    if callable(message) and not isinstance(message, str):  # bare @annotate
        return _decorate(message, None, color, domain, category, payload, args)
    if payload is not None or args:
        return _make_range(message, color, domain, category, payload, args)
    try:
        key = (message, domain, category)
        hash(key)
    except TypeError:
        message = rec.clean_name(message)
        key = (message, None if domain is None else _domain_name(domain), category)
    r = _ranges.get(key)
    if r is None:
        if len(_ranges) >= MAX_CACHED_RANGES:  # so many names: no class per name any more
            return _make_range(message, color, domain, category, None, None)
        with _lock:
            r = _ranges.get(key)
            if r is None:
                r = _ranges[key] = _make_range(message, color, domain, category, None, None,
                                               fast=True)
                if domain is None and category is None:
                    _by_message[key[0]] = r
    return r


def _decorate(func, message, color, domain, category, payload, args):
    try:
        target = inspect.unwrap(func)
        co = target.__code__
        srcloc = (co.co_filename, target.__qualname__, co.co_firstlineno)
    except (AttributeError, ValueError):
        srcloc = None
    if _unnamed(message):  # @annotate, @annotate(), @annotate(domain=...): the function
        message = getattr(func, "__qualname__", None) or repr(func)
    name = message
    cats = _categories(domain, category)
    data = _args_data(payload, args)
    if inspect.iscoroutinefunction(func):
        eid = event_id(name, cats, srcloc)
        return _decorate_coroutine(func, eid, data, rec.kinds[eid].name, color, domain, category)
    # the args are fixed for the life of the function: an event kind carrying them, so every
    # call records a fast code (see rec.event_id); a blob per call only for unhashable values
    eid = event_id(name, cats, srcloc, args=data)
    fast_code = None if eid is None else code(eid, LEVEL_DETAIL, BEGIN)
    if fast_code is not None:
        begin = rec.chain(fast_code)
    else:
        eid = event_id(name, cats, srcloc)

        def begin(eid=eid):
            rec.record_blob(Blob(BEGIN, eid, LEVEL_DETAIL, args=data))
    end = rec.end_detail
    clean = rec.kinds[eid].name

    @functools.wraps(func)
    def wrapper(*a, **k):
        if not _on:
            return func(*a, **k)
        begin()
        if _forward:
            _nvtx.forward_push(clean, color, domain, category)
        try:
            return func(*a, **k)
        finally:
            end()
            if _forward:
                _nvtx.forward_pop(domain)

    if rec.fast is not None and fast_code is not None:
        # C: calls func directly when off, records around it when on, ``wrapper`` when forwarding
        fast = rec.fast.Decorated(func, wrapper, fast_code)
        return functools.update_wrapper(fast, func)
    return wrapper


def _decorate_coroutine(func, eid, args, name, color, domain, category):
    """An ``async def`` function as an async range (the ``start_range`` kind, on an "async
    ranges" track): coroutines interleave on one thread, so their ranges cannot share the
    thread's stack (the first to end would close the last to begin)."""

    @functools.wraps(func)
    async def async_wrapper(*a, **k):
        sess = _session.current() if _on else None
        if sess is None:
            return await func(*a, **k)
        track = sess.acquire_async_track()
        rec.record_blob(Blob(BEGIN, eid, LEVEL_DETAIL, track=track, args=args))
        fwd = _nvtx.forward_start(name, color, domain, category) if _forward else None
        try:
            return await func(*a, **k)
        finally:
            if _session.current() is sess:  # not a track of the next session
                if rec.ON:
                    rec.record_blob(Blob(END, 0, LEVEL_DETAIL, track=track))
                sess.release_async_track(track)
            if fwd is not None:
                _nvtx.forward_end(fwd, domain)
    return async_wrapper


# --- push/pop, start/end, mark ------------------------------------------------------------------
_push_chains: dict = {}  # message or (message, domain, category) -> C chain recording a begin
_push_codes: dict = {}  # message -> begin code (the C push_range's fast lookup)


def push_range(message: Any = None, color: Any = None, domain: Any = None, category: Any = None,
               payload: Any = None) -> None:
    """Open a range on this thread; close it with ``pop_range``."""
    if not _on:
        return
    if payload is None:
        try:
            (_push_chains[message] if domain is None and category is None
             else _push_chains[message, domain, category])()
        except (KeyError, TypeError):
            _push_chain(message, domain, category)()
    else:
        rec.record_named(BEGIN, _name(message), _categories(domain, category), LEVEL_DETAIL,
                         _args_data(payload, None))
    if _forward:
        _nvtx.forward_push(_name(message), color, domain, category)


UNNAMED = "<unnamed>"  # the name of a range, or mark, given no message: none is nameless


def _unnamed(message) -> bool:
    return message is None or (isinstance(message, str) and str.__len__(message) == 0)


def _name(message) -> Any:
    return UNNAMED if _unnamed(message) else message


def _push_chain(message, domain, category):
    plain = domain is None and category is None
    try:
        key = message if plain else (message, domain, category)
        hash(key)
    except TypeError:  # unhashable message: clean it (str) and key on that
        message = rec.clean_name(message)
        key = message if plain else (message, *_categories(domain, category))
    c = _push_chains.get(key)
    if c is None:
        cats = _categories(domain, category)
        if len(_push_chains) >= MAX_CACHED_RANGES:
            return functools.partial(rec.record_named, BEGIN, _name(message), cats, LEVEL_DETAIL)
        begin_code = code(event_id(_name(message), cats), LEVEL_DETAIL, BEGIN)
        c = _push_chains[key] = rec.chain(begin_code)
        if plain:
            _push_codes[key] = begin_code
    return c


def pop_range(domain: Any = None) -> None:
    """Close the innermost range opened by ``push_range`` on this thread.

    A pop with nothing open is reported once and ignored (the trace stays well nested).
    """
    if _on:
        rec.end_detail()
        if _forward:
            _nvtx.forward_pop(domain)


_push_range_py, _pop_range_py = push_range, pop_range
if rec.fast is not None:  # the public names become the C fast paths over the functions above
    rec.fast.configure(rec.END_DETAIL, _by_message, _push_codes, _annotate_py, _push_range_py,
                       _pop_range_py)
    annotate = rec.fast.annotate  # noqa: F811
    push_range = rec.fast.push_range  # noqa: F811
    pop_range = rec.fast.pop_range  # noqa: F811


class RangeHandle:
    """What ``start_range`` returns; pass it to ``end_range`` from any thread."""

    __slots__ = ("track", "fwd", "domain", "__weakref__")

    def __init__(self, track, fwd, domain):
        self.track, self.fwd, self.domain = track, fwd, domain


def start_range(message: Any = None, color: Any = None, domain: Any = None,
                category: Any = None, payload: Any = None) -> RangeHandle | None:
    """Open a range that may end on another thread (drawn on an async track)."""
    if not _on:
        return None
    sess = _session.current()
    if sess is None:
        return None
    track = sess.acquire_async_track()
    rec.record_named(BEGIN, _name(message), _categories(domain, category), LEVEL_DETAIL,
                     _args_data(payload, None), track)
    fwd = _nvtx.forward_start(_name(message), color, domain, category) if _forward else None
    return RangeHandle(track, fwd, domain)


def end_range(handle: RangeHandle | None) -> None:
    """Close a range from ``start_range``. Unknown or already-ended handles are ignored."""
    if handle is None:
        return
    if not isinstance(handle, RangeHandle):
        warn_once("end_range", f"end_range() got {type(handle).__name__}, not a range handle")
        return
    track, handle.track = handle.track, None
    if track is None:
        warn_once("end_range_twice", "end_range() called twice for one range; ignored")
        return
    if rec.ON:
        rec.record_blob(Blob(END, 0, LEVEL_DETAIL, track=track))
    sess = _session.current()
    if sess is not None:
        sess.release_async_track(track)
    if handle.fwd is not None and _forward:
        _nvtx.forward_end(handle.fwd, handle.domain)


def mark(message: Any = None, color: Any = None, domain: Any = None, category: Any = None,
         payload: Any = None, **args: Any) -> None:
    """An instant event on this thread's track."""
    if not _on:
        return
    name = _name(message)
    rec.record_named(INSTANT, name, _categories(domain, category), LEVEL_DETAIL,
                     _args_data(payload, _kwargs(args) if args else None))
    if _forward:
        _nvtx.forward_mark(name, color, domain, category)


def counter(name: str, value: float, unit: str | None = None) -> None:
    """A sample on the process-level counter track ``name`` (made on first use)."""
    if not _on:
        return
    sess = _session.current()
    if sess is None:
        return
    if type(name) is not str:  # (per sample: no call for the common case)
        name = rec.clean_text(name, "counter name")
    if type(value) is not float and type(value) is not int and not isinstance(value, (int, float)):
        try:
            value = float(value)
        except Exception:  # not a number, or a __float__ that fails: never the user's problem
            warn_once("counter_value", f"counter {name!r}: a value of type "
                      f"{type(value).__name__} is not a number; ignored")
            return
    if unit is None or type(unit) is str:
        pass
    elif isinstance(unit, str):
        unit = str.__str__(unit)
    else:
        warn_once("counter_unit", f"counter {name!r}: a unit of type {type(unit).__name__} is "
                  f"not a str; using '<{type(unit).__name__}>'")
        unit = f"<{type(unit).__name__}>"
    # the writer makes it an int64 or a double (``counter_value``)
    rec.record_blob(Blob(rec.COUNTER, 0, LEVEL_DETAIL, track=sess.counter_track(name, unit),
                         value=value))


# --- sessions -----------------------------------------------------------------------------------
def start(path: str | os.PathLike | None = None, *, nvtx: bool = False, **options: Any):
    """Start tracing into ``path`` (default ``stepscope-<pid>.pftrace``); returns the session.

    Options: ``buffer_bytes`` (32 MiB), ``flush_interval_s`` (1.0), ``compress`` (True),
    ``rank``, ``process_name``; ``nvtx=True`` also sends every range to NVTX (Nsight Systems).
    Calling ``start`` while a session is active warns and returns the active session.
    """
    active = _session.current()
    if active is not None:
        warn_once("start_twice", "start() called while tracing is already on; ignored")
        return active
    if path is None:
        path = f"stepscope-{os.getpid()}.pftrace"
    sess = _session.Session(path, **options)
    set_forwarding(nvtx)
    return sess.start()


def stop() -> None:
    """Stop tracing and finish the file. Without an active session: a warning, nothing else."""
    sess = _session.current()
    if sess is None:
        warn_once("stop_without_start", "stop() called but tracing is not on; ignored")
        return
    sess.stop()
    set_forwarding(False)


@contextlib.contextmanager
def trace(path: str | os.PathLike | None = None, **options: Any) -> Iterator:
    """``with stepscope.trace("run.pftrace"):`` — trace the block, finish the file after it."""
    outer = _session.current()
    sess = start(path, **options)
    try:
        yield sess
    finally:
        if sess is not outer and sess is not None and not sess.stopped:  # only what we started
            sess.stop()
            set_forwarding(False)


def set_forwarding(on: bool) -> None:
    """Send every range to NVTX as well (needs the ``nvtx`` package)."""
    global _forward
    if on and not _nvtx.enable_forwarding():
        warn_once("nvtx_missing", "nvtx forwarding asked for but the nvtx package is missing")
        on = False
    if not on:
        _nvtx.disable_forwarding()
    _forward = bool(on)
    _on_state(rec.ON, rec.DETAIL)
