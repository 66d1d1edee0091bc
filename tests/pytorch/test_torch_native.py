"""The native reader of torch's profiler events (``stepscope build-torch``): built for real
against the installed torch, it gives the Python reader's columns and the same trace."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install stepscope[torch])")

import tq  # noqa: E402

import stepscope  # noqa: E402
from stepscope.pytorch import events, native, operators  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux")
                       or shutil.which(os.environ.get("CXX", "c++")) is None,
                       reason="no C++ compiler"),
    pytest.mark.skipif(os.environ.get("STEPSCOPE_PURE_PYTHON", "") not in ("", "0"),
                       reason="STEPSCOPE_PURE_PYTHON=1: the native reader is never loaded")]


@pytest.fixture
def reader(native_cache, monkeypatch):
    monkeypatch.setenv("STEPSCOPE_CACHE_DIR", str(native_cache))
    mod = native.load()
    assert mod is not None
    return mod


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    x, y = torch.randn(4, 8), torch.randn(4, 1)

    def work():
        for _ in range(2):
            with torch.profiler.record_function("user"):
                loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()

    work()  # warm: the profiled passes run the same ops in the same order
    return work


def _profiled(work, read):
    cap = operators.OperatorCapture(None)
    assert cap.begin()
    t0 = time.time_ns()
    work()
    t1 = time.time_ns()
    return read(), t0, t1


def test_native_and_python_readers_give_the_same_columns(reader):
    import torch.autograd as ag

    work = _model()

    def read_native():
        assert reader.take() > 0
        try:
            return events.from_native(reader.columns())
        finally:
            reader.release()
            reader.join()

    py, _, _ = _profiled(work, lambda: events.from_events(ag._disable_profiler().events()))
    nat, t0, t1 = _profiled(work, read_native)
    assert not ag._profiler_enabled()
    assert len(nat) == len(py) > 100
    assert nat.names == py.names and "aten::addmm" in nat.names and "user" in nat.names
    assert (nat.shapes, nat.dtypes) == (py.shapes, py.dtypes)
    i = nat.names.index("aten::addmm")
    first = int(nat.inputs[np.flatnonzero(nat.name == i)[0]])
    # addmm(bias, x, weight.t(), beta, alpha): the scalars have no shape
    assert (nat.shapes[first], nat.dtypes[first]) == ("[[16], [4, 8], [8, 16], [], []]",
                                                       "float, float, float, Scalar, Scalar")
    for col in ("name", "inputs", "tid", "start_tid", "fwd_tid"):
        assert np.array_equal(getattr(nat, col), getattr(py, col)), col
    # sequence numbers go on counting between the runs: the same ones, shifted
    assert np.array_equal(nat.seq < 0, py.seq < 0)
    assert len(set((nat.seq - py.seq)[nat.seq >= 0].tolist())) == 1
    # torch's stamps: its approximate clock converted to Unix time (within a microsecond here)
    slack = 100_000
    assert t0 - slack <= nat.start.min() and (nat.start + nat.dur).max() <= t1 + slack
    assert (nat.dur >= 0).all() and set(nat.tid.tolist()) == {threading.get_native_id()}


def _window(tmp, work, report=False):
    prof = stepscope.Profiler(dir=tmp, run_id="r", schedule=(1, 2), host_metrics=False,
                              report=report, use_env=False, torch=True)
    prof.start()
    for _ in range(3):
        with stepscope.annotate("fwd"):
            work()
        prof.step()
    prof.stop()
    return prof.hooks[0].ops, tq.db(tmp / "r" / "rank0.detail.0.pftrace")


def _operators(d):
    return tq.rows(d, "SELECT s.name, s.depth, a.display_value AS shapes, COUNT(*) AS n "
                      "FROM slice s LEFT JOIN args a ON a.arg_set_id = s.arg_set_id AND "
                      "a.key = 'debug.input_shapes' WHERE s.category = 'torch_op' "
                      "GROUP BY 1, 2, 3 ORDER BY 1, 2, 3")


def _flows(d):
    return tq.rows(d, "SELECT o.name AS a, i.name AS b, COUNT(*) AS n FROM flow f "
                      "JOIN slice o ON o.id = f.slice_out JOIN slice i ON i.id = f.slice_in "
                      "GROUP BY 1, 2 ORDER BY 1, 2")


def test_a_window_read_natively_is_the_window_read_in_python(reader, tmp_path, monkeypatch):
    work = _model()
    ops, d = _window(tmp_path / "native", work)
    assert ops.last_reader == "native" and ops.last_count > 100
    monkeypatch.setenv("STEPSCOPE_PURE_PYTHON", "1")
    ops_py, d_py = _window(tmp_path / "python", work)
    assert ops_py.last_reader == "python" and ops_py.last_count == ops.last_count
    assert _operators(d) == _operators(d_py)
    flows = _flows(d)
    assert flows == _flows(d_py)
    assert {"a": "aten::addmm", "b": "autograd::engine::evaluate_function: AddmmBackward0",
            "n": 4} in flows


def test_the_report_names_the_build_only_where_windows_read_through_python(
        reader, tmp_path, monkeypatch, capfd):
    work = _model()
    hint = "torch's operator events were read through its Python API"
    _window(tmp_path / "native", work, report=True)
    err = capfd.readouterr().err
    assert "steps" in err and hint not in err  # the report, without the hint
    monkeypatch.setenv("STEPSCOPE_PURE_PYTHON", "1")
    _window(tmp_path / "python", work, report=True)
    assert capfd.readouterr().err.count(hint) == 1


def test_a_forked_child_does_not_wait_for_the_parents_free(reader):
    """The free runs on a native thread, which a fork does not copy (DataLoader workers fork
    while it may run): the child's join() returns at once (glibc marks the parent's other
    threads dead in a child), and the parent's still waits for its free."""
    work = _model()
    for _ in range(3):  # a result big enough that its free is still running at the fork
        assert operators.OperatorCapture(None).begin()
        for _ in range(100):
            work()
        reader.take()
        reader.release()
        pid = os.fork()
        if pid == 0:  # the child: join, then leave without the parent's atexit handlers
            reader.join()
            os._exit(7)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.01)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in join()")
        assert os.waitstatus_to_exitcode(status) == 7
        reader.join()


def test_a_damaged_build_is_not_loaded(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("STEPSCOPE_CACHE_DIR", str(tmp_path))
    path = native.module_path(torch)
    assert native.load() is None  # not built: the Python reader, silently
    assert capfd.readouterr().err == ""
    path.write_bytes(b"\x7fELF not really")
    assert native.load() is None
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "cannot load the native torch reader" in err


def test_another_torch_build_looks_elsewhere(monkeypatch):
    here = native.module_path(torch)
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert native.module_path(torch) != here


def test_build_without_a_compiler_says_so_in_one_line(tmp_path):
    env = dict(os.environ, STEPSCOPE_CACHE_DIR=str(tmp_path), CXX="/nonexistent/c++")
    proc = subprocess.run([sys.executable, "-m", "stepscope.cli", "build-torch"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0
    assert "no C++ compiler (/nonexistent/c++)" in proc.stderr
    assert os.listdir(tmp_path) == []
