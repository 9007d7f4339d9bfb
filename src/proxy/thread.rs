//! The proxy thread: `launch` starts it over a `ProxyWork`, `run` is its loop (standing aside for
//! assisting host threads, pausing by the idle policy), `Running::stop` drains and joins it.

use super::work::{lost_peer_of, progress_idle, ProxyWork, Round, SharedWork};
use crate::error::{Error, Result};
use crate::sync::{lock, Backoff, Nap, Policy};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub struct Running {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Result<()>>,
}

/// Starts a named proxy thread over `work`.
pub fn launch(work: SharedWork) -> Result<Running> {
    let (name, device, assisted, gate) = {
        let mut w = lock(&work);
        // A peer that dies while the transport waits for it (a flush, a full queue) ends that
        // wait at once, as it ends an idle proxy's loop (`check_peers`); so does the
        // communicator's abort (an error, or a stop past its drain bound).
        let (boot, ranks, sticky) = (
            w.boot.clone(),
            w.conns.iter().map(|c| c.remote_rank).collect::<Vec<_>>(),
            w.sticky.clone(),
        );
        lock(&w.endpoint).set_abort_check(Box::new(move || {
            lost_peer_of(&boot, &ranks).or_else(|| {
                sticky
                    .cuts_waits()
                    .then(|| "the communicator was aborted or its proxies stopped".to_string())
            })
        }));
        w.active = true;
        w.stop_seen = None;
        w.stop_asked = None;
        (w.name.clone(), w.fifo.device(), w.assisted, w.gate.clone())
    };
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let work2 = work.clone();
    let spawned = std::thread::Builder::new().name(name).spawn(move || {
        // The FIFO's device is the endpoint's: its copies and streams live in that device's
        // primary context.
        crate::cuda::bind_proxy_thread(device);
        gate.set_proxy_thread(assisted.then(std::thread::current));
        // A panic (a bug) fails the communicator at once, as an error does: sticky error and
        // abort word now, not when the thread is joined at stop. AssertUnwindSafe: after it
        // the work is failed, so nobody consumes from its state again.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run(&work2, &stop2, assisted.then_some(&*gate))
        }))
        .unwrap_or_else(|p| Err(fail_and_quiesce(&mut lock(&work2), panic_error(p))));
        gate.set_proxy_thread(None);
        r
    });
    match spawned {
        Ok(handle) => Ok(Running { stop, handle }),
        Err(e) => {
            lock(&work).active = false;
            Err(Error::sys("spawning the proxy thread", e))
        }
    }
}

impl Running {
    /// Asks the thread to finish the triggers already in the FIFO and stop, without waiting.
    pub fn ask_stop(&self) {
        // Release pairs with the Acquire load in `run`.
        self.stop.store(true, Ordering::Release);
    }

    /// The thread has ended (joining it will not wait).
    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Asks the thread to finish the triggers already in the FIFO, then joins it.
    pub fn stop(self) -> Result<()> {
        self.stop_within(Duration::MAX).0
    }

