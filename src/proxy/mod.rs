//! Proxy threads: one per endpoint. Each polls its FIFO, checks every trigger against the
//! registered sizes, dispatches to its transport, retires the trigger, and keeps the transport
//! progressing when idle. A failure is sticky: stored once for the communicator, written to the
//! abort word of every FIFO of the communicator so producers stop waiting and every proxy stops
//! consuming, told to the peers, and returned by `mscclppProxyStop`.
//!
//! Files: this one holds the communicator's abort (`Sticky`); `conn.rs` is a connection's state and its direct
//! paths (a signal stored into the peer's epoch block, a small put written into its ring of
//! inline puts), `work.rs` one FIFO's consumer (a `service` round, trigger checks and dispatch,
//! the wait for inline puts to be applied, the peer watch), `assist.rs` lets host threads do
//! that work, `thread.rs` is the proxy thread (launch, stop, idle policy), `device_wait.rs`
//! watches the kernels' wait record (a WARN when a wait lasts, the failure when it expired),
//! `pending.rs` is what a blocked waiter waits for, and `hang.rs` the requests for a hang
//! report made below the layer that writes it.

mod assist;
mod conn;
mod device_wait;
mod hang;
mod keeper;
mod pending;
#[cfg(test)]
mod tests;
mod thread;
mod work;

pub use conn::{DirectEpoch, ProxyConn, WAIT_FOR_ROOM_ABOVE};
pub use hang::{request_hang_report, set_reporter_wake, take_hang_requests, wake_reporter};
pub use keeper::{keep_serving, Keeper};
pub use pending::{PendingWait, WaitOp};
pub use thread::{launch, Running};
pub use work::{ProxyWork, SharedEndpoint, SharedWork};

use crate::abi::mscclppResult_t;
use crate::bootstrap::Bootstrap;
use crate::error::Error;
use crate::fifo::AbortWord;
use crate::sync::lock;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

/// The communicator's abort: its first error (sticky, kept until the communicator is
/// destroyed) and what an abort reaches, which is the abort word of every FIFO of the
/// communicator (every transport) and, for an error, the peers. Shared by the communicator,
/// its proxies and the C API's handle (`mscclppCommGetAsyncError`).
///
/// Two ways to raise the abort words:
/// - [`Sticky::abort`]: an error. Stored once, every FIFO's word raised with its code, every
///   proxy stops consuming at its next round, transport waits end (`cuts_waits`), and the
///   peers learn it as they learn a lost peer (the bootstrap's `Abort`), unless the
///   communicator is being stopped or destroyed by its user.
/// - [`Sticky::release`]: `mscclppProxyStop` or `mscclppCommDestroy` (no error). The words
///   say `mscclppInvalidUsage`; whatever spins on a FIFO returns, proxies retire what is
///   pushed afterwards without executing it, and `mscclppProxyLaunch` clears the words again
///   ([`Sticky::rearm`]).
pub struct Sticky {
    first: Mutex<Option<(mscclppResult_t, String)>>,
    /// Set (Release) once `first` is: the proxies' per-round look (Acquire) is one load.
    failed: AtomicBool,
    /// `NONE`, `RELEASED` or `CUT` (see `release`). Changed under `targets`' lock, so Relaxed
    /// everywhere: readers outside it (`cuts_waits`, polled by transport waits) take it as a
    /// hint, and a wait that misses it ends at its own bound; what producers act on is the
    /// abort words.
    released: AtomicU8,
    targets: Mutex<Targets>,
}

/// What an abort reaches; emptied by [`Sticky::detach`] before the memory goes.
struct Targets {
    /// The abort word of every FIFO of the communicator.
    words: Vec<AbortWord>,
    /// Told of an error abort (`Bootstrap::abort`), so that peers' proxies fail.
    boot: Option<Arc<Bootstrap>>,
    /// The communicator is being destroyed: its errors are its own, peers see our goodbye.
    closing: bool,
}

const NONE: u8 = 0;
/// The words are raised; transport waits still run to their end (final flushes).
const RELEASED: u8 = 1;
/// As RELEASED, and transport waits end at once (`Endpoint::set_abort_check`).
const CUT: u8 = 2;

impl Sticky {
    /// The abort of a communicator whose bootstrap is `boot`, with no FIFO yet.
    pub fn new(boot: Arc<Bootstrap>) -> Self {
        Sticky {
            first: Mutex::new(None),
            failed: AtomicBool::new(false),
            released: AtomicU8::new(NONE),
            targets: Mutex::new(Targets {
                words: Vec::new(),
                boot: Some(boot),
                closing: false,
            }),
        }
    }

