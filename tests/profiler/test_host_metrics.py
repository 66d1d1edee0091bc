import threading
import time

import psutil

from stepscope import _schema as S
from stepscope.profiler.host_metrics import UNITS, HostSampler


def test_values_are_sane_under_known_load():
    got = []
    blob = bytearray(64 << 20)  # +64 MiB RSS while sampling
    blob[::4096] = b"x" * len(blob[::4096])  # touch every page
    sampler = HostSampler(lambda ts, v: got.append((ts, v)), interval_s=0.1)
    c0, t0 = time.process_time(), time.perf_counter()
    sampler.start()
    t_end = time.perf_counter() + 0.45
    while time.perf_counter() < t_end:  # keep a core busy, but let the sampler have the GIL
        sum(range(1000))
        time.sleep(0)
    cost = sampler.stop()
    measured = 100 * (time.process_time() - c0) / (time.perf_counter() - t0)
    # each sample: the values over its interval, stamped at the interval's start, then the
    # instantaneous ones, at its end (the next interval's start)
    rates, instants = got[0::2], got[1::2]
    assert len(rates) == len(instants) >= 3
    assert all(set(v) == {S.HOST_PROCESS_RSS, S.HOST_MEMORY_USED} for _, v in instants)
    for (t0, _), (t1, _), nxt in zip(rates, instants, rates[1:] + [None], strict=True):
        assert t0 < t1 and (nxt is None or nxt[0] == t1)
    # process CPU: the samples' time-weighted mean matches the CPU time measured around them
    # (full 0.1 s intervals; the last one, cut by stop(), is left out)
    full = [v[S.HOST_PROCESS_CPU] for _, v in rates[:-1]]
    mean = sum(full) / len(full)
    assert abs(mean - measured) < 20.0, (mean, measured)
    busy = {**rates[len(rates) // 2][1], **instants[len(rates) // 2][1]}
    for _, v in rates:
        cpu = [v.get(k, 0.0) for k in (S.HOST_CPU_USER, S.HOST_CPU_SYSTEM, S.HOST_CPU_IDLE,
                                        S.HOST_CPU_IOWAIT, S.HOST_CPU_STEAL)]
        assert all(0.0 <= x <= 100.0 for x in cpu)
        assert abs(sum(cpu) - 100.0) < 1e-6  # they share out all CPU time
    assert busy[S.HOST_PROCESS_RSS] >= len(blob)
    assert busy[S.HOST_MEMORY_USED] <= psutil.virtual_memory().total
    assert busy[S.HOST_PROCESS_CTX_SWITCHES] >= 0.0
    assert 0.0 <= busy[S.HOST_SAMPLER_CPU] < 50.0
    for name in busy:
        assert name.startswith(S.COUNTER_HOST_PREFIX) and name in UNITS
    assert cost.samples == len(rates) + 1 and cost.cpu_ns > 0 and cost.elapsed_ns > 0
    assert "samples" in cost.format()


def test_rates_from_known_deltas():
    """Rates are deltas over the wall-time interval; checked on hand-made readings."""
    import collections

    cpu_t = collections.namedtuple("cpu_t", "user nice system idle iowait irq softirq steal")
    io_t = collections.namedtuple("io_t", "read_bytes write_bytes")
    net_t = collections.namedtuple("net_t", "bytes_sent bytes_recv")
    a = {"t": 0, "cpu": cpu_t(10, 0, 5, 80, 5, 0, 0, 0), "pcpu": 1.0, "pctx": 100, "ctx": 1000,
         "rss": 1, "mem": 2, "disk": io_t(0, 0), "net": net_t(0, 0)}
    b = {"t": 2_000_000_000, "cpu": cpu_t(40, 10, 15, 100, 25, 2, 3, 5), "pcpu": 2.5, "pctx": 300,
         "ctx": 5000, "rss": 3, "mem": 4, "disk": io_t(4000, 8000), "net": net_t(600, 200)}
    v = HostSampler._values(a, b)
    # CPU deltas: user 30 + nice 10, system 10 + irq 2 + softirq 3, idle 20, iowait 20,
    # steal 5 -> total 100
    assert v[S.HOST_CPU_USER] == 40.0 and v[S.HOST_CPU_SYSTEM] == 15.0
    assert v[S.HOST_CPU_IDLE] == 20.0 and v[S.HOST_CPU_IOWAIT] == 20.0
    assert v[S.HOST_CPU_STEAL] == 5.0
    assert v[S.HOST_PROCESS_CPU] == 75.0  # 1.5 s CPU over 2 s
    assert v[S.HOST_PROCESS_CTX_SWITCHES] == 100.0 and v[S.HOST_CTX_SWITCHES] == 2000.0
    assert v[S.HOST_DISK_READ] == 2000.0 and v[S.HOST_DISK_WRITE] == 4000.0
    assert v[S.HOST_NET_SENT] == 300.0 and v[S.HOST_NET_RECV] == 100.0
    assert v[S.HOST_PROCESS_RSS] == 3.0 and v[S.HOST_MEMORY_USED] == 4.0


def test_emit_errors_never_escape():
    def bad(ts, v):
        raise RuntimeError("boom")

    s = HostSampler(bad, interval_s=0.02)
    s.start()
    time.sleep(0.08)
    s.stop()
    assert s.cost.samples >= 2
    assert not any(t.name == "stepscope-host-sampler" for t in threading.enumerate())
