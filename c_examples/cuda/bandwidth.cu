/*
 * One-way put bandwidth from rank 0 to rank 1 over a P2P connection, swept over sizes.
 *
 *   bandwidth [-r R -n 2 -a IP:PORT] [--max 1G] [--blocks B [--parts]]
 *
 * Per size: rank 0 runs one kernel of `iters` putWithSignal()s of the same range and one
 * flush(); rank 1 wait()s for each signal. --blocks B: each put split over up to B blocks of
 * 512 threads (64 KiB or more each), each putting its chunk with putWithSignalBlock(), and
 * rank 1 waits once per block (NVSHMEM's put bandwidth test does the same with its block
 * puts); one block where the chunks would be over the connection's block limit (word
 * MSCCLPP_EPOCH_DIRECT_BLOCK_BYTES: the library hands such puts to the proxy, a trigger each;
 * block_puts.h). Timed on rank 0 with CUDA events; the received
 * range is checked on rank 1 against rank 0's pattern.
 * --parts (with --blocks, a measurement): per size up to the block limit, rows
 * `RESULT parts bytes=B part=P us=U` for the block put and four stripped copies of it
 * (sendPartsKernel), instead of the plain rows.
 *
 * BANDWIDTH_PAD_STREAMS=K (measurement, bench/RESULTS.md "Hardware work queues"): creates K
 * streams after the kernels' own and before the library makes its streams, shifting which of
 * CUDA's hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS, handed out round-robin to streams
 * in creation order) the kernels' stream and the library's streams share.
 * BANDWIDTH_RECV_AFTER=1 (measurement): rank 1 waits for rank 0's signals only after rank 0's
 * kernel has ended, so that no kernel of rank 1 runs while rank 0's copies are queued.
 */
#include "block_puts.h"
#include "common.cuh"

__global__ void sendKernel(uint64_t bytes, int iters)
{
  mscclppDevConn_t conn = gConns[0];
  for (int i = 0; i < iters; i++) conn.putWithSignal(0, bytes);
  conn.flush();
}

/* --blocks: block b puts [b * chunk, +chunk) of the range, iters times. */
__global__ void sendBlocksKernel(uint64_t bytes, uint64_t chunk, int iters)
{
  mscclppDevConn_t conn = gConns[0];
  const uint64_t start = blockIdx.x * chunk;
  const uint64_t len = start < bytes ? min(chunk, bytes - start) : 0;
  for (int i = 0; i < iters; i++) conn.putWithSignalBlock(start, start, len);
  __syncthreads();
  if (threadIdx.x == 0) conn.flush();
}

/* --parts (measurement, bench/RESULTS.md): the direct block put taken apart, to say where
 * its time goes. Part 0 is putWithSignalBlock() itself; the others leave pieces out and are
 * right only because nothing of this connection is in the proxy's hands here: 1 skips only the
 * path decision (the first thread's read of the connection's ticket, and the barrier that
 * shares what it decided); 2 also the entry and exit barriers and the sender's count: a copy,
 * a barrier, one thread's fence and add to the peer's count (directSignal(), NVSHMEM's shape
 * of a block put with a signal); 3 the add with no fence before it; 4 the copy and the
 * barrier only (no signal). */
constexpr int kParts = 5;
__global__ void sendPartsKernel(uint64_t bytes, uint64_t chunk, int iters, int part)
{
  mscclppDevConn_t conn = gConns[0];
  const uint64_t start = blockIdx.x * chunk;
  const uint64_t len = start < bytes ? min(chunk, bytes - start) : 0;
  char* dst = static_cast<char*>(conn.remoteBuff) + start;
  const char* src = static_cast<const char*>(conn.localBuff) + start;
  const bool first = threadIdx.x == 0;
  for (int i = 0; i < iters; i++) {
    if (part == 0) {
      conn.putWithSignalBlock(start, start, len);
      continue;
    }
    if (part == 1) __syncthreads();
    mscclpp::device::copyBlock(dst, src, len);
    __syncthreads();
    if (first && part <= 2) conn.directSignal();
    if (first && part == 3)
      mscclpp::device::addOneSys(reinterpret_cast<uint64_t*>(conn.remoteSignalEpochId) +
                                 MSCCLPP_EPOCH_DIRECT);
    if (part == 1) {
      if (first) conn.epochIncrement();
      __syncthreads();
    }
  }
  __syncthreads();
  if (first) conn.flush();
}

__global__ void recvKernel(int iters)
{
  mscclppDevConn_t conn = gConns[0];
  for (int i = 0; i < iters; i++) conn.wait();
}

