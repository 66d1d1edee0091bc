"""Errors of the analysis: unreadable traces, missing engines, failing summaries."""

from __future__ import annotations

from .._inflate import TraceDamageWarning

__all__ = ["EngineError", "TraceDamageWarning", "TraceError"]


class TraceError(ValueError):
    """The input is not a loadable Perfetto trace (missing, unreadable, or corrupt)."""


class EngineError(RuntimeError):
    """The requested query engine is not available (e.g. no trace processor binary)."""


class SummaryError(RuntimeError):
    """A summary could not be computed (bad filter, unknown table, failing query)."""
