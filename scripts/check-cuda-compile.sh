#!/usr/bin/env bash
# Compiles every CUDA source that a GPU run builds, for sm_90, compile only (-c: nothing is
# linked or run, no GPU needed): the CUDA examples (c_examples/cuda), the perf tools (one per
# operation), examples/ep, the GPU benchmarks of bench/gpu and the NVSHMEM peers, and the two
# diagnostic builds of ep and its NVSHMEM peer (-DEP_SIGNAL_CLOCKS, -DEP_STAMPS). Its nvcc is
# the device machines' release (13.0), from NVIDIA's PyPI wheels in a venv, unless NVCC names
# one. A compile error here costs a CI step, not a call on a GPU machine.
#
#   scripts/check-cuda-compile.sh [VENV_DIR]   (default build/cuda-venv; reused when present)
#
# Leaves VENV_DIR/nvcc, a wrapper of the wheels' nvcc (which finds its headers from where it
# lies, so a link would not do), for other checks (scripts/test.sh's header compile).
# Exit 0 when every source compiles; the failing sources' errors are printed.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-$root/build/cuda-venv}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Pinned to what the GPU machines run (nvcc 13.0.88, NVSHMEM 3.4.5), so that a source that
# compiles here compiles there. A pip whose install fails is reported as such.
wheels=(nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85 nvidia-nvshmem-cu13==3.4.5)
if [[ -n ${NVCC:-} ]]; then
  nvcc=$NVCC
  nvshmem=${NVSHMEM_HOME:-}
else
  if [[ ! -x $venv/bin/python ]] && ! python3 -m venv "$venv"; then
    echo "check-cuda-compile: cannot make a venv at $venv" >&2
    exit 1
  fi
  if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check "${wheels[@]}"; then
    echo "check-cuda-compile: pip could not install ${wheels[*]}" >&2
    exit 1
  fi
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cu=$site/nvidia/cu13
  nvcc=$cu/bin/nvcc
  nvshmem=$site/nvidia/nvshmem
  # A file of its own (removed first: a link left there would be written through).
  rm -f "$venv/nvcc" && printf '#!/bin/sh\nexec "%s" "$@"\n' "$nvcc" >"$venv/nvcc" && chmod +x "$venv/nvcc"
fi
"$nvcc" --version | tail -1

inc=(-I"$root/include" -I"$root/c_examples/common")
jobs=() # "name|flags...|source", compiled below
for src in "$root"/c_examples/cuda/*.cu; do
  name=$(basename "$src" .cu)
  flags=""
  # As gpu-check builds it: regwrite checks the per-thread default stream.
  [[ $name == regwrite ]] && flags="--default-stream=per-thread"
  jobs+=("$name|$flags|$src")
done
for op in allgather alltoall sendrecv; do
  jobs+=("${op}_perf|-DPERF_OP=OP_${op^^}|$root/c_examples/perf/perf.cu")
done
jobs+=("ep|-I$root/c_examples/cuda|$root/examples/ep/ep.cu")
# The diagnostic builds the A/B script makes on the GPU machine (bench/gpu/ep-ab.sh).
jobs+=("ep_clocks|-DEP_SIGNAL_CLOCKS -I$root/c_examples/cuda|$root/examples/ep/ep.cu")
jobs+=("driver_costs||$root/bench/gpu/driver_costs.cu")
jobs+=("fifo_engine_proto||$root/bench/gpu/fifo_engine_proto.cu")
if [[ -n $nvshmem && -f $nvshmem/include/nvshmem.h ]]; then
  for name in nvshmem_perf nvshmem_pingpong nvshmem_ep; do
    jobs+=("$name|-rdc=true -I$nvshmem/include|$root/bench/gpu/$name.cu")
  done
  jobs+=("nvshmem_ep_stamps|-rdc=true -DEP_STAMPS -I$nvshmem/include|$root/bench/gpu/nvshmem_ep.cu")
else
  echo "check-cuda-compile: no NVSHMEM headers (NVSHMEM_HOME): the NVSHMEM peers are not compiled"
fi

compile() { # name|flags|source
  local name=${1%%|*} rest=${1#*|}
  local flags=${rest%%|*} src=${rest#*|}
  # shellcheck disable=SC2086 # flags is a list of words
  if "$nvcc" -c -O2 -std=c++17 -arch=sm_90 "${inc[@]}" $flags "$src" \
    -o "$tmp/$name.o" >"$tmp/$name.log" 2>&1; then
    echo "  ok    $name"
  else
    echo "  FAIL  $name ($src)"
    sed 's/^/        /' "$tmp/$name.log" | head -40
  fi
}

# Two at a time (CI has 2 cores), each into a numbered file, printed in order after.
for ((k = 0; k < ${#jobs[@]}; k += 2)); do
  compile "${jobs[k]}" >"$tmp/$(printf 'result.%03d' "$k")" &
  if ((k + 1 < ${#jobs[@]})); then compile "${jobs[k + 1]}" >"$tmp/$(printf 'result.%03d' $((k + 1)))"; fi
  wait
done
cat "$tmp"/result.*
n=${#jobs[@]}
fail=$(cat "$tmp"/result.* | grep -c '^  FAIL')
echo "cuda compile: $((n - fail)) of $n sources compiled"
((fail == 0))
