"""The hot path: recording an event is one atomic ``list.extend`` of three ints.

Every thread appends ``(code, timestamp, thread ident)`` to one process-wide list. ``list.extend``
of a tuple is a single C call, so under the GIL the three ints always land together and never
interleave with another thread's; no lock and no thread-local lookup are needed, and each thread's
events stay in its own time order (the writer splits them by thread). Only ints are stored: ints
are not tracked by the cyclic garbage collector, so a full buffer costs the program nothing.

With the C extension ``_fast`` (built on Linux when a compiler is at hand), the buffer is a raw
int64 array in C instead, as in viztracer: no Python int is made per event, and the writer takes
raw bytes. Both buffers behave alike; ``STEPSCOPE_PURE_PYTHON=1`` forces the list. Without the
extension, range begins are recorded by a chain of C callables built once per event kind
(``next(map(extend, zip(repeat(code), iter(clock), iter(get_ident))))``): no Python frame runs,
but for a summary range's begin and end, which also count the thread's open summary ranges
(``summary_depth``, ``at_top``, ``before_top``, as the C ``Emit`` does).

Codes (see ``code()``): ``eid << 3 | level << 2 | kind`` for events whose name is in the event
table, and ``-k`` for a "blob", an event with arguments or an explicit track whose description
waits in ``_blobs[k]`` until the writer encodes it. A numbered begin (the profiler's ``step N``,
see ``NumberedBegin``) carries its number in the code: ``eid = NUMBERED_EID + N``, no object
per event. All encoding happens in the writer thread.

Thread marks: Python hands a finished thread's ident to the next thread it starts, so the ident
alone would put two threads' events on one track. A ``(THREAD, native thread id, ident)`` triple
before a thread's first event tells the writer where the next holder of an ident begins. The C
buffer writes it itself (one thread-local check per event); the pure-Python one when the
session's thread-start hook sees a new thread start (``mark_thread``), which costs no event.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import warnings
from functools import partial
from itertools import repeat
from threading import get_ident
from time import perf_counter_ns
from typing import Any

import numpy as np

from .._ext import load as load_extension
from .._schema import LEVEL_DETAIL, LEVEL_SUMMARY

BEGIN, END, INSTANT = 0, 1, 2
# Kinds that only exist as blobs:
COUNTER = 3

# a step boundary at_top called failed: one line, and the program goes on (_fast.c's
# boundary_failed prints the same)
BOUNDARY_FAILED = "stepscope: optimizer step boundary failed: {!r}"

MAX_NAME_CHARS = 1024  # longer names are cut (with one warning): they would bloat every sequence


def code(eid: int, level: int, kind: int) -> int:
    return (eid << 3) | (level << 2) | kind


THREAD = code(0, LEVEL_SUMMARY, COUNTER)  # a thread mark (see above): no event has this code
# ident | STEPS: the events of that thread's steps (the profiler's step begins and ends), a
# sequence and a track of their own ("steps", a child of the thread's track), so that a range
# of the thread that spans steps never nests with them (a pthread_self ident is an address,
# under 2**47; a thread ident elsewhere is smaller still)
STEPS = 1 << 62
END_DETAIL = code(0, LEVEL_DETAIL, END)
END_SUMMARY = code(0, LEVEL_SUMMARY, END)

# --- the buffer ---------------------------------------------------------------------------------
fast = load_extension("stepscope._fast")
if fast is not None and (getattr(fast, "THREAD_MARK", None) != THREAD
                         or getattr(fast, "STEPS_IDENT", None) != STEPS
                         or not hasattr(fast, "summary_low")):
    fast = None  # a stale build (no thread marks, no range count): the pure-Python twin instead

# True while a session records: summary-level events (steps, phases, counters) are kept.
ON = False
# True while detail-level events (user ranges, captured nvtx) are kept.
DETAIL = False

if fast is not None:
    _ext = fast.extend
    chain = fast.Emit  # chain(code)() records (code, now, thread ident); ignores arguments
    # the summary ranges open on the calling thread, as its chains began and ended them;
    # at_top(fn, base): fn called after the end that brings the count down to base;
    # before_top(fn, base): fn(code) before each begin made with base open, until it returns
    # True; summary_low: the lowest count since mark_low (or at_top's call), the loop's level
    # (see _fast.c, Emit)
    summary_depth = fast.summary_depth
    summary_low = fast.summary_low
    mark_low = fast.mark_low
    thread_last_ts = fast.thread_last_ts  # the latest time the calling thread recorded
    at_top = fast.at_top
    before_top = fast.before_top
    reset_depth = fast.reset_depth
    noop = fast.noop  # a C callable taking any arguments, returning None
    pending_words = fast.size  # int64 words recorded and not drained yet (3 per event)
    lost_events = fast.lost  # events not stored for lack of memory
    clear = fast.clear

    def mark_thread(native_id: int) -> None:
        """Nothing to do: the C buffer marks each thread at its first event."""

    def drain() -> np.ndarray:
        """Take everything recorded so far, flat (code, ts, ident)* (writer thread only)."""
        return np.frombuffer(fast.drain(), dtype=np.int64)

else:
    noop = "".format  # a C callable taking any arguments, returning "" (falsy)
    events: list[int] = []
    _ext = events.extend

    def _chain(code_: int) -> partial:
        return partial(
            next, map(_ext, zip(repeat(code_), iter(perf_counter_ns, None),
                                iter(get_ident, None))))

    # .n: the thread's open summary ranges, .low: the fewest since mark_low, .epoch: as of when
    _depths = threading.local()
    _depth_epoch = [1]
    _at_top: list[Any] = [None, 0, 0]  # (fn, its thread's ident, base)
    _before_top: list[Any] = [None, 0, 0]  # (fn, its thread's ident, base)

    def summary_depth() -> int:
        d = _depths
        if getattr(d, "epoch", 0) != _depth_epoch[0]:
            d.n, d.low, d.epoch = 0, 0, _depth_epoch[0]
        return d.n

    def summary_low() -> int:
        summary_depth()
        return _depths.low

    def mark_low() -> None:
        _depths.low = summary_depth()

    def thread_last_ts() -> int:
        """The latest time the calling thread recorded (0: none; a scan of what is still in
        the list, from its end, else what the last drains took: called once per pass of a
        loader)."""
        me, ev = get_ident(), events
        for i in range(len(ev) - 3, -1, -3):
            if ev[i + 2] == me and ev[i] != THREAD:
                return ev[i + 1]
        return _drained_last.get(me, 0)

    _drained_last: dict[int, int] = {}  # thread ident -> the latest time a drain took

    def at_top(fn: Any, base: int = 0) -> Any:
        if base < 0:
            raise ValueError("at_top(): base must be >= 0")
        was = _at_top[0]
        _at_top[:] = [fn, get_ident(), base]
        return was

    def before_top(fn: Any, base: int = 0) -> Any:
        if base < 0:
            raise ValueError("before_top(): base must be >= 0")
        was = _before_top[0]
        _before_top[:] = [fn, get_ident(), base]
        return was

    def reset_depth() -> None:
        _depth_epoch[0] += 1
        _at_top[0] = _before_top[0] = None

    def chain(code_: int) -> Any:
        """A zero-argument callable that appends ``(code_, now, thread ident)`` atomically: a
        chain of C callables, with a Python frame for a summary begin or end (the depth count
        that ``at_top`` needs, as _fast.c's Emit keeps it)."""
        put = _chain(code_)
        if code_ < 0 or (code_ >> 2) & 1 != LEVEL_SUMMARY or code_ & 3 > END:
            return put
        if code_ & 3 == BEGIN:
            def begin(*_: Any) -> None:
                n = summary_depth()
                fn = _before_top[0]
                if fn is not None and n == _before_top[2] and _before_top[1] == get_ident():
                    try:
                        if fn(code_) is True and _before_top[0] is fn:
                            _before_top[0] = None
                    except Exception as exc:  # (as _fast.c's boundary_failed)
                        print(BOUNDARY_FAILED.format(exc), file=sys.stderr)
                put()
                _depths.n = n + 1
            return begin

        def end(*_: Any) -> None:
            put()
            n = summary_depth()
            if n == 0:
                return
            _depths.n = n - 1
            _depths.low = min(_depths.low, n - 1)
            fn = _at_top[0]
            if fn is not None and n - 1 == _at_top[2] and _at_top[1] == get_ident():
                _at_top[0] = None
                _depths.low = n - 1  # a boundary: the next one's base is read from here
                try:
                    fn()
                except Exception as exc:  # (as _fast.c's boundary_failed)
                    print(BOUNDARY_FAILED.format(exc), file=sys.stderr)
        return end

    def pending_words() -> int:
        return len(events)

    def lost_events() -> int:
        return 0  # a list that cannot grow raises MemoryError in the caller instead

    def clear() -> None:
        del events[:]

    def mark_thread(native_id: int) -> None:
        """Mark the start of the calling thread (called once, when it starts, while recording)."""
        if ON:
            _ext((THREAD, native_id, get_ident()))

    def drain() -> np.ndarray:
        """Take everything recorded so far, flat (code, ts, ident)* (writer thread only)."""
        n = len(events)
        n -= n % 3
        chunk = np.array(events[:n], dtype=np.int64)
        del events[:n]
        ev = chunk.reshape(-1, 3)
        ev = ev[ev[:, 0] != THREAD]
        for ident in set(ev[:, 2].tolist()):  # (for thread_last_ts once the list is empty)
            last = int(ev[ev[:, 2] == ident, 1].max())
            _drained_last[ident] = max(_drained_last.get(ident, 0), last)
        return chunk


end_detail = chain(END_DETAIL)
end_summary = chain(END_SUMMARY)


# --- the event table: (name, categories, source location) -> eid ---------------------------------
class EventKind:
    """What every event of one code shares; ``args``: debug annotations written with each."""

    __slots__ = ("name", "categories", "srcloc", "args")

    def __init__(self, name: str, categories: tuple[str, ...], srcloc: tuple | None,
                 args: dict | None = None):
        self.name = name
        self.categories = categories
        self.srcloc = srcloc
        self.args = args


kinds: list[EventKind | None] = [None]  # eid 0 is reserved (ends carry no name)
_kind_ids: dict[tuple, int] = {}
_kinds_lock = threading.RLock()  # reentrant: a signal handler may record
_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """One warning per kind of misuse. Never raises, even under ``-W error`` (a warning turned
    into an exception must not break the user's program or kill the writer thread)."""
    if key not in _warned:
        _warned.add(key)
        try:
            warnings.warn(f"stepscope: {message}", RuntimeWarning, stacklevel=3)
        except Exception:
            pass


def clean_name(name: Any) -> str:
    """Any object becomes a bounded, printable event name; never raises."""
    if type(name) is not str:
        if isinstance(name, bytes):
            name = name.decode("utf-8", "replace")
        elif isinstance(name, str):
            name = str.__str__(name)
        else:
            warn_once("nonstr", f"range message {type(name).__name__} is not a str; using str()")
            try:
                name = str(name)
            except Exception:  # a broken __str__ must not break the user's program
                name = f"<{type(name).__name__}>"
    if len(name) > MAX_NAME_CHARS:
        warn_once("long", f"range names longer than {MAX_NAME_CHARS} characters are cut")
        name = name[:MAX_NAME_CHARS]
    return name


def clean_text(value: Any, what: str) -> str:
    """``str(value)`` for text the trace holds besides event names (a category, a counter's name
    or unit); never raises: a value whose ``str()`` fails becomes ``<TypeName>``, with one
    warning (the user's program must not fail for what it hands the profiler)."""
    if type(value) is str:
        return value
    try:
        return str.__str__(value) if isinstance(value, str) else str(value)
    except Exception as exc:
        kind = type(value).__name__
        warn_once(f"badtext {what}", f"str() of the {kind} given as {what} failed "
                  f"({type(exc).__name__}); using '<{kind}>'")
        return f"<{kind}>"


MAX_EVENT_KINDS = 1 << 16  # interned names; past this, new names are written inline


def event_id(name: Any, categories: tuple[str, ...] = (), srcloc: tuple | None = None,
             force: bool = True, args: dict | None = None) -> int | None:
    """The interned id of an event kind. With ``force=False``, None once the table is full and
    the kind is new: the caller then writes the name inline (a run with endless distinct names,
    ``f"batch {i}"``, must not grow a table forever).

    ``args``: fixed debug annotations, written with every event of the kind, so that an event
    whose args repeat (the profiler's step end) is a fast code: recorded by a bare chain and
    encoded once per sequence. None when a value is unhashable, or unequal to itself (NaN: each
    event would make a new kind); the caller then records a blob.
    """
    key = (name, categories, srcloc)
    if args is not None:  # the type too: 128 and 128.0 are written differently
        try:  # an unhashable name is cleaned below; an unhashable value makes no kind
            fixed = tuple((k, type(v), v) for k, v in args.items())
            hash(fixed)
            if any(v != v for _, _, v in fixed):
                return None
        except (TypeError, ValueError):
            return None
        key += fixed
    try:
        eid = _kind_ids.get(key)
    except TypeError:  # unhashable name
        key = (clean_name(name), categories, srcloc) + key[3:]
        eid = _kind_ids.get(key)
    if eid is None:
        if not force and len(kinds) >= MAX_EVENT_KINDS:
            return None
        with _kinds_lock:
            eid = _kind_ids.get(key)
            if eid is None:
                eid = len(kinds)
                kinds.append(EventKind(clean_name(name), categories, srcloc,
                                       None if args is None else dict(args)))
                _kind_ids[key] = eid
    return eid


def record_named(kind: int, name: Any, categories: tuple[str, ...], level: int,
                 args: dict | None = None, track: int | None = None) -> tuple[int, int, int]:
    """Record a begin/instant by name: a fast code when the name is (or can be) interned and
    nothing else is attached, else a blob (inline name once the table is full)."""
    eid = event_id(name, categories, force=False)
    if eid is None:
        return record_blob(Blob(kind, event_id("", categories), level, track=track, args=args,
                                name=clean_name(name)))
    if args or track is not None:
        return record_blob(Blob(kind, eid, level, track=track, args=args))
    return record(code(eid, level, kind))


# --- blobs: events that need more than a name ---------------------------------------------------
class Blob:
    """An event with a track, arguments, flows or a counter value, encoded later."""

    __slots__ = ("kind", "eid", "level", "track", "args", "flows", "tflows", "value", "name")

    def __init__(self, kind, eid=0, level=LEVEL_DETAIL, track=None, args=None, flows=None,
                 tflows=None, value=None, name=None):
        self.kind = kind
        self.eid = eid
        self.level = level
        self.track = track
        self.args = args
        self.flows = flows
        self.tflows = tflows
        self.value = value
        self.name = name  # inline (not interned) name, for names used once


# --- blob series: a converter's columns ----------------------------------------------------------
# Event i of the series parked as blob k has the code -(k + ((i + 1) << SERIES_SHIFT)): one blob
# stands for up to SERIES_MAX events (blob ids stay below 1 << SERIES_SHIFT: a trillion blobs).
SERIES_SHIFT = 40
SERIES_MAX = 1 << 22
BLOB_ID_MASK = (1 << SERIES_SHIFT) - 1


class BlobSeries:
    """Many events of one kind as columns: event ``i`` is the blob of ``bases[base[i]]``
    (``(eid, track, args)``) plus its own int and float args (``int_names`` valued ``ints[i]``,
    ``float_names`` valued ``floats[i]``), counter
    value ``values[i]``, flow ``flows[i]`` and terminating flow ``tflows[i]`` (uint64, 0 for
    none; ``flow_lists[i]``, where given, holds all of event ``i``'s flows instead). A converter
    of thousands of records (GPU kernels, CUDA calls, counter samples) builds no object per
    event: it parks one series, its events' codes name it (``SERIES_SHIFT``), and the writer
    encodes each base once per sequence and the rest in numpy (``write.encoder``)."""

    __slots__ = ("kind", "level", "bases", "base", "int_names", "ints", "values", "flows",
                 "tflows", "flow_lists", "float_names", "floats")

    def __init__(self, kind: int, level: int, bases: list[tuple], base: Any,
                 int_names: tuple[str, ...] = (), ints: Any = None, values: Any = None,
                 flows: Any = None, tflows: Any = None,
                 flow_lists: dict[int, list[int]] | None = None,
                 float_names: tuple[str, ...] = (), floats: Any = None):
        self.kind = kind
        self.level = level
        self.bases = bases
        self.base = np.asarray(base, dtype=np.int64)
        self.int_names = tuple(int_names)
        n = len(self.base)
        if n > SERIES_MAX:
            raise ValueError(f"a blob series holds at most {SERIES_MAX} events, not {n}")
        self.ints = (np.asarray(ints, dtype=np.int64).reshape(n, len(self.int_names))
                     if self.int_names else None)
        self.values = None if values is None else np.asarray(values, dtype=np.float64)
        self.flows = None if flows is None else np.asarray(flows, dtype=np.uint64)
        self.tflows = None if tflows is None else np.asarray(tflows, dtype=np.uint64)
        self.flow_lists = flow_lists or None
        self.float_names = tuple(float_names)
        self.floats = (np.asarray(floats, dtype=np.float64).reshape(n, len(self.float_names))
                       if self.float_names else None)

    def __len__(self) -> int:
        return len(self.base)

    def blob(self, i: int) -> Blob:
        """Event ``i`` as a plain blob (the writer's encoding of the series equals it)."""
        eid, track, args = self.bases[int(self.base[i])]
        if self.int_names:
            args = {**(args or {}), **dict(zip(self.int_names, self.ints[i].tolist(),
                                               strict=True))}
        if self.float_names:
            args = {**(args or {}), **dict(zip(self.float_names, self.floats[i].tolist(),
                                               strict=True))}
        flows = tflows = None
        if self.flow_lists is not None and i in self.flow_lists:
            flows = self.flow_lists[i]
        elif self.flows is not None and self.flows[i]:
            flows = [int(self.flows[i])]
        if self.tflows is not None and self.tflows[i]:
            tflows = [int(self.tflows[i])]
        return Blob(self.kind, eid, self.level, track, args, flows, tflows,
                    None if self.values is None else float(self.values[i]))


class NumberedBegin(Blob):
    """A begin named ``prefix + str(n) + suffix`` with the one int arg ``{arg: n}`` (the
    profiler's ``step N``), one per use: made by a one-field call on the recording thread;
    the writer forms its name and args. Subclasses set ``eid``, ``level``, ``prefix``,
    ``suffix`` and ``arg`` (class attributes stand in for Blob's fields)."""

    __slots__ = ("number",)
    kind, track, flows, tflows, value = BEGIN, None, None, None, None
    eid: int
    level: int
    prefix: str  # "step {step}" cut around its field: an f-string of the parts is several
    suffix: str  # times cheaper than str.format with a keyword
    arg: str

    def __init__(self, number: int):  # not Blob's: the other fields are fixed
        self.number = number

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.prefix}{self.number}{self.suffix}"

    @property
    def args(self) -> dict:  # type: ignore[override]
        return {self.arg: self.number}


