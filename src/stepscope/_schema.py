"""Names shared by the writer, the profiler, the GPU converters and the SQL summaries.

Every string a summary query matches on lives here, so that what is written and what is read can
never drift apart. The SQL files under ``analysis/sql`` use the literal values; a test checks them.

Conventions (all visible to users' own trace-processor scripts):

* One process track per rank, named ``rank <N> (<host>)``; one thread track per thread.
* Slice categories (``slice.category``) say what a slice is. User ranges carry no category unless
  the user gave a domain/category (then ``"<domain>"`` or ``"<domain>,<category>"``).
* Typed arguments land in ``args`` under ``debug.<name>``.
"""

from __future__ import annotations

import re

# --- slice categories -------------------------------------------------------------------------
CAT_STEP = "step"  # one slice per training step, name "step <n>", args step/epoch/num_samples
CAT_PHASE = "phase"  # Dataloader / Forward / Backward / Optimization / any user phase
CAT_DATALOADER = "dataloader"  # time the consumer waited for the next batch
CAT_NVTX = "nvtx"  # ranges captured from the nvtx package (no domain given)
CAT_KERNEL = "kernel"  # GPU compute kernel (CUPTI CONCURRENT_KERNEL)
CAT_COMMUNICATION = "communication"  # GPU collective kernel (NCCL) — classified by name
CAT_MEMCPY = "memcpy"
CAT_MEMSET = "memset"
CAT_SYNC = "sync"  # CUDA synchronization records
CAT_RUNTIME = "cuda_runtime"  # CUDA runtime API calls on the launching thread
CAT_DRIVER = "cuda_driver"  # CUDA driver API calls on the launching thread
CAT_GPU_RANGE = "gpu_range"  # GPU-side ranges timed with CUDA events (no CUPTI)
# a torch.distributed op on the host, issue to completion: not device activity (a gloo op runs
# on the CPU, an NCCL op's kernel is a 'communication' slice of its own)
CAT_COLLECTIVE = "collective"
CAT_STEPSCOPE = "stepscope"  # the profiler's own bookkeeping (dropped events, sampler cost)
# the profiler's own work at a step boundary where the schedule moves on (a detail window's
# start: torch's profiler and CUPTI switched on; its end: their events converted), between the
# steps, category CAT_STEPSCOPE: "stepscope window start", "stepscope window end, start", ...
SCHEDULE_SLICE = "stepscope {}"

# Step phases by convention (any other name is allowed and reported as-is).
PHASE_DATALOADER = "Dataloader"
PHASE_FORWARD = "Forward"
PHASE_BACKWARD = "Backward"
PHASE_OPTIMIZATION = "Optimization"
PHASE_OTHERS = "Others"  # step time not covered by any phase (computed, never written)
PHASES = (PHASE_DATALOADER, PHASE_FORWARD, PHASE_BACKWARD, PHASE_OPTIMIZATION)
# The spellings of those phases that the summaries recognize, in any letter case (ASCII): a
# phase named "fwd" or "FORWARD" is a Forward phase in the Overview. The only definition: the
# summary SQL's test (analysis.summaries.PHASE_KIND_SQL) and the embedded engine's slice base
# are both made from it.
PHASE_ALIASES = {
    PHASE_DATALOADER: ("dataloader", "data_loader", "data-loader", "data loader", "dataloading",
                       "data_loading", "data-loading", "data loading", "data", "load_data",
                       "loader"),
    PHASE_FORWARD: ("forward", "fwd", "fw", "fprop", "forward_pass", "forward-pass",
                    "forward pass"),
    PHASE_BACKWARD: ("backward", "bwd", "bw", "bprop", "backprop", "backward_pass",
                     "backward-pass", "backward pass"),
    PHASE_OPTIMIZATION: ("optimization", "optimisation", "optimizer", "optimiser", "optim",
                         "opt", "optimizer_step", "optimizer-step", "optimizer step",
                         "optimizer.step", "optimiser_step", "optim_step", "opt_step",
                         "opt-step", "opt.step"),
}
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_PHASE_OF_ALIAS = {a: phase for phase, names in PHASE_ALIASES.items() for a in names}


