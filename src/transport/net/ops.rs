//! The writes in flight on one endpoint: the libfabric objects they are posted on, the op slots
//! whose addresses are their contexts, posting with the -FI_EAGAIN retry, reading the completion
//! queue, and the bounded wait every loop of the endpoint steps with.

use super::counted;
use super::fabric::{self, fab_err, strerror, InfoList, Objects, EAGAIN, EAVAIL, EBADFLAGS};
use super::mr;
use super::order::{FlagOrder, Plan};
use super::peers::Peers;
use super::record::RECORD_BYTES;
use super::signals;
use super::unordered::Layer;
use crate::error::{Error, Result};
use crate::mem::HostBlock;
use crate::sync::{Backoff, Nap, Policy};
use crate::transport::{AbortCheck, PeerId, Timed};
use libfabric_sys as fi;
use std::ffi::c_void;
use std::time::Duration;

/// Completions read per `fi_cq_read`.
pub(super) const CQ_BATCH: usize = 32;
/// Bytes of the staging ring per op slot: the largest inline source (a staging record).
pub(super) const INLINE_BYTES: usize = RECORD_BYTES;
// Flags, markers and records carry no activity mark (`Ops::post`) by their size alone.
const _: () = assert!(INLINE_BYTES as u64 <= super::order::FOLLOWER_BYTES);
/// Longest wait for in-flight writes when an endpoint is dropped.
const DROP_DRAIN: Duration = Duration::from_secs(2);

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
    /// A staging acknowledgement (`Peer::acks_in_flight`).
    ack: bool,
    /// Its sequence number among the writes to its peer (`Peer::completed`).
    seq: u64,
}

/// A try's write that did not complete within its bound, and CQ data of a try that did not
/// arrive within it (`probe.rs`): either may still come, and is then dropped, not taken for a
/// peer's (which would fail the endpoint).
#[derive(Default)]
pub(super) struct Strays {
    /// The contexts of the writes, kept until their completions come (or the endpoint drops).
    /// Boxed: a context's address is the provider's handle on it, which must not move when the
    /// vector grows.
    #[allow(clippy::vec_box)]
    pub ctxs: Vec<Box<fi::fi_context2>>,
    pub data: Vec<u64>,
}

impl Strays {
    /// Takes the write of context `ctx`, if it is a stray.
    pub(super) fn take_ctx(&mut self, ctx: *mut c_void) -> bool {
        let i = self
            .ctxs
            .iter()
            .position(|c| std::ptr::eq(&**c, ctx.cast::<fi::fi_context2>()));
        i.map(|i| self.ctxs.swap_remove(i)).is_some()
    }

    /// Takes one stray CQ datum equal to `data`, if there is one.
    pub(super) fn take_data(&mut self, data: u64) -> bool {
        let i = self.data.iter().position(|d| *d == data);
        i.map(|i| self.data.swap_remove(i)).is_some()
    }
}

/// One RMA write to post (see `Ops::post`).
pub(super) struct Op<'a> {
    pub peer: PeerId,
    /// Source address and descriptor (ignored with `inline`).
    pub local: u64,
    pub len: u64,
    pub desc: *mut c_void,
    pub raddr: u64,
    pub key: u64,
    pub fence: bool,
    /// Ask for FI_DELIVERY_COMPLETE (flags and markers).
    pub confirm: bool,
    /// At most `INLINE_BYTES` bytes, copied into the op slot's staging area and sent from there.
    pub inline: Option<&'a [u8]>,
    /// A bounce slot the write reads, busy until it completes.
    pub bounce: Option<usize>,
    /// Protocol traffic (staging acknowledgements): not a user write, so it does not make a
    /// later flush post a delivery marker.
    pub internal: bool,
    /// A staging acknowledgement: counted in `Peer::acks_in_flight` until it completes.
    pub ack: bool,
    /// Remote CQ data: a signal the target stores when it reads this write's completion
    /// (`signals.rs`), or on an endpoint that counts signals a `counted::ask` (`Ops::post`
    /// makes the tag).
    pub cq_data: Option<u64>,
}

