"""Query engines: Perfetto's trace processor, or the embedded SQLite importer.

``open(path)`` picks the engine. Both expose the same object: ``.query(sql)`` returns
:class:`Rows` (a list of :class:`Row`, every column kept in order), ``.query_df(sql)`` a pandas
DataFrame, ``.engine`` says which
engine answered, and the object is a context manager. The same PerfettoSQL (the subset both
understand: SQLite syntax over trace processor's tables) gives the same tables on both.

Trace processor needs its ``trace_processor_shell`` binary. It is looked for, in order: the
``trace_processor_bin`` argument, the ``STEPSCOPE_TRACE_PROCESSOR`` environment variable,
``trace_processor_shell`` on ``PATH``, then the binary the ``perfetto`` package downloaded
before (its cache, ``~/.local/share/perfetto/prebuilts``). Nothing touches the network unless
asked: ``engine="auto"`` uses a binary found so and otherwise the embedded engine, silently;
only ``engine="trace_processor"`` (or ``stepscope get-trace-processor``) downloads the package's
pinned binary, with a timeout (``STEPSCOPE_DOWNLOAD_TIMEOUT`` seconds, default 60), into that
cache. A binary that fails to start: ``auto`` prints one line and uses the embedded engine,
``trace_processor`` raises :class:`EngineError`.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import os
import platform
import re
import shutil
import sqlite3
import sys
import time
import urllib.request
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from os import PathLike
from typing import Any

from ._errors import EngineError, TraceDamageWarning, TraceError
from .merge import across_hosts, merged_stream, probe
from .rundir import classify
from .sqlimage import file_of
from .summaries.slicebase import POST_LOAD
from .tp import importer, sqlfuncs
from .tp.importer import Progress, paths_of, remove_db_file
from .tp.packets import refuse_empty

ENV_BIN = "STEPSCOPE_TRACE_PROCESSOR"
ENV_TIMEOUT = "STEPSCOPE_DOWNLOAD_TIMEOUT"
DOWNLOAD_TIMEOUT_S = 60.0
ENGINES = ("auto", "trace_processor", "embedded")

PathArg = str | PathLike | Iterable[str | PathLike]


def load(path_or_paths: PathArg, db: str | None = ":memory:", progress: Progress | None = None,
         indexes: bool = True, slice_base: bool = True) -> tuple[sqlite3.Connection, dict]:
    """The embedded engine's load: trace processor's tables (``tp.importer.load``) and, with
    ``slice_base``, the summaries' slice base laid into the same database image."""
    paths = paths_of(path_or_paths)
    datas = None
    if len(paths) > 1:
        infos = probe(paths)
        if across_hosts(infos):
            # ranks of several hosts: their clocks aligned and pids kept apart as the merge
            # (and so trace processor, which is given the merge) does it
            datas = [(" + ".join(paths), b"".join(merged_stream(infos)))]
    return importer.load(paths, db, progress, indexes,
                         post=(POST_LOAD,) if slice_base else (), datas=datas)


class Row:
    """One result row, every column in order (like ``sqlite3.Row``): ``row[0]`` by position,
    ``row["name"]`` by name (the first column of that name), iteration over the values; also
    ``keys()``, ``values()``, ``items()``, ``get()`` and ``==`` a dict, so code written for the
    dict rows of earlier versions keeps working."""

    __slots__ = ("_values", "_index", "_columns")

    def __init__(self, values: Iterable[Any], columns: list[str],
                 index: dict[str, int] | None = None) -> None:
        self._values = tuple(values)
        self._columns = columns
        self._index = index if index is not None else _first_index(columns)

    def __getitem__(self, key):
        if isinstance(key, str):
            try:
                return self._values[self._index[key]]
            except KeyError:
                raise KeyError(key) from None
        return self._values[key]

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def keys(self) -> list[str]:
        return list(self._columns)

    def values(self) -> tuple:
        return self._values

    def items(self) -> list[tuple[str, Any]]:
        return list(zip(self._columns, self._values, strict=True))

    def get(self, key: str, default: Any = None) -> Any:
        i = self._index.get(key)
        return default if i is None else self._values[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Row):
            return self._columns == other._columns and self._values == other._values
        if isinstance(other, Mapping):
            return len(self._index) == len(self._values) and dict(self.items()) == dict(other)
        if isinstance(other, (tuple, list)):
            return self._values == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compares equal to dicts: unhashable as they are

    def __repr__(self) -> str:
        return f"Row({', '.join(f'{c}={v!r}' for c, v in self.items())})"


