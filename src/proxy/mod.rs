//! Proxy threads: one per endpoint. Each polls its FIFO, checks every trigger against the
//! registered sizes, dispatches to its transport, retires the trigger, and keeps the transport
//! progressing when idle. A failure is sticky: stored once for the communicator, written to the
//! FIFO's abort word so producers stop waiting, and returned by `mscclppProxyStop`.

use crate::abi::{mscclppData, mscclppFlag, mscclppResult_t, mscclppSync};
use crate::error::{Error, Result};
use crate::fifo::{Fifo, Trigger};
use crate::sync::{lock, Backoff, Nap, Policy};
use crate::transport::{Endpoint, MrId, PeerId, RemoteId};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The first error of a communicator's background work, kept until the comm is destroyed.
#[derive(Default)]
pub struct Sticky {
    first: Mutex<Option<(mscclppResult_t, String)>>,
}

impl Sticky {
    /// Records `e` unless an earlier error is already stored; returns the stored code.
    pub fn set(&self, code: mscclppResult_t, msg: String) -> mscclppResult_t {
        let mut g = lock(&self.first);
        if g.is_none() {
            crate::warn!("proxy error (sticky for this communicator): {msg}");
            *g = Some((code, msg));
        }
        g.as_ref().map(|x| x.0).unwrap_or(code)
    }
    pub fn get(&self) -> Option<(mscclppResult_t, String)> {
        lock(&self.first).clone()
    }
}

/// Everything the proxy needs to act on one connection's triggers.
#[derive(Clone, Debug)]
pub struct ProxyConn {
    pub remote_rank: usize,
    pub peer: PeerId,
    pub src: MrId,
    pub local_size: u64,
    pub dst: RemoteId,
    pub remote_size: u64,
    /// The peer's epoch block; the signal count goes to offset 8 (`proxy`).
    pub remote_epoch: RemoteId,
    /// Flags sent so far: the value the next Flag writes is this + 1. Counting here rather than
    /// reading the producer's `device` epoch keeps the value in FIFO order with the data.
    pub signals: u64,
    /// The peer's epoch block, mapped (SHM over host memory), or its host signal word (P2P): a
    /// Flag may be a plain store (`direct_flag`).
    pub direct: Option<DirectEpoch>,
    /// A write on this connection went through the endpoint since its last flush.
    pub undelivered: bool,
    /// A lone Flag of this connection went through the endpoint though it has a direct path
    /// (something written before it may still be on its way, `undelivered`): once the FIFO is
    /// empty the proxy flushes the peer (`ProxyWork::regain_direct`), or every later signal
    /// would take the endpoint too until the user's next flush, which a ping-pong of
    /// signal/wait never makes (test `e2e_host::signals_regain_direct_shm`).
    pub regain_direct: bool,
}

pub type SharedEndpoint = Arc<Mutex<Box<dyn Endpoint>>>;

/// One FIFO's consumer: the FIFO, its connections and the endpoint they use. Shared between the
/// proxy thread and, for host FIFOs, the host threads that produce into it or wait on it: any
/// of them may hold the lock and do the proxy's work (`ProxyWork::service`). The lock keeps one
/// consumer at a time, so triggers still execute in FIFO order.
pub struct ProxyWork {
    /// Declared (so dropped) before the FIFO: the P2P SM copy engine stores into the FIFO's
    /// done word until its endpoint is dropped.
    pub endpoint: SharedEndpoint,
    pub fifo: Fifo,
    pub conns: Vec<ProxyConn>,
    /// Polled for peers that died: their loss aborts every wait on this FIFO.
    pub boot: Arc<crate::bootstrap::Bootstrap>,
    pub sticky: Arc<Sticky>,
    pub name: String,
    /// Between `launch` and the end of the thread, and only while no error occurred: only then
    /// may anyone consume (before launch, host producers' triggers wait for the proxy).
    active: bool,
    /// Host producers and waiters do this FIFO's work too (see `new`).
    assisted: bool,
    handled: u32,
    last_watch: Instant,
    /// Rounds of `service` so far (the clock is read once every `WATCH_EVERY` of them).
    rounds: u32,
    stop_seen: Option<Instant>,
    /// Host threads waiting on this FIFO while doing its work (host FIFOs only).
    gate: Arc<crate::fifo::HelperGate>,
}

pub type SharedWork = Arc<Mutex<ProxyWork>>;

