#!/usr/bin/env bash
# The Python package on a GPU machine (no Rust, no internet): installs a wheel built elsewhere
# and runs the GPU examples with 2 ranks (on one GPU: under an MPS daemon of its own), then the
# package's host-memory tests.
#
# Where Rust is (x86_64 Linux), build the wheel:
#   pip wheel --no-deps -w .carry ./python        # .carry/mscclpp_rs-0.1.0-py3-none-linux_x86_64.whl
# On the GPU machine, in the source tree (python3 must have cupy, torch, numpy, pytest):
#   python/gpu_examples.sh .carry/mscclpp_rs-*.whl
#
# Steps (each bounded by `timeout`; every byte of every all-gather is checked, and an example
# exits non-zero on a wrong byte):
#   install    python3 -m pip install --no-deps --no-index the wheel; import; which libfabric
#   cupy nvrtc allgather_cupy.py, kernel compiled by NVRTC (CuPy's default), P2P
#   cupy nvcc  the same through CuPy's nvcc backend
#   cupy ib    allgather_cupy.py over libfabric (GPU memory staged), NVRTC
#   torch      allgather_torch.py under torchrun (load_inline), P2P
#   torch ep   examples/ep/ep_torch.py under torchrun (load_inline): MoE dispatch and combine
#              checked against a torch reference; direct, proxied (ep proxy), libfabric tcp (ep ib)
#   numpy      allgather_numpy.py over tcp (host memory)
#   pytest     python/tests (host memory: tcp and shm, bad arguments, dead peers)
# The last line is "N passed, M failed"; the exit status is non-zero if any step failed.
# Output also goes to $OUT/python-gpu-examples.log when OUT is set.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

set -u -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
if [[ $# -ne 1 || ! -f $1 ]]; then
  echo "usage: $0 WHEEL (built with: pip wheel --no-deps -w DIR ./python)" >&2
  exit 2
fi
WHEEL=$1
WORK=${PY_GPU_WORK:-/tmp/mscclpp-py-gpu}
mkdir -p "$WORK"
if [[ -n ${OUT:-} ]]; then
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/python-gpu-examples.log") 2>&1
fi
export MSCCLPP_BOOTSTRAP_TIMEOUT=${MSCCLPP_BOOTSTRAP_TIMEOUT:-60} MSCCLPP_WAIT_TIMEOUT=${MSCCLPP_WAIT_TIMEOUT:-30}
export MSCCLPP_RUN_TIMEOUT=${MSCCLPP_RUN_TIMEOUT:-240}
export TORCH_EXTENSIONS_DIR=$WORK/torch_extensions PYTHONUNBUFFERED=1

names=() results=()
step() { # step NAME SECONDS CMD... (CMD may be a function exported with export -f)
  local name=$1 t=$2 rc
  shift 2
  printf '\n=== %s: %s\n' "$name" "$*"
  timeout -k 5 "$t" bash -c '"$@"' step "$@"
  rc=$?
  names+=("$name")
  if ((rc == 0)); then results+=(PASS); else results+=("FAIL (exit $rc)"); fi
}

# CUDA MPS with pipe and log folders of our own, quit on exit (the daemon outlives us).
export CUDA_MPS_PIPE_DIRECTORY=$WORK/mps-pipe CUDA_MPS_LOG_DIRECTORY=$WORK/mps-log
mps_quit() { [[ -S $CUDA_MPS_PIPE_DIRECTORY/control ]] && echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; }
trap mps_quit EXIT
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if ((ngpu < 2)) && command -v nvidia-cuda-mps-control >/dev/null; then
  rm -rf "$CUDA_MPS_PIPE_DIRECTORY" && mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS daemon started (2 ranks share the GPU)"
fi

install_wheel() {
  python3 -m pip install --no-deps --no-index --force-reinstall "$WHEEL" &&
    (cd "$WORK" && python3 -c 'import mscclpp_rs as m, sys
print("mscclpp_rs", m.__version__, "library", m.version(), "at", m.library_path())
print("libfabric:", m.libfabric_path(), "python", sys.version.split()[0])')
}
export WHEEL WORK
export -f install_wheel
step install 120 install_wheel
ranks() { scripts/run-local-ranks.sh 2 python3 "$@"; }
export -f ranks
step "cupy nvrtc" 240 ranks python/examples/allgather_cupy.py --compiler nvrtc
step "cupy nvcc" 240 ranks python/examples/allgather_cupy.py --compiler nvcc
step "cupy ib" 240 ranks python/examples/allgather_cupy.py --transport ib --sizes 4,4084,1048576
port=$(scripts/free-port.sh)
step torch 400 torchrun --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$port" \
  python/examples/allgather_torch.py
step numpy 120 ranks python/examples/allgather_numpy.py --transport ib
# examples/ep's kernels from Python (built once by load_inline, then cached): the direct path,
# every operation through the proxy, and libfabric tcp (GPU memory staged).
ep_torch() { # EXTRA-ENV... -- ARGS...
  local vars=()
  while [[ $1 != -- ]]; do vars+=("$1"); shift; done
  shift
  env "${vars[@]}" torchrun --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 \
    --master-port "$(scripts/free-port.sh)" examples/ep/ep_torch.py "$@"
}
export -f ep_torch
step "torch ep" 400 ep_torch -- --steps 200
step "torch ep proxy" 200 ep_torch MSCCLPP_P2P_DIRECT_BYTES=0 MSCCLPP_P2P_DIRECT_BLOCK_BYTES=0 -- --steps 30 --warmup 3
step "torch ep ib" 200 ep_torch MSCCLPP_NET_PROVIDER=tcp -- --transport ib --steps 10 --warmup 2 --tokens 1,8
step pytest 300 python3 -m pytest -q -p no:cacheprovider python/tests

passed=0 failed=0
printf '\n%-12s %s\n' step result
for i in "${!names[@]}"; do
  printf '%-12s %s\n' "${names[$i]}" "${results[$i]}"
  if [[ ${results[$i]} == PASS ]]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
done
echo "$passed passed, $failed failed"
((failed == 0))