    /// Aborts the communicator with an error: the one call for "this communicator cannot go
    /// on" (a proxy's error, a host thread's error while doing the proxy's work, a proxy that
    /// did not stop, a device wait past its timeout). Records `(code, msg)` unless an earlier
    /// error is stored (said at WARN once), raises the abort word of every FIFO with the
    /// stored code, and tells the peers (each then fails as for a lost peer), unless the
    /// user is stopping or destroying the communicator. Returns the stored code. Callable from
    /// any thread, any number of times; never waits on a proxy.
    pub fn abort(&self, code: mscclppResult_t, msg: String) -> mscclppResult_t {
        let (stored, first) = {
            let mut g = lock(&self.first);
            let first = g.is_none();
            if first {
                crate::warn!("communicator aborted (sticky for this communicator): {msg}");
                *g = Some((code, msg.clone()));
                // Release pairs with the Acquire in `failed`: a proxy that sees the flag finds
                // the error stored.
                self.failed.store(true, Ordering::Release);
            }
            (g.as_ref().map_or(code, |x| x.0), first)
        };
        let boot = {
            let t = lock(&self.targets);
            for w in &t.words {
                w.set(stored);
            }
            let ours = t.closing || self.released.load(Ordering::Relaxed) != NONE;
            t.boot.clone().filter(|_| first && !ours)
        };
        if let Some(b) = boot {
            // Outside the lock: telling the peers takes up to a second when one is slow.
            b.abort(&format!("rank {}: communicator aborted: {msg}", b.rank()));
        }
        stored
    }

    /// `mscclppProxyStop` or destroy: raises every FIFO's abort word (`mscclppInvalidUsage`;
    /// an error's code stays) without recording an error, so that kernels and host threads
    /// spinning on a FIFO return and proxies execute nothing pushed afterwards. `cut`: also
    /// end transport waits at once (a stop past its drain bound).
    pub fn release(&self, cut: bool) {
        let t = lock(&self.targets);
        let level = if cut { CUT } else { RELEASED };
        self.released.fetch_max(level, Ordering::Relaxed);
        if !self.failed() {
            for w in &t.words {
                w.set(mscclppResult_t::mscclppInvalidUsage);
            }
        }
    }

    /// `mscclppProxyLaunch` after a stop: clears every abort word, unless an error is stored
    /// (then false, and the words stay raised).
    pub fn rearm(&self) -> bool {
        let t = lock(&self.targets);
        if self.failed() {
            return false;
        }
        self.released.store(NONE, Ordering::Relaxed);
        for w in &t.words {
            w.clear();
        }
        true
    }

    /// Destroy has begun: later errors are not told to the peers (they see our goodbye).
    pub fn closing(&self) {
        lock(&self.targets).closing = true;
    }

    /// Destroy is about to free the FIFOs: later aborts (an abandoned proxy thread's) touch
    /// neither their words nor the bootstrap.
    pub fn detach(&self) {
        let mut t = lock(&self.targets);
        t.words.clear();
        t.boot = None;
    }

    /// A FIFO of this communicator: its word is raised with the others from now on (at once,
    /// if the communicator is already aborted or released). It must stay valid until
    /// [`Sticky::detach`].
    pub fn add_fifo(&self, w: AbortWord) {
        let mut t = lock(&self.targets);
        if let Some((code, _)) = self.get() {
            w.set(code);
        } else if self.released.load(Ordering::Relaxed) != NONE {
            w.set(mscclppResult_t::mscclppInvalidUsage);
        }
        t.words.push(w);
    }

    /// An error is stored (one atomic load).
    pub fn failed(&self) -> bool {
        // Acquire pairs with the Release in `abort`.
        self.failed.load(Ordering::Acquire)
    }

    /// Transport waits must end now: an error, or a stop past its drain bound.
    pub fn cuts_waits(&self) -> bool {
        self.failed() || self.released.load(Ordering::Relaxed) == CUT
    }

    pub fn get(&self) -> Option<(mscclppResult_t, String)> {
        lock(&self.first).clone()
    }

    /// The stored error as an error to return again (`InternalError` if none is stored).
    pub fn earlier(&self) -> Error {
        let (code, msg) = self.get().unwrap_or((
            mscclppResult_t::mscclppInternalError,
            "the communicator was aborted".into(),
        ));
        Error::Earlier(code, msg)
    }
}
