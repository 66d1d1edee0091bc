"""The profiler's per-step events, made cheap: step number on the begin, a shared step end,
cached encodings, phases bound to the recording state, and the sampler's cheaper readings."""

import os
import threading
import time
import warnings

import numpy as np
import psutil
import pytest
from tracedecode import decode

import perfetto_decode
from stepscope import _schema as S
from stepscope.profiler import Profiler
from stepscope.profiler import host_metrics as hm
from stepscope.profiler import profiler as P
from stepscope.record import recorder as rec
from stepscope.write.encoder import Interner, blob_event, debug_annotations
from stepscope.write.sink import SequenceState


def test_int_annotation_bytes():
    """{"step": 300}: debug_annotations (field 4) {name_iid 1, int_value 300}."""
    it = Interner()
    assert debug_annotations(it, {"step": 300}) == b"\x22\x05\x08\x01\x20\xac\x02"
    assert debug_annotations(it, {"step": -1}) == (
        b"\x22\x0d\x08\x01\x20" + b"\xff" * 9 + b"\x01")  # int64 -1: ten-byte varint
    assert it.arg_names == {"step": 1}


def test_a_step_end_is_a_fast_code_with_fixed_args_encoded_once_per_sequence():
    args = {"epoch": 0, "num_samples": 128}
    eid = rec.event_id("", (), args=args)
    assert rec.event_id("", (), args=dict(args)) == eid  # the same kind again
    assert rec.event_id("", (), args={"epoch": 0, "num_samples": 128.0}) != eid  # a double
    assert rec.event_id("", (), args={"epoch": 0, "num_samples": [128]}) is None  # unhashable
    # an unhashable name is cleaned (as without args), not refused
    with pytest.warns(RuntimeWarning, match="not a str"):
        odd = rec.event_id(["odd"], (), args=args)
    assert odd == rec.event_id(rec.clean_name(["odd"]), (), args=args) is not None
    end = rec.code(eid, S.LEVEL_SUMMARY, rec.END)
    # TrackEvent (field 11) {type END; epoch=0 (iid 1); num_samples=128 (iid 2)}: no name
    want = bytes.fromhex("5a0f4802220408012000220508022080" "01")
    a, b = SequenceState(2, None, 6), SequenceState(3, None, 6)
    first = a.fast_template(end)
    assert first == a.prefix + want and a.fast_template(end) is first  # then from the cache
    assert a.interner.take_pending() != b""  # the arg names were defined in sequence a ...
    assert b.fast_template(end) == b.prefix + want and b.interner.take_pending() != b""
    plain = rec.Blob(rec.END, 0, S.LEVEL_SUMMARY, args=args)
    assert blob_event(Interner(), plain) == want  # the same bytes as a blob with those args


def _steps(path):
    """(begin args, end args) of each step slice, in file order."""
    ev = [e for e in perfetto_decode.decode(path).events if e.categories == (S.CAT_STEP,)
          or (e.type == "E" and e.args and S.ARG_EPOCH in e.args)]
    return ([e.args for e in ev if e.type == "B"], [e.args for e in ev if e.type == "E"])


def test_step_args_split_between_begin_and_end(tmp_path):
    prof = Profiler(tmp_path, schedule=None, run_id="r", host_metrics=False, report=False,
                    use_env=False)
    prof.start()
    prof.step(num_samples=4)  # step 0
    prof.step(num_samples=4)  # step 1: the same (shared) end event as step 0
    prof.epoch()  # the open step 2 becomes batch 0 of epoch 1
    prof.step(num_samples=4.0)  # a float stays a float
    prof.step()  # step 3: no num_samples
    prof.stop()
    path = tmp_path / "r" / "rank0.summary.pftrace"
    begins, ends = _steps(path)
    assert begins == [{"step": i} for i in range(4)]
    assert ends == [{"epoch": 0, "num_samples": 4}, {"epoch": 0, "num_samples": 4},
                    {"epoch": 1, "num_samples": 4.0}, {"epoch": 1}]
    assert type(ends[2]["num_samples"]) is float
    merged = [x.args for x in decode(path).by_category(S.CAT_STEP)]  # as trace processor does
    assert merged == [{"step": 0, "epoch": 0, "num_samples": 4},
                      {"step": 1, "epoch": 0, "num_samples": 4},
                      {"step": 2, "epoch": 1, "num_samples": 4.0}, {"step": 3, "epoch": 1}]


