#!/usr/bin/env bash
# GPU check of libmscclpp: ONE script for ONE call on the device machine (kind nvidia-h200-x2:
# two H200s on NVLink, CUDA 13, CMake, OpenMPI, python3 + PyTorch + NCCL, no Rust).
#
# Here (with Rust), first:
#   cargo build --release && mkdir -p .carry && cp target/release/libmscclpp.{so,a} .carry/
#   cp "$(cargo test --release --test endpoint_conformance --no-run --message-format=json |
#         jq -r 'select(.executable != null) | .executable')" .carry/endpoint_conformance
#   scripts/libfabric2.sh --source .carry/libfabric-src.tar.gz   # for the FI_HMEM runs (5a)
#   cargo build --release -p libfabric-sys --example raw_rma && cp target/release/examples/raw_rma .carry/
#   strip --strip-debug .carry/*.so .carry/*.a .carry/endpoint_conformance .carry/raw_rma  # 64 MiB at most
#   pip wheel --no-deps -w .carry ./python                      # the Python package (step 5e)
# Then run `scripts/gpu-check.sh` there with `.carry` carried. It
#   1. installs the CMake package from the prebuilt library (-DMSCCLPP_PREBUILT_LIB_DIR),
#   2. builds the CUDA examples (c_examples/cuda) against it with nvcc (-arch=sm_90), through
#      c_examples/CMakeLists.txt and find_package(mscclpp),
#   2b. runs the nccl-tests-style tools (allgather_perf, alltoall_perf, sendrecv_perf) over P2P,
#      IB and SHM on GPU memory and once on host memory, every byte checked; their rows go to
#      $OUT/perf-results.txt and, where python3 has matplotlib, to $OUT/perf.png,
#   2c. runs ours against NVSHMEM (where its Python wheel is found), same run, same rows: 2 ranks
#      on one GPU under MPS; $OUT/nvshmem/*.txt, table.md, $OUT/nvshmem.png (see the step),
#   3. runs the GPU tests: all-gather over P2P with 2 ranks on 2 GPUs, 4 ranks on 2 GPUs (two
#      processes per GPU), with the SM copy engine (default) and with the copy engines only
#      (both Flag paths), and once under mpirun (OMPI_* environment); registered writes from
#      GPU memory over P2P (c_examples/cuda/regwrite.cu); the P2P direct path against the
#      proxy, every ordering case (c_examples/cuda/direct.cu, 2 ranks on one GPU under MPS),
#   3b. tears down stuck kernels (in wait(), in flush(), ping-ponging) on one GPU with and
#      without MPS: mscclppProxyStop and mscclppCommDestroy bounded, every kernel released,
#   4. runs the benchmarks: signal latency and FIFO costs, put bandwidth, all-gather (CUDA
#      graph timing; also with the copy engines only), and a profile (time in put/flush/wait
#      inside the kernel; the proxy's driver calls and SM engine waits, MSCCLPP_P2P_STATS=1),
#   5. runs NCCL's all-gather through PyTorch (2 processes, same sizes and timing), while the
#      examples build; GPU memory between two network namespaces; striping over 1, 2 and 4
#      veth rails on host memory (bench/rails.sh, $OUT/rails.txt),
#   5e. runs the Python package's GPU examples where its wheel is carried (python/gpu_examples.sh),
#   6. prints the table: size | ours | NCCL | 2023 anchor | target.
# Everything is bounded by `timeout`, the whole by GPU_CHECK_BUDGET seconds (default 470).
# GPU_CHECK_QUICK=1: while tuning, only the 2-rank test and the P2P benchmarks (no NCCL, no
# network or scaling runs); the profile then runs at 1 MiB alone. GPU_CHECK_LIMITS=1: with
# QUICK, also the tests of issue 28 (puts of 4 GiB and more, device wait timeouts; ~1 min).
# GPU_CHECK_EXTRA: more commands to run before the table (see step 5b). GPU_CHECK_PERF=0,
# GPU_CHECK_NVSHMEM=0 and GPU_CHECK_STUCK=0 leave out the perf tools (2b), the NVSHMEM
# comparison (2c) and the stuck teardown cases (3b), so that a check fits one device call.
# GPU_CHECK_ONLY="STEP ...": after the package and the examples are built, only the named
# steps run (conformance perf nvshmem tests stuck net python ep extra), e.g. "nvshmem extra" to
# measure against NVSHMEM and run GPU_CHECK_EXTRA alone.
# Logs and results go to $OUT (gpu-check.log, results.txt, perf-results.txt, perf.png).
#
# NVLink multicast stays off (it can take the host's GPUs down for others): never unset these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

set -u -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$ROOT/build/gpu-check}
CARRY=${MSCCLPP_CARRY:-$ROOT/.carry}
WORK=${GPU_CHECK_WORK:-/tmp/mscclpp-gpu-check}
PREFIX=$WORK/install
BIN=$WORK/examples
BUDGET=${GPU_CHECK_BUDGET:-470}
mkdir -p "$OUT" "$WORK"
LOG=$OUT/gpu-check.log
RES=$OUT/results.txt
: >"$LOG"
: >"$RES"
exec > >(tee -a "$LOG") 2>&1
START=$SECONDS
FAILED=()

# only STEP: true unless GPU_CHECK_ONLY names other steps (see the header).
only() { [[ -z ${GPU_CHECK_ONLY:-} || " $GPU_CHECK_ONLY " == *" $1 "* ]]; }
say() { printf '\n=== [%3ds] %s\n' $((SECONDS - START)) "$*"; }
left() { echo $((BUDGET - (SECONDS - START))); }

# run_step NAME SECONDS CMD...: runs CMD under timeout (capped by the budget left) with its
# output in $WORK/NAME.out (then shown), records a failure by NAME. Returns CMD's status.
run_step() {
  local name=$1 t=$2
  shift 2
  local l out="$WORK/${1##*/}.$RANDOM.out"
  l=$(left)
  if ((l < 20)); then
    echo "SKIPPED $name: budget exhausted"
    FAILED+=("$name(skipped)")
    return 99
  fi
  ((t > l - 10)) && t=$((l - 10))
  say "$name (timeout ${t}s)"
  timeout -k 5 "$t" "$@" >"$out" 2>&1
  local rc=$?
  cat "$out"
  LAST_OUT=$out
  if ((rc != 0)); then
    echo "FAILED $name: exit $rc$( ((rc == 124 || rc == 137)) && echo ' (timed out)')"
    FAILED+=("$name")
  fi
  return $rc
}

# ranks NP PROGRAM ARGS...: NP processes of PROGRAM with the launcher arguments of
# launch_env.h (-r/-n/-a) on a fresh port; fails if any rank fails. Run it under run_step
# (which bounds it): a rank killed by the timeout takes the others down with their own
# bootstrap timeout (MSCCLPP_BOOTSTRAP_TIMEOUT below).
ranks() {
  local np=$1
  shift
  # Two ranks per GPU: their kernels run at once only under MPS (without it they time-slice
  # the GPU, ~2 ms per switch); one rank per GPU runs without it, as users run. More than two
  # per GPU time-slice: under MPS, 8 ranks on one H100 deadlocked in the all-gather benchmark
  # (every rank's proxy timed out waiting for its copies to complete while the ranks' spinning
  # kernels and SM engines held the GPU; the library reported it and the kernels ended).
  if ((np > NGPU && np <= 2 * NGPU)); then mps_up; else mps_down; fi
  spawn_ranks "$np" "$@"
}
# spawn_ranks NP PROGRAM ARGS...: NP processes of PROGRAM with -r/-n/-a on a fresh port, the
# MPS state left as it is; fails if any rank fails (`ranks`, `stuck_case`).
spawn_ranks() {
  local np=$1 port pids=() rc=0 r p
  shift
  port=$("$ROOT/scripts/free-port.sh") || return 1
  for ((r = 0; r < np; r++)); do
    "$@" -r $r -n "$np" -a "127.0.0.1:$port" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do
    wait "$p" || rc=$?
  done
  return $rc
}
# CUDA MPS, with pipe and log directories of our own: started when a step runs two ranks per
# GPU (`ranks`), quit for the other steps, and always on exit (trap below):
# the daemon would outlive this script and block the next start. GPU_CHECK_MPS=0: never.
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mscclpp-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mscclpp-mps-log
# Our daemon runs while a process nvidia-cuda-mps-control lives and our pipe directory has
# its control socket (the socket file outlives a daemon that quit, so it alone proves nothing).
mps_running() {
  pgrep -f 'nvidia-cuda-mps-control' >/dev/null && [[ -S $CUDA_MPS_PIPE_DIRECTORY/control ]]
}
mps_up() {
  [[ ${GPU_CHECK_MPS:-1} == 0 ]] && return 0
  mps_running && return 0
  rm -rf "$CUDA_MPS_PIPE_DIRECTORY" && mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS daemon started ($CUDA_MPS_PIPE_DIRECTORY)"
}
mps_down() {
  mps_running || return 0
  echo quit | nvidia-cuda-mps-control
  # Bounded: the daemon exits once its clients have (every rank of the last step has).
  local i
  for ((i = 0; i < 100; i++)); do
    pgrep -f 'nvidia-cuda-mps-control' >/dev/null || break
    sleep 0.1
  done
  rm -rf "$CUDA_MPS_PIPE_DIRECTORY"
  echo "MPS daemon stopped"
}
mps_down # one left by an interrupted run
trap mps_down EXIT
trap 'exit 130' INT TERM
export -f ranks spawn_ranks mps_running mps_up mps_down
export ROOT CARRY WORK PREFIX BIN OUT
# A rank whose peer died must not wait for the default 30 s.
export MSCCLPP_BOOTSTRAP_TIMEOUT=20 MSCCLPP_WAIT_TIMEOUT=20

