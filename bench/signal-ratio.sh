#!/usr/bin/env bash
# Issue 29's ratio: 64 puts then signal + flush against 64 putWithSignals then flush
# (examples/signal_ratio.rs), for several builds run alternately, round by round, on each
# transport: tcp (IB over tcp), shm (the SHM transport), shm-ib (IB over libfabric's shm
# provider), and efa-tcp (IB over tcp under the EFA-like unordered test layer, which a build
# without it runs as plain tcp).
#
#   AB_BINS="/tmp/sr-old /tmp/sr-new" bench/signal-ratio.sh [rounds] [reps]   defaults: 3 5
#
# PEERS=3 streams from rank 0 to three peers at once (`--peers`, builds from session 16 on);
# CONFIGS="tcp shm" picks the transports; MIN_KIB and MAX_KIB the sizes (the binary's defaults:
# 16 KiB to 4 MiB); WAIT_AFTER=1 has the peers wait once, after the stream (`--wait-after`). A
# build run with settings of its own (CQ-data signals off, another libfabric) is a wrapper
# script: `exec env MSCCLPP_NET_CQ_SIGNALS=0 /tmp/sr-new "$@"`.
#
# The binaries are copies of target/release/examples/signal_ratio built from each tree. Prints
# per transport and size, for each binary, the median over rounds of its two GB/s figures and
# of its ratio (signalled / unsignalled, each run's own median of paired reps), and the signal
# half round trip.
set -euo pipefail
read -r -a bins <<<"${AB_BINS:?list the signal_ratio binaries in AB_BINS}"
rounds=${1:-3} reps=${2:-5}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
n=${#bins[@]}
run() { # config binary-index round
  local c=$1 k=$2 b=${bins[$2]} args=(--reps "$reps")
  local -a env=(env -u MSCCLPP_NET_PROVIDER -u MSCCLPP_TEST_UNORDERED)
  [[ ${PEERS:-1} == 1 ]] || args+=(--peers "$PEERS")
  [[ -z ${MIN_KIB:-} ]] || args+=(--min-kib "$MIN_KIB")
  [[ -z ${MAX_KIB:-} ]] || args+=(--max-kib "$MAX_KIB")
  [[ -z ${WAIT_AFTER:-} ]] || args+=(--wait-after)
  case $c in
  tcp) args+=(--provider tcp) ;;
  shm) args+=(--provider shm) ;;
  shm-ib) args+=(--provider shm --ib) env+=(MSCCLPP_NET_PROVIDER=shm) ;;
  efa-tcp) args+=(--provider tcp) env+=(MSCCLPP_TEST_UNORDERED=efa) ;;
  esac
  "${env[@]}" timeout 600 "$b" "${args[@]}" 2>/dev/null |
    awk -v c="$c" -v k="$k" '
      /half round trip/ { print c, k, "lat", $(NF-1) }
      $1 ~ /^[0-9]+$/ && NF == 4 { print c, k, $1, $2, $3, $4 }' >>"$log" ||
    echo "signal-ratio: $c: $b failed" >&2
}
for ((i = 0; i < rounds; i++)); do
  for c in ${CONFIGS:-tcp shm shm-ib efa-tcp}; do
    for ((j = 0; j < n; j++)); do run "$c" $(((i + j) % n)) "$i"; done
  done
done
echo "# $(date -u +%F) $(uname -n), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $rounds alternating rounds, $reps reps each; ${PEERS:-1} peer(s)"
for ((k = 0; k < n; k++)); do echo "# build $k: ${bins[$k]}"; done
python3 - "$log" "$n" <<'EOF'
import statistics as st, sys
n = int(sys.argv[2])
lat, bw = {}, {}
for line in open(sys.argv[1]):
    f = line.split()
    if f[2] == "lat":
        lat.setdefault((f[0], int(f[1])), []).append(float(f[3]))
    else:
        bw.setdefault((f[0], int(f[1]), int(f[2])), []).append(tuple(map(float, f[3:6])))
for c in [c for c in ["tcp", "shm", "shm-ib", "efa-tcp"] if any(k[0] == c for k in bw)]:
    l = " ".join(f"{st.median(lat[(c, k)]):.2f}" if (c, k) in lat else "-" for k in range(n))
    print(f"\n{c}: signal half round trip (us, median of rounds), build 0..{n-1}: {l}")
    print(f"{'bytes':>9} " + " ".join(f"{'b%d put+sig' % k:>12} {'pws':>6} {'ratio':>5}" for k in range(n)))
    for size in sorted({s for (cc, _, s) in bw if cc == c}):
        cols = []
        for k in range(n):
            v = bw.get((c, k, size))
            if not v:
                cols.append(f"{'-':>12} {'-':>6} {'-':>5}")
                continue
            cols.append(f"{st.median(x[0] for x in v):>12.2f} {st.median(x[1] for x in v):>6.2f} {st.median(x[2] for x in v):>5.2f}")
        print(f"{size:>9} " + " ".join(cols))
EOF