# --- numbered begins: the number rides in the code ---------------------------------------------
# Codes with an eid at or past NUMBERED_EID (far past any event table) are begins of the one
# registered NumberedBegin kind, number eid - NUMBERED_EID: a step's begin costs two int
# operations instead of an object and a dict entry, and the writer never looks at a blob.
NUMBERED_EID = 1 << 40
NUMBERED_MAX = 1 << 50  # numbers past it (or negative, or not int) are parked blobs instead
NUMBERED_MIN_CODE = NUMBERED_EID << 3
numbered: type[NumberedBegin] | None = None  # the kind those codes stand for


def register_numbered(cls: type[NumberedBegin]) -> int:
    """Make ``cls`` the kind of numbered codes (one per process: the profiler's step begin);
    returns the code of number 0 (number ``n``'s is that plus ``n << 3``)."""
    global numbered
    if numbered is not None and (numbered.__module__, numbered.__qualname__) != (
            cls.__module__, cls.__qualname__):  # (the same class again: its module reloaded)
        raise RuntimeError(f"numbered codes belong to {numbered.__name__} already")
    numbered = cls
    return code(NUMBERED_EID, cls.level, BEGIN)


def numbered_code(cls: type[NumberedBegin], n: Any) -> int:
    """The code of ``cls(n)``: its number in the code where it fits, else a parked blob's."""
    if cls is numbered and type(n) is int and 0 <= n < NUMBERED_MAX:
        return code(NUMBERED_EID + n, cls.level, BEGIN)
    return -register_blob(cls(n))


