//! P2P transport: CUDA IPC plus copy-engine copies between GPUs of one host (NVLink or PCIe).
//!
//! - Registration exports the IPC handle of the allocation that holds the region
//!   (`cuMemGetAddressRange`) with the region's offset; importing opens it once per allocation
//!   (cache keyed by exporting process, base and handle) with lazy peer access, and checks the
//!   region against the mapped size. Regions of this same process are used directly.
//! - One non-blocking stream per peer, owned by the endpoint: Data is `cuMemcpyAsync` on it;
//!   Flag is an 8-byte write of the signal count into the peer's epoch, queued on the same
//!   stream after the data (`cuStreamWriteValue64`, or a copy from a pinned staging ring);
//!   Sync polls the stream until idle, bounded by `MSCCLPP_WAIT_TIMEOUT`.
//! - `remote_ptr` gives the mapped addresses, so kernels may also load/store peers directly.
//! - Teardown waits for the streams, closes every mapping, then frees the streams.
//!
//! Several ranks may share a GPU (processes on one device): IPC then maps within the device.

mod blob;

use super::{Endpoint, MemKind, MrId, PeerId, Region, RemoteId};
use crate::cuda::{self, Ctx, CtxGuard, IpcMapping, PinnedHost, Stream, IPC_HANDLE_BYTES};
use crate::error::{Error, Result};
use blob::{host_id, process_nonce, Address, RegionBlob};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Staging values per peer for Flag writes done by copy: a slot is reused only after the
/// stream has been seen idle since it was queued (see `write_value`).
const RING: u64 = 512;

/// Time spent in driver calls, for `MSCCLPP_P2P_STATS=1` (printed when the endpoint closes):
/// where the proxy's share of a put's latency goes.
#[derive(Default)]
struct Stats {
    on: bool,
    copies: (u64, Duration),
    values: (u64, Duration),
    flushes: (u64, Duration),
}

impl Stats {
    fn add(slot: &mut (u64, Duration), since: Option<Instant>) {
        if let Some(t) = since {
            slot.0 += 1;
            slot.1 += t.elapsed();
        }
    }
    fn start(&self) -> Option<Instant> {
        self.on.then(Instant::now)
    }
    fn report(&self, device: i32) {
        if !self.on {
            return;
        }
        let f = |(n, d): (u64, Duration)| {
            let avg = if n == 0 {
                0.0
            } else {
                d.as_secs_f64() * 1e6 / n as f64
            };
            format!("{n} x {avg:.2} us")
        };
        crate::info!(
            "p2p:cuda{device} stats: copy calls {}, flag calls {}, flush waits {}",
            f(self.copies),
            f(self.values),
            f(self.flushes)
        );
    }
}

/// How a Flag reaches the peer's epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FlagMode {
    /// `cuStreamWriteValue64`: no copy engine and no staging; the stream's memory barrier
    /// orders it after the data.
    WriteValue,
    /// An 8-byte `cuMemcpyAsync` from the pinned staging ring.
    Copy,
}

fn flag_mode_from_env() -> FlagMode {
    match std::env::var("MSCCLPP_P2P_FLAG").as_deref() {
        Ok("copy") => FlagMode::Copy,
        _ if cuda::has_write_value64() => FlagMode::WriteValue,
        _ => FlagMode::Copy,
    }
}

/// Opens the P2P endpoint of CUDA device `device` (one stream per peer, created at `add_peer`).
pub fn open(device: i32) -> Result<Box<dyn Endpoint>> {
    if !cuda::available() {
        return Err(Error::usage(
            "mscclppTransportP2P needs a CUDA driver and device; this process runs in host mode",
        ));
    }
    let ctx = Ctx::primary(device)?;
    let mode = flag_mode_from_env();
    crate::info!("p2p endpoint on CUDA device {device}: flags by {mode:?}");
    Ok(Box::new(P2p {
        device,
        ctx,
        mode,
        locals: Vec::new(),
        local_ids: HashMap::new(),
        peers: Vec::new(),
        remotes: Vec::new(),
        maps: HashMap::new(),
        stats: Stats {
            on: std::env::var("MSCCLPP_P2P_STATS").is_ok_and(|v| v == "1"),
            ..Stats::default()
        },
    }))
}

