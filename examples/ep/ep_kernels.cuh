/*
 * ep_kernels.cuh: the kernels of the expert-parallel example over the 2023 device API, shared
 * by the C++ driver (ep.cu) and the Python one (ep_torch.py, built there by torch's
 * load_inline). examples/ep/ep.h says what moves where; this file how, on the GPU. Needs
 * mscclpp.h and ep.h first. In step order: dispatchKernel, expertKernel (the stand-in for the
 * experts' MLP, untimed), combineKernel, reduceKernel.
 *
 * Each kernel cuts every peer's rows into chunks that its blocks take in turn, and per peer
 * picks one of two ways by DevConn::putsDirect() (it does not change while a kernel runs):
 *   in place  the peer's memory is written directly (P2P with the direct path): a chunk is
 *             about an even share of all rows over the grid, at most what one direct block
 *             put carries, and goes by one putBlock() to its place in the peer's DR (dispatch
 *             gathers the chunk's rows, each a token of its own, into SR[peer] first) or CR.
 *   packed    every put is a trigger for the proxy (P2P forced through the copy engines or the
 *             SM engine, IB, SHM): one trigger per row would cost the proxy's per-operation
 *             time for each (7 ms a step at 128 tokens, bench/RESULTS.md issue 44), so
 *             dispatch's blocks gather the peer's rows into SR[peer] and the last block puts
 *             them in one operation; combine's rows for a peer are already one range (DR[src])
 *             and go in one put.
 * Dispatch's counts go from one block before its chunks (a warp's 16-byte puts per peer where
 * those land directly); then the block that finishes last sends each peer one
 * signal(), which covers every block's puts (or, packed, the rows' put and the counts'
 * putWithSignal()); combine's last block a signal() per peer; and a wait() per peer.
 *
 * Launch: dispatch, expert and combine with blockDim.x = EP_THREADS (the scans give each
 * thread one expert or run: E <= EP_MAX_EXPERTS = EP_THREADS; at most 64 registers a thread,
 * so that two blocks fit an SM: under MPS a rank may have a quarter of the SMs) and any grid (only the block that
 * finishes last waits for the peers, so the blocks need not be resident at once); reduce with
 * blockDim.x = EP_REDUCE_THREADS and grid (ceil(H / 8 / EP_REDUCE_THREADS), T), only where
 * T > Step::fuseTokens (combine's last block does it otherwise).
 */
#ifndef MSCCLPP_EXAMPLES_EP_KERNELS_CUH
#define MSCCLPP_EXAMPLES_EP_KERNELS_CUH

#define EP_THREADS 512
#define EP_MAX_EXPERTS 512
#define EP_MAX_TOKENS 128
#define EP_REDUCE_THREADS 128
#define EP_FUSE_MAX_TOKENS 8
/* Every scan gives each thread one expert or run. */
static_assert(EP_THREADS >= EP_MAX_EXPERTS, "EP_THREADS must cover EP_MAX_EXPERTS");
/* inclusiveScan: whole warps, at most 32 of them. */
static_assert(EP_THREADS % 32 == 0 && EP_THREADS <= 1024, "EP_THREADS: whole warps, at most 32");

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
  uint32_t chunkRows;           /* at most this many rows in a chunk of evenShare's (0: no limit but the even share's) */
  unsigned long long* stamps;   /* nullptr, or this step's kStamps %globaltimer times (stamp()) */
  int fuseTokens;               /* T <= this (at most EP_FUSE_MAX_TOKENS): combine's last block does the reduce, which is not launched */
#ifdef EP_SIGNAL_CLOCKS
  unsigned long long* clocks;   /* diagnostic build (ep.cu): signalClocks()'s sums */
#endif
};

#ifdef EP_SIGNAL_CLOCKS
/* Diagnostic build only (-DEP_SIGNAL_CLOCKS, ep.cu prints the means in us at the GPU's peak
 * clock, so an upper bound of the cycles' worth): what one signal() costs its thread in the
 * last block, in SM cycles (clock64), and a system-scope fence after it, then a second one:
 * sums at a.clocks[at + 0..2], the count at a.clocks[at + 3] (at: 0 dispatch, 4 combine; the
 * warm-up steps counted too). The fences after the signal only add order. */
