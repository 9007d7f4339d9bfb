/*
 * All-gather over P2P connections, the 2023 way: every rank putWithSignal()s its slice of one
 * buffer to every peer, flush()es and wait()s, one warp per peer. Every byte is checked. Over
 * P2P a slice of at most MSCCLPP_P2P_DIRECT_BYTES (2 KiB by default) goes the direct path (lane
 * 0 stores it into the peer's buffer itself: docs/DESIGN.md 3.2), larger ones through the
 * proxy; `--bench --sizes 1K,4K` times the former (with MSCCLPP_P2P_DIRECT_BYTES=0, the proxy
 * at the same sizes).
 *
 *   allgather [-r R -n N -a IP:PORT]            test: several sizes and iterations, plus a
 *                                               variant that stores straight into remoteBuff
 *   allgather ... --bench [--sizes 1M,64M,1G]    benchmark: per size, 10 all-gathers captured
 *                                               in a CUDA graph, timed over 10 graph launches
 *   allgather ... --profile [--sizes 1M]         where a kernel's time goes: putWithSignal,
 *                                               flush and wait, timed inside the kernel
 *
 * Ranks come from the launcher (launch_env.h); local rank r uses GPU r % ngpus (the local rank
 * defaults to the rank). MSCCLPP_EXAMPLE_TRANSPORT=ib|shm|mixed connects over libfabric (GPU
 * memory staged through host memory unless the provider has FI_HMEM) instead of P2P.
 */
#include "common.cuh"

#include <string>

/* The library's methods: warp w (lane 0) serves connection w; the library picks the path. */
__global__ void allgatherProxy(int rank, int npeers, uint64_t sliceBytes)
{
  const int warp = threadIdx.x / 32;
  if (warp >= npeers || threadIdx.x % 32 != 0) return;
  mscclppDevConn_t conn = gConns[warp];
  const uint64_t off = (uint64_t)rank * sliceBytes;
  conn.putWithSignal(off, sliceBytes);
  conn.flush();
  conn.wait();
}

/* The methods, timed inside the kernel: t[0..3] += ns in putWithSignal, flush, wait. */
__global__ void allgatherProfiled(int rank, int npeers, uint64_t sliceBytes, unsigned long long* t)
{
  const int warp = threadIdx.x / 32;
  if (warp >= npeers || threadIdx.x % 32 != 0) return;
  mscclppDevConn_t conn = gConns[warp];
  const uint64_t off = (uint64_t)rank * sliceBytes;
  const uint64_t t0 = globalTimerNs();
  conn.putWithSignal(off, sliceBytes);
  const uint64_t t1 = globalTimerNs();
  conn.flush();
  const uint64_t t2 = globalTimerNs();
  conn.wait();
  const uint64_t t3 = globalTimerNs();
  if (warp == 0) {
    atomicAdd(&t[0], (unsigned long long)(t1 - t0));
    atomicAdd(&t[1], (unsigned long long)(t2 - t1));
    atomicAdd(&t[2], (unsigned long long)(t3 - t2));
  }
}

/* The block's own stores: block b copies this rank's slice into peer b's buffer through
 * remoteBuff (the CUDA IPC mapping), then signals; the release fence inside signal() (a direct
 * one, or the push's) orders the block's stores (after __syncthreads) before the count. */
__global__ void allgatherDirect(int rank, uint64_t sliceBytes)
{
  mscclppDevConn_t conn = gConns[blockIdx.x];
  const uint64_t off = (uint64_t)rank * sliceBytes;
  const uint32_t* src = (const uint32_t*)((const char*)conn.localBuff + off);
  uint32_t* dst = (uint32_t*)((char*)conn.remoteBuff + off);
  for (uint64_t i = threadIdx.x; i < sliceBytes / 4; i += blockDim.x) dst[i] = src[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    gConns[blockIdx.x].signal(); /* a method called on the __constant__ array itself */
    conn.wait();
  }
}

