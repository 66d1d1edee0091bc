"""Valid or slightly damaged traces that once failed to load, and errors that once escaped."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from stepscope import analysis
from stepscope.analysis import engines
from stepscope.analysis import sqlimage as si
from stepscope.analysis.sqlimage import leaves, records, schema
from stepscope.format import wire as w

TRACK = 7


def packet(body: bytes) -> bytes:
    return w.f_bytes(w.TRACE_PACKET, body)


def event(ts: int, kind: int, extra: bytes = b"", name: str | None = None) -> bytes:
    te = w.f_varint(w.TE_TYPE, kind) + w.f_varint(w.TE_TRACK_UUID, TRACK)
    if name:
        te += w.f_str(w.TE_NAME, name)
    return (w.f_varint(w.PKT_TIMESTAMP, ts) + w.f_varint(w.PKT_SEQUENCE_ID, 1)
            + w.f_bytes(w.PKT_TRACK_EVENT, te + extra))


DESC = packet(w.f_bytes(w.PKT_TRACK_DESCRIPTOR,
                        w.f_varint(w.TD_UUID, TRACK) + w.f_str(w.TD_NAME, "t")))


def slices(path) -> list:
    conn, _ = analysis.load(str(path))
    return conn.execute("select ts, dur, name from slice order by id").fetchall()


def test_a_short_last_packet_loads(tmp_path):
    path = tmp_path / "t.pftrace"  # the last packet's body is only a few bytes long
    path.write_bytes(DESC + packet(event(100, 1, name="a")) + packet(event(200, 2)))
    assert slices(path) == [(100, 100, "a")]


def test_annotations_that_all_drop_leave_the_slice(tmp_path):
    unresolved = w.f_bytes(w.TE_DEBUG_ANNOTATIONS,
                           w.f_varint(w.DA_NAME_IID, 5) + w.f_varint(w.DA_INT, 3))
    path = tmp_path / "t.pftrace"
    path.write_bytes(DESC + packet(event(100, 1, unresolved, "a")) + packet(event(200, 2)))
    assert slices(path) == [(100, 100, "a")]


def test_a_corrupt_source_location_loses_only_itself(tmp_path):
    inline_source_location = 33  # TrackEvent.source_location: its file_name claims 5 bytes
    broken = w.f_bytes(inline_source_location, b"\x0a\x05ab")
    path = tmp_path / "t.pftrace"
    path.write_bytes(DESC + packet(event(100, 1, broken, "a")) + packet(event(200, 2)))
    assert slices(path) == [(100, 100, "a")]
    conn, stats = analysis.load(str(path))
    assert stats["corrupt_source_locations"] == 1  # counted, as other corrupt input is
    assert conn.execute("select value from stats where name = 'corrupt_source_locations'"
                        ).fetchall() == [(1,)]
    assert conn.execute("select count(*) from args").fetchone() == (0,)


def test_a_table_whose_last_interior_page_would_hold_one_child_is_well_formed():
    strings = ["x" * 1000]

    def table(n):
        return si.Table("t", "CREATE TABLE t(id INTEGER PRIMARY KEY, s TEXT)",
                        np.arange(n, dtype=np.int64),
                        [si.Column("rowid"), si.Column("text", np.zeros(n, np.int64))])

    st = records.Strings(strings)
    per = (si.PAGE - schema.INTERIOR_HDR) // (2 + 4 + 9)
    lo, hi = 1, 400_000  # the row count that needs per + 1 leaf pages
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if leaves.table_layout(table(mid), st).n_pages >= per + 1 else (mid + 1,
                                                                                         hi)
    conn = si.connect(si.build([table(lo)], strings))
    assert conn.execute("pragma integrity_check").fetchall() == [("ok",)]
    assert conn.execute("select count(*), max(id) from t").fetchone() == (lo, lo - 1)


def test_sqlite_errors_while_stepping_are_query_errors(tmp_path):
    path = tmp_path / "t.pftrace"
    path.write_bytes(DESC + packet(event(100, 1, name="a")) + packet(event(200, 2)))
    db = engines.open(str(path), engine="embedded")
    with pytest.raises(engines.QueryError, match="integer overflow"):
        db.query("select abs(column1) from (values (1), (-9223372036854775808))")
    db.close()


def test_summary_cli_reports_unwritable_outputs_in_one_line(tmp_path):
    path = tmp_path / "t.pftrace"
    path.write_bytes(DESC + packet(event(100, 1, name="a")) + packet(event(200, 2)))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    src = os.path.join(os.path.dirname(__file__), "..", "..", "..", "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    for extra in (["--cntk", str(blocker)], ["-o", str(tmp_path / "missing" / "x.txt")]):
        out = subprocess.run([sys.executable, "-m", "stepscope.cli", "summary", str(path),
                              "--engine", "embedded", *extra], capture_output=True, text=True,
                             env=env)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert "cannot write" in out.stderr


def test_a_missing_file_is_refused_before_any_download(tmp_path, monkeypatch):
    def no_download(timeout=None):
        raise AssertionError("downloaded")

    monkeypatch.setattr(engines, "download_trace_processor", no_download)
    with pytest.raises(Exception, match="no such file"):
        engines.open(str(tmp_path / "nope.pftrace"), engine="trace_processor")


def test_very_long_names_are_cut_on_a_character_boundary(tmp_path):
    long = "€" * 3000  # 9000 bytes of 3-byte characters, over the 8 KiB cell limit
    path = tmp_path / "t.pftrace"
    path.write_bytes(DESC + packet(event(100, 1, name=long)) + packet(event(200, 2)))
    ((ts, dur, name),) = slices(path)
    assert name == "€" * (si.MAX_TEXT // 3)


@pytest.mark.parametrize("layout, want", [
    # snapshot 1: BOOTTIME - MONOTONIC = 1000; snapshot 2 (MONOTONIC 2000 on): 3000
    ("s1 b s2 e", (3500, 2100)),  # b sees s1 only: 2500 + 1000; e: 2600 + 3000
    ("s1 b e s2", (3500, 100)),  # s2 comes after both: never theirs
    ("b s1 e", (3500, 100)),  # b, before any snapshot, is retried at the end: s1 then
    ("b s1 s2 e", (5500, 100)),  # ... and then every snapshot counts: 2500 is s2's
])
def test_clock_hops_use_the_snapshots_read_before_the_packet(tmp_path, layout, want):
    """As trace processor (v58.2 gives these four results): timestamps are converted as the
    packets are read, with the snapshots read so far; a packet that cannot be converted yet is
    deferred to the end of the trace."""
    def snapshot(clocks):
        return packet(w.f_bytes(w.PKT_CLOCK_SNAPSHOT, b"".join(
            w.f_bytes(w.CS_CLOCKS, w.f_varint(w.CLK_ID, c) + w.f_varint(w.CLK_TIMESTAMP, t))
            for c, t in clocks.items())))

    def mono_event(ts, kind):
        return packet(w.f_varint(w.PKT_TIMESTAMP, ts) + w.f_varint(w.DEF_TIMESTAMP_CLOCK_ID, 3)
                      + w.f_varint(w.PKT_SEQUENCE_ID, 1)
                      + w.f_bytes(w.PKT_TRACK_EVENT, w.f_varint(w.TE_TYPE, kind)
                                  + w.f_varint(w.TE_TRACK_UUID, TRACK) + w.f_str(w.TE_NAME, "a")))

    parts = {"s1": snapshot({6: 1000, 3: 0}), "s2": snapshot({6: 5000, 3: 2000}),
             "b": mono_event(2500, 1), "e": mono_event(2600, 2)}
    path = tmp_path / "t.pftrace"
    path.write_bytes(DESC + b"".join(parts[k] for k in layout.split()))
    assert slices(path) == [(*want, "a")]


def test_a_compressed_batch_of_garbage_loses_only_itself(tmp_path):
    import zlib

    def batch(raw: bytes) -> bytes:
        return packet(w.f_bytes(w.PKT_COMPRESSED_PACKETS, zlib.compress(raw)))

    path = tmp_path / "t.pftrace"
    path.write_bytes(DESC + batch(packet(event(100, 1, name="a")) + packet(event(200, 2)))
                     + batch(b"\xff" * 40)  # inflates fine, but to no packets at all
                     + batch(packet(event(300, 1, name="b")) + packet(event(350, 2))))
    conn, stats = analysis.load(str(path))
    assert conn.execute("select ts, dur, name from slice order by ts").fetchall() == [
        (100, 100, "a"), (300, 50, "b")]
    assert stats["corrupt_compressed_batches"] == 1
