"""DataLoader worker processes: their fetches in a trace file of their own, merged with the rank's.

``torch.utils.data._utils.worker._worker_loop`` (the target of every worker process) is replaced
by :func:`traced_worker_loop` bound to this rank's settings; a ``functools.partial`` of a
module-level function and a dict, so it pickles for the ``spawn`` and ``forkserver`` start
methods too (torch's function is not in it: pickled by name, it would be found replaced).
In the worker it starts a session of its own writing
``<run dir>/rank<N>.summary.worker<W>-<pid>.pftrace`` (a file per worker process: workers that
are not persistent are new processes every epoch), which ``stepscope merge`` takes with the
rank's summary file. The worker's events are on a thread track ``DataLoader worker <W> (pid
<pid>)`` *of the rank's process* (the rank's pid and process track): as processes of their own,
workers were step-less processes whose whole span the summaries counted as frame time (the
merged DDP example's step ratio fell to 38 %) and extra rows of the distributed table. Ranges,
category ``dataloader_worker``, on that thread: ``fetch`` (one batch) holding ``__getitem__``
(one per sample) or ``__getitems__`` (one per batch), and ``collate``. The worker's CPU time is
the counter ``DataLoader worker <W> (pid <pid>).cpu %`` (percent of one core, sampled at fetch
ends at most every 0.5 s).

Flush: torch's workers end with ``os._exit`` (no atexit), so the session is stopped when the
worker loop returns (the loader's shutdown, its parent gone, the iterator dropped) in a
``finally``. A worker killed by a signal loses what it recorded since its last flush (≤ 1 s).
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import time
from pathlib import Path
from typing import Any

from .. import _schema as S
from ..core import session as _session
from ..record import recorder as rec

CAT_WORKER = S.CAT_DATALOADER_WORKER
CPU_SAMPLE_S = 0.5


class WorkerTracing:
    """Points torch's worker target at :func:`traced_worker_loop` while the profiler runs."""

    def __init__(self, prof: Any) -> None:
        self.prof = prof
        self._original: Any = None

    def start(self) -> None:
        from torch.utils.data._utils import worker

        if self.prof.run_dir is None:
            return
        original = worker._worker_loop  # noqa: SLF001
        sess = self.prof._sess  # noqa: SLF001
        cfg = {"dir": str(self.prof.run_dir), "rank": self.prof.rank,
               "host": self.prof.rank_info.host, "pid": sess.pid,
               "process_uuid": sess.process_uuid, "process_name": sess.process_name}
        global _torch_loop
        self._original = _torch_loop = original
        worker._worker_loop = functools.partial(traced_worker_loop, cfg)  # noqa: SLF001

    def stop(self) -> None:
        global _torch_loop
        if self._original is not None:
            from torch.utils.data._utils import worker

            worker._worker_loop = self._original  # noqa: SLF001
            self._original = _torch_loop = None


# torch's _worker_loop while ours replaces it: a forked worker inherits it; a spawned one (or
# forkserver's) imported torch afresh, where the module's own is torch's
_torch_loop: Any = None


def _original_loop() -> Any:
    if _torch_loop is not None:
        return _torch_loop
    from torch.utils.data._utils import worker

    return worker._worker_loop  # noqa: SLF001


_chains: dict[str, Any] = {}


def _begin(name: str) -> None:
    c = _chains.get(name)
    if c is None:
        eid = rec.event_id(name, (CAT_WORKER,))
        c = _chains[name] = rec.chain(rec.code(eid, S.LEVEL_SUMMARY, rec.BEGIN))
    c()


class _CpuCounter:
    """``worker.cpu %`` samples: CPU time of this process over wall time since the last one."""

    def __init__(self, sess: Any) -> None:
        self.em = sess.emitter(clock="monotonic", level=S.LEVEL_SUMMARY)
        self.track = sess.counter_track(
            S.COUNTER_WORKER_CPU.format(worker=threading.current_thread().name), "%")
        self.last = (time.perf_counter_ns(), _cpu_ns())

    def maybe_sample(self, force: bool = False) -> None:
        now = time.perf_counter_ns()
        t, c = self.last
        if now - t < CPU_SAMPLE_S * 1e9 and not force:
            return
        cpu = _cpu_ns()
        if now > t:
            self.em.counter(now, self.track, 100.0 * (cpu - c) / (now - t))
        self.last = (now, cpu)


