#!/usr/bin/env bash
# How the phases of a communicator grow with the number of ranks on this host: init, setup
# (all-to-all connections and proxy launch), one verified all-to-all round of 4 KiB
# (putWithSignal, flush, wait from host threads), teardown (proxy stop and destroy); rank 0's
# times, from `c_examples/allgather_host`'s RESULT line.
#
#   bench/scale.sh [ib|shm] [N ...]          default: ib 8 16 32 64
#   SCALE_REPEAT=3 bench/scale.sh ib 128     each count three times
#
# The "first round" is every rank's first all-to-all (connections are made on first use),
# the "warm round" every rank's second: their median and slowest rank show whether some rank
# falls behind the others.
# Builds the package and the C examples under build/scale first (scripts/common.sh), like the
# demo. Each run is bounded by MSCCLPP_RUN_TIMEOUT (default here 600 s); a failed run is
# reported in the table and the sweep goes on. Prints a Markdown table.
set -uo pipefail
MSCCLPP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$MSCCLPP_ROOT"
# shellcheck source=scripts/common.sh
source scripts/common.sh
transport=${1:-ib}
shift || true
counts=("$@")
((${#counts[@]})) || counts=(8 16 32 64)
ensure_apt_packages && ensure_cargo || exit 1
build_and_install build/scale/cmake "$MSCCLPP_ROOT/build/scale/install" \
  -DMSCCLPP_CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$MSCCLPP_ROOT/target}" -DMSCCLPP_BUILD_TESTS=OFF \
  >/dev/null || exit 1
build_examples build/scale/c_examples "$MSCCLPP_ROOT/build/scale/install" >/dev/null || exit 1
export MSCCLPP_RUN_TIMEOUT=${MSCCLPP_RUN_TIMEOUT:-600}
echo "# $(date -u +%F) $(uname -n), $(nproc) cores, transport $transport, 4 KiB per rank, ${SCALE_REPEAT:-1} run(s) each"
echo "| ranks | transport | init | setup | round (rank 0) | first round median / slowest | warm round median / slowest | teardown | wall |"
echo "|---|---|---|---|---|---|---|---|---|"
for n in "${counts[@]}"; do
  for ((rep = 0; rep < ${SCALE_REPEAT:-1}; rep++)); do
    t0=$SECONDS
    out=$(scripts/run-local-ranks.sh "$n" build/scale/c_examples/allgather_host \
      -t "$transport" -s 4096 -i 1 -p 0 2>&1)
    rc=$?
    line=$(grep -o 'RESULT phases.*' <<<"$out" | head -1)
    if ((rc != 0)) || [[ -z $line ]]; then
      echo "| $n | $transport | FAILED (exit $rc) | | | | | | $((SECONDS - t0)) s |"
      grep -m 3 -E 'WARN|error|FAILED' <<<"$out" | sed 's/^/    /' >&2
      continue
    fi
    get() { sed -E "s/.* $1=([0-9.]+).*/\1/" <<<"$line"; }
    echo "| $n | $transport | $(get init_s) s | $(get setup_s) s | $(get round_s) s | $(get round_med_s) / $(get round_max_s) s | $(get warm_med_s) / $(get warm_max_s) s | $(get teardown_s) s | $((SECONDS - t0)) s |"
  done
done
