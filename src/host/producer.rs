//! The host producer: pushes triggers into a host-memory FIFO and waits for their retirement,
//! as the kernel methods in `include/mscclpp/fifo_methods.inc` do on the GPU.

use super::Spin;
use crate::abi::mscclppConcurrentFifo;
use crate::error::Result;
use crate::fifo::{assist_after_push, SIZE};
use crate::proxy::WaitOp;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Host producer: pushes one trigger, returns its ticket. The conn's FIFO must be in host memory.
/// On an error (wait timeout, abort) nothing was queued: the ticket taken is abandoned, and the
/// consumer skips it (`fifo::abandon`).
///
/// # Safety
/// `fifo` must be the producer view of a live host-memory FIFO.
pub unsafe fn host_push(fifo: &mscclppConcurrentFifo, w: [u64; 2]) -> Result<u64> {
    // SAFETY: the caller's promise, passed on.
    unsafe { push_within(fifo, w, crate::config::wait_timeout()) }
}

/// [`host_push`] with its wait bounded by `limit`.
///
/// # Safety
/// As for [`host_push`].
unsafe fn push_within(fifo: &mscclppConcurrentFifo, w: [u64; 2], limit: Duration) -> Result<u64> {
    debug_assert!(w[0] != 0 && w[1] != 0);
    // After the abort nothing is queued (no ticket taken): a stop or destroy released the FIFO.
    super::aborted(fifo, "push")?;
    // SAFETY: the caller passes a live host FIFO's view: head and tail are its aligned,
    // live control words, touched only atomically.
    let (head, tail) = unsafe {
        (
            AtomicU64::from_ptr(fifo.triggerFifoHead),
            AtomicU64::from_ptr(fifo.triggerFifoTail),
        )
    };
    // The ticket only has to be unique; ordering comes from the slot words.
    let h = head.fetch_add(1, Ordering::Relaxed);
    let mut spin = Spin::new(fifo, limit, WaitOp::Push, h);
    // SAFETY: slot h % SIZE of the live ring (SIZE slots of two aligned u64 words), touched
    // only atomically by producers and the proxy.
    let (w0, w1) = unsafe {
        let p = fifo.triggerFifo.add((h % SIZE) as usize) as *mut u64;
        (AtomicU64::from_ptr(p), AtomicU64::from_ptr(p.add(1)))
    };
    if let Err(e) = wait_for_slot(&mut spin, h, tail, w0) {
        // Giving up after the ticket was taken: this thread never writes slot h, so the
        // consumer may retire it as a no-op once its tail gets there (without this, it would
        // stop at the empty slot forever and every later flush would time out).
        crate::fifo::abandon(fifo.triggerFifoHead, h);
        return Err(e);
    }
    w1.store(w[1], Ordering::Relaxed);
    // Release pairs with the proxy's Acquire load of word0 in `Fifo::peek`.
    w0.store(w[0], Ordering::Release);
    // Execute it now, on this core, unless a consumer is already at work.
    assist_after_push(fifo.triggerFifoHead);
    Ok(h)
}

/// Waits until ticket `h` may write its slot (`w0` its word0): the proxy has retired ticket
/// h - SIZE (`tail`) and the slot is clear. An error (abort, deadline) leaves the slot unwritten.
fn wait_for_slot(spin: &mut Spin, h: u64, tail: &AtomicU64, w0: &AtomicU64) -> Result<()> {
    // Acquire pairs with the proxy's Release publication of the tail; ends when the proxy has
    // retired ticket h - SIZE, on abort, or at the deadline.
    while h >= SIZE + tail.load(Ordering::Acquire) {
        spin.step("waiting for room in the proxy FIFO (nothing was queued)")?;
    }
    // Acquire pairs with the proxy's Release zeroing in `Fifo::pop`; ends like the loop above.
    while w0.load(Ordering::Acquire) != 0 {
        spin.step("waiting for a free FIFO slot (nothing was queued)")?;
    }
    Ok(())
}

