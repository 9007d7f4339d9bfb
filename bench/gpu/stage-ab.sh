# Staged GPU memory against the wire (issue 15, item 6), for scripts/gpu-check.sh's
# GPU_CHECK_EXTRA: one-way put bandwidth of GPU memory staged through host memory (the
# `bandwidth` example over the IB transport) next to raw `fi_write` between host buffers on the
# same provider (`raw_rma`), alternating run by run so that the machine's drift spreads over all.
#
#   source "$ROOT/bench/gpu/stage-ab.sh"; stage_ab REPS "PROVIDERS" "LABEL:LIBDIR[:VAR=v ...]" ...
#   e.g. stage_ab 3 "shm tcp" "new:$PREFIX/lib" "old:$CARRY/old" "ring32:$PREFIX/lib:MSCCLPP_NET_STAGING_BYTES=33554432"
#
# LIBDIR goes first on LD_LIBRARY_PATH, so one built example runs against several builds of
# the library (the examples find it by RUNPATH, which LD_LIBRARY_PATH overrides); STAGE_MAX
# (default 64M) is the largest size measured. `raw` rewrites two slots of its buffers (cache
# resident up to 4 MiB), `raw-cold` spreads its writes over 64 MiB (`raw_rma --spread`), as
# fresh data would. Output: "STAGE PROVIDER LABEL SIZE median GB/s (runs) N% of raw N% of
# raw-cold" lines, also added to $RES.
stage_ab() {
  local reps=$1 provs=$2
  shift 2
  local raw=$WORK/stage-ab.$RANDOM r p s label dir vars
  : >"$raw"
  for ((r = 0; r < reps; r++)); do
    for p in $provs; do
      for s in "$@"; do
        label=${s%%:*}
        dir=${s#*:}
        vars=
        [[ $dir == *:* ]] && vars=${dir#*:} && dir=${dir%%:*}
        # shellcheck disable=SC2086 # vars is a list of VAR=value words
        env LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}" MSCCLPP_EXAMPLE_TRANSPORT=ib MSCCLPP_NET_PROVIDER=$p $vars \
          timeout -k 5 90 bash -c 'ranks 2 "$BIN/bandwidth" --max "${STAGE_MAX:-64M}"' 2>&1 |
          awk -v p="$p" -v l="$label" '$1 == "RESULT" && $2 == "bandwidth" {
            split($3, b, "="); split($5, g, "="); split($6, c, "=");
            print p "\t" l "\t" b[2] "\t" g[2] "\t" c[2] }' >>"$raw"
      done
      for spread in "" --spread; do
        # shellcheck disable=SC2086 # spread is one option or none
        timeout -k 5 90 "$CARRY/raw_rma" --provider "$p" --min-kib 1024 --max-mib 64 --volume-mib 512 $spread 2>&1 |
          awk -v p="$p" -v l="raw${spread:+-cold}" '$2 == "KiB" || $2 == "MiB" {
            b = $1 * ($2 == "MiB" ? 1048576 : 1024); print p "\t" l "\t" b "\t" $5 "\tok" }' >>"$raw"
      done
    done
  done
  python3 - "$raw" <<'EOF' | tee -a "$RES"
import statistics, sys
from collections import defaultdict
vals, bad, order = defaultdict(list), set(), []
for line in open(sys.argv[1]):
    p, label, size, gbps, check = line.rstrip("\n").split("\t")
    if check != "ok":
        bad.add((p, label))
    key = (p, label, int(size))
    if key not in vals:
        order.append(key)
    vals[key].append(float(gbps))
for p, label, size in order:
    if size < 1 << 20:
        continue
    v = vals[(p, label, size)]
    ratio = ""
    if not label.startswith("raw"):
        for base in ("raw", "raw-cold"):
            r = vals.get((p, base, size))
            if r:
                ratio += f" {100 * statistics.median(v) / statistics.median(r):.0f}% of {base}"
    runs = " ".join(f"{x:.2f}" for x in v)
    print(f"STAGE {p} {label} {size >> 20}MiB {statistics.median(v):.2f} ({runs}){ratio}")
for p, label in sorted(bad):
    print(f"STAGE {p} {label} DATA MISMATCH")
EOF
}
