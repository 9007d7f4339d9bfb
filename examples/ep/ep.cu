/*
 * ep: expert-parallel dispatch and combine (the MoE low-latency shape) over the 2023 device
 * API, any number of ranks: examples/ep/ep.h says what moves where and how it is checked.
 *
 *   ep [--tokens 1,8,32,128] [--steps 1000] [--warmup 50] [--hidden 7168] [--experts 256]
 *      [--topk 8] [--blocks 64] [--stream own|legacy]  (ranks from launch_env.h)
 *
 * --stream legacy launches the kernels on the legacy default stream, as the other CUDA
 * examples do, instead of a stream of the example's own (a diagnostic of the proxied paths'
 * stall: bench/RESULTS.md, issue 44).
 *
 * Per step, on every rank (one stream; the kernel boundaries are the grid-wide barriers):
 *   prepare   (not timed) the step's tokens, routing and weights, from ep.h's generators;
 *   dispatch  blocks stride over the (token, k) pairs: each row goes to its expert's rank by
 *             putBlock() (a local copy for this rank's own experts); the last block to finish
 *             (a release/acquire count over the blocks, so its signal covers every block's
 *             puts, as the device header's contract says) puts each peer its L counts with
 *             putWithSignal(), then one thread per peer waits for that peer's;
 *   expert    (not timed) every received row scaled in place (ep.h);
 *   combine   blocks stride over the received runs and put each row back to its source
 *             rank (putBlock()); the last block signals each peer, one thread per peer waits;
 *   reduce    out[t] = the weighted sum over the token's K expert rows, in ep.h's order.
 * Dispatch time = the dispatch kernel, combine time = combine + reduce (CUDA events on this
 * rank's stream; waiting for the slowest peer is part of both, as in every EP benchmark).
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
 */
#include "common.cuh"
#include "ep.h"

#include <algorithm>
#include <cmath>
#include <string>

using ep::bf16;
using ep::Shape;

#define EP_MAX_EXPERTS 512
#define EP_MAX_TOKENS 128

struct Step {
  Shape s;
  int me;
  int T;
  uint32_t step;
  int q;
  uint8_t* buf;       /* this rank's connected buffer (ep.h's layout) */
  int* idx;           /* [T][K] experts */
  float* w;           /* [T][K] weights */
  int* slots;         /* [T][K] slots, written by dispatch for reduce */
  bf16* out;          /* [T][H] */
  unsigned int* done; /* [2] block counts of dispatch and combine; they only grow */
  unsigned int base;  /* the counts before this step's launches */
  unsigned long long* ops; /* operations issued to peers (puts and signals), for the report */
};

/* The connection to `peer` in gConns (connectPeers() takes the peers in rank order). */
__device__ __forceinline__ const mscclppDevConn_t& connTo(int peer, int me)
{
  return gConns[peer < me ? peer : peer - 1];
}

/* Copies `bytes` (a multiple of 16) by the block, 16 bytes per thread per pass. */
__device__ __forceinline__ void blockCopy(uint8_t* dst, const uint8_t* src, uint64_t bytes)
{
  for (uint64_t i = threadIdx.x * 16ull; i < bytes; i += blockDim.x * 16ull)
    *reinterpret_cast<int4*>(dst + i) = *reinterpret_cast<const int4*>(src + i);
}

__global__ void prepareKernel(Step a)
{
  const Shape s = a.s;
  const uint64_t n = (uint64_t)a.T * s.H;
  bf16* x = reinterpret_cast<bf16*>(a.buf + s.x(0));
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x)
    x[i] = ep::token(a.me, (int)(i / s.H), (int)(i % s.H), a.step);
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < (uint64_t)a.T * s.K;
       i += (uint64_t)gridDim.x * blockDim.x) {
    const int t = (int)(i / s.K), k = (int)(i % s.K);
    a.idx[i] = ep::expertOf(s, a.me, t, k, a.step);
    a.w[i] = ep::weightOf(a.me, t, k, a.step);
  }
}

/* Bit t of masks[e] is set when token t chose expert e: the slot of (t, e) is the number of
 * bits below t. Built by the block in shared memory. */
__device__ void buildMasks(const Step& a, uint32_t (*masks)[EP_MAX_TOKENS / 32])
{
  for (int i = threadIdx.x; i < a.s.E * (EP_MAX_TOKENS / 32); i += blockDim.x)
    (&masks[0][0])[i] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < a.T * a.s.K; i += blockDim.x)
    atomicOr(&masks[a.idx[i]][(i / a.s.K) >> 5], 1u << ((i / a.s.K) & 31));
  __syncthreads();
}

