//! The network transport: one libfabric RDM endpoint (fabric, domain, address vector, completion
//! queue, endpoint) per `NetEndpoint`, RMA writes for Data, an 8-byte write for Flag, a CQ drain
//! for Sync. Serves `mscclppTransportIB` (any provider) and `mscclppTransportSHM` (`shm`).
//!
//! Choice of provider and address (`select.rs`): `shm` for SHM. Otherwise
//! `MSCCLPP_NET_PROVIDER` (or `FI_PROVIDER`) narrows the provider; `ibDev` names a domain or
//! fabric; `MSCCLPP_NET_IFACE` names the interface (the domain name of socket providers) and
//! `MSCCLPP_NET_ADDR` the local address to bind. With none of them, a hardware provider wins,
//! then `tcp;ofi_rxm`, `tcp`, `net`; `sockets` and `udp;ofi_rxd` (slow, hang-prone for RMA)
//! only when named. Socket providers then default to the loopback interface: correct on one
//! host, and it never sends traffic off the machine by surprise; a rank whose peer is not on
//! loopback fails in `add_peer` with a message naming the variables to set.
//!
//! Guarantees (Endpoint contract):
//! - Flag after data: WAW ordering is requested (`FI_ORDER_RMA_WAW | FI_ORDER_WAW`); where the
//!   provider does not grant it the flag write carries `FI_FENCE`, and failing that every
//!   earlier write to the peer is completed before the flag is posted.
//! - flush = "arrived": tcp;ofi_rxm and net complete a plain write locally before the data is
//!   at the target, so flush needs `FI_DELIVERY_COMPLETE`. Putting it on every write costs a
//!   target acknowledgement per write (measured, 8 B put + flag half round trip: tcp 7.5 us
//!   without, 11.6 us with it on both writes; shm 1.2 / 2.6 us), and on a flag alone it made
//!   the tcp signal half round trip bimodal (median 164 us against 3.7 us plain: the
//!   acknowledgement waits on the target's progress). So data and flag writes go plain, and a
//!   flush whose peer's last write was a plain one posts one 8-byte delivery-complete write (a
//!   "marker") into that peer's scratch word (advertised in its address blob). Writes to a
//!   peer are ordered (WAW, or the marker is fenced), so the last write's delivery implies
//!   every earlier write's. Without ordering or fence (`Drain`), every write carries
//!   FI_DELIVERY_COMPLETE. Where the provider refuses it, flush only means "locally complete"
//!   (INFO, once).
//! - A peer must keep progressing its endpoint until its peers' flushes are done (the marker
//!   needs the target's progress): a destroyed communicator lingers (`comm::LINGER`) before it
//!   closes its endpoints; raw `Endpoint` users progress until the peer is done.
//! - shm drops a write with a bad key or range at the target without an error completion; only
//!   validated blobs reach the data path, so this needs a peer bug, but it goes unreported.
//! - Source buffers stay untouched until completion; the flag's 8-byte value sits in a
//!   registered staging slot owned by the operation's context slot until its completion.
//! - `-FI_EAGAIN`: progress the CQ and retry the same operation, never drop; every wait is
//!   bounded by `crate::fifo::wait_timeout()`.
//!
//! GPU memory: with FI_HMEM (and a provider that registers CUDA memory, and a driver with
//! `cuFlushGPUDirectRDMAWrites`) device regions are registered directly, and values (signal
//! counts) written into them are relayed through the owner's proxy, which flushes GPUDirect
//! writes before storing them. Otherwise device regions are staged through pinned host memory
//! (`staging.rs`): the owner's proxy copies every write into the GPU buffer and stores values
//! after those copies. The owner chooses per region and tells writers in the region blob.

mod blob;
mod fabric;
mod mr;
mod select;
mod staging;
mod tuning;

use super::staging::Copier;
use super::{AbortCheck, Endpoint, MemKind, MrId, PeerId, Region, RemoteId};
use crate::error::{Error, Result};
use crate::mem::HostBlock;
use blob::{AddrBlob, ChanBlob, Mode, MrBlob};
use fabric::{fab_err, strerror, InfoList, InfoView, Objects, EAGAIN, EAVAIL, EBADFLAGS};
use libfabric_sys as fi;
use select::Ordering;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering as AtOrd};
use std::time::{Duration, Instant};

pub use tuning::Tuning;

/// Bounds on the operations one endpoint keeps in flight (the provider's tx size in between).
const MIN_DEPTH: usize = 16;
const MAX_DEPTH: usize = 4096;
/// Completions read per `fi_cq_read`.
const CQ_BATCH: usize = 32;
/// Index of the staging-ring registration in the MR table.
const STAGING_MR: usize = 0;
/// Index of the scratch word peers write flush markers into.
const SCRATCH_MR: usize = 1;
/// Bytes of the staging ring per op slot: the largest inline source (a staging record).
const INLINE_BYTES: usize = staging::RECORD_BYTES;
/// Longest wait for in-flight writes when an endpoint is dropped.
const DROP_DRAIN: Duration = Duration::from_secs(2);

/// Opens a libfabric RDM endpoint on `domain` (None: first suitable); `shm` selects the shm
/// provider. `device` is the CUDA device whose memory will be registered, if any.
pub fn open(domain: Option<&str>, shm: bool, device: Option<i32>) -> Result<Box<dyn Endpoint>> {
    Ok(Box::new(NetEndpoint::open(
        domain,
        shm,
        device,
        &Tuning::from_env(),
    )?))
}

/// Removes the shm provider's files left under this pid by a dead process
/// (`libfabric_sys::remove_stale_shm_files` says why), once, before the first endpoint.
fn remove_stale_shm_names() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for (name, r) in libfabric_sys::remove_stale_shm_files() {
            match r {
                Ok(()) => crate::info!("net: removed /dev/shm/{name}, left by a dead process that had this pid"),
                Err(e) => crate::warn!("net: cannot remove stale /dev/shm/{name} ({e}); shm endpoints may fail with EBUSY"),
            }
        }
    });
}

