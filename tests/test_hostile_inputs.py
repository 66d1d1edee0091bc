"""Hostile and damaged inputs: decompression bombs stay bounded, damaged batches are skipped
and reported, a stream with no end is refused, and merge never leaves partial outputs."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import random
import subprocess
import sys
import threading
import time
import zlib

import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

import bombs
from stepscope import _deflate, _inflate, analysis
from stepscope.analysis import TraceDamageWarning, TraceError
from stepscope.analysis import merge as M
from stepscope.analysis.tp import packets
from stepscope.format import wire as w

SRC = os.path.join(os.path.dirname(__file__), "..", "src")
MiB = 1 << 20

# loads one file in a fresh process, memory capped (a regression fails, it does not swap the
# machine): prints the slices per name, the warnings, and the process's peak RSS
_LOAD = r"""
import json, resource, sys, time, warnings
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import stepscope.analysis as sa
t = time.monotonic()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        with sa.open(sys.argv[1], engine="embedded") as db:
            names = {r["name"]: r["n"] for r in db.query(
                "select name, count(*) n from slice group by name")}
    except Exception as e:
        names = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps({"names": names, "warnings": [str(x.message) for x in caught],
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "s": time.monotonic() - t}))
"""


def load_in_child(path) -> dict:
    r = subprocess.run([sys.executable, "-c", _LOAD, str(path)], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=SRC))
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def payload_bytes(data: bytes) -> int:
    """Compressed bytes of the compressed_packets batches in ``data`` (official schema)."""
    t = pb.Trace.FromString(data)
    return sum(len(p.compressed_packets) for p in t.packet if p.HasField("compressed_packets"))


BOMB_BYTES: dict[str, int] = {}  # bomb -> compressed bytes of its batches


@pytest.fixture(scope="module")
def bomb_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bombs")
    zeros = bombs.zeros_batch()  # 1 GiB of zeros, ~1 MB
    made = {
        "zeros1": zeros,
        "zeros4": zeros * 4,
        "packet": bombs.packet_bomb(),  # one packet of 1 GiB
        "tiny": bombs.tiny_packets_batch(),  # 128M empty packets in 260 KB
        # empty packets at zlib level 1 (229x: within the per-batch ratio), 10M of them in
        # 92 KB: over the packet budget
        "tiny1": bombs.batch_packet(zlib.compress(b"\x0a\x00" * (10 * MiB // 2 * 2), 1)),
    }
    bombs.good_trace_around(str(d / "good.pftrace"), b"")
    for name, bomb in made.items():
        bombs.good_trace_around(str(d / f"{name}.pftrace"), bomb)
        BOMB_BYTES[name] = payload_bytes(bomb)
    (d / "gzip.pftrace.gz").write_bytes(bombs.gzip_repeated(bytes(MiB), 256))
    return d


@pytest.fixture(scope="module")
def base(bomb_dir):
    """The good trace, loaded alike: the memory a load takes anyway."""
    r = load_in_child(bomb_dir / "good.pftrace")
    assert r["names"] == {"before": 100, "after": 50} and r["warnings"] == []
    return r


def test_a_real_trace_is_far_inside_the_bounds():
    """The writer's most regular output (a counter at exact intervals, zlib level 1) reaches
    172x; zlib level 1 cannot pass ~230x, and the writer's compressor gives zlib what ISA-L
    squeezes further (``_deflate``): every batch the writer makes is inside BATCH_RATIO."""
    for worst in (zlib.compress(bytes(8 * MiB), 1), _deflate.compress(bytes(8 * MiB))):
        assert 8 * MiB / len(worst) < _inflate.BATCH_RATIO


@pytest.mark.parametrize("name, over, corrupt", [
    ("zeros1", 0, 1), ("zeros4", 0, 4), ("packet", 1, 0), ("tiny", 1, 0), ("tiny1", 1, 0)])
def test_bombs_are_skipped_with_bounded_memory_and_the_events_around_them_kept(
        bomb_dir, base, name, over, corrupt):
    r = load_in_child(bomb_dir / f"{name}.pftrace")
    assert r["names"] == {"before": 100, "after": 50}
    bad = BOMB_BYTES[name]
    parts = []
    if corrupt:
        parts.append(f"{corrupt} damaged compressed batch{'es' if corrupt > 1 else ''} "
                     f"({bad} bytes)")
    if over:
        parts.append(f"{over} compressed batch ({bad} bytes) over the inflation limits "
                     "(a decompression bomb?)")
    path = str(bomb_dir / f"{name}.pftrace")
    assert r["warnings"] == [f"{path}: skipped {'; '.join(parts)}; the rest is loaded"]
    # before: 4.1-7.1 GB; a bomb may cost what a batch may inflate to (~256x), not more
    assert r["rss_mb"] < base["rss_mb"] + 400, (name, r, base)


def test_a_gzip_bomb_is_refused_with_bounded_memory(bomb_dir, base):
    path = bomb_dir / "gzip.pftrace.gz"
    r = load_in_child(path)
    cap = _inflate.TOTAL_RATIO * path.stat().st_size + _inflate.TOTAL_FLOOR
    assert r["names"] == {"error": f"TraceError: {path}: gzip data inflates to more than "
                          f"{cap >> 20} MiB ({_inflate.TOTAL_RATIO}x its {path.stat().st_size}"
                          f" bytes + 64 MiB): not a trace, a decompression bomb"}
    assert r["rss_mb"] < base["rss_mb"] + 2.5 * cap / MiB  # before: 2.1 GB


def test_a_gzipped_trace_still_loads(bomb_dir, tmp_path):
    path = tmp_path / "t.pftrace.gz"
    path.write_bytes(gzip.compress((bomb_dir / "good.pftrace").read_bytes()))
    conn, _ = analysis.load(str(path))
    assert conn.execute("select count(*) from slice").fetchone() == (150,)


def test_merge_skips_a_bomb_quickly(bomb_dir, tmp_path):
    """Zeros (refused by their first byte) and a 1 GiB packet that starts like one (0x0A: given
    up at the inflation limit, 257 MiB) and 128M tiny packets: skipped in seconds."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank0.summary.pftrace").write_bytes((bomb_dir / "good.pftrace").read_bytes())
    (run / "rank1.summary.pftrace").write_bytes(b"".join(
        (bomb_dir / f"{n}.pftrace").read_bytes() for n in ("zeros4", "packet", "tiny")))
    out = tmp_path / "m.pftrace"
    t0 = time.monotonic()
    with pytest.warns(TraceDamageWarning) as caught:
        res = M.merge([run], out)
    took = time.monotonic() - t0
    zeros, over = BOMB_BYTES["zeros4"], BOMB_BYTES["packet"] + BOMB_BYTES["tiny"]
    assert [str(c.message) for c in caught] == [
        f"{run / 'rank1.summary.pftrace'}: skipped 4 damaged compressed batches ({zeros} bytes)"
        f"; 2 compressed batches ({over} bytes) over the inflation limits (a decompression "
        "bomb?); the rest is merged"]
    assert res.skipped["corrupt_compressed_batches"] == 4
    assert took < 15.0, took  # inflating the bombs whole: 1.5 GiB, and the memory with it
    conn, _ = analysis.load(str(out))
    assert conn.execute("select count(*) from slice").fetchone() == (150 * 4,)


