//! After `mscclppProxyStop`, one thread per communicator keeps progressing its network
//! endpoints until the proxies launch again or the communicator is destroyed: a peer's flush
//! that waits for delivery (its marker write, FI_DELIVERY_COMPLETE: `transport/net`) and its
//! last writes to us move only while our endpoint progresses on software providers (tcp, shm),
//! so a peer that flushes after we stopped would otherwise wait out its wait timeout. The 2023
//! library flushed to local completion and never needed this; a 2023 program that stops its
//! proxies without a barrier must still run (issue 40, finding 6).
//!
//! It serves nothing of the FIFOs: it calls `progress` and `poll_incoming`, and applies the
//! inline puts SHM peers write into our rings (`transport::inbox`: a peer's flush waits until
//! they are applied). It takes each
//! endpoint's lock with `try_lock` (a host call holding it is left alone), naps between rounds
//! longer the longer nothing arrives (at most `NAP_MAX`: a peer's flush is then that much
//! later), and stops serving an endpoint at its first error (the peer left). Quitting is
//! bounded: a thread stuck inside a provider (a peer that died inside libfabric's shm) is
//! abandoned with the endpoint it was in, which the caller must then not touch again.

use super::work::SharedEndpoint;
use crate::transport::inbox::Inbox;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The longest nap between rounds once nothing has arrived for a while.
const NAP_MAX: Duration = Duration::from_millis(1);
/// `Keeper::current` when the thread is not inside an endpoint.
const IDLE: usize = usize::MAX;

/// The thread (module doc) and how to end it.
pub struct Keeper {
    quit: Arc<AtomicBool>,
    /// The slot whose endpoint the thread is inside, or `IDLE`.
    current: Arc<AtomicUsize>,
    handle: JoinHandle<()>,
}

/// Starts a thread progressing `eps` (the caller's slot index, the endpoint) and applying
/// `inboxes` until `quit`.
pub fn keep_serving(
    name: String,
    eps: Vec<(usize, SharedEndpoint)>,
    inboxes: Vec<Arc<Inbox>>,
) -> std::io::Result<Keeper> {
    let quit = Arc::new(AtomicBool::new(false));
    let current = Arc::new(AtomicUsize::new(IDLE));
    let (q, cur) = (quit.clone(), current.clone());
    let handle = std::thread::Builder::new()
        .name(name)
        .spawn(move || serve(&eps, &inboxes, &q, &cur))?;
    Ok(Keeper {
        quit,
        current,
        handle,
    })
}

fn serve(
    eps: &[(usize, SharedEndpoint)],
    inboxes: &[Arc<Inbox>],
    quit: &AtomicBool,
    current: &AtomicUsize,
) {
    let mut live: Vec<bool> = vec![true; eps.len()];
    let mut live_inboxes: Vec<bool> = vec![true; inboxes.len()];
    let mut quiet_since = Instant::now();
    // Ends when asked to quit (Acquire pairs with the Release in `quit`), or when every
    // endpoint and ring has failed.
    while !quit.load(Ordering::Acquire)
        && (live.iter().any(|l| *l) || live_inboxes.iter().any(|l| *l))
    {
        let mut took = false;
        for (inbox, live) in inboxes.iter().zip(live_inboxes.iter_mut()) {
            if !*live {
                continue;
            }
            // What a peer put inline since (a waiter of ours applying it too leaves it to
            // that waiter: `drain_if_free`).
            match inbox.drain_if_free() {
                Ok(applied) => took |= applied,
                Err(e) => {
                    crate::info!(
                        "an inline-put ring is no longer applied after the proxies' stop: {e}"
                    );
                    *live = false;
                }
            }
        }
        for ((slot, ep), live) in eps.iter().zip(live.iter_mut()) {
            if !*live {
                continue;
            }
            let Ok(mut ep) = ep.try_lock() else {
                continue;
            };
            // Relaxed: read by `quit` only after the join failed (its bound passed), to name
            // the endpoint a stuck thread is in; a stale value names one it just left.
            current.store(*slot, Ordering::Relaxed);
            let r = ep
                .progress()
                .and_then(|_| ep.poll_incoming())
                .map(|_| ep.took_incoming());
            current.store(IDLE, Ordering::Relaxed);
            match r {
                Ok(t) => took |= t,
                Err(e) => {
                    crate::info!(
                        "{}: no longer progressed after the proxies' stop: {e}",
                        ep.describe()
                    );
                    *live = false;
                }
            }
        }
        if took {
            quiet_since = Instant::now();
            std::thread::yield_now();
        } else {
            std::thread::sleep(crate::sync::long_nap(quiet_since.elapsed(), NAP_MAX));
        }
    }
}

impl Keeper {
    /// Ends the thread, waiting at most `bound`. Returns the slot whose endpoint it is stuck
    /// inside, if it did not end (the thread is then abandoned, with that endpoint and its
    /// lock: the caller must not touch it again).
    pub fn quit(self, bound: Duration) -> Option<usize> {
        // Release pairs with the Acquire in `serve`.
        self.quit.store(true, Ordering::Release);
        let t0 = Instant::now();
        // Ends when the thread finishes, or at `bound`.
        while !self.handle.is_finished() {
            if t0.elapsed() > bound {
                let slot = self.current.load(Ordering::Relaxed);
                crate::warn!(
                    "the thread that progressed the endpoints after the proxies' stop did not end within {bound:?}: it is stuck inside a provider (a peer that died inside libfabric's shm leaves a lock held); abandoned"
                );
                return (slot != IDLE).then_some(slot);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if self.handle.join().is_err() {
            crate::warn!(
                "the thread that progressed the endpoints after the proxies' stop panicked"
            );
        }
        None
    }
}
