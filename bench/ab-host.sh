#!/usr/bin/env bash
# Our put bandwidth against raw fi_write, the two alternating run by run, medians per size.
# On the 2-core VM one run moves by 20-40% (the raw baseline as much as ours), so a 10%
# question needs many alternating runs rather than the sweep of bench/run-host.sh.
#
#   bench/ab-host.sh [provider] [runs] [min-kib] [volume-mib]      defaults: tcp 8 1024 2048
#
# Prints, per size (min-kib .. 64 MiB): raw and our median GB/s, the ratio of the medians, and
# the median of the runs' paired ratios (each of our runs over the raw run of the same round,
# which shares its moment's noise).
#
# To compare builds of ours, list their put_bench binaries in AB_BINS (copies outside the
# target directory, e.g. `AB_BINS="/tmp/pb-before /tmp/pb-after"`): each round runs raw, then
# every binary, the binaries' order rotating from round to round so that none always runs
# right after raw (use a number of rounds that the number of binaries divides). One "ours"
# column per binary, in AB_BINS order. A run that fails is reported and left out.
set -euo pipefail
read -r -a bins <<<"${AB_BINS:-}"
for ((k = 0; k < ${#bins[@]}; k++)); do
  b=${bins[$k]}
  [[ -f $b && -x $b ]] || { echo "ab-host: $b is not an executable put_bench" >&2; exit 2; }
  bins[k]=$(realpath "$b") # before the cd below
done
cd "$(dirname "${BASH_SOURCE[0]}")/.."
p=${1:-tcp} runs=${2:-8} min=${3:-1024} vol=${4:-2048}
cargo build --release -q -p libfabric-sys --example raw_rma
t=${CARGO_TARGET_DIR:-target}/release/examples
if ((${#bins[@]} == 0)); then
  cargo build --release -q --example put_bench
  bins=("$t/put_bench")
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
n=${#bins[@]}
for ((i = 0; i < runs; i++)); do
  # raw prints "  1 MiB  iters  ms  GB/s"; ours "bytes GB/s iters".
  timeout 300 "$t/raw_rma" --provider "$p" --iters 100 --min-kib "$min" --volume-mib "$vol" |
    awk -v r="$i" '$2 == "KiB" || $2 == "MiB" { b = $1 * ($2 == "MiB" ? 1048576 : 1024); print r, "raw", b, $5 }' >>"$log" ||
    echo "ab-host: round $i: raw_rma failed" >&2
  for ((j = 0; j < n; j++)); do
    k=$(((i + j) % n))
    timeout 300 "${bins[$k]}" --provider "$p" --min-kib "$min" --volume-mib "$vol" |
      awk -v r="$i" -v k="$k" '$1 ~ /^[0-9]+$/ && NF == 3 { print r, k, $1, $2 }' >>"$log" ||
      echo "ab-host: round $i: ${bins[$k]} failed" >&2
  done
done
echo "# $(date -u +%F) $(uname -n) $(nproc) cores, provider $p, $runs alternating runs, ${vol} MiB per size"
if ((n > 1)); then
  for ((k = 0; k < n; k++)); do echo "# ours$k: ${bins[$k]}"; done
fi
python3 - "$log" "$n" <<'EOF'
import statistics, sys
n = int(sys.argv[2])
runs, run = {}, {}
for line in open(sys.argv[1]):
    r, who, size, gbs = line.split()
    r, size, gbs = int(r), int(size), float(gbs)
    runs.setdefault((size, who), []).append(gbs)
    run[(r, size, who)] = gbs
names = [str(k) for k in range(n)]
head = "".join(f" {'ours' + (k if n > 1 else '') + ' GB/s':>11} {'/raw':>5} {'paired':>6}" for k in names)
print(f"{'bytes':>10} {'raw GB/s':>9}{head}  (runs)")
for size in sorted({s for s, _ in runs}):
    raw = runs.get((size, "raw"), [])
    if not raw:
        continue
    r = statistics.median(raw)
    cols, counts = "", [len(raw)]
    for k in names:
        ours = runs.get((size, k), [])
        counts.append(len(ours))
        pairs = [run[(i, s, k)] / run[(i, s, "raw")] for (i, s, w) in run
                 if s == size and w == k and (i, s, "raw") in run]
        if not pairs:
            cols += f" {'-':>11} {'-':>5} {'-':>6}"
            continue
        o = statistics.median(ours)
        cols += f" {o:>11.2f} {o / r:>5.0%} {statistics.median(pairs):>6.0%}"
    print(f"{size:>10} {r:>9.2f}{cols}  ({', '.join(map(str, counts))})")
EOF
