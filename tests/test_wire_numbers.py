"""Every field number in stepscope.format.wire (writer, merge, importer) is Perfetto's."""

from __future__ import annotations

import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from stepscope.format import wire as w

FIELDS = [
    (pb.TracePacket, {"PKT_TIMESTAMP": "timestamp", "PKT_CLOCK_SNAPSHOT": "clock_snapshot",
                      "PKT_SEQUENCE_ID": "trusted_packet_sequence_id",
                      "PKT_TRACK_EVENT": "track_event", "PKT_INTERNED_DATA": "interned_data",
                      "PKT_SEQUENCE_FLAGS": "sequence_flags",
                      "PKT_PREVIOUS_PACKET_DROPPED": "previous_packet_dropped",
                      "PKT_COMPRESSED_PACKETS": "compressed_packets",
                      "PKT_DEFAULTS": "trace_packet_defaults",
                      "PKT_TRACK_DESCRIPTOR": "track_descriptor",
                      "PKT_FIRST_ON_SEQUENCE": "first_packet_on_sequence",
                      "PKT_INCREMENTAL_STATE_CLEARED": "incremental_state_cleared",
                      "PKT_SYNCHRONIZATION_MARKER": "synchronization_marker"}),
    (pb.Trace, {"TRACE_PACKET": "packet"}),
    (pb.TrackEvent, {"TE_CATEGORY_IIDS": "category_iids", "TE_CATEGORIES": "categories",
                     "TE_DEBUG_ANNOTATIONS": "debug_annotations", "TE_TYPE": "type",
                     "TE_NAME_IID": "name_iid", "TE_TRACK_UUID": "track_uuid", "TE_NAME": "name",
                     "TE_COUNTER_VALUE": "counter_value",
                     "TE_SOURCE_LOCATION": "source_location",
                     "TE_SOURCE_LOCATION_IID": "source_location_iid",
                     "TE_DOUBLE_COUNTER_VALUE": "double_counter_value",
                     "TE_FLOW_IDS": "flow_ids", "TE_TERMINATING_FLOW_IDS": "terminating_flow_ids",
                     "TE_FLOW_IDS_OLD": "flow_ids_old",
                     "TE_TERMINATING_FLOW_IDS_OLD": "terminating_flow_ids_old",
                     "TE_CORRELATION_ID": "correlation_id"}),
    (pb.InternedData, {"ID_EVENT_CATEGORIES": "event_categories", "ID_EVENT_NAMES": "event_names",
                       "ID_DEBUG_ANNOTATION_NAMES": "debug_annotation_names",
                       "ID_SOURCE_LOCATIONS": "source_locations"}),
    (pb.DebugAnnotation, {"DA_NAME_IID": "name_iid", "DA_BOOL": "bool_value",
                          "DA_UINT": "uint_value", "DA_INT": "int_value",
                          "DA_DOUBLE": "double_value", "DA_STRING": "string_value",
                          "DA_NAME": "name", "DA_DICT_ENTRIES": "dict_entries",
                          "DA_ARRAY_VALUES": "array_values", "DA_POINTER": "pointer_value",
                          "DA_STRING_IID": "string_value_iid"}),
    (pb.TrackDescriptor, {"TD_UUID": "uuid", "TD_NAME": "name", "TD_PROCESS": "process",
                          "TD_THREAD": "thread", "TD_PARENT_UUID": "parent_uuid",
                          "TD_COUNTER": "counter"}),
    (pb.ProcessDescriptor, {"PD_PID": "pid", "PD_NAME": "process_name"}),
    (pb.ThreadDescriptor, {"THD_PID": "pid", "THD_TID": "tid", "THD_NAME": "thread_name"}),
    (pb.CounterDescriptor, {"CD_UNIT": "unit", "CD_UNIT_NAME": "unit_name",
                            "CD_UNIT_MULTIPLIER": "unit_multiplier"}),
    (pb.TracePacketDefaults, {"DEF_TIMESTAMP_CLOCK_ID": "timestamp_clock_id",
                              "DEF_TRACK_EVENT_DEFAULTS": "track_event_defaults"}),
    (pb.TrackEventDefaults, {"TED_TRACK_UUID": "track_uuid"}),
    (pb.ClockSnapshot, {"CS_CLOCKS": "clocks", "CS_PRIMARY_TRACE_CLOCK": "primary_trace_clock"}),
    (pb.ClockSnapshot.Clock, {"CLK_ID": "clock_id", "CLK_TIMESTAMP": "timestamp",
                              "CLK_IS_INCREMENTAL": "is_incremental"}),
]


@pytest.mark.parametrize("message,names", FIELDS, ids=[m.DESCRIPTOR.name for m, _ in FIELDS])
def test_field_numbers_match_the_official_schema(message, names):
    fields = message.DESCRIPTOR.fields_by_name
    for const, field in names.items():
        assert getattr(w, const) == fields[field].number, const


def test_enum_values_match_the_official_schema():
    t = pb.TrackEvent.Type
    assert (w.TYPE_SLICE_BEGIN, w.TYPE_SLICE_END, w.TYPE_INSTANT, w.TYPE_COUNTER) == (
        t.Value("TYPE_SLICE_BEGIN"), t.Value("TYPE_SLICE_END"), t.Value("TYPE_INSTANT"),
        t.Value("TYPE_COUNTER"))
    flags = pb.TracePacket.SequenceFlags
    assert w.SEQ_INCREMENTAL_STATE_CLEARED == flags.Value("SEQ_INCREMENTAL_STATE_CLEARED")
    assert w.SEQ_NEEDS_INCREMENTAL_STATE == flags.Value("SEQ_NEEDS_INCREMENTAL_STATE")
    unit = pb.CounterDescriptor.Unit
    assert w.COUNTER_UNITS == {"ns": unit.Value("UNIT_TIME_NS"), "count": unit.Value("UNIT_COUNT"),
                               "bytes": unit.Value("UNIT_SIZE_BYTES")}
