#!/usr/bin/env bash
# Our put bandwidth against raw fi_write, the two alternating run by run, medians per size.
# On the 2-core VM one run moves by 20-40% (the raw baseline as much as ours), so a 10%
# question needs many alternating runs rather than the sweep of bench/run-host.sh.
#
#   bench/ab-host.sh [provider] [runs] [min-kib] [volume-mib]      defaults: tcp 8 1024 2048
#
# Prints, per size (min-kib .. 64 MiB): raw and our median GB/s, the ratio of the medians, and
# the median of the runs' paired ratios (each of our runs over the raw run just before it,
# which shares its moment's noise).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
p=${1:-tcp} runs=${2:-8} min=${3:-1024} vol=${4:-2048}
cargo build --release -q -p libfabric-sys --example raw_rma
cargo build --release -q --example put_bench
t=${CARGO_TARGET_DIR:-target}/release/examples
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for ((i = 0; i < runs; i++)); do
  echo "run $i" >>"$log"
  # raw prints "  1 MiB  iters  ms  GB/s"; ours "bytes GB/s iters".
  timeout 300 "$t/raw_rma" --provider "$p" --iters 100 --min-kib "$min" --volume-mib "$vol" |
    awk '$2 == "KiB" || $2 == "MiB" { b = $1 * ($2 == "MiB" ? 1048576 : 1024); print "raw", b, $5 }' >>"$log"
  timeout 300 "$t/put_bench" --provider "$p" --min-kib "$min" --volume-mib "$vol" |
    awk '$1 ~ /^[0-9]+$/ && NF == 3 { print "ours", $1, $2 }' >>"$log"
done
echo "# $(date -u +%F) $(uname -n) $(nproc) cores, provider $p, $runs alternating runs, ${vol} MiB per size"
python3 - "$log" <<'EOF'
import statistics, sys
runs, run, now = {}, {}, -1
for line in open(sys.argv[1]):
    f = line.split()
    if f[0] == "run":
        now = int(f[1])
        continue
    who, size, gbs = f[0], int(f[1]), float(f[2])
    runs.setdefault((size, who), []).append(gbs)
    run[(now, size, who)] = gbs
print(f"{'bytes':>10} {'raw GB/s':>9} {'ours GB/s':>10} {'ours/raw':>9} {'paired':>7}  (runs)")
for size in sorted({s for s, _ in runs}):
    raw, ours = runs.get((size, "raw"), []), runs.get((size, "ours"), [])
    pairs = [run[(i, size, "ours")] / run[(i, size, "raw")] for i in range(now + 1)
             if (i, size, "ours") in run and (i, size, "raw") in run]
    if pairs:
        r, o = statistics.median(raw), statistics.median(ours)
        p = statistics.median(pairs)
        print(f"{size:>10} {r:>9.2f} {o:>10.2f} {o / r:>8.0%} {p:>7.0%}  ({len(raw)}, {len(ours)})")
EOF
