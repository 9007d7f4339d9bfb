/*
 * mscclpp/device.h: C++ and CUDA support for the methods of the shared structs.
 *
 * mscclpp.h includes this file (C++ only) before it declares the structs; do not include it
 * directly. It defines the function qualifiers of the methods and declares what the methods'
 * bodies call before the structs exist:
 *   - MSCCLPP_HOST_DEVICE_INLINE: `__host__ __device__ __forceinline__` under nvcc, `inline`
 *     in plain C++; MSCCLPP_DEVICE_INLINE likewise for device-only helpers.
 *   - mscclpp::host::*: the host paths of the mscclppDevConn methods. They call the C
 *     functions mscclppDevConnPut() etc., so they are defined in mscclpp/host.h, which
 *     mscclpp.h includes after those prototypes.
 *   - mscclpp::device::*: the memory operations of the device paths (CUDA only).
 *
 * Device paths (__CUDA_ARCH__): the trigger-FIFO producer of docs/DESIGN.md ("The life of a trigger"):
 * mscclppConcurrentFifo::push() in mscclpp/fifo_methods.inc and the mscclppDevConn methods
 * in mscclpp/devconn_methods.inc.
 *
 * Where the FIFO lives (set up by the library, src/fifo/ and src/cuda/):
 *   - triggerFifo: the slots, in pinned host memory mapped into the GPU. A trigger is one
 *     16-byte store that crosses PCIe as a posted write; the proxy polls its own memory.
 *   - triggerFifoTail[0]: the proxy's published tail, triggerFifoTail[1]: the abort word,
 *     both in that same pinned host memory: reading them costs the GPU a PCIe round trip.
 *     triggerFifoTail[8..16], the next cache line: the wait record, where a device wait that
 *     has lasted says what it waits for (WaitWatch below).
 *   - triggerFifoHead[0]: the ticket counter, triggerFifoHead[1]: a cache of the tail, both
 *     in device memory. push() takes its ticket and checks for room there; it reads the real
 *     tail only when the cache says the FIFO is full, and then refreshes the cache. Measured
 *     on 2x H200 (c_examples/cuda/pingpong): a load of the host tail 1.07-1.21 us, of the
 *     device cache 0.16 us, so a host tail read by every push would double its cost (a
 *     signal() push measured 1.5-1.7 us back to back); a device-memory tail written by the
 *     proxy would cost it a driver call (~2 us measured for cuStreamWriteValue64) per update.
 *     triggerFifoHead[2]: the done word, triggerFifoHead[3]: its switch, device memory too: a
 *     transport working on this GPU (the P2P SM copy engine) stores "every ticket below d has
 *     completed" there, and flush() ends on it without a round trip through the proxy; the
 *     P2P direct path reads it to know a connection's proxied work complete.
 *     triggerFifoHead[4]: flush()'s poll hint; [5..7]: the bounds of device waits and the
 *     owner of the wait record (WaitWatch below); [8]: 1 + the ticket of the last trigger
 *     with work that fifo.push()/pushPut() queued when called directly, not through a
 *     connection's method (MSCCLPP_FIFO_DEV_RAW: no connection goes direct until the done
 *     word passed it); [9]: 1 + the highest ticket a push gave up on the abort without
 *     writing its slot (MSCCLPP_FIFO_DEV_ABANDONED: no wait reports completion while set).
 *     Who may change each word, and what a reader may conclude from it: docs/DESIGN.md 5.1.
 *   - localSignalEpochId / waitEpochId: the connection's epoch block, device memory of the
 *     buffer's GPU (words: MSCCLPP_EPOCH_* in mscclpp.h). wait() polls it in L2: word 1
 *     (`proxy`), where the peer's SM copy engine or copy engine stores the count of the
 *     signals its proxy carried, and word 3, where the peer's kernels add the signals they
 *     stored themselves (the direct path, P2P: include/mscclpp/devconn_methods.inc). Words
 *     4..7, written at setup, read through the read-only cache: the direct path's limits (a
 *     thread's, a block's) and the buffer sizes; words 8..10: this side's direct-path and
 *     wait state.
 */
#ifndef MSCCLPP_DEVICE_H_
#define MSCCLPP_DEVICE_H_

#ifndef __cplusplus
#error "mscclpp/device.h is C++/CUDA only: include mscclpp.h"
#endif

#include <stdint.h>