def numbered_number(code_: int) -> int | None:
    """The number a numbered code carries (None for any other code)."""
    return (code_ >> 3) - NUMBERED_EID if code_ >= NUMBERED_MIN_CODE else None


blobs: dict[int, Blob] = {}
_blob_ids = itertools.count(1)


def register_blob(blob: Blob) -> int:
    """Park a blob for the writer; its (negative) id is the event code that refers to it."""
    k = next(_blob_ids)
    blobs[k] = blob
    return k


def record_blob(blob: Blob, ts: int | None = None) -> tuple[int, int, int]:
    event = (-register_blob(blob), perf_counter_ns() if ts is None else ts, get_ident())
    _ext(event)
    return event


NULL = 3  # a fast code of no kind: what a withdrawn event becomes (files skip it)


def record(code_: int) -> tuple[int, int, int]:
    """Record a fast event now; returns it, e.g. to ``withdraw`` it later."""
    event = (code_, perf_counter_ns(), get_ident())
    _ext(event)
    return event


def withdraw(event: tuple[int, int, int], lookback: int = 1 << 16) -> bool:
    """Turn a recorded event that no file has taken yet into nothing. False if already taken.

    The caller must hold the session's flush lock (``Session.withdraw`` does), so that no flush
    copies the buffer meanwhile. Only the last ``lookback`` events are searched.
    """
    code_, ts, ident = event
    if fast is not None:
        found = fast.withdraw(code_, ts, ident, NULL, lookback)
    else:
        found = False
        ev = events
        n = len(ev) - len(ev) % 3
        for i in range(n - 3, max(-1, n - 3 * lookback - 1), -3):
            if ev[i + 1] == ts and ev[i] == code_ and ev[i + 2] == ident:
                ev[i] = NULL
                found = True
                break
    if found and code_ < 0:
        blobs.pop(-code_, None)
    return found


