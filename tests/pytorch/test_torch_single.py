"""One process, real torch on CPU: operators in detail windows, record_function/nvtx ranges,
optimizer steps with DataLoader waits (issue 20 items 1, 2, 5)."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install stepscope[torch])")

import tq  # noqa: E402

import stepscope  # noqa: E402

BATCHES = 6  # per epoch
EPOCHS = 2


class _NvtxLibrary:
    """torch.cuda.nvtx's calls into NVTX, as a CUDA build's return: torch's CPU build has
    none (its stub raises), and its Python functions, which the capture wraps, are tested."""

    def rangePushA(self, msg):  # noqa: N802 - torch._C._nvtx's names
        return 0

    def rangePop(self):  # noqa: N802
        return 0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The scenario of the issue, small: an MLP, a DataLoader, record_function and nvtx ranges,
    user ranges and phases, no step() calls (step_on="optimizer"); windows at batches 1-2."""
    out = tmp_path_factory.mktemp("torch1")
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(BATCHES * 4, 8), torch.randn(BATCHES * 4, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = stepscope.Profiler(dir=out, run_id="a", schedule=(1, 3), step_on="optimizer",
                              host_metrics=False, report=False, use_env=False, torch=True)
    nv = torch.cuda.nvtx
    library = nv._nvtx
    if not torch.version.cuda:
        nv._nvtx = _NvtxLibrary()
    prof.start()
    try:
        time.sleep(0.05)  # step 0 must start at the first batch wait, not here
        t_loop = time.perf_counter_ns()
        enabled = []  # torch's profiler on, per batch
        for _ in range(EPOCHS):
            for x, y in loader:
                enabled.append(torch.autograd._profiler_enabled())
                with stepscope.annotate("fwd"):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                with torch.profiler.record_function("bwd"):
                    loss.backward()
                with stepscope.phase("Optimization"):
                    opt.step()
                    opt.zero_grad()
                with torch.cuda.nvtx.range("nv"):
                    pass
    finally:  # (a failure here must leave no profiler running into the next tests)
        files = prof.stop()
        nv._nvtx = library
    return {"dir": out / "a", "files": files, "t_loop": t_loop, "enabled": enabled,
            "tid": threading.get_native_id(), "prof": prof}


def test_torch_profiler_runs_only_inside_windows(run):
    assert run["enabled"] == [False, True, True, False, False, False] * EPOCHS
    assert not torch.autograd._profiler_enabled()


def test_a_step_per_optimizer_step_from_the_first_batch_wait(run):
    d = tq.db(run["dir"] / "rank0.summary.pftrace")
    steps = tq.slices(d, "s.category = 'step'")
    assert [s["name"] for s in steps] == [f"step {i}" for i in range(BATCHES * EPOCHS)]
    waits = tq.slices(d, "s.name = 'dataloader.next'")
    assert len(waits) == BATCHES * EPOCHS
    ends = tq.slices(d, "s.name = 'dataloader.exhausted'")  # each epoch's final wait: in no
    assert len(ends) == EPOCHS  # step, after the epoch's last
    for k, e in enumerate(ends):
        last = steps[(k + 1) * BATCHES - 1]
        assert last["ts"] + last["dur"] <= e["ts"]
        assert not any(st["ts"] < e["ts"] + e["dur"] <= st["ts"] + st["dur"] for st in steps)
    first = steps[0]
    assert first["ts"] > run["t_loop"]  # not at start(): after the sleep
    assert 0 <= waits[0]["ts"] - first["ts"] < 2_000_000
    for st in steps:  # each step holds exactly one wait, and every range ends inside its step
        inside = [w for w in waits if st["ts"] <= w["ts"] < st["ts"] + st["dur"]]
        assert len(inside) == 1
    for s in tq.slices(d, "s.category = 'record_function'"):
        owner = [st for st in steps if st["ts"] <= s["ts"] < st["ts"] + st["dur"]]
        if owner:
            assert s["ts"] + s["dur"] <= owner[0]["ts"] + owner[0]["dur"], s
    assert run["prof"].timer_stats().steps == BATCHES * EPOCHS


def test_record_function_and_nvtx_ranges_at_summary_level(run):
    d = tq.db(run["dir"] / "rank0.summary.pftrace")
    bwd = tq.slices(d, "s.name = 'bwd'")
    assert len(bwd) == BATCHES * EPOCHS and {b["category"] for b in bwd} == {"record_function"}
    assert all(b["depth"] == 0 for b in bwd)  # (the steps have a track of their own)
    assert "bwd" not in {s["name"] for s in tq.outside_steps(d)}  # each inside its step
    nv = tq.slices(d, "s.name = 'nv'")
    assert len(nv) == BATCHES * EPOCHS and {b["category"] for b in nv} == {"nvtx"}
    opt = tq.slices(d, "s.name = 'Optimizer.step#SGD.step'")
    assert len(opt) == BATCHES * EPOCHS
    phases = {p["id"]: p for p in tq.slices(d, "s.name = 'Optimization'")}
    assert all(o["parent_id"] in phases for o in opt)  # torch's range inside the user's phase
    assert not tq.slices(d, "s.category = 'torch_op'")  # operators: detail windows only


def test_operators_nested_under_user_ranges_with_shapes_and_flows(run):
    d = tq.db(run["dir"] / "rank0.detail.0.pftrace")
    fwd = {s["id"]: s for s in tq.slices(d, "s.name = 'fwd'")}
    assert len(fwd) == 2  # batches 1 and 2
    linear = tq.slices(d, "s.name = 'aten::linear'")
    assert len(linear) == 4 and all(s["parent_id"] in fwd for s in linear)
    for s in linear:  # the clock alignment: inside the enclosing range
        p = fwd[s["parent_id"]]
        assert p["ts"] <= s["ts"] and s["ts"] + s["dur"] <= p["ts"] + p["dur"]
    a = tq.args(d, linear[0]["arg_set_id"])
    assert a == {"input_shapes": "[[4, 8], [16, 8], [16]]", "input_dtypes": "float, float, float"}
    threads = tq.rows(d, "SELECT DISTINCT t.tid FROM slice s JOIN thread_track tt ON "
                         "tt.id = s.track_id JOIN thread t USING(utid) "
                         "WHERE s.category = 'torch_op'")
    assert threads == [{"tid": run["tid"]}]
    flows = tq.rows(d, "SELECT o.name AS a, i.name AS b FROM flow f JOIN slice o ON "
                       "o.id = f.slice_out JOIN slice i ON i.id = f.slice_in")
    pairs = {(f["a"], f["b"]) for f in flows}
    assert ("aten::addmm", "autograd::engine::evaluate_function: AddmmBackward0") in pairs
    assert ("aten::relu", "autograd::engine::evaluate_function: ReluBackward0") in pairs
    # per batch, the ops that made autograd nodes: 2 x (t, addmm) in the linears, relu, mse_loss;
    # each linked once to its backward node
    assert len(flows) == 2 * 6
    assert sorted(f["a"] for f in flows) == sorted(
        ["aten::t", "aten::addmm"] * 4 + ["aten::relu", "aten::mse_loss"] * 2)
    assert len(tq.slices(d, "s.name = 'bwd'")) == 2  # Kineto's copy of the range left out


def test_operators_summary_lists_them(run):
    from stepscope.analysis import summaries

    d = tq.db(run["dir"] / "rank0.detail.1.pftrace")
    rows = {r["name"]: r for r in summaries.table(d, "operators").rows}
    assert rows["aten::addmm"]["calls"] == 4
    assert rows["aten::mse_loss"]["calls"] == 2
    assert rows["autograd::engine::evaluate_function: AddmmBackward0"]["calls"] == 4


def test_summary_of_the_run_dir_shows_the_windows_operators_beside_the_ranges(run, capsys):
    """The whole run has summary-level ranges (record_function, nvtx): they keep the operators
    table; the windows' operators follow it, in a table of their own (it was left out)."""
    import json

    from stepscope import cli

    rc = cli.main(["summary", "--engine", "embedded", "--format", "json", "-q",
                   "--table", "operators", str(run["dir"])])
    out, err = capsys.readouterr()
    assert rc == 0, err
    data = json.loads(out)
    assert list(data) == ["operators", "operators_detail"]
    whole = {r["name"]: r["calls"] for r in data["operators"]["rows"]}
    n = BATCHES * EPOCHS
    # (stepscope.annotate is detail level: "fwd" is in the windows only)
    assert whole == {"bwd": n, "nv": n, "Optimizer.step#SGD.step": n,
                     "Optimizer.zero_grad#SGD.zero_grad": n}
    ops = data["operators_detail"]
    assert ops["title"] == "Operators (detail windows)"
    calls = {r["name"]: r["calls"] for r in ops["rows"]}
    # 4 batches in windows (1 and 2 of each epoch), two Linear layers each
    assert calls["aten::addmm"] == 8 and calls["aten::mse_loss"] == 4
    assert calls["fwd"] == 4 and calls["bwd"] == 4  # the windows' user ranges, once each


def test_the_end_of_run_report_shows_the_windows_operators(tmp_path, capfd):
    model = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8)
    prof = stepscope.Profiler(dir=tmp_path, run_id="r", schedule=(1, 3), host_metrics=False,
                              use_env=False, torch=True)
    prof.start()
    for _ in range(4):
        with torch.profiler.record_function("train"):  # a summary-level range: fills the table
            model(x).sum().backward()
        prof.step()
    prof.stop()
    err = capfd.readouterr().err
    head, _, detail = err.partition("Operators (detail windows)")
    assert "train" in head and "aten::addmm" not in head  # the whole run's ranges, 4 calls
    table = detail.split("\n\n")[0]
    row = [ln.split() for ln in table.splitlines() if ln.startswith("aten::addmm ")]
    assert row and row[0][1] == "2"  # batches 1 and 2
    assert "from 1 detail window file(s)" in table


