//! GPU memory over providers without FI_HMEM: staging through host memory, with the receiver's
//! proxy finishing every write (DESIGN.md, "Transports": after a peer's writes land, they are
//! made visible before the kernel's `wait()` may return).
//!
//! Which regions are staged is the owner's choice, told to writers in the region blob
//! (`blob::Mode`): device memory when the provider lacks FI_HMEM or cannot register CUDA memory
//! (or with `MSCCLPP_NET_HMEM=0`), and every user region under `MSCCLPP_TEST_FORCE_STAGING=1`,
//! which runs this whole protocol over host memory with `memcpy` so that CI covers it.
//!
//! The channel. Every endpoint keeps, per peer rank, a [`Chan`], advertised in the address
//! made for that peer (`Endpoint::address_for`):
//! - `credit`: an 8-byte word where the peer reports how many of our records it has applied;
//! - on endpoints that stage, an `inbox` of [`RECORD_BYTES`]-byte records and a data `ring`
//!   (pinned host memory for CUDA) that the peer writes into.
//!
//! Writing `size` bytes to a staged region of the peer: per chunk (a quarter of the ring at
//! most), `fi_write` the bytes into free ring space, then `fi_write` a record `{seq, Data,
//! region, offset, size, ring position}` into the inbox slot `(seq - 1) % slots`; the record is
//! ordered after its data like a flag (WAW ordering, else FI_FENCE, else the data is drained
//! first). A value (the signal count, `write_value`) is a record `{seq, Value, region, offset,
//! value}`. A staged *source* (device memory, or forced) is first copied out into a pinned
//! bounce slot, which stays busy until the write that sends it completes.
//!
//! Applying (the receiver's proxy, `Endpoint::poll_incoming`, and every wait loop of this
//! endpoint): records are taken strictly in seq order; each is validated against the region
//! table (a record can only touch staged regions, within their bounds, from within the ring)
//! and queued on the copier: Data as a copy ring -> region, Value as an 8-byte store ordered
//! after every earlier copy (`cuStreamWriteValue64`, or a copy from a pinned slot, on the same
//! stream). So the kernel that sees the count sees the data: its `wait()` returns only after
//! the bytes are in its GPU buffer. For FI_HMEM regions (data written directly by the NIC),
//! a Value is stored only after `cuFlushGPUDirectRDMAWrites`.
//!
//! Flow control: records up to `n` are reported to the writer (an 8-byte write of `n` into its
//! `credit` word) only once their copies have completed, so an acknowledged record's inbox slot
//! and ring bytes may be reused. A writer waits for acknowledgements when the inbox or the ring
//! is full, applying its own incoming records meanwhile (two endpoints writing to each other
//! cannot deadlock).
//!
//! `flush(peer)` returns once the peer has acknowledged every record sent so far: the data is
//! in the peer's *destination* memory (its GPU buffer), not only in its staging ring.

mod chan;
mod record;

pub(crate) use chan::Chan;
use chan::{Incoming, Outgoing};
pub(crate) use record::{Kind, Record, RECORD_BYTES};

use super::blob::{ChanBlob, MrBlob};
use super::regions::{range_ok, Backing};
use super::{mr, NetEndpoint, Op, Wait};
use crate::error::{Error, Result};
use crate::mem::HostBlock;
use crate::transport::staging::{Copier, CudaCopier, HostCopier, StageMem};
use crate::transport::{Endpoint, MrId, PeerId};
use libfabric_sys as fi;
use std::collections::VecDeque;

/// Records applied per channel per call, so one busy peer cannot starve the others.
const APPLY_BATCH: usize = 64;
/// Bounce slots for staged sources (each one chunk).
pub(super) const BOUNCE_SLOTS: usize = 4;

/// Defaults and bounds of the channel sizes (`Tuning::staging_bytes` / `staging_slots`).
pub(super) const DEFAULT_RING: u64 = 8 << 20;
pub(super) const MIN_RING: u64 = 16 << 10;
pub(super) const MAX_RING: u64 = 1 << 30;
pub(super) const DEFAULT_SLOTS: u64 = 256;
pub(super) const MIN_SLOTS: u64 = 2;
pub(super) const MAX_SLOTS: u64 = 1 << 16;

/// Pinned slots that staged sources are copied out into before the network reads them.
pub(super) struct Bounce {
    mem: StageMem,
    /// Its registration, in `NetEndpoint::mrs`.
    mr: usize,
    slot_len: u64,
    next: usize,
}

