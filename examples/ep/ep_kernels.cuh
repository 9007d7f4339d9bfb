/*
 * ep_kernels.cuh: the kernels of the expert-parallel example over the 2023 device API, shared
 * by the C++ driver (ep.cu) and the Python one (ep_torch.py, built there by torch's
 * load_inline). examples/ep/ep.h says what moves where; this file how, on the GPU. Needs
 * mscclpp.h and ep.h first. In step order: dispatchKernel, expertKernel (the stand-in for the
 * experts' MLP, untimed), combineKernel, reduceKernel.
 *
 * Per peer the kernels pick one of two ways by DevConn::putsDirect() (read once per block;
 * it does not change while a kernel runs):
 *   in place  the peer's memory is written directly (P2P with the direct path): dispatch puts
 *             each row by one block (putBlock()) straight to its place in the peer's DR (the
 *             rows of a run come from scattered tokens); combine puts the peer's range back in
 *             chunks of about total / gridDim.x rows.
 *   packed    every put is a trigger for the proxy (P2P forced through the copy engines or the
 *             SM engine, IB, SHM): one trigger per row would cost the proxy's per-operation
 *             time for each (7 ms a step at 128 tokens, bench/RESULTS.md issue 44), so
 *             dispatch packs the peer's rows into this rank's SR[peer], in DR's order, and puts
 *             them in one operation; combine's rows for a peer are already one range (DR[src])
 *             and go in one put.
 * Then the counts with putWithSignal() (dispatch) or a signal() (combine) per peer, which
 * covers the rows before it, and a wait() per peer.
 *
 * Launch: dispatch, expert and combine with blockDim.x = EP_THREADS (the scans give each thread one
 * expert or run: E <= EP_MAX_EXPERTS = EP_THREADS), any grid; the grid must fit on the GPU at
 * once (its last block waits for the peers). reduce with blockDim.x = EP_REDUCE_THREADS and
 * grid (ceil(H / 8 / EP_REDUCE_THREADS), T).
 */
#ifndef MSCCLPP_EXAMPLES_EP_KERNELS_CUH
#define MSCCLPP_EXAMPLES_EP_KERNELS_CUH

#define EP_THREADS 512
#define EP_MAX_EXPERTS 512
#define EP_MAX_TOKENS 128
#define EP_REDUCE_THREADS 128

