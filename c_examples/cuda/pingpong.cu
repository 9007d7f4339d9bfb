/*
 * Latency between two GPUs, and what the FIFO's placement costs a kernel.
 *
 *   pingpong [-r R -n 2 -a IP:PORT] [--iters N] [--sweep MIN:MAX[:FACTOR]] [--block]
 *
 * Prints (rank 0):
 *   signal one-way      signal()/wait() ping-pong, half the round trip
 *   put8 one-way        putWithSignal() of 8 bytes, ping-pong, half the round trip
 *   flush round trip    flush() with nothing queued
 *   load host tail      one volatile load of the FIFO tail (pinned host memory, over PCIe)
 *   load tail cache     one volatile load of the tail cache (device memory)
 *   push                one signal() (no waiting), averaged over 64
 *   --sweep: put N one-way, putWithSignal() of N bytes ping-pong by one thread, half the round
 *            trip, for N = MIN, MIN x FACTOR (default 2), ... up to MAX (at most 4M):
 *            "RESULT pingpong put bytes=N us=U"
 *   --block: the sweep by one block of 512 threads with putWithSignalBlock() (sizes up to 4M):
 *            "RESULT pingpong putblock bytes=N us=U"
 *   --parts: the direct put8 row taken apart (issue 42): the same ping-pong written by hand on
 *            words of the buffer (the peer's through remoteBuff), from what NVSHMEM's P2P path
 *            does (a store, __threadfence_system(), a volatile store of the signal; a volatile
 *            spin) through ours' instructions one by one: "RESULT parts8 part=NAME us=U"; and
 *            a 64-byte put by a block of 512 threads the same way, from NVSHMEM's block path to
 *            putWithSignalBlock(): "RESULT parts64 part=NAME us=U"
 * Over P2P with the direct path on (the default; docs/DESIGN.md 3.2) the signal, put8 and
 * small sweep rows are stores by the kernel itself, the empty flush is a fence and push is a
 * direct signal; with MSCCLPP_P2P_DIRECT_BYTES=0 every one of them goes through the proxy
 * (flush: GPU -> proxy thread -> GPU; push: one trigger), which is how the GPU check measures
 * both in the same run (tags `proxy` and `direct`: scripts/gpu-check.sh).
 * Each kernel checks its result; the program exits 1 on any failure.
 */
#include "common.cuh"

#include <string>

/* The sweep's regions: rank 0 sends [kSweepA, +N) into rank 1's buffer, rank 1 [kSweepB, +N)
 * into rank 0's; N at most kSweepMax. */
constexpr uint64_t kSweepMax = 4 << 20, kSweepA = 4 << 20, kSweepB = 8 << 20;

enum Mode { kSignal = 0, kPut8 = 1 };

/* --parts: words at kPartsAt of each buffer (between put8's bytes and the sweep's): the
 * message at kPartsAt + 8 * sender, part p's signal at kPartsAt + 64 * (p + 1), zero at start. */
constexpr uint64_t kPartsAt = 1 << 20;
enum Part {
  kNvshmemLike, /* st data; fence.sc.sys; st.volatile signal = i; spin ld.volatile */
  kFloor,       /* st data; fence.acq_rel.sys; red.add.sys (our directSignal); spin ld.volatile */
  kAcqTail,     /* kFloor + wait()'s two ld.acquire.sys after the spin */
  kPathLoads,   /* kFloor + directPath()'s two volatile loads before the put, results used */
  kEpochInc,    /* kFloor + epochIncrement()'s atomicAdd on the own epoch word */
  kAcqSpin,     /* kFloor, the spin by ld.acquire.sys (no tail) */
  kParts
};
const char* const kPartNames[] = {"nvshmem_like", "floor", "floor_acq_tail", "floor_path_loads",
                                  "floor_epoch_inc", "floor_acq_spin"};

