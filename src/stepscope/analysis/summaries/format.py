"""Summary tables as values and their renderings: text (Paddle-like), CSV, JSON, markdown, pandas.

Rows hold raw values straight from SQL: times in integer/float nanoseconds, ratios as fractions,
bytes as numbers. The unit is applied only when a table is rendered, so one Table can be shown in
any unit; CSV/JSON/DataFrames keep the raw numbers and full names, while text and markdown show
bytes in binary units (KiB, MiB, ...), "-" for missing values, leave out columns with no value in
any row, and cut long names in the middle so a text table stays within :data:`MAX_WIDTH` columns.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Divisors from nanoseconds to each selectable time unit.
UNITS = {"ns": 1, "us": 1_000, "ms": 1_000_000, "s": 1_000_000_000}
_TIME_DECIMALS = {"ns": 0, "us": 3, "ms": 3, "s": 6}

# Column kinds: how a raw value is converted and shown. MEASURE: a number in the unit its row
# names under the key "unit" ("bytes", "bytes/s": binary units; anything else: 2 decimals).
TEXT, INT, TIME, RATIO = "text", "int", "time", "ratio"
FLOAT, BYTES, BOOL, MEASURE = "float", "bytes", "bool", "measure"
BYTES_PER_S = "bytes/s"  # a rate, shown in binary units ("11.36 MiB/s")
_NUMERIC = {INT, TIME, RATIO, FLOAT, BYTES, MEASURE, BYTES_PER_S}

#: Default width limit of a text table: names are cut in the middle to keep within it.
MAX_WIDTH = 200
_MIN_NAME_WIDTH = 24  # names are never cut shorter than this by default
_CUT = "..."


@dataclass(frozen=True)
class Column:
    """One column: ``key`` in the rows, ``header`` shown in text/markdown, ``kind`` of value."""

    key: str
    header: str
    kind: str = TEXT

    def out_key(self, unit: str) -> str:
        """Key used in CSV/JSON/DataFrame output: time columns say their unit (``total_ms``)."""
        if self.kind == TIME:
            base = self.key[:-3] if self.key.endswith("_ns") else self.key
            return f"{base}_{unit}"
        return self.key

    def title(self, unit: str) -> str:
        if self.kind == TIME:
            return f"{self.header} ({unit})"
        if self.kind == RATIO:
            return f"{self.header} (%)"
        return self.header


@dataclass
class Table:
    """A computed summary table. ``rows`` are dicts keyed by ``Column.key`` (raw values)."""

    name: str
    title: str
    columns: list[Column]
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:  # an empty table is falsy: report() skips it
        return bool(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    # -- selection -------------------------------------------------------------------------
    def column(self, key: str) -> Column | None:
        """The column named by its key, its output key stem or its header (case-insensitive)."""
        want = key.strip().lower()
        for c in self.columns:
            stem = c.key[:-3] if c.key.endswith("_ns") else c.key
            if want in (c.key.lower(), stem.lower(), c.header.lower()):
                return c
        return None

    def sorted(self, key: str, descending: bool | None = None) -> Table:
        """Rows ordered by a column; numbers descending and text ascending unless told.

        Missing values (None) always go last.
        """
        col = self.column(key)
        if col is None:
            valid = ", ".join(c.key for c in self.columns)
            raise KeyError(f"table {self.name!r} has no column {key!r} (columns: {valid})")
        desc = (col.kind in _NUMERIC) if descending is None else descending
        present = [r for r in self.rows if r.get(col.key) is not None]
        missing = [r for r in self.rows if r.get(col.key) is None]
        present.sort(key=lambda r: r[col.key], reverse=desc)
        return Table(self.name, self.title, self.columns, present + missing, list(self.notes))

    # -- conversion ------------------------------------------------------------------------
    def records(self, unit: str = "ms") -> list[dict[str, Any]]:
        """Rows with time columns converted to ``unit`` and keyed by ``Column.out_key``."""
        div = _divisor(unit)
        out = []
        for r in self.rows:
            rec = {}
            for c in self.columns:
                v = r.get(c.key)
                if v is not None and c.kind == TIME:
                    v = v / div
                rec[c.out_key(unit)] = v
            out.append(rec)
        return out

    def to_dict(self, unit: str = "ms") -> dict[str, Any]:
        return {
            "table": self.name,
            "title": self.title,
            "unit": unit,
            "columns": [
                {"key": c.out_key(unit), "header": c.header, "kind": c.kind} for c in self.columns
            ],
            "rows": self.records(unit),
            "notes": list(self.notes),
        }

    def to_json(self, unit: str = "ms", indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(unit), indent=indent, default=_json_default)

    def to_csv(self, unit: str = "ms") -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow([c.out_key(unit) for c in self.columns])
        for rec in self.records(unit):
            w.writerow(["" if v is None else v for v in rec.values()])
        return buf.getvalue()

    def to_dataframe(self, unit: str = "ms"):
        """A pandas DataFrame (columns as in CSV). Needs pandas."""
        try:
            import pandas as pd  # lazy: an optional dependency, heavy to import
        except ImportError as e:  # pragma: no cover - pandas is a test dependency
            raise ImportError("to_dataframe() needs pandas: pip install pandas") from e
        return pd.DataFrame(self.records(unit), columns=[c.out_key(unit) for c in self.columns])

    def cells(self, unit: str = "ms") -> list[list[str]]:
        """Rows as display strings (what text and markdown show), names in full."""
        div = _divisor(unit)
        return [[_cell(r.get(c.key), c.kind, unit, div, r) for c in self.columns]
                for r in self.rows]

    def _shown(self, unit: str, name_width: int | None) -> tuple[list[Column], list[list[str]]]:
        """The columns text and markdown show (those with a value in some row; all of them for
        a table without rows) and their cells, names cut to fit (see :func:`fit_names`)."""
        keep = [i for i, c in enumerate(self.columns)
                if not self.rows or any(_present(r.get(c.key)) for r in self.rows)]
        cols = [self.columns[i] for i in keep]
        body = [[row[i] for i in keep] for row in self.cells(unit)]
        headers = [c.title(unit) for c in cols]
        limits = fit_names(cols, headers, body, name_width)
        body = [[cut_middle(v, limits[i]) if limits[i] else v for i, v in enumerate(row)]
                for row in body]
        return cols, body

    def to_text(self, unit: str = "ms", name_width: int | None = None) -> str:
        """Paddle-like layout: a titled banner, dashed rules, aligned columns.

        ``name_width``: cut text cells (names) longer than this in the middle; None: as needed
        to keep the table within :data:`MAX_WIDTH` columns; 0: never."""
        cols, body = self._shown(unit, name_width)
        headers = [c.title(unit) for c in cols]
        widths = [max([len(h)] + [len(row[i]) for row in body]) for i, h in enumerate(headers)]
        total = sum(widths) + 2 * (len(widths) - 1)
        rule = "  ".join("-" * w for w in widths)
        banner = f"{self.title} Summary".center(max(total, len(self.title) + 20), "-")
        lines = [banner]
        if any(c.kind == TIME for c in cols):
            lines.append(f"Time unit: {unit}")
        lines += [rule, _line(headers, widths, cols), rule]
        lines += [_line(row, widths, cols) for row in body]
        lines.append(rule)
        lines += [f"Note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def to_markdown(self, unit: str = "ms", name_width: int | None = None) -> str:
        """A markdown table; columns and names as in :meth:`to_text`."""
        cols, body = self._shown(unit, name_width)
        headers = [c.title(unit) for c in cols]
        align = ["---:" if c.kind in _NUMERIC else ":---" for c in cols]
        lines = [f"### {self.title}", "", _md_row(headers), _md_row(align)]
        lines += [_md_row(row) for row in body]
        if self.notes:
            lines.append("")
            lines += [f"*{n}*" for n in self.notes]
        return "\n".join(lines) + "\n"

    def render(self, fmt: str = "text", unit: str = "ms", name_width: int | None = None) -> str:
        """One of ``text``, ``csv``, ``json``, ``md``/``markdown``; ``name_width`` as in
        :meth:`to_text` (CSV and JSON always hold the full names)."""
        if fmt == "text":
            return self.to_text(unit, name_width)
        if fmt == "csv":
            return self.to_csv(unit)
        if fmt == "json":
            return self.to_json(unit) + "\n"
        if fmt in ("md", "markdown"):
            return self.to_markdown(unit, name_width)
        raise ValueError(f"unknown format {fmt!r}: use text, csv, json or md")


def render_many(
    tables: Iterable[Table], fmt: str = "text", unit: str = "ms", name_width: int | None = None
) -> str:
    """Several tables in one document (JSON: one object keyed by table name)."""
    tables = list(tables)
    if fmt == "json":
        return (
            json.dumps({t.name: t.to_dict(unit) for t in tables}, indent=2, default=_json_default)
            + "\n"
        )
    if fmt == "csv":
        return "\n".join(f"# {t.name}\n{t.to_csv(unit)}" for t in tables)
    return "\n".join(t.render(fmt, unit, name_width) for t in tables)


def cut_middle(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters by replacing its middle with "..." (C++ kernel
    names differ at both ends: the namespace at the front, the template arguments at the back)."""
    if len(text) <= width:
        return text
    if width <= len(_CUT):
        return text[:width]
    keep = width - len(_CUT)
    head = (keep + 1) // 2
    return text[:head] + _CUT + text[len(text) - (keep - head):]


