"""CUDA occupancy calculation (the arithmetic of NVIDIA's ``cuda_occupancy.h``), vectorised.

Kineto computes a kernel's *active blocks per SM* with ``cudaOccMaxActiveBlocksPerMultiprocessor``
and derives its est. achieved occupancy from it; we do the same arithmetic in numpy so that a whole
activity buffer is handled in one pass and no CUDA toolkit is needed (traces from the CUPTI fixture,
or traces converted on a machine without a GPU, give the same numbers).

The active blocks per SM are the minimum of four limits (default device state: no carveout or
cache preference, partitioned global caching off):

* **warps**: ``floor(max warps per SM / ceil(block size / warp size))``
  (0 if the block is larger than the device's max threads per block);
* **blocks**: the architecture's max resident blocks per SM;
* **registers**: registers are allocated per warp, ``regs/thread × 32`` rounded up to the
  allocation unit (256); each of the 4 SM sub-partitions holds ``floor(regs per SM / 4 / regs per
  warp)`` warps, so the SM holds ``4 × that`` warps, i.e. ``floor(4 × that / warps per block)``
  blocks (0 when the block exceeds the per-block register file, checked with the warp count rounded
  up to the 4 sub-partitions, as the hardware does); unlimited for 0 registers;
* **shared memory**: ``static + dynamic + reserved per block`` (1 KiB since Ampere) rounded up to
  the allocation granularity (128 B since Ampere), into the SM's shared memory (228 KiB on sm_90);
  unlimited for a kernel that uses none. A kernel that launched with more than the default 48 KiB
  per block evidently opted in (``cudaFuncAttributeMaxDynamicSharedMemorySize``), so the per-block
  limit is the opt-in one. (Kineto passes the default limit and reports 0 for such kernels.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

_INT_MAX = np.iinfo(np.int64).max // 4  # "unlimited" that survives min() and products

# Per compute capability (major, minor): figures the device attributes do not give directly.
# max blocks/SM, max warps/SM, shared memory per SM, opt-in shared memory per block,
# reserved shared memory per block, carveout sizes (KiB) the shared memory rounds up to.
_ARCH: dict[tuple[int, int], tuple[int, int, int, int, int]] = {
    (7, 0): (32, 64, 96 << 10, 96 << 10, 0),
    (7, 5): (16, 32, 64 << 10, 64 << 10, 0),
    (8, 0): (32, 64, 164 << 10, 163 << 10, 1024),
    (8, 6): (16, 48, 100 << 10, 99 << 10, 1024),
    (8, 7): (16, 48, 164 << 10, 163 << 10, 1024),
    (8, 9): (24, 48, 100 << 10, 99 << 10, 1024),
    (9, 0): (32, 64, 228 << 10, 227 << 10, 1024),
    (10, 0): (32, 64, 228 << 10, 227 << 10, 1024),
    (12, 0): (32, 48, 100 << 10, 99 << 10, 1024),
}


@dataclass(frozen=True)
class DeviceLimits:
    """The device figures the occupancy calculation and the SM-efficiency estimate need."""

    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    max_threads_per_sm: int = 2048
    max_threads_per_block: int = 1024
    max_blocks_per_sm: int = 32
    regs_per_sm: int = 65536
    regs_per_block: int = 65536
    max_regs_per_thread: int = 255
    reg_alloc_unit: int = 256  # registers, allocated per warp
    sub_partitions: int = 4
    smem_per_sm: int = 228 << 10
    smem_per_block: int = 48 << 10
    smem_per_block_optin: int = 227 << 10
    smem_reserved_per_block: int = 1024
    smem_alloc_unit: int = 128
    warp_size: int = 32

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // self.warp_size

    @classmethod
    def for_compute_capability(
        cls, major: int, minor: int, *, sm_count: int, name: str = ""
    ) -> DeviceLimits:
        """Limits of a known architecture (sm_70 … sm_120), e.g. ``(9, 0, sm_count=132)``."""
        key = (major, minor) if (major, minor) in _ARCH else (major, 0)
        if key not in _ARCH:
            raise ValueError(
                f"unknown compute capability {major}.{minor}; pass the limits explicitly"
            )
        blocks, warps, smem_sm, optin, reserved = _ARCH[key]
        return cls(
            name=name or f"sm_{major}{minor}",
            compute_capability=(major, minor),
            sm_count=int(sm_count),
            max_threads_per_sm=warps * 32,
            max_blocks_per_sm=blocks,
            smem_per_sm=smem_sm,
            smem_per_block_optin=optin,
            smem_reserved_per_block=reserved,
            smem_alloc_unit=128 if major >= 8 else 256,
        )

    @classmethod
    def from_attributes(cls, attrs: dict[str, Any]) -> DeviceLimits:
        """Build from CUDA device attributes named as in ``cudaDeviceProp``/the CUPTI fixture.

        Accepts the fixture's ``device`` dict (``MultiProcessorCount``, ``compute_capability`` "90",
        ...) or CuPy's ``getDeviceProperties`` dict (``multiProcessorCount``, ``major``/``minor``).
        Figures not given come from the architecture table.
        """

        def pick(*keys: str) -> Any:
            for k in keys:
                if k in attrs and attrs[k] is not None:
                    return attrs[k]
            return None

        cc = pick("compute_capability")
        if cc is not None:
            cc = str(cc).replace(".", "")
            major, minor = int(cc[:-1]), int(cc[-1])
        else:
            major, minor = (
                pick("major", "computeCapabilityMajor"),
                pick("minor", "computeCapabilityMinor"),
            )
            if major is None or minor is None:
                raise ValueError("device attributes lack the compute capability")
            major, minor = int(major), int(minor)
        sm_count = pick("MultiProcessorCount", "multiProcessorCount", "sm_count")
        if not sm_count:
            raise ValueError("device attributes lack the SM count (MultiProcessorCount)")
        name = pick("name") or f"sm_{major}{minor}"
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        base = cls.for_compute_capability(major, minor, sm_count=int(sm_count), name=str(name))
        overrides: dict[str, int] = {}
        for field, keys in (
            ("max_threads_per_sm", ("MaxThreadsPerMultiProcessor", "maxThreadsPerMultiProcessor")),
            ("max_threads_per_block", ("MaxThreadsPerBlock", "maxThreadsPerBlock")),
            ("max_blocks_per_sm", ("MaxBlocksPerMultiprocessor", "maxBlocksPerMultiProcessor")),
            ("regs_per_sm", ("MaxRegistersPerMultiprocessor", "regsPerMultiprocessor")),
            ("regs_per_block", ("MaxRegistersPerBlock", "regsPerBlock")),
            ("smem_per_sm", ("MaxSharedMemoryPerMultiprocessor", "sharedMemPerMultiprocessor")),
            ("smem_per_block", ("MaxSharedMemoryPerBlock", "sharedMemPerBlock")),
            ("smem_per_block_optin", ("MaxSharedMemoryPerBlockOptin", "sharedMemPerBlockOptin")),
            (
                "smem_reserved_per_block",
                ("ReservedSharedMemoryPerBlock", "reservedSharedMemPerBlock"),
            ),
            ("warp_size", ("WarpSize", "warpSize")),
        ):
            v = pick(*keys)
            if v is not None:
                overrides[field] = int(v)
        return replace(base, **overrides)


@dataclass(frozen=True)
class OccupancyResult:
    """Per-kernel results (numpy arrays, one entry per kernel)."""

    active_blocks: np.ndarray  # active blocks per SM = min of the four limits
    limit_warps: np.ndarray
    limit_blocks: np.ndarray
    limit_registers: np.ndarray
    limit_shared_memory: np.ndarray


def _ceil_div(a: np.ndarray, b: int | np.ndarray) -> np.ndarray:
    return -(-a // b)


def active_blocks_per_sm(
    dev: DeviceLimits,
    block_size: Any,
    registers_per_thread: Any,
    static_smem: Any = 0,
    dynamic_smem: Any = 0,
) -> OccupancyResult:
    """Max resident blocks per SM for each kernel (arrays broadcast); see the module docstring."""
    bs = np.asarray(block_size, dtype=np.int64)
    regs = np.asarray(registers_per_thread, dtype=np.int64)
    smem = np.asarray(static_smem, dtype=np.int64) + np.asarray(dynamic_smem, dtype=np.int64)
    bs, regs, smem = np.broadcast_arrays(bs, regs, smem)
    if np.any(bs <= 0):
        raise ValueError("block size must be positive")

    warps_per_block = _ceil_div(bs, dev.warp_size)

    # Warps: limit is 0 when the block exceeds the device's max threads per block.
    lim_warps = np.where(bs > dev.max_threads_per_block, 0, dev.max_warps_per_sm // warps_per_block)

    lim_blocks = np.full(bs.shape, dev.max_blocks_per_sm, dtype=np.int64)

    # Registers, allocated per warp in units of reg_alloc_unit, per SM sub-partition.
    regs_per_warp = _ceil_div(regs * dev.warp_size, dev.reg_alloc_unit) * dev.reg_alloc_unit
    regs_per_cta = regs_per_warp * warps_per_block
    regs_assumed = regs_per_warp * (
        _ceil_div(warps_per_block, dev.sub_partitions) * dev.sub_partitions
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        warps_per_sub = np.where(
            regs_per_warp > 0,
            (dev.regs_per_sm // dev.sub_partitions) // np.maximum(regs_per_warp, 1),
            0,
        )
    lim_regs = (warps_per_sub * dev.sub_partitions) // warps_per_block
    too_many = (
        (regs_assumed > dev.regs_per_block)
        | (regs_per_cta > dev.regs_per_block)
        | (regs > dev.max_regs_per_thread)
    )
    lim_regs = np.where(too_many, 0, np.where(regs_per_warp > 0, lim_regs, _INT_MAX))

    # Shared memory: reserved per block + rounding to the allocation unit.
    smem_cta = (
        _ceil_div(smem + dev.smem_reserved_per_block, dev.smem_alloc_unit) * dev.smem_alloc_unit
    )
    per_block_limit = (
        np.where(smem > dev.smem_per_block, dev.smem_per_block_optin, dev.smem_per_block)
        + dev.smem_reserved_per_block
    )
    lim_smem = np.where(
        smem_cta > per_block_limit,
        0,
        np.where(smem_cta > 0, dev.smem_per_sm // np.maximum(smem_cta, 1), _INT_MAX),
    )

    active = np.minimum(np.minimum(lim_warps, lim_blocks), np.minimum(lim_regs, lim_smem))
    return OccupancyResult(active, lim_warps, lim_blocks, lim_regs, lim_smem)


@dataclass(frozen=True)
class KernelEstimates:
    """Kineto's per-kernel estimates (numpy arrays, one entry per kernel)."""

    blocks_per_sm: np.ndarray  # blocks / SM count (float)
    warps_per_sm: np.ndarray  # blocks per SM × block size / warp size (float)
    active_blocks_per_sm: np.ndarray  # from the occupancy calculation (int)
    est_achieved_occupancy: np.ndarray  # fraction 0..1 (float)
    sm_efficiency: np.ndarray  # min(blocks per SM, 1): this kernel's share of busy SMs


