//! Transports: the one trait every way of moving bytes implements, and the one place that picks
//! an implementation for a connection.
//!
//! An [`Endpoint`] is one transport instance on this rank (one libfabric endpoint, or one GPU's
//! copy-engine stream). After `mscclppConnectionSetup` it belongs to one proxy thread, which is
//! the only caller of its data-path methods, except `mscclppRegisteredBufferWrite`, which takes the
//! same lock as the proxy.

pub mod epoch;
pub mod inbox;
pub mod net;
pub mod p2p;
pub mod slots;
pub mod staging;

use crate::abi::mscclppTransport_t;
use crate::config::IbDev;
use crate::error::{Error, Result};
use epoch::EpochMem;

pub use crate::mem::{MemKind, Region};

/// A count of timed events (waits, driver calls) and the time they took, for the endpoints'
/// statistics logs.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timed {
    pub n: u64,
    pub time: std::time::Duration,
}

impl Timed {
    /// One more event, which began at `since`.
    pub fn add(&mut self, since: std::time::Instant) {
        self.n += 1;
        self.time += since.elapsed();
    }

    /// The mean time per event in microseconds (0 without events).
    pub fn avg_us(&self) -> f64 {
        if self.n == 0 {
            0.0
        } else {
            self.time.as_secs_f64() * 1e6 / self.n as f64
        }
    }
}

/// "n (total ms)".
impl std::fmt::Display for Timed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({:.1} ms)", self.n, self.time.as_secs_f64() * 1e3)
    }
}

/// Index of a local registration inside one endpoint.
pub type MrId = usize;
/// Index of a peer (remote endpoint) inside one endpoint.
pub type PeerId = usize;
/// Index of an imported remote region inside one endpoint.
pub type RemoteId = usize;

/// What a connection's kernels may copy themselves (the direct path, `Endpoint::direct_limits`):
/// the largest put one thread copies (`put()`), and the largest one a whole block copies
/// (`putBlock()`). `thread` 0: the path is off, and so is `block`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DirectLimits {
    pub thread: u64,
    pub block: u64,
}