def _first_index(columns: list[str]) -> dict[str, int]:
    index: dict[str, int] = {}
    for i, c in enumerate(columns):
        index.setdefault(c, i)
    return index


class Rows(list):
    """Query result: a list of :class:`Row` (every column, in order), with the column names."""

    def __init__(self, rows: Iterable[Any] = (), columns: list[str] | None = None):
        rows = list(rows)
        if columns is None:
            columns = list(rows[0].keys()) if rows else []
        self.columns = list(columns)
        index = _first_index(self.columns)
        super().__init__(r if isinstance(r, Row) else
                         Row(r.values() if isinstance(r, Mapping) else r, self.columns, index)
                         for r in rows)

    def df(self):
        """A pandas DataFrame; duplicate column names are kept, as pandas keeps them."""
        import pandas as pd  # lazy: an optional dependency, heavy to import

        return pd.DataFrame([r.values() for r in self], columns=self.columns)


class QueryError(RuntimeError):
    """A query failed (SQL error), with the engine's message."""


class _Base:
    engine = "?"

    def query(self, sql: str) -> Rows:  # pragma: no cover - abstract
        raise NotImplementedError

    def query_df(self, sql: str):
        """The rows of ``sql`` as a pandas DataFrame (needs pandas)."""
        try:
            import pandas  # noqa: F401  # lazy: optional, only to say it is missing
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
    """Trace loaded by stepscope's own importer into SQLite (no binary, no network).

    Queries are read-only: statements that write (INSERT, UPDATE, DELETE, CREATE, DROP, ALTER),
    ATTACH, DETACH (and so VACUUM INTO) and PRAGMAs that set something are refused, so a query
    changes neither the engine's tables nor any file. Ctrl-C interrupts a running query
    (KeyboardInterrupt)."""

    engine = "embedded"

    def __init__(self, paths: list[str], progress: Progress | None = None,
                 db: str | None = None) -> None:
        """``db``: where SQLite keeps the tables: None (default) a temporary file, deleted on
        close or exit (other connections can then open it: the summaries use several cores),
        ":memory:", or a file path (kept)."""
        self.paths = paths
        self.conn = None
        conn, self.stats = load(paths, db=db, progress=progress)
        try:  # an interrupt from here on still removes the temporary file
            tmp = file_of(conn) if db is None else None  # None: kept in memory after all
            self._cleanup = weakref.finalize(self, _close, conn, tmp)
        except BaseException:
            _close(conn, file_of(conn) if db is None else None)
            raise
        self.conn = conn
        sqlfuncs.install(conn)
        conn.set_authorizer(_authorize)

    def query(self, sql: str) -> Rows:
        why = sqlfuncs.unsupported(sql)
        if why:
            raise QueryError(f"query failed: {why}")
        conn = self.conn
        if conn is None:
            raise QueryError("query failed: the database is closed")
        # a Python callback now and then lets a pending Ctrl-C run (SQLite itself never
        # returns to the interpreter during a statement); it aborts the statement
        conn.set_progress_handler(_tick, _TICK_OPS)
        conn.set_authorizer(_authorize_query)  # only the user's own statements: read-only
        try:  # rows are fetched inside: SQLite reports some errors only while stepping
            *first, last = _statements(sql)  # several: all run, the last one's rows (as TP)
            for stmt in first:
                conn.execute(stmt).fetchall()
            cur = conn.execute(last)
            if cur.description is None:
                return Rows()
            cols = [d[0] for d in cur.description]
            return Rows(cur.fetchall(), cols)
        except sqlite3.Error as e:
            if str(e) == "interrupted":  # Ctrl-C (or a termination signal) during the query
                if _term_signal:
                    raise SystemExit(128 + _term_signal) from None
                raise KeyboardInterrupt from None
            raise QueryError(f"query failed: {sqlfuncs.explain(e)}") from None
        finally:
            conn.set_progress_handler(None, 0)
            conn.set_authorizer(_authorize)  # the summaries' temporary tables may be written

    def close(self) -> None:
        if self.conn is not None:
            self._cleanup()
        self.conn = None


