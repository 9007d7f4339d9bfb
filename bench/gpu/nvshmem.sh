# NVSHMEM next to our tools (issue 30), sourced by bench/perf-peers.sh and scripts/gpu-check.sh:
# finds NVSHMEM's Python wheel (nvidia-nvshmem-cu13: include/, lib/libnvshmem_host.so.3,
# lib/libnvshmem_device.a, the uid bootstrap), builds bench/gpu/nvshmem_perf.cu against it, and
# sets the environment its runs need.
#
#   nvshmem_home             prints the wheel's directory (NVSHMEM_HOME wins), or fails saying why
#   nvshmem_build OUT_DIR [NAME]   builds OUT_DIR/NAME (nvshmem_perf, or nvshmem_pingpong: the
#                            independent ping-pong) from bench/gpu/NAME.cu with $NVCC (or nvcc on
#                            PATH) for NVSHMEM_PERF_ARCH (sm_90); extra nvcc flags in
#                            NVSHMEM_PERF_NVCC_FLAGS (e.g. -I for CCCL where nvcc is not a full
#                            toolkit's); prints the path
#   nvshmem_env              exports the run environment (below); a value already set is kept
#   peers_mps_up / peers_mps_down
#                            an MPS daemon for ranks sharing a GPU: the GPU check's own (its
#                            exported mps_up) inside it, else one started and later stopped here

NVSHMEM_SH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

nvshmem_home() {
  local d
  if [[ -n ${NVSHMEM_HOME:-} ]]; then
    d=$NVSHMEM_HOME
  else
    # A namespace package (no __init__.py): its __path__, not its __file__ (None).
    d=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])' 2>/dev/null) || {
      d=$(python3 -m pip show -f nvidia-nvshmem-cu13 2>/dev/null | sed -n 's/^Location: //p')
      [[ -n $d ]] && d=$d/nvidia/nvshmem
    }
  fi
  if [[ ! -f $d/include/nvshmem.h || ! -f $d/lib/libnvshmem_device.a || ! -f $d/lib/libnvshmem_host.so.3 ]]; then
    echo "NVSHMEM not found: no nvidia-nvshmem-cu13 wheel for $(command -v python3 || echo 'no python3')" \
      "(looked in '${d:-nowhere}' for include/nvshmem.h, lib/libnvshmem_device.a, lib/libnvshmem_host.so.3;" \
      "NVSHMEM_HOME names another)" >&2
    return 1
  fi
  echo "$d"
}

nvshmem_build() {
  local out=${1:?nvshmem_build OUT_DIR [NAME]} name=${2:-nvshmem_perf} home nvcc
  home=$(nvshmem_home) || return 1
  nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  mkdir -p "$out/lib" || return 1
  # The wheel ships only the versioned host library; -lnvshmem_host needs the plain name.
  ln -sf "$home/lib/libnvshmem_host.so.3" "$out/lib/libnvshmem_host.so" || return 1
  # shellcheck disable=SC2086 # NVSHMEM_PERF_NVCC_FLAGS is a list of flags
  "$nvcc" -O2 -std=c++17 -rdc=true -arch="${NVSHMEM_PERF_ARCH:-sm_90}" ${NVSHMEM_PERF_NVCC_FLAGS:-} \
    -I"$home/include" -I"$NVSHMEM_SH_DIR/../../c_examples/common" \
    "$NVSHMEM_SH_DIR/$name.cu" -o "$out/$name" \
    -L"$out/lib" -L"$home/lib" -lnvshmem_device -lnvshmem_host \
    -Xlinker -rpath -Xlinker "$home/lib" >&2 || {
    echo "$name did not build ($nvcc against $home)" >&2
    return 1
  }
  echo "$out/$name"
}

# The environment of every nvshmem_perf run, each with why:
#   NVSHMEM_DISABLE_NVLS=1   NVLink multicast stays off (it can take the host's GPUs down for
#                            others; scripts/gpu-check.sh sets it too): never unset it
#   NVSHMEM_DISABLE_NCCL=1   NVSHMEM's own collectives are measured, not NCCL's behind them
#                            (NCCL also refuses several PEs on one GPU)
#   NVSHMEM_REMOTE_TRANSPORT=none   one host: every PE is reached over P2P; no IB probing
#   NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1   full support for several PEs on one
#                            GPU under MPS without capping each PE's SMs (ours run uncapped too);
#                            NVSHMEM warns its barriers could deadlock if the PEs' kernels could
#                            not run at once: ours use 1-16 blocks each, on 132 SMs
#   NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo   the uid bootstrap's sockets on loopback: every PE is
#                            on this host
nvshmem_env() {
  export NVSHMEM_DISABLE_NVLS=1
  export NVSHMEM_DISABLE_NCCL=${NVSHMEM_DISABLE_NCCL:-1}
  export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-none}
  export NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=${NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:-1}
  export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo}
}

PEERS_MPS_STARTED=0
peers_mps_up() {
  if declare -F mps_up >/dev/null; then
    mps_up
    return
  fi
  export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/perf-peers-mps-pipe}
  export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/perf-peers-mps-log}
  # A daemon already answering on this pipe directory serves us; it is not ours to stop.
  if [[ -S $CUDA_MPS_PIPE_DIRECTORY/control ]] &&
    echo get_server_list | timeout 5 nvidia-cuda-mps-control >/dev/null 2>&1; then
    return 0
  fi
  rm -rf "$CUDA_MPS_PIPE_DIRECTORY" && mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY" &&
    nvidia-cuda-mps-control -d && PEERS_MPS_STARTED=1 && echo "MPS daemon started ($CUDA_MPS_PIPE_DIRECTORY)"
}
peers_mps_down() {
  ((PEERS_MPS_STARTED)) || return 0
  echo quit | timeout 5 nvidia-cuda-mps-control
  # Bounded: the daemon exits once its clients have (every rank of the last run has).
  local i
  for ((i = 0; i < 100; i++)); do
    [[ -S $CUDA_MPS_PIPE_DIRECTORY/control ]] &&
      echo get_server_list | timeout 5 nvidia-cuda-mps-control >/dev/null 2>&1 || break
    sleep 0.1
  done
  rm -rf "$CUDA_MPS_PIPE_DIRECTORY"
  PEERS_MPS_STARTED=0
  echo "MPS daemon stopped"
}