/// One transport instance. Each method returns an error instead of blocking without bound.
///
/// Ordering contract: on one `PeerId`, `write_value` is delivered after every earlier `write`
/// (the receiver that sees the value sees the data), and `flush` returns only when every earlier
/// `write` and `write_value` to that peer has reached the peer's memory (for memory the peer
/// stages, its destination memory: see `net/staging/`). Some of that may need the receiving
/// endpoint's own work: its proxy calls `progress` and `poll_incoming` whenever idle. Values
/// into one word only grow (they are signal counts), by less than 2^31 a write: a transport
/// may carry a value with a `write_then_value`'s data as its low bits (`net/signals.rs`).
pub trait Endpoint: Send {
    /// Human-readable identity for logs and errors, e.g. `net:tcp;ofi_rxm/lo`.
    fn describe(&self) -> String;
    /// What this endpoint answers about itself; see [`Caps`]. Default: nothing special.
    fn caps(&self) -> Caps {
        Caps::default()
    }
    /// The epoch block for a connection whose buffer is `kind` memory (see `epoch.rs`).
    /// Default: plain host or device memory.
    fn epoch_block(&mut self, kind: MemKind) -> Result<EpochMem> {
        epoch::plain(kind)
    }
    /// Whether a signal to a peer may be stored straight into the epoch block that the peer
    /// offered by name (`EpochMem::shared_name`), when this side's buffer is `kind` memory.
    /// Only asked where [`Caps::direct_epoch`] holds. Default: false.
    fn direct_epoch_for(&self, _kind: MemKind) -> bool {
        false
    }
    /// The address blob a peer needs to reach this endpoint.
    fn address(&self) -> Result<Vec<u8>>;
    /// Makes a peer reachable from its address blob. A peer is the endpoint that address
    /// names, not its rank: a rank whose two endpoints talk to this one is two peers; the same
    /// address again returns the same peer.
    fn add_peer(&mut self, remote_rank: usize, address: &[u8]) -> Result<PeerId>;
    /// What this endpoint keeps for `peer` that the peer must know to write to it (the net
    /// transport's staging channel and counting stream), made once the peer is added and
    /// handed to it (connection setup's acknowledgement), which gives it to its own endpoint's
    /// `link_to`. Default: nothing.
    fn link_for(&mut self, _peer: PeerId) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }
    /// Takes the link `peer` made for this endpoint (`link_for`), before anything is written
    /// to it. Default: nothing to take (an empty link).
    fn link_to(&mut self, peer: PeerId, link: &[u8]) -> Result<()> {
        if link.is_empty() {
            return Ok(());
        }
        Err(Error::remote(format!(
            "peer {peer}: a link of {} bytes, which this transport does not take",
            link.len()
        )))
    }
    /// Registers a local region (exactly `region`, never rounded up) and returns a blob that
    /// lets a peer write into it. Registering the same region twice returns the same id.
    fn register(&mut self, region: Region) -> Result<(MrId, Vec<u8>)>;
    /// Registers `region` as the source of the writes of one synchronous call
    /// (`mscclppRegisteredBufferWrite`), which releases it with `release_source` once a `flush`
    /// covered them. Never shared with another registration of the same range (the memory
    /// may have been freed and its address reused since), never exported.
    fn register_source(&mut self, region: Region) -> Result<MrId>;
    /// Releases a `register_source` registration, which no write in flight reads any more
    /// (every write from it was flushed); its id may be handed out again. A source whose
    /// flush failed is not released: the endpoint's teardown closes it after its drain.
    fn release_source(&mut self, src: MrId) -> Result<()>;
    /// Releases a `register` registration (`mscclppUnregisterBuffer`): the libfabric MR is
    /// closed, the bookkeeping dropped, and the id may be handed out again. Called only once
    /// every peer that imported the region has said it dropped that import, with nothing of
    /// theirs in flight into it (their writes were flushed); `register` deduplicates, so the
    /// caller releases a region only when its last use goes. A source is refused.
    fn deregister(&mut self, mr: MrId) -> Result<()>;
    /// Imports a region a peer registered (its blob); validated before use.
    fn import(&mut self, peer: PeerId, blob: &[u8]) -> Result<RemoteId>;
    /// Drops an imported region that this side will not write to again, with no write to it in
    /// flight (the caller flushed): what mapped it (a CUDA IPC mapping no other import uses)
    /// is closed. Its id is never handed out again, so an id held elsewhere cannot come to
    /// name another region; using it is an error.
    fn forget(&mut self, remote: RemoteId) -> Result<()>;
    /// The length in bytes of an imported region, as its blob declares it (None: unknown id).
    fn remote_len(&self, remote: RemoteId) -> Option<u64>;
    /// Direct pointer to an imported region, where this process can load/store it
    /// (P2P: the peer's GPU buffer mapped through CUDA IPC). None otherwise.
    fn remote_ptr(&self, _remote: RemoteId) -> Option<u64> {
        None
    }
    /// The largest puts that this side's kernels may make themselves on a connection to
    /// `peer`, storing into the imported region `dst` and adding each signal into word
    /// `MSCCLPP_EPOCH_DIRECT` of the peer's imported epoch block `epoch` (the direct path,
    /// docs/DESIGN.md 3.2); all 0: none, every operation goes through the proxy. Asked once
    /// per connection at setup. Default: none.
    fn direct_limits(&mut self, _peer: PeerId, _dst: RemoteId, _epoch: RemoteId) -> DirectLimits {
        DirectLimits::default()
    }
    /// Starts a copy of `size` bytes from local `src`+`src_off` to remote `dst`+`dst_off`.
    /// Bounds were checked by the caller.
    fn write(
        &mut self,
        peer: PeerId,
        src: MrId,
        src_off: u64,
        dst: RemoteId,
        dst_off: u64,
        size: u64,
    ) -> Result<()>;
    /// Starts a write of the 8-byte `value` into remote `dst`+`dst_off`, ordered after every
    /// earlier `write` to `peer`.
    fn write_value(&mut self, peer: PeerId, dst: RemoteId, dst_off: u64, value: u64) -> Result<()>;
    /// A `write` and then a `write_value` (`(dst, dst_off, value)`) to the same peer, as one
    /// operation where the transport does that cheaper (the P2P SM engine: one job whose flag
    /// the kernel stores after the bytes). Default: the two calls.
    #[allow(clippy::too_many_arguments)] // the arguments of `write`, plus the flag's
    fn write_then_value(
        &mut self,
        peer: PeerId,
        src: MrId,
        src_off: u64,
        dst: RemoteId,
        dst_off: u64,
        size: u64,
        (vdst, voff, value): (RemoteId, u64, u64),
    ) -> Result<()> {
        self.write(peer, src, src_off, dst, dst_off, size)?;
        self.write_value(peer, vdst, voff, value)
    }
    /// Waits (bounded) until every earlier write to `peer` has reached the peer.
    fn flush(&mut self, peer: PeerId) -> Result<()>;
    /// Drives completions and the provider's progress engine; called by the proxy when idle.
    fn progress(&mut self) -> Result<()>;
    /// Whether peers' writes arrived since the last call, as far as this endpoint can see them
    /// (the net transport: writes that carried remote CQ data). An idle proxy that sees them
    /// keeps polling rather than napping: over providers whose writes move only while the
    /// target progresses, a napping target slows its peers' streams. Default: false.
    fn took_incoming(&mut self) -> bool {
        false
    }
    /// Finishes writes that peers made into this endpoint and that need this side's work
    /// before the local waiter may see them (the net transport applies staged writes to GPU
    /// memory, then stores the signal count after them). Called by the proxy when idle and
    /// now and then while busy; must not block. Default: nothing to do.
    fn poll_incoming(&mut self) -> Result<()> {
        Ok(())
    }
    /// The proxy stops (or failed): end whatever runs on the device on its behalf (the P2P SM
    /// engine's kernel), so that the user's device-wide synchronisations (`cudaDeviceSynchronize`,
    /// `cudaFree`) after `mscclppProxyStop` do not wait for it. Bounded. Default: nothing.
    fn quiesce(&mut self) -> Result<()> {
        Ok(())
    }
    /// The proxy's FIFO has a done word in device memory (`Fifo::done_word`, a device address):
    /// an endpoint that can store into it, in order with its work, "every trigger with a ticket
    /// below d has completed" may take it and return true; the producers' flush() then polls it
    /// too. Default: false (the proxy's retirement of the Sync slot is the only signal).
    fn use_done_word(&mut self, _addr: u64) -> Result<bool> {
        Ok(false)
    }
    /// The trigger whose work the next calls start has FIFO ticket `ticket` (see
    /// `use_done_word`). Default: ignored.
    fn set_ticket(&mut self, _ticket: u64) {}
    /// Installs a check that the endpoint's bounded waits (flush, a full queue, retries) poll:
    /// when it returns why, the wait fails at once instead of running to its timeout. The
    /// proxy installs "a peer of this endpoint died". Default: ignored.
    fn set_abort_check(&mut self, _check: AbortCheck) {}
    /// After `quiesce`: what this endpoint still has running on the GPU (a kernel that did not
    /// stop, copies that did not finish), or None. Teardown then leaks the endpoint and its
    /// FIFO (that work stores into both) rather than free memory under it. Must not block.
    /// Default: None.
    fn gpu_busy(&mut self) -> Option<String> {
        None
    }
}

