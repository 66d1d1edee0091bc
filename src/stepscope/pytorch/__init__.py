"""PyTorch integration: operators, ``record_function``/``torch.cuda.nvtx`` ranges, collectives,
DataLoader workers, optimizer steps and CUDA memory, for :class:`stepscope.profiler.Profiler`.

Installed with ``pip install stepscope[torch]``. Importing this package never imports torch:
the profiler calls :func:`attach` at ``start()`` when ``torch=True``, or with ``torch=None``
when the program has already imported torch, or else (``stepscope run``) as soon as it imports
torch (:func:`attach_on_import`). Each part lives in its own module:

* :mod:`.operators` — every aten operator of a detail window from torch's own profiler
  (Kineto, CPU activity only, input shapes on), converted in bulk at the window's end;
* :mod:`.ranges` — ``record_function`` and ``torch.cuda.nvtx`` ranges as summary-level ranges;
* :mod:`.collectives` — ``torch.distributed`` collectives and p2p ops (DDP's and FSDP's from C++
  too) as ``collective`` ranges from issue to completion;
* :mod:`.workers` — DataLoader worker processes: their fetches in a file of their own;
* :mod:`.steps` — steps from optimizer steps, data-loader waits from DataLoader iteration;
* :mod:`.memory` — CUDA allocator counters at each step end.

The profiler calls the hooks of :class:`TorchIntegration` (``start``, ``window_start``,
``window_end``, ``step_end``, ``program_steps``, ``stop``); none of them ever raises into the
training loop.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["TorchIntegration", "attach", "attach_on_import", "available", "on_import"]


def available() -> bool:
    """Whether torch can be imported (imports it)."""
    try:
        import torch  # noqa: F401
    except Exception:
        return False
    return True


def attach(prof: Any) -> TorchIntegration | None:
    """The integration for a started profiler, or None (with one line on stderr) without
    torch. Imports torch only when the profiler forces the integration on (``torch=True``)."""
    if "torch" not in sys.modules and not available():
        print("stepscope: torch=True but torch cannot be imported; torch integration off",
              file=sys.stderr)
        return None
    return TorchIntegration(prof)


class _TorchImportWatcher:
    """A ``sys.meta_path`` finder that runs a callback once ``import torch`` (or of one of its
    modules: ``name``) has completed (the profiler of ``stepscope run`` starts before the
    program imports torch); it removes itself."""

    def __init__(self, callback: Any, name: str = "torch") -> None:
        self.callback = callback
        self.name = name

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        import importlib.machinery

        self.remove()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module, callback = loader.exec_module, self.callback

        def exec_then_attach(module: Any) -> None:
            exec_module(module)
            callback()

        loader.exec_module = exec_then_attach
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def on_import(fn: Any, name: str = "torch") -> _TorchImportWatcher | None:
    """Call ``fn`` once torch (or its module ``name``) is imported: now if it is already;
    the watcher that waits for it, else None."""
    if name in sys.modules:
        fn()
        return None
    watcher = _TorchImportWatcher(fn, name)
    sys.meta_path.insert(0, watcher)
    return watcher


def attach_on_import(prof: Any) -> _TorchImportWatcher:
    """Attach the integration to ``prof`` as soon as the program imports torch."""

    def attach_now() -> None:
        if getattr(prof, "_stopped", True) or "torch" not in sys.modules:
            return
        hook = TorchIntegration(prof)
        prof.hooks.append(hook)
        _call(hook.start)
        if getattr(prof, "_window_path", None) is not None:  # a window is open already
            _call(hook.window_start)

    watcher = _TorchImportWatcher(attach_now)
    sys.meta_path.insert(0, watcher)
    return watcher


class TorchIntegration:
    """Ties the parts to one profiler; each part is optional and fails alone."""

    def __init__(self, prof: Any) -> None:
        from .collectives import CollectiveTracer
        from .memory import CudaMemory
        from .operators import OperatorCapture
        from .ranges import RangeCapture
        from .steps import StepDriver
        from .workers import WorkerTracing

        self.prof = prof
        sess = prof._sess if getattr(prof, "_recording", False) else None  # noqa: SLF001
        self.sess = sess
        self.ops = OperatorCapture(sess, rank=prof.rank) if sess is not None else None
        self.ranges = RangeCapture(prof) if sess is not None else None
        self.collectives = CollectiveTracer(sess, rank=prof.rank) if sess is not None else None
        self.workers = WorkerTracing(prof) if sess is not None else None
        self.memory = CudaMemory(sess) if sess is not None else None
        self.steps = StepDriver(prof, prof.options.get("step_on"))
        self.steps.ranges = self.ranges
        self._ops_on = False
        self._gpu_vetoed = False
        import torch

        self._cuda = torch.cuda  # its _initialized flag first: is_initialized() once it is set
        self._cuda_ready = torch.cuda.is_initialized  # (the flag, and not in a bad fork)
        self._world = _dist_world(torch)
        self._dist_ready = torch.distributed.is_initialized if (
            torch.distributed.is_available()) else lambda: False
        # (object, attribute) pairs the profiler reads before it calls step_end(): while none
        # is set (a program that uses neither CUDA nor torch.distributed), step_end() has
        # nothing to do and is not called, which saves a Python frame on every step; None:
        # always called (torch.distributed without the _default_pg slot)
        gates: list[tuple[Any, str]] | None = []
        if self.memory is not None:
            gates.append((torch.cuda, "_initialized"))
        if self.collectives is not None:
            if self._world is None:
                gates = None
            else:
                gates.append((self._world, "_default_pg"))
        self.step_end_gates = None if gates is None else tuple(gates)

    def start(self) -> None:
        for part in (self.ranges, self.collectives, self.workers, self.steps):
            if part is not None:
                _call(part.start)
        if self.ops is not None and self.ranges is not None:
            from .ranges import recorded_names

            self.ops.skip_names = recorded_names  # already recorded by the range capture

    def window_start(self) -> None:
        if self.ops is None:
            return
        gpu = getattr(self.prof, "_gpu", None)
        if self.ops.foreign_profiler_active():
            # the user's own torch.profiler holds Kineto (and, with CUDA activity, CUPTI):
            # neither our operators nor our CUPTI tracer this window (one CUPTI client)
            if gpu is not None and gpu.activity:
                gpu.activity = False
                self._gpu_vetoed = True
            self.ops.warn_foreign()
            return
        self._ops_on = bool(_call(self.ops.begin))
        if self._ops_on and gpu is not None:
            # Kineto registered its CUPTI buffer callbacks, even CPU-only: where this window's
            # CUPTI tracing started first (a window open at start, or torch imported inside
            # one), the window's records would go to Kineto
            _call(gpu.reclaim_cupti)

    def window_end(self) -> None:
        if self._gpu_vetoed:
            self.prof._gpu.activity = True  # noqa: SLF001
            self._gpu_vetoed = False
        if self._ops_on and self.ops is not None:
            self._ops_on = False
            _call(self.ops.end)

    def step_end(self) -> None:
        # every step: two attribute reads while the program uses neither CUDA nor
        # torch.distributed (no Python frame: this runs at every step() of the program)
        if self.memory is not None and getattr(self._cuda, "_initialized", True) and (
                self._cuda_ready()):
            _call(self.memory.sample)
        if self.collectives is not None:
            world = self._world
            if world._default_pg is not None if world is not None else self._dist_ready():
                _call(self.collectives.watch_new_groups)

    def program_steps(self) -> None:
        if self.steps is not None:
            _call(self.steps.yield_to_program)

    def stop(self) -> None:
        if self._ops_on:
            self.window_end()
        for part in (self.steps, self.workers, self.collectives, self.ranges):
            if part is not None:
                _call(part.stop)

    def stopped(self) -> None:
        if self.ops is not None:
            _call(self.ops.wait)
        if not self.prof.options.get("report"):
            return
        slow = []
        if self.ops is not None and self.ops.last_reader == "python":
            slow.append("torch's operator events were read through its Python API (cheaper "
                        "detail windows with it)")
        c = self.collectives
        if c is not None and c.count and not c.stamped_natively:
            slow.append("collectives ended at Python done callbacks, which wait for the GIL "
                        "(late by up to tens of ms while the program's Python holds it; "
                        "stamped in C++ with it)")
        if slow:
            print(f"stepscope: {'; '.join(slow)}: `stepscope build-torch` compiles the native "
                  "module", file=sys.stderr)


def _dist_world(torch: Any) -> Any:
    """torch.distributed's ``_World``, whose ``_default_pg`` is set while the default process
    group exists: every step end reads it (``is_initialized()`` goes through two properties,
    three Python frames). None where torch.distributed or that slot is missing: the step end
    calls ``is_initialized()`` then."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed import distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    return world if "_default_pg" in getattr(world, "__dict__", {}) else None


def _call(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:
        print(f"stepscope: torch integration: {getattr(fn, '__qualname__', fn)} failed: "
              f"{exc!r}", file=sys.stderr)
        return None
