"""Summary tables as values and their renderings: text (Paddle-like), CSV, JSON, markdown, pandas.

Rows hold raw values straight from SQL: times in integer/float nanoseconds, ratios as fractions.
The unit is applied only when a table is rendered, so one Table can be shown in any unit.
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

# Column kinds: how a raw value is converted and shown.
TEXT, INT, TIME, RATIO = "text", "int", "time", "ratio"
FLOAT, BYTES, BOOL = "float", "bytes", "bool"
_NUMERIC = {INT, TIME, RATIO, FLOAT, BYTES}


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
            import pandas as pd
        except ImportError as e:  # pragma: no cover - pandas is a test dependency
            raise ImportError("to_dataframe() needs pandas: pip install pandas") from e
        return pd.DataFrame(self.records(unit), columns=[c.out_key(unit) for c in self.columns])

    def cells(self, unit: str = "ms") -> list[list[str]]:
        """Rows as display strings (what text and markdown show)."""
        div = _divisor(unit)
        return [[_cell(r.get(c.key), c.kind, unit, div) for c in self.columns] for r in self.rows]

    def to_text(self, unit: str = "ms") -> str:
        """Paddle-like layout: a titled banner, dashed rules, aligned columns."""
        headers = [c.title(unit) for c in self.columns]
        body = self.cells(unit)
        widths = [max([len(h)] + [len(row[i]) for row in body]) for i, h in enumerate(headers)]
        total = sum(widths) + 2 * (len(widths) - 1)
        rule = "  ".join("-" * w for w in widths)
        banner = f"{self.title} Summary".center(max(total, len(self.title) + 20), "-")
        lines = [banner, f"Time unit: {unit}", rule, _line(headers, widths, self.columns), rule]
        lines += [_line(row, widths, self.columns) for row in body]
        lines.append(rule)
        lines += [f"Note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def to_markdown(self, unit: str = "ms") -> str:
        headers = [c.title(unit) for c in self.columns]
        align = ["---:" if c.kind in _NUMERIC else ":---" for c in self.columns]
        lines = [f"### {self.title}", "", _md_row(headers), _md_row(align)]
        lines += [_md_row(row) for row in self.cells(unit)]
        if self.notes:
            lines.append("")
            lines += [f"*{n}*" for n in self.notes]
        return "\n".join(lines) + "\n"

    def render(self, fmt: str = "text", unit: str = "ms") -> str:
        """One of ``text``, ``csv``, ``json``, ``md``/``markdown``."""
        if fmt == "text":
            return self.to_text(unit)
        if fmt == "csv":
            return self.to_csv(unit)
        if fmt == "json":
            return self.to_json(unit) + "\n"
        if fmt in ("md", "markdown"):
            return self.to_markdown(unit)
        raise ValueError(f"unknown format {fmt!r}: use text, csv, json or md")


def render_many(tables: Iterable[Table], fmt: str = "text", unit: str = "ms") -> str:
    """Several tables in one document (JSON: one object keyed by table name)."""
    tables = list(tables)
    if fmt == "json":
        return (
            json.dumps({t.name: t.to_dict(unit) for t in tables}, indent=2, default=_json_default)
            + "\n"
        )
    if fmt == "csv":
        return "\n".join(f"# {t.name}\n{t.to_csv(unit)}" for t in tables)
    return "\n".join(t.render(fmt, unit) for t in tables)


def _divisor(unit: str) -> int:
    try:
        return UNITS[unit]
    except KeyError:
        raise ValueError(f"unknown time unit {unit!r}: use one of {', '.join(UNITS)}") from None


def _cell(v: Any, kind: str, unit: str, div: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if kind == TIME:
        return f"{v / div:.{_TIME_DECIMALS[unit]}f}"
    if kind == RATIO:
        return f"{100.0 * v:.2f}"
    if kind in (INT, BYTES):
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