def test_thread_tracks_for_threads_python_does_not_know():
    """A C++ thread (the autograd engine's on GPUs) gets a thread track named from /proc; a
    device event (Kineto hands CUDA records over when its CUPTI callbacks got them) is not an
    operator."""
    from torch._C._autograd import DeviceType

    from stepscope.core import session as _session
    from stepscope.core.native_threads import thread_name
    from stepscope.pytorch.events import from_events
    from stepscope.pytorch.operators import OperatorCapture

    class Ev:
        def __init__(self, name, start, dur, tid, device=DeviceType.CPU):
            self.v = (name, start, dur, tid, device)

        def device_type(self):
            return self.v[4]

        def name(self):
            return self.v[0]

        def start_ns(self):
            return self.v[1]

        def duration_ns(self):
            return self.v[2]

        def device_resource_id(self):
            return self.v[3]

        def sequence_nr(self):
            return -1

        def dtypes(self):
            return []

    sess = _session.Session(None, detail=True)
    cap = OperatorCapture(sess)
    worker = threading.Thread(target=time.sleep, args=(0.5,), name="py-worker")
    worker.start()
    try:
        n = cap.write(from_events([Ev("a", 1000, 10, worker.native_id),
                                   Ev("sgemm", 1500, 10, 7, DeviceType.CUDA),
                                   Ev("b", 2000, 10, 4_000_000_000)], cpu_only=True),
                      lambda ts: ts)
        assert n == 2
        assert cap._tracks[worker.native_id] == sess.thread_track(worker.ident)
        own = cap._tracks[4_000_000_000]
        assert sess.registry._native_threads == {4_000_000_000: own}
        assert b"thread 4000000000" in sess.tracks[own]  # gone from /proc: a plain name
        assert thread_name(threading.get_native_id()) != ""
    finally:
        worker.join()