/// Whether the proxy has retired every trigger pushed so far: the slot of the last ticket
/// taken is clear (tickets retire in order, so then all are). A hint, for skipping the direct
/// paths cheaply while the proxy is busy; the proxy's lock decides (`Assist`). A push in
/// progress on another thread may be missed, as the lock's check may miss it too.
///
/// # Safety
/// As for [`host_push`].
pub unsafe fn host_fifo_drained(fifo: &mscclppConcurrentFifo) -> bool {
    // SAFETY: the live FIFO's head and the word0 of its last ticket's slot, touched only
    // atomically.
    let h = unsafe { AtomicU64::from_ptr(fifo.triggerFifoHead) }.load(Ordering::Relaxed);
    if h == 0 {
        return true;
    }
    // SAFETY: as above; (h - 1) % SIZE is a slot of the ring.
    let w0 =
        unsafe { AtomicU64::from_ptr(fifo.triggerFifo.add(((h - 1) % SIZE) as usize) as *mut u64) };
    // Acquire pairs with `Fifo::pop`'s Release zeroing.
    w0.load(Ordering::Acquire) == 0
}

/// Host producer: waits until the proxy has retired ticket `h` (its slot zeroed or the tail
/// past it), on abort or deadline an error.
///
/// # Safety
/// As for [`host_push`].
pub unsafe fn host_wait_retired(fifo: &mscclppConcurrentFifo, h: u64) -> Result<()> {
    // SAFETY: as in `host_push`: the live FIFO's tail and word0 of ticket h's slot.
    let (tail, w0) = unsafe {
        (
            AtomicU64::from_ptr(fifo.triggerFifoTail),
            AtomicU64::from_ptr(fifo.triggerFifo.add((h % SIZE) as usize) as *mut u64),
        )
    };
    let mut spin = Spin::new(fifo, crate::config::wait_timeout(), WaitOp::Flush, h);
    // Both Acquire loads pair with `Fifo::pop`'s Release stores. Ends when the slot clears or
    // the tail passes h; the slot can't be refilled before the tail passes h (room check).
    while w0.load(Ordering::Acquire) != 0 && tail.load(Ordering::Acquire) <= h {
        spin.step("flush: waiting for the proxy to complete the Sync")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::*;
    use crate::error::Error;
    use crate::fifo::{Fifo, Trigger};
    use std::time::Duration;

    #[test]
    fn push_pop_in_order_and_wraps() {
        let mut f = Fifo::new_host().unwrap();
        let view = f.producer_view(3);
        for round in 0..3 * SIZE {
            let t = Trigger {
                ty: mscclppData,
                dst_off: round,
                src_off: 0,
                size: 1 + round,
                conn_id: 3,
            };
            // SAFETY: `view` is the producer view of `f`, a live host FIFO.
            let h = unsafe { host_push(&view, t.encode()) }.unwrap();
            assert_eq!(h, round);
            let got = Trigger::decode(f.peek().unwrap()).unwrap();
            assert_eq!(got, t);
            f.pop(false);
            assert!(f.is_empty());
        }
    }

    fn flag(conn_id: usize, dst_off: u64) -> Trigger {
        Trigger {
            ty: mscclppFlag,
            dst_off,
            src_off: 0,
            size: 1,
            conn_id,
        }
    }

    /// A push that times out waiting for room leaves no hole: the consumer executes every
    /// trigger before it, retires its ticket without executing anything, and goes on to the
    /// next push's trigger (before, it stopped at the empty slot forever).
    #[test]
    fn a_push_that_gives_up_leaves_no_hole() {
        let mut f = Fifo::new_host().unwrap();
        let view = f.producer_view(0);
        for i in 0..SIZE {
            // SAFETY: `view` is the producer view of `f`, a live host FIFO.
            unsafe { host_push(&view, flag(0, i).encode()) }.unwrap();
        }
        let short = Duration::from_millis(50);
        for _ in 0..2 {
            // SAFETY: as above.
            let r = unsafe { push_within(&view, flag(0, 999).encode(), short) };
            assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        }
        for i in 0..SIZE {
            let t = Trigger::decode(f.peek().expect("a queued trigger")).unwrap();
            assert_eq!(t.dst_off, i);
            f.pop(false);
        }
        assert!(f.is_empty(), "the abandoned tickets execute nothing");
        assert_eq!(f.ticket(), SIZE + 2, "both abandoned tickets were retired");
        // SAFETY: as above.
        let h = unsafe { host_push(&view, flag(0, 7).encode()) }.unwrap();
        assert_eq!(h, SIZE + 2);
        assert_eq!(Trigger::decode(f.peek().unwrap()).unwrap().dst_off, 7);
        f.pop(false);
        assert!(f.all_retired());
    }

    /// A trigger taken back before the consumer reached it is never executed, and the ones
    /// around it are.
    #[test]
    fn a_withdrawn_trigger_is_skipped() {
        let mut f = Fifo::new_host().unwrap();
        let view = f.producer_view(0);
        let mut tickets = Vec::new();
        for i in 0..3 {
            // SAFETY: `view` is the producer view of `f`, a live host FIFO.
            tickets.push(unsafe { host_push(&view, flag(0, i).encode()) }.unwrap());
        }
        assert!(f.withdraw(tickets[1]));
        assert_eq!(Trigger::decode(f.peek().unwrap()).unwrap().dst_off, 0);
        f.pop(false);
        assert!(
            !f.withdraw(tickets[0]),
            "a retired trigger cannot be taken back"
        );
        assert_eq!(Trigger::decode(f.peek().unwrap()).unwrap().dst_off, 2);
        f.pop(false);
        assert!(f.is_empty() && f.all_retired());
    }

    /// A FIFO view is accepted only whole and only while its FIFO lives, even when a newer
    /// FIFO is made right after the old one went: before, the new FIFO got the freed head in
    /// 16 of 20 such rounds and the stale view was accepted.
    #[test]
    fn a_stale_or_mixed_view_is_not_a_host_fifo() {
        let b = Fifo::new_host().unwrap();
        let vb = b.producer_view(0);
        for _ in 0..8 {
            let a = Fifo::new_host().unwrap();
            let va = a.producer_view(0);
            assert!(crate::fifo::is_host_fifo(&va));
            let mixed = mscclppConcurrentFifo {
                triggerFifo: vb.triggerFifo,
                ..va
            };
            assert!(!crate::fifo::is_host_fifo(&mixed));
            drop(a);
            let c = Fifo::new_host().unwrap();
            assert_ne!(c.producer_view(0).triggerFifoHead, va.triggerFifoHead);
            assert!(!crate::fifo::is_host_fifo(&va));
        }
        assert!(crate::fifo::is_host_fifo(&vb));
    }

    #[test]
    fn producer_blocks_when_full_and_abort_releases_it() {
        let f = Fifo::new_host().unwrap();
        let view = f.producer_view(0);
        let w = Trigger {
            ty: mscclppFlag,
            dst_off: 0,
            src_off: 0,
            size: 1,
            conn_id: 0,
        }
        .encode();
        for _ in 0..SIZE {
            // SAFETY: `view` is the producer view of `f`, a live host FIFO.
            unsafe { host_push(&view, w) }.unwrap();
        }
        let abort = f.abort_word();
        let v = view;
        struct SendView(mscclppConcurrentFifo);
        // SAFETY: the view's pointers stay valid while `f` lives, past the thread's join.
        unsafe impl Send for SendView {}
        let sv = SendView(v);
        let th = std::thread::spawn(move || {
            let sv = sv;
            // SAFETY: as above; `f` outlives the thread (joined below).
            unsafe { host_push(&sv.0, w) }
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!th.is_finished(), "a push into a full FIFO must wait");
        abort.set(mscclppResult_t::mscclppRemoteError);
        let r = th.join().unwrap();
        assert!(matches!(r, Err(Error::Remote(_))), "{r:?}");
    }
}