def _cpu_ns() -> int:
    tms = os.times()
    return int((tms.user + tms.system) * 1e9)


def _wrap_fetch(fetch: Any, cpu: _CpuCounter) -> Any:
    @functools.wraps(fetch)
    def traced_fetch(self: Any, possibly_batched_index: Any) -> Any:
        _begin("fetch")
        try:
            return fetch(self, possibly_batched_index)
        finally:
            rec.end_summary()
            cpu.maybe_sample()

    return traced_fetch


def _wrap_method(fn: Any, name: str) -> Any:
    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        _begin(name)
        try:
            return fn(*args, **kwargs)
        finally:
            rec.end_summary()

    traced._stepscope_traced = True  # type: ignore[attr-defined]
    return traced


def _patch_dataset(dataset: Any) -> None:
    """Wrap the dataset class's ``__getitem__``/``__getitems__`` (in this worker process only)."""
    cls = type(dataset)
    for name in ("__getitem__", "__getitems__"):
        fn = getattr(cls, name, None)
        if callable(fn) and not getattr(fn, "_stepscope_traced", False):
            try:
                setattr(cls, name, _wrap_method(fn, name))
            except (TypeError, AttributeError):  # a built-in or frozen class
                pass


def traced_worker_loop(cfg: dict, *args: Any, **kwargs: Any) -> None:
    """torch's ``_worker_loop`` inside a stepscope session of this worker process."""
    sess = None
    original = _original_loop()
    try:
        bound = inspect.signature(original).bind(*args, **kwargs)
        a = bound.arguments
        worker_id = int(a.get("worker_id", 0))
        sess = _start_session(cfg, worker_id)
        cpu = _CpuCounter(sess)
        from torch.utils.data._utils import fetch as fetch_mod

        for cls in (fetch_mod._MapDatasetFetcher, fetch_mod._IterableDatasetFetcher):  # noqa: SLF001
            cls.fetch = _wrap_fetch(cls.fetch, cpu)
        holder = a.get("dataset_holder", a.get("dataset"))
        dataset = holder[0] if isinstance(holder, list) and holder else holder
        if dataset is not None:
            _patch_dataset(dataset)
        if "collate_fn" in a and callable(a["collate_fn"]):
            a["collate_fn"] = _wrap_method(a["collate_fn"], "collate")
        args, kwargs = bound.args, bound.kwargs
    except Exception as exc:  # never keep the worker from working
        print(f"stepscope: tracing DataLoader worker failed ({exc!r})", flush=True)
        cpu = None
    try:
        original(*args, **kwargs)
    finally:
        if sess is not None:
            try:
                if cpu is not None:
                    cpu.maybe_sample(force=True)
                sess.stop()
            except Exception:
                pass


def _start_session(cfg: dict, worker_id: int) -> Any:
    old = _session.current()
    if old is not None:  # a session inherited by fork is the parent's: never written here
        _session._current = None  # noqa: SLF001
    rank = int(cfg["rank"])
    path = Path(cfg["dir"]) / S.WORKER_FILE.format(rank=rank, worker=worker_id, pid=os.getpid())
    name = S.WORKER_THREAD_NAME.format(worker=worker_id, pid=os.getpid())
    threading.current_thread().name = name  # this process's main thread: the worker loop
    sess = _session.Session(path, detail=True, rank=rank, process_name=cfg["process_name"])
    # the rank's process (its pid and track uuid): the worker's thread is a thread of the rank,
    # so its slices count for the rank and no step-less process dilutes the summaries' frames
    reg = sess.registry  # the session's track registry owns the process track and pid
    del reg.tracks[reg.process_uuid]
    own_pid = reg.pid
    reg.pid, reg.process_uuid = int(cfg["pid"]), int(cfg["process_uuid"])
    sess.process_uuid = reg.process_uuid
    reg.tracks[reg.process_uuid] = reg._process_descriptor(reg.process_uuid)  # noqa: SLF001
    sess.thread_track()  # this thread's descriptor, under the rank's pid
    reg.pid = own_pid  # (sess.pid, which exit and SIGTERM handling check, is untouched)
    sess.start()
    return sess