    /// As [`Running::stop`], waiting at most `bound`. Returns the thread's result, and true if
    /// the thread was abandoned instead: still inside a call that never returns (libfabric
    /// 1.17's shm provider spins forever on a lock in shared memory that a peer killed inside
    /// the provider left held). It keeps what it holds (the FIFO, the endpoint and its locks);
    /// the caller must not touch them again.
    pub fn stop_within(self, bound: Duration) -> (Result<()>, bool) {
        self.ask_stop();
        let t0 = Instant::now();
        // Ends when the thread finishes, or at `bound`.
        while !self.handle.is_finished() {
            if t0.elapsed() > bound {
                let e = Error::remote(format!(
                    "the proxy thread did not stop within {bound:?}: it is stuck inside the transport (a peer that died inside libfabric's shm provider leaves a lock held); abandoned with its endpoint"
                ));
                crate::warn!("{e}");
                return (Err(e), true);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let r = self
            .handle
            .join()
            .unwrap_or_else(|_| Err(Error::internal("the proxy thread panicked")));
        (r, false)
    }
}

/// The proxy thread. Ends when stopped (after draining), or at the first error, which it
/// records (sticky error, abort word) before returning it. `gate`: host threads do this
/// FIFO's work too (assisted FIFOs).
fn run(
    work: &Mutex<ProxyWork>,
    stop: &AtomicBool,
    gate: Option<&crate::fifo::HelperGate>,
) -> Result<()> {
    // Idle rounds pause by this policy; it never expires (the loop ends on `stop` or an
    // error), so its bound is unused.
    let mut backoff = Backoff::new(
        if gate.is_some() { IDLE_ASSISTED } else { IDLE },
        Duration::MAX,
    );
    let mut idle = false;
    let napping = crate::sync::napping_waits();
    loop {
        // While a host thread waits on this FIFO doing its work (every step of its wait is a
        // round of it), or just executed its own trigger, stand aside: park a little at a time
        // (`HelperGate`), never once asked to stop. Measured on the 2-core VM, 8 runs
        // alternating with the code before (bench/RESULTS.md): 1 MiB puts over tcp 5.16 ->
        // 5.61 GB/s, 4 MiB over net 4.25 -> 4.64 GB/s. Acquire pairs with `Running::stop`.
        let aside = gate.map_or(Duration::ZERO, |g| g.stand_aside());
        if !aside.is_zero() && !stop.load(Ordering::Acquire) {
            std::thread::park_timeout(aside);
            continue;
        }
        // The round, with the work lock held only inside this block.
        let r = {
            let mut w = lock(work);
            if !w.active {
                // A host thread's assist failed and recorded the error: report that one, with
                // its code (mscclppProxyStop returns the first error the proxy's work met).
                let (code, msg) = w.sticky.get().unwrap_or((
                    crate::abi::mscclppResult_t::mscclppInternalError,
                    String::new(),
                ));
                return Err(Error::Earlier(code, msg));
            }
            // Acquire pairs with `Running::stop`.
            match w.service(stop.load(Ordering::Acquire), false) {
                Ok(Round::Done) => {
                    w.active = false;
                    return Ok(());
                }
                Ok(round @ (Round::Idle | Round::Applied)) => {
                    // Outside the work lock (see `ProxyWork::service`): with libfabric 2.x's
                    // shm, a test's host thread lost the lock to this progress on every try.
                    let endpoint = w.endpoint.clone();
                    drop(w);
                    // Peers' writes arriving keep it polling (`Endpoint::took_incoming`), as
                    // do records applied for a sender waiting for room.
                    progress_idle(&endpoint).map(|took| match took || round == Round::Applied {
                        true => Round::Busy,
                        false => Round::Idle,
                    })
                }
                Ok(r) => Ok(r),
                // Recorded before the lock is let go: a host thread must not run the trigger
                // that failed (still in the FIFO) again in between.
                Err(e) => return Err(fail_and_quiesce(&mut w, e)),
            }
        };
        // Only progress failed here, outside the lock.
        let round = match r {
            Ok(r) => r,
            Err(e) => return Err(fail_and_quiesce(&mut lock(work), e)),
        };
        match round {
            Round::Busy => idle = false,
            _ => {
                if !idle {
                    backoff.reset();
                    idle = true;
                }
                // On a crowded host an idle proxy of an assisted FIFO naps longer the longer it
                // is idle: with many ranks per core, idle proxies napping 20 us at a time took
                // the cores from the threads with work (128 ranks on 2 cores: 60% of the CPU
                // with 1 ms naps).
                if napping && gate.is_some() && backoff.past_yields() {
                    std::thread::sleep(crate::sync::long_nap(backoff.waited(), ASSISTED_NAP));
                    backoff.paused_elsewhere();
                } else {
                    backoff.pause();
                }
            }
        }
    }
}

/// Records the proxy's error (sticky, abort word, no more consuming) and quiesces the endpoint,
/// best effort (it may be what failed), as at a normal stop; returns the error.
fn fail_and_quiesce(w: &mut ProxyWork, e: Error) -> Error {
    w.fail(&e);
    if let Err(q) = lock(&w.endpoint).quiesce() {
        crate::warn!("{}: after the error, quiescing failed too: {q}", w.name);
    }
    e
}

/// The error a panic in the proxy's work becomes: `mscclppInternalError`, with the panic's text.
pub(super) fn panic_error(p: Box<dyn std::any::Any + Send>) -> Error {
    let what = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    Error::internal(format!("the proxy's work panicked: {what}"))
}

/// An idle proxy's nap: short, because device producers (GPU FIFOs) wait for it to notice
/// their triggers.
const IDLE_NAP: Duration = Duration::from_micros(20);
/// The longest nap of an idle proxy of an assisted FIFO on a crowded host: its host producers
/// execute their own triggers and its waiters progress the endpoint, so what it covers alone
/// is a peer's writes into an idle rank (over tcp they need this side's progress to complete),
/// lost peers and the stop request, each then at most this late.
const ASSISTED_NAP: Duration = Duration::from_millis(16);

/// Idle policy: spin, then yield for a while (hands the core to producers and peers on an
/// oversubscribed machine without a sleep's timer slack), then short naps so that an idle
/// communicator does not hold a core.
const IDLE: Policy = Policy {
    spins: 8,
    yield_for: Duration::from_millis(20),
    nap: Nap::Fixed(IDLE_NAP),
};
/// Assisted FIFOs nap sooner: their producers and waiters do the proxy's work themselves
/// (`Assist`), so the thread only covers the gaps.
const IDLE_ASSISTED: Policy = Policy {
    yield_for: Duration::from_millis(1),
    ..IDLE
};
