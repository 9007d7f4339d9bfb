//! The communicator: bootstrap, declared and established connections, one endpoint and proxy
//! per (transport, device, NIC), registered buffers, and the order in which they are released.
//!
//! Files by role: this one holds the state and the calls made before and after setup
//! (declaring connections, handing out device connections, starting and stopping proxies);
//! `setup.rs` establishes connections, `buffers.rs` registered buffers, `teardown.rs` stops
//! and releases everything, `blob.rs` is the setup envelope sent to peers, `hang/` the hang
//! report (every rank's pending waits and signal counts, combined). Nothing here asks what
//! kind a transport is: the transport answers (`transport::Caps`, `Endpoint::epoch_block`).

mod blob;
mod buffers;
pub mod hang;
mod setup;
mod teardown;

pub use blob::{ConnBlob, TAG_ACK, TAG_CONN, TAG_REG, TAG_UNMAPPED, TAG_UNREG};

use crate::abi::*;
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::proxy::{self, Running, SharedEndpoint, SharedWork, Sticky};
use crate::sync::lock;
use crate::transport::epoch::EpochMem;
use crate::transport::{Caps, EndpointKey, MemKind, MrId, PeerId, RemoteId};
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Accepting `mscclppConnect`.
    Declaring,
    /// Connections established; proxies may run.
    Ready,
    /// Setup failed half-way; only destroy is allowed.
    Failed,
}

/// A connection declared by `mscclppConnect`, waiting for setup.
#[derive(Clone, Debug)]
struct Request {
    remote_rank: usize,
    tag: i32,
    buff: u64,
    size: u64,
    transport: mscclppTransport_t,
    key: EndpointKey,
    kind: MemKind,
}

/// One endpoint with its FIFO, proxy state and the epoch counters of its connections.
struct Slot {
    key: EndpointKey,
    /// What the endpoint answered about itself when it opened.
    caps: Caps,
    ep: SharedEndpoint,
    /// The FIFO and the connections' proxy state, shared with the proxy thread (and with host
    /// producers, which may do its work).
    work: SharedWork,
    /// Where `work`'s proxy thread stands aside for host threads doing its work.
    gate: Arc<crate::fifo::HelperGate>,
    running: Option<Running>,
    /// The peers of its endpoint, by rank and the address of the peer's endpoint: two
    /// connections to one endpoint of a rank share a peer; to two of its endpoints, not.
    peers: HashMap<(usize, Vec<u8>), PeerId>,
    /// Its proxy thread never stopped (`proxy::Running::stop`): the endpoint may be wedged and
    /// its lock held forever, so nothing may touch it again; it and its FIFO are leaked.
    abandoned: bool,
}

struct Conn {
    slot: usize,
    remote_rank: usize,
    tag: i32,
    peer: PeerId,
    /// The connection's epoch block (`transport::epoch`), where the transport placed it.
    _epoch: EpochMem,
    /// The ring the peer writes inline puts into (SHM over host memory), closed at destroy.
    inbox: Option<Arc<crate::transport::inbox::Inbox>>,
}

struct Registered {
    /// Per established connection: (slot, peer, the peer's imported region, its size).
    remotes: Vec<(usize, PeerId, RemoteId, u64)>,
    /// Per established connection: (slot, our registration there), each counted in
    /// `Comm::region_uses`.
    locals: Vec<(usize, MrId)>,
    state: RegState,
    /// A write through it failed after it was issued (mscclppRegisteredBufferWrite): it may
    /// still land in the peers' buffers, so it is never unregistered.
    writes_unfinished: bool,
}

/// Where a registered buffer stands (`mscclppUnregisterBuffer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RegState {
    Live,
    /// Unregistered on this rank and its peers; nothing of it is held.
    Released,
    /// An unregister failed after this rank dropped its imports: the handle is dead, and our
    /// registration stays until destroy, since a peer may not have dropped its import yet.
    Kept,
}

pub struct Comm {
    /// Shared with the proxies, which poll it for peers that vanish.
    boot: Arc<Bootstrap>,
    phase: Phase,
    requests: Vec<Request>,
    conns: Vec<Conn>,
    dev_conns: Vec<mscclppDevConn>,
    slots: Vec<Slot>,
    sticky: Arc<Sticky>,
    /// Indexed by registration (handle - 1); an unregistered one stays, so that the numbering
    /// both sides share (`register_buffer`'s `seq`) never shifts.
    registered: Vec<Registered>,
    /// Uses of each registration of an endpoint (slot, id): connections' buffers and epoch
    /// blocks, registered buffers. The endpoints return one id for the same region, so a
    /// registered buffer that is also a connection's buffer is released only with its last use.
    region_uses: HashMap<(usize, MrId), usize>,
    /// Per connection (peer rank, tag): "released" messages of registrations this rank has
    /// not unregistered yet (a peer ahead of it), for the call that does (buffers.rs).
    unreg_early: HashMap<(usize, i32), Vec<u64>>,
    proxies_running: bool,
    /// Between a stop and the next launch (or destroy): the thread that keeps the network
    /// endpoints progressing for peers still flushing to us (`proxy::Keeper`).
    keeper: Option<proxy::Keeper>,
    /// What this rank's hang report is read from, once connections are set up.
    hang: Option<Arc<hang::Source>>,
}

