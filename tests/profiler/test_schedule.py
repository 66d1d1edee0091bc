import pytest

from stepscope.profiler.schedule import (
    ALWAYS,
    NEVER,
    Schedule,
    State,
    coerce,
    from_range,
    schedule,
)

S, W, U, A, D = State.SKIP_FIRST, State.WAIT, State.WARMUP, State.ACTIVE, State.DISABLED


def test_published_composer_table():
    s = schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=1)
    assert s.table(10) == [S, W, U, A, A, W, U, A, A, D]
    recorded = [b for b in range(10) if s.state(b) is A]
    assert recorded == [3, 4, 7, 8]


def test_repeat_zero_is_one_window_then_disabled():
    s = schedule(skip_first=0, wait=2, warmup=1, active=1, repeat=0)
    assert s.table(8) == [W, W, U, A, D, D, D, D]


def test_repeat_minus_one_until_epoch_end():
    s = schedule(skip_first=2, wait=1, warmup=0, active=2, repeat=-1)
    assert s.table(12) == [S, S, W, A, A, W, A, A, W, A, A, W]


def test_last_active_and_window_index():
    s = schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=1)
    assert [b for b in range(10) if s.is_last_active(b)] == [4, 8]
    assert [s.window_index(b) for b in range(10)] == [-1, 0, 0, 0, 0, 1, 1, 1, 1, 2]


def test_stable_until_on_the_published_table():
    """The profiler skips the schedule until the next batch whose state or window changes."""
    s = schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=1)
    # states S W U A A W U A A D: batch 0 -> 1 (wait), 1 -> 2 (warmup), 2 -> 3 (active),
    # 3 and 4 -> 5 (the second window), 5 -> 6, 6 -> 7, 7 and 8 -> 9 (disabled), 9 -> never
    assert [s.stable_until(b) for b in range(10)] == [1, 2, 3, 5, 5, 6, 7, 9, 9, NEVER]
    assert [ALWAYS.stable_until(b) for b in (0, 5)] == [ALWAYS.active] * 2


@pytest.mark.parametrize("repeat", [-1, 0, 2])
def test_stable_until_is_the_next_change(repeat):
    """For every batch b: (state, window) is constant on [b, stable_until(b)) and differs at
    stable_until(b); checked against state()/window_index() on a grid of schedules."""
    import itertools

    def key(s, b):
        st = s.state(b)
        return st, (s.window_index(b) if st is not D else None)

    for sf, w, u, a in itertools.product(range(3), range(3), range(3), range(1, 3)):
        s = Schedule(sf, w, u, a, repeat)
        for b in range(30):
            until = s.stable_until(b)
            assert until > b
            assert all(key(s, x) == key(s, b) for x in range(b, min(until, 40)))
            if until < 40:
                assert key(s, until) != key(s, b), (s, b, until)


def test_paddle_range_shorthand():
    s = from_range(3, 6)
    # warmup one batch before start, record 3, 4, 5, then nothing
    assert s.table(9) == [W, W, U, A, A, A, D, D, D]
    assert from_range(0, 2).table(4) == [A, A, D, D]
    assert coerce((2, 4)) == from_range(2, 4)
    assert coerce([2, 4]) == from_range(2, 4)


def test_always_is_one_window_per_epoch():
    assert ALWAYS.table(5) == [A] * 5
    assert {ALWAYS.window_index(b) for b in (0, 1, 10**9)} == {0}


def test_coerce_dict_and_errors():
    assert coerce({"wait": 1, "active": 3}) == Schedule(wait=1, active=3)
    assert coerce(None) is None
    with pytest.raises(ValueError, match="unknown field"):
        coerce({"wiat": 1})
    with pytest.raises(ValueError, match="active must be >= 1"):
        schedule(active=0)
    with pytest.raises(ValueError, match="repeat must be"):
        schedule(repeat=-2)
    with pytest.raises(ValueError, match="wait must be an integer"):
        schedule(wait=1.5)
    with pytest.raises(ValueError, match="end must be greater"):
        from_range(4, 4)
    with pytest.raises(ValueError, match="expected"):
        coerce("3-5")
