"""Test helper: slices, args and flows of one trace file through the embedded engine."""

from __future__ import annotations

from typing import Any

from stepscope import analysis


def db(path: Any) -> Any:
    return analysis.open(str(path), engine="embedded")


def rows(d: Any, sql: str) -> list[dict]:
    return [dict(r) for r in d.query(sql)]


def slices(d: Any, where: str = "1") -> list[dict]:
    return rows(d, "SELECT s.id, s.name, s.category, s.ts, s.dur, s.depth, s.parent_id, "
                   "s.track_id, s.arg_set_id FROM slice s WHERE " + where
                   + " ORDER BY s.ts, s.depth")


def args(d: Any, arg_set_id: int | None) -> dict:
    if arg_set_id is None:
        return {}
    sql = f"SELECT key, display_value FROM args WHERE arg_set_id = {arg_set_id}"
    return {r["key"].removeprefix("debug."): r["display_value"] for r in rows(d, sql)}