# -- damaged batches: reported ------------------------------------------------------------------
def _flip_in_batch(src, dst, batch: int) -> int:
    """Copy with one byte flipped in the middle of compressed batch ``batch``; its length."""
    data = bytearray(open(src, "rb").read())
    t = pb.Trace.FromString(bytes(data))
    payload = [p.compressed_packets for p in t.packet if p.HasField("compressed_packets")][batch]
    at = bytes(data).index(payload) + len(payload) // 2
    data[at] ^= 0xFF
    open(dst, "wb").write(data)
    return len(payload)


def _cli(*args, path: str = SRC) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stepscope.cli", *args], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=path))


def test_a_flipped_byte_is_reported_by_summary_sql_and_open(bomb_dir, tmp_path):
    path = tmp_path / "d.pftrace"
    n = _flip_in_batch(bomb_dir / "good.pftrace", path, 2)  # the "after" batch (0: tracks)
    line = f"stepscope: {path}: skipped 1 damaged compressed batch ({n} bytes); the rest is loaded"
    r = _cli("summary", str(path), "--engine", "embedded")
    assert r.returncode == 0 and line in r.stderr.splitlines()
    r = _cli("sql", str(path), "select count(*) as n from slice", "--engine", "embedded")
    assert r.returncode == 0 and line in r.stderr.splitlines()
    assert r.stdout.split() == ["n", "---", "100", "(1", "row)"]
    with pytest.warns(TraceDamageWarning, match=f"skipped 1 damaged compressed batch .{n} "):
        conn, _ = analysis.load(str(path))
    assert conn.execute("select count(*) from slice").fetchone() == (100,)


