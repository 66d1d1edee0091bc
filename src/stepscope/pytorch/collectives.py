"""``torch.distributed`` collectives and point-to-point ops as ``collective`` ranges.

What torch 2.14 offers, and what each covers:

* **ProcessGroup pre/post hooks** (``ProcessGroup.register_pre_hook`` / ``register_post_hook``,
  called by the C++ ``ProcessGroup`` before and after it issues each op, any backend): they see
  every op that reaches a process group, including DDP's gradient-bucket allreduces and FSDP's
  all-gathers/reduce-scatters issued from C++, which never pass through the Python functions.
  The pre-hook gives the op, its input tensors (bytes, dtype), ``async_op`` and the root; the
  post-hook the ``Work``, whose future's done callback marks completion. **Used here.**
* RecordFunction ``record_param_comms`` events: the same ops with sizes, but only while torch's
  profiler runs (detail windows), and they time the issue, not the completion. Not used.
* ``ProcessGroup._register_on_completion_hook``: NCCL only (start/finish times from the
  watchdog). Not used: on GPUs the NCCL kernels from CUPTI are the device-side truth.
* Wrapping the Python API (``dist.all_reduce``...): misses DDP/FSDP's C++ calls. Not used.

Each op is one slice on a ``collectives`` track under the rank's process (overlapping async ops
take sibling tracks of that name), category ``collective``: host activity, not the device's (a
gloo op runs on the CPU; an NCCL op's kernel, from CUPTI, is a ``communication`` slice of its
own), from the pre-hook to completion, or at once for a synchronous op. The ``distributed``
summary's communication column counts the ops timed to their completion, and the
``collectives`` summary lists them. Where ``stepscope build-torch`` has built the native
module:

* **the hooks themselves are C++** (``collective_hooks.cpp``, torch with hooks): the pre-hook
  notes the op, the post-hook puts a C++ callback on its work's future, which notes the
  completion on the gloo or NCCL thread; no Python and no GIL per op, about 1-3 µs of CPU per
  small gloo all-reduce against 80-90 through Python hooks and callbacks
  (``tools/bench_torch.py``, table 3);
* else (torch without hooks: the path below) **our kernels on the c10d ops are C++**
  (``c10d_kernels.cpp``), which note the op and its completion as the C++ hooks do;
* and where either cannot read an object of this torch's (a ``TypeError``: Python hooks or
  kernels from then on), **the completion is stamped in C++** (``work_done.cpp``): a C++
  callback on the work's future notes the time under the op's slot.

Either way the slices are written at the next flush (a flush hook, so they never come after a
flush that took later events), at stop (waiting up to 50 ms for the stamps of works whose future
is done: a future wakes its waiters before it runs its callbacks), or when ``DRAIN_AT`` stamped
ops wait. Without the native module:

* a **Python done callback** on the future. It needs the GIL: while the program's own
  Python holds it (torch's ops release it), the op's end, and gloo's marking the work complete,
  wait up to the switch interval (5 ms). A watcher thread waiting on the futures without the GIL
  removed that wait but cost a GIL handover more per op (DDP steps of 4.6 gloo all-reduces took
  5 % longer with it, 6 of 6 pairs on two cores).
Args: ``op``, ``bytes`` (input tensors; a recv's buffer), ``dtype``, ``group_size``,
``group``. Summary level: every op of the run, not only those of detail windows.

Where a slice does not end at its op's completion, the arg ``completion`` says so:

* ``"waited"``: a work that has no future (gloo's ``isend``/``irecv``, and its
  ``reduce_scatter_tensor``: a ``LambdaWork`` whose ``wait()`` waits for an inner all-reduce,
  one no hook sees, then copies the result out) has no completion to stamp; ``Work.wait``
  wrapped ends its op when the program's wait on it returns, its completion at the latest.
  Where that wait comes from the op's own call in ``torch.distributed`` (``dist.send``/``recv``,
  a synchronous ``reduce_scatter_tensor``: FSDP's), torch waits right after issuing it, the
  output is written only then, and that end is its completion (no arg);
* ``"issued"``: such an op that no wait from Python ends (waited from C++, as functional
  collectives' ``wait_tensor`` does, or never) ends when issued, taken so at the second flush
  after it (or at stop);
* ``"stream"``: a device backend's op (NCCL's) is enqueued on a CUDA stream, and its work's
  future is a device future that the backend completes right when the op is issued (its
  waiters then wait on the stream, not on the host). A future that has devices and is complete
  when its op returns is taken for such an op (c10d_glue.h's ``on_stream``; the Python paths,
  which see no future's devices, go by the op's input tensor being on a device): it ends there,
  and its time is its kernel's (CUPTI's, in detail windows). So does an op on a device that
  returns no work: NCCL's synchronous ops (``async_op=False``, torch's ``asyncOp`` option) run
  on the caller's current stream and return none. gloo completes its futures on its own thread
  when the op is done, CUDA tensors or not.

Limits: process groups are hooked when the integration starts, when
``init_process_group``/``new_group`` return, and at each step end (groups made another way
before their first collective's step ends miss those first ops). A hook id of our own per group.

**Older torch** (no ``ProcessGroup.register_pre_hook``: 2.11, the version an H100 image here
ships, has none): a kernel of ours on the ``BackendSelect`` dispatch key of each ``c10d::`` op
(``allreduce_``, ``_allgather_base_``...) gives the same slices and args. Every
``ProcessGroup`` method goes through the dispatcher since torch 2.0, so the kernel sees each op
that reaches a process group: the program's calls, DDP's gradient all-reduces from its C++
reducer, FSDP's, and functional collectives (``torch.distributed._functional_collectives``,
which DTensor and compiled code use). ``BackendSelect`` is in every thread's included keys and
no guard of torch's excludes it (the Autograd key, which ``inference_mode`` tensors and the
functional collectives' own kernels skip, would miss ops); the c10d ops have no kernel there of
their own. The kernel notes the op, then hands it on to the key below, as the dispatcher would
have done without it. No other op passes through it: outside collectives it costs nothing.
Where the native module is built the kernel is C++ (``c10d_kernels.cpp``: no Python and no GIL
per op, its ops taken at each flush as the C++ hooks' are), else Python.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from array import array
from typing import Any

from .. import _schema as S

# the module whose functions wait for their own op at once where it is synchronous
_C10D_MODULE = "torch.distributed.distributed_c10d"
HOOK_ID = 0x5EC0  # our pre/post hook id on each process group
KEY = "BackendSelect"  # the dispatch key of our c10d kernels (torch without those hooks)
# torch has ProcessGroup pre/post hooks (None: look at start; tests set False to try the fallback)
USE_PG_HOOKS: bool | None = None
# the native module's collectives: C++ hooks, completions stamped in C++ (None: where it is
# built; tests and benchmarks set False to compare with Python's hooks and done callbacks)
USE_STAMPS: bool | None = None

# the hooks' op names (torch's HookOpName) -> the op's name in the args. torch 2.15 names one
# op by the C++ entry that issued it (all_gather_into_tensor is ALLGATHER_BASE there, ALLGATHER
# on 2.14; FSDP's coalesced ops): all are named as the op, so one call of the program reads the
# same on every torch, with or without the process-group hooks
_OP_NAMES = {
    "SEND": "send", "RECV": "recv", "BROADCAST": "broadcast",
    "ALLREDUCE": "allreduce", "ALLREDUCE_COALESCED": "allreduce", "REDUCE": "reduce",
    "ALLGATHER": "allgather", "ALLGATHER_BASE": "allgather",
    "ALLGATHER_COALESCED": "allgather", "ALLGATHER_INTO_TENSOR_COALESCED": "allgather",
    "REDUCE_SCATTER": "reduce_scatter", "REDUCE_SCATTER_BASE": "reduce_scatter",
    "REDUCE_SCATTER_TENSOR_COALESCED": "reduce_scatter",
    "ALLTOALL": "alltoall", "ALLTOALL_BASE": "alltoall", "BARRIER": "barrier",
    "SCATTER": "scatter", "GATHER": "gather", "SPLIT": "split", "NEW_WINDOW": "new_window",
    "UNKNOWN": "unknown",
}  # fmt: skip

# the dispatcher's c10d ops -> the hooks' op name (torch without process-group hooks)
_DISPATCH_OPS = {
    "allreduce_": "ALLREDUCE", "allreduce_coalesced_": "ALLREDUCE_COALESCED",
    "broadcast_": "BROADCAST", "reduce_": "REDUCE", "allgather_": "ALLGATHER",
    "_allgather_base_": "ALLGATHER_BASE", "allgather_coalesced_": "ALLGATHER_COALESCED",
    "allgather_into_tensor_coalesced_": "ALLGATHER_INTO_TENSOR_COALESCED",
    "reduce_scatter_": "REDUCE_SCATTER", "_reduce_scatter_base_": "REDUCE_SCATTER_BASE",
    "reduce_scatter_tensor_coalesced_": "REDUCE_SCATTER_TENSOR_COALESCED",
    "alltoall_": "ALLTOALL", "alltoall_base_": "ALLTOALL_BASE", "gather_": "GATHER",
    "gather_into_tensor_": "GATHER", "scatter_": "SCATTER", "send": "SEND", "recv_": "RECV",
    "recv_any_source_": "RECV", "barrier": "BARRIER", "monitored_barrier_": "BARRIER",
}  # fmt: skip

# the slots under which the native module stamps completions (one count for every tracer of
# the process: a stamp from a work that completed after its tracer stopped matches no later one)
_SLOTS = itertools.count()
_GROUP_IDS = itertools.count()  # the C++ hooks' group ids, likewise for every tracer
DRAIN_AT = 256  # works stamped but not yet written: drained at once beyond this (no step ends)

# the C++ ops' end (c10d_glue.h's Op::ended) -> S.ARG_COMPLETION's value
_ENDED = (None, S.COMPLETION_ISSUED, S.COMPLETION_STREAM, S.COMPLETION_WAITED)

_DTYPE_NAMES: dict[Any, str] = {}
_HOOK_NAMES: dict[int, str] = {}  # a HookOpName's value -> its name (see _hook_name)


def _input_size(x: Any) -> tuple[int, str, bool]:
    """(bytes, the first tensor's dtype, whether it is on a device) of an op's input: a tensor,
    a list of them or a list of lists (the three paths see one op's input alike)."""
    from torch import Tensor

    nbytes, dtype, on_device = 0, "", False
    todo = [x]
    while todo:
        t = todo.pop()
        if isinstance(t, Tensor):
            nbytes += t.nbytes
            if not dtype:
                dtype, on_device = _dtype_name(t.dtype), t.device.type != "cpu"
        elif isinstance(t, (list, tuple)):
            todo.extend(reversed(t))
    return nbytes, dtype, on_device


def _hook_name(code: int) -> str:
    """The name of a ``HookOpName`` value (the Python hooks' ``int(args.name)``, the C++
    hooks' value), looked up once: pybind's ``.name`` walks the enum's entries (~6 µs)."""
    name = _HOOK_NAMES.get(code)
    if name is None:
        from torch._C import _distributed_c10d as c10d

        name = _HOOK_NAMES[code] = c10d.HookOpName(code).name
    return name


def _completed(work: Any) -> bool:
    """The work's future has its value (gloo marks the work itself complete later)."""
    try:
        return bool(work.get_future().done())
    except Exception:
        return False


def _dtype_name(dtype: Any) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


class CollectiveTracer:
    """Hooks every process group of the process; writes one slice per op at its completion."""

    def __init__(self, sess: Any, rank: int = 0) -> None:
        self.sess = sess
        self.rank = rank
        self.em = sess.emitter(clock="monotonic", level=S.LEVEL_SUMMARY)
        self._lock = threading.Lock()
        self._open: dict[tuple[int, int], tuple] = {}  # (group id, op id) -> pre-hook data
        self._lanes: list[tuple[int, int]] = []  # (track, end of its last slice)
        self._hooked: dict[int, Any] = {}  # id(pg) -> pg
        self._patched: list[tuple[Any, str, Any]] = []
        self._library: Any = None  # our c10d kernels (torch without process-group hooks)
        # the native module (its watch()/drain(): works' completion stamped in C++; its C++
        # hooks and kernels, whose ops take_ops() gives), else None: done callbacks in Python;
        # _watching: new works are stamped (off after a work the module cannot read, while
        # those stamped before still drain)
        self._stamps: Any = None
        self._watching = False
        self._native_hooks = False  # process groups hooked in C++ (hook_group/take_ops)
        # who noted the ops take_ops() gives (a group's C++ hooks, our C++ kernels) -> the name
        # of an op's code; an op of another owner is an earlier tracer's
        self._owners: dict[int, Any] = {}
        self._native_kernels = False  # our kernels on the c10d ops are C++ (hook_ops)
        # slot -> (opened, group size, group name, work)
        self._waiting: dict[int, tuple] = {}
        self._called_back: dict[int, Any] = {}  # slot -> work whose Python callback is to come
        # id(work) -> [work, opened, group size, group name, flushes seen, issued ns]: ops whose
        # work has no future, ended when the program's Work.wait returns (else "issued" at the
        # 2nd flush)
        self._parked: dict[int, list] = {}
        self._on = False
        # stopped, its last ops waited for: a done callback after that is in no run's file
        self._closed = False
        self.pg_hooks: bool | None = None  # ProcessGroup hooks used (else our c10d kernels)
        self.count = 0  # ops written
        self.failures = 0

    @property
    def stamped_natively(self) -> bool:
        """Whether ends are stamped by the native module (else Python done callbacks)."""
        return self._stamps is not None

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        import torch.distributed as dist

        if not dist.is_available():
            return
        self._on, self._closed = True, False
        from . import native

        mod = native.load() if USE_STAMPS is not False else None  # (None: not built)
        self._stamps = mod if hasattr(mod, "watch") else None
        self._watching = self._stamps is not None
        # before each flush takes the emitter's events: a slice written after a flush that
        # took later ones would be clamped forward (and parked ops unwaited end when issued)
        self.sess.flush_hooks.append(self.drain)
        self._wrap_wait()
        self.pg_hooks = USE_PG_HOOKS
        if self.pg_hooks is None:
            self.pg_hooks = hasattr(dist.ProcessGroup, "register_pre_hook")
        self._native_hooks = self.pg_hooks and hasattr(self._stamps, "hook_group")
        if self.pg_hooks:  # each new group hooked as it is made
            self._patch_creators(dist)
            self.watch_new_groups()
        else:  # every op of every group passes our kernels
            self._register_dispatch_kernels()

    def stop(self) -> None:
        self._on = False
        if self._native_kernels:  # our C++ kernels: no op noted from here on
            self._stamps.unhook_ops()
            self._native_kernels = False
        self._drain_completed()
        self._end_parked(everything=True)
        if self.drain in self.sess.flush_hooks:
            self.sess.flush_hooks.remove(self.drain)
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()
        if self._library is not None:
            self._library._destroy()  # noqa: SLF001  (torch.library's only way to unregister)
            self._library = None
        for pg in list(self._hooked.values()):
            try:
                pg.unregister_pre_hook(HOOK_ID)
                pg.unregister_post_hook(HOOK_ID)
            except Exception:
                pass
        self._hooked.clear()
        self._closed = True

    def _patch_creators(self, dist: Any) -> None:
        import torch.distributed.distributed_c10d as c10d

        tracer = self
        for name in ("init_process_group", "new_group"):
            original = getattr(c10d, name, None)
            if original is None:
                continue

            def make(original: Any) -> Any:
                def created(*args: Any, **kwargs: Any) -> Any:
                    result = original(*args, **kwargs)
                    tracer.watch_new_groups()
                    return result

                created.__wrapped__ = original  # type: ignore[attr-defined]
                created.__doc__ = original.__doc__
                return created

            wrapper = make(original)
            self._install((c10d, dist), name, original, wrapper)

    def _wrap_wait(self) -> None:
        """``Work.wait`` wrapped (``stop()`` puts it back): a work without a future (gloo's
        reduce_scatter_tensor, send, recv) has no completion to stamp; its op ends when the
        program's wait on it returns. That is its completion where the wait comes from the
        op's own call in ``torch.distributed`` (``dist.send``, a synchronous
        ``reduce_scatter_tensor``, as FSDP issues them): torch waits there right after issuing
        it. Elsewhere it is the completion's latest (``completion: "waited"``). A wait from C++
        is not seen (those end when issued). One dict look-up per wait, and a C call where the
        native module parks ops."""
        from torch._C import _distributed_c10d as c10d

        original = c10d.Work.__dict__.get("wait")
        if original is None:
            return
        tracer = self
        waited = getattr(self._stamps, "waited", None)
        own = _C10D_MODULE

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(work, *args, **kwargs)
            if tracer._parked or waited is not None:
                at_once = sys._getframe(1).f_globals.get("__name__") == own
                if tracer._parked:
                    tracer._waited(work, at_once)
                if waited is not None:
                    waited(work, at_once)
            return result

        wait.__wrapped__ = original  # type: ignore[attr-defined]
        wait.__doc__ = getattr(original, "__doc__", None)
        self._install((c10d.Work,), "wait", original, wait)

    def _waited(self, work: Any, at_once: bool) -> None:
        entry = self._parked.pop(id(work), None)
        if entry is not None and entry[0] is work:
            self._write(entry[1], time.perf_counter_ns(), entry[2], entry[3],
                        None if at_once else S.COMPLETION_WAITED)

    def _end_parked(self, everything: bool = False) -> None:
        """Ops parked since before the last flush (or all) end when issued: their work was
        waited from C++, late, or never."""
        for key, entry in list(self._parked.items()):
            entry[4] += 1
            if everything or entry[4] > 1:
                if self._parked.pop(key, None) is not None:
                    self._write(entry[1], entry[5], entry[2], entry[3], S.COMPLETION_ISSUED)

    def _install(self, owners: tuple, name: str, original: Any, wrapper: Any) -> None:
        """``wrapper`` in place of ``original`` wherever an owner holds it (``stop()`` puts it
        back): ``torch.distributed`` re-exports ``distributed_c10d``'s functions."""
        for owner in owners:
            if owner.__dict__.get(name) is original:
                self._patched.append((owner, name, original))
                setattr(owner, name, wrapper)

    def _register_dispatch_kernels(self) -> None:
        """Without process-group hooks: our kernel on the ``BackendSelect`` key of each
        ``c10d::`` op records the op, then redispatches to the key below, as the dispatcher
        would have done without it. In C++ where the native module is built
        (``c10d_kernels.cpp``: no Python per op), else in Python."""
        import torch

        lib = None
        try:
            specs = []  # (name, op, index of the input argument or None, of the group)
            for name, op in _DISPATCH_OPS.items():
                qualified = f"c10d::{name}"
                if not torch._C._dispatch_has_kernel(qualified):  # noqa: SLF001  (older torch)
                    continue
                if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, KEY):  # noqa: SLF001
                    continue  # torch has its own there: left alone
                overload = getattr(torch.ops.c10d, name).default
                arguments = [a.name for a in overload._schema.arguments]  # noqa: SLF001
                if "process_group" not in arguments:
                    continue  # another torch's op of that name: left alone
                inputs = [i for i, a in enumerate(arguments) if a.startswith("input")]
                source = None if op == "BARRIER" else inputs[0] if inputs else 0
                specs.append((name, op, source, arguments.index("process_group"), overload))
            if self._register_native_kernels(specs):
                return
            lib = torch.library.Library("c10d", "IMPL")
            below = torch._C._dispatch_keyset_full_after(KEY)  # noqa: SLF001
            for name, op, source, where, overload in specs:
                lib.impl(name, self._make_kernel(overload, op, source, where, below), KEY,
                         with_keyset=True)
        except Exception as exc:
            if lib is not None:
                lib._destroy()  # noqa: SLF001  (none of ours left half-registered)
            print(f"stepscope: torch {torch.__version__} has no process-group hooks and its "
                  f"c10d ops cannot be hooked ({exc!r}): no collectives are recorded",
                  file=sys.stderr)
            return
        self._library = lib

    def _register_native_kernels(self, specs: list[tuple]) -> bool:
        """Our kernels registered in C++ (True), where the native module has them."""
        if not hasattr(self._stamps, "hook_ops"):
            return False
        owner = next(_GROUP_IDS)
        codes = [op for _, op, *_ in specs]
        try:
            self._stamps.hook_ops([(name, i, -1 if source is None else source, where)
                                   for i, (name, _, source, where, _) in enumerate(specs)],
                                  owner, KEY)
        except Exception as exc:
            print(f"stepscope: the C++ kernels on the c10d ops failed ({exc!r}); recording "
                  "collectives through Python's", file=sys.stderr)
            return False
        self._owners[owner] = codes.__getitem__
        self._native_kernels = True
        return True

    def _make_kernel(self, overload: Any, op: str, source: int | None, where: int,
                     below: Any) -> Any:
        """The Python kernel of one op: ``source`` and ``where`` index its input tensor(s) and
        its process group among its arguments."""
        tracer = self

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            if not tracer._on:
                return overload.redispatch(keyset & below, *args, **kwargs)
            t0 = time.perf_counter_ns()
            out = overload.redispatch(keyset & below, *args, **kwargs)
            tracer._dispatch_done(t0, op, args, source, where, out)
            return out

        return kernel

    def _dispatch_done(self, t0: int, op: str, args: tuple, source: int | None, where: int,
                       out: Any) -> None:
        """One c10d op issued: its slice now, or when its work completes."""
        try:
            from torch._C import _distributed_c10d as c10d

            x = args[source] if source is not None and source < len(args) else None
            nbytes, dtype, on_device = _input_size(x)
            pg = args[where] if where < len(args) else None
            if pg is not None and not isinstance(pg, c10d.ProcessGroup):
                pg = c10d.ProcessGroup.unbox(pg)
            size = pg.size() if pg is not None else 0
            gname = getattr(pg, "group_name", "") or ""
            work = out[-1] if isinstance(out, tuple) and out else out
            if work is None or isinstance(work, tuple):  # monitored_barrier_: done on return
                work = None
            elif not isinstance(work, c10d.Work):
                work = c10d.Work.unbox(work)
            self._finish((t0, op, nbytes, dtype, on_device), work, size, gname)
        except Exception:
            self.failures += 1

    def watch_new_groups(self) -> None:
        """Hook the process groups made since the last call (cheap: a dict walk)."""
        if not self._on:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if not self.pg_hooks:  # the c10d ops are hooked instead
            return
        from torch.distributed import distributed_c10d as c10d

        groups = list(getattr(c10d._world, "pg_map", {}).keys())  # noqa: SLF001
        live = {id(pg) for pg in groups}
        for gid in [g for g in self._hooked if g not in live]:  # destroyed: let them go
            del self._hooked[gid]
        for pg in groups:
            if id(pg) not in self._hooked:
                self.hook(pg)

    def hook(self, pg: Any) -> bool:
        """Register our pre/post hooks on one process group."""
        if id(pg) in self._hooked or not hasattr(pg, "register_pre_hook"):
            return False
        try:
            size = pg.size()
            gname = getattr(pg, "group_name", "") or ""
        except Exception:
            size, gname = 0, ""
        gid = id(pg)
        if self._native_hooks:  # no Python per op: the ops are taken at each flush
            try:
                owner = next(_GROUP_IDS)
                self._stamps.hook_group(pg, HOOK_ID, owner)
                self._owners[owner] = _hook_name
                self._hooked[gid] = pg
                return True
            except TypeError:  # a group this build cannot read: Python hooks from now on
                self._native_hooks = False
            except Exception as exc:
                print(f"stepscope: cannot hook process group {gname!r} ({exc!r})",
                      file=sys.stderr)
                return False

        def pre(a: Any) -> None:
            try:
                t = time.perf_counter_ns()
                # (a recv's buffer is an output: what it moves, as the kernels read it)
                nbytes, dtype, on_device = _input_size(a.input_tensors or a.output_tensors)
                self._open[gid, a.op_id] = (t, _hook_name(int(a.name)), nbytes, dtype, on_device)
            except Exception:
                self.failures += 1

        def post(a: Any) -> None:
            try:
                opened = self._open.pop((gid, a.op_id), None)
                if opened is None:
                    return
                self._finish(opened, a.work, size, gname, S.COMPLETION_ISSUED)
            except Exception:
                self.failures += 1

        try:
            pg.register_pre_hook(HOOK_ID, pre)
            pg.register_post_hook(HOOK_ID, post)
        except Exception as exc:
            print(f"stepscope: cannot hook process group {gname!r} ({exc!r})", file=sys.stderr)
            return False
        self._hooked[gid] = pg
        return True

    def _finish(self, opened: tuple, work: Any, size: int, group: str,
                completion: str | None = None) -> None:
        """The op's slice when its work completes (a done callback), or now: an op without a
        work is synchronous (``completion``: the hooks give none, and it ended when issued; a
        device's, NCCL's with ``async_op=False``, was enqueued on the current stream); gloo's
        send/recv have a work without a future and end when issued; a device stream's op (NCCL)
        ends when issued, its future complete then (see the module's docstring)."""
        if work is None:
            self._write(opened, time.perf_counter_ns(), size, group,
                        S.COMPLETION_STREAM if opened[4] else completion)
            return
        if self._watching:  # the completion stamped in C++, written at the next drain
            slot = next(_SLOTS)
            self._waiting[slot] = (opened, size, group, work)
            try:
                stream = self._stamps.watch(work, slot)
            except RuntimeError:  # gloo send/recv: no future (ended when issued, below)
                del self._waiting[slot]
            except TypeError:  # a work this build cannot read: done callbacks from now on
                del self._waiting[slot]
                self._watching = False
            else:
                if stream:  # (no stamp to come)
                    del self._waiting[slot]
                    self._write(opened, time.perf_counter_ns(), size, group,
                                S.COMPLETION_STREAM)
                elif len(self._waiting) > DRAIN_AT:
                    self.drain()
                return
        try:
            fut = work.get_future()
        except RuntimeError:  # no future (gloo's send/recv, reduce_scatter_tensor): its wait
            if len(self._parked) < DRAIN_AT:
                self._parked[id(work)] = [work, opened, size, group, 0, time.perf_counter_ns()]
            else:
                self._write(opened, time.perf_counter_ns(), size, group, S.COMPLETION_ISSUED)
            return
        if opened[4] and fut.done():  # a device stream's op (by its input: Python sees no
            # future's devices; a barrier, with none, waits for its callback)
            self._write(opened, time.perf_counter_ns(), size, group, S.COMPLETION_STREAM)
            return
        key = next(_SLOTS)
        self._called_back[key] = work

        def done(_fut: Any) -> None:
            self._write(opened, time.perf_counter_ns(), size, group)
            self._called_back.pop(key, None)  # (after the write: stop() waits for it)

        fut.add_done_callback(done)

    def _drain_completed(self, grace_s: float = 0.05) -> None:
        """Write every op whose work has completed by now (those still running are not
        written). A future wakes its waiters before it runs its callbacks, so a program that has
        just waited for one (DDP's last gradient all-reduce before a stop) can be ahead of its
        stamp or its Python done callback: those whose future is done get up to ``grace_s`` to
        arrive (without it, 1 of 5 2-rank runs lost that op)."""
        self.drain()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (
                any(_completed(entry[3]) for entry in list(self._waiting.values()))
                or any(_completed(work) for work in list(self._called_back.values()))
                or self._owners and self._stamps.in_flight() > 0):  # (the C++ hooks' works)
            time.sleep(0.001)
            self.drain()

    def drain(self) -> None:
        """Write the ops whose works the native module stamped complete since the last drain
        (at every flush, at stop, and beyond ``DRAIN_AT`` waiting; from any thread)."""
        if self._parked:
            self._end_parked()
        stamps = self._stamps
        if stamps is None:
            return
        try:
            pairs = array("q", stamps.drain() if self._waiting else b"")
            ops = stamps.take_ops(not self._on) if self._owners else ()
        except Exception:
            self.failures += 1
            return
        waiting = self._waiting
        for i in range(0, len(pairs), 2):  # slot, completion ns, slot, ...
            entry = waiting.pop(pairs[i], None)
            if entry is not None:
                self._write(entry[0], pairs[i + 1], entry[1], entry[2])
        for t0, t1, code, nbytes, dtype, owner, ended, size, gname in ops:
            name_of = self._owners.get(owner)
            if name_of is None:  # an earlier tracer's op that ended after its stop
                continue
            self._write((t0, name_of(code), nbytes, dtype), t1, size, gname, _ENDED[ended])

    # -- output -------------------------------------------------------------------------------
    def _write(self, opened: tuple, t_end: int, size: int, group: str,
               completion: str | None = None) -> None:
        """One op's slice (from any thread: gloo/NCCL threads run the done callbacks), ended at
        its completion, or (``completion``) where S.ARG_COMPLETION says."""
        if self._closed:  # its work completed after the tracer stopped: not in this run
            return
        try:
            t0, op, nbytes, dtype = opened[:4]
            name = _OP_NAMES.get(op, op.lower())
            args: dict[str, Any] = {S.ARG_OP: name, S.ARG_BYTES: nbytes,
                                    S.ARG_GROUP_SIZE: size}
            if dtype:
                args[S.ARG_DTYPE] = dtype
            if group:
                args[S.ARG_GROUP] = group
            if completion:
                args[S.ARG_COMPLETION] = completion
            track = self._lane(t0, t_end)
            self.em.complete(t0, t_end - t0, name, track, S.CAT_COLLECTIVE, args)
            self.count += 1
        except Exception:
            self.failures += 1

    def _lane(self, t0: int, t1: int) -> int:
        """A ``collectives`` track free over [t0, t1): ops in flight together get siblings."""
        with self._lock:
            for i, (track, busy_until) in enumerate(self._lanes):
                if busy_until <= t0:
                    self._lanes[i] = (track, t1)
                    return track
        # made outside our lock: a flush holds the session's lock while its hook (drain)
        # waits for ours
        track = self.sess.new_track(S.COLLECTIVES_TRACK_NAME)
        with self._lock:
            self._lanes.append((track, t1))
        return track
