"""Training-loop accounting: which steps and batch waits exist, and what they cost.

A loader whose ``iter()`` takes a while, a few batches, then a StopIteration that outlasts a
flush. Times come from a virtual clock (the profiler's ``time``), so every figure is exact and
computed by hand; the flushes are real ones, made while the loader waits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from tracedecode import decode

import stepscope
from stepscope import _schema as S
from stepscope import analysis
from stepscope.analysis import summaries
from stepscope.profiler import Profiler
from stepscope.profiler import profiler as P

MS = 1_000_000


class VirtualTime:
    """The profiler's ``time`` module with a clock that moves only when told (from a real
    reading, so the trace's times stay plausible)."""

    def __init__(self) -> None:
        self.now = time.perf_counter_ns()

    def perf_counter_ns(self) -> int:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


class Loader:
    """``iter()`` costs ``it_ms``; then ``n`` batches of ``batch_ms``; the final StopIteration
    costs ``stop_ms``. ``flush_at``: waits (by index over all passes, the final one included)
    during which the session flushes, as the writer does every second."""

    def __init__(self, clock, prof, n=5, it_ms=200, batch_ms=10, stop_ms=1500, flush_at=()):
        self.clock, self.prof, self.n = clock, prof, n
        self.it_ms, self.batch_ms, self.stop_ms = it_ms, batch_ms, stop_ms
        self.flush_at, self.waits = set(flush_at), 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.clock.now += self.it_ms * MS
        for i in range(self.n + 1):
            if self.waits in self.flush_at:
                self.prof._sess.flush()  # noqa: SLF001 - a real flush, mid-wait
            self.waits += 1
            if i == self.n:
                self.clock.now += self.stop_ms * MS
                return
            self.clock.now += self.batch_ms * MS
            yield i


def _profiler(tmp_path, monkeypatch, **kw):
    clock = VirtualTime()
    monkeypatch.setattr(P, "time", clock)
    prof = Profiler(tmp_path, schedule=None, run_id="r", host_metrics=False, report=False,
                    use_env=False, **kw)
    return prof, clock


def _train(prof, clock, loader, epochs=2, work_ms=30):
    for _ in range(epochs):
        for _batch in prof.dataloader(loader):
            clock.now += work_ms * MS
            prof.step(num_samples=4)


def _tables(path):
    db = analysis.open(str(path), engine="embedded")
    try:
        return {n: summaries.table(db, n).rows for n in ("overview", "steps", "model")}
    finally:
        db.close()


@pytest.mark.parametrize("flush_at", [(5,), (5, 11), (2, 5, 8, 11)],
                         ids=["first-end", "both-ends", "mid-and-ends"])