struct Local {
    region: Region,
}

struct Peer {
    rank: usize,
    addr: Address,
    stream: Stream,
    /// Pinned staging values for `FlagMode::Copy`, made on first use.
    ring: Option<PinnedHost>,
    ring_next: u64,
    /// Staging slots queued since the stream was last seen idle.
    ring_busy: u64,
    /// Work was queued since the stream was last seen idle (a flush with nothing queued
    /// returns without asking the driver).
    dirty: bool,
}

struct Remote {
    peer: PeerId,
    /// This process's address of the region (mapped, or the peer's own when same process).
    ptr: u64,
    len: u64,
}

/// Mapping cache key: exporting process, allocation base there, handle.
type MapKey = (u64, u64, [u8; IPC_HANDLE_BYTES]);

struct P2p {
    device: i32,
    ctx: Ctx,
    mode: FlagMode,
    locals: Vec<Local>,
    local_ids: HashMap<Region, MrId>,
    peers: Vec<Peer>,
    remotes: Vec<Remote>,
    maps: HashMap<MapKey, IpcMapping>,
    stats: Stats,
}

impl P2p {
    fn peer(&mut self, p: PeerId) -> Result<&mut Peer> {
        let n = self.peers.len();
        self.peers
            .get_mut(p)
            .ok_or_else(|| Error::internal(format!("P2P peer id {p} of {n}")))
    }

    fn remote(&self, r: RemoteId, peer: PeerId) -> Result<&Remote> {
        let rem = self.remotes.get(r).ok_or_else(|| {
            Error::internal(format!("P2P remote id {r} of {}", self.remotes.len()))
        })?;
        if rem.peer != peer {
            return Err(Error::internal(format!(
                "P2P remote region {r} belongs to peer {}, not {peer}",
                rem.peer
            )));
        }
        Ok(rem)
    }

    /// Switches to staging copies after the driver refused a stream write-value.
    fn flag_by_copy(&mut self, p: PeerId, addr: u64, value: u64) -> Result<()> {
        let device = self.device;
        let peer = self.peer(p)?;
        if peer.ring.is_none() {
            peer.ring = Some(PinnedHost::zeroed(device, (RING * 8) as usize)?);
        }
        if peer.ring_busy >= RING {
            // Every slot may still be read by a queued copy: let them finish first.
            peer.stream
                .wait(|| "P2P copies (staging ring full)".into())?;
            peer.ring_busy = 0;
        }
        let ring = peer.ring.as_ref().expect("made above");
        let slot = peer.ring_next % RING;
        // SAFETY: slot < RING, the ring holds RING u64s; no queued copy reads this slot (the
        // ring_busy check above). The Relaxed store is ordered before the copy that reads it
        // by the driver call that queues the copy (a full barrier in the driver's submission).
        unsafe { AtomicU64::from_ptr(ring.host().cast::<u64>().add(slot as usize)) }
            .store(value, Ordering::Relaxed);
        peer.stream.copy(addr, ring.dev() + slot * 8, 8, false)?;
        peer.ring_next += 1;
        peer.ring_busy += 1;
        peer.dirty = true;
        Ok(())
    }
}

impl Endpoint for P2p {
    fn describe(&self) -> String {
        format!("p2p:cuda{}", self.device)
    }

    fn address(&self) -> Result<Vec<u8>> {
        Ok(Address {
            host: host_id().to_owned(),
            nonce: process_nonce(),
            device: self.device,
        }
        .encode())
    }

