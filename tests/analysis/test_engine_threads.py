"""The embedded engine's use of several cores: the thread helpers, the database file laid out
in place and its lifetime, and packet chunks scanned on threads."""

from __future__ import annotations

import errno
import gc
import os
import threading
import time

import pytest
from test_importer import load, rows
from test_sqlimage import _mixed_indexes, _mixed_table

from stepscope.analysis import _threads
from stepscope.analysis import sqlimage as si
from stepscope.analysis.tp import importer as im
from stepscope.analysis.tp import packets as _packets


@pytest.fixture
def two_cpus(monkeypatch):
    monkeypatch.setattr(_threads, "cpus", lambda: 2)


def test_in_parallel_keeps_the_order_and_starts_the_costliest_first(two_cpus):
    started: list[int] = []
    lock = threading.Lock()

    def fn(x: int) -> int:
        with lock:
            started.append(x)
        time.sleep(0.01 * (x % 3))
        return x * x

    items = [1, 5, 2, 9, 3]
    assert _threads.in_parallel(fn, items, cost=lambda x: x) == [1, 25, 4, 81, 9]
    assert started[:2] == [9, 5] and sorted(started) == sorted(items)


def test_in_parallel_raises_the_first_error(two_cpus):
    def fn(x: int) -> int:
        if x == 3:
            raise ValueError("three")
        return x

    with pytest.raises(ValueError, match="three"):
        _threads.in_parallel(fn, [1, 2, 3, 4])


def test_map_ordered_yields_in_order_with_few_ahead(two_cpus):
    done: list[int] = []
    lock = threading.Lock()

    def fn(x: int) -> int:
        time.sleep(0.02 if x == 0 else 0.001)  # the first one is the slowest
        with lock:
            done.append(x)
        return -x

    out = []
    for r in _threads.map_ordered(fn, list(range(8))):
        with lock:  # computed but not yet taken: this one and the cpus() in flight behind it
            assert len(done) - len(out) <= 3
        out.append(r)
    assert out == [-x for x in range(8)]


def test_beside_runs_both_at_once_and_waits_for_both(two_cpus):
    met = threading.Barrier(2, timeout=5)  # each waits for the other: only met side by side
    ended: list[str] = []

    def side(name: str, fail: bool = False):
        def run() -> str:
            met.wait()
            time.sleep(0.02 if name == "fn" else 0)  # fn ends last
            ended.append(name)
            if fail:
                raise ValueError(name)
            return name.upper()
        return run

    assert _threads.beside(side("fn"), side("main")) == ("FN", "MAIN")
    for fail_fn in (True, False):
        ended.clear()
        met.reset()
        with pytest.raises(ValueError, match="fn" if fail_fn else "main"):
            _threads.beside(side("fn", fail_fn), side("main", not fail_fn))
        assert sorted(ended) == ["fn", "main"]  # raised once both had ended


def test_cpus_is_at_least_one_and_capped():
    assert 1 <= _threads.cpus() <= _threads.MAX_THREADS


@pytest.mark.parametrize("reserve", [True, False])
def test_build_file_lays_out_the_bytes_build_gives(tmp_path, monkeypatch, reserve):
    t, strings = _mixed_table(20_000)
    want = si.build([t], strings, _mixed_indexes(t))
    if not reserve:  # a platform without posix_fallocate: a written copy
        monkeypatch.delattr(os, "posix_fallocate", raising=False)
    path = str(tmp_path / "image.db")
    si.build_file(path, [t], strings, _mixed_indexes(t))
    with open(path, "rb") as f:
        assert f.read() == want.tobytes()
    conn = si.open_file(path)
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert conn.execute("PRAGMA mmap_size").fetchone()[0] > 0  # read mapped
    assert si.file_of(conn) == path
    conn.close()


def _temp_files(d) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith(im.TEMP_PREFIX))


@pytest.fixture
def trace(tmp_path):
    import stepscope

    path = str(tmp_path / "t.pftrace")
    with stepscope.trace(path):
        for i in range(50):
            with stepscope.annotate(f"step {i}", category="step"):
                with stepscope.annotate("work"):
                    pass
    return path


def test_the_temporary_database_lives_as_long_as_the_db(trace, tmp_path, monkeypatch):
    from stepscope import analysis

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    db = analysis.open(trace, engine="embedded")
    [name] = _temp_files(tmp)
    assert si.file_of(db.conn) == str(tmp / name)
    assert db.query("SELECT COUNT(*) AS n FROM slice") == [{"n": 100}]
    db.conn.execute("CREATE TABLE mine AS SELECT name FROM slice")  # written (queries: read-only)
    db.close()
    assert _temp_files(tmp) == []
    db = analysis.open(trace, engine="embedded")
    assert len(_temp_files(tmp)) == 1
    del db  # never closed: deleted when collected (or at exit)
    gc.collect()
    assert _temp_files(tmp) == []


def test_a_temporary_file_that_cannot_be_written_leaves_the_database_in_memory(
        trace, tmp_path, monkeypatch):
    from stepscope import analysis

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    want = analysis.open(trace, engine="embedded", progress=None)
    expected = want.query("SELECT name, COUNT(*) AS n FROM slice GROUP BY name ORDER BY name")
    want.close()

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(si, "build_file", full)
    with analysis.open(trace, engine="embedded") as db:
        assert si.file_of(db.conn) is None and _temp_files(tmp) == []
        assert db.query("SELECT name, COUNT(*) AS n FROM slice GROUP BY name "
                        "ORDER BY name") == expected
    monkeypatch.undo()  # build_file back; now a temporary directory that does not exist
    monkeypatch.setattr("tempfile.tempdir", str(tmp / "missing"))
    with analysis.open(trace, engine="embedded") as db:
        assert si.file_of(db.conn) is None
        assert db.query("SELECT COUNT(*) AS n FROM slice") == [{"n": 100}]


def test_packet_chunks_scanned_on_threads_decode_like_one_pass(trace, monkeypatch):
    one, _ = load(trace)
    monkeypatch.setattr(_packets, "_CHUNK", 7)  # many chunks, several in flight
    monkeypatch.setattr(_threads, "cpus", lambda: 2)
    many, _ = load(trace)
    for table in ("slice", "counter", "args", "thread", "track", "stats"):
        q = f"SELECT * FROM {table} ORDER BY 1, 2"
        assert rows(many, q) == rows(one, q), table
