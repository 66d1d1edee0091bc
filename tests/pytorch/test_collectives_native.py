"""Collectives through the native module (built by ``stepscope build-torch``): completions
stamped in C++ (``work_done.cpp``) and, on a torch with process-group hooks, the hooks
themselves in C++ (``collective_hooks.cpp``). The same slices as through Python's hooks and
done callbacks, each ending when its work completed, and no wait for the GIL on gloo's thread."""

from __future__ import annotations

import array
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install stepscope[torch])")
import torch.distributed as dist  # noqa: E402
import tq  # noqa: E402

from stepscope.core.session import Session  # noqa: E402
from stepscope.pytorch import collectives, native  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux")
                       or shutil.which(os.environ.get("CXX", "c++")) is None,
                       reason="no C++ compiler"),
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")]

PROGRAM = textwrap.dedent("""
    import json, sys, time, torch, torch.distributed as dist, stepscope
    from stepscope.pytorch import collectives
    run_dir, mode, completion, backend = sys.argv[1:5]
    dev = "cuda" if backend == "nccl" else "cpu"
    collectives.USE_PG_HOOKS = None if mode == "hooks" else False
    collectives.USE_STAMPS = None if completion == "stamps" else False
    prof = stepscope.Profiler(dir=run_dir, run_id=mode, schedule=None, report=False,
                              use_env=False, host_metrics=False, torch=True)
    prof.start()
    dist.init_process_group(backend, init_method=f"file://{run_dir}/store-{mode}", rank=0,
                            world_size=1)
    tracer = next(h.collectives for h in prof.hooks if hasattr(h, "collectives"))
    spans = []  # each async op's ns from before its call to after its wait
    for n in (1000, 10, 3):
        t0 = time.perf_counter_ns()
        dist.all_reduce(torch.ones(n, device=dev), async_op=True).wait()
        spans.append(time.perf_counter_ns() - t0)
    dist.all_reduce(torch.ones(2, device=dev))  # synchronous
    prof._sess.flush()  # the stamped ones are written before it takes the synchronous one
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2).to(dev))
    model(torch.ones(3, 4, device=dev)).sum().backward()  # DDP's all-reduce of 10 floats
    prof.step()
    kernels = tracer._native_kernels  # (while the profiler runs)
    prof.stop()
    dist.destroy_process_group()
    print(json.dumps({"stamps": tracer._stamps is not None, "spans": spans,
                      "native_hooks": tracer._native_hooks and bool(tracer._owners),
                      "native_kernels": kernels,
                      "waiting": len(tracer._waiting), "failures": tracer.failures}))
""")


