"""Typed args as the call gave them: a snapshot taken on the caller's thread.

The writer encodes an event's args at flush time, on its own thread. Values kept by reference
were written as they were then, not at the call (a dict, list or array changed after it); a dict
that changed size while the writer iterated it lost the event, uncounted; and a user's
``__repr__`` ran on the writer, where one that takes a lock the program holds at ``stop()``
hung the program. So the public API keeps each arg value that is not ``PLAIN`` (immutable
scalars: kept as they are, at the cost of one type test) as ``snapshot`` makes it: now, what
the encoder would make of it later (``write.encoder.debug_value``), so that a value not changed
after the call is written byte for byte as when the writer read the value itself:

* int, float and str subclasses (IntEnum, numpy.float64): their plain value;
* dicts, lists and tuples to ``DEPTH_MAX`` levels: a new container of their items snapshotted
  alike (dict keys as their ``str``); no one else holds it, so no one changes it. Each keeps
  its first ``ITEMS_MAX`` items, and one arg ``VALUES_MAX`` items in all (counted depth
  first): the rest is cut, as long strings are, so that a huge list costs bounded time and
  memory;
* an object with an ``.item()`` (numpy scalars, one-element arrays): what that returns;
* anything else (deeper containers too): its ``repr()`` now, cut at ``TEXT_MAX`` characters,
  or ``<TypeName>`` when repr fails.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

TEXT_MAX = 4096  # characters of a text arg written (the encoder cuts strings there)
DEPTH_MAX = 8  # levels of dicts/lists written as such; deeper ones are written as their repr
ITEMS_MAX = 1024  # items of one dict, list or tuple kept
VALUES_MAX = 4096  # items of all the containers of one arg kept
ITEM_DEPTH_MAX = 2 * DEPTH_MAX  # .item() results followed (an object whose item is itself)

# values kept as they are: immutable, and encoded without running any code of the program
PLAIN = frozenset((int, float, str, bool, type(None)))
_plain_only = PLAIN.issuperset


def snapshot(value: Any) -> Any:
    """``value`` as the writer is to encode it, taken now (see above); never raises."""
    return value if type(value) in PLAIN else _snapshot(value, 0, [VALUES_MAX])


def _snapshot(v: Any, depth: int, budget: list[int]) -> Any:
    """``v`` as the encoder would take it at ``depth`` (the same tests in the same order; a
    plain dict, list or tuple first: none of the tests before theirs holds for it)."""
    t = type(v)
    if t in PLAIN:
        return v
    if depth < DEPTH_MAX:
        if t is dict:
            return _dict(v, depth, budget)
        if t is list or t is tuple:
            return _sequence(v, depth, budget)
    if isinstance(v, int):  # the base types' own methods: no code of the program runs
        return int.__int__(v)
    if isinstance(v, float):
        return float.__float__(v)
    if isinstance(v, str):
        return str.__str__(v)
    if depth < DEPTH_MAX and isinstance(v, dict):
        return _dict(v, depth, budget)
    if depth < DEPTH_MAX and isinstance(v, (list, tuple)):
        return _sequence(v, depth, budget)
    if depth < ITEM_DEPTH_MAX:
        try:
            item = v.item if hasattr(v, "item") else None
            if callable(item):
                return _snapshot(item(), depth + 1, budget)
        except Exception:
            pass
    return _text(v)


class _Key:
    """A dict key whose text an earlier key of the snapshot has already (``{1: a, "1": b}``,
    two objects with one ``str``): kept apart (hashed by identity), written as its text."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __str__(self) -> str:
        return self.text


def _sequence(v: Any, depth: int, budget: list[int]) -> list | tuple | str:
    n = budget[0]
    try:
        items = _first(v, _limit(n))
    except Exception:
        return _text(v)
    if _plain_only(map(type, items)):  # the common case: no call per item
        budget[0] = n - len(items)
    else:
        out = []
        for x in items:
            if budget[0] <= 0:
                break
            budget[0] -= 1
            out.append(x if type(x) in PLAIN else _snapshot(x, depth + 1, budget))
        items = out
    return tuple(items) if isinstance(v, tuple) else items  # (a new list: _first's or out)


