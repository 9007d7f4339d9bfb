//! Waiting and locking, the same way everywhere: a poison-tolerant lock, and [`Backoff`], the
//! one shape of every bounded poll loop in the library (spin, then yield, then nap, until a
//! bound).
//!
//! Why poison-tolerant: a thread that panics while holding one of our locks is already reported
//! (the proxy's failure becomes the communicator's sticky error; an export's panic becomes
//! `mscclppInternalError`). The state behind the lock stays consistent at every await-free
//! point we hold it, so the next user may go on rather than panic in turn.

use crate::config::WaitMode;
use crate::error::Error;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

/// Locks `m`, recovering the guard from a poisoned lock (see the module doc).
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Locks `m` if nobody holds it (None if someone does), recovering a poisoned lock as `lock`.
pub fn try_lock<T: ?Sized>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// Read-locks `l`, recovering from poisoning (see the module doc).
pub fn read<T: ?Sized>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

/// Write-locks `l`, recovering from poisoning (see the module doc).
pub fn write<T: ?Sized>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

/// Set once a communicator of this process finds more ranks on its host than the process has
/// cores (`note_ranks_on_host`); never cleared (the process keeps its neighbours).
static CROWDED: AtomicBool = AtomicBool::new(false);

/// Records how many ranks of a communicator run on this host. With more ranks than cores,
/// waits that last nap between their polls ([`napping_waits`]) so that they leave the cores to
/// the ranks with work: 128 ranks on the 2-core VM polling their sockets (`poll(2)` over every
/// connection, in every waiting thread) took 72% of the CPU and a 4 KiB all-to-all round took
/// 16 s; napping, 3.3 s. With a core per rank, polling wins (a napping receiver halves a 2-rank
/// tcp stream), so that stays the rule there. Open MPI decides its `yield_when_idle` the same
/// way, from the ranks per host.
///
/// With fewer than two cores per rank it also marks the host tight ([`host_is_tight`]).
///
/// Returns the cores, and whether this call found the host crowded first (the caller says so
/// at INFO).
pub fn note_ranks_on_host(ranks: usize) -> (usize, bool) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if ranks.saturating_mul(2) > cores && !crate::config::get().test_roomy {
        TIGHT.store(true, Ordering::Relaxed);
    }
    let first = ranks > cores && !CROWDED.swap(true, Ordering::Relaxed);
    (cores, first)
}

/// Set once a communicator of this process finds fewer than two cores per rank on its host
/// (each rank's own thread and its proxy thread: `note_ranks_on_host`); never cleared, as
/// `CROWDED`.
static TIGHT: AtomicBool = AtomicBool::new(false);

/// Whether this host is tight: fewer than two cores per rank on it, as some communicator of
/// this process found at init (`note_ranks_on_host`). How long a proxy thread parks while it
/// stands aside for host threads doing its work depends on it (`fifo::park_aside`).
pub fn host_is_tight() -> bool {
    // Relaxed: a hint, set at communicator init, before the proxies it concerns.
    TIGHT.load(Ordering::Relaxed)
}

/// Whether waits that last nap between their polls (`MSCCLPP_WAIT_MODE`; `auto`: when this
/// host has more ranks than cores).
pub fn napping_waits() -> bool {
    match crate::config::get().wait_mode {
        WaitMode::Poll => false,
        WaitMode::Sleep => true,
        // Relaxed: a hint; set at communicator init, before any wait it concerns.
        WaitMode::Auto => CROWDED.load(Ordering::Relaxed),
    }
}

/// A wait that napping waits let nap has lasted this long: long enough that a round trip
/// between ranks with work never gets here, short against the scheduling delays of a crowded
/// host (tens of ms per barrier hop at 128 ranks on 2 cores).
pub const NAP_AFTER: Duration = Duration::from_micros(200);

/// The nap of a wait that has lasted `waited`: 1/16 of it, between 50 us and `max`, so that it
/// ends at most ~6% late and wakes seldom once long.
pub fn long_nap(waited: Duration, max: Duration) -> Duration {
    (waited / 16).clamp(Duration::from_micros(50), max)
}

/// What a waiter does once it has spun and yielded for its share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Nap {
    /// Keep yielding: the thing waited for is a thread on this machine that needs the core.
    Yield,
    /// Sleep this long per step.
    Fixed(Duration),
    /// Sleep `1/of_waited` of the time waited so far, at most `max`: the wait then ends at most
    /// that fraction late, and the waiter wakes seldom once the wait is long.
    Fraction { of_waited: u32, max: Duration },
}

/// The phases of a poll loop: `spins` polls with only a CPU hint between them, then yields
/// until `yield_for` has passed since the wait began, then [`Nap`]s.
///
/// Why all three: spinning answers in nanoseconds when the event is close (a copy of a few KiB,
/// a signal stored by another core); yielding hands the core at once to the thread being
/// waited for on an oversubscribed machine (CI: 2 cores, 4 ranks and their proxies), without a
/// sleep's timer slack (~50 us); napping keeps a long or idle wait from holding a core.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    pub spins: u32,
    pub yield_for: Duration,
    pub nap: Nap,
}

