//! A test layer between `Ops` and the real provider (`MSCCLPP_TEST_UNORDERED`): over tcp and
//! shm, which place every write in order, it plays a provider with weaker ordering and other
//! rules by that provider's profile (`profile.rs`, docs/PROVIDERS.md), so that CI runs the
//! code paths of cxi, efa-rdm, psm3 and verbs, and a flag that overtakes its data, or a call
//! such a provider refuses, fails a test (docs/DESIGN.md 3.6).
//!
//! What it does to the writes of one endpoint:
//! - holds each posted write back and releases the held ones to the provider in a random
//!   order, a few per call, as far as the profile allows: two writes to one peer keep their
//!   order only where both are within the profile's ordered size ("both smaller than the
//!   size", fi_endpoint(3)): cxi-like, any size; psm3-like, below 4 KiB; verbs-like, below its
//!   largest message (small here); EFA-like, none;
//! - cuts a write larger than `SPLIT_ABOVE` into pieces released independently (packets), so
//!   that a later write can land between them; remote CQ data goes with the piece released
//!   last, so that its completion at the target still means the write is in place;
//! - where the profile splits writes into segments (EFA-like: efa-rdm's device writes, at a
//!   segment made small here, `SEGMENT`), cuts a write above it into segments, each carrying
//!   the write's remote CQ data, as efa-rdm does: the target reads it once per segment;
//! - reports a plain write (no FI_DELIVERY_COMPLETE) complete, sometimes, before it is even
//!   released, from a copy of its source: local completion is not arrival;
//! - returns completions in a random order, some a few polls late.
//!
//! And what it refuses (the profile's rules, each refusal logged at WARN): FI_FENCE where the
//! profile grants none; a local buffer without its descriptor (FI_MR_LOCAL: EFA-, verbs-like);
//! remote CQ data wider than the profile carries (EFA-, verbs-like: 4 bytes); remote CQ data on
//! a write at all (cxi-like: -FI_EBADFLAGS, as `cxip_rma_writemsg` answers, although the
//! profile's fi_info advertises 8 bytes of it, for messages: the endpoint must find out by
//! trying, `probe.rs`). The cxi-like profile also keeps memory keys as a provider does, unique
//! per endpoint only (small numbers from 1, `Profile::provider_keys`), with offset addressing
//! and the FI_MR_ENDPOINT sequence: a write that names another endpoint's key may land in an
//! unrelated buffer instead of failing. The peers' CQ-data completions are returned as the
//! provider gives them.
//!
//! Lifecycle of a write: (1) `write` takes it into `writes` and its pieces into `held`, maybe
//! reporting it complete at once (`early`, from `Write::copy`); (2) `step` posts pieces to the
//! provider, each with a context of its own in `pieces`; (3) `read` collects the provider's
//! completions of pieces, and once every piece of a write is done, queues the write's own
//! completion in `ready` (or its error in `errors`), unless it was reported early; then the
//! write's slot is free. `busy` is true until every write has got there, which the endpoint's
//! teardown waits for.

use super::fabric::{EAGAIN, EAVAIL, EBADFLAGS};
use super::order::Attrs;
use super::profile;
use crate::config::{Unordered, UnorderedProfile};
use libfabric_sys as fi;
use std::collections::VecDeque;
use std::ffi::c_void;

/// Writes held back at most: beyond, the surplus is released at once.
const MAX_HELD: usize = 64;
/// Calls a held piece may wait before it is released regardless.
const MAX_AGE: u32 = 6;
/// Bytes of source copied for early completions at most, all held writes together.
const MAX_COPIED: usize = 16 << 20;
/// Writes larger than this may be cut into pieces (EFA's packets carry 8 KiB: a record or a
/// flag is never torn).
const SPLIT_ABOVE: u64 = 8192;
/// The EFA-like profile's segment: a write above it is split into segments that each carry
/// the write's CQ data (efa-rdm: 1 GiB, `profile::EFA_WRITE_SEGMENT`; small here, so that
/// tests cross it).
pub(super) const SEGMENT: u64 = 64 << 10;
/// The verbs-like profile's largest ordered write (the port's `max_msg_sz` on hardware, 1 GiB
/// or more; small here, so that tests cross it).
pub(super) const VERBS_ORDER_SIZE: u64 = 16 << 10;
const EINVAL: i64 = -(fi::FI_EINVAL as i64);

