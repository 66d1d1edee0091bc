"""One output file: its sequences, the tracks it has described, and how bytes reach the disk.

A sink turns per-thread (or per-emitter) batches of events into packets of its own sequences and
hands finished byte strings to the session's I/O thread. Every write ends on a packet boundary,
so the file is a loadable trace after every flush, and after a SIGKILL up to the last one.

A write that fails (disk full, quota) is cut back to the last whole packet, and what could not
be written is dropped and counted like the buffer cap's drops. Batches already encoded after it
lean on its interned names and timestamps, so they are dropped too, and the next flush restarts
every sequence (cleared incremental state, names interned again, tracks described again): the
file stays a valid trace at every moment and takes events again as soon as space returns.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from .. import _clock, _deflate
from ..format import wire as w
from ..record import recorder as rec
from ..record.recorder import (
    BEGIN,
    END,
    NUMBERED_EID,
    NUMBERED_MIN_CODE,
    blobs,
    kinds,
    warn_once,
)
from .encoder import Interner, assemble, blob_templates, numbered_events, packet, track_event

_PREFIX_FLAGS = w.f_varint(w.PKT_SEQUENCE_FLAGS, w.SEQ_NEEDS_INCREMENTAL_STATE)
MAIN_SEQUENCE = 1
COMPRESS_CHUNK = 1 << 20  # raw bytes per compressed_packets batch (one encoded batch may be more)
_BLOB_DEPTH = {BEGIN: 1, END: -1}  # default-track depth change of a blob event, by kind


class SequenceState:
    """Incremental state of one sequence in one file: interning, clock, open slices."""

    __slots__ = ("seq_id", "interner", "last_ts", "depth", "track", "clock_id", "prefix",
                 "templates", "started", "counted", "lost", "phantom")

    def __init__(self, seq_id: int, track: int | None, clock_id: int):
        self.seq_id = seq_id
        self.interner = Interner()
        self.last_ts = 0
        self.depth = 0  # slices open on the default track, as this file has seen them
        # slices open above them whose begins this file never got (a dropped batch's, or
        # written before a restart): the next ends below the batch's level are theirs
        self.phantom = 0
        self.track = track
        self.clock_id = clock_id
        self.prefix = w.f_varint(w.PKT_SEQUENCE_ID, seq_id) + _PREFIX_FLAGS
        self.templates: dict[int, bytes] = {}  # fast event code -> template bytes
        self.started = False
        self.counted = True  # its events count as dropped when a write fails
        self.lost = False  # packets of this sequence were lost: the restart says so

    def restart(self) -> None:
        """Forget the incremental state: the next packet starts the sequence again."""
        self.interner = Interner()
        self.templates = {}
        self.started = False
        # the slices begun before: their ends are left out, not taken for newer slices'
        self.phantom += self.depth
        self.depth = 0
        self.lost = True

    def start_packet(self, t0: int) -> bytes:
        """First packet: clears incremental state, sets defaults, declares clock 64."""
        defaults = w.f_varint(w.DEF_TIMESTAMP_CLOCK_ID, _clock.SEQUENCE_CLOCK)
        if self.track is not None:
            defaults += w.f_bytes(w.DEF_TRACK_EVENT_DEFAULTS,
                                  w.f_varint(w.TED_TRACK_UUID, self.track))
        incremental = (w.f_varint(w.CLK_ID, _clock.SEQUENCE_CLOCK) + w.f_varint(w.CLK_TIMESTAMP, t0)
                       + w.f_bool(w.CLK_IS_INCREMENTAL, True))
        base = w.f_varint(w.CLK_ID, self.clock_id) + w.f_varint(w.CLK_TIMESTAMP, t0)
        clocks = w.f_bytes(w.CS_CLOCKS, incremental) + w.f_bytes(w.CS_CLOCKS, base)
        self.started = True
        self.last_ts = t0
        return packet(
            w.f_varint(w.PKT_SEQUENCE_ID, self.seq_id),
            w.f_varint(w.PKT_SEQUENCE_FLAGS,
                       w.SEQ_INCREMENTAL_STATE_CLEARED | w.SEQ_NEEDS_INCREMENTAL_STATE),
            w.f_bool(w.PKT_PREVIOUS_PACKET_DROPPED if self.lost else w.PKT_FIRST_ON_SEQUENCE,
                     True),
            w.f_bytes(w.PKT_DEFAULTS, defaults),
            w.f_bytes(w.PKT_CLOCK_SNAPSHOT, clocks),
        )

    def fast_template(self, code: int) -> bytes:
        tpl = self.templates.get(code)
        if tpl is None:
            kind, eid = code & 3, code >> 3
            args = kinds[eid].args if eid else None
            if kind == END:  # an end names nothing; its fixed args join the slice's
                eid = 0
            tpl = self.templates[code] = self.prefix + track_event(self.interner, kind, eid,
                                                                   args=args)
        return tpl


def depth_changes(codes: np.ndarray) -> np.ndarray:
    """+1 per begin, -1 per end, 0 otherwise, of events on their thread's default track."""
    is_blob = codes < 0
    kind = np.where(is_blob, -1, codes & 3)
    dd = (kind == BEGIN).astype(np.int64) - (kind == END)
    if is_blob.any():
        bi = np.nonzero(is_blob)[0]
        bl = list(map(blobs.get, (-codes[bi]).tolist()))
        dd[bi] = [_BLOB_DEPTH.get(b.kind, 0) if b is not None and b.track is None else 0
                  for b in bl]
    return dd


