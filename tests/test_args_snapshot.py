"""Args are taken at the call, on the caller's thread (``record.args``).

They were kept by reference and encoded at flush time on the writer thread: a value changed
after the call was written changed, a dict that changed size while the writer read it lost the
event (uncounted), and a ``__repr__`` taking a lock the program held at ``stop()`` hung it.
"""

from __future__ import annotations

import collections
import enum
import random
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import stepscope
from perfetto_decode import decode
from stepscope import _api
from stepscope.record import args as _args
from stepscope.record.args import ITEMS_MAX, PLAIN, TEXT_MAX, VALUES_MAX, snapshot
from stepscope.write.encoder import Interner, debug_annotations


class Obj:
    def __init__(self, v):
        self.v = v

    def __repr__(self):
        return f"Obj({self.v})"


class NoRepr:
    def __repr__(self):
        raise RuntimeError("no repr")


def _events(path, kind):
    return [(e.name, e.args) for e in decode(path).events if e.type == kind]


def test_values_changed_after_the_call_are_written_as_they_were_at_it(tmp_path):
    path = tmp_path / "t.pftrace"
    d, lst, arr, o = {"a": 1, "in": [1]}, [1, {"k": "v"}], np.zeros(2), Obj(1)
    with stepscope.trace(path):
        with stepscope.annotate("r", cfg=d, lst=lst, arr=arr, obj=o):
            pass
        stepscope.mark("m", cfg=d, lst=lst, arr=arr, obj=o, payload=lst)
        stepscope.push_range("p", payload=d)
        stepscope.pop_range()
        stepscope.end_range(stepscope.start_range("s", payload=o))
        held = stepscope.annotate("held", cfg=d)  # taken at annotate(), entered later

        @stepscope.annotate("deco", cfg=d)
        def deco():
            pass

        d["a"] = 999
        d["in"].append(2)
        lst.append(3)
        lst[1]["k"] = "changed"
        arr[0] = 7
        o.v = 42
        with held:
            pass
        deco()
    at_call = {"cfg": {"a": 1, "in": [1]}, "lst": [1, {"k": "v"}], "arr": "array([0., 0.])",
               "obj": "Obj(1)"}
    assert _events(path, "B") == [("r", at_call), ("p", {"payload": {"a": 1, "in": [1]}}),
                                  ("s", {"payload": "Obj(1)"}),
                                  ("held", {"cfg": {"a": 1, "in": [1]}}),
                                  ("deco", {"cfg": {"a": 1, "in": [1]}})]
    assert _events(path, "I") == [("m", {**at_call, "payload": [1, {"k": "v"}]})]


@pytest.mark.parametrize("where", ["same thread", "other thread"])
def test_a_dict_that_grows_while_the_writer_flushes_loses_no_begin(tmp_path, where):
    n = 5000
    path = tmp_path / "t.pftrace"
    d = {i: i for i in range(20)}
    stop = threading.Event()

    def grow():
        i = 0
        while not stop.is_set():
            d[1000 + i % 500] = i
            if len(d) > 100:
                d.clear()
            i += 1
            if i % 64 == 0:
                time.sleep(0)  # (let the main thread run)

    t = threading.Thread(target=grow) if where == "other thread" else None
    # (a buffer the test's events fit in: on a loaded machine no batch is dropped for a backlog)
    with stepscope.trace(path, flush_interval_s=0.01, buffer_bytes=1 << 28) as sess:
        if t is not None:
            t.start()
        for i in range(n):
            with stepscope.annotate("r", d=d, i=i):
                pass
            if t is None:
                d[i + 1000] = i
                if len(d) > 100:
                    d.clear()
        stop.set()
        if t is not None:
            t.join()
    assert sess.dropped == 0
    events = [e for e in decode(path).events if e.type in "BE"]
    begins = [e for e in events if e.type == "B"]
    assert (len(begins), len(events) - len(begins)) == (n, n)
    assert [e.args["i"] for e in begins] == list(range(n))
    assert not [e for e in begins if isinstance(e.args.get("d"), str)]  # none became text
    if t is None:  # written as they were at the call: keys 0-19, then the ones added since
        assert begins[3].args["d"] == {**{str(k): k for k in range(20)},
                                       "1000": 0, "1001": 1, "1002": 2}


