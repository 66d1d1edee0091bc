"""Analysis: SQL over stepscope traces, on Perfetto's trace processor or the embedded engine.

    import stepscope.analysis as sa
    with sa.open("run.pftrace") as db:            # engine="auto" | "trace_processor" | "embedded"
        rows = db.query("SELECT name, SUM(dur) AS total FROM slice GROUP BY name")
        rows[0]["total"], rows[0][1]                # every column, by name or position
        df = db.query_df("SELECT * FROM slice")     # with pandas installed

The embedded engine loads the trace into SQLite tables that carry trace processor's names,
columns and semantics, so the same SQL runs on both. The parts, lowest first (each imports only
from those before it; ``tools/import_graph.py`` checks):

* ``_errors``, ``_threads``, ``_arrays``, ``rundir`` -- shared leaves: errors, worker threads, array
  helpers, the roles of the files in a run directory.
* ``sqlimage/``  -- the generic SQLite image writer (numpy columns -> database file bytes).
* ``tp/``        -- the embedded trace-processor clone (Perfetto bytes -> trace processor's
  tables); knows nothing of the summaries.
* ``summaries/`` -- the summary tables: SQL files, the slice base laid at load, rendering, CNTK.
* ``engines``    -- trace processor or the embedded engine behind one ``open``.
* ``cli/``       -- the ``summary``, ``sql`` and ``export-csv`` subcommands.

This module is the facade: ``open``, ``load``, the errors and ``Rows``.
"""

from __future__ import annotations

from ._errors import EngineError, TraceDamageWarning, TraceError
from .engines import (
    EmbeddedDB,
    QueryError,
    Row,
    Rows,
    TraceProcessorDB,
    find_trace_processor,
    load,
    open,
    print_progress,
)

__all__ = [
    "EmbeddedDB",
    "EngineError",
    "QueryError",
    "Row",
    "Rows",
    "TraceDamageWarning",
    "TraceError",
    "TraceProcessorDB",
    "find_trace_processor",
    "load",
    "open",
    "print_progress",
]
