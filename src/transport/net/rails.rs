//! One endpoint striped over several NICs ("rails"): a `NetEndpoint` per NIC, rail 0 first.
//!
//! Where the rails come from (`net::open`): the domains an `ibDev` (or its `MSCCLPP_IBDEV_MAP`
//! target), or else `MSCCLPP_NET_IFACE`, names joined by `+` (`mlx5_0+mlx5_1`, `eth1+eth2`),
//! all of them; or, when the library chose
//! the NIC by locality (`locality.rs`), the NICs as near to the rank's GPU as the chosen one,
//! at most `MSCCLPP_NET_RAILS`.
//!
//! What goes where: a put of more than `MSCCLPP_NET_STRIPE_CHUNK` bytes between regions
//! registered on every rail (host memory, FI_HMEM device memory) is cut into chunks of that
//! size, chunk `i` on rail `i % rails`; smaller puts, staged GPU memory, signal values and
//! flush markers go on rail 0. Rail `r` of one rank talks to rail `r` of the other, over the
//! rails both have.
//!
//! The 2023 guarantee, a signal delivered only after the data before it: rail 0 orders its
//! own writes (the child endpoint's WAW ordering or fence). The other rails are not ordered
//! with rail 0, so before a value goes out on rail 0, every other rail that carried data to
//! that peer since its last flush is flushed to delivery (its marker write with
//! FI_DELIVERY_COMPLETE completes only once everything before it on that rail arrived).
//! Striping therefore needs FI_DELIVERY_COMPLETE on every rail; named rails without it are
//! refused, NICs chosen by locality stay one rail and say why. `flush` waits on every rail.
//! Waits progress every rail they wait on, since most providers move data only when polled.
//!
//! A rail that fails fails the call with the rail named; nothing is moved to the other rails
//! (a put split over a dead rail has lost bytes, and the connection's error says so).

use super::blob;
use super::ops::provider_wait;
use super::NetEndpoint;
use crate::config::NetConfig;
use crate::error::{Error, Result};
use crate::transport::{
    AbortCheck, Caps, Endpoint, EpochMem, MemKind, MrId, PeerId, Region, RemoteId,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One NIC and what it carried.
struct Rail {
    ep: NetEndpoint,
    /// Bytes and writes of user data sent on this rail.
    bytes: u64,
    writes: u64,
}

/// A peer, as known on each rail both sides have.
struct RailPeer {
    rank: usize,
    /// The peer's id on rail `r` (`ids.len()` = the rails in use with this peer).
    ids: Vec<PeerId>,
    /// Rail `r` (> 0) carried data to the peer since its last flush to delivery.
    dirty: Vec<bool>,
}

/// A region a peer registered, as imported on each rail its blob lists (rail 0 only for
/// memory the owner stages).
struct RemoteRails {
    peer: PeerId,
    ids: Vec<RemoteId>,
}

/// Per-rail counters (for tests and the close log).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RailStats {
    pub domain: String,
    pub bytes: u64,
    pub writes: u64,
}

/// The striped endpoint (module doc).
pub struct Rails {
    rails: Vec<Rail>,
    peers: Vec<RailPeer>,
    /// Our regions: the id on each rail it is registered on, and the blob handed out.
    regions: Vec<(Vec<MrId>, Vec<u8>)>,
    /// Rail 0's region id -> ours (registering a region twice returns the same id).
    by_first: HashMap<MrId, MrId>,
    remotes: Vec<RemoteRails>,
    chunk: u64,
}

impl Rails {
    /// Opens one endpoint per domain in `names` (rail 0 first; a name may repeat: two rails
    /// over one NIC, which is how tests stripe over loopback).
    pub fn open(names: &[&str], device: Option<i32>, cfg: &NetConfig) -> Result<Self> {
        if names.is_empty()
            || names.len() > crate::config::MAX_RAILS
            || names.iter().any(|n| n.is_empty())
        {
            return Err(Error::invalid_arg(format!(
                "rails {:?}: expected 1..={} domain names joined by '+'",
                names.join("+"),
                crate::config::MAX_RAILS
            )));
        }
        // Each rail is opened by its name, which MSCCLPP_NET_IFACE (maybe the list itself)
        // must not narrow further.
        let cfg = &NetConfig {
            iface: None,
            ..cfg.clone()
        };
        let mut eps = Vec::with_capacity(names.len());
        for (r, n) in names.iter().enumerate() {
            let ep = NetEndpoint::open(Some(n), false, device, cfg)
                .map_err(|e| e.within(&rail_label(r, names.len(), n)))?;
            eps.push(ep);
        }
        if let Some(bad) = eps.iter().find(|e| !e.ops.delivery_complete) {
            return Err(Error::invalid_arg(format!(
                "striping over rails {} needs FI_DELIVERY_COMPLETE (a signal on rail 0 waits for the other rails' data to be delivered), which {} does not grant{}",
                names.join("+"),
                bad.describe(),
                if cfg.delivery_complete { "" } else { " (MSCCLPP_NET_DELIVERY_COMPLETE=0)" }
            )));
        }
        Self::from_endpoints(eps, cfg)
    }