def phase_of(name: str | None) -> str | None:
    """The step phase (one of ``PHASES``) a phase name spells, in any letter case; None for
    any other name. ASCII case only, as SQL's ``lower()``."""
    if name is None:
        return None
    return _PHASE_OF_ALIAS.get(name.translate(_ASCII_LOWER))

STEP_NAME = "step {step}"
DATALOADER_WAIT_NAME = "dataloader.next"
# the last wait of a pass over a loader, which found it exhausted (a multi-process DataLoader
# shuts its workers down there): no batch, so no reader cost, and in no step
DATALOADER_EXHAUSTED_NAME = "dataloader.exhausted"
# a wait of an evaluation pass (pytorch/steps.py: gradients off, or a loader whose passes step
# no optimizer): in no step, no reader cost
DATALOADER_EVAL_NAME = "dataloader.eval"

# --- argument names (written as debug annotations: SQL key "debug.<name>") --------------------
ARG_STEP = "step"
ARG_EPOCH = "epoch"
ARG_NUM_SAMPLES = "num_samples"
ARG_CORRELATION = "correlation_id"
ARG_DEVICE = "device"
ARG_STREAM = "stream"
ARG_BYTES = "bytes"
ARG_COPY_KIND = "copy_kind"  # HtoD, DtoH, DtoD, HtoH, PtoP, ...
ARG_BANDWIDTH = "bandwidth_gbps"
ARG_GRID = ("grid_x", "grid_y", "grid_z")
ARG_BLOCK = ("block_x", "block_y", "block_z")
ARG_REGISTERS = "registers_per_thread"
ARG_SHARED_STATIC = "static_shared_memory"
ARG_SHARED_DYNAMIC = "dynamic_shared_memory"
ARG_BLOCKS_PER_SM = "blocks_per_sm"
ARG_WARPS_PER_SM = "warps_per_sm"
ARG_OCCUPANCY = "est_achieved_occupancy"
ARG_DROPPED = "dropped_events"
ARG_LEFT_OUT = "left_out_records"  # CUPTI records with no usable stamps or outside the window
ARG_CLOCK_DOMAIN = "clock_domain"

# --- track names ------------------------------------------------------------------------------
PROCESS_NAME = "rank {rank} ({host})"
GPU_TRACK_NAME = "GPU {device} ({name})"
STREAM_TRACK_NAME = "stream {stream}"
ASYNC_TRACK_NAME = "async ranges"
DROPPED_TRACK_NAME = "stepscope dropped events"

# Counter tracks (children of the process track). Units are in the descriptor too.
COUNTER_GPU_UTILIZATION = "GPU {device} utilization"
COUNTER_GPU_SM_EFFICIENCY = "GPU {device} est. SM efficiency"
COUNTER_GPU_OCCUPANCY = "GPU {device} est. achieved occupancy"
COUNTER_HOST_PREFIX = "host."  # host metrics: "host.cpu.user %", "host.process.rss", ...
COUNTER_NVML_PREFIX = "nvml."  # "nvml.gpu0.utilization.gpu %", ...
COUNTER_GPM_PREFIX = "gpm."  # "gpm.gpu0.sm_util %", ...

# --- levels -----------------------------------------------------------------------------------
LEVEL_DETAIL = 0  # user ranges, captured nvtx, device activity: only in detail windows
LEVEL_SUMMARY = 1  # steps, phases, loader waits, counters: the whole run

