//! The device API driven from host threads, for connections whose memory is host memory: the
//! same protocol and meaning as the kernel methods in `include/mscclpp/devconn_methods.inc`
//! (push triggers into the connection's FIFO, wait on its epoch), every wait bounded by
//! `MSCCLPP_WAIT_TIMEOUT` and ended by the communicator's abort word.
//!
//! Files: this one is the API (`Conn`); `producer.rs` pushes triggers and waits for their
//! retirement; `spin.rs` is how every host wait waits (and helps the proxy meanwhile);
//! `pending.rs` lists the waits that last, for the hang report.

pub mod pending;
mod producer;
mod spin;

pub use producer::{host_fifo_drained, host_push, host_wait_retired};
pub use spin::Spin;

use crate::abi::*;
use crate::error::{Error, Result};
use crate::fifo::{self, Withdrawal};
use std::sync::atomic::{AtomicU64, Ordering};

/// A connection checked to be a live host-memory connection of this process, held for one call.
pub struct Conn(
    mscclppDevConn,
    /// The FIFO's consumer, held for the call: it owns the FIFO's memory, and a destroy that
    /// starts meanwhile waits (bounded) for it to be let go before freeing the epoch blocks.
    #[allow(dead_code)] // held, never read
    std::sync::Arc<dyn fifo::Assist>,
);

/// Why a `mscclppDevConn` is refused by the host API.
const NOT_LIVE: &str = "this connection is not a live host-memory connection (a CUDA buffer's connection is driven by its kernel's device methods; or the communicator was destroyed)";

impl Conn {
    /// Accepts `c` only if its FIFO is a live host FIFO (its whole view: head, slots, tail): a
    /// CUDA buffer's connection (driven by its kernel), a destroyed communicator's (head
    /// addresses are never reused) or a forged one is an error, not a stray access.
    pub fn new(c: mscclppDevConn) -> Result<Self> {
        if !fifo::is_host_fifo(&c.fifo) {
            return Err(Error::usage(NOT_LIVE));
        }
        match fifo::hold(c.fifo.triggerFifoHead) {
            Some(h) => Ok(Conn(c, h)),
            None => Err(Error::usage(NOT_LIVE)),
        }
    }

    /// `put()`: queues a copy of `size` bytes from `localBuff + src` to the peer's buffer at
    /// `dst`. Non-blocking; the source must not change until `flush`. A put of 0 bytes does
    /// nothing, as the device method's (a trigger of 0 bytes cannot be queued: it would read
    /// as an empty FIFO slot).
    pub fn put(&self, dst: u64, src: u64, size: u64) -> Result<()> {
        if size == 0 {
            return Ok(());
        }
        let triggers = self.put_triggers(mscclppData, dst, src, size)?;
        if self.direct_put(dst, src, size, false) {
            return Ok(());
        }
        self.push_all(triggers).map(|_| ())
    }

    /// `signal()`: the peer's `wait` returns once every earlier put on this connection arrived.
    /// Each call that fails sent nothing (the informational count is bumped on success only).
    pub fn signal(&self) -> Result<()> {
        // SHM: straight into the peer's mapped epoch block when nothing is queued or
        // undelivered before it (no trigger, no thread hand-off); otherwise by the proxy.
        if !(self.drained()
            && fifo::direct_signal(self.0.fifo.triggerFifoHead, self.0.fifo.connId as usize))
        {
            self.push(mscclppFlag, 0, 0, 1)?;
        }
        self.epoch_increment();
        Ok(())
    }

    /// `putWithSignal()`: a put followed by a signal, in one trigger; of 0 bytes, a `signal()`
    /// (as the device method).
    pub fn put_with_signal(&self, dst: u64, src: u64, size: u64) -> Result<()> {
        if size == 0 {
            return self.signal();
        }
        let triggers = self.put_triggers(mscclppData | mscclppFlag, dst, src, size)?;
        if !self.direct_put(dst, src, size, true) {
            self.push_all(triggers)?;
        }
        self.epoch_increment();
        Ok(())
    }

