# Same-run comparison of this build with a baseline build on the GPU machine: the fast path of
# a change (issue 28: "a bounded wait costs the fast path nothing measurable") measured against
# the code before it, alternated run by run on the same machine (bench/gpu/tune.sh).
#
# Where Rust is, build the baseline from its commit and carry it beside the new library:
#   git worktree add /tmp/base BASE_COMMIT && (cd /tmp/base && cargo build --release) &&
#   mkdir -p .carry/base && cp /tmp/base/target/release/libmscclpp.so .carry/base/ &&
#   cp -r /tmp/base/include .carry/base/ && ln -sf libmscclpp.so .carry/base/libmscclpp.so.0
# Then, on the GPU machine:
#   GPU_CHECK_EXTRA='source "$ROOT/bench/gpu/ab-base.sh"; ab_base 5' scripts/gpu-check.sh
# The baseline's examples are compiled from today's sources against the baseline's headers
# (the device methods are inline in the header, so each build measures its own).
ab_base() {
  local reps=${1:-5} base=$WORK/base-bin ex
  mkdir -p "$base"
  [[ -e $CARRY/base/libmscclpp.so.0 ]] || ln -sf libmscclpp.so "$CARRY/base/libmscclpp.so.0"
  for ex in pingpong allgather; do
    "$NVCC" -O2 -std=c++17 -arch=sm_90 -I"$CARRY/base/include" -I"$ROOT/c_examples/common" \
      -o "$base/$ex" "$ROOT/c_examples/cuda/$ex.cu" -L"$CARRY/base" -lmscclpp || return 1
  done
  # shellcheck source=bench/gpu/tune.sh
  source "$ROOT/bench/gpu/tune.sh"
  # LD_LIBRARY_PATH too: the check exports the new library's folder, which a RUNPATH would lose to.
  tune "$reps" pingpong "" "new:" "base:BIN=$base LD_LIBRARY_PATH=$CARRY/base"
  tune "$reps" allgather "--bench" "new:" "base:BIN=$base LD_LIBRARY_PATH=$CARRY/base"
}

# The nccl-tests-style all-gather on GPU memory staged over libfabric (tcp, and the SHM
# transport), this build against the baseline, alternated, 2 ranks on one GPU under MPS
# (issue 29: "staged GPU memory over tcp and shm no slower than today"). Rows, prefixed with
# the build, the transport and the round, go to $OUT/ab-staged.txt.
ab_staged() {
  local rounds=${1:-2} base=$WORK/base-bin r b t bin out=$OUT/ab-staged.txt
  mkdir -p "$base"
  "$NVCC" -O2 -std=c++17 -arch=sm_90 -DPERF_OP=OP_ALLGATHER -I"$CARRY/base/include" \
    -I"$ROOT/c_examples/common" -o "$base/allgather_perf" "$ROOT/c_examples/perf/perf.cu" \
    -L"$CARRY/base" -lmscclpp || return 1
  mps_up
  : >"$out"
  for ((r = 1; r <= rounds; r++)); do
    for t in ib shm; do
      for b in new base; do
        if [[ $b == new ]]; then bin=$BIN/allgather_perf; else bin=$base/allgather_perf; fi
        # LD_LIBRARY_PATH for the baseline: see ab_base.
        env $([[ $b == base ]] && echo "LD_LIBRARY_PATH=$CARRY/base") MSCCLPP_NET_PROVIDER=tcp \
          MSCCLPP_RUN_TIMEOUT=60 "$ROOT/scripts/run-local-ranks.sh" 2 "$bin" -T $t -b 64K \
          -e 16M -f 4 -n 20 -w 5 2>&1 | grep -E '^\[rank 0\] +[0-9]' |
          sed "s/^\[rank 0\] /$b $t $r: /" | tee -a "$out"
      done
    done
  done
  mps_down
}
