/*
 * The P2P direct path (issue 30): puts, signals and flushes that the calling kernel thread
 * stores itself, mixed with those that go through the proxy, on one connection; every byte and
 * every signal checked.
 *
 *   direct [-r R -n 2 -a IP:PORT]              the ordering cases (below)
 *   direct [-r R -n 2 -a IP:PORT] --case range a direct-sized put past the peer's buffer
 *
 * Two ranks, one P2P connection over a 32 MiB buffer each: the first half receives, the
 * second is the source of what a rank sends. A byte's value is a function of the step that
 * put it and of its destination offset, so a byte from another step, an earlier phase or the
 * wrong place differs. Checks run on the receiving GPU right after each wait() returns (what
 * the signal covers must be there then, not merely by the end), with loads that bypass L1.
 *
 * Cases (T = the connection's direct limit, read from its epoch block, MSCCLPP_EPOCH_*):
 *   direct only         sizes 1 to T, odd offsets, signal(), put()+signal(),
 *                       putWithSignalAndFlush(), flush(): the sender takes no FIFO ticket
 *   threshold           putWithSignal(T) + flush(): 0 tickets; putWithSignal(T + 1) + flush():
 *                       1 or 2 (Data|Flag, and a Sync unless the put was seen complete first)
 *   direct after proxied a 4 MiB put, then a small putWithSignal: the wait sees both; the same
 *                       after waiting until the 4 MiB put is known complete (the small one
 *                       then goes direct), and after a 4 MiB putWithSignal
 *   proxied after direct small putWithSignal, then 4 MiB putWithSignal; small put, then 4 MiB
 *                       putWithSignal; each wait checks what its signal covers
 *   overlap             small direct put into bytes a later large put overwrites, and a large
 *                       put whose middle a later small put overwrites: the later one stays
 *   around the threshold sizes 1, 3, 8, 15..17, T - 1, T, T + 1, T / 2 + 5, 2 T, odd offsets
 *   512 threads         each puts its chunk, __syncthreads(), one signal: one wait sees all
 *   8 blocks            each block's threads put, then its thread 0 signals: 8 waits
 *   1024 signals        8 x 128 threads each putWithSignal: 1024 waits, then every chunk
 *   both at once        small putWithSignals of 128 threads while two threads put 4 x 1 MiB
 *                       with signals: every signal counted once, every byte there
 *   block puts          putBlock()/putWithSignalBlock() by 256 threads: sizes 1 to B (the
 *                       connection's block limit) with no FIFO ticket, B + 1 through the proxy,
 *                       after and before proxied puts and thread puts, into each other's bytes
 *   16 blocks           each putWithSignalBlock()s 64 KiB + 5 bytes: 16 waits see them all
 *   then a thread       putBlock() of 256 KiB + 7, then thread 0's signal() with no barrier
 *                       in between (the block put ends with one): the wait sees every byte
 *   raw push            a 4 MiB put queued with fifo.push() or fifo.pushPut() directly, then
 *                       each method: signal() (the wait must see the put), putWithSignal(),
 *                       putWithSignalAndFlush(), putWithSignalBlock(), a small put() into its
 *                       bytes (the later one stays), flush() then a put that rewrites the raw
 *                       put's source (the raw put must have read it before the flush returned)
 *   rounds              300 rounds of ping-pong, each rank sending in turn 1-3 operations of
 *                       every kind (block puts too) and size (a seeded sequence, the same on
 *                       both ranks)
 * At the end each rank's signal count (proxy + direct words of its epoch block) must equal its
 * wait count, and with T > 0 both words must have moved (both paths carried signals).
 *
 * --case range: rank 0 puts 16 bytes at 8 bytes before the end of rank 1's buffer (small
 * enough for the direct path, but not inside the buffer): the proxy must refuse it
 * (mscclppInvalidArgument on rank 0) and the 4 KiB after rank 1's buffer must stay untouched.
 *
 * Prints "direct <case>: PASSED" on rank 0 (and per-phase lines); exits 1 on any failure.
 * MSCCLPP_P2P_DIRECT_BYTES=0 runs the same cases through the proxy alone (ticket checks off).
 */
#include "common.cuh"

#include <string>

/* kPutBlock, kPutSigBlock: putBlock() and putWithSignalBlock(), by the whole block.
 * kRawPush, kRawPushPut: a put queued with the FIFO's own fifo.push() / fifo.pushPut()
 * (the 2023 header's FIFO, called directly, not through a connection method). */