# bench NAME SECONDS TAG CMD...: run_step, then keep its RESULT lines, renamed `RESULT TAG...`
# when TAG is not "-" (the Flag-by-copy variants).
bench() {
  local name=$1 t=$2 tag=$3
  shift 3
  run_step "$name" "$t" "$@"
  if [[ $tag == - ]]; then
    grep -h '^RESULT' "$LAST_OUT" >>"$RES"
  else
    grep -h '^RESULT' "$LAST_OUT" | sed -E "s/^RESULT ([a-z0-9]+) /RESULT \1_$tag /" >>"$RES"
  fi
  return 0
}

say "machine"
nvidia-smi -L
nvidia-smi topo -m 2>&1 | head -8
nvcc --version | tail -2
cmake --version | head -1
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
ls -la "$CARRY"

# NCCL first, in the background: it needs nothing of ours, and the examples build meanwhile
# (CPU only; the GPUs are NCCL's alone until it finishes).
# One NCCL rank per GPU (NCCL refuses two on one GPU): 2 on nvidia-h200-x2, 8 on -x8.
# (Only the GPU lines: with MIG, `nvidia-smi -L` adds indented lines for the instances.)
NGPU=$(nvidia-smi -L | grep -c '^GPU' || true)
export NGPU
QUICK=${GPU_CHECK_QUICK:-0}
NCCL_LOG=$WORK/nccl.log
if ((QUICK)); then
  echo "nccl skipped (GPU_CHECK_QUICK=1)" >"$NCCL_LOG"
  echo "nccl exit 0" >>"$NCCL_LOG"
  NCCL_PID=
else
  say "NCCL all-gather through PyTorch, $NGPU ranks (background)"
  (timeout -k 10 200 python3 -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
    "$ROOT/tests/gpu/nccl_allgather.py" >"$NCCL_LOG" 2>&1; echo "nccl exit $?" >>"$NCCL_LOG") &
  NCCL_PID=$!
fi

# 1. The package, from the prebuilt library.
install_package() {
  rm -rf "$WORK/pkg" "$PREFIX"
  cmake -S "$ROOT" -B "$WORK/pkg" -DMSCCLPP_PREBUILT_LIB_DIR="$CARRY" \
    -DCMAKE_INSTALL_PREFIX="$PREFIX" -DMSCCLPP_BUILD_TESTS=OFF &&
    cmake --build "$WORK/pkg" && cmake --install "$WORK/pkg"
}
export -f install_package
run_step install-package 90 bash -c install_package
export LD_LIBRARY_PATH=$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# The endpoint conformance suite's P2P cases: the cases every libfabric endpoint passes in CI
# (tests/endpoint_conformance.rs), over CUDA IPC on this machine's GPU, from the test binary
# built where Rust is (see the header).
if ! only conformance; then
  echo "endpoint conformance skipped (GPU_CHECK_ONLY)"
elif [[ -x $CARRY/endpoint_conformance ]]; then
  run_step "endpoint conformance over P2P" 180 "$CARRY/endpoint_conformance" p2p:: --test-threads=1
else
  echo "SKIPPED endpoint conformance over P2P: no $CARRY/endpoint_conformance (see the header)"
fi

# 2. The CUDA examples, through find_package(mscclpp) and CMake's CUDA language (only their
#    targets: a C example's problem must not cost the GPU run). Plain nvcc if CMake fails.
export PATH=$PATH:/usr/local/cuda/bin
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
export NVCC
build_examples() {
  rm -rf "$WORK/ex" && mkdir -p "$BIN" &&
    cmake -S "$ROOT/c_examples" -B "$WORK/ex" -DCMAKE_PREFIX_PATH="$PREFIX" \
      -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DCMAKE_BUILD_TYPE=Release -DMSCCLPP_EXAMPLES_STATIC=OFF &&
    cmake --build "$WORK/ex" -j 8 --target allgather pingpong bandwidth regwrite bigput stuck \
      stuck_teardown direct allgather_perf alltoall_perf sendrecv_perf ep &&
    cp "$WORK/ex/allgather" "$WORK/ex/pingpong" "$WORK/ex/bandwidth" "$WORK/ex/regwrite" \
      "$WORK/ex/bigput" "$WORK/ex/stuck" "$WORK/ex/stuck_teardown" "$WORK/ex/direct" \
      "$WORK/ex/allgather_perf" "$WORK/ex/alltoall_perf" "$WORK/ex/sendrecv_perf" \
      "$WORK/ex/ep/ep" "$BIN/"
}
build_examples_nvcc() {
  mkdir -p "$BIN" && for ex in allgather pingpong bandwidth regwrite bigput stuck stuck_teardown direct; do
    local extra=()
    [[ $ex == regwrite ]] && extra=(--default-stream=per-thread)
    "$NVCC" -O2 -std=c++17 -arch=sm_90 "${extra[@]}" -I"$PREFIX/include" \
      -I"$ROOT/c_examples/common" -o "$BIN/$ex" "$ROOT/c_examples/cuda/$ex.cu" \
      -L"$PREFIX/lib" -lmscclpp -Xlinker -rpath -Xlinker "$PREFIX/lib" || return 1
  done
  for op in allgather alltoall sendrecv; do
    "$NVCC" -O2 -std=c++17 -arch=sm_90 -DPERF_OP=OP_${op^^} -I"$PREFIX/include" \
      -I"$ROOT/c_examples/common" -o "$BIN/${op}_perf" "$ROOT/c_examples/perf/perf.cu" \
      -L"$PREFIX/lib" -lmscclpp -Xlinker -rpath -Xlinker "$PREFIX/lib" || return 1
  done
  "$NVCC" -O2 -std=c++17 -arch=sm_90 -I"$PREFIX/include" -I"$ROOT/c_examples/common" \
    -I"$ROOT/c_examples/cuda" -o "$BIN/ep" "$ROOT/examples/ep/ep.cu" \
    -L"$PREFIX/lib" -lmscclpp -Xlinker -rpath -Xlinker "$PREFIX/lib" || return 1
}
export -f build_examples build_examples_nvcc
run_step build-examples 200 bash -c build_examples ||
  run_step build-examples-nvcc 200 bash -c build_examples_nvcc

say "waiting for NCCL"
[[ -n $NCCL_PID ]] && wait $NCCL_PID
grep -v '^\s*$' "$NCCL_LOG" | tail -15
grep '^RESULT' "$NCCL_LOG" >>"$RES"
grep -q "nccl exit 0" "$NCCL_LOG" || FAILED+=("nccl")

# The P2P benchmarks of both modes: SM copy engine (default) and copy engines only. The
# direct path (issue 30) against the proxy in the same run: pingpong and the small all-gathers
# with it on (default; `RESULT pingpong ...`, `RESULT fifo ...`, `RESULT allgather bytes=1024|
# 4096`) and off (MSCCLPP_P2P_DIRECT_BYTES=0: the same rows tagged `_proxy`), and the put sweep
# with it forced on at every size (`RESULT pingpong_direct put bytes=N`) and off
# (`RESULT pingpong_proxy put bytes=N`): where the two cross is the limit to set.
p2p_benches() {
  bench "bench pingpong" 60 - bash -c 'ranks 2 "$BIN/pingpong"'
  MSCCLPP_P2P_DIRECT_BYTES=0 bench "bench pingpong, proxy only" 60 proxy \
    bash -c 'ranks 2 "$BIN/pingpong" --sweep 8:64K:2'
  MSCCLPP_P2P_DIRECT_BYTES=1048576 bench "bench pingpong, direct at every size" 60 direct \
    bash -c 'ranks 2 "$BIN/pingpong" --sweep 8:64K:2'
  # Block puts (putWithSignalBlock by 512 threads) forced direct at every size and through the
  # proxy: where they cross is MSCCLPP_P2P_DIRECT_BLOCK_BYTES's default.
  MSCCLPP_P2P_DIRECT_BLOCK_BYTES=1073741824 bench "bench pingpong, block puts direct at every size" \
    60 blockdirect bash -c 'ranks 2 "$BIN/pingpong" --block --sweep 4K:4M:4'
  MSCCLPP_P2P_DIRECT_BLOCK_BYTES=0 bench "bench pingpong, block puts through the proxy" 60 \
    blockproxy bash -c 'ranks 2 "$BIN/pingpong" --block --sweep 4K:4M:4'
  MSCCLPP_P2P_ENGINE=ce bench "bench pingpong, copy engines only" 60 ce bash -c 'ranks 2 "$BIN/pingpong"'
  bench "bench bandwidth" 90 - bash -c 'ranks 2 "$BIN/bandwidth"'
  bench "bench bandwidth, block puts" 90 blocks bash -c 'ranks 2 "$BIN/bandwidth" --blocks 128'
  # The direct block put taken apart (issue 30: where a small put's time goes, against
  # NVSHMEM's put bandwidth at the same sizes): `RESULT parts bytes=N part=P us=U`.
  bench "bench bandwidth, block puts taken apart" 90 - \
    bash -c 'ranks 2 "$BIN/bandwidth" --blocks 128 --parts --max 256K'
  bench "bench allgather" 90 - bash -c 'ranks 2 "$BIN/allgather" --bench'
  bench "bench allgather, small (direct path)" 60 - bash -c 'ranks 2 "$BIN/allgather" --bench --sizes 1K,4K'
  MSCCLPP_P2P_DIRECT_BYTES=0 bench "bench allgather, small, proxy only" 60 proxy \
    bash -c 'ranks 2 "$BIN/allgather" --bench --sizes 1K,4K'
  MSCCLPP_P2P_ENGINE=ce bench "bench allgather, copy engines only" 90 ce \
    bash -c 'ranks 2 "$BIN/allgather" --bench'
}

