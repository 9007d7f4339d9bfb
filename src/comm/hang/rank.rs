//! One rank's hang report: its pending waits (host threads', kernels') and, per connection,
//! the signals it issued, sent and received; what it is read from (`Source`), and its bytes
//! on the wire.

use crate::bootstrap::Bootstrap;
use crate::error::Result;
use crate::host::pending::{self, Ended};
use crate::proxy::{PendingWait, SharedWork, WaitOp};
use crate::sync::{read, try_lock};
use crate::wire::{Reader, Writer};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

/// One connection's signal counts on the rank that reports them. `None`: not readable from the
/// host (a GPU connection's epoch is in device memory) or not read in time (a busy proxy).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnCounts {
    /// The connection's index in the rank's `mscclppDevConn` array.
    pub index: usize,
    pub remote_rank: usize,
    pub tag: i32,
    /// Signals this rank's threads issued on it: the epoch's `device` word (host memory); for
    /// a GPU epoch, what its proxy sent and what waits in its FIFO. Neither counts what its
    /// kernels stored into the peer's epoch themselves (the direct path): the waiter's record
    /// does (`PendingWait::direct`), and the summary adds it.
    pub issued: Option<u64>,
    /// Signals its proxy, or a host thread's direct store, sent to the peer
    /// (`ProxyConn::signals`); not its kernels' direct stores (see `issued`).
    pub sent: Option<u64>,
    /// Signals that arrived from the peer (the epoch's `proxy` word; host memory only).
    pub received: Option<u64>,
}

/// A pending wait as reported: a wait that ended in an error a moment ago is still listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waiting {
    pub wait: PendingWait,
    /// How it ended, and how long before the report.
    pub ended: Option<(Ended, Duration)>,
}

/// One rank's report.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankReport {
    pub rank: usize,
    pub conns: Vec<ConnCounts>,
    pub waits: Vec<Waiting>,
    /// Peers this rank's bootstrap saw die (a connection closed without a goodbye), with why.
    pub lost: Vec<(usize, String)>,
    /// What kept parts of the report out (a proxy too busy to be read, a destroyed
    /// communicator).
    pub notes: Vec<String>,
}

const MAGIC: u32 = 0x4d53_4852; // "MSHR"
const VERSION: u32 = 2;
/// Most waits and connections one report carries (the rest are counted in a note): the
/// answer must fit one `Report` frame.
const MAX_WAITS: usize = 256;
const MAX_CONNS: usize = 16 << 10;
/// Unknown count on the wire.
const NONE: u64 = u64::MAX;

fn opt(v: Option<u64>) -> u64 {
    v.unwrap_or(NONE)
}
fn unopt(v: u64) -> Option<u64> {
    (v != NONE).then_some(v)
}