def test_exhaustion_after_a_flush_writes_no_step_and_counts_iter_as_reader_cost(
        tmp_path, monkeypatch, flush_at):
    """By hand, per epoch: batch 0 waits 200 (iter) + 10 ms, batches 1-4 wait 10 ms; each step
    is its wait + 30 ms of work: 240, 40, 40, 40, 40 ms. Two epochs: 10 steps (not 12), reader
    cost 500 ms in all (avg 50, max 210, min 10), batch cost 800 ms (avg 80, max 240, min 40).
    The waits for the StopIterations (1.5 s, flushed through) are in no step: each is a
    ``dataloader.exhausted`` slice between the steps, the Overview's Dataloader time outside
    them (3 s), and no reader cost."""
    prof, clock = _profiler(tmp_path, monkeypatch)
    prof.start(open_step=False)  # step 0 opens at the first batch wait, before iter()
    start = clock.now
    _train(prof, clock, Loader(clock, prof, flush_at=flush_at))
    prof.stop()

    st = prof.timer_stats()
    assert st.steps == 10
    assert (st.reader_cost.avg, st.reader_cost.max, st.reader_cost.min) == (0.050, 0.210, 0.010)
    assert (st.batch_cost.avg, st.batch_cost.max, st.batch_cost.min) == (0.080, 0.240, 0.040)

    path = tmp_path / "r" / "rank0.summary.pftrace"
    d = decode(path)
    steps = d.by_category(S.CAT_STEP)
    waits = [w for w in d.by_category(S.CAT_DATALOADER) if w.name == S.DATALOADER_WAIT_NAME]
    ends = [(w.ts, w.dur) for w in d.by_category(S.CAT_DATALOADER)
            if w.name == S.DATALOADER_EXHAUSTED_NAME]
    assert [s.name for s in steps] == [f"step {i}" for i in range(10)]
    epoch1 = start + (240 + 4 * 40 + 1500) * MS  # epoch 0's steps, then its final wait
    want_begins = [start + k * 40 * MS + (200 * MS if k else 0) for k in range(5)]
    want_begins += [epoch1 + k * 40 * MS + (200 * MS if k else 0) for k in range(5)]
    assert [s.ts for s in steps] == want_begins
    assert [s.dur for s in steps] == [240 * MS, 40 * MS, 40 * MS, 40 * MS, 40 * MS] * 2
    assert [w.ts for w in waits] == want_begins  # each wait opens its step
    assert [w.dur for w in waits] == [210 * MS, 10 * MS, 10 * MS, 10 * MS, 10 * MS] * 2
    # each epoch's last step ends at 400 ms, and the final wait follows it
    assert ends == [(start + 400 * MS, 1500 * MS), (epoch1 + 400 * MS, 1500 * MS)]

    # the tables: the same figures (within 1 ms: the engine maps CLOCK_MONOTONIC onto the trace
    # clock through the file's clock snapshots, each two clock reads that a loaded machine may
    # preempt; the decoded times above are exact)
    t = _tables(path)
    near = lambda ms: pytest.approx(ms * MS, abs=MS)  # noqa: E731
    overview = {r["kind"]: (r["calls"], r["total_ns"], r["outside_ns"]) for r in t["overview"]}
    assert overview["Step"] == (10, near(800), 0)
    assert overview["Dataloader"] == (12, near(500), near(3000))
    # the Model table's Dataloader instances are the 10 waits in the steps: the final ones are
    # no step's phase
    model = {r["phase"]: r for r in t["model"]}
    assert (model["Dataloader"]["calls"], model["Dataloader"]["cpu_total_ns"]) == (10, near(500))
    assert model["Dataloader"]["cpu_max_ns"] == near(210)
    stats = {r["stat"]: r for r in t["steps"]}
    assert (stats["avg"]["batch_cost_ns"], stats["avg"]["reader_cost_ns"]) == (near(80), near(50))
    assert (stats["max"]["batch_cost_ns"], stats["max"]["reader_cost_ns"]) == (near(240),
                                                                              near(210))


def test_a_started_profiler_counts_iter_in_the_first_batch(tmp_path, monkeypatch):
    """start() opens step 0 at once (50 ms of set-up before the loop is in it); the first
    batch's reader cost is iter() + next(): 200 + 10 ms; the step 50 + 210 + 30 = 290 ms."""
    prof, clock = _profiler(tmp_path, monkeypatch)
    prof.start()
    clock.now += 50 * MS
    _train(prof, clock, Loader(clock, prof, n=2, stop_ms=5), epochs=1)
    prof.stop()
    st = prof.timer_stats()
    assert st.steps == 2
    assert (st.reader_cost.max, st.reader_cost.min) == (0.210, 0.010)
    assert (st.batch_cost.max, st.batch_cost.min) == (0.290, 0.040)
    steps = decode(tmp_path / "r" / "rank0.summary.pftrace").by_category(S.CAT_STEP)
    assert [s.dur for s in steps] == [290 * MS, 40 * MS]