impl<'a> Op<'a> {
    /// A plain write of `bytes` (at most `INLINE_BYTES`: flags, records, acknowledgements,
    /// markers), sent from the op slot's own area, to `raddr` under `key`. Callers set
    /// `fence`, `confirm` or `internal` on the result where they need them.
    pub fn inline(peer: PeerId, bytes: &'a [u8], raddr: u64, key: u64) -> Op<'a> {
        Op {
            peer,
            local: 0,
            len: bytes.len() as u64,
            // Replaced by the op slot's descriptor when posted.
            desc: std::ptr::null_mut(),
            raddr,
            key,
            fence: false,
            confirm: false,
            inline: Some(bytes),
            bounce: None,
            internal: false,
            ack: false,
            cq_data: None,
        }
    }
}

/// Counters for tests and logs.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    pub posted: u64,
    pub completed: u64,
    /// Times the provider answered -FI_EAGAIN (each retried).
    pub eagain: u64,
    /// GPUDirect RDMA flushes before relayed values (one per value into FI_HMEM memory).
    pub gdr_flushes: u64,
    /// Staging, the writer's side: chunks and bytes sent into peers' rings; time waiting for
    /// ring room (the receiver is behind) and for copies out of GPU memory (the copy engine is
    /// behind); the receiver's side: records applied. Logged when the endpoint closes, so a
    /// slow staged path says which side holds it up.
    pub staged_chunks: u64,
    pub staged_bytes: u64,
    pub ring_waits: Timed,
    pub copy_out_waits: Timed,
    /// Waits for a free bounce slot (the writes that read them have not completed).
    pub bounce_waits: Timed,
    pub records_applied: u64,
    /// Flags, records and markers posted with FI_FENCE, and those that first waited for the
    /// peer's writes to complete (`order::Plan::after`).
    pub order_fences: u64,
    pub order_drains: u64,
    /// Flags queued behind the writes before them instead of a drain (`Peers::defer_flag`),
    /// and those of them not posted because a newer count into the same word went instead.
    pub deferred_flags: u64,
    pub coalesced_flags: u64,
    /// Signals sent as remote CQ data riding on a put's write (`signals.rs`), and those
    /// received and stored (`signals::Incoming::stored`, filled in by `NetEndpoint::stats`).
    pub signals_with_data: u64,
    pub signals_stored: u64,
    /// Naps of waits for the provider on a crowded host (`Ops::pause`), and their time.
    pub naps: Timed,
}

/// How the endpoint waits for the provider: spins briefly, then yields (the peer's proxy may
/// share our core). On a crowded host (`sync::napping_waits`) a wait that has lasted
/// `sync::NAP_AFTER` naps instead (`Ops::pause`).
const WAIT: Policy = Policy {
    spins: 127,
    yield_for: Duration::ZERO,
    nap: Nap::Yield,
};

/// The longest nap of a wait for the provider on a crowded host: a completion it waits for
/// is then at most this late.
const NAP_MAX: Duration = Duration::from_millis(1);

/// A bounded wait for the provider (`Ops::pause`), failing with `Error::Timeout` once `limit`
/// has passed.
pub(super) fn provider_wait(limit: Duration) -> Backoff {
    Backoff::new(WAIT, limit)
}