__device__ __forceinline__ void signalClocks(const Step& a, int at, const mscclppDevConn_t& c)
{
  const long long c0 = clock64();
  c.signal();
  const long long c1 = clock64();
  mscclpp::device::fenceAcqRelSys();
  const long long c2 = clock64();
  mscclpp::device::fenceAcqRelSys();
  const long long c3 = clock64();
  atomicAdd(&a.clocks[at + 0], (unsigned long long)(c1 - c0));
  atomicAdd(&a.clocks[at + 1], (unsigned long long)(c2 - c1));
  atomicAdd(&a.clocks[at + 2], (unsigned long long)(c3 - c2));
  atomicAdd(&a.clocks[at + 3], 1ull);
}
#define EP_SIGNAL(a, at, c) signalClocks(a, at, c)
#else
#define EP_SIGNAL(a, at, c) (c).signal()
#endif

/* Stamp `which` of phase `at` (kStampDispatch or kStampCombine), if stamps are asked for:
 * the entry by every block's first thread (the earliest stays: the host sets it to ~0 first),
 * the others by the last block after a barrier (so after every thread's work before it).
 * Every thread of the block calls it (a.stamps is the same for all). */
__device__ __forceinline__ void stamp(const Step& a, int at, int which)
{
  if (!a.stamps) return;
  if (which == kStampEntry) {
    if (threadIdx.x == 0) atomicMin(&a.stamps[at + which], globalNs());
    return;
  }
  __syncthreads();
  if (threadIdx.x == 0) a.stamps[at + which] = globalNs();
}

/* Each block's copy of its connections (askPaths() makes it on the way in), where there are at
 * most EP_SHARED_CONNS ranks: a connection's words (its pointers and the FIFO's) are the first
 * of the two dependent loads of every put's, signal()'s and wait()'s path, and read from
 * shared memory they cost no memory round trip: a signal() cost the last block's thread
 * 1.6-1.8 us, 0.52 of them its fence, the rest two round trips (bench/RESULTS.md, issue 44,
 * session 29). A copy is a connection as good as the original: the 2023 kernels take theirs
 * by value, and no device method writes the struct (its state is behind its pointers). */
#define EP_SHARED_CONNS 32
__shared__ mscclppDevConn_t epConns[EP_SHARED_CONNS - 1];

/* The index of peer's connection (rank order, this rank left out) in a.conns and epConns. */
__device__ __forceinline__ int connIndex(const Step& a, int peer) { return peer < a.me ? peer : peer - 1; }

__device__ __forceinline__ const mscclppDevConn_t& connTo(const Step& a, int peer)
{
  const int i = connIndex(a, peer);
  return a.s.R <= EP_SHARED_CONNS ? epConns[i] : a.conns[i];
}

/* Word i (of 16 bytes) of n goes to to[i] from from(i), by thread i % blockDim.x: each thread
 * has four loads in flight before their stores (a load per store let each thread wait out the
 * memory's latency once per word, as the compiler cannot move a load above a store that may
 * alias it). */
template <typename From>
__device__ __forceinline__ void moveWords(int4* to, From from, uint32_t n)
{
  const uint32_t nt = blockDim.x;
  uint32_t i = threadIdx.x;
  for (; i + 3 * nt < n; i += 4 * nt) {
    int4 v[4];
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = *from(i + j * nt);
#pragma unroll
    for (int j = 0; j < 4; j++) to[i + j * nt] = v[j];
  }
  for (; i < n; i += nt) to[i] = *from(i);
}

/* Copies `bytes` (a multiple of 16) by the block. */
__device__ __forceinline__ void blockCopy(uint8_t* dst, const uint8_t* src, uint64_t bytes)
{
  const int4* s = reinterpret_cast<const int4*>(src);
  moveWords(reinterpret_cast<int4*>(dst), [s](uint32_t i) { return s + i; }, (uint32_t)(bytes / 16));
}

/* In place: v[0..n) becomes its inclusive prefix sum (n <= blockDim.x; blockDim.x a multiple
 * of 32, at most 1024; tmp, 32 words, holds the warps' sums). Returns v. Every thread of the
 * block calls it. Each warp scans its 32 values by shuffles, warp 0 the warps' sums: four
 * barriers, where a scan over the block in log2(n) rounds took one per round (ten for 512
 * experts), twice on each kernel's way in. */
