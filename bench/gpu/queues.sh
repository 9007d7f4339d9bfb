# Which hardware work queue stalls (issue 30 item 5), for scripts/gpu-check.sh (source it from
# GPU_CHECK_EXTRA there): the `bandwidth` example with 0..7 streams made between the kernels'
# stream and the library's (BANDWIDTH_PAD_STREAMS), so that at CUDA's default of 8 queues one
# padding puts the library's copy or SM-engine stream on the kernels' queue, where the copies
# wait behind the kernel that waits for them. Counted with `outcomes` (bench/gpu/outcomes.sh).
#
#   queues SM_REPS CE_REPS      e.g. GPU_CHECK_EXTRA='source "$ROOT/bench/gpu/queues.sh"; queues 2 1'
queues() {
  local sm_reps=${1:-2} ce_reps=${2:-1} k
  local -a sm=() ce=()
  # shellcheck source=bench/gpu/outcomes.sh
  source "$ROOT/bench/gpu/outcomes.sh"
  for k in 0 1 2 3 4 5 6 7; do
    sm+=("sm-pad$k:MSCCLPP_P2P_SM_SHARED=1 MSCCLPP_WAIT_TIMEOUT=5 BANDWIDTH_PAD_STREAMS=$k")
    ce+=("ce-pad$k:MSCCLPP_WAIT_TIMEOUT=5 BANDWIDTH_PAD_STREAMS=$k")
  done
  outcomes "$sm_reps" bandwidth "--max 16M" "${sm[@]}"
  ((ce_reps > 0)) && outcomes "$ce_reps" bandwidth "--max 16M" "${ce[@]}"
  return 0
}

# Whose kernel holds the copies up: the same `bandwidth` runs with rank 1's waiting kernel
# alongside rank 0's (as the example runs) and with it only after rank 0's kernel has ended
# (BANDWIDTH_RECV_AFTER=1): if only the first stalls, the copies of one MPS client wait behind
# another client's running kernel.
#
#   queues_recv REPS
queues_recv() {
  local reps=${1:-4}
  # shellcheck source=bench/gpu/outcomes.sh
  source "$ROOT/bench/gpu/outcomes.sh"
  outcomes "$reps" bandwidth "--max 16M" \
    "sm-together:MSCCLPP_P2P_SM_SHARED=1 MSCCLPP_WAIT_TIMEOUT=5" \
    "sm-recv-after:MSCCLPP_P2P_SM_SHARED=1 MSCCLPP_WAIT_TIMEOUT=5 BANDWIDTH_RECV_AFTER=1"
  return 0
}
