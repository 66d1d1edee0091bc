"""Profiler in-process: levels per schedule window, steps/phases/loader slices, host counters."""

import time

import pytest
from tracedecode import decode

import stepscope
from stepscope import _schema as S
from stepscope.profiler import Profiler, schedule


def _user_ranges(d):
    return sorted(s.name for s in d.slices if s.category == "")


def _train(prof, batches, epoch_of=None, sleep=0.002):
    for i, _ in enumerate(prof.dataloader(range(batches))):
        with prof.phase(S.PHASE_FORWARD):
            with stepscope.annotate(f"user {i}"):
                time.sleep(sleep)
        nxt = epoch_of(i + 1) if epoch_of else None
        prof.step(num_samples=4, epoch=nxt)


def test_detail_only_inside_windows(tmp_path):
    ready = []
    prof = Profiler(tmp_path, schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=1),
                    on_trace_ready=ready.append, run_id="r", host_metrics=False, report=False)
    prof.start()
    _train(prof, 10)
    files = prof.stop()
    run = tmp_path / "r"
    d0, d1 = run / "rank0.detail.0.pftrace", run / "rank0.detail.1.pftrace"
    summary = run / "rank0.summary.pftrace"
    assert files == [d0, d1, summary]
    assert ready == [[d0], [d1], [summary]]  # each file once, as soon as it is finished

    s = decode(summary)
    steps = [x for x in s.slices if x.category == S.CAT_STEP]
    # 10 batches: the step opened by the 10th step() only waited for the exhausted loader, so
    # it was withdrawn, and that wait is a slice of its own after the last step
    assert [x.name for x in steps] == [f"step {i}" for i in range(10)]
    assert all(x.dur is not None and x.dur > 0 for x in steps)
    assert steps[3].args == {"step": 3, "epoch": 0, "num_samples": 4}
    assert _user_ranges(s) == []  # user ranges are detail level
    assert len(s.by_category(S.CAT_PHASE)) == 10
    loader = s.by_category(S.CAT_DATALOADER)
    assert [x.name for x in loader] == [S.DATALOADER_WAIT_NAME] * 10 + [
        S.DATALOADER_EXHAUSTED_NAME]
    assert loader[-1].ts >= steps[-1].ts + steps[-1].dur
    # phases nest inside their step
    for ph, st in zip(s.by_category(S.CAT_PHASE), steps, strict=False):
        assert st.ts <= ph.ts and ph.ts + ph.dur <= st.ts + st.dur

    for path, recorded in ((d0, [3, 4]), (d1, [7, 8])):
        d = decode(path)
        assert _user_ranges(d) == [f"user {i}" for i in recorded]  # not warmup 2 / 6
        assert [x.name for x in d.slices if x.category == S.CAT_STEP] == [
            f"step {i}" for i in recorded]
        assert d.processes == s.processes


