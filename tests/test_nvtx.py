"""stepscope._nvtx: forwarding to NVTX and capture of nvtx calls.

stepscope's public functions are replaced by a fake recorder that logs each call and, like the
core, forwards it through ``_nvtx.forward_*``; the nvtx side is the real package (no NVTX tool
attached, so its functions are no-op stubs) or a fake module that logs what it receives.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
import types
import warnings
from pathlib import Path

import pytest

import stepscope
from stepscope import _nvtx, _schema
from stepscope.record import recorder as _recorder

nvtx = pytest.importorskip("nvtx")
nvtx_inner = importlib.import_module("nvtx.nvtx")  # capture patches this submodule too

NAMES = ("annotate", "push_range", "pop_range", "start_range", "end_range", "mark")
ORIGINAL = {name: getattr(nvtx, name) for name in NAMES}
ORIGINAL_INNER = {name: getattr(nvtx_inner, name) for name in NAMES}
SRC = Path(__file__).resolve().parents[1] / "src"


class FakeStepscope:
    """Stands in for stepscope's push_range/pop_range/start_range/end_range/mark; forwards to
    NVTX like the core does when forwarding is on."""

    def __init__(self):
        self.events: list[tuple] = []
        self.next_handle = 100

    def push_range(self, message, color=None, domain=None, category=None, payload=None):
        self.events.append(("push", message, color, domain, category, payload))
        if _nvtx.forwarding:
            _nvtx.forward_push(message, color, domain, category, payload)

    def pop_range(self, domain=None):
        self.events.append(("pop", domain))
        if _nvtx.forwarding:
            _nvtx.forward_pop(domain)

    def start_range(self, message, color=None, domain=None, category=None, payload=None):
        self.next_handle += 1
        self.events.append(("start", message, color, domain, category, payload, self.next_handle))
        if _nvtx.forwarding:
            _nvtx.forward_start(message, color, domain, category, payload)
        return self.next_handle

    def end_range(self, handle):
        self.events.append(("end", handle))

    def mark(self, message, color=None, domain=None, category=None, payload=None):
        self.events.append(("mark", message, color, domain, category, payload))
        if _nvtx.forwarding:
            _nvtx.forward_mark(message, color, domain, category, payload)


@pytest.fixture
def rec(monkeypatch):
    fake = FakeStepscope()
    for name in ("push_range", "pop_range", "start_range", "end_range", "mark"):
        monkeypatch.setattr(stepscope, name, getattr(fake, name), raising=False)
    return fake


@pytest.fixture(autouse=True)
def clean_state():
    yield
    while _nvtx._capture_depth:
        _nvtx.release_nvtx()
    _nvtx.disable_forwarding()
    _recorder._warned.clear()


def make_fake_nvtx(log: list) -> types.ModuleType:
    """An nvtx module as it behaves with a tool attached, logging every call it receives."""
    mod = types.ModuleType("nvtx")

    def push_range(message=None, color="blue", domain=None, category=None, payload=None):
        log.append(("nvtx.push", message, color, domain, category, payload))

    def pop_range(domain=None):
        log.append(("nvtx.pop", domain))

    def start_range(message=None, color=None, domain=None, category=None, payload=None):
        log.append(("nvtx.start", message, color, domain, category, payload))
        return (len(log), f"handle:{domain}")

    def end_range(range_id):
        log.append(("nvtx.end", range_id))

    def mark(message=None, color="blue", domain=None, category=None, payload=None):
        log.append(("nvtx.mark", message, color, domain, category, payload))

    class annotate:
        def __init__(self, message=None, color=None, domain=None, category=None, payload=None):
            self.args = message, color, domain, category, payload

        def __enter__(self):
            log.append(("nvtx.push", *self.args))
            return self

        def __exit__(self, *exc):
            log.append(("nvtx.pop", self.args[2]))
            return False

        def __call__(self, func):
            def inner(*a, **k):
                with self:
                    return func(*a, **k)

            return inner

    for f in (push_range, pop_range, start_range, end_range, mark, annotate):
        setattr(mod, f.__name__, f)
    return mod


@pytest.fixture
def fake_nvtx(monkeypatch):
    log: list = []
    mod = make_fake_nvtx(log)
    monkeypatch.setitem(sys.modules, "nvtx", mod)
    monkeypatch.delitem(sys.modules, "nvtx.nvtx", raising=False)
    return mod, log


NV = _schema.CAT_NVTX

# --- capture with the real nvtx package ------------------------------------------------------


def test_annotate_context_manager_nesting_and_domains(rec):
    with _nvtx.capture_nvtx():
        with nvtx.annotate("outer", color="red"):
            with nvtx.annotate("inner", domain="io", category="read", payload=3):
                pass
        with nvtx.annotate():  # nvtx: message defaults to the empty string
            pass
    assert rec.events == [
        ("push", "outer", "red", NV, None, None),
        ("push", "inner", None, "io", "read", 3),
        ("pop", "io"),
        ("pop", NV),
        ("push", "", None, NV, None, None),
        ("pop", NV),
    ]


def test_annotate_decorator(rec):
    _nvtx.capture_nvtx()

    @nvtx.annotate()
    def step(x):
        """doc"""
        with nvtx.annotate("inner"):
            return x * 2

    @nvtx.annotate("fwd", domain="model", color="green")
    def fails():
        raise KeyError("boom")

    assert step(21) == 42
    assert (step.__name__, step.__doc__) == ("step", "doc")
    with pytest.raises(KeyError):
        fails()
    assert rec.events == [
        ("push", "step", None, NV, None, None),
        ("push", "inner", None, NV, None, None),
        ("pop", NV),
        ("pop", NV),
        ("push", "fwd", "green", "model", None, None),
        ("pop", "model"),
    ]


def test_reused_annotate_object(rec):
    rng = nvtx.annotate("again", domain="d")
    _nvtx.capture_nvtx()
    rng2 = nvtx.annotate("again", domain="d")
    with rng2:
        with rng2:
            pass
    with rng:  # made before capture: nvtx's own class, not seen
        pass
    assert rec.events == [
        ("push", "again", None, "d", None, None),
        ("push", "again", None, "d", None, None),
        ("pop", "d"),
        ("pop", "d"),
    ]
    assert isinstance(rng2, ORIGINAL["annotate"])


def test_push_pop_mark(rec):
    _nvtx.capture_nvtx()
    nvtx.push_range("load", domain="data")
    nvtx.mark("here", category=2)
    nvtx.push_range(message="batch", color="red", payload=1.5)
    nvtx.pop_range()
    nvtx.pop_range(domain="data")
    assert rec.events == [
        ("push", "load", "blue", "data", None, None),
        ("mark", "here", "blue", NV, 2, None),
        ("push", "batch", "red", NV, None, 1.5),
        ("pop", NV),
        ("pop", "data"),
    ]


def test_start_end_across_threads(rec):
    _nvtx.capture_nvtx()
    rid = nvtx.start_range("async load", domain="io")
    assert isinstance(rid, _nvtx.CapturedRange)
    assert rid.nvtx_id is None  # no NVTX tool attached: nvtx's own start_range returned None
    t = threading.Thread(target=nvtx.end_range, args=(rid,))
    t.start()
    t.join()
    nvtx.end_range(None)  # nvtx accepts None: nothing to record
    assert rec.events == [
        ("start", "async load", None, "io", None, None, 101),
        ("end", 101),
    ]


def test_release_restores_nvtx_and_stops_recording(rec):
    cap = _nvtx.capture_nvtx()
    assert cap and _nvtx.is_capturing()
    assert all(getattr(nvtx, n) is not ORIGINAL[n] for n in NAMES)
    assert all(getattr(nvtx_inner, n) is not ORIGINAL_INNER[n] for n in NAMES)

    @nvtx.annotate("decorated while capturing")
    def work():
        return 7

    rid = nvtx.start_range("spans the release")
    _nvtx.release_nvtx()
    assert not _nvtx.is_capturing()
    assert {n: getattr(nvtx, n) for n in NAMES} == ORIGINAL
    assert {n: getattr(nvtx_inner, n) for n in NAMES} == ORIGINAL_INNER
    assert work() == 7  # still works, records nothing
    with nvtx.annotate("after"):
        nvtx.push_range("after")
        nvtx.pop_range()
    nvtx.end_range(rid)  # nvtx's own end_range accepts it (a no-op id: nvtx had no tool)
    assert rec.events == [("start", "spans the release", None, NV, None, None, 101)]


def test_capture_nests_and_context_manager_releases(rec):
    with _nvtx.capture_nvtx() as outer:
        inner = _nvtx.capture_nvtx()
        inner.release()
        inner.release()  # a handle releases once
        assert _nvtx.is_capturing()
        nvtx.mark("still")
    assert not outer and not _nvtx.is_capturing()
    assert nvtx.mark is ORIGINAL["mark"]
    assert rec.events == [("mark", "still", "blue", NV, None, None)]
    with pytest.warns(RuntimeWarning, match="without capture_nvtx"):
        _nvtx.release_nvtx()


def test_recording_errors_never_reach_the_user(monkeypatch):
    def broken(*a, **k):
        raise ValueError("core exploded")

    monkeypatch.setattr(stepscope, "push_range", broken, raising=False)
    monkeypatch.setattr(stepscope, "pop_range", broken, raising=False)
    _nvtx.capture_nvtx()
    with pytest.warns(RuntimeWarning, match="core exploded"):
        with nvtx.annotate("x"):
            result = 5
    assert result == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once only
        nvtx.push_range("y")
        nvtx.pop_range()


def test_nvtx_disabled_by_environment(tmp_path):
    """NVTX_DISABLE=1 makes nvtx define no-op stubs and a nullcontext annotate: still captured."""
    script = """
