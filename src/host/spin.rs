//! How a host thread waits on a FIFO or an epoch: bounded, ended by the abort word, and doing
//! the proxy's work itself where it may (`fifo::Assist`).

use super::pending::{self, Ended, HostWait};
use crate::abi::mscclppConcurrentFifo;
use crate::error::{Error, Result};
use crate::fifo::{consumer_and_gate, Assist, HelperGate};
use crate::proxy::WaitOp;
use crate::sync::{Backoff, Nap, Policy};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What a waiting host thread found when it offered its help (`Spin::step`).
enum Help {
    /// It did a round of the consumer's work.
    Did,
    /// Another thread is doing it right now.
    Busy,
    /// Nobody it may help (not launched yet, or only the proxy thread may do the work).
    None,
}

/// A spin that ends on the abort word, or the deadline. A waiter that does the proxy's work
/// (`assist`) keeps doing it, spinning and yielding now and then, never napping. One that
/// cannot help yields, and only after a long quiet period naps: on an oversubscribed machine
/// (CI: 2 cores running 4 ranks and their proxies) yielding hands the core to the thread we
/// wait for at once, while a sleep costs at least the kernel's timer slack (~50 us) per round
/// trip.
pub struct Spin {
    abort: *const u64,
    /// The FIFO's head: identifies the consumer this waiter helps (`assist`).
    head: *const u64,
    /// That consumer, looked up once (and again now and then while there is none: the proxy
    /// may be launched during the wait) rather than in the registry on every step, which
    /// took a fifth of the CPU time of a tcp transfer on the 2-core VM.
    consumer: Option<(Arc<dyn Assist>, Arc<HelperGate>)>,
    /// This waiter counted itself in the consumer's gate (from its first step on; a push that
    /// finds room at once never does).
    entered: bool,
    /// The wait's bound and, when there is no help to give, its pauses.
    backoff: Backoff,
    /// Steps taken.
    n: u32,
    /// Waits that last nap (`sync::napping_waits`: a crowded host), and this one has lasted
    /// `sync::NAP_AFTER`: a helping waiter then naps between its rounds.
    napping: bool,
    long: bool,
    /// What it waits for, as the hang report lists it (`pending`): connection id, operation
    /// and the count or ticket wanted.
    what: (usize, WaitOp, u64),
    /// Its entry in that list, once it has lasted `LIST_AFTER` steps (or ended in an error).
    listed: Option<u64>,
}

impl Drop for Spin {
    fn drop(&mut self) {
        if let (true, Some((_, gate))) = (self.entered, &self.consumer) {
            gate.leave(self.backoff.waited());
        }
        if let Some(id) = self.listed {
            // A wait that ended in an error was marked in `fail`, which keeps it listed.
            pending::end(id, None);
        }
    }
}

/// Steps before a wait lists itself for the hang report: past its first fast polls, so a
/// wait that ends in microseconds never takes the list's lock.
const LIST_AFTER: u32 = 256;

/// Steps between looks for a consumer while none is registered yet.
const LOOKUP_EVERY: u32 = 256;
/// Steps of a helping waiter between yields. Each step is a round of the proxy's work (over tcp
/// a poll of the endpoint's sockets, ~1 us): with 256 steps, 3 ranks on the 2-core VM took
/// 150-250 us per 8-byte sendrecv (a waiter kept its core while the peer it waited for sat in
/// the run queue) against 17 us for 2 ranks; with 16, 39-66 us, and 2 ranks unchanged.
const YIELD_EVERY: u32 = 16;
/// The longest nap of a helping waiter on a crowded host (`sync::napping_waits`): what it
/// waits for is then at most this late. With more ranks than cores, waiters that keep helping
/// take the cores from the ranks with work: each round polls every socket of the endpoint.
const NAP_MAX: Duration = Duration::from_millis(1);

/// A waiter that cannot help: 8 polls, then yields for 20 ms, then naps 1/64 of what it has
/// waited (at most 1 ms): it then wakes at most 1/64 of its wait late, and seldom enough not to
/// matter to the thread doing the work. Each wake-up takes that thread's core for ~7 us on
/// the 2-core VM (`perf sched timehist`): with the fixed 50 us naps before, the receiver's
/// waiter took ~7 us of every ~117 us of a 1 MiB shm transfer's copying thread: 88% of raw
/// `fi_write` against 94% with naps of 1/64 in 24 rotated rounds (bench/RESULTS.md: of two
/// 16-round batches, one agrees and one shows no change).
const UNHELPED: Policy = Policy {
    spins: 8,
    yield_for: Duration::from_millis(20),
    nap: Nap::Fraction {
        of_waited: 64,
        max: Duration::from_millis(1),
    },
};