def _statements(sql: str) -> list[str]:
    """``sql`` cut into its statements (at the semicolons that end one, not those in strings,
    identifiers or comments); trailing comments stay with the last one."""
    out, start = [], 0
    for i, ch in enumerate(sql):
        if ch == ";" and sqlite3.complete_statement(sql[start:i + 1]):
            out.append(sql[start:i + 1])
            start = i + 1
    rest = sql[start:]
    if out and not re.sub(r"--[^\n]*|/\*.*?(?:\*/|$)|\s+", "", rest, flags=re.S):
        out[-1] += rest
    else:
        out.append(rest)
    return out


_TICK_OPS = 100_000  # SQLite VM steps between callbacks: about a millisecond
_term_signal = 0  # see note_termination: an aborted query then exits as the signal would


def note_termination(signum: int) -> None:
    """Called by a termination-signal handler (the CLI's SIGTERM one, cli.common): a query the
    signal interrupts then ends in ``SystemExit(128 + signum)`` instead of KeyboardInterrupt."""
    global _term_signal
    _term_signal = signum


def _tick() -> int:
    return 0


# PRAGMAs that take an argument and only read (the summaries use table_info)
_READ_PRAGMAS = frozenset({"table_info", "table_xinfo", "index_info", "index_xinfo",
                           "index_list", "foreign_key_list", "foreign_key_check",
                           "integrity_check", "quick_check"})


def _authorize(action: int, arg1: str | None, arg2: str | None, db: str | None,
               source: str | None) -> int:
    """SQLite authorizer: no statement may reach another file (ATTACH, which VACUUM INTO uses
    too) or change the connection's settings (a PRAGMA that sets, e.g. journal_mode=WAL)."""
    if action in (sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH):
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_PRAGMA and arg2 is not None and \
            (arg1 or "").lower() not in _READ_PRAGMAS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


# what writes: a user query may not (the engine's own ss_* tables stay as loaded)
_WRITES = frozenset(getattr(sqlite3, name) for name in dir(sqlite3) if name.startswith(
    ("SQLITE_CREATE_", "SQLITE_DROP_")) or name in (
    "SQLITE_INSERT", "SQLITE_UPDATE", "SQLITE_DELETE", "SQLITE_ALTER_TABLE", "SQLITE_REINDEX",
    "SQLITE_ANALYZE"))


def _authorize_query(action: int, arg1: str | None, arg2: str | None, db: str | None,
                     source: str | None) -> int:
    """SQLite authorizer while a user query runs: _authorize, and nothing written. (SQLite
    itself asks to update the schema table when it reads it, e.g. for pragma_table_info: a
    user cannot write that table anyway, and CREATE/DROP/ALTER are denied by their action.)"""
    if action in _WRITES and arg1 not in ("sqlite_master", "sqlite_temp_master"):
        return sqlite3.SQLITE_DENY
    return _authorize(action, arg1, arg2, db, source)


def _close(conn: sqlite3.Connection, tmp: str | None) -> None:
    conn.close()
    if tmp is not None:
        remove_db_file(tmp)


class TraceProcessorDB(_Base):
    """Trace loaded by Perfetto's trace processor (``perfetto.trace_processor``), run from the
    binary ``bin_path`` (never downloaded here: see :func:`download_trace_processor`)."""

    engine = "trace_processor"

    def __init__(self, paths: list[str], bin_path: str) -> None:
        # lazy: the perfetto package is only needed for this engine
        from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

        self.paths = paths
        self.tp = None
        trace: Any = paths[0] if len(paths) == 1 else _concatenated(paths)
        config = TraceProcessorConfig(bin_path=bin_path)
        with _local_without_proxy():  # its start-up check asks http://localhost through urllib
            self.tp = TraceProcessor(trace=trace, config=config)
        try:
            self._refuse_unreadable()
        except BaseException:
            self.close()
            raise

    def _refuse_unreadable(self) -> None:
        """Trace processor loads what it can of a damaged file without a word: a file cut
        short before its first event gave "No events to summarize" and exit 0. Where it holds
        no slice and no counter, the files are read as the embedded engine reads them, which
        says what was lost (TraceError: "nothing readable: ...") if anything was."""
        held = self.query("SELECT EXISTS (SELECT 1 FROM slice) "
                          "OR EXISTS (SELECT 1 FROM counter) AS held")
        if held and held[0]["held"]:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TraceDamageWarning)
            importer.decode_files(self.paths)

    def query(self, sql: str) -> Rows:
        try:
            it = self.tp.query(sql)
            cols = list(it.column_names)
            rows = _result_rows(it, cols)
        except Exception as e:
            raise QueryError(f"query failed: {_one_line(e)}") from None
        return Rows(rows, cols)

    def close(self) -> None:
        if self.tp is not None:
            self.tp.close()
            self.tp = None


