//! Staged sources: a write from a region that libfabric cannot read (GPU memory without
//! FI_HMEM, or forced staging) is copied out into a pinned bounce slot first and sent from there.

use super::Staging;
use crate::error::{Error, Result};
use crate::sync::Backoff;
use crate::transport::net::mr;
use crate::transport::net::ops::{provider_wait, Op};
use crate::transport::net::regions::Backing;
use crate::transport::net::Net;
use crate::transport::staging::StageMem;
use crate::transport::{MrId, PeerId};
use libfabric_sys as fi;

/// Bounce slots for staged sources (each one chunk).
pub(crate) const BOUNCE_SLOTS: usize = 4;

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
        if net.regions[src].backing == Backing::Staged {
            c = c.min(self.bounce(net)?.slot_len);
        }
        Ok(c.max(1))
    }

    /// Posts one RMA write of `n` bytes of region `src` at `off` (`n` within one chunk, see
    /// `source_chunk`) to `raddr`/`key`: from the region's registration, or for a staged
    /// source through a bounce slot.
    #[allow(clippy::too_many_arguments)] // one chunk's source and destination, and the endpoint's parts
    pub fn post_from(
        &mut self,
        net: &mut Net<'_>,
        peer: PeerId,
        src: MrId,
        off: u64,
        n: u64,
        raddr: u64,
        key: u64,
    ) -> Result<()> {
        let (addr, backing) = {
            let r = &net.regions[src];
            (r.region.addr + off, r.backing)
        };
        let (local, desc, bounce) = match backing {
            Backing::Mr(i) | Backing::Hmem(i, _) => (addr, net.regions.mrs.mrs[i].desc, None),
            Backing::Staged => {
                let slot = self.bounce_slot(net)?;
                let b = self.bounce(net)?;
                let (mr, slot_len) = (b.mr, b.slot_len);
                // SAFETY: slot < BOUNCE_SLOTS and the bounce memory holds that many slots.
                let dst = unsafe { b.mem.ptr().add(slot * slot_len as usize) };
                // SAFETY: `addr..addr+n` lies in the registered source region (the caller checked
                // the range against it), of the kind this endpoint's copier serves; `dst` is a
                // bounce slot of `slot_len >= n` bytes (`source_chunk`) that we just marked busy.
                let r = self
                    .copier(net.ops)
                    .and_then(|c| unsafe { c.stage_out(dst, addr, n) });
                if let Err(e) = r {
                    net.ops.release_bounce(slot);
                    return Err(e);
                }
                (dst as u64, net.regions.mrs.mrs[mr].desc, Some(slot))
            }
        };
        net.post(&Op {
            peer,
            local,
            len: n,
            desc,
            raddr,
            key,
            fence: false,
            confirm: false,
            inline: None,
            bounce,
            internal: false,
        })
    }

    /// The bounce slots, made and registered on first use.
    fn bounce(&mut self, net: &mut Net<'_>) -> Result<&mut Bounce> {
        if self.bounce.is_none() {
            let slot_len = (self.sizes.ring / 4).clamp(4096, net.ops.max_chunk.max(4096));
            let mem = self
                .copier(net.ops)?
                .alloc(slot_len as usize * BOUNCE_SLOTS)?;
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
        // Ends when a write that read a bounce slot completes, on an error, or at the deadline.
        loop {
            let b = self.bounce(net)?;
            let start = b.next;
            for k in 0..BOUNCE_SLOTS {
                let i = (start + k) % BOUNCE_SLOTS;
                if !net.ops.bounce_busy[i] {
                    net.ops.bounce_busy[i] = true;
                    b.next = (i + 1) % BOUNCE_SLOTS;
                    return Ok(i);
                }
            }
            net.poll()?;
            let limit = net.ops.timeout;
            wait.get_or_insert_with(|| provider_wait(limit))
                .step(|| "waiting for a bounce slot (staged writes not completing)".into())?;
        }
    }
}