# --- profiler (issue 4): host metric counter tracks, children of the rank's process track -------
# name -> unit written in the counter descriptor. Rates are per second over the sample interval.
HOST_CPU_USER = "host.cpu.user %"  # system-wide CPU time in user mode (+nice), % of all cores
HOST_CPU_SYSTEM = "host.cpu.system %"  # system-wide kernel time (+irq, softirq), % of all cores
HOST_CPU_IDLE = "host.cpu.idle %"
HOST_CPU_IOWAIT = "host.cpu.iowait %"
HOST_CPU_STEAL = "host.cpu.steal %"  # time a VM's vCPUs waited for the hypervisor
HOST_PROCESS_CPU = "host.process.cpu %"  # this process, % of one core (can exceed 100)
HOST_PROCESS_CTX_SWITCHES = "host.process.ctx_switches/s"  # voluntary + involuntary
HOST_CTX_SWITCHES = "host.cpu.ctx_switches/s"  # system-wide
HOST_PROCESS_RSS = "host.process.rss"  # bytes
HOST_MEMORY_USED = "host.memory.used"  # bytes, system-wide (psutil virtual_memory().used)
HOST_DISK_READ = "host.disk.read bytes/s"
HOST_DISK_WRITE = "host.disk.write bytes/s"
HOST_NET_SENT = "host.net.sent bytes/s"
HOST_NET_RECV = "host.net.recv bytes/s"
HOST_SAMPLER_CPU = "host.sampler.cpu %"  # the sampler thread's own CPU time, % of one core
# Per-rank output files written by the profiler under <dir>/<run-id>/.
SUMMARY_FILE = "rank{rank}.summary.pftrace"
DETAIL_FILE = "rank{rank}.detail.{window}.pftrace"  # one file per schedule window

# --- GPU (issue 5: stepscope.gpu) -------------------------------------------------------------
API_TRACK_NAME = "CUDA API"  # runtime/driver API slices, child track of the launching thread
# a thread's steps (and the profiler's own work between them), child track of the thread: a
# track of their own, so a range of the thread that spans steps never nests with them
STEPS_TRACK_NAME = "steps"
SYNC_TRACK_NAME = "sync"  # CUDA synchronization records, child track of the GPU track
ARG_SYNC_TYPE = "sync_type"  # Stream synchronize, Context synchronize, Event synchronize, ...
ARG_SRC_KIND = "src_kind"  # memcpy source memory: Device, Pageable, Pinned, Managed, ...
ARG_DST_KIND = "dst_kind"
ARG_CBID = "cbid"  # CUPTI callback id of a runtime/driver API call
ARG_GRAPH_ID = "graph_id"  # CUDA graph that ran the record (only on graph work)
ARG_GRAPH_NODE_ID = "graph_node_id"
GPU_COUNTER_UNIT = "%"  # utilization, est. SM efficiency, est. achieved occupancy: 0..100
COUNTER_CUPY_PREFIX = "cupy."  # "cupy.gpu0.pool.used", "cupy.gpu0.pool.total" (bytes)
# NVML / GPM counter tracks ({device} = CUDA ordinal, see gpu/nvml.py); units in the descriptors.
COUNTER_NVML_UTILIZATION = "nvml.gpu{device}.utilization.gpu %"
COUNTER_NVML_MEMORY_USED = "nvml.gpu{device}.memory.used"
COUNTER_NVML_POWER = "nvml.gpu{device}.power W"
COUNTER_NVML_SM_CLOCK = "nvml.gpu{device}.clocks.sm MHz"
COUNTER_GPM_SM_UTIL = "gpm.gpu{device}.sm_util %"
COUNTER_GPM_SM_OCCUPANCY = "gpm.gpu{device}.sm_occupancy %"
COUNTER_GPM_TENSOR_UTIL = "gpm.gpu{device}.tensor_util %"
COUNTER_GPM_DRAM_BW_UTIL = "gpm.gpu{device}.dram_bw_util %"
GPU_RANGE_TRACK_NAME = "CUDA events"  # "CUDA events (stream <ptr>)" under the GPU track

