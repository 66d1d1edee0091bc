"""Bridges to the ``nvtx`` package, in both directions.

*Forwarding* sends every stepscope range to real NVTX too, so Nsight Systems shows the same
ranges: while forwarding is on (:func:`enable_forwarding`, called by ``set_forwarding``), the
core calls :func:`forward_push` / :func:`forward_pop` / :func:`forward_start` /
:func:`forward_end` / :func:`forward_mark`, which call nvtx's original functions.

*Capture* records the ``nvtx`` calls that user code and libraries already make:
:func:`capture_nvtx` replaces ``annotate``, ``push_range``, ``pop_range``, ``start_range``,
``end_range`` and ``mark`` in the ``nvtx`` module (and ``nvtx.nvtx``) by wrappers that call the
original *and* stepscope's public API; :func:`release_nvtx` puts the originals back. Captured
ranges get the nvtx domain as their stepscope domain (hence category), or ``_schema.CAT_NVTX``.

Works whether or not an NVTX tool is attached: without one, nvtx's own functions are no-op stubs
(and ``@nvtx.annotate`` returns the bare function), which is why the wrappers record on their own
instead of hooking nvtx's C layer. Without the ``nvtx`` package everything here is a no-op.

Limits: only calls made through the patched names are seen, so call :func:`capture_nvtx` before
code runs ``from nvtx import annotate`` or decorates with ``@nvtx.annotate`` (those bind the
function or class at that moment); ``nvtx.Domain`` methods are not captured.

Forwarding and capture together: a captured call reaches NVTX once, through the original nvtx
function; the stepscope range it records is not forwarded again (a per-thread flag), and
forwarding always calls the original functions, never the capturing wrappers, so nothing loops.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from types import ModuleType
from typing import Any

from stepscope import _schema
from stepscope.record import recorder as _recorder

_NAMES = ("annotate", "push_range", "pop_range", "start_range", "end_range", "mark")

_lock = threading.RLock()


class _ThreadState(threading.local):
    capturing = False  # this thread is recording a captured nvtx call: do not forward it


_tls = _ThreadState()


def _warn_once(what: str, exc: BaseException | None = None) -> None:
    detail = f": {exc!r}" if exc is not None else ""
    _recorder.warn_once(f"nvtx:{what}:{type(exc).__name__}",
                        f"{what}{detail} (further ones are not reported)")


def _import_nvtx() -> ModuleType | None:
    try:
        import nvtx
    except Exception:  # not installed, or a broken install: treated alike
        return None
    return nvtx


def _functions_of(module: ModuleType | None) -> dict[str, Any] | None:
    if module is None:
        return None
    return {name: getattr(module, name, None) for name in _NAMES}


def _originals() -> dict[str, Any] | None:
    """The unpatched nvtx functions (the ones capture replaced, while it is active)."""
    if _capture_depth:
        return _saved_functions
    return _functions_of(_import_nvtx())


# ---------------------------------------------------------------------------------------------
# Forwarding: stepscope ranges -> real NVTX
# ---------------------------------------------------------------------------------------------

forwarding = False  # enable_forwarding() is in effect (``_api._forward`` mirrors it)
_fwd: dict[str, Any] | None = None  # nvtx's original functions (no-ops if missing), on first use


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _resolve() -> dict[str, Any]:
    global _fwd
    functions = _originals() or {}
    _fwd = {name: functions.get(name) or _noop for name in _NAMES}
    return _fwd


def available() -> bool:
    """Whether the ``nvtx`` package can be imported."""
    return _import_nvtx() is not None


def enable_forwarding() -> bool:
    """Mark forwarding on and resolve nvtx's functions. False (and off) without nvtx."""
    global forwarding
    with _lock:
        forwarding = _originals() is not None
        _resolve()
        return forwarding


def disable_forwarding() -> None:
    global forwarding, _fwd
    forwarding = False
    _fwd = None


# Each forward_* calls nvtx's original function with the same arguments, unless this thread is
# recording a captured nvtx call (nvtx already has it). Non-string messages are sent as str().
def _forward(fn: str, *args: Any) -> Any:
    if _tls.capturing:
        return None
    try:
        return (_fwd or _resolve())[fn](*args)
    except Exception as exc:  # a bad colour or a broken nvtx must never reach the user
        _warn_once(f"forwarding to nvtx.{fn} failed", exc)
        return None


def _text(message: Any) -> Any:
    if message is None or type(message) is str:
        return message
    try:
        return str(message)
    except Exception:  # a broken __str__: the name stepscope records too
        return f"<{type(message).__name__}>"


def forward_push(message: Any, color: Any = None, domain: str | None = None,
                 category: Any = None, payload: Any = None) -> None:
    """``nvtx.push_range`` (per-thread NVTX stack of the domain)."""
    _forward("push_range", _text(message), color, domain, category, payload)


def forward_pop(domain: str | None = None) -> None:
    """``nvtx.pop_range``."""
    _forward("pop_range", domain)