def kernel_estimates(
    dev: DeviceLimits,
    grid: tuple[Any, Any, Any],
    block: tuple[Any, Any, Any],
    registers_per_thread: Any,
    static_smem: Any = 0,
    dynamic_smem: Any = 0,
) -> KernelEstimates:
    """Per-kernel estimates as Kineto defines them.

    * blocks per SM = gridX·gridY·gridZ / SM count;
    * warps per SM = blocks per SM × blockX·blockY·blockZ / warp size;
    * est. achieved occupancy = min(blocks per SM, active blocks per SM) × block size / max threads
      per SM, with active blocks per SM from :func:`active_blocks_per_sm`;
    * SM efficiency contribution = min(blocks per SM, 1).
    """
    blocks = (
        np.asarray(grid[0], dtype=np.int64)
        * np.asarray(grid[1], dtype=np.int64)
        * np.asarray(grid[2], dtype=np.int64)
    )
    bs = (
        np.asarray(block[0], dtype=np.int64)
        * np.asarray(block[1], dtype=np.int64)
        * np.asarray(block[2], dtype=np.int64)
    )
    occ = active_blocks_per_sm(dev, bs, registers_per_thread, static_smem, dynamic_smem)
    bps = blocks / float(dev.sm_count)
    warps = bps * bs / dev.warp_size
    achieved = np.minimum(bps, occ.active_blocks) * bs / float(dev.max_threads_per_sm)
    return KernelEstimates(
        blocks_per_sm=bps,
        warps_per_sm=warps,
        active_blocks_per_sm=occ.active_blocks,
        est_achieved_occupancy=achieved,
        sm_efficiency=np.minimum(bps, 1.0),
    )