fn op_code(op: WaitOp) -> u32 {
    match op {
        WaitOp::Wait => 0,
        WaitOp::Flush => 1,
        WaitOp::Push => 2,
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// At most `wire::MAX_FIELD` bytes of `s`, cut at a character boundary.
fn field(s: &str) -> &[u8] {
    let mut end = s.len().min(crate::wire::MAX_FIELD);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s.as_bytes()[..end]
}

impl RankReport {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new()
            .u32(MAGIC)
            .u32(VERSION)
            .u32(self.rank as u32)
            .u32(self.conns.len() as u32);
        for c in &self.conns {
            w = w
                .u32(c.index as u32)
                .u32(c.remote_rank as u32)
                .u32(c.tag as u32)
                .u64(opt(c.issued))
                .u64(opt(c.sent))
                .u64(opt(c.received));
        }
        w = w.u32(self.waits.len() as u32);
        for x in &self.waits {
            let p = &x.wait;
            let (ended, ago) = match x.ended {
                None => (0, 0),
                Some((Ended::TimedOut, d)) => (1, d.as_millis() as u64),
                Some((Ended::Aborted, d)) => (2, d.as_millis() as u64),
            };
            w = w
                .u32(p.conn as u32)
                .u32(p.remote_rank as u32)
                .u32(op_code(p.op))
                .u64(p.wanted)
                .u64(p.seen)
                .u64(p.direct)
                .u64(p.waited.as_millis() as u64)
                .u32(p.device as u32)
                .u32(ended)
                .u64(ago);
        }
        w = w.u32(self.lost.len() as u32);
        for (r, why) in &self.lost {
            w = w.u32(*r as u32).bytes(field(why));
        }
        w = w.u32(self.notes.len() as u32);
        for n in &self.notes {
            w = w.bytes(field(n));
        }
        w.finish()
    }

    /// Parses rank `from`'s report; anything malformed (or claiming another rank, or ranks
    /// outside the communicator's `nranks`) is an error.
    pub fn decode(b: &[u8], from: usize, nranks: usize) -> Result<Self> {
        let bad = |what: String| {
            crate::error::Error::remote(format!("hang report of rank {from}: {what}"))
        };
        let mut r = Reader::new(b, "hang report");
        if r.u32()? != MAGIC || r.u32()? != VERSION {
            return Err(bad("wrong magic or version".into()));
        }
        let rank = r.u32()? as usize;
        if rank != from {
            return Err(bad(format!("it says it is rank {rank}")));
        }
        let in_range = |x: usize| {
            if x < nranks {
                Ok(x)
            } else {
                Err(bad(format!("rank {x} out of range")))
            }
        };
        let mut rep = RankReport {
            rank,
            ..Default::default()
        };
        let n = r.u32()? as usize;
        for _ in 0..n.min(MAX_CONNS + 1) {
            rep.conns.push(ConnCounts {
                index: r.u32()? as usize,
                remote_rank: in_range(r.u32()? as usize)?,
                tag: r.u32()? as i32,
                issued: unopt(r.u64()?),
                sent: unopt(r.u64()?),
                received: unopt(r.u64()?),
            });
        }
        let n = r.u32()? as usize;
        for _ in 0..n.min(MAX_WAITS + 1) {
            let conn = r.u32()? as usize;
            let remote_rank = in_range(r.u32()? as usize)?;
            let op = match r.u32()? {
                0 => WaitOp::Wait,
                1 => WaitOp::Flush,
                2 => WaitOp::Push,
                x => return Err(bad(format!("unknown wait operation {x}"))),
            };
            let (wanted, seen, direct) = (r.u64()?, r.u64()?, r.u64()?);
            let waited = Duration::from_millis(r.u64()?);
            let device = r.u32()? != 0;
            let ended = match (r.u32()?, Duration::from_millis(r.u64()?)) {
                (0, _) => None,
                (1, d) => Some((Ended::TimedOut, d)),
                (2, d) => Some((Ended::Aborted, d)),
                (x, _) => return Err(bad(format!("unknown end of a wait {x}"))),
            };
            rep.waits.push(Waiting {
                wait: PendingWait {
                    conn,
                    remote_rank,
                    op,
                    wanted,
                    seen,
                    direct,
                    waited,
                    device,
                },
                ended,
            });
        }
        let n = r.u32()? as usize;
        for _ in 0..n.min(nranks) {
            let p = in_range(r.u32()? as usize)?;
            rep.lost.push((p, text(r.bytes()?)));
        }
        let n = r.u32()? as usize;
        for _ in 0..n.min(64) {
            rep.notes.push(text(r.bytes()?));
        }
        r.finish()?;
        Ok(rep)
    }
}

/// One connection as the report reads it.
pub(crate) struct ConnView {
    pub remote_rank: usize,
    pub tag: i32,
    /// Index into `Source::slots`.
    pub slot: usize,
    /// The connection's id in that slot's FIFO (`ProxyWork::conns`).
    pub conn_id: usize,
    /// The epoch block where the host can read it (host memory): `device` at 0, `proxy` at 8.
    pub epoch: Option<*const u64>,
}

/// One endpoint's FIFO and proxy state as the report reads them.
pub(crate) struct SlotView {
    /// The FIFO's head (its producer view's `triggerFifoHead`, as an address): how host waits
    /// and requests name it.
    pub head: usize,
    /// The FIFO's tail (pinned or host memory, readable here for every FIFO).
    pub tail: *const u64,
    pub work: Weak<Mutex<crate::proxy::ProxyWork>>,
}

/// What one communicator's report is read from, shared by the reporter thread, the bootstrap's
/// mailbox thread (which answers peers with it) and the communicator, which closes it first
/// thing at destroy (`alive`), before anything it points to is freed.
pub(crate) struct Source {
    pub rank: usize,
    pub nranks: usize,
    pub boot: Weak<Bootstrap>,
    pub conns: Vec<ConnView>,
    pub slots: Vec<SlotView>,
    /// False once destroy began: nothing behind the pointers may be read any more. Readers
    /// hold it for the few microseconds of a read; destroy takes it for writing.
    pub alive: RwLock<bool>,
    /// Held while this communicator's report is written (one at a time; destroy waits for it).
    pub busy: Mutex<()>,
    /// Why a report of this communicator is wanted, until one is written (`super::reporter`).
    pub wanted: Mutex<Option<super::Wanted>>,
    /// Reports written, for their headlines.
    pub written: AtomicU64,
}

// SAFETY: the raw pointers point into the communicator's epoch blocks and FIFOs, which live
// until `Comm::drop`; that first sets `alive` to false under its write lock, and every read
// through them happens under the read lock after checking it (`Source::local`).
unsafe impl Send for Source {}
// SAFETY: as for Send; the pointed-to words are only read atomically.
unsafe impl Sync for Source {}

/// How long the report may wait for a busy proxy's lock (held for one round of its work).
const PROXY_LOCK_WAIT: Duration = Duration::from_millis(20);

/// Word `i` of the 8-byte words at `p`, read atomically.
///
/// # Safety
/// `p` must point to at least `i + 1` aligned, live u64 words.
unsafe fn word(p: *const u64, i: usize) -> u64 {
    // SAFETY: per the caller. Relaxed: a snapshot for a diagnosis; nothing is read behind it.
    unsafe { AtomicU64::from_ptr(p.add(i) as *mut u64) }.load(Ordering::Relaxed)
}

impl Source {
    /// This rank's report, now. Never blocks for long: a proxy whose lock stays taken (a round
    /// of its work, or a transport call that hangs) is left out with a note.
    pub fn local(&self) -> RankReport {
        let mut rep = RankReport {
            rank: self.rank,
            ..Default::default()
        };
        if let Some(b) = self.boot.upgrade() {
            rep.lost = b.lost_peers();
        }
        let alive = read(&self.alive);
        if !*alive {
            rep.notes.push("its communicator is being destroyed".into());
            return rep;
        }
        // Per slot, under its proxy's lock: the signals sent and still queued per connection,
        // and the waits of its kernels.
        let mut sent: Vec<Option<Vec<(u64, u64)>>> = Vec::with_capacity(self.slots.len());
        for (i, s) in self.slots.iter().enumerate() {
            let Some(work) = s.work.upgrade() else {
                sent.push(None);
                continue;
            };
            let t0 = Instant::now();
            // Ends: the lock is taken, or PROXY_LOCK_WAIT passes.
            let g = loop {
                if let Some(g) = try_lock(&work) {
                    break Some(g);
                }
                if t0.elapsed() > PROXY_LOCK_WAIT {
                    break None;
                }
                std::thread::yield_now();
            };
            match g {
                Some(w) => {
                    let queued = w.queued_signals();
                    sent.push(Some(
                        w.conns.iter().map(|c| c.signals).zip(queued).collect(),
                    ));
                    for mut p in w.device_pending_waits() {
                        if let Some(ci) = self
                            .conns
                            .iter()
                            .position(|c| c.slot == i && c.conn_id == p.conn)
                        {
                            p.conn = ci;
                            p.remote_rank = self.conns[ci].remote_rank;
                            rep.waits.push(Waiting {
                                wait: p,
                                ended: None,
                            });
                        }
                    }
                }
                None => {
                    rep.notes.push(format!(
                        "proxy {i} busy for {PROXY_LOCK_WAIT:?}: its signal counts and kernels' waits left out"
                    ));
                    sent.push(None);
                }
            }
        }
        for (index, c) in self.conns.iter().enumerate().take(MAX_CONNS) {
            // SAFETY: the epoch block (at least 32 bytes, 16-aligned) lives while `alive`.
            let e = c.epoch.map(|p| unsafe { (word(p, 0), word(p, 1)) });
            let proxy = sent[c.slot]
                .as_ref()
                .and_then(|v| v.get(c.conn_id).copied());
            rep.conns.push(ConnCounts {
                index,
                remote_rank: c.remote_rank,
                tag: c.tag,
                // A host-memory epoch counts what its threads issued; a GPU one does not, and
                // what its kernels handed to the proxy is then what the proxy sent and what
                // waits in its FIFO (what they stored themselves the waiter counts).
                issued: e.map(|e| e.0).or(proxy.map(|(s, q)| s + q)),
                sent: proxy.map(|(s, _)| s),
                received: e.map(|e| e.1),
            });
        }
        if self.conns.len() > MAX_CONNS {
            rep.notes.push(format!(
                "{} more connections left out",
                self.conns.len() - MAX_CONNS
            ));
        }
        let heads: Vec<usize> = self.slots.iter().map(|s| s.head).collect();
        let now = Instant::now();
        for h in pending::waits_on(&heads) {
            let Some(slot) = heads.iter().position(|&x| x == h.head) else {
                continue;
            };
            let Some(ci) = self
                .conns
                .iter()
                .position(|c| c.slot == slot && c.conn_id == h.conn_id)
            else {
                continue;
            };
            let c = &self.conns[ci];
            let seen = match (h.op, c.epoch) {
                // SAFETY: the epoch block lives while `alive` (held).
                (WaitOp::Wait, Some(p)) => unsafe { word(p, 1) },
                (WaitOp::Wait, None) => 0,
                // SAFETY: the FIFO's tail word lives while `alive` (held).
                _ => unsafe { word(self.slots[slot].tail, 0) },
            };
            let end = h
                .ended
                .map(|(how, at)| (how, now.saturating_duration_since(at)));
            rep.waits.push(Waiting {
                wait: PendingWait {
                    conn: ci,
                    remote_rank: c.remote_rank,
                    op: h.op,
                    wanted: h.wanted,
                    seen,
                    // A host thread's wait: the peer's direct stores (SHM) are in its count.
                    direct: 0,
                    waited: h
                        .ended
                        .map_or(now, |(_, at)| at)
                        .saturating_duration_since(h.since),
                    device: false,
                },
                ended: end,
            });
        }
        drop(alive);
        if rep.waits.len() > MAX_WAITS {
            rep.notes.push(format!(
                "{} more waits left out",
                rep.waits.len() - MAX_WAITS
            ));
            rep.waits.truncate(MAX_WAITS);
        }
        rep
    }
}

/// The shape of the shared proxy state the report reads (`SharedWork`), for `SlotView`.
pub(crate) fn weak_work(w: &SharedWork) -> Weak<Mutex<crate::proxy::ProxyWork>> {
    std::sync::Arc::downgrade(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_round_trip_and_lies_are_refused() {
        let rep = RankReport {
            rank: 1,
            conns: vec![ConnCounts {
                index: 0,
                remote_rank: 0,
                tag: -3,
                issued: Some(4),
                sent: Some(4),
                received: None,
            }],
            waits: vec![Waiting {
                wait: PendingWait {
                    conn: 0,
                    remote_rank: 0,
                    op: WaitOp::Flush,
                    wanted: 5,
                    seen: 4,
                    direct: 3,
                    waited: Duration::from_millis(1500),
                    device: true,
                },
                ended: Some((Ended::TimedOut, Duration::from_millis(20))),
            }],
            lost: vec![(2, "rank 2 closed its connection".into())],
            notes: vec!["a note".into()],
        };
        let b = rep.encode();
        assert_eq!(RankReport::decode(&b, 1, 3).unwrap(), rep);
        // Another rank's, a rank outside the communicator, a cut or a longer one: refused.
        assert!(RankReport::decode(&b, 0, 3).is_err());
        assert!(RankReport::decode(&b, 1, 2).is_err());
        for cut in 0..b.len() {
            assert!(RankReport::decode(&b[..cut], 1, 3).is_err(), "cut {cut}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(RankReport::decode(&long, 1, 3).is_err());
    }
}