@pytest.mark.parametrize("window", [False, True], ids=["summary", "detail-window"])
def test_a_flush_between_step_and_the_exhausted_loader(tmp_path, monkeypatch, window):
    """A flush right after each step(), before the next batch wait: the step opened by the
    last step() gets no batch (the loader runs dry, 100 ms) and is no step, in a detail window
    too: 2 steps of 240 and 40 ms in the timer, every file and the tables; the final wait is in
    none of them, a ``dataloader.exhausted`` slice after them. (The flush takes the begins'
    placeholders; the begins are written late, at their own times, once their steps get a
    batch; the final wait's too, at once.)"""
    sched = stepscope.schedule(warmup=0, active=100) if window else None
    clock = VirtualTime()
    monkeypatch.setattr(P, "time", clock)
    prof = Profiler(tmp_path, schedule=sched, run_id="r", host_metrics=False, report=False,
                    use_env=False)
    prof.start(open_step=False)
    start = clock.now
    loader = Loader(clock, prof, n=2, stop_ms=100)
    for _ in prof.dataloader(loader):
        clock.now += 30 * MS
        prof.step()
        prof._sess.flush()  # noqa: SLF001 - the writer's periodic flush, right after step()
    prof.stop()
    st = prof.timer_stats()
    assert st.steps == 2 and (st.batch_cost.max, st.batch_cost.min) == (0.240, 0.040)
    files = prof.files
    assert len(files) == (2 if window else 1)  # the window's detail file, the summary file
    for path in files:
        d = decode(path)
        steps = d.by_category(S.CAT_STEP)
        assert [(s.name, s.ts, s.dur) for s in steps] == [
            ("step 0", start, 240 * MS), ("step 1", start + 240 * MS, 40 * MS)]
        waits = d.by_category(S.CAT_DATALOADER)
        assert [(w.name, w.ts, w.dur) for w in waits] == [
            (S.DATALOADER_WAIT_NAME, start, 210 * MS),
            (S.DATALOADER_WAIT_NAME, start + 240 * MS, 10 * MS),
            (S.DATALOADER_EXHAUSTED_NAME, start + 280 * MS, 100 * MS)]
    t = _tables(tmp_path / "r" / "rank0.summary.pftrace")
    overview = {r["kind"]: (r["calls"], r["total_ns"]) for r in t["overview"]}
    assert overview["Step"] == (2, pytest.approx(280 * MS, abs=MS))


class LoggedTime(VirtualTime):
    """The real clock, each reading the profiler makes logged: the hand measurement of what
    the profiler saw, for runs that mix its times with the C recorder's (phases, ranges)."""

    def __init__(self) -> None:
        self.log: list[int] = []

    def perf_counter_ns(self) -> int:
        self.log.append(time.perf_counter_ns())
        return self.log[-1]


def _engine_slices(path, where):
    """(name, dur, depth, parent's name) of the slices ``where`` selects, as the embedded
    engine nests them (it sorts each track's events by time first, as trace processor does)."""
    db = analysis.open(str(path), engine="embedded")
    try:
        rows = db.query("select s.name, s.dur, s.depth, p.name as parent from slice s left "
                        f"join slice p on p.id = s.parent_id where {where} order by s.ts")
        return [(r["name"], r["dur"], r["depth"], r["parent"]) for r in rows]
    finally:
        db.close()


def _track_names(path, category):
    """The names of the tracks that hold the slices of ``category``."""
    db = analysis.open(str(path), engine="embedded")
    try:
        return [r["name"] for r in db.query(
            "select distinct t.name from slice s join track t on t.id = s.track_id "
            f"where s.category = '{category}'")]
    finally:
        db.close()


