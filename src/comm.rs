//! The communicator: bootstrap, declared and established connections, one endpoint and proxy
//! per (transport, device, NIC), registered buffers, and the order in which they are released.

use crate::abi::*;
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::fifo::{AbortWord, Fifo};
use crate::proxy::{self, ProxyConn, ProxyWork, Running, SharedEndpoint, SharedWork, Sticky};
use crate::transport::{self, EndpointKey, MemKind, MrId, PeerId, Region, RemoteId};
use crate::wire::{Reader, Writer};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

const CONN_MAGIC: u32 = 0x4d53_434e; // "MSCN"
const WIRE_VERSION: u32 = 2;
// Bootstrap tag spaces (top byte) for the messages of connection setup; the low 32 bits carry
// the connection's tag. Public so that protocol tests can speak to a real rank.
/// Tag space of the [`ConnBlob`]s (`TAG_CONN | tag as u32`).
pub const TAG_CONN: u64 = 1 << 56;
/// Tag space of the setup acknowledgements (`b"ok"`).
pub const TAG_ACK: u64 = 2 << 56;
/// Tag space of the registered-buffer blobs.
pub const TAG_REG: u64 = 3 << 56;

/// One rank's half of a connection, sent to the peer on `TAG_CONN | tag` during setup: magic,
/// version, transport, tag, sender rank (u32 LE each), buffer size (u64 LE), then the
/// transport's endpoint address, data-region blob and epoch-region blob (u32 LE length, at
/// most `wire::MAX_FIELD` bytes each), then the name of the shared-memory object holding the
/// epoch block (SHM over host memory; empty otherwise, at most 64 bytes). The three blobs are
/// the transport's to validate; the name, `mem::SharedBlock::open`'s.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnBlob<'a> {
    pub transport: u32,
    pub tag: i32,
    pub rank: usize,
    pub size: u64,
    pub addr: &'a [u8],
    pub data: &'a [u8],
    pub epoch: &'a [u8],
    pub epoch_shm: &'a [u8],
}

impl<'a> ConnBlob<'a> {
    pub fn encode(&self) -> Vec<u8> {
        Writer::new()
            .u32(CONN_MAGIC)
            .u32(WIRE_VERSION)
            .u32(self.transport)
            .u32(self.tag as u32)
            .u32(self.rank as u32)
            .u64(self.size)
            .bytes(self.addr)
            .bytes(self.data)
            .bytes(self.epoch)
            .bytes(self.epoch_shm)
            .finish()
    }

    /// Parses the half that rank `from` sent for the connection this rank declared with `tag`
    /// and `transport`, and checks it against that declaration. Pure: no I/O, no allocation
    /// beyond the error text; the blobs it returns borrow from `msg`.
    pub fn decode(
        msg: &'a [u8],
        from: usize,
        tag: i32,
        transport: mscclppTransport_t,
    ) -> Result<Self> {
        let mut rd = Reader::new(msg, "connection setup blob");
        let (magic, ver) = (rd.u32()?, rd.u32()?);
        if magic != CONN_MAGIC || ver != WIRE_VERSION {
            return Err(Error::remote(format!(
                "rank {from}: foreign connection blob (magic {magic:#x}, version {ver})"
            )));
        }
        let (tr, rtag, rank, size) = (rd.u32()?, rd.u32()? as i32, rd.u32()? as usize, rd.u64()?);
        let (addr, data, epoch, epoch_shm) = (rd.bytes()?, rd.bytes()?, rd.bytes()?, rd.bytes()?);
        rd.finish()?;
        if rank != from || rtag != tag {
            return Err(Error::remote(format!(
                "rank {from}: setup blob names rank {rank} tag {rtag}, expected rank {from} tag {tag}"
            )));
        }
        if tr != transport as u32 {
            return Err(Error::invalid_arg(format!(
                "connection to rank {from} tag {tag}: transports differ (here {transport:?}, peer {tr})"
            )));
        }
        if size == 0 {
            return Err(Error::remote(format!(
                "rank {from}: peer registered a 0-byte buffer"
            )));
        }
        let shares_epoch = matches!(
            transport,
            mscclppTransport_t::mscclppTransportSHM | mscclppTransport_t::mscclppTransportP2P
        );
        if !epoch_shm.is_empty() && (!shares_epoch || epoch_shm.len() > 64) {
            return Err(Error::remote(format!(
                "rank {from}: setup blob names a shared epoch block ({} bytes) on a {transport:?} connection",
                epoch_shm.len()
            )));
        }
        Ok(ConnBlob {
            transport: tr,
            tag: rtag,
            rank,
            size,
            addr,
            data,
            epoch,
            epoch_shm,
        })
    }
}
/// The most connections one proxy FIFO can address (connId has 10 bits).
const MAX_CONNS_PER_PROXY: usize = 1 << MSCCLPP_BITS_CONNID;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Accepting `mscclppConnect`.
    Declaring,
    /// Connections established; proxies may run.
    Ready,
    /// Setup failed half-way; only destroy is allowed.
    Failed,
}