namespace ep {

/* What the kernels of one step get. */
struct Step {
  Shape s;
  int me;
  int T;
  int q;                        /* the step's parity (ep.h) */
  uint8_t* buf;                 /* this rank's connected buffer (ep.h's layout) */
  const mscclppDevConn_t* conns; /* to the peers in rank order, this rank left out */
  const int* idx;               /* [T][K] experts */
  const float* w;               /* [T][K] weights */
  int* rows;                    /* [T][K] the row of each (token, k) in its rank's DR[me] (dispatch), for reduce */
  bf16* out;                    /* [T][H] */
  unsigned int* done;           /* [2] block counts of dispatch and combine; they only grow */
  unsigned int base;            /* done's values before this step's launches (step * gridDim.x) */
  unsigned long long* ops;      /* operations issued to peers (puts and signals), for the report */
};

__device__ __forceinline__ const mscclppDevConn_t& connTo(const Step& a, int peer)
{
  return a.conns[peer < a.me ? peer : peer - 1];
}

/* Copies `bytes` (a multiple of 16) by the block, 16 bytes per thread per pass. */
__device__ __forceinline__ void blockCopy(uint8_t* dst, const uint8_t* src, uint64_t bytes)
{
  for (uint64_t i = threadIdx.x * 16ull; i < bytes; i += blockDim.x * 16ull)
    *reinterpret_cast<int4*>(dst + i) = *reinterpret_cast<const int4*>(src + i);
}

/* In place: v[0..n) becomes its inclusive prefix sum (n <= blockDim.x; tmp as large as v).
 * Returns the buffer that holds it (v or tmp). Every thread of the block calls it. */
__device__ uint32_t* inclusiveScan(uint32_t* v, uint32_t* tmp, int n)
{
  const int i = threadIdx.x;
  uint32_t *in = v, *out = tmp;
  for (int off = 1; off < n; off <<= 1) {
    __syncthreads();
    if (i < n) out[i] = in[i] + (i >= off ? in[i - off] : 0);
    uint32_t* x = in;
    in = out;
    out = x;
  }
  __syncthreads();
  return in;
}

/* True in the block that finished last of the launch's gridDim.x blocks on counter `c`:
 * each block's writes (its threads', ordered by the barrier) are released by its first
 * thread's fence before the add, and the last block's first thread acquires them all by its
 * fence after reading the count; the barrier hands that on to the block. So a signal() or a
 * put of the last block covers or reads every block's writes. */
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

/* Whether the rows to `peer` go in place (above), read once per block. */
__device__ __forceinline__ bool inPlace(const Step& a, int peer)
{
  return connTo(a, peer).putsDirect(a.s.row(), true);
}

__global__ void __launch_bounds__(EP_THREADS) dispatchKernel(Step a)
{
  /* Bit t of masks[e] is set when token t chose expert e: its slot is the number of bits below
   * t. start[e]: the first row of expert e's run in its rank's DR[me] (ep.h). */
  __shared__ uint32_t masks[EP_MAX_EXPERTS][EP_MAX_TOKENS / 32];
  __shared__ uint32_t scan[2][EP_MAX_EXPERTS];
  const Shape s = a.s;
  const int L = s.L(), E = s.E, tid = threadIdx.x;
  for (int i = tid; i < E * (EP_MAX_TOKENS / 32); i += blockDim.x) (&masks[0][0])[i] = 0;
  __syncthreads();
  for (int i = tid; i < a.T * s.K; i += blockDim.x)
    atomicOr(&masks[a.idx[i]][(i / s.K) >> 5], 1u << ((i / s.K) & 31));
  __syncthreads();
  uint32_t count = 0;
  if (tid < E)
    for (int w = 0; w < EP_MAX_TOKENS / 32; w++) count += __popc(masks[tid][w]);
  scan[0][tid] = count;
  const uint32_t* end = inclusiveScan(scan[0], scan[1], E); /* over all experts */
  __shared__ uint32_t start[EP_MAX_EXPERTS];
  if (tid < E) start[tid] = end[tid] - count - (tid >= L ? end[tid / L * L - 1] : 0);
  __syncthreads();
  for (int i = blockIdx.x; i < a.T * s.K; i += gridDim.x) {
    const int t = i / s.K, e = a.idx[i], dst = e / L;
    const uint32_t* m = masks[e];
    uint32_t slot = __popc(m[t >> 5] & ((1u << (t & 31)) - 1u));
    for (int w = 0; w < (t >> 5); w++) slot += __popc(m[w]);
    const uint64_t r = start[e] + slot;
    if (tid == 0) a.rows[i] = (int)r;
    if (dst == a.me)
      blockCopy(a.buf + s.dr(a.q, a.me, r), a.buf + s.x(t), s.row());
    else if (inPlace(a, dst)) {
      connTo(a, dst).putBlock(s.dr(a.q, a.me, r), s.x(t), s.row());
      if (tid == 0) atomicAdd(a.ops, 1ull);
    } else
      blockCopy(a.buf + s.sr(a.q, dst, r), a.buf + s.x(t), s.row());
  }
  if (!lastBlock(&a.done[0], a.base)) return;
  /* The counts (end[] and start[] are this block's own, still in shared memory): ours to
   * ourselves in place, the peers' staged (the puts' source). */
  for (int e = tid; e < E; e += blockDim.x) {
    const int dst = e / L;
    const uint64_t at = dst == a.me ? s.dc(a.q, a.me) : s.sc(a.q, dst);
    reinterpret_cast<uint32_t*>(a.buf + at)[e % L] = end[e] - (e ? end[e - 1] : 0);
  }
  __syncthreads(); /* the staged counts before the puts that read them */
  for (int p = tid; p < s.R; p += blockDim.x)
    if (p != a.me) {
      const mscclppDevConn_t& c = connTo(a, p);
      if (!inPlace(a, p)) { /* the packed rows, then the counts: the proxy keeps their order */
        const uint64_t n = end[p * L + L - 1] - (p ? end[p * L - 1] : 0);
        c.put(s.dr(a.q, a.me, 0), s.sr(a.q, p, 0), n * s.row());
        if (n) atomicAdd(a.ops, 1ull); /* a put of 0 bytes is no operation */
      }
      c.putWithSignal(s.dc(a.q, a.me), s.sc(a.q, p), (uint64_t)L * 4);
      atomicAdd(a.ops, 1ull);
    }
  /* One thread per peer waits (a connection's wait() belongs to one thread); bounded by the
   * library's wait timeout. */
  for (int p = tid; p < s.R; p += blockDim.x)
    if (p != a.me) connTo(a, p).wait();
}

/* The rows received (DR), by source rank: srcEnd[src] = rows of sources 0..src, from the
 * counts of the dispatch. Every thread of the block calls it. */
__device__ const uint32_t* receivedBySource(const Step& a, uint32_t (*scan)[EP_MAX_EXPERTS])
{
  const Shape s = a.s;
  const int L = s.L(), tid = threadIdx.x;
  uint32_t n = 0;
  if (tid < s.R)
    for (int l = 0; l < L; l++) n += reinterpret_cast<const uint32_t*>(a.buf + s.dc(a.q, tid))[l];
  scan[0][tid] = n;
  return inclusiveScan(scan[0], scan[1], s.R);
}

/* The expert (ep.h; it stands in for the MLP): every received row scaled in place. Block b
 * takes rows b, b + gridDim.x, ... of all of DR; the run (src, l) of each is found in a scan
 * of the counts. */
__global__ void __launch_bounds__(EP_THREADS) expertKernel(Step a)
{
  __shared__ uint32_t scan[2][EP_MAX_EXPERTS];
  const Shape s = a.s;
  const int L = s.L(), runs = s.R * L, tid = threadIdx.x;
  scan[0][tid] = tid < runs ? reinterpret_cast<const uint32_t*>(a.buf + s.dc(a.q, tid / L))[tid % L] : 0;
  const uint32_t* end = inclusiveScan(scan[0], scan[1], runs);
  for (uint32_t g = blockIdx.x; g < end[runs - 1]; g += gridDim.x) {
    int lo = 0, hi = runs - 1; /* the first run whose end is past g */
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (end[mid] > g) hi = mid;
      else lo = mid + 1;
    }
    const int src = lo / L, e = a.me * L + lo % L;
    bf16* row = reinterpret_cast<bf16*>(a.buf + s.dr(a.q, src, g - (src ? end[src * L - 1] : 0)));
    for (int h = tid; h < s.H; h += blockDim.x) row[h] = expertValue(row[h], e);
  }
}

