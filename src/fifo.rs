//! The trigger FIFO between producers (GPU threads, or host threads for host-memory
//! connections) and one proxy thread.
//!
//! Protocol (DESIGN.md, "Trigger FIFO"): a producer takes a ticket `head` with a fetch-add, waits
//! until `head < SIZE + tail` and the slot is empty, then stores word1 and word0 of the trigger;
//! word0 is never 0 for a real trigger. The proxy reads the slot at its tail, acts, zeroes the slot
//! and advances its tail, publishing it every `MSCCLPP_PROXY_FIFO_FLUSH_COUNTER` triggers and on
//! every Sync. The u64 after the tail is the abort word: non-zero ends every producer spin.

use crate::abi::*;
use crate::error::{Error, Result};
use crate::mem::HostBlock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, RwLock, Weak};
use std::time::{Duration, Instant};

/// Whoever consumes a host FIFO, reachable from its producers (see `proxy::ProxyWork`).
pub trait Assist: Send + Sync {
    /// Does a round of the consumer's work if nobody else is doing it; never blocks on it.
    /// True if this thread did it (false: another thread holds the consumer).
    fn assist(&self) -> bool;
    /// Delivers a signal on connection `conn` at once, without a trigger, if that is allowed
    /// now (nothing queued or undelivered before it, and a transport that needs no call for
    /// it); false: push the trigger. Never blocks.
    fn direct_signal(&self, conn: usize) -> bool;
}

/// Host threads that wait on a FIFO while doing its consumer's work (`Spin`), counted so that
/// the proxy thread can stand aside meanwhile (`proxy::run`): on a machine with fewer cores than
/// busy threads, a second thread taking turns at the same work only costs the first one its
/// core, and both of them the futex hand-offs of the consumer's lock.
///
/// The proxy thread parks for `ASIDE` at a time and looks again. A waiter that leaves after a
/// long wait (`LONG_WAIT`: a transfer) wakes it at once; one that leaves after a short wait
/// does not: the futex wake on the waiter's way back to the caller (and on 2 cores the waiter
/// preempted by the woken thread) made an 8-byte putWithSignal round trip over tcp 27 us
/// instead of 8. Parking 50 us at a time instead of waking it cost bulk transfers ~15% (the
/// parked thread's wake-ups take the helpers' cores).
pub struct HelperGate {
    helpers: AtomicU32,
    /// The proxy thread, woken when a long-waiting helper leaves.
    proxy: std::sync::Mutex<Option<std::thread::Thread>>,
    /// When a host producer last executed triggers itself (`host_push`), in ns since `epoch`
    /// (0: not since the last time it found the consumer busy).
    last_push_assist: AtomicU64,
    epoch: Instant,
}

