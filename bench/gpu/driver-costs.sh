#!/usr/bin/env bash
# Builds and runs bench/gpu/driver_costs.cu on a machine with 2 GPUs (the device machine):
# both directions, the proxy thread's CPU left to the scheduler and pinned to two cores.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
BIN=${TMPDIR:-/tmp}/driver_costs
"$NVCC" -O2 -std=c++17 -arch=sm_90 -o "$BIN" "$HERE/driver_costs.cu" -lcuda
lscpu | grep -E '^(CPU\(s\)|NUMA|Model name|Socket)' || true
for pair in "0 1" "1 0"; do
  timeout 120 "$BIN" $pair
  timeout 120 taskset -c 3 "$BIN" $pair
done