__global__ void __launch_bounds__(EP_THREADS) combineKernel(Step a)
{
  /* DR[src] goes back as it is, to CR[me] on src: one range per source, cut into chunks that
   * the blocks take in turn (chunk j, j + gridDim.x, ...). In place, a chunk is about an even
   * share of all the rows (total / gridDim.x, as large as one direct block put carries): each
   * block put costs a path decision and three barriers besides its copy, so a put per row cost
   * 4 ranks 1.6x the NVSHMEM peer's combine at 128 tokens (bench/RESULTS.md, issue 44). Packed,
   * the whole range is one chunk: one trigger. */
  __shared__ uint32_t scan[2][EP_MAX_EXPERTS];
  __shared__ uint32_t chunkRows[EP_MAX_EXPERTS], chunks[2][EP_MAX_EXPERTS];
  const Shape s = a.s;
  const int tid = threadIdx.x;
  const uint32_t* srcEnd = receivedBySource(a, scan);
  const uint32_t total = srcEnd[s.R - 1];
  uint32_t n = 0, c = 0;
  if (tid < s.R) {
    n = srcEnd[tid] - (tid ? srcEnd[tid - 1] : 0);
    uint32_t rows = n;
    if (tid == a.me || inPlace(a, tid)) {
      rows = (total + gridDim.x - 1) / gridDim.x;
      while (rows > 1 && !(tid == a.me || connTo(a, tid).putsDirect(rows * s.row(), true))) rows /= 2;
      rows = rows ? rows : 1;
    }
    chunkRows[tid] = rows;
    c = n ? (n + rows - 1) / rows : 0;
  }
  chunks[0][tid] = c;
  const uint32_t* chunkEnd = inclusiveScan(chunks[0], chunks[1], s.R);
  for (uint32_t j = blockIdx.x; j < chunkEnd[s.R - 1]; j += gridDim.x) {
    int src = 0;
    while (chunkEnd[src] <= j) src++; /* ends: j < chunkEnd[R - 1] */
    const uint32_t per = chunkRows[src], have = srcEnd[src] - (src ? srcEnd[src - 1] : 0);
    const uint64_t r = (uint64_t)(j - (src ? chunkEnd[src - 1] : 0)) * per;
    const uint64_t bytes = (have - r < per ? have - r : per) * s.row();
    if (src == a.me)
      blockCopy(a.buf + s.cr(a.q, a.me, r), a.buf + s.dr(a.q, src, r), bytes);
    else {
      connTo(a, src).putBlock(s.cr(a.q, a.me, r), s.dr(a.q, src, r), bytes);
      if (tid == 0) atomicAdd(a.ops, 1ull);
    }
  }
  if (!lastBlock(&a.done[1], a.base)) return;
  for (int p = threadIdx.x; p < s.R; p += blockDim.x)
    if (p != a.me) {
      connTo(a, p).signal();
      atomicAdd(a.ops, 1ull);
    }
  for (int p = threadIdx.x; p < s.R; p += blockDim.x)
    if (p != a.me) connTo(a, p).wait();
}

/* Block (c, t): 16-byte word c * blockDim.x + threadIdx.x of token t's output (ep.h's
 * combineWord, the NVSHMEM peer's reduce too). (One block per token reading 2 bytes per load
 * made the first GPU run's combine 2.3-2.6x the peer's.) */
__global__ void __launch_bounds__(EP_REDUCE_THREADS) reduceKernel(Step a)
{
  __shared__ uint64_t off[16];
  __shared__ float wk[16];
  const Shape s = a.s;
  const int t = blockIdx.y, K = s.K, L = s.L(), V = s.H / 8;
  if ((int)threadIdx.x < K) {
    const int k = threadIdx.x, e = a.idx[t * K + k];
    off[k] = s.cr(a.q, e / L, (uint64_t)a.rows[t * K + k]);
    wk[k] = a.w[t * K + k];
  }
  __syncthreads();
  const int v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v < V) reinterpret_cast<int4*>(a.out)[(uint64_t)t * V + v] = combineWord(K, wk, a.buf, off, v);
}

} // namespace ep

#endif