__device__ uint32_t* inclusiveScan(uint32_t* v, uint32_t* tmp, int n)
{
  const int i = threadIdx.x, lane = i & 31, warp = i >> 5;
  __syncthreads(); /* the callers' v[] before it is read */
  uint32_t x = i < n ? v[i] : 0;
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  if (lane == 31) tmp[warp] = x;
  __syncthreads(); /* every warp's sum before warp 0 scans them */
  if (warp == 0) {
    uint32_t t = lane < (int)(blockDim.x >> 5) ? tmp[lane] : 0;
    for (int off = 1; off < 32; off <<= 1) {
      const uint32_t y = __shfl_up_sync(0xffffffffu, t, off);
      if (lane >= off) t += y;
    }
    tmp[lane] = t; /* each lane read its own word above, before the shuffles */
  }
  __syncthreads(); /* the warps' prefix sums before they are added */
  if (i < n) v[i] = x + (warp ? tmp[warp - 1] : 0);
  __syncthreads(); /* v[] before its readers, and tmp[] free again */
  return v;
}

/* True in the block that finished last of the launch's gridDim.x blocks on counter `c`:
 * each block's writes (its threads', ordered by the barrier) are released by its first
 * thread's add, an acq_rel atomic at GPU scope; the add that brings the count to the end
 * acquires them all (every earlier add is in the counter's release sequence), and the barrier
 * hands that on to the block. So a signal() or a put of the last block covers or reads every
 * block's writes. One atomic rather than a fence, a relaxed add and a fence: 0.1-0.5 us less
 * per kernel (bench/RESULTS.md, issue 44, session 29); a system-scope release in every block
 * instead was slower. */
__device__ bool lastBlock(unsigned int* c, unsigned int base)
{
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(c) : "memory");
    last = old == base + gridDim.x - 1;
  }
  __syncthreads();
  return last;
}

/* Each peer's path (ours: in place, trivially), asked once per block on the way in: a
 * question is two dependent loads (the connection, then its limit words), which, asked in
 * the last block after every put, lay on the path to the signal (bench/RESULTS.md, issue
 * 44). Thread blockDim.x - 1 - p asks for peer p, from the block's last warp down, and copies
 * its connection into epConns: the first threads load the step's routing (dispatch) or counts
 * (combine) meanwhile, so that the round trips overlap. The answers and the copies are read
 * after the caller's next barrier. Counts go direct where the rows go in place (rows packed
 * for the proxy must go before their counts, in the proxy's order) and a thread's 16-byte put
 * lands directly. */
struct Paths {
  bool rows[EP_MAX_EXPERTS];   /* the rows go in place */
  bool counts[EP_MAX_EXPERTS]; /* dispatch's counts go by direct thread puts and a signal() */
};

__device__ __forceinline__ void askPaths(const Step& a, Paths& paths)
{
  const int p = (int)(blockDim.x - 1 - threadIdx.x);
  if (p >= a.s.R) return;
  bool rows = true, counts = false;
  if (p != a.me) {
    const int i = connIndex(a, p);
    const mscclppDevConn_t& c = a.conns[i];
    if (a.s.R <= EP_SHARED_CONNS) epConns[i] = c;
    rows = c.putsDirect(a.s.row(), true);
    counts = rows && c.putsDirect(16, false);
  }
  paths.rows[p] = rows;
  paths.counts[p] = counts;
}

/* Rows per chunk of the rows to `peer` (`direct`: they go in place): an even share of all
 * `total` rows over the grid, and, in place, no more than one direct block put carries. */
__device__ uint32_t evenShare(const Step& a, int peer, bool direct, uint32_t total)
{
  uint32_t rows = (total + gridDim.x - 1) / gridDim.x;
  if (a.chunkRows && rows > a.chunkRows) rows = a.chunkRows;
  if (rows > 1 && peer != a.me && direct) /* one row: no need to ask */
    while (rows > 1 && !connTo(a, peer).putsDirect(rows * a.s.row(), true)) rows /= 2;
  return rows ? rows : 1;
}

/* The chunks of every peer's rows, numbered peer by peer: peer p's n[p] rows in chunks of
 * per[p] (the last one shorter). Returns chunkEnd (in `chunks`, EP_THREADS words; `sums`, 32
 * words, is inclusiveScan's), chunkEnd[p] = chunks of peers 0..p. Every thread calls it, after
 * n and per are written for p < R. */
__device__ const uint32_t* chunkScan(const uint32_t* n, const uint32_t* per, uint32_t* chunks,
                                     uint32_t* sums, int R)
{
  const int tid = threadIdx.x;
  chunks[tid] = tid < R && n[tid] ? (n[tid] + per[tid] - 1) / per[tid] : 0;
  return inclusiveScan(chunks, sums, R);
}

