//! The trigger FIFO between producers (GPU threads, or host threads for host-memory
//! connections) and one proxy thread.
//!
//! Protocol (docs/DESIGN.md, "The life of a trigger"): a producer takes a ticket `head` with a fetch-add, waits
//! until `head < SIZE + tail` and the slot is empty, then stores word1 and word0 of the trigger;
//! word0 is never 0 for a real trigger. The proxy reads the slot at its tail, acts, zeroes the slot
//! and advances its tail, publishing it every `MSCCLPP_PROXY_FIFO_FLUSH_COUNTER` triggers and on
//! every Sync. The u64 after the tail is the abort word: non-zero ends every producer spin. The
//! cache line after `[tail, abort]` is the wait record, where a kernel whose wait lasts says
//! what it waits for ([`Fifo::wait_record`]). A host producer that gives up after taking its
//! ticket records it as abandoned, and the consumer retires it as a no-op (`abandoned.rs`).
//!
//! Files: this one is the ring and its memory; `registry.rs` finds the consumer of a host FIFO
//! from its producers (so a host thread can do the proxy's work), `gate.rs` lets the proxy
//! thread stand aside while host threads do, `abandoned.rs` keeps the tickets whose slot will
//! never be written. The host producer itself is `crate::host`.

mod abandoned;
mod gate;
mod registry;

use abandoned::Abandoned;
pub use gate::{park_aside, HelperGate};
pub use registry::{
    abandon, direct_put, direct_signal, inbox, is_host_fifo, set_consumer, set_direct, set_inbox,
    withdraw, Assist, Drain, Withdrawal,
};
pub(crate) use registry::{assist_after_push, consumer_and_gate, hold};

use crate::abi::*;
use crate::error::Result;
use crate::mem::HostBlock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

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
    /// The trigger in `w`, or the producer's refusal (`MSCCLPP_TRIGGER_REFUSED`). Bits a
    /// producer never sets (word1 bits 61..63) make a type the proxy refuses.
    pub fn decode(w: [u64; 2]) -> Result<Self, Refusal> {
        let conn_id =
            ((w[1] >> MSCCLPP_TRIGGER_CONNID_SHIFT) & MSCCLPP_TRIGGER_CONNID_MASK) as usize;
        if w[1] & MSCCLPP_TRIGGER_REFUSED != 0 {
            return Err(Refusal {
                conn_id,
                what: w[1] & MSCCLPP_TRIGGER_OFFSET_MASK,
                value: w[0],
            });
        }
        let high = |shift: u32| {
            ((w[1] >> shift) & MSCCLPP_TRIGGER_OFFSET_HIGH_MASK) << MSCCLPP_BITS_OFFSET
        };
        let reserved = w[1] >> (MSCCLPP_TRIGGER_DST_HIGH_SHIFT + 8) != 0;
        Ok(Trigger {
            size: w[0] & MSCCLPP_TRIGGER_SIZE_MASK,
            src_off: (w[0] >> MSCCLPP_BITS_SIZE) | high(MSCCLPP_TRIGGER_SRC_HIGH_SHIFT),
            dst_off: (w[1] & MSCCLPP_TRIGGER_OFFSET_MASK) | high(MSCCLPP_TRIGGER_DST_HIGH_SHIFT),
            conn_id,
            // Reserved bits set: a type no producer writes, so `handle` refuses it by name.
            ty: ((w[1] >> MSCCLPP_TRIGGER_TYPE_SHIFT) & MSCCLPP_TRIGGER_TYPE_MASK)
                | if reserved { 1 << MSCCLPP_BITS_TYPE } else { 0 },
        })
    }
    /// Only for values `trigger_refusal` accepts (see `trigger_encode`).
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

/// A put a producer could not encode (a refused trigger, or a host put checked before it is
/// queued): which value (`MSCCLPP_REFUSED_*`) and what it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub conn_id: usize,
    pub what: u64,
    pub value: u64,
}

