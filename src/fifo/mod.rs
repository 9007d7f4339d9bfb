//! The trigger FIFO between producers (GPU threads, or host threads for host-memory
//! connections) and one proxy thread.
//!
//! Protocol (docs/DESIGN.md, "The life of a trigger"): a producer takes a ticket `head` with a fetch-add, waits
//! until `head < SIZE + tail` and the slot is empty, then stores word1 and word0 of the trigger;
//! word0 is never 0 for a real trigger. The proxy reads the slot at its tail, acts, zeroes the slot
//! and advances its tail, publishing it every `MSCCLPP_PROXY_FIFO_FLUSH_COUNTER` triggers and on
//! every Sync. The u64 after the tail is the abort word: non-zero ends every producer spin.

//!
//! Files: this one is the ring and its memory; `registry.rs` finds the consumer of a host FIFO
//! from its producers (so a host thread can do the proxy's work), `gate.rs` lets the proxy
//! thread stand aside while host threads do. The host producer itself is `crate::host`.

mod gate;
mod registry;

pub use gate::HelperGate;
pub(crate) use registry::{assist_after_push, consumer_and_gate, hold};
pub use registry::{
    direct_put, direct_signal, drain_inbox, is_host_fifo, set_consumer, set_direct, set_inbox,
    Assist, Drain,
};

use crate::abi::*;
use crate::error::Result;
use crate::mem::HostBlock;
use std::sync::atomic::{AtomicU64, Ordering};

pub const SIZE: u64 = MSCCLPP_PROXY_FIFO_SIZE;

/// A decoded trigger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trigger {
    pub ty: u64,
    pub dst_off: u64,
    pub src_off: u64,
    pub size: u64,
    pub conn_id: usize,
}

impl Trigger {
    pub fn decode(w: [u64; 2]) -> Self {
        Trigger {
            size: w[0] & MSCCLPP_TRIGGER_SIZE_MASK,
            src_off: w[0] >> MSCCLPP_BITS_SIZE,
            dst_off: w[1] & MSCCLPP_TRIGGER_OFFSET_MASK,
            conn_id: ((w[1] >> MSCCLPP_TRIGGER_CONNID_SHIFT) & MSCCLPP_TRIGGER_CONNID_MASK)
                as usize,
            ty: (w[1] >> MSCCLPP_TRIGGER_TYPE_SHIFT) & MSCCLPP_TRIGGER_TYPE_MASK,
        }
    }
    pub fn encode(&self) -> [u64; 2] {
        trigger_encode(
            self.ty,
            self.dst_off,
            self.src_off,
            self.size,
            self.conn_id as u64,
        )
    }
}

/// Consumer side of one FIFO, owned by one proxy thread. The memory lives in host memory (for a
/// GPU producer: pinned and mapped into the device, see `crate::cuda`).
pub struct Fifo {
    slots: *mut mscclppTrigger,
    /// `[tail, abort]`, read by producers.
    ctrl: *mut u64,
    head: *mut u64,
    /// The consumer's own tail; `ctrl[0]` lags it by at most FLUSH_COUNTER - 1.
    tail: u64,
    /// The producers' addresses of `slots` and `ctrl` (device addresses for a CUDA FIFO, the
    /// same as the consumer's for a host FIFO).
    prod_slots: *mut mscclppTrigger,
    prod_ctrl: *mut u64,
    /// Freed on drop unless [`Fifo::leak_memory`] was called.
    _mem: std::mem::ManuallyDrop<FifoMem>,
    leaked: bool,
}

// SAFETY: the raw pointers point into `_mem`, which the Fifo owns; only the proxy thread that
// owns the Fifo consumes, producers go through their own copies of the pointers.
unsafe impl Send for Fifo {}

