//! P2P transport: CUDA IPC between GPUs of one host (NVLink or PCIe), data moved by the SM copy
//! engine (`engine.rs`, a resident kernel) or by the copy engines.
//!
//! - Registration exports the IPC handle of the allocation that holds the region
//!   (`cuMemGetAddressRange`) with the region's offset; importing opens it once per allocation
//!   (cache keyed by exporting process, base and handle) with lazy peer access, and checks the
//!   region against the mapped size. Regions of this same process are used directly.
//! - Which engine: a put between device buffers, 16-byte aligned, of at most
//!   `MSCCLPP_P2P_SM_MAX_BYTES` (2 MiB), and a flag, go to the SM engine when its kernel runs
//!   (a put with its flag as one job); everything else, and everything while the kernel starts,
//!   to the copy engines. Measured on 2x H200 (bench/RESULTS.md): a copy-engine copy takes
//!   7-9 us from submission to completion whatever its size up to ~1 MiB, the SM engine ~3 us
//!   for a flag and ~8 us for 512 KiB; above a few MiB the copy engine alone fills NVLink.
//! - Copy engines: one non-blocking stream per peer, owned by the endpoint. Data is
//!   `cuMemcpyAsync` on it; Flag is an 8-byte write of the signal count into the peer's epoch,
//!   queued on the same stream after the data (`cuStreamWriteValue64`, or a copy from a pinned
//!   staging ring).
//! - Ordering between the two: work that must follow earlier work of the other path (a flag,
//!   a put, a flush) waits for it first (`drain_sm`, `drain_ce`, and `Engine::order_flags`
//!   before a flag changes path, so the signal count never steps back). Sync waits for both,
//!   bounded by `MSCCLPP_WAIT_TIMEOUT`.
//! - `remote_ptr` gives the mapped addresses, so kernels may also load/store peers directly;
//!   where our GPU reaches the peer's with native atomics, small puts, signals and flushes of
//!   kernels skip the proxy altogether (`direct_bytes`, the direct path: `route.rs`).
//! - Teardown stops the engine, waits for the streams, closes every mapping, then frees the
//!   streams.
//!
//! Several ranks may share a GPU (processes on one device): IPC then maps within the device,
//! and the SM engine stays off (its resident kernel would hold the GPU the processes
//! time-slice).
//!
//! Files: this one the endpoint (`open`, the `Endpoint` impl, teardown); `route.rs` which path
//! carries an operation (the kernel itself, the SM engine or the copy engines) and the ordering
//! between the paths; `engine.rs` the SM engine;
//! `ce.rs` a peer's copy-engine stream; `regions.rs` registration and IPC import; `done.rs`
//! the done word; `blob.rs` the wire blobs; `stats.rs` driver-call timing. Settings come
//! from `config::P2pConfig`, read once per process.

mod blob;
mod ce;
mod done;
mod engine;
mod regions;
mod route;
mod stats;

use super::epoch::{self, EpochMem};
use super::{DirectLimits, Endpoint, MemKind, MrId, PeerId, Region, RemoteId};
use crate::config::P2pConfig;
use crate::cuda::{self, Ctx, CtxGuard};
use crate::error::{Error, Result};
use blob::{host_id, process_nonce, Address, RegionBlob};
use ce::{FlagMode, PeerStream};
use done::DoneWord;
use engine::Engine;
use regions::Regions;
use stats::Stats;

/// Opens the P2P endpoint of CUDA device `device` (one stream per peer, created at `add_peer`).
pub fn open(device: i32) -> Result<Box<dyn Endpoint>> {
    if !cuda::available() {
        return Err(Error::usage(
            "mscclppTransportP2P needs a CUDA driver and device; this process runs in host mode",
        ));
    }
    let ctx = Ctx::primary(device)?;
    let cfg = crate::config::get().p2p.clone();
    let mode = FlagMode::choose(&cfg);
    let stats = cfg.stats;
    crate::info!("p2p endpoint on CUDA device {device}: flags by {mode:?}");
    Ok(Box::new(P2p {
        device,
        me: Address {
            host: host_id().to_owned(),
            nonce: process_nonce(),
            device,
            bus: cuda::pci_bus_id(device).unwrap_or_default(),
        },
        ctx,
        mode,
        engine: Engine::open(device, &cfg),
        regions: Regions::new(device),
        peers: Vec::new(),
        done: DoneWord::default(),
        stats: Stats {
            on: stats,
            ..Stats::default()
        },
        cfg,
    }))
}

