"""The C hot path (``stepscope._fast``) and its pure-Python twin record the same events.

Most of the suite runs on whichever recorder is loaded (the C one where it is built); here the C
objects are checked directly, and the core test files run once more with the pure-Python
recorder forced (``STEPSCOPE_PURE_PYTHON=1``), so that neither path goes untested.
"""

from __future__ import annotations

import functools
import gc
import inspect
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

import stepscope
from perfetto_decode import decode
from stepscope._schema import LEVEL_DETAIL
from stepscope.record import recorder as _recorder
from stepscope.record.recorder import BEGIN, END_DETAIL, code
from stepscope.write import encoder as _encoder

FORCED_PURE = os.environ.get("STEPSCOPE_PURE_PYTHON", "") not in ("", "0")
fast = _recorder.fast
needs_fast = pytest.mark.skipif(fast is None, reason="the C extension is not loaded")


@pytest.mark.skipif(FORCED_PURE or not sys.platform.startswith("linux"),
                    reason="pure Python asked for, or not Linux (the extension is Linux-only)")
def test_the_extension_is_built_on_linux():
    # the install compiles it (setup.py); a silent fallback would hide a 3x slower hot path
    assert fast is not None, "stepscope._fast missing: reinstall with `pip install -e .`"


@needs_fast
def test_events_carry_code_time_and_thread_ident():
    # the time lies between two perf_counter_ns() reads: the C clock is the same clock
    _recorder.clear()
    got = {}

    def work():
        t0 = time.perf_counter_ns()
        _recorder.chain(41)()
        got["window"] = (t0, time.perf_counter_ns())
        got["ident"] = threading.get_ident()
        got["native"] = threading.get_native_id()

    th = threading.Thread(target=work)
    th.start()
    th.join()
    ev = _recorder.drain().reshape(-1, 3)
    # the thread's first event is preceded by its mark: (THREAD, native id, ident)
    assert ev.shape == (2, 3)
    assert ev[0].tolist() == [_recorder.THREAD, got["native"], got["ident"]]
    assert ev[1, 0] == 41 and ev[1, 2] == got["ident"]
    assert got["window"][0] <= ev[1, 1] <= got["window"][1]
    assert _recorder.pending_words() == 0


def _unmarked(words: np.ndarray) -> list[int]:
    """Recorded words without the thread marks (see _recorder: THREAD)."""
    ev = words.reshape(-1, 3)
    return ev[ev[:, 0] != _recorder.THREAD].ravel().tolist()


@needs_fast
def test_each_os_thread_marks_its_first_event_once_per_recording():
    # a mark per thread, not per event; again after clear() (a new session), not per drain
    _recorder.clear()
    emit = fast.Emit(5)

    def work():
        emit()
        emit()

    threads = [threading.Thread(target=work) for _ in range(3)]
    for th in threads:
        th.start()
        th.join()  # one after another: the idents are probably reused, the marks are not
    emit()
    ev = _recorder.drain().reshape(-1, 3)
    codes = ev[:, 0].tolist()
    assert codes == [_recorder.THREAD, 5, 5] * 3 + [_recorder.THREAD, 5]
    assert ev[ev[:, 0] == _recorder.THREAD, 1].tolist() == (
        [th.native_id for th in threads] + [threading.get_native_id()])
    emit()
    assert _recorder.drain().reshape(-1, 3)[:, 0].tolist() == [5]  # a drain keeps the mark
    _recorder.clear()
    emit()
    assert _recorder.drain().reshape(-1, 3)[:, 0].tolist() == [_recorder.THREAD, 5]


@needs_fast
def test_extend_takes_whole_events_or_nothing():
    _recorder.clear()
    fast.extend((1, 2, 3, 4, 5, 6))
    with pytest.raises(ValueError, match="triples"):
        fast.extend((7, 8))
    with pytest.raises(TypeError):
        fast.extend((7, 8, "x"))
    with pytest.raises(OverflowError):
        fast.extend((7, 8, 1 << 70))
    assert _unmarked(_recorder.drain()) == [1, 2, 3, 4, 5, 6]


@needs_fast
def test_withdraw_nulls_the_matching_event_only():
    _recorder.clear()
    fast.extend((8, 100, 7, 8, 200, 7, 9, 200, 7))
    assert _recorder.withdraw((8, 200, 7))
    assert not _recorder.withdraw((8, 300, 7))
    assert _unmarked(_recorder.drain()) == [8, 100, 7, _recorder.NULL, 200, 7, 9, 200, 7]


