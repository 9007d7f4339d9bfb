/*
 * The P2P transport's SM copy engine: a kernel that stays resident while the proxy is busy and
 * executes copy jobs and flag writes that the proxy posts into a ring in pinned host memory.
 *
 * Why: on the machines measured (bench/RESULTS.md, "driver costs"), a copy-engine copy takes
 * 7-9 us from its submission to its completion, even for 8 bytes: the stream front end, not
 * the transfer. A kernel that is already running reads a job from host memory in ~1 us and
 * moves 512 KiB over NVLink in ~1.5 us, so puts up to a few MiB and signals go through here,
 * and larger puts through the copy engines (src/transport/p2p/engine.rs decides).
 *
 * This file is the source of p2p_engine.ptx (scripts/gen-ptx.sh), which the library embeds
 * and loads at run time: the Rust library has no CUDA compiler at build time.
 *
 * Protocol (host side: src/transport/p2p/engine.rs):
 * - ring[k % ringSize] (pinned host memory, 64-byte slots) holds job k (k = 1, 2, ...). The
 *   proxy writes the fields, then `seqEnd` and `seq` = k with release stores; it posts job k
 *   only once job k - ringSize is done. Block 0's first warp reads a whole slot in one load
 *   (a host read costs ~1.2 us; six dependent ones made every job ~8 us). The GPU may fetch
 *   the slot as two 32-byte sectors taken at different times: each holds one of the two
 *   sequence numbers, written after every field, so a slot whose both read k is complete.
 * - Block 0 alone reads host memory (one thread, one read in flight: on the machines measured,
 *   more readers of host memory slowed every GPU access to it, the user's FIFO pushes too). It
 *   runs the jobs in order. A job of at most soloBytes (a flag alone has size 0) it copies
 *   itself; a larger one it hands to the whole grid through device memory (dev[] below) and
 *   copies its share, then waits until every other block reports it done.
 * - After job k's bytes are written, block 0 fences (system scope), then writes the job's flag
 *   (if any) into the peer's memory and ctrl[DONE] = k: a reader that sees either sees all of
 *   job k's bytes and all earlier jobs'. The flag may land after DONE (no second fence on the
 *   common path); a job of size 0 without a flag is a barrier whose DONE also orders every
 *   earlier flag (the proxy posts one before a flag of the same peer goes another way). Jobs
 *   never overlap in time, so a later put's bytes are the ones that stay.
 * - A job's `done` (non-zero) is stored at doneAddr (the FIFO's done word in device memory)
 *   after its flag: the proxy's claim that every trigger below that value has completed once
 *   this job has, which the producer's flush() polls on this GPU (src/fifo/mod.rs, done_word).
 * - ctrl[STOP] != 0 (written by the proxy only when every posted job is done) ends block 0,
 *   which passes STOP on to the others.
 * - At start every block checks in; block 0 then writes ctrl[ALIVE] = `launch`, after which
 *   the proxy may post jobs: all blocks are resident, so none can be starved of an SM by the
 *   user's kernels while a job waits for it.
 *
 * dev[] (device memory, zeroed by the proxy before each launch): [0] the last grid job handed
 * out (or kStop), [1] grid-job completions by blocks other than 0, [2..4] the grid job's dst,
 * src and size, [7] check-ins.
 */

struct Job {
  unsigned long long seq;
  unsigned long long dst;
  unsigned long long src;
  unsigned long long size;
  unsigned long long flagAddr; /* 0: no flag */
  unsigned long long flagValue;
  unsigned long long done; /* 0: none; else stored at doneAddr after the job (see below) */
  unsigned long long seqEnd;
};

enum { CTRL_STOP = 0, CTRL_ALIVE = 1, CTRL_DONE = 2, CTRL_STATS = 8 };
enum { DEV_POSTED = 0, DEV_FINISHED = 1, DEV_JOB = 2, DEV_CHECKIN = 7 };
static const unsigned long long kStop = ~0ull;
/* Host-memory polls between two looks at ctrl[STOP]. */
static const unsigned kStopCheck = 64;

