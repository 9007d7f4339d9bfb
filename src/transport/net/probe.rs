//! A plan tried, not assumed (docs/PROVIDERS.md): when an endpoint opens, each primitive its
//! plan relies on that can be tried without a peer is tried once, on 8-byte writes from the
//! endpoint to itself (its own address in its address vector, its scratch word as the
//! target): a write carrying remote CQ data (where signals ride or are counted), a fenced write
//! (where flags are fenced), a delivery-complete write (where flags drain, and for flush
//! markers). A refusal (an error at the post or in the completion, or CQ data that does not
//! arrive as sent) takes that primitive out of the attributes, and the endpoint plans again
//! with what is left, with one WARN line naming the refusal. Every libfabric provider this
//! library names accepts writes to its own address (cited in docs/PROVIDERS.md: cxi's and
//! psm3's own tests do it, rxm and tcp make a loopback connection, shm maps its own region,
//! efa-rdm goes through shm); where even a plain write to itself fails, nothing can be tried,
//! the plan stands untried and a WARN says so.
//!
//! Runs before any peer is added, on the endpoint's own completion queue, through the unordered
//! test layer where there is one (which plays a provider's refusals).

use super::fabric::{strerror, EAGAIN, EAVAIL};
use super::ops::Ops;
use crate::error::Result;
use libfabric_sys as fi;
use std::ffi::c_void;
use std::time::{Duration, Instant};

/// The longest one try waits for its completions (a tcp endpoint first connects to itself;
/// under valgrind that took more than 2 s): the wait timeout, at most this.
const BOUND_MAX: Duration = Duration::from_secs(10);

#[cfg(test)]
thread_local! {
    /// Tests: the tries that give up as soon as they are posted (`Primitive::bit`), leaving
    /// their completions and CQ data to come after (`Ops::strays`).
    pub(super) static GIVE_UP_AFTER_POST: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
}

/// Whether this try gives up as soon as it is posted (tests only).
fn gives_up_at_once(what: Primitive) -> bool {
    #[cfg(test)]
    return GIVE_UP_AFTER_POST.with(|g| g.get()) & what.bit() != 0;
    #[cfg(not(test))]
    {
        let _ = what;
        false
    }
}

/// The remote CQ data a try sends: 8 bytes where 8 are carried (a provider that cut it, as
/// verbs cuts its immediate to 32 bits, would not pass), else 4. Neither is ever a peer's
/// (a ride's top byte is its tag, a counted tag is below 2^32 and one that is not an epoch's
/// closer names no word): a stray datum that is dropped is never a peer's signal
/// (`tests::the_tries_data_is_never_a_peers`).
pub(super) fn probe_data(cq_data_size: u64) -> u64 {
    if cq_data_size >= 8 {
        0x4d53_5052_4f42_4531 // "MSPROBE1"
    } else {
        0x4d53_0001
    }
}

/// What a try asks the provider for (`try_write`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Primitive {
    Plain,
    /// Remote CQ data, the value.
    CqData(u64),
    Fence,
    DeliveryComplete,
}

impl Primitive {
    /// One bit per primitive (tests' `GIVE_UP_AFTER_POST`).
    #[cfg(test)]
    pub fn bit(self) -> u8 {
        match self {
            Primitive::Plain => 1,
            Primitive::CqData(_) => 2,
            Primitive::Fence => 4,
            Primitive::DeliveryComplete => 8,
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Primitive::Plain => "a plain write",
            Primitive::CqData(_) => "a write carrying remote CQ data",
            Primitive::Fence => "a fenced write (FI_FENCE)",
            Primitive::DeliveryComplete => "a delivery-complete write (FI_DELIVERY_COMPLETE)",
        }
    }

    fn flags(self) -> u64 {
        fi::FI_COMPLETION as u64
            | match self {
                Primitive::Plain => 0,
                Primitive::CqData(_) => fi::FI_REMOTE_CQ_DATA as u64,
                Primitive::Fence => fi::FI_FENCE as u64,
                Primitive::DeliveryComplete => fi::FI_DELIVERY_COMPLETE as u64,
            }
    }
}

/// The endpoint's own address in its address vector, and its scratch word (address and key
/// as a peer would write it): what every try writes to.
#[derive(Clone, Copy, Debug)]
struct SelfTarget {
    addr: fi::fi_addr_t,
    raddr: u64,
    key: u64,
}

impl SelfTarget {
    /// Inserts `raw`, the endpoint's own name, into its address vector.
    pub fn new(ops: &Ops, raw: &[u8], (raddr, key): (u64, u64)) -> Result<SelfTarget> {
        let addr = ops.objs.av_insert(raw, "the endpoint's own address")?;
        Ok(SelfTarget { addr, raddr, key })
    }
}