static int runTest(Ctx& c, uint32_t* buf, uint64_t maxBytes, cudaStream_t s)
{
  const int npeers = c.nranks - 1;
  /* Bytes per rank: one word, around the direct path's default limit (2 KiB), an odd number
   * of words, a few MiB (whole words: the checks assign words to owners). */
  const uint64_t slices[] = {4, 2044, 2048, 2052, 4 * 1021, ((8ull << 20) / c.nranks) & ~3ull};
  int failures = 0;
  uint32_t seed = 1;
  for (uint64_t slice : slices) {
    if (slice * c.nranks > maxBytes) continue;
    /* The direct variant stores through remoteBuff: P2P connections only. */
    for (int variant = 0; variant < (c.allP2P ? 2 : 1); variant++) {
      for (int iter = 0; iter < 3; iter++, seed++) {
        const uint64_t words = slice / 4;
        fillKernel<<<264, 512, 0, s>>>(buf, words, c.rank, c.nranks, seed);
        KERNELCHECK();
        CUDACHECK(cudaStreamSynchronize(s));
        /* Nobody puts before every rank has poisoned its buffer. */
        MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
        if (variant == 0)
          allgatherProxy<<<1, 32 * npeers, 0, s>>>(c.rank, npeers, slice);
        else
          allgatherDirect<<<npeers, 512, 0, s>>>(c.rank, slice);
        KERNELCHECK();
        CUDACHECK(cudaStreamSynchronize(s));
        const unsigned long long bad = countBad(buf, words, 0, c.nranks, seed, s);
        if (bad) {
          fprintf(stderr, "rank %d: %s all-gather of %llu bytes per rank, iteration %d: %llu bad words\n",
                  c.rank, variant ? "remoteBuff" : "methods", (unsigned long long)slice, iter, bad);
          failures++;
        }
        /* Nobody overwrites a peer's buffer (next fill + put) before it has checked. */
        MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
      }
    }
  }
  if (c.rank == 0)
    printf("allgather test, %d ranks on %d GPUs: %s\n", c.nranks, c.ndevices,
           failures ? "FAILED" : "PASSED");
  return failures;
}

static int runBench(Ctx& c, uint32_t* buf, uint64_t maxBytes, const std::vector<uint64_t>& sizes,
                    cudaStream_t s)
{
  const int npeers = c.nranks - 1;
  const int kernelsPerGraph = 10, graphLaunches = 10;
  int failures = 0;
  if (c.rank == 0) printf("%-12s %-14s %-10s\n", "total bytes", "us/allgather", "algBW GB/s");
  for (uint64_t total : sizes) {
    if (total > maxBytes || total % (4ull * c.nranks) != 0) {
      if (c.rank == 0) printf("skipping %llu bytes\n", (unsigned long long)total);
      continue;
    }
    const uint64_t slice = total / c.nranks;
    const uint32_t seed = 1000 + (uint32_t)(total >> 10);
    fillKernel<<<264, 512, 0, s>>>(buf, slice / 4, c.rank, c.nranks, seed);
    KERNELCHECK();
    CUDACHECK(cudaStreamSynchronize(s));
    MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));

    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDACHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int k = 0; k < kernelsPerGraph; k++) {
      allgatherProxy<<<1, 32 * npeers, 0, s>>>(c.rank, npeers, slice);
      KERNELCHECK();
    }
    CUDACHECK(cudaStreamEndCapture(s, &graph));
    CUDACHECK(cudaGraphInstantiate(&exec, graph, 0));

    /* Warm-up launch, then the timed ones; every rank starts from a barrier. */
    CUDACHECK(cudaGraphLaunch(exec, s));
    CUDACHECK(cudaStreamSynchronize(s));
    MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
    cudaEvent_t t0, t1;
    CUDACHECK(cudaEventCreate(&t0));
    CUDACHECK(cudaEventCreate(&t1));
    CUDACHECK(cudaEventRecord(t0, s));
    for (int g = 0; g < graphLaunches; g++) CUDACHECK(cudaGraphLaunch(exec, s));
    CUDACHECK(cudaEventRecord(t1, s));
    CUDACHECK(cudaEventSynchronize(t1));
    float ms = 0;
    CUDACHECK(cudaEventElapsedTime(&ms, t0, t1));
    const double us = maxOverRanks(c, ms * 1000.0 / (kernelsPerGraph * graphLaunches));

    const unsigned long long bad = countBad(buf, slice / 4, 0, c.nranks, seed, s);
    const double badAll = maxOverRanks(c, (double)bad);
    if (badAll > 0) failures++;
    if (c.rank == 0) {
      printf("%-12llu %-14.2f %-10.2f%s\n", (unsigned long long)total, us, total / us / 1e3,
             badAll > 0 ? "  DATA MISMATCH" : "");
      printf("RESULT allgather nranks=%d bytes=%llu us=%.2f check=%s\n", c.nranks,
             (unsigned long long)total, us, badAll > 0 ? "FAIL" : "ok");
      fflush(stdout);
    }
    CUDACHECK(cudaEventDestroy(t0));
    CUDACHECK(cudaEventDestroy(t1));
    CUDACHECK(cudaGraphExecDestroy(exec));
    CUDACHECK(cudaGraphDestroy(graph));
    MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  }
  return failures;
}

