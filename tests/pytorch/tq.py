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


def step_children(d: Any, step: dict) -> list[dict]:
    """The slices at the top of the step's thread's own track (the parent of its ``steps``
    track) that start inside ``step``, in time order: what a step holds."""
    parent = rows(d, f"SELECT parent_id FROM track WHERE id = {step['track_id']}")[0]["parent_id"]
    return slices(d, f"s.track_id = {parent} AND s.depth = 0 AND s.ts >= {step['ts']} "
                     f"AND s.ts < {step['ts'] + step['dur']}")


def outside_steps(d: Any) -> list[dict]:
    """The slices at the top of a stepping thread's track that no step holds whole."""
    steps = slices(d, "s.category = 'step'")
    threads = {rows(d, f"SELECT parent_id FROM track WHERE id = {t}")[0]["parent_id"]
               for t in {s["track_id"] for s in steps}}
    out = []
    for t in sorted(threads):
        for s in slices(d, f"s.track_id = {t} AND s.depth = 0"):
            if not any(st["ts"] <= s["ts"] and s["ts"] + s["dur"] <= st["ts"] + st["dur"]
                       for st in steps):
                out.append(s)
    return out
