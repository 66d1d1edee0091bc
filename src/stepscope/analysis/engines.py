"""Query engines: Perfetto's trace processor, or the embedded SQLite importer.

``open(path)`` picks the engine. Both expose the same object: ``.query(sql)`` returns
:class:`Rows` (a list of dicts), ``.query_df(sql)`` a pandas DataFrame, ``.engine`` says which
engine answered, and the object is a context manager. The same PerfettoSQL (the subset both
understand: SQLite syntax over trace processor's tables) gives the same tables on both.

Trace processor needs its ``trace_processor_shell`` binary. It is looked for, in order: the
``trace_processor_bin`` argument, the ``STEPSCOPE_TRACE_PROCESSOR`` environment variable,
``trace_processor_shell`` on ``PATH``, then the ``perfetto`` package's own download (needs
internet). With ``engine="auto"`` any failure prints one line and falls back to the embedded
engine; with ``engine="trace_processor"`` it raises :class:`EngineError`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from os import PathLike
from typing import Any

from ._errors import EngineError, TraceError
from ._sqlimage import file_of
from .importer import Progress, _paths, load, remove_db_file

ENV_BIN = "STEPSCOPE_TRACE_PROCESSOR"
ENGINES = ("auto", "trace_processor", "embedded")

PathArg = str | PathLike | Iterable[str | PathLike]


class Rows(list):
    """Query result: a list of dicts (column -> value), with the column names kept."""

    def __init__(self, rows: Iterable[dict[str, Any]] = (), columns: list[str] | None = None):
        super().__init__(rows)
        self.columns = list(columns or (self[0].keys() if self else []))

    def df(self):
        import pandas as pd

        return pd.DataFrame(list(self), columns=self.columns)


class QueryError(RuntimeError):
    """A query failed (SQL error), with the engine's message."""


class _Base:
    engine = "?"

    def query(self, sql: str) -> Rows:  # pragma: no cover - abstract
        raise NotImplementedError

    def query_df(self, sql: str):
        """The rows of ``sql`` as a pandas DataFrame (needs pandas)."""
        try:
            import pandas  # noqa: F401
        except ImportError:
            raise EngineError("query_df needs pandas: pip install pandas") from None
        return self.query(sql).df()

    def close(self) -> None:  # pragma: no cover - abstract
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} engine={self.engine!r}>"


class EmbeddedDB(_Base):
    """Trace loaded by stepscope's own importer into SQLite (no binary, no network)."""

    engine = "embedded"

    def __init__(self, paths: list[str], progress: Progress | None = None,
                 db: str | None = None) -> None:
        """``db``: where SQLite keeps the tables: None (default) a temporary file, deleted on
        close or exit (other connections can then open it: the summaries use several cores),
        ":memory:", or a file path (kept)."""
        self.paths = paths
        self.conn, self.stats = load(paths, db=db, progress=progress)
        tmp = file_of(self.conn) if db is None else None  # None: kept in memory after all
        self._cleanup = weakref.finalize(self, _close, self.conn, tmp)

    def query(self, sql: str) -> Rows:
        try:  # rows are fetched inside: SQLite reports some errors only while stepping
            cur = self.conn.execute(sql)
            if cur.description is None:
                return Rows()
            cols = [d[0] for d in cur.description]
            return Rows([dict(zip(cols, r, strict=True)) for r in cur], cols)
        except sqlite3.Error as e:
            raise QueryError(f"query failed: {e}") from None

    def close(self) -> None:
        self._cleanup()
        self.conn = None


def _close(conn: sqlite3.Connection, tmp: str | None) -> None:
    conn.close()
    if tmp is not None:
        remove_db_file(tmp)


class TraceProcessorDB(_Base):
    """Trace loaded by Perfetto's trace processor (``perfetto.trace_processor``)."""

    engine = "trace_processor"

    def __init__(self, paths: list[str], bin_path: str | None) -> None:
        from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

        self.paths = paths
        trace: Any = paths[0] if len(paths) == 1 else _concatenated(paths)
        config = TraceProcessorConfig(bin_path=bin_path)
        if bin_path is None:  # the perfetto package downloads the binary: keep its output quiet
            with _quiet_fds():
                self.tp = TraceProcessor(trace=trace, config=config)
        else:
            self.tp = TraceProcessor(trace=trace, config=config)

    def query(self, sql: str) -> Rows:
        try:
            it = self.tp.query(sql)
            cols = list(it.column_names)
            rows = [{c: _py(getattr(r, c)) for c in cols} for r in it]
        except Exception as e:
            raise QueryError(f"query failed: {_one_line(e)}") from None
        return Rows(rows, cols)

    def close(self) -> None:
        if self.tp is not None:
            self.tp.close()
            self.tp = None