def test_clock_offsets_interpolate_between_window_start_and_end():
    from stepscope.pytorch.operators import _Offsets

    conv = _Offsets((1_000, 500), (3_000, 700))  # offset 500 at mono 1000, 700 at mono 3000
    assert conv(1_500) == 1_000  # at the start: offset 500
    assert conv(2_000 + 600) == 2_000  # halfway: 600
    assert conv(3_000 + 700) == 3_000
    assert conv(10_000 + 700) == 10_000  # past the end: the end's offset


def test_clock_offsets_in_bulk_are_the_scalar_conversion():
    from stepscope.pytorch.operators import _Offsets

    conv = _Offsets((1_000, 500), (3_000, 700))
    real = [0, 1_500, 1_501, 2_600, 2_601, 2_602, 3_699, 3_700, 10_700]
    assert conv.many(real).tolist() == [conv(r) for r in real]
    assert conv.many(real)[:4].tolist() == [-500, 1_000, 1_001, 2_000]  # clamped before the start
    flat = _Offsets((1_000, 500), (3_000, 500))
    assert flat.many([1_500, 9_000]).tolist() == [1_000, 8_500]


def test_bulk_slices_are_ordered_as_single_ones():
    """Emitter.completes_indexed: the same (ts, order, tiebreak, sequence) keys as complete()
    calls, so a flush sorts bulk-written operators exactly as before."""
    from stepscope.core.session import Emitter
    from stepscope.record import recorder as rec

    slices = [(100, 50, "a"), (100, 0, "b"), (120, 10, "a")]
    one, bulk = Emitter("monotonic", 1), Emitter("monotonic", 1)
    for ts, dur, name in slices:
        one.complete(ts, dur, name, 7, "torch_op")
    blobs = [rec.Blob(rec.BEGIN, rec.event_id(n, ("torch_op",)), 1, 7) for _, _, n in slices]
    end = rec.Blob(rec.END, 0, 1, 7)
    bulk.completes_indexed([s[0] for s in slices], [s[1] for s in slices], [*blobs, end],
                           [0, 1, 2], [3, 3, 3])
    a, b = _taken(one), _taken(bulk)
    assert [e[:4] for e in a] == [e[:4] for e in b]
    assert [(e[4].kind, e[4].eid, e[4].track) for e in a] == [
        (e[4].kind, e[4].eid, e[4].track) for e in b]
    assert [e[:3] for e in b] == [(100, 1, -150), (100, 1, -100), (100, 2, -100),
                                  (120, 1, -130), (130, 0, -120), (150, 0, -100)]


