"""Occupancy calculation and per-kernel estimates against values worked out by hand.

H100 (sm_90) limits used by hand: 132 SMs, 2048 threads (64 warps) and 32 blocks per SM, 64K
registers per SM in 4 sub-partitions of 16384, registers allocated per warp in units of 256,
shared memory 228 KiB (233472 B) per SM, 1 KiB reserved per block, 128 B granularity, 48 KiB per
block by default and 227 KiB opt-in.
"""

from __future__ import annotations

import numpy as np
import pytest

from stepscope.gpu.occupancy import DeviceLimits, active_blocks_per_sm, kernel_estimates

H100 = DeviceLimits.for_compute_capability(9, 0, sm_count=132, name="H100")


def test_fixture_device_attributes_give_h100_limits(fixture):
    dev = fixture.device
    assert dev.sm_count == 132
    assert dev.compute_capability == (9, 0)
    assert dev.max_threads_per_sm == 2048 and dev.max_warps_per_sm == 64
    assert dev.max_blocks_per_sm == 32
    assert dev.regs_per_sm == 65536
    assert dev.smem_per_sm == 233472
    assert dev.smem_per_block == 49152
    assert dev.smem_per_block_optin == 232448
    assert dev.smem_reserved_per_block == 1024


def _one(**kw):
    r = active_blocks_per_sm(H100, **kw)
    return (
        int(r.active_blocks),
        int(r.limit_warps),
        int(r.limit_registers),
        int(r.limit_shared_memory),
    )


def test_cutlass_sgemm_256x128_is_register_limited():
    # 256 threads = 8 warps -> warps limit 64 // 8 = 8.
    # 202 regs * 32 = 6464 -> rounded to 256: 26 * 256 = 6656 per warp; 16384 // 6656 = 2 warps per
    # sub-partition -> 8 warps per SM -> 8 // 8 = 1 block.
    # smem 49152 + 1024 = 50176 (multiple of 128), within 48 KiB + 1 KiB; 233472 // 50176 = 4.
    assert _one(block_size=256, registers_per_thread=202, dynamic_smem=49152) == (1, 8, 1, 4)


def test_xmma_gemm_with_opt_in_shared_memory():
    # 255 regs * 32 = 8160 -> 8192 per warp; 16384 // 8192 = 2 per sub-partition -> 8 warps -> 1.
    # smem 67584 + 1024 = 68608 > 48 KiB + 1 KiB default, so the kernel opted in (227 KiB);
    # 233472 // 68608 = 3.
    assert _one(block_size=256, registers_per_thread=255, dynamic_smem=67584) == (1, 8, 1, 3)


def test_small_elementwise_kernel_is_warp_limited():
    # 128 threads = 4 warps -> 16. 22 regs * 32 = 704 -> 768; 16384 // 768 = 21 -> 84 warps -> 21.
    # no shared memory but 1 KiB reserved: 233472 // 1024 = 228.
    assert _one(block_size=128, registers_per_thread=22) == (16, 16, 21, 228)


def test_static_shared_memory_rounds_up_to_granularity():
    # cub DeviceScanKernel: 128 threads, 64 regs, 12304 B static.
    # regs: 64 * 32 = 2048 per warp; 16384 // 2048 = 8 -> 32 warps -> 8 blocks.
    # smem: 12304 + 1024 = 13328 -> 105 * 128 = 13440; 233472 // 13440 = 17.
    assert _one(block_size=128, registers_per_thread=64, static_smem=12304) == (8, 16, 8, 17)


def test_register_file_overflow_and_oversized_block_give_zero():
    # 1024 threads x 64 regs: 2048 per warp x 32 warps = 65536 fits exactly -> 32 // 32 = 1.
    assert _one(block_size=1024, registers_per_thread=64)[0] == 1
    # 65 regs: 2080 -> 2304 per warp x 32 warps = 73728 > 65536 -> 0.
    assert _one(block_size=1024, registers_per_thread=65)[0] == 0
    # more threads than a block may have
    assert _one(block_size=2048, registers_per_thread=16)[0] == 0
    # shared memory beyond the opt-in limit: 232449 + 1024 -> 233600 > 232448 + 1024
    assert _one(block_size=32, registers_per_thread=16, dynamic_smem=232449)[0] == 0


def test_bad_block_size_is_a_clear_error():
    with pytest.raises(ValueError, match="block size"):
        active_blocks_per_sm(H100, block_size=0, registers_per_thread=16)


