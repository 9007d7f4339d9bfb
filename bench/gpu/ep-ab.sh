# Same-run A/B of examples/ep and its NVSHMEM peer (issue 44): cases alternated round by
# round, NP ranks on GPU 0 under MPS as the GPU check's ep step places them (ep_place), every
# rank's RESULT lines (the timings and, where asked, the phases) kept with the case's label and
# the round. Run inside scripts/gpu-check.sh (its BIN, WORK, OUT, ROOT, spawn_ranks, mps_up and
# ep_place), e.g.
#   GPU_CHECK_EXTRA='source "$ROOT/bench/gpu/ep-ab.sh"; ep_ab 5 2 1,8 "g64:ours:" "g8:ours:--blocks 8" "nv:peer:"'
# A case is LABEL:WHO:ARGS, WHO one of
#   ours    build/.../ep (the example), ARGS its options (VAR=VALUE words first set its environment)
#   base    the example as it was at a baseline commit, built here from $CARRY/ep-base (its
#           include/ and examples/ep/ there, as `git archive BASE include examples/ep | tar -x
#           -C .carry/ep-base` leaves them) against the same library: a change of the kernels
#           or of the device header against the code before it
#   clk     the example built with -DEP_SIGNAL_CLOCKS (prints RESULT ep_clocks: what a signal()
#           and a fence after it cost the last block's thread, timed in SM cycles, printed in us
#           at the GPU's peak clock; not for timings)
#   peer    bench/gpu/nvshmem_ep as timed by the GPU check
#   speer   the same built with -DEP_STAMPS (prints RESULT ep_phases; not for timings)
# Lines go to $OUT/ep-ab.txt as "AB label=LABEL round=R RESULT ...".
# ep_ab_build OUT INCLUDE_DIR SOURCE [NVCC FLAGS...]: the example as gpu-check builds it (nvcc,
# against the installed library), from SOURCE with INCLUDE_DIR's headers.
ep_ab_build() {
  local out=$1 inc=$2 src=$3
  shift 3
  "$NVCC" -O2 -std=c++17 -arch=sm_90 "$@" -I"$inc" -I"$ROOT/c_examples/common" -I"$ROOT/c_examples/cuda" \
    -o "$out" "$src" -L"$PREFIX/lib" -lmscclpp -Xlinker -rpath -Xlinker "$PREFIX/lib"
}

ep_ab() {
  local rounds=${1:?ep_ab ROUNDS NP TOKENS CASE...} np=${2:?} tokens=${3:?} r c label who args
  local out=$OUT/ep-ab.txt peer="" speer="" rc=0 words vars opts w bin pids p
  shift 3
  # shellcheck source=bench/gpu/nvshmem.sh
  source "$ROOT/bench/gpu/nvshmem.sh"
  # Every case well formed before anything is built or run.
  for c in "$@"; do
    who=${c#*:}
    if [[ $c != *:*:* || ! ${who%%:*} =~ ^(ours|base|clk|peer|speer)$ || ${c%%:*} == *[/\&]* ]]; then
      echo "ep_ab: $c: a case is LABEL:WHO:ARGS (WHO ours, base, clk, peer or speer; no / or & in LABEL)" >&2
      return 2
    fi
  done
  for c in "$@"; do
    who=${c#*:}
    who=${who%%:*}
    if [[ $who == base && ! -x $WORK/ep-base ]]; then
      ep_ab_build "$WORK/ep-base" "$CARRY/ep-base/include" "$CARRY/ep-base/examples/ep/ep.cu" || return 1
    elif [[ $who == clk && ! -x $WORK/ep-clk ]]; then
      ep_ab_build "$WORK/ep-clk" "$PREFIX/include" "$ROOT/examples/ep/ep.cu" -DEP_SIGNAL_CLOCKS || return 1
    elif [[ $who == peer && -z $peer ]]; then
      peer=$(nvshmem_build "$WORK/ep-ab-peer" nvshmem_ep) || return 1
    elif [[ $who == speer && -z $speer ]]; then
      speer=$(NVSHMEM_PERF_NVCC_FLAGS=-DEP_STAMPS nvshmem_build "$WORK/ep-ab-speer" nvshmem_ep) || return 1
    fi
  done
  nvshmem_env
  mps_down
  mps_up
  for ((r = 1; r <= rounds; r++)); do
    for c in "$@"; do
      label=${c%%:*}
      who=${c#*:}
      args=${who#*:}
      who=${who%%:*}
      read -r -a words <<<"$args"
      vars=()
      opts=()
      for w in "${words[@]}"; do
        if ((${#opts[@]} == 0)) && [[ $w == [A-Z]*=* ]]; then vars+=("$w"); else opts+=("$w"); fi
      done
      : >"$WORK/ep-ab.out"
      case $who in
      ours | base | clk)
        bin=$BIN/ep
        [[ $who == base ]] && bin=$WORK/ep-base
        [[ $who == clk ]] && bin=$WORK/ep-clk
        # shellcheck disable=SC2046 # ep_place's words are VAR=VALUE pairs
        spawn_ranks "$np" timeout -k 5 120 env $(ep_place "$np") "${vars[@]}" "$bin" \
          --tokens "$tokens" "${opts[@]}" >"$WORK/ep-ab.out" 2>&1 || rc=1
        ;;
      peer | speer)
        [[ $who == peer ]] && bin=$peer || bin=$speer
        rm -f "$WORK/ep-ab.uid"
        pids=()
        for ((p = 0; p < np; p++)); do
          # shellcheck disable=SC2046 # ep_place's words are VAR=VALUE pairs
          env $(ep_place "$np") "${vars[@]}" timeout -k 5 120 "$bin" $p "$np" "$WORK/ep-ab.uid" \
            --tokens "$tokens" "${opts[@]}" >>"$WORK/ep-ab.out" 2>&1 &
          pids+=($!)
        done
        for p in "${pids[@]}"; do wait "$p" || rc=1; done
        ;;
      esac
      grep -E 'wrong [1-9]|[1-9][0-9]* wrong values|FAILED|error' "$WORK/ep-ab.out" | head -5
      grep '^RESULT' "$WORK/ep-ab.out" | sed "s/^/AB label=$label round=$r /" >>"$out"
      echo "ep_ab round $r $label: $(grep -c '^RESULT ep ' "$WORK/ep-ab.out") timing lines"
    done
  done
  mps_down
  return $rc
}