/// The sizes of channels this endpoint creates.
#[derive(Clone, Copy, Debug)]
pub(super) struct Sizes {
    pub ring: u64,
    pub slots: u64,
}

impl NetEndpoint {
    /// The copier of this endpoint, made on first use: CUDA copies on the endpoint's device,
    /// `memcpy` on a host endpoint.
    pub(super) fn copier(&mut self) -> Result<&mut dyn Copier> {
        if self.copier.is_none() {
            let c: Box<dyn Copier> = match self.device {
                Some(d) => Box::new(CudaCopier::new(d)?),
                None => Box::new(HostCopier::new()),
            };
            crate::info!(
                "net: {} stages through host memory with {} copies",
                self.describe(),
                c.describe()
            );
            self.copier = Some(c);
        }
        match self.copier.as_deref_mut() {
            Some(c) => Ok(c),
            None => Err(Error::internal("staging copier missing")),
        }
    }

    /// Whether this endpoint stages any memory (and so offers peers an inbox and a ring).
    fn stages(&self) -> bool {
        self.device.is_some() || self.force_staging
    }

    /// The channel for `rank` (made on first call): its blob goes into `address_for(rank)`.
    pub(super) fn chan_for(&mut self, rank: usize) -> Result<ChanBlob> {
        if let Some(&ci) = self.chan_ids.get(&rank) {
            return Ok(self.chans[ci].blob);
        }
        let credit = HostBlock::zeroed(8, 64)?;
        let credit_blob = self.register_internal(credit.ptr() as u64, 8)?;
        let (incoming, in_blob) = if self.stages() {
            let slots = self.sizes.slots;
            let inbox = HostBlock::zeroed(slots as usize * RECORD_BYTES, 4096)?;
            let ring_len = self.sizes.ring as usize;
            let ring = self.copier()?.alloc(ring_len)?;
            let ib = self.register_internal(inbox.ptr() as u64, inbox.len() as u64)?;
            let rb = self.register_internal(ring.ptr() as u64, ring_len as u64)?;
            let inc = Incoming {
                inbox,
                ring,
                slots,
                read: 0,
                pending: VecDeque::new(),
                complete: 0,
                reported: 0,
            };
            (Some(inc), Some((ib, rb)))
        } else {
            (None, None)
        };
        let blob = ChanBlob {
            credit: credit_blob,
            incoming: in_blob,
        };
        let peer = self.peers.of_rank(rank);
        self.chans.push(Chan {
            rank,
            peer,
            credit,
            blob,
            incoming,
            out: Outgoing::default(),
        });
        let ci = self.chans.len() - 1;
        self.chan_ids.insert(rank, ci);
        if let Some(p) = peer {
            self.peers[p].chan = Some(ci);
        }
        Ok(blob)
    }

    /// Registers endpoint-owned host memory that peers write into (channel words and rings).
    fn register_internal(&mut self, addr: u64, len: u64) -> Result<MrBlob> {
        let req = mr::Request {
            addr,
            len,
            access: fi::FI_REMOTE_WRITE as u64,
            requested_key: self.regions.request_key()?,
            cuda_device: None,
        };
        let policy = self.regions.policy;
        let m = mr::register(&mut self.ops.mr_ops(), &policy, &req)?;
        let blob = MrBlob::direct(
            policy.virt_addr,
            if policy.virt_addr { addr } else { 0 },
            len,
            m.key,
        );
        self.regions.add_mr(m);
        Ok(blob)
    }

    /// Our channel for `peer` and the peer's inbox and ring, or why staged writes to it are
    /// impossible.
    fn out_chan(&self, peer: PeerId) -> Result<(usize, MrBlob, MrBlob)> {
        let p = &self.peers[peer];
        let incoming = p.remote_chan.and_then(|c| c.incoming);
        match (p.chan, incoming) {
            (Some(ci), Some((inbox, ring))) => Ok((ci, inbox, ring)),
            _ => Err(Error::usage(format!(
                "rank {} stages this region, but the two endpoints did not exchange staging channels (addresses must come from address_for)",
                p.rank
            ))),
        }
    }

    /// One step of a wait for the peer's acknowledgements: reads our credit word, completes
    /// writes, applies incoming records (the peer may be waiting on ours), then backs off.
    fn ack_step(&mut self, ci: usize, wait: &mut Option<Wait>, what: &str) -> Result<()> {
        let c = self.chans[ci].credit();
        self.chans[ci].out.ack(c);
        self.poll()?;
        self.apply_incoming()?;
        let (rank, limit) = (self.chans[ci].rank, self.ops.timeout);
        let (sent, acked) = (self.chans[ci].out.sent, self.chans[ci].out.acked);
        wait.get_or_insert_with(|| Wait::new(limit)).step(|| {
            format!("{what}: rank {rank} has applied {acked} of our {sent} staged writes (is its proxy running?)")
        })
    }