/// One in-flight operation. `ctx` comes first: its address is the operation's context, as
/// FI_CONTEXT/FI_CONTEXT2 require (provider scratch space that lives until the completion).
#[repr(C)]
#[derive(Default)]
struct OpSlot {
    ctx: fi::fi_context2,
    peer: PeerId,
    busy: bool,
    /// The bounce slot this write reads, freed at its completion.
    bounce: Option<usize>,
}

/// One RMA write to post (see `NetEndpoint::post`).
struct Op<'a> {
    peer: PeerId,
    /// Source address and descriptor (ignored with `inline`).
    local: u64,
    len: u64,
    desc: *mut c_void,
    raddr: u64,
    key: u64,
    fence: bool,
    /// Ask for FI_DELIVERY_COMPLETE (flags and markers).
    confirm: bool,
    /// At most `INLINE_BYTES` bytes, copied into the op slot's staging area and sent from there.
    inline: Option<&'a [u8]>,
    /// A bounce slot the write reads, busy until it completes.
    bounce: Option<usize>,
    /// Protocol traffic (staging acknowledgements): not a user write, so it does not make a
    /// later flush post a delivery marker.
    internal: bool,
}

/// How a local region handed out by `register` is backed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backing {
    /// Registered with libfabric (index into `mrs`): host memory.
    Mr(usize),
    /// Device memory registered with FI_HMEM (index into `mrs`): data direct, values relayed.
    Hmem(usize),
    /// Not registered: writes arrive through a staging channel.
    Staged,
}

struct LocalRegion {
    region: Region,
    backing: Backing,
    blob: Vec<u8>,
}

struct Peer {
    rank: usize,
    addr: fi::fi_addr_t,
    raw: Vec<u8>,
    /// The peer's scratch word: target of flush markers.
    scratch: MrBlob,
    /// Posted operations to this peer whose completion has not been read yet.
    outstanding: usize,
    /// A write without FI_DELIVERY_COMPLETE was posted since the last one with it: a flush
    /// must post a marker before its completions mean "arrived".
    unconfirmed: bool,
    /// Our staging channel for this rank (index into `chans`), once `address_for` made it.
    chan: Option<usize>,
    /// The staging channel the peer keeps for us (from its address).
    remote_chan: Option<ChanBlob>,
    /// The last user write to the peer was a staging record: once the peer acknowledges it,
    /// every earlier write has arrived (no delivery marker needed).
    last_was_record: bool,
}

struct Remote {
    peer: PeerId,
    blob: MrBlob,
}

/// Counters for tests and logs.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    pub posted: u64,
    pub completed: u64,
    /// Times the provider answered -FI_EAGAIN (each retried).
    pub eagain: u64,
}

/// A bounded wait: spins briefly, then yields (the peer's proxy may share our core), and fails
/// with `Error::Timeout` once `limit` has passed.
struct Wait {
    start: Instant,
    limit: Duration,
    n: u32,
}

impl Wait {
    fn new(limit: Duration) -> Self {
        Wait {
            start: Instant::now(),
            limit,
            n: 0,
        }
    }
    fn step(&mut self, what: impl FnOnce() -> String) -> Result<()> {
        self.n = self.n.wrapping_add(1);
        if self.n < 128 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
        if self.n % 64 == 0 && self.start.elapsed() > self.limit {
            return Err(Error::timeout(what(), self.limit));
        }
        Ok(())
    }
}

pub struct NetEndpoint {
    /// libfabric registrations; entry `STAGING_MR` is the staging ring, `SCRATCH_MR` the
    /// scratch word, then user regions, channels and bounce slots. Closed before `objs.ep`.
    mrs: mr::Table<*mut fi::fid_mr, Region>,
    /// Regions handed out by `register` (`MrId` indexes this), deduplicated by `region_ids`.
    regions: Vec<LocalRegion>,
    region_ids: HashMap<Region, MrId>,
    /// `INLINE_BYTES` per op slot: the source of values, flush markers and staging records.
    staging: HostBlock,
    /// 8 bytes peers write flush markers into (nobody reads them).
    scratch: HostBlock,
    objs: Objects,
    /// The chosen fi_info, kept (not read) so it outlives every object made from it: declared
    /// after `objs`, so it drops after them.
    _info: InfoList,
    provider: String,
    domain: String,
    addr: AddrBlob,
    policy: mr::Policy,
    ordering: Ordering,
    delivery_complete: bool,
    hmem: bool,
    slots: Box<[OpSlot]>,
    free: Vec<usize>,
    outstanding: usize,
    peers: Vec<Peer>,
    remotes: Vec<Remote>,
    max_chunk: u64,
    timeout: Duration,
    stats: Stats,
    /// Consulted by `poll` when nothing completed (`Endpoint::set_abort_check`), so that every
    /// wait loop, all of which poll, ends at once when a peer died: shm neither completes nor
    /// fails a write to a peer that died.
    abort_check: Option<AbortCheck>,
    /// The CUDA device whose memory this endpoint serves (None: host memory).
    device: Option<i32>,
    force_staging: bool,
    sizes: staging::Sizes,
    /// Copies for staging, made on first use; drained before the rings are freed.
    copier: Option<Box<dyn Copier>>,
    /// Staging channels, one per peer rank (`chan_ids`).
    chans: Vec<staging::Chan>,
    chan_ids: HashMap<usize, usize>,
    bounce: Option<staging::Bounce>,
}

