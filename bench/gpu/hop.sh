# The proxy hop (issue 42, item 3) on ranks sharing GPU 0 under MPS: pingpong's one-thread
# putWithSignal sweep with every put through the proxy (MSCCLPP_P2P_DIRECT_BYTES=0), the copy
# engines against the SM engine (MSCCLPP_P2P_SM_SHARED=1, off by default for ranks sharing a GPU),
# alternated round by round, each run bounded, both ranks on GPU 0 whatever the machine has.
# Run inside scripts/gpu-check.sh (its BIN, OUT, WORK, mps_up, spawn_ranks), e.g.
#   GPU_CHECK_EXTRA='source "$ROOT/bench/gpu/hop.sh"; hop_ab 3'
# Lines go to $OUT/hop-ab.txt as "HOP engine=ce|sm round=R RESULT ..." (and the run's exit status).
hop_ab() {
  local rounds=${1:-3} r sm rc=0 st e out=$OUT/hop-ab.txt
  mps_up
  for ((r = 1; r <= rounds; r++)); do
    for sm in 0 1; do
      CUDA_VISIBLE_DEVICES=0 MSCCLPP_P2P_DIRECT_BYTES=0 MSCCLPP_P2P_SM_SHARED=$sm MSCCLPP_P2P_STATS=1 \
        timeout -k 5 90 bash -c 'spawn_ranks 2 "$BIN/pingpong" --sweep 64K:1M:4 --iters 400' >"$WORK/hop.out" 2>&1
      st=$?
      ((st == 0)) || rc=1
      e=ce
      [[ $sm == 1 ]] && e=sm
      grep '^RESULT' "$WORK/hop.out" | sed "s/^/HOP engine=$e round=$r /" >>"$out"
      echo "HOP engine=$e round=$r exit=$st" >>"$out"
      grep -iE 'stats|error|timed out|FAILED|WARN' "$WORK/hop.out" | head -6 | sed "s/^/HOP engine=$e round=$r /" >>"$out"
    done
  done
  mps_down
  return $rc
}
