//! Staged sources: a write from a region that libfabric cannot read (GPU memory without
//! FI_HMEM, or forced staging) is copied out into a pinned bounce slot first and sent from there.

use super::Net;
use super::Staging;
use crate::error::{Error, Result};
use crate::sync::{Backoff, Nap, Policy};
use crate::transport::net::mr;
use crate::transport::net::ops::{provider_wait, Op};
use crate::transport::net::regions::Backing;
use crate::transport::staging::StageMem;
use crate::transport::{MrId, PeerId};
use libfabric_sys as fi;
use std::ffi::c_void;
use std::time::Duration;

/// Waiting for a copy out: spin (a chunk's copy takes tens of microseconds and the wire waits
/// for it), then yield; never nap.
const COPY_OUT_WAIT: Policy = Policy {
    spins: 1000,
    yield_for: Duration::ZERO,
    nap: Nap::Yield,
};

/// One chunk's source, ready to post: the local address and descriptor, and for a staged
/// source its bounce slot and the ticket of the copy that fills it.
pub(crate) struct Source {
    local: u64,
    len: u64,
    desc: *mut c_void,
    bounce: Option<(usize, u64)>,
}

/// Pinned slots that staged sources are copied out into before the network reads them. Which
/// slots are busy is kept by `Ops` (`bounce_busy`), which frees a slot when the write that
/// reads it completes.
pub(super) struct Bounce {
    mem: StageMem,
    /// Its registration, in `Regions::mrs`.
    mr: usize,
    slot_len: u64,
    next: usize,
}

impl Staging {
    /// The largest chunk a write from `src` may have: `limit`, the provider's, and for a
    /// staged source one bounce slot.
    pub fn source_chunk(&mut self, net: &mut Net<'_>, src: MrId, limit: u64) -> Result<u64> {
        let mut c = limit.min(net.ops.max_chunk);
        if net.regions[src].staged_source {
            c = c.min(self.bounce(net)?.slot_len);
        }
        Ok(c.max(1))
    }

    /// Makes `n` bytes of region `src` at `off` ready to post (`n` within one chunk, see
    /// `source_chunk`): the region's own registration, or for a staged source a bounce slot
    /// with its copy out started (not waited for: `post_source` does, so the copy of the next
    /// chunk can run while the current one is on the wire).
    pub fn prepare_source(
        &mut self,
        net: &mut Net<'_>,
        src: MrId,
        off: u64,
        n: u64,
    ) -> Result<Source> {
        let (addr, backing, staged) = {
            let r = &net.regions[src];
            (r.region.addr + off, r.backing, r.staged_source)
        };
        match backing {
            Backing::Mr(i) | Backing::Hmem(i, _) if !staged => Ok(Source {
                local: addr,
                len: n,
                desc: net.regions.mrs[i].desc,
                bounce: None,
            }),
            _ => {
                let slot = self.bounce_slot(net)?;
                let b = self.bounce(net)?;
                let (mr, slot_len) = (b.mr, b.slot_len);
                // SAFETY: slot < `sizes.bounce` and the bounce memory holds that many slots.
                let dst = unsafe { b.mem.ptr().add(slot * slot_len as usize) };
                // SAFETY: `addr..addr+n` lies in the registered source region (the caller checked
                // the range against it), of the kind this endpoint's copier serves; `dst` is a
                // bounce slot of `slot_len >= n` bytes (`source_chunk`) that we just marked busy,
                // and it stays busy until this copy's ticket is complete (`post_source`,
                // `abandon`).
                let t = self
                    .copier(net.ops)
                    .and_then(|c| unsafe { c.stage_out(dst, addr, n) });
                match t {
                    Ok(t) => Ok(Source {
                        local: dst as u64,
                        len: n,
                        desc: net.regions.mrs[mr].desc,
                        bounce: Some((slot, t)),
                    }),
                    Err(e) => {
                        // The copy was not queued: nothing writes the slot.
                        net.ops.release_bounce(slot);
                        Err(e)
                    }
                }
            }
        }
    }