    /// Waits (bounded) until the peer has acknowledged record `upto`.
    pub(super) fn wait_acked(&mut self, ci: usize, upto: u64) -> Result<()> {
        let mut wait = None;
        // Ends when the count arrives, on an error, or at the deadline (`ack_step`).
        loop {
            let c = self.chans[ci].credit();
            self.chans[ci].out.ack(c);
            if self.chans[ci].out.acked >= upto {
                return Ok(());
            }
            self.ack_step(ci, &mut wait, "flush")?;
        }
    }

    /// Posts `rec` (its seq assigned here) into the peer's inbox, ordered after every earlier
    /// write to the peer; returns the seq.
    pub(super) fn post_record(&mut self, peer: PeerId, mut rec: Record) -> Result<u64> {
        let (ci, inbox, _) = self.out_chan(peer)?;
        let slots = inbox.len / RECORD_BYTES as u64;
        let mut wait = None;
        // Ends when a slot is free (the peer acknowledged the record that used it), on an
        // error, or at the deadline.
        while !self.chans[ci].out.room_for_record(slots) {
            self.ack_step(ci, &mut wait, "waiting for a free staging record slot")?;
        }
        let seq = self.chans[ci].out.sent + 1;
        rec.seq = seq;
        let bytes = rec.encode();
        let fence = self.order_before_flag(peer)?;
        let desc = self.ops.inline_desc;
        self.post(&Op {
            peer,
            local: 0,
            len: RECORD_BYTES as u64,
            desc,
            raddr: inbox.base + ((seq - 1) % slots) * RECORD_BYTES as u64,
            key: inbox.key,
            fence,
            confirm: false,
            inline: Some(&bytes),
            bounce: None,
            internal: false,
        })?;
        self.chans[ci].out.sent = seq;
        self.peers[peer].last_was_record = true;
        Ok(seq)
    }

    /// Writes `size` bytes of local region `src` at `src_off` into the peer's staged region
    /// `remote` at `dst_off`: data into its ring, then a record per chunk.
    pub(super) fn write_staged(
        &mut self,
        peer: PeerId,
        src: MrId,
        src_off: u64,
        remote: MrBlob,
        dst_off: u64,
        size: u64,
    ) -> Result<()> {
        let (ci, _, ring) = self.out_chan(peer)?;
        let chunk = self.source_chunk(src, (ring.len / 4).max(1))?;
        let mut done = 0;
        while done < size {
            let n = (size - done).min(chunk);
            let mut wait = None;
            // Ends when the ring has room (acknowledgements free it), on an error, or at the
            // deadline.
            let pos = loop {
                let c = self.chans[ci].credit();
                self.chans[ci].out.ack(c);
                if let Some(p) = self.chans[ci].out.alloc(ring.len, n) {
                    break p;
                }
                self.ack_step(ci, &mut wait, "waiting for room in the staging ring")?;
            };
            self.post_from(peer, src, src_off + done, n, ring.base + pos, ring.key)?;
            let seq = self.post_record(
                peer,
                Record {
                    seq: 0,
                    kind: Kind::Data,
                    region: remote.id,
                    off: dst_off + done,
                    arg: n,
                    ring_pos: pos,
                },
            )?;
            self.chans[ci].out.data_sent(seq);
            done += n;
        }
        Ok(())
    }

    /// The largest chunk a write from `src` may have: `limit`, the provider's, and for a
    /// staged source one bounce slot.
    pub(super) fn source_chunk(&mut self, src: MrId, limit: u64) -> Result<u64> {
        let mut c = limit.min(self.ops.max_chunk);
        if self.regions[src].backing == Backing::Staged {
            c = c.min(self.bounce()?.slot_len);
        }
        Ok(c.max(1))
    }

