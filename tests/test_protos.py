"""protos/ against Perfetto's official schema (``perfetto_trace_pb2``, ``perfetto`` package).

The .proto files are read by a small parser below (the proto2 subset they use), so the test needs
no protoc; when ``grpcio-tools`` is installed the parser itself is checked against protoc. Every
message, field, oneof and enum value we define must exist in the official schema with the same
number, type, label and type name, and the enums we define must be complete.
"""

from __future__ import annotations

import re
import time
import zlib
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as official

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "protos"
FDP = descriptor_pb2.FieldDescriptorProto

# ----------------------------------------------------------------------------------------------
# A parser for the proto2 subset used in protos/: package, import, option, message, enum, oneof,
# fields with [options], extensions, reserved. Produces FileDescriptorProtos like protoc does.
# ----------------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""\s+|//[^\n]*|/\*.*?\*/|(?P<tok>"(?:[^"\\]|\\.)*"|[A-Za-z_][\w.]*|-?\d+|[{}\[\]();=,<>])""",
    re.S,
)
_SCALARS = {
    name[len("TYPE_") :].lower(): value
    for name, value in FDP.Type.items()
    if name not in ("TYPE_GROUP", "TYPE_MESSAGE", "TYPE_ENUM")
}
_LABELS = {
    "optional": FDP.LABEL_OPTIONAL,
    "required": FDP.LABEL_REQUIRED,
    "repeated": FDP.LABEL_REPEATED,
}
_MAX_FIELD = 536870911