@needs_fast
@pytest.mark.parametrize("seed", [0, 1])
def test_c_assemble_writes_the_numpy_bytes(seed):
    rng = np.random.default_rng(seed)
    n = 2000
    deltas = rng.integers(0, 1 << 40, n) >> rng.integers(0, 40, n)
    deltas[rng.random(n) < 0.05] = -1  # packets without a timestamp
    templates = [bytes(rng.integers(0, 256, k, dtype=np.uint8)) for k in (0, 3, 150, 20000)]
    tidx = rng.integers(0, len(templates), n)
    c_bytes = fast.assemble(deltas.astype(np.int64), tidx.astype(np.int64), templates)
    assert c_bytes == _encoder.assemble_numpy(deltas, tidx, templates)


@needs_fast
def test_c_assemble_rejects_bad_input_clearly():
    d = np.zeros(2, dtype=np.int64)
    with pytest.raises(TypeError, match="int64"):
        fast.assemble(np.zeros(2, dtype=np.int32), d, [b""])
    with pytest.raises(IndexError, match="template index"):
        fast.assemble(d, np.array([0, 1], dtype=np.int64), [b""])
    with pytest.raises(ValueError, match="length"):
        fast.assemble(d, np.zeros(3, dtype=np.int64), [b""])
    with pytest.raises(TypeError, match="bytes"):
        fast.assemble(d, np.zeros(2, dtype=np.int64), ["text"])


def test_assemble_output_parses_with_the_official_schema():
    deltas = np.array([5, 1 << 50, -1], dtype=np.int64)
    tpl = bytes([0x50, 0x05, 0x5A, 0x02, 0x48, 0x03])  # seq 5, track_event{type: INSTANT}
    trace = pb.Trace()
    trace.ParseFromString(_encoder.assemble(deltas, np.zeros(3, dtype=np.int64), [tpl]))
    assert [(p.HasField("timestamp"), p.timestamp, p.trusted_packet_sequence_id)
            for p in trace.packet] == [(True, 5, 5), (True, 1 << 50, 5), (False, 0, 5)]


# --- the decorator wrapper ---------------------------------------------------------------------
@stepscope.annotate("scaled")
def scaled(x, *, by=2):
    """Multiply."""
    return x * by


class Model:
    @stepscope.annotate
    def forward(self, x):
        return x + 1


@needs_fast
def test_decorated_function_keeps_identity_signature_and_pickles_by_name():
    assert isinstance(scaled, fast.Decorated)
    assert scaled.__name__ == "scaled" and scaled.__doc__ == "Multiply."
    assert scaled.__wrapped__.__qualname__ == "scaled"
    assert str(inspect.signature(scaled)) == "(x, *, by=2)"
    assert pickle.loads(pickle.dumps(scaled)) is scaled
    assert scaled(3) == 6 and scaled(3, by=3) == 9  # inactive: a plain call
    assert Model().forward(1) == 2 and Model.forward(Model(), 4) == 5  # bound like a function
    assert functools.partial(scaled, by=5)(2) == 10


@needs_fast
def test_decorated_function_records_a_range_even_when_it_raises(tmp_path):
    path = str(tmp_path / "t.pftrace")

    @stepscope.annotate("boom")
    def boom():
        raise KeyError("x")

    with stepscope.trace(path):
        with pytest.raises(KeyError):
            boom()
        assert Model().forward(1) == 2
    d = decode(path)
    slices = d.slices(d.thread_track("MainThread"))
    assert [(name, depth) for name, depth, _, _ in slices] == [("boom", 0), ("Model.forward", 0)]
    assert all(t0 < t1 for _, _, t0, t1 in slices)


@needs_fast
def test_modes_follow_the_session(tmp_path):
    r = stepscope.annotate("mode probe")
    assert isinstance(r, fast.Range)
    _recorder.clear()
    with r:  # no session: mode off, nothing recorded
        pass
    stepscope.push_range("mode probe")
    stepscope.pop_range()
    assert _recorder.pending_words() == 0
    begin = code(_recorder.event_id("mode probe", ()), LEVEL_DETAIL, BEGIN)
    with stepscope.trace(str(tmp_path / "t.pftrace")):
        _recorder.clear()
        with r:
            stepscope.push_range("mode probe")
            stepscope.pop_range()
        got = _unmarked(_recorder.drain())[0::3]
    assert got == [begin, begin, END_DETAIL, END_DETAIL]