# The nccl-tests-style tools (c_examples/perf, CUDA build), 2 ranks (under MPS when they share
# a GPU): GPU memory over P2P, IB (tcp, staged) and SHM, and host memory (-G 0); each run must
# end with "Out of bounds values : 0 OK" (every byte checked). Their rows go to one results file
# ($OUT/perf-results.txt, bench/perf-peers.sh's format) and, where python3 has matplotlib (the
# PyTorch environment does), to $OUT/perf.png (bench/plot_perf.py); with 2+ GPUs
# bench/perf-peers.sh runs them against NCCL.
perf_tools() {
  local op t out rc=0 res=$OUT/perf-results.txt
  echo "# $(date -u +%F) $(uname -n), $NGPU x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), 2 ranks" >"$res"
  if ((NGPU < 2)); then mps_up; fi
  run_perf() { # OP TRANSPORT(label) ARGS...
    local op=$1 label=$2
    shift 2
    out=$WORK/perf-$op-$label.txt
    MSCCLPP_NET_PROVIDER=tcp MSCCLPP_RUN_TIMEOUT=60 "$ROOT/scripts/run-local-ranks.sh" 2 \
      "$BIN/${op}_perf" "$@" >"$out" 2>&1
    grep -E '^\[rank 0\] +[0-9]|Out of bounds|Avg bus' "$out" | sed "s/^/$op $label: /"
    echo "## run ours 1 $(uname -n) $label $op" >>"$res"
    grep -E '^\[rank 0\] ' "$out" | sed 's/^\[rank 0\] //' >>"$res"
    grep -q 'Out of bounds values : 0 OK' "$out" || { echo "FAILED: ${op}_perf $*"; rc=1; }
  }
  for t in p2p ib shm; do
    for op in allgather alltoall sendrecv; do
      run_perf $op gpu-$t -T $t -b 8 -e 16M -f 8 -n 20 -w 5
    done
  done
  run_perf allgather host-shm -G 0 -T shm -b 8 -e 4M -f 8
  mps_down
  if python3 -c 'import matplotlib' 2>/dev/null; then
    python3 "$ROOT/bench/plot_perf.py" "$OUT/perf.png" "$res" || rc=1
  else
    echo "no matplotlib for python3 here: plot $res with bench/plot.sh perf OUT.png $res"
  fi
  return $rc
}
export -f perf_tools

if ((!${GPU_CHECK_PERF:-1})) || ! only perf; then
  echo "perf tools skipped (GPU_CHECK_PERF=0 or GPU_CHECK_ONLY)"
elif [[ -x $BIN/allgather_perf && -x $BIN/alltoall_perf && -x $BIN/sendrecv_perf ]]; then
  run_step "perf tools on the GPU (allgather/alltoall/sendrecv_perf over p2p, ib, shm)" 200 \
    bash -c perf_tools
else
  FAILED+=("perf tools not built")
fi

