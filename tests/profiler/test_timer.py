import itertools
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
    """Real sleeps: the figures match the waits timed around them, and are at least the sleeps.
    Each step boundary the timer takes lies between the clock reads just before and just after
    its call, so its step times lie within those brackets (a busy machine may preempt the test
    between a call and its read: the brackets hold anyway)."""
    t = StepTimer()
    waits, brackets = [], []  # (read before, read after) of start() and of each step()
    b0 = time.perf_counter()
    t.start()
    brackets.append((b0, time.perf_counter()))
    for _ in range(5):
        r0 = time.perf_counter_ns()
        time.sleep(0.010)  # "loader"
        w = time.perf_counter_ns() - r0
        t.add_reader(w)
        waits.append(w / 1e9)
        time.sleep(0.020)  # "compute"
        b0 = time.perf_counter()
        t.step(num_samples=32)
        brackets.append((b0, time.perf_counter()))
    s = t.stats()
    assert s.steps == 5
    assert s.reader_cost.avg >= 0.010 and s.batch_cost.min >= 0.030
    assert s.reader_cost.avg == pytest.approx(sum(waits) / 5, abs=1e-6)
    assert s.reader_cost.max == pytest.approx(max(waits), abs=1e-6)
    shortest = [b[0] - a[1] for a, b in itertools.pairwise(brackets)]  # each step's bounds
    longest = [b[1] - a[0] for a, b in itertools.pairwise(brackets)]
    steps = [(lo + hi) / 2 for lo, hi in zip(shortest, longest, strict=True)]
    eps = 1e-6  # the timer's ns figures against these float seconds
    assert sum(shortest) / 5 - eps <= s.batch_cost.avg <= sum(longest) / 5 + eps
    assert max(shortest) - eps <= s.batch_cost.max <= max(longest) + eps
    assert s.ips.avg == pytest.approx(1 / s.batch_cost.avg)
    assert s.samples_per_s.avg == pytest.approx(32 / s.batch_cost.avg)
    assert s.reader_ratio == pytest.approx(100 * sum(waits) / sum(steps), abs=1.0)


FIELDS = ("_t0", "_reader", "steps", "_b_sum", "_b_max", "_b_min", "_r_sum", "_r_max", "_r_min",
          "_s_sum", "_s_time", "_s_max", "_s_min")


@pytest.mark.parametrize("seed", range(5))
def test_the_c_counters_keep_the_python_twins_figures(seed):
    """``_fast.StepCounters`` (one C call per step) and ``_PyCounters`` agree field by field
    over random driven steps: waits, zero-length steps, counts as ints and floats, none."""
    import random

    from stepscope.profiler import timer as T
    from stepscope.record.recorder import fast

    if fast is None:
        pytest.skip("the C extension is not loaded")
    rng = random.Random(seed)
    c, py = fast.StepCounters(), T._PyCounters()
    for obj in (c, py):
        assert [getattr(obj, f) for f in FIELDS[:1]] == [None]
    now = 1_000
    c.step(4, now=now), py.step(4, now=now)  # the first step() only opens a step
    for _ in range(300):
        op = rng.random()
        if op < 0.3:
            ns = rng.randrange(0, 5 * MS)
            c.add_reader(ns), py.add_reader(ns)
        elif op < 0.35:
            c.reset(), py.reset()
        else:
            now += rng.choice((0, rng.randrange(1, 50 * MS)))
            samples = rng.choice((None, 32, 7.5, 0))
            if rng.random() < 0.5:
                c.step(samples, now=now), py.step(samples, now=now)
            else:
                c.step(num_samples=samples, now=now), py.step(num_samples=samples, now=now)
        got, want = ([getattr(o, f) for f in FIELDS] for o in (c, py))
        assert got == pytest.approx(want), (got, want)
    t = T.StepTimer()
    assert isinstance(t, fast.StepCounters) and not hasattr(t, "__dict__")
    t.start(now=0)
    t.step(now=7 * MS)
    assert t.stats().batch_cost.avg == pytest.approx(0.007)
    with pytest.raises(TypeError, match="unexpected or repeated"):
        t.step(1, num_samples=2)
    with pytest.raises(TypeError, match="at most 2"):
        t.step(1, 2, 3)