/// The libfabric objects of one endpoint and the operations in flight on them. Fields drop in
/// this order after `Drop for NetEndpoint` closed every MR and the endpoint: the two registered
/// host blocks, the objects (CQ, AV, domain, fabric), the fi_info, then the op slots.
pub(super) struct Ops {
    /// `INLINE_BYTES` per op slot: the source of values, flush markers and staging records.
    pub inline: HostBlock,
    /// The descriptor of `inline`'s registration (`INLINE_MR`), set once it is registered.
    pub inline_desc: *mut c_void,
    /// 8 bytes peers write flush markers into (nobody reads them).
    pub scratch: HostBlock,
    pub objs: Objects,
    /// The chosen fi_info, kept (not read) so it outlives every object made from it: declared
    /// after `objs`, so it drops after them.
    _info: InfoList,
    /// The unordered test layer, where `MSCCLPP_TEST_UNORDERED` asks for it: every write and
    /// completion goes through it. After `objs`: its pieces' contexts and source copies must
    /// outlive the endpoint.
    pub layer: Option<Box<Layer>>,
    /// What the endpoint's tries of its plan left behind (`probe.rs`): completions and CQ data
    /// that may still come. After `objs`: the contexts must outlive the endpoint.
    pub strays: Strays,
    pub provider: String,
    pub domain: String,
    /// How flags, staging records and markers are ordered after earlier writes, and which
    /// writes carry FI_DELIVERY_COMPLETE for that (`order`).
    pub plan: Plan,
    /// Flush markers carry FI_DELIVERY_COMPLETE (granted, and not turned off): a flush then
    /// means arrived, else locally complete.
    pub delivery_complete: bool,
    /// Signals ride as remote CQ data (`signals.rs`), both ways: this endpoint's host regions
    /// accept them, and values into a peer's region that accepts them are sent so.
    pub cq_signals: bool,
    /// The regions signals may name, and the stores of those that arrived.
    pub incoming: signals::Incoming,
    /// The values sent as CQ data so far (checked to be ones the receiver can rebuild).
    pub outgoing: signals::Outgoing,
    /// Data writes of more than `order::FOLLOWER_BYTES` without a signal carry
    /// `signals::ACTIVITY` (software providers, `signals.rs`).
    pub activity_marks: bool,
    /// How many of the peers' CQ-data writes (`incoming.arrived`) `took_incoming` last saw.
    pub incoming_told: u64,
    /// Signals are counted by the receiver (`counted.rs`): every write to a peer with a
    /// stream carries a tag.
    pub counted: bool,
    slots: Box<[OpSlot]>,
    free: Vec<usize>,
    pub outstanding: usize,
    /// Bounce slots (`staging::Bounce`) in use: taken by `Staging::bounce_slot`, freed at the
    /// completion of the write that reads the slot (or when that write is not posted). Sized
    /// when the slots are made.
    pub bounce_busy: Vec<bool>,
    pub max_chunk: u64,
    pub timeout: Duration,
    pub stats: Stats,
    /// Waits that last nap (`sync::napping_waits`, decided when the endpoint opens).
    pub napping: bool,
    /// Consulted by `poll` when nothing completed (`Endpoint::set_abort_check`), so that every
    /// wait loop, all of which poll, ends at once when a peer died: shm neither completes nor
    /// fails a write to a peer that died.
    pub abort_check: Option<AbortCheck>,
}

impl Ops {
    /// Opens the libfabric objects for `info` (a CQ of twice `depth` entries, four times with
    /// CQ-data signals), `depth` op slots and their inline area, and the scratch word; returns
    /// them with the endpoint's address. `(plan, delivery_complete, cq_signals)`: the fields.
    pub fn open(
        info: InfoList,
        depth: usize,
        max_chunk: u64,
        (provider, domain): (String, String),
        (plan, delivery_complete, cq_signals): (Plan, bool, bool),
    ) -> Result<(Self, Vec<u8>)> {
        // Room for the completions of our writes and, with CQ-data signals, as many of peers'
        // writes to us read late.
        let objs = Objects::open(&info, depth * if cq_signals { 4 } else { 2 })?;
        let raw = objs.name()?;
        let inline = HostBlock::zeroed(depth * INLINE_BYTES, 64)?;
        let scratch = HostBlock::zeroed(8, 64)?;
        let ops = Ops {
            inline,
            inline_desc: std::ptr::null_mut(),
            scratch,
            objs,
            _info: info,
            layer: None,
            strays: Strays::default(),
            provider,
            domain,
            plan,
            delivery_complete,
            cq_signals,
            incoming: signals::Incoming::default(),
            outgoing: signals::Outgoing::default(),
            activity_marks: false,
            incoming_told: 0,
            counted: false,
            slots: (0..depth).map(|_| OpSlot::default()).collect(),
            free: (0..depth).rev().collect(),
            outstanding: 0,
            bounce_busy: Vec::new(),
            max_chunk,
            timeout: crate::config::wait_timeout(),
            stats: Stats::default(),
            napping: crate::sync::napping_waits(),
            abort_check: None,
        };
        Ok((ops, raw))
    }