import json, stepscope, nvtx
from stepscope import _nvtx
assert not nvtx.enabled()
ev = []
stepscope.push_range = lambda m, color=None, domain=None, category=None, payload=None: ev.append(
    ["push", m, domain])
stepscope.pop_range = lambda domain=None: ev.append(["pop", domain])
stepscope.mark = lambda m, color=None, domain=None, category=None, payload=None: ev.append(
    ["mark", m, domain])
with _nvtx.capture_nvtx():
    @nvtx.annotate("deco", domain="d")
    def f():
        return 1
    with nvtx.annotate("cm"):
        f()
    nvtx.push_range("p")
    nvtx.pop_range()
    nvtx.mark("m")
print(json.dumps(ev))
"""
    env = dict(os.environ, NVTX_DISABLE="1", PYTHONPATH=str(SRC))
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [
        ["push", "cm", NV],
        ["push", "deco", "d"],
        ["pop", "d"],
        ["pop", NV],
        ["push", "p", NV],
        ["pop", NV],
        ["mark", "m", NV],
    ]


# --- with a fake nvtx module (as with a tool attached) ---------------------------------------


def test_capture_calls_the_originals(rec, fake_nvtx):
    mod, log = fake_nvtx
    _nvtx.capture_nvtx()
    with mod.annotate("a", domain="d"):
        rid = mod.start_range("s")
    mod.end_range(rid)
    assert tuple(rid) == (2, "handle:None") and rid.nvtx_id == (2, "handle:None")
    assert log == [
        ("nvtx.push", "a", None, "d", None, None),
        ("nvtx.start", "s", None, None, None, None),
        ("nvtx.pop", "d"),
        ("nvtx.end", (2, "handle:None")),
    ]
    assert rec.events == [
        ("push", "a", None, "d", None, None),
        ("start", "s", None, NV, None, None, 101),
        ("pop", "d"),
        ("end", 101),
    ]


def test_forwarding_calls_nvtx_with_the_same_arguments(rec, fake_nvtx):
    mod, log = fake_nvtx
    assert _nvtx.available() and _nvtx.enable_forwarding() and _nvtx.forwarding
    _nvtx.forward_push("fwd", "red", "d", "c", 5)
    _nvtx.forward_pop("d")
    rid = _nvtx.forward_start(123, None, "io")  # non-string message: sent as its str()
    _nvtx.forward_end(rid, "io")
    _nvtx.forward_end(None)
    _nvtx.forward_mark("m", domain="d")
    assert log == [
        ("nvtx.push", "fwd", "red", "d", "c", 5),
        ("nvtx.pop", "d"),
        ("nvtx.start", "123", None, "io", None, None),
        ("nvtx.end", (3, "handle:io")),
        ("nvtx.mark", "m", None, "d", None, None),
    ]


def test_forwarding_and_capture_together_send_each_range_once(rec, fake_nvtx):
    mod, log = fake_nvtx
    _nvtx.enable_forwarding()
    _nvtx.capture_nvtx()
    mod.push_range("captured", domain="d")  # nvtx -> stepscope (not forwarded back)
    stepscope.push_range("own", domain="mine")  # stepscope -> nvtx (not captured back)
    stepscope.pop_range(domain="mine")
    mod.pop_range(domain="d")
    with mod.annotate("cm"):
        mod.mark("m")
    assert log == [
        ("nvtx.push", "captured", "blue", "d", None, None),
        ("nvtx.push", "own", None, "mine", None, None),
        ("nvtx.pop", "mine"),
        ("nvtx.pop", "d"),
        ("nvtx.push", "cm", None, None, None, None),
        ("nvtx.mark", "m", "blue", None, None, None),
        ("nvtx.pop", None),
    ]
    assert rec.events == [
        ("push", "captured", "blue", "d", None, None),
        ("push", "own", None, "mine", None, None),
        ("pop", "mine"),
        ("pop", "d"),
        ("push", "cm", None, NV, None, None),
        ("mark", "m", "blue", NV, None, None),
        ("pop", NV),
    ]


def test_forwarding_started_during_capture_uses_the_originals(rec, fake_nvtx):
    mod, log = fake_nvtx
    _nvtx.capture_nvtx()
    _nvtx.enable_forwarding()
    _nvtx.release_nvtx()
    _nvtx.forward_push("x")
    assert log == [("nvtx.push", "x", None, None, None, None)]
    assert rec.events == []


def test_forwarding_errors_warn_once(fake_nvtx):
    mod, log = fake_nvtx

    def bad_color(*a, **k):
        raise TypeError("Invalid color")

    mod.push_range = bad_color
    _nvtx.enable_forwarding()
    with pytest.warns(RuntimeWarning, match="Invalid color"):
        _nvtx.forward_push("x", "chartreuse")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _nvtx.forward_push("x", "chartreuse")
        _nvtx.forward_pop()
    assert log == [("nvtx.pop", None)]


# --- without nvtx ------------------------------------------------------------------------------


def test_without_nvtx_everything_is_a_no_op(rec, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx -> ImportError
    assert _nvtx.available() is False
    assert _nvtx.enable_forwarding() is False and _nvtx.forwarding is False
    _nvtx.forward_push("x")
    _nvtx.forward_pop()
    assert _nvtx.forward_start("x") is None
    _nvtx.forward_end(None)
    _nvtx.forward_mark("x")
    with pytest.warns(RuntimeWarning, match="not installed"):
        cap = _nvtx.capture_nvtx()
    assert not cap and not _nvtx.is_capturing()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cap.release()  # an inactive handle releases nothing
        with cap:
            pass
    assert rec.events == []


# --- end to end with the core: the trace decoded with the official schema ----------------------


def decode(path) -> dict[str, list[tuple]]:
    """Events per track name (thread name for thread tracks) in time order, names and categories
    resolved through each sequence's interning, delta timestamps (clock 64) made absolute
    (MONOTONIC) through the sequence's ClockSnapshot."""
    import zlib

    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    def packets(data):
        for p in pb.Trace.FromString(data).packet:
            if p.HasField("compressed_packets"):
                yield from packets(zlib.decompress(p.compressed_packets))
            else:
                yield p

    tracks, events, seq = {}, [], {}
    for p in packets(Path(path).read_bytes()):
        state = seq.setdefault(p.trusted_packet_sequence_id, {"ts": 0})
        if p.sequence_flags & 1:
            state.clear()
            state["ts"] = 0
        clocks = {c.clock_id: c.timestamp for c in p.clock_snapshot.clocks}
        if 64 in clocks:  # incremental clock: starts at clocks[64], which is clocks[3] MONOTONIC
            state["ts"] = clocks[64]
            state["base"] = clocks[3] - clocks[64]
        if p.HasField("trace_packet_defaults"):
            state["track"] = p.trace_packet_defaults.track_event_defaults.track_uuid
            state["clock"] = p.trace_packet_defaults.timestamp_clock_id
        for e in p.interned_data.event_names:
            state[("name", e.iid)] = e.name
        for e in p.interned_data.event_categories:
            state[("cat", e.iid)] = e.name
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            tracks[d.uuid] = d.thread.thread_name if d.HasField("thread") else d.name
        if p.HasField("track_event"):
            ev = p.track_event
            if p.HasField("timestamp_clock_id") or state.get("clock") != 64:
                ts = p.timestamp
            else:
                state["ts"] += p.timestamp
                ts = state["ts"] + state["base"]
            track = ev.track_uuid if ev.HasField("track_uuid") else state["track"]
            kind = {1: "B", 2: "E", 3: "I"}[ev.type]
            if kind == "E":
                item = ("E",)
            else:
                name = state[("name", ev.name_iid)] if ev.HasField("name_iid") else ev.name
                cats = ",".join([state[("cat", i)] for i in ev.category_iids] + list(ev.categories))
                item = (kind, name, cats)
            events.append((track, ts, item))
    out: dict[str, list[tuple]] = {}
    for track, _, item in sorted(events, key=lambda e: e[1]):  # stable: same-ts keeps file order
        out.setdefault(tracks[track], []).append(item)
    return out