    /// `putWithSignalAndFlush()`: put, signal, and wait until both have completed. When the
    /// wait times out, the trigger is taken back if the proxy has not started it, and then
    /// nothing was sent (the error says which). Of 0 bytes: a signal and a flush in one
    /// trigger (as the device method), taken back the same way, so that a retry after a
    /// timeout never signals twice.
    pub fn put_with_signal_and_flush(&self, dst: u64, src: u64, size: u64) -> Result<()> {
        if size == 0 {
            let h = self.push(mscclppFlag | mscclppSync, 0, 0, 1)?;
            return self.retire_signal(h, 1);
        }
        let triggers =
            self.put_triggers(mscclppData | mscclppFlag | mscclppSync, dst, src, size)?;
        let parts = triggers.count(); // (a copy: PutTriggers is Copy)
                                      // Inline, the flush still waits until the peer applied it (flush means "arrived").
        if self.direct_put(dst, src, size, true) {
            self.epoch_increment();
            return self.flush().map_err(|e| {
                e.within("the put and its signal were sent inline; only their flush failed (retry with mscclppDevConnFlush, not the put)")
            });
        }
        // The last trigger carries the Sync: retiring it proves the earlier chunks done.
        let h = self.push_all(triggers)?;
        self.retire_signal(h, parts)
    }

    /// Waits for ticket `h`, the last of `parts` triggers, which carries a signal and a Sync;
    /// on a timeout takes it back if the proxy has not started it. The signal is counted
    /// (`epoch_increment`) unless it was taken back.
    fn retire_signal(&self, h: u64, parts: usize) -> Result<()> {
        match self.wait_retired(h) {
            Err(e @ Error::Timeout { .. }) => {
                match fifo::withdraw(self.0.fifo.triggerFifoHead, h) {
                    Withdrawal::Withdrawn if parts == 1 => Err(
                        e.within("taken back before the proxy started it: nothing of it was sent")
                    ),
                    Withdrawal::Withdrawn => Err(e.within(
                        "its last part, which carries the signal, was taken back before the proxy started it: the signal was not sent, earlier parts of the put may have been (retry the whole call)",
                    )),
                    // Completed between the deadline and the withdrawal.
                    Withdrawal::Retired => {
                        self.epoch_increment();
                        Ok(())
                    }
                    Withdrawal::Queued => {
                        self.epoch_increment();
                        Err(e.within("the proxy could not give it back (it was busy with it, or failed): the put and its signal may still be sent (retry with mscclppDevConnFlush, not the put)"))
                    }
                }
            }
            r => {
                // Completed, or the communicator was aborted (then nothing more is sent).
                self.epoch_increment();
                r
            }
        }
    }

    /// `flush()`: returns once every earlier put and signal on this connection has completed
    /// (the source buffer may be reused).
    pub fn flush(&self) -> Result<()> {
        let h = self.push(mscclppSync, 0, 0, 1)?;
        self.wait_retired(h)
    }

