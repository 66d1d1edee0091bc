"""Bounded inflation of compressed trace data (zlib ``compressed_packets`` batches, gzip files).

A decompression bomb (a 1 MB batch of 1 GiB of zeros, a small file of millions of empty
packets) is skipped and counted, never inflated whole. The bounds are relative to what a real
trace holds:

* one batch: at most ``BATCH_RATIO`` times its compressed size (+ 1 MiB). stepscope writes
  none past 224x (``_deflate``: zlib's level 1 cannot pass about 230x, all zeros; a batch
  ISA-L compresses further is compressed by zlib); its most regular output (a counter at
  exact intervals) reaches 172x with zlib, ordinary traces 4-10x. Bombs made at higher levels
  reach 1030x.
* one load (all files read together, or one file merged): at most ``TOTAL_RATIO`` times the
  input bytes (+ 64 MiB) inflated in all, and ``PACKETS_PER_BYTE`` packets per input byte
  (+ 1M): each packet costs its reader about 50 bytes of columns, so tiny packets, not bytes,
  are what a small file can blow up with. Real traces hold under one packet per file byte.
"""

from __future__ import annotations

import zlib

BATCH_RATIO, BATCH_FLOOR = 256, 1 << 20
TOTAL_RATIO, TOTAL_FLOOR = 64, 64 << 20
PACKETS_PER_BYTE, PACKETS_FLOOR = 16, 1 << 20

OK, CORRUPT, OVER = "ok", "corrupt", "over"


class TraceDamageWarning(UserWarning):
    """Parts of a trace were skipped (damaged, or over the inflation limits); the rest is read.
    The ``stepscope`` command prints it as one ``stepscope: ...`` line on stderr."""


class Budget:
    """What a load may still inflate (bytes) and decode (packets)."""

    def __init__(self, input_bytes: int) -> None:
        self.bytes = TOTAL_RATIO * input_bytes + TOTAL_FLOOR
        self.packets = PACKETS_PER_BYTE * input_bytes + PACKETS_FLOOR

    def batch_limit(self, compressed: int) -> int:
        return max(0, min(BATCH_RATIO * compressed + BATCH_FLOOR, self.bytes))


_STEP = 16 << 20  # inflated at most this much at a time (a bomb is given up at the limit)


def inflate(data: bytes | memoryview, limit: int, wbits: int = zlib.MAX_WBITS,
            first: int | None = None) -> tuple[bytes | bytearray | None, str]:
    """``data`` inflated if it holds at most ``limit`` bytes: (bytes, OK); else (None, OVER)
    with at most ``limit`` bytes ever held, or (None, CORRUPT) for a damaged or cut stream, or
    one whose first byte is not ``first`` (a batch of packets starts 0x0A: a run of zeros is
    refused after a few bytes, not after ``limit``). ``wbits=31``: gzip (every member)."""
    parts: list[bytes] = []
    size = 0
    rest = data
    d = zlib.decompressobj(wbits)
    try:
        if first is not None:
            probe = d.copy().decompress(data, 1)
            if probe and probe[0] != first:
                return None, CORRUPT
        while True:
            chunk = d.decompress(rest, min(_STEP, limit + 1 - size))  # never 0: no limit
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                return None, OVER
            if d.eof:
                rest = d.unused_data
                if wbits != 31 or not rest.strip(b"\0"):  # gzip: another member may follow
                    break
                d = zlib.decompressobj(wbits)
                continue
            rest = d.unconsumed_tail
            if not chunk and not rest:
                return None, CORRUPT  # cut short
    except zlib.error:
        return None, CORRUPT
    if len(parts) == 1:  # the common case: no copy
        return parts[0], OK
    out = bytearray()  # grown in place: no second copy of everything at the end
    for part in parts:
        out += part
    return out, OK