def test_step_begins_are_numbered_codes_and_past_their_range_blobs_with_the_same_bytes(
        tmp_path, monkeypatch):
    """A step's begin carries its number in its code (no object per step); a number past
    the codes' range is a parked blob; the file has the same begins either way."""
    assert rec.numbered is P._StepBegin
    code7 = rec.numbered_code(P._StepBegin, 7)
    assert code7 == P._STEP_CODE0 + (7 << 3) > 0 and rec.numbered_number(code7) == 7
    assert code7 & 3 == rec.BEGIN and (code7 >> 2) & 1 == S.LEVEL_SUMMARY
    top = rec.NUMBERED_MAX - 1
    assert rec.numbered_number(rec.numbered_code(P._StepBegin, top)) == top
    blobs_before = len(rec.blobs)
    past = rec.numbered_code(P._StepBegin, top + 1)
    assert past < 0 and rec.blobs.pop(-past).number == top + 1
    assert len(rec.blobs) == blobs_before
    with pytest.raises(RuntimeError, match="_StepBegin"):
        rec.register_numbered(type("Other", (rec.NumberedBegin,), {"__slots__": ()}))
    # a reload of the profiler's module (autoreload in a notebook) defines the class again
    again = type("_StepBegin", (rec.NumberedBegin,), {
        "__slots__": (), "__module__": P.__name__, "__qualname__": "_StepBegin",
        "level": S.LEVEL_SUMMARY})
    monkeypatch.setattr(rec, "numbered", rec.numbered)
    assert rec.register_numbered(again) == P._STEP_CODE0 and rec.numbered is again
    monkeypatch.undo()
    assert rec.numbered is P._StepBegin

    def run(run_id, first):
        prof = Profiler(tmp_path, schedule=None, run_id=run_id, host_metrics=False,
                        report=False, use_env=False)
        prof.start()  # step 0 opens here
        prof._step = first  # noqa: SLF001 - the next ones: the numbers of a very long run
        for _ in range(3):
            with prof.phase("Forward"):
                pass
            prof.step(num_samples=2)
        prof.stop()
        return _steps(tmp_path / run_id / "rank0.summary.pftrace")

    begins, ends = run("near", top - 1)  # 0 and top as codes, top + 1 as a blob
    assert begins == [{"step": 0}, {"step": top}, {"step": top + 1}]
    assert ends == [{"epoch": 0, "num_samples": 2}] * 3
    names = [e.name for e in perfetto_decode.decode(tmp_path / "near" / "rank0.summary.pftrace")
             .events if e.categories == (S.CAT_STEP,)]
    assert names == [f"step {n}" for n in (0, top, top + 1)]
    assert run("low", 0) == ([{"step": n} for n in range(3)], ends)


def test_numbered_events_of_a_batch_are_the_blobs_bytes(monkeypatch):
    """The writer builds a batch's step begins in one C call: the bytes of each as a blob."""
    from stepscope.write import encoder as E

    numbers = np.array([0, 5, 127, 128, 300, 1 << 40, rec.NUMBERED_MAX - 1], dtype=np.int64)
    got = E.numbered_events(Interner(), P._StepBegin, numbers, b"PFX")
    with monkeypatch.context() as m:
        m.setattr(E, "fast", None)  # the Python path
        slow = E.numbered_events(Interner(), P._StepBegin, numbers, b"PFX")
    it = Interner()
    want = [b"PFX" + E.track_event(it, rec.BEGIN, P._StepBegin.eid, args={"step": n},
                                   name=f"step {n}") for n in numbers.tolist()]
    assert got == slow == want
    assert E.numbered_events(Interner(), P._StepBegin, numbers[:0], b"") == []


def test_a_step_boundary_writes_the_begin_in_place_or_nothing():
    """One call at a step with no phase: the open step's placeholder becomes its begin, then
    its end and the next placeholder are appended; without the placeholder, nothing."""
    null = rec.NULL
    twins = [P._py_boundary] + ([rec.fast.step_boundary] if rec.fast is not None else [])
    for boundary in twins:
        rec.clear()
        P._emit((40, 5, 9, null, 100, 7, 41, 150, 7))  # another event, the placeholder, one more
        assert boundary(16, 200, 7, 12, 100, 7, null, 4096)
        got = rec.drain().reshape(-1, 3)
        got = got[got[:, 0] != rec.THREAD].tolist()
        assert got == [[40, 5, 9], [12, 100, 7], [41, 150, 7], [16, 200, 7], [null, 200, 7]]
        P._emit((null, 300, 7))
        assert not boundary(16, 400, 7, 12, 300, 8, null, 4096)  # another thread's: not found
        assert not boundary(16, 400, 7, 12, 299, 7, null, 4096)  # another time: not found
        P._emit((1, 2, 7))
        assert not boundary(16, 400, 7, 12, 300, 7, null, 1)  # past the lookback
        got = rec.drain().reshape(-1, 3)
        assert got[got[:, 0] != rec.THREAD].tolist() == [[null, 300, 7], [1, 2, 7]]