#[derive(Clone, Debug)]
struct Request {
    remote_rank: usize,
    tag: i32,
    buff: u64,
    size: u64,
    transport: mscclppTransport_t,
    ib_dev: Option<String>,
    kind: MemKind,
}

/// Whether P2P connections get a host signal word (`MSCCLPP_P2P_HOST_SIGNAL=0` turns it off:
/// every signal then reaches the peer's GPU through the SM or copy engines).
fn p2p_host_signals() -> bool {
    !std::env::var("MSCCLPP_P2P_HOST_SIGNAL").is_ok_and(|v| v == "0")
}

/// One endpoint with its FIFO, proxy state and the epoch counters of its connections.
struct Slot {
    key: EndpointKey,
    ep: SharedEndpoint,
    /// The FIFO and the connections' proxy state, shared with the proxy thread (and with host
    /// producers, which may do its work).
    work: SharedWork,
    abort: AbortWord,
    running: Option<Running>,
    peers: HashMap<usize, PeerId>,
    /// Its proxy thread never stopped (`proxy::Running::stop`): the endpoint may be wedged and
    /// its lock held forever, so nothing may touch it again; it and its FIFO are leaked.
    abandoned: bool,
}

struct Conn {
    slot: usize,
    remote_rank: usize,
    tag: i32,
    peer: PeerId,
    /// Epoch block: `mscclppDevConnSignalEpochId` (16 bytes), `waitEpochId` (8 bytes), then
    /// the device address of the host signal word or 0 (`cuda::SignaledEpoch`); host memory for
    /// host buffers, device memory for CUDA buffers.
    _epoch: crate::cuda::EpochMem,
}

struct Registered {
    /// Per established connection: (slot, peer, the peer's imported region, its size).
    remotes: Vec<(usize, PeerId, RemoteId, u64)>,
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
    registered: Vec<Registered>,
    proxies_running: bool,
}

// SAFETY: the raw pointers inside `dev_conns` and slots point to memory the Comm owns; the C API
// documents that one communicator is used from one thread at a time.
unsafe impl Send for Comm {}

impl Comm {
    pub fn new(boot: Bootstrap) -> Self {
        Comm {
            boot: Arc::new(boot),
            phase: Phase::Declaring,
            requests: Vec::new(),
            conns: Vec::new(),
            dev_conns: Vec::new(),
            slots: Vec::new(),
            sticky: Arc::new(Sticky::default()),
            registered: Vec::new(),
            proxies_running: false,
        }
    }