@pytest.mark.parametrize("window", [False, True], ids=["summary", "detail-window"])
def test_a_kept_phase_after_a_flush_stays_in_a_step_that_starts_on_time(tmp_path, monkeypatch,
                                                                       window):
    """A phase object kept across steps records without the profiler seeing it; a flush
    between step() and the phase takes the step's placeholder. The step still begins at the
    time step() read (not at the phase, after the flush), the phase nests in it, and detail
    ranges recorded after the flush too. Steps, phases and ranges: 3 each; then a tail with a
    range and flushes in it (no step() ends it): no step 3, the range at depth 0."""
    sched = stepscope.schedule(warmup=0, active=100) if window else None
    clock = LoggedTime()
    monkeypatch.setattr(P, "time", clock)
    prof = Profiler(tmp_path, schedule=sched, run_id="r", host_metrics=False, report=False,
                    use_env=False)
    prof.start()
    bounds = [clock.log[-1]]  # the reading that opened step 0
    ph = prof.phase("forward")
    for i in range(3):
        prof._sess.flush()  # noqa: SLF001 - the writer's flush, before the step's first event
        with ph:
            with stepscope.annotate(f"user {i}"):
                time.sleep(0.002)
        prof.step()
        bounds.append(clock.log[-1])
    with stepscope.annotate("tail"):  # the time after the last step: checkpointing, say
        prof._sess.flush()  # noqa: SLF001
    prof._sess.flush()  # noqa: SLF001
    prof.stop()
    st = prof.timer_stats()
    want = [(f"step {i}", bounds[i], bounds[i + 1] - bounds[i]) for i in range(3)]
    assert st.steps == 3
    assert st.batch_cost.max == max(w[2] for w in want) / 1e9
    summary = tmp_path / "r" / "rank0.summary.pftrace"
    assert prof.files[-1] == summary and len(prof.files) == (2 if window else 1)
    for path in prof.files:
        d = decode(path)
        assert [(s.name, s.ts, s.dur) for s in d.by_category(S.CAT_STEP)] == want
        phases = d.by_category(S.CAT_PHASE)
        assert len(phases) == 3
        for (_, b, dur), p in zip(want, phases, strict=True):
            assert b < p.ts and p.ts + p.dur < b + dur
        # the embedded engine's nesting: the steps on their own track, the phases on the
        # thread's, each inside its step's time (above)
        assert _engine_slices(path, f"s.category = '{S.CAT_STEP}'") == [
            (name, dur, 0, None) for name, _, dur in want]
        assert [s[2:] for s in _engine_slices(path, f"s.category = '{S.CAT_PHASE}'")] == [
            (0, None)] * 3
        assert _track_names(path, S.CAT_STEP) == [S.STEPS_TRACK_NAME]
    users = decode(prof.files[0]).slices if window else []
    assert [u.name for u in users if u.category == ""] == (
        ["user 0", "user 1", "user 2", "tail"] if window else [])
    if window:
        users = _engine_slices(prof.files[0], "s.name like 'user %' or s.name = 'tail'")
        assert [(n, dep, par) for n, _, dep, par in users] == [
            ("user 0", 1, "forward"), ("user 1", 1, "forward"), ("user 2", 1, "forward"),
            ("tail", 0, None)]
    t = _tables(summary)
    overview = {r["kind"]: (r["calls"], r["total_ns"]) for r in t["overview"]}
    total = bounds[3] - bounds[0]
    assert overview["Step"] == (3, pytest.approx(total, abs=MS))


@pytest.mark.skipif(os.environ.get("STEPSCOPE_PURE_PYTHON", "") not in ("", "0")
                    or P.rec.fast is None, reason="this run already is the pure one")