enum Op {
  kPut,
  kPutSig,
  kSignal,
  kPutSigFlush,
  kFlush,
  kAwaitIdle,
  kPutBlock,
  kPutSigBlock,
  kRawPush,
  kRawPushPut
};

/* One operation of a phase: `actor` (a rank) does `op`; a put copies `size` bytes from its
 * own buffer at kHalf + src to the peer's at dst. */
struct Step {
  int op;
  int actor;
  uint64_t dst, src, size;
};

constexpr uint64_t kBuf = 32ull << 20;
constexpr uint64_t kHalf = kBuf / 2;
constexpr uint64_t kCanary = 4096; /* allocated after the registered buffer (--case range) */
constexpr int kThreads = 256;

__host__ __device__ inline bool hasData(int op)
{
  return op == kPut || op == kPutSig || op == kPutSigFlush || op == kPutBlock ||
         op == kPutSigBlock || op == kRawPush || op == kRawPushPut;
}
__host__ __device__ inline bool hasSignal(int op)
{
  return op == kPutSig || op == kSignal || op == kPutSigFlush || op == kPutSigBlock;
}

/* The byte that step `id` puts at destination offset `off`. */
__host__ __device__ inline uint8_t pat(uint32_t id, uint64_t off)
{
  uint64_t x = (off + 1) * 0x9E3779B97F4A7C15ull ^ ((uint64_t)(id + 1) * 0xC2B2AE3D27D4EB4Full);
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return (uint8_t)(x ^ (x >> 8));
}

/* Mismatches found on the device, and the first one. */
struct Report {
  unsigned long long bad;
  unsigned long long step, off, got, want;
  int claimed;
};

__device__ inline void noteBad(Report* r, uint64_t step, uint64_t off, uint8_t got, uint8_t want)
{
  atomicAdd(&r->bad, 1ull);
  if (atomicCAS(&r->claimed, 0, 1) == 0) {
    r->step = step;
    r->off = off;
    r->got = got;
    r->want = want;
  }
}

/* Checks the bytes of step p of `steps` (ids base + index) in our buffer; with `overlap`, a
 * byte's expected writer is the last step up to `last` of the same actor whose put covers it. */
__device__ void checkStep(const Step* steps, int p, int last, bool overlap, uint32_t base, Report* r)
{
  const volatile uint8_t* buf = (const volatile uint8_t*)gConns[0].localBuff;
  const Step st = steps[p];
  for (uint64_t i = threadIdx.x; i < st.size; i += blockDim.x) {
    const uint64_t o = st.dst + i;
    int writer = p;
    if (overlap) {
      for (int q = last; q >= 0; q--) {
        const Step& w = steps[q];
        if (w.actor == st.actor && hasData(w.op) && o >= w.dst && o < w.dst + w.size) {
          writer = q;
          break;
        }
      }
    }
    const uint8_t want = pat(base + writer, o), got = buf[o];
    if (got != want) noteBad(r, base + p, o, got, want);
  }
}

/* Thread 0: until the connection's proxied work is known complete (its epoch block's last
 * pushed ticket covered by its last flush or the FIFO's done word, as the direct path reads
 * them), at most 2 s; then the next small operation goes direct. */
__device__ void awaitIdle()
{
  const mscclppDevConn_t& c = gConns[0];
  const uint64_t t0 = globalTimerNs();
  while (globalTimerNs() - t0 < 2000000000ull) {
    const uint64_t pushed = mscclpp::device::loadVolatile(c.epochWord(MSCCLPP_EPOCH_PROXIED));
    if (pushed == 0 || mscclpp::device::loadVolatile(c.epochWord(MSCCLPP_EPOCH_FLUSHED)) >= pushed ||
        mscclpp::device::loadVolatile(c.fifo.triggerFifoHead + 2) >= pushed)
      return;
  }
}

/* Both ranks run the same steps: the actor of a step fills its source (the whole block), then
 * thread 0 does the operation; the other rank waits for each signal and checks, right then,
 * every put of that actor since its previous signal (with `overlap`, only once at the end,
 * every put, against the last writer of each byte). Ends with a flush. */
