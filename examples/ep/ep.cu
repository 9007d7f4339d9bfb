/*
 * ep: expert-parallel dispatch and combine (the MoE low-latency shape) over the 2023 device
 * API, any number of ranks: examples/ep/ep.h says what moves where and how it is checked.
 *
 *   ep [--tokens 1,8,32,128] [--steps 1000] [--warmup 50] [--hidden 7168] [--experts 256]
 *      [--topk 8] [--blocks 64] [--chunk-rows 0] [--fuse-tokens 1] [--stamps no|yes]
 *      [--stream own|legacy] [--preload yes|no]
 *      (ranks from launch_env.h)
 *
 * --chunk-rows N caps the rows of a chunk cut by an even share (ep_kernels.cuh: the in-place
 * chunks, this rank's own, and dispatch's gathering of packed rows) at N; 0, the default,
 * leaves them an even share of all rows over the blocks.
 *
 * --fuse-tokens N: a step of at most N tokens (0..8) has its weighted sums done by combine's
 * last block after its waits, and no reduce kernel launched (1 by default: at 2 tokens the one
 * block's sums cost more than the launch they save; bench/RESULTS.md, issue 44).
 *
 * --stamps yes also times each kernel's phases (%globaltimer in the kernels: the first block's
 * entry, every put issued, the signals issued, the waits returned) and prints, on every rank,
 * a RESULT ep_phases line (ep.h's printPhases; combine's "outside" holds a fused reduce). The
 * stamps cost a barrier each in the last block; off by default.
 *
 * --stream legacy launches the kernels on the legacy default stream instead of a stream of
 * the example's own; --preload no leaves the kernels to CUDA's lazy loading (diagnostics of
 * the proxied paths' stall: bench/RESULTS.md, issue 44).
 *
 * Per step, on every rank (one stream; the kernel boundaries are the grid-wide barriers):
 *   prepare   (not timed) the step's tokens, routing and weights, from ep.h's generators;
 *   dispatch  the blocks take chunks of every peer's rows: each row goes to its place in its
 *             expert's rank's DR, in place by putBlock() or packed for one put per peer
 *             (ep_kernels.cuh says which when), and each peer its L counts (by one block,
 *             before its rows, where they land directly); the last block to
 *             finish (a release/acquire count over the blocks, so its signal covers every
 *             block's puts, as the device header's contract says) sends each peer one
 *             signal() (or, packed, the rows' put and the counts' putWithSignal()), then one
 *             thread per peer waits for that peer's;
 *   expert    (not timed) every received row scaled in place (ep.h);
 *   combine   the received rows back to their source ranks, each source's as one range: in
 *             place in even chunks over the blocks, or one put per peer; the last block
 *             signals each peer, one thread per peer waits;
 *   reduce    out[t] = the weighted sum over the token's K expert rows, in ep.h's order (by
 *             combine's last block instead where T <= --fuse-tokens).
 * Dispatch time = the dispatch kernel, combine time = combine + reduce, each of the two also
 * alone (combine_kernel_med_us, reduce_med_us: where combine's time goes; with the reduce
 * fused, reduce_med_us is two events with nothing between them, about 3 us on an H200) (CUDA
 * events on this rank's stream; waiting for the slowest peer is part of both, as in every EP
 * benchmark).
 * The paths: by default the direct path (P2P stores) where the library allows it;
 * MSCCLPP_P2P_DIRECT_BYTES=0 MSCCLPP_P2P_DIRECT_BLOCK_BYTES=0 sends every put and signal
 * through the proxy (copy engines, or the SM engine with MSCCLPP_P2P_SM_ENGINE);
 * MSCCLPP_EXAMPLE_TRANSPORT=ib the network path (libfabric). Each rank prints how many of its
 * operations went through the proxy (its FIFO's triggers) against the number it issued.
 * Checked: the first two steps and the last of each token count, every received row after the
 * expert, every count and every output value bit for bit against ep.h's reference; any wrong
 * value fails the run (exit 1). Rank 0 prints, per token count:
 *   RESULT ep impl=mscclpp ranks=R tokens=T hidden=H experts=E topk=K steps=N
 *          dispatch_med_us=.. dispatch_p99_us=.. combine_med_us=.. combine_p99_us=.. wrong=0
 *          combine_kernel_med_us=.. reduce_med_us=.. expert_med_us=.. gpus=G
 * (expert_med_us: the untimed expert kernel, each rank's combine waits for its slowest peer's
 * to end; gpus: the GPUs the ranks are spread over, rank r on GPU local rank % GPUs).
 */
