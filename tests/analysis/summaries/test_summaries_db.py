"""A hand-made trace database with trace processor's tables, for exact summary tests.

``TraceDB`` creates exactly the tables/columns the summaries read (the subset of trace
processor's schema named in issue 3) in an in-memory SQLite database, so each summary's numbers
can be computed by hand from the rows a test inserts. ``scenario()`` builds the two-rank trace
that test_summaries.py asserts against.
"""

from __future__ import annotations

import sqlite3
from typing import Any

_SCHEMA = """
CREATE TABLE track(id INTEGER PRIMARY KEY, name TEXT, parent_id INTEGER);
CREATE TABLE thread_track(id INTEGER PRIMARY KEY, utid INTEGER);
CREATE TABLE process_track(id INTEGER PRIMARY KEY, upid INTEGER);
CREATE TABLE counter_track(id INTEGER PRIMARY KEY, name TEXT);
CREATE TABLE process_counter_track(id INTEGER PRIMARY KEY, name TEXT, upid INTEGER);
CREATE TABLE thread_counter_track(id INTEGER PRIMARY KEY, name TEXT, utid INTEGER);
CREATE TABLE thread(utid INTEGER PRIMARY KEY, tid INTEGER, name TEXT, upid INTEGER);
CREATE TABLE process(upid INTEGER PRIMARY KEY, pid INTEGER, name TEXT);
CREATE TABLE slice(id INTEGER PRIMARY KEY, ts INTEGER, dur INTEGER, track_id INTEGER,
                   category TEXT, name TEXT, depth INTEGER, parent_id INTEGER,
                   arg_set_id INTEGER);
CREATE TABLE counter(id INTEGER PRIMARY KEY, ts INTEGER, track_id INTEGER, value REAL);
CREATE TABLE args(arg_set_id INTEGER, key TEXT, int_value INTEGER, string_value TEXT,
                  real_value REAL, value_type TEXT);
CREATE TABLE flow(slice_out INTEGER, slice_in INTEGER);
"""


class TraceDB:
    """Builder for the tables; ``query(sql)`` returns a list of dicts like the real engines."""

    def __init__(self) -> None:
        self.conn = sqlite3.connect(":memory:")
        self.conn.executescript(_SCHEMA)
        self._track_id = 0
        self._arg_set = 0
        self._depth: dict[int, int] = {}
        self._process_track: dict[int, int] = {}

    def query(self, sql: str) -> list[dict[str, Any]]:
        cur = self.conn.execute(sql)
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r, strict=True)) for r in cur]

    # -- tracks ------------------------------------------------------------------------------
    def _new_track(self, name: str | None, parent: int | None) -> int:
        self._track_id += 1
        self.conn.execute("INSERT INTO track VALUES (?, ?, ?)", (self._track_id, name, parent))
        return self._track_id

    def process(self, pid: int, name: str | None) -> int:
        """A process and its process track; returns the upid."""
        upid = pid  # distinct per test process
        self.conn.execute("INSERT INTO process VALUES (?, ?, ?)", (upid, pid, name))
        tr = self._new_track(name, None)
        self.conn.execute("INSERT INTO process_track VALUES (?, ?)", (tr, upid))
        self._process_track[upid] = tr
        return upid

    def process_track(self, upid: int) -> int:
        return self._process_track[upid]

    def thread(self, upid: int | None, tid: int, name: str | None) -> int:
        """A thread and its thread track; returns the track id."""
        utid = tid
        self.conn.execute("INSERT INTO thread VALUES (?, ?, ?, ?)", (utid, tid, name, upid))
        tr = self._new_track(name, None)
        self.conn.execute("INSERT INTO thread_track VALUES (?, ?)", (tr, utid))
        return tr

    def track(
        self, name: str, parent: int | None, upid: int | None = None, utid: int | None = None
    ) -> int:
        """A custom track; with ``upid`` it is also a process track, with ``utid`` a thread
        track (trace processor scopes the descendants of a process/thread descriptor so)."""
        tr = self._new_track(name, parent)
        if upid is not None:
            self.conn.execute("INSERT INTO process_track VALUES (?, ?)", (tr, upid))
        if utid is not None:
            self.conn.execute("INSERT INTO thread_track VALUES (?, ?)", (tr, utid))
        return tr

    def counter_track(self, name: str, parent: int | None, upid: int | None = None,
                      utid: int | None = None) -> int:
        """A counter track; with ``upid`` (``utid``) also a process (thread) counter track, as
        trace processor lists a counter under a process (thread) descriptor: no parent_id."""
        tr = self._new_track(name, parent)
        self.conn.execute("INSERT INTO counter_track VALUES (?, ?)", (tr, name))
        if upid is not None:
            self.conn.execute("INSERT INTO process_counter_track VALUES (?, ?, ?)",
                              (tr, name, upid))
        if utid is not None:
            self.conn.execute("INSERT INTO thread_counter_track VALUES (?, ?, ?)",
                              (tr, name, utid))
        return tr

    # -- events ------------------------------------------------------------------------------
    def _args(self, args: dict[str, Any] | None) -> int | None:
        if not args:
            return None
        self._arg_set += 1
        for k, v in args.items():
            if isinstance(v, str):
                row = (None, v, None, "string")
            elif isinstance(v, float):
                row = (None, None, v, "real")
            else:
                row = (int(v), None, None, "int")
            self.conn.execute(
                "INSERT INTO args VALUES (?, ?, ?, ?, ?, ?)", (self._arg_set, f"debug.{k}", *row)
            )
        return self._arg_set

    def slice(
        self,
        track: int,
        ts: int,
        dur: int,
        name: str,
        category: str | None = None,
        args: dict[str, Any] | None = None,
        parent: int | None = None,
    ) -> int:
        depth = 0 if parent is None else self._depth[parent] + 1
        cur = self.conn.execute(
            "INSERT INTO slice(ts, dur, track_id, category, name, depth, parent_id, arg_set_id) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (ts, dur, track, category, name, depth, parent, self._args(args)),
        )
        sid = cur.lastrowid
        self._depth[sid] = depth
        return sid

    def flow(self, out: int, into: int) -> None:
        self.conn.execute("INSERT INTO flow VALUES (?, ?)", (out, into))

    def counter(self, track: int, ts: int, value: float) -> None:
        self.conn.execute(
            "INSERT INTO counter(ts, track_id, value) VALUES (?, ?, ?)", (ts, track, value)
        )


