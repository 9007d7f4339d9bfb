#!/usr/bin/env bash
# Bandwidth over 1, 2 and 4 rails (striping, issue 16): two network namespaces joined by four
# veth pairs (10.97.K.1 and 10.97.K.2), one rank in each, sendrecv_perf on host memory over the
# IB transport (tcp), the rails named by MSCCLPP_NET_IFACE (veth0a, veth0a+veth1a, ...).
# Where namespaces cannot be made (no root, no iproute2: the GPU machine), or with
# RAILS_LOOPBACK=1, both ranks run here with rails on loopback (lo, lo+lo, lo+lo+lo+lo: one
# endpoint per rail), and the header says so. The rail counts alternate, ROUNDS times (default
# 3), into bench/results/MACHINE-rails.txt, each run's nccl-tests output after a line
# `## run rails=N ROUND MACHINE`.
#
#   bench/rails.sh [ROUNDS]      PERF_SIZES (default "-b 64K -e 64M -f 4"), PERF_ITERS
#                                ("-n 20 -w 5"), PERF_BIN (the tools' directory, else built),
#                                PERF_OUT (default bench/results); MSCCLPP_NET_STRIPE_CHUNK
#                                is passed through.
# Every rail rides on the same kernel, so the rails share this machine's cores: the numbers
# show what striping costs and gains in the library, not a NIC's wire speed.
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
netns() { # sets up the namespaces and their four veth pairs; fails without root or iproute2
  command -v ip >/dev/null && ip netns add $a && ip netns add $b &&
    ip -n $a link set lo up && ip -n $b link set lo up || return 1
  local k
  for k in 0 1 2 3; do
    ip link add "veth${k}a" type veth peer name "veth${k}b" &&
      ip link set "veth${k}a" netns $a && ip link set "veth${k}b" netns $b &&
      ip -n $a addr add "10.97.$k.1/24" dev "veth${k}a" && ip -n $b addr add "10.97.$k.2/24" dev "veth${k}b" &&
      ip -n $a link set "veth${k}a" up && ip -n $b link set "veth${k}b" up || return 1
  done
}
trap cleanup EXIT
cleanup
if [[ -z ${RAILS_LOOPBACK:-} ]] && netns 2>/dev/null; then
  where="tcp over veth pairs between two namespaces"
  in_a=(ip netns exec $a) in_b=(ip netns exec $b) root=10.97.0.1
  rail() { echo "veth$1$2"; } # K SIDE: rail K's interface on side a or b
else
  cleanup
  why=$([[ -n ${RAILS_LOOPBACK:-} ]] && echo "RAILS_LOOPBACK=1" ||
    { command -v ip >/dev/null && echo "no network namespaces here: not root?" || echo "no network namespaces here: no iproute2"; })
  where="tcp on loopback, one endpoint per rail ($why)"
  in_a=() in_b=() root=127.0.0.1
  rail() { echo lo; }
fi
rails() { # N SIDE: the interfaces of N rails joined by '+'
  local out k
  out=$(rail 0 "$2")
  for ((k = 1; k < $1; k++)); do out+="+$(rail $k "$2")"; done
  echo "$out"
}
file=$outdir/$machine-rails.txt
: >"$file"
echo "# $(date -u +%F) $machine, $(nproc) cores, libfabric $(pkg-config --modversion libfabric 2>/dev/null || echo '(no pkg-config)'), $where" | tee -a "$file"
for ((k = 1; k <= rounds; k++)); do
  for n in 1 2 4; do
    port=$(scripts/free-port.sh) || exit 1
    echo "## run rails=$n $k $machine" >>"$file"
    env=(MSCCLPP_NRANKS=2 MSCCLPP_ROOT="$root:$port" MSCCLPP_NET_PROVIDER=tcp MSCCLPP_RUN_TIMEOUT=120)
    # shellcheck disable=SC2086
    "${in_b[@]}" env "${env[@]}" MSCCLPP_RANK=1 MSCCLPP_LOCAL_RANK=1 MSCCLPP_NET_IFACE="$(rails $n b)" \
      MSCCLPP_SOCKET_IFNAME="$(rail 0 b)" timeout 300 "$bin/sendrecv_perf" -G 0 -T ib $sizes $iters >/dev/null &
    p1=$!
    # shellcheck disable=SC2086
    "${in_a[@]}" env "${env[@]}" MSCCLPP_RANK=0 MSCCLPP_LOCAL_RANK=0 MSCCLPP_NET_IFACE="$(rails $n a)" \
      MSCCLPP_SOCKET_IFNAME="$(rail 0 a)" timeout 300 "$bin/sendrecv_perf" -G 0 -T ib $sizes $iters |
      tee -a "$file" | tail -3 || { echo "rank 0 failed (rails=$n)" >&2; exit 1; }
    wait $p1 || { echo "rank 1 failed (rails=$n)" >&2; exit 1; }
  done
done
echo "results: $file"