def _tokenize(text: str, where: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise SyntaxError(f"{where}: cannot read {text[pos : pos + 20]!r}")
        if m.group("tok"):
            tokens.append(m.group("tok"))
        pos = m.end()
    return tokens


class _Parser:
    def __init__(self, text: str, name: str):
        self.toks = _tokenize(text, name)
        self.i = 0
        self.name = name

    def peek(self) -> str:
        return self.toks[self.i] if self.i < len(self.toks) else ""

    def next(self) -> str:
        if self.i >= len(self.toks):
            raise SyntaxError(f"{self.name}: unexpected end of file")
        self.i += 1
        return self.toks[self.i - 1]

    def expect(self, tok: str) -> None:
        got = self.next()
        if got != tok:
            raise SyntaxError(f"{self.name}: expected {tok!r}, got {got!r}")

    def skip_statement(self) -> None:
        while self.next() != ";":
            pass

    def parse_file(self) -> descriptor_pb2.FileDescriptorProto:
        fd = descriptor_pb2.FileDescriptorProto(name=self.name)
        while self.peek():
            tok = self.next()
            if tok == "syntax":
                self.expect("=")
                if self.next() != '"proto2"':
                    raise SyntaxError(f"{self.name}: only proto2 is supported")
                self.expect(";")
            elif tok == "package":
                fd.package = self.next()
                self.expect(";")
            elif tok == "import":
                fd.dependency.append(self.next().strip('"'))
                self.expect(";")
            elif tok == "option":
                self.skip_statement()
            elif tok == "message":
                self.parse_message(fd.message_type.add())
            elif tok == "enum":
                self.parse_enum(fd.enum_type.add())
            else:
                raise SyntaxError(f"{self.name}: unexpected {tok!r}")
        return fd

    def parse_enum(self, enum: descriptor_pb2.EnumDescriptorProto) -> None:
        enum.name = self.next()
        self.expect("{")
        while (tok := self.next()) != "}":
            if tok in ("option", "reserved"):
                self.skip_statement()
                continue
            self.expect("=")
            enum.value.add(name=tok, number=int(self.next()))
            if self.peek() == "[":
                while self.next() != "]":
                    pass
            self.expect(";")

    def parse_message(self, msg: descriptor_pb2.DescriptorProto) -> None:
        msg.name = self.next()
        self.expect("{")
        while (tok := self.next()) != "}":
            if tok == "message":
                self.parse_message(msg.nested_type.add())
            elif tok == "enum":
                self.parse_enum(msg.enum_type.add())
            elif tok == "oneof":
                msg.oneof_decl.add(name=self.next())
                self.expect("{")
                while self.peek() != "}":
                    self.parse_field(msg, None, oneof_index=len(msg.oneof_decl) - 1)
                self.expect("}")
            elif tok == "extensions":
                start = int(self.next())
                end = start
                if self.peek() == "to":
                    self.next()
                    end_tok = self.next()
                    end = _MAX_FIELD if end_tok == "max" else int(end_tok)
                msg.extension_range.add(start=start, end=end + 1)
                self.expect(";")
            elif tok in ("reserved", "option"):
                self.skip_statement()
            elif tok in _LABELS:
                self.parse_field(msg, tok)
            else:
                raise SyntaxError(f"{self.name}: field {tok!r} in {msg.name} needs a label")

    def parse_field(self, msg, label: str | None, oneof_index: int | None = None) -> None:
        type_name, name = self.next(), self.next()
        self.expect("=")
        field = msg.field.add(name=name, number=int(self.next()))
        field.label = _LABELS[label] if label else FDP.LABEL_OPTIONAL
        if oneof_index is not None:
            field.oneof_index = oneof_index
        if type_name in _SCALARS:
            field.type = _SCALARS[type_name]
        else:
            field.type_name = type_name  # resolved later, once every file is known
        if self.peek() == "[":
            self.next()
            while True:
                key = self.next()
                self.expect("=")
                value = self.next()
                if key == "default":
                    field.default_value = value.strip('"')
                elif key in ("packed", "deprecated", "lazy"):
                    setattr(field.options, key, value == "true")
                else:
                    raise SyntaxError(f"{self.name}: unsupported field option {key}")
                if self.next() == "]":
                    break
        self.expect(";")


def _walk(prefix: str, messages, enums):
    """Yield (full name, proto, kind) for every message and enum, nested ones included."""
    for enum in enums:
        yield f"{prefix}.{enum.name}", enum, "enum"
    for msg in messages:
        full = f"{prefix}.{msg.name}"
        yield full, msg, "message"
        yield from _walk(full, msg.nested_type, msg.enum_type)


def _resolve(files: list[descriptor_pb2.FileDescriptorProto]) -> None:
    """Turn relative type names into '.pkg.Name', set TYPE_MESSAGE / TYPE_ENUM (proto scoping)."""
    kinds = {}
    for fd in files:
        for full, _, kind in _walk("." + fd.package, fd.message_type, fd.enum_type):
            kinds[full] = kind
    for fd in files:
        for scope, msg, kind in _walk("." + fd.package, fd.message_type, fd.enum_type):
            if kind != "message":
                continue
            for field in msg.field:
                if not field.type_name or field.type_name.startswith("."):
                    continue
                parts = scope.split(".")
                for depth in range(len(parts), 0, -1):
                    candidate = ".".join(parts[:depth]) + "." + field.type_name
                    if candidate in kinds:
                        break
                else:
                    raise LookupError(f"{fd.name}: unknown type {field.type_name} in {scope}")
                field.type_name = candidate
                field.type = FDP.TYPE_MESSAGE if kinds[candidate] == "message" else FDP.TYPE_ENUM


def parse_protos(root: Path = ROOT) -> list[descriptor_pb2.FileDescriptorProto]:
    files = [
        _Parser(path.read_text(), path.relative_to(root).as_posix()).parse_file()
        for path in sorted((root / "protos").rglob("*.proto"))
    ]
    _resolve(files)
    return files


# ----------------------------------------------------------------------------------------------
# Comparison with the official schema
# ----------------------------------------------------------------------------------------------


def _official_index() -> dict[str, tuple[object, str]]:
    fd = descriptor_pb2.FileDescriptorProto.FromString(official.DESCRIPTOR.serialized_pb)
    return {
        full: (proto, kind)
        for full, proto, kind in _walk("." + fd.package, fd.message_type, fd.enum_type)
    }


def _oneof_name(msg, field) -> str | None:
    return msg.oneof_decl[field.oneof_index].name if field.HasField("oneof_index") else None


def schema_mismatches(files, off=None) -> list[str]:
    """Every way in which our definitions differ from the official ones (empty list: none)."""
    off = off if off is not None else _official_index()
    problems = []
    for fd in files:
        if fd.package != "perfetto.protos":
            problems.append(f"{fd.name}: package {fd.package!r} is not perfetto.protos")
        for full, ours, kind in _walk("." + fd.package, fd.message_type, fd.enum_type):
            if full not in off or off[full][1] != kind:
                problems.append(f"{full}: no such {kind} in the official schema")
                continue
            theirs = off[full][0]
            if kind == "enum":
                mine = {v.name: v.number for v in ours.value}
                ref = {v.name: v.number for v in theirs.value}
                if mine != ref:
                    problems.append(f"{full}: values {mine} != official {ref}")
                continue
            ref_fields = {f.name: f for f in theirs.field}
            for field in ours.field:
                where = f"{full}.{field.name}"
                ref = ref_fields.get(field.name)
                if ref is None:
                    problems.append(f"{where}: no such field in the official schema")
                    continue
                for attr in ("number", "label", "type", "type_name", "default_value"):
                    if getattr(field, attr) != getattr(ref, attr):
                        problems.append(
                            f"{where}: {attr} {getattr(field, attr)!r} != official "
                            f"{getattr(ref, attr)!r}"
                        )
                if field.options.packed != ref.options.packed:
                    problems.append(f"{where}: packed differs from the official schema")
                if _oneof_name(ours, field) != _oneof_name(theirs, ref):
                    problems.append(
                        f"{where}: oneof {_oneof_name(ours, field)!r} != official "
                        f"{_oneof_name(theirs, ref)!r}"
                    )
            ref_ranges = [(r.start, r.end) for r in theirs.extension_range]
            for r in ours.extension_range:
                if not any(s <= r.start and r.end <= e for s, e in ref_ranges):
                    problems.append(f"{full}: extension range {r.start}..{r.end - 1} not official")
    return problems


@pytest.fixture(scope="module")
def files():
    return parse_protos()


def _ours(files) -> dict[str, tuple[object, str]]:
    return {
        full: (proto, kind)
        for fd in files
        for full, proto, kind in _walk("." + fd.package, fd.message_type, fd.enum_type)
    }


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


def test_every_definition_matches_the_official_schema(files):
    assert schema_mismatches(files) == []


# What the writer needs: each (message, fields) pair must be defined in protos/.
REQUIRED = {
    "Trace": ["packet"],
    "TracePacket": [
        "timestamp",
        "timestamp_clock_id",
        "trusted_packet_sequence_id",
        "sequence_flags",
        "track_event",
        "track_descriptor",
        "interned_data",
        "trace_packet_defaults",
        "clock_snapshot",
        "compressed_packets",
        "previous_packet_dropped",
        "first_packet_on_sequence",
    ],
    "TrackEvent": [
        "type",
        "name_iid",
        "name",
        "category_iids",
        "categories",
        "track_uuid",
        "counter_value",
        "double_counter_value",
        "extra_counter_track_uuids",
        "extra_counter_values",
        "extra_double_counter_track_uuids",
        "extra_double_counter_values",
        "flow_ids",
        "terminating_flow_ids",
        "correlation_id",
        "debug_annotations",
        "source_location",
        "source_location_iid",
    ],
    "TrackEventDefaults": ["track_uuid", "extra_counter_track_uuids"],
    "TrackDescriptor": ["uuid", "name", "parent_uuid", "process", "thread", "counter"],
    "ProcessDescriptor": ["pid", "process_name"],
    "ThreadDescriptor": ["pid", "tid", "thread_name"],
    "CounterDescriptor": ["unit", "unit_name", "unit_multiplier", "is_incremental"],
    "InternedData": [
        "event_categories",
        "event_names",
        "debug_annotation_names",
        "source_locations",
        "debug_annotation_string_values",
    ],
    "EventName": ["iid", "name"],
    "EventCategory": ["iid", "name"],
    "DebugAnnotationName": ["iid", "name"],
    "InternedString": ["iid", "str"],
    "ClockSnapshot": ["clocks", "primary_trace_clock"],
    "ClockSnapshot.Clock": ["clock_id", "timestamp", "is_incremental", "unit_multiplier_ns"],
    "TracePacketDefaults": ["timestamp_clock_id", "track_event_defaults"],
    "DebugAnnotation": [
        "name_iid",
        "name",
        "bool_value",
        "uint_value",
        "int_value",
        "double_value",
        "string_value",
        "string_value_iid",
        "pointer_value",
        "nested_value",
        "legacy_json_value",
        "dict_entries",
        "array_values",
    ],
    "DebugAnnotation.NestedValue": [
        "nested_type",
        "dict_keys",
        "dict_values",
        "array_values",
        "int_value",
        "double_value",
        "bool_value",
        "string_value",
    ],
    "SourceLocation": ["iid", "file_name", "function_name", "line_number"],
}
REQUIRED_ENUMS = [
    "BuiltinClock",
    "ClockSnapshot.Clock.BuiltinClocks",
    "TrackEvent.Type",
    "TracePacket.SequenceFlags",
    "CounterDescriptor.Unit",
    "DebugAnnotation.NestedValue.NestedType",
]


def test_everything_the_writer_needs_is_defined(files):
    ours = _ours(files)
    missing = []
    for name, fields in REQUIRED.items():
        msg = ours.get(".perfetto.protos." + name, (None, None))[0]
        have = {f.name for f in msg.field} if msg is not None else set()
        missing += [f"{name}.{f}" for f in fields if f not in have]
    missing += [e for e in REQUIRED_ENUMS if ".perfetto.protos." + e not in ours]
    assert missing == []


def test_oneofs_are_perfettos():
    """The oneofs named in the brief, with the members checked by hand against Perfetto."""
    ours = _ours(parse_protos())

    def members(msg_name, oneof):
        msg = ours[".perfetto.protos." + msg_name][0]
        return {f.name for f in msg.field if _oneof_name(msg, f) == oneof}

    assert members("TracePacket", "data") == {
        "clock_snapshot",
        "track_event",
        "compressed_packets",
        "track_descriptor",
    }
    assert members("TracePacket", "optional_trusted_packet_sequence_id") == {
        "trusted_packet_sequence_id"
    }
    assert members("TracePacket", None) >= {
        "timestamp",
        "interned_data",
        "sequence_flags",
        "trace_packet_defaults",
        "timestamp_clock_id",
    }
    assert members("TrackEvent", "name_field") == {"name_iid", "name"}
    assert members("TrackEvent", "counter_value_field") == {"counter_value", "double_counter_value"}
    assert members("TrackEvent", "source_location_field") == {
        "source_location",
        "source_location_iid",
    }
    assert members("DebugAnnotation", "value") == {
        "bool_value",
        "uint_value",
        "int_value",
        "double_value",
        "pointer_value",
        "nested_value",
        "legacy_json_value",
        "string_value",
        "string_value_iid",
    }
    assert members("DebugAnnotation", None) == {"dict_entries", "array_values", "proto_value"}


def _mutated(files, edit):
    copies = [descriptor_pb2.FileDescriptorProto.FromString(f.SerializeToString()) for f in files]
    edit(
        {
            full: proto
            for fd in copies
            for full, proto, _ in _walk("." + fd.package, fd.message_type, fd.enum_type)
        }
    )
    return copies


def _field(msg, name):
    return next(f for f in msg.field if f.name == name)


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            lambda m: setattr(_field(m[".perfetto.protos.TrackEvent"], "flow_ids"), "number", 36),
            ".perfetto.protos.TrackEvent.flow_ids: number 36 != official 47",
        ),
        (
            lambda m: setattr(
                _field(m[".perfetto.protos.TrackEvent"], "flow_ids"), "type", FDP.TYPE_UINT64
            ),
            ".perfetto.protos.TrackEvent.flow_ids: type 4 != official 6",
        ),
        (
            lambda m: setattr(
                _field(m[".perfetto.protos.TracePacket"], "timestamp"), "label", FDP.LABEL_REPEATED
            ),
            ".perfetto.protos.TracePacket.timestamp: label 3 != official 1",
        ),
        (
            lambda m: m[".perfetto.protos.SourceLocation"].field.add(
                name="column", number=5, label=FDP.LABEL_OPTIONAL, type=FDP.TYPE_UINT32
            ),
            ".perfetto.protos.SourceLocation.column: no such field in the official schema",
        ),
        (
            lambda m: m[".perfetto.protos.TrackEvent.Type"].value.add(name="TYPE_FOO", number=6),
            ".perfetto.protos.TrackEvent.Type: values",
        ),
        (
            lambda m: setattr(m[".perfetto.protos.TrackEvent.Type"].value[1], "number", 7),
            ".perfetto.protos.TrackEvent.Type: values",
        ),
        (
            lambda m: (
                _field(m[".perfetto.protos.TracePacket"], "timestamp").ClearField("oneof_index")
                or _field(m[".perfetto.protos.TracePacket"], "compressed_packets").ClearField(
                    "oneof_index"
                )
            ),
            ".perfetto.protos.TracePacket.compressed_packets: oneof None != official 'data'",
        ),
        (
            lambda m: setattr(
                _field(m[".perfetto.protos.TrackDescriptor"], "counter"),
                "type_name",
                ".perfetto.protos.ThreadDescriptor",
            ),
            ".perfetto.protos.TrackDescriptor.counter: type_name",
        ),
        (
            lambda m: setattr(m[".perfetto.protos.EventName"], "name", "EventNames"),
            ".perfetto.protos.EventNames: no such message in the official schema",
        ),
    ],
)
def test_comparison_is_strict(files, edit, expected):
    problems = schema_mismatches(_mutated(files, edit))
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_parser_reads_what_protoc_reads(files, tmp_path):
    """Cross-check of the parser above against protoc (skipped without grpcio-tools)."""
    protoc = pytest.importorskip("grpc_tools.protoc")
    out = tmp_path / "set.pb"
    names = [f.name for f in files]
    assert protoc.main(["protoc", f"-I{ROOT}", f"--descriptor_set_out={out}", *names]) == 0
    by_name = {
        f.name: f for f in descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    }
    for fd in files:
        ref = by_name[fd.name]
        for _, msg, kind in _walk("", ref.message_type, ref.enum_type):
            if kind == "message":
                for field in msg.field:
                    field.ClearField("json_name")
        assert text_format.MessageToString(fd) == text_format.MessageToString(ref), fd.name