def forward_start(message: Any, color: Any = None, domain: str | None = None,
                  category: Any = None, payload: Any = None) -> Any:
    """``nvtx.start_range``: returns its id (None when not forwarded), for :func:`forward_end`."""
    return _forward("start_range", _text(message), color, domain, category, payload)


def forward_end(range_id: Any, domain: str | None = None) -> None:
    """``nvtx.end_range`` of an id from :func:`forward_start` (nvtx's id carries the domain)."""
    if range_id is not None:
        _forward("end_range", range_id)


def forward_mark(message: Any, color: Any = None, domain: str | None = None,
                 category: Any = None, payload: Any = None) -> None:
    """``nvtx.mark``."""
    _forward("mark", _text(message), color, domain, category, payload)


# ---------------------------------------------------------------------------------------------
# Capture: nvtx calls -> stepscope
# ---------------------------------------------------------------------------------------------

_capturing = False  # read by the wrappers on every call: off means pass straight through
_capture_depth = 0
_saved_functions: dict[str, Any] | None = None
_patched: list[tuple[ModuleType, str, Any, Any]] = []  # (module, name, original, wrapper)
_target: Any = None  # the public API (the stepscope package), handed down by set_api()


_NV = _schema.CAT_NVTX


def _record(method: str, *args: Any) -> Any:
    """``stepscope.<method>(*args)``, never raising (the user's program must keep running). With
    forwarding on, this thread's forwarding is suppressed meanwhile: nvtx already has the call."""
    try:
        fn = getattr(_target, method)
        if not forwarding:
            return fn(*args)
        _tls.capturing = True
        try:
            return fn(*args)
        finally:
            _tls.capturing = False
    except Exception as exc:
        _warn_once(f"recording a captured nvtx call (stepscope.{method}) failed", exc)
        return None


class CapturedRange(tuple):
    """What a captured ``nvtx.start_range`` returns: a tuple nvtx's own ``end_range`` accepts
    (nvtx's id, or a no-op placeholder when nvtx returned None because no tool is attached) that
    also carries the stepscope handle, so the captured ``end_range`` ends both."""

    def __new__(cls, nvtx_id: Any, handle: Any) -> CapturedRange:
        self = super().__new__(cls, _placeholder_id() if nvtx_id is None else nvtx_id)
        self.handle = handle
        self.from_nvtx = nvtx_id is not None
        return self

    @property
    def nvtx_id(self) -> Any:
        """What nvtx's start_range returned."""
        return tuple(self) if self.from_nvtx else None


_placeholder: tuple | None = None


def _placeholder_id() -> tuple:
    """(range 0, a disabled domain handle): nvtx's end_range ends nothing with it. Lets a range
    started while capturing be ended by the restored original after :func:`release_nvtx`."""
    global _placeholder
    if _placeholder is None:
        try:
            from nvtx._lib.lib import DomainHandle

            _placeholder = (0, DomainHandle())
        except Exception:  # another nvtx implementation: nothing better to offer
            _placeholder = ()
    return _placeholder


def _make_wrappers(orig: dict[str, Any]) -> dict[str, Any]:
    """Capturing versions of nvtx's public functions and of the ``annotate`` class.

    Each calls the original with the same arguments (defaults as in nvtx's own signatures) and,
    while capturing, records the same range in stepscope with domain ``domain or CAT_NVTX``.
    """
    o_push, o_pop, o_start, o_end, o_mark = (orig[n] for n in _NAMES[1:])
    wrappers: dict[str, Any] = {}

    if o_push is not None:

        @functools.wraps(o_push)
        def push_range(message=None, color="blue", domain=None, category=None, payload=None):
            result = o_push(message, color, domain, category, payload)  # raises on bad input
            if _capturing:
                m = "" if message is None else message
                _record("push_range", m, color, domain or _NV, category, payload)
            return result

        wrappers["push_range"] = push_range

    if o_pop is not None:

        @functools.wraps(o_pop)
        def pop_range(domain=None):
            if _capturing:
                _record("pop_range", domain or _NV)
            return o_pop(domain)

        wrappers["pop_range"] = pop_range

    if o_start is not None:

        @functools.wraps(o_start)
        def start_range(message=None, color=None, domain=None, category=None, payload=None):
            result = o_start(message, color, domain, category, payload)
            if not _capturing:
                return result
            m = "" if message is None else message
            handle = _record("start_range", m, color, domain or _NV, category, payload)
            return CapturedRange(result, handle)

        wrappers["start_range"] = start_range

    if o_end is not None:

        @functools.wraps(o_end)
        def end_range(range_id):
            if type(range_id) is CapturedRange:
                _record("end_range", range_id.handle)  # even after release: the start was recorded
                range_id = range_id.nvtx_id
            return o_end(range_id)

        wrappers["end_range"] = end_range

    if o_mark is not None:

        @functools.wraps(o_mark)
        def mark(message=None, color="blue", domain=None, category=None, payload=None):
            result = o_mark(message, color, domain, category, payload)
            if _capturing:
                m = "" if message is None else message
                _record("mark", m, color, domain or _NV, category, payload)
            return result

        wrappers["mark"] = mark

    base = orig["annotate"]
    if isinstance(base, type):
        wrappers["annotate"] = _make_annotate(base)
    return wrappers


