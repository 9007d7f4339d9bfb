/*
 * mscclpp/host.h: the host paths of the mscclppDevConn methods (C++ only).
 *
 * mscclpp.h includes this file at its end, after the C prototypes these functions call; do
 * not include it directly. Each forwards to the C function of the same operation, which runs
 * the 2023 device protocol from a host thread (connections over host memory). The result is
 * not returned (the methods return void, as in 2023): a failure is logged and kept for
 * mscclppGetLastError().
 */
#ifndef MSCCLPP_HOST_H_
#define MSCCLPP_HOST_H_

#ifndef MSCCLPP_H_
#error "mscclpp/host.h is part of mscclpp.h: include mscclpp.h"
#endif

namespace mscclpp {
namespace host {

inline void put(mscclppDevConn* conn, uint64_t dstDataOffset, uint64_t srcDataOffset,
                uint64_t dataSize)
{
  (void)mscclppDevConnPut(conn, dstDataOffset, srcDataOffset, dataSize);
}

inline void signal(mscclppDevConn* conn)
{
  (void)mscclppDevConnSignal(conn);
}

inline void putWithSignal(mscclppDevConn* conn, uint64_t dstDataOffset, uint64_t srcDataOffset,
                          uint64_t dataSize)
{
  (void)mscclppDevConnPutWithSignal(conn, dstDataOffset, srcDataOffset, dataSize);
}

inline void putWithSignalAndFlush(mscclppDevConn* conn, uint64_t dstDataOffset,
                                  uint64_t srcDataOffset, uint64_t dataSize)
{
  (void)mscclppDevConnPutWithSignalAndFlush(conn, dstDataOffset, srcDataOffset, dataSize);
}

inline void flush(mscclppDevConn* conn)
{
  (void)mscclppDevConnFlush(conn);
}

inline void wait(mscclppDevConn* conn)
{
  (void)mscclppDevConnWait(conn);
}

} // namespace host
} // namespace mscclpp

#endif // MSCCLPP_HOST_H_
