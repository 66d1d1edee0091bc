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
import textwrap
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
                                             "test_thread_tracks.py", "test_decorators.py",
                                             "test_args_snapshot.py")]
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
        idle_prefix = None

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
    _recorder.set_state(False, False)
    with CM("a"):
        pass
    assert log == ["enter", ("exit", None)]  # not recording: no range (exit: never rest())
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
    """RangeCapture's ``waiting`` and ``idle_prefix`` are struct fields of
    ``_fast.CaptureFlags``, which the hook reads without an attribute lookup; any other capture
    object is read through its attributes, with the same outcome (an unset flag included). In a
    quiet step, a range begins with the profiler's ``_activity()`` unless its name starts with
    a str ``idle_prefix``; with a step that is not quiet, the prefix is not read."""
    log: list = []
    Capture = type("Capture", (fast.CaptureFlags,) if flags else (), {})
    cap = Capture()
    cap.waiting, cap.idle_prefix = False, None

    class CM(_Named):
        pass

    class Prof(fast.ProfilerCore):
        def _activity_py(self):
            log.append("activity")

    prof = Prof()
    prof._started, prof._stopped, prof._pending, prof._tentative = True, False, True, None
    o_enter, o_exit = CM.__enter__, CM.__exit__
    chains = {n: (lambda n=n: log.append(n)) for n in ("a", "Optimizer.zero_grad#SGD.zero_grad")}
    args = (prof, cap, chains, lambda: log.append("end"), threading.get_ident(), [], 1024)
    CM.__enter__ = fast.ContextHook(0, o_enter, lambda o: log.append("rest in"), *args)
    CM.__exit__ = fast.ContextHook(1, o_exit, lambda o: log.append("rest out"), *args)
    was = (_recorder.ON, _recorder.DETAIL)
    _recorder.set_state(True, False)
    try:
        runs = []
        for quiet, setting in ((False, {}), (False, {"waiting": True}), (False, {"waiting": None}),
                               (True, {"waiting": False}), (True, {"idle_prefix": "Optimizer."}),
                               (True, {"idle_prefix": 3}), (False, {"idle_prefix": None})):
            prof._quiet = quiet
            for k, v in setting.items():
                if v is None:
                    delattr(cap, k)  # unset: read as waiting / an error (the hook's or Python's)
                else:
                    setattr(cap, k, v)
            for name in ("a", "Optimizer.zero_grad#SGD.zero_grad"):
                try:
                    with CM(name):
                        pass
                except AttributeError:
                    log.append("no idle_prefix")
            runs.append(log[:])
            log.clear()
    finally:
        _recorder.set_state(*was)
    z = "Optimizer.zero_grad#SGD.zero_grad"
    assert runs == [["a", "end", z, "end"], ["rest in"] * 2, ["rest in"] * 2,
                    ["activity", "a", "end", "activity", z, "end"],
                    ["activity", "a", "end", z, "end"],
                    ["activity", "a", "end", "activity", z, "end"],
                    ["a", "end", z, "end"]]


@needs_fast
def test_context_hook_with_an_unset_idle_prefix_in_a_quiet_step_raises_as_the_attribute():
    """An unset ``idle_prefix`` read for a quiet step raises AttributeError out of
    ``__enter__`` (after torch's own ``__enter__``), as reading the attribute would."""
    cap = fast.CaptureFlags()
    cap.waiting = False

    class CM(_Named):
        pass

    prof = fast.ProfilerCore()
    prof._quiet = True
    args = (prof, cap, {"a": lambda: None}, lambda: None, threading.get_ident(), [], 1024)
    CM.__enter__ = fast.ContextHook(0, CM.__enter__, lambda o: None, *args)
    was = (_recorder.ON, _recorder.DETAIL)
    _recorder.set_state(True, False)
    try:
        with pytest.raises(AttributeError, match="idle_prefix"):
            CM("a").__enter__()
    finally:
        _recorder.set_state(*was)