    fn add_peer(&mut self, remote_rank: usize, address: &[u8]) -> Result<PeerId> {
        let addr = Address::decode(address)?;
        if addr.host != host_id() {
            return Err(Error::invalid_arg(format!(
                "mscclppTransportP2P to rank {remote_rank}: that rank runs on another host (CUDA IPC works within one host; use mscclppTransportIB)"
            )));
        }
        let stream = Stream::new(self.device)?;
        crate::trace!(
            "p2p:cuda{}: peer rank {remote_rank} on its device {}",
            self.device,
            addr.device
        );
        self.peers.push(Peer {
            rank: remote_rank,
            addr,
            stream,
            ring: None,
            ring_next: 0,
            ring_busy: 0,
            dirty: false,
        });
        Ok(self.peers.len() - 1)
    }

    fn register(&mut self, region: Region) -> Result<(MrId, Vec<u8>)> {
        let id = match self.local_ids.get(&region) {
            Some(id) => *id,
            None => {
                self.locals.push(Local { region });
                self.local_ids.insert(region, self.locals.len() - 1);
                self.locals.len() - 1
            }
        };
        let nonce = process_nonce();
        let blob = match region.kind {
            // Usable as a local source (mscclppRegisteredBufferWrite from host memory), never
            // exported: the blob tells the peer so.
            MemKind::Host => RegionBlob {
                nonce,
                device: None,
                base: region.addr,
                alloc_size: region.len,
                offset: 0,
                len: region.len,
                handle: [0; IPC_HANDLE_BYTES],
            },
            MemKind::Device(d) => {
                if cuda::is_managed(region.addr) {
                    return Err(Error::invalid_arg(format!(
                        "buffer {:#x} is CUDA managed memory, which CUDA IPC cannot share; use cudaMalloc memory",
                        region.addr
                    )));
                }
                let (base, size) = cuda::address_range(d, region.addr)?;
                let offset = region.addr - base;
                if offset.checked_add(region.len).is_none_or(|e| e > size) {
                    return Err(Error::invalid_arg(format!(
                        "buffer {:#x} + {} bytes runs past the end of its CUDA allocation ({size} bytes at {base:#x})",
                        region.addr, region.len
                    )));
                }
                RegionBlob {
                    nonce,
                    device: Some(d),
                    base,
                    alloc_size: size,
                    offset,
                    len: region.len,
                    handle: cuda::ipc_handle(d, base)?,
                }
            }
        };
        Ok((id, blob.encode()))
    }

    fn import(&mut self, peer: PeerId, blob: &[u8]) -> Result<RemoteId> {
        let b = RegionBlob::decode(blob)?;
        let (rank, peer_nonce) = {
            let p = self.peer(peer)?;
            (p.rank, p.addr.nonce)
        };
        if b.nonce != peer_nonce {
            return Err(Error::remote(format!(
                "rank {rank}: P2P region blob from another process than the rank's endpoint"
            )));
        }
        if b.device.is_none() {
            return Err(Error::invalid_arg(format!(
                "rank {rank} registered host memory on a P2P connection; P2P shares CUDA device memory only"
            )));
        }
        let ptr = if b.nonce == process_nonce() {
            // Same process (ranks as threads): the exporter's address is ours.
            b.base + b.offset
        } else {
            let key = (b.nonce, b.base, b.handle);
            if !self.maps.contains_key(&key) {
                let m = IpcMapping::open(self.device, &b.handle, b.alloc_size).map_err(|e| {
                    Error::remote(format!("rank {rank}: opening its CUDA IPC handle: {e}"))
                })?;
                self.maps.insert(key, m);
            }
            let m = &self.maps[&key];
            if b.offset + b.len > m.size() {
                return Err(Error::remote(format!(
                    "rank {rank}: region [{}, +{}) exceeds the {}-byte allocation its handle maps",
                    b.offset,
                    b.len,
                    m.size()
                )));
            }
            m.ptr() + b.offset
        };
        self.remotes.push(Remote {
            peer,
            ptr,
            len: b.len,
        });
        Ok(self.remotes.len() - 1)
    }