    pub fn rank(&self) -> usize {
        self.boot.rank()
    }
    pub fn nranks(&self) -> usize {
        self.boot.nranks()
    }
    pub fn bootstrap(&self) -> &Bootstrap {
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
        match (transport, kind) {
            (mscclppTransport_t::mscclppTransportP2P, MemKind::Host) => {
                return Err(Error::invalid_arg("mscclppTransportP2P needs a CUDA device buffer; this buffer is host memory (use mscclppTransportSHM or mscclppTransportIB)"))
            }
            (mscclppTransport_t::mscclppTransportP2P | mscclppTransport_t::mscclppTransportSHM, _) if ib_dev.is_some() => {
                return Err(Error::invalid_arg("ibDev must be NULL for P2P and SHM connections"))
            }
            _ => {}
        }
        self.requests.push(Request {
            remote_rank,
            tag,
            buff,
            size,
            transport,
            ib_dev,
            kind,
        });
        Ok(())
    }

    fn endpoint_key(r: &Request) -> EndpointKey {
        let device = match r.kind {
            MemKind::Device(d) => Some(d),
            MemKind::Host => None,
        };
        match r.transport {
            mscclppTransport_t::mscclppTransportP2P => EndpointKey::P2p {
                device: device.unwrap_or(0),
            },
            mscclppTransport_t::mscclppTransportSHM => EndpointKey::Net {
                domain: None,
                shm: true,
                device,
            },
            mscclppTransport_t::mscclppTransportIB => EndpointKey::Net {
                domain: r.ib_dev.clone(),
                shm: false,
                device,
            },
        }
    }

    fn slot_for(&mut self, key: &EndpointKey) -> Result<usize> {
        if let Some(i) = self.slots.iter().position(|s| &s.key == key) {
            return Ok(i);
        }
        let mut ep = transport::open(key)?;
        crate::info!("rank {}: opened endpoint {}", self.rank(), ep.describe());
        let fifo = match key {
            EndpointKey::P2p { device }
            | EndpointKey::Net {
                device: Some(device),
                ..
            } => crate::cuda::new_fifo(*device)?,
            EndpointKey::Net { device: None, .. } => Fifo::new_host()?,
        };
        let abort = fifo.abort_word();
        if let Some(word) = fifo.done_word() {
            if ep.use_done_word(word)? {
                fifo.enable_done_word()?;
            }
        }
        let ep: SharedEndpoint = Arc::new(Mutex::new(ep));
        let name = format!("mscclpp-proxy-{}.{}", self.rank(), self.slots.len());
        let work = ProxyWork::new(
            fifo,
            ep.clone(),
            self.boot.clone(),
            self.sticky.clone(),
            name,
            !Self::may_wedge(key),
        );
        self.slots.push(Slot {
            key: key.clone(),
            ep,
            work,
            abort,
            running: None,
            abandoned: false,
            peers: HashMap::new(),
        });
        Ok(self.slots.len() - 1)
    }

    /// Establishes every declared connection (mscclppConnectionSetup). All blobs are sent before
    /// any is received, and sends never wait for the receiver, so the order in which ranks
    /// declared their connections cannot deadlock; a missing counterpart times out.
    pub fn setup(&mut self) -> Result<()> {
        self.check_sticky()?;
        if self.phase != Phase::Declaring {
            return Err(Error::usage(if self.phase == Phase::Ready {
                "mscclppConnectionSetup was already called"
            } else {
                "an earlier mscclppConnectionSetup failed; destroy this communicator"
            }));
        }
        let r = self.setup_inner();
        self.phase = if r.is_ok() {
            Phase::Ready
        } else {
            Phase::Failed
        };
        r
    }