impl Refusal {
    /// What was refused and why, for an error message that also names the connection.
    pub fn describe(&self) -> String {
        let v = self.value;
        match self.what {
            MSCCLPP_REFUSED_ZERO_SIZE => {
                "dataSize 0: a trigger of 0 bytes would read as an empty FIFO slot".into()
            }
            MSCCLPP_REFUSED_SRC_OFFSET => format!(
                "srcDataOffset {v} is not below 2^40 (1 TiB), the largest offset a trigger carries"
            ),
            MSCCLPP_REFUSED_DST_OFFSET => format!(
                "dstDataOffset {v} is not below 2^40 (1 TiB), the largest offset a trigger carries"
            ),
            MSCCLPP_REFUSED_SIZE => format!(
                "dataSize {v}: the put would end past 2^40 bytes (1 TiB) into a buffer, or one trigger was asked to carry more than 2^32 - 1 bytes"
            ),
            MSCCLPP_REFUSED_RANGE_SRC => format!(
                "its source range ends at byte {v}, past the local buffer: a put of more than one trigger (over 4 GiB - 1 bytes) is checked whole, and refused before any of it moved"
            ),
            MSCCLPP_REFUSED_RANGE_DST => format!(
                "its destination range ends at byte {v}, past the peer's buffer: a put of more than one trigger (over 4 GiB - 1 bytes) is checked whole, and refused before any of it moved"
            ),
            other => format!("refused for an unknown reason {other} (value {v})"),
        }
    }
}

/// The triggers of one put (`put_triggers`): `MSCCLPP_TRIGGER_CHUNK` bytes at a time with
/// type Data, then the rest with the put's own type. One trigger for a put that fits.
#[derive(Clone, Copy, Debug)]
pub struct PutTriggers {
    ty: u64,
    dst: u64,
    src: u64,
    left: u64,
    conn_id: usize,
}

/// The triggers of a put of `size` bytes with type `ty` (Data, plus Flag and Sync for the last
/// trigger), or why it cannot be queued: 0 bytes, or a byte at or past 2^40 of either buffer.
/// The same rule as the device's `pushPut` (include/mscclpp/fifo_methods.inc): refused as a
/// whole, so no part of it moves.
pub fn put_triggers(
    ty: u64,
    dst: u64,
    src: u64,
    size: u64,
    conn_id: usize,
) -> Result<PutTriggers, Refusal> {
    let refuse = |what, value| Refusal {
        conn_id,
        what,
        value,
    };
    if size == 0 {
        return Err(refuse(MSCCLPP_REFUSED_ZERO_SIZE, 0));
    }
    if src >= MSCCLPP_TRIGGER_MAX_END {
        return Err(refuse(MSCCLPP_REFUSED_SRC_OFFSET, src));
    }
    if dst >= MSCCLPP_TRIGGER_MAX_END {
        return Err(refuse(MSCCLPP_REFUSED_DST_OFFSET, dst));
    }
    if size > MSCCLPP_TRIGGER_MAX_END - src.max(dst) {
        return Err(refuse(MSCCLPP_REFUSED_SIZE, size));
    }
    Ok(PutTriggers {
        ty,
        dst,
        src,
        left: size,
        conn_id,
    })
}

impl Iterator for PutTriggers {
    type Item = Trigger;
    fn next(&mut self) -> Option<Trigger> {
        if self.left == 0 {
            return None;
        }
        let (ty, size) = if self.left > MSCCLPP_TRIGGER_SIZE_MASK {
            (mscclppData, MSCCLPP_TRIGGER_CHUNK)
        } else {
            (self.ty, self.left)
        };
        let t = Trigger {
            ty,
            dst_off: self.dst,
            src_off: self.src,
            size,
            conn_id: self.conn_id,
        };
        self.dst += size;
        self.src += size;
        self.left -= size;
        Some(t)
    }
}