#if defined(__CUDACC__)
#define MSCCLPP_HOST_DEVICE_INLINE __host__ __device__ __forceinline__
#define MSCCLPP_DEVICE_INLINE __device__ __forceinline__
#else
#define MSCCLPP_HOST_DEVICE_INLINE inline
#define MSCCLPP_DEVICE_INLINE inline
#endif

struct mscclppDevConn;

namespace mscclpp {
namespace host {

/* Host paths of the mscclppDevConn methods, for connections over host memory (defined in
 * mscclpp/host.h). A failure is logged and kept for mscclppGetLastError(); code that needs
 * the result code calls the C function (mscclppDevConnPut() etc.) instead. */
inline void put(mscclppDevConn* conn, uint64_t dstDataOffset, uint64_t srcDataOffset,
                uint64_t dataSize);
inline void signal(mscclppDevConn* conn);
inline void putWithSignal(mscclppDevConn* conn, uint64_t dstDataOffset, uint64_t srcDataOffset,
                          uint64_t dataSize);
inline void putWithSignalAndFlush(mscclppDevConn* conn, uint64_t dstDataOffset,
                                  uint64_t srcDataOffset, uint64_t dataSize);
inline void flush(mscclppDevConn* conn);
inline void wait(mscclppDevConn* conn);

} // namespace host

#if defined(__CUDACC__)
namespace device {

/* Spin loops read the abort word (a PCIe read) once every this many polls: polls of host
 * memory are slow already, polls of device memory are cheap and need it rarely. */
constexpr uint32_t kAbortCheckSysmem = 16;
constexpr uint32_t kAbortCheckDevice = 1024;
/* pollEither(), device-first: device reads per host read. */
constexpr uint32_t kDevicePolls = 15;

/* A load that is never cached in L1 or kept in a register: sees other agents' stores. */
MSCCLPP_DEVICE_INLINE uint64_t loadVolatile(const uint64_t* p)
{
  return *reinterpret_cast<const volatile uint64_t*>(p);
}

/* A fence at system scope with acquire and release semantics: as a release before a store,
 * it makes every earlier write of this thread (and, through a barrier, of its block) visible
 * to the CPU and to copy engines before that store; as an acquire after a poll, it keeps
 * later loads from reading older data than the poll saw (and drops stale L1 lines). */
MSCCLPP_DEVICE_INLINE void fenceAcqRelSys()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#else
  __threadfence_system();
#endif
}

/* Both words of a trigger in one 16-byte store, so the proxy never sees half a trigger
 * written by one thread. `slot` must be 16-byte aligned global (or host-mapped) memory. */
MSCCLPP_DEVICE_INLINE void storeTrigger(uint64_t* slot, uint64_t w0, uint64_t w1)
{
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(slot), "l"(w0), "l"(w1)
               : "memory");
}

/* What ended a pollEither(). */
enum class Polled { Device, Host, Stopped };

/* Waits until `deviceReady()` (a read of device memory, ~0.16 us) or `hostReady()` (a read of
 * pinned host memory: a PCIe round trip, ~1.1 us on H200) returns true, or `stop()` does
 * (called once every kAbortCheckSysmem rounds: the abort word is a host read too).
 *
 * A thread's host read holds up its later loads until it returns (measured on 2x H200: six
 * device reads queued behind each slot read made an empty flush() 1.6 us slower than reading
 * the slot alone), so the two cannot overlap and the loop chooses whom to watch closely:
 * host-first (`hostFirst`: the host word ended the last wait of this kind) reads host memory
 * every round and device memory every other round; device-first reads device memory
 * kDevicePolls times per host read. Callers keep the hint in device memory (updatePollHint).
 * Ends when one of the three does. */
template <class DeviceReady, class HostReady, class Stop>
MSCCLPP_DEVICE_INLINE Polled pollEither(bool hostFirst, DeviceReady deviceReady,
                                        HostReady hostReady, Stop stop)
{
  for (uint32_t round = 1;; round++) {
    if (hostFirst) {
      if (hostReady()) return Polled::Host;
      if ((round & 1) == 0 && deviceReady()) return Polled::Device;
    } else {
      for (uint32_t i = 0; i < kDevicePolls; i++)
        if (deviceReady()) return Polled::Device;
      if (hostReady()) return Polled::Host;
    }
    if (round % kAbortCheckSysmem == 0 && stop()) return Polled::Stopped;
  }
}

/* Records in `*hint` (device memory; racing writers only disturb a heuristic) whether the
 * host word ended the last pollEither(); a store only when it changes. */