def _result_rows(it: Any, cols: list[str]) -> list[Row]:
    """A perfetto result's rows, every column by position. Its row objects hold one attribute
    per name (a name given twice keeps only one value), so the cells are read when present."""
    index = _first_index(cols)
    cells = getattr(it, "cells", None)
    n = len(cols)
    if cells is not None and n and len(cells) == n * len(it):
        return [Row([_py(v) for v in cells[i:i + n]], cols, index)
                for i in range(0, len(cells), n)]
    return [Row([_py(getattr(r, c)) for c in cols], cols, index) for r in it]


@contextlib.contextmanager
def _local_without_proxy():
    """localhost reached directly for the duration, whatever HTTP(S)_PROXY says (a proxy that
    stalls would otherwise hang trace processor's start-up check)."""
    saved = {k: os.environ.get(k) for k in ("no_proxy", "NO_PROXY")}
    for k, v in saved.items():
        os.environ[k] = ",".join(x for x in (v, "localhost", "127.0.0.1", "::1") if x)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _py(v: Any) -> Any:
    """numpy scalars -> plain Python values."""
    return v.item() if hasattr(v, "item") else v


def _concatenated(paths: list[str]) -> Iterator[bytes]:
    """Several traces as one stream, as ``stepscope merge`` writes them (each file's sequence
    ids made its own, clock snapshots that go back left out), in chunks of about 16 MiB (trace
    processor's Python API sends each chunk as one request)."""
    chunk: list[bytes] = []
    size = 0
    for framed in merged_stream(probe(paths)):
        chunk.append(framed)
        size += len(framed)
        if size >= 1 << 24:
            yield b"".join(chunk)
            chunk, size = [], 0
    if chunk:
        yield b"".join(chunk)


def _prebuilt_entry() -> dict | None:
    """The perfetto package's pinned trace_processor_shell for this machine (None: none)."""
    try:
        # lazy: optional perfetto package, read only when a binary is looked for
        from perfetto.prebuilts.manifests.trace_processor_shell import (
            TRACE_PROCESSOR_SHELL_MANIFEST as manifest,
        )
    except ImportError:
        return None
    plat, machine = sys.platform.lower(), platform.machine().lower()
    for e in manifest:
        if e.get("platform") == plat and machine in e.get("machine", []) and e.get("url"):
            return e
    return None


def _cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".local", "share", "perfetto", "prebuilts")


def _cache_path(entry: dict) -> str:
    """Where the perfetto package keeps (and looks for) its downloaded binary."""
    root, ext = os.path.splitext(entry["file_name"])
    return os.path.join(_cache_dir(), f"{root}-{entry['sha256'][:16]}{ext}")


def cached_trace_processor() -> str | None:
    """A trace_processor_shell the perfetto package downloaded before (no network)."""
    entry = _prebuilt_entry()
    cands = [_cache_path(entry)] if entry else []
    cands.append(os.path.join(_cache_dir(), "trace_processor_shell"))  # older packages' name
    for c in cands:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def find_trace_processor(explicit: str | None = None) -> str | None:
    """The trace_processor_shell to use: explicit path, env var, PATH, the perfetto package's
    cache; None when there is none. Never downloads.

    An explicit path or env var that names no executable file is an error.
    """
    for source, cand in (("trace_processor_bin", explicit), (ENV_BIN, os.environ.get(ENV_BIN))):
        if cand:
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
            raise EngineError(f"{source}={cand!r} is not an executable trace_processor_shell")
    return shutil.which("trace_processor_shell") or cached_trace_processor()