LOCKY = textwrap.dedent("""
    import threading, time, stepscope
    lock = threading.Lock()

    class Locky:
        def __repr__(self):
            with lock:
                return "locky"

    with stepscope.trace({path!r}, flush_interval_s=0.05):
        with stepscope.annotate("r", o=Locky()):
            pass
        stepscope.mark("m", o=[Locky()])
        lock.acquire()  # held by the program through stop(), as the writer flushes
        time.sleep(0.3)
    lock.release()
    print("done")
""")


def test_a_repr_taking_a_lock_the_program_holds_at_stop_does_not_hang(tmp_path):
    path = tmp_path / "t.pftrace"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", LOCKY.format(path=str(path))],
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (0, "done"), proc.stderr
    assert time.monotonic() - t0 < 20
    assert _events(path, "B") == [("r", {"o": "locky"})]
    assert _events(path, "I") == [("m", {"o": ["locky"]})]


def test_reprs_run_on_the_callers_thread_at_the_call(tmp_path):
    seen = []

    class Who:
        def __repr__(self):
            seen.append(threading.current_thread() is threading.main_thread())
            return "who"

    path = tmp_path / "t.pftrace"
    with stepscope.trace(path):
        w = Who()
        with stepscope.annotate("r", w=w, nested={"x": [w]}):
            assert seen == [True, True]
    assert seen == [True, True]  # the writer ran none
    assert _events(path, "B") == [("r", {"w": "who", "nested": {"x": ["who"]}})]


class Color(enum.IntEnum):
    RED = 3


class Text(str):
    pass


Point = collections.namedtuple("Point", "x y")


def _deep(depth, leaf):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def _values():
    """Values of every kind the encoder distinguishes (under the caps)."""
    selfref: list = [1]
    selfref.append(selfref)
    selfdict: dict = {"a": 1}
    selfdict["me"] = selfdict
    return [
        0, -1, 1 << 63, -(1 << 63) - 1, 1 << 70, 10 ** 30, True, False, None, 1.5, -0.0,
        float("nan"), float("inf"), "", "text", "x" * 5000, "é\ud800", Color.RED, Text("t"),
        np.float64(2.5), np.float32(0.1), np.int32(-7), np.int64(1 << 40), np.bool_(True),
        np.array(3.5), np.array([4]), np.zeros((2, 2)), np.array(["a", "b"]),
        b"bytes", bytearray(b"ba"), {1, 2}, frozenset(), complex(1, 2), Obj(5), NoRepr(),
        object, len, {}, [], (), (1,), Point(1, 2), collections.OrderedDict(b=1, a=2),
        collections.Counter("aab"), collections.defaultdict(list, {"k": [1]}),
        {"n": {"m": [1, (2.5, "s"), {"o": Obj(1)}]}}, [np.int8(1), [np.float16(2)]],
        {1: "int", "1": "str", 1.5: "float", None: "none", (1, 2): "tuple", Obj(1): "obj"},
        {Obj("k"): 1, "Obj(k)": 2, Obj("k"): 3},
        selfref, selfdict, _deep(7, Obj(2)), _deep(8, [1, 2]), _deep(9, (1,)),
        _deep(8, {"a": [1, (2,), {"b": "q'\""}], (1, "t"): None}), _deep(8, list(range(3000))),
        _deep(8, selfref), _deep(8, [Obj(3), NoRepr()]), _deep(12, np.float64(1.25)),
        list(range(ITEMS_MAX)), {i: str(i) for i in range(100)},
    ]


def _encode(args: dict) -> bytes:
    return debug_annotations(Interner(), args)


def _taken(args: dict) -> dict:
    return _api._args_data(None, args)  # what the public API records


def test_a_value_not_changed_after_the_call_is_written_as_the_writer_wrote_it():
    for v in _values():
        args = {"v": v}
        assert _encode(_taken(args)) == _encode(args), repr(v)[:200]
    every = {f"a{i}": v for i, v in enumerate(_values())}
    assert _encode(_taken(every)) == _encode(every)
    assert _encode(_taken(_taken(every))) == _encode(every)  # a range's args, decorated later
    assert _encode(_api._args_data([1, Obj(2)], every)) == _encode({**every,
                                                                    "payload": [1, Obj(2)]})


