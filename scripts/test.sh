#!/usr/bin/env bash
# Every test of the repository, one step after the other, with a summary table at the end:
#
#   scripts/test.sh
#
# Steps, by their names in the summary: deps (system packages, rustfmt, clippy); fmt; clippy;
# doc (no warnings: links that do not resolve); cargo test (workspace), but the tests over the
# unordered fabric layer, which run as their own step next; unordered fabric (every test named
# `unordered`: the layer playing cxi, efa-rdm, psm3 and verbs over tcp and shm, with rails and
# staged sources, the planted-bug tests, the all-to-all and the two-endpoint test over it);
# header (regeneration check); abi (ctest) (layout checks); cuda compile (every CUDA source
# a GPU run builds, compile only, by nvcc 13.0 from NVIDIA's PyPI wheels:
# scripts/check-cuda-compile.sh); header compile (gcc/clang, C11..C++20, and that nvcc, or
# one installed); cmake install; exports (the installed library's
# symbols); ctest (C/C++) (header tests); c_examples build (find_package); pkg-config build;
# c_examples run (bootstrap_demo and allgather_host with 3 local ranks, shared and static
# library, examples/ep's ep_host over tcp, SHM and the EFA- and cxi-like unordered layers, and
# the perf tools); scale (allgather_host with 32 ranks over tcp and shm, twice
# each); sanitize (ASan/UBSan and valgrind, scripts/sanitize.sh); python (the package built
# with pip into a venv, its pytest suite python/tests); libfabric 2.x (the libfabric suites
# against libfabric 2.x built from Debian's source, scripts/libfabric2.sh); soak (4 ranks over
# tcp and shm, examples/soak.rs).
#
# Needs Debian/Ubuntu (missing packages are installed with apt-get) and a Rust toolchain.
# Environment: CARGO_TARGET_DIR (default ./target), MSCCLPP_TEST_BUILD_DIR (default
# ./build/test), MSCCLPP_TEST_SKIP="step step..." (names as in the summary) to skip steps,
# MSCCLPP_SOAK_SECONDS (per provider, default 30).
# The last line is "N passed, M failed" (steps); the exit status is non-zero if any failed.
set -uo pipefail

MSCCLPP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$MSCCLPP_ROOT"
# shellcheck source=scripts/common.sh
source scripts/common.sh

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$MSCCLPP_ROOT/target}
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
# Disk: CI's machine has had as little as a few hundred MB free, and a full run once ran out
# at its last build. A run from a clean clone gains nothing from incremental state, and line
# tables keep file:line in backtraces and sanitizer reports at a fraction of full debug info's
# size. Both can be overridden from the environment.
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
export CARGO_PROFILE_DEV_DEBUG=${CARGO_PROFILE_DEV_DEBUG:-line-tables-only}
build=${MSCCLPP_TEST_BUILD_DIR:-$MSCCLPP_ROOT/build/test}
prefix=$build/install
skip=" ${MSCCLPP_TEST_SKIP:-} "

names=() results=() times=()
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