def live_plan(rows: list[dict[str, Any]]) -> list[str]:
    """The details of an EXPLAIN QUERY PLAN, less the overview's arm for the CTEs alone (the
    ``UNION ALL`` arm that materializes ``x``), which ``WHERE NOT 1`` skips on the shared base:
    what runs there."""
    kids: dict[int, list[int]] = {}
    for r in rows:
        kids.setdefault(r["parent"], []).append(r["id"])
    detail = {r["id"]: r["detail"] for r in rows}

    def subtree(i: int) -> list[int]:
        return [i] + [j for k in kids.get(i, []) for j in subtree(k)]

    skipped = {j for i, d in detail.items() if d == "UNION ALL"
               and any(detail[k] == "MATERIALIZE x" for k in subtree(i)) for j in subtree(i)}
    return [r["detail"] for r in rows if r["id"] not in skipped]


# a collective's args, as stepscope.pytorch writes them
COLL_ARGS = {"op": "allreduce", "bytes": 4096, "dtype": "float32", "group_size": 2, "group": "0"}


def scenario(streams_as_process_tracks: bool = False) -> TraceDB:
    """Two ranks, times in ns. See test_summaries.py for every number derived from it.

    rank 0 (pid 100): main thread 101, worker thread 102, GPU 0 with streams 7 and 8.
    rank 1 (pid 200): main thread 201, GPU 0 with stream 7; slower steps (a straggler).
    """
    db = TraceDB()
    r0 = db.process(100, "rank 0 (hostA)")
    main = db.thread(r0, 101, "main")
    worker = db.thread(r0, 102, "worker")
    up = r0 if streams_as_process_tracks else None
    gpu = db.track("GPU 0 (H100)", db.process_track(r0), upid=up)
    s7 = db.track("stream 7", gpu, upid=up)
    s8 = db.track("stream 8", gpu, upid=up)
    # runtime calls on a "CUDA API" child track of the main thread, as the GPU converter writes
    api = db.track("CUDA API", main, utid=101 if streams_as_process_tracks else None)

    # step 1 [1000, 2000): Dataloader [1000,1200) > wait [1000,1150); Forward [1200,1500)
    # > matmul [1250,1400) > launch [1300,1320) -> K1, inner [1320,1380) > mark at 1340; Backward
    # [1500,1800) > launch [1600,1610) -> K2.
    st1 = db.slice(main, 1000, 1000, "step 1", "step", {"step": 1, "num_samples": 32})
    dl = db.slice(main, 1000, 200, "Dataloader", "phase", parent=st1)
    db.slice(main, 1000, 150, "dataloader.next", "dataloader", parent=dl)
    fw = db.slice(main, 1200, 300, "Forward", "phase", parent=st1)
    mm = db.slice(main, 1250, 150, "matmul", None, parent=fw)
    l1 = db.slice(main, 1300, 20, "cudaLaunchKernel", "cuda_runtime", parent=mm)
    inner = db.slice(main, 1320, 60, "inner", "mydomain", parent=mm)
    # a mark (an instant, dur 0) in it: no call of any kind, so it changes no table
    db.slice(main, 1340, 0, "checkpoint", None, parent=inner)
    db.slice(main, 1500, 300, "Backward", "phase", parent=st1)
    l2 = db.slice(api, 1600, 10, "cudaLaunchKernel", "cuda_runtime")
    # step 2 [2000, 3000): wait [2000,2100) directly in the step; Forward [2100,2400) > matmul
    # [2150,2250); Backward [2400,2700); Optimization [2700,2900) > launch [2750,2760) -> M1.
    st2 = db.slice(main, 2000, 1000, "step 2", "step", {"step": 2, "num_samples": 32})
    db.slice(main, 2000, 100, "dataloader.next", "dataloader", parent=st2)
    fw2 = db.slice(main, 2100, 300, "Forward", "phase", parent=st2)
    db.slice(main, 2150, 100, "matmul", None, parent=fw2)
    db.slice(main, 2400, 300, "Backward", "phase", parent=st2)
    db.slice(main, 2700, 200, "Optimization", "phase", parent=st2)
    l3 = db.slice(api, 2750, 10, "cudaMemcpyAsync", "cuda_runtime")
    # worker thread: overlaps main's matmul; "load" crosses the step boundary.
    db.slice(worker, 1350, 100, "matmul", None)
    db.slice(worker, 1900, 150, "load", None)
    # device
    k1 = db.slice(
        s7, 1330, 200, "gemm", "kernel", {"blocks_per_sm": 2.0, "est_achieved_occupancy": 0.5}
    )
    k2 = db.slice(
        s7, 1620, 100, "gemm", "kernel", {"blocks_per_sm": 4.0, "est_achieved_occupancy": 0.25}
    )
    db.slice(s8, 1650, 100, "relu", "kernel")  # no flow
    db.slice(s8, 2750, 200, "ncclAllReduce", "communication")
    m1 = db.slice(s7, 2760, 40, "Memcpy HtoD", "memcpy", {"bytes": 4000, "copy_kind": "HtoD"})
    db.slice(s7, 2850, 100, "Memcpy DtoH", "memcpy", {"bytes": 2000, "copy_kind": "DtoH"})
    db.slice(s7, 2960, 20, "Memset", "memset", {"bytes": 1000})
    db.slice(s7, 3100, 100, "gemm", "kernel")  # after the last step
    # host collectives (not device activity): an NCCL op, ended when enqueued on its stream
    coll = db.track("collectives", db.process_track(r0))
    db.slice(coll, 2740, 10, "allreduce", "collective", dict(COLL_ARGS, completion="stream"))
    db.flow(l1, k1)
    db.flow(l2, k2)
    db.flow(l3, m1)
    cpu = db.counter_track("host.cpu.user %", db.process_track(r0))
    for ts, v in ((1000, 10.0), (2000, 30.0), (3000, 50.0)):
        db.counter(cpu, ts, v)

    r1 = db.process(200, "rank 1 (hostB)")
    main1 = db.thread(r1, 201, "main")
    up1 = r1 if streams_as_process_tracks else None
    gpu1 = db.track("GPU 0 (A100)", db.process_track(r1), upid=up1)
    s17 = db.track("stream 7", gpu1, upid=up1)
    s18 = db.track("stream 8", gpu1, upid=up1)
    db.slice(main1, 1000, 1500, "step 1", "step", {"step": 1})
    db.slice(main1, 2500, 1500, "step 2", "step", {"step": 2})
    db.slice(s17, 1100, 500, "gemm", "kernel")
    db.slice(s18, 1500, 500, "ncclAllReduce", "communication")
    # host collectives: a gloo op timed to its completion, a send ended when issued
    coll1 = db.track("collectives", db.process_track(r1))
    db.slice(coll1, 1900, 200, "allreduce", "collective", dict(COLL_ARGS, bytes=1000))
    db.slice(coll1, 3000, 10, "send", "collective",
             dict(COLL_ARGS, op="send", bytes=8, completion="issued"))
    pcpu = db.counter_track("host.process.cpu %", db.process_track(r1))
    db.counter(pcpu, 1500, 75.0)
    # an unfinished slice and profiler bookkeeping: ignored by every table
    db.slice(main1, 3900, -1, "unfinished", None)
    db.slice(main1, 1000, 5, "stepscope flush", "stepscope")
    db.conn.commit()
    return db


def test_builder_nests_slices_and_links_tracks():
    db = scenario()
    rows = db.query("SELECT name, depth FROM slice WHERE name = 'cudaLaunchKernel' ORDER BY ts")
    assert rows == [
        {"name": "cudaLaunchKernel", "depth": 3},
        {"name": "cudaLaunchKernel", "depth": 0},
    ]
    streams = db.query(
        "SELECT t.name, p.name AS parent FROM track t JOIN track p "
        "ON p.id = t.parent_id WHERE t.name LIKE 'stream %' ORDER BY t.id"
    )
    assert [r["parent"] for r in streams] == ["GPU 0 (H100)"] * 2 + ["GPU 0 (A100)"] * 2