struct Peer {
    rank: usize,
    addr: Address,
    /// The peer's copy-engine stream (`ce.rs`).
    ce: PeerStream,
    /// The last SM-engine job for this peer (done once the engine's DONE reaches it). Work
    /// that must follow both paths' earlier work (a flag, a flush, a put by the other path)
    /// drains the other path first.
    sm_last: u64,
    /// An SM-engine job for this peer stored a flag that may still be in flight (the kernel
    /// does not fence after flags): a flag by the copy engine must wait for it.
    sm_flag: bool,
    /// The SM engine may carry this peer's work: its GPU is another one, or ours with an MPS
    /// daemon serving it (`MSCCLPP_P2P_SM_SHARED`). Without MPS, ranks sharing a GPU
    /// time-slice it, and a resident engine kernel would hold it.
    sm_ok: bool,
    /// The direct path's answer for this peer was logged (once per peer, `direct_limit`).
    direct_said: bool,
}

/// `peers[p]` (a function of the vector alone, so that other fields stay borrowable).
fn peer_mut(peers: &mut [Peer], p: PeerId) -> Result<&mut Peer> {
    let n = peers.len();
    peers
        .get_mut(p)
        .ok_or_else(|| Error::internal(format!("P2P peer id {p} of {n}")))
}

struct P2p {
    device: i32,
    /// This endpoint's address: its host, process and GPU (ordinal and PCI address).
    me: Address,
    ctx: Ctx,
    mode: FlagMode,
    /// Puts up to `Engine::max_bytes` and flags, when the kernel runs (`engine.rs`).
    engine: Option<Engine>,
    /// Registrations, imported regions and their IPC mappings (`regions.rs`).
    regions: Regions,
    /// Indexed by `PeerId`.
    peers: Vec<Peer>,
    /// The proxy FIFO's done word (`done.rs`).
    done: DoneWord,
    stats: Stats,
    cfg: P2pConfig,
}

impl P2p {
    /// Rank `rank` uses this process's GPU too: without MPS the two processes' kernels
    /// time-slice it, and every wait across them lasts a context switch (~2 ms measured on an
    /// H100). Returns whether an MPS daemon serves this process (its control socket exists);
    /// says so at INFO, once per process, where none does.
    fn note_shared_gpu(&self, rank: usize, nonce: u64) -> bool {
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        let control = std::path::Path::new(&self.cfg.mps_pipe_dir).join("control");
        if control.exists() {
            // Peers in other processes only (a rank that is a thread of this one shares our
            // streams' queues, not another client's).
            if nonce != process_nonce() && crate::cuda::note_mps_shared_peer(self.device, nonce) {
                crate::warn!(
                    "p2p:cuda{}: three or more ranks share this GPU under MPS, whose clients share one pool of hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS, CUDA's default 8): this library's copy-engine work for them (puts and signals through the proxy) can queue behind another rank's spinning kernel, and a kernel that waits for it then stalls until the wait timeout (measured with 3 and 4 ranks; none stalled at 16: bench/RESULTS.md, issue 44). Set CUDA_DEVICE_MAX_CONNECTIONS=16 in every rank's environment",
                    self.device
                );
            }
            return true;
        }
        if SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
            return false;
        }
        crate::info!(
            "p2p:cuda{}: rank {rank} uses this GPU too and no MPS daemon answers here ({} is missing): the ranks' kernels time-slice the GPU, ~2 ms per wait across them; run an MPS daemon for several ranks per GPU (README)",
            self.device,
            control.display()
        );
        false
    }

    fn peer(&mut self, p: PeerId) -> Result<&mut Peer> {
        peer_mut(&mut self.peers, p)
    }
}

impl Endpoint for P2p {
    fn describe(&self) -> String {
        format!("p2p:cuda{}", self.device)
    }

    /// A device block whose word `MSCCLPP_EPOCH_DIRECT` the peer's kernels may add their own
    /// signals into (the direct path, `route.rs`), exported with it.
    fn epoch_block(&mut self, kind: MemKind) -> Result<EpochMem> {
        match kind {
            MemKind::Device(d) => epoch::device(d, true),
            MemKind::Host => epoch::plain(kind),
        }
    }

    fn address(&self) -> Result<Vec<u8>> {
        Ok(self.me.encode())
    }