def download_timeout() -> float:
    """Seconds a download may take: ``STEPSCOPE_DOWNLOAD_TIMEOUT``, else 60."""
    raw = os.environ.get(ENV_TIMEOUT)
    if not raw:
        return DOWNLOAD_TIMEOUT_S
    try:
        t = float(raw)
    except ValueError:
        t = float("nan")
    if not 0 < t < 1e6:
        raise EngineError(f"{ENV_TIMEOUT}={raw!r} is not a number of seconds")
    return t


def download_trace_processor(timeout: float | None = None) -> str:
    """Download the perfetto package's pinned trace_processor_shell into its cache (checked
    against the pinned SHA-256; where the package looks for it too) and return its path.

    Gives up after ``timeout`` seconds (default :func:`download_timeout`) with an
    :class:`EngineError` of one line; leaves no partial file.
    """
    entry = _prebuilt_entry()
    if entry is None:
        raise EngineError(f"the perfetto package has no trace_processor_shell for "
                          f"{sys.platform}-{platform.machine()}; set {ENV_BIN}")
    dest = _cache_path(entry)
    if os.path.isfile(dest) and os.access(dest, os.X_OK):
        return dest
    timeout = download_timeout() if timeout is None else timeout
    url = entry["url"]
    deadline = time.monotonic() + timeout
    tmp = f"{dest}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        digest = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=timeout) as resp, \
                builtins.open(tmp, "wb") as f:
            # read1: at most one recv a round, each bounded by the time left (a server that
            # trickles bytes would otherwise hold read() for a full timeout per recv)
            sock = getattr(getattr(getattr(resp, "fp", None), "raw", None), "_sock", None)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("timed out")
                if sock is not None:
                    sock.settimeout(max(0.1, left))
                if not (chunk := resp.read1(1 << 16)):
                    break
                digest.update(chunk)
                f.write(chunk)
        if digest.hexdigest() != entry["sha256"]:
            raise EngineError(f"cannot download trace_processor_shell from {url}: checksum "
                              f"mismatch")
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
        return dest
    except EngineError:
        raise
    except Exception as e:
        why = _one_line(getattr(e, "reason", None) or e)
        if isinstance(e, TimeoutError) or "timed out" in why:
            why = f"timed out after {timeout:g} s"
        raise EngineError(f"cannot download trace_processor_shell from {url}: {why} "
                          f"(set {ENV_BIN} to a local binary)") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


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
    (Perfetto's trace processor, downloaded when no binary is found; raises
    :class:`EngineError` if it cannot start) or ``"auto"`` (trace processor when a binary is
    found, see :func:`find_trace_processor`, else the embedded engine; no network; one line on
    stderr when a binary found fails). Several paths are loaded into one database. A run
    directory stands for its rank files, as on the command line (whole-run files, else the
    detail windows; see ``rundir.classify``).
    ``progress``: a ``callback(stage, fraction)`` or True to print progress to stderr (the
    embedded engine only).
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
    paths = paths_of(path_or_paths)
    if any(os.path.isdir(p) for p in paths):
        paths = classify(paths).main()
    _check_files(paths)
    if progress is True:
        progress = print_progress()
    elif progress is False:
        progress = None
    if engine == "trace_processor":
        return _start_trace_processor(paths, find_trace_processor(trace_processor_bin)
                                      or download_trace_processor())
    if engine == "auto":
        try:
            binary = find_trace_processor(trace_processor_bin)
            if binary is not None:
                return _start_trace_processor(paths, binary)
        except EngineError as e:
            _say(f"trace processor unavailable ({_one_line(e)}); using the embedded engine")
    return EmbeddedDB(paths, progress=progress)


def _start_trace_processor(paths: list[str], binary: str) -> TraceProcessorDB:
    """Trace processor on ``paths``; EngineError whatever fails (the binary crashed, ...), so
    ``open`` can fall back. The paths were checked: a failure is not theirs, but for a
    TraceError (it loaded nothing of files that the embedded reader finds damaged)."""
    try:
        return TraceProcessorDB(paths, binary)
    except TraceError:
        raise
    except Exception as e:
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
    refuse_empty(paths)


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



__all__ = ["EmbeddedDB", "QueryError", "Row", "Rows", "TraceProcessorDB", "cached_trace_processor",
           "download_trace_processor", "find_trace_processor", "open", "print_progress"]
