"""Stub of ``stepscope.analysis.tp._decodeloops`` (``_decodeloops.c``): the decoder's sequential
loops in C. Optional: ``tp.loops.native`` is this module or None, and each function has a numpy
twin (named in its docstring) giving the same results. Arrays are C-contiguous int64 unless
said; outputs are written in place."""

import numpy as np

def split_repeated(buf: np.ndarray, start: int, end: int, tag: int,
                   /) -> tuple[bytes, bytes, int]:
    """(payload starts, payload ends as native int64 bytes, stop) of the items of one repeated
    length-delimited field in ``buf[start:end]`` (twin: ``protoscan.split_repeated``)."""

def nest(typ: np.ndarray, track: np.ndarray, ts: np.ndarray, begin: int, end: int,
         instant: int, out_slice: np.ndarray, dur: np.ndarray, depth: np.ndarray,
         parent: np.ndarray, top: np.ndarray, /) -> int:
    """Slices from begin / end / instant events in time order (typ int8, track int32); returns
    the number of ends with nothing open (twin: ``decode._build_slices``'s numpy passes)."""

def last_owner(owner_gen: np.ndarray, owner_pkt: np.ndarray, last: np.ndarray,
               gen: np.ndarray, pkt: np.ndarray, out: np.ndarray, /) -> None:
    """The last owner of the same generation at or before each query packet; ValueError when
    owners or queries are not in packet order (twin: ``state.lookup_last``)."""

def packet_clocks(owner_gen: np.ndarray, owner_pkt: np.ndarray, last: np.ndarray,
                  owner_clock: np.ndarray, gen: np.ndarray, srank: np.ndarray,
                  clock: np.ndarray, /) -> None:
    """Each packet's clock key, in place in ``clock`` (twin: ``state._packet_clocks``)."""

def generations(srank: np.ndarray, flags: np.ndarray, scratch: np.ndarray, gen: np.ndarray,
                /) -> None:
    """Each packet's generation id into ``gen`` (flags int8; scratch: 2 per sequence); ValueError
    for sequence ranks out of range (twin: ``state.generations``)."""

def groups(buf: np.ndarray, start: np.ndarray, length: np.ndarray, inv: np.ndarray,
           /) -> bytes:
    """Groups of equal byte strings ``buf[start:start + length]``: ``inv`` gets each one's group,
    the result (native int64 bytes) each group's first (twin: ``packets._body_groups``)."""