enum FifoMem {
    Host {
        _slots: HostBlock,
        _ctrl: HostBlock,
        _head: HostBlock,
    },
    /// Producers are kernels on `device`. Slots and `[tail, abort]` sit in one pinned, mapped
    /// host block: a kernel's trigger store is a posted PCIe write and the proxy polls its own
    /// memory. `[head, tail cache, done, done on, poll hint]` sits in device memory: the ticket atomic and
    /// the room check stay on the GPU; a kernel reads the host tail (a PCIe round trip) only
    /// when the cached tail says the FIFO looks full, and refreshes the cache
    /// (include/mscclpp/fifo_methods.inc). `done` (see [`Fifo::done_word`]) lets a flush end
    /// on a word of its own GPU's memory instead of a PCIe read of its Sync slot.
    Cuda {
        device: i32,
        _host: crate::cuda::PinnedHost,
        _head: crate::cuda::DeviceMem,
    },
}

/// Byte offset of `[tail, abort]` inside a CUDA FIFO's pinned block (after the slots, on its
/// own cache line so that tail publications don't disturb slot polling).
const CUDA_CTRL_OFFSET: usize = SIZE as usize * 16;

/// Words of a CUDA FIFO's device block: the ticket counter, the producers' tail cache, the
/// done word, the switch that tells producers to poll it (see [`Fifo::done_word`]) and their
/// poll hint (`pollEither` in include/mscclpp/device.h).
const DEV_HEAD: usize = 0;
const DEV_DONE: usize = 2;
const DEV_DONE_ON: usize = 3;
const DEV_WORDS: usize = 8;

/// Shared handle to a FIFO's abort word, for the communicator's abort (`proxy::Sticky`), which
/// raises the words of all its FIFOs together; valid until the communicator detaches it at
/// destroy, before the FIFO's memory goes.
#[derive(Clone, Copy)]
pub struct AbortWord(*mut u64);
// SAFETY: the word is only touched through atomics; the comm keeps its memory alive.
unsafe impl Send for AbortWord {}
// SAFETY: as for the unsafe code just above.
unsafe impl Sync for AbortWord {}

impl AbortWord {
    /// Stores an error code for every producer to see. Release pairs with the Acquire loads in
    /// the producers' spin loops.
    pub fn set(&self, code: mscclppResult_t) {
        // SAFETY: points to a live, 8-byte aligned u64 (see type doc).
        unsafe { AtomicU64::from_ptr(self.0) }.store(code as u64, Ordering::Release);
    }

    /// Lowers the word again (`mscclppProxyLaunch` after a stop). Release, as in `set`.
    pub fn clear(&self) {
        // SAFETY: as in `set`.
        unsafe { AtomicU64::from_ptr(self.0) }.store(0, Ordering::Release);
    }
}

impl Fifo {
    /// A FIFO in ordinary host memory, for host-memory connections.
    pub fn new_host() -> Result<Self> {
        let slots = HostBlock::zeroed(SIZE as usize * 16, 64)?;
        let ctrl = HostBlock::zeroed(16, 64)?;
        let head = HostBlock::zeroed(8, 64)?;
        registry::add(head.ptr().cast());
        Ok(Fifo {
            slots: slots.ptr().cast(),
            ctrl: ctrl.ptr().cast(),
            head: head.ptr().cast(),
            tail: 0,
            prod_slots: slots.ptr().cast(),
            prod_ctrl: ctrl.ptr().cast(),
            _mem: std::mem::ManuallyDrop::new(FifoMem::Host {
                _slots: slots,
                _ctrl: ctrl,
                _head: head,
            }),
            leaked: false,
        })
    }

    /// A FIFO whose producers are kernels on CUDA `device` (layout: see `FifoMem::Cuda`).
    /// The FIFO for an endpoint whose producers run on `device` (kernels), or on host threads
    /// when `None`.
    pub fn for_device(device: Option<i32>) -> Result<Self> {
        match device {
            Some(d) => {
                crate::cuda::require("a FIFO for kernels")?;
                Self::new_cuda(d)
            }
            None => Self::new_host(),
        }
    }