// SAFETY: the raw pointers are libfabric objects and memory owned by this endpoint. The domain is
// opened with FI_THREAD_DOMAIN, and every use goes through `&mut self` (the comm and the proxy
// serialise on a Mutex), so no two threads touch the domain's objects at once.
unsafe impl Send for NetEndpoint {}

/// Logged once per process: what flush means without FI_DELIVERY_COMPLETE.
static WEAK_FLUSH_LOGGED: AtomicBool = AtomicBool::new(false);

impl NetEndpoint {
    /// Opens an endpoint (see `open`); `tuning` instead of the environment for the extra knobs.
    pub fn open(
        domain: Option<&str>,
        shm: bool,
        device: Option<i32>,
        tuning: &Tuning,
    ) -> Result<Self> {
        remove_stale_shm_names();
        let env = select::Env::read();
        let req = select::Request {
            domain,
            shm,
            // Only asks for FI_HMEM.
            device: device.filter(|_| !tuning.no_hmem),
        };
        let choice = select::choose(&req, &env)?;
        let info = choice.info;
        let i = info
            .first()
            .ok_or_else(|| Error::internal("empty fi_info after selection"))?;
        let v = InfoView(i);
        let (provider, domain_name, fabric_name) =
            (v.prov_name(), v.domain_name(), v.fabric_name());
        let d = v
            .domain()
            .ok_or_else(|| Error::internal("fi_info without domain_attr"))?;
        let mr_mode = d.mr_mode as u32;
        let unsupported = mr_mode & !(select::MR_MODE_SUPPORTED | fi::FI_MR_HMEM);
        if unsupported != 0 {
            return Err(Error::usage(format!(
                "provider {provider} requires mr_mode {} which this transport does not implement",
                select::mr_mode_names(unsupported)
            )));
        }
        let forced = tuning.force_mr_endpoint;
        let policy = mr::Policy {
            endpoint: mr_mode & fi::FI_MR_ENDPOINT != 0 || forced,
            forced: forced && mr_mode & fi::FI_MR_ENDPOINT == 0,
            prov_key: mr_mode & fi::FI_MR_PROV_KEY != 0,
            virt_addr: mr_mode & fi::FI_MR_VIRT_ADDR != 0,
            key_size: d.mr_key_size,
        };
        let tx_size = v.tx().map_or(MIN_DEPTH, |t| t.size);
        // More slots than the provider's queue makes the provider answer -FI_EAGAIN, which the
        // retry path then absorbs.
        let depth = tuning
            .depth
            .map(|n| n.clamp(1, 65536))
            .unwrap_or_else(|| tx_size.clamp(MIN_DEPTH, MAX_DEPTH));
        let max_msg = v.ep().map_or(u64::MAX, |e| e.max_msg_size as u64).max(8);
        let max_chunk = tuning.max_chunk.map_or(max_msg, |c| c.clamp(1, max_msg));

        let objs = Objects::open(&info, depth * 2)?;
        let raw = objs.name()?;
        let staging = HostBlock::zeroed(depth * INLINE_BYTES, 64)?;
        let scratch = HostBlock::zeroed(8, 64)?;
        let mut ep = NetEndpoint {
            mrs: mr::Table::new(),
            regions: Vec::new(),
            region_ids: HashMap::new(),
            staging,
            scratch,
            objs,
            provider: provider.clone(),
            domain: domain_name.clone(),
            addr: AddrBlob {
                provider: provider.clone(),
                addr_format: i.addr_format,
                raw,
                scratch: MrBlob::direct(policy.virt_addr, 0, 8, 0),
                chan: None,
            },
            _info: info,
            policy,
            ordering: choice.ordering,
            delivery_complete: choice.delivery_complete && !tuning.no_delivery_complete,
            hmem: choice.hmem,
            slots: (0..depth).map(|_| OpSlot::default()).collect(),
            free: (0..depth).rev().collect(),
            outstanding: 0,
            peers: Vec::new(),
            remotes: Vec::new(),
            max_chunk,
            timeout: crate::fifo::wait_timeout(),
            stats: Stats::default(),
            abort_check: None,
            device,
            force_staging: tuning.force_staging,
            sizes: staging::Sizes {
                ring: tuning
                    .staging_bytes
                    .map_or(staging::DEFAULT_RING, |b| {
                        b.clamp(staging::MIN_RING, staging::MAX_RING)
                    })
                    .next_multiple_of(4096),
                slots: tuning.staging_slots.map_or(staging::DEFAULT_SLOTS, |n| {
                    n.clamp(staging::MIN_SLOTS, staging::MAX_SLOTS)
                }),
            },
            copier: None,
            chans: Vec::new(),
            chan_ids: HashMap::new(),
            bounce: None,
        };
        // The staging ring: registered like any source buffer (FI_MR_LOCAL needs its desc).
        let staging_req = mr::Request {
            addr: ep.staging.ptr() as u64,
            len: ep.staging.len() as u64,
            access: fi::FI_WRITE as u64,
            requested_key: ep.request_key()?,
            cuda_device: None,
        };
        let m = mr::register(&mut ep.ops(), &policy, &staging_req)?;
        debug_assert_eq!(ep.mrs.mrs.len(), STAGING_MR);
        ep.mrs.mrs.push(m);
        ep.mrs.blobs.push(Vec::new());
        // The scratch word: peers' flush markers land here.
        let scratch_req = mr::Request {
            addr: ep.scratch.ptr() as u64,
            len: 8,
            access: fi::FI_REMOTE_WRITE as u64,
            requested_key: ep.request_key()?,
            cuda_device: None,
        };
        let m = mr::register(&mut ep.ops(), &policy, &scratch_req)?;
        debug_assert_eq!(ep.mrs.mrs.len(), SCRATCH_MR);
        ep.addr.scratch.key = m.key;
        if policy.virt_addr {
            ep.addr.scratch.base = m.addr;
        }
        ep.mrs.mrs.push(m);
        ep.mrs.blobs.push(Vec::new());

        crate::info!(
            "net: opened {} domain {domain_name} fabric {fabric_name}{} mr_mode {}{} ordering {:?} delivery-complete {} hmem {}{} depth {depth} max_msg {max_msg} chunk {max_chunk}",
            provider,
            env.addr.as_ref().map_or(String::new(), |a| format!(" addr {a}")),
            select::mr_mode_names(mr_mode),
            if policy.forced { " (FI_MR_ENDPOINT forced for testing)" } else { "" },
            ep.ordering,
            ep.delivery_complete,
            ep.hmem,
            if ep.force_staging { " (staging forced for testing)" } else { "" },
        );
        if !ep.delivery_complete && !WEAK_FLUSH_LOGGED.swap(true, AtOrd::Relaxed) {
            crate::info!(
                "net: {}: a flush waits for local completion only, which on some providers precedes arrival at the peer; the flag-after-data order still holds",
                if tuning.no_delivery_complete {
                    "FI_DELIVERY_COMPLETE disabled (MSCCLPP_NET_DELIVERY_COMPLETE=0)".to_string()
                } else {
                    format!("provider {provider} does not accept FI_DELIVERY_COMPLETE")
                }
            );
        }
        Ok(ep)
    }