/* The chunk that a block takes as its j-th of all: the chunks rotated to begin with peer
 * me + 1's, so that the ranks' blocks start on different peers (all of them on peer 0's first
 * would queue every rank's stores at one GPU's links), this rank's own last. */
__device__ __forceinline__ uint32_t rotated(uint32_t j, const uint32_t* chunkEnd, int me, int R)
{
  const uint32_t all = chunkEnd[R - 1];
  return (j + chunkEnd[me]) % all;
}

/* Chunk j: its peer (found in chunkEnd), first row and rows. */
__device__ __forceinline__ void chunkOf(uint32_t j, const uint32_t* chunkEnd, const uint32_t* n,
                                        const uint32_t* per, int& peer, uint32_t& first,
                                        uint32_t& rows)
{
  peer = 0;
  while (chunkEnd[peer] <= j) peer++; /* ends: j < chunkEnd[R - 1] */
  first = (j - (peer ? chunkEnd[peer - 1] : 0)) * per[peer];
  rows = n[peer] - first < per[peer] ? n[peer] - first : per[peer];
}

/* The token of the k-th set bit (from 0) of a 128-token mask. */
__device__ __forceinline__ int nthToken(const uint32_t* m, uint32_t k)
{
  for (int w = 0; w < EP_MAX_TOKENS / 32; w++) {
    const uint32_t c = __popc(m[w]);
    if (k < c) {
      uint32_t x = m[w];
      for (; k; k--) x &= x - 1; /* ends: k < popc(x) */
      return w * 32 + __ffs(x) - 1;
    }
    k -= c;
  }
  return 0; /* not reached: k < the mask's count */
}

/* Dispatch's counts, from end[] (the block's inclusive scan of every expert's rows): ours into
 * DC[me] in place, each peer's into SC[peer] (the source of their puts); then, for each peer
 * whose counts go directly, a warp puts them, 16 bytes a lane (one thread's put of all L counts
 * waited out its loads' latency L / 32 times in a row), warp w for peers w, w + warps, ...
 * Their signal is the last block's. Every thread of the block calls it. */
__device__ void putCounts(const Step& a, const Paths& paths, const uint32_t* end)
{
  const Shape s = a.s;
  const int L = s.L(), tid = threadIdx.x, lane = tid & 31;
  for (int e = tid; e < s.E; e += blockDim.x) {
    const int dst = e / L;
    const uint64_t at = dst == a.me ? s.dc(a.q, a.me) : s.sc(a.q, dst);
    reinterpret_cast<uint32_t*>(a.buf + at)[e % L] = end[e] - (e ? end[e - 1] : 0);
  }
  __syncthreads(); /* the staged counts before the puts that read them */
  const uint32_t countBytes = (uint32_t)L * 4;
  for (int p = tid >> 5; p < s.R; p += blockDim.x >> 5) {
    if (!paths.counts[p]) continue;
    for (uint32_t off = lane * 16u; off < countBytes; off += 32 * 16u) {
      connTo(a, p).put(s.dc(a.q, a.me) + off, s.sc(a.q, p) + off, countBytes - off < 16 ? countBytes - off : 16);
      atomicAdd(a.ops, 1ull);
    }
  }
}

/* Dispatch. The rows for each peer are cut into chunks of about an even share of all rows
 * over the grid, and the blocks take the chunks in turn. A block gathers its chunk's rows
 * (each row of a run is a token of its own) into this rank's SR[peer] in DR's order, every
 * row's loads in flight at once, then puts the chunk there with one putBlock(): a put per row
 * straight from the tokens cost each block a path decision, three barriers and a memory round
 * trip per row, 1.1-1.2x the NVSHMEM peer's dispatch at 128 tokens (bench/RESULTS.md, issue
 * 44). A chunk of one row goes straight from its token; ours go into DR[me] directly. Packed
 * peers' chunks are only gathered: the last block puts each such peer's whole range. */