    /// `wait()`: waits for the peer's next signal on this connection; the data of every put
    /// before that signal is then readable. A wait that fails consumes no signal: its retry
    /// waits for the same one.
    pub fn wait(&self) -> Result<()> {
        let c = &self.0;
        // SAFETY: waitEpochId and localSignalEpochId point into the connection's live epoch
        // block; waitEpochId is only touched by this connection's waiter.
        let (waited, proxy) = unsafe {
            (
                AtomicU64::from_ptr(c.waitEpochId),
                AtomicU64::from_ptr(std::ptr::addr_of_mut!((*c.localSignalEpochId).proxy)),
            )
        };
        // Relaxed: only this connection's waiter touches it. Stored only once the signal came
        // (the kernel's wait() stores it first: on the GPU the only failure is the abort, which
        // is final, but a host wait may time out and be retried).
        let target = waited.load(Ordering::Relaxed) + 1;
        let mut spin = Spin::new(
            &c.fifo,
            crate::config::wait_timeout(),
            crate::proxy::WaitOp::Wait,
            target,
        );
        // SHM over host memory: the ring the peer writes small puts into. Applied as records
        // come, not only at the signal, while the sender waits for room
        // (`proxy::conn::direct_put`): this waiter makes it soonest.
        let inbox = fifo::inbox(c.fifo.triggerFifoHead, c.fifo.connId as usize);
        // Acquire pairs with the peer's write of the signal count, which the transport orders
        // after the data. Ends when the count arrives, on abort, or at the deadline.
        while proxy.load(Ordering::Acquire) < target {
            if let Some(i) = inbox.as_ref().filter(|i| i.room_wanted()) {
                i.drain_if_free()?;
            }
            spin.step("wait: no signal from the peer")?;
        }
        waited.store(target, Ordering::Relaxed);
        // The peer's inline puts before this signal are in our ring (the count's Acquire above
        // pairs with the peer's Release after writing them); apply them before the caller
        // reads the buffer.
        inbox.map_or(Ok(()), |i| i.drain())
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

    /// The triggers of a put (several for one over 4 GiB, the last with `ty`'s Flag and
    /// Sync), or the refusal of one no trigger can carry (0 bytes, or past 2^40 bytes into a
    /// buffer), checked before anything is queued. The same rule as the kernels' put
    /// (`fifo::put_triggers`).
    /// A put split into several triggers is checked whole against the buffers first, as a
    /// kernel's is (`queuePut` in include/mscclpp/devconn_methods.inc): one that does not fit is
    /// refused before any of it is queued (one trigger's range the proxy checks as it comes).
    fn put_triggers(&self, ty: u64, dst: u64, src: u64, size: u64) -> Result<fifo::PutTriggers> {
        let conn = self.0.fifo.connId as usize;
        let refuse = |r: fifo::Refusal| {
            Error::invalid_arg(format!(
                "put to rank {} refused: {}",
                self.0.remoteRank,
                r.describe()
            ))
        };
        let triggers = fifo::put_triggers(ty, dst, src, size, conn).map_err(refuse)?;
        if size > MSCCLPP_TRIGGER_SIZE_MASK {
            let (local, remote) = self.1.buffer_sizes(conn).unwrap_or((0, 0));
            let past = |off: u64, limit: u64| off > limit || size > limit - off;
            let what = if past(src, local) {
                Some((MSCCLPP_REFUSED_RANGE_SRC, src + size))
            } else if past(dst, remote) {
                Some((MSCCLPP_REFUSED_RANGE_DST, dst + size))
            } else {
                None
            };
            if let Some((what, value)) = what {
                return Err(refuse(fifo::Refusal {
                    conn_id: conn,
                    what,
                    value,
                }));
            }
        }
        Ok(triggers)
    }

    /// Pushes every trigger of one put in order; returns the last one's ticket. A push that
    /// fails part-way leaves the chunks before it queued.
    fn push_all(&self, triggers: fifo::PutTriggers) -> Result<u64> {
        let mut last = None;
        for t in triggers {
            last = Some(self.push(t.ty, t.dst_off, t.src_off, t.size)?);
        }
        last.ok_or_else(|| Error::internal("a put with no trigger"))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fifo::{Fifo, Trigger};

    /// The buffers of `Idle`'s connections, here and at the peer: 9 GiB.
    const BUF: u64 = 9 << 30;

    /// A consumer that never consumes: what a connection's calls queue stays in the FIFO.
    struct Idle;
    impl fifo::Assist for Idle {
        fn assist(&self) -> bool {
            false
        }
        fn direct_signal(&self, _: usize) -> bool {
            false
        }
        fn direct_put(&self, _: usize, _: u64, _: u64, _: u64, _: bool) -> bool {
            false
        }
        fn withdraw(&self, _: u64) -> Withdrawal {
            Withdrawal::Queued
        }
        fn buffer_sizes(&self, _: usize) -> Option<(u64, u64)> {
            Some((BUF, BUF))
        }
    }

    /// A connection on a host FIFO with no consumer (`Conn::new` would refuse it: only a
    /// consumer makes a FIFO live), built directly.
    fn conn(f: &Fifo, epoch: &mut mscclppDevConnSignalEpochId, wait: &mut u64) -> Conn {
        let c = mscclppDevConn {
            remoteRank: 1,
            tag: 0,
            localBuff: std::ptr::null_mut(),
            localSignalEpochId: epoch,
            remoteSignalEpochId: std::ptr::null_mut(),
            waitEpochId: wait,
            remoteBuff: std::ptr::null_mut(),
            fifo: f.producer_view(4),
        };
        assert!(fifo::is_host_fifo(&c.fifo));
        Conn(c, std::sync::Arc::new(Idle))
    }

    fn drain(f: &mut Fifo) -> Vec<Trigger> {
        let mut out = Vec::new();
        while let Some(w) = f.peek() {
            out.push(Trigger::decode(w).unwrap());
            f.pop(false);
        }
        out
    }

    #[test]
    fn host_puts_past_4_gib_split_and_past_2_pow_40_are_refused_whole() {
        let mut f = Fifo::new_host().unwrap();
        let (mut epoch, mut wait) = (mscclppDevConnSignalEpochId::default(), 0u64);
        let c = conn(&f, &mut epoch, &mut wait);
        let gib = 1u64 << 30;
        c.put_with_signal(4 * gib + 8192, 0, 4 * gib + 4096)
            .unwrap();
        let got = drain(&mut f);
        let sizes: Vec<u64> = got.iter().map(|t| t.size).collect();
        assert_eq!(sizes, [2 * gib, 2 * gib + 4096]);
        assert_eq!(got[0].ty, mscclppData);
        assert_eq!(
            got[1].ty,
            mscclppData | mscclppFlag,
            "only the last carries the flag"
        );
        assert_eq!((got[1].dst_off, got[1].src_off), (6 * gib + 8192, 2 * gib));
        assert!(got.iter().all(|t| t.conn_id == 4));
        assert_eq!(epoch.device, 1, "one signal for the whole put");
        // Exactly 2^32 bytes, which wedged the 2023 FIFO (word0 == 0): two triggers.
        c.put(0, 0, 1 << 32).unwrap();
        assert_eq!(drain(&mut f).len(), 2);
        // Refused before anything is queued or counted, naming the peer and the value.
        for (dst, src, size) in [(1 << 40, 0, 1), (0, (1 << 40) - 4, 8)] {
            let e = c.put_with_signal(dst, src, size).unwrap_err();
            assert_eq!(e.code(), mscclppResult_t::mscclppInvalidArgument, "{e}");
            assert!(e.to_string().contains("rank 1"), "{e}");
            assert!(f.is_empty(), "{e}");
        }
        assert_eq!(epoch.device, 1);
        let e = c.put(0, 1u64 << 41, 1).unwrap_err();
        assert!(e.to_string().contains(&(1u64 << 41).to_string()), "{e}");
        // A split put is checked whole against the buffers before its first trigger: one that
        // ends exactly at the end goes, one a byte past it (either side) queues nothing.
        c.put(BUF - 4 * gib, 0, 4 * gib).unwrap();
        assert_eq!(drain(&mut f).len(), 2);
        for (dst, src, end) in [
            (BUF - 4 * gib + 1, 0, BUF + 1),
            (0, BUF - 4 * gib + 1, BUF + 1),
        ] {
            let e = c.put_with_signal(dst, src, 4 * gib).unwrap_err();
            assert_eq!(e.code(), mscclppResult_t::mscclppInvalidArgument, "{e}");
            assert!(
                e.to_string().contains(&format!("ends at byte {end}")),
                "{e}"
            );
            assert!(e.to_string().contains("before any of it moved"), "{e}");
            assert!(f.is_empty(), "{e}");
        }
        assert_eq!(epoch.device, 1);
        // One trigger's range is the proxy's to check, as it comes.
        c.put(BUF, 0, 8).unwrap();
        assert_eq!(drain(&mut f).len(), 1);
        // 0 bytes, as the device methods: a put does nothing, a put with signal is a signal.
        c.put(0, 0, 0).unwrap();
        assert!(f.is_empty(), "a put of 0 bytes queued a trigger");
        c.put_with_signal(0, 0, 0).unwrap();
        let got = drain(&mut f);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].ty, mscclppFlag, "a signal, no data");
        assert_eq!(epoch.device, 2, "counted as one signal");
    }
}
