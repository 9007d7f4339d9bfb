//! The proxy thread's stand-aside gate: host threads that wait while doing the proxy's work
//! count themselves here, and the proxy thread parks while they do.

use crate::sync::lock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Host threads that wait on a FIFO while doing its consumer's work (`Spin`), counted so that
/// the proxy thread can stand aside meanwhile (`run`, proxy/thread.rs): on a machine with fewer cores than
/// busy threads, a second thread taking turns at the same work only costs the first one its
/// core, and both of them the futex hand-offs of the consumer's lock.
///
/// The proxy thread parks for `aside` at a time and looks again. A waiter that leaves after a
/// long wait (`LONG_WAIT`: a transfer) wakes it at once; one that leaves after a short wait
/// does not: the futex wake on the waiter's way back to the caller (and on 2 cores the waiter
/// preempted by the woken thread) made an 8-byte putWithSignal round trip over tcp 27 us
/// instead of 8. How long it parks depends on the host (`park_aside`): where cores are
/// short, `ASIDE_TIGHT` (parking 50 us at a time instead cost bulk transfers ~15% on 2 cores:
/// the parked thread's wake-ups take the helpers' cores); where each thread has a core,
/// `ASIDE_ROOMY` (with 250 us parks there, a receiver waiting once per 16 KiB put over tcp
/// moved its stream at 0.71 of the rate of one that waited once for all of it; with 20 us,
/// 0.92: bench/RESULTS.md, session 18).
pub struct HelperGate {
    helpers: AtomicU32,
    /// How long the proxy thread parks at a time while standing aside.
    aside: Duration,
    /// The proxy thread, woken when a long-waiting helper leaves.
    proxy: std::sync::Mutex<Option<std::thread::Thread>>,
    /// When a host producer last executed triggers itself (`host_push`), in ns since `epoch`
    /// (0: not since the last time it found the consumer busy).
    last_push_assist: AtomicU64,
    epoch: Instant,
}

impl Default for HelperGate {
    /// A tight host's gate (`ASIDE_TIGHT`).
    fn default() -> Self {
        HelperGate::new(ASIDE_TIGHT)
    }
}

