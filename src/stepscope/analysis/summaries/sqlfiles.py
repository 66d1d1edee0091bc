"""The summaries' SQL files and how they are filled in: filters, placeholders, base CTEs.

Every summary table is one file under ``sql/``; ``_base.sql`` holds the CTEs they share (the
slices with their process, thread and kind, the steps, the windows the filters select). Its
``{{placeholder}}``s are filled from :class:`Filters` here; ``render`` gives a table's runnable
SQL (pasteable into trace processor's shell or UI), ``base_ctes`` the base split into its CTEs
(for the shared temporary tables and the slice base's track owners).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources

from ... import _schema as S
from .._errors import SummaryError

# --- filters ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Filters:
    """Which part of the trace a table covers (see ``sql/_base.sql`` for exact semantics).

    ``threads``: tids (int) or thread names (str); host slices of other threads are dropped.
    ``ranks``: rank numbers (from process names ``rank <N> (<host>)``, else pids).
    ``steps``: ``(first, stop)`` step numbers, half-open like a Python slice; either may be None.
    """

    threads: tuple[int | str, ...] | None = None
    ranks: tuple[int, ...] | None = None
    steps: tuple[int | None, int | None] | None = None

    @classmethod
    def make(
        cls,
        threads: Iterable[int | str] | int | str | None = None,
        ranks: Iterable[int] | int | None = None,
        steps: str | tuple[int | None, int | None] | None = None,
    ) -> Filters:
        """Filters from loose arguments (one value or a list; steps as ``"A:B"`` or a tuple)."""
        if isinstance(steps, str):
            steps = parse_steps(steps)
        if isinstance(threads, (str, int)):
            threads = [threads]
        if isinstance(ranks, int):
            ranks = [ranks]
        return cls(
            tuple(threads) if threads else None,
            tuple(int(r) for r in ranks) if ranks else None,
            tuple(steps) if steps else None,
        )


def parse_steps(spec: str) -> tuple[int | None, int | None]:
    """``"A:B"`` → steps A..B-1 (half-open, like a slice); ``"A:"``, ``":B"``; ``"N"`` → step N.
    An empty range (B <= A) is an error: it selects nothing ("No events to summarize")."""
    s = (spec or "").strip()
    try:
        if ":" not in s:
            n = int(s)
            return n, n + 1
        a, b = s.split(":", 1)
        first, stop = (int(a) if a.strip() else None), (int(b) if b.strip() else None)
    except ValueError:
        raise SummaryError(f"bad step range {spec!r}: use A:B, A:, :B or N") from None
    if first is not None and stop is not None and stop <= first:
        raise SummaryError(f"empty step range {spec!r}: A:B is steps A to B-1, give B > A")
    return first, stop


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _phase_sql() -> tuple[str, str]:
    """The kind of a 'phase' slice ``s`` by its name, and the test that a 'phase' slice ``p``
    is a Dataloader phase: the spellings of ``_schema.PHASE_ALIASES`` in any (ASCII) case."""
    kinds = {S.PHASE_DATALOADER: 1, S.PHASE_FORWARD: 2, S.PHASE_BACKWARD: 3,
             S.PHASE_OPTIMIZATION: 4}
    whens = " ".join(f"WHEN {_sql_str(a)} THEN {kinds[ph]}"
                     for ph, names in S.PHASE_ALIASES.items() for a in names)
    loaders = ", ".join(_sql_str(a) for a in S.PHASE_ALIASES[S.PHASE_DATALOADER])
    return f"CASE lower(s.name) {whens} ELSE 5 END", f"lower(p.name) IN ({loaders})"


PHASE_KIND_SQL, DATALOADER_PHASE_SQL = _phase_sql()


def placeholders(f: Filters) -> dict[str, str]:
    """The base SQL's placeholders for the filters ``f``, reading trace processor's ``slice``."""
    p = {"rank_filter": "1", "thread_filter": "1", "step_filter": "1", "window_filter": "1",
         "step_slice_filter": "1",
         "phase_kind": PHASE_KIND_SQL, "dataloader_phase": DATALOADER_PHASE_SQL,
         "between_waits": ", ".join(_sql_str(n) for n in (S.DATALOADER_EXHAUSTED_NAME,
                                                          S.DATALOADER_EVAL_NAME)),
         "slices": "slice", "step_rows": "s.category = 'step'"}
    if f.ranks is not None:
        ranks = ", ".join(str(int(r)) for r in f.ranks)
        p["rank_filter"] = f"COALESCE(p.rank, ti.upid) IN ({ranks})"
    if f.threads is not None:
        is_tid = [isinstance(t, int) or str(t).isdigit() for t in f.threads]
        tids = [str(int(t)) for t, i in zip(f.threads, is_tid, strict=True) if i]
        names = [_sql_str(str(t)) for t, i in zip(f.threads, is_tid, strict=True) if not i]
        conds = []
        if tids:
            conds.append(f"tid IN ({', '.join(tids)})")
        if names:
            conds.append(f"name IN ({', '.join(names)})")
        p["thread_filter"] = (
            f"(ti.utid IS NULL AND ti.track_name IS NOT {_sql_str(S.ASYNC_TRACK_NAME)}) "
            f"OR ti.utid IN (SELECT utid FROM thread WHERE {' OR '.join(conds)})"
        )
    if f.steps is not None:
        first, stop = f.steps
        conds = []
        if first is not None:
            conds.append(f"step >= {int(first)}")
        if stop is not None:
            conds.append(f"step < {int(stop)}")
        p["step_filter"] = " AND ".join(conds) or "1"
        p["window_filter"] = (
            "EXISTS (SELECT 1 FROM ss_window w WHERE w.upid = ti.upid "
            "AND s.ts >= w.w_start AND s.ts < w.w_end)"
        )
        # of the step slices, the selected ones (another thread's may start in the window)
        p["step_slice_filter"] = "s.category IS NOT 'step' OR s.id IN (SELECT id FROM ss_step)"
    return p


# --- SQL files --------------------------------------------------------------------------------


@cache
def sql_text(name: str) -> str:
    """The raw text of ``sql/<name>.sql`` (with its ``{{...}}`` placeholders)."""
    try:
        path = resources.files(__package__).joinpath("sql").joinpath(f"{name}.sql")
        return path.read_text("utf-8")
    except FileNotFoundError:
        raise SummaryError(f"no SQL file for {name!r}") from None


def render(
    name: str, filters: Filters | None = None, *, base: str | None = None, **extra: str
) -> str:
    """The runnable SQL of one table: ``_base.sql`` and the filters filled in.

    The result can be pasted into trace processor's shell or UI as-is. ``base`` replaces the
    base CTEs (used when they were materialized as temporary tables, see shared_base()).
    """
    values = placeholders(filters or Filters())
    # 1 where the base CTEs are the shared base's tables, with their indexes (the overview
    # then probes them; with the CTEs alone it sorts instead)
    values["indexed_base"] = "0" if base is None else "1"
    if base is None:
        base = _fill(_strip_comments(sql_text("_base")), values)
    values = {**values, **extra, "base": base.strip()}
    return _fill(sql_text(name), values)


# The base CTEs of _base.sql start at column 0 as "name AS (" or "name(cols) AS (".
CTE_HEAD = re.compile(r"^(\w+)(\([^)]*\))? AS \($", re.M)


def base_ctes(filters: Filters,
              slices: Mapping[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(name, column list, body) of each base CTE, filters filled in, in definition order;
    ``slices``: placeholders that read the slices elsewhere (the slice base's)."""
    text = _fill(_strip_comments(sql_text("_base")), {**placeholders(filters), **(slices or {})})
    heads = list(CTE_HEAD.finditer(text))
    out = []
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        body = text[m.end() : end].rstrip().rstrip(",").rstrip()
        if not body.endswith(")"):
            raise SummaryError(f"cannot split _base.sql at {m.group(1)}")
        out.append((m.group(1), m.group(2) or "", body[:-1]))
    return out


def _fill(text: str, values: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        key = m.group(1)
        if key not in values:
            raise SummaryError(f"SQL placeholder {{{{{key}}}}} has no value")
        return values[key]

    return re.sub(r"\{\{(\w+)\}\}", sub, text)


def _strip_comments(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
