#!/usr/bin/env bash
# Our nccl-tests-style tools next to a peer doing the same work, alternately, in one results
# file (then `bench/plot.sh perf OUT.png FILE...` draws it).
#
#   bench/perf-peers.sh host [PROVIDER] [ROUNDS]   sendrecv_perf on host memory against raw
#       libfabric (raw_rma --exchange: fi_write and a flag both ways, then wait for the peer's
#       flag), 2 local ranks; PROVIDER tcp (default) or shm (ours then uses the SHM transport)
#   bench/perf-peers.sh gpu OP [ROUNDS]            OP on GPU memory over P2P (-T p2p), ours
#       against the peers in PERF_PEERS: one rank per GPU where there are several, and on a
#       machine of one GPU two ranks sharing it under MPS (started here unless one runs).
#       OP: allgather, alltoall, sendrecv (ours: OP_perf, block puts over up to 128 blocks
#       per peer, its default over P2P), pingpong (a putWithSignal
#       ping-pong by one thread, half the round trip, per size: ours the pingpong example's
#       --sweep, NVSHMEM nvshmem_putmem_signal_nbi + nvshmem_signal_wait_until; 2 ranks),
#       pingpong-block (the same by a block of 512 threads: ours --block, NVSHMEM's _block put,
#       and its _warp put as "nvshmem-warp"), signal (ours signal(); NVSHMEM nvshmem_fence +
#       nvshmemx_signal_op, the pair that orders earlier puts as ours does, and signal_op alone
#       as "nvshmem-bare"), putbw (ours: the bandwidth example, one way,
#       2 ranks, block puts over up to PERF_BLOCKS (128) blocks as NVSHMEM's test). Peers: nccl (bench/gpu/nccl_perf.py through PyTorch; needs
#       one GPU per rank, allgather/alltoall/sendrecv only) and nvshmem (bench/gpu/nvshmem_perf
#       against the machine's NVSHMEM wheel, bench/gpu/nvshmem.sh; for allgather and alltoall
#       both NVSHMEM's collective, "nvshmem", and a put-with-signal kernel like ours,
#       "nvshmem-sig"). PERF_PEERS defaults to "nccl nvshmem" on several GPUs, "nvshmem" on
#       one; a peer that cannot run here is reported and left out. PERF_BIN names the directory
#       of the CUDA build of our tools and examples (default: built here), NVSHMEM_PERF an
#       nvshmem_perf binary (default: built into build/nvshmem), NVSHMEM_PERF_ARGS more options
#       for it (e.g. "-B 64").
#
# ROUNDS (default 3) alternations, each round's order the reverse of the last one's; sizes
# PERF_SIZES ("-b 8 -e 4M -f 4" on host, "-b 8 -e 64M -f 4" on GPUs; pingpong* "-b 8 -e 64K -f 2",
# signal 8 bytes alone, putbw "-b 4K -e 64M -f 4"), PERF_ITERS ("-n 20 -w 5"; pingpong* and signal "-n 2000 -w 100", putbw
# "-n 50 -w 5"). PERF_BUDGET_S: no new round once the next would end after that many seconds
# (one round at least); PERF_RUN_TIMEOUT (120): seconds per run. The file (PERF_OUT, default
# bench/results/) holds each run's nccl-tests output after a line `## run IMPL ROUND MACHINE
# TRANSPORT OP`. Exit status: 1 when a run failed or had a wrong byte; an NVSHMEM run that
# NVSHMEM refused (nvshmem_perf's exit 3, or NVSHMEM's own exit 255) is shown, not repeated in
# later rounds, and does not fail it.
set -uo pipefail
MSCCLPP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$MSCCLPP_ROOT"
# shellcheck source=scripts/common.sh
source scripts/common.sh
mode=${1:?usage: bench/perf-peers.sh host [PROVIDER] [ROUNDS] | gpu OP [ROUNDS]}
outdir=${PERF_OUT:-bench/results}
mkdir -p "$outdir"
machine=$(uname -n)