    fn add_peer(&mut self, remote_rank: usize, address: &[u8]) -> Result<PeerId> {
        let addr = Address::decode(address)?;
        if addr.host != host_id() {
            return Err(Error::invalid_arg(format!(
                "mscclppTransportP2P to rank {remote_rank}: that rank runs on another host (CUDA IPC works within one host; use mscclppTransportIB)"
            )));
        }
        let ce = PeerStream::new(self.device)?;
        let sm_ok = !self.me.same_gpu(&addr)
            || (self.note_shared_gpu(remote_rank, addr.nonce) && self.cfg.sm_shared);
        crate::trace!(
            "p2p:cuda{}: peer rank {remote_rank} on its device {}",
            self.device,
            addr.device
        );
        self.peers.push(Peer {
            rank: remote_rank,
            addr,
            ce,
            sm_last: 0,
            sm_flag: false,
            sm_ok,
            direct_said: false,
        });
        Ok(self.peers.len() - 1)
    }

    fn register(&mut self, region: Region) -> Result<(MrId, Vec<u8>)> {
        self.regions.register(region)
    }

    fn register_source(&mut self, region: Region) -> Result<MrId> {
        self.regions.register_source(region)
    }

    fn release_source(&mut self, src: MrId) -> Result<()> {
        self.regions.release_source(src)
    }

    fn deregister(&mut self, mr: MrId) -> Result<()> {
        self.regions.deregister(mr)
    }

    fn forget(&mut self, remote: RemoteId) -> Result<()> {
        self.regions.forget(remote)
    }

    fn import(&mut self, peer: PeerId, blob: &[u8]) -> Result<RemoteId> {
        let b = RegionBlob::decode(blob)?;
        let (rank, peer_nonce) = {
            let p = self.peer(peer)?;
            (p.rank, p.addr.nonce)
        };
        self.regions.import(peer, (rank, peer_nonce), b)
    }

    fn remote_ptr(&self, remote: RemoteId) -> Option<u64> {
        self.regions.remote_ptr(remote)
    }

    fn direct_limits(&mut self, peer: PeerId, dst: RemoteId, epoch: RemoteId) -> DirectLimits {
        self.direct_limit(peer, dst, epoch)
    }

    fn remote_len(&self, remote: RemoteId) -> Option<u64> {
        self.regions.remote_len(remote)
    }

    fn write(
        &mut self,
        peer: PeerId,
        src: MrId,
        src_off: u64,
        dst: RemoteId,
        dst_off: u64,
        size: u64,
    ) -> Result<()> {
        let put = self
            .regions
            .put_target(peer, src, src_off, dst, dst_off, size)?;
        let _g = CtxGuard::enter_ctx(self.ctx)?;
        if self.sm_put(peer, &put, None)? {
            return Ok(());
        }
        self.ce_put(peer, &put)?;
        self.ce_done(peer)
    }

