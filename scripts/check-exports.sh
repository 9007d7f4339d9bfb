#!/usr/bin/env bash
# Checks that a built libmscclpp.so exports every function of the 2023 header, plus the
# additions, as dynamic symbols (what a program linked against the 2023 library needs).
#
#   scripts/check-exports.sh path/to/libmscclpp.so
set -euo pipefail
lib=${1:?usage: check-exports.sh LIBRARY}
api_2023=(mscclppGetUniqueId mscclppCommInitRank mscclppCommInitRankFromId mscclppBootstrapAllGather
  mscclppBootstrapBarrier mscclppCommDestroy mscclppGetErrorString mscclppConnect
  mscclppConnectionSetup mscclppGetAllDeviceConnections mscclppGetDeviceConnection
  mscclppProxyLaunch mscclppProxyStop mscclppCommRank mscclppCommSize
  mscclppSetBootstrapConnTimeout mscclppDefaultLogHandler mscclppSetLogHandler
  mscclppRegisterBuffer mscclppRegisteredBufferWrite)
additions=(mscclppGetVersion mscclppGetLastError mscclppCommGetAsyncError mscclppDevConnPut
  mscclppDevConnSignal mscclppDevConnPutWithSignal mscclppDevConnPutWithSignalAndFlush
  mscclppDevConnFlush mscclppDevConnWait mscclppUnregisterBuffer)
exported=$(nm -D --defined-only "$lib" | awk '$2 == "T" { print $3 }')
missing=()
for f in "${api_2023[@]}" "${additions[@]}"; do
  grep -qx "$f" <<<"$exported" || missing+=("$f")
done
if ((${#missing[@]})); then
  echo "check-exports: $lib lacks: ${missing[*]}" >&2
  exit 1
fi
echo "check-exports: all ${#api_2023[@]} functions of the 2023 header and ${#additions[@]} additions are exported by $lib"
echo "soname: $(objdump -p "$lib" | awk '/SONAME/ { print $2 }')"
