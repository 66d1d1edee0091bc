"""GPU utilization, est. SM efficiency and est. achieved occupancy per time bucket (Kineto's).

All three are integrals of step functions over the kernel intervals of one device, computed with a
single sweep over the sorted kernel start/end times (no per-kernel Python loop), then averaged per
bucket. Buckets are ``[edges[i], edges[i+1])`` in the kernels' own clock (ns).

Definitions (the TensorBoard plugin's / Kineto's, so numbers are comparable):

* **GPU utilization** of a bucket = time in the bucket during which at least one kernel runs
  (union of kernel intervals) / bucket length. Memcpy and memset are not kernels and do not count.
* **Est. SM efficiency** of a bucket = ∫ min(Σ blocks-per-SM of the kernels running at t, 1) dt
  over the bucket / bucket length, where a kernel's blocks per SM = blocks / SM count. A kernel
  with fewer blocks than SMs leaves SMs idle; concurrent kernels add up, clipped at 1.
* **Est. achieved occupancy** of a bucket = Σ_k occupancy_k × (time kernel k runs in the bucket) /
  Σ_k (time kernel k runs in the bucket): the mean per-kernel occupancy weighted by kernel time
  (concurrent kernels each count), with the per-kernel occupancy from
  :func:`stepscope.gpu.occupancy.kernel_estimates`. Undefined (NaN) where no kernel runs.

Summaries over a whole window use the same integrals with the window as the only bucket; note the
different denominators: SM efficiency over elapsed time, occupancy over kernel time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_NICE = (1, 2, 5)


def choose_bucket_ns(span_ns: int, *, target_buckets: int = 50, min_ns: int = 1_000) -> int:
    """A 1-2-5 × 10^k ns bucket giving at most ``target_buckets`` buckets over ``span_ns``.

    Called with one step's duration it gives "tens of buckets per step"; with a whole window it
    follows the TensorBoard plugin's rule (a round bucket, at most ~100 of them).
    """
    if target_buckets < 1:
        raise ValueError("target_buckets must be >= 1")
    want = max(int(span_ns) / target_buckets, min_ns)
    exp = 0
    while True:
        for m in _NICE:
            b = m * 10**exp
            if b >= want:
                return int(b)
        exp += 1


def bucket_edges(t0: int, t1: int, bucket_ns: int) -> np.ndarray:
    """Edges aligned to multiples of ``bucket_ns`` covering ``[t0, t1)`` (int64)."""
    if bucket_ns <= 0:
        raise ValueError("bucket_ns must be positive")
    lo = (int(t0) // bucket_ns) * bucket_ns
    hi = -(-int(t1) // bucket_ns) * bucket_ns
    if hi <= lo:
        hi = lo + bucket_ns
    return np.arange(lo, hi + 1, bucket_ns, dtype=np.int64)


def _integrate(
    starts: np.ndarray, ends: np.ndarray, weights: np.ndarray, edges: np.ndarray, clip1: bool
) -> np.ndarray:
    """∫ f over each bucket, f(t) = Σ weights of intervals covering t (clipped to [0,1] if asked).

    The step function's integral F is piecewise linear between event times, so F at the edges is an
    exact linear interpolation.
    """
    if starts.size == 0:
        return np.zeros(edges.size - 1)
    times = np.concatenate([starts, ends]).astype(np.int64)
    deltas = np.concatenate([weights, -weights]).astype(np.float64)
    order = np.argsort(times, kind="stable")
    times = times[order]
    level = np.cumsum(deltas[order])
    # Level after the last event at each distinct time.
    last = np.r_[times[1:] != times[:-1], True]
    times, level = times[last], level[last]
    level = np.where(np.abs(level) < 1e-9, 0.0, level)  # float residue from +w/-w
    if clip1:
        level = np.clip(level, 0.0, 1.0)
    seg = np.diff(times).astype(np.float64) * level[:-1]
    cum = np.r_[0.0, np.cumsum(seg)]
    # interpolate on times relative to the first edge: absolute CUPTI ns (~1.8e18) as float64
    # are only good to ~256 ns, which would skew short buckets by tens of percent
    origin = int(edges[0])
    at_edges = np.interp((edges - origin).astype(np.float64),
                         (times - origin).astype(np.float64), cum)
    return np.diff(at_edges)


@dataclass(frozen=True)
class BucketMetrics:
    edges: np.ndarray  # int64, n+1 edges
    busy_ns: np.ndarray  # union of kernel time per bucket
    kernel_ns: np.ndarray  # sum of kernel time per bucket (concurrent kernels each count)
    utilization: np.ndarray  # busy / bucket length, 0..1
    sm_efficiency: np.ndarray  # 0..1
    achieved_occupancy: np.ndarray  # 0..1, NaN where kernel_ns == 0


def bucket_metrics(
    starts: np.ndarray,
    ends: np.ndarray,
    blocks_per_sm: np.ndarray,
    occupancy: np.ndarray,
    edges: np.ndarray,
) -> BucketMetrics:
    """The three estimates per bucket for one device's kernels (see the module docstring)."""
    s = np.asarray(starts, dtype=np.int64)
    e = np.asarray(ends, dtype=np.int64)
    if s.shape != e.shape:
        raise ValueError("starts and ends differ in length")
    keep = e > s
    s, e = s[keep], e[keep]
    bps = np.asarray(blocks_per_sm, dtype=np.float64)[keep]
    occ = np.asarray(occupancy, dtype=np.float64)[keep]
    edges = np.asarray(edges, dtype=np.int64)
    length = np.diff(edges).astype(np.float64)
    ones = np.ones(s.size)
    busy = _integrate(s, e, ones, edges, clip1=True)
    kernel = _integrate(s, e, ones, edges, clip1=False)
    sm = _integrate(s, e, bps, edges, clip1=True)
    occ_t = _integrate(s, e, occ, edges, clip1=False)
    with np.errstate(divide="ignore", invalid="ignore"):
        achieved = np.where(kernel > 0, occ_t / kernel, np.nan)
    return BucketMetrics(
        edges=edges,
        busy_ns=busy,
        kernel_ns=kernel,
        utilization=busy / length,
        sm_efficiency=sm / length,
        achieved_occupancy=achieved,
    )