def unmatched_ends(dd: np.ndarray, depth0: int) -> tuple[np.ndarray, int]:
    """Which ends (dd == -1) close nothing, given ``depth0`` slices already open.

    ``dd`` is +1 per begin, -1 per end, 0 otherwise on the default track. An end is unmatched
    when the running depth would drop below zero; it is dropped, so the file stays well nested
    (e.g. a range that began before a detail window and ends inside it). Returns the mask of
    dropped ends and the depth after the batch.
    """
    running = depth0 + np.cumsum(dd)
    drops = np.maximum(0, -np.minimum.accumulate(running))
    dropped = np.diff(drops, prepend=0) > 0
    return dropped, int(running[-1] + drops[-1]) if len(dd) else depth0


def _phantom_ends(dd: np.ndarray, phantom: int) -> np.ndarray:
    """The ends (dd == -1) that close the ``phantom`` slices open below the batch's first
    event: the first ``phantom`` ends that go below the batch's starting level."""
    below = unmatched_ends(dd, 0)[0]
    idx = np.flatnonzero(below)[:phantom]
    out = np.zeros(len(dd), dtype=bool)
    out[idx] = True
    return out


class Sink:
    """One trace file taking the levels in ``levels`` (a set of _schema.LEVEL_* values)."""

    def __init__(self, path: str, levels: frozenset[int], compress: bool, write):
        self.path = os.fspath(path)
        self.levels = levels
        self.compress = compress
        self._write = write  # callable(sink, bytes): the session's I/O queue
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.sequences: dict[object, SequenceState] = {}
        self._next_seq = MAIN_SEQUENCE + 1
        self.described: dict[int, bytes] = {}  # track uuid -> descriptor written
        self.pending: list[bytes] = []  # packets of the current flush
        self.bytes_raw = 0
        self.closed = False
        self.warn_unmatched = True  # False for files opened mid-run (windows): drops expected
        self.lost_ends = 0  # ends left out since a dropped batch held their begins (uncounted)
        # failed writes: what the writer thread encodes belongs to generation `gen`; the I/O
        # thread drops the chunks of every generation up to `_failed_gen` (see write_chunk)
        self.gen = 0
        self._failed_gen = -1
        self._chunk_info: dict[int, tuple[int, int]] = {}  # id(chunk) -> (gen, events)
        self._part_events: dict[int, int] = {}  # index in pending -> events of that part
        self.offset = 0  # bytes on disk, all whole packets
        self._cut = False  # a failed write's tail is still beyond offset (its cut failed)
        self.lost_events = 0  # events dropped because a write failed (I/O thread)
        self.lost_bytes = 0  # raw packet bytes dropped with them
        self._lost_reported = 0

    # -- building one flush ----------------------------------------------------------------
    def sequence(self, key: object, track: int | None, clock_id: int) -> SequenceState:
        seq = self.sequences.get(key)
        if seq is None:
            seq = self.sequences[key] = SequenceState(self._next_seq, track, clock_id)
            seq.counted = key != ("dropped",)  # the drop counter does not count itself
            self._next_seq += 1
        return seq

    def main_packet(self, *fields: bytes) -> None:
        self.pending.append(packet(w.f_varint(w.PKT_SEQUENCE_ID, MAIN_SEQUENCE), *fields))

    def clock_snapshot(self, snap: dict[int, int]) -> None:
        clocks = b"".join(
            w.f_bytes(w.CS_CLOCKS, w.f_varint(w.CLK_ID, cid) + w.f_varint(w.CLK_TIMESTAMP, ts))
            for cid, ts in snap.items())
        self.main_packet(w.f_bytes(w.PKT_CLOCK_SNAPSHOT, clocks))

    def describe(self, tracks: dict[int, bytes]) -> None:
        """Write descriptors of tracks this file has not seen (or whose descriptor changed)."""
        for uuid, desc in tracks.items():
            if self.described.get(uuid) != desc:
                self.described[uuid] = desc
                self.main_packet(w.f_bytes(w.PKT_TRACK_DESCRIPTOR, desc))

    def add_events(self, seq: SequenceState, codes: np.ndarray, ts: np.ndarray,
                   default_track_depth: bool = True) -> None:
        """Encode one sequence's batch (time-ordered, already filtered to this file's levels)."""
        n = len(codes)
        if n == 0:
            return
        is_blob = codes < 0
        if default_track_depth:
            dd = depth_changes(codes)
            if seq.phantom and dd.any():  # the ends of slices whose begins were lost
                gone = _phantom_ends(dd, seq.phantom)
                k = int(np.count_nonzero(gone))
                seq.phantom -= k
                self.lost_ends += k
                keep = ~gone
                codes, ts, is_blob, dd = codes[keep], ts[keep], is_blob[keep], dd[keep]
                n = len(codes)
                if n == 0:
                    return
            if dd.any():
                dropped, seq.depth = unmatched_ends(dd, seq.depth)
                if dropped.any():
                    if self.warn_unmatched:
                        warn_once("unmatched", "pop_range() or a range end with no open range "
                                  "on its thread was ignored")
                    keep = ~dropped
                    codes, ts, is_blob = codes[keep], ts[keep], is_blob[keep]
                    n = len(codes)
                    if n == 0:
                        return
        out = []
        if not seq.started:
            out.append(seq.start_packet(int(ts[0])))
        templates: list[bytes] = []
        tidx = np.empty(n, dtype=np.int64)
        fast = ~is_blob
        numbered = codes >= NUMBERED_MIN_CODE  # numbers in codes (step begins): built apart
        if numbered.any():
            ni = np.nonzero(numbered)[0]
            fast &= ~numbered
            tidx[ni] = np.arange(len(ni))
            templates.extend(numbered_events(seq.interner, rec.numbered,
                                             (codes[ni] >> 3) - NUMBERED_EID, seq.prefix))
        if fast.any():
            fc = codes[fast]
            top = int(fc.max())
            if top < 4 * len(fc) + 4096:  # a lookup table is cheaper than a sort
                uniq = np.nonzero(np.bincount(fc))[0]
                lut = np.zeros(top + 1, dtype=np.int64)
                lut[uniq] = np.arange(len(uniq))
                inv = lut[fc]
            else:
                uniq, inv = np.unique(fc, return_inverse=True)
            tidx[fast] = len(templates) + inv
            templates.extend(seq.fast_template(int(c)) for c in uniq)
        if is_blob.any():
            bi = np.nonzero(is_blob)[0]
            # one blob id may stand for many events (a converter's shared begins and ends):
            # encoded once (its interned ids do not change within a sequence; definitions
            # ride on the batch's first packet, whatever the order of encoding)
            uniq, inv = np.unique(codes[bi], return_inverse=True)
            tidx[bi] = len(templates) + inv
            templates.extend(blob_templates(seq.interner, seq.prefix, -uniq))
        interned = seq.interner.take_pending()
        if interned:  # definitions ride on the batch's first packet
            templates.append(interned + templates[tidx[0]])
            tidx[0] = len(templates) - 1
        deltas = np.diff(ts, prepend=seq.last_ts)
        if deltas.min() < 0:  # never write a corrupt clock: an event stamped before the one
            # it follows is moved up to it (only misuse of emitters); the events after it keep
            # their times (clamping its delta to 0 shifted every later event of the sequence
            # by the step back)
            ts = np.maximum.accumulate(np.concatenate(([seq.last_ts], ts)))[1:]
            deltas = np.diff(ts, prepend=seq.last_ts)
        seq.last_ts = int(ts[-1])
        out.append(assemble(deltas, tidx, templates))
        self.pending.extend(out)
        if seq.counted:
            self._part_events[len(self.pending) - 1] = n

    def rescue_ends(self, seq: SequenceState, codes: np.ndarray, ts: np.ndarray,
                    dd: np.ndarray) -> int:
        """A dropped batch of one sequence (``dd`` as in :func:`unmatched_ends`): its ends of
        slices begun before it are written, at their own times, and the slices it leaves open
        are counted as phantoms, whose ends are left out when they come. Returns the number
        of ends written."""
        closing, open_after = unmatched_ends(dd, 0)
        depth, lost = seq.depth, self.lost_ends
        if closing.any() and seq.started:
            self.add_events(seq, codes[closing], ts[closing])
        self.lost_ends = lost  # (ends of the batch's own: counted with it)
        seq.phantom += open_after
        return depth - seq.depth

    # -- handing bytes to the disk -----------------------------------------------------------
    def take(self) -> list[bytes]:
        """The finished byte strings of this flush, compressed if asked."""
        if not self.pending:
            return []
        parts, self.pending = self.pending, []
        events, self._part_events = self._part_events, {}
        self.bytes_raw += sum(map(len, parts))
        if not self.compress:
            return [self._tag(b"".join(parts), sum(events.values()))]
        # batches of ~1 MiB, split between encoded batches (each holds whole packets)
        chunks, cur, size, nev = [], [], 0, 0
        for i, part in enumerate(parts):
            cur.append(part)
            size += len(part)
            nev += events.get(i, 0)
            if size >= COMPRESS_CHUNK:
                chunks.append(self._tag(b"".join(cur), nev))
                cur, size, nev = [], 0, 0
        if cur:
            chunks.append(self._tag(b"".join(cur), nev))
        return chunks

    def _tag(self, chunk: bytes, events: int) -> bytes:
        self._chunk_info[id(chunk)] = (self.gen, events)
        return chunk

    def recover(self) -> int:
        """After a failed write (writer thread, before encoding a flush): restart every
        sequence and describe every track again, so what follows stands on its own. Returns
        the events lost since the last call."""
        if self._failed_gen >= self.gen:
            self.gen += 1
            for seq in self.sequences.values():
                seq.restart()
            self.described = {}
            self.warn_unmatched = False  # ends of slices begun in the lost part: expected
            self.clock_snapshot(_clock.snapshot())
        lost = self.lost_events - self._lost_reported
        self._lost_reported += lost
        return lost

    def write_chunk(self, raw: bytes) -> None:
        """Compress (if asked) and write one chunk of ``take()`` (the I/O thread).

        A chunk of a generation with a failed write is dropped (it leans on what was lost). A
        failed write is cut back to the last whole packet, counted, and raised (to be
        reported); the writer restarts the sequences at its next flush (``recover``)."""
        gen, events = self._chunk_info.pop(id(raw), (self.gen, 0))
        if self.closed:
            return
        if gen <= self._failed_gen:
            self.lost_events += events
            self.lost_bytes += len(raw)
            return
        data = self.compress_chunk(raw) if self.compress else raw
        if self._cut:  # a shorter chunk must not leave the old partial packet's tail after it
            self._cut_back()
        try:
            self.write_now(data)
        except OSError as e:
            self._failed_gen = gen
            self.lost_events += events
            self.lost_bytes += len(raw)
            # a partial packet would make the rest of the file unreadable: cut it off, and
            # write the next chunk over it even if the cut failed
            self._cut = True
            self._cut_back()
            with contextlib.suppress(OSError):
                os.lseek(self.fd, self.offset, os.SEEK_SET)
            raise OSError(e.errno, f"{e.strerror or e}: the file keeps its first {self.offset} "
                          "bytes (whole packets); events are dropped and counted until a write "
                          "succeeds again") from None
        self.offset += len(data)

    def compress_chunk(self, raw: bytes) -> bytes:
        """Wrap raw packets into one ``compressed_packets`` packet (runs on the I/O thread)."""
        data = _deflate.compress(raw)
        body = w.f_bytes(w.PKT_COMPRESSED_PACKETS, data)
        return w.tag(w.TRACE_PACKET, w.LEN) + w.varint(len(body)) + body

    def write_now(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def _cut_back(self) -> None:
        """Cut the file back to its whole packets (retried until it succeeds)."""
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, self.offset)
            self._cut = False

    def close_file(self) -> None:
        if not self.closed:
            self.closed = True
            if self._cut:
                self._cut_back()
            os.close(self.fd)