__global__ void stepsKernel(const Step* steps, int n, int me, uint32_t base, int overlap, Report* r)
{
  mscclppDevConn_t conn = gConns[0];
  uint8_t* buf = (uint8_t*)conn.localBuff;
  int since[2] = {0, 0}; /* first step of each actor not yet checked */
  for (int s = 0; s < n; s++) {
    const Step st = steps[s];
    if (st.actor == me) {
      if (hasData(st.op))
        for (uint64_t i = threadIdx.x; i < st.size; i += blockDim.x)
          buf[kHalf + st.src + i] = pat(base + s, st.dst + i);
      __syncthreads();
      if (st.op == kPutBlock) conn.putBlock(st.dst, kHalf + st.src, st.size);
      if (st.op == kPutSigBlock) conn.putWithSignalBlock(st.dst, kHalf + st.src, st.size);
      if (threadIdx.x == 0) {
        switch (st.op) {
        case kPut: conn.put(st.dst, kHalf + st.src, st.size); break;
        case kPutSig: conn.putWithSignal(st.dst, kHalf + st.src, st.size); break;
        case kSignal: conn.signal(); break;
        case kPutSigFlush: conn.putWithSignalAndFlush(st.dst, kHalf + st.src, st.size); break;
        case kFlush: conn.flush(); break;
        case kAwaitIdle: awaitIdle(); break;
        case kRawPush: conn.fifo.push(mscclppData, st.dst, kHalf + st.src, st.size); break;
        case kRawPushPut: conn.fifo.pushPut(mscclppData, st.dst, kHalf + st.src, st.size); break;
        }
      }
      __syncthreads();
    } else if (hasSignal(st.op)) {
      if (threadIdx.x == 0) conn.wait();
      __syncthreads();
      if (!overlap) {
        for (int p = since[st.actor]; p <= s; p++)
          if (steps[p].actor == st.actor && hasData(steps[p].op)) checkStep(steps, p, s, false, base, r);
        since[st.actor] = s + 1;
      }
      __syncthreads();
    }
  }
  if (overlap)
    for (int p = 0; p < n; p++)
      if (steps[p].actor != me && hasData(steps[p].op)) checkStep(steps, p, n - 1, true, base, r);
  __syncthreads();
  if (threadIdx.x == 0) conn.flush();
}

/* The chunks of the many-thread cases: chunk i's destination, source and size. Sizes 1..64
 * at odd offsets (kinds 0-2); kind 3: chunks 0..127 small, 128..131 1 MiB each. */
struct Chunk {
  uint64_t dst, src, size;
};

__host__ __device__ inline Chunk chunkOf(int kind, int i)
{
  if (kind == 3 && i >= 128) {
    const uint64_t big = 1ull << 20;
    return {(uint64_t)(i - 127) * big + 64, (uint64_t)(i - 127) * big + 64, big};
  }
  const uint64_t size = 1 + (uint64_t)(i * 37 + kind * 11) % 64;
  const uint64_t at = (uint64_t)i * 128 + (uint64_t)(i % 7);
  return {at, at + 8, size};
}

/* Chunk i of kind `kind`, filled and put by the calling thread (with its signal if `sig`). */
__device__ void putChunk(int kind, int i, uint32_t base, bool sig)
{
  mscclppDevConn_t conn = gConns[0];
  uint8_t* buf = (uint8_t*)conn.localBuff;
  const Chunk ch = chunkOf(kind, i);
  for (uint64_t k = 0; k < ch.size; k++) buf[kHalf + ch.src + k] = pat(base + i, ch.dst + k);
  if (sig)
    conn.putWithSignal(ch.dst, kHalf + ch.src, ch.size);
  else
    conn.put(ch.dst, kHalf + ch.src, ch.size);
}

/* Kind 0: one block, every thread puts its chunk, then thread 0 signals once. */
__global__ void manyPutsOneSignal(uint32_t base)
{
  putChunk(0, threadIdx.x, base, false);
  __syncthreads();
  if (threadIdx.x == 0) {
    gConns[0].signal();
    gConns[0].flush();
  }
}

/* Kind 1: every block's threads put their chunks, then each block's thread 0 signals. */
__global__ void blocksPutThenSignal(uint32_t base)
{
  putChunk(1, blockIdx.x * blockDim.x + threadIdx.x, base, false);
  __syncthreads();
  if (threadIdx.x == 0) {
    gConns[0].signal();
    gConns[0].flush();
  }
}

/* Kind 2: every thread of every block putWithSignal()s its chunk: one signal each. */
__global__ void everyThreadSignals(uint32_t base)
{
  putChunk(2, blockIdx.x * blockDim.x + threadIdx.x, base, true);
  __syncthreads();
  if (threadIdx.x == 0) gConns[0].flush();
}

/* Kind 3: blocks 0-1 each thread a small putWithSignal; blocks 2-3 fill, then their thread 0
 * puts two 1 MiB chunks with signals (through the proxy) while the small ones go on. */