    pub fn new_cuda(device: i32) -> Result<Self> {
        let host = crate::cuda::PinnedHost::zeroed(device, CUDA_CTRL_OFFSET + 64)?;
        // [head, tail cache, done, done on, hint]: all start at 0 (the cache may only lag the
        // real tail; done = 0 claims nothing; producers ignore done until switched on).
        let head = crate::cuda::DeviceMem::zeroed(device, DEV_WORDS * 8)?;
        // SAFETY: the block is CUDA_CTRL_OFFSET + 64 bytes; slots come first, ctrl after.
        let (ctrl, prod_ctrl) = unsafe {
            (
                host.host().add(CUDA_CTRL_OFFSET),
                (host.dev() + CUDA_CTRL_OFFSET as u64) as usize as *mut u64,
            )
        };
        Ok(Fifo {
            slots: host.host().cast(),
            ctrl: ctrl.cast(),
            head: (head.ptr() + DEV_HEAD as u64 * 8) as usize as *mut u64,
            tail: 0,
            prod_slots: host.dev() as usize as *mut mscclppTrigger,
            prod_ctrl,
            _mem: std::mem::ManuallyDrop::new(FifoMem::Cuda {
                device,
                _host: host,
                _head: head,
            }),
            leaked: false,
        })
    }

    /// The CUDA device whose kernels produce into this FIFO (None: host producers).
    pub fn device(&self) -> Option<i32> {
        match &*self._mem {
            FifoMem::Host { .. } => None,
            FifoMem::Cuda { device, .. } => Some(*device),
        }
    }

    /// The ticket of the trigger at the tail (the next one `peek` returns): tickets count
    /// triggers from 0 in FIFO order, as the producers' head does.
    pub fn ticket(&self) -> u64 {
        self.tail
    }

    /// A CUDA FIFO's done word (device address): where a transport that completes work on the
    /// FIFO's GPU may store `d`, meaning "every trigger with a ticket below `d` has completed",
    /// with values that never decrease (the P2P SM copy engine stores it after a job's bytes).
    /// A producer's flush() then ends as soon as it sees its tickets covered there, a read of
    /// its own GPU's memory instead of a PCIe round trip to its Sync slot, which only the proxy
    /// clears after it has itself seen the completion. Producers look at it only once
    /// [`Fifo::enable_done_word`] was called. None for host FIFOs.
    pub fn done_word(&self) -> Option<u64> {
        match &*self._mem {
            FifoMem::Host { .. } => None,
            FifoMem::Cuda { _head, .. } => Some(_head.ptr() + DEV_DONE as u64 * 8),
        }
    }

    /// Tells the producers to poll the done word in their flush() (once, before any kernel
    /// uses the FIFO: a stream write followed by a wait).
    pub fn enable_done_word(&self) -> Result<()> {
        match &*self._mem {
            FifoMem::Host { .. } => Ok(()),
            FifoMem::Cuda { _head, .. } => _head.write_u64(DEV_DONE_ON * 8, 1),
        }
    }

    /// The producer view that goes into a `mscclppDevConn`.
    pub fn producer_view(&self, conn_id: usize) -> mscclppConcurrentFifo {
        mscclppConcurrentFifo {
            triggerFifo: self.prod_slots,
            triggerFifoTail: self.prod_ctrl,
            triggerFifoHead: self.head,
            connId: conn_id as i32,
        }
    }

    pub fn abort_word(&self) -> AbortWord {
        // SAFETY: ctrl points to two u64; the second is the abort word.
        AbortWord(unsafe { self.ctrl.add(1) })
    }

    /// The abort word's value (0: not raised). Acquire pairs with `AbortWord::set`.
    pub fn aborted(&self) -> u64 {
        // SAFETY: ctrl points to two live u64; the second is the abort word, touched only
        // atomically.
        unsafe { AtomicU64::from_ptr(self.ctrl.add(1)) }.load(Ordering::Acquire)
    }

    /// Retires every trigger now in the FIFO without executing it (at most `SIZE`, so that a
    /// producer that keeps pushing cannot hold the caller), publishes the tail, and returns
    /// how many. For triggers pushed after the communicator's abort.
    pub fn discard(&mut self) -> u64 {
        let mut n = 0;
        // Ends when the FIFO is empty or after SIZE triggers.
        while n < SIZE && self.peek().is_some() {
            self.pop(false);
            n += 1;
        }
        if n > 0 {
            self.publish_tail();
        }
        n
    }

