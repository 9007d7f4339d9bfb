#!/usr/bin/env bash
# The demo, from a fresh clone:
#
#   scripts/demo.sh
#
# Installs missing Debian packages, builds libmscclpp with cargo through CMake, installs the
# CMake package into ./install, builds the C examples against it (find_package) and runs the
# demo with 4 ranks as local processes: with GPUs and nvcc, the CUDA all-gather over P2P
# (c_examples/cuda/allgather.cu, rank r on GPU r % ngpus); otherwise allgather_host, a host
# buffer all-gathered over libfabric (tcp on loopback; MSCCLPP_NET_PROVIDER picks another
# provider), with every byte verified and the bandwidth and putWithSignal latency printed.
#
# Needs Debian/Ubuntu and a Rust toolchain (cargo). Environment: MSCCLPP_DEMO_PROGRAM (a
# program of c_examples, default below), MSCCLPP_DEMO_RANKS (default 4), CARGO_TARGET_DIR
# (default ./target), MSCCLPP_RUN_TIMEOUT (seconds, default 120).
set -euo pipefail

MSCCLPP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$MSCCLPP_ROOT"
# shellcheck source=scripts/common.sh
source scripts/common.sh

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 &&
  { command -v nvcc >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]]; }; then
  export PATH=$PATH:/usr/local/cuda/bin
  default_program=allgather
else
  default_program=allgather_host
fi
program=${MSCCLPP_DEMO_PROGRAM:-$default_program}
ranks=${MSCCLPP_DEMO_RANKS:-4}

echo "== system packages and Rust toolchain"
ensure_apt_packages
ensure_cargo

echo "== build libmscclpp and install it into ./install"
build_and_install build/cmake "$MSCCLPP_ROOT/install" \
  -DMSCCLPP_CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$MSCCLPP_ROOT/target}" -DMSCCLPP_BUILD_TESTS=OFF

echo "== build c_examples against ./install"
build_examples build/c_examples "$MSCCLPP_ROOT/install"

echo "== run $program with $ranks local ranks"
scripts/run-local-ranks.sh "$ranks" "build/c_examples/$program"