def _our_classes(files):
    pool = descriptor_pool.DescriptorPool()
    pending = list(files)
    added: set[str] = set()
    while pending:  # add in dependency order
        fd = next(f for f in pending if set(f.dependency) <= added)
        pool.Add(fd)
        added.add(fd.name)
        pending.remove(fd)
    return lambda name: message_factory.GetMessageClass(
        pool.FindMessageTypeByName("perfetto.protos." + name)
    )


def _sample_trace() -> official.Trace:
    """Every kind of packet and value the writer emits, built with the official classes."""
    trace = official.Trace()
    p = trace.packet.add(trusted_packet_sequence_id=1, timestamp=1_000)
    p.clock_snapshot.primary_trace_clock = official.BUILTIN_CLOCK_BOOTTIME
    for clock_id, ts in ((6, 1_000), (3, 900), (1, 1_700_000_000_000_000_000)):
        p.clock_snapshot.clocks.add(clock_id=clock_id, timestamp=ts)
    p = trace.packet.add(trusted_packet_sequence_id=1)
    p.track_descriptor.uuid = 11
    p.track_descriptor.process.pid = 42
    p.track_descriptor.process.process_name = "rank 0 (host)"
    p = trace.packet.add(trusted_packet_sequence_id=1)
    p.track_descriptor.uuid = 12
    p.track_descriptor.parent_uuid = 11
    p.track_descriptor.name = "host.cpu.user %"
    p.track_descriptor.counter.unit_name = "%"
    p.track_descriptor.counter.unit = official.CounterDescriptor.UNIT_COUNT
    p = trace.packet.add(
        trusted_packet_sequence_id=2, first_packet_on_sequence=True, sequence_flags=3, timestamp=5
    )
    p.track_descriptor.uuid = 13
    p.track_descriptor.thread.pid = 42
    p.track_descriptor.thread.tid = 43
    p.track_descriptor.thread.thread_name = "MainThread"
    p.trace_packet_defaults.timestamp_clock_id = 64
    p.trace_packet_defaults.track_event_defaults.track_uuid = 13
    p = trace.packet.add(trusted_packet_sequence_id=2, sequence_flags=2, timestamp=7)
    p.interned_data.event_names.add(iid=1, name="forward")
    p.interned_data.event_categories.add(iid=1, name="phase")
    p.interned_data.debug_annotation_names.add(iid=1, name="step")
    p.interned_data.source_locations.add(
        iid=1, file_name="train.py", function_name="main", line_number=10
    )
    p.interned_data.debug_annotation_string_values.add(iid=1, str=b"adam")
    ev = p.track_event
    ev.type = official.TrackEvent.TYPE_SLICE_BEGIN
    ev.name_iid = 1
    ev.category_iids.append(1)
    ev.source_location_iid = 1
    ev.flow_ids.append(2**64 - 1)
    ev.correlation_id = 9
    ev.debug_annotations.add(name_iid=1, int_value=-3)
    ev.debug_annotations.add(name="optimizer", string_value_iid=1)
    ev.debug_annotations.add(name="lr", double_value=0.5)
    ev.debug_annotations.add(name="ok", bool_value=True)
    ev.debug_annotations.add(name="n", uint_value=2**63)
    ev.debug_annotations.add(name="ptr", pointer_value=0xDEAD)
    ev.debug_annotations.add(name="json", legacy_json_value='{"a": 1}')
    d = ev.debug_annotations.add(name="cfg")
    d.dict_entries.add(name="k", string_value="v")
    d.dict_entries.add(name="xs").array_values.add(int_value=1)
    nv = ev.debug_annotations.add(name="old").nested_value
    nv.nested_type = official.DebugAnnotation.NestedValue.DICT
    nv.dict_keys.append("a")
    nv.dict_values.add(int_value=1, double_value=2.0, bool_value=True, string_value="s")
    p = trace.packet.add(
        trusted_packet_sequence_id=2, sequence_flags=2, timestamp=3, previous_packet_dropped=1
    )
    p.track_event.type = official.TrackEvent.TYPE_SLICE_END
    p.track_event.terminating_flow_ids.append(7)
    p.track_event.extra_counter_track_uuids.append(12)
    p.track_event.extra_counter_values.append(4)
    p.track_event.extra_double_counter_track_uuids.append(12)
    p.track_event.extra_double_counter_values.append(0.25)
    p = trace.packet.add(trusted_packet_sequence_id=2, timestamp_clock_id=3, timestamp=9)
    p.track_event.type = official.TrackEvent.TYPE_COUNTER
    p.track_event.track_uuid = 12
    p.track_event.double_counter_value = 12.5
    p.track_event.name = "inline"
    p.track_event.categories.append("cat")
    p.track_event.source_location.file_name = "x.py"
    inner = official.Trace()
    inner.packet.add(trusted_packet_sequence_id=2).track_event.counter_value = 3
    trace.packet.add(compressed_packets=zlib.compress(inner.SerializeToString()))
    return trace


