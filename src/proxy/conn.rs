//! One connection's state on its proxy, and its direct paths: a Flag stored straight into the
//! peer's mapped epoch block, and a small put written into the ring in that block
//! (`transport::inbox`), instead of going through the endpoint.

use crate::sync::{Backoff, Nap, Policy};
use crate::transport::inbox::{Inbox, Outbox, Put};
use crate::transport::{MrId, PeerId, RemoteId};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

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
    /// An inline put larger than this that finds the peer's ring full waits for room
    /// (`direct_put`; `WAIT_FOR_ROOM_ABOVE`). A smaller one takes the endpoint at once.
    /// `u64::MAX` on a tight host (`sync::host_is_tight`, as it stood when the connection was
    /// set up): no put waits there.
    pub wait_for_room_above: u64,
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
/// room, or, for a put past `wait_for_room_above`, gets it within `room_wait` (`ROOM_WAIT`;
/// meanwhile it applies the rings peers write into this proxy, this connection's and the
/// others', which their own waits for room may need: `go_on` applies the others', and ends
/// the wait with false, at an abort or a malformed ring). The caller holds the proxy's lock
/// with an empty FIFO, so no trigger of this connection waits either. Returns whether it did;
/// false leaves everything as it was, and the caller pushes the trigger (whose checks report
/// a bad range).
pub(super) fn direct_put(
    c: &mut ProxyConn,
    src_off: u64,
    dst_off: u64,
    size: u64,
    signal: bool,
    room_wait: Duration,
    mut go_on: impl FnMut() -> bool,
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
    // The wait for room, from the first time the ring had none (the clock is read only then).
    let mut room: Option<Backoff> = None;
    // Ends: the record is written, the receiver refuses it, `go_on` says no (an abort; a
    // malformed ring, which the proxy's round reports), or `room_wait` passed.
    let written = loop {
        match out.put(src_off, dst_off, size) {
            Put::Written => break true,
            Put::Refused => {
                c.inline.refused += 1;
                break false;
            }
            Put::NoRoom
                if size <= c.wait_for_room_above
                    || room.as_ref().is_some_and(Backoff::expired)
                    || !drain_ours(&c.inbox, &mut go_on) =>
            {
                c.inline.ring_full += 1;
                break false;
            }
            Put::NoRoom => {
                let r = room.get_or_insert_with(|| {
                    out.want_room(true);
                    // Spins first (a record applied by another core), then yields for the
                    // rest of the wait: on a crowded host the receiver needs a core to apply
                    // it.
                    let policy = Policy {
                        spins: 64,
                        yield_for: room_wait,
                        nap: Nap::Yield,
                    };
                    Backoff::new(policy, room_wait)
                });
                // Acquire in `put` pairs with the receiver's Release of its tail.
                r.pause();
            }
        }
    };
    if room.is_some() {
        out.want_room(false);
    }
    if !written {
        return false;
    }
    c.inline.inline += 1;
    c.inline.waited += u64::from(room.is_some());
    if signal {
        // Cannot refuse: it has a direct epoch and nothing undelivered (checked above).
        let stored = direct_flag(c);
        debug_assert!(stored);
    }
    true
}

/// Applies what peers wrote into this connection's ring (`inbox`), then asks `go_on` (which
/// applies the other connections' rings). False if the ring is malformed (the proxy's next
/// round reports it) or `go_on` says so.
fn drain_ours(inbox: &Option<Arc<Inbox>>, go_on: &mut impl FnMut() -> bool) -> bool {
    inbox.as_deref().is_none_or(|i| i.drain_if_free().is_ok()) && go_on()
}

/// Inline puts larger than this wait for room in the peer's ring (`direct_put`), where the host
/// has two cores per rank. Through the endpoint, every later put of the connection takes it too
/// until the user's next flush (`undelivered`), and for such puts the ring is the faster path,
/// even with their signals riding on their writes (16 KiB streams, bench/RESULTS.md session
/// 21). Smaller ones take the endpoint at once: for a 4 KiB stream that is the faster path (one
/// copy, on the proxy thread).
pub const WAIT_FOR_ROOM_ABOVE: u64 = 4096;

/// How long a put that found the peer's ring full waits for room before it takes the endpoint
/// (only a put past `ProxyConn::wait_for_room_above`). A receiver in `wait()`, or its proxy,
/// applies a record of the largest size within microseconds. Against a receiver that applies
/// nothing the wait costs this once per flush. The waiting thread holds the proxy's lock, so the
/// proxy thread's rounds wait too, at most this long per put.
pub(super) const ROOM_WAIT: Duration = Duration::from_micros(100);

/// Puts small enough to go inline on a connection with a ring (`direct_put`): how many did (and
/// how many of those waited for room first), how many found the ring full and took the
/// endpoint (the peer had not applied enough of the earlier ones, within `ROOM_WAIT` where the
/// put may wait), how many came after a write through the endpoint since the last flush (so
/// could not overtake it), and how many the receiver refused (its communicator was gone).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InlineStats {
    pub inline: u64,
    pub waited: u64,
    pub ring_full: u64,
    pub after_endpoint: u64,
    pub refused: u64,
}

