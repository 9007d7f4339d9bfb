//! GPU memory over providers without FI_HMEM: staging through host memory, with the receiver's
//! proxy finishing every write (docs/DESIGN.md, 3.3, "GPU memory": after a peer's writes land, they are
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
//! Writing `size` bytes to a staged region of the peer: per chunk (the writer's
//! `MSCCLPP_NET_STAGING_CHUNK`, at most half the peer's ring; default a quarter), `fi_write`
//! the bytes into free ring space, then `fi_write` a record `{seq, Data, region, offset, size,
//! ring position}` into the inbox slot `(seq - 1) % slots`; the record is ordered after its
//! data like a flag (`order::Plan`: plain within the provider's trusted WAW bound, else
//! FI_FENCE, else the data, sent with FI_DELIVERY_COMPLETE, is drained first). A value (the signal count, `write_value`) is a record `{seq, Value, region, offset,
//! value}`. A staged *source* (device memory, or forced) is first copied out into a pinned
//! bounce slot, which stays busy until the write that sends it completes; the copy of the next
//! chunk starts before the current chunk is posted, so copies out overlap the wire
//! (`send::write_chunks`).
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

mod apply;
mod bounce;
mod chan;
mod send;

pub(crate) use super::record::{Kind, Record, RECORD_BYTES};
use bounce::Bounce;
pub(crate) use chan::Chan;
use chan::{Incoming, Outgoing};
pub(crate) use send::Dest;

use super::blob::{ChanBlob, MrBlob};
use super::mr;
use super::ops::{Op, Ops};
use super::peers::Peers;
use super::regions::Regions;
use crate::config::NetConfig;
use crate::error::{Error, Result};
use crate::mem::HostBlock;
use crate::transport::staging::{Copier, CudaCopier, HostCopier};
use crate::transport::PeerId;
use libfabric_sys as fi;
use std::collections::VecDeque;

/// Defaults and bounds of the channel sizes (`NetConfig::staging_bytes` / `staging_slots`).
const DEFAULT_RING: u64 = 8 << 20;
const MIN_RING: u64 = 16 << 10;
const MAX_RING: u64 = 1 << 30;
const DEFAULT_SLOTS: u64 = 256;
const MIN_SLOTS: u64 = 2;
const MAX_SLOTS: u64 = 1 << 16;
const MIN_CHUNK: u64 = 4 << 10;
const DEFAULT_BOUNCE: usize = 4;
const MAX_BOUNCE: u64 = 64;

/// The sizes of channels this endpoint creates, and of its staged writes.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    ring: u64,
    slots: u64,
    /// Bytes per chunk written (and per bounce slot); None: a quarter of the peer's ring.
    chunk: Option<u64>,
    /// Bounce slots for staged sources.
    bounce: usize,
}

/// The parts of an endpoint that `Staging` works with, borrowed next to it for one call
/// (`NetEndpoint::parts`, `endpoint.rs`).
pub(super) struct Net<'a> {
    pub regions: &'a mut Regions,
    pub ops: &'a mut Ops,
    pub peers: &'a mut Peers,
}

impl Net<'_> {
    pub fn post(&mut self, op: &Op<'_>) -> Result<()> {
        self.ops.post(self.peers, op)
    }

    pub fn poll(&mut self) -> Result<usize> {
        self.ops.poll(self.peers)
    }

    pub fn order_before_flag(&mut self, peer: PeerId) -> Result<bool> {
        self.peers.order_before_flag(self.ops, peer)
    }
}

/// The staging state of one endpoint (module doc): its channels, one per peer rank, the copier
/// that finishes staged writes, and the bounce slots of staged sources. Its methods take the
/// rest of the endpoint as a `Net`.
pub(super) struct Staging {
    /// The CUDA device whose memory this endpoint serves (None: host memory).
    pub device: Option<i32>,
    pub force_staging: bool,
    /// `MSCCLPP_TEST_FORCE_STAGING=source` (`regions::Stage::force_source`).
    pub force_staged_source: bool,
    sizes: Sizes,
    /// Copies for staging, made on first use; drained before the rings are freed.
    copier: Option<Box<dyn Copier>>,
    /// Staging channels, one per peer endpoint (`chan_for`, indexed by `Peer::chan`).
    pub chans: Vec<Chan>,
    bounce: Option<Bounce>,
    /// Makes the NIC's writes into a CUDA device's memory visible to its kernels
    /// (`cuFlushGPUDirectRDMAWrites`); a unit test puts a model of such a NIC here.
    pub gdr_flush: GdrFlush,
}

/// See [`Staging::gdr_flush`].
pub(super) type GdrFlush = Box<dyn FnMut(i32) -> Result<()> + Send>;

