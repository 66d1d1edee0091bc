"""Rank, local rank, world size and host of this process, from the usual launchers' variables.

Each rank writes its own files with no coordination, so the rank only has to be known locally.
Launchers are tried in a fixed order: torchrun / torch elastic, Open MPI, MPICH/Intel MPI (PMI),
then Slurm. Without any of them the process is rank 0 of a world of 1.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

# (rank, local rank, world size) variable names per launcher, in lookup order.
LAUNCHERS: tuple[tuple[str, str, str, str], ...] = (
    ("torchrun", "RANK", "LOCAL_RANK", "WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("pmi", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
)


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in a distributed job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    host: str = ""
    source: str = "default"  # which launcher's variables were used, or "explicit"/"default"


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        msg = f"stepscope: environment variable {name}={raw!r} is not an integer"
        raise ValueError(msg) from None
    if value < 0:
        raise ValueError(f"stepscope: environment variable {name}={raw!r} must be >= 0")
    return value


def detect(env: Mapping[str, str] | None = None, rank: int | None = None) -> RankInfo:
    """Rank info from ``env`` (default ``os.environ``); an explicit ``rank`` wins."""
    env = os.environ if env is None else env
    host = socket.gethostname()
    if rank is not None:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"stepscope: rank must be an integer >= 0, got {rank!r}")
        world = _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK")
        return RankInfo(rank, local if local is not None else 0,
                        max(world or 1, rank + 1), host, "explicit")
    for source, rank_var, local_var, size_var in LAUNCHERS:
        r = _int(env, rank_var)
        if r is None:
            continue
        local = _int(env, local_var)
        size = _int(env, size_var)
        if size is not None and r >= size:
            raise ValueError(
                f"stepscope: {rank_var}={r} is not below {size_var}={size} ({source} launcher)"
            )
        return RankInfo(r, local if local is not None else 0, size or r + 1, host, source)
    return RankInfo(0, 0, 1, host, "default")
