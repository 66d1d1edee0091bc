"""Real decompression bombs, small on disk, built in milliseconds: deflate of a long run of
one block is periodic after a full flush, so the block's compressed form is repeated."""

from __future__ import annotations

import os
import struct
import zlib

import stepscope
from stepscope.core import session as _session
from stepscope.format import wire as w

MiB = 1 << 20


def _deflate_repeated(block: bytes, times: int) -> bytes:
    """Raw deflate (level 9) of ``block * times``."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    one = c.compress(block) + c.flush(zlib.Z_FULL_FLUSH)
    again = c.compress(block) + c.flush(zlib.Z_FULL_FLUSH)
    assert one == again  # the window was reset: every block compresses alike
    return one * times + c.flush()


def zlib_repeated(block: bytes, times: int) -> bytes:
    """A zlib stream of ``block * times`` (what compressed_packets holds)."""
    if not block.strip(b"\0"):  # zeros: a stays 1, b grows by 1 a byte
        a, b = 1, (len(block) * times) % 65521
    else:
        a, b = 1, 0
        for _ in range(times):  # adler32 of block*times, without building it
            a, b = _adler_extend(a, b, block)
    return b"\x78\xda" + _deflate_repeated(block, times) + struct.pack(">I", (b << 16) | a)


def _adler_extend(a: int, b: int, data: bytes) -> tuple[int, int]:
    v = zlib.adler32(data, (b << 16) | a)
    return v & 0xFFFF, v >> 16


def gzip_repeated(block: bytes, times: int) -> bytes:
    crc = 0
    for _ in range(times):
        crc = zlib.crc32(block, crc)
    head = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    return head + _deflate_repeated(block, times) + struct.pack(
        "<II", crc, (len(block) * times) & 0xFFFFFFFF)


def packet_bomb(size: int = 1 << 30) -> bytes:
    """A batch holding one packet of about ``size`` zero bytes: it starts like packets do."""
    head = b"\x0a" + w.varint(size - 6)
    block = head + bytes(MiB - len(head))
    c = zlib.compressobj(9)
    z = bytes(MiB)
    first = c.compress(block) + c.flush(zlib.Z_FULL_FLUSH)
    one = c.compress(z) + c.flush(zlib.Z_FULL_FLUSH)
    again = c.compress(z) + c.flush(zlib.Z_FULL_FLUSH)
    assert one == again  # the window was reset: every block compresses alike
    end = c.flush()
    ad = zlib.adler32(block)
    a, b = ad & 0xFFFF, ad >> 16
    b = (b + a * (size - MiB)) % 65521  # zeros: a stays, b grows by a a byte
    body = first + one * (size // MiB - 1) + end[:-4] + struct.pack(">I", (b << 16) | a)
    return batch_packet(body)


def batch_packet(zdata: bytes) -> bytes:
    """One Trace.packet holding one compressed_packets batch."""
    body = w.f_bytes(w.PKT_COMPRESSED_PACKETS, zdata)
    return w.tag(1, w.LEN) + w.varint(len(body)) + body


def zeros_batch(size: int = 1 << 30) -> bytes:
    """A batch of ``size`` zero bytes (1 GiB: about 1 MB)."""
    return batch_packet(zlib_repeated(bytes(MiB), size // MiB))


def tiny_packets_batch(size: int = 256 * MiB) -> bytes:
    """A batch of empty packets (``0A 00``), ``size`` bytes of them (256 MiB: about 260 KB)."""
    return batch_packet(zlib_repeated(b"\x0a\x00" * (MiB // 2), size // MiB))


def good_trace_around(path: str, bomb: bytes, before: int = 100, after: int = 50) -> None:
    """A real trace with ``before`` ranges, ``bomb`` between its batches, ``after`` ranges."""
    tmp = path + ".good"
    sess = _session.Session(tmp, flush_interval_s=60)
    sess.start()
    for i in range(before):
        with stepscope.annotate("before", step=i):
            pass
    sess.flush()
    cut = os.path.getsize(tmp)
    for i in range(after):
        with stepscope.annotate("after", step=i):
            pass
    sess.stop()
    with open(tmp, "rb") as f:
        data = f.read()
    os.remove(tmp)
    with open(path, "wb") as f:
        f.write(data[:cut] + bomb + data[cut:])