__device__ __forceinline__ int slotIn(const uint32_t* mask, int t)
{
  int n = 0;
  for (int w = 0; w < (t >> 5); w++) n += __popc(mask[w]);
  return n + __popc(mask[t >> 5] & ((1u << (t & 31)) - 1u));
}

/* True in the block that finished last of the launch's gridDim.x blocks on counter `c`:
 * each block's puts (its threads', ordered by the barrier) are released by its first
 * thread's fence before the add, and the last block's first thread acquires them all by its
 * fence after reading the count; the barrier hands that on to the block. So a signal() of the
 * last block covers every block's puts. */
__device__ bool lastBlock(unsigned int* c, unsigned int base)
{
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(c, 1u) == base + gridDim.x - 1;
    if (last) __threadfence();
  }
  __syncthreads();
  return last;
}

__global__ void __launch_bounds__(512) dispatchKernel(Step a)
{
  __shared__ uint32_t masks[EP_MAX_EXPERTS][EP_MAX_TOKENS / 32];
  const Shape s = a.s;
  const int L = s.L();
  buildMasks(a, masks);
  for (int i = blockIdx.x; i < a.T * s.K; i += gridDim.x) {
    const int t = i / s.K, e = a.idx[i], dst = e / L, l = e % L;
    const int slot = slotIn(masks[e], t);
    if (threadIdx.x == 0) a.slots[i] = slot;
    const uint64_t to = s.dr(a.q, a.me, l, slot);
    if (dst == a.me)
      blockCopy(a.buf + to, a.buf + s.x(t), s.row());
    else {
      connTo(dst, a.me).putBlock(to, s.x(t), s.row());
      if (threadIdx.x == 0) atomicAdd(a.ops, 1ull);
    }
  }
  if (!lastBlock(&a.done[0], a.base)) return;
  /* The counts: ours to ourselves in place, the peers' staged (the puts' source). */
  for (int i = threadIdx.x; i < s.R * L; i += blockDim.x) {
    const int dst = i / L, l = i % L;
    uint32_t n = 0;
    for (int w = 0; w < EP_MAX_TOKENS / 32; w++) n += __popc(masks[i][w]);
    const uint64_t at = dst == a.me ? s.dc(a.q, a.me) : s.sc(a.q, dst);
    reinterpret_cast<uint32_t*>(a.buf + at)[l] = n;
  }
  __syncthreads(); /* the staged counts before the puts that read them */
  for (int p = threadIdx.x; p < s.R; p += blockDim.x)
    if (p != a.me) {
      connTo(p, a.me).putWithSignal(s.dc(a.q, a.me), s.sc(a.q, p), (uint64_t)L * 4);
      atomicAdd(a.ops, 1ull);
    }
  for (int p = threadIdx.x; p < s.R; p += blockDim.x)
    if (p != a.me) connTo(p, a.me).wait();
}

/* Block j scales the rows of run j = (src, l) in place. */
__global__ void expertKernel(Step a)
{
  const Shape s = a.s;
  const int L = s.L();
  for (int j = blockIdx.x; j < s.R * L; j += gridDim.x) {
    const int src = j / L, l = j % L, e = a.me * L + l;
    const uint32_t n = reinterpret_cast<const uint32_t*>(a.buf + s.dc(a.q, src))[l];
    for (uint32_t slot = 0; slot < n; slot++) {
      bf16* row = reinterpret_cast<bf16*>(a.buf + s.dr(a.q, src, l, (int)slot));
      for (int h = threadIdx.x; h < s.H; h += blockDim.x) row[h] = ep::expertValue(row[h], e);
    }
  }
}

