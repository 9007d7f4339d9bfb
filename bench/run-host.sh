#!/usr/bin/env bash
# Host-memory benchmark: our put bandwidth and 8-byte signal latency through the C API next to
# a minimal raw-libfabric program on the same provider, in one run (numbers for
# bench/RESULTS.md). Two local processes each; no GPU.
#
#   bench/run-host.sh [provider...]        default: tcp shm net
#
# Raw: crates/libfabric-sys/examples/raw_rma.rs (fi_write with 16 in flight, then an ordered
# flag the target echoes). Ours: examples/put_bench.rs (back-to-back mscclppDevConnPut, then
# signal + flush, which returns once the data was delivered; ping-pong of putWithSignal/wait).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
providers=("$@")
((${#providers[@]})) || providers=(tcp shm net)
cargo build --release -q -p libfabric-sys --example raw_rma
cargo build --release -q --example put_bench
t=${CARGO_TARGET_DIR:-target}/release/examples
echo "# $(date -u +%F) $(uname -n) $(nproc) cores, libfabric $(pkg-config --modversion libfabric)"
for p in "${providers[@]}"; do
  echo "## provider $p: raw libfabric (plain fi_write)"
  timeout 300 "$t/raw_rma" --provider "$p"
  echo "## provider $p: raw libfabric, FI_DELIVERY_COMPLETE on every write"
  timeout 300 "$t/raw_rma" --provider "$p" --dc
  echo "## provider $p: libmscclpp (C API, host memory)"
  timeout 300 "$t/put_bench" --provider "$p"
done