def _make_annotate(base: type) -> type:
    b_init, b_enter, b_exit, b_call = base.__init__, base.__enter__, base.__exit__, base.__call__

    class annotate(base):  # a subclass, so isinstance(x, nvtx.annotate) keeps working
        __doc__ = base.__doc__

        def __init__(self, message=None, color=None, domain=None, category=None, payload=None):
            b_init(self, message, color, domain, category, payload)
            self._stepscope_args = (message, color, domain, category, payload)
            self._stepscope_push = (
                "" if message is None else message,
                color,
                domain or _NV,
                category,
                payload,
            )
            self._stepscope_open: list[bool] = []  # per __enter__: was a range recorded?

        def __reduce__(self):  # pickles as nvtx's own class
            return base, self._stepscope_args

        def __enter__(self):
            result = b_enter(self)
            if _capturing:
                _record("push_range", *self._stepscope_push)
                self._stepscope_open.append(True)
            else:
                self._stepscope_open.append(False)
            return result

        def __exit__(self, exc_type, exc_value, tb):
            if self._stepscope_open and self._stepscope_open.pop():
                _record("pop_range", self._stepscope_push[2])
            return b_exit(self, exc_type, exc_value, tb)

        def __call__(self, func):
            inner = b_call(self, func)  # nvtx's wrapper, or func itself without a tool
            push = self._stepscope_push
            if self._stepscope_args[0] is None:  # nvtx's default for decorators
                push = (getattr(func, "__name__", ""), *push[1:])
            domain = push[2]

            @functools.wraps(func)
            def captured(*args, **kwargs):
                if not _capturing:
                    return inner(*args, **kwargs)
                _record("push_range", *push)
                try:
                    return inner(*args, **kwargs)
                finally:
                    _record("pop_range", domain)

            return captured

    annotate.__module__ = base.__module__
    annotate.__qualname__ = base.__qualname__
    return annotate


def _modules_to_patch(nvtx: ModuleType) -> list[ModuleType]:
    modules = [nvtx]
    inner = sys.modules.get("nvtx.nvtx")
    if isinstance(inner, ModuleType) and inner is not nvtx:
        modules.append(inner)
    return modules


class NvtxCapture:
    """Returned by :func:`capture_nvtx`; as a context manager it releases the capture on exit."""

    def __init__(self, active: bool):
        self.active = active

    def __bool__(self) -> bool:
        return self.active

    def release(self) -> None:
        if self.active:
            self.active = False
            release_nvtx()

    def __enter__(self) -> NvtxCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<stepscope nvtx capture {'active' if self.active else 'inactive'}>"


def set_api(api: ModuleType) -> None:
    """The module whose ``annotate``/``push_range``/... captured calls go to: the stepscope
    package sets itself here at import (this module sits below it and never imports it)."""
    global _target
    _target = api


def capture_nvtx() -> NvtxCapture:
    """Record the nvtx calls made from now on, until :func:`release_nvtx`.

    Calls nest: each ``capture_nvtx()`` needs one ``release_nvtx()`` (or use it as a context
    manager). Without the ``nvtx`` package it warns and returns an inactive handle.
    """
    global _capturing, _capture_depth, _saved_functions, _target
    with _lock:
        nvtx = _import_nvtx()
        if nvtx is None:
            warnings.warn(
                "stepscope.capture_nvtx(): the nvtx package is not installed; nothing to capture",
                RuntimeWarning,
                stacklevel=2,
            )
            return NvtxCapture(False)
        if _capture_depth == 0:
            _saved_functions = _functions_of(nvtx)
            wrappers = _make_wrappers(_saved_functions)
            for module in _modules_to_patch(nvtx):
                for name, wrapper in wrappers.items():
                    if hasattr(module, name):
                        original = getattr(module, name)
                        setattr(module, name, wrapper)
                        _patched.append((module, name, original, wrapper))
            _capturing = True
        _capture_depth += 1
        return NvtxCapture(True)


def release_nvtx() -> None:
    """Undo one :func:`capture_nvtx`; the last one restores nvtx's original functions."""
    global _capturing, _capture_depth, _saved_functions
    with _lock:
        if _capture_depth == 0:
            warnings.warn(
                "stepscope.release_nvtx() without capture_nvtx()", RuntimeWarning, stacklevel=2
            )
            return
        _capture_depth -= 1
        if _capture_depth:
            return
        _capturing = False
        for module, name, original, wrapper in reversed(_patched):
            if getattr(module, name, None) is wrapper:
                setattr(module, name, original)
            # else someone patched over us: leave theirs; ours passes through when not capturing
        _patched.clear()
        _saved_functions = None


def is_capturing() -> bool:
    return _capturing


__all__ = [
    "available",
    "CapturedRange",
    "NvtxCapture",
    "capture_nvtx",
    "release_nvtx",
    "is_capturing",
    "enable_forwarding",
    "disable_forwarding",
    "forward_push",
    "forward_pop",
    "forward_start",
    "forward_end",
    "forward_mark",
    "forwarding",
]