impl Default for HelperGate {
    fn default() -> Self {
        HelperGate {
            helpers: AtomicU32::new(0),
            proxy: std::sync::Mutex::new(None),
            last_push_assist: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

/// How long after a host producer executed its own trigger the proxy thread keeps standing
/// aside: a stream of pushes (each executing itself) needs no second thread.
const PUSH_ASSIST_HOLD: Duration = Duration::from_micros(200);
/// The longest the proxy thread parks before it looks again (the kernel adds its timer slack,
/// ~50 us): bounds how long endpoint progress pauses once host threads stop helping after
/// short waits.
const ASIDE: Duration = Duration::from_micros(250);
/// A helper that waited longer than this wakes the proxy thread when it leaves.
const LONG_WAIT: Duration = Duration::from_micros(100);

impl HelperGate {
    fn enter(&self) {
        // Relaxed, here and below: the count is a hint; the consumer's lock orders the work.
        self.helpers.fetch_add(1, Ordering::Relaxed);
    }
    /// `waited`: how long this helper waited.
    fn leave(&self, waited: Duration) {
        if self.helpers.fetch_sub(1, Ordering::Relaxed) == 1 && waited > LONG_WAIT {
            if let Some(t) = self
                .proxy
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
            {
                t.unpark();
            }
        }
    }
    /// Names the thread that a long-waiting helper wakes when it leaves (the proxy thread).
    pub fn set_proxy_thread(&self, t: Option<std::thread::Thread>) {
        *self.proxy.lock().unwrap_or_else(|p| p.into_inner()) = t;
    }
    /// How long the proxy thread should park now (zero: not at all): while some host thread
    /// waits doing the consumer's work, or shortly after a producer executed its own trigger.
    pub fn stand_aside(&self) -> Duration {
        self.stand_aside_with(|| self.now())
    }
    /// As `stand_aside`, with `now` (ns since `epoch`) read only if a push's hold may run: the
    /// proxy thread asks on every round, and reading the clock on each one cost ~1% of a tcp
    /// transfer (see `ProxyWork::service`). A hold that ran out is cleared for the same reason.
    fn stand_aside_with(&self, now: impl FnOnce() -> u64) -> Duration {
        if self.helpers.load(Ordering::Relaxed) > 0 {
            return ASIDE;
        }
        let last = self.last_push_assist.load(Ordering::Relaxed);
        if last == 0 {
            return Duration::ZERO;
        }
        let rest =
            PUSH_ASSIST_HOLD.saturating_sub(Duration::from_nanos(now().saturating_sub(last)));
        if rest.is_zero() {
            // Only if no newer push stored its time meanwhile.
            let _ = self.last_push_assist.compare_exchange(
                last,
                0,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
        rest.min(ASIDE)
    }
    fn now(&self) -> u64 {
        // At least 1: 0 means "no push to stand aside for".
        (self.epoch.elapsed().as_nanos() as u64).max(1)
    }
    /// A producer executed triggers itself.
    fn pushed_and_assisted(&self) {
        self.pushed_and_assisted_at(self.now());
    }
    fn pushed_and_assisted_at(&self, now: u64) {
        self.last_push_assist.store(now, Ordering::Relaxed);
    }
    /// A producer found the consumer busy: the proxy thread must not stay aside for it (the
    /// thread holding the consumer may have finished its round before this trigger).
    fn nudge(&self) {
        self.last_push_assist.store(0, Ordering::Relaxed);
    }
}

/// The consumer of a host FIFO, whether host threads may do its work (`assist`), and whether
/// any of its connections can take a signal without a trigger (`direct_signal`).
struct Consumer {
    work: Weak<dyn Assist>,
    helps: bool,
    direct: bool,
    gate: Arc<HelperGate>,
}

/// Head addresses of the live host-memory FIFOs, with their consumer once the communicator has
/// one. The host-driven API accepts a connection only if its FIFO is here, so a device-memory or
/// foreign `mscclppDevConn` is an error rather than a stray access.
type HostFifos = HashMap<usize, Option<Consumer>>;
static HOST_FIFOS: LazyLock<RwLock<HostFifos>> = LazyLock::new(Default::default);

fn host_fifos() -> std::sync::RwLockReadGuard<'static, HostFifos> {
    HOST_FIFOS.read().unwrap_or_else(|p| p.into_inner())
}

/// True if `head` belongs to a live host-memory FIFO of this process.
pub fn is_host_fifo(head: *const u64) -> bool {
    host_fifos().contains_key(&(head as usize))
}

/// Names the consumer of the host FIFO whose head is `head`; `helps`: host threads may do its
/// work (`assist`), and count themselves in `gate` while they wait doing it.
pub fn set_consumer(head: *const u64, work: Weak<dyn Assist>, helps: bool, gate: Arc<HelperGate>) {
    if let Some(e) = HOST_FIFOS
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .get_mut(&(head as usize))
    {
        *e = Some(Consumer {
            work,
            helps,
            direct: false,
            gate,
        });
    }
}

/// Notes that a connection of the host FIFO at `head` can take signals directly (SHM over
/// host memory): only then does `direct_signal` try the consumer, whose lock it may have to
/// wait a little for.
pub fn set_direct(head: *const u64) {
    if let Some(Some(c)) = HOST_FIFOS
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .get_mut(&(head as usize))
    {
        c.direct = true;
    }
}

/// What `take` makes of the consumer of the host FIFO at `head`, if it has one that `wanted`
/// accepts and that still lives.
fn lookup<T>(
    head: *const u64,
    wanted: impl Fn(&Consumer) -> bool,
    take: impl FnOnce(&Consumer, Arc<dyn Assist>) -> T,
) -> Option<T> {
    let fifos = host_fifos();
    let c = fifos
        .get(&(head as usize))?
        .as_ref()
        .filter(|c| wanted(c))?;
    Some(take(c, c.work.upgrade()?))
}

/// The consumer of the host FIFO at `head`, if it has one that `wanted` accepts.
fn consumer(head: *const u64, wanted: impl Fn(&Consumer) -> bool) -> Option<Arc<dyn Assist>> {
    lookup(head, wanted, |_, work| work)
}

/// As `consumer`, with its helper gate.
fn consumer_and_gate(
    head: *const u64,
    wanted: impl Fn(&Consumer) -> bool,
) -> Option<(Arc<dyn Assist>, Arc<HelperGate>)> {
    lookup(head, wanted, |c, work| (work, c.gate.clone()))
}

/// Lets the calling host thread, which just pushed a trigger, do a round of the consumer's work
/// for the FIFO at `head`, and tells the proxy thread whether it still has to (`HelperGate`).
fn assist_after_push(head: *const u64) {
    if let Some((c, gate)) = consumer_and_gate(head, |c| c.helps) {
        if c.assist() {
            gate.pushed_and_assisted();
        } else {
            gate.nudge();
        }
    }
}

/// What a waiting host thread found when it offered its help (`Spin::step`).
enum Help {
    /// It did a round of the consumer's work.
    Did,
    /// Another thread is doing it right now.
    Busy,
    /// Nobody it may help (not launched yet, or only the proxy thread may do the work).
    None,
}

/// See [`Assist::direct_signal`]: true if the signal on connection `conn` of the host FIFO at
/// `head` was delivered without a trigger.
pub fn direct_signal(head: *const u64, conn: usize) -> bool {
    consumer(head, |c| c.direct).is_some_and(|c| c.direct_signal(conn))
}

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
    _mem: FifoMem,
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

/// Shared handle to a FIFO's abort word, for the API thread (valid while the comm lives).
#[derive(Clone, Copy)]
pub struct AbortWord(*mut u64);
// SAFETY: the word is only touched through atomics; the comm keeps its memory alive.
unsafe impl Send for AbortWord {}
unsafe impl Sync for AbortWord {}

impl AbortWord {
    /// Stores an error code for every producer to see. Release pairs with the Acquire loads in
    /// the producers' spin loops.
    pub fn set(&self, code: mscclppResult_t) {
        // SAFETY: points to a live, 8-byte aligned u64 (see type doc).
        unsafe { AtomicU64::from_ptr(self.0) }.store(code as u64, Ordering::Release);
    }
}

impl Fifo {
    /// A FIFO in ordinary host memory, for host-memory connections.
    pub fn new_host() -> Result<Self> {
        let slots = HostBlock::zeroed(SIZE as usize * 16, 64)?;
        let ctrl = HostBlock::zeroed(16, 64)?;
        let head = HostBlock::zeroed(8, 64)?;
        HOST_FIFOS
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(head.ptr() as usize, None);
        Ok(Fifo {
            slots: slots.ptr().cast(),
            ctrl: ctrl.ptr().cast(),
            head: head.ptr().cast(),
            tail: 0,
            prod_slots: slots.ptr().cast(),
            prod_ctrl: ctrl.ptr().cast(),
            _mem: FifoMem::Host {
                _slots: slots,
                _ctrl: ctrl,
                _head: head,
            },
        })
    }

    /// A FIFO whose producers are kernels on CUDA `device` (layout: see `FifoMem::Cuda`).
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
            _mem: FifoMem::Cuda {
                device,
                _host: host,
                _head: head,
            },
        })
    }

    /// The CUDA device whose kernels produce into this FIFO (None: host producers).
    pub fn device(&self) -> Option<i32> {
        match &self._mem {
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
        match &self._mem {
            FifoMem::Host { .. } => None,
            FifoMem::Cuda { _head, .. } => Some(_head.ptr() + DEV_DONE as u64 * 8),
        }
    }

    /// Tells the producers to poll the done word in their flush() (once, before any kernel
    /// uses the FIFO: a stream write followed by a wait).
    pub fn enable_done_word(&self) -> Result<()> {
        match &self._mem {
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
}

impl Drop for Fifo {
    fn drop(&mut self) {
        if !matches!(self._mem, FifoMem::Host { .. }) {
            return;
        }
        HOST_FIFOS
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(self.head as usize));
    }
}

/// How long host producers wait for the proxy or a peer before giving up
/// (`MSCCLPP_WAIT_TIMEOUT` seconds; default: the bootstrap timeout).
pub fn wait_timeout() -> Duration {
    std::env::var("MSCCLPP_WAIT_TIMEOUT")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .map(Duration::from_secs_f64)
        .unwrap_or_else(crate::bootstrap::timeout)
}

/// A spin that ends on the abort word, or the deadline. A waiter that does the proxy's work
/// (`assist`) keeps doing it, spinning and yielding now and then, never napping. One that
/// cannot help yields, and only after a long quiet period naps: on an oversubscribed machine
/// (CI: 2 cores running 4 ranks and their proxies) yielding hands the core to the thread we
/// wait for at once, while a sleep costs at least the kernel's timer slack (~50 us) per round
/// trip.
pub(crate) struct Spin {
    abort: *const u64,
    /// The FIFO's head: identifies the consumer this waiter helps (`assist`).
    head: *const u64,
    /// That consumer, looked up once (and again now and then while there is none: the proxy
    /// may be launched during the wait) rather than in the registry on every step, which
    /// took a fifth of the CPU time of a tcp transfer on the 2-core VM.
    consumer: Option<(Arc<dyn Assist>, Arc<HelperGate>)>,
    /// This waiter counted itself in the consumer's gate (from its first step on; a push that
    /// finds room at once never does).
    entered: bool,
    start: Instant,
    deadline: Duration,
    n: u32,
}

impl Drop for Spin {
    fn drop(&mut self) {
        if let (true, Some((_, gate))) = (self.entered, &self.consumer) {
            gate.leave(self.start.elapsed());
        }
    }
}

/// Spin iterations before yielding, and how long to keep yielding before napping.
const SPIN_ITERS: u32 = 256;
const YIELD_FOR: Duration = Duration::from_millis(20);
/// Polls before a waiter that cannot help starts yielding.
const UNHELPED_SPINS: u32 = 8;
/// After `YIELD_FOR`, a waiter that cannot help naps for this fraction of what it has waited
/// (at most `NAP_MAX`): it then wakes at most 1/64 of its wait late, and seldom enough not to
/// matter to the thread doing the work. Each wake-up takes that thread's core for ~7 us on
/// the 2-core VM (`perf sched timehist`): with the fixed 50 us naps before, the receiver's
/// waiter took ~7 us of every ~117 us of a 1 MiB shm transfer's copying thread: 88% of raw
/// `fi_write` against 94% with naps of 1/64 in 24 rotated rounds (bench/RESULTS.md: of two
/// 16-round batches, one agrees and one shows no change).
const NAP_FRACTION: u32 = 64;
const NAP_MAX: Duration = Duration::from_millis(1);

impl Spin {
    /// A wait on the host FIFO `fifo` (its abort word ends the wait).
    pub(crate) fn new(fifo: &mscclppConcurrentFifo, deadline: Duration) -> Self {
        Spin {
            // SAFETY: the abort word follows the tail in every FIFO's control block.
            abort: unsafe { fifo.triggerFifoTail.add(1) },
            head: fifo.triggerFifoHead,
            consumer: consumer_and_gate(fifo.triggerFifoHead, |c| c.helps),
            entered: false,
            start: Instant::now(),
            deadline,
            n: 0,
        }
    }
    /// One step of waiting: Ok while the caller should keep waiting, Err when it must stop.
    pub(crate) fn step(&mut self, what: &str) -> Result<()> {
        // SAFETY: `abort` points into a live FIFO control block (the caller's DevConn).
        let a = unsafe { AtomicU64::from_ptr(self.abort as *mut u64) }.load(Ordering::Acquire);
        if a != 0 {
            return Err(Error::remote(format!("{what}: the communicator was aborted (error code {a}); see mscclppCommGetAsyncError")));
        }
        self.n = self.n.saturating_add(1);
        // What we wait for may need the proxy's work (our trigger executed, the endpoint through
        // which the peer's data comes progressed): do it here rather than wait for a thread
        // that may not even have a core.
        if self.consumer.is_none() && self.n % SPIN_ITERS == 0 {
            self.consumer = consumer_and_gate(self.head, |c| c.helps);
        }
        if let (false, Some((_, gate))) = (self.entered, &self.consumer) {
            gate.enter();
            self.entered = true;
        }
        let help = match &self.consumer {
            Some((c, _)) if c.assist() => Help::Did,
            Some(_) => Help::Busy,
            None => Help::None,
        };
        if !matches!(help, Help::None) {
            // Checked every 64 steps: reading the clock on every one cost ~4% of a tcp
            // transfer's CPU time on the 2-core VM.
            if self.n % 64 == 0 && self.start.elapsed() > self.deadline {
                return Err(Error::timeout(what.to_string(), self.deadline));
            }
            // Helping: this thread progresses the endpoint (the proxy thread naps while host
            // threads assist), so it must not nap, or a long transfer over a socket provider
            // moves one chunk per nap (64 KiB puts over tcp fell to 1 GB/s after 20 ms of
            // waiting). It spins, yielding now and then; and at once while another thread
            // holds the consumer, which then has the work to do and may need this core.
            if matches!(help, Help::Busy) || self.n % SPIN_ITERS == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            return Ok(());
        }
        let waited = self.start.elapsed();
        if waited > self.deadline {
            return Err(Error::timeout(what.to_string(), self.deadline));
        }
        // Without help to give, the proxy thread does the work: on a machine with fewer cores
        // than busy threads, yielding soon hands it the core. A few polls first: a signal
        // stored straight into our epoch (SHM, `proxy::direct_flag`) needs no other thread.
        if self.n < UNHELPED_SPINS {
            std::hint::spin_loop();
        } else if waited < YIELD_FOR {
            std::thread::yield_now();
        } else {
            std::thread::sleep((waited / NAP_FRACTION).min(NAP_MAX));
        }
        Ok(())
    }
}

/// Host producer: pushes one trigger, returns its ticket. The conn's FIFO must be in host memory.
///
/// # Safety
/// `fifo` must be the producer view of a live host-memory FIFO.
pub unsafe fn host_push(fifo: &mscclppConcurrentFifo, w: [u64; 2]) -> Result<u64> {
    debug_assert!(w[0] != 0 && w[1] != 0);
    let head = AtomicU64::from_ptr(fifo.triggerFifoHead);
    let tail = AtomicU64::from_ptr(fifo.triggerFifoTail);
    // The ticket only has to be unique; ordering comes from the slot words.
    let h = head.fetch_add(1, Ordering::Relaxed);
    let mut spin = Spin::new(fifo, wait_timeout());
    // Acquire pairs with the proxy's Release publication of the tail; ends when the proxy has
    // retired ticket h - SIZE, on abort, or at the deadline.
    while h >= SIZE + tail.load(Ordering::Acquire) {
        spin.step("waiting for room in the proxy FIFO")?;
    }
    let p = fifo.triggerFifo.add((h % SIZE) as usize) as *mut u64;
    let (w0, w1) = (AtomicU64::from_ptr(p), AtomicU64::from_ptr(p.add(1)));
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

/// Host producer: waits until the proxy has retired ticket `h` (its slot zeroed or the tail
/// past it), on abort or deadline an error.
///
/// # Safety
/// As for [`host_push`].
pub unsafe fn host_wait_retired(fifo: &mscclppConcurrentFifo, h: u64) -> Result<()> {
    let tail = AtomicU64::from_ptr(fifo.triggerFifoTail);
    let w0 = AtomicU64::from_ptr(fifo.triggerFifo.add((h % SIZE) as usize) as *mut u64);
    let mut spin = Spin::new(fifo, wait_timeout());
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

    #[test]
    fn helper_gate_sets_the_proxy_aside_while_helped() {
        // Explicit times (ns since the gate's epoch): a slow run (valgrind) must not matter.
        let gate = HelperGate::default();
        assert!(
            gate.stand_aside_with(|| 1_000).is_zero(),
            "nobody helps yet"
        );
        gate.pushed_and_assisted_at(1_000);
        assert_eq!(gate.stand_aside_with(|| 1_000), ASIDE.min(PUSH_ASSIST_HOLD));
        let hold = PUSH_ASSIST_HOLD.as_nanos() as u64;
        assert_eq!(
            gate.stand_aside_with(|| 1_000 + hold - 10_000),
            Duration::from_micros(10).min(ASIDE),
            "the rest of the hold"
        );
        assert!(
            gate.stand_aside_with(|| 1_000 + hold).is_zero(),
            "the hold ran out"
        );
        assert!(gate
            .stand_aside_with(|| unreachable!("a cleared hold reads no clock"))
            .is_zero());
        gate.pushed_and_assisted_at(5_000);
        gate.nudge();
        assert!(
            gate.stand_aside_with(|| 5_000).is_zero(),
            "a producer that found the consumer busy"
        );
        gate.enter();
        gate.enter();
        assert_eq!(gate.stand_aside(), ASIDE);
        gate.leave(Duration::ZERO);
        assert_eq!(gate.stand_aside(), ASIDE, "one waiter still helps");
        gate.leave(Duration::ZERO);
        assert!(gate.stand_aside().is_zero(), "nobody helps any more");
    }

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
            unsafe { host_push(&view, w) }.unwrap();
        }
        let abort = f.abort_word();
        let v = view;
        struct SendView(mscclppConcurrentFifo);
        unsafe impl Send for SendView {}
        let sv = SendView(v);
        let th = std::thread::spawn(move || {
            let sv = sv;
            unsafe { host_push(&sv.0, w) }
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!th.is_finished(), "a push into a full FIFO must wait");
        abort.set(mscclppResult_t::mscclppRemoteError);
        let r = th.join().unwrap();
        assert!(matches!(r, Err(Error::Remote(_))), "{r:?}");
    }
}
