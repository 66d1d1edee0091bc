"""Whole-array numpy helpers shared by the trace-processor clone and the image writer:
a hash (``mix64``), compact sort keys (``small_key``), and a faster stable argsort
(``stable_order``). They know nothing of traces or SQLite.
"""

from __future__ import annotations

import numpy as np


def mix64(x: np.ndarray) -> np.ndarray:
    """A 64-bit finaliser (splitmix64): hashes whole arrays."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def small_key(a: np.ndarray) -> np.ndarray:
    """``a`` as sort keys in the smallest unsigned type that holds them, same stable order:
    numpy sorts 16-bit keys by radix. Keys with a negative value are returned as they are."""
    if not len(a) or int(a.min()) < 0:
        return a
    top = int(a.max())
    if top < (1 << 16):
        return a.astype(np.uint16)
    return a.astype(np.uint32) if top < (1 << 32) else a


def neighbours(a: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """4096 pairs of neighbours (a[i], a[i + 1]) spread over ``a``, to judge its order on a
    sample; None for arrays under 64K items (they fit in the caches: no need to judge)."""
    n = len(a)
    if n < (1 << 16):
        return None
    at = np.linspace(0, n - 2, 4096).astype(np.int64)
    return a[at], a[at + 1]


def _mostly_ascending(a: np.ndarray) -> bool:
    """Whether ``a`` is close to sorted already (nine in ten sampled neighbours in order):
    timsort then merges long runs, two to four times faster than sorting packed keys."""
    pairs = neighbours(a)
    return pairs is not None and bool((pairs[1] >= pairs[0]).mean() > 0.9)


def stable_order(a: np.ndarray) -> np.ndarray:
    """``np.argsort(a, kind="stable")`` (int64 positions), faster on keys in no particular order.

    Keys above 16 bits are sorted by timsort, which is quick on runs (and so used on keys close
    to sorted already) but takes about 250 ns a key on shuffled ones. Shuffled keys are packed
    with their positions (ties then keep position order, as a stable sort) and the packed values
    sorted by numpy's vectorised quicksort (about 15 ns a key); a key too wide for that is
    sorted in two such passes, by its low bits and then, stably, by its high bits."""
    n = len(a)
    if n < 2:
        return np.arange(n, dtype=np.int64)
    lo, hi = int(a.min()), int(a.max())
    pos_bits = (n - 1).bit_length()
    if hi - lo < (1 << 16):
        return np.argsort(small_key(a - lo), kind="stable")
    room = 63 - pos_bits  # key bits that fit beside a position
    width = (hi - lo).bit_length()
    if width > min(2 * room, 63) or _mostly_ascending(a):  # (63: the differences fit int64)
        return np.argsort(a, kind="stable")
    d = a.astype(np.int64) - lo
    if width > room:
        first = stable_order(d & ((1 << room) - 1))
        return first[stable_order((d >> room)[first])]
    packed = d << pos_bits
    packed |= np.arange(n, dtype=np.int64)
    packed.sort()
    packed &= (1 << pos_bits) - 1
    return packed