# --- PyTorch (issue 20: stepscope.pytorch) ----------------------------------------------------
CAT_TORCH_OP = "torch_op"  # an operator from torch's profiler (aten::mm, autograd nodes)
CAT_RECORD_FUNCTION = "record_function"  # torch.profiler.record_function ranges
CAT_DATALOADER_WORKER = "dataloader_worker"  # fetch/__getitem__/collate in a DataLoader worker
ARG_INPUT_SHAPES = "input_shapes"  # an operator's input shapes, "[[64, 64], [64]]"
ARG_INPUT_DTYPES = "input_dtypes"  # an operator's input dtypes, "float, float"
ARG_OP = "op"  # a collective's op: allreduce, broadcast, send, ...
ARG_BYTES = "bytes"  # a collective's input bytes (a recv's: its buffer's)
ARG_DTYPE = "dtype"
ARG_GROUP_SIZE = "group_size"
ARG_GROUP = "group"  # the process group's name
# where a collective's slice ends other than at its completion: absent = at its completion
ARG_COMPLETION = "completion"
# no completion to wait for, and no wait() on its work from Python: ended when issued
COMPLETION_ISSUED = "issued"
# enqueued on a device stream (NCCL: its work's future completes when the op is issued); the
# device's 'communication' kernel is its time
COMPLETION_STREAM = "stream"
# no completion to wait for (gloo's reduce_scatter_tensor, isend/irecv): ended when the program's
# wait() on its work returned, later than its issue (its completion at the latest). Where torch's
# own function waits at once (dist.send, a synchronous reduce_scatter_tensor: FSDP's), that end
# is its completion and the slice has no such arg
COMPLETION_WAITED = "waited"
COLLECTIVES_TRACK_NAME = "collectives"  # child tracks of the rank's process, one per lane
WORKER_THREAD_NAME = "DataLoader worker {worker} (pid {pid})"  # a thread of the rank's process
WORKER_FILE = "rank{rank}.summary.worker{worker}-{pid}.pftrace"  # merged with the rank's summary
COUNTER_WORKER_CPU = "{worker}.cpu %"  # a DataLoader worker's CPU time, % of one core
COUNTER_CUDA_ALLOCATED = "torch.cuda{device}.memory.allocated"  # bytes, at each step end
COUNTER_CUDA_RESERVED = "torch.cuda{device}.memory.reserved"
COUNTER_CUDA_PEAK = "torch.cuda{device}.memory.peak"  # max allocated since the previous step end

# the counters in bytes ({device}: any CUDA ordinal), which the summaries show in binary units;
# besides these, every counter whose name ends in " bytes" or ".bytes" (and "bytes/s": a rate)
BYTE_COUNTERS = (HOST_PROCESS_RSS, HOST_MEMORY_USED, COUNTER_NVML_MEMORY_USED,
                 COUNTER_CUPY_PREFIX + "gpu{device}.pool.used",
                 COUNTER_CUPY_PREFIX + "gpu{device}.pool.total",
                 COUNTER_CUDA_ALLOCATED, COUNTER_CUDA_RESERVED, COUNTER_CUDA_PEAK)


# --- reading the file names back ----------------------------------------------------------------
def _name_pattern(fmt: str) -> re.Pattern[str]:
    """The regular expression of a file name format above: each ``{field}`` a number."""
    parts = re.split(r"\{\w+\}", fmt)
    return re.compile("^" + r"(\d+)".join(map(re.escape, parts)) + "$")


_FILE_ROLES = (("summary", _name_pattern(SUMMARY_FILE)), ("detail", _name_pattern(DETAIL_FILE)),
               ("worker", _name_pattern(WORKER_FILE)))


def rank_file(name: str) -> tuple[str, int] | None:
    """``(role, rank)`` of a file the profiler names (``"summary"``: ``SUMMARY_FILE``,
    ``"detail"``: ``DETAIL_FILE``, ``"worker"``: ``WORKER_FILE``), else None. Read back from
    the same formats the profiler writes with, so that the run directory's reader and the
    merge never disagree with the writer on what a rank file is."""
    for role, pattern in _FILE_ROLES:
        m = pattern.match(name)
        if m:
            return role, int(m.group(1))
    return None
