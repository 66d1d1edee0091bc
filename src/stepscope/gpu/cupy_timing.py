"""GPU-side ranges timed with CUDA events through CuPy (no CUPTI needed), and ``sync_gpu``.

When CuPy is in use, a range can also be timed on the GPU: a CUDA event is recorded on the
current stream at range begin and at range end. Nothing waits: :meth:`CupyEventTimer.poll`
(called at flush time) emits the ranges whose end event has completed and keeps the others.

GPU times are placed on the host clock through an *anchor*: an event recorded and synchronized
once (at the first range begin), with ``perf_counter_ns()`` read right after; a range's start is
``anchor_host + elapsed(anchor, begin event)``. ``cudaEventElapsedTime`` fails for events of two
devices, so each device has its own anchor, made while it is current. It has ~0.5 µs resolution
and float precision, so an anchor is renewed every ``reanchor_s`` seconds (one short synchronize).

Ranges that cannot be timed (events of two devices, a failed query) or that exceed
``max_pending`` are counted in ``dropped`` and, at the next :meth:`CupyEventTimer.poll`, written as
a ``CUDA event ranges dropped`` instant on the device's GPU track whose ``dropped_events`` arg
counts the ranges dropped since the previous such instant.

``sync_gpu=True`` (CNTK's ``profilerSyncGpu``) is the blunt alternative: synchronize the current
stream at range end so that the CPU range includes the GPU work it launched. Cost: it serialises
CPU and GPU at every range end, removing the overlap a training loop relies on; use it for
attribution runs, not for measuring throughput.

Threads: each host thread has its own push/pop stack (keyed by ``threading.get_ident()``), so
ranges pushed from several threads never close each other's. Their slices go on a track
``CUDA events (stream <ptr>)`` under ``GPU <id> (<name>)`` for the first thread that times ranges
on that stream, and ``CUDA events (stream <ptr>, thread <native id>)`` for any other: ranges of two
threads on one stream can overlap without nesting, which one track could not hold. Pending ranges
are appended by the timing threads and resolved by the flush thread under a lock.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from .. import _schema

log = logging.getLogger("stepscope.gpu")

DROPPED_NAME = "CUDA event ranges dropped"  # instant on the GPU track, like "CUPTI dropped records"


def cupy_module() -> Any | None:
    """CuPy if the program already imported it (we never import it ourselves)."""
    return sys.modules.get("cupy")


def sync_current_stream() -> None:
    """``sync_gpu``: wait for the current CuPy stream; no-op without CuPy."""
    cp = cupy_module()
    if cp is not None:
        try:
            cp.cuda.get_current_stream().synchronize()
        except Exception as exc:  # never break the program
            log.debug("stepscope: sync_gpu failed: %s", exc)


@dataclass
class _Pending:
    name: str
    begin: Any
    end: Any
    stream: int
    device: int
    anchor: tuple[Any, int]
    thread: int = 0  # ident of the thread that timed it
    native_id: int = 0


class CupyEventTimer:
    """Times ranges with CUDA events on the current CuPy stream (see the module docstring)."""

    def __init__(
        self, sess: Any, *, reanchor_s: float = 10.0, category: str = _schema.CAT_GPU_RANGE,
        max_pending: int = 100_000, host_clock: Any = time.perf_counter_ns,
    ) -> None:  # fmt: skip
        self.sess = sess
        self.category = category
        self.reanchor_s = reanchor_s
        self.max_pending = max_pending
        self._host_clock = host_clock
        self.dropped = 0
        self._unwritten: dict[int, int] = {}  # device -> dropped ranges not in the trace yet
        self._cp = cupy_module()
        # per thread ident: open ranges (name, begin event, stream ptr, device, anchor)
        self._stacks: dict[int, list[tuple[str, Any, int, int, tuple[Any, int]]]] = {}
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()  # pending list, dropped count: pop() vs poll
        # device -> ((event, host ns), time.monotonic() at the anchor): one entry, so a thread
        # reading it never sees half of another thread's update
        self._anchors: dict[int, tuple[tuple[Any, int], float]] = {}
        self._tracks: dict[tuple[int, int, int], int] = {}
        self._stream_owner: dict[tuple[int, int], int] = {}  # first thread on (device, stream)
        self._gpu_tracks: dict[int, int] = {}
        self._em = sess.emitter(clock="monotonic", level=_schema.LEVEL_DETAIL)

    @property
    def available(self) -> bool:
        return self._cp is not None

    def _get_anchor(self, device: int) -> tuple[Any, int]:
        """The anchor of ``device``, the current device (its events are created there)."""
        entry, now = self._anchors.get(device), time.monotonic()
        if entry is None or now - entry[1] > self.reanchor_s:
            ev = self._cp.cuda.Event()
            ev.record()
            ev.synchronize()
            entry = self._anchors[device] = ((ev, self._host_clock()), now)
        return entry[0]

    def push(self, name: str) -> None:
        """Record the begin event of a range on the current stream (of the calling thread)."""
        if self._cp is None:
            return
        try:
            cp = self._cp
            device = int(cp.cuda.Device().id)
            anchor = self._get_anchor(device)  # before the begin event: elapsed times are >= 0
            stream = cp.cuda.get_current_stream()
            ev = cp.cuda.Event()
            ev.record(stream)
            entry = (name, ev, int(stream.ptr), device, anchor)
            ident = threading.get_ident()
            stack = self._stacks.get(ident)
            if stack is None:  # only this thread touches its own stack after creation
                stack = self._stacks.setdefault(ident, [])
            stack.append(entry)
        except Exception as exc:
            log.debug("stepscope: CUDA event begin failed: %s", exc)

    def pop(self) -> None:
        """Record the end event of the calling thread's innermost range; resolved later by
        :meth:`poll`. A pop with no open range on this thread is ignored."""
        if self._cp is None:
            return
        ident = threading.get_ident()
        stack = self._stacks.get(ident)
        if not stack:
            return
        name, begin, stream_ptr, device, anchor = stack.pop()
        if not stack:
            self._stacks.pop(ident, None)  # no entry left behind by finished threads
        try:
            cp = self._cp
            ev = cp.cuda.Event()
            ev.record(cp.cuda.get_current_stream())
            p = _Pending(name, begin, ev, stream_ptr, device, anchor, ident,
                         threading.get_native_id())  # fmt: skip
            with self._lock:
                if len(self._pending) >= self.max_pending:
                    self._count_dropped([p])
                    return
                self._pending.append(p)
        except Exception as exc:
            log.debug("stepscope: CUDA event end failed: %s", exc)

    def open_ranges(self, ident: int | None = None) -> list[str]:
        """Names of the ranges open on a thread (default: the caller), outermost first."""
        stack = self._stacks.get(threading.get_ident() if ident is None else ident, [])
        return [e[0] for e in stack]

    def _count_dropped(self, lost: list[_Pending]) -> None:
        """Count ranges as dropped (under the lock where the caller can take it)."""
        self.dropped += len(lost)
        for p in lost:
            self._unwritten[p.device] = self._unwritten.get(p.device, 0) + 1

    def poll(self) -> int:
        """Emit the ranges whose end event completed and the drops since the last poll; return
        how many ranges were emitted."""
        if self._cp is None:
            return 0
        n = self._resolve() if self._pending else 0
        if self._unwritten:
            self._write_dropped()
        return n

    def _write_dropped(self) -> None:
        if not self._lock.acquire(timeout=0.5):
            return  # written at a later poll
        try:
            new, self._unwritten = self._unwritten, {}
        finally:
            self._lock.release()
        ts = self._host_clock()
        for device, n in sorted(new.items()):
            self._em.instant(ts, DROPPED_NAME, self._gpu_track(device), _schema.CAT_STEPSCOPE,
                             {_schema.ARG_DROPPED: n})  # fmt: skip
        log.debug("stepscope: %d CUDA event ranges dropped", sum(new.values()))

    def _resolve(self) -> int:
        if not self._lock.acquire(timeout=0.5):
            return 0
        try:
            pending, self._pending = self._pending, []
        finally:
            self._lock.release()
        get_elapsed = self._cp.cuda.get_elapsed_time
        keep: list[_Pending] = []
        failed: list[_Pending] = []
        n = 0
        for p in pending:
            try:
                if not p.end.done:
                    keep.append(p)
                    continue
                anchor_ev, anchor_ns = p.anchor
                t0 = anchor_ns + round(get_elapsed(anchor_ev, p.begin) * 1e6)
                t1 = anchor_ns + round(get_elapsed(anchor_ev, p.end) * 1e6)
            except Exception:  # e.g. events of two devices
                failed.append(p)
                continue
            self._em.complete(
                t0, max(t1 - t0, 0), p.name, self._track(p.device, p.stream, p), self.category
            )
            n += 1
        if keep or failed:
            if self._lock.acquire(timeout=0.5):
                try:  # dropped is counted under the lock (pop() counts into it too)
                    self._count_dropped(failed)
                    self._pending[:0] = keep
                    # pop() may have filled the list meanwhile: keep the cap, dropping the
                    # newest as pop() does
                    if len(self._pending) > self.max_pending:
                        self._count_dropped(self._pending[self.max_pending :])
                        del self._pending[self.max_pending :]
                finally:
                    self._lock.release()
            else:  # the lock is stuck (rare): the kept ranges are lost, counted without it
                self._count_dropped(failed + keep)
        return n

    def _track(self, device: int, stream: int, p: _Pending) -> int:
        key = (device, stream, p.thread)
        t = self._tracks.get(key)
        if t is None:
            owner = self._stream_owner.setdefault((device, stream), p.thread)
            suffix = "" if owner == p.thread else f", thread {p.native_id}"
            t = self._tracks[key] = self.sess.new_track(
                f"{_schema.GPU_RANGE_TRACK_NAME} (stream {stream:#x}{suffix})",
                parent=self._gpu_track(device),
            )
        return t

    def _gpu_track(self, device: int) -> int:
        g = self._gpu_tracks.get(device)
        if g is None:
            name = f"GPU {device}"
            try:
                props = self._cp.cuda.runtime.getDeviceProperties(device)
                raw = props.get("name", b"")
                name = _schema.GPU_TRACK_NAME.format(
                    device=device, name=raw.decode() if isinstance(raw, bytes) else raw
                )
            except Exception:
                pass
            g = self._gpu_tracks[device] = self.sess.gpu_track(device, name)
        return g


def memory_pool_counters(device: int = 0) -> list[tuple[str, str, int]]:
    """CuPy's default memory pool used/total bytes as (counter name, unit, value); [] without CuPy.

    The numbers are the calling thread's *current* device's (CuPy keeps one pool per device but
    reports only that one); ``device`` names the counters. The NVML sampler thread calls this for
    each device in use (:class:`stepscope.gpu.nvml.NvmlSampler`).
    """
    cp = cupy_module()
    if cp is None:
        return []
    try:
        pool = cp.get_default_memory_pool()
        prefix = f"{_schema.COUNTER_CUPY_PREFIX}gpu{device}.pool."
        return [
            (prefix + "used", "bytes", int(pool.used_bytes())),
            (prefix + "total", "bytes", int(pool.total_bytes())),
        ]
    except Exception:
        return []