@pytest.mark.parametrize("pure", [False, True], ids=["C", "pure-Python"])
def test_at_top_calls_once_after_the_end_of_the_outermost_summary_range(pure, capsys):
    """``summary_depth`` counts the summary begins and ends of the calling thread's chains
    (detail ones and ends without a begin leave it as it is); ``at_top(fn)`` calls ``fn`` once,
    after the end that brings the count to 0, on the thread that set it, and returns the call it
    replaces; a failing call is one line on stderr, an interrupt goes through; ``reset_depth``
    zeroes the count and drops the call. Both buffers alike."""
    rec = _recorder_of(pure)
    begin = rec.chain(rec.code(5, 1, rec.BEGIN))
    dbegin = rec.chain(rec.code(5, 0, rec.BEGIN))
    end, dend = rec.end_summary, rec.end_detail
    log: list = []
    rec.reset_depth()
    end()  # an end with no begin counted: still 0
    assert rec.summary_depth() == 0
    begin(), begin(), dbegin()
    assert rec.summary_depth() == 2
    assert rec.at_top(lambda: log.append(rec.summary_depth())) is None
    dend(), end()
    assert log == [] and rec.summary_depth() == 1
    other: list = []
    t = threading.Thread(target=lambda: (begin(), end(), other.append(rec.summary_depth())))
    t.start()
    t.join()
    assert other == [0] and log == []  # another thread's ranges neither count nor call
    end()
    assert log == [0]
    end(), begin(), end()
    assert log == [0]  # once
    begin()
    first = rec.at_top(lambda: log.append("first"))
    assert first is None and callable(rec.at_top(lambda: log.append("second")))
    end()
    assert log == [0, "second"]
    begin()
    rec.at_top(lambda: 1 / 0)
    end()  # a failure: one line, and the program goes on
    assert capsys.readouterr().err == rec.BOUNDARY_FAILED.format(ZeroDivisionError(
        "division by zero")) + "\n"

    def interrupt():
        raise KeyboardInterrupt

    begin()
    rec.at_top(interrupt)
    with pytest.raises(KeyboardInterrupt):
        end()
    begin(), begin()
    rec.at_top(lambda: log.append("dropped"))
    rec.reset_depth()
    assert rec.summary_depth() == 0
    end()
    assert log == [0, "second"]


@pytest.mark.parametrize("pure", [False, True], ids=["C", "pure-Python"])
def test_before_top_is_called_before_each_outermost_begin_until_it_says_true(pure, capsys):
    """``before_top(fn)``: ``fn(code)`` runs before the begin of each outermost summary range
    of the thread that set it (not of nested ones, not of detail ones, not on another thread),
    until it returns True; ``reset_depth`` drops it. Both buffers alike."""
    rec = _recorder_of(pure)
    a, b = rec.code(5, 1, rec.BEGIN), rec.code(6, 1, rec.BEGIN)
    begin_a, begin_b, dbegin = rec.chain(a), rec.chain(b), rec.chain(rec.code(5, 0, rec.BEGIN))
    end = rec.end_summary
    log: list = []
    answers = iter([False, True])
    rec.reset_depth()

    def fn(code):
        log.append((code, rec.summary_depth()))
        return next(answers)

    assert rec.before_top(fn) is None
    dbegin()
    begin_a(), begin_b(), end(), end()  # a: outermost (False: again); b: nested
    t = threading.Thread(target=lambda: (begin_a(), end()))
    t.start()
    t.join()
    begin_b(), end()  # True: no more
    begin_a(), end()
    assert log == [(a, 0), (b, 0)]
    rec.before_top(lambda code: 1 / 0)
    begin_a(), end()  # a failure: one line, the begin recorded all the same
    assert capsys.readouterr().err == rec.BOUNDARY_FAILED.format(ZeroDivisionError(
        "division by zero")) + "\n"
    assert rec.summary_depth() == 0
    rec.before_top(lambda code: log.append("dropped"))
    rec.reset_depth()
    begin_a(), end()
    assert log == [(a, 0), (b, 0)]


