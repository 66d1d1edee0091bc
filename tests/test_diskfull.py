"""A disk that fills up and frees again: the file stays a valid trace at every moment, what
could not be written is dropped and counted, and events recorded after space returns are kept."""

from __future__ import annotations

import errno
import os
import subprocess
import uuid
import warnings
from collections import Counter

import pytest

import stepscope
from perfetto_decode import decode
from stepscope.core import session as _session
from stepscope.record import recorder as _recorder


@pytest.fixture(autouse=True)
def fresh_warnings():
    _recorder._warned.clear()
    yield
    _recorder._warned.clear()


def ranges(name: str, n: int) -> None:
    for i in range(n):
        with stepscope.annotate(name, step=i):
            pass


def begins(path) -> Counter:
    return Counter(e.name for e in decode(path).events if e.type == "B")


def dropped_marks(path) -> list:
    return [e.args["dropped_events"] for e in decode(path).events
            if e.name == "stepscope dropped events"]


@pytest.mark.parametrize("compress", [True, False])
def test_failed_writes_are_cut_back_dropped_counted_and_recording_goes_on(
        tmp_path, monkeypatch, compress):
    """os.write fails after writing half a chunk (ENOSPC), then keeps failing for two flushes,
    then works again."""
    path = str(tmp_path / "t.pftrace")
    sess = _session.Session(path, flush_interval_s=60, compress=compress)
    sess.start()
    sink = sess.sinks[0]
    real_write = os.write
    state = {"full": False, "calls": 0}

    def write(fd, data):
        if fd != sink.fd or not state["full"]:
            return real_write(fd, data)
        state["calls"] += 1
        if state["calls"] == 1 and len(data) > 1:  # half a packet lands on the disk
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", write)
    try:
        ranges("before", 100)
        sess.flush()
        kept = os.path.getsize(path)
        state["full"] = True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ranges("during", 5000)
            sess.flush()
            # the half-written chunk is gone: the file is what it was, and still reads
            assert os.path.getsize(path) == kept == sink.offset
            assert begins(path) == {"before": 100}
            ranges("during", 300)  # the restarted sequences cannot be written either
            sess.flush()
            assert os.path.getsize(path) == kept
            state["full"] = False
            ranges("after", 50)
            sess.flush()
            sess.stop()
    finally:
        sess.stop()
    assert state["calls"] >= 3
    assert [str(w.message) for w in caught if "No space left" in str(w.message)]
    assert begins(path) == {"before": 100, "after": 50}
    assert sess.dropped == 2 * (5000 + 300)  # a begin and an end per range
    assert dropped_marks(path) == [10600]
    d = decode(path)
    track = d.thread_track("MainThread")
    after = [s for s in d.slices(track) if s[0] == "after"]
    assert len(after) == 50 and all(s[1] == 0 for s in after)


def test_a_failed_cut_is_retried_so_no_partial_packet_stays(tmp_path, monkeypatch):
    """A write fails after half a chunk and the cut back fails too (EIO, while the disk is
    full): the next, shorter, chunk must not leave the old half packet's tail after it."""
    path = str(tmp_path / "t.pftrace")
    sess = _session.Session(path, flush_interval_s=60, compress=False)
    sess.start()
    sink = sess.sinks[0]
    real_write, real_truncate = os.write, os.ftruncate
    state = {"full": False, "calls": 0}

    def write(fd, data):
        if fd != sink.fd or not state["full"]:
            return real_write(fd, data)
        state["calls"] += 1
        if state["calls"] == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def ftruncate(fd, size):
        if fd == sink.fd and state["full"]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_truncate(fd, size)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "ftruncate", ftruncate)
    try:
        ranges("before", 100)
        sess.flush()
        kept = os.path.getsize(path)
        state["full"] = True
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            ranges("during", 5000)
            sess.flush()
            assert os.path.getsize(path) > kept  # the half chunk is still there
            state["full"] = False
            ranges("after", 50)
            sess.flush()
            sess.stop()
    finally:
        sess.stop()
    assert os.path.getsize(path) == sink.offset
    assert begins(path) == {"before": 100, "after": 50}


def test_slices_open_across_the_loss_stay_well_nested(tmp_path, monkeypatch):
    """A range begun before the disk filled and ended after: its end has no begin in the
    restarted sequence and is left out (no warning, no broken nesting)."""
    path = str(tmp_path / "t.pftrace")
    sess = _session.Session(path, flush_interval_s=60)
    sess.start()
    sink = sess.sinks[0]
    real_write = os.write
    full = {"on": False}

    def write(fd, data):
        if fd == sink.fd and full["on"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stepscope.push_range("outer")
        sess.flush()  # "outer" begins on disk
        full["on"] = True
        stepscope.push_range("inner")
        sess.flush()  # lost
        full["on"] = False
        stepscope.pop_range()  # ends "inner": lost begin, so this end is left out ...
        stepscope.pop_range()  # ... and so is "outer"'s
        ranges("after", 3)
        sess.stop()
    assert not [w for w in caught if "pop_range" in str(w.message)]
    d = decode(path)
    track = d.thread_track("MainThread")
    assert [e.name for e in d.by_track(track) if e.type == "B"] == ["outer", "after", "after",
                                                                    "after"]
    assert sess.dropped == 3  # every event recorded and not in the file: "inner"'s begin,
    # and the two ends left out (before, the ends went uncounted: 1)


def _mount_tmpfs(where: str, size: str) -> str | None:
    """Mount a small tmpfs; the reason when this machine does not allow it."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else f"cannot mount a tmpfs: {r.stderr.strip()}"


def test_real_disk_full_on_a_small_tmpfs(tmp_path):
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    why = _mount_tmpfs(str(mnt), "256k")
    if why:
        pytest.skip(why)
    sess = None
    try:
        path = str(mnt / "t.pftrace")
        sess = _session.Session(path, flush_interval_s=60)
        sess.start()
        ranges("before", 100)
        sess.flush()
        kept = os.path.getsize(path)
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:  # fill the disk to the last byte
            while True:
                os.write(fd, b"\xff" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        for n in (512, 64, 1):
            try:
                while True:
                    os.write(fd, b"\xff" * n)
            except OSError:
                pass
        os.close(fd)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ranges("during", 5000)
            sess.flush()
            assert os.path.getsize(path) == kept
            assert begins(path) == {"before": 100}
            os.remove(mnt / "filler")  # space comes back
            ranges("after", 50)
            sess.stop()
        assert [w for w in caught if "No space left" in str(w.message)]
        assert begins(path) == {"before": 100, "after": 50}
        assert sess.dropped == 10000
        assert dropped_marks(path) == [10000]
        assert os.path.getsize(path) > kept
    finally:
        if sess is not None:
            sess.stop()  # closes the file (a failed assertion above would keep the mount busy)
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
