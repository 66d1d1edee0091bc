import time

import pytest

from stepscope.profiler.timer import StepTimer

MS = 1_000_000


def test_exact_figures_with_driven_clock():
    t = StepTimer()
    t.start(now=0)
    # step 1: 10 ms, 2 ms reader, 4 samples; step 2: 30 ms, 6 ms reader, 4 samples;
    # step 3: 20 ms, 4 ms reader, no sample count
    t.add_reader(2 * MS)
    t.step(4, now=10 * MS)
    t.add_reader(6 * MS)
    t.step(4, now=40 * MS)
    t.add_reader(4 * MS)
    t.step(None, now=60 * MS)
    s = t.stats()
    assert s.steps == 3
    assert s.batch_cost.avg == pytest.approx(0.020)
    assert (s.batch_cost.max, s.batch_cost.min) == (pytest.approx(0.030), pytest.approx(0.010))
    assert s.reader_cost.avg == pytest.approx(0.004)
    assert (s.reader_cost.max, s.reader_cost.min) == (pytest.approx(0.006), pytest.approx(0.002))
    assert s.ips.avg == pytest.approx(50.0)  # 3 steps / 60 ms
    assert s.ips.max == pytest.approx(100.0) and s.ips.min == pytest.approx(1 / 0.03)
    # samples/s over the two steps that gave counts: 8 samples / 40 ms
    assert s.samples_per_s.avg == pytest.approx(200.0)
    assert s.samples_per_s.max == pytest.approx(400.0)
    assert s.samples_per_s.min == pytest.approx(4 / 0.03)
    assert s.reader_ratio == pytest.approx(20.0)  # 12 ms of 60 ms
    text = s.format()
    assert "reader_cost: avg 4.000 ms, max 6.000 ms, min 2.000 ms" in text
    assert "reader ratio: 20.00%" in text and "samples/s" in text


def test_no_steps():
    s = StepTimer().stats()
    assert s.steps == 0 and s.samples_per_s is None
    assert "no completed steps" in s.format()


def test_known_sleeps():
    """Real sleeps: the figures match the waits timed around them, and are at least the sleeps."""
    t = StepTimer()
    waits, steps = [], []
    t.start()
    s0 = time.perf_counter()
    for _ in range(5):
        r0 = time.perf_counter_ns()
        time.sleep(0.010)  # "loader"
        w = time.perf_counter_ns() - r0
        t.add_reader(w)
        waits.append(w / 1e9)
        time.sleep(0.020)  # "compute"
        t.step(num_samples=32)
        s1 = time.perf_counter()
        steps.append(s1 - s0)
        s0 = s1
    s = t.stats()
    assert s.steps == 5
    assert s.reader_cost.avg >= 0.010 and s.batch_cost.min >= 0.030
    assert s.reader_cost.avg == pytest.approx(sum(waits) / 5, abs=1e-6)
    assert s.reader_cost.max == pytest.approx(max(waits), abs=1e-6)
    assert s.batch_cost.avg == pytest.approx(sum(steps) / 5, abs=5e-4)
    assert s.batch_cost.max == pytest.approx(max(steps), abs=5e-4)
    assert s.ips.avg == pytest.approx(1 / s.batch_cost.avg)
    assert s.samples_per_s.avg == pytest.approx(32 / s.batch_cost.avg)
    assert s.reader_ratio == pytest.approx(100 * sum(waits) / sum(steps), abs=1.0)