    /// Posts one RMA write of `n` bytes of region `src` at `off` (`n` within one chunk, see
    /// `source_chunk`) to `raddr`/`key`: from the region's registration, or for a staged
    /// source through a bounce slot.
    pub(super) fn post_from(
        &mut self,
        peer: PeerId,
        src: MrId,
        off: u64,
        n: u64,
        raddr: u64,
        key: u64,
    ) -> Result<()> {
        let (addr, backing) = {
            let r = &self.regions[src];
            (r.region.addr + off, r.backing)
        };
        let (local, desc, bounce) = match backing {
            Backing::Mr(i) | Backing::Hmem(i) => (addr, self.regions.mrs.mrs[i].desc, None),
            Backing::Staged => {
                let slot = self.bounce_slot()?;
                let b = self.bounce()?;
                let (mr, slot_len) = (b.mr, b.slot_len);
                // SAFETY: slot < BOUNCE_SLOTS and the bounce memory holds that many slots.
                let dst = unsafe { b.mem.ptr().add(slot * slot_len as usize) };
                // SAFETY: `addr..addr+n` lies in the registered source region (the caller checked
                // the range against it), of the kind this endpoint's copier serves; `dst` is a
                // bounce slot of `slot_len >= n` bytes (`source_chunk`) that we just marked busy.
                let r = self
                    .copier()
                    .and_then(|c| unsafe { c.stage_out(dst, addr, n) });
                if let Err(e) = r {
                    self.ops.release_bounce(slot);
                    return Err(e);
                }
                (dst as u64, self.regions.mrs.mrs[mr].desc, Some(slot))
            }
        };
        self.post(&Op {
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
    fn bounce(&mut self) -> Result<&mut Bounce> {
        if self.bounce.is_none() {
            let slot_len = (self.sizes.ring / 4).clamp(4096, self.ops.max_chunk.max(4096));
            let mem = self.copier()?.alloc(slot_len as usize * BOUNCE_SLOTS)?;
            let req = mr::Request {
                addr: mem.ptr() as u64,
                len: mem.len() as u64,
                access: fi::FI_WRITE as u64,
                requested_key: self.regions.request_key()?,
                cuda_device: None,
            };
            let policy = self.regions.policy;
            let m = mr::register(&mut self.ops.mr_ops(), &policy, &req)?;
            let mr = self.regions.add_mr(m);
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
    fn bounce_slot(&mut self) -> Result<usize> {
        let mut wait: Option<Wait> = None;
        // Ends when a write that read a bounce slot completes, on an error, or at the deadline.
        loop {
            let start = self.bounce()?.next;
            for k in 0..BOUNCE_SLOTS {
                let i = (start + k) % BOUNCE_SLOTS;
                if !self.ops.bounce_busy[i] {
                    self.ops.bounce_busy[i] = true;
                    self.bounce()?.next = (i + 1) % BOUNCE_SLOTS;
                    return Ok(i);
                }
            }
            self.poll()?;
            let limit = self.ops.timeout;
            wait.get_or_insert_with(|| Wait::new(limit))
                .step(|| "waiting for a bounce slot (staged writes not completing)".into())?;
        }
    }

    /// Applies the records that have arrived on every channel and acknowledges completed ones
    /// (the receiver's half of the protocol; see the module doc).
    pub(super) fn apply_incoming(&mut self) -> Result<()> {
        for ci in 0..self.chans.len() {
            if self.chans[ci].incoming.is_some() {
                self.apply_chan(ci)?;
                self.acknowledge(ci)?;
            }
        }
        Ok(())
    }

    fn apply_chan(&mut self, ci: usize) -> Result<()> {
        let mut taken = 0;
        // Ends at the first record that has not (fully) arrived, or after APPLY_BATCH records.
        while taken < APPLY_BATCH {
            let Some(inc) = self.chans[ci].incoming.as_ref() else {
                return Ok(());
            };
            let Some(rec) = inc.peek() else { break };
            self.apply_record(ci, &rec)?;
            if let Some(inc) = self.chans[ci].incoming.as_mut() {
                inc.read += 1;
            }
            taken += 1;
        }
        if taken > 0 {
            let t = self.copier()?.mark()?;
            if let Some(inc) = self.chans[ci].incoming.as_mut() {
                inc.pending.push_back((inc.read, t));
            }
        }
        Ok(())
    }

    /// Validates one record against the region table and the ring, then queues it.
    fn apply_record(&mut self, ci: usize, rec: &Record) -> Result<()> {
        let rank = self.chans[ci].rank;
        let bad = |why: String| Error::remote(format!("rank {rank}: staged write refused: {why}"));
        let Some(r) = self.regions.get(rec.region as usize) else {
            return Err(bad(format!(
                "record {} names unknown region {}",
                rec.seq, rec.region
            )));
        };
        let (addr, len, backing) = (r.region.addr, r.region.len, r.backing);
        match rec.kind {
            Kind::Data => {
                if backing != Backing::Staged {
                    return Err(bad(format!("region {} is not staged", rec.region)));
                }
                if rec.arg == 0 || !range_ok(rec.off, rec.arg, len) {
                    return Err(bad(format!(
                        "range [{}, {}+{}) outside the {len}-byte region",
                        rec.off, rec.off, rec.arg
                    )));
                }
                let Some(inc) = self.chans[ci].incoming.as_ref() else {
                    return Err(Error::internal("applying without an inbox"));
                };
                if !range_ok(rec.ring_pos, rec.arg, inc.ring.len() as u64) {
                    return Err(bad(format!(
                        "ring range [{}, {}+{}) outside the {}-byte ring",
                        rec.ring_pos,
                        rec.ring_pos,
                        rec.arg,
                        inc.ring.len()
                    )));
                }
                // SAFETY: within the ring (checked above).
                let from = unsafe { inc.ring.ptr().add(rec.ring_pos as usize) };
                let c = self.copier()?;
                // SAFETY: the destination range lies in a registered staged region (checked
                // above), which its user must keep alive while connected; the ring bytes stay
                // unchanged until we acknowledge this record, which we do only once the copy's
                // ticket is done (`acknowledge`); the ring lives until the copier is drained.
                unsafe { c.copy_in(addr + rec.off, from, rec.arg) }
            }
            Kind::Value => {
                if !matches!(backing, Backing::Staged | Backing::Hmem(_)) {
                    return Err(bad(format!(
                        "region {} takes no relayed values",
                        rec.region
                    )));
                }
                if rec.off % 8 != 0 || !range_ok(rec.off, 8, len) {
                    return Err(bad(format!(
                        "value at {} outside (or unaligned in) the {len}-byte region",
                        rec.off
                    )));
                }
                if let (Backing::Hmem(_), Some(d)) = (backing, self.device) {
                    // The NIC wrote the data before this record (ordering); make those writes
                    // visible to the device's kernels before the value can be seen.
                    crate::cuda::flush_gpudirect_rdma_writes(d)?;
                }
                let c = self.copier()?;
                // SAFETY: an aligned word inside a registered region (checked above), which
                // the local waiter reads atomically.
                unsafe { c.value_in(addr + rec.off, rec.arg) }
            }
        }
    }

    /// Reports completed records to the writer (one 8-byte write of the count into its credit
    /// word), once per change.
    fn acknowledge(&mut self, ci: usize) -> Result<()> {
        let Some(peer) = self.chans[ci].peer else {
            return Ok(());
        };
        // Completed tickets, oldest first; ends at the first incomplete one or an empty queue.
        while let Some(&(seq, t)) = self.chans[ci]
            .incoming
            .as_ref()
            .and_then(|i| i.pending.front())
        {
            if !self.copier()?.done(t)? {
                break;
            }
            if let Some(inc) = self.chans[ci].incoming.as_mut() {
                inc.complete = seq;
                inc.pending.pop_front();
            }
        }
        let Some(inc) = self.chans[ci].incoming.as_mut() else {
            return Ok(());
        };
        if inc.complete == inc.reported {
            return Ok(());
        }
        let n = inc.complete;
        inc.reported = n;
        let Some(credit) = self.peers[peer].remote_chan.map(|c| c.credit) else {
            return Err(Error::remote(format!(
                "rank {} writes staged records but offered no credit word",
                self.chans[ci].rank
            )));
        };
        let desc = self.ops.inline_desc;
        self.post(&Op {
            peer,
            local: 0,
            len: 8,
            desc,
            raddr: credit.base,
            key: credit.key,
            fence: false,
            confirm: false,
            inline: Some(&n.to_ne_bytes()),
            bounce: None,
            internal: true,
        })
    }

    /// Waits for the copier's queued work (teardown: the rings are freed after this).
    pub(super) fn drain_copier(&mut self) {
        if let Some(c) = self.copier.as_mut() {
            if let Err(e) = c.drain() {
                crate::warn!("net: draining staging copies: {e}");
            }
        }
    }

    /// Whether records sent to `peer` are still unacknowledged (a direct flag to that peer
    /// must then wait, or it could overtake staged data).
    pub(super) fn records_pending(&self, peer: PeerId) -> Option<(usize, u64)> {
        let ci = self.peers[peer].chan?;
        let o = &self.chans[ci].out;
        (o.sent > o.acked.max(self.chans[ci].credit())).then_some((ci, o.sent))
    }
}