def test_sample_trace_round_trips_through_our_schema(files):
    """Bytes written with the official classes decode with ours to the same fields, none unknown."""
    cls = _our_classes(files)
    data = _sample_trace().SerializeToString()
    ours = cls("Trace").FromString(data)
    assert text_format.MessageToString(ours) == text_format.MessageToString(
        official.Trace.FromString(data)
    )
    assert ours.SerializeToString() == data
    inner = cls("Trace").FromString(zlib.decompress(ours.packet[-1].compressed_packets))
    assert inner.packet[0].track_event.counter_value == 3
    assert ours.packet[4].track_event.WhichOneof("source_location_field") == "source_location_iid"
    assert ours.packet[6].track_event.WhichOneof("counter_value_field") == "double_counter_value"


def test_readme_lists_every_file(files):
    readme = (PROTO_DIR / "README.md").read_text()
    assert [f.name for f in files if f.name not in readme] == []


def _fields_used(msg, prefix: str = "") -> set[str]:
    out = set()
    for field, value in msg.ListFields():
        name = f"{msg.DESCRIPTOR.name}.{field.name}"
        out.add(name)
        if field.message_type is not None:
            for item in value if field.is_repeated else [value]:
                out |= _fields_used(item)
    return out


def test_what_the_writer_writes_is_all_defined_here(files, tmp_path):
    """A trace written by stepscope itself, using every kind of event, track and argument,
    decodes with our schema to exactly what the official one decodes: no field goes unknown."""
    stepscope = pytest.importorskip("stepscope")
    if not hasattr(stepscope, "trace"):
        pytest.skip("the core writer is not there yet")
    path = tmp_path / "all.pftrace"
    with stepscope.trace(path) as sess:

        @stepscope.annotate(domain="model", step=3)
        def work():
            stepscope.mark("m", lr=0.5, name="adam", ok=True, big=2**63 + 1, cfg={"a": [1, 2]})

        with stepscope.annotate("outer", payload=7):
            work()
        stepscope.push_range("p", domain="d", category="c")
        stepscope.pop_range()
        stepscope.end_range(stepscope.start_range("async"))
        stepscope.counter("loss", 1.5)
        stepscope.counter("samples", 3, unit="count")
        gpu = sess.new_track("GPU 0", parent=sess.process_uuid)
        stream = sess.new_track("stream 7", parent=gpu)
        util = sess.new_counter_track("util", unit="%", parent=gpu)
        # times now on each clock: trace processor drops events before BOOTTIME's zero
        for clock, t in (("monotonic", time.monotonic_ns()), ("realtime", time.time_ns())):
            em = sess.emitter(clock=clock)
            em.complete(t, 50, "launch", gpu, category="cuda_runtime", flow_ids=[5])
            em.complete(
                t + 10,
                20,
                "kernel",
                stream,
                category="kernel",
                args={"grid_x": 4},
                terminating_flow_ids=[5],
            )
            em.instant(t + 20, "sync", stream)
            em.counter(t + 30, util, 0.75)
            em.counter(t + 31, util, 2)
    cls = _our_classes(files)
    data = path.read_bytes()
    used: set[str] = set()
    pending = [data]
    while pending:
        chunk = pending.pop()
        ours, theirs = cls("Trace").FromString(chunk), official.Trace.FromString(chunk)
        assert text_format.MessageToString(ours) == text_format.MessageToString(theirs)
        used |= _fields_used(theirs)
        pending += [
            zlib.decompress(p.compressed_packets)
            for p in theirs.packet
            if p.HasField("compressed_packets")
        ]
    # the trace did exercise the interesting parts of the schema
    assert {
        "TrackEvent.flow_ids",
        "TrackEvent.terminating_flow_ids",
        "TrackEvent.debug_annotations",
        "InternedData.event_names",
        "TrackDescriptor.parent_uuid",
        "TrackDescriptor.counter",
        "TracePacket.trace_packet_defaults",
        "ClockSnapshot.clocks",
    } <= used