    /// Adds to `first` (opened on the NIC the library chose) the equally near NICs after it
    /// (`NetEndpoint::nics`), up to `MSCCLPP_NET_RAILS` in all. Returns `first` alone when
    /// there is nothing to add, or when its provider cannot order a signal after data on other
    /// rails (logged).
    pub fn widen(
        first: NetEndpoint,
        device: Option<i32>,
        cfg: &NetConfig,
    ) -> Result<Box<dyn Endpoint>> {
        let more: Vec<String> = first
            .nics
            .iter()
            .filter(|n| **n != first.ops.domain)
            .take(cfg.rails.saturating_sub(1))
            .cloned()
            .collect();
        if more.is_empty() {
            return Ok(Box::new(first));
        }
        if !first.ops.delivery_complete {
            crate::info!(
                "net: not striping over NICs {} and {}: {} does not grant FI_DELIVERY_COMPLETE, which orders a signal after the data of other rails; one NIC",
                first.ops.domain,
                more.join(", "),
                first.describe()
            );
            return Ok(Box::new(first));
        }
        let n = more.len() + 1;
        let mut eps = vec![first];
        for (r, name) in more.iter().enumerate() {
            let ep = NetEndpoint::open(Some(name), false, device, cfg).map_err(|e| {
                e.within(&format!(
                    "{} (MSCCLPP_NET_RAILS=1 uses one NIC)",
                    rail_label(r + 1, n, name)
                ))
            })?;
            eps.push(ep);
        }
        Ok(Box::new(Self::from_endpoints(eps, cfg)?))
    }

    fn from_endpoints(eps: Vec<NetEndpoint>, cfg: &NetConfig) -> Result<Self> {
        let p0 = eps[0].provider().to_string();
        if let Some(o) = eps.iter().find(|e| e.provider() != p0) {
            return Err(Error::invalid_arg(format!(
                "rails of different providers: {} and {}",
                eps[0].describe(),
                o.describe()
            )));
        }
        let rails = Rails {
            rails: eps
                .into_iter()
                .map(|ep| Rail {
                    ep,
                    bytes: 0,
                    writes: 0,
                })
                .collect(),
            peers: Vec::new(),
            regions: Vec::new(),
            by_first: HashMap::new(),
            remotes: Vec::new(),
            chunk: cfg.stripe_chunk.max(crate::config::MIN_STRIPE_CHUNK),
        };
        crate::info!(
            "net: {} stripes puts of more than {} bytes over its {} rails, in chunks of that size (MSCCLPP_NET_STRIPE_CHUNK)",
            rails.describe(),
            rails.chunk,
            rails.rails.len()
        );
        Ok(rails)
    }

    /// What each rail carried.
    pub fn rail_stats(&self) -> Vec<RailStats> {
        self.rails
            .iter()
            .map(|r| RailStats {
                domain: r.ep.ops.domain.clone(),
                bytes: r.bytes,
                writes: r.writes,
            })
            .collect()
    }

    /// `rail r of n (domain)`, for errors.
    fn label(&self, r: usize) -> String {
        rail_label(r, self.rails.len(), &self.rails[r].ep.ops.domain)
    }

    fn peer(&self, peer: PeerId) -> Result<&RailPeer> {
        self.peers.get(peer).ok_or_else(|| {
            Error::invalid_arg(format!("unknown peer {peer} on {}", self.describe()))
        })
    }

    /// Flushes the rails `which` of `peer` to delivery, progressing all of them while it waits
    /// (bounded by the wait timeout; the error names the rail still waited for).
    fn flush_rails(&mut self, peer: PeerId, which: &[usize]) -> Result<()> {
        let (rank, ids) = {
            let p = self.peer(peer)?;
            (p.rank, p.ids.clone())
        };
        for &r in which {
            let ep = &mut self.rails[r].ep;
            if let Err(e) = ep.begin_flush(ids[r]) {
                return Err(e.within(&self.label(r)));
            }
        }
        let timeout = self.rails[0].ep.ops.timeout;
        let mut wait = None;
        // Ends when no write to the peer is outstanding on any rail of `which`, on an error
        // completion, or when the bound passes. Every rail is polled, not only those waited
        // for: data still queued on the others moves meanwhile.
        loop {
            for r in 0..self.rails.len() {
                if let Err(e) = self.rails[r].ep.poll_once() {
                    return Err(e.within(&self.label(r)));
                }
            }
            let busy = which
                .iter()
                .copied()
                .find(|&r| self.rails[r].ep.outstanding_to(ids[r]) > 0);
            let Some(r) = busy else {
                break;
            };
            let label = self.label(r);
            let n = self.rails[r].ep.outstanding_to(ids[r]);
            let w = wait.get_or_insert_with(|| provider_wait(timeout));
            self.rails[r]
                .ep
                .pause(w, || {
                    format!("flushing {n} writes to rank {rank}: no completion (is the peer's proxy running? is the link up?)")
                })
                .map_err(|e| e.within(&label))?;
        }
        let p = &mut self.peers[peer];
        for &r in which {
            p.dirty[r] = false;
        }
        Ok(())
    }

