#!/usr/bin/env bash
# Compiles include/mscclpp.h (through the header tests of tests/c) with every C and C++
# compiler and language standard found here, with -Wall -Wextra -Wpedantic -Werror, and under
# nvcc when it is installed. Syntax and static_assert checks only: nothing is linked.
#
#   scripts/check-header-compile.sh      exit 0 when every available combination compiles
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
inc=$root/include
tests=$root/tests/c
warn=(-Wall -Wextra -Wpedantic -Werror)
pass=0 fail=0 tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The header included twice (include guard) and nothing else.
printf '#include <mscclpp.h>\n#include <mscclpp.h>\nint main(void) { return 0; }\n' >"$tmp/twice.c"
cp "$tmp/twice.c" "$tmp/twice.cpp"
# C++ code that includes it the way C headers are often included.
printf 'extern "C" {\n#include <mscclpp.h>\n}\nint main() { mscclppDevConn c = {}; (void)c; }\n' \
  >"$tmp/in_extern_c.cpp"

check() { # label, command...
  local label=$1
  shift
  if "$@" >"$tmp/out" 2>&1; then
    pass=$((pass + 1))
    printf '  ok    %s\n' "$label"
  else
    fail=$((fail + 1))
    printf '  FAIL  %s\n' "$label"
    sed 's/^/        /' "$tmp/out" | head -40
  fi
}

for cc in gcc clang; do
  command -v "$cc" >/dev/null || { echo "  skip  $cc (not installed)"; continue; }
  for std in c11 c17; do
    for src in "$tmp/twice.c" "$tests/compile_c.c"; do
      check "$cc -std=$std $(basename "$src")" \
        "$cc" -std="$std" "${warn[@]}" -I"$inc" -fsyntax-only "$src"
    done
  done
done

for cxx in g++ clang++; do
  command -v "$cxx" >/dev/null || { echo "  skip  $cxx (not installed)"; continue; }
  for std in c++11 c++14 c++17 c++20; do
    for src in "$tmp/twice.cpp" "$tmp/in_extern_c.cpp" "$tests/layout_2023.cpp" "$tests/compile_cpp.cpp"; do
      check "$cxx -std=$std $(basename "$src")" \
        "$cxx" -std="$std" "${warn[@]}" -I"$inc" -fsyntax-only "$src"
    done
  done
done

nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
if [[ -x $nvcc ]]; then
  for std in c++14 c++17; do
    check "nvcc -std=$std compile_cuda.cu" \
      "$nvcc" -std="$std" -Xcompiler "-Wall,-Wextra,-Werror" -I"$inc" -c \
      "$tests/compile_cuda.cu" -o "$tmp/compile_cuda.o"
  done
else
  echo "  skip  nvcc (not installed)"
fi

echo "header compile: $pass passed, $fail failed"
[[ $fail -eq 0 ]]