def test_kernel_estimates_by_hand():
    # columns: sgemm 256x128 (128 blocks), elementwise (16384 blocks), xmma 64x32 (264 blocks),
    # scan_naive (1 block of 512)
    est = kernel_estimates(
        H100,
        grid=([64, 16384, 8, 1], [2, 1, 1, 1], [1, 1, 33, 1]),
        block=([256, 128, 64, 512], [1, 1, 1, 1], [1, 1, 1, 1]),
        registers_per_thread=[202, 22, 121, 24],
        static_smem=[0, 0, 0, 2176],
        dynamic_smem=[49152, 0, 9600, 0],
    )
    np.testing.assert_allclose(est.blocks_per_sm, [128 / 132, 16384 / 132, 2.0, 1 / 132])
    np.testing.assert_allclose(est.warps_per_sm, [128 / 132 * 8, 16384 / 132 * 4, 4.0, 16 / 132])
    # xmma 64x32: 2 warps -> 32; regs 121*32 = 3872 -> 4096, 4 per sub-partition -> 16 warps -> 8;
    # smem 9600 + 1024 = 10624, 233472 // 10624 = 21 -> active 8.
    # scan_naive: 16 warps -> 4; regs 24*32 = 768 -> 21 -> 84 // 16 = 5;
    # smem 2176 + 1024 = 3200 -> 72 -> active 4.
    np.testing.assert_array_equal(est.active_blocks_per_sm, [1, 16, 8, 4])
    # occupancy = min(blocks per SM, active) * block size / 2048
    np.testing.assert_allclose(
        est.est_achieved_occupancy,
        [(128 / 132) * 256 / 2048, 16 * 128 / 2048, 2 * 64 / 2048, (1 / 132) * 512 / 2048],
    )
    assert est.est_achieved_occupancy[0] == pytest.approx(4 / 33)
    np.testing.assert_allclose(est.sm_efficiency, [128 / 132, 1.0, 1.0, 1 / 132])


def test_fixture_kernels_estimates(fixture):
    b = fixture.batch
    k = b.kernels
    names = b.kernel_names()
    est = kernel_estimates(
        fixture.device,
        (k["grid_x"], k["grid_y"], k["grid_z"]),
        (k["block_x"], k["block_y"], k["block_z"]),
        k["registers"],
        k["static_smem"],
        k["dynamic_smem"],
    )
    sgemm = np.array(["cutlass_80_simt_sgemm_256x128" in n for n in names])
    assert sgemm.sum() == 12
    np.testing.assert_array_equal(est.active_blocks_per_sm[sgemm], 1)
    np.testing.assert_allclose(est.est_achieved_occupancy[sgemm], 4 / 33)
    maximum = np.array([n == "cupy_maximum__float32_float_float32" for n in names])
    assert maximum.sum() == 12
    np.testing.assert_allclose(est.est_achieved_occupancy[maximum], 1.0)
    assert np.all((est.est_achieved_occupancy > 0) & (est.est_achieved_occupancy <= 1))


def test_limits_from_cupy_style_properties():
    props = {
        "name": b"NVIDIA A10", "major": 8, "minor": 6, "multiProcessorCount": 72,
        "maxThreadsPerMultiProcessor": 1536, "regsPerMultiprocessor": 65536,
        "sharedMemPerMultiprocessor": 102400, "sharedMemPerBlockOptin": 101376,
        "maxBlocksPerMultiProcessor": 16, "reservedSharedMemPerBlock": 1024,
        "sharedMemPerBlock": 49152, "regsPerBlock": 65536, "warpSize": 32,
        "maxThreadsPerBlock": 1024,
    }  # fmt: skip
    dev = DeviceLimits.from_attributes(props)
    assert (dev.name, dev.compute_capability, dev.sm_count) == ("NVIDIA A10", (8, 6), 72)
    assert dev.max_warps_per_sm == 48 and dev.max_blocks_per_sm == 16
    # 1024-thread blocks on sm_86: 32 warps -> 48 // 32 = 1 block
    r = active_blocks_per_sm(dev, block_size=1024, registers_per_thread=32)
    assert int(r.active_blocks) == 1
    with pytest.raises(ValueError, match="SM count"):
        DeviceLimits.from_attributes({"major": 9, "minor": 0})
    with pytest.raises(ValueError, match="compute capability"):
        DeviceLimits.from_attributes({"multiProcessorCount": 1})