    /// The rails other than 0 that carried data to `peer` since their last flush.
    fn dirty_rails(&self, peer: PeerId) -> Result<Vec<usize>> {
        let p = self.peer(peer)?;
        Ok((1..p.ids.len()).filter(|&r| p.dirty[r]).collect())
    }
}

fn rail_label(r: usize, n: usize, domain: &str) -> String {
    format!("rail {} of {n} ({domain})", r)
}

impl Endpoint for Rails {
    fn describe(&self) -> String {
        let names: Vec<&str> = self
            .rails
            .iter()
            .map(|r| r.ep.ops.domain.as_str())
            .collect();
        format!("net:{}/{}", self.rails[0].ep.ops.provider, names.join("+"))
    }

    fn caps(&self) -> Caps {
        self.rails[0].ep.caps()
    }

    fn epoch_block(&mut self, kind: MemKind) -> Result<EpochMem> {
        self.rails[0].ep.epoch_block(kind)
    }

    fn address(&self) -> Result<Vec<u8>> {
        let parts = self
            .rails
            .iter()
            .map(|r| r.ep.address())
            .collect::<Result<Vec<_>>>()?;
        Ok(blob::encode_rails(&parts))
    }

    /// Rail 0 carries the staging channel for the rank (staged memory goes on rail 0 only).
    fn address_for(&mut self, remote_rank: usize) -> Result<Vec<u8>> {
        let mut parts = vec![self.rails[0].ep.address_for(remote_rank)?];
        for r in &self.rails[1..] {
            parts.push(r.ep.address()?);
        }
        Ok(blob::encode_rails(&parts))
    }

    fn add_peer(&mut self, remote_rank: usize, address: &[u8]) -> Result<PeerId> {
        let parts = blob::decode_rails(address)
            .map_err(|e| Error::remote(format!("rank {remote_rank}: {e}")))?;
        let k = parts.len().min(self.rails.len());
        let mut ids = Vec::with_capacity(k);
        for (r, part) in parts.iter().take(k).enumerate() {
            let id = self.rails[r]
                .ep
                .add_peer(remote_rank, part)
                .map_err(|e| e.within(&self.label(r)))?;
            ids.push(id);
        }
        if let Some(i) = self.peers.iter().position(|p| p.rank == remote_rank) {
            if self.peers[i].ids == ids {
                return Ok(i);
            }
            return Err(Error::invalid_arg(format!(
                "rank {remote_rank} was already added with a different address"
            )));
        }
        if k < self.rails.len() {
            crate::info!(
                "net: rank {remote_rank} has {} rail(s), {} here: puts to it use {k}",
                parts.len(),
                self.rails.len()
            );
        }
        self.peers.push(RailPeer {
            rank: remote_rank,
            dirty: vec![false; k],
            ids,
        });
        Ok(self.peers.len() - 1)
    }

    /// Registers on rail 0, and on every other rail where rail 0 registered the memory itself
    /// (staged GPU memory is reached through rail 0's staging channel only).
    fn register(&mut self, region: Region) -> Result<(MrId, Vec<u8>)> {
        let (m0, b0) = self.rails[0].ep.register(region)?;
        if let Some(&id) = self.by_first.get(&m0) {
            return Ok((id, self.regions[id].1.clone()));
        }
        let mut ids = vec![m0];
        let mut blobs = vec![b0];
        if self.rails[0].ep.is_direct(m0) {
            for r in 1..self.rails.len() {
                let (m, b) = self.rails[r]
                    .ep
                    .register(region)
                    .map_err(|e| e.within(&self.label(r)))?;
                ids.push(m);
                blobs.push(b);
            }
        }
        let blob = blob::encode_rails(&blobs);
        let id = self.regions.len();
        self.regions.push((ids, blob.clone()));
        self.by_first.insert(m0, id);
        Ok((id, blob))
    }

    fn import(&mut self, peer: PeerId, b: &[u8]) -> Result<RemoteId> {
        let ids = self.peer(peer)?.ids.clone();
        let parts = blob::decode_rails(b)?;
        let k = parts.len().min(ids.len());
        let mut rids = Vec::with_capacity(k);
        for (r, part) in parts.iter().take(k).enumerate() {
            let id = self.rails[r]
                .ep
                .import(ids[r], part)
                .map_err(|e| e.within(&self.label(r)))?;
            rids.push(id);
        }
        self.remotes.push(RemoteRails { peer, ids: rids });
        Ok(self.remotes.len() - 1)
    }

