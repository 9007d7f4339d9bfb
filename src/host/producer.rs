//! The host producer: pushes triggers into a host-memory FIFO and waits for their retirement,
//! as the kernel methods in `include/mscclpp/fifo_methods.inc` do on the GPU.

use super::Spin;
use crate::abi::mscclppConcurrentFifo;
use crate::error::Result;
use crate::fifo::{assist_after_push, SIZE};
use std::sync::atomic::{AtomicU64, Ordering};

/// Host producer: pushes one trigger, returns its ticket. The conn's FIFO must be in host memory.
///
/// # Safety
/// `fifo` must be the producer view of a live host-memory FIFO.
pub unsafe fn host_push(fifo: &mscclppConcurrentFifo, w: [u64; 2]) -> Result<u64> {
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
    let mut spin = Spin::new(fifo, crate::config::wait_timeout());
    // Acquire pairs with the proxy's Release publication of the tail; ends when the proxy has
    // retired ticket h - SIZE, on abort, or at the deadline.
    while h >= SIZE + tail.load(Ordering::Acquire) {
        spin.step("waiting for room in the proxy FIFO")?;
    }
    // SAFETY: slot h % SIZE of the live ring (SIZE slots of two aligned u64 words), touched
    // only atomically by producers and the proxy.
    let (w0, w1) = unsafe {
        let p = fifo.triggerFifo.add((h % SIZE) as usize) as *mut u64;
        (AtomicU64::from_ptr(p), AtomicU64::from_ptr(p.add(1)))
    };
    // Acquire pairs with the proxy's Release zeroing in `Fifo::pop`; ends like the loop above.
    while w0.load(Ordering::Acquire) != 0 {
        spin.step("waiting for a free FIFO slot")?;
    }
    w1.store(w[1], Ordering::Relaxed);
    // Release pairs with the proxy's Acquire load of word0 in `Fifo::peek`.
    w0.store(w[0], Ordering::Release);
    // Execute it now, on this core, unless a consumer is already at work.
    assist_after_push(fifo.triggerFifoHead);
    Ok(h)
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
    let mut spin = Spin::new(fifo, crate::config::wait_timeout());
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
            let got = Trigger::decode(f.peek().unwrap());
            assert_eq!(got, t);
            f.pop(false);
            assert!(f.is_empty());
        }
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
