//! Proxy threads: one per endpoint. Each polls its FIFO, checks every trigger against the
//! registered sizes, dispatches to its transport, retires the trigger, and keeps the transport
//! progressing when idle. A failure is sticky: stored once for the communicator, written to the
//! FIFO's abort word so producers stop waiting, and returned by `mscclppProxyStop`.
//!
//! Files: this one holds the sticky error; `conn.rs` is a connection's state and its direct
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
mod pending;
#[cfg(test)]
mod tests;
mod thread;
mod work;

pub use conn::{DirectEpoch, ProxyConn};
pub use hang::{request_hang_report, set_reporter_wake, take_hang_requests, wake_reporter};
pub use pending::{PendingWait, WaitOp};
pub use thread::{launch, Running};
pub use work::{ProxyWork, SharedEndpoint, SharedWork};

use crate::abi::mscclppResult_t;
use crate::sync::lock;
use std::sync::Mutex;

/// The first error of a communicator's background work, kept until the comm is destroyed.
#[derive(Default)]
pub struct Sticky {
    first: Mutex<Option<(mscclppResult_t, String)>>,
}

impl Sticky {
    /// Records `e` unless an earlier error is already stored; returns the stored code.
    pub fn set(&self, code: mscclppResult_t, msg: String) -> mscclppResult_t {
        let mut g = lock(&self.first);
        if g.is_none() {
            crate::warn!("proxy error (sticky for this communicator): {msg}");
            *g = Some((code, msg));
        }
        g.as_ref().map(|x| x.0).unwrap_or(code)
    }
    pub fn get(&self) -> Option<(mscclppResult_t, String)> {
        lock(&self.first).clone()
    }
}