def test_random_nested_values_are_written_as_the_writer_wrote_them():
    rng = random.Random(7)
    leaves = [lambda: rng.randint(-5, 5), lambda: rng.random(), lambda: "s'\"" * rng.randint(0, 3),
              lambda: None, lambda: True, lambda: np.float32(rng.random()), lambda: Obj(1),
              lambda: np.arange(rng.randint(0, 3)), lambda: b"b"]

    def make(depth):
        if depth > 11 or rng.random() < 0.3:
            return rng.choice(leaves)()
        kind = rng.choice((list, tuple, dict))
        items = [make(depth + 1) for _ in range(rng.randint(0, 4))]
        if kind is dict:
            return {rng.choice((str(i), i, (i, "k"))): x for i, x in enumerate(items)}
        return kind(items)

    for _ in range(300):
        args = {"v": make(0)}
        assert _encode(_taken(args)) == _encode(args), repr(args)[:300]


def test_a_deep_containers_text_is_its_repr_cut():
    for v in _values():
        if type(v) in (list, tuple, dict):
            try:
                want = repr(v)[:TEXT_MAX]
            except RuntimeError:  # an item's repr fails
                want = f"<{type(v).__name__}>"
            assert _args._text(v) == want, want[:200]
    huge = _deep(3, [list(range(10 ** 6))] * 3)
    t0 = time.perf_counter()
    assert _args._text(huge) == repr(huge)[:TEXT_MAX]
    assert time.perf_counter() - t0 < 2


def test_plain_values_are_kept_as_they_are():
    values = {"i": 1, "f": 2.5, "s": "x" * 10000, "b": True, "n": None, "big": 1 << 80}
    assert set(map(type, values.values())) == PLAIN
    args = _taken(values)
    assert args == values and all(args[k] is v for k, v in values.items())
    assert snapshot(values["s"]) is values["s"]


def test_the_no_arg_range_is_the_cached_one():
    assert stepscope.annotate("x") is stepscope.annotate("x")


def test_containers_are_cut_to_the_caps(tmp_path):
    path = tmp_path / "t.pftrace"
    big = list(range(10 ** 6))
    grid = [[j for j in range(ITEMS_MAX)] for _ in range(ITEMS_MAX)]
    t0 = time.perf_counter()
    with stepscope.trace(path):
        stepscope.mark("big", big=big, d={i: i for i in range(10 ** 5)})
        stepscope.mark("grid", grid=grid)
    assert time.perf_counter() - t0 < 10
    (_, a), (_, b) = _events(path, "I")
    assert a["big"] == list(range(ITEMS_MAX))
    assert len(a["d"]) == ITEMS_MAX
    kept = [len(row) for row in b["grid"]]  # VALUES_MAX items in all, counted depth first
    assert kept == [ITEMS_MAX] * 3 + [VALUES_MAX - 3 * ITEMS_MAX - 4]
    assert b["grid"][3] == list(range(kept[3]))


def test_containers_that_fail_are_written_as_text_and_the_event_kept(tmp_path):
    class BadItems(dict):
        def items(self):
            raise RuntimeError("no items")

    class BadIter(list):
        def __iter__(self):
            raise RuntimeError("no iter")

        def __repr__(self):
            return "BadIter"

    class BadKey:
        def __str__(self):
            raise RuntimeError("no str")

        def __hash__(self):
            return 1

    class BadItem:
        @property
        def item(self):
            raise KeyError("item")

        def __repr__(self):
            return "BadItem"

    path = tmp_path / "t.pftrace"
    with stepscope.trace(path):
        with stepscope.annotate("r", a=BadItems(x=1), b=BadIter([1]), c={BadKey(): 1},
                                d=BadItem(), e=NoRepr(), big=10 ** 5000):
            pass
    assert _events(path, "B") == [("r", {"a": "{'x': 1}", "b": "BadIter", "c": {"<BadKey>": 1},
                                         "d": "BadItem", "e": "<NoRepr>", "big": "<int>"})]