/// What one `service` round found.
enum Round {
    /// Triggers were executed.
    Busy,
    /// Nothing to do; the endpoint was progressed.
    Idle,
    /// Asked to stop, and the FIFO is drained and flushed.
    Done,
}

impl ProxyWork {
    pub fn new(
        fifo: Fifo,
        endpoint: SharedEndpoint,
        boot: Arc<crate::bootstrap::Bootstrap>,
        sticky: Arc<Sticky>,
        name: String,
        assist: bool,
    ) -> SharedWork {
        // Host producers may do the work only if `assist`: an endpoint that can wedge when a
        // peer dies (libfabric 1.17 shm: locks in shared memory) must be entered by the proxy
        // thread alone, which can be abandoned; a user thread stuck there could not. They may
        // still deliver a signal that needs no endpoint call (`direct_signal`).
        let host_head = fifo
            .device()
            .is_none()
            .then(|| fifo.producer_view(0).triggerFifoHead);
        let gate = Arc::new(crate::fifo::HelperGate::default());
        let work = Arc::new(Mutex::new(ProxyWork {
            fifo,
            conns: Vec::new(),
            endpoint,
            boot,
            sticky,
            name,
            active: false,
            assisted: assist && host_head.is_some(),
            handled: 0,
            last_watch: Instant::now(),
            rounds: 0,
            stop_seen: None,
            gate: gate.clone(),
        }));
        if let Some(head) = host_head {
            let weak: Weak<dyn crate::fifo::Assist> =
                Arc::downgrade(&work) as Weak<Mutex<ProxyWork>>;
            crate::fifo::set_consumer(head, weak, assist, gate);
        }
        work
    }

    /// Records `e` as the communicator's sticky error, raises the abort word and stops
    /// consuming.
    fn fail(&mut self, e: &Error) {
        let code = e.code();
        self.sticky.set(code, format!("{}: {e}", self.name));
        self.fifo.abort_word().set(code);
        self.active = false;
    }

    /// One round of the proxy's work: up to a batch of triggers, or, when the FIFO is empty,
    /// progress of the endpoint (and the final drain once `stopping`).
    fn service(&mut self, stopping: bool) -> Result<Round> {
        // Reading the clock on every round cost ~1% of a tcp transfer's CPU time (`perf`, 2-core
        // VM); a dead peer is noticed within the period plus WATCH_EVERY rounds.
        self.rounds = self.rounds.wrapping_add(1);
        if self.rounds % WATCH_EVERY == 0 && self.last_watch.elapsed() > PEER_WATCH_PERIOD {
            self.last_watch = Instant::now();
            check_peers(self)?;
        }
        let mut n = 0;
        while n < BATCH {
            let Some(words) = self.fifo.peek() else { break };
            let t = Trigger::decode(words);
            handle(self, &t)?;
            self.fifo.pop(t.ty & mscclppSync != 0);
            n += 1;
            self.handled = self.handled.wrapping_add(1);
            if self.handled % BUSY_PROGRESS_EVERY == 0 {
                // Writes posted must also move while triggers keep coming: a socket provider
                // sends only when progressed, and a host producer's every push is a Busy round
                // (4 MiB puts over tcp ran at 77% of raw fi_write without this).
                lock(&self.endpoint).progress()?;
            }
            if self.handled % BUSY_INCOMING_EVERY == 0 {
                // A FIFO that never empties must not starve the peers' writes into us.
                lock(&self.endpoint).poll_incoming()?;
            }
        }
        if n > 0 {
            self.stop_seen = None;
            return Ok(Round::Busy);
        }
        if stopping {
            // A producer may have taken a ticket and not yet written its slot; give it a short
            // grace period, then finish.
            let t0 = *self.stop_seen.get_or_insert_with(Instant::now);
            if t0.elapsed() > Duration::from_millis(20) {
                let mut ep = lock(&self.endpoint);
                ep.poll_incoming()?;
                let mut peers: Vec<PeerId> = self.conns.iter().map(|c| c.peer).collect();
                peers.sort_unstable();
                peers.dedup();
                for p in peers {
                    ep.flush(p)?;
                }
                // Nothing of ours may keep running on the GPU once the proxy is stopped.
                ep.quiesce()?;
                return Ok(Round::Done);
            }
        }
        if self.conns.iter().any(|c| c.regain_direct) {
            self.regain_direct()?;
        }
        let mut ep = lock(&self.endpoint);
        ep.progress()?;
        // Writes peers made into us that need our work before our waiters may see them (net
        // staging); after progress, which may just have delivered some.
        ep.poll_incoming()?;
        Ok(Round::Idle)
    }

