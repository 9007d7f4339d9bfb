// The 2023 MSCCL++ layout, pinned against include/mscclpp.h as C++ sees it (with the device
// methods spliced into the structs). Compiling this file is the test; it also runs (and
// returns 0) so CTest lists it. Numbers from the 2023 mscclpp.h / mscclppfifo.h on LP64.
#include <mscclpp.h>

#include <cstddef>
#include <type_traits>

// Result codes 0..8 and transports 0..2, as in 2023.
static_assert(mscclppSuccess == 0, "mscclppSuccess");
static_assert(mscclppUnhandledCudaError == 1, "mscclppUnhandledCudaError");
static_assert(mscclppSystemError == 2, "mscclppSystemError");
static_assert(mscclppInternalError == 3, "mscclppInternalError");
static_assert(mscclppInvalidArgument == 4, "mscclppInvalidArgument");
static_assert(mscclppInvalidUsage == 5, "mscclppInvalidUsage");
static_assert(mscclppRemoteError == 6, "mscclppRemoteError");
static_assert(mscclppInProgress == 7, "mscclppInProgress");
static_assert(mscclppNumResults == 8, "mscclppNumResults");
static_assert(sizeof(mscclppResult_t) == 4, "mscclppResult_t is int-sized");
static_assert(mscclppTransportP2P == 0, "mscclppTransportP2P");
static_assert(mscclppTransportSHM == 1, "mscclppTransportSHM");
static_assert(mscclppTransportIB == 2, "mscclppTransportIB");
static_assert(sizeof(mscclppTransport_t) == 4, "mscclppTransport_t is int-sized");

// Version and FIFO macros.
static_assert(MSCCLPP_VERSION == MSCCLPP_MAJOR * 10000 + MSCCLPP_MINOR * 100 + MSCCLPP_PATCH,
              "MSCCLPP_VERSION");
static_assert(MSCCLPP_PROXY_FIFO_SIZE == 128, "MSCCLPP_PROXY_FIFO_SIZE");
static_assert(MSCCLPP_PROXY_FIFO_FLUSH_COUNTER == 4, "MSCCLPP_PROXY_FIFO_FLUSH_COUNTER");
static_assert(MSCCLPP_UNIQUE_ID_BYTES == 128, "MSCCLPP_UNIQUE_ID_BYTES");
static_assert(mscclppData == 0x1 && mscclppFlag == 0x2 && mscclppSync == 0x4, "trigger types");
static_assert(MSCCLPP_BITS_SIZE == 32 && MSCCLPP_BITS_OFFSET == 32 && MSCCLPP_BITS_TYPE == 3 &&
                MSCCLPP_BITS_CONNID == 10,
              "trigger bit widths");

// mscclppDevConnSignalEpochId: struct alignas(16) { uint64_t device; uint64_t proxy; }.
static_assert(sizeof(mscclppDevConnSignalEpochId) == 16, "epoch size");
static_assert(alignof(mscclppDevConnSignalEpochId) == 16, "epoch alignment");
static_assert(offsetof(mscclppDevConnSignalEpochId, device) == 0, "epoch.device");
static_assert(offsetof(mscclppDevConnSignalEpochId, proxy) == 8, "epoch.proxy");

// mscclppTrigger: alignas(16) { uint64_t value[2]; }.
static_assert(sizeof(mscclppTrigger) == 16 && alignof(mscclppTrigger) == 16, "trigger");
static_assert(offsetof(mscclppTrigger, value) == 0, "trigger.value");

// mscclppConcurrentFifo: triggerFifo, triggerFifoTail, triggerFifoHead, connId.
static_assert(sizeof(mscclppConcurrentFifo) == 32, "fifo size");
static_assert(offsetof(mscclppConcurrentFifo, triggerFifo) == 0, "fifo.triggerFifo");
static_assert(offsetof(mscclppConcurrentFifo, triggerFifoTail) == 8, "fifo.triggerFifoTail");
static_assert(offsetof(mscclppConcurrentFifo, triggerFifoHead) == 16, "fifo.triggerFifoHead");
static_assert(offsetof(mscclppConcurrentFifo, connId) == 24, "fifo.connId");

// mscclppBaseConn, then mscclppDevConn = the base fields followed by fifo: 80 bytes.
static_assert(sizeof(mscclppBaseConn) == 48, "base conn size");
static_assert(sizeof(mscclppDevConn) == 80, "mscclppDevConn is 80 bytes");
static_assert(alignof(mscclppDevConn) == 8, "mscclppDevConn alignment");
static_assert(offsetof(mscclppDevConn, remoteRank) == 0, "remoteRank");
static_assert(offsetof(mscclppDevConn, tag) == 4, "tag");
static_assert(offsetof(mscclppDevConn, localBuff) == 8, "localBuff");
static_assert(offsetof(mscclppDevConn, localSignalEpochId) == 16, "localSignalEpochId");
static_assert(offsetof(mscclppDevConn, remoteSignalEpochId) == 24, "remoteSignalEpochId");
static_assert(offsetof(mscclppDevConn, waitEpochId) == 32, "waitEpochId");
static_assert(offsetof(mscclppDevConn, remoteBuff) == 40, "remoteBuff");
static_assert(offsetof(mscclppDevConn, fifo) == 48, "fifo at offset 48");
static_assert(offsetof(mscclppBaseConn, remoteBuff) == offsetof(mscclppDevConn, remoteBuff),
              "base fields first");

// The methods keep the structs plain data: copyable to the GPU byte for byte.
static_assert(std::is_standard_layout<mscclppDevConn>::value, "standard layout");
static_assert(std::is_trivially_copyable<mscclppDevConn>::value, "trivially copyable");
static_assert(std::is_trivially_copyable<mscclppConcurrentFifo>::value, "trivially copyable");
static_assert(std::is_same<mscclppDevConn_t, mscclppDevConn>::value, "mscclppDevConn_t");
static_assert(std::is_same<mscclppComm_t, mscclppComm*>::value, "mscclppComm_t");

static_assert(sizeof(mscclppUniqueId) == 128, "mscclppUniqueId is 128 bytes");
static_assert(sizeof(mscclppUniqueId::internal) == MSCCLPP_UNIQUE_ID_BYTES, "internal[]");

int main() { return 0; }