__global__ void bothPathsAtOnce(uint32_t base)
{
  if (blockIdx.x < 2) {
    putChunk(3, blockIdx.x * blockDim.x + threadIdx.x, base, true);
  } else {
    uint8_t* buf = (uint8_t*)gConns[0].localBuff;
    for (int j = 0; j < 2; j++) {
      const int i = 128 + (blockIdx.x - 2) * 2 + j;
      const Chunk ch = chunkOf(3, i);
      for (uint64_t k = threadIdx.x; k < ch.size; k += blockDim.x)
        buf[kHalf + ch.src + k] = pat(base + i, ch.dst + k);
    }
    __syncthreads();
    if (threadIdx.x == 0)
      for (int j = 0; j < 2; j++) {
        const int i = 128 + (blockIdx.x - 2) * 2 + j;
        const Chunk ch = chunkOf(3, i);
        gConns[0].putWithSignal(ch.dst, kHalf + ch.src, ch.size);
      }
  }
  __syncthreads();
  if (threadIdx.x == 0) gConns[0].flush();
}

/* Kind 4: each of the blocks fills its chunk, then putWithSignalBlock()s it: one signal per
 * block. Chunks of 64 KiB + 5 at odd offsets. */
__host__ __device__ inline Chunk blockChunk(int i)
{
  const uint64_t size = (64u << 10) + 5, at = (uint64_t)i * (80u << 10) + (uint64_t)(i % 5);
  return {at, at + 3, size};
}
/* Kind 5: one block putBlock()s 256 KiB + 7 bytes, then thread 0 signals at once, with no
 * barrier of the caller's in between: the block put's own closing barrier must order every
 * thread's share before that signal. */
__host__ __device__ inline Chunk lateChunk(int) { return {3, 11, (256u << 10) + 7}; }
__global__ void blockPutThenThreadSignal(uint32_t base)
{
  mscclppDevConn_t conn = gConns[0];
  uint8_t* buf = (uint8_t*)conn.localBuff;
  const Chunk ch = lateChunk(0);
  for (uint64_t k = threadIdx.x; k < ch.size; k += blockDim.x)
    buf[kHalf + ch.src + k] = pat(base, ch.dst + k);
  conn.putBlock(ch.dst, kHalf + ch.src, ch.size);
  if (threadIdx.x == 0) {
    conn.signal();
    conn.flush();
  }
}

__global__ void blocksPutWithSignalBlock(uint32_t base)
{
  mscclppDevConn_t conn = gConns[0];
  uint8_t* buf = (uint8_t*)conn.localBuff;
  const Chunk ch = blockChunk(blockIdx.x);
  for (uint64_t k = threadIdx.x; k < ch.size; k += blockDim.x)
    buf[kHalf + ch.src + k] = pat(base + blockIdx.x, ch.dst + k);
  conn.putWithSignalBlock(ch.dst, kHalf + ch.src, ch.size);
  __syncthreads();
  if (threadIdx.x == 0) conn.flush();
}

/* The receiver of a many-thread case: `nsig` waits, then every chunk checked. */
__global__ void recvChunks(int kind, int nchunks, int nsig, uint32_t base, Report* r)
{
  if (threadIdx.x == 0)
    for (int k = 0; k < nsig; k++) gConns[0].wait();
  __syncthreads();
  const volatile uint8_t* buf = (const volatile uint8_t*)gConns[0].localBuff;
  for (int i = 0; i < nchunks; i++) {
    const Chunk ch = kind == 5 ? lateChunk(i) : kind == 4 ? blockChunk(i) : chunkOf(kind, i);
    for (uint64_t k = threadIdx.x; k < ch.size; k += blockDim.x) {
      const uint8_t want = pat(base + i, ch.dst + k), got = buf[ch.dst + k];
      if (got != want) noteBad(r, base + i, ch.dst + k, got, want);
    }
  }
}

/* --case range: a put of 16 bytes 8 bytes before the end of the peer's buffer. */
__global__ void outOfRange()
{
  gConns[0].put(kBuf - 8, kHalf, 16);
  gConns[0].signal();
}

struct Run {
  Ctx& c;
  mscclppDevConn_t host; /* our connection, as the library filled it */
  cudaStream_t s;
  Report* rep;
  Step* dsteps;
  uint32_t base = 1;
  uint64_t limit = 0;
  int failures = 0;

  uint64_t epochWord(int i)
  {
    uint64_t v = 0;
    CUDACHECK(cudaMemcpy(&v, reinterpret_cast<uint64_t*>(host.localSignalEpochId) + i, 8,
                         cudaMemcpyDeviceToHost));
    return v;
  }
  uint64_t tickets()
  {
    uint64_t v = 0;
    CUDACHECK(cudaMemcpy(&v, host.fifo.triggerFifoHead, 8, cudaMemcpyDeviceToHost));
    return v;
  }