/// One endpoint's tries (module doc): each primitive tried once, a plain write before the first,
/// and why nothing could be tried where nothing could.
pub(super) struct Tries {
    me: Option<SelfTarget>,
    done: Vec<(Primitive, Answer)>,
    /// Why nothing can be tried (the endpoint's own address refused by its address vector,
    /// or a plain write to itself failed), once known.
    pub untried: Option<String>,
    started: Instant,
}

impl Tries {
    /// Tries on `ops`'s endpoint, whose own name is `raw` and scratch word `target`.
    pub fn new(ops: &Ops, raw: &[u8], target: (u64, u64)) -> Tries {
        let (me, untried) = match SelfTarget::new(ops, raw, target) {
            Ok(m) => (Some(m), None),
            Err(e) => (None, Some(e.to_string())),
        };
        Tries {
            me,
            done: Vec::new(),
            untried,
            started: Instant::now(),
        }
    }

    /// The same, trying nothing (a unit test's planted bug: the plan trusted untried).
    pub fn none(why: &str) -> Tries {
        Tries {
            me: None,
            done: Vec::new(),
            untried: Some(why.to_string()),
            started: Instant::now(),
        }
    }

    /// The provider's answer to `p`, tried once (a plain write first); None where nothing can
    /// be tried (`untried` says why).
    pub fn answer(&mut self, ops: &mut Ops, p: Primitive) -> Option<Answer> {
        let me = self.me.filter(|_| self.untried.is_none())?;
        for q in [Primitive::Plain, p] {
            if self.done.iter().all(|t| t.0 != q) {
                let a = try_write(ops, me, q);
                self.done.push((q, a));
            }
        }
        let of = |q: Primitive| self.done.iter().find(|t| t.0 == q).map(|t| t.1.clone());
        match of(Primitive::Plain)? {
            Answer::Done => of(p),
            a => {
                self.untried = Some(format!(
                    "a plain write of the endpoint to itself {}",
                    match a {
                        Answer::Refused(why) => format!("failed: {why}"),
                        _ => "did not complete within the bound".to_string(),
                    }
                ));
                None
            }
        }
    }

    /// "tried on itself and accepted (T ms): ..." for the endpoint's INFO line, where any was.
    pub fn accepted(&self) -> Option<String> {
        let ok: Vec<&str> = self
            .done
            .iter()
            .filter(|t| t.0 != Primitive::Plain && t.1 == Answer::Done)
            .map(|t| t.0.describe())
            .collect();
        (!ok.is_empty() && self.untried.is_none()).then(|| {
            format!(
                "tried on itself and accepted ({:.1} ms): {}",
                self.started.elapsed().as_secs_f64() * 1e3,
                ok.join(", ")
            )
        })
    }
}

/// What came of one try.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Answer {
    Done,
    /// The provider refused it: why.
    Refused(String),
    /// Nothing came back within the bound.
    Silent,
}

/// Writes 8 bytes from the endpoint's inline area to itself as `what` asks, and waits (at most
/// the wait timeout, at most `BOUND_MAX`) for its completion and, for remote CQ data, for that
/// data to arrive as sent. Must run while nothing else is in flight on the endpoint (before
/// any peer is added). What may still come once it gave up (the write's completion, its CQ
/// data) is left to `ops.strays`, which the endpoint's reads then drop.
fn try_write(ops: &mut Ops, me: SelfTarget, what: Primitive) -> Answer {
    // The context lives until the write's completion: in `ops.strays` where that may be later.
    let mut ctx: Box<fi::fi_context2> = Box::default();
    let ctx_ptr: *mut c_void = (&mut *ctx as *mut fi::fi_context2).cast();
    let (answer, done, arrived) = post_and_wait(ops, me, what, ctx_ptr);
    if !done {
        ops.strays.ctxs.push(ctx);
    }
    if let (Primitive::CqData(d), None) = (what, arrived) {
        ops.strays.data.push(d);
    }
    answer
}

