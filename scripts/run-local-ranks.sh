#!/usr/bin/env bash
# Runs N ranks of a program as local processes and waits for all of them.
#
#   scripts/run-local-ranks.sh N PROGRAM [ARGS...]
#
# Each rank gets MSCCLPP_RANK, MSCCLPP_NRANKS, MSCCLPP_LOCAL_RANK and MSCCLPP_ROOT (127.0.0.1 and
# a free port; set MSCCLPP_ROOT yourself to choose), which the examples read through
# c_examples/common/launch_env.h. Output lines are prefixed with "[rank i]".
# MSCCLPP_RUN_TIMEOUT (seconds, default 120) bounds the whole run. When a rank fails or the time
# runs out, every other rank is killed. Exit status: 0 when all ranks exited 0; otherwise the
# first failure's status (124 on timeout).
set -uo pipefail

if [[ $# -lt 2 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N PROGRAM [ARGS...]" >&2
  exit 2
fi
n=$1
shift
timeout=${MSCCLPP_RUN_TIMEOUT:-120}

root=${MSCCLPP_ROOT:-}
if [[ -z $root ]]; then
  port=$("$(dirname "${BASH_SOURCE[0]}")/free-port.sh") || exit 1
  root=127.0.0.1:$port
fi
echo "run-local-ranks: $n ranks of $*, root $root, timeout ${timeout}s"

pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do
    kill -TERM -- "-$p" 2>/dev/null
  done
  sleep 0.5
  for p in "${pids[@]}"; do
    kill -KILL -- "-$p" 2>/dev/null
  done
}
trap 'cleanup; exit 130' INT TERM

for ((r = 0; r < n; r++)); do
  # Own process group per rank (setsid), so that a kill reaches the program and its prefixer.
  MSCCLPP_RANK=$r MSCCLPP_NRANKS=$n MSCCLPP_LOCAL_RANK=$r MSCCLPP_ROOT=$root \
    setsid bash -c 'set -o pipefail; r=$1; shift; "$@" 2>&1 | sed -u "s/^/[rank $r] /"' \
    rank "$r" "$@" </dev/null &
  pids+=($!)
done

status=0
deadline=$((SECONDS + timeout))
running=$n
declare -A done_=()
while ((running > 0)); do
  for ((r = 0; r < n; r++)); do
    [[ -n ${done_[$r]:-} ]] && continue
    if ! kill -0 "${pids[$r]}" 2>/dev/null; then
      wait "${pids[$r]}"
      rc=$?
      done_[$r]=1
      running=$((running - 1))
      if ((rc != 0)); then
        echo "run-local-ranks: rank $r exited with status $rc" >&2
        if ((status == 0)); then
          status=$rc
          ((running > 0)) && echo "run-local-ranks: stopping the other ranks" >&2
          cleanup
        fi
      fi
    fi
  done
  if ((running > 0 && SECONDS >= deadline)); then
    echo "run-local-ranks: timeout after ${timeout}s: killing the remaining ranks" >&2
    cleanup
    status=124
    wait
    break
  fi
  ((running > 0)) && sleep 0.1
done

if ((status == 0)); then
  echo "run-local-ranks: all $n ranks succeeded"
else
  echo "run-local-ranks: FAILED (status $status)" >&2
fi
exit "$status"