def fit_names(
    cols: Sequence[Column], headers: Sequence[str], body: Sequence[Sequence[str]],
    name_width: int | None = None,
) -> list[int | None]:
    """Per column, the width its text cells are cut to (None: not cut).

    ``name_width`` > 0 cuts every text column to it (never below its header), 0 cuts nothing.
    None: the widest text columns are narrowed, one after the other and not below
    ``_MIN_NAME_WIDTH`` (or their header), until the table fits :data:`MAX_WIDTH` columns."""
    widths = [max([len(h)] + [len(row[i]) for row in body]) for i, h in enumerate(headers)]
    limits: list[int | None] = [None] * len(cols)
    text = [i for i, c in enumerate(cols) if c.kind not in _NUMERIC]
    if name_width == 0:
        return limits
    if name_width is not None:
        for i in text:
            if widths[i] > name_width:
                limits[i] = max(name_width, len(headers[i]))
        return limits
    excess = sum(widths) + 2 * (len(widths) - 1) - MAX_WIDTH
    for i in sorted(text, key=lambda i: -widths[i]):
        if excess <= 0:
            break
        floor = max(_MIN_NAME_WIDTH, len(headers[i]))
        new = max(floor, widths[i] - excess)
        if new < widths[i]:
            limits[i] = new
            excess -= widths[i] - new
    return limits