impl Spin {
    /// A wait on the host FIFO `fifo` (its abort word ends the wait) for `wanted` (`op`
    /// `Wait`: the signal count; `Flush`, `Push`: the FIFO ticket), as the hang report names
    /// it.
    pub fn new(fifo: &mscclppConcurrentFifo, deadline: Duration, op: WaitOp, wanted: u64) -> Self {
        Spin {
            // SAFETY: the abort word follows the tail in every FIFO's control block.
            abort: unsafe { fifo.triggerFifoTail.add(1) },
            head: fifo.triggerFifoHead,
            consumer: consumer_and_gate(fifo.triggerFifoHead, |c| c.helps),
            entered: false,
            backoff: Backoff::new(UNHELPED, deadline),
            n: 0,
            napping: crate::sync::napping_waits(),
            long: false,
            what: (fifo.connId as usize, op, wanted),
            listed: None,
        }
    }

    /// Lists this wait for the hang report (`pending`), once.
    fn list(&mut self) {
        if self.listed.is_none() {
            let (conn_id, op, wanted) = self.what;
            self.listed = Some(pending::add(HostWait {
                head: self.head as usize,
                conn_id,
                op,
                wanted,
                since: std::time::Instant::now() - self.backoff.waited(),
                ended: None,
            }));
        }
    }

    /// The wait ends in error `e`: it stays listed, marked, for a while; a timeout asks for a
    /// hang report (written by the reporter thread; this call does not wait for it).
    fn fail(&mut self, e: Error) -> Error {
        let how = match e {
            Error::Timeout { .. } => Ended::TimedOut,
            _ => Ended::Aborted,
        };
        self.list();
        if let Some(id) = self.listed.take() {
            pending::end(id, Some(how));
        }
        if how == Ended::TimedOut {
            crate::proxy::request_hang_report(self.head as usize, format!("host thread: {e}"));
        }
        e
    }
    /// One step of waiting: Ok while the caller should keep waiting, Err when it must stop.
    pub fn step(&mut self, what: &str) -> Result<()> {
        // SAFETY: `abort` points into a live FIFO control block (the caller's DevConn).
        let a = unsafe { AtomicU64::from_ptr(self.abort as *mut u64) }.load(Ordering::Acquire);
        if a != 0 {
            return Err(self.fail(super::abort_error(what, a)));
        }
        self.n = self.n.saturating_add(1);
        if self.n == LIST_AFTER {
            self.list();
        }
        // What we wait for may need the proxy's work (our trigger executed, the endpoint through
        // which the peer's data comes progressed): do it here rather than wait for a thread
        // that may not even have a core.
        if self.consumer.is_none() && self.n % LOOKUP_EVERY == 0 {
            self.consumer = consumer_and_gate(self.head, |c| c.helps);
        }
        if let (false, Some((_, gate))) = (self.entered, &self.consumer) {
            gate.enter();
            self.entered = true;
        }
        let help = match &self.consumer {
            Some((c, _)) if c.assist() => Help::Did,
            Some(_) => Help::Busy,
            None => Help::None,
        };
        if !matches!(help, Help::None) {
            // Checked every 64 steps: reading the clock on every one cost ~4% of a tcp
            // transfer's CPU time on the 2-core VM.
            if self.n % 64 == 0 {
                self.backoff
                    .check(|| what.to_string())
                    .map_err(|e| self.fail(e))?;
                self.long = self.napping && self.backoff.waited() >= crate::sync::NAP_AFTER;
            }
            if self.long && matches!(help, Help::Did) {
                // Out of the gate while napping: the proxy thread, standing aside for this
                // helper, would otherwise park on through the nap with nobody progressing the
                // endpoint (over tcp the peer's data moves only while this side progresses: a
                // 16 KiB stream into a napping receiver ran at 0.06 GB/s on the crowded VM).
                // Leaving after a long wait wakes it (`HelperGate::leave`); it naps itself
                // when there is nothing incoming. (`Did`: this waiter has a consumer and
                // entered its gate above.)
                if let Some((_, gate)) = &self.consumer {
                    gate.leave(self.backoff.waited());
                    std::thread::sleep(crate::sync::long_nap(self.backoff.waited(), NAP_MAX));
                    gate.enter();
                }
                return Ok(());
            }
            // Helping: this thread progresses the endpoint (the proxy thread naps while host
            // threads assist), so it must not nap, or a long transfer over a socket provider
            // moves one chunk per nap (64 KiB puts over tcp fell to 1 GB/s after 20 ms of
            // waiting). It spins, yielding now and then; and at once while another thread
            // holds the consumer, which then has the work to do and may need this core.
            if matches!(help, Help::Busy) || self.n % YIELD_EVERY == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            return Ok(());
        }
        self.backoff
            .check(|| what.to_string())
            .map_err(|e| self.fail(e))?;
        // Without help to give, the proxy thread does the work: on a machine with fewer cores
        // than busy threads, yielding soon hands it the core. A few polls first: a signal
        // stored straight into our epoch (SHM, `direct_flag`, proxy/conn.rs) needs no other thread.
        self.backoff.pause();
        Ok(())
    }
}