impl std::ops::Add for InlineStats {
    type Output = InlineStats;
    fn add(self, o: InlineStats) -> InlineStats {
        InlineStats {
            inline: self.inline + o.inline,
            waited: self.waited + o.waited,
            ring_full: self.ring_full + o.ring_full,
            after_endpoint: self.after_endpoint + o.after_endpoint,
            refused: self.refused + o.refused,
        }
    }
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
    /// A wait for room that no slow machine (valgrind) outlasts between two polls.
    const LONG: Duration = Duration::from_secs(60);

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
            wait_for_room_above: WAIT_FOR_ROOM_ABOVE,
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
    fn a_put_that_finds_the_ring_full_waits_for_the_receiver_to_make_room() {
        let src: Vec<u8> = (0..SIZE).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; SIZE as usize];
        let (mut c, peer, block) = conn(&src, &mut dst);
        // The ring holds two records of the largest size.
        assert!(direct_put(&mut c, 0, 0, SIZE, true, ROOM_WAIT, || true));
        assert!(direct_put(&mut c, 0, 0, SIZE, true, ROOM_WAIT, || true));
        assert_eq!(c.inline.waited, 0);
        // The third waits; the receiver (here, called from the wait's drain of our own rings)
        // applies the first two on the wait's third poll.
        let mut polls = 0;
        assert!(!peer.room_wanted());
        let put = direct_put(&mut c, 0, 0, SIZE, true, LONG, || {
            polls += 1;
            // The receiver's waiters apply records as they come once they see this.
            assert!(polls == 1 || peer.room_wanted(), "poll {polls}");
            if polls == 3 {
                peer.drain().unwrap();
            }
            true
        });
        assert!(put, "the put went through the endpoint after all");
        assert_eq!(polls, 3);
        assert!(!peer.room_wanted(), "still asking for room after the put");
        assert_eq!(
            (c.inline.inline, c.inline.waited, c.inline.ring_full),
            (3, 1, 0)
        );
        assert_eq!(count(&block), 3, "its signal was stored after the record");
        peer.drain().unwrap();
        assert_eq!(dst, src);
    }

    #[test]
    fn a_put_that_never_finds_room_changes_nothing_and_takes_the_endpoint() {
        let src = vec![7u8; SIZE as usize];
        let mut dst = vec![0u8; SIZE as usize];
        let (mut c, peer, block) = conn(&src, &mut dst);
        assert!(direct_put(&mut c, 0, 0, SIZE, true, ROOM_WAIT, || true));
        assert!(direct_put(&mut c, 0, 0, SIZE, true, ROOM_WAIT, || true));
        let t0 = std::time::Instant::now();
        assert!(!direct_put(&mut c, 0, 0, SIZE, true, ROOM_WAIT, || true));
        assert!(t0.elapsed() >= ROOM_WAIT, "it gave up before its wait");
        // An abort, or a ring of ours that is malformed, ends the wait at once.
        assert!(!direct_put(&mut c, 0, 0, SIZE, true, ROOM_WAIT, || false));
        assert_eq!(
            (
                c.inline.inline,
                c.inline.waited,
                c.inline.ring_full,
                c.signals
            ),
            (2, 0, 2, 2),
            "a put that waited and then took the endpoint counts as found full, not waited"
        );
        assert_eq!(count(&block), 2, "no signal for a put that was not written");
        // Only the two records are there.
        dst.fill(0);
        peer.drain().unwrap();
        assert!(dst.iter().all(|b| *b == 7));
        assert!(
            direct_put(&mut c, 0, 0, SIZE, false, ROOM_WAIT, || true),
            "room again"
        );
        // A receiver that is gone refuses every put; each is counted, and goes nowhere.
        peer.close().unwrap();
        assert!(!direct_put(&mut c, 0, 0, 8, true, ROOM_WAIT, || true));
        assert_eq!((c.inline.refused, c.signals), (1, 2));
    }

    #[test]
    fn a_put_within_the_bound_takes_the_endpoint_at_once_when_the_ring_is_full() {
        let src = vec![7u8; SIZE as usize];
        let mut dst = vec![0u8; SIZE as usize];
        let (mut c, _peer, _block) = conn(&src, &mut dst);
        c.wait_for_room_above = SIZE;
        assert!(direct_put(&mut c, 0, 0, SIZE, true, ROOM_WAIT, || true));
        assert!(direct_put(&mut c, 0, 0, SIZE, true, ROOM_WAIT, || true));
        let mut polls = 0;
        let put = direct_put(&mut c, 0, 0, SIZE, true, LONG, || {
            polls += 1;
            true
        });
        assert!(!put && polls == 0, "it waited for room");
        assert_eq!((c.inline.waited, c.inline.ring_full), (0, 1));
    }
}