    fn write_value(&mut self, peer: PeerId, dst: RemoteId, dst_off: u64, value: u64) -> Result<()> {
        let flag = self.regions.flag_target(peer, dst, dst_off, value)?;
        let _g = CtxGuard::enter_ctx(self.ctx)?;
        // By the SM engine unless data for this peer is still queued on its stream (the flag
        // must follow that data, which the stream orders).
        if !self.peer(peer)?.ce.dirty() && self.sm_route(peer, flag.mapped)? {
            return self.sm_post(peer, (0, 0, 0), Some((flag.addr, value)));
        }
        self.ce_flag(peer, &flag)?;
        self.ce_done(peer)
    }

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
        let put = self
            .regions
            .put_target(peer, src, src_off, dst, dst_off, size)?;
        let flag = self.regions.flag_target(peer, vdst, voff, value)?;
        let _g = CtxGuard::enter_ctx(self.ctx)?;
        // One engine job carries both: the kernel stores the flag after the bytes.
        if flag.mapped && self.sm_put(peer, &put, Some((flag.addr, value)))? {
            return Ok(());
        }
        self.ce_put(peer, &put)?;
        self.ce_flag(peer, &flag)?;
        self.ce_done(peer)
    }

    fn flush(&mut self, peer: PeerId) -> Result<()> {
        let _g = CtxGuard::enter_ctx(self.ctx)?;
        self.drain_sm(peer)?;
        self.drain_ce(peer)?;
        // A Sync whose earlier tickets no job claimed (nothing queued, or copy-engine work):
        // a job that only stores the done word, so that the producer's flush() (which needs
        // the tickets below its Sync's) still ends on its GPU's memory rather than on a PCIe
        // read of its slot. Only while the kernel runs (starting it costs more than that
        // read).
        if self.engine.as_ref().is_some_and(|e| e.on()) {
            let done = self.claim_below(self.done.before_current(), None);
            if done != 0 {
                let e = self.engine.as_mut().expect("checked above");
                e.post((0, 0, 0), None, done)?;
            }
        }
        Ok(())
    }

    fn use_done_word(&mut self, addr: u64) -> Result<bool> {
        if let Some(e) = self.engine.as_mut() {
            e.set_done_word(addr);
        } else if self.mode != FlagMode::WriteValue {
            // Neither the SM engine nor stream write-values: nobody could store it.
            return Ok(false);
        }
        if !self.cfg.done_word {
            crate::info!(
                "p2p:cuda{}: flush() waits for the proxy (MSCCLPP_P2P_DONE_WORD=0)",
                self.device
            );
            if let Some(e) = self.engine.as_mut() {
                e.set_done_word(0);
            }
            return Ok(false);
        }
        self.done.word = addr;
        Ok(true)
    }

    fn set_ticket(&mut self, ticket: u64) {
        self.done.ticket = Some(ticket);
    }

    fn quiesce(&mut self) -> Result<()> {
        if let Some(e) = self.engine.as_mut() {
            let _g = CtxGuard::enter_ctx(self.ctx)?;
            e.stop()?;
        }
        Ok(())
    }

    fn gpu_busy(&mut self) -> Option<String> {
        let mut busy: Vec<String> = Vec::new();
        if self.engine.as_ref().is_some_and(|e| !e.is_off()) {
            busy.push("the SM copy engine's kernel did not stop".into());
        }
        match CtxGuard::enter_ctx(self.ctx) {
            Ok(_g) => {
                for p in &self.peers {
                    match p.ce.idle() {
                        Ok(true) => {}
                        Ok(false) => busy.push(format!("copies to rank {} did not finish", p.rank)),
                        Err(e) => busy.push(format!("copies to rank {} failed ({e})", p.rank)),
                    }
                }
            }
            Err(e) => busy.push(format!("its CUDA context could not be entered ({e})")),
        }
        (!busy.is_empty()).then(|| busy.join("; "))
    }

    fn progress(&mut self) -> Result<()> {
        // Copies progress by themselves; an engine idle for its linger time stops.
        if let Some(e) = self.engine.as_mut() {
            let _g = CtxGuard::enter_ctx(self.ctx)?;
            e.idle_tick()?;
        }
        Ok(())
    }
}

impl Drop for P2p {
    fn drop(&mut self) {
        // Streams first (queued copies read and write the mappings), then the mappings, then the
        // streams and staging rings (dropped with `peers`). What may still run (the engine's
        // kernel, a stream's copies) keeps what it uses: the mappings, streams and rings are
        // then leaked, never freed under it.
        let mut busy: Vec<String> = Vec::new();
        match CtxGuard::enter_ctx(self.ctx) {
            Ok(_g) => {
                // The engine's kernel stores into the mappings too: stopped first.
                if let Some(mut e) = self.engine.take() {
                    self.stats.sm_jobs = e.jobs;
                    self.stats.sm_timing = e.timing();
                    self.stats.sm_launches = e.launches();
                    match e.stop() {
                        Ok(()) => {}
                        Err(err) if e.is_off() => {
                            crate::warn!("p2p:cuda{} teardown: {err}", self.device)
                        }
                        Err(err) => {
                            busy.push(format!("the SM copy engine's kernel did not stop ({err})"))
                        }
                    }
                    // Frees its own memory only if the kernel ended.
                    drop(e);
                }
                for p in &self.peers {
                    if let Err(e) = p.ce.wait(|| "P2P copies at teardown".into()) {
                        busy.push(format!("copies to rank {} did not finish ({e})", p.rank));
                    }
                }
            }
            Err(e) => busy.push(format!("its CUDA context could not be entered ({e})")),
        }
        self.stats.report(self.device);
        if busy.is_empty() {
            self.regions.unmap();
            self.peers.clear();
        } else {
            crate::warn!(
                "p2p:cuda{} teardown: leaking its CUDA IPC mappings of the peers' memory, its copy streams and flag rings, which may still be in use: {}",
                self.device,
                busy.join("; ")
            );
            std::mem::forget(std::mem::replace(
                &mut self.regions,
                Regions::new(self.device),
            ));
            std::mem::forget(std::mem::take(&mut self.peers));
        }
    }
}