template <int P>
__device__ __forceinline__ void partSend(const mscclppDevConn_t& conn, int rank, uint64_t v, uint64_t* sink)
{
  using namespace mscclpp::device;
  char* rbuf = static_cast<char*>(conn.remoteBuff);
  if (P == kPathLoads) {
    /* The two words directPath() reads per operation; a result that depends on them. */
    const uint64_t a = loadVolatile(conn.epochWord(MSCCLPP_EPOCH_PROXIED));
    const uint64_t b = loadVolatile(conn.fifo.triggerFifoHead + MSCCLPP_FIFO_DEV_RAW);
    if (a + b == 12345) *sink += 1;
  }
  *reinterpret_cast<uint64_t*>(rbuf + kPartsAt + 8 * rank) = v;
  uint64_t* sig = reinterpret_cast<uint64_t*>(rbuf + kPartsAt + 64 * (P + 1));
  if (P == kNvshmemLike) {
    __threadfence_system();
    storeVolatile(sig, v);
  } else {
    fenceAcqRelSys();
    addOneSys(sig);
  }
  if (P == kEpochInc) conn.epochIncrement();
}

template <int P>
__device__ __forceinline__ void partWait(const mscclppDevConn_t& conn, uint64_t v, uint64_t* sink)
{
  using namespace mscclpp::device;
  const uint64_t* sig = reinterpret_cast<const uint64_t*>(static_cast<char*>(conn.localBuff) + kPartsAt + 64 * (P + 1));
  if (P == kAcqSpin) {
    while (loadAcquireSys(sig) < v) {}
  } else {
    while (loadVolatile(sig) < v) {}
  }
  if (P == kAcqTail) *sink += loadAcquireSys(sig) + loadAcquireSys(sig + 1);
}

template <int P>
__global__ void partsKernel(int rank, int iters, uint64_t base, unsigned long long* ns, uint64_t* sink)
{
  mscclppDevConn_t conn = gConns[0];
  const uint64_t t0 = globalTimerNs();
  for (int i = 1; i <= iters; i++) {
    if (rank == 0) {
      partSend<P>(conn, rank, base + i, sink);
      partWait<P>(conn, base + i, sink);
    } else {
      partWait<P>(conn, base + i, sink);
      partSend<P>(conn, rank, base + i, sink);
    }
  }
  *ns = globalTimerNs() - t0;
}

/* --parts, by a block of 512 threads, 64 bytes (4 threads copy one 16-byte word each): the
 * same ladder for putWithSignalBlock(), from NVSHMEM's block path (barrier, copy, barrier,
 * thread 0's __threadfence_system() and volatile store, barrier) to ours. Signal words after
 * the thread parts'. */
enum BlockPart {
  kBNvshmemLike, /* as above */
  kBFloor,       /* thread 0: fence.acq_rel.sys; red.add.sys */
  kBDecision,    /* kBFloor + thread 0's two path loads and a __syncthreads_or() on them */
  kBEpochInc,    /* kBFloor + thread 0's epochIncrement() before the last barrier */
  kBOurs,        /* putWithSignalBlock() and wait(): the library's own */
  kBlockParts
};
const char* const kBlockPartNames[] = {"block_nvshmem_like", "block_floor", "block_floor_decision",
                                       "block_floor_epoch_inc", "block_ours"};
constexpr uint64_t kBlockPartBytes = 64;

template <int P>
__device__ __forceinline__ void blockSend(const mscclppDevConn_t& conn, int rank, uint64_t v, uint64_t* sink)
{
  using namespace mscclpp::device;
  const uint32_t t = threadIdx.x;
  const uint64_t at = kPartsAt + 4096 + 256 * rank; /* the sender's 64 bytes, both sides */
  if (P == kBOurs) {
    conn.putWithSignalBlock(at, at, kBlockPartBytes);
    return;
  }
  char* rbuf = static_cast<char*>(conn.remoteBuff);
  const char* lbuf = static_cast<const char*>(conn.localBuff);
  __syncthreads();
  bool go = true;
  if (P == kBDecision) {
    uint64_t a = 0, b = 0;
    if (t == 0) {
      a = loadVolatile(conn.epochWord(MSCCLPP_EPOCH_PROXIED));
      b = loadVolatile(conn.fifo.triggerFifoHead + MSCCLPP_FIFO_DEV_RAW);
    }
    go = __syncthreads_or(t == 0 && a + b != 12345);
  }
  if (go && t < kBlockPartBytes / 16)
    reinterpret_cast<int4*>(rbuf + at)[t] = reinterpret_cast<const int4*>(lbuf + at)[t];
  __syncthreads();
  if (t == 0) {
    uint64_t* sig = reinterpret_cast<uint64_t*>(rbuf + kPartsAt + 64 * (kParts + P + 1));
    if (P == kBNvshmemLike) {
      __threadfence_system();
      storeVolatile(sig, v);
    } else {
      fenceAcqRelSys();
      addOneSys(sig);
    }
    if (P == kBEpochInc) conn.epochIncrement();
  }
  __syncthreads();
}