    /// Counters (for tests).
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// The provider name, e.g. `tcp;ofi_rxm`.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    fn ops(&mut self) -> mr::RealOps<'_> {
        mr::RealOps {
            domain: self.objs.domain,
            ep: &mut self.objs.ep,
        }
    }

    /// Keeps a registration for teardown; returns its index in `mrs`.
    fn add_mr(&mut self, m: mr::LocalMr<*mut fi::fid_mr>) -> usize {
        self.mrs.mrs.push(m);
        self.mrs.blobs.push(Vec::new());
        self.mrs.mrs.len() - 1
    }

    fn request_key(&self) -> Result<u64> {
        if self.policy.prov_key {
            Ok(0)
        } else {
            mr::next_key(self.policy.key_size)
        }
    }

    fn peer_name(&self, p: PeerId) -> String {
        self.peers
            .get(p)
            .map_or_else(|| format!("peer {p}"), |x| format!("rank {}", x.rank))
    }

    /// Maps a completion's context back to its slot and retires it.
    fn retire(&mut self, ctx: *mut c_void) -> Result<PeerId> {
        let base = self.slots.as_ptr() as usize;
        let sz = std::mem::size_of::<OpSlot>();
        let off = (ctx as usize).wrapping_sub(base);
        let idx = off / sz;
        if off % sz != 0 || idx >= self.slots.len() || !self.slots[idx].busy {
            return Err(Error::internal(format!(
                "completion with unknown context {ctx:p} on {}",
                self.describe()
            )));
        }
        let s = &mut self.slots[idx];
        s.busy = false;
        let p = s.peer;
        if let Some(b) = s.bounce.take() {
            self.release_bounce(b);
        }
        self.free.push(idx);
        self.outstanding -= 1;
        if let Some(peer) = self.peers.get_mut(p) {
            peer.outstanding -= 1;
        }
        self.stats.completed += 1;
        Ok(p)
    }

    /// Reads available completions once; returns how many. When none were there, fails if the
    /// abort check says so (every bounded wait of this endpoint polls).
    fn poll(&mut self) -> Result<usize> {
        let n = self.poll_cq()?;
        if n == 0 {
            if let Some(why) = self.abort_check.as_ref().and_then(|f| f()) {
                return Err(Error::remote(format!("{}: {why}", self.describe())));
            }
        }
        Ok(n)
    }

    /// Reads available completions once; returns how many.
    fn poll_cq(&mut self) -> Result<usize> {
        let mut ents = [fi::fi_cq_entry::default(); CQ_BATCH];
        // SAFETY: cq is open with FI_CQ_FORMAT_CONTEXT; ents has room for CQ_BATCH entries.
        let rc = unsafe { fi::fi_cq_read(self.objs.cq, ents.as_mut_ptr().cast(), CQ_BATCH) } as i64;
        if rc > 0 {
            for e in &ents[..rc as usize] {
                self.retire(e.op_context)?;
            }
            return Ok(rc as usize);
        }
        if rc == EAGAIN {
            return Ok(0);
        }
        if rc == EAVAIL {
            return Err(self.read_error());
        }
        Err(fab_err(format!("fi_cq_read on {}", self.describe()), rc))
    }

    /// Turns the error completion at the head of the CQ into an error naming the peer.
    fn read_error(&mut self) -> Error {
        let mut e = fi::fi_cq_err_entry::default();
        // SAFETY: cq is open; e is a valid, zeroed error entry (err_data_size 0: no buffer).
        let rc = unsafe { fi::fi_cq_readerr(self.objs.cq, &mut e, 0) } as i64;
        if rc < 0 {
            return fab_err("fi_cq_readerr", rc);
        }
        let mut buf = [0 as std::ffi::c_char; 256];
        // SAFETY: cq is open; err_data belongs to the provider and is valid until the next
        // readerr; buf is writable for its length. Returns a string in buf or a static one.
        let p = unsafe {
            fi::fi_cq_strerror(
                self.objs.cq,
                e.prov_errno,
                e.err_data,
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        let prov = fabric::cstr(p);
        let who = match self.retire(e.op_context) {
            Ok(p) => self.peer_name(p),
            Err(_) => "an unknown peer".into(),
        };
        Error::Fabric {
            call: format!("RMA write to {who} over {} (completion)", self.describe()),
            code: -(e.err as i64),
            detail: format!("{}; provider: {prov}", strerror(e.err as i64)),
        }
    }

    /// A free op slot for `peer`, progressing until one frees up (bounded).
    fn acquire(&mut self, peer: PeerId) -> Result<usize> {
        let mut wait: Option<Wait> = None;
        loop {
            if let Some(i) = self.free.pop() {
                let s = &mut self.slots[i];
                s.busy = true;
                s.peer = peer;
                return Ok(i);
            }
            self.poll()?;
            let depth = self.slots.len();
            let rank = self.peers.get(peer).map_or(usize::MAX, |p| p.rank);
            wait.get_or_insert_with(|| Wait::new(self.timeout)).step(|| {
                format!("waiting for one of {depth} in-flight writes to complete (writing to rank {rank})")
            })?;
        }
    }

    fn release(&mut self, i: usize) {
        self.slots[i].busy = false;
        if let Some(b) = self.slots[i].bounce.take() {
            self.release_bounce(b);
        }
        self.free.push(i);
    }

    /// Posts one RMA write of `[op.local, op.local+op.len)` (or of `op.inline`, copied into the
    /// op slot's staging area first and sent from there) to `op.raddr` under `op.key`.
    fn post(&mut self, op: &Op<'_>) -> Result<()> {
        let (peer, len, raddr, key, fence, confirm) =
            (op.peer, op.len, op.raddr, op.key, op.fence, op.confirm);
        let (mut local, mut desc) = (op.local, op.desc);
        let slot = match self.acquire(peer) {
            Ok(s) => s,
            Err(e) => {
                if let Some(b) = op.bounce {
                    self.release_bounce(b);
                }
                return Err(e);
            }
        };
        self.slots[slot].bounce = op.bounce;
        if let Some(bytes) = op.inline {
            if bytes.len() > INLINE_BYTES || bytes.len() as u64 != len {
                self.release(slot);
                return Err(Error::internal(format!(
                    "inline write of {} bytes (length {len})",
                    bytes.len()
                )));
            }
            // SAFETY: slot < depth and the ring has INLINE_BYTES * depth bytes; the slot's area
            // is ours until its completion, so no in-flight write reads it while we store.
            let p = unsafe { self.staging.ptr().add(slot * INLINE_BYTES) };
            // SAFETY: p has room for INLINE_BYTES (checked above); distinct from `bytes`.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len()) };
            local = p as u64;
            desc = self.mrs.mrs[STAGING_MR].desc;
        }
        let iov = libc::iovec {
            iov_base: local as *mut c_void,
            iov_len: len as usize,
        };
        let rma = fi::fi_rma_iov {
            addr: raddr,
            len: len as usize,
            key,
        };
        let msg = fi::fi_msg_rma {
            msg_iov: (&iov as *const libc::iovec).cast(),
            desc: &mut desc,
            iov_count: 1,
            addr: self.peers[peer].addr,
            rma_iov: &rma,
            rma_iov_count: 1,
            context: (&mut self.slots[slot] as *mut OpSlot).cast(),
            data: 0,
        };
        let mut wait: Option<Wait> = None;
        loop {
            let mut flags = fi::FI_COMPLETION as u64;
            // Every write in Drain mode (no ordering to lean on), else only markers.
            let dc = self.delivery_complete && (confirm || self.ordering == Ordering::Drain);
            if dc {
                flags |= fi::FI_DELIVERY_COMPLETE as u64;
            }
            if fence {
                flags |= fi::FI_FENCE as u64;
            }
            // SAFETY: ep is open; msg and everything it points to (iov, desc, rma) live until
            // the call returns (the provider copies them); the source memory is registered and
            // stays valid until completion (user buffers by contract, staging by slot
            // ownership); the context is a slot that lives in `self.slots` until retired.
            let rc = unsafe { fi::fi_writemsg(self.objs.ep, &msg, flags) } as i64;
            if rc == 0 {
                break;
            }
            let r = if rc == EAGAIN {
                // The provider's queue is full: complete something, then retry the same write.
                self.stats.eagain += 1;
                let (rank, limit) = (self.peers[peer].rank, self.timeout);
                self.poll().and_then(|_| {
                    wait.get_or_insert_with(|| Wait::new(limit)).step(|| {
                        format!("provider kept answering -FI_EAGAIN to a write to rank {rank}")
                    })
                })
            } else if rc == EBADFLAGS && self.delivery_complete {
                // Accepted at fi_getinfo time but refused per operation: fall back once.
                self.delivery_complete = false;
                crate::info!(
                    "net: {} refuses FI_DELIVERY_COMPLETE on writes; flush now waits for local completion only",
                    self.provider
                );
                Ok(())
            } else {
                Err(fab_err(
                    format!(
                        "fi_writemsg to {} over {}",
                        self.peer_name(peer),
                        self.describe()
                    ),
                    rc,
                ))
            };
            if let Err(e) = r {
                self.release(slot);
                return Err(e);
            }
        }
        let dc = self.delivery_complete && (confirm || self.ordering == Ordering::Drain);
        self.stats.posted += 1;
        self.outstanding += 1;
        let p = &mut self.peers[peer];
        p.outstanding += 1;
        if !op.internal {
            p.unconfirmed = !dc;
            p.last_was_record = false;
        }
        Ok(())
    }

    /// Orders the next write to `peer` after every earlier one, as a flag must be: nothing
    /// with WAW ordering, FI_FENCE on it (returns true), or drain every earlier write first.
    fn order_before_flag(&mut self, peer: PeerId) -> Result<bool> {
        match self.ordering {
            Ordering::Waw => Ok(false),
            Ordering::Fence => Ok(true),
            Ordering::Drain => {
                self.drain_writes(peer)?;
                Ok(false)
            }
        }
    }

    /// Waits (bounded) until every write to `peer` has arrived (`flush` without the staging
    /// acknowledgements; see the module doc for what "arrived" rests on).
    fn drain_writes(&mut self, peer: PeerId) -> Result<()> {
        if self.delivery_complete && self.peers[peer].unconfirmed {
            // The marker: ordered after every earlier write to the peer (WAW, or fenced), and
            // its completion waits for delivery, so all of them have arrived when it completes.
            let sc = self.peers[peer].scratch;
            let desc = self.mrs.mrs[STAGING_MR].desc;
            let fence = self.ordering == Ordering::Fence;
            self.post(&Op {
                peer,
                local: 0,
                len: 8,
                desc,
                raddr: sc.base,
                key: sc.key,
                fence,
                confirm: true,
                inline: Some(&0u64.to_ne_bytes()),
                bounce: None,
                internal: false,
            })?;
        }
        let mut wait: Option<Wait> = None;
        // Ends when every write to `peer` has completed, on an error completion, or at the
        // deadline.
        while self.peers[peer].outstanding > 0 {
            if self.poll()? > 0 {
                continue;
            }
            let (n, rank, limit) = (
                self.peers[peer].outstanding,
                self.peers[peer].rank,
                self.timeout,
            );
            wait.get_or_insert_with(|| Wait::new(limit)).step(|| {
                format!(
                    "flushing {n} writes to rank {rank}: no completion (is the peer's proxy running?)"
                )
            })?;
        }
        Ok(())
    }

    fn remote(&self, peer: PeerId, dst: RemoteId) -> Result<MrBlob> {
        let r = self.remotes.get(dst).ok_or_else(|| {
            Error::invalid_arg(format!(
                "unknown remote region {dst} on {}",
                self.describe()
            ))
        })?;
        if r.peer != peer {
            return Err(Error::invalid_arg(format!(
                "remote region {dst} belongs to {}, not {}",
                self.peer_name(r.peer),
                self.peer_name(peer)
            )));
        }
        Ok(r.blob)
    }

    /// Registers device memory with FI_HMEM if this endpoint can use it directly: the provider
    /// has FI_HMEM, registering CUDA memory succeeds, and the driver can flush GPUDirect RDMA
    /// writes (needed before a relayed value is stored). None: stage it instead.
    fn try_hmem(&mut self, region: Region, device: i32) -> Result<Option<usize>> {
        if !self.hmem {
            return Ok(None);
        }
        if !crate::cuda::has_flush_gpudirect_rdma() {
            log_once(
                &NO_GDR_FLUSH_LOGGED,
                "net: the CUDA driver has no cuFlushGPUDirectRDMAWrites: GPU memory is staged through host memory instead of FI_HMEM",
            );
            return Ok(None);
        }
        let req = mr::Request {
            addr: region.addr,
            len: region.len,
            access: fi::FI_WRITE as u64 | fi::FI_REMOTE_WRITE as u64,
            requested_key: self.request_key()?,
            cuda_device: Some(device),
        };
        let policy = self.policy;
        match mr::register(&mut self.ops(), &policy, &req) {
            Ok(m) => Ok(Some(self.add_mr(m))),
            // A provider that claims FI_HMEM may still lack CUDA support in this build.
            Err(e) => {
                log_once(
                    &HMEM_FAILED_LOGGED,
                    &format!(
                        "net: {} reports FI_HMEM but registering CUDA memory failed ({e}): GPU memory is staged through host memory",
                        self.provider
                    ),
                );
                Ok(None)
            }
        }
    }

    fn check_peer(&self, peer: PeerId) -> Result<()> {
        if peer >= self.peers.len() {
            return Err(Error::invalid_arg(format!(
                "unknown peer {peer} on {}",
                self.describe()
            )));
        }
        Ok(())
    }
}

/// Logged once per process each: why GPU memory is staged although the provider has FI_HMEM.
static NO_GDR_FLUSH_LOGGED: AtomicBool = AtomicBool::new(false);
static HMEM_FAILED_LOGGED: AtomicBool = AtomicBool::new(false);

fn log_once(flag: &AtomicBool, msg: &str) {
    // Relaxed: only "once" matters, nothing is published through the flag.
    if !flag.swap(true, AtOrd::Relaxed) {
        crate::info!("{msg}");
    }
}

fn range_ok(off: u64, size: u64, len: u64) -> bool {
    off.checked_add(size).is_some_and(|e| e <= len)
}

impl Endpoint for NetEndpoint {
    fn describe(&self) -> String {
        format!("net:{}/{}", self.provider, self.domain)
    }

    fn address(&self) -> Result<Vec<u8>> {
        Ok(self.addr.encode())
    }

    fn address_for(&mut self, remote_rank: usize) -> Result<Vec<u8>> {
        let chan = self.chan_for(remote_rank)?;
        Ok(AddrBlob {
            chan: Some(chan),
            ..self.addr.clone()
        }
        .encode())
    }

    fn add_peer(&mut self, remote_rank: usize, address: &[u8]) -> Result<PeerId> {
        let a = AddrBlob::decode(address, self.policy.virt_addr, self.policy.key_size)
            .map_err(|e| Error::remote(format!("rank {remote_rank}: {e}")))?;
        if a.provider != self.provider || a.addr_format != self.addr.addr_format {
            return Err(Error::invalid_arg(format!(
                "rank {remote_rank} uses libfabric provider {} (address format {}) but this endpoint is {} (format {}): set MSCCLPP_NET_PROVIDER / ibDev alike on every rank",
                a.provider, a.addr_format, self.describe(), self.addr.addr_format
            )));
        }
        let mut raw = a.raw;
        if self.addr.addr_format == fi::FI_ADDR_STR {
            // A C string: no interior NUL, terminated.
            let body = raw.strip_suffix(&[0]).unwrap_or(&raw);
            if body.is_empty() || body.contains(&0) {
                return Err(Error::remote(format!(
                    "rank {remote_rank}: malformed string address"
                )));
            }
            raw = [body, &[0]].concat();
        } else if raw.len() != self.addr.raw.len() {
            return Err(Error::remote(format!(
                "rank {remote_rank}: address of {} bytes, this provider's are {}",
                raw.len(),
                self.addr.raw.len()
            )));
        }
        let fmt = self.addr.addr_format;
        let (here_lo, there_lo) = (
            select::is_loopback(fmt, &self.addr.raw),
            select::is_loopback(fmt, &raw),
        );
        if here_lo != there_lo {
            return Err(Error::invalid_arg(format!(
                "rank {remote_rank} listens on a {} address but this endpoint ({}) on a {} one: ranks on different hosts need a routable interface: set MSCCLPP_NET_IFACE (or MSCCLPP_NET_ADDR, or pass ibDev) on every rank",
                if there_lo { "loopback" } else { "non-loopback" },
                self.describe(),
                if here_lo { "loopback" } else { "non-loopback" },
            )));
        }
        if let Some(i) = self.peers.iter().position(|p| p.rank == remote_rank) {
            if self.peers[i].raw == raw {
                // Several connections to one rank: each address carries the same channel.
                if self.peers[i].remote_chan.is_none() {
                    self.peers[i].remote_chan = a.chan;
                }
                return Ok(i);
            }
            return Err(Error::invalid_arg(format!(
                "rank {remote_rank} was already added with a different address"
            )));
        }
        let mut addr: fi::fi_addr_t = fi::FI_ADDR_NOTAVAIL;
        // SAFETY: av is open; raw holds one address of this provider's format (checked above);
        // addr receives the handle. Synchronous insert (no flags, no context).
        let rc = unsafe {
            fi::fi_av_insert(
                self.objs.av,
                raw.as_ptr().cast(),
                1,
                &mut addr,
                0,
                std::ptr::null_mut(),
            )
        } as i64;
        if rc != 1 {
            return Err(fab_err(
                format!("fi_av_insert for rank {remote_rank}"),
                if rc < 0 { rc } else { -(fi::FI_EINVAL as i64) },
            ));
        }
        let chan = self.chan_ids.get(&remote_rank).copied();
        self.peers.push(Peer {
            rank: remote_rank,
            addr,
            raw,
            scratch: a.scratch,
            outstanding: 0,
            unconfirmed: false,
            chan,
            remote_chan: a.chan,
            last_was_record: false,
        });
        if let Some(ci) = chan {
            self.chans[ci].peer = Some(self.peers.len() - 1);
        }
        crate::trace!("net: {} added rank {remote_rank}", self.describe());
        Ok(self.peers.len() - 1)
    }

    fn register(&mut self, region: Region) -> Result<(MrId, Vec<u8>)> {
        if region.addr == 0 || region.len == 0 || region.addr.checked_add(region.len).is_none() {
            return Err(Error::invalid_arg(format!(
                "cannot register {:#x}+{} bytes",
                region.addr, region.len
            )));
        }
        if let Some(&id) = self.region_ids.get(&region) {
            return Ok((id, self.regions[id].blob.clone()));
        }
        let id = self.regions.len();
        let backing = match region.kind {
            MemKind::Host if self.force_staging => {
                if self.device.is_some() {
                    return Err(Error::usage(
                        "MSCCLPP_TEST_FORCE_STAGING stages host memory on host endpoints only",
                    ));
                }
                Backing::Staged
            }
            MemKind::Host => {
                let req = mr::Request {
                    addr: region.addr,
                    len: region.len,
                    access: fi::FI_WRITE as u64 | fi::FI_REMOTE_WRITE as u64,
                    requested_key: self.request_key()?,
                    cuda_device: None,
                };
                let policy = self.policy;
                let m = mr::register(&mut self.ops(), &policy, &req)?;
                Backing::Mr(self.add_mr(m))
            }
            MemKind::Device(d) => {
                if self.device != Some(d) {
                    return Err(Error::usage(format!(
                        "{} serves {}, not CUDA device {d}",
                        self.describe(),
                        self.device
                            .map_or("host memory".to_string(), |x| format!("CUDA device {x}"))
                    )));
                }
                match self.try_hmem(region, d)? {
                    Some(i) => Backing::Hmem(i),
                    None => {
                        // Fail now rather than at the first write if copies are impossible.
                        self.copier()?;
                        Backing::Staged
                    }
                }
            }
        };
        let virt = self.policy.virt_addr;
        let blob = match backing {
            Backing::Mr(i) | Backing::Hmem(i) => MrBlob {
                virt_addr: virt,
                base: if virt { region.addr } else { 0 },
                len: region.len,
                key: self.mrs.mrs[i].key,
                mode: if matches!(backing, Backing::Hmem(_)) {
                    Mode::RelayValues
                } else {
                    Mode::Direct
                },
                id: id as u32,
            },
            Backing::Staged => MrBlob {
                virt_addr: virt,
                base: 0,
                len: region.len,
                key: 0,
                mode: Mode::Staged,
                id: id as u32,
            },
        }
        .encode();
        self.regions.push(LocalRegion {
            region,
            backing,
            blob: blob.clone(),
        });
        self.region_ids.insert(region, id);
        crate::trace!(
            "net: {} registered {:#x}+{} as region {id} ({backing:?})",
            self.describe(),
            region.addr,
            region.len
        );
        Ok((id, blob))
    }

    fn import(&mut self, peer: PeerId, blob: &[u8]) -> Result<RemoteId> {
        self.check_peer(peer)?;
        let b = MrBlob::decode(blob, self.policy.virt_addr, self.policy.key_size)
            .map_err(|e| Error::remote(format!("{}: {e}", self.peer_name(peer))))?;
        self.remotes.push(Remote { peer, blob: b });
        Ok(self.remotes.len() - 1)
    }

    fn write(
        &mut self,
        peer: PeerId,
        src: MrId,
        src_off: u64,
        dst: RemoteId,
        dst_off: u64,
        size: u64,
    ) -> Result<()> {
        self.check_peer(peer)?;
        let remote = self.remote(peer, dst)?;
        match self.regions.get(src) {
            Some(r) if range_ok(src_off, size, r.region.len) => {}
            Some(r) => {
                return Err(Error::invalid_arg(format!(
                    "write refused: source range [{src_off}, {src_off}+{size}) outside the {}-byte registration",
                    r.region.len
                )))
            }
            None => {
                return Err(Error::invalid_arg(format!(
                    "unknown local registration {src}"
                )))
            }
        }
        if size == 0 || !range_ok(dst_off, size, remote.len) {
            return Err(Error::invalid_arg(format!(
                "write refused: destination range [{dst_off}, {dst_off}+{size}) outside the {}-byte region imported from {}",
                remote.len,
                self.peer_name(peer)
            )));
        }
        if remote.mode == Mode::Staged {
            return self.write_staged(peer, src, src_off, remote, dst_off, size);
        }
        let chunk = self.source_chunk(src, u64::MAX)?;
        let mut done = 0u64;
        while done < size {
            let n = (size - done).min(chunk);
            self.post_from(
                peer,
                src,
                src_off + done,
                n,
                remote.base + dst_off + done,
                remote.key,
            )?;
            done += n;
        }
        Ok(())
    }

    fn write_value(&mut self, peer: PeerId, dst: RemoteId, dst_off: u64, value: u64) -> Result<()> {
        self.check_peer(peer)?;
        let remote = self.remote(peer, dst)?;
        if !range_ok(dst_off, 8, remote.len) {
            return Err(Error::invalid_arg(format!(
                "flag write refused: 8 bytes at {dst_off} outside the {}-byte region imported from {}",
                remote.len,
                self.peer_name(peer)
            )));
        }
        if remote.mode != Mode::Direct {
            // Into device memory: the owner's proxy stores it after the data (module doc).
            if dst_off % 8 != 0 {
                return Err(Error::invalid_arg(format!(
                    "flag write refused: offset {dst_off} is not 8-byte aligned"
                )));
            }
            return self
                .post_record(
                    peer,
                    staging::Record {
                        seq: 0,
                        kind: staging::Kind::Value,
                        region: remote.id,
                        off: dst_off,
                        arg: value,
                        ring_pos: 0,
                    },
                )
                .map(|_| ());
        }
        if let Some((ci, sent)) = self.records_pending(peer) {
            // A direct flag must not overtake staged data still being applied by the peer.
            self.wait_acked(ci, sent)?;
        }
        let fence = self.order_before_flag(peer)?;
        let desc = self.mrs.mrs[STAGING_MR].desc;
        self.post(&Op {
            peer,
            local: 0,
            len: 8,
            desc,
            raddr: remote.base + dst_off,
            key: remote.key,
            fence,
            // Flags are plain writes, like data: FI_DELIVERY_COMPLETE on tcp;ofi_rxm turned the
            // 8-byte signal half round trip from 3.7 us into a bimodal 7..230 us (acks wait for
            // the target's progress), and its p99 is milliseconds even in a raw ping-pong. A
            // flush confirms delivery with one marker write instead (see module doc).
            confirm: false,
            inline: Some(&value.to_ne_bytes()),
            bounce: None,
            internal: false,
        })
    }

    /// Returns when every earlier write to `peer` has arrived: for staged regions, once the
    /// peer has copied it into its destination memory (it acknowledges only then).
    fn flush(&mut self, peer: PeerId) -> Result<()> {
        self.check_peer(peer)?;
        if let Some(ci) = self.peers[peer].chan {
            let sent = self.chans[ci].out.sent;
            self.wait_acked(ci, sent)?;
            if self.peers[peer].last_was_record {
                // Acknowledged, and ordered after every earlier write: all have arrived.
                self.peers[peer].unconfirmed = false;
            }
        }
        self.drain_writes(peer)
    }

    fn set_abort_check(&mut self, check: AbortCheck) {
        self.abort_check = Some(check);
    }

    fn progress(&mut self) -> Result<()> {
        // Drains what is there (bounded: a few batches), which also drives the provider's
        // progress engine for incoming writes.
        for _ in 0..8 {
            if self.poll()? < CQ_BATCH {
                break;
            }
        }
        Ok(())
    }

    fn poll_incoming(&mut self) -> Result<()> {
        if self.chans.iter().any(|c| c.incoming.is_some()) {
            self.apply_incoming()?;
        }
        Ok(())
    }
}

impl Drop for NetEndpoint {
    fn drop(&mut self) {
        // In-flight writes still read our registered memory: let them finish (bounded), then
        // close every MR (endpoint-bound ones must go before the endpoint), then the endpoint;
        // `objs` closes the CQ, AV, domain and fabric as it drops, and only then is the staging
        // ring freed (fields drop after this body).
        self.drain_copier();
        let mut wait = Wait::new(DROP_DRAIN.min(self.timeout));
        while self.outstanding > 0 {
            match self.poll_cq() {
                Ok(0) => {
                    if wait.step(String::new).is_err() {
                        crate::warn!(
                            "net: closing {} with {} writes still in flight",
                            self.describe(),
                            self.outstanding
                        );
                        break;
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    crate::warn!("net: while closing {}: {e}", self.describe());
                    if wait.step(String::new).is_err() {
                        break;
                    }
                }
            }
        }
        let mut mrs = std::mem::replace(&mut self.mrs, mr::Table::new());
        if let Err(e) = mr::teardown(&mut self.ops(), &mut mrs) {
            crate::warn!("net: teardown of {}: {e}", self.describe());
        }
    }
}

#[cfg(test)]
mod tests;
