//! What a waiter is waiting for, in one shape for every kind of waiter (a kernel's `wait()`,
//! `flush()` or full-FIFO `push`, read from the record the device methods keep; a host
//! thread's bounded wait): the hang report (`comm`) combines these across ranks to name a
//! cycle, and a device wait past its timeout is reported with one.

use std::time::Duration;

/// The operation a waiter is blocked in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitOp {
    /// `wait()`: for the peer's signal number `wanted`; `seen` is the count that arrived.
    Wait,
    /// `flush()`: for ticket `wanted` to complete; `seen` is the FIFO's tail.
    Flush,
    /// A push into a full FIFO: for room for ticket `wanted`; `seen` is the FIFO's tail.
    Push,
}

/// One pending wait of this rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingWait {
    /// Index of the connection in the communicator's `mscclppDevConn` array.
    pub conn: usize,
    /// The rank at the other end of that connection.
    pub remote_rank: usize,
    pub op: WaitOp,
    pub wanted: u64,
    pub seen: u64,
    /// Of `seen`, the signals the peer's kernels stored themselves (a kernel's wait on a
    /// connection with P2P's direct path; 0 otherwise): the peer counts only what its proxy
    /// sent (`ProxyConn::signals`), and the hang report adds these to it.
    pub direct: u64,
    /// How long it has waited so far.
    pub waited: Duration,
    /// True for a kernel's wait (read from device-written memory), false for a host thread.
    pub device: bool,
}

impl super::ProxyWork {
    /// Per connection of this FIFO (`ProxyWork::conns`), the signals (Flag triggers) queued
    /// in it that the proxy has not sent yet: with what it sent, what the connection's
    /// producers handed to the proxy (the hang report's `issued` where no host-memory epoch
    /// counts it).
    pub fn queued_signals(&self) -> Vec<u64> {
        let mut n = vec![0; self.conns.len()];
        for w in self.fifo.queued_triggers() {
            if let Ok(t) = crate::fifo::Trigger::decode(w) {
                if t.ty & crate::abi::mscclppFlag != 0 && t.conn_id < n.len() {
                    n[t.conn_id] += 1;
                }
            }
        }
        n
    }

    /// The waits this FIFO's kernels are blocked in, read from the record the device methods
    /// keep (`device_wait.rs`), for the hang report. Here `conn` is the connection's id in this
    /// FIFO (`ProxyWork::conns`); the report maps it to the communicator's index.
    pub fn device_pending_waits(&self) -> Vec<PendingWait> {
        self.pending_wait()
            .into_iter()
            .filter_map(|mut p| {
                p.conn = self.conns.iter().position(|c| c.index == p.conn)?;
                Some(p)
            })
            .collect()
    }
}
