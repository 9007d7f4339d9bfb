#!/usr/bin/env bash
# Puts this machine's `perf` and the libraries it needs (all but the C and C++ runtimes, which
# the GPU machine has in a newer glibc) into .carry/perf, so that a `run` on the GPU machine,
# which has no perf, can profile there (about 28 MB of the 64 MB a run may carry):
#
#   bench/carry-perf.sh
#   # on the GPU machine, with carry [".carry"]:
#   LD_LIBRARY_PATH=.carry/perf/lib .carry/perf/perf record -F 1999 -o /tmp/p.data -- CMD
#   LD_LIBRARY_PATH=.carry/perf/lib .carry/perf/perf report -i /tmp/p.data --sort pid,sym --stdio
#
# Seen working (session 20): perf 6.1 from Debian 12 on the GPU machine's Ubuntu (glibc 2.39),
# as root, perf_event_paranoid 2. Give the profiled binary its symbols (`strip --strip-debug`
# keeps them); set MSCCLPP_DISABLE_CUDA=1 where the GPU is not the point, or CUDA's start-up
# fills short profiles.
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
out=$root/.carry/perf
perf=$(readlink -f "$(command -v perf)")
mkdir -p "$out/lib"
cp -L "$perf" "$out/perf"
ldd "$perf" | awk '$3 ~ /^\// {print $3}' |
  grep -vE '/(libc|libm|libgcc_s|libstdc\+\+|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
du -sh "$out"