/// A kernel's wait record (`MSCCLPP_FIFO_RECORD_WORD`), as read by the consumer in one
/// consistent snapshot. The fields mean what the `MSCCLPP_RECORD_*` constants say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitRecord {
    /// Changes with every write: tells one published record from the next.
    pub seq: u64,
    /// 0 (none), `MSCCLPP_RECORD_PENDING` or `MSCCLPP_RECORD_EXPIRED`.
    pub state: u64,
    /// `MSCCLPP_WAIT_OP_*`.
    pub op: u64,
    /// The connection's index on this FIFO (`ProxyWork::conns`).
    pub conn_id: usize,
    pub wanted: u64,
    pub seen: u64,
    /// Of `seen` (a wait's), what the peer's kernels stored themselves.
    pub direct: u64,
    pub head: u64,
    pub waited: std::time::Duration,
    /// A wait that did not own the record ended at the device timeout.
    pub others_expired: bool,
}

impl WaitRecord {
    /// Decodes the record's 8 words (`words[MSCCLPP_RECORD_*]`).
    pub fn from_words(w: [u64; 8]) -> Self {
        let what = w[MSCCLPP_RECORD_WHAT];
        WaitRecord {
            seq: w[MSCCLPP_RECORD_SEQ],
            state: (what >> MSCCLPP_RECORD_STATE_SHIFT) & 0xff,
            op: what & ((1 << MSCCLPP_RECORD_STATE_SHIFT) - 1),
            direct: w[MSCCLPP_RECORD_DIRECT],
            conn_id: ((what >> 32) & MSCCLPP_TRIGGER_CONNID_MASK) as usize,
            wanted: w[MSCCLPP_RECORD_WANTED],
            seen: w[MSCCLPP_RECORD_SEEN],
            head: w[MSCCLPP_RECORD_HEAD],
            waited: std::time::Duration::from_nanos(w[MSCCLPP_RECORD_WAITED_NS]),
            others_expired: w[MSCCLPP_RECORD_OTHERS_EXPIRED] != 0,
        }
    }
}

/// Consumer side of one FIFO, owned by one proxy thread. The memory lives in host memory (for a
/// GPU producer: pinned and mapped into the device, see `crate::cuda`).
pub struct Fifo {
    slots: *mut mscclppTrigger,
    /// `[tail, abort]`, read by producers; the wait record follows on the next cache line
    /// (`MSCCLPP_FIFO_RECORD_WORD` words on).
    ctrl: *mut u64,
    head: *mut u64,
    /// The consumer's own tail; `ctrl[0]` lags it by at most FLUSH_COUNTER - 1.
    tail: u64,
    /// The producers' addresses of `slots` and `ctrl` (device addresses for a CUDA FIFO, the
    /// same as the consumer's for a host FIFO).
    prod_slots: *mut mscclppTrigger,
    prod_ctrl: *mut u64,
    /// Host FIFOs: tickets whose slot will never be written (see `abandoned.rs`).
    abandoned: Option<Arc<Abandoned>>,
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
        /// Never freed: moved to `RETIRED_HEADS` when the FIFO goes (see there). `None` only
        /// once moved.
        _head: Option<HostBlock>,
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
/// Bytes from `[tail, abort]` on: their cache line, then the wait record's.
const CTRL_BYTES: usize = 128;

/// Words of a CUDA FIFO's device block: the ticket counter, the producers' tail cache, the
/// done word, the switch that tells producers to poll it (see [`Fifo::done_word`]), their
/// poll hint (`pollEither` in include/mscclpp/device.h), the device wait bounds
/// (`MSCCLPP_FIFO_DEV_WARN_NS`, `..._LIMIT_NS`, `..._RECORD_OWNER`), the last raw push
/// with work (`MSCCLPP_FIFO_DEV_RAW`) and the mark of tickets given up on the abort
/// (`MSCCLPP_FIFO_DEV_ABANDONED`); two 64-byte lines.
const DEV_HEAD: usize = 0;
const DEV_DONE: usize = 2;
const DEV_DONE_ON: usize = 3;
const DEV_WORDS: usize = 16;

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
        // The wait record too, though only kernels write one: the same layout for both kinds.
        let ctrl = HostBlock::zeroed(CTRL_BYTES, 64)?;
        let head = HostBlock::zeroed(8, 64)?;
        let abandoned = Arc::<Abandoned>::default();
        let f = Fifo {
            slots: slots.ptr().cast(),
            ctrl: ctrl.ptr().cast(),
            head: head.ptr().cast(),
            tail: 0,
            prod_slots: slots.ptr().cast(),
            prod_ctrl: ctrl.ptr().cast(),
            abandoned: Some(abandoned.clone()),
            _mem: std::mem::ManuallyDrop::new(FifoMem::Host {
                _slots: slots,
                _ctrl: ctrl,
                _head: Some(head),
            }),
            leaked: false,
        };
        registry::add(&f.producer_view(0), abandoned);
        Ok(f)
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
        let host = crate::cuda::PinnedHost::zeroed(device, CUDA_CTRL_OFFSET + CTRL_BYTES)?;
        // [head, tail cache, done, done on, hint, warn, limit, record owner]: all start at 0
        // (the cache may only lag the real tail; done = 0 claims nothing; producers ignore
        // done until switched on; no record is owned); then the wait bounds.
        let head = crate::cuda::DeviceMem::zeroed(device, DEV_WORDS * 8)?;
        let (warn, limit) = device_wait_bounds_ns();
        head.write_u64(MSCCLPP_FIFO_DEV_WARN_NS * 8, warn)?;
        head.write_u64(MSCCLPP_FIFO_DEV_LIMIT_NS * 8, limit)?;
        // SAFETY: the block is CUDA_CTRL_OFFSET + CTRL_BYTES bytes; slots first, ctrl after.
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
            abandoned: None,
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

