"""The decoded trace: strings, tracks and the columns of trace processor's tables."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NONE = -1  # string / row id meaning NULL


def to_str(v) -> str:
    """A string field's value: bytes when the field held invalid UTF-8 (decoded here with
    replacement characters), else the str itself."""
    return v if isinstance(v, str) else bytes(v).decode("utf-8", "replace")


class Strings:
    """Interned strings: id <-> str; id -1 means NULL."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.list: list[str] = []

    def id(self, s: str | None) -> int:
        if s is None:
            return NONE
        s = to_str(s)  # bytes from a string field with invalid UTF-8
        i = self.ids.get(s)
        if i is None:
            i = self.ids[s] = len(self.list)
            self.list.append(s)
        return i


@dataclass
class Track:
    id: int
    uuid: int
    name: str | None = None
    parent_uuid: int | None = None
    kind: str = "track"  # "process" | "thread" | "counter" | "track"
    pid: int | None = None
    tid: int | None = None
    thread_name: str | None = None
    process_name: str | None = None
    unit: str | None = None
    multiplier: int = 1
    incremental: bool = False


@dataclass
class Tables:
    """The decoded trace: numpy columns for the big tables, small Python lists for the rest."""

    strings: Strings
    slice: dict[str, np.ndarray]
    counter: dict[str, np.ndarray]
    args: dict[str, np.ndarray]  # args columns (string ids), {} when there are none
    flows: list[tuple[int, int]]  # (slice_out, slice_in)
    tracks: list[Track]
    processes: list[tuple[int, int | None, str | None]]  # (upid, pid, name)
    threads: list[tuple[int, int | None, str | None, int | None]]  # (utid, tid, name, upid)
    track_utid: dict[int, int]
    track_upid: dict[int, int]
    stats: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# Reading packets