/// What the layer plays (module doc): a provider of `profile.rs`, with the sizes tests cross.
#[derive(Clone, Debug)]
pub(super) struct Profile {
    pub name: &'static str,
    /// The provider's entry in `profile.rs`.
    pub table: &'static profile::Profile,
    /// Two writes of at most this many bytes each keep their order (None: none do).
    ordered_upto: Option<u64>,
    fence: bool,
    mr_local: bool,
    /// Remote CQ data on a write is refused with -FI_EBADFLAGS.
    refuses_write_data: bool,
    cq_data_size: u64,
    /// A write above this many bytes goes as segments, each with the write's CQ data.
    segment: Option<u64>,
    /// Keys as a provider picks them (unique per endpoint only), offset addressing, and the
    /// FI_MR_ENDPOINT registration sequence.
    pub provider_keys: bool,
}

impl Profile {
    pub fn of(p: UnorderedProfile) -> Profile {
        let t = |n: &str| profile::named(n).expect("a profile of the table");
        match p {
            UnorderedProfile::Cxi => Profile {
                name: "cxi-like",
                table: t("cxi"),
                ordered_upto: Some(u64::MAX),
                fence: true,
                mr_local: false,
                refuses_write_data: true,
                cq_data_size: 8,
                segment: None,
                provider_keys: true,
            },
            UnorderedProfile::Efa => Profile {
                name: "EFA-like",
                table: t("efa (efa-rdm)"),
                ordered_upto: None,
                fence: false,
                mr_local: true,
                refuses_write_data: false,
                cq_data_size: 4,
                segment: Some(SEGMENT),
                provider_keys: false,
            },
            UnorderedProfile::Psm3 => Profile {
                name: "psm3-like",
                table: t("psm3"),
                ordered_upto: Some(4095),
                fence: false,
                mr_local: false,
                refuses_write_data: false,
                cq_data_size: 8,
                segment: None,
                provider_keys: false,
            },
            UnorderedProfile::Verbs => Profile {
                name: "verbs-like",
                table: t("verbs;ofi_rxm"),
                ordered_upto: Some(VERBS_ORDER_SIZE - 1),
                fence: false,
                mr_local: true,
                refuses_write_data: false,
                cq_data_size: 4,
                segment: None,
                provider_keys: false,
            },
        }
    }

    /// What the real provider granted, turned into what the played provider's fi_info grants,
    /// and what of its source rules cannot be tried at run time (the segment; `Attrs::amend`
    /// does the same for the real provider). What can be tried is left for the endpoint to
    /// find out (`probe.rs`): a cxi-like layer still advertises its 8 bytes of CQ data.
    pub fn restrict(&self, mut a: Attrs) -> Attrs {
        match self.ordered_upto {
            None => a.msg_order = 0,
            Some(u64::MAX) => {}
            // "Both smaller than the size" (`order::decide`).
            Some(n) => a.max_order_waw_size = a.max_order_waw_size.min(n + 1),
        }
        a.fence &= self.fence;
        a.mr_local |= self.mr_local;
        a.cq_data_size = a.cq_data_size.min(self.cq_data_size);
        if self.segment.is_some() {
            a.split_with_data = self.segment;
        }
        a
    }

