// mscclpp.h under nvcc: the structs keep the 2023 layout on the device side, and a kernel can
// call the device methods of mscclppDevConn (compiled, not run).
#include <mscclpp.h>

#include <cstddef>

static_assert(sizeof(mscclppDevConn) == 80, "mscclppDevConn is 80 bytes");
static_assert(offsetof(mscclppDevConn, fifo) == 48, "fifo at offset 48");
static_assert(alignof(mscclppDevConnSignalEpochId) == 16, "epoch alignment");

__constant__ mscclppDevConn_t constDevConns[8];

__global__ void kernel(int rank, uint64_t bytes)
{
  mscclppDevConn_t& conn = constDevConns[threadIdx.x % 8];
  if (rank == 0) {
    conn.put(0, bytes);
    conn.signal();
    conn.putWithSignal(0, 0, bytes);
    conn.putWithSignalAndFlush(0, bytes);
    conn.putBlock(0, 0, bytes); /* every thread of the block calls the block methods */
    conn.putWithSignalBlock(0, 0, bytes);
    if (conn.putsDirect(bytes, true) && conn.putsDirect(bytes, false)) conn.put(0, 0, bytes);
    conn.flush();
  } else {
    conn.wait();
  }
}

int main()
{
  kernel<<<1, 8>>>(0, 1024);
  return 0;
}