impl Policy {
    /// Spin only: for waits on a device or a peer that answers within microseconds, where a
    /// yield would add a scheduler round to the latency that is the product (the bound still
    /// ends them).
    pub const SPIN: Policy = Policy {
        spins: u32::MAX,
        yield_for: Duration::ZERO,
        nap: Nap::Yield,
    };
}

/// One bounded wait: call [`Backoff::pause`] after each poll that found nothing, and
/// [`Backoff::check`] (or [`Backoff::expired`]) to end it at its bound. Every loop built on it
/// ends: at the bound, or when its own condition (the caller's poll, an abort flag) holds.
#[derive(Debug)]
pub struct Backoff {
    policy: Policy,
    bound: Duration,
    start: Instant,
    /// Polls so far; 64 bits never wrap, so the periodic checks never stop.
    n: u64,
}

impl Backoff {
    /// A wait that begins now and may last `bound`.
    pub fn new(policy: Policy, bound: Duration) -> Self {
        Backoff {
            policy,
            bound,
            start: Instant::now(),
            n: 0,
        }
    }

    /// Starts over (the awaited thing made progress; an idle loop found work).
    pub fn reset(&mut self) {
        self.start = Instant::now();
        self.n = 0;
    }

    /// Polls made so far (pauses taken).
    pub fn polls(&self) -> u64 {
        self.n
    }

    /// Time since the wait began (or was reset).
    pub fn waited(&self) -> Duration {
        self.start.elapsed()
    }

    /// The bound this wait was given.
    pub fn bound(&self) -> Duration {
        self.bound
    }

    /// The bound has passed.
    pub fn expired(&self) -> bool {
        self.start.elapsed() > self.bound
    }

    /// `Err(timeout)` naming `what` once the bound has passed.
    pub fn check(&self, what: impl FnOnce() -> String) -> Result<(), Error> {
        if self.expired() {
            return Err(self.timeout(what()));
        }
        Ok(())
    }

    /// The timeout error of this wait, naming `what`.
    pub fn timeout(&self, what: String) -> Error {
        Error::timeout(what, self.bound)
    }

    /// A pause, then the bound checked every 64 polls (reading the clock on every poll costs
    /// a few percent of a transfer's CPU time on a small machine): `Err(timeout)` naming
    /// `what` once it has passed.
    pub fn step(&mut self, what: impl FnOnce() -> String) -> Result<(), Error> {
        self.pause();
        if self.n % 64 == 0 {
            self.check(what)?;
        }
        Ok(())
    }

    /// The wait is past its spins and its yields: a pause now would nap.
    pub fn past_yields(&self) -> bool {
        self.n >= u64::from(self.policy.spins) && self.start.elapsed() >= self.policy.yield_for
    }

    /// Counts a pause the caller took its own way (a crowded host's longer nap,
    /// [`long_nap`]) instead of [`Backoff::pause`].
    pub fn paused_elsewhere(&mut self) {
        self.n += 1;
    }

    /// One pause between polls, by the policy's phase for this point of the wait.
    pub fn pause(&mut self) {
        self.n += 1;
        if self.n <= u64::from(self.policy.spins) {
            std::hint::spin_loop();
            return;
        }
        let waited = self.start.elapsed();
        if waited < self.policy.yield_for {
            std::thread::yield_now();
            return;
        }
        match self.policy.nap {
            Nap::Yield => std::thread::yield_now(),
            Nap::Fixed(d) => std::thread::sleep(d),
            Nap::Fraction { of_waited, max } => {
                std::thread::sleep((waited / of_waited.max(1)).min(max))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_recovers_from_poison() {
        let m = std::sync::Arc::new(Mutex::new(5));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        assert_eq!(*lock(&m), 5);
    }

    #[test]
    fn backoff_ends_at_its_bound_and_names_the_wait() {
        let policy = Policy {
            spins: 4,
            yield_for: Duration::from_millis(1),
            nap: Nap::Fraction {
                of_waited: 4,
                max: Duration::from_millis(2),
            },
        };
        let mut b = Backoff::new(policy, Duration::from_millis(30));
        let t0 = Instant::now();
        let err = loop {
            if let Err(e) = b.check(|| "the test's event".into()) {
                break e;
            }
            b.pause();
        };
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(30), "{took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        assert!(b.polls() > 4);
        let msg = err.to_string();
        assert!(
            msg.contains("the test's event") && msg.contains("30 ms"),
            "{msg}"
        );
    }

    #[test]
    fn reset_starts_the_wait_over() {
        let mut b = Backoff::new(Policy::SPIN, Duration::from_millis(5));
        std::thread::sleep(Duration::from_millis(10));
        assert!(b.expired());
        b.pause();
        b.reset();
        assert!(!b.expired());
        assert_eq!(b.polls(), 0);
    }
}