// SAFETY: the raw pointers inside `dev_conns` (and the epoch and FIFO memory they name) point to
// memory the Comm owns, or leaks at teardown while something may still use it; nothing in it is
// tied to the creating thread. Any thread may call on a communicator (RELIABILITY.md,
// "Threads"), but only through `&mut Comm` under the Mutex of its `capi::Entry`, so one at a time.
unsafe impl Send for Comm {}

impl Comm {
    pub fn new(boot: Bootstrap) -> Self {
        let ranks = boot.ranks_on_this_host();
        let (cores, crowded) = crate::sync::note_ranks_on_host(ranks);
        if crowded {
            crate::info!(
                "rank {}: {ranks} ranks on this host, {cores} cores for this process: waits that last nap between their polls (MSCCLPP_WAIT_MODE)",
                boot.rank()
            );
        }
        let tight = crate::sync::host_is_tight();
        crate::info!(
            "rank {}: {ranks} ranks on this host, {cores} cores: a proxy thread standing aside for host threads that do its work parks {} us at a time ({})",
            boot.rank(),
            crate::fifo::park_aside(tight).as_micros(),
            if tight {
                "fewer than two cores per rank on this host"
            } else {
                "two cores per rank or more"
            }
        );
        let boot = Arc::new(boot);
        Comm {
            sticky: Arc::new(Sticky::new(boot.clone())),
            boot,
            phase: Phase::Declaring,
            requests: Vec::new(),
            conns: Vec::new(),
            dev_conns: Vec::new(),
            slots: Vec::new(),
            registered: Vec::new(),
            region_uses: HashMap::new(),
            unreg_early: HashMap::new(),
            proxies_running: false,
            keeper: None,
            hang: None,
        }
    }

    pub fn rank(&self) -> usize {
        self.boot.rank()
    }
    pub fn nranks(&self) -> usize {
        self.boot.nranks()
    }
    /// The bootstrap, for a host thread about to block in it (the C API's barrier and
    /// all-gather): the proxies standing aside for this thread resume first
    /// (`HelperGate::resume`), so that peers' writes needing our progress meanwhile (the
    /// acknowledgement a peer's flush waits for) do not wait for the end of their park.
    pub fn bootstrap_to_block(&self) -> &Bootstrap {
        for s in &self.slots {
            s.gate.resume();
        }
        &self.boot
    }

    /// The communicator's sticky-error cell, shared with its proxies.
    pub fn sticky_handle(&self) -> Arc<Sticky> {
        self.sticky.clone()
    }

    /// Fails with the sticky error, so that every API call after a proxy failure reports it.
    pub fn check_sticky(&self) -> Result<()> {
        match self.sticky.get() {
            None => Ok(()),
            Some((_, msg)) => Err(Error::remote(format!(
                "an earlier asynchronous error is pending: {msg}"
            ))),
        }
    }

    /// Declares a connection (mscclppConnect). Nothing is created until `setup`.
    pub fn connect(
        &mut self,
        remote_rank: i32,
        tag: i32,
        buff: u64,
        size: u64,
        transport: mscclppTransport_t,
        ib_dev: Option<String>,
    ) -> Result<()> {
        if self.phase != Phase::Declaring {
            return Err(Error::usage("mscclppConnect after mscclppConnectionSetup: declare every connection before setup"));
        }
        let n = self.nranks();
        if remote_rank < 0 || remote_rank as usize >= n || remote_rank as usize == self.rank() {
            return Err(Error::invalid_arg(format!("remoteRank {remote_rank} is not another rank of this {n}-rank communicator (this is rank {})", self.rank())));
        }
        if buff == 0 {
            return Err(Error::invalid_arg("localBuff is NULL"));
        }
        if size == 0 {
            return Err(Error::invalid_arg("buffSize is 0"));
        }
        if buff.checked_add(size).is_none() {
            return Err(Error::invalid_arg(format!(
                "buffer {buff:#x} + {size} bytes wraps the address space"
            )));
        }
        let remote_rank = remote_rank as usize;
        if self
            .requests
            .iter()
            .any(|r| r.remote_rank == remote_rank && r.tag == tag)
        {
            return Err(Error::invalid_arg(format!("a connection to rank {remote_rank} with tag {tag} was already declared; (remoteRank, tag) must be unique")));
        }
        let kind = crate::cuda::mem_kind(buff);
        let key = EndpointKey::for_connection(transport, kind, ib_dev.as_deref())?;
        self.requests.push(Request {
            remote_rank,
            tag,
            buff,
            size,
            transport,
            key,
            kind,
        });
        Ok(())
    }

