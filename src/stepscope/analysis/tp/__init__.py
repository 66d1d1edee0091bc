"""The embedded trace-processor clone: Perfetto trace bytes -> trace processor's tables.

Follows trace processor's import semantics (``proto_trace_reader``, ``track_event_tokenizer`` /
``parser``, ``clock_tracker``) for the TrackEvent subset of the format, vectorised with numpy.
Like Perfetto's ``importers/``, it knows nothing of the SQL written on top of its tables (the
summaries add theirs through the ``PostLoad`` hook).

What the files share: one byte buffer per file (``protoscan.padded``), packets and events as
numpy columns (``packets.Acc``), per-sequence state in file order (``state.State``), strings by
id (``model.Strings``), and the C-or-numpy choice in ``loops``.

* ``protoscan`` -- protobuf wire scanning of many messages at once.
* ``packets``   -- packets of the files (batches inflated), per packet and per event columns.
* ``state``     -- sequences: generations, defaults, interning, clocks, timestamps.
* ``args``      -- debug annotations and source locations -> ``args`` rows.
* ``decode``    -- the whole decode: events sorted, slices nested, counters, flows.
* ``model``     -- the decoded trace (``Tables``, ``Track``, ``Strings``).
* ``importer``  -- the decoded tables written as an SQLite database (via ``sqlimage``),
  with post-load builders (``PostLoad``, ``Laid``).
* ``sqlfuncs``  -- trace processor's SQL functions (EXTRACT_ARG, STR_SPLIT, REGEXP) on the
  embedded engine's connections, and clear words for PerfettoSQL it lacks.
* ``loops``     -- ``native``: the C module ``_decodeloops`` (``_decodeloops.pyi``) or None.

Exports: ``load``, ``decode_files``, ``write_tables``, ``PostLoad``, ``Laid``, ``Tables``.
"""

from __future__ import annotations

from .importer import Laid, PostLoad, decode_files, load, write_tables
from .model import Tables

__all__ = ["Laid", "PostLoad", "Tables", "decode_files", "load", "write_tables"]