    /// One line of what this profile plays, for test logs and the suite's summary.
    pub fn describe(&self) -> String {
        format!(
            "{} (plays {} by docs/PROVIDERS.md): writes ordered {}; {}; remote CQ data on writes {}{}{}",
            self.name,
            self.table.name,
            match self.ordered_upto {
                None => "never".to_string(),
                Some(u64::MAX) => "at any size".to_string(),
                Some(n) => format!("when both are below {} bytes", n + 1),
            },
            if self.fence { "FI_FENCE" } else { "no FI_FENCE" },
            if self.refuses_write_data {
                "refused (-FI_EBADFLAGS)".to_string()
            } else {
                format!("{} bytes", self.cq_data_size)
            },
            match self.segment {
                Some(n) => format!(", repeated on every {n}-byte segment"),
                None => String::new(),
            },
            if self.provider_keys {
                "; provider keys, offsets, FI_MR_ENDPOINT"
            } else if self.mr_local {
                "; FI_MR_LOCAL"
            } else {
                ""
            }
        )
    }
}

/// One posted write (`Layer::writes`).
struct Write {
    /// The context `Ops` posted it with: its completion (or error) carries it.
    user_ctx: *mut c_void,
    /// Pieces not completed by the provider yet (held or in flight).
    pieces_left: u32,
    /// Reported complete before it arrived (module doc); its pieces read `copy`.
    early: bool,
    copy: Option<Vec<u8>>,
    err: Option<fi::fi_cq_err_entry>,
}

/// A part of a write not yet posted to the provider.
struct Held {
    write: usize,
    /// Source (into the user's buffer, or into the write's `copy`), descriptor, length.
    local: u64,
    desc: *mut c_void,
    len: u64,
    peer: fi::fi_addr_t,
    raddr: u64,
    key: u64,
    flags: u64,
    /// Remote CQ data (with FI_REMOTE_CQ_DATA in `flags`).
    data: u64,
    /// The segment of its write it belongs to (0 where the profile has none): the CQ data rides
    /// the piece of each segment released last.
    segment: u64,
    /// Its write is within the profile's ordered size: a later write to `peer` also within it
    /// may not be released first ("both smaller than the size").
    ordered: bool,
    age: u32,
}

/// The provider's context for one piece in flight: `ctx` first (FI_CONTEXT2).
#[repr(C)]
#[derive(Default)]
struct PieceSlot {
    ctx: fi::fi_context2,
    write: usize,
    busy: bool,
}

/// What the layer did, for the endpoint's INFO line at close (and tests).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct LayerStats {
    pub writes: u64,
    /// Pieces released while an earlier-posted piece to the same peer was still held.
    pub overtook: u64,
    /// Writes reported complete before they were released.
    pub early: u64,
    /// Writes cut into pieces.
    pub split: u64,
    /// Completions returned after a later-posted write's.
    pub late_completions: u64,
    /// Writes cut into segments that each carried the write's remote CQ data.
    pub segmented: u64,
    /// Writes refused by the profile's rules (each also at WARN).
    pub refused: u64,
}

/// The layer of one endpoint (module doc).
pub(super) struct Layer {
    pub profile: Profile,
    pub seed: u64,
    rng: u64,
    /// Whether the real provider needs descriptors (then nothing is sent from a copy).
    real_mr_local: bool,
    writes: Vec<Option<Write>>,
    free_writes: Vec<usize>,
    held: VecDeque<Held>,
    pieces: Box<[PieceSlot]>,
    free_pieces: Vec<usize>,
    /// Completions to return: (context, post order of its write, polls waited).
    ready: Vec<(*mut c_void, u64, u32)>,
    /// Peers' writes that carried remote CQ data, to return as they came.
    remote: VecDeque<fi::fi_cq_data_entry>,
    errors: VecDeque<fi::fi_cq_err_entry>,
    copied: usize,
    posted: u64,
    /// The post order of each write slot's current write.
    order: Vec<u64>,
    last_returned: u64,
    pub stats: LayerStats,
}