def _dict(v: Any, depth: int, budget: list[int]) -> dict | str:
    n = budget[0]
    limit = _limit(n)
    if type(v) is dict and len(v) <= limit:
        c = v.copy()  # (one C call: another thread may have grown it since len)
        if len(c) <= limit and _plain_only(map(type, c)) and _plain_only(map(type, c.values())):
            budget[0] = n - len(c)  # the common case: no call per item
            return c
        items = list(c.items())[:limit]
    else:
        try:
            items = _first(v, limit)
        except Exception:
            return _text(v)
    out: dict = {}
    for k, x in items:
        if budget[0] <= 0:
            break
        budget[0] -= 1
        if type(k) not in PLAIN:  # the encoder writes str(key): taken now
            try:
                k = str.__str__(str(k))
            except Exception:
                k = f"<{type(k).__name__}>"
        if k in out:
            k = _Key(str(k))
        out[k] = x if type(x) in PLAIN else _snapshot(x, depth + 1, budget)
    return out


def _limit(budget: int) -> int:
    """How many items the next container keeps."""
    return ITEMS_MAX if budget > ITEMS_MAX else max(budget, 0)


def _first(v: Any, n: int) -> list | tuple:
    """The first ``n`` items of a list or tuple, or (key, value) pairs of a dict, as the encoder
    iterates them. A plain one's are taken by one C call where that can be done, so that no
    other thread changes it meanwhile (the program may switch threads between two calls: a
    dict's iterator made by one call and read by the next raised for a dict another thread
    grew)."""
    t = type(v)
    if t is list or t is tuple:
        return v[:n]
    if t is not dict:
        return list(islice(v.items() if isinstance(v, dict) else v, n))
    if len(v) <= n:
        return list(v.items())[:n]  # (sliced: it may have grown since len)
    for _ in range(3):
        try:
            return list(islice(v.items(), n))
        except RuntimeError:  # changed size between the two calls
            pass
    return list(v.items())[:n]  # (one call, but over all of a large dict)


def _text(v: Any) -> str:
    """``repr(v)`` cut at ``TEXT_MAX`` characters (plain lists, tuples and dicts: made only so
    far), ``<TypeName>`` when repr fails."""
    try:
        text = _repr_cut(v) if type(v) in _CONTAINERS else repr(v)
        return str.__str__(text)[:TEXT_MAX]
    except Exception:
        return f"<{type(v).__name__}>"


_CONTAINERS = {list: "[]", tuple: "()", dict: "{}"}


class _Enough(Exception):
    """The text has ``TEXT_MAX`` characters: the rest is not made."""


def _repr_cut(value: Any) -> str:
    """``repr(value)[:TEXT_MAX]`` of a plain list, tuple or dict, made only that far (a deep
    container's repr would be made whole for its first characters)."""
    out: list[str] = []
    size = [0]

    def put(s: str) -> None:
        out.append(s)
        size[0] += len(s)
        if size[0] >= TEXT_MAX:
            raise _Enough

    def walk(x: Any, active: set) -> None:
        t = type(x)
        ends = _CONTAINERS.get(t)
        if ends is None:
            put(repr(x))
            return
        if id(x) in active:  # (as repr marks a container inside itself)
            put(ends[0] + "..." + ends[1])
            return
        active.add(id(x))
        # each item takes at least 3 characters: no more than TEXT_MAX are needed
        items = _first(x, TEXT_MAX)
        put(ends[0])
        for i, item in enumerate(items):
            if i:
                put(", ")
            if t is dict:
                walk(item[0], active)
                put(": ")
                walk(item[1], active)
            else:
                walk(item, active)
        if t is tuple and len(items) == 1:
            put(",")
        put(ends[1])
        active.discard(id(x))

    try:
        walk(value, set())
    except _Enough:
        pass
    return "".join(out)