def test_the_loop_accounting_holds_on_the_pure_python_recorder():
    """The placeholders, their in-place writes and the late begins take another path there
    (a Python list under the session's lock)."""
    env = dict(os.environ, STEPSCOPE_PURE_PYTHON="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           __file__, "-k", "not pure_python"], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout


def test_the_tail_after_the_last_step_is_no_step_even_across_flushes(tmp_path, monkeypatch):
    """After the last step(), 3 s of checkpointing with flushes in it: no step 3."""
    prof, clock = _profiler(tmp_path, monkeypatch)
    prof.start()
    for _ in range(3):
        clock.now += 20 * MS
        prof.step()
    for _ in range(3):
        clock.now += 1000 * MS
        prof._sess.flush()  # noqa: SLF001
    prof.stop()
    assert prof.timer_stats().steps == 3
    steps = decode(tmp_path / "r" / "rank0.summary.pftrace").by_category(S.CAT_STEP)
    assert [(s.name, s.dur) for s in steps] == [(f"step {i}", 20 * MS) for i in range(3)]


def test_cached_phases_and_ranges_stay_inside_their_step_across_flushes(tmp_path):
    """A phase object kept by the program records without the profiler seeing it, and ranges
    record in detail windows: a flush between step() and them writes the step's begin first
    (real clock: the nesting is what is checked)."""
    prof = Profiler(tmp_path, schedule=stepscope.schedule(warmup=0, active=100), run_id="r",
                    host_metrics=False, report=False, use_env=False)
    prof.start()
    fwd = prof.phase("Forward")
    for i in range(4):
        prof._sess.flush()  # noqa: SLF001 - between step() and the step's first event
        with fwd:
            with stepscope.annotate(f"user {i}"):
                pass
        prof.step()
    prof.stop()
    for path in prof.files:
        d = decode(path)
        steps = d.by_category(S.CAT_STEP)
        phases = d.by_category(S.CAT_PHASE)
        assert [s.name for s in steps] == [f"step {i}" for i in range(4)]
        assert len(phases) == 4
        for st, ph in zip(steps, phases, strict=True):
            assert st.ts <= ph.ts and ph.ts + ph.dur <= st.ts + st.dur
        users = [s for s in d.slices if s.category == ""]
        for st, u in zip(steps, users, strict=False):
            assert st.ts <= u.ts and u.ts + u.dur <= st.ts + st.dur


def test_a_step_only_loop_does_not_scan_the_whole_step(tmp_path, monkeypatch):
    """Review 4: with only step() (no phase, no loader), step() looked for the step's
    placeholder back over every event of the step (10-27 ms a step with 100k events, under the
    lock). The lookback is bounded; a step with more events has its begin written late, and
    the steps still enclose their ranges."""
    looked = []
    withdraw = P._replace

    def counting(old, ts, ident, new, lookback=P._ALL):
        looked.append(lookback)
        return withdraw(old, ts, ident, new, lookback)

    monkeypatch.setattr(P, "_replace", counting)
    prof = Profiler(tmp_path, schedule=stepscope.schedule(warmup=0, active=100), run_id="r",
                    host_metrics=False, report=False, use_env=False)
    prof.start()
    prof.step()
    for n in (10, 3 * P._STEP_LOOKBACK, 10):  # ranges in steps 1, 2, 3 (start() opened 0)
        for _ in range(n):
            with stepscope.annotate("user"):
                pass
        prof.step()
    prof.stop()
    assert looked and max(looked) == P._STEP_LOOKBACK == 4096
    d = decode(tmp_path / "r" / "rank0.summary.pftrace")
    assert [s.name for s in d.by_category(S.CAT_STEP)] == [f"step {i}" for i in range(4)]
    (detail,) = [f for f in prof.files if "summary" not in str(f)]
    d = decode(detail)
    steps = d.by_category(S.CAT_STEP)
    assert [s.name for s in steps] == [f"step {i}" for i in range(4)]
    users = sorted((s for s in d.slices if s.category == ""), key=lambda s: s.ts)
    assert len(users) == 10 + 3 * 4096 + 10
    for st, lo, hi in zip(steps[1:], (0, 10, 10 + 3 * 4096), (10, 10 + 3 * 4096, len(users)),
                          strict=True):
        assert all(st.ts <= u.ts and u.ts + u.dur <= st.ts + st.dur for u in users[lo:hi])


def test_the_loader_wrapper_keeps_len_and_attributes(tmp_path):
    prof = Profiler(tmp_path, schedule=None, run_id="r", timer_only=True, report=False,
                    use_env=False)
    prof.start()

    class WithLen(list):
        batch_size = 32

    wrapped = prof.dataloader(WithLen([1, 2, 3]))
    assert len(wrapped) == 3 and wrapped.batch_size == 32
    assert list(wrapped) == [1, 2, 3] and list(wrapped) == [1, 2, 3]  # a new pass each time
    gen = prof.dataloader(x for x in "ab")
    with pytest.raises(TypeError):
        len(gen)  # the loader has none: len() says so, as on the loader itself
    assert next(gen) == "a" and list(gen) == ["b"]  # next() on the wrapper, then go on
    assert len(stepscope.dataloader(WithLen([1, 2]))) == 2  # the running profiler's
    prof.stop()


def test_next_on_the_wrapper_then_for_loops_each_get_a_full_epoch(tmp_path):
    """Review 1: after one next() on the wrapper, the next ``for`` goes on from there, and
    every later ``for`` starts a new pass (it used to get the spent generator: an empty epoch)."""
    prof = Profiler(tmp_path, schedule=None, run_id="r", timer_only=True, report=False,
                    use_env=False)
    prof.start()
    wrapped = prof.dataloader([1, 2, 3])
    assert next(wrapped) == 1
    assert list(wrapped) == [2, 3]  # the pass next() began
    assert list(wrapped) == [1, 2, 3] and list(wrapped) == [1, 2, 3]  # then new passes
    assert next(wrapped) == 1 and next(wrapped) == 2  # next() begins its own pass again
    assert list(wrapped) == [3]
    prof.stop()


def test_a_session_stopped_from_elsewhere_ends_a_step_begun_late(tmp_path, monkeypatch):
    """A flush between step() and a phase, then the session stops under the profiler (the
    exit path, a signal): step 1, begun late, ends there, like the slices the session ends
    itself; no slice is left open in the file."""
    import perfetto_decode

    clock = LoggedTime()
    monkeypatch.setattr(P, "time", clock)
    prof = Profiler(tmp_path, schedule=None, run_id="r", host_metrics=False, report=False,
                    use_env=False)
    prof.start()
    prof.step()
    t1 = clock.log[-1]
    prof._sess.flush()  # noqa: SLF001
    with prof.phase("forward"):
        pass
    before = time.perf_counter_ns()
    prof._sess.stop()  # noqa: SLF001 - as the exit flush does
    after = time.perf_counter_ns()
    prof.stop()
    path = tmp_path / "r" / "rank0.summary.pftrace"
    d = perfetto_decode.decode(str(path))
    thread = next(u for u, t in d.tracks.items() if t.HasField("thread"))
    track = next(u for u, t in d.tracks.items()
                 if t.parent_uuid == thread and t.name == S.STEPS_TRACK_NAME)
    steps = [s for s in d.slices(track) if s[0].startswith("step")]  # asserts none is open
    assert [s[0] for s in steps] == ["step 0", "step 1"]
    assert steps[1][2] == t1 and before <= steps[1][3] <= after


def test_waits_on_another_thread_overtaken_by_a_flush_keep_their_times(tmp_path, monkeypatch):
    """A loader iterated by another thread (a prefetcher), a flush inside every wait: each
    wait is written late, on that thread's track, at its own time: 210, 10, 10 ms, and the
    final one that found the loader exhausted, 5 ms; no step comes from that thread."""
    prof, clock = _profiler(tmp_path, monkeypatch)
    prof.start()
    loader = Loader(clock, prof, n=3, stop_ms=5, flush_at=(0, 1, 2, 3))
    start = clock.now
    worker = threading.Thread(target=lambda: list(prof.dataloader(loader)), name="prefetch")
    worker.start()
    worker.join()
    prof.step()
    prof.stop()
    d = decode(tmp_path / "r" / "rank0.summary.pftrace")
    waits = d.by_category(S.CAT_DATALOADER)
    assert {d.thread_name(w.track) for w in waits} == {"prefetch"}
    assert [(w.name, w.ts - start, w.dur) for w in waits] == [
        (S.DATALOADER_WAIT_NAME, 0, 210 * MS), (S.DATALOADER_WAIT_NAME, 210 * MS, 10 * MS),
        (S.DATALOADER_WAIT_NAME, 220 * MS, 10 * MS),
        (S.DATALOADER_EXHAUSTED_NAME, 230 * MS, 5 * MS)]
    steps = d.by_category(S.CAT_STEP)
    assert [(s.name, s.ts, s.dur) for s in steps] == [("step 0", start, 235 * MS)]


class _SlowWindows:
    """A producer hook whose window start and end take 7 and 11 ms of the virtual clock (as
    torch's profiler and CUPTI switched on, and their events converted, do for real)."""

    def __init__(self, clock) -> None:
        self.clock = clock

    def window_start(self) -> None:
        self.clock.now += 7 * MS

    def window_end(self) -> None:
        self.clock.now += 11 * MS


def test_a_windows_start_and_end_lie_between_the_steps(tmp_path, monkeypatch):
    """Schedule wait 1, warmup 1, active 2: batches 2-3 are the window. Each step's own work is
    2 ms; the profiler's window start (7 ms) and end (11 ms) are its own, as torch.profiler
    keeps its own between its ProfilerStep ranges: slices 'stepscope window start' and
    'stepscope window end' between the steps on their track, and every step, in the summary
    file and in the window's, lasts its 2 ms (before: 9 ms for step 2 and 13 ms for
    step 4, the profiler's time billed as the step's "Others")."""
    clock = VirtualTime()
    monkeypatch.setattr(P, "time", clock)
    prof = Profiler(tmp_path, schedule=stepscope.schedule(wait=1, warmup=1, active=2),
                    run_id="r", host_metrics=False, report=False, use_env=False, torch=False)
    prof.start()
    prof.hooks.append(_SlowWindows(clock))
    start = clock.now
    for _ in range(6):
        clock.now += 2 * MS
        prof.step()
    prof.stop()

    d = decode(tmp_path / "r" / "rank0.summary.pftrace")
    steps_ = d.by_category(S.CAT_STEP)
    own = d.by_category(S.CAT_STEPSCOPE)
    assert [s.dur for s in steps_] == [2 * MS] * 6
    begin_2, end_3 = start + 4 * MS, start + 15 * MS  # (steps 0, 1; then 7 ms; steps 2, 3)
    assert [(s.name, s.ts, s.dur) for s in own] == [
        ("stepscope window start", begin_2, 7 * MS), ("stepscope window end", end_3, 11 * MS)]
    assert [s.ts for s in steps_] == [start, start + 2 * MS, begin_2 + 7 * MS, begin_2 + 9 * MS,
                                      end_3 + 11 * MS, end_3 + 13 * MS]
    assert {s.track for s in own} == {s.track for s in steps_}  # the thread's steps track
    # the embedded engine nests none in another: each slice ends where the next begins
    assert [(n, dep) for n, _, dep, _ in _engine_slices(
        tmp_path / "r" / "rank0.summary.pftrace",
        f"s.category in ('{S.CAT_STEP}', '{S.CAT_STEPSCOPE}')")] == [
        ("step 0", 0), ("step 1", 0), ("stepscope window start", 0), ("step 2", 0),
        ("step 3", 0), ("stepscope window end", 0), ("step 4", 0), ("step 5", 0)]
    window = decode(tmp_path / "r" / "rank0.detail.0.pftrace")
    assert [(s.name, s.dur) for s in window.by_category(S.CAT_STEP)] == [
        ("step 2", 2 * MS), ("step 3", 2 * MS)]
    # the tables count the steps' time, not the profiler's
    stats = {r["stat"]: r for r in _tables(tmp_path / "r" / "rank0.summary.pftrace")["steps"]}
    assert stats["max"]["batch_cost_ns"] == pytest.approx(2 * MS, abs=MS // 10)


def test_a_window_open_at_start_is_before_step_0_and_one_from_epoch_is_in_its_step(
        tmp_path, monkeypatch):
    """Schedule active=1 from batch 0 of each epoch. The first window starts in start(),
    before step 0 (7 ms); each window ends between steps (11 ms). The second epoch's window is
    switched on by epoch(), inside the step that the last step() opened: that 7 ms is the
    step's (10 ms in all, with the program's 1 ms there), its slice nested in it."""
    clock = VirtualTime()
    monkeypatch.setattr(P, "time", clock)
    prof = Profiler(tmp_path, schedule=stepscope.schedule(warmup=0, active=1), run_id="r",
                    host_metrics=False, report=False, use_env=False, torch=False)
    prof.hooks.append(_SlowWindows(clock))
    start = clock.now
    prof.start()
    for epoch in range(2):
        if epoch:
            clock.now += 1 * MS  # the program's own work at the top of the epoch
        prof.epoch()  # (a no-op in the first epoch, at its batch 0)
        for _ in range(2):
            clock.now += 2 * MS
            prof.step()
    prof.stop()

    d = decode(tmp_path / "r" / "rank0.summary.pftrace")
    own = [(s.name, s.ts - start, s.dur) for s in d.by_category(S.CAT_STEPSCOPE)]
    assert own == [("stepscope window start", 0, 7 * MS),
                   ("stepscope window end", 9 * MS, 11 * MS),
                   ("stepscope window start", 23 * MS, 7 * MS),
                   ("stepscope window end", 32 * MS, 11 * MS)]
    steps_ = [(s.name, s.ts - start, s.dur) for s in d.by_category(S.CAT_STEP)]
    assert steps_ == [("step 0", 7 * MS, 2 * MS), ("step 1", 20 * MS, 2 * MS),
                      ("step 2", 22 * MS, 10 * MS), ("step 3", 43 * MS, 2 * MS)]
    # the second epoch's window start is nested in step 2, which holds it
    nested = _engine_slices(tmp_path / "r" / "rank0.summary.pftrace",
                            "s.name = 'stepscope window start'")
    assert [(dep, parent) for _, _, dep, parent in nested] == [(0, None), (1, "step 2")]


@pytest.mark.parametrize("span", ["phase", "range"])
def test_a_range_that_spans_steps_leaves_each_step_whole(tmp_path, monkeypatch, span):
    """A phase (summary level), or a user range in a detail window, around the whole loop, and
    step() inside it: a track holds slices that nest, and these cannot, so the steps have a
    track of their own. Before, step 0's end closed the spanning range, and the range's end
    step 3: step 0 lasted the whole loop (the Steps table's max, and "Others" over 100 %).
    Each of 3 steps: 1 ms of Forward, then 3 ms; the steps are the clock readings the profiler
    made at step() (the hand measurement)."""
    clock = LoggedTime()
    monkeypatch.setattr(P, "time", clock)
    window = stepscope.schedule(warmup=0, active=5) if span == "range" else None
    prof = Profiler(tmp_path, schedule=window, run_id="r", host_metrics=False, report=False,
                    use_env=False, torch=False)
    prof.start()
    bounds = [clock.log[-1]]  # the reading that opened step 0
    outer = prof.phase("train") if span == "phase" else stepscope.annotate("train")
    with outer:
        for _ in range(3):
            with prof.phase("Forward"):
                time.sleep(0.001)
            time.sleep(0.003)
            prof.step()
            bounds.append(clock.log[-1])
    prof.stop()

    want = [(f"step {i}", bounds[i + 1] - bounds[i], 0, None) for i in range(3)]
    for path in prof.files:
        assert _engine_slices(path, f"s.category = '{S.CAT_STEP}'") == want
        assert [s.ts for s in decode(path).by_category(S.CAT_STEP)] == bounds[:3]
        assert _track_names(path, S.CAT_STEP) == [S.STEPS_TRACK_NAME]
        if span == "range" and "detail" not in path.name:
            assert [s for s in decode(path).slices if s.name == "train"] == []  # (detail)
            continue
        (train,) = [s for s in decode(path).slices if s.name == "train"]
        assert train.ts < bounds[0] + (bounds[1] - bounds[0]) and train.ts + train.dur > bounds[3]
        assert _engine_slices(path, "s.name = 'train'") == [("train", train.dur, 0, None)]
        fwd = _engine_slices(path, "s.name = 'Forward'")
        assert [(depth, parent) for _, _, depth, parent in fwd] == [(1, "train")] * 3
    t = _tables(tmp_path / "r" / "rank0.summary.pftrace")
    stats = {r["stat"]: r for r in t["steps"]}
    assert stats["max"]["batch_cost_ns"] == pytest.approx(max(w[1] for w in want), abs=MS // 10)