  /* Reads and clears the device report; one line per phase on rank 0 (rank 1's failures are
   * printed by rank 1). */
  void report(const char* phase, const std::string& extra = "")
  {
    Report h;
    CUDACHECK(cudaMemcpy(&h, rep, sizeof h, cudaMemcpyDeviceToHost));
    CUDACHECK(cudaMemset(rep, 0, sizeof h));
    const double bad = maxOverRanks(c, (double)h.bad);
    if (h.bad)
      fprintf(stderr, "rank %d: %s: %llu wrong bytes; first: step %llu offset %llu got %llu want %llu\n",
              c.rank, phase, h.bad, h.step, h.off, h.got, h.want);
    const bool ok = bad == 0 && extra.empty();
    if (!ok) failures++;
    if (c.rank == 0) printf("direct %-22s %s%s\n", phase, ok ? "ok" : "FAILED", extra.c_str());
  }

  /* Runs `steps` on both ranks (ids from `base`); rank 0 must take between `least` and
   * `most` FIFO tickets (checked only with the direct path on; -1: any). */
  void steps(const char* phase, const std::vector<Step>& st, bool overlap, long least = -1,
             long most = -1)
  {
    CUDACHECK(cudaMemcpy(dsteps, st.data(), st.size() * sizeof(Step), cudaMemcpyHostToDevice));
    MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
    const uint64_t t0 = tickets();
    stepsKernel<<<1, kThreads, 0, s>>>(dsteps, (int)st.size(), c.rank, base, overlap, rep);
    KERNELCHECK();
    CUDACHECK(cudaStreamSynchronize(s));
    const uint64_t took = tickets() - t0;
    base += (uint32_t)st.size();
    std::string extra;
    if (c.rank == 0 && least >= 0 && limit > 0 && ((long)took < least || (long)took > most))
      extra = " (rank 0 took " + std::to_string(took) + " FIFO tickets, expected " +
              std::to_string(least) + (most > least ? " to " + std::to_string(most) : "") + ")";
    MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
    report(phase, extra);
  }

  /* A many-thread case: rank 0 runs `send`, rank 1 receives `nsig` signals and `nchunks`. */
  template <class Send>
  void chunks(const char* phase, int kind, int nchunks, int nsig, Send send)
  {
    MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
    if (c.rank == 0)
      send();
    else
      recvChunks<<<1, kThreads, 0, s>>>(kind, nchunks, nsig, base, rep);
    KERNELCHECK();
    CUDACHECK(cudaStreamSynchronize(s));
    base += (uint32_t)nchunks;
    MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
    report(phase);
  }
};

/* Destination and source cursors of one phase: regions 256-byte apart, `skew` bytes in. */
struct Cursor {
  uint64_t dst = 0, src = 0;
  Step at(int op, int actor, uint64_t size, uint64_t skew = 0)
  {
    Step st{op, actor, dst + skew, src + skew, size};
    const uint64_t span = (size + skew + 255) & ~255ull;
    dst += span;
    src += span;
    return st;
  }
};

static uint64_t lcg(uint64_t& x)
{
  x = x * 6364136223846793005ull + 1442695040888963407ull;
  return x >> 33;
}

static int runRange(Ctx& c, cudaStream_t s, uint8_t* buf)
{
  int failures = 0;
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  if (c.rank == 0) {
    outOfRange<<<1, 1, 0, s>>>();
    KERNELCHECK();
    CUDACHECK(cudaStreamSynchronize(s));
    const mscclppResult_t async = awaitAsyncError(c, 5);
    const bool ok = async == mscclppInvalidArgument;
    printf("direct range: the proxy refused the put: %s (%s)\n", ok ? "ok" : "FAILED",
           mscclppGetErrorString(async));
    failures += !ok;
  }
  /* The refusal aborts the communicator and tells the peer (as a lost peer), which poisons the
   * bootstrap: this barrier then fails on both ranks, but only once rank 0 has aborted, after
   * the refusal, so it still orders rank 1's check after it. */
  const mscclppResult_t bar = mscclppBootstrapBarrier(c.comm);
  printf("direct range: rank %d: barrier after the refusal: %s\n", c.rank,
         mscclppGetErrorString(bar));
  if (c.rank == 1) {
    std::vector<uint8_t> tail(8 + kCanary);
    CUDACHECK(cudaMemcpy(tail.data(), buf + kBuf - 8, tail.size(), cudaMemcpyDeviceToHost));
    size_t changed = 0;
    for (size_t i = 0; i < tail.size(); i++) changed += tail[i] != (i < 8 ? 0x11 : 0xC5);
    printf("direct range: rank 1's last 8 bytes and the 4 KiB after its buffer untouched: %s\n",
           changed ? "FAILED" : "ok");
    failures += changed != 0;
  }
  const mscclppResult_t stop = mscclppProxyStop(c.comm);
  /* Rank 0's stop returns its refusal; rank 1's the abort its peer told it of. */
  if (stop != mscclppInvalidArgument && stop != mscclppRemoteError) failures++;
  CUDACHECK(cudaDeviceSynchronize());
  MSCCLPPCHECK(mscclppCommDestroy(c.comm));
  return failures;
}

