"""Collectives on a torch without ProcessGroup pre/post hooks (2.11, as an H100 image here ships):
a kernel of ours sits on the c10d ops' BackendSelect key instead, in Python or, where
``stepscope build-torch`` has built the native module, in C++. Forced here on a torch that has
the hooks, so every path runs on the same program and gives the same slices."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install stepscope[torch])")
import torch.distributed as dist  # noqa: E402
import tq  # noqa: E402

if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

PROGRAM = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, stepscope
    from stepscope.pytorch import collectives
    run_dir, mode = sys.argv[1], sys.argv[2]
    collectives.USE_PG_HOOKS = mode == "hooks"
    prof = stepscope.Profiler(dir=run_dir, run_id=mode, schedule=None, report=False,
                              use_env=False, host_metrics=False, torch=True)
    prof.start()
    dist.init_process_group("gloo", init_method=f"file://{run_dir}/store-{mode}", rank=0,
                            world_size=1)
    dist.all_reduce(torch.ones(1000))  # 4000 bytes of float32, synchronous
    dist.all_reduce(torch.ones(10, dtype=torch.float64), async_op=True).wait()  # 80 bytes
    dist.broadcast(torch.ones(5, dtype=torch.int32), src=0)  # 20 bytes
    dist.all_gather_into_tensor(torch.empty(16), torch.ones(16))  # input: 64 bytes
    dist.barrier()
    group = dist.new_group([0])
    dist.all_reduce(torch.ones(3), dist.ReduceOp.SUM, group)  # the group by position: 12 bytes
    with torch.inference_mode():  # no autograd key (an Autograd kernel would miss it): 28 bytes
        dist.all_reduce(torch.ones(7))
    # a functional collective (DTensor's, compiled code's): its kernel issues the c10d op below
    # the Autograd key; 20 bytes
    from torch.distributed import _functional_collectives as fc
    fc.wait_tensor(fc.all_reduce(torch.ones(5), "sum", dist.group.WORLD))
    dist.all_gather_into_tensor(output_tensor=torch.empty(2), input_tensor=torch.ones(2))  # 8
    # the c10d op itself, its arguments by name: 12 bytes
    torch.ops.c10d.broadcast_(tensors=[torch.ones(3)], root_rank=0, root_tensor=0, timeout=-1,
                              process_group=dist.distributed_c10d._get_default_group().boxed())
    # DDP: its C++ reducer all-reduces the gradients, 10 floats of Linear(4, 2) = 40 bytes
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.ones(3, 4)).sum().backward()
    prof.step()
    hooked = torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_", "BackendSelect")
    tracer = next(h.collectives for h in prof.hooks if hasattr(h, "collectives"))
    print("kernels in C++:", tracer._native_kernels)
    prof.stop()
    # our c10d kernels are there while the profiler runs, and only then
    assert hooked == (mode != "hooks")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_", "BackendSelect")
    dist.destroy_process_group()
""")

PROGRAMS_OWN = [  # (op, bytes, dtype, group) of the program's own calls, in order
    ("allreduce", "4000", "float32", "0"), ("allreduce", "80", "float64", "0"),
    ("broadcast", "20", "int32", "0"), ("allgather", "64", "float32", "0"),
    ("barrier", "0", None, "0"), ("allreduce", "12", "float32", "1"),
    ("allreduce", "28", "float32", "0"), ("allreduce", "20", "float32", "0"),
    ("allgather", "8", "float32", "0"), ("broadcast", "12", "float32", "0"),
]  # fmt: skip


@pytest.fixture(params=["python", "cpp"])
def kernels(request) -> tuple[dict, bool]:
    """Where our kernels on the c10d ops are: (the environment of a program, True where it has
    them in C++ (the native module built), False in Python (none built))."""
    if request.param == "python":
        return dict(os.environ), False
    if (not sys.platform.startswith("linux")
            or shutil.which(os.environ.get("CXX", "c++")) is None):
        pytest.skip("no C++ compiler")
    cache = str(request.getfixturevalue("native_cache"))
    return dict(os.environ, STEPSCOPE_CACHE_DIR=cache), True


