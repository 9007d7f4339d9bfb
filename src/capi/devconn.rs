//! The device API run from a host thread (C exports over `crate::host`), for connections whose
//! memory is host memory.

use super::{check_null, ffi_boundary, mscclppDevConn_t};
use crate::abi::*;
use crate::error::Result;
use crate::host;

/// The checked connection behind a C pointer.
fn host_conn(conn: *const mscclppDevConn) -> Result<host::Conn> {
    check_null!(conn);
    // SAFETY: non-NULL; the caller passes a connection obtained from this library (a copy is
    // taken). `host::Conn::new` checks that its FIFO view (head, slots, tail) is a live host
    // FIFO's before anything is touched; a head address is never reused, so a connection of a
    // destroyed communicator never passes, even when a newer one got its other addresses.
    host::Conn::new(unsafe { *conn })
}

/// Host `put()`: queues a copy of `size` bytes from `localBuff + srcOffset` to the peer's
/// `buff + dstOffset`. Non-blocking; the source must not change until `flush`. Waits (bounded by
/// `MSCCLPP_WAIT_TIMEOUT`) only while the FIFO is full; a put (or signal) that fails queued
/// nothing. A put of 0 bytes does nothing (as the device method).
#[no_mangle]
pub extern "C" fn mscclppDevConnPut(
    conn: *mut mscclppDevConn_t,
    dstOffset: u64,
    srcOffset: u64,
    size: u64,
) -> mscclppResult_t {
    ffi_boundary!("mscclppDevConnPut", {
        host_conn(conn)?.put(dstOffset, srcOffset, size)
    })
}

/// Host `signal()`: the peer's `wait` returns once every earlier put on this connection arrived.
#[no_mangle]
pub extern "C" fn mscclppDevConnSignal(conn: *mut mscclppDevConn_t) -> mscclppResult_t {
    ffi_boundary!("mscclppDevConnSignal", { host_conn(conn)?.signal() })
}

/// Host `putWithSignal()`: a put followed by a signal, in one trigger; of 0 bytes, a signal.
#[no_mangle]
pub extern "C" fn mscclppDevConnPutWithSignal(
    conn: *mut mscclppDevConn_t,
    dstOffset: u64,
    srcOffset: u64,
    size: u64,
) -> mscclppResult_t {
    ffi_boundary!("mscclppDevConnPutWithSignal", {
        host_conn(conn)?.put_with_signal(dstOffset, srcOffset, size)
    })
}

/// Host `putWithSignalAndFlush()`: put, signal, and wait until both have completed. When the
/// wait times out, the put and signal are taken back if the proxy has not started them (then
/// nothing was sent and a retry sends them once); the error text says which.
#[no_mangle]
pub extern "C" fn mscclppDevConnPutWithSignalAndFlush(
    conn: *mut mscclppDevConn_t,
    dstOffset: u64,
    srcOffset: u64,
    size: u64,
) -> mscclppResult_t {
    ffi_boundary!("mscclppDevConnPutWithSignalAndFlush", {
        host_conn(conn)?.put_with_signal_and_flush(dstOffset, srcOffset, size)
    })
}

/// Host `flush()`: returns once every earlier put and signal on this connection has completed
/// (the source buffer may be reused). Bounded by `MSCCLPP_WAIT_TIMEOUT`; fails on proxy error.
#[no_mangle]
pub extern "C" fn mscclppDevConnFlush(conn: *mut mscclppDevConn_t) -> mscclppResult_t {
    ffi_boundary!("mscclppDevConnFlush", { host_conn(conn)?.flush() })
}

/// Host `wait()`: waits for the peer's next signal on this connection; the data of every put
/// before that signal is then readable. Bounded by `MSCCLPP_WAIT_TIMEOUT`; fails on abort. A
/// wait that fails consumes no signal: a retry waits for the same one.
#[no_mangle]
pub extern "C" fn mscclppDevConnWait(conn: *mut mscclppDevConn_t) -> mscclppResult_t {
    ffi_boundary!("mscclppDevConnWait", { host_conn(conn)?.wait() })
}
