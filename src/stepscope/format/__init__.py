"""The trace format: ``wire`` is the one module that knows Perfetto's field numbers and the
protobuf wire encoding; the writer, ``stepscope merge``, the importer and the C recorder
(``_wire_tags.h``, generated from it) all take them from there."""