def _run(tmp_path, mode: str, completion: str, env: dict, backend: str = "gloo"
         ) -> tuple[dict, list[dict], object]:
    script = tmp_path / "c.py"
    script.write_text(PROGRAM)
    run_dir = tmp_path / completion
    run_dir.mkdir(exist_ok=True)
    r = subprocess.run([sys.executable, str(script), str(run_dir), mode, completion, backend],
                       capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stepscope" not in r.stderr, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    d = tq.db(run_dir / mode / "rank0.summary.pftrace")
    return out, tq.slices(d, "s.category = 'collective'"), d


def _described(d, slices: list[dict]) -> list[tuple]:
    return [(s["name"],) + tuple(tq.args(d, s["arg_set_id"]).get(k)
                                 for k in ("bytes", "dtype", "group_size", "completion"))
            for s in slices]


def _same_slices_stamped_and_called_back(tmp_path, native_cache, mode: str,
                                         backend: str = "gloo") -> None:
    env = dict(os.environ, STEPSCOPE_CACHE_DIR=str(native_cache))
    out, slices, d = _run(tmp_path, mode, "stamps", env, backend)
    assert out["stamps"] and out["waiting"] == 0 and out["failures"] == 0
    # the hooks themselves in C++ there; else our kernels on the c10d ops are C++
    assert (out["native_hooks"], out["native_kernels"]) == (mode == "hooks", mode == "python")
    got = _described(d, slices)
    # the program's four; DDP's from C++: at construction the parameters' count (one int64),
    # their shapes (6 int64) and values (10 floats), then the gradients' all-reduce. NCCL's
    # end when enqueued on their stream (its kernels have their time)
    end = "stream" if backend == "nccl" else None
    assert got == [("allreduce", "4000", "float32", "1", end),
                   ("allreduce", "40", "float32", "1", end),
                   ("allreduce", "12", "float32", "1", end),
                   ("allreduce", "8", "float32", "1", end),
                   ("allgather", "8", "int64", "1", end),
                   ("broadcast", "48", "int64", "1", end),
                   ("broadcast", "40", "float32", "1", end),
                   ("allreduce", "40", "float32", "1", end)], got
    for s, span in zip(slices, out["spans"], strict=False):
        assert 0 < s["dur"] <= span, (s, span)
    py_out, py_slices, py_d = _run(tmp_path, mode, "callback", env, backend)
    assert not py_out["stamps"] and not py_out["native_hooks"] and not py_out["native_kernels"]
    assert _described(py_d, py_slices) == got


@pytest.mark.parametrize("mode", ["hooks", "python"])
def test_native_stamps_give_the_slices_of_the_done_callbacks(tmp_path, native_cache, mode):
    """Through the process-group hooks and through the path of a torch without them, one
    program's ops read the same with the completion stamped in C++ as with Python's done
    callbacks; each async op's slice lies inside its call-to-wait span. A flush taken while
    stamped ops wait to be written writes them first (else the synchronous op's slice, written
    at once, would come first and push theirs after it)."""
    if mode == "hooks" and not hasattr(dist.ProcessGroup, "register_pre_hook"):
        pytest.skip("this torch has no process-group hooks")
    _same_slices_stamped_and_called_back(tmp_path, native_cache, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["hooks", "python"])
def test_nccl_ops_stamped_in_cpp(tmp_path, native_cache, mode):
    """The same program on one GPU with NCCL: its futures are CUDA futures, completed when
    the op is enqueued on its stream, so every op ends there with ``completion: stream`` (the
    kernels from CUPTI are the device-side truth), through C++ and through Python alike."""
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("no CUDA device or no NCCL")
    if mode == "hooks" and not hasattr(dist.ProcessGroup, "register_pre_hook"):
        pytest.skip("this torch has no process-group hooks")
    _same_slices_stamped_and_called_back(tmp_path, native_cache, mode, "nccl")


PROMPT = textwrap.dedent("""
    import json, sys, time, torch, torch.distributed as dist, stepscope
    from stepscope.pytorch import collectives
    run_dir = sys.argv[1]
    collectives.USE_STAMPS = None if sys.argv[2] == "stamps" else False
    dist.init_process_group("gloo", init_method=f"file://{run_dir}/store", rank=0, world_size=1)
    prof = stepscope.Profiler(dir=run_dir, run_id="p", schedule=None, report=False,
                              use_env=False, host_metrics=False, torch=True)
    prof.start()
    dist.all_reduce(torch.ones(4))
    sys.setswitchinterval(2.0)  # the program's Python keeps the GIL for 2 s at a time
    polls = []  # (done at the first look, seconds until done or 1.5)
    for _ in range(50):
        work = dist.all_reduce(torch.ones(4), async_op=True)
        t0 = time.monotonic()
        first = work.is_completed()
        while not work.is_completed() and time.monotonic() - t0 < 1.5:
            pass
        polls.append((first, time.monotonic() - t0))
        work.wait()
        if not first:
            break
    sys.setswitchinterval(0.005)
    prof.stop()
    dist.destroy_process_group()
    print(json.dumps(polls))
""")


def test_a_completion_does_not_wait_for_the_programs_python(tmp_path, native_cache):
    """gloo marks a work complete after its future's callbacks ran. A Python done callback
    needs the GIL, which a program polling ``is_completed()`` in Python holds for the switch
    interval (2 s here): its poll times out at 1.5 s. Stamped in C++, the work completes at
    once. (A work gloo finished while the call was still returning, its callback run before
    the program took the GIL back, is done at the first look and says nothing of the wait:
    the program tries again, up to 50 times, until one was not; where none was, as on a
    loaded machine, the callback's side has nothing to show and the test is skipped.)"""
    script = tmp_path / "p.py"
    script.write_text(PROMPT)
    env = dict(os.environ, STEPSCOPE_CACHE_DIR=str(native_cache))
    polls = {}
    for completion in ("stamps", "callback"):
        (tmp_path / completion).mkdir()
        r = subprocess.run([sys.executable, str(script), str(tmp_path / completion), completion],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        polls[completion] = json.loads(r.stdout.strip().splitlines()[-1])
    # (a second for the stamps: a loaded machine may keep gloo's thread waiting that long)
    assert max(t for _, t in polls["stamps"]) < 1.0, polls
    first, waited = polls["callback"][-1]
    if first:
        pytest.skip("gloo completed all 50 ops before the program took the GIL back")
    assert waited >= 1.5, polls


class _OtherWork:
    """A work of another kind than torch's C++ ``Work`` (a backend written in Python)."""

    def __init__(self):
        self.fut = torch.futures.Future()

    def get_future(self):
        return self.fut


def test_works_the_build_cannot_stamp(tmp_path, native_cache, monkeypatch):
    """A work that is no C++ ``Work`` turns the stamps off for good (done callbacks from then
    on, its slice written at its completion; works stamped before still drain); a ``Work``
    without a future (gloo's send/recv) waits for the program's wait, and ends when issued
    where none comes."""
    monkeypatch.setenv("STEPSCOPE_CACHE_DIR", str(native_cache))
    mod = native.load()
    assert hasattr(mod, "watch")
    sess = Session(tmp_path / "t.pftrace").start()
    tracer = collectives.CollectiveTracer(sess)
    tracer._stamps, tracer._watching = mod, True
    t0 = time.perf_counter_ns()
    tracer._finish((t0, "SEND", 8, "float32", False), torch._C._distributed_c10d.Work(), 2, "0")
    assert tracer.count == 0 and tracer._watching and not tracer._waiting
    assert len(tracer._parked) == 1
    tracer._end_parked(everything=True)  # (stop's: it was never waited for)
    assert tracer.count == 1 and not tracer._parked
    # a real work stamped before the switch still drains after it
    fut = torch.futures.Future()
    stamped = torch._C._distributed_c10d._create_work_from_future(fut)
    tracer._finish((t0, "BROADCAST", 4, "float32", False), stamped, 2, "0")
    assert len(tracer._waiting) == 1
    other = _OtherWork()
    tracer._finish((t0, "ALLREDUCE", 16, "float32", False), other, 2, "0")
    assert not tracer._watching and tracer.count == 1 and len(tracer._waiting) == 1
    other.fut.set_result(None)
    fut.set_result(None)
    tracer.drain()
    assert tracer.count == 3 and tracer.failures == 0 and not tracer._waiting
    sess.stop()
    d = tq.db(tmp_path / "t.pftrace")
    got = [(s["name"], tq.args(d, s["arg_set_id"]).get("completion"))
           for s in tq.slices(d, "s.category = 'collective'")]
    assert sorted(got) == [("allreduce", None), ("broadcast", None), ("send", "issued")]


def test_a_stamp_that_comes_after_its_waiter_is_still_written_at_stop(tmp_path, native_cache,
                                                                       monkeypatch):
    """A future wakes its waiters before it runs its callbacks: DDP's step can end, and the
    profiler stop, before the C++ stamp of its last all-reduce (1 run in 5 of a 2-rank DDP run
    lost that op). Here a callback registered before ours takes 20 ms; the stop, made as soon
    as the future is done, still writes the op (a stamp whose future is done is waited for)."""
    import threading

    monkeypatch.setenv("STEPSCOPE_CACHE_DIR", str(native_cache))
    sess = Session(tmp_path / "t.pftrace").start()
    tracer = collectives.CollectiveTracer(sess)
    tracer._stamps, tracer._watching = native.load(), True
    fut = torch.futures.Future()
    fut.add_done_callback(lambda _f: time.sleep(0.02))  # runs before our stamp
    work = torch._C._distributed_c10d._create_work_from_future(fut)
    tracer._finish((time.perf_counter_ns(), "ALLREDUCE", 64, "float32", False), work, 2, "0")
    setter = threading.Thread(target=fut.set_result, args=(None,))
    setter.start()
    while not fut.done():
        pass
    tracer.drain()
    assert tracer.count == 0  # the stamp is not there yet
    tracer._drain_completed()
    setter.join()
    assert tracer.count == 1 and not tracer._waiting
    sess.stop()


def _device_work(done: bool):
    """A c10d ``Work`` whose future has a device (``cpu:0`` stands for CUDA's here), complete
    at once (as NCCL's, enqueued on a stream) or not."""
    fut = torch.futures.Future(devices=["cpu:0"])
    if done:
        fut.set_result(torch.ones(1))
    return torch._C._distributed_c10d._create_work_from_future(fut)


@pytest.mark.parametrize("stamps", [True, False])
def test_a_device_streams_op_ends_when_issued(tmp_path, native_cache, monkeypatch, stamps):
    """NCCL completes an op's future when it enqueues the op on its stream: the host slice ends
    there with ``completion: stream`` (its kernel has its time), in C++ (a future with devices,
    complete when its op returns) and in Python (by the op's input tensor being on a device,
    the future complete); an op whose future completes later is timed to it."""
    monkeypatch.setenv("STEPSCOPE_CACHE_DIR", str(native_cache))
    sess = Session(tmp_path / "t.pftrace").start()
    tracer = collectives.CollectiveTracer(sess)
    tracer._stamps, tracer._watching = (native.load(), True) if stamps else (None, False)
    if stamps:
        mod = tracer._stamps
        assert mod.watch(_device_work(True), -1) is True  # no stamp to come
        assert mod.watch(_device_work(False), -2) is False
        done = torch.futures.Future()
        done.set_result(None)
        assert mod.watch(torch._C._distributed_c10d._create_work_from_future(done), -3) is False
        assert sorted(array.array("q", mod.drain())[::2]) == [-3]
    t0 = time.perf_counter_ns()
    on_device = not stamps  # (C++ reads the future's devices, Python the input's)
    tracer._finish((t0, "ALLREDUCE", 16, "float32", on_device), _device_work(True), 2, "0")
    assert tracer.count == 1 and not tracer._waiting
    later = torch.futures.Future()  # a device's op whose future completes after it returned
    tracer._finish((t0, "BROADCAST", 8, "float32", on_device),
                   torch._C._distributed_c10d._create_work_from_future(later), 2, "0")
    assert tracer.count == 1
    time.sleep(0.01)
    later.set_result(None)
    tracer.drain()
    # no work: NCCL's synchronous op, enqueued on the current stream; a host's, done
    tracer._finish((t0, "ALLGATHER", 8, "float32", True), None, 2, "0")
    tracer._finish((t0, "REDUCE", 8, "float32", False), None, 2, "0")
    assert tracer.count == 4 and tracer.failures == 0
    sess.stop()
    d = tq.db(tmp_path / "t.pftrace")
    got = {s["name"]: (tq.args(d, s["arg_set_id"]).get("completion"), s["dur"])
           for s in tq.slices(d, "s.category = 'collective'")}
    assert got["allreduce"][0] == "stream" and got["allreduce"][1] < 10_000_000
    assert got["broadcast"][0] is None and got["broadcast"][1] >= 10_000_000
    assert got["allgather"][0] == "stream" and got["reduce"][0] is None


DEVICE_BACKEND = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist, stepscope
    import torch._C._distributed_c10d as c10d
    from stepscope.pytorch import collectives
    run_dir, mode, completion = sys.argv[1:4]
    collectives.USE_PG_HOOKS = None if mode == "hooks" else False
    collectives.USE_STAMPS = None if completion == "stamps" else False

    class DeviceStreamBackend(c10d.Backend):
        # as NCCL's: each op's work has a future with a device, complete when the op returns
        def allreduce(self, tensors, opts=None):
            fut = torch.futures.Future(devices=["cpu:0"])
            fut.set_result(tensors)
            return c10d._create_work_from_future(fut)

        def broadcast(self, tensors, opts=None):  # a synchronous op done on the host: no work
            assert not opts.asyncOp
            return None

    dist.Backend.register_backend("devstream", lambda store, rank, size, timeout:
                                  DeviceStreamBackend(rank, size), devices=["cpu"])
    dist.init_process_group("devstream", init_method=f"file://{run_dir}/store", rank=0,
                            world_size=1)
    prof = stepscope.Profiler(dir=run_dir, run_id="r", schedule=None, report=False,
                              use_env=False, host_metrics=False, torch=True)
    prof.start()
    dist.all_reduce(torch.ones(4), async_op=True).wait()
    dist.all_reduce(torch.ones(2))
    dist.broadcast(torch.ones(3), 0)
    tracer = next(h.collectives for h in prof.hooks if hasattr(h, "collectives"))
    native = tracer._native_hooks or tracer._native_kernels
    prof.stop()
    print(json.dumps({"native": native, "failures": tracer.failures}))
""")


@pytest.mark.parametrize("mode", ["hooks", "python"])
def test_a_device_backends_ops_through_the_cpp_hooks_and_kernels(tmp_path, native_cache, mode):
    """A backend whose futures are a device's, complete when the op returns (NCCL's kind): the
    C++ hooks and kernels end its ops there (``completion: stream``); a synchronous op on the
    host that returns no work ended when it returned (``issued`` by the hooks, whose post-hook
    runs then; the kernels' return is the op's). (Python's paths go by
    the input tensor, on a device: test_a_device_streams_op_ends_when_issued; a callback on
    this stand-in's ``cpu:0`` future cannot run, as torch has no stream pool for the CPU.)"""
    if mode == "hooks" and not hasattr(dist.ProcessGroup, "register_pre_hook"):
        pytest.skip("this torch has no process-group hooks")
    try:
        torch._C._distributed_c10d.Backend(0, 1)
    except TypeError:
        pytest.skip("this torch's c10d Backend cannot be subclassed in Python")
    script = tmp_path / "b.py"
    script.write_text(DEVICE_BACKEND)
    env = dict(os.environ, STEPSCOPE_CACHE_DIR=str(native_cache))
    r = subprocess.run([sys.executable, str(script), str(tmp_path), mode, "stamps"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"native": True, "failures": 0}
    d = tq.db(tmp_path / "r" / "rank0.summary.pftrace")
    assert _described(d, tq.slices(d, "s.category = 'collective'")) == [
        ("allreduce", "16", "float32", "1", "stream"), ("allreduce", "8", "float32", "1", "stream"),
        ("broadcast", "12", "float32", "1", "issued" if mode == "hooks" else None)]


NO_FUTURE = textwrap.dedent("""
    import json, sys, time, torch, torch.distributed as dist, stepscope
    from stepscope.pytorch import collectives
    run_dir, mode, completion = sys.argv[1:4]
    collectives.USE_PG_HOOKS = None if mode == "hooks" else False
    collectives.USE_STAMPS = None if completion == "stamps" else False
    prof = stepscope.Profiler(dir=run_dir, run_id="r", schedule=None, report=False,
                              use_env=False, host_metrics=False, torch=True)
    prof.start()
    dist.init_process_group("gloo", init_method=f"file://{run_dir}/store", rank=0,
                            world_size=1)
    tracer = next(h.collectives for h in prof.hooks if hasattr(h, "collectives"))
    out = torch.empty(64)
    t0 = time.perf_counter_ns()
    dist.reduce_scatter_tensor(out, torch.ones(64))  # (waits in Python)
    work = dist.reduce_scatter_tensor(out, torch.ones(64), async_op=True)
    time.sleep(0.02)
    work.wait()
    span = time.perf_counter_ns() - t0
    unwaited = dist.group.WORLD._reduce_scatter_base(torch.empty(16), torch.ones(16))
    prof.step()
    prof.step()  # (the second flush since it was issued: it ended when issued)
    prof.stop()
    dist.destroy_process_group()
    print(json.dumps({"span": span, "parked": len(tracer._parked), "failures": tracer.failures}))
""")


@pytest.mark.parametrize("completion", ["stamps", "callback"])
@pytest.mark.parametrize("mode", ["hooks", "python"])
def test_a_work_without_a_future_ends_at_its_wait(tmp_path, native_cache, mode, completion):
    """gloo's reduce_scatter_tensor gives a work without a future (its wait() waits for an
    inner all-reduce, then copies the output): its op ends when the program's wait returns.
    Waited in torch's own function (synchronous: FSDP's reduce-scatters on the CPU), that is
    its completion; waited by the program 20 ms later, its completion's latest ('waited');
    with no wait from Python, it ends when issued ('issued')."""
    if mode == "hooks" and not hasattr(dist.ProcessGroup, "register_pre_hook"):
        pytest.skip("this torch has no process-group hooks")
    script = tmp_path / "nf.py"
    script.write_text(NO_FUTURE)
    env = dict(os.environ, STEPSCOPE_CACHE_DIR=str(native_cache))
    r = subprocess.run([sys.executable, str(script), str(tmp_path), mode, completion],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["parked"] == 0 and out["failures"] == 0
    d = tq.db(tmp_path / "r" / "rank0.summary.pftrace")
    slices = tq.slices(d, "s.category = 'collective'")
    assert _described(d, slices) == [("reduce_scatter", "256", "float32", "1", None),
                                     ("reduce_scatter", "256", "float32", "1", "waited"),
                                     ("reduce_scatter", "64", "float32", "1", "issued")]
    assert slices[1]["dur"] >= 20_000_000  # to its wait, after the program's 20 ms
    assert slices[0]["dur"] + slices[1]["dur"] <= out["span"]


P2P = textwrap.dedent("""
    import json, sys, time, torch, torch.distributed as dist, stepscope
    from stepscope.pytorch import collectives
    run_dir, mode, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    collectives.USE_PG_HOOKS = None if mode == "hooks" else False
    prof = stepscope.Profiler(dir=run_dir, run_id="r", schedule=None, report=False,
                              use_env=False, host_metrics=False, torch=True)
    prof.start()
    dist.init_process_group("gloo", init_method=f"file://{run_dir}/store", rank=rank,
                            world_size=2)
    t = torch.zeros(8)
    dist.barrier()
    if rank == 1:
        time.sleep(0.03)  # rank 0's recv waits for this send
        dist.send(torch.ones(8), dst=0)
        work = dist.irecv(t, src=0)
        time.sleep(0.05)  # the program computes; rank 0 sent long ago
        work.wait()
    else:
        dist.recv(t, src=1)
        dist.isend(torch.ones(8), dst=1).wait()
    dist.barrier()
    prof.stop()
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("mode", ["hooks", "python"])
def test_gloo_send_and_recv_end_at_their_wait(tmp_path, native_cache, mode):
    """gloo's send/recv works have no future. dist.send/dist.recv wait in torch's own function
    right after issuing: the wait's return is their completion (rank 0's recv lasts the 30 ms
    until rank 1 sends, timed, no arg). A work the program waits for later, after 50 ms of its
    own, ends at that wait: its completion's latest ('waited'), as does one the program waits
    for at once (an isend's): only torch's own functions are known to wait at once."""
    if mode == "hooks" and not hasattr(dist.ProcessGroup, "register_pre_hook"):
        pytest.skip("this torch has no process-group hooks")
    script = tmp_path / "p2p.py"
    script.write_text(P2P)
    env = dict(os.environ, STEPSCOPE_CACHE_DIR=str(native_cache))
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), mode, str(rank)],
                              env=dict(env, RANK=str(rank), WORLD_SIZE="2"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]  # fmt: skip
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    got = {}
    for rank in (0, 1):
        d = tq.db(tmp_path / "r" / f"rank{rank}.summary.pftrace")
        slices = [s for s in tq.slices(d, "s.category = 'collective'") if s["name"] != "barrier"]
        got[rank] = [(desc, s["dur"]) for desc, s in zip(_described(d, slices), slices,
                                                            strict=True)]
    (recv, recv_ns), (isend, _) = got[0]
    assert (recv, isend) == (("recv", "32", "float32", "2", None),  # (the program's wait,
                             ("send", "32", "float32", "2", "waited"))  # if at once)
    assert recv_ns >= 25_000_000  # rank 1's 30 ms before its send (its clock's, barrier-aligned)
    (send, _), (irecv, irecv_ns) = got[1]
    assert (send, irecv) == (("send", "32", "float32", "2", None),
                             ("recv", "32", "float32", "2", "waited"))
    assert irecv_ns >= 50_000_000
