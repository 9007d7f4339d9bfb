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
//! refused, NICs chosen by locality without it are left out (said at INFO). `flush` waits on
//! every rail. Every wait here progresses every rail and applies incoming records
//! (`wait_until`), and op slots are taken before a child endpoint would wait for one
//! (`reserve`): a child's own waits move only its rail, so two ranks each waiting on a
//! different rail of the other would wait for each other.
//!
//! A rail that fails fails the call with the rail named; nothing is moved to the other rails
//! (a put split over a dead rail has lost bytes, and the connection's error says so).

use super::blob::{self, Mode};
use super::endpoint::NetEndpoint;
use super::ops::provider_wait;
use crate::config::NetConfig;
use crate::error::{Error, Result};
use crate::transport::slots::Slots;
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

/// A region of ours: its id on each rail it is registered on (rail 0 first).
struct RailRegion {
    ids: Vec<MrId>,
    /// The blob handed out (`register`); None for a source (`register_source`).
    blob: Option<Vec<u8>>,
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
    /// Our regions (`MrId` indexes this); an id freed by `release_source` or `deregister` is
    /// reused.
    regions: Slots<RailRegion>,
    /// Rail 0's region id -> ours (registering a region twice returns the same id).
    by_first: HashMap<MrId, MrId>,
    /// Indexed by `RemoteId`; None once forgotten, never reused (as each rail's own).
    remotes: Vec<Option<RemoteRails>>,
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
        if let Some(a) = &cfg.addr {
            return Err(Error::invalid_arg(format!(
                "rails {}: MSCCLPP_NET_ADDR={a} names one local address, but each rail binds its own interface's: leave MSCCLPP_NET_ADDR unset and name the interfaces",
                names.join("+")
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
            // (`widen` leaves such NICs out instead.)
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
        // The further rails on the first one's provider, each by its domain name.
        let cfg = &NetConfig {
            providers: Some(vec![first.provider().to_string()]),
            ..cfg.clone()
        };
        let mut eps = vec![first];
        for (r, name) in more.iter().enumerate() {
            // A NIC that cannot join leaves the rails opened so far (said, not silent): the
            // library chose these NICs, and one fewer rail still works where an error would not.
            let why = match NetEndpoint::open(Some(name), false, device, cfg) {
                Ok(ep) if ep.ops.delivery_complete => {
                    eps.push(ep);
                    continue;
                }
                Ok(ep) => format!("{} does not grant FI_DELIVERY_COMPLETE", ep.describe()),
                Err(e) => e.to_string(),
            };
            crate::info!(
                "net: striping over {} of the {n} NICs chosen: {} cannot be added: {why}",
                eps.len(),
                rail_label(r + 1, n, name)
            );
            break;
        }
        if eps.len() == 1 {
            return Ok(Box::new(eps.pop().expect("one endpoint")));
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
            regions: Slots::default(),
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

    /// Our region `id`, if held.
    fn region(&self, id: MrId) -> Option<&RailRegion> {
        self.regions.get(id)
    }

    /// Keeps `g` (in a released id's place if there is one); returns its id.
    fn hold(&mut self, g: RailRegion) -> MrId {
        self.regions.insert(g)
    }

    /// Releases the sources `ids` (rail 0 first) on their rails; every one is attempted, the
    /// first failure returned.
    fn release_ids(&mut self, ids: &[MrId]) -> Result<()> {
        self.on_rails(0, ids, NetEndpoint::release_source)
    }

    /// `first`, rail 0's registration of `region` (and what came with it), followed by the same
    /// on rails 1.. (`reg`) where rail 0 registered the memory itself: the ids by rail and what
    /// came with each. A later rail that stages it (no FI_HMEM on that NIC: rail 0's staging
    /// channel alone reaches staged memory) ends the list at rail 0, and what rails 1.. hold for
    /// it is released (`release`), that rail's included; a failure releases every rail's,
    /// rail 0's too (a release that fails then is logged; the first error is returned).
    fn on_later_rails<T>(
        &mut self,
        region: Region,
        first: (MrId, T),
        reg: fn(&mut NetEndpoint, Region) -> Result<(MrId, T)>,
        release: fn(&mut NetEndpoint, MrId) -> Result<()>,
    ) -> Result<(Vec<MrId>, Vec<T>)> {
        let mut ids = vec![first.0];
        let mut with = vec![first.1];
        if !self.rails[0].ep.is_direct(ids[0]) {
            return Ok((ids, with));
        }
        for r in 1..self.rails.len() {
            let (m, x) = match reg(&mut self.rails[r].ep, region) {
                Ok(got) => got,
                Err(e) => {
                    let _ = self.on_rails(0, &ids, release);
                    return Err(e.within(&self.label(r)));
                }
            };
            ids.push(m);
            if !self.rails[r].ep.is_direct(m) {
                crate::info!(
                    "net: {}: a region of {} bytes is staged on {} but not on rail 0: it is not striped",
                    self.describe(),
                    region.len,
                    self.label(r)
                );
                let rest = ids.split_off(1);
                if let Err(e) = self.on_rails(1, &rest, release) {
                    let _ = self.on_rails(0, &ids, release);
                    return Err(e);
                }
                with.truncate(1);
                break;
            }
            with.push(x);
        }
        Ok((ids, with))
    }

    /// `op` with `ids[i]` on rail `first + i`, for every one: a release that fails on one rail
    /// still releases the others. The first failure, naming its rail, is returned.
    fn on_rails(
        &mut self,
        first: usize,
        ids: &[usize],
        op: fn(&mut NetEndpoint, usize) -> Result<()>,
    ) -> Result<()> {
        let mut res = Ok(());
        for (r, &m) in ids.iter().enumerate().map(|(i, m)| (first + i, m)) {
            if let Err(e) = op(&mut self.rails[r].ep, m) {
                let e = e.within(&self.label(r));
                crate::warn!("net: {e}");
                if res.is_ok() {
                    res = Err(e);
                }
            }
        }
        res
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

    /// `f` on every rail in turn; the first error, naming its rail.
    fn each_rail(&mut self, mut f: impl FnMut(&mut NetEndpoint) -> Result<()>) -> Result<()> {
        for r in 0..self.rails.len() {
            if let Err(e) = f(&mut self.rails[r].ep) {
                return Err(e.within(&self.label(r)));
            }
        }
        Ok(())
    }

    /// One step of every rail: completions, and the incoming work (staged records, relayed
    /// values) a peer's own wait may need from us. Every wait of this endpoint takes it, so that
    /// two ranks waiting on different rails of each other both move.
    fn progress_all(&mut self) -> Result<()> {
        self.each_rail(|ep| ep.poll_once().and_then(|_| ep.poll_incoming()))
    }

    /// Waits, progressing every rail, until `pending` says nothing is (it names the rail and
    /// what is waited for otherwise). Bounded by the wait timeout; the error names the rail.
    fn wait_until(
        &mut self,
        mut pending: impl FnMut(&Self) -> Option<(usize, String)>,
    ) -> Result<()> {
        let timeout = self.rails[0].ep.ops.timeout;
        let mut wait = None;
        // Ends when `pending` is satisfied, on a rail's error, or when the bound passes.
        loop {
            if pending(self).is_none() {
                return Ok(());
            }
            self.progress_all()?;
            let Some((r, what)) = pending(self) else {
                return Ok(());
            };
            let label = self.label(r);
            let w = wait.get_or_insert_with(|| provider_wait(timeout));
            self.rails[r]
                .ep
                .pause(w, || what)
                .map_err(|e| e.within(&label))?;
        }
    }

    /// Waits (as `wait_until`) until rail `r` has op slots for `n` writes, so that the child
    /// endpoint never waits for one itself: its own wait would progress that rail alone, and a
    /// peer waiting on another rail for us would wait for it in turn.
    fn reserve(&mut self, r: usize, n: usize, rank: usize) -> Result<()> {
        self.wait_until(|s| {
            (!s.rails[r].ep.has_room(n))
                .then(|| (r, format!("waiting for an op slot to write to rank {rank}")))
        })
    }

    /// Flushes the rails `which` of `peer` to delivery: a marker where one is needed, then a
    /// wait for every write to the peer on those rails (`wait_until`).
    fn flush_rails(&mut self, peer: PeerId, which: &[usize]) -> Result<()> {
        // The peer's id on each rail is looked up where it is used (as `write` does), not
        // copied out: a signal after striped data comes here.
        let rank = self.peer(peer)?.rank;
        // Ends when no rail had flags waiting at the start of a pass (their marker then
        // follows them), on an error, or at a wait's bound (each pass waits for completions,
        // which let the waiting flags go).
        loop {
            let mut again = false;
            for &r in which {
                self.reserve(r, 1, rank)?;
                let id = self.peers[peer].ids[r];
                match self.rails[r].ep.begin_flush(id) {
                    Ok(a) => again |= a,
                    Err(e) => return Err(e.within(&self.label(r))),
                }
            }
            self.wait_until(|s| {
                which.iter().find_map(|&r| {
                    let n = s.rails[r].ep.outstanding_to(s.peers[peer].ids[r]);
                    (n > 0).then(|| {
                        (r, format!("flushing {n} writes to rank {rank}: no completion (is the peer's proxy running? is the link up?)"))
                    })
                })
            })?;
            if !again {
                break;
            }
        }
        let p = &mut self.peers[peer];
        for &r in which {
            p.dirty[r] = false;
        }
        Ok(())
    }

    /// `peer`'s imported region `dst`, or an error saying it is not one.
    fn remote_of(&self, peer: PeerId, dst: RemoteId) -> Result<&RemoteRails> {
        let rank = self.peer(peer)?.rank;
        match self.remotes.get(dst) {
            Some(Some(d)) if d.peer == peer => Ok(d),
            _ => Err(Error::invalid_arg(format!(
                "remote region {dst} is not one of rank {rank}'s on {}",
                self.describe()
            ))),
        }
    }

    /// Waits (`wait_until`) until `peer` has applied every staging record rail 0 sent it.
    fn wait_records_taken(&mut self, peer: PeerId, why: &str) -> Result<()> {
        let (rank, p0) = {
            let p = self.peer(peer)?;
            (p.rank, p.ids[0])
        };
        self.wait_until(|s| {
            s.rails[0].ep.records_unacked(p0).then(|| {
                (
                    0,
                    format!("waiting for rank {rank} to apply staged writes {why}"),
                )
            })
        })
    }

    /// The rails other than 0 that carried data to `peer` since their last flush.
    fn dirty_rails(&self, peer: PeerId) -> Result<Vec<usize>> {
        let p = self.peer(peer)?;
        Ok((1..p.ids.len()).filter(|&r| p.dirty[r]).collect())
    }
}

/// The address of every rail in one blob, which must fit a setup field.
fn rails_blob(parts: &[Vec<u8>]) -> Result<Vec<u8>> {
    let b = blob::encode_rails(parts);
    if b.len() > crate::wire::MAX_FIELD {
        return Err(Error::invalid_arg(format!(
            "the addresses of {} rails take {} bytes, more than a setup field's {}: use fewer rails (MSCCLPP_NET_RAILS, or fewer names joined by '+')",
            parts.len(),
            b.len(),
            crate::wire::MAX_FIELD
        )));
    }
    Ok(b)
}

fn rail_label(r: usize, n: usize, domain: &str) -> String {
    format!("rail {r} of {n} ({domain})")
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
        rails_blob(&parts)
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
        // The same endpoint again (several connections between the two): the same peer. A
        // rank's other endpoint is another peer (its addresses differ on rail 0 at least).
        if let Some(i) = self.peers.iter().position(|p| p.ids == ids) {
            return Ok(i);
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

    /// Rail 0 carries the staging channel and the counting stream (staged memory and values go
    /// on rail 0 only).
    fn link_for(&mut self, peer: PeerId) -> Result<Vec<u8>> {
        let id = self.peer(peer)?.ids[0];
        self.rails[0].ep.link_for(id)
    }

    fn link_to(&mut self, peer: PeerId, link: &[u8]) -> Result<()> {
        let id = self.peer(peer)?.ids[0];
        self.rails[0].ep.link_to(id, link)
    }

    /// Registers on rail 0, and on every other rail where rail 0 registered the memory itself
    /// (staged GPU memory is reached through rail 0's staging channel only).
    fn register(&mut self, region: Region) -> Result<(MrId, Vec<u8>)> {
        let (m0, b0) = self.rails[0]
            .ep
            .register(region)
            .map_err(|e| e.within(&self.label(0)))?;
        if let Some(&id) = self.by_first.get(&m0) {
            if let Some(blob) = self.region(id).and_then(|g| g.blob.clone()) {
                return Ok((id, blob));
            }
        }
        let (ids, blobs) = self.on_later_rails(
            region,
            (m0, b0),
            NetEndpoint::register,
            NetEndpoint::deregister,
        )?;
        let blob = blob::encode_rails(&blobs);
        let id = self.hold(RailRegion {
            ids,
            blob: Some(blob.clone()),
        });
        self.by_first.insert(m0, id);
        Ok((id, blob))
    }

    /// On rail 0, and on every other rail where both register it themselves, as `register`
    /// does; released on every rail it was registered on.
    fn register_source(&mut self, region: Region) -> Result<MrId> {
        let m0 = self.rails[0]
            .ep
            .register_source(region)
            .map_err(|e| e.within(&self.label(0)))?;
        let (ids, _) = self.on_later_rails(
            region,
            (m0, ()),
            |ep, r| ep.register_source(r).map(|m| (m, ())),
            NetEndpoint::release_source,
        )?;
        Ok(self.hold(RailRegion { ids, blob: None }))
    }

    fn release_source(&mut self, src: MrId) -> Result<()> {
        let ids = self
            .regions
            .remove_if(src, |g| g.blob.is_none())
            .map(|g| g.ids)
            .ok_or_else(|| {
                Error::internal(format!(
                    "{}: releasing region {src}, which is not a held source",
                    self.describe()
                ))
            })?;
        self.release_ids(&ids)
    }

    /// Released on every rail it was registered on, as a source is.
    fn deregister(&mut self, mr: MrId) -> Result<()> {
        let ids = self
            .regions
            .remove_if(mr, |g| g.blob.is_some())
            .map(|g| g.ids)
            .ok_or_else(|| {
                Error::internal(format!(
                    "{}: deregistering region {mr}, which is not a held registration",
                    self.describe()
                ))
            })?;
        self.by_first.remove(&ids[0]);
        self.on_rails(0, &ids, NetEndpoint::deregister)
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
            if r > 0 && self.rails[r].ep.remote_mode(ids[r], id) == Some(Mode::Staged) {
                // Only rail 0 has the staging channel: the other rails cannot reach it.
                rids.truncate(1);
                break;
            }
            rids.push(id);
        }
        self.remotes.push(Some(RemoteRails { peer, ids: rids }));
        Ok(self.remotes.len() - 1)
    }

    fn forget(&mut self, remote: RemoteId) -> Result<()> {
        let ids = self
            .remotes
            .get_mut(remote)
            .and_then(Option::take)
            .map(|d| d.ids)
            .ok_or_else(|| {
                Error::internal(format!(
                    "{}: forgetting remote region {remote}, which is not held",
                    self.describe()
                ))
            })?;
        self.on_rails(0, &ids, NetEndpoint::forget)
    }

    fn remote_len(&self, remote: RemoteId) -> Option<u64> {
        let d = self.remotes.get(remote)?.as_ref()?;
        self.rails[0].ep.remote_len(d.ids[0])
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
        let (rank, peer_rails) = {
            let p = self.peer(peer)?;
            (p.rank, p.ids.len())
        };
        let dst_rails = self.remote_of(peer, dst)?.ids.len();
        let Some(src_rails) = self.region(src).map(|g| g.ids.len()) else {
            return Err(Error::invalid_arg(format!(
                "unknown region {src} on {}",
                self.describe()
            )));
        };
        // The ids of the peer and both regions on rail `r` (all three checked above, `r`
        // below each one's rail count); looked up per piece rather than copied out, which
        // would allocate on every put.
        let ids = |s: &Self, r: usize| {
            (
                s.peers[peer].ids[r],
                // (Held: checked above; an unknown id would be refused by the rail.)
                s.region(src).map_or(MrId::MAX, |g| g.ids[r]),
                // (Held: checked above, as `remote_of`.)
                s.remotes[dst].as_ref().map_or(RemoteId::MAX, |d| d.ids[r]),
            )
        };
        // Rails over which both regions are registered (all of them, or rail 0 alone), and
        // the size of each piece: the whole put where it goes on rail 0 alone.
        let k = src_rails.min(dst_rails).min(peer_rails);
        let (k, chunk) = if k < 2 || size <= self.chunk {
            (1, size)
        } else {
            // The whole range, before any chunk moves: a bad one changes nothing (a put on
            // one rail is checked by that rail).
            let (p0, s0, d0) = ids(self, 0);
            if let Err(e) = self.rails[0]
                .ep
                .check_write(p0, s0, src_off, d0, dst_off, size)
            {
                return Err(e.within(&self.label(0)));
            }
            (k, self.chunk)
        };
        let (mut off, mut i) = (0, 0);
        // Ends after the last piece: `off` grows by `chunk` (or what is left) per step. One
        // step even for an empty put, which the rail refuses.
        loop {
            let n = chunk.min(size - off);
            let r = i % k;
            let slots = self.rails[r].ep.slots_for(n);
            self.reserve(r, slots, rank)?;
            let (p, s, d) = ids(self, r);
            let rail = &mut self.rails[r];
            if let Err(e) = rail.ep.write(p, s, src_off + off, d, dst_off + off, n) {
                return Err(e.within(&self.label(r)));
            }
            rail.bytes += n;
            rail.writes += 1;
            if r > 0 {
                self.peers[peer].dirty[r] = true;
            }
            off += n;
            i += 1;
            if off >= size {
                return Ok(());
            }
        }
    }

    fn write_value(&mut self, peer: PeerId, dst: RemoteId, dst_off: u64, value: u64) -> Result<()> {
        let d = self.remote_of(peer, dst)?.ids[0];
        let dirty = self.dirty_rails(peer)?;
        if !dirty.is_empty() {
            // The value must not arrive before the data other rails still carry.
            self.flush_rails(peer, &dirty)?;
        }
        let (rank, p0) = (self.peers[peer].rank, self.peers[peer].ids[0]);
        if self.rails[0].ep.remote_mode(p0, d) == Some(Mode::Direct) {
            // A plain value must not overtake staged writes the peer has yet to apply: wait
            // here, progressing every rail, rather than in rail 0's own wait. (Values into
            // staged or relayed memory are records, ordered behind the others.)
            self.wait_records_taken(peer, "before a value")?;
        }
        self.reserve(0, 1, rank)?;
        self.rails[0]
            .ep
            .write_value(p0, d, dst_off, value)
            .map_err(|e| e.within(&self.label(0)))
    }

    fn flush(&mut self, peer: PeerId) -> Result<()> {
        let all: Vec<usize> = (0..self.peer(peer)?.ids.len()).collect();
        self.flush_rails(peer, &all)?;
        // Rail 0's staging acknowledgements, waited for progressing every rail; its writes
        // are delivered already, so its own flush then returns at once.
        self.wait_records_taken(peer, "(flush)")?;
        let p0 = self.peers[peer].ids[0];
        self.rails[0]
            .ep
            .flush(p0)
            .map_err(|e| e.within(&self.label(0)))
    }

    fn progress(&mut self) -> Result<()> {
        self.each_rail(|ep| ep.progress())
    }

    fn poll_incoming(&mut self) -> Result<()> {
        self.each_rail(|ep| ep.poll_incoming())
    }

    fn took_incoming(&mut self) -> bool {
        // Every rail's count is read (and reset), not only up to the first that saw some.
        self.rails
            .iter_mut()
            .fold(false, |any, r| r.ep.took_incoming() | any)
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
