//! Host FIFOs and their consumers: the producers of a host-memory FIFO find its consumer (the
//! proxy's work) here, to do a round of it themselves or to deliver a signal without a trigger.

use super::abandoned::Abandoned;
use super::HelperGate;
use crate::abi::mscclppConcurrentFifo;
use crate::sync::{read, write};
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, RwLock, Weak};

/// Whoever consumes a host FIFO, reachable from its producers (see `proxy::ProxyWork`).
pub trait Assist: Send + Sync {
    /// Does a round of the consumer's work if nobody else is doing it; never blocks on it.
    /// True if this thread did it (false: another thread holds the consumer).
    fn assist(&self) -> bool;
    /// Delivers a signal on connection `conn` at once, without a trigger, if that is allowed
    /// now (nothing queued or undelivered before it, and a transport that needs no call for
    /// it); false: push the trigger. Never blocks.
    fn direct_signal(&self, conn: usize) -> bool;
    /// Copies a put of `size` bytes from `src` to the peer's `dst` on connection `conn` at
    /// once, followed by its signal if `signal`, without a trigger, if that is allowed now (as
    /// for `direct_signal`, and a peer with a ring of inline puts that has room);
    /// false: push the trigger. Never blocks on the peer.
    fn direct_put(&self, conn: usize, dst: u64, src: u64, size: u64, signal: bool) -> bool;
    /// Takes back the trigger of `ticket` if the consumer has not started it (`Fifo::withdraw`):
    /// for a producer that gave up waiting for its trigger's completion. Never blocks on a
    /// consumer at work.
    fn withdraw(&self, ticket: u64) -> Withdrawal;
    /// The sizes of connection `conn`'s buffers, here and at the peer (None: no such
    /// connection): a put split into several triggers is checked whole against them before
    /// its first is queued, as the proxy checks each trigger. May wait for a consumer's round.
    fn buffer_sizes(&self, conn: usize) -> Option<(u64, u64)>;
}

/// What became of a trigger its producer asked to take back (`Assist::withdraw`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Withdrawal {
    /// Taken back: nothing of it was or will be executed.
    Withdrawn,
    /// Already executed and retired.
    Retired,
    /// Still queued, or being executed: the consumer was busy (or failed, or is gone), so it
    /// may still run.
    Queued,
}

/// A ring of inline puts into one connection's buffer (`transport::inbox::Inbox`): a waiter
/// applies what the peer writes while it waits if the sender waits for room (`room_wanted`,
/// `drain_if_free`), and, once it saw its signal, everything written before it (`drain`).
pub trait Drain: Send + Sync {
    fn drain(&self) -> crate::error::Result<()>;
    fn drain_if_free(&self) -> crate::error::Result<bool>;
    fn room_wanted(&self) -> bool;
}

/// The consumer of a host FIFO, whether host threads may do its work (`assist`), and whether
/// any of its connections can take a signal without a trigger (`direct_signal`).
pub(crate) struct Consumer {
    pub(crate) helps: bool,
    work: Weak<dyn Assist>,
    direct: bool,
    gate: Arc<HelperGate>,
    /// Per connection id, its ring of inline puts, if it has one.
    inboxes: Vec<Option<Arc<dyn Drain>>>,
}

/// A live host-memory FIFO: the rest of its producer view, its abandoned tickets, and its
/// consumer once the communicator has one.
struct HostFifo {
    slots: usize,
    tail: usize,
    abandoned: Arc<Abandoned>,
    consumer: Option<Consumer>,
}

/// The live host-memory FIFOs by head address. The host-driven API accepts a connection only if
/// its whole FIFO view is here, so a device-memory, foreign or stale `mscclppDevConn` is an
/// error rather than a stray access. Head addresses are never reused (`Fifo::new_host` never
/// frees a head), so a connection of a destroyed communicator cannot match a newer FIFO.
type HostFifos = HashMap<usize, HostFifo>;
static HOST_FIFOS: LazyLock<RwLock<HostFifos>> = LazyLock::new(Default::default);

fn host_fifos() -> std::sync::RwLockReadGuard<'static, HostFifos> {
    read(&HOST_FIFOS)
}

/// A new host FIFO with producer view `view` and abandoned tickets `abandoned`, without a
/// consumer yet.
pub(super) fn add(view: &mscclppConcurrentFifo, abandoned: Arc<Abandoned>) {
    write(&HOST_FIFOS).insert(
        view.triggerFifoHead as usize,
        HostFifo {
            slots: view.triggerFifo as usize,
            tail: view.triggerFifoTail as usize,
            abandoned,
            consumer: None,
        },
    );
}

/// The host FIFO with head `head` is gone.
pub(super) fn remove(head: *const u64) {
    write(&HOST_FIFOS).remove(&(head as usize));
}

/// True if `f` is the producer view of a live host-memory FIFO of this process (head, slots
/// and tail all match).
pub fn is_host_fifo(f: &mscclppConcurrentFifo) -> bool {
    host_fifos()
        .get(&(f.triggerFifoHead as usize))
        .is_some_and(|e| e.slots == f.triggerFifo as usize && e.tail == f.triggerFifoTail as usize)
}