# step NAME [needs=OTHER_STEP] -- COMMAND...: runs COMMAND, records PASS/FAIL and its seconds;
# SKIP when listed in MSCCLPP_TEST_SKIP or when the step it needs did not pass.
step() {
  local name=$1 needs="" start rc result i
  shift
  [[ $1 == needs=* ]] && { needs=${1#needs=}; shift; }
  [[ $1 == -- ]] && shift
  names+=("$name")
  if [[ $skip == *" $name "* ]]; then
    results+=("SKIP (MSCCLPP_TEST_SKIP)") times+=(0)
    return
  fi
  if [[ -n $needs ]]; then
    for i in "${!names[@]}"; do
      if [[ ${names[$i]} == "$needs" && ${results[$i]:-} != PASS ]]; then
        results+=("SKIP ($needs did not pass)") times+=(0)
        return
      fi
    done
  fi
  printf '\n=== %s: %s\n' "$name" "$*"
  start=$SECONDS
  # The output also goes to a file, so that a failed step's last lines can be repeated under
  # the summary: a CI log is often read from its end only. (The step runs in a subshell of the
  # pipe; no step sets variables for later ones.)
  "$@" 2>&1 | tee "$logs/step.out"
  rc=${PIPESTATUS[0]}
  if ((rc == 0)); then result=PASS; else
    result=FAIL
    tail -n 25 "$logs/step.out" >"$logs/failed.$((${#names[@]} - 1))"
  fi
  results+=("$result") times+=($((SECONDS - start)))
  printf '=== %s: %s (%ss)\n' "$name" "$result" "$((SECONDS - start))"
}

deps() { ensure_apt_packages && ensure_cargo rustfmt clippy; }

# The tests over the unordered fabric layer (`MSCCLPP_TEST_UNORDERED`), and how many passed.
unordered_fabric() {
  cargo test -p mscclpp --no-fail-fast -- unordered 2>&1 | tee "$logs/unordered.out"
  local rc=${PIPESTATUS[0]}
  # Unique names: a multi-process test's ranks print their own "test ... ok" lines too.
  local ok failed
  ok=$(grep -oE '^test [^ ]*unordered[^ ]* \.\.\. ok$' "$logs/unordered.out" | sort -u | wc -l)
  failed=$(grep -oE '^test [^ ]*unordered[^ ]* \.\.\. FAILED$' "$logs/unordered.out" | sort -u | wc -l)
  echo "unordered fabric layer: $ok tests passed, $failed failed" | tee -a "$logs/summary"
  # Per provider the layer plays (docs/PROVIDERS.md), and the planted bugs: each such test
  # passes only when the layer catches the defense it takes out.
  local p line=""
  for p in cxi efa psm3 verbs; do
    line+=" $p $(grep -oE "^test [^ ]*unordered_${p}[^ ]* \.\.\. ok\$" "$logs/unordered.out" | sort -u | wc -l),"
  done
  echo "  passed per profile played:${line%,}" | tee -a "$logs/summary"
  local planted
  planted=$(grep -oE '^test [^ ]*unordered_planted_[a-z_0-9]* \.\.\. (ok|FAILED)$' "$logs/unordered.out" |
    sort -u | sed -E 's/^test ([^ ]*::)?unordered_planted_([a-z_0-9]*) \.\.\. (.*)$/\2 (\3)/' | paste -sd, - | sed 's/,/, /g')
  echo "  planted bugs caught: ${planted:-none ran}" | tee -a "$logs/summary"
  return "$rc"
}

cmake_install() {
  rm -rf "$prefix"
  build_and_install "$build/cmake" "$prefix" -DMSCCLPP_CARGO_TARGET_DIR="$CARGO_TARGET_DIR"
}

examples_build() {
  build_examples "$build/c_examples" "$prefix" -DCMAKE_C_FLAGS=-Werror -DCMAKE_CXX_FLAGS=-Werror
}

# A consumer that knows only pkg-config: compile and run one example with its flags.
pkgconfig_build() {
  local flags
  flags=$(PKG_CONFIG_PATH=$prefix/lib/pkgconfig pkg-config --cflags --libs mscclpp) || return 1
  # shellcheck disable=SC2086
  "${CC:-cc}" -std=c11 -Wall -Wextra -Wpedantic -Werror -I"$MSCCLPP_ROOT/c_examples/common" \
    "$MSCCLPP_ROOT/c_examples/bootstrap_demo.c" -o "$build/bootstrap_demo_pkgconfig" $flags \
    -Wl,-rpath,"$prefix/lib" || return 1
  # -h prints the usage and exits 2: the program was linked and libmscclpp.so.0 was loaded.
  "$build/bootstrap_demo_pkgconfig" -h 2>/dev/null
  [[ $? -eq 2 ]]
}

run_examples() {
  scripts/run-local-ranks.sh 3 "$build/c_examples/bootstrap_demo" &&
    scripts/run-local-ranks.sh 3 "$build/c_examples/bootstrap_demo_static" &&
    scripts/run-local-ranks.sh 3 "$build/c_examples/allgather_host" -s 1048576 -i 5 &&
    scripts/run-local-ranks.sh 3 "$build/c_examples/allgather_host_static" -t shm -s 1048576 -i 5 &&
    scripts/run-local-ranks.sh 2 "$build/c_examples/ep/ep_host" &&
    scripts/run-local-ranks.sh 4 "$build/c_examples/ep/ep_host" -t shm &&
    scripts/run-local-ranks.sh 3 "$build/c_examples/ep/ep_host" --experts 24 --topk 8 --tokens 7,32 --steps 6 &&
    scripts/run-local-ranks.sh 2 "$build/c_examples/ep/ep_host" --experts 64 --topk 1 --tokens 1,2 --steps 4 &&
    MSCCLPP_TEST_UNORDERED=efa scripts/run-local-ranks.sh 3 "$build/c_examples/ep/ep_host" --experts 24 --topk 8 --tokens 7,32 --steps 6 &&
    MSCCLPP_TEST_UNORDERED=cxi scripts/run-local-ranks.sh 3 "$build/c_examples/ep/ep_host" --experts 24 --topk 8 --tokens 7,32 --steps 6 &&
    perf_runs
}

# The nccl-tests-style tools on host memory; each exits non-zero on a wrong byte (#wrong).
perf_runs() {
  local ex=$build/c_examples
  scripts/run-local-ranks.sh 2 "$ex/allgather_perf" -b 8 -e 4M -f 4 -n 5 -w 1 &&
    scripts/run-local-ranks.sh 3 "$ex/allgather_perf" -b 8 -e 4M -f 4 -n 5 -w 1 &&
    scripts/run-local-ranks.sh 3 "$ex/alltoall_perf" -b 1K -e 1M -f 8 -n 5 -w 1 -T shm &&
    scripts/run-local-ranks.sh 3 "$ex/sendrecv_perf" -b 8 -e 1M -f 16 -n 5 -w 1
}

# Many ranks on the 2 cores: 32 ranks, all-to-all connections, three verified all-to-all
# rounds of 4 KiB, over tcp and over shm, twice each. Every run must complete (a rank that
# starves fails its peers at the bootstrap timeout); the RESULT lines show the phases and the
# slowest rank's round against the median (bench/scale.sh makes the table, up to 128 ranks).
scale_runs() {
  local t k out
  for t in ib shm; do
    for k in 1 2; do
      out=$(MSCCLPP_RUN_TIMEOUT=300 scripts/run-local-ranks.sh 32 "$build/c_examples/allgather_host" \
        -t "$t" -s 4096 -i 1 -p 0 2>&1) || {
        # The first errors (the other ranks' later ones follow from them), then the end.
        echo "scale: 32 ranks over $t, run $k failed:"
        grep -iE 'error|fail|timed out|exited with' <<<"$out" | head -12
        tail -8 <<<"$out"
        return 1
      }
      grep -o 'RESULT phases.*' <<<"$out"
    done
  done
}

# The library built against libfabric 2.x (Debian trixie's source, built by
# scripts/libfabric2.sh into a cache) and its libfabric tests run on it: the bindings, the
# conformance suite over tcp/shm (direct, staged, FI_MR_ENDPOINT), the multi-process host
# suites, hostile input. 2.x has no `net` provider: the tests over it skip, saying so.
libfabric2() {
  local prefix
  prefix=$(scripts/libfabric2.sh) || return 1
  echo "libfabric 2.x: $("$prefix/bin/fi_info" --version | head -1) in $prefix"
  PKG_CONFIG_PATH=$prefix/lib/pkgconfig LD_LIBRARY_PATH=$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
    CARGO_TARGET_DIR=$CARGO_TARGET_DIR/libfabric2 MSCCLPP_TEST_ALLOW_MISSING=net \
    MSCCLPP_TEST_EXPECT_LIBFABRIC=2. \
    cargo test -p libfabric-sys -p mscclpp --no-fail-fast --lib --test version \
    --test endpoint_conformance --test net_endpoint --test net_two_process --test net_staging \
    --test e2e_host --test hostile_region --test hostile_setup
}

# Bounded soak: 4 ranks over tcp, then shm, checksums on every transfer, RSS flat after warm-up
# (examples/soak.rs; MSCCLPP_SOAK_SECONDS per provider, default 30).
soak() {
  local p
  for p in tcp shm; do
    timeout 300 cargo run -q --example soak -- --provider "$p" --ranks 4 \
      --seconds "${MSCCLPP_SOAK_SECONDS:-30}" || return 1
  done
}

# The Python package (python/): pip builds its wheel (scikit-build-core from PyPI; cargo
# reuses the release build of "cmake install" in $CARGO_TARGET_DIR), python/manylinux.py gives
# it the manylinux tag it meets, and that wheel goes into a venv; then the public API's types
# (`mypy --strict`, python/pyproject.toml) and its pytest suite on host memory: 2-4 ranks
# over tcp and shm, bad arguments, dead peers, lifetimes, Ctrl-C, README's example; then an
# editable install (`pip install -e ./python`) loads its library.
python_pkg() {
  local venv=$build/python-venv wheels=$build/python-wheel
  [[ -x $venv/bin/python ]] || python3 -m venv "$venv" || return 1
  "$venv/bin/python" -m pip install -q --disable-pip-version-check pytest numpy mypy wheel || return 1
  rm -rf "$wheels" && "$venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$wheels" ./python || return 1
  local whl
  whl=$("$venv/bin/python" python/manylinux.py "$wheels"/mscclpp_rs-*-linux_*.whl) || return 1
  echo "wheel: $(basename "$whl")"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$whl" || return 1
  (cd python && "$venv/bin/python" -m mypy) || return 1
  (cd python && "$venv/bin/python" -m pytest -q -p no:cacheprovider) || return 1
  # An editable install (pip install -e: scikit-build-core keeps the Python files in the
  # source tree and installs the built library into site-packages) finds its library and
  # headers.
  local ev=$build/python-venv-editable
  [[ -x $ev/bin/python ]] || python3 -m venv "$ev" || return 1
  "$ev/bin/python" -m pip install -q --disable-pip-version-check -e ./python || return 1
  (cd / && "$ev/bin/python" -c 'import os, mscclpp_rs as m
assert m.version() == 100, m.version()
assert os.path.isfile(os.path.join(m.include_dir(), "mscclpp.h")), m.include_dir()
print("editable install: version", m.version(), "headers in", m.include_dir())')
}

total_start=$SECONDS
if ! deps; then
  echo "test.sh: cannot set up the build environment (see above)" >&2
  echo "0 passed, 1 failed"
  exit 1
fi
names+=(deps) results+=(PASS) times+=($((SECONDS - total_start)))

# A clean-clone run needs about 4 GB (README, "Requirements"). Less free space is said now, and
# again under the summary, rather than left to a build's "No space left on device".
mkdir -p "$CARGO_TARGET_DIR"
free_kb=$(df -Pk "$CARGO_TARGET_DIR" 2>/dev/null | awk 'NR == 2 { print $4 }')
if [[ -n $free_kb ]] && ((free_kb < 4 * 1024 * 1024)); then
  echo "test.sh: warning: only $((free_kb / 1024)) MB free for $CARGO_TARGET_DIR; a full run" \
    "from a clean clone needs about 4 GB" | tee -a "$logs/summary" >&2
fi

step fmt -- cargo fmt --all --check
step clippy -- cargo clippy --all-targets --workspace -- -D warnings
step doc -- env RUSTDOCFLAGS="-D warnings" cargo doc --no-deps -p mscclpp
step "cargo test" -- cargo test --workspace --no-fail-fast -- --skip unordered
step "unordered fabric" -- unordered_fabric
step header -- cargo test -p mscclpp --test header
step "abi (ctest)" -- cargo test -p mscclpp-abi-test --no-fail-fast
step "cuda compile" -- scripts/check-cuda-compile.sh "$build/cuda-venv"
# Under nvcc too: the one the step above installed, where it did.
step "header compile" -- env NVCC="$([[ -x $build/cuda-venv/nvcc ]] && echo "$build/cuda-venv/nvcc")" \
  scripts/check-header-compile.sh
step "cmake install" -- cmake_install
step exports needs="cmake install" -- scripts/check-exports.sh "$prefix/lib/libmscclpp.so"
step "ctest (C/C++)" needs="cmake install" -- ctest --test-dir "$build/cmake" --output-on-failure
step "c_examples build" needs="cmake install" -- examples_build
step "pkg-config build" needs="cmake install" -- pkgconfig_build
step "c_examples run" needs="c_examples build" -- run_examples
step scale needs="c_examples build" -- scale_runs
step sanitize needs="cmake install" -- scripts/sanitize.sh "$prefix" "$build/sanitize"
step python -- python_pkg
step "libfabric 2.x" -- libfabric2
step soak -- soak

passed=0 failed=0
printf '\n%-20s %-28s %8s\n' step result seconds
printf '%-20s %-28s %8s\n' -------------------- ---------------------------- -------
for i in "${!names[@]}"; do
  printf '%-20s %-28s %8s\n' "${names[$i]}" "${results[$i]}" "${times[$i]}"
  case ${results[$i]} in
    PASS) passed=$((passed + 1)) ;;
    FAIL) failed=$((failed + 1)) ;;
  esac
done
printf '%-20s %-28s %8s\n\n' total "" "$((SECONDS - total_start))"
# Lines the steps left for the summary (the unordered fabric layer's count, a disk warning).
[[ -f $logs/summary ]] && cat "$logs/summary"
# What the run left on disk, and what is free: a step that failed for want of space says so.
echo "disk: target $(du -sh "$CARGO_TARGET_DIR" 2>/dev/null | cut -f1), build $(du -sh "$build" \
  2>/dev/null | cut -f1), free $(df -h --output=avail "$CARGO_TARGET_DIR" 2>/dev/null | tail -1)"
for i in "${!names[@]}"; do
  [[ -f $logs/failed.$i ]] || continue
  echo "--- ${names[$i]} failed; its last lines:"
  sed 's/^/  | /' "$logs/failed.$i"
  echo
done
echo "$passed passed, $failed failed"
((failed == 0))
