//! The device API driven from host threads, for connections whose memory is host memory: the
//! same protocol and meaning as the kernel methods in `include/mscclpp/devconn_methods.inc`
//! (push triggers into the connection's FIFO, wait on its epoch), every wait bounded by
//! `MSCCLPP_WAIT_TIMEOUT` and ended by the communicator's abort word.
//!
//! Files: this one is the API (`Conn`); `producer.rs` pushes triggers and waits for their
//! retirement; `spin.rs` is how every host wait waits (and helps the proxy meanwhile).

mod producer;
mod spin;

pub use producer::{host_fifo_drained, host_push, host_wait_retired};
pub use spin::Spin;

use crate::abi::*;
use crate::error::{Error, Result};
use crate::fifo;
use std::sync::atomic::{AtomicU64, Ordering};

/// A connection checked to be a live host-memory connection of this process, held for one call.
pub struct Conn(
    mscclppDevConn,
    /// The FIFO's consumer, held for the call: it owns the FIFO's memory, and a destroy that
    /// starts meanwhile waits (bounded) for it to be let go before freeing the epoch blocks.
    #[allow(dead_code)] // held, never read
    std::sync::Arc<dyn fifo::Assist>,
);

impl Conn {
    /// Accepts `c` only if its FIFO is a live host FIFO: a CUDA buffer's connection (driven by
    /// its kernel), a destroyed communicator's or a forged one is an error, not a stray access.
    pub fn new(c: mscclppDevConn) -> Result<Self> {
        match fifo::hold(c.fifo.triggerFifoHead) {
            Some(h) => Ok(Conn(c, h)),
            None => Err(Error::usage("this connection is not a live host-memory connection (a CUDA buffer's connection is driven by its kernel's device methods; or the communicator was destroyed)")),
        }
    }

    /// `put()`: queues a copy of `size` bytes from `localBuff + src` to the peer's buffer at
    /// `dst`. Non-blocking; the source must not change until `flush`.
    pub fn put(&self, dst: u64, src: u64, size: u64) -> Result<()> {
        check_put(dst, src, size)?;
        if self.direct_put(dst, src, size, false) {
            return Ok(());
        }
        self.push(mscclppData, dst, src, size).map(|_| ())
    }

    /// `signal()`: the peer's `wait` returns once every earlier put on this connection arrived.
    pub fn signal(&self) -> Result<()> {
        self.epoch_increment();
        // SHM: straight into the peer's mapped epoch block when nothing is queued or
        // undelivered before it (no trigger, no thread hand-off); otherwise by the proxy.
        if self.drained()
            && fifo::direct_signal(self.0.fifo.triggerFifoHead, self.0.fifo.connId as usize)
        {
            return Ok(());
        }
        self.push(mscclppFlag, 0, 0, 1).map(|_| ())
    }

    /// `putWithSignal()`: a put followed by a signal, in one trigger.
    pub fn put_with_signal(&self, dst: u64, src: u64, size: u64) -> Result<()> {
        check_put(dst, src, size)?;
        self.epoch_increment();
        if self.direct_put(dst, src, size, true) {
            return Ok(());
        }
        self.push(mscclppData | mscclppFlag, dst, src, size)
            .map(|_| ())
    }

    /// `putWithSignalAndFlush()`: put, signal, and wait until both have completed.
    pub fn put_with_signal_and_flush(&self, dst: u64, src: u64, size: u64) -> Result<()> {
        check_put(dst, src, size)?;
        self.epoch_increment();
        // Inline, the flush still waits until the peer applied it (flush means "arrived").
        if self.direct_put(dst, src, size, true) {
            return self.flush();
        }
        let h = self.push(mscclppData | mscclppFlag | mscclppSync, dst, src, size)?;
        self.wait_retired(h)
    }

    /// `flush()`: returns once every earlier put and signal on this connection has completed
    /// (the source buffer may be reused).
    pub fn flush(&self) -> Result<()> {
        let h = self.push(mscclppSync, 0, 0, 1)?;
        self.wait_retired(h)
    }

