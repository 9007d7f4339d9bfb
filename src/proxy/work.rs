//! One FIFO's consumer (`ProxyWork`): a `service` round drains a batch of triggers, checking
//! each against the registered sizes and dispatching it to the endpoint, or progresses the
//! endpoint when idle; it also watches for lost peers. Whoever holds the lock runs it: the proxy
//! thread (`thread.rs`) or a host thread (`assist.rs`).

use super::conn::{direct_flag, flushed, InlineStats, ProxyConn};
use super::Sticky;
use crate::abi::{mscclppData, mscclppFlag, mscclppSync};
use crate::error::{Error, Result};
use crate::fifo::{Fifo, Trigger};
use crate::sync::{lock, Backoff, Nap, Policy};
use crate::transport::inbox::Taken;
use crate::transport::{Endpoint, PeerId};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

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
    pub(super) active: bool,
    /// Host producers and waiters do this FIFO's work too (see `new`).
    pub(super) assisted: bool,
    handled: u32,
    last_watch: Instant,
    /// Rounds of `service` so far (the clock is read once every `WATCH_EVERY` of them).
    rounds: u32,
    pub(super) stop_seen: Option<Instant>,
    /// When the proxy first saw the stop request: its final flushes share one deadline
    /// from there (`MSCCLPP_WAIT_TIMEOUT`).
    pub(super) stop_asked: Option<Instant>,
    /// Host threads waiting on this FIFO while doing its work (host FIFOs only).
    pub(super) gate: Arc<crate::fifo::HelperGate>,
    /// The kernels' wait record as last seen (`device_wait.rs`).
    pub(super) watched: super::device_wait::Watched,
}

pub type SharedWork = Arc<Mutex<ProxyWork>>;

/// What one `service` round found.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Round {
    /// Triggers were executed.
    Busy,
    /// Nothing to do; the endpoint was progressed.
    Idle,
    /// No trigger, but records of inline puts were applied for a sender waiting for room
    /// (`conn::direct_put`): as `Idle` for the endpoint, as `Busy` for the pause.
    Applied,
    /// Asked to stop, and the FIFO is drained and flushed.
    Done,
}