#include "common.cuh"
#include "ep.h"
#include "ep_kernels.cuh"

#include <algorithm>
#include <cmath>
#include <string>

using ep::bf16;
using ep::Shape;
using ep::Step;

/* The step's tokens (in X of the buffer), routing and weights (ep.h's generators). */
__global__ void prepareKernel(Step a, uint32_t step, int* idx, float* w)
{
  const Shape s = a.s;
  const uint64_t n = (uint64_t)a.T * s.H;
  bf16* x = reinterpret_cast<bf16*>(a.buf + s.x(0));
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x)
    x[i] = ep::token(a.me, (int)(i / s.H), (int)(i % s.H), step);
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < (uint64_t)a.T * s.K;
       i += (uint64_t)gridDim.x * blockDim.x) {
    const int t = (int)(i / s.K), k = (int)(i % s.K);
    idx[i] = ep::expertOf(s, a.me, t, k, step);
    w[i] = ep::weightOf(a.me, t, k, step);
  }
}

/* The host's check of one step (ep.h), reading the device buffer. */
static uint64_t checkStep(const Step& a, uint32_t step)
{
  std::vector<bf16> out((size_t)a.T * a.s.H);
  CUDACHECK(cudaMemcpy(out.data(), a.out, out.size() * 2, cudaMemcpyDeviceToHost));
  auto read = [&](uint64_t off, void* dst, uint64_t bytes) {
    CUDACHECK(cudaMemcpy(dst, a.buf + off, bytes, cudaMemcpyDeviceToHost));
  };
  return ep::checkStepInBuffer(a.s, a.me, a.T, step, a.q, read, out.data());
}

static double percentile(std::vector<float> v, double p)
{
  std::sort(v.begin(), v.end());
  size_t i = (size_t)std::ceil(p * v.size());
  return v[i == 0 ? 0 : i - 1] * 1000.0; /* ms to us */
}

/* Triggers pushed so far into this rank's FIFOs (each connection's head word). */
static uint64_t triggersPushed(const Ctx& c)
{
  mscclppDevConn_t* conns = nullptr;
  int n = 0;
  MSCCLPPCHECK(mscclppGetAllDeviceConnections(c.comm, &conns, &n));
  uint64_t total = 0;
  std::vector<const void*> seen;
  for (int i = 0; i < n; i++) {
    const uint64_t* head = conns[i].fifo.triggerFifoHead;
    if (std::find(seen.begin(), seen.end(), (const void*)head) != seen.end()) continue;
    seen.push_back(head);
    uint64_t v = 0;
    CUDACHECK(cudaMemcpy(&v, head, 8, cudaMemcpyDefault));
    total += v;
  }
  return total;
}