MSCCLPP_DEVICE_INLINE void updatePollHint(uint64_t* hint, bool hostFirst, Polled how)
{
  if (how == Polled::Stopped || hostFirst == (how == Polled::Host)) return;
  *reinterpret_cast<volatile uint64_t*>(hint) = how == Polled::Host ? 1 : 0;
}

MSCCLPP_DEVICE_INLINE void storeVolatile(uint64_t* p, uint64_t v)
{
  *reinterpret_cast<volatile uint64_t*>(p) = v;
}

/* An acquire load at system scope: later loads and stores of this thread come after it, and
 * after every write that a release before the value it reads made visible. Cheaper than a
 * fence (it does not wait for this thread's earlier stores). */
MSCCLPP_DEVICE_INLINE uint64_t loadAcquireSys(const uint64_t* p)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  const uint64_t v = loadVolatile(p);
  __threadfence_system();
  return v;
#endif
}

/* A load through the read-only data cache (ld.global.nc): only for words that no one writes
 * while any kernel that reads them runs (the direct path's settings, written at setup). */
MSCCLPP_DEVICE_INLINE uint64_t loadReadOnly(const uint64_t* p)
{
  uint64_t v;
  asm("ld.global.nc.u64 %0, [%1];" : "=l"(v) : "l"(p));
  return v;
}

/* Adds 1 to a u64 at system scope without waiting for the result (a reduction: the store
 * travels like a posted write): a P2P peer's direct signal count, which several threads may
 * add to at once, each after its own release fence. Relaxed: the caller fences first. */
MSCCLPP_DEVICE_INLINE void addOneSys(uint64_t* p)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("red.relaxed.sys.global.add.u64 [%0], 1;" ::"l"(p) : "memory");
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 600
  atomicAdd_system(reinterpret_cast<unsigned long long*>(p), 1ull);
#else
  atomicAdd(reinterpret_cast<unsigned long long*>(p), 1ull); /* no system scope before sm_60 */
#endif
}

/* Copies the whole words of type W at the start of [src, src + n) to dst (both aligned to W)
 * by thread `t` of `nt` threads together: word i goes by thread i % nt, each thread with
 * kInFlight loads before their stores; returns the bytes copied (by all of them). */
template <typename W, int kInFlight>
MSCCLPP_DEVICE_INLINE uint64_t copyWordsBy(char* dst, const char* src, uint64_t n, uint32_t t,
                                           uint32_t nt)
{
  const uint64_t words = n / sizeof(W);
  const W* s = reinterpret_cast<const W*>(src);
  W* d = reinterpret_cast<W*>(dst);
  const uint64_t stride = (uint64_t)nt * kInFlight;
  uint64_t i = t;
  for (; i + (uint64_t)(kInFlight - 1) * nt < words; i += stride) {
    W v[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; j++) v[j] = s[i + (uint64_t)j * nt];
#pragma unroll
    for (int j = 0; j < kInFlight; j++) d[i + (uint64_t)j * nt] = v[j];
  }
  for (; i < words; i += nt) d[i] = s[i];
  return words * sizeof(W);
}

/* Copies n bytes from src to dst by thread `t` of `nt` threads together: 16-, 8- or 4-byte
 * words as both addresses allow (16 and 8 with kInFlight loads in flight before their stores
 * in each thread: the source's latency, not the link, bounds a thread), then the rest byte by
 * byte. Plain loads and stores: the caller's release fence (after a barrier, where several
 * threads copied) orders them before the signal that publishes them. */
template <int kInFlight>
MSCCLPP_DEVICE_INLINE void copyBy(char* dst, const char* src, uint64_t n, uint32_t t, uint32_t nt)
{
  const uint64_t both = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  uint64_t done = 0;
  if (both % 16 == 0) {
    done = copyWordsBy<int4, kInFlight>(dst, src, n, t, nt);
  } else if (both % 8 == 0) {
    done = copyWordsBy<uint64_t, kInFlight>(dst, src, n, t, nt);
  } else if (both % 4 == 0) {
    done = copyWordsBy<uint32_t, 1>(dst, src, n, t, nt);
  }
  for (uint64_t i = done + t; i < n; i += nt) dst[i] = src[i];
}

/* A direct put by the calling thread alone (dst is a peer's buffer mapped through CUDA IPC):
 * eight loads in flight. */
MSCCLPP_DEVICE_INLINE void copyThread(char* dst, const char* src, uint64_t n)
{
  copyBy<8>(dst, src, n, 0, 1);
}

