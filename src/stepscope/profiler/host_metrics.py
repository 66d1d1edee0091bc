"""Host metrics sampled with psutil on a background thread, as counter tracks of the rank.

Every ``interval_s`` the sampler reads cumulative counters and turns them into values over the
interval since the previous sample (definitions beside the names in ``_schema``):

* CPU user/system/idle/iowait/steal %: deltas of ``psutil.cpu_times()`` over their total delta
  (all cores; guest time is already inside user), user includes nice, system includes irq and
  softirq; the five add up to 100.
* process CPU %: delta of the process's user+system CPU time over wall time (100 = one core).
* context switches/s: process (voluntary+involuntary: all its threads through ``getrusage``
  when sampling this process; psutil's count, the main thread's on Linux, for another process
  or without ``/proc``) and system-wide, delta over wall time.
* process RSS and system memory used: instantaneous, bytes.
* disk read/write and network sent/received: byte-counter deltas over wall time, bytes/s (absent
  where the platform has no counters, e.g. some containers).
* sampler CPU %: the sampler thread's own CPU time (``time.thread_time_ns``) over wall time: its
  cost, also totalled in :attr:`HostSampler.cost`.

A value over an interval is stamped at the interval's start, an instantaneous one (RSS, memory
used) when it was read: a counter's value holds from its timestamp until the next one (Perfetto
draws it so, and the device table's time-weighted mean weighs it so), so a rate stamped at its
interval's end stood for the interval after it (a busy first half of a run and an idle second
half read 56 % and 40 % process CPU, for 49 % measured either way).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from .options import MAX_INTERVAL_S, MIN_INTERVAL_S

try:
    import resource

    _PAGE_SIZE = resource.getpagesize()
except ImportError:  # not a Unix
    resource = None  # type: ignore[assignment]

from .. import _schema as S

UNITS: dict[str, str] = {
    S.HOST_CPU_USER: "%",
    S.HOST_CPU_SYSTEM: "%",
    S.HOST_CPU_IDLE: "%",
    S.HOST_CPU_IOWAIT: "%",
    S.HOST_CPU_STEAL: "%",
    S.HOST_PROCESS_CPU: "%",
    S.HOST_PROCESS_CTX_SWITCHES: "1/s",
    S.HOST_CTX_SWITCHES: "1/s",
    S.HOST_PROCESS_RSS: "bytes",
    S.HOST_MEMORY_USED: "bytes",
    S.HOST_DISK_READ: "bytes/s",
    S.HOST_DISK_WRITE: "bytes/s",
    S.HOST_NET_SENT: "bytes/s",
    S.HOST_NET_RECV: "bytes/s",
    S.HOST_SAMPLER_CPU: "%",
}

Emit = Callable[[int, dict[str, float]], None]
"""Receives (CLOCK_MONOTONIC ns, {counter name: value}) for each sample: twice, the values over
the interval at its start, then the instantaneous ones at its end."""
INSTANT = frozenset((S.HOST_PROCESS_RSS, S.HOST_MEMORY_USED))  # read at a time, not over one


@dataclass
class SamplerCost:
    """The sampler's own cost: CPU time of its thread and wall time inside sampling."""

    samples: int = 0
    errors: int = 0  # samples that failed (psutil errors); the sampler goes on
    last_error: str = ""
    cpu_ns: int = 0
    wall_ns: int = 0
    elapsed_ns: int = 0  # wall time the sampler has been running

    @property
    def cpu_percent(self) -> float:
        """Sampler CPU time as % of one core over the time it ran."""
        return 100.0 * self.cpu_ns / self.elapsed_ns if self.elapsed_ns else 0.0

    @property
    def cpu_us_per_sample(self) -> float:
        return self.cpu_ns / self.samples / 1e3 if self.samples else 0.0

    def format(self) -> str:
        text = (
            f"host sampler: {self.samples} samples, {self.cpu_us_per_sample:.0f} us CPU per "
            f"sample, {self.cpu_percent:.3f}% of one core"
        )
        if self.errors:
            text += f"; {self.errors} failed samples (last: {self.last_error})"
        return text