def test_epochs_restart_the_schedule(tmp_path):
    prof = Profiler(tmp_path, schedule(skip_first=1, warmup=1, active=2), run_id="r",
                    host_metrics=False, report=False)
    prof.start()
    _train(prof, 12, epoch_of=lambda i: i // 6)  # epochs of 6 batches: steps 0-5, 6-11
    prof.stop()
    run = tmp_path / "r"
    got = [_user_ranges(decode(run / f"rank0.detail.{k}.pftrace")) for k in (0, 1)]
    assert got == [["user 2", "user 3"], ["user 8", "user 9"]]
    assert not (run / "rank0.detail.2.pftrace").exists()
    steps = decode(run / "rank0.summary.pftrace").by_category(S.CAT_STEP)
    assert [x.args["epoch"] for x in steps[:12]] == [0] * 6 + [1] * 6


def test_epoch_method_at_top_of_each_epoch(tmp_path):
    prof = Profiler(tmp_path, schedule(warmup=0, active=1), run_id="r", host_metrics=False,
                    report=False)
    prof.start()
    for _ in range(2):
        prof.epoch()  # first call: no-op (epoch 0 has no batch yet)
        for _ in prof.dataloader(range(3)):
            with stepscope.annotate(f"user {prof.step_num}"):
                pass
            prof.step()
    prof.stop()
    run = tmp_path / "r"
    steps = decode(run / "rank0.summary.pftrace").by_category(S.CAT_STEP)
    assert [x.args["epoch"] for x in steps] == [0, 0, 0, 1, 1, 1]
    assert [x.name for x in steps] == [f"step {i}" for i in range(6)]
    for k, i in ((0, 0), (1, 3)):
        d = decode(run / f"rank0.detail.{k}.pftrace")
        assert _user_ranges(d) == [f"user {i}"]
        assert [x.name for x in d.by_category(S.CAT_STEP)] == [f"step {i}"]


def test_summary_only_and_no_schedule(tmp_path):
    prof = Profiler(tmp_path, schedule=None, run_id="r", host_metrics=False, report=False)
    prof.start()
    _train(prof, 3)
    prof.stop()
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["rank0.summary.pftrace"]


def test_host_counters_present_and_sane(tmp_path):
    prof = Profiler(tmp_path, schedule=None, run_id="r", sample_interval_s=0.05, report=False)
    c0, t0 = time.process_time(), time.perf_counter()
    t_start = time.perf_counter_ns()
    prof.start()
    t_end = time.perf_counter() + 0.35
    while time.perf_counter() < t_end:
        sum(range(2000))
        prof.step()
        time.sleep(0)  # let the sampler thread have the GIL
    prof.stop()
    t_stopped = time.perf_counter_ns()  # the trace's clock (CLOCK_MONOTONIC)
    measured = 100 * (time.process_time() - c0) / (time.perf_counter() - t0)
    d = decode(tmp_path / "r" / "rank0.summary.pftrace")
    c = d.counters
    for name in (S.HOST_CPU_USER, S.HOST_CPU_SYSTEM, S.HOST_CPU_IDLE, S.HOST_PROCESS_CPU,
                 S.HOST_PROCESS_RSS, S.HOST_MEMORY_USED, S.HOST_PROCESS_CTX_SWITCHES,
                 S.HOST_SAMPLER_CPU):
        assert len(c.get(name, ())) >= 3, (name, sorted(c), prof.sampler_cost)
    assert all(0 <= v <= 100 for _, v in c[S.HOST_CPU_USER] + c[S.HOST_CPU_IDLE])
    cpu = [v for _, v in c[S.HOST_PROCESS_CPU]]
    assert abs(sum(cpu) / len(cpu) - measured) < 25.0, (cpu, measured)  # the busy loop
    assert min(v for _, v in c[S.HOST_PROCESS_RSS]) > 10 << 20
    # counters are on tracks under the rank's process, inside the run: from the sampler's
    # first reading in start() (the first rate over an interval is stamped at its start, a
    # little before the first step begins, at start()'s end) to stop(), where the last sample
    # is taken. The last step may end long before that: in a full-suite run, ~250 ms once
    # passed between the loop's last step() and stop(), the sampler silent too; the step then
    # open had no work, so it is in no file.
    pid = next(iter(d.processes))
    steps = d.by_category(S.CAT_STEP)
    assert len(steps) == prof.timer.steps  # every step of the loop is in the file
    for name, samples in c.items():
        track = next(t for t in d.tracks.values() if t.name == name)
        assert d.track_pid(track.uuid) == pid
        lo, hi = t_start, t_stopped
        assert all(lo <= ts <= hi for ts, _ in samples), (name, lo, hi, [ts for ts, _ in samples])
        if name in (S.HOST_PROCESS_RSS, S.HOST_MEMORY_USED):  # (read at a time: not before)
            assert samples[0][0] > steps[0].ts
    assert prof.sampler_cost.samples >= 4


def test_timer_only_writes_nothing(tmp_path):
    prof = Profiler(tmp_path, timer_only=True, run_id="r", report=False)
    prof.start()
    t0 = time.perf_counter()
    for _ in prof.dataloader(range(4)):
        time.sleep(0.005)
        prof.step(num_samples=2)
    elapsed = time.perf_counter() - t0
    assert prof.stop() == []
    assert not (tmp_path / "r").exists()
    st = prof.timer_stats()
    assert st.steps == 4
    assert 0.005 <= st.batch_cost.min and st.batch_cost.avg == pytest.approx(elapsed / 4, rel=0.1)
    assert st.samples_per_s.avg == pytest.approx(2 / st.batch_cost.avg)


def test_env_options_override_and_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPSCOPE_OPTIONS", f'{{"dir": "{tmp_path}", "run_id": "env", '
                       '"schedule": [1, 2], "host_metrics": false, "report": false}')
    prof = Profiler("ignored", schedule=None)
    assert prof.options["dir"] == str(tmp_path) and prof.schedule.active == 1
    prof.start()
    _train(prof, 3)
    prof.stop()
    assert _user_ranges(decode(tmp_path / "env" / "rank0.detail.0.pftrace")) == ["user 1"]
    monkeypatch.setenv("STEPSCOPE_OPTIONS", '{"schedule": {"active": -1}}')
    with pytest.raises(ValueError, match="STEPSCOPE_OPTIONS: 'schedule': schedule: active"):
        Profiler(tmp_path)
    monkeypatch.delenv("STEPSCOPE_OPTIONS")
    with pytest.raises(ValueError, match="levels must be a non-empty subset"):
        Profiler(tmp_path, levels=("full",))
    with pytest.raises(ValueError, match="buffer_bytes must be an integer >= 65536"):
        Profiler(tmp_path, buffer_bytes=10)