@needs_fast
def test_a_range_binds_enter_and_exit_once_and_is_collected_with_them():
    class Probe(fast.Range):
        __slots__ = ("__weakref__",)

    r = Probe(code(_recorder.event_id("bound once", ()), LEVEL_DETAIL, BEGIN))
    assert r.__enter__ is r.__enter__ and r.__exit__ is r.__exit__  # made once, kept
    assert r.__enter__ is not Probe(0).__enter__
    assert fast.Range.__enter__(r) is r and fast.Range.__exit__(r, None, None, None) is None
    with pytest.raises(TypeError, match="non-Range"):
        fast.Range.__dict__["__enter__"].__get__(object(), fast.Range)
    with pytest.raises(TypeError, match="first argument"):
        fast.Range.__enter__()
    with r as entered:
        assert entered is r
    ref = weakref.ref(r)
    del r, entered
    gc.collect()  # the range and its kept bound methods form a cycle
    assert ref() is None


@needs_fast
def test_noop_and_emit_take_any_arguments():
    assert fast.noop() is None and fast.noop(1, 2, x=3) is None
    _recorder.clear()
    emit = fast.Emit(12345)
    assert emit(None, None, None) is None and emit(ValueError, ValueError("x"), None) is None
    assert _unmarked(_recorder.drain())[0::3] == [12345, 12345]


