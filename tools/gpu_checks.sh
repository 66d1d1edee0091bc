#!/bin/bash
# The checks that need an NVIDIA GPU, in one run with a time limit per step (a machine lent for
# minutes: each step's output goes to a file, so a step that hangs loses nothing of the others).
#
#   tools/gpu_checks.sh [OUT_DIR]     (default: ./gpu-checks; from the repository root)
#
# Needs stepscope's dependencies, CuPy, cupti-python, nvidia-ml-py and torch with CUDA, and a C
# compiler; builds the C extensions in place and the native torch module into a temporary cache.
# Prints each step's tail; the full outputs are in OUT_DIR.
out=${1:-gpu-checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export STEPSCOPE_CACHE_DIR=${STEPSCOPE_CACHE_DIR:-$(mktemp -d)}
t0=$(date +%s)
step() {  # step NAME SECONDS COMMAND...: run it under a hard limit, output to OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  timeout -s KILL "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name: exit $? at $(( $(date +%s) - t0 )) s"
  tail -n 12 "$out/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
step build 120 python3 setup.py -q build_ext --inplace
step build-torch 180 python3 -m stepscope.cli build-torch
step pytest-gpu 240 python3 -m pytest -p no:cacheprovider -q -rs -m gpu tests
# the example on the GPU with NCCL (a world of one: torchrun sets WORLD_SIZE), its report's
# "(detail windows)" tables: backward operators with GPU time, torch's memory in binary units
step example-cuda 120 torchrun --nproc-per-node 1 examples/train_torch.py --device cuda \
  --dir "$out/example" --run-id g --epochs 2 --samples 2048 --batch-size 64
step bench-gpu 120 python3 tools/bench_gpu.py --mode live --steps 300 --repeat 3
step bench-torch-cuda 180 python3 tools/bench_torch.py --device cuda --reps 3
step bench-gpu-summary 150 python3 tools/bench_gpu_summary.py  # the summary level, in pairs
# everything else that a GPU changes: CUDA initialized, NVML and CuPy present, in one process
# after another; each result as it comes (-v) and a stack dump for a test that hangs
step pytest-pytorch-gpu 300 python3 -m pytest -p no:cacheprovider -v -rfs --tb=short \
  -o faulthandler_timeout=100 -n 8 tests/pytorch tests/gpu
