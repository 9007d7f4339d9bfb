//! The host threads' pending waits, for the hang report (`comm::hang`): a wait lists itself
//! once it has outlasted its first fast polls (`Spin`), so a wait that ends at once costs
//! nothing here, and leaves when it ends. One that ends in an error (timed out, aborted) stays
//! listed, marked, for [`KEEP_ENDED`]: a report asked for a moment later (its own timeout's,
//! or a peer's whose wait timed out at the same time) still sees the dependency.

use crate::proxy::WaitOp;
use crate::sync::lock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How a listed wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    TimedOut,
    Aborted,
}

/// One host thread's wait on a host FIFO or epoch.
#[derive(Clone, Debug)]
pub struct HostWait {
    /// The FIFO's head (its producer view's `triggerFifoHead`): which endpoint of which
    /// communicator.
    pub head: usize,
    /// The connection's id in that FIFO (`connId`).
    pub conn_id: usize,
    pub op: WaitOp,
    /// `Wait`: the signal count wanted; `Flush`: the ticket to retire; `Push`: the ticket that
    /// needs room.
    pub wanted: u64,
    pub since: Instant,
    /// How and when it ended, for a wait kept after an error.
    pub ended: Option<(Ended, Instant)>,
}

/// How long a wait that ended in an error stays listed.
pub const KEEP_ENDED: Duration = Duration::from_secs(30);

/// Listed waits, by id. A plain list: it holds the waits of stuck threads, a handful.
static WAITS: Mutex<Vec<(u64, HostWait)>> = Mutex::new(Vec::new());
/// Relaxed: ids only have to be unique.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Lists a wait; returns its id. Waits of the same thread on the same connection that ended
/// in an error are superseded (a retry), and long-ended ones go.
pub(super) fn add(w: HostWait) -> u64 {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let mut l = lock(&WAITS);
    let now = Instant::now();
    l.retain(|(_, x)| match x.ended {
        None => true,
        Some((_, at)) => {
            !(x.head == w.head && x.conn_id == w.conn_id && x.op == w.op)
                && now.duration_since(at) < KEEP_ENDED
        }
    });
    l.push((id, w));
    id
}

/// Wait `id` ended: gone from the list, or, if it ended in an error, kept and marked.
pub(super) fn end(id: u64, how: Option<Ended>) {
    let mut l = lock(&WAITS);
    let Some(i) = l.iter().position(|(x, _)| *x == id) else {
        return;
    };
    match how {
        None => {
            l.swap_remove(i);
        }
        Some(e) => l[i].1.ended = Some((e, Instant::now())),
    }
}

/// The listed waits on the FIFOs whose heads are `heads` (waits that ended in an error within
/// [`KEEP_ENDED`] included).
pub fn waits_on(heads: &[usize]) -> Vec<HostWait> {
    let now = Instant::now();
    lock(&WAITS)
        .iter()
        .map(|(_, w)| w)
        .filter(|w| heads.contains(&w.head))
        .filter(|w| {
            w.ended
                .is_none_or(|(_, at)| now.duration_since(at) < KEEP_ENDED)
        })
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(head: usize, conn_id: usize) -> HostWait {
        HostWait {
            head,
            conn_id,
            op: WaitOp::Wait,
            wanted: 5,
            since: Instant::now(),
            ended: None,
        }
    }

    #[test]
    fn listed_until_ended_kept_after_an_error_until_retried() {
        // Heads no other test uses (the list is process-wide).
        let (h, other) = (0xdead_0001, 0xdead_0002);
        let a = add(w(h, 0));
        let b = add(w(h, 1));
        add(w(other, 0));
        assert_eq!(waits_on(&[h]).len(), 2);
        end(a, None);
        let l = waits_on(&[h]);
        assert_eq!((l.len(), l[0].conn_id), (1, 1));
        end(b, Some(Ended::TimedOut));
        let l = waits_on(&[h]);
        assert_eq!(l.len(), 1);
        assert!(matches!(l[0].ended, Some((Ended::TimedOut, _))));
        // A retry on that connection supersedes the wait that timed out.
        let c = add(w(h, 1));
        let l = waits_on(&[h]);
        assert_eq!(l.len(), 1);
        assert!(l[0].ended.is_none());
        end(c, None);
        assert!(waits_on(&[h]).is_empty());
    }
}