static int runProfile(Ctx& c, uint32_t* buf, uint64_t maxBytes, const std::vector<uint64_t>& sizes,
                      cudaStream_t s)
{
  const int npeers = c.nranks - 1, iters = 200;
  unsigned long long* d = nullptr;
  CUDACHECK(cudaMalloc(&d, 3 * sizeof(unsigned long long)));
  for (uint64_t total : sizes) {
    if (total > maxBytes || total % (4ull * c.nranks) != 0) continue;
    const uint64_t slice = total / c.nranks;
    CUDACHECK(cudaMemset(d, 0, 3 * sizeof(unsigned long long)));
    MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
    for (int i = 0; i < iters; i++) {
      allgatherProfiled<<<1, 32 * npeers, 0, s>>>(c.rank, npeers, slice, d);
      KERNELCHECK();
    }
    CUDACHECK(cudaStreamSynchronize(s));
    unsigned long long h[3];
    CUDACHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
    if (c.rank == 0) {
      printf("RESULT profile bytes=%llu put_us=%.2f flush_us=%.2f wait_us=%.2f\n",
             (unsigned long long)total, h[0] / 1e3 / iters, h[1] / 1e3 / iters,
             h[2] / 1e3 / iters);
      fflush(stdout);
    }
  }
  CUDACHECK(cudaFree(d));
  return 0;
}

int main(int argc, char** argv)
{
  Ctx c;
  setupRank(c, &argc, argv);
  if (c.nranks < 2) {
    fprintf(stderr, "needs at least 2 ranks\n");
    return 2;
  }
  const bool profile = hasFlag(argc, argv, "--profile");
  const bool bench = hasFlag(argc, argv, "--bench") || profile;
  std::vector<uint64_t> sizes;
  if (const char* s = flagValue(argc, argv, "--sizes")) {
    std::string all(s);
    size_t pos = 0;
    while (pos <= all.size()) {
      size_t comma = all.find(',', pos);
      if (comma == std::string::npos) comma = all.size();
      sizes.push_back(parseBytes(all.substr(pos, comma - pos).c_str()));
      pos = comma + 1;
    }
  } else {
    sizes = {1ull << 20, 64ull << 20, 1ull << 30};
  }
  uint64_t maxBytes = 8ull << 20;
  if (bench)
    for (uint64_t x : sizes) maxBytes = x > maxBytes ? x : maxBytes;

  uint32_t* buf = nullptr;
  CUDACHECK(cudaMalloc(&buf, maxBytes));
  cudaStream_t s;
  CUDACHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  std::vector<int> peers;
  for (int p = 0; p < c.nranks; p++)
    if (p != c.rank) peers.push_back(p);
  connectPeers(c, buf, maxBytes, peers);

  int failures = profile ? runProfile(c, buf, maxBytes, sizes, s)
                 : bench ? runBench(c, buf, maxBytes, sizes, s)
                         : runTest(c, buf, maxBytes, s);

  failures += teardown(c);
  CUDACHECK(cudaStreamDestroy(s));
  CUDACHECK(cudaFree(buf));
  if (failures) fprintf(stderr, "rank %d: %d failures\n", c.rank, failures);
  return failures ? 1 : 0;
}