__global__ void __launch_bounds__(EP_THREADS, 2) dispatchKernel(Step a)
{
  /* Bit t of masks[e] is set when token t chose expert e: its slot is the number of bits below
   * t. start[e]: the first row of expert e's run in its rank's DR[me] (ep.h). n[p]: the rows
   * for peer p. */
  __shared__ uint32_t masks[EP_MAX_EXPERTS][EP_MAX_TOKENS / 32];
  __shared__ uint32_t scan[EP_MAX_EXPERTS], start[EP_MAX_EXPERTS], sums[32];
  __shared__ uint32_t n[EP_MAX_EXPERTS], per[EP_MAX_EXPERTS], chunks[EP_MAX_EXPERTS];
  __shared__ int tok[EP_MAX_TOKENS * 16]; /* the tokens of a chunk's rows */
  __shared__ Paths paths;
  const Shape s = a.s;
  const int L = s.L(), E = s.E, tid = threadIdx.x, V = s.H / 8;
  stamp(a, kStampDispatch, kStampEntry);
  askPaths(a, paths);
  for (int i = tid; i < E * (EP_MAX_TOKENS / 32); i += blockDim.x) (&masks[0][0])[i] = 0;
  __syncthreads();
  for (int i = tid; i < a.T * s.K; i += blockDim.x)
    atomicOr(&masks[a.idx[i]][(i / s.K) >> 5], 1u << ((i / s.K) & 31));
  __syncthreads();
  uint32_t count = 0;
  if (tid < E)
    for (int w = 0; w < EP_MAX_TOKENS / 32; w++) count += __popc(masks[tid][w]);
  scan[tid] = count;
  const uint32_t* end = inclusiveScan(scan, sums, E); /* over all experts */
  if (tid < E) start[tid] = end[tid] - count - (tid >= L ? end[tid / L * L - 1] : 0);
  if (tid < s.R) {
    n[tid] = end[tid * L + L - 1] - (tid ? end[tid * L - 1] : 0);
    per[tid] = evenShare(a, tid, paths.rows[tid], end[E - 1]);
  }
  const uint32_t* chunkEnd = chunkScan(n, per, chunks, sums, s.R); /* its barriers publish start[] too */
  /* For reduce: the row of each (token, k) in its rank's DR[me]. */
  if (blockIdx.x == 0)
    for (int i = tid; i < a.T * s.K; i += blockDim.x) {
      const int t = i / s.K, e = a.idx[i];
      const uint32_t* m = masks[e];
      uint32_t slot = __popc(m[t >> 5] & ((1u << (t & 31)) - 1u));
      for (int w = 0; w < (t >> 5); w++) slot += __popc(m[w]);
      a.rows[i] = (int)(start[e] + slot);
    }
  /* The counts, before any chunk of the block that sends them: off the path from the last
   * chunk to the signal, which covers them through lastBlock() as it covers the rows (the last
   * block putting them after the rows was slower: bench/RESULTS.md, issue 44). By the first
   * block that has no chunk, where there is one (a few tokens: it starts with the others),
   * else by the grid's last block (scheduled last, it has the fewest chunks). */
  const uint32_t allChunks = chunkEnd[s.R - 1];
  if (blockIdx.x == (allChunks < gridDim.x ? allChunks : gridDim.x - 1)) putCounts(a, paths, end);
  const int4* x = reinterpret_cast<const int4*>(a.buf + s.x(0));
  for (uint32_t j = blockIdx.x; j < allChunks; j += gridDim.x) {
    int p;
    uint32_t first, rows;
    chunkOf(rotated(j, chunkEnd, a.me, s.R), chunkEnd, n, per, p, first, rows);
    for (uint32_t r = tid; r < rows; r += blockDim.x) {
      /* Row first + r of p's region: in the run of the last of p's experts that starts at or
       * before it (an expert with no rows starts where the next one does). */
      const uint32_t row = first + r;
      int lo = p * L, hi = p * L + L - 1;
      while (lo < hi) { /* ends: the interval shrinks every pass */
        const int mid = (lo + hi + 1) / 2;
        if (start[mid] <= row) lo = mid;
        else hi = mid - 1;
      }
      tok[r] = nthToken(masks[lo], row - start[lo]);
    }
    __syncthreads(); /* tok[] before its readers */
    const bool direct = p != a.me && paths.rows[p];
    if (direct && rows == 1) {
      connTo(a, p).putBlock(s.dr(a.q, a.me, first), s.x(tok[0]), s.row());
    } else {
      int4* to = reinterpret_cast<int4*>(a.buf + (p == a.me ? s.dr(a.q, a.me, first) : s.sr(a.q, p, first)));
      moveWords(to, [x, V](uint32_t i) { return x + (uint64_t)tok[i / V] * V + i % V; }, rows * (uint32_t)V);
      /* putBlock()'s entry barrier orders the gathered rows before its copy or trigger. */
      if (direct) connTo(a, p).putBlock(s.dr(a.q, a.me, first), s.sr(a.q, p, first), (uint64_t)rows * s.row());
    }
    if (direct && tid == 0) atomicAdd(a.ops, 1ull);
    __syncthreads(); /* tok[] is rewritten only after every thread has used it */
  }
  if (!lastBlock(&a.done[0], a.base)) return;
  stamp(a, kStampDispatch, kStampPut);
  /* Per peer: where its counts went directly, one signal(), which covers them and the rows
   * (the counts block's puts and every block's, through lastBlock()). Otherwise the packed
   * rows, if they were packed (a block limit under a row's bytes packs them while thread puts
   * stay direct), then the counts with putWithSignal: a trigger each, which the proxy carries
   * in order. */
  for (int p = tid; p < s.R; p += blockDim.x) {
    if (p == a.me) continue;
    const mscclppDevConn_t& c = connTo(a, p);
    if (paths.counts[p]) {
      EP_SIGNAL(a, 0, c);
      atomicAdd(a.ops, 1ull);
    } else {
      if (!paths.rows[p]) {
        c.put(s.dr(a.q, a.me, 0), s.sr(a.q, p, 0), (uint64_t)n[p] * s.row());
        if (n[p]) atomicAdd(a.ops, 1ull); /* a put of 0 bytes is no operation */
      }
      c.putWithSignal(s.dc(a.q, a.me), s.sc(a.q, p), (uint32_t)L * 4);
      atomicAdd(a.ops, 1ull);
    }
  }
  stamp(a, kStampDispatch, kStampSignalled);
  /* One thread per peer waits (a connection's wait() belongs to one thread); bounded by the
   * library's wait timeout. */
  for (int p = tid; p < s.R; p += blockDim.x)
    if (p != a.me) connTo(a, p).wait();
  stamp(a, kStampDispatch, kStampWaited);
}

