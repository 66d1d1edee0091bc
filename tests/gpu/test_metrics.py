"""Utilization / est. SM efficiency / est. achieved occupancy per bucket, by hand."""

from __future__ import annotations

import numpy as np
import pytest

from stepscope.gpu import metrics
from stepscope.gpu.metrics import bucket_edges, bucket_metrics, choose_bucket_ns

# K1 runs [0, 6000) with 0.5 blocks/SM and occupancy 0.25;
# K2 runs [4000, 9000) with 0.75 blocks/SM and occupancy 0.5 (they overlap in [4000, 6000)).
STARTS = [0, 4000]
ENDS = [6000, 9000]
BPS = [0.5, 0.75]
OCC = [0.25, 0.5]


def test_two_overlapping_kernels_in_one_10us_bucket():
    m = bucket_metrics(STARTS, ENDS, BPS, OCC, np.array([0, 10_000]))
    # union [0, 9000) = 9000 ns of 10000
    assert m.busy_ns.tolist() == [9000.0]
    assert m.utilization.tolist() == [0.9]
    # SM efficiency: [0,4000) 0.5 -> 2000; [4000,6000) min(1.25, 1) -> 2000; [6000,9000) 0.75 ->
    # 2250; 6250 / 10000
    assert m.sm_efficiency[0] == pytest.approx(0.625)
    # occupancy weighted by kernel time: (0.25*6000 + 0.5*5000) / 11000
    assert m.kernel_ns.tolist() == [11000.0]
    assert m.achieved_occupancy[0] == pytest.approx(4000 / 11000)


def test_same_kernels_in_two_5us_buckets_and_an_idle_one():
    m = bucket_metrics(STARTS, ENDS, BPS, OCC, np.array([0, 5000, 10_000, 15_000]))
    assert m.utilization.tolist() == [1.0, 0.8, 0.0]
    # bucket 0: 0.5*4000 + 1*1000 = 3000; bucket 1: 1*1000 + 0.75*3000 = 3250
    np.testing.assert_allclose(m.sm_efficiency, [0.6, 0.65, 0.0])
    # bucket 0: (0.25*5000 + 0.5*1000) / 6000; bucket 1: (0.25*1000 + 0.5*4000) / 5000
    np.testing.assert_allclose(m.achieved_occupancy[:2], [1750 / 6000, 2250 / 5000])
    assert np.isnan(m.achieved_occupancy[2])


def test_concurrent_sm_efficiency_is_clipped_and_nested_kernels_count_once_for_busy():
    # a long kernel [0, 10000) bps 0.8 with a nested one [2000, 3000) bps 0.8
    m = bucket_metrics([0, 2000], [10_000, 3000], [0.8, 0.8], [1.0, 0.5], np.array([0, 10_000]))
    assert m.utilization.tolist() == [1.0]
    # 0.8 * 9000 + 1.0 * 1000 = 8200
    assert m.sm_efficiency[0] == pytest.approx(0.82)
    assert m.achieved_occupancy[0] == pytest.approx((10_000 * 1.0 + 1000 * 0.5) / 11_000)


def test_kernels_sharing_a_boundary_and_zero_length_kernels():
    m = bucket_metrics([0, 5000, 7000], [5000, 10_000, 7000], [1, 1, 1], [1, 1, 1], [0, 10_000])
    assert m.utilization.tolist() == [1.0]
    assert m.kernel_ns.tolist() == [10_000.0]


def test_no_kernels():
    m = bucket_metrics([], [], [], [], np.array([0, 1000, 2000]))
    assert m.utilization.tolist() == [0.0, 0.0]
    assert np.isnan(m.achieved_occupancy).all()


def test_bucket_choice_and_edges():
    assert choose_bucket_ns(1_500_000) == 50_000  # 1.5 ms step -> 30 buckets of 50 us
    assert choose_bucket_ns(1_000_000, target_buckets=100) == 10_000
    assert choose_bucket_ns(10) == 1_000
    assert bucket_edges(1234, 25_000, 10_000).tolist() == [0, 10_000, 20_000, 30_000]
    assert bucket_edges(20_000, 20_000, 10_000).tolist() == [20_000, 30_000]
    with pytest.raises(ValueError):
        bucket_edges(0, 1, 0)


def test_short_buckets_on_absolute_cupti_times_are_exact():
    """Absolute CUPTI REALTIME ns (~1.8e18) lose ~256 ns as float64: integrate relative times."""
    base = 1_795_341_789_415_826_808
    starts = np.array([base + 100, base + 2_150], dtype=np.int64)
    ends = np.array([base + 1_100, base + 2_650], dtype=np.int64)
    edges = np.array([base, base + 2_000, base + 4_000], dtype=np.int64)
    busy = metrics._integrate(starts, ends, np.ones(2), edges, clip1=True)
    assert busy.tolist() == [1000.0, 500.0]
