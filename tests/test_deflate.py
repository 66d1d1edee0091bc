"""The files' compression (``stepscope._deflate``): ISA-L where it is installed, zlib
otherwise; every batch either writes comes back whole through the reader's bomb bounds."""

from __future__ import annotations

import zlib

import pytest

import stepscope
from perfetto_decode import decode
from stepscope import _deflate, _inflate

BACKENDS = ["isal", "zlib"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    if request.param == "isal":
        if _deflate.BACKEND != "isal":
            pytest.skip("isal is not installed here")
    else:
        monkeypatch.setattr(_deflate, "_isal_compress", None)
    return request.param


def _read_back(data: bytes) -> tuple[object, str]:
    return _inflate.inflate(data, _inflate.Budget(len(data)).batch_limit(len(data)))


@pytest.mark.parametrize("period", [1, 3, 13, 4096])
def test_every_batch_reads_back_whole_however_regular(backend, period):
    """Runs of period <= 4 are where ISA-L's level 1 passes the reader's bound (1000x): zlib
    writes those; 13 bytes (an end packet) and 4 KiB (a capped string arg) stay ISA-L's."""
    unit = bytes((7 * i + 1) % 251 for i in range(period))
    raw = unit * ((8 << 20) // period)
    data = _deflate.compress(raw)
    out, status = _read_back(data)
    assert status == _inflate.OK and out == raw
    if backend == "zlib" or period <= 3:
        assert data == zlib.compress(raw, 1)
    else:
        from isal import isal_zlib

        assert data == isal_zlib.compress(raw, 1)
        assert len(raw) <= _deflate.MAX_RATIO * len(data)


def test_isal_alone_would_write_batches_the_reader_takes_for_bombs():
    """Why the fallback exists: ISA-L's own stream of 8 MiB of zeros is refused."""
    if _deflate.BACKEND != "isal":
        pytest.skip("isal is not installed here")
    from isal import isal_zlib

    raw = bytes(8 << 20)
    data = isal_zlib.compress(raw, 1)
    assert len(raw) > _inflate.BATCH_RATIO * len(data)
    assert _read_back(data) == (None, _inflate.OVER)
    assert _read_back(_deflate.compress(raw))[1] == _inflate.OK


def test_a_compressed_trace_reads_the_same_with_either_backend(backend, tmp_path):
    path = tmp_path / "t.pftrace"
    with stepscope.trace(path, compress=True):
        for i in range(300):
            with stepscope.annotate("step", n=i):
                stepscope.mark("tick")
    d = decode(str(path))
    assert [e.name for e in d.events if e.type == "B"] == ["step"] * 300
    assert len([e for e in d.events if e.name == "tick"]) == 300
    assert sorted(a for e in d.events if e.type == "B" for a in e.args.values()) == list(
        range(300))