def test_a_file_with_nothing_readable_is_an_error(bomb_dir, tmp_path):
    path = tmp_path / "d.pftrace"
    n = _flip_in_batch(bomb_dir / "good.pftrace", path, 1)  # interning, clocks: all lost
    r = _cli("summary", str(path), "--engine", "embedded")
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [
        f"stepscope summary: error: cannot read {path}: nothing readable: 1 damaged "
        f"compressed batch ({n} bytes)"]
    assert "No events" not in r.stdout
    with pytest.raises(TraceError, match="nothing readable"):
        analysis.load(str(path))


# -- bounded reads ------------------------------------------------------------------------------
def test_a_pipe_past_the_limit_is_refused(monkeypatch):
    """A stream that starts like a trace and does not end: read up to the limit only."""
    monkeypatch.setattr(packets, "NONREGULAR_MAX", 4 * MiB)
    r, wfd = os.pipe()
    stop = threading.Event()

    def feed():
        with os.fdopen(wfd, "wb") as f:
            with contextlib.suppress(BrokenPipeError):
                f.write(b"\x0a\x00")
                while not stop.is_set():
                    f.write(bytes(MiB))

    t = threading.Thread(target=feed)
    t.start()
    try:
        with pytest.raises(TraceError) as e:
            packets.read_file(f"/dev/fd/{r}")
    finally:
        stop.set()
        os.close(r)
        t.join()
    assert str(e.value) == (f"/dev/fd/{r}: not a regular file and longer than 4 MiB, the "
                            "most stepscope reads from a pipe or device; save it to a file "
                            "first")


def test_a_pipe_under_the_limit_still_loads(bomb_dir):
    data = (bomb_dir / "good.pftrace").read_bytes()
    r, wfd = os.pipe()

    def feed():
        with os.fdopen(wfd, "wb") as f:
            f.write(data)

    t = threading.Thread(target=feed)
    t.start()
    try:
        assert packets.read_file(f"/dev/fd/{r}") == data
    finally:
        t.join()
        os.close(r)


def test_summary_of_dev_zero_is_one_line_error():
    r = _cli("summary", "/dev/zero", "--engine", "embedded")
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [
        "stepscope summary: error: cannot read /dev/zero: not a Perfetto protobuf trace "
        "(starts with byte 0x00, not a packet)"]


