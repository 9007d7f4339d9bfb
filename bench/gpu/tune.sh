# Tuning helper for scripts/gpu-check.sh (source it from GPU_CHECK_EXTRA there): runs one of the
# CUDA examples under several settings, each several times, and prints the median of every
# RESULT figure per setting, so that one device call compares settings on the same machine.
#
#   tune REPS EXAMPLE "ARGS" "LABEL:VAR=value VAR2=value" ["LABEL2:..."]...
#   e.g. tune 5 allgather "--bench --sizes 1M,64M" "default:" "16 blocks:MSCCLPP_P2P_SM_BLOCKS=16"
#
# Settings alternate run by run (A B C A B C ...), so that a drift of the machine spreads over
# all of them. Output: "TUNE EXAMPLE LABEL KEY median (min..max, n)" lines, also added to $RES.
tune() {
  local reps=$1 ex=$2 args=$3
  shift 3
  local raw=$WORK/tune.$ex.$RANDOM
  : >"$raw"
  local r s label vars
  for ((r = 0; r < reps; r++)); do
    for s in "$@"; do
      label=${s%%:*}
      vars=${s#*:}
      # shellcheck disable=SC2086 # vars is a list of VAR=value words
      timeout -k 5 60 env $vars bash -c "ranks 2 \"\$BIN/$ex\" $args" 2>&1 |
        grep '^RESULT' | sed "s|^|$label\t|" >>"$raw"
    done
  done
  python3 - "$raw" "$ex" <<'EOF' | tee -a "$RES"
import statistics, sys
from collections import defaultdict
vals = defaultdict(list)
order = []
for line in open(sys.argv[1]):
    label, rest = line.rstrip("\n").split("\t", 1)
    parts = rest.split()
    kv = dict(p.split("=", 1) for p in parts[2:] if "=" in p)
    # The figure's name: the RESULT kind plus the words that are not key=value, or bytes=.
    key = " ".join([parts[1]] + [p for p in parts[2:] if "=" not in p] +
                   ([f"bytes={kv['bytes']}"] if "bytes" in kv else []))
    for k, v in kv.items():
        if k in ("bytes", "nranks", "check"):
            continue
        try:
            vals[(label, key, k)].append(float(v))
        except ValueError:
            pass
        if (label, key, k) not in order:
            order.append((label, key, k))
for label, key, k in sorted(order, key=lambda t: (t[1], t[2])):
    v = vals[(label, key, k)]
    print(f"TUNE {sys.argv[2]} {label:24} {key} {k} median {statistics.median(v):.2f} "
          f"({min(v):.2f}..{max(v):.2f}, n={len(v)})")
EOF
}