impl Layer {
    /// For an endpoint of `depth` op slots (`sized`); `u.seed`, or one from the clock and
    /// pid.
    pub fn new(u: Unordered, real_mr_local: bool) -> Layer {
        let seed = u.seed.unwrap_or_else(|| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            t ^ u64::from(std::process::id()) << 32
        });
        Layer {
            profile: Profile::of(u.profile),
            seed,
            rng: seed | 1,
            real_mr_local,
            writes: Vec::new(),
            free_writes: Vec::new(),
            held: VecDeque::new(),
            pieces: Box::new([]),
            free_pieces: Vec::new(),
            ready: Vec::new(),
            remote: VecDeque::new(),
            errors: VecDeque::new(),
            copied: 0,
            posted: 0,
            order: Vec::new(),
            last_returned: 0,
            stats: LayerStats::default(),
        }
    }

    /// Room for the pieces of an endpoint of `depth` op slots.
    pub fn sized(mut self, depth: usize) -> Layer {
        let n = depth * 4;
        self.pieces = (0..n).map(|_| PieceSlot::default()).collect();
        self.free_pieces = (0..n).rev().collect();
        self
    }

    /// xorshift64*: a number below `n` (> 0).
    fn below(&mut self, n: u64) -> u64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        (self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) % n
    }

    /// Whether writes are still held or in flight (teardown waits until none is).
    pub fn busy(&self) -> bool {
        self.free_writes.len() != self.writes.len()
    }

    /// `fi_writemsg` as the profile allows (module doc): 0, or a negative libfabric code.
    pub fn write(&mut self, ep: *mut fi::fid_ep, msg: &fi::fi_msg_rma, flags: u64) -> i64 {
        let p = self.profile.name;
        if flags & fi::FI_FENCE as u64 != 0 && !self.profile.fence {
            crate::warn!("net: unordered test layer ({p}): FI_FENCE on a write, which this profile does not grant");
            self.stats.refused += 1;
            return EINVAL;
        }
        if flags & fi::FI_REMOTE_CQ_DATA as u64 != 0 && self.profile.refuses_write_data {
            // As cxip_rma_writemsg answers a flag outside CXIP_WRITEMSG_ALLOWED_FLAGS.
            crate::warn!("net: unordered test layer ({p}): FI_REMOTE_CQ_DATA on fi_writemsg: -FI_EBADFLAGS, as the provider it plays answers");
            self.stats.refused += 1;
            return EBADFLAGS;
        }
        if msg.iov_count != 1 || msg.rma_iov_count != 1 {
            crate::warn!("net: unordered test layer ({p}): only single-iovec writes are modelled");
            self.stats.refused += 1;
            return EINVAL;
        }
        // SAFETY: `Ops::post` passes one iovec, one descriptor and one rma_iov that live until
        // this call returns (counts checked above).
        let (iov, desc, rma) = unsafe { (*msg.msg_iov, *msg.desc, *msg.rma_iov) };
        if self.profile.mr_local && desc.is_null() {
            crate::warn!("net: unordered test layer ({p}): a write without the descriptor of its local buffer (FI_MR_LOCAL)");
            self.stats.refused += 1;
            return EINVAL;
        }
        let cq_data = flags & fi::FI_REMOTE_CQ_DATA as u64 != 0;
        if cq_data
            && self.profile.cq_data_size < 8
            && msg.data >> (8 * self.profile.cq_data_size) != 0
        {
            crate::warn!(
                "net: unordered test layer ({p}): remote CQ data {:#x} does not fit the profile's {} bytes",
                msg.data,
                self.profile.cq_data_size
            );
            self.stats.refused += 1;
            return EINVAL;
        }
        let len = iov.iov_len as u64;
        let dc = flags & fi::FI_DELIVERY_COMPLETE as u64 != 0;
        let early = !dc
            && !self.real_mr_local
            && len > 0
            && self.copied + iov.iov_len <= MAX_COPIED
            && self.below(2) == 0;
        let copy = early.then(|| {
            // SAFETY: the source is registered memory (or an op slot's inline area) that the
            // caller keeps untouched until the write completes, which is after this copy.
            unsafe { std::slice::from_raw_parts(iov.iov_base as *const u8, iov.iov_len) }.to_vec()
        });
        let (base, desc) = match &copy {
            Some(c) => (c.as_ptr() as u64, std::ptr::null_mut()),
            None => (iov.iov_base as u64, desc),
        };
        // Segments (where the profile cuts writes into them, each carrying the CQ data), and
        // within each, pieces: one, or up to four cut at random 8-byte boundaries. Remote CQ
        // data goes with the piece of its segment released last (`release`): the provider
        // places pieces in the order they are posted, so its completion at the target still
        // means the segment is in place.
        let seg = match self.profile.segment {
            Some(n) if len > n => {
                self.stats.segmented += 1;
                n
            }
            _ => len.max(1),
        };
        let mut cuts = vec![(0, 0)];
        let mut split = false;
        for (k, start) in (0..len).step_by(seg as usize).enumerate() {
            let end = (start + seg).min(len);
            let mut inner = Vec::new();
            if end - start > SPLIT_ABOVE {
                for _ in 0..1 + self.below(3) {
                    inner.push(start + self.below((end - start) / 8) * 8);
                }
                split = true;
            }
            inner.push(end);
            inner.sort_unstable();
            inner.dedup();
            cuts.extend(
                inner
                    .into_iter()
                    .filter(|&c| c > start)
                    .map(|c| (c, k as u64)),
            );
        }
        if len == 0 {
            cuts.push((0, 0));
        }
        if split {
            self.stats.split += 1;
        }
        let w = Write {
            user_ctx: msg.context,
            pieces_left: (cuts.len() - 1) as u32,
            early,
            copy,
            err: None,
        };
        let wi = match self.free_writes.pop() {
            Some(i) => {
                self.writes[i] = Some(w);
                i
            }
            None => {
                self.writes.push(Some(w));
                self.order.push(0);
                self.writes.len() - 1
            }
        };
        self.posted += 1;
        self.order[wi] = self.posted;
        self.stats.writes += 1;
        let ordered = self.profile.ordered_upto.is_some_and(|n| len <= n);
        for c in cuts.windows(2) {
            let ((from, _), (to, segment)) = (c[0], c[1]);
            self.held.push_back(Held {
                write: wi,
                local: base + from,
                desc,
                len: to - from,
                peer: msg.addr,
                raddr: rma.addr + from,
                key: rma.key,
                flags,
                data: msg.data,
                segment,
                ordered,
                age: 0,
            });
        }
        if early {
            self.copied += len as usize;
            self.stats.early += 1;
            self.ready.push((msg.context, self.posted, 0));
        }
        self.step(ep);
        0
    }

    /// Releases a few held pieces (module doc): random ones among those the profile lets go
    /// first, the oldest when it has waited `MAX_AGE` calls, the surplus over `MAX_HELD`.
    fn step(&mut self, ep: *mut fi::fid_ep) {
        for h in self.held.iter_mut() {
            h.age += 1;
        }
        let old = self.held.front().is_some_and(|h| h.age >= MAX_AGE);
        let surplus = self.held.len().saturating_sub(MAX_HELD);
        let mut n = self.below(3) as usize + surplus + usize::from(old);
        // Ends after `n` releases, when nothing is held, or when the provider is full.
        while n > 0 && !self.held.is_empty() {
            n -= 1;
            let k = if old || surplus > 0 {
                0
            } else {
                // Piece i may go first unless an earlier one to its peer is held and both are
                // within the ordered size.
                let eligible: Vec<usize> = (0..self.held.len())
                    .filter(|&i| {
                        let (peer, ordered) = (self.held[i].peer, self.held[i].ordered);
                        self.held
                            .iter()
                            .take(i)
                            .all(|e| e.peer != peer || !(e.ordered && ordered))
                    })
                    .collect();
                eligible[self.below(eligible.len() as u64) as usize]
            };
            if !self.release(ep, k) {
                break;
            }
        }
    }

    /// Posts held piece `k`; false when the provider (or the piece table) is full: it stays.
    fn release(&mut self, ep: *mut fi::fid_ep, k: usize) -> bool {
        let Some(slot) = self.free_pieces.pop() else {
            return false;
        };
        let h = &self.held[k];
        let mut desc = h.desc;
        let iov = libc::iovec {
            iov_base: h.local as *mut c_void,
            iov_len: h.len as usize,
        };
        let rma = fi::fi_rma_iov {
            addr: h.raddr,
            len: h.len as usize,
            key: h.key,
        };
        self.pieces[slot].write = h.write;
        self.pieces[slot].busy = true;
        // Remote CQ data rides the last piece of its segment to be released (`write`).
        let mut flags = h.flags | fi::FI_COMPLETION as u64;
        let more = self
            .held
            .iter()
            .enumerate()
            .any(|(i, e)| i != k && e.write == h.write && e.segment == h.segment);
        if more {
            flags &= !(fi::FI_REMOTE_CQ_DATA as u64);
        }
        let msg = fi::fi_msg_rma {
            msg_iov: (&iov as *const libc::iovec).cast(),
            desc: &mut desc,
            iov_count: 1,
            addr: h.peer,
            rma_iov: &rma,
            rma_iov_count: 1,
            context: (&mut self.pieces[slot] as *mut PieceSlot).cast(),
            data: h.data,
        };
        // SAFETY: ep is open; msg and what it points to live until the call returns; the
        // source stays valid until the piece completes (the user's buffer until the write's
        // completion, which waits for every piece, or the write's copy, kept as long); the
        // context is a slot of `pieces`, which outlives the endpoint (field order in `Ops`).
        let rc = unsafe { fi::fi_writemsg(ep, &msg, flags) } as i64;
        if rc != 0 {
            self.pieces[slot].busy = false;
            self.free_pieces.push(slot);
            if rc == EAGAIN {
                return false;
            }
            // A write the provider refuses: its error completion, as a provider would give.
            let w = self.held[k].write;
            let e = fi::fi_cq_err_entry {
                err: (-rc) as i32,
                ..Default::default()
            };
            self.held.remove(k);
            self.piece_done(w, Some(e));
            return true;
        }
        let peer = self.held[k].peer;
        if self.held.iter().take(k).any(|e| e.peer == peer) {
            self.stats.overtook += 1;
        }
        self.held.remove(k);
        true
    }

    /// At the endpoint's close: drops the pieces never posted, each counted done as if sent.
    /// They read no memory and their peer may be closed already: posting one at close, after
    /// a test had closed the peer, crashed inside libfabric (an invalid read under
    /// `fi_writemsg`, seen under valgrind; the cause inside libfabric not confirmed). A real
    /// provider's unsent writes at close end unsent too.
    pub fn discard_held(&mut self) {
        // Ends when `held` is empty: each round removes one entry.
        while let Some(h) = self.held.pop_front() {
            self.piece_done(h.write, None);
        }
    }

    /// One piece of write `w` completed (or failed with `err`).
    fn piece_done(&mut self, w: usize, err: Option<fi::fi_cq_err_entry>) {
        let Some(x) = self.writes[w].as_mut() else {
            return;
        };
        x.pieces_left -= 1;
        if err.is_some() && x.err.is_none() {
            x.err = err;
        }
        if x.pieces_left > 0 {
            return;
        }
        let x = self.writes[w].take().expect("checked above");
        self.free_writes.push(w);
        if let Some(c) = &x.copy {
            self.copied -= c.len();
        }
        match x.err {
            Some(mut e) => {
                // An early write's context was retired already: its error names no write.
                e.op_context = if x.early {
                    std::ptr::null_mut()
                } else {
                    x.user_ctx
                };
                e.err_data = std::ptr::null_mut();
                e.err_data_size = 0;
                self.errors.push_back(e);
            }
            None if !x.early => self.ready.push((x.user_ctx, self.order[w], 0)),
            None => {}
        }
    }

    /// `fi_cq_read` as the profile allows (module doc); releases held pieces first.
    pub fn read(
        &mut self,
        ep: *mut fi::fid_ep,
        cq: *mut fi::fid_cq,
        out: &mut [fi::fi_cq_data_entry],
    ) -> i64 {
        self.step(ep);
        let mut ents = [fi::fi_cq_data_entry::default(); 32];
        let mut n = 0;
        // Ends when the provider's queue is empty, or at its error.
        loop {
            // SAFETY: cq is open with FI_CQ_FORMAT_DATA; ents has room for its length.
            let rc = unsafe { fi::fi_cq_read(cq, ents.as_mut_ptr().cast(), ents.len()) } as i64;
            if rc > 0 {
                for e in &ents[..rc as usize] {
                    if e.flags & fi::FI_REMOTE_CQ_DATA as u64 != 0 {
                        self.remote.push_back(*e);
                        continue;
                    }
                    let Some(w) = self.piece_of(e.op_context) else {
                        return EINVAL;
                    };
                    self.piece_done(w, None);
                }
                continue;
            }
            if rc == EAVAIL {
                let mut e = fi::fi_cq_err_entry::default();
                // SAFETY: cq is open; e is a zeroed error entry (no error data buffer).
                let r = unsafe { fi::fi_cq_readerr(cq, &mut e, 0) } as i64;
                if r < 0 {
                    return r;
                }
                let Some(w) = self.piece_of(e.op_context) else {
                    return EINVAL;
                };
                self.piece_done(w, Some(e));
                continue;
            }
            if rc != EAGAIN {
                return rc;
            }
            break;
        }
        if !self.errors.is_empty() {
            return EAVAIL;
        }
        // Peers' writes that carried CQ data: returned first, in the provider's order.
        while n < out.len() {
            let Some(e) = self.remote.pop_front() else {
                break;
            };
            out[n] = fi::fi_cq_data_entry {
                op_context: std::ptr::null_mut(),
                ..e
            };
            n += 1;
        }
        // A random half of the ready completions, and every one that waited two calls, in a
        // random order.
        let mut i = 0;
        while i < self.ready.len() && n < out.len() {
            if self.ready[i].2 >= 2 || self.below(2) == 0 {
                let j = i + self.below((self.ready.len() - i) as u64) as usize;
                self.ready.swap(i, j);
                let (ctx, order, _) = self.ready.remove(i);
                if order < self.last_returned {
                    self.stats.late_completions += 1;
                }
                self.last_returned = self.last_returned.max(order);
                out[n] = fi::fi_cq_data_entry {
                    op_context: ctx,
                    ..Default::default()
                };
                n += 1;
            } else {
                self.ready[i].2 += 1;
                i += 1;
            }
        }
        if n == 0 {
            EAGAIN
        } else {
            n as i64
        }
    }

    /// `fi_cq_readerr` of an error `read` announced.
    pub fn readerr(&mut self, e: &mut fi::fi_cq_err_entry) -> i64 {
        match self.errors.pop_front() {
            Some(x) => {
                *e = x;
                1
            }
            None => EAGAIN,
        }
    }

    /// The write a piece's context belongs to, for a context of ours.
    fn piece_of(&mut self, ctx: *mut c_void) -> Option<usize> {
        let i = super::fabric::slot_of(&self.pieces, ctx).filter(|&i| self.pieces[i].busy)?;
        self.pieces[i].busy = false;
        self.free_pieces.push(i);
        Some(self.pieces[i].write)
    }

    /// One line for the endpoint's INFO at close.
    pub fn summary(&self) -> String {
        let s = &self.stats;
        format!(
            "unordered test layer {} (seed {}): {} writes, {} pieces released ahead of an earlier write to the same peer, {} writes reported complete before they were sent, {} cut into pieces, {} into segments each carrying the CQ data, {} completions returned after a later write's, {} writes refused by the profile's rules",
            self.profile.name, self.seed, s.writes, s.overtook, s.early, s.split, s.segmented, s.late_completions, s.refused
        )
    }
}