    fn remote_ptr(&self, remote: RemoteId) -> Option<u64> {
        self.remotes.get(remote).map(|r| r.ptr)
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
        let l = self
            .locals
            .get(src)
            .ok_or_else(|| Error::internal(format!("P2P local region {src}")))?
            .region;
        let r = self.remote(dst, peer)?;
        // The proxy checked both ranges; re-checked here because a stray copy engine write
        // would land in another process's memory.
        if src_off.checked_add(size).is_none_or(|e| e > l.len)
            || dst_off.checked_add(size).is_none_or(|e| e > r.len)
        {
            return Err(Error::internal(format!(
                "P2P write out of range: src [{src_off}, +{size}) of {}, dst [{dst_off}, +{size}) of {}",
                l.len, r.len
            )));
        }
        let dst_addr = r.ptr + dst_off;
        let _g = CtxGuard::enter_ctx(self.ctx)?;
        let d2d = matches!(l.kind, MemKind::Device(_));
        let t = self.stats.start();
        let p = self.peer(peer)?;
        p.stream.copy(dst_addr, l.addr + src_off, size, d2d)?;
        p.dirty = true;
        Stats::add(&mut self.stats.copies, t);
        Ok(())
    }

    fn write_value(&mut self, peer: PeerId, dst: RemoteId, dst_off: u64, value: u64) -> Result<()> {
        let r = self.remote(dst, peer)?;
        if dst_off.checked_add(8).is_none_or(|e| e > r.len) || (r.ptr + dst_off) % 8 != 0 {
            return Err(Error::internal(format!(
                "P2P value write at offset {dst_off} of a {}-byte region (or misaligned)",
                r.len
            )));
        }
        let addr = r.ptr + dst_off;
        let _g = CtxGuard::enter_ctx(self.ctx)?;
        let t = self.stats.start();
        if self.mode == FlagMode::WriteValue {
            let p = self.peer(peer)?;
            match p.stream.write_value64(addr, value) {
                Ok(()) => {
                    p.dirty = true;
                    Stats::add(&mut self.stats.values, t);
                    return Ok(());
                }
                Err(e) => {
                    crate::info!(
                        "p2p:cuda{}: cuStreamWriteValue64 to a peer mapping refused ({e}); flags go by staged copies from now on",
                        self.device
                    );
                    self.mode = FlagMode::Copy;
                }
            }
        }
        self.flag_by_copy(peer, addr, value)?;
        Stats::add(&mut self.stats.values, t);
        Ok(())
    }

    fn flush(&mut self, peer: PeerId) -> Result<()> {
        let t = self.stats.start();
        let ctx = self.ctx;
        let p = self.peer(peer)?;
        if !p.dirty {
            // Nothing queued since the stream was last seen idle.
            return Ok(());
        }
        let _g = CtxGuard::enter_ctx(ctx)?;
        let rank = p.rank;
        p.stream.wait(|| format!("P2P copies to rank {rank}"))?;
        p.ring_busy = 0;
        p.dirty = false;
        Stats::add(&mut self.stats.flushes, t);
        Ok(())
    }

    fn progress(&mut self) -> Result<()> {
        // Copies progress in the copy engines by themselves.
        Ok(())
    }
}

impl Drop for P2p {
    fn drop(&mut self) {
        // Streams first (queued copies read and write the mappings), then the mappings, then the
        // streams and staging rings (dropped with `peers`).
        if let Ok(_g) = CtxGuard::enter_ctx(self.ctx) {
            for p in &self.peers {
                if let Err(e) = p.stream.wait(|| "P2P copies at teardown".into()) {
                    crate::warn!("p2p:cuda{} teardown: {e}", self.device);
                }
            }
        }
        self.stats.report(self.device);
        self.maps.clear();
        self.remotes.clear();
        self.peers.clear();
    }
}