    /// One pause of a bounded wait for the provider (`provider_wait`): by its policy; on a
    /// crowded host, once it has lasted `sync::NAP_AFTER`, a nap (counted in `stats.naps`).
    /// `Err(timeout)` naming `what` once the bound has passed.
    pub fn pause(&mut self, wait: &mut Backoff, what: impl FnOnce() -> String) -> Result<()> {
        if !self.napping || wait.waited() < crate::sync::NAP_AFTER {
            return wait.step(what);
        }
        let since = std::time::Instant::now();
        std::thread::sleep(crate::sync::long_nap(wait.waited(), NAP_MAX));
        self.stats.naps.add(since);
        wait.paused_elsewhere();
        wait.check(what)
    }

    /// Waits for the provider until `ready` gives a value: each round asks `ready` (which may
    /// post what became possible), reads completions, and pauses (`pause`) only when none came.
    /// Bounded by the endpoint's wait timeout; `what` says in the error what was waited for.
    pub fn wait_until<T>(
        &mut self,
        peers: &mut Peers,
        mut ready: impl FnMut(&mut Ops, &mut Peers) -> Result<Option<T>>,
        what: impl Fn(&Peers) -> String,
    ) -> Result<T> {
        let mut wait: Option<Backoff> = None;
        // Ends when `ready` gives a value, on an error (its own or a completion's), or at the
        // deadline.
        loop {
            if let Some(t) = ready(self, peers)? {
                return Ok(t);
            }
            if self.poll(peers)? > 0 {
                continue;
            }
            let limit = self.timeout;
            let w = wait.get_or_insert_with(|| provider_wait(limit));
            self.pause(w, || what(peers))?;
        }
    }

    /// `Endpoint::describe`: `net:<provider>/<domain>`.
    pub fn describe(&self) -> String {
        format!("net:{}/{}", self.provider, self.domain)
    }

