"""Trace processor's SQL functions on the embedded engine, and clear words for the rest.

Scripts written for trace processor call a few of its functions on TrackEvent traces; the
embedded engine provides them with trace processor's results:

``EXTRACT_ARG(arg_set_id, key)``  the value of ``key`` in the arg set (int, real or string,
                                  as ``args.value_type`` says), NULL when absent
``STR_SPLIT(str, delim, index)``  the index-th (0-based) part of ``str`` split at ``delim``
``REGEXP``                        ``x REGEXP pattern`` (Python's ``re.search``)

PerfettoSQL's own statements (``INCLUDE PERFETTO MODULE``, ``CREATE PERFETTO TABLE`` ...) and
functions the engine lacks are refused in one line that names them and says that trace
processor runs them (``--engine trace_processor``).
"""

from __future__ import annotations

import re
import sqlite3
from typing import Any

_TP_HINT = "trace processor runs it (--engine trace_processor)"

_PERFETTO_STMT = re.compile(
    r"\b(INCLUDE\s+PERFETTO\s+MODULE\s+[\w.*]+|"
    r"CREATE\s+(?:OR\s+REPLACE\s+)?PERFETTO\s+(?:TABLE|VIEW|FUNCTION|MACRO|INDEX)\b)",
    re.IGNORECASE)
_COMMENT = re.compile(r"--[^\n]*|/\*.*?\*/", re.DOTALL)
_STRING = re.compile(r"'(?:[^']|'')*'")


def unsupported(sql: str) -> str | None:
    """One line naming the PerfettoSQL statement in ``sql`` that SQLite cannot run, or None."""
    m = _PERFETTO_STMT.search(_STRING.sub("''", _COMMENT.sub(" ", sql)))
    if m is None:
        return None
    stmt = " ".join(m.group(1).split())
    return f"{stmt}: PerfettoSQL the embedded engine does not run; {_TP_HINT}"


def explain(e: sqlite3.Error) -> str:
    """SQLite's message, with what to do where the embedded engine lacks something."""
    msg = str(e)
    if msg.startswith("no such function:"):
        return f"{msg} (not provided by the embedded engine; {_TP_HINT})"
    if msg in ("not authorized", "authorization denied"):
        return ("not authorized: queries are read-only (ATTACH, DETACH, VACUUM INTO and "
                "PRAGMAs that set a value are refused)")
    return msg


_ARG_SQL = ("SELECT CASE WHEN value_type IN ('string', 'json') THEN string_value"
            " WHEN value_type = 'real' THEN real_value ELSE int_value END"
            " FROM args WHERE arg_set_id = ? AND key = ? LIMIT 1")


def install(conn: sqlite3.Connection) -> None:
    """Register the functions on ``conn`` (which holds the ``args`` table)."""

    def extract_arg(arg_set_id: Any, key: Any) -> Any:
        if arg_set_id is None or key is None:
            return None
        row = conn.execute(_ARG_SQL, (arg_set_id, key)).fetchone()
        return None if row is None else row[0]

    conn.create_function("EXTRACT_ARG", 2, extract_arg)
    conn.create_function("STR_SPLIT", 3, _str_split, deterministic=True)
    conn.create_function("REGEXP", 2, _regexp, deterministic=True)


def _str_split(s: Any, delim: Any, index: Any) -> str | None:
    if s is None or delim is None or index is None:
        return None
    if not delim:
        raise ValueError("STR_SPLIT: delimiter must not be empty")
    parts = str(s).split(str(delim))
    i = int(index)
    return parts[i] if 0 <= i < len(parts) else None


def _regexp(pattern: Any, value: Any) -> int | None:
    if pattern is None or value is None:
        return None
    return int(re.search(str(pattern), str(value)) is not None)
