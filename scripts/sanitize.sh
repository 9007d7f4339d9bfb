#!/usr/bin/env bash
# Memory checks (run by scripts/test.sh after the CMake install; also on its own):
#
#   scripts/sanitize.sh PREFIX BUILD_DIR
#
#   1. the C examples built with ASan + UBSan (-fno-sanitize-recover: any finding fails) against
#      the installed package at PREFIX, run with 3 local ranks (bootstrap and host all-gather
#      over tcp and shm), and the C/C++ header tests of tests/c linked and run the same way;
#   2. the C host all-gather with 2 ranks under valgrind: no invalid access, no definite leak
#      after mscclppCommDestroy;
#   3. the Rust tests that run in one process under valgrind, same criteria: the unit tests,
#      tests/leaks.rs (create/connect/exchange/destroy cycles over tcp and shm, ranks as
#      threads), tests/threads.rs (each test's body runs in a child process, traced too) and
#      tests/capi_basics.rs.
# Exit status non-zero on the first failure.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
prefix=${1:?usage: sanitize.sh PREFIX BUILD_DIR}
build=${2:?usage: sanitize.sh PREFIX BUILD_DIR}
cd "$ROOT"

echo "== ASan + UBSan: C examples"
san="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"
cmake -S c_examples -B "$build/asan" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_PREFIX_PATH="$prefix" \
  -DMSCCLPP_EXAMPLES_STATIC=OFF -DCMAKE_C_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="$san" >/dev/null
cmake --build "$build/asan" --parallel "$(nproc)" >/dev/null
# libfabric keeps provider tables for the life of the process (freed by no API): not ours.
export LSAN_OPTIONS="suppressions=$ROOT/scripts/lsan.supp:print_suppressions=0"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:exitcode=23"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
scripts/run-local-ranks.sh 3 "$build/asan/bootstrap_demo"
scripts/run-local-ranks.sh 3 "$build/asan/allgather_host" -s 262144 -i 3
scripts/run-local-ranks.sh 3 "$build/asan/allgather_host" -t shm -s 262144 -i 3
echo "== ASan + UBSan: C and C++ header tests (tests/c, linked and run)"
"${CC:-cc}" -std=c11 -Wall -Wextra -Wpedantic -Werror $san -I"$prefix/include" tests/c/compile_c.c \
  -L"$prefix/lib" -lmscclpp -Wl,-rpath,"$prefix/lib" -o "$build/asan/compile_c"
"$build/asan/compile_c"
"${CXX:-c++}" -std=c++17 -Wall -Wextra -Wpedantic -Werror $san -I"$prefix/include" tests/c/compile_cpp.cpp \
  -L"$prefix/lib" -lmscclpp -Wl,-rpath,"$prefix/lib" -o "$build/asan/compile_cpp"
"$build/asan/compile_cpp"
unset LSAN_OPTIONS ASAN_OPTIONS UBSAN_OPTIONS

# --fair-sched=yes: valgrind runs one thread at a time, and by default a thread that spins
# (a test's watcher, a proxy polling its queue) keeps the turn for long stretches. Two net
# tests that poll, run side by side (--test-threads=2), took 415 s and one failed its 30 s
# flush; with fair turns, 8 s and both pass (the same three tests, 2 cores).
vg=(valgrind -q --fair-sched=yes --error-exitcode=9 --leak-check=full
  --errors-for-leak-kinds=definite --show-leak-kinds=definite
  --suppressions="$ROOT/scripts/valgrind.supp")
echo "== valgrind: C host all-gather, 2 ranks"
cmake -S c_examples -B "$build/plain" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_PREFIX_PATH="$prefix" \
  -DMSCCLPP_EXAMPLES_STATIC=OFF >/dev/null
cmake --build "$build/plain" --parallel "$(nproc)" >/dev/null
MSCCLPP_RUN_TIMEOUT=300 MSCCLPP_BOOTSTRAP_TIMEOUT=120 \
  scripts/run-local-ranks.sh 2 "${vg[@]}" "$build/plain/allgather_host" -s 65536 -i 2

echo "== valgrind: Rust tests that run in one process (unit tests, leaks, threads, capi_basics)"
# The multi-process suites re-execute themselves per rank; these cover the same library code
# in one process, where valgrind can see every allocation.
rust_bin() { # cargo-args...: the test executable cargo builds for them
  cargo test -q "$@" --no-run --message-format=json | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1
}
for args in "--lib" "--test leaks" "--test threads" "--test capi_basics"; do
  # shellcheck disable=SC2086
  bin=$(rust_bin $args)
  [[ -x $bin ]] || { echo "sanitize: cannot find the test binary for $args" >&2; exit 1; }
  echo "-- $args"
  # threads.rs runs each body in a child process (its own environment): valgrind follows it.
  trace=()
  [[ $args == "--test threads" ]] && trace=(--trace-children=yes)
  MSCCLPP_TEST_CYCLES=10 timeout 600 "${vg[@]}" "${trace[@]}" "$bin" --test-threads=2
done
echo "sanitize: all checks passed"
