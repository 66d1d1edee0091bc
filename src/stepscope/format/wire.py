"""The trace format: Perfetto's field numbers and tags, and the protobuf wire helpers.

The one owner of field numbers: the writer, ``stepscope merge``, the importer and the C recorder
(``_wire_tags.h``) take them from here. The helpers serve the parts of a trace that are not
encoded in numpy batches: varints, length-delimited fields, fixed64 and doubles, and a field
reader (``fields``) for what reads packets one by one (``stepscope merge``). Field numbers
are Perfetto's (see ``protos/``; a test proves them against the official descriptors).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5

_pack_d = struct.Struct("<d").pack
_pack_q = struct.Struct("<Q").pack


_SMALL = [bytes((i,)) for i in range(0x80)]


def varint(value: int) -> bytes:
    """Unsigned LEB128; negative ints are written as 64-bit two's complement (protobuf int64)."""
    if 0 <= value < 0x80:
        return _SMALL[value]
    if value < 0:
        value += 1 << 64
    if value < 0x4000:
        return bytes(((value & 0x7F) | 0x80, value >> 7))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(field: int, wire_type: int) -> bytes:
    return varint((field << 3) | wire_type)


def f_varint(field: int, value: int) -> bytes:
    return varint(field << 3) + varint(int(value))


def f_bool(field: int, value: bool) -> bytes:
    return varint(field << 3) + (b"\x01" if value else b"\x00")


def f_bytes(field: int, data: bytes) -> bytes:
    return varint((field << 3) | LEN) + varint(len(data)) + data


def f_str(field: int, text: str) -> bytes:
    return f_bytes(field, utf8(text))


def f_fixed64(field: int, value: int) -> bytes:
    return varint((field << 3) | FIXED64) + _pack_q(value & 0xFFFFFFFFFFFFFFFF)


def f_double(field: int, value: float) -> bytes:
    return varint((field << 3) | FIXED64) + _pack_d(value)


def read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``pos``."""
    result = 0
    shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("malformed varint")


def fields(buf: bytes) -> Iterator[tuple[int, int, int, int, int]]:
    """(field, wire type, value-or-payload start, end of field, start of field) over a message."""
    pos = 0
    n = len(buf)
    while pos < n:
        start = pos
        key, pos = read_varint(buf, pos)
        field, wt = key >> 3, key & 7
        if wt == 0:
            value, pos = read_varint(buf, pos)
            yield field, wt, value, pos, start
        elif wt == 2:
            ln, pos = read_varint(buf, pos)
            yield field, wt, pos, pos + ln, start
            pos += ln
        elif wt == 1:
            yield field, wt, pos, pos + 8, start
            pos += 8
        elif wt == 5:
            yield field, wt, pos, pos + 4, start
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wt}")
    if pos != n:
        raise ValueError("truncated message")


def utf8(text: str) -> bytes:
    """Encode any Python str as valid UTF-8 (lone surrogates become U+FFFD, never an error)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        fixed = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return fixed.encode("utf-8", "replace")


# TracePacket fields
PKT_TIMESTAMP = 8
PKT_CLOCK_SNAPSHOT = 6
PKT_SEQUENCE_ID = 10
PKT_TRACK_EVENT = 11
PKT_INTERNED_DATA = 12
PKT_SEQUENCE_FLAGS = 13
PKT_PREVIOUS_PACKET_DROPPED = 42
PKT_COMPRESSED_PACKETS = 50
PKT_DEFAULTS = 59
PKT_TRACK_DESCRIPTOR = 60
PKT_FIRST_ON_SEQUENCE = 87
PKT_INCREMENTAL_STATE_CLEARED = 41  # (legacy flag, read only)
PKT_SYNCHRONIZATION_MARKER = 36  # (read only: carries nothing for the tables)
TRACE_PACKET = 1  # Trace.packet

SEQ_INCREMENTAL_STATE_CLEARED = 1
SEQ_NEEDS_INCREMENTAL_STATE = 2

# TrackEvent fields
TE_CATEGORY_IIDS = 3
TE_CATEGORIES = 22  # inline category names (read only)
TE_SOURCE_LOCATION = 33  # inline SourceLocation (read only)
TE_FLOW_IDS_OLD = 36  # (read only)
TE_TERMINATING_FLOW_IDS_OLD = 42  # (read only)
TE_DEBUG_ANNOTATIONS = 4
TE_TYPE = 9
TE_NAME_IID = 10
TE_TRACK_UUID = 11
TE_NAME = 23
TE_COUNTER_VALUE = 30
TE_SOURCE_LOCATION_IID = 34
TE_DOUBLE_COUNTER_VALUE = 44
TE_FLOW_IDS = 47
TE_TERMINATING_FLOW_IDS = 48
TE_CORRELATION_ID = 52

TYPE_SLICE_BEGIN, TYPE_SLICE_END, TYPE_INSTANT, TYPE_COUNTER = 1, 2, 3, 4

# InternedData fields and its entries (iid=1, name=2)
ID_EVENT_CATEGORIES = 1
ID_EVENT_NAMES = 2
ID_DEBUG_ANNOTATION_NAMES = 3
ID_SOURCE_LOCATIONS = 4

# DebugAnnotation fields
DA_NAME_IID = 1
DA_BOOL = 2
DA_UINT = 3
DA_INT = 4
DA_DOUBLE = 5
DA_STRING = 6
DA_NAME = 10
DA_POINTER = 7  # (read only)
DA_STRING_IID = 17  # (read only)
DA_DICT_ENTRIES = 11
DA_ARRAY_VALUES = 12

# TrackDescriptor and friends
TD_UUID = 1
TD_NAME = 2
TD_PROCESS = 3
TD_THREAD = 4
TD_PARENT_UUID = 5
TD_COUNTER = 8
PD_PID = 1
PD_NAME = 6
THD_PID = 1
THD_TID = 2
THD_NAME = 5
CD_UNIT = 3
CD_UNIT_NAME = 6
CD_UNIT_MULTIPLIER = 4
COUNTER_UNITS = {"ns": 1, "count": 2, "bytes": 3}  # CounterDescriptor.Unit

# TracePacketDefaults / TrackEventDefaults
DEF_TIMESTAMP_CLOCK_ID = 58
DEF_TRACK_EVENT_DEFAULTS = 11
TED_TRACK_UUID = 11

# ClockSnapshot
CS_CLOCKS = 1
CS_PRIMARY_TRACE_CLOCK = 2
CLK_ID = 1
CLK_TIMESTAMP = 2
CLK_IS_INCREMENTAL = 3
SEQUENCE_SCOPED_CLOCK_IDS = range(64, 128)  # BuiltinClock: ids a sequence defines for itself

# Whole tags written byte for byte: every packet of a file or batch starts TAG_TRACE_PACKET
TAG_TRACE_PACKET = (TRACE_PACKET << 3) | LEN
TAG_PACKET_TIMESTAMP = (PKT_TIMESTAMP << 3) | VARINT

# Tags the C recorder writes itself (stepscope/_wire_tags.h is generated from these by
# tools/gen_wire_tags.py): name -> (tag byte, what it is)
C_TAGS = {
    "TRACE_PACKET": (TAG_TRACE_PACKET, "Trace.packet, length-delimited"),
    "PACKET_TIMESTAMP": (TAG_PACKET_TIMESTAMP, "TracePacket.timestamp, varint"),
}
