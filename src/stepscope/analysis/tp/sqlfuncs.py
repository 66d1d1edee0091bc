"""Trace processor's SQL functions on the embedded engine, and clear words for the rest.

Scripts written for trace processor call a few of its functions on TrackEvent traces; the
embedded engine provides them with trace processor's results:

``EXTRACT_ARG(arg_set_id, key)``  the value of ``key`` in the arg set (int, real or string,
                                  as ``args.value_type`` says), NULL when absent
``STR_SPLIT(str, delim, index)``  the index-th (0-based) part of ``str`` split at ``delim``
                                  (NULL past the end or for a non-text ``str``)
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
    if msg.startswith("user-defined function raised exception") and _FunctionError.last:
        msg, _FunctionError.last = _FunctionError.last, None
        return msg
    if msg.startswith("no such function:"):
        return f"{msg} (not provided by the embedded engine; {_TP_HINT})"
    if msg in ("not authorized", "authorization denied"):
        return ("not authorized: queries are read-only (INSERT, UPDATE, DELETE, CREATE, DROP, "
                "ALTER, ATTACH, DETACH, VACUUM INTO and PRAGMAs that set a value are refused)")
    return msg


_ARG_SQL = ("SELECT CASE WHEN value_type IN ('string', 'json') THEN string_value"
            " WHEN value_type = 'real' THEN real_value ELSE int_value END"
            " FROM args WHERE arg_set_id = ? AND key = ? LIMIT 1")


def install(conn: sqlite3.Connection) -> None:
    """Register the functions on ``conn`` (which holds the ``args`` table)."""

    def extract_arg(arg_set_id: Any, key: Any) -> Any:
        if arg_set_id is None:
            return None
        if not isinstance(arg_set_id, int):
            raise _FunctionError("EXTRACT_ARG: 1st argument should be arg set id")
        if not isinstance(key, str):
            raise _FunctionError("EXTRACT_ARG: 2nd argument should be key")
        row = conn.execute(_ARG_SQL, (arg_set_id, key)).fetchone()
        return None if row is None else row[0]

    conn.create_function("EXTRACT_ARG", 2, extract_arg)
    conn.create_function("STR_SPLIT", 3, _str_split, deterministic=True)
    conn.create_function("REGEXP", 2, _regexp, deterministic=True)


class _FunctionError(ValueError):
    """A function's own error; SQLite reports only "user-defined function raised exception",
    so the message is kept for explain() (as trace processor words it)."""

    last: str | None = None

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        _FunctionError.last = msg


def _str_split(s: Any, delim: Any, index: Any) -> str | None:
    """As trace processor's: NULL for a non-text string or a field past the end."""
    if not isinstance(delim, str) or not delim:
        raise _FunctionError("str_split: delimiter must be a non-empty string")
    if not isinstance(index, int) or index < 0:
        raise _FunctionError("str_split: field number must be a non-negative integer")
    if not isinstance(s, str):
        return None
    parts = s.split(delim)
    return parts[index] if index < len(parts) else None


def _regexp(pattern: Any, value: Any) -> int | None:
    if pattern is None or value is None:
        return None
    try:
        rx = re.compile(str(pattern))
    except re.error as e:
        raise _FunctionError(f"regexp: invalid pattern {pattern!r}: {e}") from None
    return int(rx.search(str(value)) is not None)