# -- merge: damaged rank files, outputs ---------------------------------------------------------
@pytest.fixture
def run_dir(bomb_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank0.summary.pftrace").write_bytes((bomb_dir / "good.pftrace").read_bytes())
    n = _flip_in_batch(bomb_dir / "good.pftrace", run / "rank1.summary.pftrace", 2)
    return run, n


def test_merge_skips_a_damaged_batch_and_merges_the_rest(run_dir, tmp_path):
    run, n = run_dir
    out = tmp_path / "m.pftrace"
    r = _cli("merge", str(run), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [f"stepscope: {run / 'rank1.summary.pftrace'}: skipped 1 "
                                     f"damaged compressed batch ({n} bytes); the rest is merged"]
    conn, _ = analysis.load(str(out))
    assert conn.execute("select count(*) from slice").fetchone() == (150 + 100,)
    assert sorted(os.listdir(tmp_path)) == ["m.pftrace", "run"]


def test_merge_refuses_a_directory_or_an_input_as_output(run_dir, tmp_path):
    run, _ = run_dir
    before = sorted(os.listdir(tmp_path)), sorted(os.listdir(run))
    r = _cli("merge", str(run), "-o", str(run))
    assert r.returncode == 2
    assert r.stderr.strip() == (f"stepscope merge: -o {run}: is a directory; name the merged "
                                ".pftrace file to write")
    target = run / "rank0.summary.pftrace"
    data = target.read_bytes()
    r = _cli("merge", str(run), "-o", str(target))
    assert r.returncode == 2
    assert r.stderr.strip() == (f"stepscope merge: -o {target}: is one of the inputs; name a "
                                "new file")
    assert (sorted(os.listdir(tmp_path)), sorted(os.listdir(run))) == before
    assert target.read_bytes() == data


def test_a_failed_merge_leaves_nothing_behind(run_dir, tmp_path, monkeypatch):
    run, _ = run_dir
    calls = []

    def interrupted(self, pkt):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return self.packet(pkt)

    monkeypatch.setattr(M._Rewriter, "rewrite", interrupted)
    with pytest.raises(KeyboardInterrupt):
        M.merge([run], tmp_path / "m.pftrace")
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_merge_of_nothing_readable_is_an_error_and_writes_nothing(bomb_dir, tmp_path):
    bad = tmp_path / "rank0.summary.pftrace"
    bad.write_bytes(bombs.zeros_batch(64 * MiB))
    with pytest.raises(ValueError, match="nothing readable in .*: 1 damaged compressed batch"):
        M.merge([bad], tmp_path / "m.pftrace")
    assert sorted(os.listdir(tmp_path)) == ["rank0.summary.pftrace"]


def test_inflate_bounds_hold_exactly():
    raw = b"\x0a\x01\x00" * 1000
    z = zlib.compress(raw)
    assert _inflate.inflate(z, len(raw)) == (bytearray(raw), _inflate.OK)
    assert _inflate.inflate(z, len(raw) - 1) == (None, _inflate.OVER)
    assert _inflate.inflate(z[:-6], 10 * len(raw)) == (None, _inflate.CORRUPT)
    assert _inflate.inflate(zlib.compress(bytes(100)), 1000, first=0x0A) == (None,
                                                                               _inflate.CORRUPT)
    two = gzip.compress(raw) + gzip.compress(raw)
    assert _inflate.inflate(two, 2 * len(raw), wbits=31) == (bytearray(raw * 2), _inflate.OK)
    assert w.PKT_COMPRESSED_PACKETS == 50


def _cut_in_after_batch(src, dst, into: int = 40, batch: bytes = b"after") -> None:
    """Copy of ``src`` cut ``into`` bytes into the packet holding the compressed batch of the
    ``batch`` ranges (as a writer killed mid-write leaves it; b"": the first batch)."""
    good = open(src, "rb").read()
    packets = pb.Trace.FromString(good).packet
    last = next(i for i, p in enumerate(packets) if p.HasField("compressed_packets")
                and batch in zlib.decompress(p.compressed_packets))
    whole = sum(len(w.tag(1, 2)) + len(w.varint(len(b))) + len(b)
                for b in (p.SerializeToString() for p in packets[:last]))
    open(dst, "wb").write(good[:whole + into])


def test_a_file_cut_inside_its_last_packet_says_so(bomb_dir, tmp_path):
    # a run killed while writing: the last batch (the "after" ranges) is cut short; loading
    # what is whole is right, but silently losing the batch's events hid that a third of the
    # run was missing (a killed PyTorch run's trace: 30 of its 48 steps, not a word)
    path = tmp_path / "cut.pftrace"
    _cut_in_after_batch(bomb_dir / "good.pftrace", path)
    line = (f"stepscope: {path}: skipped 1 cut-short last packet (40 bytes: the file ends "
            "inside it); the rest is loaded")
    r = _cli("summary", str(path), "--engine", "embedded")
    assert r.returncode == 0 and line in r.stderr.splitlines(), r.stderr
    r = _cli("sql", str(path), "select count(*) as n from slice", "--engine", "embedded")
    assert r.returncode == 0 and line in r.stderr.splitlines()
    assert r.stdout.split() == ["n", "---", "100", "(1", "row)"]  # the 50 "after" ranges lost
    with pytest.warns(TraceDamageWarning, match="skipped 1 cut-short last packet .40 bytes"):
        analysis.load(str(path))


def test_a_file_cut_before_its_first_event_is_an_error_on_either_engine(bomb_dir, tmp_path):
    """Cut inside its first compressed batch: nothing readable. Trace processor loads what
    it can without a word: the summary said "No events to summarize", exit 0, where the
    embedded engine said what was lost. Now both do (trace processor here: the stand-in,
    which loads nothing it cannot read, as trace processor does; the real one too where
    STEPSCOPE_TRACE_PROCESSOR names it)."""
    path = tmp_path / "cut.pftrace"
    _cut_in_after_batch(bomb_dir / "good.pftrace", path, batch=b"")
    line = (f"stepscope summary: error: cannot read {path}: nothing readable: 1 cut-short "
            "last packet (40 bytes: the file ends inside it)")
    fake = os.path.join(os.path.dirname(__file__), "analysis", "fake_tp",
                        "trace_processor_shell")
    bins = [fake] + [b for b in (os.environ.get("STEPSCOPE_TRACE_PROCESSOR"),) if b]
    runs = [("--engine", "embedded")] + [("--engine", "trace_processor",
                                          "--trace-processor-bin", b) for b in bins]
    here = os.pathsep.join([SRC, *[p for p in sys.path if p]])  # (the stand-in's imports)
    for args in runs:
        r = _cli("summary", str(path), *args, path=here)
        assert (r.returncode, r.stderr.splitlines()) == (2, [line]), (args, r.stdout, r.stderr)


def test_merge_says_when_a_rank_file_ends_inside_a_packet(bomb_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank0.summary.pftrace").write_bytes((bomb_dir / "good.pftrace").read_bytes())
    _cut_in_after_batch(bomb_dir / "good.pftrace", run / "rank1.summary.pftrace")
    out = tmp_path / "m.pftrace"
    r = _cli("merge", str(run), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [
        f"stepscope: {run / 'rank1.summary.pftrace'}: skipped 1 cut-short last packet (40 "
        "bytes: the file ends inside it); the rest is merged"]
    conn, _ = analysis.load(str(out))
    assert conn.execute("select count(*) from slice").fetchone() == (150 + 100,)


def test_an_empty_file_is_an_error_for_every_command_and_writes_nothing(tmp_path):
    """A trace file of 0 bytes (a run that ended before its first flush): one line, exit 2,
    nothing written, for summary (each engine), sql, export-csv and merge. Before: "No events
    to summarize" with exit 0, ten empty CSV files, a merge of 0 bytes ("ranks [None]")."""
    empty = tmp_path / "e.pftrace"
    empty.write_bytes(b"")
    line = f"{empty}: empty (0 bytes): no trace was written to it"
    engines = ["embedded"] + (["trace_processor"] if os.environ.get(
        "STEPSCOPE_TRACE_PROCESSOR") else [])
    runs = [("summary", str(empty), "--engine", e) for e in engines] + [
        ("sql", str(empty), "SELECT 1"), ("export-csv", str(empty), "-o", str(tmp_path / "c")),
        ("merge", str(empty), "-o", str(tmp_path / "m.pftrace"))]
    for args in runs:
        r = _cli(*args)
        assert r.returncode == 2 and line in r.stderr and len(r.stderr.splitlines()) == 1, (
            args, r.stderr)
    assert sorted(os.listdir(tmp_path)) == ["e.pftrace"]


def test_merge_of_a_file_with_nothing_readable_says_only_so(tmp_path):
    """A text file given to merge: the error alone (summary's: it is no trace). Before, a
    warning said "the rest is merged" first."""
    text = tmp_path / "t.pftrace"
    text.write_text("not a trace, just text\n")
    r = _cli("merge", str(text), "-o", str(tmp_path / "m.pftrace"))
    (line,) = r.stderr.splitlines()
    assert r.returncode == 2 and line == (f"stepscope merge: {text}: not a Perfetto protobuf "
                                          "trace (no packet at offset 0)")
    assert sorted(os.listdir(tmp_path)) == ["t.pftrace"]


@pytest.mark.parametrize("name, data, why", [
    ("passwd", b"root:x:0:0:root:/root:/bin/bash\n", "no packet at offset 0"),
    ("hello", b"hello", "no packet at offset 0"),
    ("random", b"\x9d" + random.Random(1).randbytes(4095), "no packet at offset 0"),
    ("one_bad_packet", b"\x0a\x05hello", "first packet is corrupt"),
])
def test_merge_refuses_a_file_that_is_not_a_trace_beside_a_good_one(bomb_dir, tmp_path, name,
                                                                      data, why):
    """A file that is no trace, given beside a rank file: merge skipped its bytes as damage
    and wrote the rest, exit 0 ("merged 2 file(s), ranks [0, None]"), where summary refuses
    it. Now merge refuses it as summary does: one line, exit 2, nothing written."""
    good = tmp_path / "good.pftrace"
    good.write_bytes((bomb_dir / "good.pftrace").read_bytes())
    bad = tmp_path / name
    bad.write_bytes(data)
    r = _cli("merge", str(good), str(bad), "-o", str(tmp_path / "m.pftrace"))
    assert (r.returncode, r.stdout, r.stderr) == (
        2, "", f"stepscope merge: {bad}: not a Perfetto protobuf trace ({why})\n")
    assert sorted(os.listdir(tmp_path)) == sorted([good.name, name])
    r = _cli("summary", str(good), str(bad), "--engine", "embedded")
    assert (r.returncode, r.stderr) == (
        2, f"stepscope summary: error: cannot read {bad}: not a Perfetto protobuf trace "
        f"({why})\n")


def test_merge_refuses_a_gzip_file_it_cannot_read(bomb_dir, tmp_path):
    """A gzip-compressed trace (which the loader inflates) was merged as damage, exit 0."""
    good = tmp_path / "rank0.summary.pftrace"
    good.write_bytes((bomb_dir / "good.pftrace").read_bytes())
    gz = tmp_path / "rank1.summary.pftrace.gz"
    gz.write_bytes(gzip.compress(good.read_bytes()))
    r = _cli("merge", str(good), str(gz), "-o", str(tmp_path / "m.pftrace"))
    assert (r.returncode, r.stderr) == (
        2, f"stepscope merge: {gz}: gzip-compressed; merge reads uncompressed traces: gunzip "
        "it first\n")
    assert sorted(os.listdir(tmp_path)) == [good.name, gz.name]
