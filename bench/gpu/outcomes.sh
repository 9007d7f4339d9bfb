# Outcome counter for scripts/gpu-check.sh (source it from GPU_CHECK_EXTRA there): runs one of
# the CUDA examples under several settings, each several times, and counts the runs that
# failed, with the first error line of each failure, so that one device call can tell a
# setting that fails now and then from one that does not.
#
#   outcomes REPS EXAMPLE "ARGS" "LABEL:VAR=value VAR2=value" ["LABEL2:..."]...
#   e.g. outcomes 6 bandwidth "" "default:MSCCLPP_P2P_SM_SHARED=1" "32 queues:MSCCLPP_P2P_SM_SHARED=1 CUDA_DEVICE_MAX_CONNECTIONS=32"
#
# Settings alternate run by run, as in tune.sh. Output: an "OUTCOME EXAMPLE LABEL run N rc=.."
# line per run and "OUTCOMES EXAMPLE LABEL failed F of N" per setting, also added to $RES.
outcomes() {
  local reps=$1 ex=$2 args=$3
  shift 3
  local r s label vars rc out=$WORK/outcomes.$ex.$RANDOM
  declare -A failed=()
  for ((r = 1; r <= reps; r++)); do
    for s in "$@"; do
      label=${s%%:*}
      vars=${s#*:}
      # shellcheck disable=SC2086 # vars is a list of VAR=value words
      timeout -k 5 90 env $vars bash -c "ranks 2 \"\$BIN/$ex\" $args" >"$out" 2>&1
      rc=$?
      ((rc != 0)) && failed[$label]=$((${failed[$label]:-0} + 1))
      echo "OUTCOME $ex $label run $r rc=$rc $(grep -m1 -iE 'error|timed out' "$out" | cut -c1-400)" |
        tee -a "$RES"
    done
  done
  for s in "$@"; do
    label=${s%%:*}
    echo "OUTCOMES $ex $label failed ${failed[$label]:-0} of $reps" | tee -a "$RES"
  done
}