int main(int argc, char** argv)
{
  Ctx c;
  setupRank(c, &argc, argv);
  std::vector<int> tokens = {1, 8, 32, 128};
  int steps = 1000, warmup = 50, blocks = 64, chunkRows = 0, fuseTokens = 1;
  bool legacyStream = false, preload = true, stamps = false;
  Shape s{c.nranks, 256, 8, 7168, 0};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--tokens") {
      if (!ep::parseTokens(v, tokens)) {
        fprintf(stderr, "--tokens %s: expected numbers separated by commas\n", v);
        return 2;
      }
    } else if (k == "--steps") steps = atoi(v);
    else if (k == "--warmup") warmup = atoi(v);
    else if (k == "--hidden") s.H = atoi(v);
    else if (k == "--experts") s.E = atoi(v);
    else if (k == "--topk") s.K = atoi(v);
    else if (k == "--blocks") blocks = atoi(v);
    else if (k == "--chunk-rows") chunkRows = atoi(v);
    else if (k == "--fuse-tokens") fuseTokens = atoi(v);
    else if (k == "--stream" && (strcmp(v, "legacy") == 0 || strcmp(v, "own") == 0))
      legacyStream = strcmp(v, "legacy") == 0;
    else if (k == "--preload" && (strcmp(v, "yes") == 0 || strcmp(v, "no") == 0))
      preload = strcmp(v, "yes") == 0;
    else if (k == "--stamps" && (strcmp(v, "yes") == 0 || strcmp(v, "no") == 0))
      stamps = strcmp(v, "yes") == 0;
    else {
      fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  int fewest = EP_MAX_TOKENS;
  for (int t : tokens) {
    s.Tmax = std::max(s.Tmax, t);
    fewest = std::min(fewest, t);
  }
  if (s.E % s.R || s.E > EP_MAX_EXPERTS || fewest < 1 || s.Tmax > EP_MAX_TOKENS || s.K < 1 ||
      s.K > 16 || s.K > s.E || s.H < 8 || s.H % 8 || steps < 1 || warmup < 0 || blocks < 1 || chunkRows < 0 ||
      fuseTokens < 0 || fuseTokens > EP_FUSE_MAX_TOKENS) {
    fprintf(stderr, "ep: experts %d must divide by ranks %d and be at most %d, tokens 1..%d, "
                    "topk 1..16, hidden a positive multiple of 8, steps and blocks at least 1, chunk rows "
                    "at least 0, fuse tokens 0..%d\n",
            s.E, s.R, EP_MAX_EXPERTS, EP_MAX_TOKENS, EP_FUSE_MAX_TOKENS);
    return 2;
  }
  /* Every kernel loaded before the first one runs (unless --preload no, the diagnostic).
   * Under CUDA's lazy loading (the default on Linux since CUDA 12.2: CUDA_MODULE_LOADING) a
   * kernel's first launch may load its module,
   * and a load may synchronize the context: the host's first launch of the expert kernel would
   * wait for this rank's dispatch kernel, which waits for its peer's signal, which the peer's
   * proxy can send only once its own copies run in a context as stuck (the CUDA Programming
   * Guide, "Lazy Loading"; the proxied runs' stall, bench/RESULTS.md issue 44).
   * cudaFuncGetAttributes loads a kernel without running it. */
  if (preload) {
    cudaFuncAttributes fa;
    CUDACHECK(cudaFuncGetAttributes(&fa, prepareKernel));
    CUDACHECK(cudaFuncGetAttributes(&fa, ep::dispatchKernel));
    CUDACHECK(cudaFuncGetAttributes(&fa, ep::expertKernel));
    CUDACHECK(cudaFuncGetAttributes(&fa, ep::combineKernel));
    CUDACHECK(cudaFuncGetAttributes(&fa, ep::reduceKernel));
  }
  /* The kernels' stream, made before the library makes its own (connection setup): CUDA hands
   * its hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS) to streams round-robin in creation
   * order, and a copy stream that shared the kernels' queue would run only after the kernel
   * that waits for it (bench/RESULTS.md, "Hardware work queues"). */
  cudaStream_t st = cudaStreamLegacy;
  if (!legacyStream) CUDACHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  uint8_t* buf = nullptr;
  CUDACHECK(cudaMalloc(&buf, s.bytes()));
  CUDACHECK(cudaMemset(buf, 0, s.bytes()));
  std::vector<int> peers;
  for (int p = 0; p < c.nranks; p++)
    if (p != c.rank) peers.push_back(p);
  connectPeers(c, buf, s.bytes(), peers);
  Step a{};
  a.s = s;
  a.me = c.rank;
  a.buf = buf;
  a.chunkRows = (uint32_t)chunkRows;
  a.fuseTokens = fuseTokens;
#ifdef EP_SIGNAL_CLOCKS
  CUDACHECK(cudaMalloc(&a.clocks, 8 * sizeof(unsigned long long)));
  int clockKHz = 0;
  CUDACHECK(cudaDeviceGetAttribute(&clockKHz, cudaDevAttrClockRate, c.device));
#endif
  unsigned long long* stampsDev = nullptr;
  if (stamps) CUDACHECK(cudaMalloc(&stampsDev, (size_t)steps * ep::kStamps * sizeof(unsigned long long)));
  int* idx = nullptr;
  float* w = nullptr;
  CUDACHECK(cudaMalloc(&idx, EP_MAX_TOKENS * 16 * sizeof(int)));
  CUDACHECK(cudaMalloc(&w, EP_MAX_TOKENS * 16 * sizeof(float)));
  a.idx = idx;
  a.w = w;
  CUDACHECK(cudaMalloc(&a.rows, EP_MAX_TOKENS * 16 * sizeof(int)));
  CUDACHECK(cudaGetSymbolAddress((void**)&a.conns, gConns));
  CUDACHECK(cudaMalloc(&a.out, (size_t)s.Tmax * s.H * 2));
  CUDACHECK(cudaMalloc(&a.done, 2 * sizeof(unsigned int)));
  CUDACHECK(cudaMemset(a.done, 0, 2 * sizeof(unsigned int)));
  CUDACHECK(cudaMalloc(&a.ops, sizeof(unsigned long long)));
  CUDACHECK(cudaMemset(a.ops, 0, sizeof(unsigned long long)));
  /* Per timed step: before dispatch, after it, after the expert, after combine, after reduce. */
  std::vector<cudaEvent_t> ev(5 * (size_t)steps);
  for (auto& e : ev) CUDACHECK(cudaEventCreate(&e));
  const uint64_t pushed0 = triggersPushed(c);
  uint64_t wrong = 0;
  uint32_t step = 0;
  int failures = 0;
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  for (int T : tokens) {
    a.T = T;
    std::vector<float> dispatchMs, combineMs, combineKernelMs, reduceMs, expertMs;
#ifdef EP_SIGNAL_CLOCKS
    CUDACHECK(cudaMemsetAsync(a.clocks, 0, 8 * sizeof(unsigned long long), st)); /* the kernels' stream */
#endif
    /* Every entry stamp starts at the largest value (the blocks keep the earliest); on the
     * kernels' stream, which does not wait for the legacy one. */
    if (stamps)
      CUDACHECK(cudaMemsetAsync(stampsDev, 0xff, (size_t)steps * ep::kStamps * sizeof(unsigned long long), st));
    for (int i = 0; i < warmup + steps; i++, step++) {
      a.q = step & 1;
      const bool timed = i >= warmup;
      const int j = i - warmup;
      a.stamps = stamps && timed ? stampsDev + (size_t)j * ep::kStamps : nullptr;
      prepareKernel<<<64, 256, 0, st>>>(a, step, idx, w);
      if (timed) CUDACHECK(cudaEventRecord(ev[5 * j], st));
      a.base = (unsigned int)(step * (uint32_t)blocks);
      ep::dispatchKernel<<<blocks, EP_THREADS, 0, st>>>(a);
      if (timed) CUDACHECK(cudaEventRecord(ev[5 * j + 1], st));
      ep::expertKernel<<<s.E, EP_THREADS, 0, st>>>(a); /* a block per run */
      if (timed) CUDACHECK(cudaEventRecord(ev[5 * j + 2], st));
      ep::combineKernel<<<blocks, EP_THREADS, 0, st>>>(a);
      if (timed) CUDACHECK(cudaEventRecord(ev[5 * j + 3], st));
      if (T > fuseTokens)
        ep::reduceKernel<<<dim3((s.H / 8 + EP_REDUCE_THREADS - 1) / EP_REDUCE_THREADS, T), EP_REDUCE_THREADS, 0, st>>>(a);
      if (timed) CUDACHECK(cudaEventRecord(ev[5 * j + 4], st));
      KERNELCHECK();
      if (i < 2 || i == warmup + steps - 1) {
        CUDACHECK(cudaStreamSynchronize(st));
        const uint64_t bad = checkStep(a, step);
        wrong += bad;
        if (bad) failures++;
      }
    }
    CUDACHECK(cudaStreamSynchronize(st));
    for (int j = 0; j < steps; j++) {
      float d = 0, cb = 0, ck = 0, rd = 0, ex = 0;
      CUDACHECK(cudaEventElapsedTime(&d, ev[5 * j], ev[5 * j + 1]));
      CUDACHECK(cudaEventElapsedTime(&ex, ev[5 * j + 1], ev[5 * j + 2]));
      CUDACHECK(cudaEventElapsedTime(&cb, ev[5 * j + 2], ev[5 * j + 4]));
      CUDACHECK(cudaEventElapsedTime(&ck, ev[5 * j + 2], ev[5 * j + 3]));
      CUDACHECK(cudaEventElapsedTime(&rd, ev[5 * j + 3], ev[5 * j + 4]));
      dispatchMs.push_back(d);
      combineMs.push_back(cb);
      combineKernelMs.push_back(ck);
      reduceMs.push_back(rd);
      expertMs.push_back(ex);
    }
    if (c.rank == 0)
      printf("RESULT ep impl=mscclpp ranks=%d tokens=%d hidden=%d experts=%d topk=%d steps=%d "
             "dispatch_med_us=%.2f dispatch_p99_us=%.2f combine_med_us=%.2f combine_p99_us=%.2f "
             "wrong=%llu combine_kernel_med_us=%.2f reduce_med_us=%.2f expert_med_us=%.2f gpus=%d\n",
             c.nranks, T, s.H, s.E, s.K, steps, percentile(dispatchMs, 0.5),
             percentile(dispatchMs, 0.99), percentile(combineMs, 0.5), percentile(combineMs, 0.99),
             (unsigned long long)wrong, percentile(combineKernelMs, 0.5), percentile(reduceMs, 0.5),
             percentile(expertMs, 0.5), std::min(c.nranks, c.ndevices));
#ifdef EP_SIGNAL_CLOCKS
    {
      unsigned long long k[8];
      CUDACHECK(cudaMemcpy(k, a.clocks, sizeof k, cudaMemcpyDeviceToHost));
      auto us = [&](int at, int i) { return k[at + 3] ? (double)k[at + i] / k[at + 3] / clockKHz * 1000.0 : 0.0; };
      printf("RESULT ep_clocks rank=%d tokens=%d clock_khz=%d dispatch_signal_us=%.3f dispatch_fence1_us=%.3f "
             "dispatch_fence2_us=%.3f combine_signal_us=%.3f combine_fence1_us=%.3f combine_fence2_us=%.3f n=%llu/%llu\n",
             c.rank, T, clockKHz, us(0, 0), us(0, 1), us(0, 2), us(4, 0), us(4, 1), us(4, 2), k[3], k[7]);
    }
#endif
    if (stamps) {
      /* Where each kernel's time went (ep.h's printPhases), this rank's. */
      std::vector<unsigned long long> t((size_t)steps * ep::kStamps);
      CUDACHECK(cudaMemcpy(t.data(), stampsDev, t.size() * sizeof t[0], cudaMemcpyDeviceToHost));
      ep::printPhases("mscclpp", c.nranks, T, c.rank, steps, t, dispatchMs, combineKernelMs);
    }
    fflush(stdout);
  }
  const uint64_t proxied = triggersPushed(c) - pushed0;
  unsigned long long issued = 0;
  CUDACHECK(cudaMemcpy(&issued, a.ops, sizeof issued, cudaMemcpyDeviceToHost));
  printf("rank %d: operations issued to peers %llu, through the proxy %llu (%s), checked values "
         "wrong %llu\n",
         c.rank, (unsigned long long)issued, (unsigned long long)proxied,
         proxied == 0 ? "all direct" : proxied >= issued ? "all proxied" : "mixed",
         (unsigned long long)wrong);
  failures += teardown(c);
  if (failures == 0 && c.rank == 0) printf("ep: ok\n");
  return failures ? 1 : 0;
}