/// The questions about a transport whose answers change what the communicator does around it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caps {
    /// A peer that dies may leave this endpoint wedged (libfabric 1.17's shm provider keeps
    /// locks in shared memory: a peer killed while holding one makes every later call into our
    /// endpoint spin forever). After such a death only the proxy thread, which can be
    /// abandoned, may touch it; teardown leaks it instead of closing it.
    pub may_wedge: bool,
    /// Peers' flushes may need this endpoint's progress after our last operation (the net
    /// transport's delivery markers move only while the target progresses): a destroyed
    /// communicator keeps progressing it a little while before closing it.
    pub linger: bool,
    /// Peers may offer their epoch blocks by shared-memory name in the setup blob, and signals
    /// may then be stored into them directly (see [`Endpoint::direct_epoch_for`]). A blob that
    /// offers one on an endpoint without this is refused.
    pub direct_epoch: bool,
}

/// See [`Endpoint::set_abort_check`]: `Some(why)` means "give up now".
pub type AbortCheck = Box<dyn Fn() -> Option<String> + Send>;

/// The C transport enum, checked (C may pass any integer).
pub fn transport_from_c(v: i32) -> Option<mscclppTransport_t> {
    match v {
        0 => Some(mscclppTransport_t::mscclppTransportP2P),
        1 => Some(mscclppTransport_t::mscclppTransportSHM),
        2 => Some(mscclppTransport_t::mscclppTransportIB),
        _ => None,
    }
}