    fn record_word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < 8);
        // SAFETY: the record is 8 aligned u64 at ctrl + MSCCLPP_FIFO_RECORD_WORD words, inside
        // the CTRL_BYTES of both kinds of FIFO, live as long as self; kernels write it over
        // PCIe, so it is read through atomics.
        unsafe { AtomicU64::from_ptr(self.ctrl.add(MSCCLPP_FIFO_RECORD_WORD + i)) }
    }

    /// The kernels' wait record, if it can be read consistently now: None while a kernel is
    /// writing it (try again later). Sequence lock: the writer makes SEQ odd, writes, makes
    /// it even again (include/mscclpp/device.h, `WaitWatch`).
    pub fn wait_record(&self) -> Option<WaitRecord> {
        // Acquire pairs with the kernel's system-scope fence before its even SEQ store: the
        // fields of that write are visible to the loads below.
        let s1 = self.record_word(MSCCLPP_RECORD_SEQ).load(Ordering::Acquire);
        if s1 % 2 == 1 {
            return None;
        }
        let mut w = [0u64; 8];
        for (i, x) in w.iter_mut().enumerate().skip(1) {
            // Relaxed: validated by the second SEQ load below.
            *x = self.record_word(i).load(Ordering::Relaxed);
        }
        // Acquire fence: the field loads above happen before the SEQ reload below, so an
        // unchanged SEQ proves no write overlapped them (pairs with the kernel's fence after
        // its odd SEQ store).
        std::sync::atomic::fence(Ordering::Acquire);
        let s2 = self.record_word(MSCCLPP_RECORD_SEQ).load(Ordering::Relaxed);
        if s2 != s1 {
            return None;
        }
        w[MSCCLPP_RECORD_SEQ] = s1;
        Some(WaitRecord::from_words(w))
    }

    /// Tests: queues `w` as a producer would (an empty FIFO: no wait for room).
    #[cfg(test)]
    pub(crate) fn push_for_test(&self, w: [u64; 2]) {
        // SAFETY: the head counter of this live FIFO, touched only atomically.
        let h = unsafe { AtomicU64::from_ptr(self.head) }.fetch_add(1, Ordering::Relaxed);
        let (w0, w1) = self.slot_words(h);
        w1.store(w[1], Ordering::Relaxed);
        // Release pairs with `peek`'s Acquire load of word0.
        w0.store(w[0], Ordering::Release);
    }

    /// Tests: writes the record as a kernel would (SEQ odd, fields, SEQ = `w[SEQ]`).
    #[cfg(test)]
    pub(crate) fn write_record_for_test(&self, w: [u64; 8]) {
        let seq = self.record_word(MSCCLPP_RECORD_SEQ);
        seq.store(w[MSCCLPP_RECORD_SEQ] | 1, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        for (i, x) in w.iter().enumerate().skip(1) {
            self.record_word(i).store(*x, Ordering::Relaxed);
        }
        seq.store(w[MSCCLPP_RECORD_SEQ], Ordering::Release);
    }

    /// The abort word's value (0: not raised). Acquire pairs with `AbortWord::set`.
    pub fn aborted(&self) -> u64 {
        // SAFETY: ctrl points to two live u64; the second is the abort word, touched only
        // atomically.
        unsafe { AtomicU64::from_ptr(self.ctrl.add(1)) }.load(Ordering::Acquire)
    }

    /// How many triggers, from the tail on, producers have written and the consumer has not
    /// retired (at most `SIZE`).
    pub fn queued(&self) -> u64 {
        self.queued_triggers().len() as u64
    }

    /// The triggers, from the tail on, that producers have written and the consumer has not
    /// retired, up to the first slot not (fully) written, at most `SIZE`. The caller holds the
    /// consumer (`&self` of the proxy's work, under its lock), so none is retired meanwhile.
    pub fn queued_triggers(&self) -> Vec<[u64; 2]> {
        let mut out = Vec::new();
        // Ends at the first slot not written, or after SIZE slots.
        while (out.len() as u64) < SIZE {
            let (w0, w1) = self.slot_words(self.tail + out.len() as u64);
            // Acquire pairs with the producers' Release store (or 16-byte store) of word0; a
            // zero word1 is a store not yet fully visible (`peek_slot`).
            let (a, b) = (w0.load(Ordering::Acquire), w1.load(Ordering::Acquire));
            if a == 0 || b == 0 {
                break;
            }
            out.push([a, b]);
        }
        out
    }

    /// Retires every trigger now in the FIFO without executing it (at most `SIZE`, so that a
    /// producer that keeps pushing cannot hold the caller), publishes the tail, and returns
    /// how many. Only at `mscclppProxyLaunch` after a stop that raised the abort: a slot's
    /// zero means "executed" to every waiter (docs/DESIGN.md 5.1), so nothing else may zero a
    /// slot whose trigger did not run.
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

    /// CUDA FIFOs, at `mscclppProxyLaunch` after a stop that raised the abort (after
    /// [`Fifo::discard`]): the tickets kernels took but never wrote, because the abort found
    /// them waiting for room (`MSCCLPP_FIFO_DEV_ABANDONED`, 1 + the highest), are retired as
    /// no-ops with every ticket before them, and the mark is cleared: the consumer does not
    /// wait at their empty slots forever, and waits on later tickets trust a zero slot again.
    /// Returns how many were retired. A kernel still pushing into the full FIFO while this runs
    /// may give up a ticket after the mark was read; its slot then stays empty (said in
    /// docs/DESIGN.md 5.1). Host FIFOs: 0 (their producers withdraw, `abandoned.rs`).
    pub fn retire_abandoned(&mut self) -> Result<u64> {
        let mark = match &*self._mem {
            FifoMem::Host { .. } => return Ok(0),
            FifoMem::Cuda { _head, .. } => _head.read_u64(MSCCLPP_FIFO_DEV_ABANDONED * 8)?,
        };
        let mut n = 0;
        // Ends at the mark: every ticket below it was taken before it was read (the FIFO's
        // head passed it), and written or given up long before (the stop's drain alone is a
        // second).
        while self.tail < mark {
            self.pop(false);
            n += 1;
        }
        if n > 0 {
            self.publish_tail();
        }
        if mark != 0 {
            if let FifoMem::Cuda { _head, .. } = &*self._mem {
                _head.write_u64(MSCCLPP_FIFO_DEV_ABANDONED * 8, 0)?;
            }
        }
        Ok(n)
    }

    fn slot_words(&self, idx: u64) -> (&AtomicU64, &AtomicU64) {
        // SAFETY: idx % SIZE is within the SIZE slots; each slot is 16-byte aligned and lives as
        // long as self. Producers write these words too, hence atomics.
        unsafe {
            let p = self.slots.add((idx % SIZE) as usize) as *mut u64;
            (AtomicU64::from_ptr(p), AtomicU64::from_ptr(p.add(1)))
        }
    }

    /// The trigger at the tail, if a producer has completed it. Host FIFOs: an empty slot whose
    /// ticket was abandoned (its producer gave up, see `abandoned.rs`) is retired on the way
    /// as a no-op, executing nothing.
    pub fn peek(&mut self) -> Option<[u64; 2]> {
        // Ends at a written slot, or at an empty one whose ticket is not abandoned; each turn
        // retires one abandoned ticket, of which there are finitely many.
        loop {
            if let Some(w) = self.peek_slot() {
                return Some(w);
            }
            if !self.abandoned.as_ref().is_some_and(|a| a.take(self.tail)) {
                return None;
            }
            // Published at once: producers waiting for room count on it (the slot's zero
            // pairs as in any pop).
            self.pop(true);
        }
    }

    /// Host FIFOs: takes back the trigger of `ticket`, which a producer wrote and the consumer
    /// has not reached: its slot is cleared and the ticket retired as a no-op when the tail
    /// gets there. `&mut self` means the caller holds the consumer (the proxy's lock), so the
    /// trigger is not being executed. False (nothing done) if it was retired already, or for
    /// a CUDA FIFO.
    pub fn withdraw(&mut self, ticket: u64) -> bool {
        let Some(a) = &self.abandoned else {
            return false;
        };
        if ticket < self.tail {
            return false;
        }
        let (w0, w1) = self.slot_words(ticket);
        // Relaxed: the consumer reads the slot under the lock our caller holds; the producer
        // of the slot's next ticket writes it only once the tail has passed `ticket`, which
        // `pop` publishes with Release after its own zeroing.
        w1.store(0, Ordering::Relaxed);
        w0.store(0, Ordering::Relaxed);
        a.add(ticket);
        true
    }

    fn peek_slot(&self) -> Option<[u64; 2]> {
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

    pub fn is_empty(&mut self) -> bool {
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

/// The device wait bounds a CUDA FIFO's kernels read (`MSCCLPP_FIFO_DEV_WARN_NS`,
/// `..._LIMIT_NS`): the wait timeout, and the device wait timeout (0: none), in ns.
fn device_wait_bounds_ns() -> (u64, u64) {
    let ns = |d: std::time::Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    (
        ns(crate::config::wait_timeout()),
        crate::config::device_wait_timeout().map_or(0, ns),
    )
}

/// The head blocks of host FIFOs that are gone, kept allocated for the life of the process
/// (a 64-byte block per host FIFO ever created, one per host-memory endpoint): a head address
/// then names one FIFO forever, so a `mscclppDevConn` of a destroyed communicator is refused
/// (`is_host_fifo`) even when a newer FIFO got its slots and tail addresses. Kept here rather
/// than forgotten, so that leak checkers see them reachable.
static RETIRED_HEADS: std::sync::Mutex<Vec<HostBlock>> = std::sync::Mutex::new(Vec::new());

impl Fifo {
    /// Keeps the FIFO's memory for good instead of freeing it on drop: a kernel (or the SM
    /// engine) that has not ended may still poll or store into it (teardown says why, at WARN).
    pub fn leak_memory(&mut self) {
        self.leaked = true;
    }
}

impl Drop for Fifo {
    fn drop(&mut self) {
        if let FifoMem::Host { _head, .. } = &mut *self._mem {
            registry::remove(self.head);
            if let Some(h) = _head.take() {
                crate::sync::lock(&RETIRED_HEADS).push(h);
            }
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

    fn trigger(ty: u64, dst_off: u64, src_off: u64, size: u64, conn_id: usize) -> Trigger {
        Trigger {
            ty,
            dst_off,
            src_off,
            size,
            conn_id,
        }
    }

    #[test]
    fn trigger_roundtrip() {
        let t = trigger(
            mscclppData | mscclppFlag,
            0xdead_beef,
            0x1234_5678,
            0xffff_ffff,
            1023,
        );
        assert_eq!(Trigger::decode(t.encode()), Ok(t));
        let w = t.encode();
        assert_eq!(w[0], 0x1234_5678_ffff_ffff);
        assert_eq!(w[1] >> 42, 3);
    }

    #[test]
    fn the_2023_layout_decodes_as_before() {
        // A trigger with offsets below 2^32 sets no bit above the type: what a kernel built
        // against the 2023 encoding writes is read the same way.
        let t = trigger(mscclppData | mscclppSync, 0xffff_ffff, 0xffff_fffe, 7, 5);
        let w = t.encode();
        assert_eq!(w[1] >> MSCCLPP_TRIGGER_SRC_HIGH_SHIFT, 0);
        assert_eq!(w[0], 7 | 0xffff_fffe << 32);
        assert_eq!(w[1], 0xffff_ffff | 5 << 32 | 5 << 42);
    }

    #[test]
    fn roundtrip_at_the_limits_and_word0_is_never_zero() {
        let max_off = MSCCLPP_TRIGGER_MAX_END - 1;
        let offs = [
            0,
            1,
            0xffff_ffff,
            1 << 32,
            (1 << 32) + 8192,
            0xff_0000_0000,
            max_off - 1,
            max_off,
        ];
        let sizes = [1, 2, 4096, MSCCLPP_TRIGGER_CHUNK, MSCCLPP_TRIGGER_SIZE_MASK];
        let types = [1, 2, 3, 4, 5, 6, 7];
        let mut n = 0;
        for &dst in &offs {
            for &src in &offs {
                for &size in &sizes {
                    for &ty in &types {
                        for conn in [0usize, 1, 1023] {
                            assert_eq!(trigger_refusal(dst, src, size), None);
                            let t = trigger(ty, dst, src, size, conn);
                            let w = t.encode();
                            assert_ne!(w[0], 0, "{t:?} encodes as an empty slot");
                            assert_ne!(w[1], 0, "{t:?}: word1 0 reads as not yet written");
                            assert_eq!(Trigger::decode(w), Ok(t));
                            n += 1;
                        }
                    }
                }
            }
        }
        assert!(n > 5000);
        // The size whose low 32 bits are 0 that wedged the 2023 FIFO is never one trigger.
        assert!(trigger_refusal(0, 0, 1 << 32).is_some());
    }

    #[test]
    fn values_past_the_limits_are_refused_never_wrapped() {
        let end = MSCCLPP_TRIGGER_MAX_END;
        for (dst, src, size, what, value) in [
            (0, 0, 0, MSCCLPP_REFUSED_ZERO_SIZE, 0),
            (0, 0, 1 << 32, MSCCLPP_REFUSED_SIZE, 1 << 32),
            (0, 0, u64::MAX, MSCCLPP_REFUSED_SIZE, u64::MAX),
            (0, end, 1, MSCCLPP_REFUSED_SRC_OFFSET, end),
            (end, 0, 1, MSCCLPP_REFUSED_DST_OFFSET, end),
            (u64::MAX, 0, 1, MSCCLPP_REFUSED_DST_OFFSET, u64::MAX),
        ] {
            assert_eq!(trigger_refusal(dst, src, size), Some((what, value)));
            // What a producer queues instead: never an empty slot, decoded as the refusal.
            let w = trigger_encode_refused(what, value, 9);
            assert_ne!(w[0], 0);
            let r = Trigger::decode(w).unwrap_err();
            assert_eq!((r.conn_id, r.what), (9, what));
            assert_eq!(r.value, value.max(1));
            assert!(!r.describe().contains("unknown"), "{}", r.describe());
        }
        // Reserved bits (61, 62) make a type the proxy refuses.
        let mut w = trigger(mscclppData, 0, 0, 1, 0).encode();
        w[1] |= 1 << 61;
        assert!(Trigger::decode(w).unwrap().ty > MSCCLPP_TRIGGER_TYPE_MASK);
    }

    #[test]
    fn large_puts_split_into_chunks_with_the_flag_on_the_last() {
        let gib = 1u64 << 30;
        let ty = mscclppData | mscclppFlag | mscclppSync;
        let all: Vec<Trigger> = put_triggers(ty, 4 * gib + 8192, 0, 4 * gib + 4096, 2)
            .unwrap()
            .collect();
        assert_eq!(
            all,
            vec![
                trigger(mscclppData, 4 * gib + 8192, 0, 2 * gib, 2),
                trigger(ty, 6 * gib + 8192, 2 * gib, 2 * gib + 4096, 2),
            ]
        );
        // Exactly 2^32 bytes: two chunks, no trigger of size 0 and no empty word0.
        let two: Vec<Trigger> = put_triggers(ty, 0, 0, 1 << 32, 0).unwrap().collect();
        assert_eq!(two.len(), 2);
        assert_eq!(two.iter().map(|t| t.size).sum::<u64>(), 1 << 32);
        assert_eq!(two[1].ty, ty);
        assert!(two.iter().all(|t| t.encode()[0] != 0));
        // Up to 2^32 - 1 bytes: one trigger.
        let one: Vec<Trigger> = put_triggers(ty, 1, 2, MSCCLPP_TRIGGER_SIZE_MASK, 0)
            .unwrap()
            .collect();
        assert_eq!(one, vec![trigger(ty, 1, 2, MSCCLPP_TRIGGER_SIZE_MASK, 0)]);
        // Every byte of a put that ends exactly at 2^40 is carried; one byte more is refused
        // as a whole, whichever side passes the limit.
        let end = MSCCLPP_TRIGGER_MAX_END;
        let size = 5 * gib + 3;
        let t: Vec<Trigger> = put_triggers(ty, end - size, 0, size, 0).unwrap().collect();
        assert_eq!(t.iter().map(|t| t.size).sum::<u64>(), size);
        assert_eq!(t.last().map(|t| t.dst_off + t.size), Some(end));
        for (dst, src) in [(end - size + 1, 0), (0, end - size + 1)] {
            let r = put_triggers(ty, dst, src, size, 0).unwrap_err();
            assert_eq!((r.what, r.value), (MSCCLPP_REFUSED_SIZE, size));
        }
        assert_eq!(
            put_triggers(ty, 0, 0, 0, 0).unwrap_err().what,
            MSCCLPP_REFUSED_ZERO_SIZE
        );
    }

    #[test]
    fn wait_record_reads_what_a_kernel_wrote_and_not_a_write_in_progress() {
        let f = Fifo::new_host().unwrap();
        assert_eq!(
            f.wait_record().map(|r| r.state),
            Some(0),
            "a new FIFO has none"
        );
        let mut w = [0u64; 8];
        w[MSCCLPP_RECORD_SEQ] = 2;
        w[MSCCLPP_RECORD_WHAT] =
            MSCCLPP_WAIT_OP_WAIT | MSCCLPP_RECORD_PENDING << MSCCLPP_RECORD_STATE_SHIFT | 3 << 32;
        w[MSCCLPP_RECORD_WANTED] = 18;
        w[MSCCLPP_RECORD_SEEN] = 17;
        w[MSCCLPP_RECORD_DIRECT] = 12;
        w[MSCCLPP_RECORD_HEAD] = 40;
        w[MSCCLPP_RECORD_WAITED_NS] = 2_000_000_123;
        f.write_record_for_test(w);
        assert_eq!(
            f.wait_record(),
            Some(WaitRecord {
                seq: 2,
                state: MSCCLPP_RECORD_PENDING,
                op: MSCCLPP_WAIT_OP_WAIT,
                conn_id: 3,
                wanted: 18,
                seen: 17,
                direct: 12,
                head: 40,
                waited: std::time::Duration::from_nanos(2_000_000_123),
                others_expired: false,
            })
        );
        // An odd SEQ: the kernel is writing it; not read until it is even again.
        f.record_word(MSCCLPP_RECORD_SEQ)
            .store(3, Ordering::Relaxed);
        assert_eq!(f.wait_record(), None);
    }
}