def format_bytes(v: float) -> str:
    """A byte count in binary units: ``512 B``, ``1.50 KiB``, ``1.43 GiB``."""
    size = float(v)
    if abs(size) < 1024:
        return f"{int(size)} B" if size == int(size) else f"{size:.2f} B"
    for prefix in ("Ki", "Mi", "Gi", "Ti", "Pi"):
        size /= 1024.0
        if abs(size) < 1024 or prefix == "Pi":
            break
    return f"{size:.2f} {prefix}B"


def _present(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def _divisor(unit: str) -> int:
    try:
        return UNITS[unit]
    except KeyError:
        raise ValueError(f"unknown time unit {unit!r}: use one of {', '.join(UNITS)}") from None


def _cell(v: Any, kind: str, unit: str, div: int, row: dict[str, Any] | None = None) -> str:
    if not _present(v):
        return "-"
    if kind == TIME:
        return f"{v / div:.{_TIME_DECIMALS[unit]}f}"
    if kind == RATIO:
        return f"{100.0 * v:.2f}"
    if kind == BYTES:
        return format_bytes(v)
    if kind == BYTES_PER_S:
        return format_bytes(v) + "/s"
    if kind == MEASURE:
        u = (row or {}).get("unit")
        if u == "bytes":
            return format_bytes(v)
        if u == "bytes/s":
            return format_bytes(v) + "/s"
        return f"{v:.2f}"
    if kind == INT:
        return str(int(v))
    if kind == FLOAT:
        return f"{v:.2f}"
    if kind == BOOL:
        return "yes" if v else "no"
    return str(v)


def _line(cells: Sequence[str], widths: Sequence[int], cols: Sequence[Column]) -> str:
    parts = [
        c.rjust(w) if col.kind in _NUMERIC else c.ljust(w)
        for c, w, col in zip(cells, widths, cols, strict=True)
    ]
    return "  ".join(parts).rstrip()


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