template <int P>
__global__ void blockPartsKernel(int rank, int iters, uint64_t base, unsigned long long* ns, uint64_t* sink)
{
  mscclppDevConn_t conn = gConns[0];
  const uint64_t* sig = reinterpret_cast<const uint64_t*>(static_cast<char*>(conn.localBuff) + kPartsAt +
                                                          64 * (kParts + P + 1));
  const uint64_t t0 = globalTimerNs();
  for (int i = 1; i <= iters; i++) {
    if (rank == 1 && threadIdx.x == 0) {
      if (P == kBOurs) conn.wait(); else while (mscclpp::device::loadVolatile(sig) < base + i) {}
    }
    blockSend<P>(conn, rank, base + i, sink);
    if (rank == 0 && threadIdx.x == 0) {
      if (P == kBOurs) conn.wait(); else while (mscclpp::device::loadVolatile(sig) < base + i) {}
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *ns = globalTimerNs() - t0;
}

static void launchBlockPart(int p, int rank, int iters, uint64_t base, unsigned long long* ns, uint64_t* sink,
                            cudaStream_t s)
{
  switch (p) {
  case kBNvshmemLike: blockPartsKernel<kBNvshmemLike><<<1, 512, 0, s>>>(rank, iters, base, ns, sink); break;
  case kBFloor: blockPartsKernel<kBFloor><<<1, 512, 0, s>>>(rank, iters, base, ns, sink); break;
  case kBDecision: blockPartsKernel<kBDecision><<<1, 512, 0, s>>>(rank, iters, base, ns, sink); break;
  case kBEpochInc: blockPartsKernel<kBEpochInc><<<1, 512, 0, s>>>(rank, iters, base, ns, sink); break;
  default: blockPartsKernel<kBOurs><<<1, 512, 0, s>>>(rank, iters, base, ns, sink); break;
  }
}

static void launchPart(int p, int rank, int iters, uint64_t base, unsigned long long* ns, uint64_t* sink,
                       cudaStream_t s)
{
  switch (p) {
  case kNvshmemLike: partsKernel<kNvshmemLike><<<1, 1, 0, s>>>(rank, iters, base, ns, sink); break;
  case kFloor: partsKernel<kFloor><<<1, 1, 0, s>>>(rank, iters, base, ns, sink); break;
  case kAcqTail: partsKernel<kAcqTail><<<1, 1, 0, s>>>(rank, iters, base, ns, sink); break;
  case kPathLoads: partsKernel<kPathLoads><<<1, 1, 0, s>>>(rank, iters, base, ns, sink); break;
  case kEpochInc: partsKernel<kEpochInc><<<1, 1, 0, s>>>(rank, iters, base, ns, sink); break;
  default: partsKernel<kAcqSpin><<<1, 1, 0, s>>>(rank, iters, base, ns, sink); break;
  }
}

__global__ void pingpongKernel(int rank, int iters, int mode, unsigned long long* ns)
{
  mscclppDevConn_t conn = gConns[0];
  const uint64_t t0 = globalTimerNs();
  for (int i = 0; i < iters; i++) {
    if (rank == 0) {
      if (mode == kSignal) conn.signal(); else conn.putWithSignal(0, 0, 8);
      conn.wait();
    } else {
      conn.wait();
      if (mode == kSignal) conn.signal(); else conn.putWithSignal(8, 8, 8);
    }
  }
  conn.flush();
  *ns = globalTimerNs() - t0;
}

/* putWithSignal() of `bytes` ping-pong: rank 0 sends its [a, a + bytes), rank 1 its
 * [b, b + bytes) (the offsets of main's sweep), one thread each. */
__global__ void sweepKernel(int rank, int iters, uint64_t bytes, uint64_t a, uint64_t b,
                            unsigned long long* ns)
{
  mscclppDevConn_t conn = gConns[0];
  const uint64_t t0 = globalTimerNs();
  for (int i = 0; i < iters; i++) {
    if (rank == 0) {
      conn.putWithSignal(a, bytes);
      conn.wait();
    } else {
      conn.wait();
      conn.putWithSignal(b, bytes);
    }
  }
  conn.flush();
  *ns = globalTimerNs() - t0;
}

/* The same by a whole block with putWithSignalBlock(): thread 0 waits, the block follows (the
 * block put begins with __syncthreads(), which holds the other threads until thread 0's wait
 * returned, as NVSHMEM's block puts and its perftest's kernel do). */
__global__ void sweepBlockKernel(int rank, int iters, uint64_t bytes, uint64_t a, uint64_t b,
                                 unsigned long long* ns)
{
  mscclppDevConn_t conn = gConns[0];
  const uint64_t t0 = globalTimerNs();
  for (int i = 0; i < iters; i++) {
    if (rank == 0) {
      conn.putWithSignalBlock(a, a, bytes);
      if (threadIdx.x == 0) conn.wait();
    } else {
      if (threadIdx.x == 0) conn.wait();
      conn.putWithSignalBlock(b, b, bytes);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    conn.flush();
    *ns = globalTimerNs() - t0;
  }
}

__global__ void flushKernel(int iters, unsigned long long* ns)
{
  mscclppDevConn_t conn = gConns[0];
  const uint64_t t0 = globalTimerNs();
  for (int i = 0; i < iters; i++) conn.flush();
  *ns = globalTimerNs() - t0;
}

/* A chain of dependent volatile loads: the next address depends on the value just read. */
__global__ void loadKernel(const uint64_t* p, int iters, unsigned long long* out)
{
  uint64_t v = 0;
  const uint64_t t0 = globalTimerNs();
  for (int i = 0; i < iters; i++) v = mscclpp::device::loadVolatile(p + (v >> 62));
  out[0] = globalTimerNs() - t0;
  out[1] = v;
}

__global__ void pushKernel(int n, unsigned long long* ns)
{
  mscclppDevConn_t conn = gConns[0];
  const uint64_t t0 = globalTimerNs();
  for (int i = 0; i < n; i++) conn.signal();
  const uint64_t t1 = globalTimerNs();
  conn.flush();
  *ns = t1 - t0;
}

__global__ void waitKernel(int n)
{
  mscclppDevConn_t conn = gConns[0];
  for (int i = 0; i < n; i++) conn.wait();
}

int main(int argc, char** argv)
{
  Ctx c;
  setupRank(c, &argc, argv);
  if (c.nranks != 2) {
    fprintf(stderr, "pingpong runs on exactly 2 ranks\n");
    return 2;
  }
  int iters = 2000;
  if (const char* v = flagValue(argc, argv, "--iters")) iters = atoi(v);
  const bool block = hasFlag(argc, argv, "--block");
  const bool parts = hasFlag(argc, argv, "--parts");
  /* --sweep MIN:MAX[:FACTOR]: sizes of the put sweep (none without it). */
  uint64_t sweepMin = 0, sweepMax = 0, sweepFactor = 2;
  if (const char* v = flagValue(argc, argv, "--sweep")) {
    std::string all(v);
    const size_t c1 = all.find(':'), c2 = all.find(':', c1 == std::string::npos ? c1 : c1 + 1);
    sweepMin = parseBytes(all.substr(0, c1).c_str());
    sweepMax = c1 == std::string::npos ? sweepMin : parseBytes(all.substr(c1 + 1, c2 - c1 - 1).c_str());
    if (c2 != std::string::npos) sweepFactor = strtoull(all.c_str() + c2 + 1, nullptr, 10);
    if (sweepMin == 0 || sweepMax < sweepMin || sweepMax > kSweepMax || sweepFactor < 2) {
      fprintf(stderr, "--sweep MIN:MAX[:FACTOR]: 1 <= MIN <= MAX <= 4M, FACTOR >= 2\n");
      return 2;
    }
  }
  const uint64_t bytes = kSweepB + kSweepMax;
  void* buf = nullptr;
  CUDACHECK(cudaMalloc(&buf, bytes));
  /* Rank r's bytes are r + 1; put8 sends rank 0's [0,8) and rank 1's [8,16) across. */
  CUDACHECK(cudaMemset(buf, c.rank + 1, bytes));
  CUDACHECK(cudaMemset((char*)buf + kPartsAt, 0, 64 * (kParts + kBlockParts + 1)));
  connectPeers(c, buf, bytes, {1 - c.rank});
  cudaStream_t s;
  CUDACHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned long long* d = nullptr;
  CUDACHECK(cudaMalloc(&d, 4 * sizeof(unsigned long long)));
  unsigned long long h[2] = {0, 0};

  const char* names[] = {"signal one-way", "put8 one-way"};
  for (int mode = kSignal; mode <= kPut8; mode++) {
    for (int pass = 0; pass < 2; pass++) { /* pass 0 warms up */
      const int n = pass ? iters : 100;
      MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
      pingpongKernel<<<1, 1, 0, s>>>(c.rank, n, mode, d);
      KERNELCHECK();
      CUDACHECK(cudaStreamSynchronize(s));
      CUDACHECK(cudaMemcpy(h, d, sizeof h[0], cudaMemcpyDeviceToHost));
      if (pass && c.rank == 0) {
        const double us = h[0] / 1e3 / (2.0 * n);
        printf("%-20s %8.2f us\n", names[mode], us);
        printf("RESULT pingpong %s us=%.3f\n", mode == kSignal ? "signal" : "put8", us);
      }
    }
  }

  /* The sweep: one row per size. Rank 0's bytes are 1, rank 1's 2 (checked below). */
  uint64_t swept = 0;
  for (uint64_t n = sweepMin; n != 0 && n <= sweepMax; n *= sweepFactor) {
    const int it = n > (64 << 10) ? iters / 4 + 1 : iters;
    for (int pass = 0; pass < 2; pass++) {
      const int k = pass ? it : 20;
      MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
      if (block)
        sweepBlockKernel<<<1, 512, 0, s>>>(c.rank, k, n, kSweepA, kSweepB, d);
      else
        sweepKernel<<<1, 1, 0, s>>>(c.rank, k, n, kSweepA, kSweepB, d);
      KERNELCHECK();
      CUDACHECK(cudaStreamSynchronize(s));
      CUDACHECK(cudaMemcpy(h, d, sizeof h[0], cudaMemcpyDeviceToHost));
      if (pass && c.rank == 0) {
        const double us = h[0] / 1e3 / (2.0 * k);
        printf("%-20s %8.2f us\n", ((block ? "block put " : "put ") + std::to_string(n) + " one-way").c_str(), us);
        printf("RESULT pingpong %s bytes=%llu us=%.3f\n", block ? "putblock" : "put",
               (unsigned long long)n, us);
      }
    }
    swept = n;
  }

  /* --parts: each part's ping-pong, warm-up then timed, its signal word counting on. After
   * them each rank holds the other's last round number at kPartsAt + 8 * other. */
  uint64_t* sink = nullptr;
  CUDACHECK(cudaMalloc(&sink, sizeof(uint64_t)));
  uint64_t partRounds = 0;
  /* The thread ladder (p < kParts), then the block ladder. */
  for (int p = 0; parts && p < kParts + kBlockParts; p++) {
    const bool blockLadder = p >= kParts;
    uint64_t base = 0;
    for (int pass = 0; pass < 2; pass++) {
      const int n = pass ? iters : 100;
      MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
      if (blockLadder)
        launchBlockPart(p - kParts, c.rank, n, base, d, sink, s);
      else
        launchPart(p, c.rank, n, base, d, sink, s);
      KERNELCHECK();
      CUDACHECK(cudaStreamSynchronize(s));
      base += n;
      CUDACHECK(cudaMemcpy(h, d, sizeof h[0], cudaMemcpyDeviceToHost));
      if (pass && c.rank == 0) {
        const double us = h[0] / 1e3 / (2.0 * n);
        const char* name = blockLadder ? kBlockPartNames[p - kParts] : kPartNames[p];
        printf("%-20s %8.2f us\n", name, us);
        printf("RESULT %s part=%s us=%.3f\n", blockLadder ? "parts64" : "parts8", name, us);
      }
    }
    if (!blockLadder) partRounds = base;
  }

  /* Rank 0 alone from here; rank 1 only serves the signals of the push test. */
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  if (c.rank == 0) {
    for (int pass = 0; pass < 2; pass++) {
      const int n = pass ? iters : 100;
      flushKernel<<<1, 1, 0, s>>>(n, d);
      KERNELCHECK();
      CUDACHECK(cudaStreamSynchronize(s));
      CUDACHECK(cudaMemcpy(h, d, sizeof h[0], cudaMemcpyDeviceToHost));
    }
    const double us = h[0] / 1e3 / iters;
    printf("%-20s %8.2f us\n", "flush round trip", us);
    printf("RESULT fifo flush_rtt_us=%.3f\n", us);

    mscclppDevConn_t* conn = nullptr;
    MSCCLPPCHECK(mscclppGetDeviceConnection(c.comm, 1, 0, &conn));
    const uint64_t* where[] = {conn->fifo.triggerFifoTail, conn->fifo.triggerFifoHead + 1};
    const char* what[] = {"load host tail", "load tail cache"};
    const char* key[] = {"host_tail_load_ns", "dev_cache_load_ns"};
    const int loads = 1000;
    for (int k = 0; k < 2; k++) {
      loadKernel<<<1, 1, 0, s>>>(where[k], loads, d);
      KERNELCHECK();
      CUDACHECK(cudaStreamSynchronize(s));
      CUDACHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
      const double ns = (double)h[0] / loads;
      printf("%-20s %8.0f ns\n", what[k], ns);
      printf("RESULT fifo %s=%.1f\n", key[k], ns);
    }
  }
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  const int pushes = 64;
  for (int pass = 0; pass < 2; pass++) {
    if (c.rank == 0)
      pushKernel<<<1, 1, 0, s>>>(pushes, d);
    else
      waitKernel<<<1, 1, 0, s>>>(pushes);
    KERNELCHECK();
    CUDACHECK(cudaStreamSynchronize(s));
    MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  }
  if (c.rank == 0) {
    CUDACHECK(cudaMemcpy(h, d, sizeof h[0], cudaMemcpyDeviceToHost));
    const double ns = (double)h[0] / pushes;
    printf("%-20s %8.0f ns\n", "push", ns);
    printf("RESULT fifo push_ns=%.1f\n", ns);
  }

  /* After put8 both ranks hold rank 0's bytes in [0,8) and rank 1's in [8,16). */
  unsigned char got[16];
  CUDACHECK(cudaMemcpy(got, buf, 16, cudaMemcpyDeviceToHost));
  int failures = 0;
  for (int i = 0; i < 16; i++) {
    if (got[i] != (i < 8 ? 1 : 2)) {
      fprintf(stderr, "rank %d: byte %d is %d after put8, expected %d\n", c.rank, i, got[i],
              i < 8 ? 1 : 2);
      failures++;
      break;
    }
  }
  /* After the sweep rank 1 holds rank 0's bytes in [kSweepA, +largest) and rank 0 rank 1's
   * in [kSweepB, +largest). */
  if (swept != 0) {
    const uint64_t at = c.rank == 1 ? kSweepA : kSweepB;
    const unsigned char want = c.rank == 1 ? 1 : 2;
    std::vector<unsigned char> all(swept);
    CUDACHECK(cudaMemcpy(all.data(), (char*)buf + at, swept, cudaMemcpyDeviceToHost));
    for (uint64_t i = 0; i < swept; i++) {
      if (all[i] != want) {
        fprintf(stderr, "rank %d: byte %llu of the sweep's region is %d, expected %d\n", c.rank,
                (unsigned long long)i, all[i], want);
        failures++;
        break;
      }
    }
  }
  if (parts) {
    uint64_t last = 0;
    CUDACHECK(cudaMemcpy(&last, (char*)buf + kPartsAt + 8 * (1 - c.rank), 8, cudaMemcpyDeviceToHost));
    if (last != partRounds) {
      fprintf(stderr, "rank %d: --parts' last message is %llu, expected %llu\n", c.rank,
              (unsigned long long)last, (unsigned long long)partRounds);
      failures++;
    }
  }
  CUDACHECK(cudaFree(sink));
  failures += teardown(c);
  CUDACHECK(cudaFree(d));
  CUDACHECK(cudaFree(buf));
  CUDACHECK(cudaStreamDestroy(s));
  if (c.rank == 0) printf("pingpong: %s\n", failures ? "FAILED" : "PASSED");
  return failures ? 1 : 0;
}