/* The inclusive scan (into `scan`, EP_THREADS words; `sums` is inclusiveScan's 32) of the
 * dispatch's counts received, run (src, l) at src * L + l: the rows from src for local expert
 * l. One count per thread (a thread per source summing its L counts cost L loads in a row).
 * Every thread of the block calls it. */
__device__ const uint32_t* countsScan(const Step& a, uint32_t* scan, uint32_t* sums)
{
  const Shape s = a.s;
  const int L = s.L(), runs = s.R * L, tid = threadIdx.x;
  scan[tid] = tid < runs ? reinterpret_cast<const uint32_t*>(a.buf + s.dc(a.q, tid / L))[tid % L] : 0;
  return inclusiveScan(scan, sums, runs);
}

/* The rows received (DR) from each source, n[src] for src < R (countsScan's). Returns their
 * sum. Every thread of the block calls it. */
__device__ uint32_t receivedBySource(const Step& a, uint32_t* scan, uint32_t* sums, uint32_t* n)
{
  const Shape s = a.s;
  const int L = s.L(), runs = s.R * L, tid = threadIdx.x;
  const uint32_t* end = countsScan(a, scan, sums);
  if (tid < s.R) n[tid] = end[tid * L + L - 1] - (tid ? end[tid * L - 1] : 0);
  const uint32_t total = end[runs - 1];
  __syncthreads(); /* n[] before its readers */
  return total;
}

/* The expert (ep.h's expertRun): block i scales the received run i, i + gridDim.x, ... (run
 * (src, l): the rows from src for local expert l, found in countsScan()). */
__global__ void __launch_bounds__(EP_THREADS, 2) expertKernel(Step a)
{
  __shared__ uint32_t scan[EP_MAX_EXPERTS], sums[32];
  const Shape s = a.s;
  const int L = s.L(), runs = s.R * L;
  const uint32_t* end = countsScan(a, scan, sums);
  for (int i = blockIdx.x; i < runs; i += gridDim.x) {
    const int src = i / L;
    const uint32_t before = i ? end[i - 1] : 0; /* rows of the runs before i, over all sources */
    expertRun(a.buf + s.dr(a.q, src, before - (src ? end[src * L - 1] : 0)), end[i] - before, s.H,
              a.me * L + i % L);
  }
}

