"""A few threads for the analysis' big independent passes.

SQLite, the C loops of the extensions and numpy's large array operations release the GIL, so
independent B-trees (load) and summary tables (analysis) can use several cores.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

MAX_THREADS = 4  # beyond this the shared memory bandwidth and the temporaries stop paying


def cpus() -> int:
    """CPUs this process may run on (its affinity where the OS tells it), at most MAX_THREADS."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        n = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, n))


def in_parallel(fn: Callable[[T], R], items: Sequence[T],
                cost: Callable[[T], int] | None = None) -> list[R]:
    """``[fn(x) for x in items]`` on up to cpus() threads, the costliest items started first;
    results in the order of ``items``. The first exception is raised once all have ended."""
    if len(items) < 2 or cpus() < 2:
        return [fn(x) for x in items]
    order = sorted(range(len(items)), key=lambda i: -cost(items[i])) if cost else \
        range(len(items))
    out: list = [None] * len(items)
    with ThreadPoolExecutor(min(cpus(), len(items))) as ex:
        futures = {i: ex.submit(fn, items[i]) for i in order}
        for i, f in futures.items():
            out[i] = f.result()
    return out


def beside(fn: Callable[[], T], main: Callable[[], R]) -> tuple[T, R]:
    """``(fn(), main())``, with ``fn`` on another thread while ``main`` runs on this one (one
    after the other with a single CPU). An exception of either is raised once both have ended."""
    if cpus() < 2:
        return fn(), main()
    with ThreadPoolExecutor(1) as ex:  # leaving it waits for fn, even when main raises
        other = ex.submit(fn)
        here = main()
    return other.result(), here


_END = object()


def map_ordered(fn: Callable[[T], R], items: Sequence[T]) -> Iterator[R]:
    """``fn(x)`` for each of ``items``, yielded in order while up to cpus() more are computed
    ahead on threads (so at most cpus() + 1 results wait in memory)."""
    k = cpus()
    if len(items) < 2 or k < 2:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(k) as ex:
        ahead: deque[Future] = deque(ex.submit(fn, x) for x in items[:k])
        rest = iter(items[k:])
        while ahead:
            r = ahead.popleft().result()
            x = next(rest, _END)  # one more in flight, before this result is handed over
            if x is not _END:
                ahead.append(ex.submit(fn, x))
            yield r