    /// With the FIFO empty: flushes each peer that a connection with a direct path sent a Flag
    /// to through the endpoint (`ProxyConn::regain_direct`), so that its next signals may be
    /// stores again. One delivery-complete round trip per such episode, off the producer's
    /// thread; bounded like every flush.
    fn regain_direct(&mut self) -> Result<()> {
        let mut ep = lock(&self.endpoint);
        while let Some(peer) = self.conns.iter().find(|c| c.regain_direct).map(|c| c.peer) {
            ep.flush(peer)?;
            flushed(&mut self.conns, peer);
        }
        Ok(())
    }
}

/// After a flush of `peer`: everything written to it has arrived, on every connection to it.
fn flushed(conns: &mut [ProxyConn], peer: PeerId) {
    for x in conns.iter_mut().filter(|x| x.peer == peer) {
        x.undelivered = false;
        x.regain_direct = false;
    }
}

/// Host threads that push into, or wait on, a host FIFO do the proxy's work themselves when
/// nobody else is doing it: the trigger is executed on the producer's own core, and a waiter
/// progresses the endpoint through which its data arrives. On a machine with fewer cores than
/// busy threads this removes the hand-offs between threads from every round trip.
impl crate::fifo::Assist for Mutex<ProxyWork> {
    fn assist(&self) -> bool {
        // try_lock: if the proxy thread (or another producer) is consuming, it does the work.
        let Ok(mut w) = self.try_lock() else {
            return false;
        };
        if w.active {
            if let Err(e) = w.service(false) {
                w.fail(&e);
            }
        }
        true
    }

    fn direct_signal(&self, conn: usize) -> bool {
        // The lock (try_lock: never wait) keeps the proxy out of this connection's state, and
        // an empty FIFO means every trigger this thread pushed before was executed: the signal
        // then follows them as a trigger would.
        // The proxy thread takes the lock for each of its rounds (short unless it is stuck in
        // the transport): a few tries, then the trigger path, which has bounded waits.
        let mut tries = 0;
        let mut w = loop {
            match self.try_lock() {
                Ok(w) => break w,
                Err(_) if tries < 64 => {
                    tries += 1;
                    std::hint::spin_loop();
                }
                Err(_) => return false,
            }
        };
        if !w.active || !w.fifo.is_empty() {
            return false;
        }
        w.conns.get_mut(conn).is_some_and(direct_flag)
    }
}