/// `try_write`'s post and wait: the answer, whether nothing of the write is left in flight (it
/// completed, or was never posted), and the CQ data that arrived, if any.
fn post_and_wait(
    ops: &mut Ops,
    me: SelfTarget,
    what: Primitive,
    ctx: *mut c_void,
) -> (Answer, bool, Option<u64>) {
    let bound = crate::config::wait_timeout().min(BOUND_MAX);
    // "MSPROBE0"
    let value = 0x4d53_5052_4f42_4530u64.to_ne_bytes();
    // SAFETY: the inline area holds at least INLINE_BYTES (>= 8) per slot, and nothing is in
    // flight on the endpoint, so slot 0's area is ours until this write completes.
    unsafe { std::ptr::copy_nonoverlapping(value.as_ptr(), ops.inline.ptr(), 8) };
    let iov = libc::iovec {
        iov_base: ops.inline.ptr().cast(),
        iov_len: 8,
    };
    let mut desc = ops.inline_desc;
    let rma = fi::fi_rma_iov {
        addr: me.raddr,
        len: 8,
        key: me.key,
    };
    let data = match what {
        Primitive::CqData(d) => d,
        _ => 0,
    };
    let msg = fi::fi_msg_rma {
        msg_iov: (&iov as *const libc::iovec).cast(),
        desc: &mut desc,
        iov_count: 1,
        addr: me.addr,
        rma_iov: &rma,
        rma_iov_count: 1,
        context: ctx,
        data,
    };
    let t0 = Instant::now();
    // Ends when posted, refused, or at the bound (a connection to itself may take a while:
    // -FI_EAGAIN until then, each poll driving it).
    loop {
        let rc = match ops.layer.as_mut() {
            Some(l) => l.write(ops.objs.ep, &msg, what.flags()),
            // SAFETY: ep is open; msg and what it points to live until the call returns; the
            // source is registered (inline_desc) and stays untouched until the completion;
            // the context outlives the write (`try_write`).
            None => unsafe { fi::fi_writemsg(ops.objs.ep, &msg, what.flags()) as i64 },
        };
        if rc == 0 {
            break;
        }
        let answer = if rc != EAGAIN {
            Answer::Refused(format!("fi_writemsg: {} ({rc})", strerror(rc)))
        } else if let Err(why) = read(ops, ctx, &mut false, &mut None) {
            Answer::Refused(why)
        } else if t0.elapsed() > bound {
            Answer::Silent
        } else {
            std::thread::yield_now();
            continue;
        };
        // Not posted: nothing of it will come.
        return (answer, true, Some(data));
    }
    let want_data = matches!(what, Primitive::CqData(_));
    if gives_up_at_once(what) {
        return (Answer::Silent, false, None);
    }
    let (mut done, mut arrived) = (false, None);
    // Ends when the write completed (and its data arrived, if it carried any), at an error,
    // or at the bound.
    loop {
        if let Err(why) = read(ops, ctx, &mut done, &mut arrived) {
            // An error completion of this write ends it; of the queue, leaves it as it is.
            return (Answer::Refused(why), done, arrived.or(Some(data)));
        }
        if done && (!want_data || arrived.is_some()) {
            let answer = match arrived {
                Some(got) if got != data => Answer::Refused(format!(
                    "its remote CQ data arrived as {got:#x}, sent as {data:#x}"
                )),
                _ => Answer::Done,
            };
            return (answer, true, arrived);
        }
        if t0.elapsed() > bound {
            let answer = match done {
                true => Answer::Refused(format!(
                    "the write completed, but its remote CQ data did not arrive within {bound:?}"
                )),
                false => Answer::Silent,
            };
            return (answer, done, if want_data { arrived } else { Some(data) });
        }
        std::thread::yield_now();
    }
}

/// Reads the completion queue once: the try's own completion sets `done`, remote CQ data sets
/// `arrived`; an error completion of the try is its refusal.
fn read(
    ops: &mut Ops,
    ctx: *mut c_void,
    done: &mut bool,
    arrived: &mut Option<u64>,
) -> std::result::Result<(), String> {
    let mut ents = [fi::fi_cq_data_entry::default(); 8];
    let rc = match ops.layer.as_mut() {
        Some(l) => l.read(ops.objs.ep, ops.objs.cq, &mut ents),
        // SAFETY: cq is open with FI_CQ_FORMAT_DATA; ents has room for its length.
        None => unsafe { fi::fi_cq_read(ops.objs.cq, ents.as_mut_ptr().cast(), ents.len()) as i64 },
    };
    if rc > 0 {
        // What an earlier try gave up on is dropped here as in `Ops::poll_cq`: taken for this
        // try's, an earlier CQ datum would refuse it and an earlier completion be lost.
        for e in &ents[..rc as usize] {
            if e.flags & fi::FI_REMOTE_CQ_DATA as u64 != 0 {
                if !ops.strays.take_data(e.data) {
                    *arrived = Some(e.data);
                }
            } else if e.op_context == ctx {
                *done = true;
            } else {
                ops.strays.take_ctx(e.op_context);
            }
        }
        return Ok(());
    }
    if rc == EAGAIN {
        return Ok(());
    }
    if rc == EAVAIL {
        let mut e = fi::fi_cq_err_entry::default();
        let r = match ops.layer.as_mut() {
            Some(l) => l.readerr(&mut e),
            // SAFETY: cq is open; e is a zeroed error entry (no error data buffer).
            None => unsafe { fi::fi_cq_readerr(ops.objs.cq, &mut e, 0) as i64 },
        };
        if r < 0 {
            return Err(format!("fi_cq_readerr: {} ({r})", strerror(r)));
        }
        if ops.strays.take_ctx(e.op_context) {
            return Ok(());
        }
        *done = true;
        return Err(format!(
            "its completion: {} ({})",
            strerror(-(e.err as i64)),
            -(e.err as i64)
        ));
    }
    Err(format!("fi_cq_read: {} ({rc})", strerror(rc)))
}