# --- internal API for the profiler and others (events on the calling thread's track) -----------
def begin(name: str, category: str | None = None, level: int = LEVEL_SUMMARY) -> None:
    """Open a slice on the calling thread's track (closed by ``end`` with the same level)."""
    if ON and (level == LEVEL_SUMMARY or DETAIL):
        record_named(BEGIN, name, (category,) if category else (), level)


def end(level: int = LEVEL_SUMMARY) -> None:
    """Close the innermost slice of that level."""
    if ON:
        (end_summary if level == LEVEL_SUMMARY else end_detail)()


def counter_value(value) -> int | float:
    """A counter value Perfetto can hold: an int64, else a float (never raises)."""
    if type(value) is int and -(1 << 63) <= value < (1 << 63):
        return value
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return float("nan")


_state_listeners: list = []


def on_state_change(listener) -> None:
    """Call ``listener(on, detail)`` whenever recording turns on or off (after the change)."""
    _state_listeners.append(listener)


def set_state(on: bool, detail: bool) -> None:
    """Turn recording on/off; listeners (the public API, the phases) rebind their fast paths."""
    global ON, DETAIL
    ON, DETAIL = bool(on), bool(on and detail)
    if fast is not None:
        fast.set_recording(ON)  # (the C profiler methods read ON there)
    for listener in _state_listeners:
        listener(ON, DETAIL)


def reset_after_fork() -> None:
    """In a forked child: record nothing and drop what the parent had not written yet."""
    global _kinds_lock
    _kinds_lock = threading.RLock()  # another thread may have held it at fork time
    set_state(False, False)
    clear()
    blobs.clear()


os.register_at_fork(after_in_child=reset_after_fork)
