//! One connection's state on its proxy, and its direct paths: a Flag stored straight into the
//! peer's mapped epoch block, and a small put written into the ring in that block
//! (`transport::inbox`), instead of going through the endpoint.

use crate::transport::inbox::{Inbox, Outbox, Put};
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
/// room now. A full ring is not waited for: through the endpoint the put is one write with its
/// signal riding on it (`net/order.rs`), which costs no round trip. The caller holds the
/// proxy's lock with an empty FIFO, so no trigger of this connection waits either. Returns
/// whether it did; false leaves everything as it was, and the caller pushes the trigger (whose
/// checks report a bad range).
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
    match out.put(src_off, dst_off, size) {
        Put::Written => {}
        Put::NoRoom => {
            c.inline.ring_full += 1;
            return false;
        }
        Put::Refused => return false,
    }
    c.inline.inline += 1;
    if signal {
        // Cannot refuse: it has a direct epoch and nothing undelivered (checked above).
        let stored = direct_flag(c);
        debug_assert!(stored);
    }
    true
}

/// Puts small enough to go inline on a connection with a ring (`direct_put`): how many did, how
/// many found the ring full and took the endpoint (the peer had not applied enough of the
/// earlier ones), and how many came after a write through the endpoint since the last flush
/// (so could not overtake it).
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::SharedBlock;
    use crate::transport::inbox::BLOCK_BYTES;

    const SIZE: u64 = 16 << 10;

    /// A connection with both direct paths into a fresh peer block, and the peer's side of
    /// that block: its ring (applying into `dst`) and its signal count.
    fn conn(src: &[u8], dst: &mut [u8]) -> (ProxyConn, Inbox, Arc<SharedBlock>) {
        let block = Arc::new(SharedBlock::create(BLOCK_BYTES).unwrap());
        let c = ProxyConn {
            index: 0,
            remote_rank: 1,
            peer: 0,
            src: 0,
            local_size: src.len() as u64,
            dst: 0,
            remote_size: dst.len() as u64,
            remote_epoch: 0,
            signals: 0,
            direct: Some(DirectEpoch(block.clone())),
            outbox: Some(Outbox::new(block.clone(), src.as_ptr() as u64, SIZE).unwrap()),
            inline: InlineStats::default(),
            inbox: None,
            undelivered: false,
            regain_direct: false,
        };
        // SAFETY: `dst` outlives the inbox in each test.
        let inbox = unsafe { Inbox::new(block.clone(), dst.as_mut_ptr() as u64, SIZE, 1) };
        (c, inbox.unwrap(), block)
    }

    fn count(block: &SharedBlock) -> u64 {
        // SAFETY: offset 8 of a live block of BLOCK_BYTES, aligned.
        unsafe { AtomicU64::from_ptr(block.ptr().add(8).cast()) }.load(Ordering::Acquire)
    }

    #[test]
    fn a_put_that_finds_the_ring_full_changes_nothing_and_takes_the_endpoint() {
        let src: Vec<u8> = (0..SIZE).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; SIZE as usize];
        let (mut c, peer, block) = conn(&src, &mut dst);
        // The ring holds two records of the largest size.
        assert!(direct_put(&mut c, 0, 0, SIZE, true));
        assert!(direct_put(&mut c, 0, 0, SIZE, true));
        assert!(!direct_put(&mut c, 0, 0, SIZE, true), "a third fitted");
        assert_eq!((c.inline.inline, c.inline.ring_full, c.signals), (2, 1, 2));
        assert_eq!(count(&block), 2, "no signal for a put that was not written");
        // Only the two records are there, each the whole put.
        peer.drain().unwrap();
        assert_eq!(dst, src);
        assert!(direct_put(&mut c, 0, 0, SIZE, false), "room again");
        // After a write through the endpoint, nothing goes inline until a flush.
        c.undelivered = true;
        assert!(!direct_put(&mut c, 0, 0, 8, true));
        assert_eq!((c.inline.after_endpoint, c.signals), (1, 2));
        flushed(std::slice::from_mut(&mut c), 0);
        assert!(direct_put(&mut c, 0, 0, 8, true));
        assert_eq!(count(&block), 3);
    }
}
