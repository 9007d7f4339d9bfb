#!/usr/bin/env bash
# Prints a TCP port that nobody uses now and that the kernel will not hand out by itself, for
# a bootstrap root that binds it a moment later:
#
#   port=$(scripts/free-port.sh)
#
# The port lies below the ephemeral range (/proc/sys/net/ipv4/ip_local_port_range), so no
# other program's connect or bind(0) can take it before the root binds it, and no rank that
# retries towards the root before it listens can be handed it as its own source port (TCP
# then connects the rank to itself). tests/common/mod.rs's free_port picks ports the same way.
set -uo pipefail

low=$(awk '{ print $1 }' /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null)
[[ $low =~ ^[0-9]+$ ]] || low=32768
base=10000
span=$((low > base + 1000 ? low - base : 1000))
# Ports in use, any state (TIME_WAIT included), as upper-case hex from /proc/net/tcp{,6}.
used=$(cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | awk 'NR > 1 { split($2, a, ":"); print a[2] }')
for ((i = 0; i < 100; i++)); do
  port=$((base + (RANDOM * 32768 + RANDOM) % span))
  if ! grep -qix "$(printf '%04X' "$port")" <<<"$used"; then
    echo "$port"
    exit 0
  fi
done
echo "$0: no free port found in $base..$((base + span))" >&2
exit 1