def test_step_ends_past_the_kind_limit_are_blobs_with_the_same_args(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "_step_ends", {})
    monkeypatch.setattr(P, "MAX_STEP_END_KINDS", 1)  # room for one kind
    prof = Profiler(tmp_path, schedule=None, run_id="k", host_metrics=False, report=False,
                    use_env=False)
    prof.start()
    kinds_before = len(rec.kinds)
    for n in (1000, 1001, 1002, 1000):  # tokens per batch: a new num_samples each step
        prof.step(num_samples=n)
    assert len(rec.kinds) <= kinds_before + 1  # one kind made, then blobs
    prof.stop()
    _, ends = _steps(tmp_path / "k" / "rank0.summary.pftrace")
    assert ends == [{"epoch": 0, "num_samples": n} for n in (1000, 1001, 1002, 1000)]


def test_repeated_step_ends_make_one_kind_each_however_many_there_are(tmp_path, monkeypatch):
    """More distinct (epoch, num_samples) than any cache of ends, cycling: each is one kind,
    made once, and every later end of it is that kind's fast code, not a blob."""
    monkeypatch.setattr(P, "_step_ends", {})
    prof = Profiler(tmp_path, schedule=None, run_id="c", host_metrics=False, report=False,
                    use_env=False)
    prof.start()
    kinds_before = len(rec.kinds)
    blobs = []
    real = rec.record_blob
    monkeypatch.setattr(rec, "record_blob", lambda b, *a: blobs.append(b) or real(b, *a))
    base = time.monotonic_ns()  # values no earlier test or run in this process made kinds of
    for i in range(3 * 100):
        prof.step(num_samples=base + i % 100)
    assert len(rec.kinds) == kinds_before + 100 and len(P._step_ends) == 100
    assert [b for b in blobs if b.kind == rec.END] == []  # every end a fast code
    prof.stop()
    _, ends = _steps(tmp_path / "c" / "rank0.summary.pftrace")
    assert ends == [{"epoch": 0, "num_samples": base + i % 100} for i in range(300)]


def test_nan_num_samples_make_no_kind_per_step(tmp_path, monkeypatch):
    """NaN equals nothing, itself included: its step ends are blobs, not a new kind a step."""
    monkeypatch.setattr(P, "_step_ends", {})
    prof = Profiler(tmp_path, schedule=None, run_id="n", host_metrics=False, report=False,
                    use_env=False)
    prof.start()
    kinds_before = len(rec.kinds)
    for _ in range(20):
        prof.step(num_samples=float("nan"))
    prof.stop()
    assert len(rec.kinds) == kinds_before and P._step_ends == {}
    _, ends = _steps(tmp_path / "n" / "rank0.summary.pftrace")
    assert len(ends) == 20 and all(e["epoch"] == 0 and e["num_samples"] != e["num_samples"]
                                   for e in ends)


def test_unhashable_num_samples_still_recorded(tmp_path):
    import numpy as np

    prof = Profiler(tmp_path, schedule=None, run_id="u", host_metrics=False, report=False,
                    use_env=False)
    prof.start()
    prof.step(num_samples=np.array(128))  # not hashable: a fresh end event, not a shared one
    prof.stop()
    steps = decode(tmp_path / "u" / "rank0.summary.pftrace").by_category(S.CAT_STEP)
    assert [x.args for x in steps] == [{"step": 0, "epoch": 0, "num_samples": 128}]


def test_cached_phase_records_only_while_recording(tmp_path):
    prof = Profiler(tmp_path, schedule=None, run_id="p", host_metrics=False, report=False,
                    use_env=False)
    prof.start()
    ph = prof.phase("Forward")
    with ph:
        pass
    prof.step()
    prof.stop()
    before = rec.pending_words()
    with ph:  # kept by the user past stop(): records nothing
        pass
    assert rec.pending_words() == before
    assert type(ph).__enter__ is rec.noop
    d = decode(tmp_path / "p" / "rank0.summary.pftrace")
    assert [x.name for x in d.by_category(S.CAT_PHASE)] == ["Forward"]


def test_an_exception_leaves_a_phase_closed_and_propagates(tmp_path):
    prof = Profiler(tmp_path, schedule=None, run_id="p", host_metrics=False, report=False,
                    use_env=False)
    prof.start()
    with pytest.raises(ZeroDivisionError):
        with prof.phase("Forward"):
            with prof.phase("Backward"):
                1 / 0  # noqa: B018
    with prof.phase("Optimization"):
        pass
    prof.step()
    prof.stop()
    d = decode(tmp_path / "p" / "rank0.summary.pftrace")
    fwd, bwd, opt = sorted(d.by_category(S.CAT_PHASE), key=lambda x: x.ts)
    assert (fwd.name, bwd.name, opt.name) == ("Forward", "Backward", "Optimization")
    assert None not in (fwd.dur, bwd.dur, opt.dur)  # every phase ended
    assert fwd.ts <= bwd.ts and bwd.ts + bwd.dur <= fwd.ts + fwd.dur <= opt.ts  # nested, closed


