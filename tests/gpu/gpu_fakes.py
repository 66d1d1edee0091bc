"""A stand-in for ``cupti.cupti`` that hands recorded records to the live path."""

from __future__ import annotations

import enum
import time
from types import SimpleNamespace

import numpy as np


class ActivityKind(enum.IntEnum):  # CUpti_ActivityKind values
    MEMCPY = 1
    MEMSET = 2
    DRIVER = 4
    RUNTIME = 5
    CONCURRENT_KERNEL = 10
    SYNCHRONIZATION = 38


class RuntimeCbid(enum.IntEnum):
    cudaGetDevice_v3020 = 17
    cudaMemcpyAsync_v3020 = 41
    cudaMemsetAsync_v3020 = 51
    cudaStreamSynchronize_v3020 = 131
    cudaEventSynchronize_v3020 = 138
    cudaDeviceSynchronize_v3020 = 165
    cudaLaunchKernel_v7000 = 211
    cudaLaunchKernelExC_v11060 = 430


class DriverCbid(enum.IntEnum):
    cuCtxGetCurrent = 677
    cuLaunchKernel = 307


class FakeCupti:
    """Just enough of cupti-python's activity API; flush hands the records over in 3 buffers."""

    ActivityKind = ActivityKind
    runtime_api_trace_cbid = RuntimeCbid
    driver_api_trace_cbid = DriverCbid

    def __init__(self, records, *, per_api=False, dropped=2):
        self.records = records
        self.enabled: set[int] = set()
        self.api_enabled: list[tuple[str, int]] = []
        self.dropped = dropped
        if per_api:
            self.activity_enable_runtime_api = lambda c, on: self.api_enabled.append(("rt", c, on))
            self.activity_enable_driver_api = lambda c, on: self.api_enabled.append(("drv", c, on))

    def activity_register_callbacks(self, requested, completed):
        self.requested, self.completed = requested, completed

    def activity_enable(self, kind):
        self.enabled.add(int(kind))

    def activity_disable(self, kind):
        self.enabled.discard(int(kind))

    def get_timestamp(self):
        return time.time_ns() - 3000

    def activity_get_num_dropped_records(self, ctx, stream):
        return self.dropped

    def activity_flush_all(self, flag):
        size, _ = self.requested()
        assert size > 0
        objs = [
            SimpleNamespace(**{**r, "kind": int(ActivityKind[r["kind"]])}) for r in self.records
        ]
        for part in np.array_split(np.arange(len(objs)), 3):
            self.completed([objs[i] for i in part])