/// What an endpoint is made for: the key under which the communicator keeps one endpoint (and
/// one proxy thread) per (transport, device, NIC) combination.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum EndpointKey {
    /// CUDA IPC from this device ordinal.
    P2p { device: i32 },
    /// libfabric; `ibdev`: the domain the user's `ibDev` resolved to (through
    /// `MSCCLPP_IBDEV_MAP`), `shm` for SHM.
    Net {
        ibdev: IbDev,
        shm: bool,
        device: Option<i32>,
    },
}

impl EndpointKey {
    /// The endpoint a connection over `transport` with a buffer of `kind` memory needs
    /// (`ib_dev`: the user's NIC name for IB). Refuses the combinations no transport serves.
    pub fn for_connection(
        transport: mscclppTransport_t,
        kind: MemKind,
        ib_dev: Option<&str>,
    ) -> Result<Self> {
        use mscclppTransport_t::*;
        let device = match kind {
            MemKind::Device(d) => Some(d),
            MemKind::Host => None,
        };
        match (transport, device) {
            (mscclppTransportP2P, None) => Err(Error::invalid_arg("mscclppTransportP2P needs a CUDA device buffer; this buffer is host memory (use mscclppTransportSHM or mscclppTransportIB)")),
            (mscclppTransportP2P | mscclppTransportSHM, _) if ib_dev.is_some() => {
                Err(Error::invalid_arg("ibDev must be NULL for P2P and SHM connections"))
            }
            (mscclppTransportP2P, Some(device)) => Ok(EndpointKey::P2p { device }),
            (mscclppTransportSHM, device) => Ok(EndpointKey::Net {
                ibdev: IbDev::Auto,
                shm: true,
                device,
            }),
            (mscclppTransportIB, device) => {
                let ibdev = crate::config::get().net.map_ibdev(ib_dev);
                match &ibdev {
                    IbDev::Mapped { from, to } => crate::info!(
                        "ibDev {from:?}: libfabric domain {to:?} (MSCCLPP_IBDEV_MAP)"
                    ),
                    IbDev::MappedAuto { from } => crate::info!(
                        "ibDev {from:?}: the library's choice of domain (MSCCLPP_IBDEV_MAP maps it to auto)"
                    ),
                    IbDev::Named(_) | IbDev::Auto => {}
                }
                Ok(EndpointKey::Net {
                    ibdev,
                    shm: false,
                    device,
                })
            }
        }
    }

    /// The device whose kernels produce into this endpoint's FIFO (None: host threads).
    pub fn device(&self) -> Option<i32> {
        match self {
            EndpointKey::P2p { device } => Some(*device),
            EndpointKey::Net { device, .. } => *device,
        }
    }

    pub fn transport(&self) -> mscclppTransport_t {
        match self {
            EndpointKey::P2p { .. } => mscclppTransport_t::mscclppTransportP2P,
            EndpointKey::Net { shm: true, .. } => mscclppTransport_t::mscclppTransportSHM,
            EndpointKey::Net { shm: false, .. } => mscclppTransport_t::mscclppTransportIB,
        }
    }
}

/// Opens the endpoint for `key`. The single place that maps a transport choice to code.
pub fn open(key: &EndpointKey) -> Result<Box<dyn Endpoint>> {
    match key {
        EndpointKey::P2p { device } => p2p::open(*device),
        EndpointKey::Net {
            ibdev,
            shm,
            device,
        } => net::open(ibdev.domain(), *shm, *device).map_err(|e| match (ibdev, e) {
            // A name the program passed that names no domain here: say how to map it.
            (IbDev::Named(name), Error::InvalidArgument(m)) => Error::InvalidArgument(format!(
                "ibDev {name:?}: {m}; map the names a program passes as ibDev with MSCCLPP_IBDEV_MAP, e.g. MSCCLPP_IBDEV_MAP='*=auto' (the library's choice) or '{name}=DOMAIN'"
            )),
            (IbDev::Mapped { from, to }, Error::InvalidArgument(m)) => Error::InvalidArgument(
                format!("ibDev {from:?} is mapped to {to:?} by MSCCLPP_IBDEV_MAP: {m}"),
            ),
            (_, e) => e,
        }),
    }
}
