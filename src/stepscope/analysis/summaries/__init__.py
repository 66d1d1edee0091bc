"""The summary tables of a trace: portable SQL files plus the little Python SQL cannot share.

What the files share: every table is one SQL file under ``sql/`` (its comments state its
algorithm) reading the CTEs of ``sql/_base.sql``, over trace processor's tables, so it runs on
trace processor and on the embedded engine alike.

* ``sqlfiles``  -- :class:`Filters`, the SQL files' text and placeholders, ``render``,
  ``base_ctes``.
* ``slicebase`` -- the shared slice base (table ``ss_slice_base``) built from the clone's decoded
  columns at load time, through the importer's post-load hook (``POST_LOAD``).
* ``sharedbase`` -- the base CTEs computed once for several tables (temporary tables, views
  over the slice base).
* ``post``      -- what the tables compute in Python after their SQL (stddev, percentiles, ...).
* ``tables``    -- the table specs, running them (several connections), ``report``.
* ``format``    -- rendering: text, CSV, JSON, markdown, units.
* ``cntk``      -- CNTK-style per-rank output files.

Exports the public API below (``stepscope.analysis.summaries.report`` and friends).
"""

from __future__ import annotations

from .._errors import SummaryError
from .post import counter_unit, percentile
from .sharedbase import shared_base
from .sqlfiles import (
    DATALOADER_PHASE_SQL,
    PHASE_KIND_SQL,
    Filters,
    parse_steps,
    render,
    sql_text,
)
from .tables import (
    DEFAULT_TABLES,
    DETAIL_TABLES,
    TABLES,
    all_tables,
    check_name,
    has_column,
    operator_values,
    query_rows,
    render_report,
    report,
    run_sql,
    table,
    with_detail,
)

__all__ = [
    "DATALOADER_PHASE_SQL",
    "DEFAULT_TABLES",
    "DETAIL_TABLES",
    "PHASE_KIND_SQL",
    "TABLES",
    "Filters",
    "SummaryError",
    "all_tables",
    "check_name",
    "counter_unit",
    "has_column",
    "operator_values",
    "parse_steps",
    "percentile",
    "query_rows",
    "render",
    "render_report",
    "report",
    "run_sql",
    "shared_base",
    "sql_text",
    "table",
    "with_detail",
]