@pytest.mark.skipif(FORCED_PURE or fast is None, reason="this run already is the pure one")
def test_core_tests_pass_on_the_pure_python_recorder():
    here = os.path.dirname(__file__)
    env = dict(os.environ, STEPSCOPE_PURE_PYTHON="1")
    files = [os.path.join(here, f) for f in ("test_writer.py", "test_robustness.py",
                                             "test_nvtx.py", "test_fast.py",
                                             "test_thread_tracks.py", "test_decorators.py")]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *files], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_a_failing_hash_other_than_unhashable_reaches_the_caller():
    class Interrupting(str):
        def __hash__(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stepscope.annotate(Interrupting("x"))


@pytest.mark.parametrize("n", [0, 5, 9, 10, 127, 128, 300, 1 << 40, -1, -10, (1 << 63) - 1,
                               -(1 << 63), 1 << 63])
@pytest.mark.parametrize(("prefix", "suffix"), [("step ", ""), ("étape ", " ü"),
                                                ("bad \ud800 ", "surrogate"), ("", "")])
def test_numbered_begin_encodes_like_python(n, prefix, suffix, monkeypatch):
    # blob_event's C path (numbered_event, where it applies) writes track_event's bytes
    class Numbered(_recorder.NumberedBegin):
        __slots__ = ()
        eid = _recorder.event_id("", ("step",))
        level = LEVEL_DETAIL
        arg = "step"

    Numbered.prefix, Numbered.suffix = prefix, suffix
    blob = Numbered(n)
    a, b = _encoder.Interner(), _encoder.Interner()
    for _ in range(2):  # first use defines the interned category and arg name, then cached
        got = _encoder.blob_event(a, blob)
        with monkeypatch.context() as m:
            m.setattr(_encoder, "fast", None)
            want = _encoder.blob_event(b, blob)
        assert got == want
        assert a.take_pending() == b.take_pending()
    assert want == _encoder.track_event(_encoder.Interner(), BEGIN, Numbered.eid,
                                        args={"step": n}, name=f"{prefix}{n}{suffix}")


@needs_fast
def test_numbered_event_checks_its_arguments():
    with pytest.raises(TypeError, match="8 arguments"):
        fast.numbered_event(b"", b"")
    with pytest.raises(TypeError, match="bytes"):
        fast.numbered_event("x", b"", b"", "n", "", b"", b"", 1)
    with pytest.raises(OverflowError):
        fast.numbered_event(b"", b"", b"", "n", "", b"", b"", 1 << 64)


def test_the_thread_local_is_initial_exec():
    """Review 18: the per-thread mark check is a direct TLS load (initial-exec); the default
    global-dynamic model made every put() call __tls_get_addr (tools/bench_overhead.py, one run
    each on a shared machine: with annotate 401 -> 190 ns while a bare call went 82 -> 57)."""
    from stepscope.record import recorder as _recorder

    if _recorder.fast is None or not sys.platform.startswith("linux"):
        pytest.skip("the C extension's ELF build only")
    with open(_recorder.fast.__file__, "rb") as f:
        assert b"__tls_get_addr" not in f.read()


@needs_fast
def test_context_hook_calls_the_original_then_records_and_ends_even_where_exit_raises():
    log: list = []

    class Capture:
        waiting = False
        after_optimizer = None

    class CM:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            log.append("enter")
            return "entered"

        def __exit__(self, *exc):
            log.append(("exit", exc[0]))
            if self.name == "raise":
                raise OSError("exit failed")

    o_enter, o_exit = CM.__dict__["__enter__"], CM.__dict__["__exit__"]
    cap = Capture()
    by_name = {"a": lambda: log.append("begin a"), "raise": lambda: log.append("begin raise")}
    opened: list = []
    args = (object(), cap, by_name, lambda: log.append("end"), 0, opened, 1024)  # main 0: none
    CM.__enter__ = fast.ContextHook(0, o_enter, lambda o: log.append(("rest in", o.name)), *args)
    CM.__exit__ = fast.ContextHook(1, o_exit, lambda o: log.append(("rest out", o.name)), *args)
    assert CM.__exit__.__wrapped__ is o_exit
    was = (_recorder.ON, _recorder.DETAIL)
    _recorder.set_state(True, False)  # recording (the hook reads the C copy of ON)
    try:
        _context_hook_cases(CM, cap, log, opened)
    finally:
        _recorder.set_state(*was)


def _context_hook_cases(CM, cap, log, opened):
    with CM("a") as got:
        log.append("body")
        assert len(opened) == 1
    assert got == "entered"
    assert log == ["enter", "begin a", "body", ("exit", None), "end"] and opened == []
    log.clear()
    cm = CM("raise")
    with pytest.raises(OSError, match="exit failed"):  # the original's error, after the end
        with cm:
            pass
    assert log == ["enter", "begin raise", ("exit", None), "end"] and opened == []
    log.clear()
    with pytest.raises(KeyError):
        with CM("b"):  # not cached: rest() decides (and records no begin here)
            raise KeyError("body")
    assert log == ["enter", ("rest in", "b"), ("exit", KeyError)]
    log.clear()
    cap.after_optimizer = "set"
    _recorder.set_state(False, False)
    with CM("a"):
        pass
    assert log == ["enter", ("exit", None), ("rest out", "a")]  # not recording: no range
    with pytest.raises(TypeError):
        CM.__enter__(CM("a"), 1)


class _Named:
    """A context manager with a ``name`` (as torch's record_function), doing nothing."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        pass

    def __exit__(self, *exc):
        pass


@needs_fast
@pytest.mark.parametrize("flags", [True, False], ids=["CaptureFlags", "attributes"])
def test_context_hook_reads_the_capture_flags_as_fields_or_attributes(flags):
    """RangeCapture's ``waiting`` and ``after_optimizer`` are struct fields of
    ``_fast.CaptureFlags``, which the hook reads without an attribute lookup; any other capture
    object is read through its attributes, with the same outcome (an unset flag included)."""
    log: list = []
    Capture = type("Capture", (fast.CaptureFlags,) if flags else (), {})
    cap = Capture()
    cap.waiting, cap.after_optimizer = False, None

    class CM(_Named):
        pass

    prof = fast.ProfilerCore()
    prof._quiet = False
    o_enter, o_exit = CM.__enter__, CM.__exit__
    args = (prof, cap, {"a": lambda: log.append("begin")}, lambda: log.append("end"),
            threading.get_ident(), [], 1024)  # the profiler's thread: this one
    CM.__enter__ = fast.ContextHook(0, o_enter, lambda o: log.append("rest in"), *args)
    CM.__exit__ = fast.ContextHook(1, o_exit, lambda o: log.append("rest out"), *args)
    was = (_recorder.ON, _recorder.DETAIL)
    _recorder.set_state(True, False)
    try:
        runs = []
        for setting in ({}, {"waiting": True}, {"waiting": False, "after_optimizer": "set"},
                        {"waiting": None}):
            for k, v in setting.items():
                if v is None:
                    delattr(cap, k)  # unset: read as waiting (the attribute's error cleared)
                else:
                    setattr(cap, k, v)
            with CM("a"):
                pass
            runs.append(log[:])
            log.clear()
    finally:
        _recorder.set_state(*was)
    assert runs == [["begin", "end"], ["rest in"], ["begin", "end", "rest out"],
                    ["rest in", "rest out"]]


@needs_fast
def test_context_hook_calls_after_optimizer_once_at_the_exit_of_a_range_named_with_the_prefix(
        capsys):
    """Where the capture is a ``CaptureFlags`` with a str ``after_prefix``, the exit hook itself
    calls ``after_optimizer`` (taken: set to None first) at the exit of a range whose str name
    starts with it, and leaves it set at other exits; a name that is not a str goes to rest().
    Its failure is reported as the Python twin reports it (ranges.BOUNDARY_FAILED)."""
    log: list = []
    cap = type("Capture", (fast.CaptureFlags,), {})()
    cap.waiting, cap.after_optimizer, cap.after_prefix = False, None, "Optimizer.step#"

    class CM(_Named):
        def __exit__(self, *exc):
            log.append(("exit", cap.after_optimizer is None))

    prof = fast.ProfilerCore()
    prof._quiet = False
    o_enter, o_exit = CM.__enter__, CM.__exit__
    args = (prof, cap, {}, lambda: log.append("end"), threading.get_ident(), [], 1024)
    CM.__enter__ = fast.ContextHook(0, o_enter, lambda o: None, *args)
    CM.__exit__ = fast.ContextHook(1, o_exit, lambda o: log.append(("rest", o.name)), *args)

    def after():
        log.append(("after", cap.after_optimizer))

    was = (_recorder.ON, _recorder.DETAIL)
    _recorder.set_state(True, False)
    try:
        cap.after_optimizer = after
        for name in ("Optimizer.zero_grad#SGD.zero_grad", "Optimizer.step", 7,
                     "Optimizer.step#SGD.step", "Optimizer.step#SGD.step"):
            with CM(name):
                pass
        assert log == [("exit", False), ("exit", False), ("exit", False), ("rest", 7),
                       ("exit", False), ("after", None), ("exit", True)]
        assert cap.after_optimizer is None
        log.clear()
        cap.after_prefix = None  # no prefix: every exit with after_optimizer set is rest()'s
        cap.after_optimizer = after
        with CM("Optimizer.step#SGD.step"):
            pass
        assert log == [("exit", False), ("rest", "Optimizer.step#SGD.step")]
        # a boundary that fails is one line on stderr and the program goes on; an interrupt
        # goes through
        cap.after_prefix, log[:] = "Optimizer.step#", []
        for failure in (RuntimeError("no step"), KeyboardInterrupt()):
            def failing(failure=failure):
                raise failure

            cap.after_optimizer = failing
            try:
                with CM("Optimizer.step#SGD.step"):
                    pass
            except KeyboardInterrupt:
                log.append("interrupted")
        assert log == [("exit", False), ("exit", False), "interrupted"]
        from stepscope.pytorch.ranges import BOUNDARY_FAILED  # (imports no torch)

        assert capsys.readouterr().err == BOUNDARY_FAILED.format(RuntimeError("no step")) + "\n"
    finally:
        _recorder.set_state(*was)


@needs_fast
def test_step_advances_the_timer_in_c_only_while_its_step_is_step_counters_own(tmp_path,
                                                                                monkeypatch):
    """The C ``step()`` advances the ``StepTimer``'s figures itself (no method lookup) while
    ``timer.step`` is ``StepCounters.step``; a ``step`` patched on the class later, or a
    subclass's own, is called instead, with the same arguments."""
    from stepscope.profiler import timer as timer_mod

    prof = stepscope.Profiler(tmp_path, schedule=None, run_id="t", host_metrics=False,
                              report=False, use_env=False)
    prof.start()
    calls: list = []
    own = timer_mod.StepTimer.step

    def patched(self, num_samples=None, now=None):
        calls.append((type(self).__name__, num_samples))
        return own(self, num_samples, now=now)

    try:
        prof.step(4)
        prof.step(4)
        assert prof.timer.steps == 2 and calls == []
        with monkeypatch.context() as m:
            m.setattr(timer_mod.StepTimer, "step", patched)
            prof.step(5)
        prof.step(6)  # (the class as it was again: no call)

        class Sub(timer_mod.StepTimer):
            __slots__ = ()
            step = patched

        prof.timer = Sub()
        prof.step(7)  # opens the Sub's first step: a call, no figure
        prof.step(8)
    finally:
        prof.stop()
    assert calls == [("StepTimer", 5), ("Sub", 7), ("Sub", 8)]
    assert prof.timer.steps == 1