int main(int argc, char** argv)
{
  Ctx c;
  setupRank(c, &argc, argv);
  if (c.nranks != 2) {
    fprintf(stderr, "direct runs on exactly 2 ranks\n");
    return 2;
  }
  const char* which = flagValue(argc, argv, "--case");
  uint8_t* buf = nullptr;
  CUDACHECK(cudaMalloc(&buf, kBuf + kCanary));
  CUDACHECK(cudaMemset(buf, 0x11, kBuf));
  CUDACHECK(cudaMemset(buf + kBuf, 0xC5, kCanary));
  connectPeers(c, buf, kBuf, {1 - c.rank});
  cudaStream_t s;
  CUDACHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  if (which != nullptr && strcmp(which, "range") == 0) {
    const int failures = runRange(c, s, buf);
    if (c.rank == 0) printf("direct range: %s\n", failures ? "FAILED" : "PASSED");
    return failures ? 1 : 0;
  }

  mscclppDevConn_t* hc = nullptr;
  MSCCLPPCHECK(mscclppGetDeviceConnection(c.comm, 1 - c.rank, 0, &hc));
  Run run{c, *hc, s, nullptr, nullptr};
  CUDACHECK(cudaMalloc(&run.rep, sizeof(Report)));
  CUDACHECK(cudaMemset(run.rep, 0, sizeof(Report)));
  CUDACHECK(cudaMalloc(&run.dsteps, 4096 * sizeof(Step)));
  run.limit = run.epochWord(MSCCLPP_EPOCH_DIRECT_BYTES);
  const uint64_t T = run.limit, B = T ? run.epochWord(MSCCLPP_EPOCH_DIRECT_BLOCK_BYTES) : 0;
  if (c.rank == 0)
    printf("direct: the connection's direct limit is %llu bytes, %llu for a block%s\n",
           (unsigned long long)T, (unsigned long long)B,
           T ? "" : " (off: every operation through the proxy; ticket checks skipped)");
  /* Sizes that fit the direct path, whatever T is (T 0: they all go through the proxy). */
  const uint64_t small = T ? (T < 64 ? T : 64) : 64;
  const uint64_t big = 4ull << 20;

  { /* direct only */
    Cursor k;
    std::vector<Step> st;
    for (uint64_t n : {1ull, 7ull, 8ull, 15ull, 16ull, 100ull, T ? T - 1 : 9ull, T ? T : 33ull})
      st.push_back(k.at(kPutSig, 0, n ? n : 1, n % 5));
    st.push_back(k.at(kSignal, 0, 0));
    st.push_back(k.at(kPut, 0, small, 3));
    st.push_back(k.at(kSignal, 0, 0));
    st.push_back(k.at(kPut, 0, small, 0));
    st.push_back(k.at(kPutSigFlush, 0, small, 1));
    st.push_back(k.at(kFlush, 0, 0));
    run.steps("direct only", st, false, 0, 0);
  }
  if (T > 0) { /* threshold */
    Cursor k;
    run.steps("threshold T", {k.at(kPutSig, 0, T), k.at(kFlush, 0, 0)}, false, 0, 0);
    /* The put a trigger; the flush one more unless the put was already seen complete. */
    run.steps("threshold T + 1", {k.at(kPutSig, 0, T + 1), k.at(kFlush, 0, 0)}, false, 1, 2);
  }
  { /* direct after proxied */
    Cursor k;
    run.steps("direct after proxied", {k.at(kPut, 0, big), k.at(kPutSig, 0, small)}, false);
    Cursor k2;
    run.steps("direct after completed",
              {k2.at(kPut, 0, big), k2.at(kAwaitIdle, 0, 0), k2.at(kPutSig, 0, small, 5)}, false);
    Cursor k3;
    run.steps("signal after proxied",
              {k3.at(kPutSig, 0, big), k3.at(kPutSig, 0, small), k3.at(kPut, 0, big, 8),
               k3.at(kSignal, 0, 0)},
              false);
  }
  { /* proxied after direct */
    Cursor k;
    run.steps("proxied after direct",
              {k.at(kPutSig, 0, small), k.at(kPutSig, 0, big), k.at(kPut, 0, small, 1),
               k.at(kPutSig, 0, big, 16), k.at(kPut, 0, small), k.at(kPutSigFlush, 0, big)},
              false);
  }
  { /* overlap: the later put's bytes stay */
    std::vector<Step> st;
    st.push_back({kPut, 0, 4096, 0, small});                    /* direct */
    st.push_back({kPutSig, 0, 0, 1 << 20, big});                /* proxied, covers it */
    st.push_back({kPut, 0, 8ull << 20, 6ull << 20, big});       /* proxied */
    st.push_back({kPutSig, 0, (8ull << 20) + 1000, 12ull << 20, small}); /* into its middle */
    st.push_back({kPut, 0, (8ull << 20) + 5000, (12ull << 20) + 4096, big / 2}); /* again over it */
    st.push_back({kAwaitIdle, 0, 0, 0, 0});
    st.push_back({kPutSig, 0, (8ull << 20) + 6000, 15ull << 20, small}); /* direct */
    run.steps("overlap", st, true);
  }
  { /* around the threshold */
    Cursor k;
    std::vector<Step> st;
    const uint64_t t = T ? T : 4096; /* the library's default (src/config.rs P2P_DIRECT_BYTES) */
    const uint64_t sizes[] = {1, 3, 8, 15, 16, 17, t - 1, t, t + 1, t / 2 + 5, 2 * t, 4096 + 3};
    int i = 0;
    for (uint64_t n : sizes) {
      st.push_back(k.at(i % 3 == 2 ? kPut : kPutSig, 0, n, (uint64_t)(i * 3) % 17));
      i++;
    }
    st.push_back(k.at(kSignal, 0, 0));
    run.steps("around the threshold", st, false);
  }
  { /* block puts */
    const uint64_t b = B ? (B < (2u << 20) ? B : 2u << 20) : 1u << 20; /* fits the buffer */
    Cursor k;
    std::vector<Step> st;
    for (uint64_t n : {(uint64_t)1, (uint64_t)17, (uint64_t)4099, (uint64_t)65536, b - 1, b})
      st.push_back(k.at(kPutSigBlock, 0, n, n % 7));
    st.push_back(k.at(kPutBlock, 0, 1000, 1));
    st.push_back(k.at(kSignal, 0, 0));
    st.push_back(k.at(kPutBlock, 0, 3000, 2));
    st.push_back(k.at(kPutSigFlush, 0, small, 1));
    st.push_back(k.at(kFlush, 0, 0));
    /* With a block limit, all of them direct (only the flush could take a ticket: none). */
    run.steps("block puts, direct", st, false, B >= b ? 0 : -1, B >= b ? 0 : -1);
    Cursor k2;
    run.steps("block put over the limit",
              {k2.at(kPutSigBlock, 0, B ? B + 1 : 4096), k2.at(kFlush, 0, 0)}, false, B ? 1 : -1, 2);
    Cursor k3;
    run.steps("block after proxied",
              {k3.at(kPut, 0, big), k3.at(kPutSigBlock, 0, 65536, 3), k3.at(kPutSig, 0, big, 8),
               k3.at(kPutSigBlock, 0, 100), k3.at(kPut, 0, small), k3.at(kPutSigBlock, 0, 70000, 1)},
              false);
    std::vector<Step> ov; /* into each other's bytes: the later put's stay */
    ov.push_back({kPutBlock, 0, 0, 0, 65536});
    ov.push_back({kPutSig, 0, 1000, 1 << 20, big});         /* proxied, over it */
    ov.push_back({kPutSigBlock, 0, 5000, 6ull << 20, 20000}); /* into its middle */
    ov.push_back({kPut, 0, 6000, (7ull << 20), small});       /* a thread's into that */
    ov.push_back({kPutSigBlock, 0, 9000, 8ull << 20, 70000});
    run.steps("block overlap", ov, true);
  }
  run.chunks("16 blocks, 16 signals", 4, 16, 16, [&] {
    blocksPutWithSignalBlock<<<16, kThreads, 0, s>>>(run.base);
  });
  run.chunks("block put, then a thread's signal", 5, 1, 1, [&] {
    blockPutThenThreadSignal<<<1, kThreads, 0, s>>>(run.base);
  });
  run.chunks("512 threads, 1 signal", 0, 512, 1, [&] {
    manyPutsOneSignal<<<1, 512, 0, s>>>(run.base);
  });
  run.chunks("8 blocks, 8 signals", 1, 8 * 128, 8, [&] {
    blocksPutThenSignal<<<8, 128, 0, s>>>(run.base);
  });
  run.chunks("1024 signals", 2, 8 * 128, 8 * 128, [&] {
    everyThreadSignals<<<8, 128, 0, s>>>(run.base);
  });
  run.chunks("both paths at once", 3, 132, 132, [&] {
    bothPathsAtOnce<<<4, 64, 0, s>>>(run.base);
  });
  { /* raw push: none of the methods after it may overtake it */
    Cursor k;
    run.steps("raw push, then signal", {k.at(kRawPush, 0, big), k.at(kSignal, 0, 0)}, false);
    Cursor k2;
    run.steps("raw pushPut, then pws",
              {k2.at(kRawPushPut, 0, big), k2.at(kPutSig, 0, small, 3)}, false);
    Cursor k3;
    run.steps("raw push, then pwsf",
              {k3.at(kRawPush, 0, big), k3.at(kPutSigFlush, 0, small, 5)}, false);
    Cursor k4;
    run.steps("raw push, then block",
              {k4.at(kRawPushPut, 0, big), k4.at(kPutSigBlock, 0, 1000, 1)}, false);
    std::vector<Step> ov; /* a small put into the raw put's bytes: the later one stays */
    ov.push_back({kRawPush, 0, 0, 1 << 20, big});
    ov.push_back({kPut, 0, 4096, 6ull << 20, small});
    ov.push_back({kSignal, 0, 0, 0, 0});
    run.steps("raw push, then a put over", ov, true);
    /* flush(), then a put whose source is the raw put's: the raw put read it before. */
    std::vector<Step> fl;
    fl.push_back({kRawPush, 0, 0, 1 << 20, big});
    fl.push_back({kFlush, 0, 0, 0, 0});
    fl.push_back({kPutSig, 0, 8ull << 20, 1 << 20, small});
    run.steps("raw push, flush, reuse", fl, false);
  }
  { /* rounds: ping-pong, every kind of operation and size, both ranks sending in turn */
    uint64_t x = 12345;
    const uint64_t sizes[] = {1, 8, 13, 64, T ? T : 512, T + 1, 4096 + 7, 65536, 1ull << 20};
    std::vector<Step> st;
    for (int r = 0; r < 300; r++) {
      const int actor = r % 2;
      Cursor k; /* the peer checked this actor's last round before this one starts */
      const int ops = 1 + (int)(lcg(x) % 3);
      for (int o = 0; o < ops; o++) {
        const bool last = o == ops - 1;
        const uint64_t n = sizes[lcg(x) % 9];
        const int pick = (int)(lcg(x) % 5);
        int op = last ? (pick == 0 ? kSignal : pick == 1 ? kPutSigFlush : pick == 4 ? kPutSigBlock : kPutSig)
                      : (pick == 0 ? kPut : pick == 1 ? kFlush : pick == 4 ? kPutBlock : kPutSig);
        st.push_back(k.at(op, actor, hasData(op) ? n : 0, lcg(x) % 9));
      }
    }
    run.steps("300 rounds", st, false);
  }

  /* Every signal counted once: our count (both words) equals our waits, and with the direct
   * path both words moved. */
  const uint64_t proxied = run.epochWord(1), waits = run.epochWord(2),
                 direct = run.epochWord(MSCCLPP_EPOCH_DIRECT);
  const bool counted = proxied + direct == waits && (T == 0 || (proxied > 0 && direct > 0));
  printf("direct counts, rank %d: proxy %llu + direct %llu, waits %llu: %s\n", c.rank,
         (unsigned long long)proxied, (unsigned long long)direct, (unsigned long long)waits,
         counted ? "ok" : "FAILED");
  int failures = run.failures + !counted;
  failures += teardown(c);
  CUDACHECK(cudaFree(run.rep));
  CUDACHECK(cudaFree(run.dsteps));
  CUDACHECK(cudaFree(buf));
  CUDACHECK(cudaStreamDestroy(s));
  if (c.rank == 0) printf("direct %s: %s\n", which ? which : "ordering", failures ? "FAILED" : "PASSED");
  return failures ? 1 : 0;
}