    fn remote_len(&self, remote: RemoteId) -> Option<u64> {
        self.rails[0]
            .ep
            .remote_len(self.remotes.get(remote)?.ids[0])
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
        let pids = self.peer(peer)?.ids.clone();
        let (srcs, dsts) = match (self.regions.get(src), self.remotes.get(dst)) {
            (Some((s, _)), Some(d)) if d.peer == peer => (s.clone(), d.ids.clone()),
            (None, _) => {
                return Err(Error::invalid_arg(format!(
                    "unknown region {src} on {}",
                    self.describe()
                )))
            }
            _ => {
                return Err(Error::invalid_arg(format!(
                    "remote region {dst} is not one of rank {}'s on {}",
                    self.peers[peer].rank,
                    self.describe()
                )))
            }
        };
        // Rails over which both regions are registered (all of them, or rail 0 alone).
        let k = srcs.len().min(dsts.len()).min(pids.len());
        if k < 2 || size <= self.chunk {
            let rail = &mut self.rails[0];
            rail.ep
                .write(pids[0], srcs[0], src_off, dsts[0], dst_off, size)?;
            rail.bytes += size;
            rail.writes += 1;
            return Ok(());
        }
        // The whole range, before any chunk moves: a bad one changes nothing.
        self.rails[0]
            .ep
            .check_write(pids[0], srcs[0], src_off, dsts[0], dst_off, size)?;
        let mut off = 0;
        let mut i = 0;
        // Ends after the last chunk: `off` grows by at least one byte per step up to `size`.
        while off < size {
            let n = self.chunk.min(size - off);
            let r = i % k;
            let rail = &mut self.rails[r];
            if let Err(e) =
                rail.ep
                    .write(pids[r], srcs[r], src_off + off, dsts[r], dst_off + off, n)
            {
                return Err(e.within(&self.label(r)));
            }
            rail.bytes += n;
            rail.writes += 1;
            if r > 0 {
                self.peers[peer].dirty[r] = true;
            }
            off += n;
            i += 1;
        }
        Ok(())
    }

    fn write_value(&mut self, peer: PeerId, dst: RemoteId, dst_off: u64, value: u64) -> Result<()> {
        let dirty = self.dirty_rails(peer)?;
        if !dirty.is_empty() {
            // The value must not arrive before the data other rails still carry.
            self.flush_rails(peer, &dirty)?;
        }
        let d = match self.remotes.get(dst) {
            Some(d) if d.peer == peer => d.ids[0],
            _ => {
                return Err(Error::invalid_arg(format!(
                    "remote region {dst} is not one of rank {}'s on {}",
                    self.peers[peer].rank,
                    self.describe()
                )))
            }
        };
        let p0 = self.peers[peer].ids[0];
        self.rails[0].ep.write_value(p0, d, dst_off, value)
    }

    fn flush(&mut self, peer: PeerId) -> Result<()> {
        let all: Vec<usize> = (0..self.peer(peer)?.ids.len()).collect();
        self.flush_rails(peer, &all)?;
        // Rail 0's staging acknowledgements, if any (its writes are already delivered).
        let p0 = self.peers[peer].ids[0];
        self.rails[0].ep.flush(p0)
    }

    fn progress(&mut self) -> Result<()> {
        for r in 0..self.rails.len() {
            if let Err(e) = self.rails[r].ep.progress() {
                return Err(e.within(&self.label(r)));
            }
        }
        Ok(())
    }

    fn poll_incoming(&mut self) -> Result<()> {
        for r in 0..self.rails.len() {
            if let Err(e) = self.rails[r].ep.poll_incoming() {
                return Err(e.within(&self.label(r)));
            }
        }
        Ok(())
    }

    fn set_abort_check(&mut self, check: AbortCheck) {
        // One check shared by every rail (a Box is not Sync, hence the Mutex).
        let shared = Arc::new(Mutex::new(check));
        for r in &mut self.rails {
            let s = shared.clone();
            r.ep.set_abort_check(Box::new(move || (crate::sync::lock(&s))()));
        }
    }
}

impl Drop for Rails {
    fn drop(&mut self) {
        let used: Vec<String> = self
            .rails
            .iter()
            .map(|r| {
                format!(
                    "{} {} MiB in {} writes",
                    r.ep.ops.domain,
                    r.bytes >> 20,
                    r.writes
                )
            })
            .collect();
        crate::info!("net: {} carried: {}", self.describe(), used.join("; "));
    }
}

#[cfg(test)]
mod tests;