/* The calling thread's index in its block, and the block's thread count (any shape). */
MSCCLPP_DEVICE_INLINE uint32_t threadInBlock()
{
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
MSCCLPP_DEVICE_INLINE uint32_t threadsInBlock() { return blockDim.x * blockDim.y * blockDim.z; }

/* A direct put by every thread of the calling block (putBlock()): four loads in flight in
 * each thread, the block's threads together keeping the link busy. */
MSCCLPP_DEVICE_INLINE void copyBlock(char* dst, const char* src, uint64_t n)
{
  copyBy<4>(dst, src, n, threadInBlock(), threadsInBlock());
}

/* %globaltimer: nanoseconds on one clock for the whole GPU (updated about every microsecond),
 * steady across SM clock changes. Read only on the slow path of a wait. */
MSCCLPP_DEVICE_INLINE uint64_t waitClockNs()
{
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* Words of the FIFO that bound device waits. These are mscclpp.h's MSCCLPP_FIFO_DEV_*,
 * MSCCLPP_FIFO_RECORD_WORD and MSCCLPP_RECORD_* (src/abi.rs), which are defined after this
 * file; mscclpp/fifo_methods.inc static_asserts that the two agree. */
constexpr int kDevWarnNs = 5;      /* triggerFifoHead[5]: warn after this many ns (0: never) */
constexpr int kDevLimitNs = 6;     /* triggerFifoHead[6]: end after this many ns (0: never) */
constexpr int kDevRecordOwner = 7; /* triggerFifoHead[7]: 1 while a wait owns the record */
constexpr int kRecordWord = 8;     /* the record: triggerFifoTail[8..16], pinned host memory */
constexpr int kRecSeq = 0, kRecWhat = 1, kRecDirect = 2, kRecWanted = 3, kRecSeen = 4,
              kRecHead = 5, kRecWaitedNs = 6, kRecOthersExpired = 7;
constexpr uint64_t kRecPending = 1, kRecExpired = 2;
constexpr int kRecStateShift = 16; /* the state's place in the record's WHAT word */
/* What an expired wait stores into the abort word (triggerFifoTail[1]): mscclppRemoteError,
 * the code Error::Timeout reports as (static_assert in fifo_methods.inc). */
constexpr uint64_t kAbortExpired = 6;

/* A sequence-locked write of the wait record (src/fifo/mod.rs, Fifo::wait_record): SEQ odd,
 * the fields, SEQ even. Only the record's owner writes, so its own read of SEQ is current. */
MSCCLPP_DEVICE_INLINE void waitRecordWrite(uint64_t* ctrl, uint64_t state, uint64_t what,
                                           uint64_t wanted, uint64_t seen, uint64_t direct,
                                           uint64_t head, uint64_t waited)
{
  uint64_t* rec = ctrl + kRecordWord;
  const uint64_t seq = loadVolatile(rec + kRecSeq);
  storeVolatile(rec + kRecSeq, seq + 1);
  /* The odd SEQ before the fields: pairs with the proxy's Acquire fence before it reads SEQ
   * again, so a read that overlaps this write is discarded. */
  fenceAcqRelSys();
  storeVolatile(rec + kRecWhat, what | state << kRecStateShift);
  storeVolatile(rec + kRecDirect, direct);
  storeVolatile(rec + kRecWanted, wanted);
  storeVolatile(rec + kRecSeen, seen);
  storeVolatile(rec + kRecHead, head);
  storeVolatile(rec + kRecWaitedNs, waited);
  /* The fields before the even SEQ: pairs with the proxy's Acquire load of SEQ. */
  fenceAcqRelSys();
  storeVolatile(rec + kRecSeq, seq + 2);
}

/* The bound and the report of one device wait (docs/DESIGN.md section 5). A spin calls
 * expired() only where it already reads the abort word (its slow path, every
 * kAbortCheckSysmem / kAbortCheckDevice polls), never before the answer's first poll, so a
 * wait that is satisfied at once, or a push with room, runs none of this. The first call
 * notes the time (%globaltimer); each later one compares the clock with the FIFO's bounds
 * (device memory, written when the FIFO was made, read here rather than kept in registers):
 *   - past the warn bound (MSCCLPP_WAIT_TIMEOUT), the first of the FIFO's waits to claim the
 *     record (triggerFifoHead[kDevRecordOwner], a device-scope CAS) writes there what it waits
 *     for; the proxy reports it at WARN (src/proxy/device_wait.rs);
 *   - past the limit (MSCCLPP_DEVICE_WAIT_TIMEOUT; 0: none), the wait marks the record expired
 *     (when another wait owns it: sets kRecOthersExpired), raises the FIFO's abort word and
 *     expired() returns true: the caller ends its wait as on abort. The proxy then fails the
 *     communicator, whose abort releases every other wait.
 * finish(), after a wait that ended normally, withdraws a record it wrote. The clock starts at
 * the first check, at most one check interval after the wait began. */
class WaitWatch {
 public:
  /* `what`: MSCCLPP_WAIT_OP_* | connId << 32; `wanted`: the count or ticket waited for;
   * `seenA`, `seenB` (either may be null): the words whose sum is what has come so far (a
   * wait's two signal counts: seenB the direct one, recorded on its own too, so the hang
   * report counts what the peer's kernels stored themselves as sent), read only when the
   * record is written. */
  MSCCLPP_DEVICE_INLINE bool expired(uint64_t* dev, uint64_t* ctrl, uint64_t what,
                                     uint64_t wanted, const uint64_t* seenA,
                                     const uint64_t* seenB = nullptr)
  {
    const uint64_t now = waitClockNs();
    if (phase_ == kNew) {
      start_ = now;
      phase_ = kTiming;
      return false;
    }
    if (phase_ == kExpired) return true;
    const uint64_t waited = now - start_;
    const uint64_t limit = loadVolatile(dev + kDevLimitNs);
    const bool expire = limit != 0 && waited >= limit;
    if (!expire) {
      /* The owner wrote its record once; a wait that lost the claim (kOther) tries again at
       * each check, so once the owner's wait ends and frees the record, a wait still stuck
       * is the one shown (a CAS, on the slow path only). */
      if (phase_ == kOwner) return false;
      const uint64_t warn = loadVolatile(dev + kDevWarnNs);
      if (warn == 0 || waited < warn) return false;
    }
    const uint64_t direct = seenB != nullptr ? loadVolatile(seenB) : 0;
    const uint64_t seen = (seenA != nullptr ? loadVolatile(seenA) : 0) + direct;
    if (phase_ != kOwner && claim(dev)) phase_ = kOwner;
    if (phase_ == kOwner) {
      waitRecordWrite(ctrl, expire ? kRecExpired : kRecPending, what, wanted, seen, direct,
                      loadVolatile(dev), waited);
    } else if (expire) {
      /* Another wait owns the record: the proxy fails the communicator on this word alone.
       * The fence sends the store on its way before the kernel can end. */
      storeVolatile(ctrl + kRecordWord + kRecOthersExpired, 1);
      fenceAcqRelSys();
    }
    if (!expire) {
      if (phase_ == kTiming) phase_ = kOther; /* another wait's record is shown */
      return false;
    }
    /* Abort this FIFO now, as the proxy will (with the same code) once it has read the
     * record: the kernel's later waits and pushes on it then return at once instead of each
     * running to the limit again, even where no proxy runs. Release (the fence): after the
     * record, so a waiter that sees the abort finds the record written. */
    fenceAcqRelSys();
    storeVolatile(ctrl + 1, kAbortExpired);
    /* The record stays claimed: the proxy must read it, and the communicator fails. */
    phase_ = kExpired;
    return true;
  }

  /* After a wait that ended normally: withdraws the record this wait wrote, if any, and frees
   * it for the next wait that lasts. A register test otherwise. */
  MSCCLPP_DEVICE_INLINE void finish(uint64_t* dev, uint64_t* ctrl)
  {
    if (phase_ != kOwner) return;
    waitRecordWrite(ctrl, 0, 0, 0, 0, 0, 0, waitClockNs() - start_);
    /* Release: the record's stores, its last SEQ included, before the claim is freed; pairs
     * with claim()'s fence in the next owner, which then reads that SEQ. */
    fenceAcqRelSys();
    atomicExch(reinterpret_cast<unsigned long long*>(dev + kDevRecordOwner), 0ull);
  }

 private:
  enum : uint32_t { kNew, kTiming, kOwner, kOther, kExpired };

  MSCCLPP_DEVICE_INLINE static bool claim(uint64_t* dev)
  {
    const bool won =
      atomicCAS(reinterpret_cast<unsigned long long*>(dev + kDevRecordOwner), 0ull, 1ull) == 0;
    /* Acquire: the previous owner's record stores (its last SEQ) are seen before ours. */
    if (won) fenceAcqRelSys();
    return won;
  }

  uint64_t start_ = 0;
  uint32_t phase_ = kNew;
};

} // namespace device
#endif // __CUDACC__
} // namespace mscclpp

#endif // MSCCLPP_DEVICE_H_