_download_failed: str | None = None  # remembered so a process tries to download only once


@contextlib.contextmanager
def _quiet_fds():
    """Silence fds 1 and 2 (the download's curl progress) for the duration."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def _py(v: Any) -> Any:
    """numpy scalars -> plain Python values."""
    return v.item() if hasattr(v, "item") else v


def _concatenated(paths: list[str]):
    """Several traces as one stream: Perfetto traces are concatenable."""
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                yield chunk


def find_trace_processor(explicit: str | None = None) -> str | None:
    """The trace_processor_shell to use: explicit path, env var, PATH (None: let perfetto fetch).

    An explicit path or env var that names no executable file is an error.
    """
    for source, cand in (("trace_processor_bin", explicit), (ENV_BIN, os.environ.get(ENV_BIN))):
        if cand:
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
            raise EngineError(f"{source}={cand!r} is not an executable trace_processor_shell")
    return shutil.which("trace_processor_shell")


def _say(msg: str) -> None:
    print(f"stepscope: {msg}", file=sys.stderr)


def open(  # noqa: A001 - mirrors the builtin on purpose: stepscope.analysis.open(path)
    path_or_paths: PathArg,
    engine: str = "auto",
    trace_processor_bin: str | None = None,
    progress: Progress | bool | None = None,
) -> _Base:
    """Open trace file(s) for SQL queries.

    engine: ``"embedded"`` (stepscope's importer, always available), ``"trace_processor"``
    (Perfetto's trace processor; raises :class:`EngineError` if it cannot start) or ``"auto"``
    (trace processor when its binary is found or can be downloaded, else the embedded engine,
    after one line on stderr saying why; a failed download is not retried). Several paths are
    loaded into one database. ``progress``: a ``callback(stage, fraction)`` or True to print
    progress to stderr (the embedded engine only).
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
    paths = _paths(path_or_paths)
    _check_files(paths)
    if progress is True:
        progress = print_progress()
    elif progress is False:
        progress = None
    if engine in ("auto", "trace_processor"):
        try:
            return _start_trace_processor(paths, trace_processor_bin)
        except EngineError as e:
            if engine == "trace_processor":
                raise
            _say(f"trace processor unavailable ({_one_line(e)}); using the embedded engine")
    return EmbeddedDB(paths, progress=progress)


def _start_trace_processor(paths: list[str], bin_arg: str | None) -> TraceProcessorDB:
    """Trace processor on ``paths``; EngineError whatever fails (no binary, failed download,
    binary crashed), so ``open`` can fall back. The paths were checked: a failure is not theirs.
    A failed download is remembered: it would fail again, slowly."""
    global _download_failed
    explicit = find_trace_processor(bin_arg)
    if explicit is None and _download_failed:
        raise EngineError(_download_failed)
    try:
        return TraceProcessorDB(paths, explicit)
    except Exception as e:
        if explicit is None:  # the perfetto package's own download failed
            _download_failed = (f"no trace_processor_shell found and downloading it "
                                f"failed ({type(e).__name__}); set {ENV_BIN}")
            raise EngineError(_download_failed) from None
        raise EngineError(f"trace_processor_shell failed: {_one_line(e)}") from None


def _check_files(paths: list[str]) -> None:
    """Fail on a missing path or a directory before any engine starts (same words as the
    importer's own read, so both engines report a bad path alike). Not isfile: pipes,
    /dev/stdin and ``<(...)`` are readable traces too."""
    for p in paths:
        if os.path.isdir(p):
            raise TraceError(f"{p}: is a directory, not a trace file")
        if not os.path.exists(p):
            raise TraceError(f"{p}: no such file")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


def print_progress(stream=None, min_interval_s: float = 0.5) -> Callable[[str, float], None]:
    """A progress callback that prints ``loading: <stage> NN%`` lines, at most every 0.5 s."""
    stream = stream or sys.stderr
    state = {"t": 0.0, "stage": None}

    def cb(stage: str, frac: float) -> None:
        now = time.monotonic()
        if stage != state["stage"] or now - state["t"] >= min_interval_s:
            print(f"stepscope: loading: {stage} {100 * frac:3.0f}%", file=stream, flush=True)
            state["t"] = now
            state["stage"] = stage

    return cb



__all__ = ["EmbeddedDB", "QueryError", "Rows", "TraceProcessorDB", "find_trace_processor", "open",
           "print_progress"]