impl HelperGate {
    /// `aside`: how long the proxy thread parks at a time while standing aside
    /// (`park_aside`).
    pub fn new(aside: Duration) -> Self {
        HelperGate {
            helpers: AtomicU32::new(0),
            aside,
            proxy: std::sync::Mutex::new(None),
            last_push_assist: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

/// How long after a host producer executed its own trigger the proxy thread keeps standing
/// aside: a stream of pushes (each executing itself) needs no second thread.
const PUSH_ASSIST_HOLD: Duration = Duration::from_micros(200);
/// The longest the proxy thread parks before it looks again on a host with fewer cores than
/// busy threads (the kernel adds its timer slack, ~50 us): bounds how long endpoint progress
/// pauses once host threads stop helping after short waits.
const ASIDE_TIGHT: Duration = Duration::from_micros(250);
/// The same where every rank's thread and its proxy thread have a core.
const ASIDE_ROOMY: Duration = Duration::from_micros(20);

/// How long a proxy thread parks at a time while standing aside, on a host that is `tight`
/// (`sync::host_is_tight`) or not.
pub fn park_aside(tight: bool) -> Duration {
    if tight {
        ASIDE_TIGHT
    } else {
        ASIDE_ROOMY
    }
}
/// A helper that waited longer than this wakes the proxy thread when it leaves.
const LONG_WAIT: Duration = Duration::from_micros(100);

impl HelperGate {
    pub(crate) fn enter(&self) {
        // Relaxed, here and below: the count is a hint; the consumer's lock orders the work.
        self.helpers.fetch_add(1, Ordering::Relaxed);
    }
    /// `waited`: how long this helper waited.
    pub(crate) fn leave(&self, waited: Duration) {
        if self.helpers.fetch_sub(1, Ordering::Relaxed) == 1 && waited > LONG_WAIT {
            if let Some(t) = lock(&self.proxy).as_ref() {
                t.unpark();
            }
        }
    }
    /// A host thread that did this FIFO's work is about to block elsewhere (a bootstrap
    /// barrier): a proxy thread parked for it resumes now rather than at the end of its park.
    /// After short waits (which do not wake it on leaving) and the producer's own pushes (the
    /// hold) it would otherwise sleep up to `aside` on: on a tight host 250 us, in which a
    /// peer's flush waits for the acknowledgement only our progress sends.
    pub fn resume(&self) {
        self.nudge();
        if self.helpers.load(Ordering::Relaxed) == 0 {
            if let Some(t) = lock(&self.proxy).as_ref() {
                t.unpark();
            }
        }
    }
    /// Names the thread that a long-waiting helper wakes when it leaves (the proxy thread).
    pub fn set_proxy_thread(&self, t: Option<std::thread::Thread>) {
        *lock(&self.proxy) = t;
    }
    /// How long the proxy thread should park now (zero: not at all): while some host thread
    /// waits doing the consumer's work, or shortly after a producer executed its own trigger.
    pub fn stand_aside(&self) -> Duration {
        self.stand_aside_with(|| self.now())
    }
    /// As `stand_aside`, with `now` (ns since `epoch`) read only if a push's hold may run: the
    /// proxy thread asks on every round, and reading the clock on each one cost ~1% of a tcp
    /// transfer (see `ProxyWork::service`). A hold that ran out is cleared for the same reason.
    fn stand_aside_with(&self, now: impl FnOnce() -> u64) -> Duration {
        if self.helpers.load(Ordering::Relaxed) > 0 {
            return self.aside;
        }
        let last = self.last_push_assist.load(Ordering::Relaxed);
        if last == 0 {
            return Duration::ZERO;
        }
        let rest =
            PUSH_ASSIST_HOLD.saturating_sub(Duration::from_nanos(now().saturating_sub(last)));
        if rest.is_zero() {
            // Only if no newer push stored its time meanwhile.
            let _ = self.last_push_assist.compare_exchange(
                last,
                0,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
        rest.min(self.aside)
    }
    fn now(&self) -> u64 {
        // At least 1: 0 means "no push to stand aside for".
        (self.epoch.elapsed().as_nanos() as u64).max(1)
    }
    /// A producer executed triggers itself.
    pub(crate) fn pushed_and_assisted(&self) {
        self.pushed_and_assisted_at(self.now());
    }
    fn pushed_and_assisted_at(&self, now: u64) {
        self.last_push_assist.store(now, Ordering::Relaxed);
    }
    /// A producer found the consumer busy: the proxy thread must not stay aside for it (the
    /// thread holding the consumer may have finished its round before this trigger).
    pub(crate) fn nudge(&self) {
        self.last_push_assist.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helper_gate_sets_the_proxy_aside_while_helped() {
        // Explicit times (ns since the gate's epoch): a slow run (valgrind) must not matter.
        let gate = HelperGate::default();
        assert!(
            gate.stand_aside_with(|| 1_000).is_zero(),
            "nobody helps yet"
        );
        gate.pushed_and_assisted_at(1_000);
        assert_eq!(
            gate.stand_aside_with(|| 1_000),
            ASIDE_TIGHT.min(PUSH_ASSIST_HOLD)
        );
        let hold = PUSH_ASSIST_HOLD.as_nanos() as u64;
        assert_eq!(
            gate.stand_aside_with(|| 1_000 + hold - 10_000),
            Duration::from_micros(10).min(ASIDE_TIGHT),
            "the rest of the hold"
        );
        assert!(
            gate.stand_aside_with(|| 1_000 + hold).is_zero(),
            "the hold ran out"
        );
        assert!(gate
            .stand_aside_with(|| unreachable!("a cleared hold reads no clock"))
            .is_zero());
        gate.pushed_and_assisted_at(5_000);
        gate.nudge();
        assert!(
            gate.stand_aside_with(|| 5_000).is_zero(),
            "a producer that found the consumer busy"
        );
        gate.enter();
        gate.enter();
        assert_eq!(gate.stand_aside(), ASIDE_TIGHT);
        gate.leave(Duration::ZERO);
        assert_eq!(gate.stand_aside(), ASIDE_TIGHT, "one waiter still helps");
        gate.leave(Duration::ZERO);
        assert!(gate.stand_aside().is_zero(), "nobody helps any more");
    }

    #[test]
    fn resume_wakes_a_proxy_parked_for_a_helper_gone_to_block_elsewhere() {
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        let gate = Arc::new(HelperGate::default());
        let woke = Arc::new(AtomicBool::new(false));
        // The proxy thread: parked a minute at a time, as `aside` would have it.
        let (g, w) = (gate.clone(), woke.clone());
        let proxy = std::thread::spawn(move || {
            g.set_proxy_thread(Some(std::thread::current()));
            let t0 = Instant::now();
            std::thread::park_timeout(Duration::from_secs(60));
            w.store(true, Ordering::Release);
            t0.elapsed()
        });
        // A producer's own push holds it aside; a short wait's leave does not wake it.
        // (Explicit times, as above: a slow run must not end the hold first.)
        gate.pushed_and_assisted_at(1_000);
        gate.enter();
        gate.leave(Duration::ZERO);
        // (Until the proxy thread named itself, an unpark would have nobody to wake.)
        while lock(&gate.proxy).is_none() {
            std::thread::yield_now();
        }
        assert!(
            !gate.stand_aside_with(|| 1_000).is_zero(),
            "the push's hold"
        );
        gate.resume();
        assert!(
            gate.stand_aside_with(|| 1_000).is_zero(),
            "the hold is gone"
        );
        let parked = proxy.join().unwrap();
        assert!(woke.load(Ordering::Acquire));
        assert!(parked < Duration::from_secs(60), "it slept its whole park");
    }

    #[test]
    fn a_roomy_hosts_gate_parks_briefly() {
        let gate = HelperGate::new(ASIDE_ROOMY);
        gate.enter();
        assert_eq!(
            gate.stand_aside_with(|| 1_000),
            ASIDE_ROOMY,
            "a helper waits"
        );
        gate.leave(Duration::ZERO);
        gate.pushed_and_assisted_at(1_000);
        assert_eq!(
            gate.stand_aside_with(|| 1_000),
            ASIDE_ROOMY,
            "a producer executed its own trigger: the hold, parked in short steps"
        );
    }
}