__global__ void __launch_bounds__(512) combineKernel(Step a)
{
  /* The received rows as one list, run j = (src, l) after run j - 1: an inclusive scan of the
   * counts (one per thread, blockDim.x = 512 >= runs) gives each run's first row, and block b
   * takes rows b, b + gridDim.x, ... (runs differ in length; a loop over runs that read each
   * count in turn cost each block a global load's latency per run, 256 of them). */
  __shared__ uint32_t scan[2][EP_MAX_EXPERTS];
  const Shape s = a.s;
  const int L = s.L(), runs = s.R * L, tid = threadIdx.x;
  scan[0][tid] = tid < runs ? reinterpret_cast<const uint32_t*>(a.buf + s.dc(a.q, tid / L))[tid % L] : 0;
  int in = 0;
  for (int off = 1; off < runs; off <<= 1) {
    __syncthreads();
    scan[1 - in][tid] = scan[in][tid] + (tid >= off ? scan[in][tid - off] : 0);
    in = 1 - in;
  }
  __syncthreads();
  const uint32_t* end = scan[in]; /* end[j]: rows of runs 0..j */
  const uint32_t total = end[runs - 1];
  for (uint32_t r = blockIdx.x; r < total; r += gridDim.x) {
    int lo = 0, hi = runs - 1; /* the first run whose end is past r */
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (end[mid] > r) hi = mid;
      else lo = mid + 1;
    }
    const int src = lo / L, l = lo % L, slot = (int)(r - (lo ? end[lo - 1] : 0));
    const uint64_t from = s.dr(a.q, src, l, slot), to = s.cr(a.q, a.me, l, slot);
    if (src == a.me)
      blockCopy(a.buf + to, a.buf + from, s.row());
    else {
      connTo(src, a.me).putBlock(to, from, s.row());
      if (threadIdx.x == 0) atomicAdd(a.ops, 1ull);
    }
  }
  if (!lastBlock(&a.done[1], a.base)) return;
  for (int p = threadIdx.x; p < s.R; p += blockDim.x)
    if (p != a.me) {
      connTo(p, a.me).signal();
      atomicAdd(a.ops, 1ull);
    }
  for (int p = threadIdx.x; p < s.R; p += blockDim.x)
    if (p != a.me) connTo(p, a.me).wait();
}

/* Block (c, t): 16-byte word c * blockDim.x + threadIdx.x of token t's output (ep.h's
 * combineWord, the NVSHMEM peer's reduce too). (One block per token reading 2 bytes per load
 * made the first GPU run's combine 2.3-2.6x the peer's.) */
#define EP_REDUCE_THREADS 128
__global__ void __launch_bounds__(EP_REDUCE_THREADS) reduceKernel(Step a)
{
  __shared__ uint64_t off[16];
  __shared__ float wk[16];
  const Shape s = a.s;
  const int t = blockIdx.y, K = s.K, L = s.L(), V = s.H / 8;
  if ((int)threadIdx.x < K) {
    const int k = threadIdx.x, e = a.idx[t * K + k];
    off[k] = s.cr(a.q, e / L, e % L, a.slots[t * K + k]);
    wk[k] = a.w[t * K + k];
  }
  __syncthreads();
  const int v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v < V) reinterpret_cast<int4*>(a.out)[(uint64_t)t * V + v] = ep::combineWord(K, wk, a.buf, off, v);
}