def test_module_level_helpers_without_profiler():
    from stepscope import profiler as P

    assert P.current() is None
    P.step()  # no-op
    with P.phase("Forward"):
        pass
    assert list(P.dataloader([1, 2])) == [1, 2]


def test_profiler_inside_a_users_session(tmp_path):
    """A session the user started keeps running and keeps its detail setting."""
    user_file = tmp_path / "mine.pftrace"
    stepscope.start(user_file)
    try:
        prof = Profiler(tmp_path, schedule(warmup=1, active=1), run_id="r", host_metrics=False,
                        report=False)
        prof.start()
        _train(prof, 4)
        prof.stop()
        assert stepscope.current() is not None
        with stepscope.annotate("after"):
            pass
    finally:
        stepscope.stop()
    mine = decode(user_file)
    assert _user_ranges(mine) == ["after"] + [f"user {i}" for i in range(4)]
    assert len(mine.by_category(S.CAT_STEP)) == 4
    summary = decode(tmp_path / "r" / "rank0.summary.pftrace")
    assert [x.name for x in summary.by_category(S.CAT_STEP)] == [f"step {i}" for i in range(4)]
    assert _user_ranges(summary) == []
    assert _user_ranges(decode(tmp_path / "r" / "rank0.detail.0.pftrace")) == ["user 1"]


def test_open_step_at_stop_dropped_unless_it_failed(tmp_path):
    prof = Profiler(tmp_path, schedule=None, run_id="ok", host_metrics=False, report=False)
    prof.start()
    for _ in range(3):
        with prof.phase("Forward"):
            pass
        prof.step()
    prof.stop()  # the tail after the 3rd step() is no step
    steps = decode(tmp_path / "ok" / "rank0.summary.pftrace").by_category(S.CAT_STEP)
    assert [x.name for x in steps] == ["step 0", "step 1", "step 2"]

    with pytest.raises(RuntimeError, match="in step 2"):
        with Profiler(tmp_path, schedule=None, run_id="bad", host_metrics=False,
                      report=False) as prof:
            for i in range(5):
                with prof.phase("Forward"):
                    if i == 2:
                        raise RuntimeError("in step 2")
                prof.step()
    d = decode(tmp_path / "bad" / "rank0.summary.pftrace")
    steps = d.by_category(S.CAT_STEP)
    assert [x.name for x in steps] == ["step 0", "step 1", "step 2"]  # the failed one is kept
    assert steps[2].args == {"step": 2, "epoch": 0} and steps[2].dur is not None