    /// What `mr::register` and `mr::teardown` act on.
    pub fn mr_ops(&mut self) -> mr::RealOps<'_> {
        mr::RealOps {
            domain: self.objs.domain,
            ep: &mut self.objs.ep,
        }
    }

    /// Op slots free now, and how many there are.
    pub fn free_slots(&self) -> (usize, usize) {
        (self.free.len(), self.slots.len())
    }

    pub fn release_bounce(&mut self, slot: usize) {
        self.bounce_busy[slot] = false;
    }

    /// Maps a completion's context back to its slot and retires it.
    fn retire(&mut self, peers: &mut Peers, ctx: *mut c_void) -> Result<PeerId> {
        let Some(idx) = fabric::slot_of(&self.slots, ctx).filter(|&i| self.slots[i].busy) else {
            return Err(Error::internal(format!(
                "completion with unknown context {ctx:p} on {}",
                self.describe()
            )));
        };
        let s = &mut self.slots[idx];
        s.busy = false;
        let p = s.peer;
        let ack = std::mem::take(&mut s.ack);
        let seq = s.seq;
        if let Some(b) = s.bounce.take() {
            self.release_bounce(b);
        }
        self.free.push(idx);
        self.outstanding -= 1;
        if let Some(peer) = peers.get_mut(p) {
            peer.outstanding -= 1;
            peer.completed(seq);
            if ack {
                peer.acks_in_flight -= 1;
            }
            if peer.outstanding == 0 && self.plan.beyond == FlagOrder::Drain {
                // Every write to the peer completed, and those the plan does not order
                // carried FI_DELIVERY_COMPLETE: all of them have arrived.
                peer.largest_since_drain = 0;
            }
        }
        self.stats.completed += 1;
        Ok(p)
    }

    /// Reads available completions once; returns how many. When none were there, fails if the
    /// abort check says so (every bounded wait of this endpoint polls).
    pub fn poll(&mut self, peers: &mut Peers) -> Result<usize> {
        let n = self.poll_cq(peers)?;
        if n == 0 {
            if let Some(why) = self.abort_check.as_ref().and_then(|f| f()) {
                return Err(Error::remote(format!("{}: {why}", self.describe())));
            }
        }
        Ok(n)
    }

    /// Reads available completions once; returns how many.
    fn poll_cq(&mut self, peers: &mut Peers) -> Result<usize> {
        let mut ents = [fi::fi_cq_data_entry::default(); CQ_BATCH];
        let rc = match self.layer.as_mut() {
            Some(l) => l.read(self.objs.ep, self.objs.cq, &mut ents),
            // SAFETY: cq is open with FI_CQ_FORMAT_DATA; ents has room for CQ_BATCH entries.
            None => unsafe {
                fi::fi_cq_read(self.objs.cq, ents.as_mut_ptr().cast(), CQ_BATCH) as i64
            },
        };
        if rc > 0 {
            for e in &ents[..rc as usize] {
                // A peer's write that carried CQ data: its context is not one of our writes (no
                // provider this library uses gives one there: docs/PROVIDERS.md). The flag is
                // read alone: shm 2.0-2.4 sets no FI_RMA or FI_REMOTE_WRITE with it.
                if e.flags & fi::FI_REMOTE_CQ_DATA as u64 != 0 {
                    if !self.strays.take_data(e.data) {
                        self.take_remote(peers, e)?;
                    }
                    continue;
                }
                if !self.strays.take_ctx(e.op_context) {
                    self.retire(peers, e.op_context)?;
                }
            }
            return Ok(rc as usize);
        }
        if rc == EAGAIN {
            return Ok(0);
        }
        if rc == EAVAIL {
            return match self.read_error(peers) {
                Some(e) => Err(e),
                None => Ok(0),
            };
        }
        Err(fab_err(format!("fi_cq_read on {}", self.describe()), rc))
    }

    /// A peer's write that carried remote CQ data: a riding value stored (`signals.rs`), or a
    /// counted tag counted for its writer's stream (`counted.rs`).
    fn take_remote(&mut self, peers: &mut Peers, e: &fi::fi_cq_data_entry) -> Result<()> {
        let fail = |ops: &Ops, why: String| {
            Error::remote(format!("{}: a peer's write: {why}", ops.describe()))
        };
        if !self.counted {
            return self.incoming.apply(e.data).map_err(|why| fail(self, why));
        }
        let tag = u32::try_from(e.data)
            .map_err(|_| fail(self, format!("CQ data {:#x} is not a tag", e.data)))?;
        let stream = counted::stream_of(tag);
        let Some((rank, counts)) = peers.stream_counts(stream) else {
            return Err(fail(
                self,
                format!("tag {tag:#x} names stream {stream}, which we gave no rank"),
            ));
        };
        self.incoming.counted += 1;
        let incoming = &mut self.incoming;
        let r = counts.take(tag, |w, v| {
            let (region, off) = counted::word_place(w);
            incoming.store_counted(region, off, v)
        });
        r.map_err(|why| fail(self, format!("from rank {rank}: {why}")))
    }

    /// Turns the error completion at the head of the CQ into an error naming the peer (None:
    /// a stray try's, dropped).
    fn read_error(&mut self, peers: &mut Peers) -> Option<Error> {
        let mut e = fi::fi_cq_err_entry::default();
        let rc = match self.layer.as_mut() {
            Some(l) => l.readerr(&mut e),
            // SAFETY: cq is open; e is a valid, zeroed error entry (err_data_size 0: no buffer).
            None => unsafe { fi::fi_cq_readerr(self.objs.cq, &mut e, 0) as i64 },
        };
        if rc < 0 {
            return Some(fab_err("fi_cq_readerr", rc));
        }
        if self.strays.take_ctx(e.op_context) {
            return None;
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
        let who = match self.retire(peers, e.op_context) {
            Ok(p) => peers.name(p),
            Err(_) => "an unknown peer".into(),
        };
        Some(Error::Fabric {
            call: format!("RMA write to {who} over {} (completion)", self.describe()),
            code: -(e.err as i64),
            detail: format!("{}; provider: {prov}", strerror(e.err as i64)),
        })
    }

    /// `Endpoint::progress`.
    pub fn progress(&mut self, peers: &mut Peers) -> Result<()> {
        // Drains what is there (bounded: a few batches), which also drives the provider's
        // progress engine for incoming writes.
        for _ in 0..8 {
            if self.poll(peers)? < CQ_BATCH {
                break;
            }
        }
        Ok(())
    }

    /// A free op slot for `peer`, progressing until one frees up (bounded).
    fn acquire(&mut self, peers: &mut Peers, peer: PeerId) -> Result<usize> {
        let depth = self.slots.len();
        self.wait_until(
            peers,
            |ops, _| {
                Ok(ops.free.pop().inspect(|&i| {
                    let s = &mut ops.slots[i];
                    s.busy = true;
                    s.peer = peer;
                }))
            },
            |peers| {
                let rank = peers.get(peer).map_or(usize::MAX, |p| p.rank);
                format!("waiting for one of {depth} in-flight writes to complete (writing to rank {rank})")
            },
        )
    }

    /// Whether our writes to `peer` carry counted tags (`counted.rs`): signals are counted on
    /// this endpoint, and the peer gave us a stream.
    pub fn tags_to(&self, peers: &Peers, peer: PeerId) -> bool {
        self.counted && peers[peer].epochs.stream.is_some()
    }

    /// Waits (progressing, bounded) until another write to `peer` may be tagged
    /// (`counted::Epochs::room`).
    fn counted_room(&mut self, peers: &mut Peers, peer: PeerId) -> Result<()> {
        // (Room comes when the oldest open epoch's writes have completed.)
        self.wait_until(
            peers,
            |_, peers| {
                let p = &mut peers[peer];
                Ok(p.epochs.room(p.done_upto).then_some(()))
            },
            |peers| {
                format!(
                    "waiting for the writes of the oldest of {} open signal epochs to rank {} to complete",
                    counted::OPEN_EPOCHS,
                    peers[peer].rank
                )
            },
        )
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
    pub fn post(&mut self, peers: &mut Peers, op: &Op<'_>) -> Result<()> {
        let (peer, len, raddr, key, fence, confirm) =
            (op.peer, op.len, op.raddr, op.key, op.fence, op.confirm);
        let (mut local, mut desc) = (op.local, op.desc);
        let slot = match self.acquire(peers, peer) {
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
            let p = unsafe { self.inline.ptr().add(slot * INLINE_BYTES) };
            // SAFETY: p has room for INLINE_BYTES (checked above); distinct from `bytes`.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len()) };
            local = p as u64;
            desc = self.inline_desc;
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
        // A signal, or on software providers the activity mark on a data write (`signals.rs`):
        // never on flags, markers and records, whose half round trip it lengthened over tcp
        // (bench/RESULTS.md, session 16).
        // (Inline writes, flags and records, are at most `INLINE_BYTES`: never above it.)
        // Where the epochs stood before this write's tag (tagged writes only).
        let mut mark = None;
        let cq_data = if self.tags_to(peers, peer) {
            // Every write to the peer carries its epoch's tag (`counted.rs`), once fewer than
            // `counted::OPEN_EPOCHS` epochs are open.
            if let Err(e) = self.counted_room(peers, peer) {
                self.release(slot);
                return Err(e);
            }
            let p = &mut peers[peer];
            mark = Some(p.epochs.mark());
            let word = counted::asked(op.cq_data);
            Some(u64::from(p.epochs.tag(p.next_seq + 1, word)))
        } else {
            op.cq_data
                .or((self.activity_marks && len > super::order::FOLLOWER_BYTES)
                    .then_some(signals::ACTIVITY))
        };
        let msg = fi::fi_msg_rma {
            msg_iov: (&iov as *const libc::iovec).cast(),
            desc: &mut desc,
            iov_count: 1,
            addr: peers[peer].addr,
            rma_iov: &rma,
            rma_iov_count: 1,
            context: (&mut self.slots[slot] as *mut OpSlot).cast(),
            data: cq_data.unwrap_or(0),
        };
        let mut wait: Option<Backoff> = None;
        // Markers, and the writes that a later drain must see arrived (`Plan::needs_dc`).
        let mut dc = (confirm && self.delivery_complete) || self.plan.needs_dc(len);
        loop {
            let mut flags = fi::FI_COMPLETION as u64;
            if cq_data.is_some() {
                flags |= fi::FI_REMOTE_CQ_DATA as u64;
            }
            if dc {
                flags |= fi::FI_DELIVERY_COMPLETE as u64;
            }
            if fence {
                flags |= fi::FI_FENCE as u64;
            }
            let rc = match self.layer.as_mut() {
                Some(l) => l.write(self.objs.ep, &msg, flags),
                // SAFETY: ep is open; msg and everything it points to (iov, desc, rma) live
                // until the call returns (the provider copies them); the source memory is
                // registered and stays valid until completion (user buffers by contract,
                // staging by slot ownership); the context is a slot that lives in
                // `self.slots` until retired.
                None => unsafe { fi::fi_writemsg(self.objs.ep, &msg, flags) as i64 },
            };
            if rc == 0 {
                break;
            }
            let r = if rc == EAGAIN {
                // The provider's queue is full: complete something, then retry the same write.
                self.stats.eagain += 1;
                let (rank, limit) = (peers[peer].rank, self.timeout);
                self.poll(peers).and_then(|_| {
                    let w = wait.get_or_insert_with(|| provider_wait(limit));
                    self.pause(w, || {
                        format!("provider kept answering -FI_EAGAIN to a write to rank {rank}")
                    })
                })
            } else if rc == EBADFLAGS && dc && self.plan.beyond == FlagOrder::Drain {
                // Accepted at fi_getinfo time but refused per operation, where it is what
                // orders a flag after data: nothing else can (`order::decide`).
                Err(Error::usage(format!(
                    "{} refuses FI_DELIVERY_COMPLETE on a write to {}, which it granted and which orders flags after data here ({}): no other ordering is available",
                    self.describe(),
                    peers.name(peer),
                    self.plan.describe()
                )))
            } else if rc == EBADFLAGS && dc {
                // Accepted at fi_getinfo time but refused per operation: fall back once. Only
                // flush markers asked for it (ordering does not rest on it here).
                self.delivery_complete = false;
                crate::info!(
                    "net: {} refuses FI_DELIVERY_COMPLETE on writes; flush now waits for local completion only (flags stay ordered: {})",
                    self.provider,
                    self.plan.describe()
                );
                dc = false;
                Ok(())
            } else {
                Err(fab_err(
                    format!(
                        "fi_writemsg to {} over {}",
                        peers.name(peer),
                        self.describe()
                    ),
                    rc,
                ))
            };
            if let Err(e) = r {
                self.release(slot);
                // Not posted: its tag is taken back (the receiver never counts it).
                if let Some(m) = mark {
                    peers[peer].epochs.undo(m);
                }
                return Err(e);
            }
        }
        self.stats.posted += 1;
        self.outstanding += 1;
        self.slots[slot].ack = op.ack;
        let p = &mut peers[peer];
        p.next_seq += 1;
        self.slots[slot].seq = p.next_seq;
        p.outstanding += 1;
        if op.ack {
            p.acks_in_flight += 1;
        }
        if fence {
            // Started once every earlier write to the peer completed: later ones follow it.
            p.largest_since_drain = 0;
            self.stats.order_fences += 1;
        }
        p.largest_since_drain = p.largest_since_drain.max(len);
        if !op.internal {
            if !dc {
                p.unconfirmed = true;
            } else if confirm {
                // A marker, ordered after every earlier write (`Peers::post_marker`).
                p.unconfirmed = false;
            }
            p.last_was_record = false;
        }
        Ok(())
    }

    /// Lets the writes still in flight finish before the endpoint closes (bounded by
    /// `DROP_DRAIN`): they read registered memory.
    pub fn drain_at_close(&mut self, peers: &mut Peers) {
        let mut wait = provider_wait(DROP_DRAIN.min(self.timeout));
        // (The layer may have reported writes complete that it has not sent yet: it drops
        // what it never posted, then what it posted completes as any write.)
        if let Some(l) = self.layer.as_mut() {
            l.discard_held();
        }
        while self.outstanding > 0 || self.layer.as_ref().is_some_and(|l| l.busy()) {
            match self.poll_cq(peers) {
                Ok(0) => {
                    if self.pause(&mut wait, String::new).is_err() {
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
    }
}