# 2c. NVSHMEM in the same run (issue 30): where python3 has NVSHMEM's wheel (nvidia-nvshmem-cu13),
#     bench/gpu/nvshmem_perf is built against it (bench/gpu/nvshmem.sh) and bench/perf-peers.sh
#     alternates ours with it for pingpong (by a thread), pingpong-block (a block, and
#     NVSHMEM's warp), signal, allgather, sendrecv, alltoall and putbw: on one GPU 2 ranks
#     sharing it under MPS, on several one rank per GPU; every byte checked. NVSHMEM's kernels
#     are written as its users and its perftests write them (issue 42: one thread where the row
#     is one thread, waits by nvshmem_signal_wait_until alone). Beside the pingpong rows, an
#     independent NVSHMEM ping-pong (bench/gpu/nvshmem_pingpong.cu, no code shared with the
#     tool) at 8 bytes: the two must agree within 5%, or the step says by how much they do not.
#     Within GPU_CHECK_NVSHMEM_BUDGET seconds (150; rounds are cut to fit it, one at least);
#     GPU_CHECK_NVSHMEM_OPS names fewer operations. Rows go to
#     $OUT/nvshmem/*.txt, medians to $OUT/nvshmem/table.md (bench/gpu/peers_table.py), the plot
#     to $OUT/nvshmem.png. Where NVSHMEM refuses an operation (or two PEs on one GPU), its
#     message is shown and the rest still runs; no wheel: skipped, saying so.
nvshmem_peers() {
  source "$ROOT/bench/gpu/nvshmem.sh"
  local budget=${GPU_CHECK_NVSHMEM_BUDGET:-150} t0=$SECONDS rc=0 op left
  local ops=(${GPU_CHECK_NVSHMEM_OPS:-pingpong pingpong-block signal allgather sendrecv alltoall putbw})
  local home nv mini files ran=0
  if ! home=$(nvshmem_home); then
    echo "SKIPPED: no NVSHMEM wheel for this python3 (pip install nvidia-nvshmem-cu13 adds it)"
    return 0
  fi
  echo "NVSHMEM: $home"
  nv=$(nvshmem_build "$WORK/nvshmem") || return 1
  mini=$(nvshmem_build "$WORK/nvshmem" nvshmem_pingpong) || return 1
  mkdir -p "$OUT/nvshmem"
  for ((i = 0; i < ${#ops[@]}; i++)); do
    op=${ops[$i]}
    # An equal share of what is left to each operation still to run.
    left=$(((budget - (SECONDS - t0)) / (${#ops[@]} - i)))
    ((left < 5)) && { echo "SKIPPED $op: the budget is spent (GPU_CHECK_NVSHMEM_BUDGET)"; continue; }
    echo "--- $op (about ${left}s)"
    ran=$((ran + 1))
    PERF_BIN=$BIN NVSHMEM_PERF=$nv PERF_PEERS=nvshmem PERF_OUT=$OUT/nvshmem PERF_BUDGET_S=$left \
      PERF_RUN_TIMEOUT=40 PERF_SIZES=$([[ $op == pingpong* || $op == signal || $op == putbw ]] || echo "-b 16 -e 64M -f 4") \
      bash "$ROOT/bench/perf-peers.sh" gpu "$op" 3 || rc=1
    [[ $op == pingpong ]] && { nvshmem_independent "$mini" || rc=1; }
  done
  mps_down
  ((ran > 0)) || { echo "FAILED: no operation ran within ${budget}s"; return 1; }
  files=$(ls "$OUT"/nvshmem/*.txt 2>/dev/null) || { echo "FAILED: no results"; return 1; }
  # shellcheck disable=SC2086 # files: paths without spaces ($OUT's)
  python3 "$ROOT/bench/gpu/peers_table.py" $files | tee "$OUT/nvshmem/table.md"
  if python3 -c 'import matplotlib' 2>/dev/null; then
    # shellcheck disable=SC2086
    python3 "$ROOT/bench/plot_perf.py" "$OUT/nvshmem.png" $files || rc=1
  fi
  return $rc
}
# The independent NVSHMEM ping-pong, 3 runs, against the tool's 8-byte pingpong rows of the
# same step (median against median).
nvshmem_independent() {
  local mini=$1 k us=() tool med d
  nvshmem_env
  mps_up
  for k in 1 2 3; do
    rm -f "$WORK/nvshmem/uid"
    timeout -k 5 40 "$mini" 0 "$WORK/nvshmem/uid" >"$WORK/nvshmem/mini.0" 2>&1 &
    local p0=$!
    timeout -k 5 40 "$mini" 1 "$WORK/nvshmem/uid" >"$WORK/nvshmem/mini.1" 2>&1
    local r1=$?
    wait $p0
    local r0=$?
    if ((r0 != 0 || r1 != 0)); then
      echo "FAILED: independent NVSHMEM ping-pong (exit $r0/$r1):"
      tail -5 "$WORK/nvshmem/mini.0" "$WORK/nvshmem/mini.1"
      return 1
    fi
    us+=("$(sed -n 's/^RESULT nvshmem_pingpong bytes=8 us=//p' "$WORK/nvshmem/mini.0")")
  done
  echo "RESULT nvshmem_independent pingpong bytes=8 us=${us[*]}" | tee -a "$OUT/nvshmem/independent.log"
  tool=$(awk '/^## run nvshmem /{on=1; next} /^## run/{on=0} on && $1 == 8 {print $6}' \
    "$OUT"/nvshmem/*-pingpong.txt | sort -n | awk '{v[NR]=$1} END {if (NR) print v[int((NR+1)/2)]}')
  med=$(printf '%s\n' "${us[@]}" | sort -n | sed -n 2p)
  [[ -n $tool && -n $med ]] || { echo "FAILED: no 8-byte rows to compare (tool '$tool', independent '$med')"; return 1; }
  d=$(awk -v a="$tool" -v b="$med" 'BEGIN { printf "%.1f", (a - b) / b * 100 }')
  if awk -v d="$d" 'BEGIN { exit !(d <= 5 && d >= -5) }'; then
    echo "NVSHMEM 8-byte ping-pong, one way: nvshmem_perf $tool us, independent $med us: agree ($d%)"
  else
    echo "NVSHMEM 8-byte ping-pong, one way: nvshmem_perf $tool us, independent $med us: DIFFER by $d%" \
      "(over 5%; the tool times its kernel by %globaltimer on PE 0 over 2000 rounds after 100, the" \
      "independent one by CUDA events around 10000 rounds after a 1000-round kernel)"
  fi
}
export -f nvshmem_peers nvshmem_independent
if [[ -x $BIN/pingpong && -x $BIN/bandwidth && -x $BIN/allgather_perf ]] && ((${GPU_CHECK_NVSHMEM:-1})) && only nvshmem; then
  run_step "ours and NVSHMEM in the same run (bench/perf-peers.sh gpu, one GPU under MPS)" \
    $((${GPU_CHECK_NVSHMEM_BUDGET:-150} + 40)) bash -c nvshmem_peers
fi

if [[ -x $BIN/allgather && -x $BIN/pingpong && -x $BIN/bandwidth ]] && only tests; then
  # 3. Tests. INFO logs once, to record what the library detected (driver, Flag path).
  MSCCLPP_DEBUG=INFO run_step "test allgather 2 ranks / 2 GPUs" 90 bash -c 'ranks 2 "$BIN/allgather"'
  # The SM engine kept resident (3 s linger) until mscclppProxyStop, which must end it: the
  # examples' teardown synchronizes the device right after the stop (c_examples/cuda/common.cuh).
  # Meanwhile the first launch of each kernel waits for the linger to end (CUDA's lazy module
  # loading synchronizes the context): measured 21 s for this test with a 10 s linger.
  MSCCLPP_P2P_SM_LINGER_US=3000000 run_step "test allgather, engine ended by mscclppProxyStop" 60 \
    bash -c 'ranks 2 "$BIN/allgather"'
  # mscclppCommDestroy frees its epoch blocks (GPU memory the peer maps through CUDA IPC)
  # only once the peer has closed its mapping: rank 1 destroys 1.5 s after rank 0, whose
  # destroy must wait for it (its INFO line says how long; before, it freed at once).
  MSCCLPP_EXAMPLE_DESTROY_DELAY_MS=1500 MSCCLPP_DEBUG=INFO run_step \
    "test destroy waits for the CUDA IPC peer to unmap" 60 bash -c \
    'ranks 2 "$BIN/allgather" 2>&1 | tee /dev/stderr |
       grep -E "rank 0: 1 CUDA IPC peers closed their mappings of our memory in (1\.[4-9]|[2-9]\.)[0-9]*s \(0 did not\)"'
  # One hardware work queue (CUDA_DEVICE_MAX_CONNECTIONS=1, as some training frameworks set):
  # rank 0's kernel waits in flush() for copies that queue behind that very kernel, so the run
  # must fail at the wait timeout, with a WARN when the endpoint opens and the variable named
  # in the error (bench/RESULTS.md, session 13: every such run stalled, measured under MPS).
  # On GPU 0 alone, under MPS: ranks sharing a GPU use the copy engines. With one rank per GPU
  # the SM engine (a kernel) carries the puts and ran alongside (session 17, 2 H100s).
  CUDA_VISIBLE_DEVICES=0 NGPU=1 CUDA_DEVICE_MAX_CONNECTIONS=1 MSCCLPP_WAIT_TIMEOUT=3 run_step \
    "test one hardware queue: the stall is reported and named" 60 bash -c \
    'ranks 2 "$BIN/bandwidth" --max 64K >"$WORK/one-queue.out" 2>&1; rc=$?; cat "$WORK/one-queue.out"
     ((rc != 0)) && grep -q "CUDA_DEVICE_MAX_CONNECTIONS=1 gives this process one" "$WORK/one-queue.out" &&
       grep -q "to complete (CUDA_DEVICE_MAX_CONNECTIONS=1 is set" "$WORK/one-queue.out"'
  # mscclppRegisteredBufferWrite from GPU memory over P2P: a source at a reused address, 10^4
  # source ranges, and stream = cudaStreamPerThread under --default-stream per-thread.
  if [[ -x $BIN/regwrite ]]; then
    run_step "test registered writes over P2P" 90 bash -c \
      'ranks 2 "$BIN/regwrite" >"$WORK/regwrite.out" 2>&1; rc=$?; cat "$WORK/regwrite.out"
       ((rc == 0)) && grep -q "regwrite: ok" "$WORK/regwrite.out"'
  else
    FAILED+=("regwrite not built")
  fi
  # Issue 30: the P2P direct path (c_examples/cuda/direct.cu): every ordering case between
  # puts and signals that the kernel stores itself and those through the proxy, every byte
  # checked right after each wait, and the signal counts. Two ranks on GPU 0 under MPS (NGPU=1
  # makes `ranks` start it): by default; with the SM engine carrying the proxied puts
  # (MSCCLPP_P2P_SM_SHARED=1); with a 64 KiB limit; with the path off (the same cases through
  # the proxy alone); where there are two GPUs, one rank on each (NVLink). A lost signal ends
  # the kernel at the device wait timeout (5 s) instead of the step's. Each prints
  # "direct ordering: PASSED"; the range case "direct range: PASSED" (a direct-sized put past
  # the peer's buffer refused by the proxy, the 4 KiB after it untouched).
  if [[ -x $BIN/direct ]]; then
    direct_run() { # NAME VAR=VALUE... -- ARGS...: one run, under `timeout` (run_step)
      local name=$1 vars=()
      shift
      while [[ $1 != -- ]]; do vars+=("$1"); shift; done
      shift
      run_step "test direct path: $name" 60 env "${vars[@]}" MSCCLPP_DEVICE_WAIT_TIMEOUT=5 \
        MSCCLPP_DEBUG=INFO bash -c 'ranks 2 "$BIN/direct" "$@" >"$WORK/direct.out" 2>&1; rc=$?
          cat "$WORK/direct.out"
          ((rc == 0)) && grep -q -E "^direct (ordering|range): PASSED" "$WORK/direct.out"' _ "$@"
    }
    direct_run "2 ranks on one GPU (MPS)" CUDA_VISIBLE_DEVICES=0 NGPU=1 --
    direct_run "2 ranks on one GPU, SM engine on" CUDA_VISIBLE_DEVICES=0 NGPU=1 MSCCLPP_P2P_SM_SHARED=1 --
    direct_run "2 ranks on one GPU, 64 KiB limit" CUDA_VISIBLE_DEVICES=0 NGPU=1 MSCCLPP_P2P_DIRECT_BYTES=65536 --
    direct_run "2 ranks on one GPU, path off" CUDA_VISIBLE_DEVICES=0 NGPU=1 MSCCLPP_P2P_DIRECT_BYTES=0 --
    direct_run "a put past the buffer is refused" CUDA_VISIBLE_DEVICES=0 NGPU=1 -- --case range
    if ((NGPU >= 2)); then
      direct_run "2 ranks on 2 GPUs" CUDA_VISIBLE_DEVICES=0,1 NGPU=2 --
    fi
  else
    FAILED+=("direct not built")
  fi
  # Issue 28: puts of 4 GiB and more, and device waits that end (GPU_CHECK_LIMITS=1 runs them
  # with GPU_CHECK_QUICK=1 too). Two ranks on GPU 0 under MPS (NGPU=1 makes `ranks` start it).
  if ((${GPU_CHECK_LIMITS:-$((!QUICK))})); then
    # Each rank registers 5 GiB; rank 0's kernel: putWithSignal of 4 GiB + 4096 at offset 0, a
    # 1 MiB put at 4 GiB + 8192, then a put of exactly 2^32 bytes and flush(). Rank 1 prints
    # one "ok" line per byte checked (first, last, chunk boundary, past the end untouched).
    if [[ -x $BIN/bigput ]]; then
      run_step "test puts of 4 GiB and more (5 GiB buffers, 2 ranks on one GPU)" 120 bash -c \
        'CUDA_VISIBLE_DEVICES=0 NGPU=1 ranks 2 "$BIN/bigput"'
      # A 4 GiB + 4096 put at 1 GiB into the peer's 5 GiB: refused whole, no chunk moved.
      run_step "test a split put past the buffer is refused before any chunk moves" 90 bash -c \
        'CUDA_VISIBLE_DEVICES=0 NGPU=1 ranks 2 "$BIN/bigput" --case range >"$WORK/bigrange.out" 2>&1
         rc=$?; cat "$WORK/bigrange.out"; ((rc == 0)) && (($(grep -c "bigput range: PASSED" "$WORK/bigrange.out") == 2))'
    else
      FAILED+=("bigput not built")
    fi
    # A kernel that waits for a signal that never comes (wait), flushes or pushes behind a put
    # with no proxy running (flush, push): the WARN at ~2 s (wait), the kernel back at ~5 s,
    # mscclppCommGetAsyncError = mscclppRemoteError with the record, and stop and destroy
    # return. `stuck` checks each and prints "stuck CASE: PASSED".
    if [[ -x $BIN/stuck ]]; then
      for case in wait flush push deadlock handover; do
        MSCCLPP_WAIT_TIMEOUT=2 MSCCLPP_DEVICE_WAIT_TIMEOUT=5 run_step \
          "test device wait timeout: $case (2 ranks on one GPU, MPS)" 60 bash -c \
          "CUDA_VISIBLE_DEVICES=0 NGPU=1 ranks 2 \"\$BIN/stuck\" --case $case --warn 2 --limit 5"
      done
    else
      FAILED+=("stuck not built")
    fi
  fi
  if ((QUICK)); then
    MSCCLPP_P2P_ENGINE=ce run_step "test allgather 2 ranks, copy engines only" 90 \
      bash -c 'ranks 2 "$BIN/allgather"'
    p2p_benches
    MSCCLPP_P2P_STATS=1 MSCCLPP_DEBUG=INFO bench "profile allgather" 60 - \
      bash -c 'ranks 2 "$BIN/allgather" --profile --sizes 1M'
    grep -h -E "stats:" "$LAST_OUT" | sed 's/^/STATS /' >>"$RES"
  else
    run_step "test allgather 4 ranks / 2 GPUs" 150 bash -c 'ranks 4 "$BIN/allgather"'
    MSCCLPP_P2P_ENGINE=ce run_step "test allgather 2 ranks, copy engines only" 90 \
      bash -c 'ranks 2 "$BIN/allgather"'
    MSCCLPP_P2P_ENGINE=ce MSCCLPP_P2P_FLAG=copy run_step "test allgather 2 ranks, copy engines, flags by copy" 90 \
      bash -c 'ranks 2 "$BIN/allgather"'
    # The OMPI_COMM_WORLD_* path of launch_env.h (the root address still given with -a).
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 run_step "test allgather under mpirun" 60 \
      mpirun --allow-run-as-root -np 2 --oversubscribe --bind-to none -x NCCL_NVLS_ENABLE \
      -x LD_LIBRARY_PATH -x MSCCLPP_BOOTSTRAP_TIMEOUT -x MSCCLPP_WAIT_TIMEOUT \
      "$BIN/allgather" -a "127.0.0.1:$("$ROOT/scripts/free-port.sh")"

    # GPU memory over libfabric (no CUDA FI_HMEM here: staged through pinned host memory), and
    # communicators that mix P2P and network connections.
    MSCCLPP_EXAMPLE_TRANSPORT=ib MSCCLPP_NET_PROVIDER=tcp run_step "test allgather over ib(tcp), 2 ranks" 90 \
      bash -c 'ranks 2 "$BIN/allgather"'
    MSCCLPP_EXAMPLE_TRANSPORT=shm run_step "test allgather over shm, 2 ranks" 90 bash -c 'ranks 2 "$BIN/allgather"'
    MSCCLPP_EXAMPLE_TRANSPORT=ib MSCCLPP_NET_PROVIDER=tcp MSCCLPP_NET_STAGING_BYTES=65536 \
      MSCCLPP_NET_STAGING_SLOTS=4 run_step "test allgather over ib(tcp), tiny staging ring" 90 \
      bash -c 'ranks 2 "$BIN/allgather"'
    MSCCLPP_EXAMPLE_TRANSPORT=mixed MSCCLPP_NET_PROVIDER=tcp run_step "test allgather mixed P2P + ib, 4 ranks" 150 \
      bash -c 'ranks 4 "$BIN/allgather"'

    # Scaling (issue 6): 8 ranks on the GPUs there are (4 per GPU on 2 GPUs); with 8 GPUs also
    # 16 ranks (two per GPU). NCCL refuses two ranks on one GPU, so it is measured only at one
    # rank per GPU.
    run_step "test allgather 8 ranks / $NGPU GPUs" 240 bash -c 'ranks 8 "$BIN/allgather"'
    if ((NGPU >= 8)); then
      run_step "test allgather 16 ranks / $NGPU GPUs" 300 bash -c 'ranks 16 "$BIN/allgather"'
    fi

    # 4. Benchmarks (RESULT lines go to results.txt).
    p2p_benches
    bench "bench allgather 8 ranks / $NGPU GPUs" 240 r8 bash -c 'ranks 8 "$BIN/allgather" --bench'
    MSCCLPP_EXAMPLE_TRANSPORT=ib MSCCLPP_NET_PROVIDER=tcp bench "bench allgather over ib(tcp), staged" 120 ib \
      bash -c 'ranks 2 "$BIN/allgather" --bench --sizes 1M,64M'
    # Where the time goes: inside the kernel (put / flush / wait) and in the proxy's driver calls.
    MSCCLPP_P2P_STATS=1 MSCCLPP_DEBUG=INFO bench "profile allgather" 60 - \
      bash -c 'ranks 2 "$BIN/allgather" --profile --sizes 1M,64M'
    grep -h -E "stats:" "$LAST_OUT" | sed 's/^/STATS /' >>"$RES"
    # The SM engine's own round trips (a run of its own: the self-test delays what runs then).
    MSCCLPP_P2P_SM_SELFTEST=1 MSCCLPP_DEBUG=INFO run_step "SM engine self-test" 60 \
      bash -c 'ranks 2 "$BIN/allgather"'
  fi
  grep -h -E "self-test:" "$LAST_OUT" | sed 's/^/STATS /' >>"$RES"
elif ! [[ -x $BIN/allgather && -x $BIN/pingpong && -x $BIN/bandwidth ]]; then
  FAILED+=("examples missing")
fi

# 3b. Stuck jobs tear down (issue 28): two ranks on one GPU over P2P, their kernels stuck in
#     wait() (a deadlock), in flush() (one hardware queue: the proxy's copy queues behind the
#     kernel), in flush() with no proxy launched, or ping-ponging putWithSignal + wait(); the
#     host calls mscclppProxyStop then mscclppCommDestroy (and once destroy alone) under the
#     program's watchdog, with MPS and without (the daemon restarted before every case, so a
#     case that wedges the server does not fail the next). Each rank prints a RESULT
#     stuck_teardown line (how long the stop and destroy took, whether and when its kernel
#     ended) and exits 1 past a bound or when its kernel did not end, 3 on a hang.
stuck_case() { # MODE MPS [ARGS...]
  local mode=$1 mps=$2
  shift 2
  mps_down
  ((mps)) && mps_up
  spawn_ranks 2 env CUDA_VISIBLE_DEVICES="${STUCK_GPU:-0}" "$BIN/stuck_teardown" --mode "$mode" "$@"
}
export -f stuck_case
if ((!${GPU_CHECK_STUCK:-1})) || ! only stuck; then
  echo "stuck teardown skipped (GPU_CHECK_STUCK=0 or GPU_CHECK_ONLY)"
elif [[ -x $BIN/stuck_teardown ]]; then
  for mps in 1 0; do
    [[ $mps == 1 && ${GPU_CHECK_MPS:-1} == 0 ]] && continue
    for args in "wait" "flush" "flush-noproxy" "push" "flushrace" "wait --no-stop"; do
      read -r mode extra <<<"$args"
      run_step "test stuck teardown: $args, mps=$mps" 100 bash -c "stuck_case $mode $mps $extra"
      grep -h '^RESULT stuck_teardown' "$LAST_OUT" |
        sed "s/^RESULT stuck_teardown /RESULT stuck_teardown mps=$mps /" >>"$RES"
    done
  done
  # A kernel that goes on storing into its peer's memory after the release (issue 41): the
  # destroy of its rank keeps the mappings and must not tell the peer they are unmapped; the
  # peer keeps its memory past its own deadline (a short one: MSCCLPP_WAIT_TIMEOUT=3).
  if [[ ${GPU_CHECK_MPS:-1} != 0 ]]; then
    MSCCLPP_WAIT_TIMEOUT=3 run_step "test stuck teardown: store (a kernel storing after the release), mps=1" 60 \
      bash -c 'stuck_case store 1 >"$WORK/store.out" 2>&1; rc=$?; cat "$WORK/store.out"
        ((rc == 0)) && grep -q "not telling ranks \[1\] that their memory is unmapped" "$WORK/store.out" &&
          grep -q "leaking the GPU memory rank 0 maps through CUDA IPC (its epoch blocks): its communicator is destroyed, but something of it still runs" "$WORK/store.out"'
    grep -h '^RESULT stuck_teardown' "$LAST_OUT" |
      sed "s/^RESULT stuck_teardown /RESULT stuck_teardown mps=1 /" >>"$RES"
  fi
  mps_down
else
  FAILED+=("stuck_teardown not built")
fi

# 5a. GPU memory through FI_HMEM (issue 15): Debian's libfabric 2.x source (carried, see the
#     header) built here with CUDA, so that its shm provider registers GPU memory; the same
#     all-gather, ping-pong and bandwidth over the IB transport on every provider that reports
#     FI_HMEM with RMA, and over the SHM transport, each next to the staged path
#     (MSCCLPP_NET_HMEM=0) in the same run. The log must show the FI_HMEM registration.
if [[ -f $CARRY/libfabric-src.tar.gz && -x $BIN/allgather ]] && ((!QUICK)) && only net; then
  LF=$WORK/lf-cuda
  build_cuda_libfabric() {
    rm -rf "$WORK/lf-src" "$LF" && mkdir -p "$WORK/lf-src" &&
      tar xzf "$CARRY/libfabric-src.tar.gz" -C "$WORK/lf-src" &&
      cd "$WORK"/lf-src/libfabric-* &&
      ./configure -q --prefix="$LF" --with-cuda=/usr/local/cuda --disable-static --enable-only \
        --enable-shm=yes --enable-sm2=yes --enable-tcp=yes --enable-rxm=yes >/dev/null &&
      make -s -j"$(nproc)" >/dev/null 2>&1 && make -s install >/dev/null 2>&1 &&
      "$LF/bin/fi_info" --version | head -1
  }
  export -f build_cuda_libfabric
  export LF
  if run_step "libfabric 2.x with CUDA" 240 bash -c build_cuda_libfabric; then
    hmem_providers=$(for p in shm sm2 tcp; do
      LD_LIBRARY_PATH=$LF/lib "$LF/bin/fi_info" -p "$p" -c "FI_HMEM|FI_RMA" -t FI_EP_RDM 2>/dev/null |
        grep -q "provider: $p" && echo "$p"
    done | tr '\n' ' ')
    echo "providers with FI_HMEM and RMA on RDM endpoints: ${hmem_providers:-none}"
    # hmem_run TRANSPORT PROVIDER HMEM NAME SECONDS CMD...: one run against the CUDA libfabric.
    hmem_run() {
      local tr=$1 prov=$2 hmem=$3 name=$4 t=$5
      shift 5
      LD_LIBRARY_PATH=$LF/lib:$LD_LIBRARY_PATH MSCCLPP_EXAMPLE_TRANSPORT=$tr \
        MSCCLPP_NET_PROVIDER=$prov MSCCLPP_NET_HMEM=$hmem MSCCLPP_DEBUG=INFO \
        bench "$name" "$t" "${tr}_${prov}_hmem$hmem" "$@"
      local want="registered with FI_HMEM"
      ((hmem == 0)) && want="staged through pinned host memory"
      if ! grep -q "$want" "$LAST_OUT"; then
        echo "FAILED $name: the log does not show \"$want\""
        FAILED+=("$name (path)")
      fi
    }
    for prov in $hmem_providers; do
      for hmem in 1 0; do
        hmem_run ib "$prov" $hmem "allgather over ib($prov), hmem=$hmem" 120 \
          bash -c 'ranks 2 "$BIN/allgather" --bench --sizes 1M,64M'
      done
      hmem_run ib "$prov" 1 "pingpong over ib($prov), FI_HMEM" 60 bash -c 'ranks 2 "$BIN/pingpong"'
      for hmem in 1 0; do
        hmem_run ib "$prov" $hmem "bandwidth over ib($prov), hmem=$hmem" 120 \
          bash -c 'ranks 2 "$BIN/bandwidth" --max 64M'
      done
    done
    # The provider's own speed on GPU buffers, and on host buffers with the same build: the
    # raw fi_write program between two processes' CUDA buffers registered with FI_HMEM.
    if [[ -x $CARRY/raw_rma ]]; then
      for prov in $hmem_providers; do
        for mode in cuda host; do
          LD_LIBRARY_PATH=$LF/lib:$LD_LIBRARY_PATH run_step "raw fi_write $prov, $mode buffers, libfabric 2.x with CUDA" 120 \
            "$CARRY/raw_rma" --provider $prov $([[ $mode == cuda ]] && echo --cuda) \
            --min-kib 1024 --max-mib 64 --volume-mib 512 --iters 2000
          awk -v k="raw_${prov}_lf2_$mode" '$2 == "KiB" || $2 == "MiB" { b = $1 * ($2 == "MiB" ? 1048576 : 1024);
            print "RESULT " k " bytes=" b " GBps=" $5 }' "$LAST_OUT" >>"$RES"
        done
      done
    fi
    for hmem in 1 0; do
      hmem_run shm shm $hmem "allgather over SHM, hmem=$hmem" 120 \
        bash -c 'ranks 2 "$BIN/allgather" --bench --sizes 1M,64M'
    done
    # Every byte checked: the examples exit non-zero on a wrong byte (the tests, not the
    # benchmarks, check the whole buffer): one test run per path.
    for prov in $hmem_providers; do
      LD_LIBRARY_PATH=$LF/lib:$LD_LIBRARY_PATH MSCCLPP_EXAMPLE_TRANSPORT=ib MSCCLPP_NET_PROVIDER=$prov \
        run_step "test allgather over ib($prov), FI_HMEM" 120 bash -c 'ranks 2 "$BIN/allgather"'
    done
    LD_LIBRARY_PATH=$LF/lib:$LD_LIBRARY_PATH MSCCLPP_EXAMPLE_TRANSPORT=shm \
      run_step "test allgather over SHM, FI_HMEM" 120 bash -c 'ranks 2 "$BIN/allgather"'
  fi
fi

# 5b'. Staging against the wire (issue 15): GPU memory staged over tcp, one way, next to raw
#      fi_write between host buffers on the same provider (crates/libfabric-sys/examples/
#      raw_rma.rs, carried as .carry/raw_rma), same machine, same run.
if [[ -x $BIN/bandwidth ]] && ((!QUICK)) && only net; then
  MSCCLPP_EXAMPLE_TRANSPORT=ib MSCCLPP_NET_PROVIDER=tcp bench "bandwidth over ib(tcp), staged" 120 ib_tcp_staged \
    bash -c 'ranks 2 "$BIN/bandwidth" --max 64M'
  if [[ -x $CARRY/raw_rma ]]; then
    for prov in tcp shm; do
      run_step "raw fi_write host to host, $prov" 120 "$CARRY/raw_rma" --provider $prov \
        --min-kib 1024 --max-mib 64 --volume-mib 512
      awk -v p=$prov '$2 == "KiB" || $2 == "MiB" { b = $1 * ($2 == "MiB" ? 1048576 : 1024);
        print "RESULT raw_" p " bytes=" b " GBps=" $5 }' "$LAST_OUT" >>"$RES"
    done
  fi
fi

# 5c. Two hosts with GPUs (issue 15): two network namespaces joined by a veth pair (addresses
#     only inside them), one rank in each, GPU buffers over tcp (staged), every byte checked.
#     Where the machine refuses namespaces, the two ranks bind two loopback addresses instead,
#     and the step says so.
if [[ -x $BIN/allgather ]] && ((!QUICK)) && only net; then
  two_hosts() {
    local a=mscclpp-gpu-a b=mscclpp-gpu-b port=$("$ROOT/scripts/free-port.sh") rc=0 p0 p1
    local env=(MSCCLPP_EXAMPLE_TRANSPORT=ib MSCCLPP_NET_PROVIDER=tcp MSCCLPP_DEBUG=INFO)
    cleanup() { ip netns del $a 2>/dev/null; ip netns del $b 2>/dev/null; true; }
    cleanup
    if command -v ip >/dev/null && ip netns add $a 2>/dev/null && ip netns add $b &&
      ip link add veth-mga type veth peer name veth-mgb &&
      ip link set veth-mga netns $a && ip link set veth-mgb netns $b &&
      ip -n $a addr add 10.99.7.1/24 dev veth-mga && ip -n $b addr add 10.99.7.2/24 dev veth-mgb &&
      ip -n $a link set veth-mga up && ip -n $b link set veth-mgb up &&
      ip -n $a link set lo up && ip -n $b link set lo up; then
      echo "two network namespaces, 10.99.7.1 (rank 0) and 10.99.7.2 (rank 1), over a veth pair"
      ip netns exec $a env "${env[@]}" MSCCLPP_NET_IFACE=veth-mga \
        "$BIN/allgather" -r 0 -n 2 -a "10.99.7.1:$port" &
      p0=$!
      ip netns exec $b env "${env[@]}" MSCCLPP_NET_IFACE=veth-mgb \
        "$BIN/allgather" -r 1 -n 2 -a "10.99.7.1:$port" &
      p1=$!
    else
      local why
      if ! command -v ip >/dev/null; then
        why="no ip command (iproute2)"
      else
        why=$(ip netns add $a 2>&1 || true)
      fi
      cleanup
      echo "NOTE: no network namespaces here (${why:-unknown reason}); two loopback addresses instead"
      env "${env[@]}" MSCCLPP_NET_ADDR=127.0.0.1 "$BIN/allgather" -r 0 -n 2 -a "127.0.0.1:$port" &
      p0=$!
      env "${env[@]}" MSCCLPP_NET_ADDR=127.0.0.2 "$BIN/allgather" -r 1 -n 2 -a "127.0.0.1:$port" &
      p1=$!
    fi
    wait $p0 || rc=$?
    wait $p1 || rc=$?
    cleanup
    return $rc
  }
  export -f two_hosts
  mps_up
  run_step "test allgather between two network namespaces, GPU memory over tcp" 150 bash -c two_hosts
  grep -h "region 0 .*staged\|net: opened" "$LAST_OUT" | head -4
  mps_down
fi

# 5d. Striping over rails (issue 16) on this machine's cores: host memory between two network
#     namespaces joined by four veth pairs, sendrecv_perf over 1, 2 and 4 rails, alternated
#     twice, every byte checked (bench/rails.sh); rows in $OUT/rails.txt.
if [[ -x $BIN/sendrecv_perf ]] && ((!QUICK)) && only net; then
  run_step "striping over 1, 2 and 4 veth rails between namespaces (host memory)" 120 \
    env PERF_BIN="$BIN" PERF_OUT="$WORK/rails" PERF_SIZES="-b 1M -e 64M -f 4" \
    bash "$ROOT/bench/rails.sh" 2
  cp "$WORK"/rails/*-rails.txt "$OUT/rails.txt" 2>/dev/null
  grep -E "^## run|^ +(4194304|67108864) " "$OUT/rails.txt" 2>/dev/null
fi

# 5e. The Python package (issue 31): where a wheel built where Rust is lies in $CARRY
#     (`pip wheel --no-deps -w .carry ./python`), python/gpu_examples.sh installs it and runs
#     the CuPy (NVRTC, nvcc, over libfabric), PyTorch (torchrun, load_inline) and NumPy
#     all-gathers, 2 ranks on one GPU under its own MPS daemon, every byte checked, examples/ep
#     driven from torch (ep_torch.py), then the package's pytest suite; its log also goes to
#     $OUT/python-gpu-examples.log.
wheel=$(ls "$CARRY"/mscclpp_rs-*.whl 2>/dev/null | head -1)
if [[ -z $wheel ]]; then
  echo "SKIPPED the Python examples: no $CARRY/mscclpp_rs-*.whl (pip wheel --no-deps -w .carry ./python)"
elif only python; then
  mps_down
  run_step "Python package: CuPy, PyTorch and NumPy examples, examples/ep from torch (python/gpu_examples.sh)" \
    "${GPU_CHECK_PYTHON_BUDGET:-420}" bash "$ROOT/python/gpu_examples.sh" "$wheel"
  grep -h '^RESULT ep' "$OUT/python-gpu-examples.log" 2>/dev/null | sed 's/^/PY /'
  mps_down
fi

# 5f. Expert parallelism (issue 44): examples/ep's dispatch and combine (BF16, hidden 7168, 256
#     experts, top-8, 1 to 128 tokens per rank, GPU_CHECK_EP_STEPS timed steps each, 1000 by
#     default), 2 and 4 ranks on GPU 0 under MPS, each rank CUDA_MPS_ACTIVE_THREAD_PERCENTAGE =
#     100 / ranks so that every rank's spinning kernel stays resident: the direct path, every
#     operation through the proxy (MSCCLPP_P2P_DIRECT_BYTES=0 MSCCLPP_P2P_DIRECT_BLOCK_BYTES=0,
#     CUDA_DEVICE_MAX_CONNECTIONS=16; GPU_CHECK_EP_PROXY_STEPS steps, 100 by default, with the
#     proxy's stats),
#     and, fewer steps and tokens, the network path (MSCCLPP_EXAMPLE_TRANSPORT=ib, libfabric
#     tcp, GPU memory staged); then the NVSHMEM peer (bench/gpu/nvshmem_ep.cu, ours, written
#     as NVSHMEM's users write it) on the same shape, and pplx-kernels where its tree is at
#     GPU_CHECK_PPLX_SRC (default .pplx/src; carry it: bench/gpu/pplx/README.md). On a machine
#     with several GPUs, also one rank per GPU without MPS (ours direct and proxied, both
#     peers, and pplx's torch all-to-all row over NCCL, a timing row with nothing to check).
#     Every other run checks every count, row and output value (exit 1 on a wrong one);
#     RESULT lines to $OUT/ep.txt, the table after.
# ep_place NP: the environment of NP ranks' placement, as VAR=VALUE words for `env`: all on
# GPU 0, each with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / NP (under the MPS daemon the
# caller started); with EP_SPREAD set (by ep_runs) none: rank r on GPU r (NP <= NGPU, no MPS),
# as users run.
ep_place() {
  [[ -n ${EP_SPREAD:-} ]] || echo "CUDA_VISIBLE_DEVICES=0 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / $1))"
}
ep_case() { # NP LABEL [VAR=VALUE...] -- ARGS...
  local np=$1 label=$2 vars=()
  shift 2
  while [[ $1 != -- ]]; do vars+=("$1"); shift; done
  shift
  echo "## ep $label ranks=$np${EP_SPREAD:+, one per GPU}"
  (
    ((${#vars[@]} == 0)) || export "${vars[@]}"
    # Each rank bounded, so that a case that hangs leaves time for the others.
    # shellcheck disable=SC2046 # ep_place's words are VAR=VALUE pairs
    spawn_ranks "$np" timeout -k 5 "${GPU_CHECK_EP_CASE_S:-150}" env $(ep_place "$np") "$BIN/ep" "$@"
  ) >"$WORK/ep.out" 2>&1
  local rc=$?
  grep -v '^RESULT' "$WORK/ep.out" | grep -E 'operations issued|ep: ok|wrong|FAILED|failed|error|stats:' | head -20
  sed -n "s/^RESULT ep impl=mscclpp /RESULT ep impl=mscclpp-$label /p" "$WORK/ep.out" | tee -a "$OUT/ep.txt"
  ((rc == 0)) || { echo "FAILED: ep $label ranks=$np (exit $rc)"; grep -v "^RESULT" "$WORK/ep.out" | tail -20; }
  return $rc
}
ep_nvshmem() { # BIN NP ARGS... (BIN: bench/gpu/nvshmem_ep built by ep_runs)
  local bin=$1 np=$2 r pids=() rc=0
  shift 2
  nvshmem_env
  rm -f "$WORK/nvshmem/ep.uid"
  echo "## ep nvshmem ranks=$np${EP_SPREAD:+, one per GPU}"
  for ((r = 0; r < np; r++)); do
    # shellcheck disable=SC2046 # ep_place's words are VAR=VALUE pairs
    env $(ep_place "$np") timeout -k 5 200 "$bin" $r "$np" "$WORK/nvshmem/ep.uid" "$@" \
      >"$WORK/nvshmem/ep.$r" 2>&1 &
    pids+=($!)
  done
  for r in "${pids[@]}"; do wait "$r" || rc=$?; done
  grep -h '^RESULT ep' "$WORK/nvshmem/ep.0" | tee -a "$OUT/ep.txt"
  ((rc == 0)) || { echo "FAILED: nvshmem_ep ranks=$np (exit $rc)"; tail -8 "$WORK"/nvshmem/ep.*; }
  return $rc
}
# pplx-kernels' intranode all-to-all (bench/gpu/pplx: its README says how to get the tree,
# which stays out of this repository, built by ep_runs) on the same shape, graph mode, rank
# 0's times. Its kernels are cooperative grids of one 1024-thread block per SM that spin on
# each other's flags, so ranks sharing a GPU need their grids to fit on it at once wherever
# MPS places them: 64 / ranks blocks (32 with 2 ranks, the SMs ours use; 32 with 4 ranks
# stalled, as 66 with 2 did). One rank per GPU (EP_SPREAD=1): its own grid, the GPU's SMs.
ep_pplx() { # SRC NP STEPS
  local src=$1 np=$2 steps=$3 cap=() rc=0
  echo "## ep pplx-kernels ranks=$np${EP_SPREAD:+, one per GPU}"
  [[ -n ${EP_SPREAD:-} ]] || cap=(PPLX_NUM_SMS=$((64 / np)))
  # shellcheck disable=SC2046 # ep_place's words are VAR=VALUE pairs
  env $(ep_place "$np") "${cap[@]}" CUDA_MODULE_LOADING=EAGER \
    timeout -k 5 150 python3 "$ROOT/bench/gpu/pplx/pplx_a2a_bench.py" --ranks "$np" --src "$src" \
    --steps "$steps" --modes graph --hang-s 120 >"$WORK/pplx.$np" 2>&1 || rc=1
  grep -E 'rows|grid' "$WORK/pplx.$np" | grep 'rank 0' | head -6
  grep -h '^RESULT ep' "$WORK/pplx.$np" | tee -a "$OUT/ep.txt"
  grep -q "^RESULT ep impl=pplx ranks=$np " "$WORK/pplx.$np" ||
    { rc=1; echo "FAILED: pplx-kernels ranks=$np"; tail -8 "$WORK/pplx.$np"; }
  return $rc
}
ep_runs() {
  local np rc=0 steps=${GPU_CHECK_EP_STEPS:-1000} peer=""
  unset EP_SPREAD # the shared runs first, whatever the caller's environment says
  # The NVSHMEM peer, built once for every rank count.
  source "$ROOT/bench/gpu/nvshmem.sh"
  if nvshmem_home >/dev/null; then
    peer=$(nvshmem_build "$WORK/nvshmem" nvshmem_ep) || rc=1
  else
    echo "SKIPPED the NVSHMEM peer: no NVSHMEM wheel"
  fi
  mps_down
  mps_up
  for np in ${GPU_CHECK_EP_RANKS:-2 4}; do
    ep_case "$np" direct -- --steps "$steps" || rc=1
    # 16 hardware work queues: with 3 or more ranks under MPS, CUDA's default of 8 let the
    # proxy's copies queue behind another rank's spinning kernel (the library WARNs so).
    ep_case "$np" proxy MSCCLPP_P2P_DIRECT_BYTES=0 MSCCLPP_P2P_DIRECT_BLOCK_BYTES=0 MSCCLPP_P2P_STATS=1 \
      CUDA_DEVICE_MAX_CONNECTIONS=16 \
      -- --steps "${GPU_CHECK_EP_PROXY_STEPS:-100}" --warmup 5 || rc=1
    [[ -n $peer ]] && { ep_nvshmem "$peer" "$np" --steps "$steps" || rc=1; }
  done
  # Block puts through the proxy, a thread's puts direct (a block limit under a row's bytes):
  # the rows go packed while the counts could go in place.
  ep_case 2 blockproxy MSCCLPP_P2P_DIRECT_BLOCK_BYTES=0 -- --steps 100 --warmup 5 || rc=1
  ep_case 2 network MSCCLPP_EXAMPLE_TRANSPORT=ib MSCCLPP_NET_PROVIDER=tcp -- --steps 20 --warmup 2 --tokens 1,8 || rc=1
  local pplx=${GPU_CHECK_PPLX_SRC:-$ROOT/.pplx/src}
  if [[ ! -d $pplx/csrc ]]; then
    echo "SKIPPED pplx-kernels: no tree at $pplx (bench/gpu/pplx/README.md)"
    pplx=""
  elif ! SRC=$pplx bash "$ROOT/bench/gpu/pplx/build.sh" >"$WORK/pplx-build.log" 2>&1; then
    echo "FAILED: pplx-kernels did not build"
    tail -20 "$WORK/pplx-build.log"
    pplx=""
    rc=1
  fi
  if [[ -n $pplx ]]; then
    # A daemon of its own: a case before that faulted can leave MPS refusing new clients.
    mps_down
    mps_up
    for np in ${GPU_CHECK_EP_RANKS:-2 4}; do ep_pplx "$pplx" "$np" "$steps" || rc=1; done
  fi
  mps_down
  # The table of the shared runs now, so that the step's bound cannot take it.
  python3 "$ROOT/bench/gpu/ep_table.py" "$OUT/ep.txt" || rc=1
  # One rank per GPU where there are several, without MPS, as users run: ours (direct and all
  # through the proxy) and both peers, rows of their own (gpus= in the RESULT lines).
  if ((NGPU >= 2)); then
    export EP_SPREAD=1
    ep_case "$NGPU" direct -- --steps "$steps" || rc=1
    ep_case "$NGPU" proxy MSCCLPP_P2P_DIRECT_BYTES=0 MSCCLPP_P2P_DIRECT_BLOCK_BYTES=0 MSCCLPP_P2P_STATS=1 \
      -- --steps "${GPU_CHECK_EP_PROXY_STEPS:-100}" --warmup 5 || rc=1
    [[ -n $peer ]] && { ep_nvshmem "$peer" "$NGPU" --steps "$steps" || rc=1; }
    [[ -n $pplx ]] && { ep_pplx "$pplx" "$NGPU" "$steps" || rc=1; }
    unset EP_SPREAD
    python3 "$ROOT/bench/gpu/ep_table.py" "$OUT/ep.txt" || rc=1
  fi
  return $rc
}
export -f ep_place ep_case ep_nvshmem ep_pplx ep_runs
if [[ -x $BIN/ep ]] && only ep; then
  run_step "expert parallelism: examples/ep, its NVSHMEM peer and pplx-kernels, one GPU under MPS (and one per GPU)" \
    "${GPU_CHECK_EP_BUDGET:-300}" bash -c ep_runs
fi

# 5b. While tuning: GPU_CHECK_EXTRA, a bash command line run as one more step (bounded by the
#     budget like the others), with `ranks` and the variables BIN, RES, WORK, PREFIX, NVCC; e.g.
#     'source "$ROOT/bench/gpu/tune.sh"; tune 5 allgather "--bench" "a:" "b:VAR=1"'.
if [[ -n ${GPU_CHECK_EXTRA:-} && -x $BIN/allgather ]] && only extra; then
  export RES
  run_step "extra" $(($(left) - 15)) bash -c "$GPU_CHECK_EXTRA"
fi

# 6. The table.
say "results"
python3 - "$RES" <<'EOF'
import re, sys
res = {}
for line in open(sys.argv[1]):
    m = re.match(r"RESULT (\S+) (.*)", line.strip())
    if not m:
        continue
    kv = dict(x.split("=", 1) for x in m.group(2).split() if "=" in x)
    res.setdefault(m.group(1), []).append(kv)
def ag(kind, n):
    for kv in res.get(kind, []):
        if kv.get("bytes") == str(n) and kv.get("nranks", "2") == "2":
            return kv
    for kv in res.get(kind, []):
        if kv.get("bytes") == str(n):
            return kv
    return None
def fmt(kv):
    if not kv:
        return "n/a"
    return kv["us"] + ("" if kv.get("check", "ok") == "ok" else " (BAD DATA)")
rows = [("1 MiB", 1 << 20, "17.3", "10"), ("64 MiB", 64 << 20, "103", "95"),
        ("1 GiB", 1 << 30, "1393", "1380")]
import os
ngpu = os.environ.get("NGPU", "?")
ours_gpus = min(2, int(ngpu)) if ngpu.isdigit() else ngpu  # rank r on GPU r % ngpus
shared = ("; the ranks share the GPU under MPS" if os.environ.get("GPU_CHECK_MPS", "1") != "0"
          else "; ranks sharing a GPU time-slice it (~2 ms per switch), so these are no P2P figures")
print(f"all-gather, ours with 2 ranks on {ours_gpus} GPU(s), NCCL with one rank per GPU "
      f"({ngpu} ranks): time per all-gather in us (10 x 10 CUDA-graph launches)"
      + (shared if ngpu == "1" else ""))
print("| size   | ours    | ours, copy engines only | NCCL    | 2023 anchor | target |")
print("|--------|---------|-------------------------|---------|-------------|--------|")
for name, n, anchor, target in rows:
    print(f"| {name:6} | {fmt(ag('allgather', n)):7} | {fmt(ag('allgather_ce', n)):23} | "
          f"{fmt(ag('nccl', n)):7} | {anchor:11} | {target:6} |")
ib = res.get("allgather_ib", [])
if ib:
    print("all-gather over ib(tcp), GPU memory staged through host memory, 2 ranks, us: " +
          ", ".join(f"{int(kv['bytes']) >> 20} MiB {fmt(kv)}" for kv in ib))
for k in sorted(res):
    if k.startswith("raw_") or (k.startswith("bandwidth_") and k != "bandwidth"):
        print(k, "GB/s: " + ", ".join(f"{int(kv['bytes']) >> 10} KiB {kv['GBps']}"
                                      for kv in res[k] if int(kv['bytes']) >= 1 << 20))
    elif "_hmem" in k and k.startswith("allgather_"):
        print(f"all-gather {k[len('allgather_'):]}, us: " + ", ".join(
            f"{int(kv['bytes']) >> 20} MiB {fmt(kv)}" for kv in res[k]))
    elif "_hmem" in k and not k.startswith("bandwidth_"):
        print(k, "; ".join(" ".join(f"{a}={b}" for a, b in kv.items()) for kv in res[k]))
r8 = res.get("allgather_r8", [])
if r8:
    print(f"all-gather, 8 ranks on the machine's {ngpu} GPU(s), us per all-gather: " +
          ", ".join(f"{int(kv['bytes']) >> 20} MiB {fmt(kv)}" for kv in r8))
for k in ("pingpong", "pingpong_proxy", "pingpong_direct", "pingpong_ce", "fifo", "fifo_proxy",
          "fifo_direct", "fifo_ce", "profile", "stuck_teardown"):
    for kv in res.get(k, []):
        if "bytes" not in kv:
            print(k, " ".join(f"{a}={b}" for a, b in kv.items()))
# The direct path against the proxy (issue 30): the put sweeps (one thread, one block), and
# the small all-gathers.
for tag, what in (("", "putWithSignal one way by one thread"),
                  ("block", "putWithSignalBlock one way by one block of 512 threads")):
    on, off = f"pingpong_{tag}direct", f"pingpong_{tag}proxy"
    sweep = {}
    for k in (on, off):
        for kv in res.get(k, []):
            if "bytes" in kv:
                sweep.setdefault(int(kv["bytes"]), {})[k] = kv["us"]
    if sweep:
        print(f"{what}, us: | bytes | direct path | proxy |")
        for n in sorted(sweep):
            print(f"| {n} | {sweep[n].get(on, 'n/a')} | {sweep[n].get(off, 'n/a')} |")
for n in (1024, 4096):
    d, p = ag("allgather", n), ag("allgather_proxy", n)
    if d or p:
        print(f"all-gather {n} bytes, 2 ranks, us: default (direct) {fmt(d)}, proxy only {fmt(p)}")
for k, how in (("bandwidth", ""), ("bandwidth_blocks", ", block puts over up to 128 blocks")):
    bw = res.get(k, [])
    if bw:
        print(f"put bandwidth rank 0 -> rank 1{how}: " + ", ".join(
            f"{int(kv['bytes']) >> 10} KiB {kv['GBps']} GB/s" for kv in bw))
parts = {}
for kv in res.get("parts", []):
    if "part" in kv:
        parts.setdefault(int(kv["bytes"]), {})[int(kv["part"])] = kv["us"]
if parts:
    print("block put taken apart (bandwidth --parts), us per put: | bytes | putWithSignalBlock | "
          "without the path decision | copy, barrier, fence + add | copy, barrier, add | "
          "copy, barrier |")
    for n in sorted(parts):
        print(f"| {n} | " + " | ".join(parts[n].get(p, "n/a") for p in range(5)) + " |")
for line in open(sys.argv[1]):
    if line.startswith("STATS "):
        print(line.strip())
EOF
if ((${#FAILED[@]})); then
  echo "FAILED STEPS: ${FAILED[*]}"
  status=1
else
  echo "ALL STEPS PASSED"
  status=0
fi
echo "total ${SECONDS}s"
cp "$NCCL_LOG" "$OUT/" 2>/dev/null || true
exit $status
