//! One connection's state on its proxy, and its direct paths: a Flag stored straight into the
//! peer's mapped epoch block, and a small put written into the ring in that block
//! (`transport::inbox`), instead of going through the endpoint.

use crate::transport::inbox::{Inbox, Outbox};
use crate::transport::{MrId, PeerId, RemoteId};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Everything the proxy needs to act on one connection's triggers.
#[derive(Clone, Debug)]
pub struct ProxyConn {
    /// Index of the connection in the communicator's `mscclppDevConn` array (what errors and
    /// the hang report call the connection; its index on this proxy is its place in `conns`).
    pub index: usize,
    pub remote_rank: usize,
    pub peer: PeerId,
    pub src: MrId,
    pub local_size: u64,
    pub dst: RemoteId,
    pub remote_size: u64,
    /// The peer's epoch block; the signal count goes to offset 8 (`proxy`).
    pub remote_epoch: RemoteId,
    /// Flags this proxy sent so far: the value the next Flag writes into the peer's `proxy`
    /// word is this + 1. Counting here rather than reading the producer's `device` epoch keeps
    /// the value in FIFO order with the data. Signals that P2P kernels store themselves (the
    /// direct path) are counted apart, in the peer's word `MSCCLPP_EPOCH_DIRECT`, and the
    /// peer's wait() adds the two.
    pub signals: u64,
    /// The peer's epoch block, mapped (SHM over host memory): a Flag may be a plain store
    /// (`direct_flag`).
    pub direct: Option<DirectEpoch>,
    /// The ring in the peer's epoch block (SHM over host memory): small puts may go inline,
    /// written by the calling host thread (`direct_put`).
    pub outbox: Option<Outbox>,
    /// What became of the puts that could have gone inline (`direct_put`), for the INFO line
    /// at the stop.
    pub inline: InlineStats,
    /// The ring in our epoch block, which the peer writes small puts into: applied to our
    /// buffer by our waiters and by this proxy (`ProxyWork::drain_inboxes`).
    pub inbox: Option<Arc<Inbox>>,
    /// A write on this connection went through the endpoint since its last flush.
    pub undelivered: bool,
    /// A lone Flag of this connection went through the endpoint though it has a direct path
    /// (something written before it may still be on its way, `undelivered`): once the FIFO is
    /// empty the proxy flushes the peer (`ProxyWork::regain_direct`), or every later signal
    /// would take the endpoint too until the user's next flush, which a ping-pong of
    /// signal/wait never makes (test `e2e_host::signals_regain_direct_shm`).
    pub regain_direct: bool,
}

/// The peer's epoch block mapped into this process (SHM connections over host memory, see
/// `mem::SharedBlock`).
#[derive(Clone)]
pub struct DirectEpoch(pub Arc<crate::mem::SharedBlock>);

impl std::fmt::Debug for DirectEpoch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DirectEpoch({})", self.0.name())
    }
}

/// Delivers connection `c`'s next Flag as a store into the peer's mapped epoch block, if it has
/// one and nothing written on the connection since the last flush may still be on its way (a
/// store could overtake it: the data, or an earlier flag and the count would step back).
/// Returns whether it did; then the count went up by one.
pub(super) fn direct_flag(c: &mut ProxyConn) -> bool {
    let Some(d) = &c.direct else { return false };
    if c.undelivered {
        return false;
    }
    c.signals += 1;
    // SAFETY: the peer's epoch block is mapped for the connection's lifetime (`d` holds it),
    // at least 32 bytes; the signal count (`proxy`) is the aligned u64 at offset 8. Release
    // pairs with the Acquire load of the peer's wait().
    unsafe { AtomicU64::from_ptr(d.0.ptr().add(8).cast::<u64>()) }
        .store(c.signals, Ordering::Release);
    true
}

/// Writes a put of connection `c` into the peer's ring, then, if `signal`, stores its Flag
/// (`direct_flag`): only where the connection has both paths, nothing written on it through the
/// endpoint may still be on its way (the receiver could apply the record first, and the older
/// write land over it), the put is small and within both registered buffers, and the ring has
/// room. The caller holds the proxy's lock with an empty FIFO, so no trigger of this connection
/// waits either. Returns whether it did; false leaves everything as it was, and the caller
/// pushes the trigger (whose checks report a bad range).
pub(super) fn direct_put(
    c: &mut ProxyConn,
    src_off: u64,
    dst_off: u64,
    size: u64,
    signal: bool,
) -> bool {
    let (Some(_), Some(out)) = (&c.direct, &mut c.outbox) else {
        return false;
    };
    let fits = |off: u64, limit: u64| off.checked_add(size).is_some_and(|end| end <= limit);
    if size == 0
        || size > out.max_bytes
        || !fits(src_off, c.local_size)
        || !fits(dst_off, c.remote_size)
    {
        return false;
    }
    if c.undelivered {
        c.inline.after_endpoint += 1;
        return false;
    }
    if !out.put(src_off, dst_off, size) {
        c.inline.ring_full += 1;
        return false;
    }
    c.inline.inline += 1;
    if signal {
        // Cannot refuse: it has a direct epoch and nothing undelivered (checked above).
        let stored = direct_flag(c);
        debug_assert!(stored);
    }
    true
}

/// Puts small enough to go inline on a connection with a ring (`direct_put`): how many did,
/// how many found the ring full (the peer had not applied enough of the earlier ones), and how
/// many came after a write through the endpoint since the last flush (so could not overtake
/// it).
#[derive(Clone, Copy, Debug, Default)]
pub struct InlineStats {
    pub inline: u64,
    pub ring_full: u64,
    pub after_endpoint: u64,
}

/// After a flush of `peer`: everything written to it has arrived, on every connection to it.
pub(super) fn flushed(conns: &mut [ProxyConn], peer: PeerId) {
    for x in conns.iter_mut().filter(|x| x.peer == peer) {
        x.undelivered = false;
        x.regain_direct = false;
    }
}
