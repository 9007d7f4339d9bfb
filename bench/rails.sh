#!/usr/bin/env bash
# Bandwidth over 1, 2 and 4 rails (striping, issue 16): two network namespaces joined by four
# veth pairs (10.97.K.1 and 10.97.K.2), one rank in each, sendrecv_perf on host memory over the
# IB transport (tcp), the rails named by MSCCLPP_NET_IFACE (veth0a, veth0a+veth1a, ...). The
# rail counts alternate, ROUNDS times (default 3), into bench/results/MACHINE-rails.txt, each
# run's nccl-tests output after a line `## run rails=N ROUND MACHINE`.
#
#   bench/rails.sh [ROUNDS]      PERF_SIZES (default "-b 64K -e 64M -f 4"), PERF_ITERS
#                                ("-n 20 -w 5"), PERF_BIN (the tools' directory, else built)
#                                MSCCLPP_NET_STRIPE_CHUNK is passed through.
# Needs root and ip (iproute2). Every veth pair rides on the same kernel, so the rails share
# this machine's cores: the numbers show what striping costs and gains in the library, not a
# NIC's wire speed.
set -uo pipefail
MSCCLPP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$MSCCLPP_ROOT"
# shellcheck source=scripts/common.sh
source scripts/common.sh
rounds=${1:-3}
sizes=${PERF_SIZES:--b 64K -e 64M -f 4}
iters=${PERF_ITERS:--n 20 -w 5}
outdir=${PERF_OUT:-bench/results}
mkdir -p "$outdir"
machine=$(uname -n)
if [[ -n ${PERF_BIN:-} ]]; then bin=$PERF_BIN; else bin=$(build_perf_tools) || exit 1; fi
a=mscclpp-rails-a b=mscclpp-rails-b
cleanup() { ip netns del $a 2>/dev/null; ip netns del $b 2>/dev/null; true; }
trap cleanup EXIT
cleanup
ip netns add $a && ip netns add $b || { echo "bench/rails.sh: cannot create network namespaces (root?)" >&2; exit 2; }
ip -n $a link set lo up && ip -n $b link set lo up || exit 1
for k in 0 1 2 3; do
  ip link add "veth${k}a" type veth peer name "veth${k}b" &&
    ip link set "veth${k}a" netns $a && ip link set "veth${k}b" netns $b &&
    ip -n $a addr add "10.97.$k.1/24" dev "veth${k}a" && ip -n $b addr add "10.97.$k.2/24" dev "veth${k}b" &&
    ip -n $a link set "veth${k}a" up && ip -n $b link set "veth${k}b" up || exit 1
done
rails() { # N SIDE: veth0SIDE+veth1SIDE+...
  local out="veth0$2" k
  for ((k = 1; k < $1; k++)); do out+="+veth$k$2"; done
  echo "$out"
}
file=$outdir/$machine-rails.txt
: >"$file"
echo "# $(date -u +%F) $machine, $(nproc) cores, libfabric $(pkg-config --modversion libfabric 2>/dev/null || echo '(no pkg-config)'), tcp over veth pairs between two namespaces" | tee -a "$file"
for ((k = 1; k <= rounds; k++)); do
  for n in 1 2 4; do
    port=$((20000 + RANDOM % 20000))
    echo "## run rails=$n $k $machine" >>"$file"
    env=(MSCCLPP_NRANKS=2 MSCCLPP_ROOT="10.97.0.1:$port" MSCCLPP_NET_PROVIDER=tcp MSCCLPP_RUN_TIMEOUT=120)
    # shellcheck disable=SC2086
    ip netns exec $b env "${env[@]}" MSCCLPP_RANK=1 MSCCLPP_LOCAL_RANK=0 MSCCLPP_NET_IFACE="$(rails $n b)" \
      MSCCLPP_SOCKET_IFNAME=veth0b timeout 300 "$bin/sendrecv_perf" -G 0 -T ib $sizes $iters >/dev/null &
    p1=$!
    # shellcheck disable=SC2086
    ip netns exec $a env "${env[@]}" MSCCLPP_RANK=0 MSCCLPP_LOCAL_RANK=0 MSCCLPP_NET_IFACE="$(rails $n a)" \
      MSCCLPP_SOCKET_IFNAME=veth0a timeout 300 "$bin/sendrecv_perf" -G 0 -T ib $sizes $iters |
      tee -a "$file" | tail -3 || { echo "rank 0 failed (rails=$n)" >&2; exit 1; }
    wait $p1 || { echo "rank 1 failed (rails=$n)" >&2; exit 1; }
  done
done
echo "results: $file"
