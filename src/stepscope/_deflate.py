"""Compression of trace data into zlib streams (the ``compressed_packets`` batches of a file).

Compression is most of what a summary file costs the program once its events are encoded:
zlib's fastest level takes about 1.4 ms a second for a small CPU training step (142 KB of
packets), a tenth of the summary level's whole budget. ISA-L's deflate (the ``isal`` package,
a dependency on the platforms it has wheels for; crossing into C at the import below) writes the
same format about five times faster, its level 1 at about 95 % of zlib's ratio on stepscope's
packets. Where ``isal`` cannot be imported, the standard library's zlib does it all.

The one catch is the reader's bound on a batch (``_inflate.BATCH_RATIO``, what tells a
decompression bomb from a trace): zlib's level 1 never passes about 230x, ISA-L's level 1
reaches 1000x on runs with a period of at most 4 bytes (a megabyte string arg of one letter).
A batch ISA-L squeezes past the bound is compressed again by zlib, so every batch stepscope
writes reads back whole, here and in trace processor.
"""

from __future__ import annotations

import zlib

from ._inflate import BATCH_RATIO

try:
    from isal.isal_zlib import compress as _isal_compress  # C (ISA-L), releases the GIL
except ImportError:  # no wheel for this platform: the standard library alone
    _isal_compress = None

BACKEND = "isal" if _isal_compress is not None else "zlib"
LEVEL = 1  # the fastest of both that still finds repeats across packets

# a batch compressed at most this many times (a margin under the reader's BATCH_RATIO)
MAX_RATIO = BATCH_RATIO * 7 // 8


def compress(raw: bytes | bytearray | memoryview) -> bytes:
    """``raw`` as one zlib stream (RFC 1950) that ``_inflate.inflate`` accepts whole."""
    if _isal_compress is not None:
        data = _isal_compress(raw, LEVEL)
        if len(raw) <= MAX_RATIO * len(data):
            return data
    return zlib.compress(raw, LEVEL)
