#!/usr/bin/env bash
# Turns benchmark tables into PNGs with matplotlib (Debian's python3-matplotlib, installed
# here when missing; run by Debian's own /usr/bin/python3, which that package serves).
#
#   bench/plot.sh scale OUT.png TABLE.md [TABLE.md ...]     bench/scale.sh tables
set -euo pipefail
MSCCLPP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/common.sh
source "$MSCCLPP_ROOT/scripts/common.sh"
MSCCLPP_APT_PACKAGES=(python3-matplotlib)
ensure_apt_packages
kind=${1:?usage: bench/plot.sh scale OUT.png TABLE.md...}
shift
case $kind in
  scale) exec /usr/bin/python3 "$MSCCLPP_ROOT/bench/plot_scale.py" "$@" ;;
  *) echo "bench/plot.sh: unknown kind $kind (scale)" >&2; exit 2 ;;
esac