/// The peer's epoch block mapped into this process (SHM connections over host memory, see
/// `mem::SharedBlock`), or the host word of a P2P peer's epoch block (`transport::epoch::SignaledEpoch`,
/// which the peer's wait() polls beside the count the engines store).
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
fn direct_flag(c: &mut ProxyConn) -> bool {
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

pub struct Running {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Result<()>>,
}

/// Starts a named proxy thread over `work`.
pub fn launch(work: SharedWork) -> Result<Running> {
    let (name, device, assisted, gate) = {
        let mut w = lock(&work);
        // A peer that dies while the transport waits for it (a flush, a full queue) ends that
        // wait at once, as it ends an idle proxy's loop (`check_peers`).
        let (boot, ranks) = (
            w.boot.clone(),
            w.conns.iter().map(|c| c.remote_rank).collect::<Vec<_>>(),
        );
        lock(&w.endpoint).set_abort_check(Box::new(move || lost_peer_of(&boot, &ranks)));
        w.active = true;
        w.stop_seen = None;
        (w.name.clone(), w.fifo.device(), w.assisted, w.gate.clone())
    };
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let work2 = work.clone();
    let spawned = std::thread::Builder::new().name(name).spawn(move || {
        // The FIFO's device is the endpoint's: its copies and streams live in that device's
        // primary context.
        crate::cuda::bind_proxy_thread(device);
        gate.set_proxy_thread(assisted.then(std::thread::current));
        let r = run(&work2, &stop2, assisted.then_some(&*gate));
        gate.set_proxy_thread(None);
        r
    });
    match spawned {
        Ok(handle) => Ok(Running { stop, handle }),
        Err(e) => {
            lock(&work).active = false;
            Err(Error::sys("spawning the proxy thread", e))
        }
    }
}

impl Running {
    /// Asks the thread to finish the triggers already in the FIFO, then joins it.
    pub fn stop(self) -> Result<()> {
        self.stop_within(Duration::MAX).0
    }

    /// As [`Running::stop`], waiting at most `bound`. Returns the thread's result, and true if
    /// the thread was abandoned instead: still inside a call that never returns (libfabric
    /// 1.17's shm provider spins forever on a lock in shared memory that a peer killed inside
    /// the provider left held). It keeps what it holds (the FIFO, the endpoint and its locks);
    /// the caller must not touch them again.
    pub fn stop_within(self, bound: Duration) -> (Result<()>, bool) {
        // Release pairs with the Acquire load in `run`.
        self.stop.store(true, Ordering::Release);
        let t0 = Instant::now();
        // Ends when the thread finishes, or at `bound`.
        while !self.handle.is_finished() {
            if t0.elapsed() > bound {
                let e = Error::remote(format!(
                    "the proxy thread did not stop within {bound:?}: it is stuck inside the transport (a peer that died inside libfabric's shm provider leaves a lock held); abandoned with its endpoint"
                ));
                crate::warn!("{e}");
                return (Err(e), true);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let r = self
            .handle
            .join()
            .unwrap_or_else(|_| Err(Error::internal("the proxy thread panicked")));
        (r, false)
    }
}

/// The proxy thread. Ends when stopped (after draining), or at the first error, which it
/// records (sticky error, abort word) before returning it. `gate`: host threads do this
/// FIFO's work too (assisted FIFOs).
fn run(
    work: &Mutex<ProxyWork>,
    stop: &AtomicBool,
    gate: Option<&crate::fifo::HelperGate>,
) -> Result<()> {
    // Idle rounds pause by this policy; it never expires (the loop ends on `stop` or an
    // error), so its bound is unused.
    let mut backoff = Backoff::new(
        if gate.is_some() { IDLE_ASSISTED } else { IDLE },
        Duration::MAX,
    );
    let mut idle = false;
    loop {
        // While a host thread waits on this FIFO doing its work (every step of its wait is a
        // round of it), or just executed its own trigger, stand aside: park a little at a time
        // (`HelperGate`), never once asked to stop. Measured on the 2-core VM, 8 runs
        // alternating with the code before (bench/RESULTS.md): 1 MiB puts over tcp 5.16 ->
        // 5.61 GB/s, 4 MiB over net 4.25 -> 4.64 GB/s. Acquire pairs with `Running::stop`.
        let aside = gate.map_or(Duration::ZERO, |g| g.stand_aside());
        if !aside.is_zero() && !stop.load(Ordering::Acquire) {
            std::thread::park_timeout(aside);
            continue;
        }
        let round = {
            let mut w = lock(work);
            if !w.active {
                // A host thread's assist failed and recorded the error: report that one, with
                // its code (mscclppProxyStop returns the first error the proxy's work met).
                let (code, msg) = w.sticky.get().unwrap_or((
                    crate::abi::mscclppResult_t::mscclppInternalError,
                    String::new(),
                ));
                return Err(Error::Earlier(code, msg));
            }
            // Acquire pairs with `Running::stop`.
            match w.service(stop.load(Ordering::Acquire)) {
                Ok(Round::Done) => {
                    w.active = false;
                    return Ok(());
                }
                Ok(r) => r,
                Err(e) => {
                    w.fail(&e);
                    // Best effort (the endpoint may be what failed): as at a normal stop.
                    if let Err(q) = lock(&w.endpoint).quiesce() {
                        crate::warn!("{}: after the error, quiescing failed too: {q}", w.name);
                    }
                    return Err(e);
                }
            }
        };
        match round {
            Round::Busy => idle = false,
            _ => {
                if !idle {
                    backoff.reset();
                    idle = true;
                }
                backoff.pause();
            }
        }
    }
}

/// Triggers one `service` round executes before it lets go of the lock.
const BATCH: u32 = 32;

/// While busy, the proxy finishes incoming writes (`Endpoint::poll_incoming`) after this many
/// triggers; when idle, on every round.
const BUSY_INCOMING_EVERY: u32 = 64;

/// While busy, the proxy progresses its endpoint after this many triggers; when idle, on every
/// round.
const BUSY_PROGRESS_EVERY: u32 = 4;

/// How often the proxy asks the bootstrap whether a connected peer vanished.
const PEER_WATCH_PERIOD: Duration = Duration::from_millis(10);
/// Rounds of `service` between two looks at the clock for that period.
const WATCH_EVERY: u32 = 64;

/// Fails when a peer of one of this proxy's connections died (no goodbye on its bootstrap
/// connection): the caller turns that into the sticky error and the abort word.
fn check_peers(w: &ProxyWork) -> Result<()> {
    let ranks: Vec<usize> = w.conns.iter().map(|c| c.remote_rank).collect();
    match lost_peer_of(&w.boot, &ranks) {
        Some(why) => Err(Error::remote(why)),
        None => Ok(()),
    }
}

/// "peer lost: why" when one of `ranks` died (one atomic load while none did).
fn lost_peer_of(boot: &crate::bootstrap::Bootstrap, ranks: &[usize]) -> Option<String> {
    match boot.lost_peer() {
        Some((rank, why)) if ranks.contains(&rank) => Some(format!("peer lost: {why}")),
        _ => None,
    }
}

/// Idle policy: spin, then yield for a while (hands the core to producers and peers on an
/// oversubscribed machine without a sleep's timer slack), then short naps so that an idle
/// communicator does not hold a core.
const IDLE: Policy = Policy {
    spins: 8,
    yield_for: Duration::from_millis(20),
    nap: Nap::Fixed(Duration::from_micros(20)),
};
/// Assisted FIFOs nap sooner: their producers and waiters do the proxy's work themselves
/// (`Assist`), so the thread only covers the gaps.
const IDLE_ASSISTED: Policy = Policy {
    yield_for: Duration::from_millis(1),
    ..IDLE
};

/// Checks one trigger against the connection's registered sizes, then acts on it.
fn handle(w: &mut ProxyWork, t: &Trigger) -> Result<()> {
    let ticket = w.fifo.ticket();
    let nconns = w.conns.len();
    // Only host FIFOs regain the direct path by a flush: a P2P flush waits for the GPU's copies,
    // which a kernel's next trigger must not queue behind.
    let host_fifo = w.fifo.device().is_none();
    let c = w.conns.get_mut(t.conn_id).ok_or_else(|| {
        Error::invalid_arg(format!(
            "trigger for connection {} but this proxy has {nconns}",
            t.conn_id
        ))
    })?;
    if t.ty == 0 || t.ty & !(mscclppData | mscclppFlag | mscclppSync) != 0 {
        return Err(Error::invalid_arg(format!(
            "trigger with unknown type {:#x}",
            t.ty
        )));
    }
    let mut ep = lock(&w.endpoint);
    ep.set_ticket(ticket);
    if t.ty & mscclppData != 0 {
        check_range("source", t.src_off, t.size, c.local_size, c.remote_rank)?;
        check_range(
            "destination",
            t.dst_off,
            t.size,
            c.remote_size,
            c.remote_rank,
        )?;
        c.undelivered = true;
        if t.ty & mscclppFlag != 0 {
            c.signals += 1;
            let flag = (c.remote_epoch, 8, c.signals);
            ep.write_then_value(c.peer, c.src, t.src_off, c.dst, t.dst_off, t.size, flag)?;
        } else {
            ep.write(c.peer, c.src, t.src_off, c.dst, t.dst_off, t.size)?;
        }
    } else if t.ty & mscclppFlag != 0 && !direct_flag(c) {
        c.undelivered = true;
        // (A Sync in the same trigger clears it again below.)
        c.regain_direct = c.direct.is_some() && host_fifo;
        c.signals += 1;
        ep.write_value(c.peer, c.remote_epoch, 8, c.signals)?;
    }
    if t.ty & mscclppSync != 0 {
        let peer = c.peer;
        ep.flush(peer)?;
        drop(ep);
        flushed(&mut w.conns, peer);
    }
    Ok(())
}

fn check_range(side: &str, off: u64, size: u64, limit: u64, peer: usize) -> Result<()> {
    if size == 0 || off.checked_add(size).is_none_or(|end| end > limit) {
        return Err(Error::invalid_arg(format!(
            "put refused: {side} range [{off}, {off}+{size}) is outside the {limit}-byte buffer registered on the connection to rank {peer}"
        )));
    }
    Ok(())
}