case $mode in
  host)
    provider=${2:-tcp}
    rounds=${3:-3}
    sizes=${PERF_SIZES:--b 8 -e 4M -f 4}
    iters=${PERF_ITERS:--n 20 -w 5}
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
    op=${2:?usage: bench/perf-peers.sh gpu allgather|alltoall|sendrecv|pingpong|putbw [ROUNDS]}
    rounds=${3:-3}
    case $op in
      pingpong | pingpong-block) sizes=${PERF_SIZES:--b 8 -e 64K -f 2} iters=${PERF_ITERS:--n 2000 -w 100} ;;
      signal) sizes="-b 8 -e 8 -f 2" iters=${PERF_ITERS:--n 2000 -w 100} ;;
      putbw) sizes=${PERF_SIZES:--b 4K -e 64M -f 4} iters=${PERF_ITERS:--n 50 -w 5} ;;
      allgather | alltoall | sendrecv) sizes=${PERF_SIZES:--b 8 -e 64M -f 4} iters=${PERF_ITERS:--n 20 -w 5} ;;
      *) echo "bench/perf-peers.sh gpu: OP is allgather, alltoall, sendrecv, pingpong, pingpong-block, signal or putbw, not $op" >&2; exit 2 ;;
    esac
    ngpu=$(nvidia-smi -L | grep -c '^GPU' || true)
    ((ngpu >= 1)) || { echo "bench/perf-peers.sh gpu: no GPU here (nvidia-smi -L)" >&2; exit 2; }
    # One rank per GPU; on one GPU two ranks share it (under MPS: without it their kernels
    # time-slice the GPU, ~2 ms per switch). pingpong and putbw are between 2 ranks.
    np=$ngpu label=gpu-p2p
    ((ngpu == 1)) && np=2 label=gpu-p2p-mps
    [[ $op == pingpong* || $op == signal || $op == putbw ]] && np=2
    if ((ngpu >= 2)); then peers=${PERF_PEERS:-nccl nvshmem}; else peers=${PERF_PEERS:-nvshmem}; fi
    if [[ -n ${PERF_BIN:-} ]]; then bin=$PERF_BIN; else bin=$(build_perf_tools) || exit 1; fi
    run_timeout=${PERF_RUN_TIMEOUT:-120}
    tmp=$(mktemp -d /tmp/perf-peers.XXXXXX)
    # shellcheck source=bench/gpu/nvshmem.sh
    source bench/gpu/nvshmem.sh
    trap 'peers_mps_down; rm -rf "$tmp"' EXIT
    impls=(ours)
    for peer in $peers; do
      case $peer:$op in
        nccl:pingpong* | nccl:signal | nccl:putbw) echo "peer nccl: no $op in bench/gpu/nccl_perf.py; left out" ;;
        nccl:*)
          if ((ngpu < 2)); then
            echo "peer nccl: $ngpu GPU here; NCCL refuses two ranks on one GPU; left out"
          else
            impls+=(nccl)
          fi
          ;;
        nvshmem:*)
          # Built once into build/nvshmem (again when the source is newer).
          nv=${NVSHMEM_PERF:-build/nvshmem/nvshmem_perf}
          if [[ -z ${NVSHMEM_PERF:-} && (! -x $nv || bench/gpu/nvshmem_perf.cu -nt $nv) ]] &&
            ! nv=$(nvshmem_build build/nvshmem); then
            echo "peer nvshmem: not built (above); left out"
            continue
          fi
          nvshmem_env
          impls+=(nvshmem)
          [[ $op == allgather || $op == alltoall ]] && impls+=(nvshmem-sig)
          [[ $op == pingpong-block ]] && impls+=(nvshmem-warp)
          [[ $op == signal ]] && impls+=(nvshmem-bare)
          ;;
        *) echo "bench/perf-peers.sh gpu: unknown peer $peer (nccl, nvshmem)" >&2; exit 2 ;;
      esac
    done
    ((ngpu == 1)) && { peers_mps_up || exit 1; }
    read -r -a s <<<"$sizes"
    max=${s[3]}
    file=$outdir/$machine-$label-$op.txt
    : >"$file"
    echo "# $(date -u +%F) $machine, $ngpu x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $np ranks, $op: ${impls[*]}" | tee -a "$file"
    failed=() refused=()
    # gpu_run IMPL ROUND: one run; its rows (rank 0's, as nccl-tests prints them) go into the
    # file after its "## run" line; its whole output is shown when it fails.
    gpu_run() {
      local impl=$1 k=$2 log=$tmp/$1.$2.log rc
      case $impl in
        ours)
          case $op in
            pingpong | pingpong-block | signal)
              local sweep=() n
              n=$(sed -E 's/.*-n ([0-9]+).*/\1/' <<<"$iters")
              [[ $op == signal ]] || sweep=(--sweep "${s[1]}:${s[3]}:${s[5]}")
              [[ $op == pingpong-block ]] && sweep+=(--block)
              MSCCLPP_RUN_TIMEOUT=$run_timeout scripts/run-local-ranks.sh 2 "$bin/pingpong" --iters "$n" "${sweep[@]}" ;;
            putbw) MSCCLPP_RUN_TIMEOUT=$run_timeout scripts/run-local-ranks.sh 2 "$bin/bandwidth" --max "$max" \
              --blocks "${PERF_BLOCKS:-128}" ;;
            # shellcheck disable=SC2086 # sizes and iters are lists of options
            *) MSCCLPP_RUN_TIMEOUT=$run_timeout scripts/run-local-ranks.sh "$np" "$bin/${op}_perf" -T p2p $sizes $iters ;;
          esac
          ;;
        nccl)
          # shellcheck disable=SC2086
          timeout -k 10 "$run_timeout" python3 -m torch.distributed.run --standalone \
            --nproc_per_node="$np" bench/gpu/nccl_perf.py "$op" $sizes $iters
          ;;
        nvshmem*)
          local what=$op
          case $impl:$op in
            nvshmem-sig:*) what=$op-sig ;;
            nvshmem-warp:*) what=pingpong-warp ;;
            nvshmem:signal) what=fence-signal ;;
            nvshmem-bare:*) what=signal ;;
          esac
          # shellcheck disable=SC2086
          MSCCLPP_RUN_TIMEOUT=$run_timeout scripts/run-local-ranks.sh "$np" "$nv" "$what" $sizes $iters \
            ${NVSHMEM_PERF_ARGS:-}
          ;;
      esac >"$log" 2>&1
      rc=$?
      local rows=$tmp/rows
      case $impl:$op in
        ours:signal) # RESULT pingpong signal us=U: one row, at 8 bytes (the signal word)
          sed -n 's/^\[rank 0\] //p' "$log" | awk -v rc=$rc '$1 == "RESULT" && $3 == "signal" {
            split($4, a, "="); printf "# pingpong example, signal() one way\n";
            printf "%12d  %12d  %8s  %6s  %6d  %7.2f  %6.2f  %6.2f  %6s\n", 8, 8, "uint8", "none", -1,
              a[2], 8 / a[2] / 1e3, 8 / a[2] / 1e3, rc == 0 ? "0" : "N/A" }' ;;
        ours:pingpong*) # RESULT pingpong put|putblock bytes=N us=U: a row per size (the
          # example checks the bytes itself and exits 1 on a wrong one)
          sed -n 's/^\[rank 0\] //p' "$log" | awk -v rc=$rc -v k=$([[ $op == pingpong ]] && echo put || echo putblock) '
            $1 == "RESULT" && $2 == "pingpong" && $3 == k { split($4, b, "="); split($5, a, "=");
            printf "%12d  %12d  %8s  %6s  %6d  %7.2f  %6.2f  %6.2f  %6s\n", b[2], b[2], "uint8", "none", -1,
              a[2], b[2] / a[2] / 1e3, b[2] / a[2] / 1e3, rc == 0 ? "0" : "N/A" }' ;;
        ours:putbw) # RESULT bandwidth bytes=B us=U GBps=G check=ok|FAIL, one row per size
          sed -n 's/^\[rank 0\] //p' "$log" | awk '$1 == "RESULT" && $2 == "bandwidth" {
            for (i = 3; i <= NF; i++) { split($i, a, "="); v[a[1]] = a[2] }
            printf "%12d  %12d  %8s  %6s  %6d  %7.2f  %6.2f  %6.2f  %6s\n", v["bytes"], v["bytes"],
              "uint8", "none", -1, v["us"], v["GBps"], v["GBps"], v["check"] == "ok" ? "0" : "1" }' ;;
        nccl:*) grep -E '^#|^ +[0-9]' "$log" ;;
        *) sed -n 's/^\[rank 0\] //p' "$log" ;;
      esac >"$rows"
      { echo "## run $impl $k $machine $label $op"; cat "$rows"; } >>"$file"
      grep -E '^ +[0-9]' "$rows" | tail -1 | sed "s/^/$impl $k: /"
      # Rows with wrong bytes: every #wrong column (all-gather rows of ours have two).
      local bad
      bad=$(awk '/^ +[0-9]/ { for (i = 9; i <= NF; i += 4) if ($i != "0" && $i != "N/A") { n++; break } }
        END { print n + 0 }' "$rows")
      if [[ $impl == nvshmem* ]] && ((rc == 3 || rc == 255)); then
        # 3: nvshmem_perf saw a limited MPG run and did not start the collective; 255: NVSHMEM
        # exited the process itself (it refused an initialisation or a call).
        echo "REFUSED $impl $op (exit $rc): NVSHMEM's message:"
        grep -v '^run-local-ranks' "$log" | tail -8
        refused+=("$impl")
      elif ((rc != 0 || bad != 0)); then
        echo "FAILED $impl $op round $k (exit $rc, $bad rows with wrong bytes):"
        tail -15 "$log"
        failed+=("$impl:$k")
      fi
    }
    t0=$SECONDS
    for ((k = 1; k <= rounds; k++)); do
      if ((k > 1)) && [[ -n ${PERF_BUDGET_S:-} ]] &&
        ((SECONDS - t0 + (SECONDS - t0) / (k - 1) > PERF_BUDGET_S)); then
        echo "budget of ${PERF_BUDGET_S}s: $((k - 1)) round(s)"
        break
      fi
      order=("${impls[@]}")
      ((k % 2 == 0)) && order=($(printf '%s\n' "${impls[@]}" | tac))
      for impl in "${order[@]}"; do
        # A peer refused once is refused every round: its message was shown.
        [[ " ${refused[*]} " == *" $impl "* ]] && continue
        gpu_run "$impl" "$k"
      done
    done
    ((${#refused[@]})) && echo "refused by NVSHMEM here: ${refused[*]}"
    if ((${#failed[@]})); then
      echo "results: $file; FAILED: ${failed[*]}"
      exit 1
    fi
    ;;
  *)
    echo "bench/perf-peers.sh: host or gpu, not $mode" >&2
    exit 2
    ;;
esac
echo "results: $file"
