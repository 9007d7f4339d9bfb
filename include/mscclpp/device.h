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
 *   - triggerFifoHead[0]: the ticket counter, triggerFifoHead[1]: a cache of the tail, both
 *     in device memory. push() takes its ticket and checks for room there; it reads the real
 *     tail only when the cache says the FIFO is full, and then refreshes the cache. Measured
 *     on 2x H200 (c_examples/cuda/pingpong): a load of the host tail 1.07-1.21 us, of the
 *     device cache 0.16 us, so a host tail read by every push would double its cost (a
 *     signal() push measured 1.5-1.7 us back to back); a device-memory tail written by the
 *     proxy would cost it a driver call (~2 us measured for cuStreamWriteValue64) per update.
 *     triggerFifoHead[2]: the done word, triggerFifoHead[3]: its switch, device memory too: a
 *     transport working on this GPU (the P2P SM copy engine) stores "every ticket below d has
 *     completed" there, and flush() ends on it without a round trip through the proxy.
 *   - localSignalEpochId / waitEpochId: device memory of the buffer's GPU; wait() polls it in
 *     L2, the peer's SM copy engine or copy engine writes the signal count into it through
 *     CUDA IPC. Word 3 of that block (after waitEpochId): on P2P connections, the device
 *     address of a host word where the peer's proxy may store a signal itself; 0 otherwise.
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

} // namespace device
#endif // __CUDACC__
} // namespace mscclpp

#endif // MSCCLPP_DEVICE_H_