/* The host's check of one step (ep.h), reading the device buffer. */
static uint64_t checkStep(const Step& a)
{
  std::vector<bf16> out((size_t)a.T * a.s.H);
  CUDACHECK(cudaMemcpy(out.data(), a.out, out.size() * 2, cudaMemcpyDeviceToHost));
  auto read = [&](uint64_t off, void* dst, uint64_t bytes) {
    CUDACHECK(cudaMemcpy(dst, a.buf + off, bytes, cudaMemcpyDeviceToHost));
  };
  return ep::checkStep(a.s, a.me, a.T, a.step, a.q, read, out.data());
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
  int steps = 1000, warmup = 50, blocks = 64;
  bool legacyStream = false;
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
    else if (k == "--stream" && (strcmp(v, "legacy") == 0 || strcmp(v, "own") == 0))
      legacyStream = strcmp(v, "legacy") == 0;
    else {
      fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  for (int t : tokens) s.Tmax = std::max(s.Tmax, t);
  if (s.E % s.R || s.E > EP_MAX_EXPERTS || s.Tmax < 1 || s.Tmax > EP_MAX_TOKENS || s.K < 1 ||
      s.K > 16 || s.K > s.E || s.H % 8 || steps < 1) {
    fprintf(stderr, "ep: experts %d must divide by ranks %d and be at most %d, tokens 1..%d, "
                    "topk 1..16, hidden a multiple of 8\n",
            s.E, s.R, EP_MAX_EXPERTS, EP_MAX_TOKENS);
    return 2;
  }
  /* Every kernel loaded before the first one runs. Under CUDA's lazy loading (the default on
   * Linux since CUDA 12.2: CUDA_MODULE_LOADING) a kernel's first launch may load its module,
   * and a load may synchronize the context: the host's first launch of the expert kernel would
   * wait for this rank's dispatch kernel, which waits for its peer's signal, which the peer's
   * proxy can send only once its own copies run in a context as stuck (the CUDA Programming
   * Guide, "Lazy Loading"; the suspected cause of the proxied runs' stall, bench/RESULTS.md
   * issue 44, not yet confirmed). cudaFuncGetAttributes loads a kernel without running it. */
  {
    cudaFuncAttributes fa;
    CUDACHECK(cudaFuncGetAttributes(&fa, prepareKernel));
    CUDACHECK(cudaFuncGetAttributes(&fa, dispatchKernel));
    CUDACHECK(cudaFuncGetAttributes(&fa, expertKernel));
    CUDACHECK(cudaFuncGetAttributes(&fa, combineKernel));
    CUDACHECK(cudaFuncGetAttributes(&fa, reduceKernel));
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
  CUDACHECK(cudaMalloc(&a.idx, EP_MAX_TOKENS * 16 * sizeof(int)));
  CUDACHECK(cudaMalloc(&a.w, EP_MAX_TOKENS * 16 * sizeof(float)));
  CUDACHECK(cudaMalloc(&a.slots, EP_MAX_TOKENS * 16 * sizeof(int)));
  CUDACHECK(cudaMalloc(&a.out, (size_t)s.Tmax * s.H * 2));
  CUDACHECK(cudaMalloc(&a.done, 2 * sizeof(unsigned int)));
  CUDACHECK(cudaMemset(a.done, 0, 2 * sizeof(unsigned int)));
  CUDACHECK(cudaMalloc(&a.ops, sizeof(unsigned long long)));
  CUDACHECK(cudaMemset(a.ops, 0, sizeof(unsigned long long)));
  /* Per timed step: before dispatch, after it, after the expert, after reduce. */
  std::vector<cudaEvent_t> ev(4 * (size_t)steps);
  for (auto& e : ev) CUDACHECK(cudaEventCreate(&e));
  const uint64_t pushed0 = triggersPushed(c);
  uint64_t wrong = 0;
  uint32_t step = 0;
  int failures = 0;
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  for (int T : tokens) {
    a.T = T;
    std::vector<float> dispatchMs, combineMs;
    for (int i = 0; i < warmup + steps; i++, step++) {
      a.step = step;
      a.q = step & 1;
      const bool timed = i >= warmup;
      const int j = i - warmup;
      prepareKernel<<<64, 256, 0, st>>>(a);
      if (timed) CUDACHECK(cudaEventRecord(ev[4 * j], st));
      a.base = (unsigned int)(step * (uint32_t)blocks);
      dispatchKernel<<<blocks, 512, 0, st>>>(a);
      if (timed) CUDACHECK(cudaEventRecord(ev[4 * j + 1], st));
      expertKernel<<<std::min(s.R * s.L(), 1024), 256, 0, st>>>(a);
      if (timed) CUDACHECK(cudaEventRecord(ev[4 * j + 2], st));
      combineKernel<<<blocks, 512, 0, st>>>(a);
      reduceKernel<<<dim3((s.H / 8 + EP_REDUCE_THREADS - 1) / EP_REDUCE_THREADS, T), EP_REDUCE_THREADS, 0, st>>>(a);
      if (timed) CUDACHECK(cudaEventRecord(ev[4 * j + 3], st));
      KERNELCHECK();
      if (i < 2 || i == warmup + steps - 1) {
        CUDACHECK(cudaStreamSynchronize(st));
        const uint64_t w = checkStep(a);
        wrong += w;
        if (w) failures++;
      }
    }
    CUDACHECK(cudaStreamSynchronize(st));
    for (int j = 0; j < steps; j++) {
      float d = 0, cb = 0;
      CUDACHECK(cudaEventElapsedTime(&d, ev[4 * j], ev[4 * j + 1]));
      CUDACHECK(cudaEventElapsedTime(&cb, ev[4 * j + 2], ev[4 * j + 3]));
      dispatchMs.push_back(d);
      combineMs.push_back(cb);
    }
    if (c.rank == 0)
      printf("RESULT ep impl=mscclpp ranks=%d tokens=%d hidden=%d experts=%d topk=%d steps=%d "
             "dispatch_med_us=%.2f dispatch_p99_us=%.2f combine_med_us=%.2f combine_p99_us=%.2f "
             "wrong=%llu\n",
             c.nranks, T, s.H, s.E, s.K, steps, percentile(dispatchMs, 0.5),
             percentile(dispatchMs, 0.99), percentile(combineMs, 0.5), percentile(combineMs, 0.99),
             (unsigned long long)wrong);
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