/* The weighted sums of a step of few tokens (a.T <= a.fuseTokens), by combine's last block
 * once its waits have returned, in reduceKernel's arithmetic: a kernel of its own costs a
 * launch, more than one block takes for a few tokens' sums (bench/RESULTS.md, issue 44). The
 * rows it reads arrived before a wait of this block returned (a peer's, covered by its signal)
 * or were copied by a block that lastBlock() ordered before this one (ours). Every thread of
 * the block calls it, after the waits. */
__device__ void reduceInBlock(const Step& a)
{
  __shared__ uint64_t off[EP_FUSE_MAX_TOKENS * 16];
  __shared__ float wk[EP_FUSE_MAX_TOKENS * 16];
  const Shape s = a.s;
  const int K = s.K, L = s.L(), V = s.H / 8, tid = threadIdx.x;
  for (int i = tid; i < a.T * K; i += blockDim.x) {
    off[i] = s.cr(a.q, a.idx[i] / L, (uint64_t)a.rows[i]);
    wk[i] = a.w[i];
  }
  __syncthreads(); /* the waiting threads' acquires, and off[], wk[], before every thread's loads */
  for (int i = tid; i < a.T * V; i += blockDim.x) {
    const int t = i / V, v = i % V;
    reinterpret_cast<int4*>(a.out)[(uint64_t)t * V + v] = combineWord(K, wk + t * K, a.buf, off + t * K, v);
  }
}

__global__ void __launch_bounds__(EP_THREADS, 2) combineKernel(Step a)
{
  /* DR[src] goes back as it is, to CR[me] on src: one range per source, cut into chunks that
   * the blocks take in turn (chunk j, j + gridDim.x, ...). In place, a chunk is about an even
   * share of all the rows (total / gridDim.x, as large as one direct block put carries): each
   * block put costs a path decision and three barriers besides its copy, so a put per row cost
   * 4 ranks 1.6x the NVSHMEM peer's combine at 128 tokens (bench/RESULTS.md, issue 44). Packed,
   * the whole range is one chunk: one trigger. */
  __shared__ uint32_t scan[EP_MAX_EXPERTS], sums[32];
  __shared__ uint32_t n[EP_MAX_EXPERTS], per[EP_MAX_EXPERTS], chunks[EP_MAX_EXPERTS];
  __shared__ Paths paths;
  const Shape s = a.s;
  const int tid = threadIdx.x;
  stamp(a, kStampCombine, kStampEntry);
  askPaths(a, paths); /* read after receivedBySource()'s barriers */
  const uint32_t total = receivedBySource(a, scan, sums, n);
  if (tid < s.R)
    per[tid] = paths.rows[tid] ? evenShare(a, tid, true, total) : (n[tid] ? n[tid] : 1);
  const uint32_t* chunkEnd = chunkScan(n, per, chunks, sums, s.R);
  for (uint32_t j = blockIdx.x; j < chunkEnd[s.R - 1]; j += gridDim.x) {
    int src;
    uint32_t first, rows;
    chunkOf(rotated(j, chunkEnd, a.me, s.R), chunkEnd, n, per, src, first, rows);
    const uint64_t bytes = (uint64_t)rows * s.row();
    if (src == a.me)
      blockCopy(a.buf + s.cr(a.q, a.me, first), a.buf + s.dr(a.q, src, first), bytes);
    else {
      connTo(a, src).putBlock(s.cr(a.q, a.me, first), s.dr(a.q, src, first), bytes);
      if (tid == 0) atomicAdd(a.ops, 1ull);
    }
  }
  if (!lastBlock(&a.done[1], a.base)) return;
  stamp(a, kStampCombine, kStampPut);
  for (int p = threadIdx.x; p < s.R; p += blockDim.x)
    if (p != a.me) {
      EP_SIGNAL(a, 4, connTo(a, p));
      atomicAdd(a.ops, 1ull);
    }
  stamp(a, kStampCombine, kStampSignalled);
  for (int p = threadIdx.x; p < s.R; p += blockDim.x)
    if (p != a.me) connTo(a, p).wait();
  stamp(a, kStampCombine, kStampWaited);
  /* reduceInBlock()'s arrays hold EP_FUSE_MAX_TOKENS tokens, whoever filled in the Step. */
  if (a.T <= a.fuseTokens && a.T <= EP_FUSE_MAX_TOKENS) reduceInBlock(a);
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