def _own_process() -> tuple[float, int, int]:
    """(CPU seconds, context switches, RSS bytes) of this process from one ``getrusage`` call
    and ``/proc/self/statm``: a fifth of the cost of psutil's three /proc files. The context
    switches are those of all the process's threads (psutil's count only the main thread's)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/self/statm", "rb") as f:
        rss = int(f.read().split()[1]) * _PAGE_SIZE
    return ru.ru_utime + ru.ru_stime, ru.ru_nvcsw + ru.ru_nivcsw, rss


def _io(fn: Callable[[], object]) -> object | None:
    try:
        return fn()
    except Exception:  # counters missing in containers / permission errors
        return None


class HostSampler:
    """Reads psutil counters; :meth:`sample` returns the values over the interval since the last."""

    def __init__(self, emit: Emit | None = None, interval_s: float = 0.5,
                 pid: int | None = None) -> None:
        if not MIN_INTERVAL_S <= interval_s <= MAX_INTERVAL_S:  # NaN and inf too
            raise ValueError(f"host metrics: sample_interval_s must be from {MIN_INTERVAL_S:g} "
                             f"to {MAX_INTERVAL_S:g} seconds, got {interval_s!r}")
        self.emit = emit
        self.interval_s = float(interval_s)
        self.proc = psutil.Process(pid)
        self._own = resource is not None and self.proc.pid == os.getpid()
        self._whole_disks: dict[str, bool] = {}
        self.cost = SamplerCost()
        self._prev: dict[str, object] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._started_ns = 0

    def _read(self) -> dict[str, object]:
        pcpu, pctx, rss = self._process()
        # nowrap=False: psutil's wrap bookkeeping costs as much as reading the counters, and
        # 64-bit kernel counters do not wrap (a decrease, e.g. a NIC gone, gives a rate of 0)
        return {
            "t": time.monotonic_ns(),
            "cpu": psutil.cpu_times(),
            "pcpu": pcpu,
            "pctx": pctx,
            "ctx": _io(lambda: psutil.cpu_stats().ctx_switches),
            "rss": rss,
            "mem": psutil.virtual_memory().used,
            "disk": _io(self._disk),
            "net": _io(lambda: psutil.net_io_counters(pernic=False, nowrap=False)),
        }

    def _disk(self) -> tuple[int, int] | None:
        """(read, written) bytes of the whole disks: psutil's ``perdisk=False`` total. On Linux
        that total keeps whole disks only (``/sys/block/<name>`` exists): the test is made here
        once per name instead of on every sample; elsewhere psutil's total is used as it is."""
        if not psutil.LINUX:
            c = psutil.disk_io_counters(perdisk=False, nowrap=False)
            return None if c is None else (c.read_bytes, c.write_bytes)
        per = psutil.disk_io_counters(perdisk=True, nowrap=False)
        if not per:
            return None
        whole = self._whole_disks
        rd = wr = 0
        for name, c in per.items():
            ok = whole.get(name)
            if ok is None:
                ok = whole[name] = os.path.exists("/sys/block/" + name.replace("/", "!"))
            if ok:
                rd += c.read_bytes
                wr += c.write_bytes
        return rd, wr

    def _process(self) -> tuple[float, int, int]:
        """(CPU seconds, context switches, RSS bytes) of the sampled process."""
        if self._own:
            try:
                return _own_process()
            except (OSError, ValueError, IndexError):
                self._own = False  # no /proc/self/statm: psutil from now on
                self._prev = None  # psutil counts differently: no delta across the switch
        p = self.proc
        with p.oneshot():
            pcpu = p.cpu_times()
            pctx = p.num_ctx_switches()
            rss = p.memory_info().rss
        return pcpu.user + pcpu.system, pctx.voluntary + pctx.involuntary, rss

    def sample(self) -> tuple[int, int, dict[str, float]] | None:
        """Take one reading; returns (start, end, values) of the interval since the last one
        from the second call on, None on the first."""
        cpu0 = time.thread_time_ns()
        w0 = time.perf_counter_ns()
        cur = self._read()
        prev, self._prev = self._prev, cur
        out = None
        if prev is not None:
            out = (prev["t"], cur["t"], self._values(prev, cur))  # type: ignore[index]
        self.cost.samples += 1
        self.cost.wall_ns += time.perf_counter_ns() - w0
        self.cost.cpu_ns += time.thread_time_ns() - cpu0
        return out

    @staticmethod
    def _values(a: dict[str, object], b: dict[str, object]) -> dict[str, float]:
        dt = (b["t"] - a["t"]) / 1e9  # type: ignore[operator]
        v: dict[str, float] = {S.HOST_PROCESS_RSS: float(b["rss"]),  # type: ignore[arg-type]
                               S.HOST_MEMORY_USED: float(b["mem"])}  # type: ignore[arg-type]
        ca, cb = a["cpu"], b["cpu"]
        d = {f: getattr(cb, f) - getattr(ca, f) for f in cb._fields}  # type: ignore[attr-defined]
        total = sum(d.values()) - d.get("guest", 0.0) - d.get("guest_nice", 0.0)
        if total > 0:
            v[S.HOST_CPU_USER] = 100.0 * (d["user"] + d.get("nice", 0.0)) / total
            v[S.HOST_CPU_SYSTEM] = (
                100.0 * (d["system"] + d.get("irq", 0.0) + d.get("softirq", 0.0)) / total
            )
            v[S.HOST_CPU_IDLE] = 100.0 * d["idle"] / total
            if "iowait" in d:
                v[S.HOST_CPU_IOWAIT] = 100.0 * d["iowait"] / total
            if "steal" in d:
                v[S.HOST_CPU_STEAL] = 100.0 * d["steal"] / total
        if dt <= 0:
            return v
        v[S.HOST_PROCESS_CPU] = 100.0 * (b["pcpu"] - a["pcpu"]) / dt  # type: ignore[operator]
        v[S.HOST_PROCESS_CTX_SWITCHES] = (b["pctx"] - a["pctx"]) / dt  # type: ignore[operator]
        if a["ctx"] is not None and b["ctx"] is not None:
            v[S.HOST_CTX_SWITCHES] = (b["ctx"] - a["ctx"]) / dt  # type: ignore[operator]
        da, db = a["disk"], b["disk"]
        if da is not None and db is not None:
            v[S.HOST_DISK_READ] = max(0, db[0] - da[0]) / dt  # type: ignore[index]
            v[S.HOST_DISK_WRITE] = max(0, db[1] - da[1]) / dt  # type: ignore[index]
        na, nb = a["net"], b["net"]
        if na is not None and nb is not None:
            v[S.HOST_NET_SENT] = max(0, nb.bytes_sent - na.bytes_sent) / dt  # type: ignore
            v[S.HOST_NET_RECV] = max(0, nb.bytes_recv - na.bytes_recv) / dt  # type: ignore
        return v

    # -- background thread ----------------------------------------------------------------------
    def start(self) -> None:
        """Start sampling every ``interval_s`` on a daemon thread."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._started_ns = time.perf_counter_ns()
        self._thread = threading.Thread(target=self._run, name="stepscope-host-sampler",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        cpu_before = self.cost.cpu_ns
        last_t = time.perf_counter_ns()
        self._tick(cpu_before, last_t)  # baseline reading
        while not self._stop.wait(self.interval_s):
            self._tick(cpu_before, last_t)
            cpu_before, last_t = self.cost.cpu_ns, time.perf_counter_ns()
        self._tick(cpu_before, last_t)  # final sample at stop

    def _tick(self, cpu_before: int, last_t: int) -> None:
        """One sample, emitted; errors are counted, never raised (the user's run goes on)."""
        try:
            self._tick_unsafe(cpu_before, last_t)
        except Exception as exc:
            self.cost.errors += 1
            self.cost.last_error = repr(exc)

    def _tick_unsafe(self, cpu_before: int, last_t: int) -> None:
        s = self.sample()
        if s is None or self.emit is None:
            return
        t0, t1, values = s
        now = time.perf_counter_ns()
        # cost of the previous interval, including this sample
        values[S.HOST_SAMPLER_CPU] = 100.0 * (self.cost.cpu_ns - cpu_before) / max(1, now - last_t)
        instants = {k: values.pop(k) for k in INSTANT if k in values}
        self.emit(t0, values)  # (over the interval: from its start)
        self.emit(t1, instants)

    def stop(self) -> SamplerCost:
        """Stop the thread (after one final sample) and return the sampler's cost."""
        t = self._thread
        if t is not None:
            self._stop.set()
            t.join(timeout=5.0)
            self._thread = None
            self.cost.elapsed_ns += time.perf_counter_ns() - self._started_ns
        return self.cost