def test_captured_ranges_in_the_trace(tmp_path):
    path = tmp_path / "capture.pftrace"
    with stepscope.trace(path):
        with stepscope.capture_nvtx():

            @nvtx.annotate()
            def step():
                nvtx.push_range("load", domain="data")
                nvtx.pop_range(domain="data")

            with nvtx.annotate("outer"):
                with nvtx.annotate("inner", domain="io", category="read"):
                    nvtx.mark("m")
                step()
            rid = nvtx.start_range("async")
            t = threading.Thread(target=nvtx.end_range, args=(rid,), name="ender")
            t.start()
            t.join()
        nvtx.mark("released: not recorded")
    events = decode(path)
    assert events["MainThread"] == [
        ("B", "outer", NV),
        ("B", "inner", "io,read"),
        ("I", "m", NV),
        ("E",),
        ("B", "step", NV),
        ("B", "load", "data"),
        ("E",),
        ("E",),
        ("E",),
    ]
    assert events[_schema.ASYNC_TRACK_NAME] == [("B", "async", NV), ("E",)]


def test_capture_and_forwarding_through_the_core(tmp_path, fake_nvtx):
    mod, log = fake_nvtx
    path = tmp_path / "both.pftrace"
    with stepscope.trace(path, nvtx=True):
        with stepscope.capture_nvtx():
            mod.push_range("captured", domain="d")
            with stepscope.annotate("own"):
                pass
            mod.pop_range(domain="d")
            with mod.annotate("cm"):
                mod.mark("m")
    assert log == [
        ("nvtx.push", "captured", "blue", "d", None, None),
        ("nvtx.push", "own", None, None, None, None),
        ("nvtx.pop", None),
        ("nvtx.pop", "d"),
        ("nvtx.push", "cm", None, None, None, None),
        ("nvtx.mark", "m", "blue", None, None, None),
        ("nvtx.pop", None),
    ]
    assert decode(path)["MainThread"] == [
        ("B", "captured", "d"),
        ("B", "own", ""),
        ("E",),
        ("E",),
        ("B", "cm", NV),
        ("I", "m", NV),
        ("E",),
    ]


def test_forwarding_push_pop_and_decorator_through_the_core(tmp_path, fake_nvtx):
    mod, log = fake_nvtx
    path = tmp_path / "fwd.pftrace"

    @stepscope.annotate("deco", color="red")
    def deco():
        stepscope.push_range("pushed")
        stepscope.pop_range()

    deco()  # not tracing: neither recorded nor forwarded
    with stepscope.trace(path, nvtx=True):
        deco()
    deco()
    assert log == [
        ("nvtx.push", "deco", "red", None, None, None),
        ("nvtx.push", "pushed", None, None, None, None),
        ("nvtx.pop", None),
        ("nvtx.pop", None),
    ]
    assert decode(path)["MainThread"] == [("B", "deco", ""), ("B", "pushed", ""), ("E",), ("E",)]
