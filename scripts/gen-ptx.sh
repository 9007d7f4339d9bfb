#!/usr/bin/env bash
# Regenerates the PTX the library embeds (src/cuda/kernels/*.ptx) from its CUDA source. The Rust
# build has no CUDA compiler (CI has none), so the PTX is committed; tests/ptx.rs checks it is
# current wherever the two tools below are found, and (in CI too) that it declares ISA 8.0.
#
# PTX ISA 8.0 (CUDA 12.0): a driver loads PTX of its own CUDA release or older, so 8.0 loads on
# every driver from CUDA 12.0 on; the ISA 9.0 that CUDA 13's nvcc writes would need a 13.0
# driver, and on older ones the SM engine would be off. The kernel needs less (ptxas asks for
# 6.3: the sm_75 target, nanosleep); 8.0 covers every CUDA 12 driver and is checked below by
# the 12.0 assembler (a lower ISA would need an older one to check it).
# The PTX is made by CUDA 13.0's nvcc for compute_75 and its `.version` line set to 8.0. CUDA
# 12.0's nvcc is not on PyPI (its wheel holds ptxas and libNVVM only), but its ptxas is: it is
# the assembler a 12.0 driver runs, and it refuses any instruction or syntax newer than the ISA
# a file declares, so every file must assemble with it (sm_75, sm_90), and with nvcc's own
# ptxas (sm_90, sm_100), or this script fails.
#   NVCC=/path/to/nvcc PTXAS12=/path/to/ptxas-of-12.0 scripts/gen-ptx.sh [--check]
# Without a CUDA toolkit, NVIDIA's pip wheels give both (no GPU needed):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 "nvidia-cuda-nvcc==13.0.*" "nvidia-nvvm==13.0.*" \
#     "nvidia-cuda-crt==13.0.*" "nvidia-cuda-runtime==13.0.*"
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "nvidia-cuda-nvcc-cu12==12.0.*"
#   unzip the CUDA 13 wheels into one folder R13 and the 12.0 one into R12, then
#   NVCC=R13/nvidia/cu13/bin/nvcc PTXAS12=R12/nvidia/cuda_nvcc/bin/ptxas. The same nvcc
#   compile-checks the CUDA examples (-arch=sm_90 -Iinclude -Ic_examples/common -c).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
PTXAS12=${PTXAS12:-}
ISA=8.0
check=0
[[ ${1:-} == --check ]] && check=1
if [[ -z $PTXAS12 || $("$PTXAS12" --version 2>/dev/null) != *"release 12.0,"* ]]; then
  echo "gen-ptx.sh: set PTXAS12 to CUDA 12.0's ptxas (see the recipe at the top of this script)" >&2
  exit 2
fi
NVCC_PTXAS=$(dirname "$NVCC")/ptxas
status=0
for cu in "$ROOT"/src/cuda/kernels/*.cu; do
  ptx=${cu%.cu}.ptx
  tmp=$(mktemp)
  obj=$(mktemp)
  "$NVCC" -ptx -arch=compute_75 -O3 -o "$tmp" "$cu"
  # The header names the compiler build; keep the file stable across builds of one version.
  sed -i -E '/^\/\/ (Compiler Build ID|Based on|Cuda compilation tools)/d' "$tmp"
  made=$(sed -n -E 's/^\.version ([0-9]+\.[0-9]+)$/\1/p' "$tmp")
  if [[ $(printf '%s\n%s\n' "$ISA" "$made" | sort -V | head -1) != "$ISA" ]]; then
    echo "$NVCC wrote PTX ISA '$made', older than $ISA: use CUDA 13.0's nvcc" >&2
    exit 1
  fi
  sed -i -E "s/^\\.version [0-9]+\\.[0-9]+\$/.version $ISA/" "$tmp"
  for arch in sm_75 sm_90; do
    "$PTXAS12" -arch=$arch -o "$obj" "$tmp" || { echo "CUDA 12.0's ptxas refuses $cu's PTX as ISA $ISA for $arch" >&2; exit 1; }
  done
  if [[ -x $NVCC_PTXAS ]]; then
    for arch in sm_90 sm_100; do
      "$NVCC_PTXAS" -arch=$arch -o "$obj" "$tmp" || { echo "$NVCC_PTXAS refuses $cu's PTX for $arch" >&2; exit 1; }
    done
  fi
  rm -f "$obj"
  if ((check)); then
    if ! cmp -s "$tmp" "$ptx"; then
      echo "$ptx is stale: run scripts/gen-ptx.sh" >&2
      status=1
    fi
    rm -f "$tmp"
  else
    cat "$tmp" >"$ptx"
    rm -f "$tmp"
  fi
done
exit $status
