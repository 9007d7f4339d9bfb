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