    fn setup_inner(&mut self) -> Result<()> {
        let reqs = std::mem::take(&mut self.requests);
        // 1. Register locally and send our half of every connection.
        let mut local = Vec::with_capacity(reqs.len());
        for r in &reqs {
            let key = Self::endpoint_key(r);
            let s = self.slot_for(&key)?;
            // SHM over host memory: the epoch block in shared memory, so the peer can store a
            // signal into it without a libfabric call (`proxy::direct_flag`).
            // P2P: a host word beside the device block, where the peer's proxy may store a
            // signal that has no data to follow (`proxy::direct_flag`), which this GPU's
            // wait() polls too: one PCIe leg instead of the proxy -> GPU -> NVLink chain.
            let epoch = match (r.transport, r.kind) {
                (mscclppTransport_t::mscclppTransportSHM, MemKind::Host) => {
                    crate::cuda::EpochMem::Shared(crate::mem::SharedBlock::create(32)?)
                }
                (mscclppTransport_t::mscclppTransportP2P, MemKind::Device(d))
                    if p2p_host_signals() =>
                {
                    match crate::cuda::EpochMem::signaled(d) {
                        Ok(e) => e,
                        Err(e) => {
                            crate::info!("connection to rank {}: no host signal word ({e}): its signals reach this GPU through the peer's engines", r.remote_rank);
                            crate::cuda::alloc_epoch(r.kind)?
                        }
                    }
                }
                _ => crate::cuda::alloc_epoch(r.kind)?,
            };
            let (addr, (src, data_blob), (_, epoch_blob)) = {
                let mut ep = proxy::lock(&self.slots[s].ep);
                (
                    // Per peer: the net transport puts this peer's staging channel in it.
                    ep.address_for(r.remote_rank)?,
                    ep.register(Region {
                        addr: r.buff,
                        len: r.size,
                        kind: r.kind,
                    })?,
                    ep.register(Region {
                        addr: epoch.ptr() as u64,
                        len: 16,
                        kind: crate::cuda::epoch_kind(r.kind),
                    })?,
                )
            };
            let msg = ConnBlob {
                transport: r.transport as u32,
                tag: r.tag,
                rank: self.rank(),
                size: r.size,
                addr: &addr,
                data: &data_blob,
                epoch: &epoch_blob,
                epoch_shm: epoch.shared_name().unwrap_or("").as_bytes(),
            }
            .encode();
            self.boot
                .send(r.remote_rank, TAG_CONN | r.tag as u32 as u64, &msg)?;
            local.push((s, src, epoch));
        }
        // 2. Receive the peers' halves, validate, import.
        for (i, (r, (s, src, epoch))) in reqs.iter().zip(local).enumerate() {
            let msg = self.boot.recv(r.remote_rank, TAG_CONN | r.tag as u32 as u64).map_err(|e| {
                Error::remote(format!("connection to rank {} tag {}: no matching mscclppConnect on the peer ({e})", r.remote_rank, r.tag))
            })?;
            let ConnBlob {
                size: rsize,
                addr,
                data: data_blob,
                epoch: epoch_blob,
                epoch_shm,
                ..
            } = ConnBlob::decode(&msg, r.remote_rank, r.tag, r.transport)?;
            // The peer's epoch block, mapped when both sides are SHM over host memory; or
            // the host word of its P2P epoch block.
            let direct_ok =
                r.kind == MemKind::Host || r.transport == mscclppTransport_t::mscclppTransportP2P;
            let direct = if epoch_shm.is_empty() || !direct_ok {
                None
            } else {
                let name = std::str::from_utf8(epoch_shm).map_err(|_| {
                    Error::remote(format!(
                        "rank {}: shared epoch name is not UTF-8",
                        r.remote_rank
                    ))
                })?;
                let block = crate::mem::SharedBlock::open(name, 32).map_err(|e| {
                    Error::remote(format!("rank {}: its epoch block: {e}", r.remote_rank))
                })?;
                Some(proxy::DirectEpoch(std::sync::Arc::new(block)))
            };
            let slot = &mut self.slots[s];
            let mut ep = proxy::lock(&slot.ep);
            let peer = match slot.peers.get(&r.remote_rank) {
                Some(p) => *p,
                None => {
                    let p = ep.add_peer(r.remote_rank, addr)?;
                    slot.peers.insert(r.remote_rank, p);
                    p
                }
            };
            let dst = ep.import(peer, data_blob)?;
            let remote_epoch = ep.import(peer, epoch_blob)?;
            let remote_buff = ep.remote_ptr(dst).unwrap_or(0);
            let remote_epoch_ptr = ep.remote_ptr(remote_epoch).unwrap_or(0);
            drop(ep);
            let mut work = proxy::lock(&slot.work);
            if work.conns.len() >= MAX_CONNS_PER_PROXY {
                return Err(Error::invalid_arg(format!(
                    "more than {MAX_CONNS_PER_PROXY} connections on one endpoint"
                )));
            }
            let conn_id = work.conns.len();
            if direct.is_some() {
                crate::fifo::set_direct(work.fifo.producer_view(0).triggerFifoHead);
            }
            work.conns.push(ProxyConn {
                remote_rank: r.remote_rank,
                peer,
                src,
                local_size: r.size,
                dst,
                remote_size: rsize,
                remote_epoch,
                signals: 0,
                direct,
                undelivered: false,
                regain_direct: false,
            });
            let ep_ptr = epoch.ptr();
            self.dev_conns.push(mscclppDevConn {
                remoteRank: r.remote_rank as i32,
                tag: r.tag,
                localBuff: r.buff as *mut _,
                localSignalEpochId: ep_ptr.cast(),
                remoteSignalEpochId: remote_epoch_ptr as *mut _,
                // SAFETY: the epoch block is 32 bytes: 16 of epoch ids, then waitEpochId.
                waitEpochId: unsafe { ep_ptr.add(16) }.cast(),
                remoteBuff: remote_buff as *mut _,
                fifo: work.fifo.producer_view(conn_id),
            });
            drop(work);
            self.conns.push(Conn {
                slot: s,
                remote_rank: r.remote_rank,
                tag: r.tag,
                peer,
                _epoch: epoch,
            });
            crate::trace!(
                "rank {}: connection {i} to rank {} tag {} ready",
                self.rank(),
                r.remote_rank,
                r.tag
            );
        }
        // 3. Both sides have imported each other's regions (and mapped the shared epoch
        // blocks) before either returns; the names can go then.
        for c in &self.conns {
            self.boot
                .send(c.remote_rank, TAG_ACK | c.tag as u32 as u64, b"ok")?;
        }
        for c in &self.conns {
            let m = self
                .boot
                .recv(c.remote_rank, TAG_ACK | c.tag as u32 as u64)?;
            if m != b"ok" {
                return Err(Error::remote(format!(
                    "rank {}: bad setup acknowledgement",
                    c.remote_rank
                )));
            }
        }
        for c in &mut self.conns {
            c._epoch.unlink_shared();
        }
        // From now on a peer that dies (closes its bootstrap connection without a goodbye)
        // is noticed by the proxies, which abort every wait on this communicator.
        let peers: Vec<usize> = self.conns.iter().map(|c| c.remote_rank).collect();
        self.boot.watch_peers(&peers)?;
        crate::info!(
            "rank {}: {} connections set up over {} endpoints",
            self.rank(),
            self.conns.len(),
            self.slots.len()
        );
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
        self.proxies_running = true;
        for i in 0..self.slots.len() {
            match proxy::launch(self.slots[i].work.clone()) {
                Ok(r) => self.slots[i].running = Some(r),
                Err(e) => {
                    // Leave nothing half-started behind.
                    self.stop_all();
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Stops every proxy after it has drained its FIFO; returns the first error any met.
    pub fn proxy_stop(&mut self) -> Result<()> {
        self.require_ready("mscclppProxyStop")?;
        if !self.proxies_running {
            return Err(Error::usage(
                "mscclppProxyStop: no proxy is running (call mscclppProxyLaunch first)",
            ));
        }
        self.stop_all();
        self.check_sticky()
    }

    /// libfabric 1.17's shm provider keeps locks in shared memory: a peer killed while holding
    /// one makes every later call into our endpoint spin forever. After such a peer's death
    /// only the proxy thread (which can be abandoned) may have touched the endpoint.
    fn may_wedge(key: &EndpointKey) -> bool {
        matches!(key, EndpointKey::Net { shm: true, .. })
    }

    /// Slots nothing may call into any more: their proxy thread was abandoned, or they may be
    /// wedged by a peer that died.
    fn untouchable(&self) -> Vec<bool> {
        let lost = self.boot.lost_peer().map(|l| l.0);
        self.slots
            .iter()
            .map(|s| {
                s.abandoned
                    || (Self::may_wedge(&s.key) && lost.is_some_and(|p| s.peers.contains_key(&p)))
            })
            .collect()
    }

    fn stop_all(&mut self) {
        let lost = self.boot.lost_peer().map(|l| l.0);
        for s in self.slots.iter_mut() {
            if let Some(r) = s.running.take() {
                // A healthy proxy stops within its final flushes, each bounded by the wait
                // timeout; after a peer of it died they end at once.
                let bound = if lost.is_some_and(|p| s.peers.contains_key(&p)) {
                    STOP_AFTER_LOSS
                } else {
                    crate::fifo::wait_timeout()
                        .saturating_mul(1 + s.peers.len() as u32)
                        .saturating_add(STOP_AFTER_LOSS)
                };
                // The thread records its own failure (sticky error, abort word); a panic or
                // an abandoned thread is recorded here.
                let (r, abandoned) = r.stop_within(bound);
                if let Err(e) = r {
                    let code = crate::capi::result_of(&e);
                    self.sticky.set(code, format!("proxy for {:?}: {e}", s.key));
                    s.abort.set(code);
                }
                s.abandoned |= abandoned;
            }
        }
        self.proxies_running = false;
    }

    /// Registers `[ptr, ptr+size)` with every connection and exchanges it with each peer, which
    /// must make the same call in the same order (mscclppRegisterBuffer). Returns a handle.
    pub fn register_buffer(&mut self, ptr: u64, size: u64) -> Result<u64> {
        self.require_ready("mscclppRegisterBuffer")?;
        self.check_sticky()?;
        if ptr == 0 || size == 0 || ptr.checked_add(size).is_none() {
            return Err(Error::invalid_arg(format!(
                "cannot register buffer {ptr:#x} of {size} bytes"
            )));
        }
        let kind = crate::cuda::mem_kind(ptr);
        let seq = self.registered.len() as u64;
        let tag_of = |c: &Conn| TAG_REG | (seq & 0xff_ffff) << 32 | c.tag as u32 as u64;
        for c in &self.conns {
            let (_, blob) = proxy::lock(&self.slots[c.slot].ep).register(Region {
                addr: ptr,
                len: size,
                kind,
            })?;
            let msg = Writer::new().u64(seq).u64(size).bytes(&blob).finish();
            self.boot.send(c.remote_rank, tag_of(c), &msg)?;
        }
        let mut remotes = Vec::with_capacity(self.conns.len());
        for c in &self.conns {
            let msg = self.boot.recv(c.remote_rank, tag_of(c))?;
            let mut rd = Reader::new(&msg, "registered-buffer blob");
            let (rseq, rsize, blob) = (rd.u64()?, rd.u64()?, rd.bytes()?);
            rd.finish()?;
            if rseq != seq || rsize == 0 {
                return Err(Error::remote(format!("rank {}: registered-buffer blob for registration {rseq} of {rsize} bytes, expected registration {seq}", c.remote_rank)));
            }
            let id = proxy::lock(&self.slots[c.slot].ep).import(c.peer, blob)?;
            remotes.push((c.slot, c.peer, id, rsize));
        }
        self.registered.push(Registered { remotes });
        Ok(seq + 1)
    }

    /// Writes `size` bytes from `src + src_off` into every peer's buffer of registration
    /// `handle` at `dst_off`, and returns once they have arrived.
    pub fn registered_write(
        &mut self,
        handle: u64,
        src: u64,
        size: u64,
        src_off: u64,
        dst_off: u64,
    ) -> Result<()> {
        self.require_ready("mscclppRegisteredBufferWrite")?;
        self.check_sticky()?;
        let reg = handle
            .checked_sub(1)
            .and_then(|i| self.registered.get(i as usize))
            .ok_or_else(|| {
                Error::invalid_arg(format!("unknown registered-memory handle {handle}"))
            })?;
        if src == 0 || size == 0 {
            return Err(Error::invalid_arg("srcBuff is NULL or size is 0"));
        }
        // Check every peer before writing to any, so a bad call changes nothing.
        for &(_, _, _, rsize) in &reg.remotes {
            if dst_off.checked_add(size).is_none_or(|e| e > rsize) {
                return Err(Error::invalid_arg(format!("write of {size} bytes at offset {dst_off} exceeds the peer's {rsize}-byte registered buffer")));
            }
        }
        let src_end = src_off
            .checked_add(size)
            .ok_or_else(|| Error::invalid_arg("srcOffset + size overflows"))?;
        let kind = crate::cuda::mem_kind(src);
        for &(s, peer, rid, _) in &reg.remotes {
            let mut ep = proxy::lock(&self.slots[s].ep);
            let (mr, _): (MrId, _) = ep.register(Region {
                addr: src,
                len: src_end,
                kind,
            })?;
            ep.write(peer, mr, src_off, rid, dst_off, size)?;
            ep.flush(peer)?;
        }
        Ok(())
    }
}

/// How long a destroyed communicator keeps progressing its network endpoints before closing
/// them. A peer that signalled us and then flushes confirms delivery with a marker write that
/// our endpoint must still accept (software providers move it only while we progress); closing
/// at once would cancel it and fail the peer's flush. The marker follows the signal by
/// microseconds in the usual put-signal-flush sequence.
const LINGER: std::time::Duration = std::time::Duration::from_millis(50);
/// How long stopping a proxy may take once a peer of it died (see `stop_all`).
const STOP_AFTER_LOSS: std::time::Duration = std::time::Duration::from_secs(2);

impl Comm {
    fn linger(&mut self) {
        let skip = self.untouchable();
        let net: Vec<&SharedEndpoint> = self
            .slots
            .iter()
            .zip(skip)
            .filter(|(s, skip)| matches!(s.key, EndpointKey::Net { .. }) && !skip)
            .map(|(s, _)| &s.ep)
            .collect();
        if net.is_empty() || self.conns.is_empty() {
            return;
        }
        let t0 = std::time::Instant::now();
        // Ends after LINGER; errors (a peer already gone) do not matter any more.
        while t0.elapsed() < LINGER {
            for ep in &net {
                let mut ep = proxy::lock(ep);
                let _ = ep.progress();
                let _ = ep.poll_incoming();
            }
            std::thread::yield_now();
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // Producers still spinning on our FIFOs must stop; proxies drain, then endpoints close
        // (their registrations before the endpoint), then FIFOs and epoch memory go.
        for s in &self.slots {
            if s.running.is_some() {
                s.abort.set(mscclppResult_t::mscclppInvalidUsage);
            }
        }
        self.stop_all();
        self.linger();
        self.registered.clear();
        self.dev_conns.clear();
        let skip = self.untouchable();
        let slots = std::mem::take(&mut self.slots);
        // An untouchable endpoint is leaked, not closed (closing calls into it). Peers may
        // still write into its connections' epoch blocks (shm writes straight into our
        // memory): those are kept too. The FIFO goes; no transport call is involved.
        let (keep, conns): (Vec<Conn>, Vec<Conn>) = std::mem::take(&mut self.conns)
            .into_iter()
            .partition(|c| skip[c.slot]);
        std::mem::forget(keep);
        for (s, skip) in slots.into_iter().zip(skip) {
            if skip {
                crate::warn!(
                    "rank {}: leaking endpoint {:?}: a peer died and the endpoint may be wedged",
                    self.rank(),
                    s.key
                );
                std::mem::forget(s.ep);
            } else {
                drop(s.ep);
            }
            drop(s.work);
        }
        // Epoch memory goes after the endpoints that registered it.
        drop(conns);
    }
}