    /// `wait()`: waits for the peer's next signal on this connection; the data of every put
    /// before that signal is then readable.
    pub fn wait(&self) -> Result<()> {
        let c = &self.0;
        // SAFETY: waitEpochId and localSignalEpochId point into the connection's live epoch
        // block; waitEpochId is only touched by this connection's waiter.
        let (wait, proxy) = unsafe {
            let w = AtomicU64::from_ptr(c.waitEpochId);
            (
                w.fetch_add(1, Ordering::Relaxed) + 1,
                AtomicU64::from_ptr(std::ptr::addr_of_mut!((*c.localSignalEpochId).proxy)),
            )
        };
        let mut spin = Spin::new(&c.fifo, crate::config::wait_timeout());
        // Acquire pairs with the peer's write of the signal count, which the transport orders
        // after the data. Ends when the count arrives, on abort, or at the deadline.
        while proxy.load(Ordering::Acquire) < wait {
            spin.step("wait: no signal from the peer")?;
        }
        // SHM over host memory: the peer's inline puts before this signal are in our ring
        // (the count's Acquire above pairs with the peer's Release after writing them); apply
        // them before the caller reads the buffer.
        fifo::drain_inbox(c.fifo.triggerFifoHead, c.fifo.connId as usize)
    }

    /// SHM over host memory: the put written into the peer's ring by this thread, and its
    /// signal stored, when the connection is idle and fully delivered and the put is small
    /// (`transport::inbox`); false: push the trigger.
    fn direct_put(&self, dst: u64, src: u64, size: u64, signal: bool) -> bool {
        self.drained()
            && fifo::direct_put(
                self.0.fifo.triggerFifoHead,
                self.0.fifo.connId as usize,
                dst,
                src,
                size,
                signal,
            )
    }

    /// Whether every trigger pushed so far was retired: a cheap look before asking for the
    /// proxy's lock, which a busy proxy holds for each round (64 tries for it on every put of
    /// a 4 KiB stream cost a third of its bandwidth).
    fn drained(&self) -> bool {
        // SAFETY: `new` checked that the FIFO is a live host FIFO.
        unsafe { host_fifo_drained(&self.0.fifo) }
    }

    fn push(&self, ty: u64, dst: u64, src: u64, size: u64) -> Result<u64> {
        let w = trigger_encode(ty, dst, src, size, self.0.fifo.connId as u64);
        // SAFETY: `new` checked that the FIFO is a live host FIFO.
        unsafe { host_push(&self.0.fifo, w) }
    }

    fn wait_retired(&self, h: u64) -> Result<()> {
        // SAFETY: as in `push`.
        unsafe { host_wait_retired(&self.0.fifo, h) }
    }

    fn epoch_increment(&self) {
        // SAFETY: localSignalEpochId points to the connection's live, 16-byte aligned epoch
        // block. Relaxed: the proxy counts Flags itself; this counter is informational for the
        // producer.
        unsafe { AtomicU64::from_ptr(std::ptr::addr_of_mut!((*self.0.localSignalEpochId).device)) }
            .fetch_add(1, Ordering::Relaxed);
    }
}

/// Fails once the FIFO's abort word is raised: the communicator was aborted, or its proxies
/// were stopped (`mscclppProxyStop`, until the next `mscclppProxyLaunch`) or it is being
/// destroyed. `what`: the call, for the message.
pub(crate) fn aborted(fifo: &mscclppConcurrentFifo, what: &str) -> Result<()> {
    // SAFETY: the abort word follows the tail in every FIFO's control block; the FIFO is live
    // (the caller's `Conn` holds its consumer, or `host_push`'s contract says so).
    let a = unsafe { AtomicU64::from_ptr(fifo.triggerFifoTail.add(1)) }.load(Ordering::Acquire);
    match a {
        0 => Ok(()),
        a => Err(abort_error(what, a)),
    }
}

/// The error of a host call ended by the abort word `code`.
pub(crate) fn abort_error(what: &str, code: u64) -> Error {
    if code == mscclppResult_t::mscclppInvalidUsage as u64 {
        Error::remote(format!("{what}: released: the proxies were stopped (mscclppProxyStop) or the communicator is being destroyed; mscclppProxyLaunch makes the connection usable again"))
    } else {
        Error::remote(format!("{what}: the communicator was aborted (error code {code}); see mscclppCommGetAsyncError"))
    }
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