impl ProxyWork {
    /// Connection `conn_id` of this proxy (an id a kernel wrote) in words for an error: its
    /// index and peer, or that no such connection exists here.
    pub(super) fn conn_name(&self, conn_id: usize) -> String {
        match self.conns.get(conn_id) {
            Some(c) => format!("connection {} (to rank {})", c.index, c.remote_rank),
            None => format!(
                "connection id {conn_id} (this proxy has {})",
                self.conns.len()
            ),
        }
    }

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
        let gate = Arc::new(crate::fifo::HelperGate::new(crate::fifo::park_aside(
            crate::sync::host_is_tight(),
        )));
        sticky.add_fifo(fifo.abort_word());
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
            stop_asked: None,
            gate: gate.clone(),
            watched: Default::default(),
        }));
        if let Some(head) = host_head {
            let weak: Weak<dyn crate::fifo::Assist> =
                Arc::downgrade(&work) as Weak<Mutex<ProxyWork>>;
            crate::fifo::set_consumer(head, weak, assist, gate);
        }
        work
    }

    /// Aborts the communicator with `e` (`Sticky::abort`: the sticky error, every FIFO's abort
    /// word, the peers told) and stops consuming.
    pub(super) fn fail(&mut self, e: &Error) {
        // (An error met because the communicator was already aborted changes nothing there.)
        self.sticky.abort(e.code(), format!("{}: {e}", self.name));
        self.active = false;
    }

    /// `mscclppProxyLaunch` after a stop that raised the abort: retires what the FIFO holds
    /// (pushed before or after that stop's drain ended, by kernels it released) without
    /// executing it, said at WARN, before the abort word goes down. Every waiter on those
    /// triggers saw the raised word long before (the stop's drain alone is a second; a waiter
    /// reads the word every few microseconds), so the zeros written now tell no one "done".
    /// Nothing when the abort word is down.
    pub fn retire_released(&mut self) {
        if self.fifo.aborted() != 0 {
            let n = self.fifo.discard();
            if n > 0 {
                crate::warn!(
                    "{}: {n} triggers left in the FIFO by the last stop were retired without being executed (at mscclppProxyLaunch)",
                    self.name
                );
            }
            match self.fifo.retire_abandoned() {
                Ok(0) => {}
                Ok(k) => crate::warn!(
                    "{}: {k} tickets that kernels took but gave up on at the last stop's abort (the FIFO was full) were retired as no-ops (at mscclppProxyLaunch)",
                    self.name
                ),
                Err(e) => crate::warn!(
                    "{}: reading or clearing the FIFO's mark of given-up tickets failed ({e}): flushes on it may keep failing",
                    self.name
                ),
            }
        }
    }

    /// One round of the proxy's work: up to a batch of triggers, or, when the FIFO is empty,
    /// progress of the endpoint if `progress` (and the final drain once `stopping`). The proxy
    /// thread passes false and progresses the endpoint after letting go of this lock
    /// (`progress_idle`): host threads' direct signals and puts need it, and progress is the
    /// long part of an idle round.
    pub(super) fn service(&mut self, stopping: bool, progress: bool) -> Result<Round> {
        // Another proxy of the communicator (or a host thread doing its work) failed: the
        // abort is the communicator's, so this one stops consuming too.
        if self.sticky.failed() {
            return Err(self.sticky.earlier());
        }
        // Reading the clock on every round cost ~1% of a tcp transfer's CPU time (`perf`, 2-core
        // VM); a dead peer is noticed within the period plus WATCH_EVERY rounds.
        self.rounds = self.rounds.wrapping_add(1);
        if self.rounds % WATCH_EVERY == 0 && self.last_watch.elapsed() > PEER_WATCH_PERIOD {
            self.last_watch = Instant::now();
            check_peers(self)?;
            // A kernel that has waited long says so in its record: reported here.
            self.watch_device_wait()?;
        }
        let mut n = 0;
        while n < BATCH {
            let Some(words) = self.fifo.peek() else { break };
            // After the abort nothing more is executed, and nothing is retired either: a slot's
            // zero (and a tail past a ticket) means "executed" to every waiter (docs/DESIGN.md
            // 5.1), so what is left stays in its slot, where each waiter ends on the abort with
            // an error, until `mscclppProxyLaunch` retires it (`retire_released`) or destroy
            // frees the FIFO. The word is read after the slot (the Acquire loads in `peek` keep
            // it there), so a trigger stored after the raise was visible here is not executed.
            if self.fifo.aborted() != 0 {
                break;
            }
            let t = Trigger::decode(words).map_err(|r| refused(self, &r))?;
            test_panic(self.handled);
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
                self.drain_inboxes()?;
            }
        }
        if n > 0 {
            self.stop_seen = None;
            return Ok(Round::Busy);
        }
        if stopping {
            let asked = *self.stop_asked.get_or_insert_with(Instant::now);
            // A producer may have taken a ticket and not yet written its slot; give it a short
            // grace period (retired triggers do not count as work), then finish. Once the
            // abort is raised there is nothing to wait for: what comes is not executed.
            let t0 = *self.stop_seen.get_or_insert_with(Instant::now);
            if self.fifo.aborted() != 0 || t0.elapsed() > Duration::from_millis(20) {
                self.finish(asked + crate::config::wait_timeout())?;
                return Ok(Round::Done);
            }
        }
        if self.conns.iter().any(|c| c.regain_direct) {
            self.regain_direct()?;
        }
        let applied = self.drain_inboxes()?;
        if progress {
            progress_idle(&self.endpoint)?;
        }
        // Records applied while their sender waits for room (`conn::direct_put`) are work: a
        // proxy napping between its rounds would keep it waiting a nap per record.
        Ok(if applied { Round::Applied } else { Round::Idle })
    }

    /// The gate its proxy thread stands aside at while host threads do its work.
    pub fn gate(&self) -> Arc<crate::fifo::HelperGate> {
        self.gate.clone()
    }

    /// Tests: the next look at the clock finds the peer-watch period passed.
    #[cfg(test)]
    pub(super) fn last_watch_for_test(&mut self) {
        self.last_watch = Instant::now()
            .checked_sub(2 * PEER_WATCH_PERIOD)
            .unwrap_or(self.last_watch);
    }

    /// The end of a stop: inline puts applied, every peer flushed, the endpoint quiesced. The
    /// waits share one `deadline`, not one wait timeout per peer.
    fn finish(&mut self, deadline: Instant) -> Result<()> {
        let past = |what: &str| -> Result<()> {
            if Instant::now() > deadline {
                return Err(Error::timeout(
                    format!("{}: stopping: {what}", self.name),
                    crate::config::wait_timeout(),
                ));
            }
            Ok(())
        };
        self.drain_inboxes()?;
        let mut peers: Vec<PeerId> = self.conns.iter().map(|c| c.peer).collect();
        peers.sort_unstable();
        peers.dedup();
        for &p in &peers {
            past("waiting for peers to apply our inline puts")?;
            wait_inline_taken(self, p)?;
        }
        let mut ep = lock(&self.endpoint);
        ep.poll_incoming()?;
        for p in peers {
            past("the final flushes")?;
            ep.flush(p)?;
        }
        // Nothing of ours may keep running on the GPU once the proxy is stopped.
        ep.quiesce()?;
        drop(ep);
        if self.fifo.aborted() != 0 {
            let n = self.fifo.queued();
            if n > 0 {
                crate::warn!(
                    "{}: {n} triggers pushed by kernels or threads the stop released are left unexecuted in the FIFO: the flushes and syncs waiting on them return an error; mscclppProxyLaunch retires them",
                    self.name
                );
            }
        }
        let s = self
            .conns
            .iter()
            .fold(InlineStats::default(), |a, c| a + c.inline);
        if s != InlineStats::default() {
            crate::info!(
                "{}: SHM puts small enough to go inline: {} did ({} of them after waiting for room in the peer's ring), {} found the ring full and took the endpoint, {} followed a put through the endpoint since the last flush, {} were refused (the receiver was gone)",
                self.name,
                s.inline,
                s.waited,
                s.ring_full,
                s.after_endpoint,
                s.refused
            );
        }
        Ok(())
    }

    /// Applies the inline puts peers wrote into our rings (SHM over host memory) to our
    /// buffers: for puts that no signal follows (a waiter applies the others), and for the
    /// peers' flushes, which wait until we have. Skips a ring another consumer is draining.
    /// Returns whether it applied any that a waiting sender wanted room for.
    pub(super) fn drain_inboxes(&self) -> Result<bool> {
        let mut wanted = false;
        for i in self.conns.iter().filter_map(|c| c.inbox.as_ref()) {
            let w = i.room_wanted();
            wanted |= i.drain_if_free()? && w;
        }
        Ok(wanted)
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

/// An idle round's endpoint work: progress, then the writes peers made into us that need our
/// work before our waiters may see them (net staging; after progress, which may just have
/// delivered some).
/// Progress of an idle proxy's endpoint; returns whether peers' writes arrived meanwhile
/// (`Endpoint::took_incoming`).
pub(super) fn progress_idle(endpoint: &SharedEndpoint) -> Result<bool> {
    let mut ep = lock(endpoint);
    ep.progress()?;
    ep.poll_incoming()?;
    Ok(ep.took_incoming())
}

/// `MSCCLPP_TEST_PROXY_PANIC=N` (tests): panics before the N-th trigger, `handled` having
/// been executed before it.
fn test_panic(handled: u32) {
    if crate::config::get().test_proxy_panic == Some(handled as u64 + 1) {
        panic!(
            "MSCCLPP_TEST_PROXY_PANIC: the proxy's work panics at trigger {}",
            handled as u64 + 1
        );
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
pub(super) const WATCH_EVERY: u32 = 64;

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
pub(super) fn lost_peer_of(boot: &crate::bootstrap::Bootstrap, ranks: &[usize]) -> Option<String> {
    boot.lost_peer_among(ranks)
        .map(|(_, why)| format!("peer lost: {why}"))
}

/// The error for a trigger its producer refused to encode (`MSCCLPP_TRIGGER_REFUSED`): a put
/// that no trigger can carry, reported instead of moved with wrapped offsets.
fn refused(w: &ProxyWork, r: &crate::fifo::Refusal) -> Error {
    let conn = w.conn_name(r.conn_id);
    let sizes = w.conns.get(r.conn_id).map_or(String::new(), |c| {
        format!(
            " (buffers: {} bytes here, {} at the peer)",
            c.local_size, c.remote_size
        )
    });
    Error::invalid_arg(format!(
        "{}: a kernel's put on {conn} was refused: {}{sizes}",
        w.name,
        r.describe()
    ))
}

/// Checks one trigger against the connection's registered sizes, then acts on it.
fn handle(w: &mut ProxyWork, t: &Trigger) -> Result<()> {
    let ticket = w.fifo.ticket();
    let nconns = w.conns.len();
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
    if t.ty & (mscclppData | mscclppSync) != 0 {
        // Inline puts before this one must be applied before its write lands (same bytes), and
        // before a flush can say they arrived.
        let peer = c.peer;
        wait_inline_taken(w, peer)?;
    }
    let c = &mut w.conns[t.conn_id];
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
        c.regain_direct = c.direct.is_some();
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

/// Waits until `peer` has applied every inline put of our connections to it (`transport::inbox`):
/// bounded by `MSCCLPP_WAIT_TIMEOUT`, ended by the peer's death or its destroyed communicator
/// (errors: what was not applied is lost). Meanwhile applies our own inboxes and progresses
/// the endpoint, since the peer's proxy may be waiting for us: for our inline puts the same
/// way, or inside a flush whose delivery needs our endpoint's progress.
fn wait_inline_taken(w: &ProxyWork, peer: PeerId) -> Result<()> {
    let pending = || -> Result<bool> {
        let mut any = false;
        for c in w.conns.iter().filter(|c| c.peer == peer) {
            match c.outbox.as_ref().map(|o| o.taken()) {
                None | Some(Taken::All) => {}
                Some(Taken::Pending) => any = true,
                Some(Taken::Closed) => {
                    return Err(Error::remote(format!(
                        "rank {}: its communicator was destroyed before it applied our inline puts",
                        c.remote_rank
                    )))
                }
            }
        }
        Ok(any)
    };
    let mut b = Backoff::new(INLINE_WAIT, crate::config::wait_timeout());
    // Ends when the peer has applied them, at its death or destroy, or at the bound.
    while pending()? {
        w.drain_inboxes()?;
        progress_idle(&w.endpoint)?;
        b.pause();
        if b.polls() % 64 == 0 {
            check_peers(w)?;
            b.check(|| {
                format!(
                    "{}: waiting for a peer to apply our inline SHM puts",
                    w.name
                )
            })?;
        }
    }
    Ok(())
}

/// Waiting for a peer to apply inline puts: its waiter or proxy thread does within
/// microseconds when it runs; on a crowded host it needs our core.
const INLINE_WAIT: Policy = Policy {
    spins: 256,
    yield_for: Duration::from_millis(50),
    nap: Nap::Fixed(Duration::from_micros(50)),
};

fn check_range(side: &str, off: u64, size: u64, limit: u64, peer: usize) -> Result<()> {
    if size == 0 || off.checked_add(size).is_none_or(|end| end > limit) {
        return Err(Error::invalid_arg(format!(
            "put refused: {side} range [{off}, {off}+{size}) is outside the {limit}-byte buffer registered on the connection to rank {peer}"
        )));
    }
    Ok(())
}