def test_a_batch_of_single_and_bulk_slices_reaches_one_flush_whole():
    """Emitter.batch with complete() and completes_indexed() inside: taken together, in
    order."""
    from stepscope.core.session import Emitter
    from stepscope.record import recorder as rec

    em = Emitter("monotonic", 1)
    b = rec.Blob(rec.BEGIN, rec.event_id("x", ()), 1, 7)
    end = rec.Blob(rec.END, 0, 1, 7)
    with em.batch():
        em.complete(300, 10, "y", 7)
        assert _taken(em) == []  # nothing before the batch ends
        em.completes_indexed([100, 200], [5, 0], [b, end], [0, 0], [1, 1])
    got = _taken(em)
    assert [e[:3] for e in got] == [(100, 1, -105), (105, 0, -100), (200, 1, -200),
                                    (200, 2, -200), (300, 1, -310), (310, 0, -300)]
    assert [e[4] for e in got][:4] == [b, end, b, end]
    assert _taken(em) == []


def _taken(em) -> list[tuple]:
    """An emitter's events so far as (ts, order, tiebreak, seq no, blob), in the flush's order."""
    keys, idx, blobs = em._take()
    return [(*k, blobs[i]) for k, i in zip(keys.T.tolist(), idx.tolist(), strict=True)]