@pytest.mark.skipif(hm.resource is None or not os.path.exists("/proc/self/statm"),
                    reason="Linux /proc and getrusage")
def test_own_process_readings_match_psutil():
    p = psutil.Process()
    ctx_before = sum(p.num_ctx_switches())  # psutil: the main thread's switches
    cpu, ctx, rss = hm._own_process()
    t = p.cpu_times()
    assert abs((t.user + t.system) - cpu) < 0.05  # psutil counts clock ticks (10 ms)
    assert ctx >= ctx_before  # ours: every thread's
    assert abs(p.memory_info().rss - rss) < 4 << 20

    def switching():  # each wait that times out is a voluntary switch of this thread
        ev = threading.Event()
        for _ in range(50):
            ev.wait(0.001)

    main_before = sum(p.num_ctx_switches())
    th = threading.Thread(target=switching)
    th.start()
    th.join()
    assert hm._own_process()[1] - ctx >= 50  # the worker's switches count
    assert sum(p.num_ctx_switches()) - main_before < 50  # psutil's count would miss them


def test_disk_totals_match_psutil():
    s = hm.HostSampler(None, 0.5)
    before = psutil.disk_io_counters(perdisk=False, nowrap=False)
    ours = s._disk()
    after = psutil.disk_io_counters(perdisk=False, nowrap=False)
    if before is None:
        assert ours is None
        return
    assert before.read_bytes <= ours[0] <= after.read_bytes
    assert before.write_bytes <= ours[1] <= after.write_bytes


def test_disk_totals_elsewhere_than_linux_are_psutils_own(monkeypatch):
    """psutil keeps whole disks only on Linux (there is no /sys/block elsewhere): other
    platforms' totals are taken as psutil gives them, not filtered down to zero."""
    from collections import namedtuple

    io = namedtuple("io", "read_bytes write_bytes")
    monkeypatch.setattr(psutil, "LINUX", False)
    monkeypatch.setattr(psutil, "disk_io_counters",
                        lambda perdisk, nowrap: None if perdisk else io(7, 9))
    assert hm.HostSampler(None, 0.5)._disk() == (7, 9)
    monkeypatch.setattr(psutil, "disk_io_counters", lambda perdisk, nowrap: None)
    assert hm.HostSampler(None, 0.5)._disk() is None


@pytest.mark.parametrize("python", [False, True], ids=["c", "python"])
@pytest.mark.parametrize("phase", [False, True], ids=["bare", "phase"])
def test_steps_ended_on_another_thread_end_on_their_begins_track(tmp_path, python, phase):
    """start() on the main thread (step 0 opens there), then a training thread makes 4 steps
    (with a phase each, or bare), and stop() comes from the main thread while a fifth is
    open on the training thread: the file holds the timer's steps, each ended on the track of
    its begin (step 0 on the main thread's, the others on the trainer's), and nothing warns.
    Before, step 0 ended on the trainer's track, where it matched no begin: it never ended in
    the file (one step fewer than the timer), with a warning of an unmatched pop_range()."""
    prof = Profiler(tmp_path, schedule=None, run_id="r", host_metrics=False, report=False,
                    use_env=False)
    if python:
        prof.step = prof._step_py  # type: ignore[method-assign]
    prof.start()
    opened = threading.Event()

    def train():
        for _ in range(4):
            if phase:
                with prof.phase("fwd"):
                    time.sleep(0.001)
            prof.step()
        with prof.phase("fwd"):  # step 4: begun on this thread, ended by stop() on main
            opened.set()
            time.sleep(0.001)

    t = threading.Thread(target=train, name="trainer")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t.start()
        t.join()
        assert opened.is_set()
        prof.stop()
    d = perfetto_decode.decode(tmp_path / "r" / "rank0.summary.pftrace")
    main, trainer = d.thread_track("MainThread"), d.thread_track("trainer")
    steps = {}
    for uuid in [u for u, desc in d.tracks.items() if desc.name == "steps"]:
        for name, _depth, t0, t1 in d.slices(uuid):  # (every begin ended, every end matched)
            if name.startswith("step "):
                parent = d.tracks[uuid].parent_uuid
                steps[name] = (parent, t0 <= t1)
    assert prof.timer_stats().steps == 5
    assert steps == {"step 0": (main, True), **{f"step {k}": (trainer, True)
                                                 for k in range(1, 5)}}