impl Staging {
    /// No channel yet; sizes from `tuning`, within bounds.
    pub fn new(device: Option<i32>, cfg: &NetConfig) -> Self {
        Staging {
            device,
            force_staging: cfg.force_staging,
            force_staged_source: cfg.force_staged_source,
            sizes: Sizes {
                ring: cfg
                    .staging_bytes
                    .map_or(DEFAULT_RING, |b| b.clamp(MIN_RING, MAX_RING))
                    .next_multiple_of(4096),
                slots: cfg
                    .staging_slots
                    .map_or(DEFAULT_SLOTS, |n| n.clamp(MIN_SLOTS, MAX_SLOTS)),
                chunk: cfg
                    .staging_chunk
                    .map(|c| c.clamp(MIN_CHUNK, MAX_RING).next_multiple_of(4096)),
                bounce: cfg
                    .staging_bounce
                    .map_or(DEFAULT_BOUNCE, |n| n.clamp(1, MAX_BOUNCE) as usize),
            },
            copier: None,
            chans: Vec::new(),
            bounce: None,
            gdr_flush: Box::new(crate::cuda::flush_gpudirect_rdma_writes),
        }
    }

    /// The copier of this endpoint, made on first use: CUDA copies on the endpoint's device,
    /// `memcpy` on a host endpoint.
    pub fn copier(&mut self, ops: &Ops) -> Result<&mut dyn Copier> {
        if self.copier.is_none() {
            self.prepare_copier(&ops.describe())?;
        }
        match self.copier.as_deref_mut() {
            Some(c) => Ok(c),
            None => Err(Error::internal("staging copier missing")),
        }
    }

    /// Makes the copier of endpoint `who` unless it exists (`copier`).
    pub fn prepare_copier(&mut self, who: &str) -> Result<()> {
        if self.copier.is_none() {
            let c: Box<dyn Copier> = match self.device {
                Some(d) => Box::new(CudaCopier::new(d)?),
                None => Box::new(HostCopier::new()),
            };
            crate::info!(
                "net: {who} copies with {} (staged regions' bytes, and signal values relayed into GPU or staged memory)",
                c.describe()
            );
            self.copier = Some(c);
        }
        Ok(())
    }

    /// Whether this endpoint stages any memory (and so offers peers an inbox and a ring).
    fn stages(&self) -> bool {
        self.device.is_some() || self.force_staging
    }

    /// The channel for `peer` (made on first call): its blob goes into the link made for it
    /// (`Endpoint::link_for`).
    pub fn chan_for(&mut self, net: &mut Net<'_>, peer: PeerId) -> Result<ChanBlob> {
        if let Some(ci) = net.peers[peer].chan {
            return Ok(self.chans[ci].blob);
        }
        let credit = HostBlock::zeroed(8, 64)?;
        let credit_blob = register_internal(net, credit.ptr() as u64, 8)?;
        let (incoming, in_blob) = if self.stages() {
            let slots = self.sizes.slots;
            let inbox = HostBlock::zeroed(slots as usize * RECORD_BYTES, 4096)?;
            let ring_len = self.sizes.ring as usize;
            let ring = self.copier(net.ops)?.alloc(ring_len)?;
            let ib = register_internal(net, inbox.ptr() as u64, inbox.len() as u64)?;
            let rb = register_internal(net, ring.ptr() as u64, ring_len as u64)?;
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
        self.chans.push(Chan {
            rank: net.peers[peer].rank,
            peer,
            credit,
            blob,
            incoming,
            out: Outgoing::default(),
        });
        net.peers[peer].chan = Some(self.chans.len() - 1);
        Ok(blob)
    }

    /// Waits for the copier's queued work (teardown: the rings are freed after this).
    pub fn drain_copier(&mut self) {
        if let Some(c) = self.copier.as_mut() {
            if let Err(e) = c.drain() {
                crate::warn!("net: draining staging copies: {e}");
            }
        }
    }
}

/// Registers endpoint-owned host memory that peers write into (channel words and rings).
fn register_internal(net: &mut Net<'_>, addr: u64, len: u64) -> Result<MrBlob> {
    let req = mr::Request {
        addr,
        len,
        access: fi::FI_REMOTE_WRITE as u64,
        requested_key: net.regions.request_key()?,
        cuda_device: None,
    };
    let policy = net.regions.policy;
    let m = mr::register(&mut net.ops.mr_ops(), &policy, &req)?;
    let blob = MrBlob::direct(
        policy.virt_addr,
        if policy.virt_addr { addr } else { 0 },
        len,
        m.key,
    );
    net.regions.add_mr(m);
    Ok(blob)
}