    fn slot_words(&self, idx: u64) -> (&AtomicU64, &AtomicU64) {
        // SAFETY: idx % SIZE is within the SIZE slots; each slot is 16-byte aligned and lives as
        // long as self. Producers write these words too, hence atomics.
        unsafe {
            let p = self.slots.add((idx % SIZE) as usize) as *mut u64;
            (AtomicU64::from_ptr(p), AtomicU64::from_ptr(p.add(1)))
        }
    }

    /// The trigger at the tail, if a producer has completed it.
    pub fn peek(&self) -> Option<[u64; 2]> {
        let (w0, w1) = self.slot_words(self.tail);
        // Acquire pairs with the producer's Release store of word0 (host producers); a GPU
        // producer writes both words in one 16-byte store. word1 always has a non-zero type, so
        // a zero word1 means the store is not fully visible yet: retry later.
        let a = w0.load(Ordering::Acquire);
        if a == 0 {
            return None;
        }
        let b = w1.load(Ordering::Acquire);
        if b == 0 {
            return None;
        }
        Some([a, b])
    }

    /// Retires the trigger at the tail: zero the slot, advance, publish the tail when due.
    pub fn pop(&mut self, sync: bool) {
        let (w0, w1) = self.slot_words(self.tail);
        w1.store(0, Ordering::Relaxed);
        // Release pairs with the producers' Acquire wait for an empty slot and with flush()'s
        // wait for its Sync slot to clear: everything the proxy did for this trigger is visible
        // to a producer that sees the zero.
        w0.store(0, Ordering::Release);
        self.tail += 1;
        if sync || self.tail % MSCCLPP_PROXY_FIFO_FLUSH_COUNTER == 0 {
            self.publish_tail();
        }
    }

    fn publish_tail(&self) {
        // SAFETY: ctrl[0] is the published tail. Release pairs with the producers' Acquire
        // load in their wait for room.
        unsafe { AtomicU64::from_ptr(self.ctrl) }.store(self.tail, Ordering::Release);
    }

    pub fn is_empty(&self) -> bool {
        self.peek().is_none()
    }

    /// Host FIFOs: every ticket the producers have taken was retired, including one a producer
    /// took and has not yet written (`is_empty` misses that one, and a direct signal or put
    /// would overtake the trigger that thread is about to write). False for CUDA FIFOs.
    pub fn all_retired(&self) -> bool {
        if self.device().is_some() {
            return false;
        }
        // SAFETY: a host FIFO's head counter, live as long as `self`, touched only atomically.
        // Relaxed: a count compared with our own tail; the slots carry the data.
        unsafe { AtomicU64::from_ptr(self.head) }.load(Ordering::Relaxed) == self.tail
    }
}

impl Fifo {
    /// Keeps the FIFO's memory for good instead of freeing it on drop: a kernel (or the SM
    /// engine) that has not ended may still poll or store into it (teardown says why, at WARN).
    pub fn leak_memory(&mut self) {
        self.leaked = true;
    }
}

impl Drop for Fifo {
    fn drop(&mut self) {
        if matches!(*self._mem, FifoMem::Host { .. }) {
            registry::remove(self.head);
        }
        if !self.leaked {
            // SAFETY: dropped once, here; nothing uses the memory after the Fifo is gone
            // (producers' copies of the pointers are the caller's to stop first, see
            // `leak_memory`).
            unsafe { std::mem::ManuallyDrop::drop(&mut self._mem) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trigger_roundtrip() {
        let t = Trigger {
            ty: mscclppData | mscclppFlag,
            dst_off: 0xdead_beef,
            src_off: 0x1234_5678,
            size: 0xffff_ffff,
            conn_id: 1023,
        };
        assert_eq!(Trigger::decode(t.encode()), t);
        let w = t.encode();
        assert_eq!(w[0], 0x1234_5678_ffff_ffff);
        assert_eq!(w[1] >> 42, 3);
    }
}