    /// Posts one RMA write of a prepared source to `raddr`/`key` (carrying `cq_data`, a signal,
    /// if given), once its copy out (if any) is complete. On an error the source is abandoned
    /// (its slot freed once no copy writes it).
    pub fn post_source(
        &mut self,
        net: &mut Net<'_>,
        peer: PeerId,
        s: Source,
        (raddr, key): (u64, u64),
        cq_data: Option<u64>,
    ) -> Result<()> {
        if let Some((_, t)) = s.bounce {
            if let Err(e) = self.wait_out(net, t) {
                self.abandon(net, s);
                return Err(e);
            }
        }
        net.post(&Op {
            peer,
            local: s.local,
            len: s.len,
            desc: s.desc,
            raddr,
            key,
            fence: false,
            confirm: false,
            inline: None,
            bounce: s.bounce.map(|(slot, _)| slot),
            internal: false,
            ack: false,
            cq_data,
        })
    }

    /// Gives up a prepared source that will not be posted: its bounce slot is freed once its
    /// copy out is complete (a slot a copy may still write is never reused).
    pub fn abandon(&mut self, net: &mut Net<'_>, s: Source) {
        let Some((slot, t)) = s.bounce else { return };
        let mut b = Backoff::new(COPY_OUT_WAIT, net.ops.timeout);
        // Ends when the copy is complete, on a copier error, or at the deadline.
        loop {
            match self.copier(net.ops).and_then(|c| c.out_done(t)) {
                Ok(true) => return net.ops.release_bounce(slot),
                Ok(false) if !b.expired() => b.pause(),
                Ok(false) | Err(_) => {
                    crate::warn!(
                        "net: bounce slot {slot} stays out of use: its copy out of GPU memory did not complete"
                    );
                    return;
                }
            }
        }
    }

    /// Waits (bounded) for copy-out ticket `t`, progressing the network meanwhile.
    fn wait_out(&mut self, net: &mut Net<'_>, t: u64) -> Result<()> {
        if self.copier(net.ops)?.out_done(t)? {
            return Ok(());
        }
        let since = std::time::Instant::now();
        let mut wait = Backoff::new(COPY_OUT_WAIT, net.ops.timeout);
        // Ends when the copy is complete, on an error, or at the deadline.
        while !self.copier(net.ops)?.out_done(t)? {
            net.poll()?;
            wait.step(|| "waiting for a copy out of GPU memory into a bounce slot".into())?;
        }
        net.ops.stats.copy_out_waits.add(since);
        Ok(())
    }

    /// The bounce slots, made and registered on first use.
    fn bounce(&mut self, net: &mut Net<'_>) -> Result<&mut Bounce> {
        if self.bounce.is_none() {
            let chunk = self.sizes.chunk.unwrap_or(self.sizes.ring / 4);
            let slot_len = chunk.clamp(4096, net.ops.max_chunk.max(4096));
            let slots = self.sizes.bounce;
            let mem = self.copier(net.ops)?.alloc(slot_len as usize * slots)?;
            let req = mr::Request {
                addr: mem.ptr() as u64,
                len: mem.len() as u64,
                access: fi::FI_WRITE as u64,
                requested_key: net.regions.request_key()?,
                cuda_device: None,
            };
            let policy = net.regions.policy;
            let m = mr::register(&mut net.ops.mr_ops(), &policy, &req)?;
            let mr = net.regions.add_mr(m);
            net.ops.bounce_busy = vec![false; slots];
            self.bounce = Some(Bounce {
                mem,
                mr,
                slot_len,
                next: 0,
            });
        }
        self.bounce
            .as_mut()
            .ok_or_else(|| Error::internal("bounce slots missing"))
    }

    /// A free bounce slot, marked busy; completes writes until one frees up (bounded).
    fn bounce_slot(&mut self, net: &mut Net<'_>) -> Result<usize> {
        let mut wait: Option<Backoff> = None;
        let since = std::time::Instant::now();
        // Ends when a write that read a bounce slot completes, on an error, or at the deadline.
        loop {
            let slots = self.sizes.bounce;
            let b = self.bounce(net)?;
            let start = b.next;
            for k in 0..slots {
                let i = (start + k) % slots;
                if !net.ops.bounce_busy[i] {
                    net.ops.bounce_busy[i] = true;
                    b.next = (i + 1) % slots;
                    if wait.is_some() {
                        net.ops.stats.bounce_waits.add(since);
                    }
                    return Ok(i);
                }
            }
            net.poll()?;
            let limit = net.ops.timeout;
            let w = wait.get_or_insert_with(|| provider_wait(limit));
            net.ops.pause(w, || {
                "waiting for a bounce slot (staged writes not completing)".into()
            })?;
        }
    }
}