def _ops(tmp_path, mode: str, kernels: tuple[dict, bool]) -> tuple[list[tuple], str]:
    script = tmp_path / "c.py"
    script.write_text(PROGRAM)
    env, in_cpp = kernels
    r = subprocess.run([sys.executable, str(script), str(tmp_path), mode], capture_output=True,
                       text=True, timeout=120, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"kernels in C++: {in_cpp and mode != 'hooks'}" in r.stdout, r.stdout
    d = tq.db(tmp_path / mode / "rank0.summary.pftrace")
    out = []
    for s in tq.slices(d, "s.category = 'collective'"):
        a = tq.args(d, s["arg_set_id"])
        assert (a["op"], a["group_size"]) == (s["name"], "1")
        out.append((a["op"], a["bytes"], a.get("dtype"), a["group"]))
    return out, r.stderr


def test_without_hooks_every_collective_is_recorded_as_the_hooks_do(tmp_path, kernels):
    """Every op once, as the hooks record it: the program's own calls (torch.distributed's
    functions, an op on inference tensors, a functional collective, the c10d op called by
    name) and DDP's from C++; our kernels are on the ops while the profiler runs, and only
    then."""
    ops, err = _ops(tmp_path, "python", kernels)
    assert ops[: len(PROGRAMS_OWN)] == PROGRAMS_OWN, ops
    # DDP's own, issued in C++: its construction's checks and its gradients' all-reduce, last
    assert ops[-1] == ("allreduce", "40", "float32", "0"), ops
    assert "stepscope" not in err, err
    if not hasattr(dist.ProcessGroup, "register_pre_hook"):
        return  # this torch has no hooks to compare with
    hooked, err = _ops(tmp_path, "hooks", kernels)
    assert hooked == ops and "stepscope" not in err


def test_the_step_end_probe_follows_is_initialized(tmp_path):
    """Every step end asks whether torch.distributed is up (new groups get hooked then): the
    integration reads the default group's slot instead of calling ``is_initialized()`` (three
    Python frames); both agree before, during and after a process group."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        from stepscope.pytorch import _dist_world
        world = _dist_world(torch)
        probe = lambda: world._default_pg is not None
        seen = [(probe(), dist.is_initialized())]
        dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}/store", rank=0,
                                world_size=1)
        seen.append((probe(), dist.is_initialized()))
        dist.destroy_process_group()
        seen.append((probe(), dist.is_initialized()))
        print(seen)
    """))
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[-2] == "[(False, False), (True, True), (False, False)]"


def test_the_report_names_the_build_where_collectives_end_at_python_callbacks(tmp_path):
    """Without the native module a collective's end is a Python done callback, late by the
    GIL (a DDP run's all-reduces ended up to 20 ms after the step that waited for them, the
    window work holding the GIL): the report says so once, with the command that builds the
    module; nothing where no collective ran."""
    script = tmp_path / "c.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, torch.distributed as dist, stepscope
        from stepscope.pytorch import collectives
        collectives.USE_STAMPS = False
        with stepscope.Profiler(dir=sys.argv[1], run_id="r", schedule=None, use_env=False,
                                host_metrics=False, torch=True) as prof:
            if sys.argv[2] == "collectives":
                dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}/store",
                                        rank=0, world_size=1)
            for _ in range(2):
                if sys.argv[2] == "collectives":
                    dist.all_reduce(torch.ones(4))
                prof.step()
        if dist.is_initialized():
            dist.destroy_process_group()
    """))
    hint = ("collectives ended at Python done callbacks, which wait for the GIL (late by up "
            "to tens of ms while the program's Python holds it; stamped in C++ with it): "
            "`stepscope build-torch` compiles the native module")
    for ops, count in (("collectives", 1), ("none", 0)):
        r = subprocess.run([sys.executable, str(script), str(tmp_path / ops), ops],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stderr.count(hint) == count, r.stderr[-3000:]


def test_every_op_name_of_the_hooks_is_named_as_its_op():
    """The hooks name one op by the C++ entry that issued it on torch 2.15
    (``all_gather_into_tensor`` is ``ALLGATHER_BASE`` there, ``ALLGATHER`` on 2.14): every name
    this torch's hooks can give is written as the op's plain name, the one our c10d kernels
    write for the same call."""
    hook_names = getattr(torch._C._distributed_c10d, "HookOpName", None)
    if hook_names is None:
        pytest.skip("this torch has no process-group hooks")
    from stepscope.pytorch.collectives import _DISPATCH_OPS, _OP_NAMES

    names = {m: _OP_NAMES.get(m) for m in hook_names.__members__}
    assert None not in names.values(), [m for m, n in names.items() if n is None]
    plain = {_OP_NAMES[op] for op in _DISPATCH_OPS.values()}
    assert set(names.values()) <= plain | {"split", "new_window", "unknown"}
    for member, name in names.items():  # the one its name holds
        assert name.replace("_", "") in member.lower().replace("_", ""), member
    for member, name in (("ALLGATHER_BASE", "allgather"), ("ALLTOALL_BASE", "alltoall"),
                         ("REDUCE_SCATTER_BASE", "reduce_scatter")):
        assert names.get(member, name) == name


def test_every_collective_of_the_dispatcher_is_hooked_and_named_as_its_op():
    """Every ``c10d::`` op this torch registers (bar ``check_for_nan``, which is no collective)
    gets our kernel on a torch without process-group hooks, named as the hooks name it."""
    from stepscope.pytorch.collectives import _DISPATCH_OPS, _OP_NAMES

    ops = {n.removeprefix("c10d::") for n in torch._C._dispatch_get_all_op_names()
           if n.startswith("c10d::")} - {"check_for_nan"}
    assert ops and ops <= set(_DISPATCH_OPS), sorted(ops - set(_DISPATCH_OPS))
    for name in ops:
        plain = _OP_NAMES[_DISPATCH_OPS[name]]
        assert plain.replace("_", "") in name.replace("_", ""), name


TWO_RANKS = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, stepscope
    from stepscope.pytorch import collectives
    run_dir, rank = sys.argv[1], int(sys.argv[2])
    collectives.USE_PG_HOOKS = False
    prof = stepscope.Profiler(dir=run_dir, run_id="two", schedule=None, report=False,
                              use_env=False, host_metrics=False, torch=True)
    prof.start()
    dist.init_process_group("gloo", init_method=f"file://{run_dir}/store", rank=rank,
                            world_size=2)
    torch.manual_seed(0)
    local = torch.nn.Linear(4, 2)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model.module.load_state_dict(local.state_dict())
    for step in range(3):
        x = torch.full((3, 4), float(rank + 1 + step))
        model(x).sum().backward()
        local(x).sum().backward()  # this rank's own gradient, to compare with the mean
        mine = [p.grad.clone() for p in local.parameters()]
        for p, g in zip(model.parameters(), mine):
            both = [torch.empty_like(g), torch.empty_like(g)]
            dist.all_gather(both, g)
            assert p.dim() == 1 or not torch.equal(both[0], both[1])  # the weights' differ
            assert torch.allclose(p.grad, (both[0] + both[1]) / 2, rtol=1e-6), (step, p.grad)
        model.zero_grad()
        local.zero_grad()
        prof.step()
    prof.stop()
    dist.destroy_process_group()
""")


