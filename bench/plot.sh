#!/usr/bin/env bash
# Turns benchmark tables into PNGs with matplotlib (Debian's python3-matplotlib, installed
# here when missing; run by Debian's own /usr/bin/python3, which that package serves).
#
#   bench/plot.sh scale OUT.png TABLE.md [TABLE.md ...]     bench/scale.sh tables
#   bench/plot.sh perf OUT.png RESULTS.txt [RESULTS.txt ...] bench/perf-peers.sh results
set -euo pipefail
MSCCLPP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/common.sh
source "$MSCCLPP_ROOT/scripts/common.sh"
MSCCLPP_APT_PACKAGES=(python3-matplotlib)
ensure_apt_packages
kind=${1:?usage: bench/plot.sh scale|perf OUT.png FILE...}
shift
case $kind in
  scale) exec /usr/bin/python3 "$MSCCLPP_ROOT/bench/plot_scale.py" "$@" ;;
  perf) exec /usr/bin/python3 "$MSCCLPP_ROOT/bench/plot_perf.py" "$@" ;;
  *) echo "bench/plot.sh: unknown kind $kind (scale, perf)" >&2; exit 2 ;;
esac