int main(int argc, char** argv)
{
  Ctx c;
  setupRank(c, &argc, argv);
  if (c.nranks != 2) {
    fprintf(stderr, "bandwidth runs on exactly 2 ranks\n");
    return 2;
  }
  uint64_t maxBytes = 1ull << 30;
  if (const char* v = flagValue(argc, argv, "--max")) maxBytes = parseBytes(v);
  int maxBlocks = 0;
  if (const char* v = flagValue(argc, argv, "--blocks")) maxBlocks = atoi(v);
  if (maxBlocks < 0 || maxBlocks > 1024) {
    fprintf(stderr, "--blocks: 0..1024\n");
    return 2;
  }
  const bool parts = hasFlag(argc, argv, "--parts");
  if (parts && maxBlocks == 0) {
    fprintf(stderr, "--parts takes a block put apart: give --blocks too\n");
    return 2;
  }
  uint32_t* buf = nullptr;
  CUDACHECK(cudaMalloc(&buf, maxBytes));
  cudaStream_t s;
  CUDACHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const bool recvAfter = getenv("BANDWIDTH_RECV_AFTER") != nullptr;
  int pad = 0;
  if (const char* v = getenv("BANDWIDTH_PAD_STREAMS")) pad = atoi(v);
  cudaStream_t padding[64];
  for (int i = 0; i < pad && i < 64; i++)
    CUDACHECK(cudaStreamCreateWithFlags(&padding[i], cudaStreamNonBlocking));
  /* One "slice" of maxBytes owned by rank 0: rank 0 holds the pattern, rank 1 its complement. */
  const uint32_t seed = 77;
  fillKernel<<<264, 512, 0, s>>>(buf, maxBytes / 4, c.rank == 0 ? 0 : -1, 1, seed);
  KERNELCHECK();
  CUDACHECK(cudaStreamSynchronize(s));
  connectPeers(c, buf, maxBytes, {1 - c.rank});
  int failures = 0;
  uint64_t blockLimit = 0;
  if (maxBlocks > 0) {
    mscclppDevConn_t* hc = nullptr;
    MSCCLPPCHECK(mscclppGetDeviceConnection(c.comm, 1 - c.rank, 0, &hc));
    CUDACHECK(block_limit(hc, &blockLimit));
  }
  if (parts && blockLimit == 0) {
    fprintf(stderr, "--parts: the direct path is off on this connection (not P2P, or "
                    "MSCCLPP_P2P_DIRECT_BYTES=0): nothing to take apart\n");
    teardown(c);
    return 2;
  }

  cudaEvent_t t0, t1;
  CUDACHECK(cudaEventCreate(&t0));
  CUDACHECK(cudaEventCreate(&t1));
  if (c.rank == 0) printf("%-12s %-8s %-12s %-10s\n", "bytes", "iters", "us/put", "GB/s");
  for (uint64_t bytes = 4096; bytes <= maxBytes; bytes *= 4) {
    int iters = (int)((4ull << 30) / bytes);
    iters = iters < 5 ? 5 : (iters > 200 ? 200 : iters);
    /* --blocks: blocks per put and the signals per put rank 1 waits for. */
    uint64_t bpp = 1, chunk = bytes;
    if (maxBlocks > 0) block_split(bytes, (uint64_t)maxBlocks, blockLimit, &bpp, &chunk);
    if (parts && chunk > blockLimit) break; /* over the limit: the proxy's, not a direct put */
    /* part -1: the plain run; with --parts, parts 0..kParts-1 in turn (sendPartsKernel). */
    for (int part = parts ? 0 : -1; part < (parts ? kParts : 0); part++) {
      const int waits = part == 4 ? 0 : (int)bpp; /* signals per put rank 1 waits for */
      for (int pass = 0; pass < 2; pass++) { /* pass 0 warms up */
        const int n = pass ? iters : 2;
        MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
        if (c.rank == 0) {
          CUDACHECK(cudaEventRecord(t0, s));
          if (part >= 0)
            sendPartsKernel<<<(unsigned)bpp, 512, 0, s>>>(bytes, chunk, n, part);
          else if (maxBlocks > 0)
            sendBlocksKernel<<<(unsigned)bpp, 512, 0, s>>>(bytes, chunk, n);
          else
            sendKernel<<<1, 1, 0, s>>>(bytes, n);
          KERNELCHECK();
          CUDACHECK(cudaEventRecord(t1, s));
        } else if (!recvAfter && waits > 0) {
          recvKernel<<<1, 1, 0, s>>>(n * waits);
          KERNELCHECK();
        }
        CUDACHECK(cudaStreamSynchronize(s));
        if (recvAfter) {
          MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
          if (c.rank == 1 && waits > 0) {
            recvKernel<<<1, 1, 0, s>>>(n * waits);
            KERNELCHECK();
            CUDACHECK(cudaStreamSynchronize(s));
          }
        }
      }
      if (part >= 0 && c.rank == 0) {
        float ms = 0;
        CUDACHECK(cudaEventElapsedTime(&ms, t0, t1));
        printf("RESULT parts bytes=%llu part=%d us=%.3f\n", (unsigned long long)bytes, part,
               ms * 1e3 / iters);
        fflush(stdout);
      }
    }
    /* Rank 1 checks the first `bytes` (the rest must still be its complement pattern). */
    double bad = 0;
    if (c.rank == 1) bad = (double)countBad(buf, bytes / 4, 0, 1, seed, s);
    bad = maxOverRanks(c, bad);
    if (bad > 0) failures++;
    if (c.rank == 0 && parts) {
      printf("RESULT parts bytes=%llu check=%s\n", (unsigned long long)bytes, bad > 0 ? "FAIL" : "ok");
    } else if (c.rank == 0) {
      float ms = 0;
      CUDACHECK(cudaEventElapsedTime(&ms, t0, t1));
      const double us = ms * 1e3 / iters;
      printf("%-12llu %-8d %-12.2f %-10.2f%s\n", (unsigned long long)bytes, iters, us,
             bytes / us / 1e3, bad > 0 ? "  DATA MISMATCH" : "");
      printf("RESULT bandwidth bytes=%llu us=%.3f GBps=%.2f check=%s\n", (unsigned long long)bytes,
             us, bytes / us / 1e3, bad > 0 ? "FAIL" : "ok");
      fflush(stdout);
    }
  }
  failures += teardown(c);
  CUDACHECK(cudaEventDestroy(t0));
  CUDACHECK(cudaEventDestroy(t1));
  CUDACHECK(cudaStreamDestroy(s));
  for (int i = 0; i < pad && i < 64; i++) CUDACHECK(cudaStreamDestroy(padding[i]));
  CUDACHECK(cudaFree(buf));
  return failures ? 1 : 0;
}
