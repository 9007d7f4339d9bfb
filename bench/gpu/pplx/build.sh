#!/usr/bin/env bash
# Builds pplx-kernels (perplexityai/pplx-kernels HEAD 2bd6e30fab358829bd01d1c0907be8088ff9e5e1)
# offline against python3's torch and the pip wheel nvidia-nvshmem-cu13, which ships no CMake
# package files (a stand-in NVSHMEMConfig.cmake sits beside this script).
# Output: $SRC/src/pplx_kernels/libpplx_kernels.so (csrc/CMakeLists.txt:73-76).
#   SRC=folder of the pplx-kernels tree (required; bench/gpu/pplx/README.md says how to get it)
#   PYTHON=python3, JOBS=nproc, PPLX_SM_PATCH=1 (0 leaves csrc/core/cuda_utils.h untouched)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SRC=${SRC:?SRC: the pplx-kernels tree}
PY=${PYTHON:-python3}
SP=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
NVSHMEM_HOME=${NVSHMEM_HOME:-$($PY -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])')}
TORCH_PREFIX=$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
echo "python $PY ($SP); torch cmake $TORCH_PREFIX; NVSHMEM $NVSHMEM_HOME; nvcc $NVCC; CUDA root $CUDA_ROOT"
ls "$NVSHMEM_HOME/include/nvshmem.h" "$NVSHMEM_HOME/lib/libnvshmem_host.so.3" "$NVSHMEM_HOME/lib/libnvshmem_device.a" >/dev/null

# torch's ATen/cuda/CUDAContextLight.h includes cusparse.h, cublas_v2.h, cusolverDn.h. A toolkit
# without them: take torch's own pip copies, searched after every other include directory.
EXTRA_CXX=""
if [[ ! -f $CUDA_ROOT/include/cusparse.h && -f $SP/nvidia/cu13/include/cusparse.h ]]; then
  EXTRA_CXX="-idirafter $SP/nvidia/cu13/include"
fi

# patch_once FILE MARK OLD NEW: FILE's one OLD becomes NEW, unless MARK (a piece of NEW) is
# there already; fails where OLD is not there exactly once (the upstream text changed).
patch_once() {
  grep -qF -- "$2" "$1" && return 0
  $PY - "$@" <<'PYEOF'
import sys
path, _, old, new = sys.argv[1:]
s = open(path).read()
assert s.count(old) == 1, f"{path} changed upstream; patch not applied"
open(path, "w").write(s.replace(old, new))
print("patched", path)
PYEOF
}

# Opt-in grid cap (only active when the environment sets PPLX_NUM_SMS): get_sm_count()
# (csrc/core/cuda_utils.h:24-31) sizes every cooperative grid. Ranks sharing one GPU need their
# combine grids (1024 threads x 56 registers: one block per SM) to fit on the GPU together.
if [[ ${PPLX_SM_PATCH:-1} == 1 ]]; then
  patch_once "$SRC/csrc/core/cuda_utils.h" PPLX_NUM_SMS $'  return numSMs;\n}' \
    $'  // bench/gpu/pplx patch: PPLX_NUM_SMS caps the grid (ranks sharing one GPU)\n  if (const char *cap = std::getenv("PPLX_NUM_SMS")) {\n    int v = std::atoi(cap);\n    if (v > 0 && v < numSMs) numSMs = v;\n  }\n  return numSMs;\n}'
fi

# Race fix (PPLX_DISPATCH_FIX=1, default on): intranode_dispatch.cu stages each token in shared
# memory (lines 102-125) and warps 0..7 copy it out (131-180), but the loop over tokens (97) has no
# __syncthreads() at its end, so when a block sends more than one token (numSendTokens > grid,
# e.g. under the PPLX_NUM_SMS cap) idle/finished warps overwrite the staged token while other warps
# are still sending it. Adds the missing barrier.
if [[ ${PPLX_DISPATCH_FIX:-1} == 1 ]]; then
  patch_once "$SRC/csrc/all_to_all/intranode_dispatch.cu" "bench/gpu/pplx patch: WAR barrier" \
    $'          d += WARP_SIZE;\n        }\n      }\n    }\n\n    // Wait for all blocks to finish copying tokens to the shared buffers.' \
    $'          d += WARP_SIZE;\n        }\n      }\n      __syncthreads(); // bench/gpu/pplx patch: WAR barrier before the next token overwrites shared memory\n    }\n\n    // Wait for all blocks to finish copying tokens to the shared buffers.'
fi

export TORCH_CUDA_ARCH_LIST=9.0a
time cmake -S "$SRC/csrc" -B "$SRC/build-cmake" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
  -DTORCH_CUDA_ARCH_LIST=9.0a -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DCMAKE_CUDA_COMPILER="$NVCC" -DCUDAToolkit_ROOT="$CUDA_ROOT" -DCUDA_TOOLKIT_ROOT_DIR="$CUDA_ROOT" \
  -DPython_EXECUTABLE="$(command -v "$PY")" \
  -DNVSHMEM_DIR="$HERE" -DNVSHMEM_HOME="$NVSHMEM_HOME" \
  ${EXTRA_CXX:+-DCMAKE_CXX_FLAGS="$EXTRA_CXX"}
time ninja -C "$SRC/build-cmake" -j "${JOBS:-$(nproc)}" pplx_kernels
ls -la "$SRC/src/pplx_kernels/libpplx_kernels.so"