/// Records that the producer of `ticket` of the host FIFO at `head` gave up without writing
/// its slot: the consumer retires it as a no-op (`Abandoned`). Nothing if the FIFO is gone.
pub fn abandon(head: *const u64, ticket: u64) {
    if let Some(e) = host_fifos().get(&(head as usize)) {
        e.abandoned.add(ticket);
    }
}

/// See [`Assist::withdraw`], for ticket `ticket` of the host FIFO at `head`.
pub fn withdraw(head: *const u64, ticket: u64) -> Withdrawal {
    consumer(head, |_| true).map_or(Withdrawal::Queued, |c| c.withdraw(ticket))
}

/// Names the consumer of the host FIFO whose head is `head`; `helps`: host threads may do its
/// work (`assist`), and count themselves in `gate` while they wait doing it.
pub fn set_consumer(head: *const u64, work: Weak<dyn Assist>, helps: bool, gate: Arc<HelperGate>) {
    if let Some(e) = write(&HOST_FIFOS).get_mut(&(head as usize)) {
        e.consumer = Some(Consumer {
            work,
            helps,
            direct: false,
            gate,
            inboxes: Vec::new(),
        });
    }
}

/// Notes that a connection of the host FIFO at `head` can take signals (and maybe puts)
/// directly (SHM over host memory): only then do `direct_signal` and `direct_put` try the
/// consumer, whose lock they may have to wait a little for.
pub fn set_direct(head: *const u64) {
    if let Some(c) = consumer_mut(&mut write(&HOST_FIFOS), head) {
        c.direct = true;
    }
}

fn consumer_mut(fifos: &mut HostFifos, head: *const u64) -> Option<&mut Consumer> {
    fifos.get_mut(&(head as usize))?.consumer.as_mut()
}

/// Names the ring of inline puts into connection `conn` of the host FIFO at `head`.
pub fn set_inbox(head: *const u64, conn: usize, inbox: Arc<dyn Drain>) {
    if let Some(c) = consumer_mut(&mut write(&HOST_FIFOS), head) {
        if c.inboxes.len() <= conn {
            c.inboxes.resize(conn + 1, None);
        }
        c.inboxes[conn] = Some(inbox);
    }
}

/// The ring of inline puts into connection `conn` of the host FIFO at `head`, if it has one: a
/// waiter applies what the peer wrote, while it waits and once it saw the signal that follows.
pub fn inbox(head: *const u64, conn: usize) -> Option<Arc<dyn Drain>> {
    // Not `lookup`: the inbox needs no live consumer (its Arc keeps the ring), so the
    // consumer's Weak is not upgraded (an atomic on a count the proxy thread shares).
    host_fifos()
        .get(&(head as usize))
        .and_then(|e| e.consumer.as_ref())
        .and_then(|c| c.inboxes.get(conn).cloned().flatten())
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
        .consumer
        .as_ref()
        .filter(|c| wanted(c))?;
    Some(take(c, c.work.upgrade()?))
}

/// The consumer of the live host FIFO at `head`, whoever may do its work: a host call holds it
/// for its whole length, which keeps the FIFO's memory alive (the consumer owns it) and tells
/// destroy that a call is still inside (`comm::teardown`).
pub(crate) fn hold(head: *const u64) -> Option<Arc<dyn Assist>> {
    consumer(head, |_| true)
}

/// The consumer of the host FIFO at `head`, if it has one that `wanted` accepts.
fn consumer(head: *const u64, wanted: impl Fn(&Consumer) -> bool) -> Option<Arc<dyn Assist>> {
    lookup(head, wanted, |_, work| work)
}

/// As `consumer`, with its helper gate.
pub(crate) fn consumer_and_gate(
    head: *const u64,
    wanted: impl Fn(&Consumer) -> bool,
) -> Option<(Arc<dyn Assist>, Arc<HelperGate>)> {
    lookup(head, wanted, |c, work| (work, c.gate.clone()))
}

/// Lets the calling host thread, which just pushed a trigger, do a round of the consumer's work
/// for the FIFO at `head`, and tells the proxy thread whether it still has to (`HelperGate`).
pub(crate) fn assist_after_push(head: *const u64) {
    if let Some((c, gate)) = consumer_and_gate(head, |c| c.helps) {
        if c.assist() {
            gate.pushed_and_assisted();
        } else {
            gate.nudge();
        }
    }
}

/// See [`Assist::direct_signal`]: true if the signal on connection `conn` of the host FIFO at
/// `head` was delivered without a trigger.
pub fn direct_signal(head: *const u64, conn: usize) -> bool {
    consumer(head, |c| c.direct).is_some_and(|c| c.direct_signal(conn))
}

/// See [`Assist::direct_put`]: true if the put (and its signal, if `signal`) on connection
/// `conn` of the host FIFO at `head` was delivered without a trigger.
pub fn direct_put(
    head: *const u64,
    conn: usize,
    dst: u64,
    src: u64,
    size: u64,
    signal: bool,
) -> bool {
    consumer(head, |c| c.direct).is_some_and(|c| c.direct_put(conn, dst, src, size, signal))
}
