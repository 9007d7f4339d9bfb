//! Requests for a hang report from below the layer that writes it (`comm::hang`): a host
//! thread's wait that timed out (`host::Spin`), a kernel's wait that the proxy found waiting
//! longer than the host wait timeout. Queued here; the reporter thread, which a byte written
//! to its pipe wakes, takes them. The wake is async-signal-safe, so the `SIGUSR1` handler uses
//! it too.

use crate::sync::lock;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;

/// Requests not yet taken: (FIFO head of the communicator's endpoint, why).
static REQUESTS: Mutex<Vec<(usize, String)>> = Mutex::new(Vec::new());
/// Most requests kept while the reporter has not taken them: a report covers every wait of
/// its communicator, so more would only repeat it.
const MAX_REQUESTS: usize = 64;
/// The write end of the reporter's pipe; -1 until it has one. Release in `set_reporter_wake`
/// pairs with the Acquire in `wake_reporter`.
static WAKE: AtomicI32 = AtomicI32::new(-1);

/// Asks for a hang report of the communicator whose FIFO has head `head` (its producer view's
/// `triggerFifoHead`, as an address), saying `why` (`MSCCLPP_HANG_REPORT` decides whether
/// one is written). Never blocks on the report: it is written by the reporter thread.
pub fn request_hang_report(head: usize, why: String) {
    if !crate::config::get().hang_report.on_timeout {
        return;
    }
    {
        let mut q = lock(&REQUESTS);
        if q.len() >= MAX_REQUESTS {
            return;
        }
        q.push((head, why));
    }
    wake_reporter();
}

/// The requests made since the last call (for the reporter).
pub fn take_hang_requests() -> Vec<(usize, String)> {
    std::mem::take(&mut *lock(&REQUESTS))
}

/// Names the descriptor a byte is written to when a report is wanted (the reporter's pipe,
/// non-blocking; it stays open for the process's lifetime).
pub fn set_reporter_wake(fd: i32) {
    WAKE.store(fd, Ordering::Release);
}

/// Wakes the reporter thread. Async-signal-safe: one atomic load and one `write(2)` on a
/// non-blocking pipe (a full pipe already holds a wake-up). Does not preserve `errno`; a
/// signal handler saves it around the call.
pub fn wake_reporter() {
    let fd = WAKE.load(Ordering::Acquire);
    if fd >= 0 {
        // SAFETY: a one-byte write from a live buffer to a descriptor that is never closed.
        let _ = unsafe { libc::write(fd, [1u8].as_ptr().cast(), 1) };
    }
}