__device__ __forceinline__ unsigned long long loadAcquireGpu(const unsigned long long* p)
{
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long loadVolatile(const unsigned long long* p)
{
  unsigned long long v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void storeReleaseSys(unsigned long long* p, unsigned long long v)
{
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void storeRelaxedSys(unsigned long long* p, unsigned long long v)
{
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* Release and acquire at system scope (MEMBAR.ALL.SYS): what the engine needs, and lighter
 * than __threadfence_system(), which is fence.sc.sys (MEMBAR.SC.SYS). */
__device__ __forceinline__ void fenceAcqRelSys()
{
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

__device__ __forceinline__ unsigned long long globalTimerNs()
{
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void storeReleaseGpu(unsigned long long* p, unsigned long long v)
{
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* This block's share of a copy: 16-byte words i = first, first + stride, ... (the proxy routes
 * only 16-byte aligned addresses here), four loads in flight per thread before their stores
 * (NVLink latency is long); the tail bytes by whoever has first == threadIdx.x (block 0). */
__device__ __forceinline__ void copyShare(unsigned long long dst, unsigned long long src,
                                          unsigned long long size, unsigned long long first,
                                          unsigned long long stride)
{
  const unsigned long long words = size / 16;
  const int4* s = reinterpret_cast<const int4*>(src);
  int4* d = reinterpret_cast<int4*>(dst);
  unsigned long long i = first;
  for (; i + 3 * stride < words; i += 4 * stride) {
    const int4 a = s[i], b = s[i + stride], c = s[i + 2 * stride], e = s[i + 3 * stride];
    d[i] = a;
    d[i + stride] = b;
    d[i + 2 * stride] = c;
    d[i + 3 * stride] = e;
  }
  for (; i < words; i += stride) d[i] = s[i];
  if (first == threadIdx.x)
    for (unsigned long long b = words * 16 + threadIdx.x; b < size; b += blockDim.x)
      reinterpret_cast<unsigned char*>(dst)[b] = reinterpret_cast<const unsigned char*>(src)[b];
}

extern "C" __global__ void __launch_bounds__(1024)
  mscclpp_p2p_engine(const Job* ring, unsigned long long* ctrl, unsigned long long* dev,
                     unsigned int ringSize, unsigned long long first, unsigned long long launch,
                     unsigned long long soloBytes, unsigned int pollSleepNs,
                     unsigned long long* doneAddr, unsigned int timing)
{
  __shared__ unsigned long long job[6]; /* dst, src, size, flagAddr, flagValue, done */
  __shared__ int go;
  const unsigned long long others = gridDim.x - 1;

  if (threadIdx.x == 0) {
    atomicAdd(&dev[DEV_CHECKIN], 1ull);
    if (blockIdx.x == 0) {
      /* Ends when every block of this grid is resident (they all become so: nothing else
       * waits on this kernel before ALIVE is written). */
      while (loadVolatile(&dev[DEV_CHECKIN]) < gridDim.x) {
      }
      storeReleaseSys(&ctrl[CTRL_ALIVE], launch);
    }
  }

  if (blockIdx.x != 0) {
    /* A worker: grid jobs g = 1, 2, ... as block 0 hands them out. */
    for (unsigned long long g = 1;; g++) {
      if (threadIdx.x == 0) {
        unsigned long long p;
        /* Ends when block 0 hands out grid job g, or passes STOP on. Device memory (L2). */
        while ((p = loadAcquireGpu(&dev[DEV_POSTED])) < g) {
        }
        go = p != kStop;
        if (go) {
          /* Plain loads, all three in flight at once (strong ones would each wait for the one
           * before): the acquire load of DEV_POSTED above orders them after block 0's stores
           * of these fields, and keeps them from hitting stale L1 lines. */
          job[0] = dev[DEV_JOB];
          job[1] = dev[DEV_JOB + 1];
          job[2] = dev[DEV_JOB + 2];
        }
      }
      __syncthreads();
      if (!go) return;
      copyShare(job[0], job[1], job[2], (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x,
                (unsigned long long)gridDim.x * blockDim.x);
      __syncthreads();
      if (threadIdx.x == 0) {
        /* Release this block's writes (ordered before thread 0 by the barrier) to the whole
         * system: pairs with block 0's fence once it counted every block done. */
        fenceAcqRelSys();
        atomicAdd(&dev[DEV_FINISHED], 1ull);
      }
      /* `job` is rewritten by thread 0 for the next grid job. */
      __syncthreads();
    }
  }

  /* Block 0: the sequencer. */
  unsigned long long grid = 0;
  /* Thread 0's timing sums (see CTRL_STATS): grid jobs ns, count, others ns, count, then the
   * grid jobs' phases: read -> block 0's share copied, -> every worker done, -> fenced. */
  unsigned long long stat[7] = {0, 0, 0, 0, 0, 0, 0};
  for (unsigned long long k = first;; k++) {
    if (threadIdx.x < 32) {
      /* Warp 0: lane w reads word w of the slot, all in one request. */
      const unsigned lane = threadIdx.x;
      const unsigned long long* slot =
        reinterpret_cast<const unsigned long long*>(&ring[k % ringSize]);
      int ok = 0;
      unsigned long long v = 0;
      /* Ends when job k is posted, or when the proxy asks to stop (only once every posted job
       * is done, so never in the middle of one). One host read in flight. */
      for (unsigned polls = 1;; polls++) {
        if (lane < 8) v = loadVolatile(&slot[lane]);
        const unsigned long long s0 = __shfl_sync(0xffffffffu, v, 0);
        const unsigned long long s1 = __shfl_sync(0xffffffffu, v, 7);
        if (s0 == k && s1 == k) {
          ok = 1;
          break;
        }
        /* Host reads compete with the GPU's own fetches from host memory (its command
         * buffers): a pause between polls trades job latency for the user's launch latency. */
        if (pollSleepNs != 0) __nanosleep(pollSleepNs);
        if (polls % kStopCheck == 0) {
          unsigned long long stop = 0;
          if (lane == 0) stop = loadVolatile(&ctrl[CTRL_STOP]);
          if (__shfl_sync(0xffffffffu, stop, 0) != 0) break;
        }
      }
      /* Fields of the same read as the sequence numbers: lanes 1-6 hold dst .. done. */
      if (ok && lane >= 1 && lane <= 6) job[lane - 1] = v;
      __syncwarp();
      if (lane == 0) {
        if (ok) {
          if (job[2] > soloBytes) {
            /* Hand it to the grid: the fields, then (release) the grid job number the workers
             * wait for. Every worker finished grid job `grid` (counted below) so none still
             * reads the fields being replaced. */
            dev[DEV_JOB] = job[0];
            dev[DEV_JOB + 1] = job[1];
            dev[DEV_JOB + 2] = job[2];
            storeReleaseGpu(&dev[DEV_POSTED], ++grid);
          }
        } else {
          storeReleaseGpu(&dev[DEV_POSTED], kStop);
        }
        go = ok;
      }
    }
    __syncthreads();
    if (!go) return;
    const unsigned long long tSeen = threadIdx.x == 0 ? globalTimerNs() : 0;
    const bool solo = job[2] <= soloBytes;
    copyShare(job[0], job[1], job[2], threadIdx.x, solo ? blockDim.x : (unsigned long long)gridDim.x * blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
      const unsigned long long tCopied = globalTimerNs();
      if (!solo) {
        /* Ends when every worker finished this grid job (each does, unconditionally). */
        while (loadVolatile(&dev[DEV_FINISHED]) < grid * others) {
        }
      }
      const unsigned long long tJoined = globalTimerNs();
      /* Acquire the workers' writes and release ours (ordered before thread 0 by the barrier)
       * before the flag and DONE. A flag alone, or a done word alone, needs no fence: every
       * earlier job's bytes were released before that job's DONE. A barrier job (nothing at
       * all) fences so that the earlier flags are delivered before its DONE. */
      if (job[2] != 0 || (job[3] == 0 && job[5] == 0)) fenceAcqRelSys();
      if (job[3] != 0) storeRelaxedSys(reinterpret_cast<unsigned long long*>(job[3]), job[4]);
      /* The FIFO's done word (src/fifo/mod.rs, Fifo::done_word): after the fence like the flag.
       * Values only grow: the proxy hands them out in job order. The producer's flush() polls
       * it, then fences (acquire). */
      if (job[5] != 0 && doneAddr != nullptr) storeRelaxedSys(doneAddr, job[5]);
      storeRelaxedSys(&ctrl[CTRL_DONE], k);
      /* Time from the job's read to its DONE, summed in registers and stored (posted writes,
       * never read back over PCIe) for the proxy's MSCCLPP_P2P_STATS=1 report: only then
       * (`timing`), so that seven more host stores do not follow every job otherwise. */
      if (timing != 0) {
        const unsigned long long tEnd = globalTimerNs();
        if (solo) {
          stat[2] += tEnd - tSeen;
          stat[3] += 1;
        } else {
          stat[0] += tEnd - tSeen;
          stat[1] += 1;
          stat[4] += tCopied - tSeen;
          stat[5] += tJoined - tCopied;
          stat[6] += tEnd - tJoined;
        }
        for (int i = 0; i < 7; i++) storeRelaxedSys(&ctrl[CTRL_STATS + i], stat[i]);
      }
    }
    /* `job` and `go` are rewritten by thread 0 at the top of the next round. */
    __syncthreads();
  }
}
