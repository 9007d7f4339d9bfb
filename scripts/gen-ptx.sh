#!/usr/bin/env bash
# Regenerates the PTX the library embeds (src/cuda/kernels/*.ptx) from its CUDA source. The Rust
# build has no CUDA compiler (CI has none), so the PTX is committed; tests/ptx.rs checks it is
# current wherever nvcc is found. PTX for compute_75 from CUDA 13.0: the driver compiles it for
# the GPU at run time (any GPU CUDA 13 supports; drivers older than 13.0 refuse it, and the
# library then uses the copy engines alone).
#   scripts/gen-ptx.sh [--check]      NVCC=/path/to/nvcc to choose the compiler
# Without a CUDA toolkit, NVIDIA's pip wheels give this nvcc (no GPU needed):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 "nvidia-cuda-nvcc==13.0.*" "nvidia-nvvm==13.0.*" \
#     "nvidia-cuda-crt==13.0.*" "nvidia-cuda-runtime==13.0.*"
#   unzip each wheel into one folder R, then NVCC=R/nvidia/cu13/bin/nvcc. The same nvcc
#   compile-checks the CUDA examples (-arch=sm_90 -Iinclude -Ic_examples/common -c).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
check=0
[[ ${1:-} == --check ]] && check=1
status=0
for cu in "$ROOT"/src/cuda/kernels/*.cu; do
  ptx=${cu%.cu}.ptx
  tmp=$(mktemp)
  "$NVCC" -ptx -arch=compute_75 -O3 -o "$tmp" "$cu"
  # The header names the compiler build; keep the file stable across builds of one version.
  sed -i -E '/^\/\/ (Compiler Build ID|Based on|Cuda compilation tools)/d' "$tmp"
  if ((check)); then
    if ! cmp -s "$tmp" "$ptx"; then
      echo "$ptx is stale: run scripts/gen-ptx.sh" >&2
      status=1
    fi
    rm -f "$tmp"
  else
    mv "$tmp" "$ptx"
  fi
done
exit $status
