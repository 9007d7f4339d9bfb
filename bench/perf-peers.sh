#!/usr/bin/env bash
# Our nccl-tests-style tools next to a peer doing the same work, alternately, in one results
# file (then `bench/plot.sh perf OUT.png FILE...` draws it).
#
#   bench/perf-peers.sh host [PROVIDER] [ROUNDS]   sendrecv_perf on host memory against raw
#       libfabric (raw_rma --exchange: fi_write and a flag both ways, then wait for the peer's
#       flag), 2 local ranks; PROVIDER tcp (default) or shm (ours then uses the SHM transport)
#   bench/perf-peers.sh gpu OP [ROUNDS]            OP_perf (allgather, alltoall, sendrecv) on
#       GPU memory over P2P against NCCL through PyTorch (bench/gpu/nccl_perf.py), one rank per
#       GPU on every GPU of the machine (needs 2 or more: NCCL refuses two ranks on one GPU);
#       PERF_BIN names the directory of the CUDA build of the tools (default: built here)
#
# ROUNDS (default 3) alternations; sizes PERF_SIZES ("-b 8 -e 4M -f 4" on host, "-b 8 -e 64M -f 4"
# on GPUs), PERF_ITERS ("-n 20 -w 5"). The file (PERF_OUT, default bench/results/) holds each
# run's nccl-tests output after a line `## run IMPL ROUND MACHINE TRANSPORT OP`.
set -uo pipefail
MSCCLPP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$MSCCLPP_ROOT"
# shellcheck source=scripts/common.sh
source scripts/common.sh
mode=${1:?usage: bench/perf-peers.sh host [PROVIDER] [ROUNDS] | gpu OP [ROUNDS]}
iters=${PERF_ITERS:--n 20 -w 5}
outdir=${PERF_OUT:-bench/results}
mkdir -p "$outdir"
machine=$(uname -n)

case $mode in
  host)
    provider=${2:-tcp}
    rounds=${3:-3}
    sizes=${PERF_SIZES:--b 8 -e 4M -f 4}
    if [[ -n ${PERF_BIN:-} ]]; then bin=$PERF_BIN; else bin=$(build_perf_tools) || exit 1; fi
    cargo build --release -q -p libfabric-sys --example raw_rma || exit 1
    raw=${CARGO_TARGET_DIR:-target}/release/examples/raw_rma
    read -r -a s <<<"$sizes"
    [[ ${s[0]} == -b && ${s[2]} == -e && ${s[4]} == -f ]] ||
      { echo "PERF_SIZES must be \"-b MIN -e MAX -f FACTOR\"" >&2; exit 2; }
    if [[ $provider == shm ]]; then t=shm; else t=ib; fi
    file=$outdir/$machine-host-$provider-sendrecv.txt
    : >"$file"
    echo "# $(date -u +%F) $machine, $(nproc) cores, libfabric $(pkg-config --modversion libfabric), provider $provider" | tee -a "$file"
    for ((k = 1; k <= rounds; k++)); do
      echo "## run ours $k $machine host-$provider sendrecv" >>"$file"
      # shellcheck disable=SC2086
      MSCCLPP_NET_PROVIDER=$provider scripts/run-local-ranks.sh 2 "$bin/sendrecv_perf" -G 0 -T "$t" \
        $sizes $iters | sed 's/^\[rank 0\] //' | grep -v '^\[rank' | tee -a "$file" | tail -2 || exit 1
      echo "## run raw $k $machine host-$provider sendrecv" >>"$file"
      # shellcheck disable=SC2086
      "$raw" --provider "$provider" --exchange "${s[1]}:${s[3]}:${s[5]}" \
        --exchange-iters "$(sed -E 's/.*-n ([0-9]+).*/\1/' <<<"$iters")" | tee -a "$file" | tail -2 || exit 1
    done
    ;;
  gpu)
    op=${2:?usage: bench/perf-peers.sh gpu allgather|alltoall|sendrecv [ROUNDS]}
    rounds=${3:-3}
    sizes=${PERF_SIZES:--b 8 -e 64M -f 4}
    ngpu=$(nvidia-smi -L | grep -c '^GPU' || true)
    if ((ngpu < 2)); then
      echo "bench/perf-peers.sh gpu: $ngpu GPU(s) here; NCCL needs one GPU per rank and 2 ranks at least" >&2
      exit 2
    fi
    if [[ -n ${PERF_BIN:-} ]]; then bin=$PERF_BIN; else bin=$(build_perf_tools) || exit 1; fi
    file=$outdir/$machine-gpu-p2p-$op.txt
    : >"$file"
    echo "# $(date -u +%F) $machine, $ngpu x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee -a "$file"
    for ((k = 1; k <= rounds; k++)); do
      echo "## run ours $k $machine gpu-p2p $op" >>"$file"
      # shellcheck disable=SC2086
      scripts/run-local-ranks.sh "$ngpu" "$bin/${op}_perf" -T p2p $sizes $iters |
        sed 's/^\[rank 0\] //' | grep -v '^\[rank' | tee -a "$file" | tail -2 || exit 1
      echo "## run nccl $k $machine gpu-p2p $op" >>"$file"
      # shellcheck disable=SC2086
      timeout 600 python3 -m torch.distributed.run --standalone --nproc_per_node="$ngpu" \
        bench/gpu/nccl_perf.py "$op" $sizes $iters 2>&1 | grep -E '^#|^ +[0-9]' |
        tee -a "$file" | tail -2 || exit 1
    done
    ;;
  *)
    echo "bench/perf-peers.sh: host or gpu, not $mode" >&2
    exit 2
    ;;
esac
echo "results: $file"
