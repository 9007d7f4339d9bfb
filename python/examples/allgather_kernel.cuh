/*
 * The all-gather kernel of allgather_cupy.py and allgather_torch.py: CUDA that includes
 * mscclpp.h, compiled at run time (CuPy: NVRTC or nvcc; PyTorch: load_inline, nvcc) with the
 * flags of mscclpp_rs.compile_flags().
 *
 * Every rank owns bytes [rank * sliceBytes, (rank + 1) * sliceBytes) of the same buffer on every
 * rank. Warp w serves connection w (its lane 0: a connection takes one thread at a time): it
 * puts this rank's slice to the same offset on the peer with a signal, waits until the put
 * has left (flush: the slice may change again), then waits for the peer's signal (its slice
 * has arrived here). `conns` is the array of mscclpp_rs's Communicator.device_connections(),
 * copied to GPU memory (to_cupy() / to_torch()): the methods are const and read the 80-byte
 * structs in place.
 */
#include <mscclpp.h>

extern "C" __global__ void mscclppAllGather(const mscclppDevConn_t* conns, int npeers, int rank,
                                            uint64_t sliceBytes)
{
  const int warp = threadIdx.x / 32;
  if (warp >= npeers || threadIdx.x % 32 != 0) return;
  const mscclppDevConn_t& conn = conns[warp];
  const uint64_t offset = (uint64_t)rank * sliceBytes;
  conn.putWithSignal(offset, sliceBytes);
  conn.flush();
  conn.wait();
}
