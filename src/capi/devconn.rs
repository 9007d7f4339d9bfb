//! The device API run from a host thread, for connections whose memory is host memory. Same
//! protocol and semantics as the kernel methods in `include/mscclpp/device.h`.

use super::{check_null, ffi_boundary, mscclppDevConn_t};
use crate::abi::*;
use crate::error::{Error, Result};
use crate::fifo::{self, Spin};
use std::sync::atomic::{AtomicU64, Ordering};

/// Validates a host-driven connection and returns a copy of it.
fn host_conn(conn: *const mscclppDevConn) -> Result<mscclppDevConn> {
    check_null!(conn);
    // SAFETY: non-NULL; the caller passes a connection obtained from this library.
    let c = unsafe { *conn };
    if !fifo::is_host_fifo(c.fifo.triggerFifoHead) {
        return Err(Error::usage("this connection is not a live host-memory connection (a CUDA buffer's connection is driven by its kernel's device methods; or the communicator was destroyed)"));
    }
    Ok(c)
}

fn check_put(dst: u64, src: u64, size: u64) -> Result<()> {
    if size == 0 {
        return Err(Error::invalid_arg("put of 0 bytes"));
    }
    for (what, v) in [("dstOffset", dst), ("srcOffset", src), ("size", size)] {
        if v > MSCCLPP_TRIGGER_OFFSET_MASK {
            return Err(Error::invalid_arg(format!(
                "{what} {v} does not fit the trigger's 32 bits"
            )));
        }
    }
    Ok(())
}

fn push(c: &mscclppDevConn, ty: u64, dst: u64, src: u64, size: u64) -> Result<u64> {
    let w = trigger_encode(ty, dst, src, size, c.fifo.connId as u64);
    // SAFETY: `host_conn` checked that the FIFO is a live host FIFO.
    unsafe { fifo::host_push(&c.fifo, w) }
}

fn epoch_increment(c: &mscclppDevConn) {
    // SAFETY: localSignalEpochId points to the connection's live, 16-byte aligned epoch block.
    // Relaxed: the proxy counts Flags itself; this counter is informational for the producer.
    unsafe { AtomicU64::from_ptr(std::ptr::addr_of_mut!((*c.localSignalEpochId).device)) }
        .fetch_add(1, Ordering::Relaxed);
}

fn flush_ticket(c: &mscclppDevConn, h: u64) -> Result<()> {
    // SAFETY: as in `push`.
    unsafe { fifo::host_wait_retired(&c.fifo, h) }
}

/// Host `put()`: queues a copy of `size` bytes from `localBuff + srcOffset` to the peer's
/// `buff + dstOffset`. Non-blocking; the source must not change until `flush`.
#[no_mangle]
pub extern "C" fn mscclppDevConnPut(
    conn: *mut mscclppDevConn_t,
    dstOffset: u64,
    srcOffset: u64,
    size: u64,
) -> mscclppResult_t {
    ffi_boundary!("mscclppDevConnPut", {
        let c = host_conn(conn)?;
        check_put(dstOffset, srcOffset, size)?;
        push(&c, mscclppData, dstOffset, srcOffset, size).map(|_| ())
    })
}

/// Host `signal()`: the peer's `wait` returns once every earlier put on this connection arrived.
#[no_mangle]
pub extern "C" fn mscclppDevConnSignal(conn: *mut mscclppDevConn_t) -> mscclppResult_t {
    ffi_boundary!("mscclppDevConnSignal", {
        let c = host_conn(conn)?;
        epoch_increment(&c);
        // SHM: straight into the peer's mapped epoch block when nothing is queued or
        // undelivered before it (no trigger, no thread hand-off); otherwise by the proxy.
        if fifo::direct_signal(c.fifo.triggerFifoHead, c.fifo.connId as usize) {
            return Ok(());
        }
        push(&c, mscclppFlag, 0, 0, 1).map(|_| ())
    })
}

/// Host `putWithSignal()`: a put followed by a signal, in one trigger.
#[no_mangle]
pub extern "C" fn mscclppDevConnPutWithSignal(
    conn: *mut mscclppDevConn_t,
    dstOffset: u64,
    srcOffset: u64,
    size: u64,
) -> mscclppResult_t {
    ffi_boundary!("mscclppDevConnPutWithSignal", {
        let c = host_conn(conn)?;
        check_put(dstOffset, srcOffset, size)?;
        epoch_increment(&c);
        push(&c, mscclppData | mscclppFlag, dstOffset, srcOffset, size).map(|_| ())
    })
}

/// Host `putWithSignalAndFlush()`: put, signal, and wait until both have completed.
#[no_mangle]
pub extern "C" fn mscclppDevConnPutWithSignalAndFlush(
    conn: *mut mscclppDevConn_t,
    dstOffset: u64,
    srcOffset: u64,
    size: u64,
) -> mscclppResult_t {
    ffi_boundary!("mscclppDevConnPutWithSignalAndFlush", {
        let c = host_conn(conn)?;
        check_put(dstOffset, srcOffset, size)?;
        epoch_increment(&c);
        let h = push(
            &c,
            mscclppData | mscclppFlag | mscclppSync,
            dstOffset,
            srcOffset,
            size,
        )?;
        flush_ticket(&c, h)
    })
}

/// Host `flush()`: returns once every earlier put and signal on this connection has completed
/// (the source buffer may be reused). Bounded by `MSCCLPP_WAIT_TIMEOUT`; fails on proxy error.
#[no_mangle]
pub extern "C" fn mscclppDevConnFlush(conn: *mut mscclppDevConn_t) -> mscclppResult_t {
    ffi_boundary!("mscclppDevConnFlush", {
        let c = host_conn(conn)?;
        let h = push(&c, mscclppSync, 0, 0, 1)?;
        flush_ticket(&c, h)
    })
}

/// Host `wait()`: waits for the peer's next signal on this connection; the data of every put
/// before that signal is then readable. Bounded by `MSCCLPP_WAIT_TIMEOUT`; fails on abort.
#[no_mangle]
pub extern "C" fn mscclppDevConnWait(conn: *mut mscclppDevConn_t) -> mscclppResult_t {
    ffi_boundary!("mscclppDevConnWait", {
        let c = host_conn(conn)?;
        // SAFETY: waitEpochId and localSignalEpochId point into the connection's live epoch
        // block; waitEpochId is only touched by this connection's waiter.
        let (wait, proxy) = unsafe {
            let w = AtomicU64::from_ptr(c.waitEpochId);
            (
                w.fetch_add(1, Ordering::Relaxed) + 1,
                AtomicU64::from_ptr(std::ptr::addr_of_mut!((*c.localSignalEpochId).proxy)),
            )
        };
        let mut spin = Spin::new(&c.fifo, fifo::wait_timeout());
        // Acquire pairs with the peer's write of the signal count, which the transport orders
        // after the data. Ends when the count arrives, on abort, or at the deadline.
        while proxy.load(Ordering::Acquire) < wait {
            spin.step("wait: no signal from the peer")?;
        }
        Ok(())
    })
}