    fn require_ready(&self, what: &str) -> Result<()> {
        match self.phase {
            Phase::Ready => Ok(()),
            Phase::Declaring => Err(Error::usage(format!(
                "{what} before mscclppConnectionSetup"
            ))),
            Phase::Failed => Err(Error::usage(format!(
                "{what}: mscclppConnectionSetup failed earlier; destroy this communicator"
            ))),
        }
    }

    /// The connections in `mscclppConnect` order (host memory, owned by the comm).
    pub fn dev_conns(&mut self) -> Result<&mut [mscclppDevConn]> {
        self.require_ready("mscclppGetAllDeviceConnections")?;
        Ok(&mut self.dev_conns)
    }

    pub fn dev_conn(&mut self, remote_rank: i32, tag: i32) -> Result<&mut mscclppDevConn> {
        self.require_ready("mscclppGetDeviceConnection")?;
        let (rank, n) = (self.rank(), self.conns.len());
        self.dev_conns
            .iter_mut()
            .find(|c| c.remoteRank == remote_rank && c.tag == tag)
            .ok_or_else(|| Error::invalid_arg(format!("rank {rank} has no connection to rank {remote_rank} with tag {tag} (it has {n})")))
    }

    pub fn proxy_launch(&mut self) -> Result<()> {
        self.require_ready("mscclppProxyLaunch")?;
        self.check_sticky()?;
        if self.proxies_running {
            return Err(Error::usage(
                "mscclppProxyLaunch: proxies are already running",
            ));
        }
        self.end_keeper();
        // After a stop: what its FIFOs still hold was pushed after its drain ended (by a kernel
        // it then released), and is not executed; then the abort words are cleared.
        for s in &self.slots {
            lock(&s.work).retire_released();
        }
        if !self.sticky.rearm() {
            return self.check_sticky();
        }
        self.proxies_running = true;
        for i in 0..self.slots.len() {
            match proxy::launch(self.slots[i].work.clone()) {
                Ok(r) => self.slots[i].running = Some(r),
                Err(e) => {
                    // Leave nothing half-started behind.
                    self.stop_all(false);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Stops every proxy after it has drained its FIFO (bounded), then raises the abort word of
    /// every FIFO, so that kernels and host threads still waiting on them return (the next
    /// `proxy_launch` clears them). Returns the first error any proxy met. Bounded by
    /// `MSCCLPP_WAIT_TIMEOUT` + `STOP_SLACK` (teardown.rs).
    pub fn proxy_stop(&mut self) -> Result<()> {
        self.require_ready("mscclppProxyStop")?;
        if !self.proxies_running {
            return Err(Error::usage(
                "mscclppProxyStop: no proxy is running (call mscclppProxyLaunch first)",
            ));
        }
        self.stop_all(false);
        self.check_sticky()?;
        self.start_keeper();
        Ok(())
    }

    /// After a clean stop: a thread keeps the endpoints that linger (network ones: `Caps`)
    /// progressing, and the inline-put rings applied, until the next launch or destroy
    /// (`proxy::Keeper` says why). None where there is neither.
    fn start_keeper(&mut self) {
        let skip = self.untouchable();
        let eps: Vec<(usize, proxy::SharedEndpoint)> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(i, s)| s.caps.linger && !skip[*i])
            .map(|(i, s)| (i, s.ep.clone()))
            .collect();
        let inboxes: Vec<_> = self
            .conns
            .iter()
            .filter(|c| !skip[c.slot])
            .filter_map(|c| c.inbox.clone())
            .collect();
        if eps.is_empty() && inboxes.is_empty() {
            return;
        }
        match proxy::keep_serving(format!("mscclpp-keeper-{}", self.rank()), eps, inboxes) {
            Ok(k) => self.keeper = Some(k),
            Err(e) => crate::warn!(
                "rank {}: cannot start the thread that progresses the endpoints after the stop ({e}): peers that flush to this rank now wait for its next launch or destroy",
                self.rank()
            ),
        }
    }

    /// Ends the keeper (bounded); an endpoint it is stuck inside is abandoned with its slot.
    fn end_keeper(&mut self) {
        if let Some(k) = self.keeper.take() {
            if let Some(slot) = k.quit(KEEPER_QUIT) {
                self.slots[slot].abandoned = true;
            }
        }
    }
}

/// How long ending the keeper may take: one round of progress calls and a nap.
const KEEPER_QUIT: std::time::Duration = std::time::Duration::from_secs(1);