def test_without_hooks_ddp_still_averages_the_gradients_of_both_ranks(tmp_path, kernels):
    """Our kernel hands DDP's all-reduce on: each step's gradients are the mean of both ranks'
    own, and each rank records its 3 all-reduces of 10 floats."""
    script = tmp_path / "two.py"
    script.write_text(TWO_RANKS)
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), str(rank)],
                              env=dict(kernels[0], RANK=str(rank), WORLD_SIZE="2"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]  # fmt: skip
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    for rank in (0, 1):
        d = tq.db(tmp_path / "two" / f"rank{rank}.summary.pftrace")
        grads = [tq.args(d, s["arg_set_id"]) for s in tq.slices(d, "s.category = 'collective'")
                 if s["name"] == "allreduce"]
        assert [(a["bytes"], a["group_size"]) for a in grads] == [("40", "2")] * 3, grads


RESTARTS = textwrap.dedent("""
    import json, sys, threading, time, torch, torch.distributed as dist, stepscope
    from stepscope.pytorch import collectives
    run_dir = sys.argv[1]
    collectives.USE_PG_HOOKS = False
    dist.init_process_group("gloo", init_method=f"file://{run_dir}/store", rank=0, world_size=1)
    group = dist.distributed_c10d._get_default_group()
    done = threading.Event()

    def issue():  # as DDP's reducer does, from another thread, all along
        t = torch.ones(16)
        while not done.is_set():
            group.allreduce([t]).wait()

    threads = [threading.Thread(target=issue) for _ in range(2)]
    for th in threads:
        th.start()
    runs = []
    for i in range(10):
        prof = stepscope.Profiler(dir=run_dir, run_id=f"r{i}", schedule=None, report=False,
                                  use_env=False, host_metrics=False, torch=True)
        prof.start()
        time.sleep(0.02)
        tracer = next(h.collectives for h in prof.hooks if hasattr(h, "collectives"))
        prof.stop()
        runs.append((tracer.count, tracer.failures))
    done.set()
    for th in threads:
        th.join()
    dist.destroy_process_group()
    # The group's last reference: its destructor joins gloo's threads with the GIL released.
    # Left to the interpreter's exit, a gloo thread still freeing the last work of a thread
    # (its tensors' Python objects need the GIL) is ended by the finalizing interpreter, and
    # torch aborts the process ("terminate called without an active exception"): torch's race,
    # in any program, that this script's threads hit once in some hundred runs.
    del group
    print(json.dumps(runs))
""")


def test_the_profiler_starts_and_stops_while_other_threads_issue_collectives(tmp_path,
                                                                              kernels):
    """Our kernels are registered and removed 10 times while two threads issue all-reduces
    through them: the program never fails, no op is misread, each run writes whole ops, and
    an op that completes after its run stopped is counted in no run's file."""
    script = tmp_path / "restarts.py"
    script.write_text(RESTARTS)
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                       text=True, timeout=180, env=kernels[0])
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(runs) == 10 and all(failures == 0 for _, failures in runs), runs
    assert all(count > 0 for count, _ in runs), runs
    d = tq.db(tmp_path / "r9" / "rank0.summary.pftrace")
    ops = [tq.args(d, s["arg_set_id"]) for s in tq.slices(d, "s.category = 'collective'")]
    assert len(ops) == runs[-1][0]
    assert {(a["op"], a["bytes"], a["dtype"], a["group_size"]) for a in ops} == {
        ("allreduce", "64", "float32", "1")}