@pytest.mark.parametrize("pure", [False, True], ids=["C", "pure-Python"])
def test_a_base_level_and_the_low_water_mark_of_the_range_count(pure):
    """``summary_low``: the fewest summary ranges open on the thread since ``mark_low`` (or
    ``at_top``'s call), which ``mark_low`` starts at the current count; ``at_top(fn, base)``
    calls after the end that brings the count to ``base``, ``before_top(fn, base)`` before a
    begin made with ``base`` open; a negative base is refused. Both buffers alike."""
    rec = _recorder_of(pure)
    a = rec.code(5, 1, rec.BEGIN)
    begin, end = rec.chain(a), rec.end_summary
    rec.reset_depth()
    log: list = []
    begin()  # "epoch": around the loop
    rec.mark_low()
    assert rec.summary_low() == 1
    begin(), end()  # an iteration's phase
    begin(), begin()  # its "Optimization", torch's Optimizer.step#
    assert (rec.summary_depth(), rec.summary_low()) == (3, 1)
    rec.at_top(lambda: log.append(("at", rec.summary_depth())), rec.summary_low())
    end()
    assert log == []
    end()  # "Optimization" ends: back at the loop's level
    assert log == [("at", 1)] and rec.summary_low() == 1
    begin(), end(), end()  # the next iteration, then "epoch" ends
    assert (rec.summary_depth(), rec.summary_low()) == (0, 0)
    rec.mark_low()
    begin()
    rec.mark_low()
    answers = iter([False, True])
    rec.before_top(lambda code: log.append(("before", rec.summary_depth())) or next(answers), 1)
    begin()  # made with 1 open: called (False: again)
    begin(), end()  # made with 2 open: not called
    end()
    begin(), end()  # with 1 open: called, and taken (True)
    begin(), end()
    end()
    assert log == [("at", 1), ("before", 1), ("before", 1)]
    for top in (rec.at_top, rec.before_top):
        with pytest.raises(ValueError, match="base must be >= 0"):
            top(lambda *_: None, -1)
    rec.reset_depth()
    assert (rec.summary_depth(), rec.summary_low()) == (0, 0)


@pytest.mark.parametrize("pure", [False, True], ids=["C", "pure-Python"])
def test_thread_last_ts_is_the_latest_time_the_thread_recorded(pure):
    """``thread_last_ts``: the latest timestamp the calling thread recorded (given times
    included), not another thread's, and still after a drain took the events."""
    rec = _recorder_of(pure)
    before = rec.thread_last_ts()
    rec._ext((rec.END_SUMMARY, before + 10**9, threading.get_ident()))  # (a given time)
    t = threading.Thread(target=lambda: rec._ext((rec.END_SUMMARY, before + 10**12,
                                                  threading.get_ident())))
    t.start()
    t.join()
    assert rec.thread_last_ts() == before + 10**9
    if pure:
        rec.drain()
        assert rec.thread_last_ts() == before + 10**9


def test_a_stale_build_without_the_range_count_is_not_used(tmp_path):
    """A ``_fast`` built from older sources (an editable install not rebuilt) that lacks
    ``summary_depth`` would fail at the first optimizer step: the recorder takes the
    pure-Python twin instead, and a profiled run still works."""
    code = textwrap.dedent("""
        import sys, types
        stale = types.ModuleType("stepscope._fast")
        stale.THREAD_MARK = 7  # (marks, as the real build: only the range count is missing)
        sys.modules["stepscope._fast"] = stale
        import stepscope
        from stepscope.record import recorder
        assert recorder.fast is None and recorder.summary_depth() == 0
        with stepscope.Profiler(dir=sys.argv[1], run_id="s", schedule=None, report=False,
                                host_metrics=False, use_env=False, torch=False):
            with stepscope.phase("Forward"):
                assert recorder.summary_depth() == 1
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr


def _recorder_of(pure: bool):
    """The recorder with the C buffer (the one in use; skipped without it), or a fresh copy with
    the pure-Python one."""
    if not pure:
        if _recorder.fast is None:
            pytest.skip("no C extension")
        return _recorder
    return _pure_recorder()


def _pure_recorder():
    """A fresh copy of the recorder module with the pure-Python buffer (not the one in use)."""
    import importlib.util

    spec = importlib.util.find_spec("stepscope.record.recorder")
    mod = importlib.util.module_from_spec(spec)
    was = os.environ.get("STEPSCOPE_PURE_PYTHON")
    os.environ["STEPSCOPE_PURE_PYTHON"] = "1"
    try:
        spec.loader.exec_module(mod)
    finally:
        if was is None:
            del os.environ["STEPSCOPE_PURE_PYTHON"]
        else:
            os.environ["STEPSCOPE_PURE_PYTHON"] = was
    assert mod.fast is None
    return mod


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
