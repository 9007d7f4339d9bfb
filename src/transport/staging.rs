//! Copies between a region's own memory and host staging memory, behind one small trait so that
//! the staging protocol of the network transport (`net/staging/`) runs unchanged over CUDA
//! copies (GPU buffers on providers without FI_HMEM) and over plain `memcpy` (host buffers under
//! `MSCCLPP_TEST_FORCE_STAGING=1`, which is how CI exercises the whole protocol without a GPU).
//!
//! Two directions with different needs:
//! - out (sender): region -> staging, queued, with a ticket per copy that `out_done` reports
//!   complete once the bytes are in staging memory. The sender starts the next chunk's copy
//!   before it posts the current one, so the copy out overlaps the wire (issue 15).
//! - in (receiver): staging -> region, queued. Copies and 8-byte value stores are applied in
//!   queue order, so a value queued after copies is visible only after their bytes; `mark`
//!   returns a ticket that `done` reports complete once everything queued before it is.

use crate::cuda::{self, Ctx, CtxGuard, Event, PinnedHost, Stream};
use crate::error::{Error, Result};
use crate::mem::HostBlock;
use crate::sync::{Backoff, Nap, Policy};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Host memory for staging rings: pinned and mapped for CUDA copiers (copies from it run
/// asynchronously at full bandwidth), ordinary for the host copier.
pub enum StageMem {
    Host(HostBlock),
    Pinned(PinnedHost),
}

impl StageMem {
    pub fn ptr(&self) -> *mut u8 {
        match self {
            StageMem::Host(h) => h.ptr(),
            StageMem::Pinned(p) => p.host(),
        }
    }
    pub fn len(&self) -> usize {
        match self {
            StageMem::Host(h) => h.len(),
            StageMem::Pinned(p) => p.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The copy operations the staging protocol needs. One per endpoint, used only by the thread
/// that holds the endpoint (`&mut self`).
pub trait Copier: Send {
    /// For logs: `memcpy` or `cuda:N`.
    fn describe(&self) -> String;
    /// `len` zeroed bytes of staging memory (page aligned).
    fn alloc(&self, len: usize) -> Result<StageMem>;
    /// Queues a copy of `len` bytes from region memory `src` into staging `dst`; returns a
    /// ticket that `out_done` reports complete once the bytes are there. Copies out complete
    /// in the order they were queued.
    ///
    /// # Safety
    /// `src..src+len` is readable memory of the kind this copier serves (device memory of its
    /// GPU, or host memory), and `dst..dst+len` is staging memory from `alloc` that nothing
    /// else reads or writes until the ticket is complete (or `drain` returned).
    unsafe fn stage_out(&mut self, dst: *mut u8, src: u64, len: u64) -> Result<u64>;
    /// Whether the copy out with ticket `t` has completed. Never blocks.
    fn out_done(&mut self, t: u64) -> Result<bool>;
    /// Queues a copy of `len` bytes from staging `src` to region memory `dst`.
    ///
    /// # Safety
    /// `dst..dst+len` is writable memory of the kind this copier serves, and `src..src+len` is
    /// staging memory from `alloc`; both stay valid and `src` unchanged until a later `mark`'s
    /// ticket is `done` (or `drain` returned).
    unsafe fn copy_in(&mut self, dst: u64, src: *const u8, len: u64) -> Result<()>;
    /// Queues an 8-byte store of `value` at region memory `dst` (8-byte aligned), visible only
    /// after every earlier queued copy: a reader that sees the value sees their bytes.
    ///
    /// # Safety
    /// `dst` is a writable, 8-byte aligned word of the kind of memory this copier serves, valid
    /// until a later `mark`'s ticket is `done`; others touch it only atomically.
    unsafe fn value_in(&mut self, dst: u64, value: u64) -> Result<()>;
    /// A ticket for everything queued so far (tickets grow by one per call).
    fn mark(&mut self) -> Result<u64>;
    /// Whether the work before ticket `t` has completed. Never blocks.
    fn done(&mut self, t: u64) -> Result<bool>;
    /// Waits (bounded by `crate::config::wait_timeout()`) until everything queued has completed.
    fn drain(&mut self) -> Result<()>;
}

/// Plain memory copies on the calling thread: everything is complete when queued.
pub struct HostCopier {
    tickets: u64,
    out_tickets: u64,
}

impl HostCopier {
    pub fn new() -> Self {
        HostCopier {
            tickets: 0,
            out_tickets: 0,
        }
    }
}

impl Default for HostCopier {
    fn default() -> Self {
        Self::new()
    }
}

impl Copier for HostCopier {
    fn describe(&self) -> String {
        "memcpy".into()
    }
    fn alloc(&self, len: usize) -> Result<StageMem> {
        Ok(StageMem::Host(HostBlock::zeroed(len, 4096)?))
    }
    unsafe fn stage_out(&mut self, dst: *mut u8, src: u64, len: u64) -> Result<u64> {
        // SAFETY: both ranges valid and exclusively ours for the copy (trait contract); distinct
        // allocations (region vs staging): no overlap.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst, len as usize) };
        self.out_tickets += 1;
        Ok(self.out_tickets)
    }
    fn out_done(&mut self, t: u64) -> Result<bool> {
        Ok(t <= self.out_tickets)
    }
    unsafe fn copy_in(&mut self, dst: u64, src: *const u8, len: u64) -> Result<()> {
        // SAFETY: both ranges valid for the copy (trait contract: the region's owner reads it
        // only after the value store that follows, the sender reuses the staging bytes only
        // after our acknowledgement); distinct allocations: no overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, dst as *mut u8, len as usize) };
        Ok(())
    }
    unsafe fn value_in(&mut self, dst: u64, value: u64) -> Result<()> {
        if dst % 8 != 0 {
            return Err(Error::internal(format!(
                "unaligned value store at {dst:#x}"
            )));
        }
        // SAFETY: a valid aligned word, touched by others only atomically (trait contract).
        // Release pairs with the waiter's Acquire load of the epoch (`mscclppDevConnWait`):
        // the copies queued before, made by this thread, happen before it.
        unsafe { AtomicU64::from_ptr(dst as *mut u64) }.store(value, Ordering::Release);
        Ok(())
    }
    fn mark(&mut self) -> Result<u64> {
        self.tickets += 1;
        Ok(self.tickets)
    }
    fn done(&mut self, t: u64) -> Result<bool> {
        Ok(t <= self.tickets)
    }
    fn drain(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Values staged for `value_in` when the driver has no `cuStreamWriteValue64`: one slot per
/// value in flight; a slot is reused only once the ticket that covers its copy has completed.
const VALUE_SLOTS: usize = 1024;

/// Tickets on one stream: an event recorded per ticket, retired in order (events of one stream
/// complete in the order they were recorded).
#[derive(Default)]
struct Tickets {
    /// Events not yet seen complete, oldest first, with the ticket each completes.
    marks: VecDeque<(u64, Event)>,
    /// Completed events, reused by `mark`.
    spare: Vec<Event>,
    issued: u64,
    reached: u64,
}

impl Tickets {
    /// A ticket for the work queued on `stream` so far. The stream's context must be current.
    fn mark(&mut self, device: i32, stream: &Stream) -> Result<u64> {
        let ev = match self.spare.pop() {
            Some(e) => e,
            None => Event::new(device)?,
        };
        ev.record(stream)?;
        self.issued += 1;
        self.marks.push_back((self.issued, ev));
        Ok(self.issued)
    }

    /// Whether ticket `t` is complete; retires completed events. Enters `ctx` (the stream's)
    /// only when an event must be asked: a ticket already reached costs nothing.
    fn done(&mut self, ctx: Ctx, t: u64) -> Result<bool> {
        if t <= self.reached {
            return Ok(true);
        }
        let _g = CtxGuard::enter_ctx(ctx)?;
        // Ends at the first event still pending, or when every event is retired.
        while t > self.reached {
            let Some((tk, ev)) = self.marks.front() else {
                break;
            };
            if !ev.query()? {
                break;
            }
            self.reached = *tk;
            if let Some((_, ev)) = self.marks.pop_front() {
                self.spare.push(ev);
            }
        }
        Ok(t <= self.reached)
    }
}

/// Copies on two private non-blocking streams of one device: `inbound` (staging -> GPU and the
/// value stores, ordered by the stream) and `outbound` (GPU -> staging), so that a sender never
/// waits behind the receiver's queued copies.
pub struct CudaCopier {
    device: i32,
    ctx: Ctx,
    inbound: Stream,
    outbound: Stream,
    /// Tickets of `inbound` (`mark`/`done`) and of `outbound` (`stage_out`/`out_done`).
    ins: Tickets,
    outs: Tickets,
    /// Pinned value slots (made on first use without cuStreamWriteValue64) and, per slot, the
    /// ticket that must complete before it is reused.
    values: Option<PinnedHost>,
    value_ticket: Vec<u64>,
    value_next: usize,
}

/// Waiting for staging copies: spin (they take microseconds), then yield to the threads on
/// this machine that may need the core; never nap (the proxy's latency is the product).
const COPY_POLL: Policy = Policy {
    spins: 1000,
    yield_for: Duration::ZERO,
    nap: Nap::Yield,
};

impl CudaCopier {
    pub fn new(device: i32) -> Result<Self> {
        if !cuda::available() {
            return Err(Error::usage(
                "staging GPU memory needs a CUDA driver; this process runs in host mode",
            ));
        }
        Ok(CudaCopier {
            device,
            ctx: Ctx::primary(device)?,
            inbound: Stream::new(device)?,
            outbound: Stream::new(device)?,
            ins: Tickets::default(),
            outs: Tickets::default(),
            values: None,
            value_ticket: vec![0; VALUE_SLOTS],
            value_next: 0,
        })
    }

    /// Waits for ticket `t` (bounded); a value slot's reuse needs this.
    fn wait_ticket(&mut self, t: u64) -> Result<()> {
        let mut b = Backoff::new(COPY_POLL, crate::config::wait_timeout());
        // Ends when the ticket's event has completed, on a CUDA error, or at the deadline.
        while !self.done(t)? {
            b.check(|| {
                format!(
                    "staging copies on CUDA device {}{}",
                    self.device,
                    cuda::queue_hint()
                )
            })?;
            b.pause();
        }
        Ok(())
    }
}

impl Copier for CudaCopier {
    fn describe(&self) -> String {
        format!("cuda:{}", self.device)
    }
    fn alloc(&self, len: usize) -> Result<StageMem> {
        Ok(StageMem::Pinned(PinnedHost::zeroed(self.device, len)?))
    }
    unsafe fn stage_out(&mut self, dst: *mut u8, src: u64, len: u64) -> Result<u64> {
        let _g = CtxGuard::enter_ctx(self.ctx)?;
        // Valid ranges by the trait contract; `dst` is read only once the ticket is complete.
        self.outbound.copy(dst as u64, src, len, false)?;
        self.outs.mark(self.device, &self.outbound)
    }
    fn out_done(&mut self, t: u64) -> Result<bool> {
        self.outs.done(self.ctx, t)
    }
    unsafe fn copy_in(&mut self, dst: u64, src: *const u8, len: u64) -> Result<()> {
        let _g = CtxGuard::enter_ctx(self.ctx)?;
        // Valid until a later ticket completes (trait contract).
        self.inbound.copy(dst, src as u64, len, false)
    }
    unsafe fn value_in(&mut self, dst: u64, value: u64) -> Result<()> {
        if dst % 8 != 0 {
            return Err(Error::internal(format!(
                "unaligned value store at {dst:#x}"
            )));
        }
        let _g = CtxGuard::enter_ctx(self.ctx)?;
        if cuda::has_write_value64() {
            // The default flag puts a memory barrier before the store: every earlier copy of
            // this stream is visible to a kernel that sees the value.
            return self.inbound.write_value64(dst, value);
        }
        // An 8-byte copy from a pinned slot, ordered after the earlier copies by the stream.
        let i = self.value_next;
        self.value_next = (i + 1) % VALUE_SLOTS;
        let before = self.value_ticket[i];
        if before > self.ins.issued {
            self.mark()?;
        }
        self.wait_ticket(before)?;
        if self.values.is_none() {
            self.values = Some(PinnedHost::zeroed(self.device, VALUE_SLOTS * 8)?);
        }
        let v = self
            .values
            .as_ref()
            .ok_or_else(|| Error::internal("value slots missing"))?;
        // SAFETY: slot i of VALUE_SLOTS 8-byte slots; no queued copy reads it (its last
        // ticket completed above).
        let p = unsafe { v.host().add(i * 8) }.cast::<u64>();
        // SAFETY: p is valid and aligned (page-aligned block, 8-byte slots).
        unsafe { p.write_volatile(value) };
        self.inbound.copy(dst, p as u64, 8, false)?;
        // The next mark covers this copy.
        self.value_ticket[i] = self.ins.issued + 1;
        Ok(())
    }
    fn mark(&mut self) -> Result<u64> {
        let _g = CtxGuard::enter_ctx(self.ctx)?;
        self.ins.mark(self.device, &self.inbound)
    }
    fn done(&mut self, t: u64) -> Result<bool> {
        self.ins.done(self.ctx, t)
    }
    fn drain(&mut self) -> Result<()> {
        let _g = CtxGuard::enter_ctx(self.ctx)?;
        self.inbound
            .wait(|| format!("staging copies into CUDA device {}", self.device))?;
        self.outbound
            .wait(|| format!("staging copies out of CUDA device {}", self.device))?;
        self.ins.done(self.ctx, self.ins.issued)?;
        self.outs.done(self.ctx, self.outs.issued)?;
        Ok(())
    }
}

impl Drop for CudaCopier {
    fn drop(&mut self) {
        // Queued copies read staging memory that the endpoint frees after us: let them finish.
        if let Err(e) = self.drain() {
            crate::warn!(
                "closing the staging copier of CUDA device {}: {e}",
                self.device
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_copier_orders_and_tickets() {
        let mut c = HostCopier::new();
        let stage = c.alloc(64).unwrap();
        let src: Vec<u8> = (0..64).collect();
        // SAFETY: (all three): live buffers of this test, in bounds, used by no one else.
        let t = unsafe { c.stage_out(stage.ptr(), src.as_ptr() as u64, 64) }.unwrap();
        assert!(c.out_done(t).unwrap());
        let mut dst = vec![0u8; 64];
        // SAFETY: as for the unsafe code just above.
        unsafe { c.copy_in(dst.as_mut_ptr() as u64 + 8, stage.ptr(), 16) }.unwrap();
        let mut word = [0u64; 2];
        // SAFETY: as for the unsafe code just above.
        unsafe { c.value_in(word.as_mut_ptr() as u64 + 8, 7) }.unwrap();
        let t = c.mark().unwrap();
        assert!(c.done(t).unwrap());
        assert_eq!(&dst[8..24], &src[..16]);
        assert!(dst[..8].iter().chain(&dst[24..]).all(|b| *b == 0));
        assert_eq!(word[1], 7);
        // SAFETY: refused before any store (unaligned).
        assert!(unsafe { c.value_in(word.as_mut_ptr() as u64 + 3, 1) }.is_err());
        c.drain().unwrap();
    }

    #[test]
    fn cuda_copier_needs_a_driver() {
        if !cuda::available() {
            assert!(CudaCopier::new(0).is_err());
        }
    }
}