def test_gpu_tracing_follows_the_windows(tmp_path, monkeypatch):
    """NVML for the run, CUPTI only inside active windows, converted before the file closes."""
    import stepscope.gpu as gpu

    calls = []

    class FakeGpu:
        def __init__(self, sess, log_level, init_cuda, bucket_ns):
            self.sess = sess
            calls.append(("init", init_cuda, bucket_ns))

        def start(self):
            calls.append("start")

        def begin_window(self):
            calls.append(("begin", prof.step_num))

        def end_window(self, steps=0):
            # the window's file is still open: device events land in it
            em = self.sess.emitter(clock="monotonic", level=S.LEVEL_DETAIL)
            em.complete(time.perf_counter_ns() - 1000, 500, "kernel", self.sess.process_uuid,
                        S.CAT_KERNEL)
            calls.append(("end", prof.step_num, steps))

        def stop(self):
            calls.append("stop")

    monkeypatch.setattr(gpu, "GpuTracing", FakeGpu)
    prof = Profiler(tmp_path, schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=1),
                    run_id="r", host_metrics=False, report=False, gpu=True,
                    gpu_bucket_ns=5000)
    prof.start()
    _train(prof, 10)
    prof.stop()
    # gpu=True may initialize CUDA itself; the bucket is passed through
    assert calls == [("init", True, 5000), "start", ("begin", 3), ("end", 5, 2), ("begin", 7),
                     ("end", 9, 2), "stop"]
    for k in (0, 1):
        d = decode(tmp_path / "r" / f"rank0.detail.{k}.pftrace")
        assert [x.name for x in d.by_category(S.CAT_KERNEL)] == ["kernel"]
    assert decode(tmp_path / "r" / "rank0.summary.pftrace").by_category(S.CAT_KERNEL) == []


def test_a_windows_events_have_the_same_times_in_both_files(tmp_path):
    """Each file is put on the trace clock by its own clock snapshots, whose pairing of the
    clocks errs by some 100 ns at each reading: a detail window's step and phase sat 426 ns
    from the same events in the summary file. The offsets read at the process's first
    snapshot are kept: the same times, to the ns."""
    from stepscope import analysis

    prof = Profiler(dir=tmp_path, run_id="r", schedule=(2, 5), report=False, use_env=False,
                    host_metrics=False)
    with prof:
        for _ in range(8):
            with prof.phase("Forward"):
                time.sleep(0.002)
            prof.step()
    sql = "SELECT name, ts, dur FROM slice WHERE category IN ('step', 'phase') ORDER BY ts"
    got = {}
    for f in ("summary", "detail.0"):
        with analysis.open(str(tmp_path / "r" / f"rank0.{f}.pftrace"), engine="embedded") as db:
            got[f] = [tuple(r.values()) for r in db.query(sql)]
    window = got["detail.0"]
    assert [n for n, _, _ in window] == ["step 2", "Forward", "step 3", "Forward", "step 4",
                                         "Forward"]
    assert set(window) <= set(got["summary"])


def test_clock_snapshots_keep_their_offsets_but_for_a_real_change(monkeypatch):
    from stepscope import _clock

    monkeypatch.setattr(_clock, "_offsets", None)
    first = _clock.snapshot()
    offsets = lambda s: (s[_clock.BOOTTIME] - s[_clock.MONOTONIC],  # noqa: E731
                         s[_clock.REALTIME] - s[_clock.MONOTONIC])
    for _ in range(50):  # the readings' noise: the first offsets, exactly
        assert offsets(_clock.snapshot()) == offsets(first)
    boot = _clock._boottime_ns
    monkeypatch.setattr(_clock, "_boottime_ns", lambda: boot() + 5_000_000)  # a 5 ms suspend
    moved = offsets(_clock.snapshot())
    assert abs(moved[0] - offsets(first)[0] - 5_000_000) < _clock.STABLE_NS
    assert offsets(_clock.snapshot()) == moved  # and kept from then on
