//! The memory of one endpoint: its libfabric registrations, the regions it hands out
//! (`register`), the regions peers handed it (`import`), and the bounds every write is checked
//! against before it is posted.

use super::blob::{Mode, MrBlob};
use super::mr;
use super::ops::Ops;
use super::peers::Peers;
use crate::error::{Error, Result};
use crate::transport::slots::Slots;
use crate::transport::{MemKind, MrId, PeerId, Region, RemoteId};
use libfabric_sys as fi;
use std::collections::HashMap;
use std::ops::Index;
use std::sync::atomic::{AtomicBool, Ordering as AtOrd};

/// Index of the staging-ring registration in the MR table.
pub(super) const STAGING_MR: usize = 0;
/// Index of the scratch word peers write flush markers into.
pub(super) const SCRATCH_MR: usize = 1;

/// How a local region handed out by `register` is backed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Backing {
    /// Registered with libfabric (index into `mrs`): host memory.
    Mr(usize),
    /// Device memory of this CUDA device registered with FI_HMEM (index into `mrs`): data
    /// direct, values relayed after a GPUDirect flush of the device.
    Hmem(usize, i32),
    /// Not registered: writes arrive through a staging channel.
    Staged,
}

pub(super) struct LocalRegion {
    pub region: Region,
    pub backing: Backing,
    /// What peers need to write into it; empty for a source (`register_source`).
    pub blob: Vec<u8>,
    /// Registered by `register_source`: released after its call, never exported.
    source: bool,
    /// Writes from it are copied out through the bounce slots first (staged GPU memory; host
    /// memory under `MSCCLPP_TEST_FORCE_STAGING=source`), whatever its backing.
    pub staged_source: bool,
}

struct Remote {
    peer: PeerId,
    blob: MrBlob,
}

/// The registrations and regions of one endpoint (module doc).
pub(super) struct Regions {
    /// libfabric registrations; entry `STAGING_MR` is the staging ring, `SCRATCH_MR` the
    /// scratch word, then user regions, channels, bounce slots and the sources of registered
    /// writes (closed after their call). Closed before `objs.ep`.
    pub mrs: mr::Table<*mut fi::fid_mr>,
    pub policy: mr::Policy,
    /// The provider registers GPU memory with FI_HMEM (`try_hmem`), or why not.
    hmem: std::result::Result<(), &'static str>,
    /// Regions handed out by `register` (deduplicated by `region_ids`, kept until
    /// `deregister` or the endpoint closes) and by `register_source` (until `release_source`).
    /// `MrId` indexes this; a released id is reused, so that a registration per call does not
    /// grow it.
    local: Slots<LocalRegion>,
    region_ids: HashMap<Region, MrId>,
    /// Indexed by `RemoteId`; None once forgotten, never reused: the proxy's connections and
    /// registered buffers hold ids, and a reused one would send their writes elsewhere.
    remotes: Vec<Option<Remote>>,
    /// Unit tests only: host regions registered from now on stand in for FI_HMEM memory of
    /// this CUDA device (values to them are relayed after a GPUDirect flush), so that the
    /// relay and its flush run without a GPU (`tests.rs`).
    pub host_as_hmem: Option<i32>,
    /// Keys requested from a counter of this endpoint's, from 1, instead of the process's
    /// (`mr::next_key`): unique per domain only, as a provider keeps its keys (the cxi-like
    /// test layer; `unordered::Profile::provider_keys`). A write that names another
    /// endpoint's key may then land in one of ours.
    pub endpoint_keys: Option<u64>,
}

impl Index<MrId> for Regions {
    type Output = LocalRegion;
    /// `id` was handed out and not released: the write paths use only ids the caller holds.
    fn index(&self, id: MrId) -> &LocalRegion {
        self.local
            .get(id)
            .unwrap_or_else(|| panic!("local region {id} used after it was released"))
    }
}

/// What registering needs to know of staging (`staging/`), which sits above this module: the
/// CUDA device the endpoint serves (None: host memory), whether every host region is staged
/// (`MSCCLPP_TEST_FORCE_STAGING`), and how to make the copier that staged GPU memory needs,
/// so that a region that cannot be copied fails at registration, not at its first write.
pub(super) struct Stage<'a> {
    pub device: Option<i32>,
    pub force: bool,
    /// `MSCCLPP_TEST_FORCE_STAGING=source`: host regions registered, but written from through
    /// the bounce slots (`LocalRegion::staged_source`).
    pub force_source: bool,
    pub copier: &'a mut dyn FnMut() -> Result<()>,
}

impl Regions {
    pub fn new(policy: mr::Policy, hmem: std::result::Result<(), &'static str>) -> Self {
        Regions {
            mrs: mr::Table::new(),
            policy,
            hmem,
            local: Slots::default(),
            region_ids: HashMap::new(),
            remotes: Vec::new(),
            host_as_hmem: None,
            endpoint_keys: None,
        }
    }

    pub fn get(&self, id: MrId) -> Option<&LocalRegion> {
        self.local.get(id)
    }

    /// Region `id` if `register` handed it out: what a peer's staging record may name (a
    /// source of a registered write was never exported, and its id may be reused).
    pub fn exported(&self, id: MrId) -> Option<&LocalRegion> {
        self.get(id).filter(|r| !r.source)
    }

    /// Local regions held now (exported and sources), and of them libfabric registrations
    /// (with the fixed ones and bounce slots): what `register_source` must not grow.
    #[cfg(test)]
    pub fn held(&self) -> (usize, usize) {
        (self.local.held(), self.mrs.open())
    }

    /// The registrations every endpoint makes when it opens: the op slots' inline area
    /// (`STAGING_MR`) and the scratch word (`SCRATCH_MR`), whose key (and address) go into
    /// `scratch`, the blob peers write markers with. Sets `ops.inline_desc`.
    pub fn register_fixed(&mut self, ops: &mut Ops, scratch: &mut MrBlob) -> Result<()> {
        let policy = self.policy;
        // The staging ring: registered like any source buffer (FI_MR_LOCAL needs its desc).
        let staging_req = mr::Request {
            addr: ops.inline.ptr() as u64,
            len: ops.inline.len() as u64,
            access: fi::FI_WRITE as u64,
            requested_key: self.request_key()?,
            cuda_device: None,
        };
        let m = mr::register(&mut ops.mr_ops(), &policy, &staging_req)?;
        ops.inline_desc = m.desc;
        let i = self.mrs.insert(m);
        debug_assert_eq!(i, STAGING_MR);
        // The scratch word: peers' flush markers land here.
        let scratch_req = mr::Request {
            addr: ops.scratch.ptr() as u64,
            len: 8,
            access: fi::FI_REMOTE_WRITE as u64,
            requested_key: self.request_key()?,
            cuda_device: None,
        };
        let m = mr::register(&mut ops.mr_ops(), &policy, &scratch_req)?;
        scratch.key = m.key;
        if policy.virt_addr {
            scratch.base = m.addr;
        }
        let i = self.mrs.insert(m);
        debug_assert_eq!(i, SCRATCH_MR);
        Ok(())
    }

    /// Keeps a registration for teardown; returns its index in `mrs`.
    pub fn add_mr(&mut self, m: mr::LocalMr<*mut fi::fid_mr>) -> usize {
        self.mrs.insert(m)
    }

    /// The key to request for the next registration (ignored under FI_MR_PROV_KEY).
    pub fn request_key(&mut self) -> Result<u64> {
        if self.policy.prov_key {
            return Ok(0);
        }
        if let Some(k) = self.endpoint_keys.as_mut() {
            *k += 1;
            return Ok(*k - 1);
        }
        mr::next_key(self.policy.key_size)
    }

    /// `Endpoint::register`: host memory is registered, device memory registered with FI_HMEM
    /// where that works and staged otherwise (and every region under forced staging).
    pub fn register(
        &mut self,
        ops: &mut Ops,
        staging: Stage<'_>,
        region: Region,
    ) -> Result<(MrId, Vec<u8>)> {
        check_region(region)?;
        if let Some(&id) = self.region_ids.get(&region) {
            return Ok((id, self[id].blob.clone()));
        }
        let staged_source = staging.force_source;
        let (backing, staged_why) = self.back(ops, staging, region)?;
        let id = self.hold(LocalRegion {
            region,
            backing,
            blob: Vec::new(),
            source: false,
            staged_source: staged_source || backing == Backing::Staged,
        });
        let virt = self.policy.virt_addr;
        let blob = match backing {
            Backing::Mr(i) | Backing::Hmem(i, _) => MrBlob {
                virt_addr: virt,
                base: if virt { region.addr } else { 0 },
                len: region.len,
                key: self.mrs[i].key,
                mode: if matches!(backing, Backing::Hmem(..)) {
                    Mode::RelayValues
                } else {
                    Mode::Direct
                },
                id: id as u32,
                // Host memory: this endpoint stores values that ride as CQ data into it.
                cq_values: ops.cq_signals && matches!(backing, Backing::Mr(_)),
            },
            Backing::Staged => MrBlob {
                virt_addr: virt,
                base: 0,
                len: region.len,
                key: 0,
                mode: Mode::Staged,
                id: id as u32,
                cq_values: false,
            },
        };
        if blob.cq_values {
            ops.incoming.accept(blob.id, region.addr, region.len);
        }
        let blob = blob.encode();
        if let Some(r) = self.local.get_mut(id) {
            r.blob = blob.clone();
        }
        self.region_ids.insert(region, id);
        // Which path the region's bytes take, and why: the one place a user can see whether
        // GPU memory goes by FI_HMEM or is staged.
        let path = match (backing, region.kind) {
            (Backing::Mr(_), _) if staged_source => "host memory, registered with the provider; writes from it staged through bounce slots (MSCCLPP_TEST_FORCE_STAGING=source)".to_string(),
            (Backing::Mr(_), _) => "host memory, registered with the provider".to_string(),
            (Backing::Hmem(..), MemKind::Device(d)) => format!(
                "CUDA device {d} memory, registered with FI_HMEM: the NIC writes it directly; signal values are relayed by this proxy after a GPUDirect RDMA flush"
            ),
            (Backing::Staged, MemKind::Host) => {
                "host memory, staged (MSCCLPP_TEST_FORCE_STAGING=1)".to_string()
            }
            (Backing::Staged, MemKind::Device(d)) => format!(
                "CUDA device {d} memory, staged through pinned host memory ({staged_why})"
            ),
            (Backing::Hmem(_, d), MemKind::Host) => format!(
                "host memory standing in for FI_HMEM memory of CUDA device {d} (tests)"
            ),
        };
        crate::info!(
            "net: {} region {id} {:#x}+{}: {path}",
            ops.describe(),
            region.addr,
            region.len
        );
        Ok((id, blob))
    }

    /// `Endpoint::register_source`: backed as `register` would back it, but never shared with
    /// another registration of the same range (a region of that range may have been freed and
    /// its address reused since) and never exported.
    pub fn register_source(
        &mut self,
        ops: &mut Ops,
        staging: Stage<'_>,
        region: Region,
    ) -> Result<MrId> {
        check_region(region)?;
        let staged_source = staging.force_source;
        let (backing, _) = self.back(ops, staging, region)?;
        let id = self.hold(LocalRegion {
            region,
            backing,
            blob: Vec::new(),
            source: true,
            staged_source: staged_source || backing == Backing::Staged,
        });
        crate::trace!(
            "net: {} source {id} {:#x}+{}: {backing:?}",
            ops.describe(),
            region.addr,
            region.len
        );
        Ok(id)
    }

    /// `Endpoint::release_source`: closes the source's registration and frees its id.
    pub fn release_source(&mut self, ops: &mut Ops, id: MrId) -> Result<()> {
        let r = self.local.remove_if(id, |r| r.source).ok_or_else(|| {
            Error::internal(format!(
                "{}: releasing local region {id}, which is not a held source",
                ops.describe()
            ))
        })?;
        match r.backing {
            Backing::Mr(i) | Backing::Hmem(i, _) => mr::close(&mut ops.mr_ops(), &mut self.mrs, i),
            Backing::Staged => Ok(()),
        }
    }

    /// `Endpoint::deregister`: closes an exported region's registration, refuses values and
    /// records into it from now on, and frees its id.
    pub fn deregister(&mut self, ops: &mut Ops, id: MrId) -> Result<()> {
        let r = self.local.remove_if(id, |r| !r.source).ok_or_else(|| {
            Error::internal(format!(
                "{}: deregistering local region {id}, which is not a held registration",
                ops.describe()
            ))
        })?;
        self.region_ids.remove(&r.region);
        ops.incoming.refuse(id as u32);
        crate::info!(
            "net: {} region {id} {:#x}+{} deregistered",
            ops.describe(),
            r.region.addr,
            r.region.len
        );
        match r.backing {
            Backing::Mr(i) | Backing::Hmem(i, _) => mr::close(&mut ops.mr_ops(), &mut self.mrs, i),
            Backing::Staged => Ok(()),
        }
    }

    /// Keeps `r` (in a released id's place if there is one); returns its id.
    fn hold(&mut self, r: LocalRegion) -> MrId {
        self.local.insert(r)
    }

    /// How `region` is backed: registered (host memory, FI_HMEM) or staged, and for staged
    /// GPU memory why (for the log).
    fn back(
        &mut self,
        ops: &mut Ops,
        staging: Stage<'_>,
        region: Region,
    ) -> Result<(Backing, String)> {
        // Why a GPU region is staged rather than registered with FI_HMEM (for the log).
        let mut staged_why = String::new();
        let backing = match region.kind {
            MemKind::Host if staging.force && self.host_as_hmem.is_none() => {
                if staging.device.is_some() {
                    return Err(Error::usage(
                        "MSCCLPP_TEST_FORCE_STAGING stages host memory on host endpoints only",
                    ));
                }
                Backing::Staged
            }
            MemKind::Host => {
                let req = mr::Request {
                    addr: region.addr,
                    len: region.len,
                    access: fi::FI_WRITE as u64 | fi::FI_REMOTE_WRITE as u64,
                    requested_key: self.request_key()?,
                    cuda_device: None,
                };
                let policy = self.policy;
                let m = mr::register(&mut ops.mr_ops(), &policy, &req)?;
                let i = self.add_mr(m);
                match self.host_as_hmem {
                    Some(d) => Backing::Hmem(i, d),
                    None => Backing::Mr(i),
                }
            }
            MemKind::Device(d) => {
                if staging.device != Some(d) {
                    return Err(Error::usage(format!(
                        "{} serves {}, not CUDA device {d}",
                        ops.describe(),
                        staging
                            .device
                            .map_or("host memory".to_string(), |x| format!("CUDA device {x}"))
                    )));
                }
                match self.try_hmem(ops, region, d)? {
                    Ok(i) => Backing::Hmem(i, d),
                    Err(why) => {
                        // Fail now rather than at the first write if copies are impossible.
                        (staging.copier)()?;
                        staged_why = why;
                        Backing::Staged
                    }
                }
            }
        };
        Ok((backing, staged_why))
    }

    /// Registers device memory with FI_HMEM if this endpoint can use it directly: the provider
    /// has FI_HMEM, registering CUDA memory succeeds, and the driver can flush GPUDirect RDMA
    /// writes (needed before a relayed value is stored). None: stage it instead.
    fn try_hmem(
        &mut self,
        ops: &mut Ops,
        region: Region,
        device: i32,
    ) -> Result<std::result::Result<usize, String>> {
        if let Err(why) = self.hmem {
            return Ok(Err(why.to_string()));
        }
        if !crate::cuda::has_flush_gpudirect_rdma() {
            log_once(
                &NO_GDR_FLUSH_LOGGED,
                "net: the CUDA driver has no cuFlushGPUDirectRDMAWrites: GPU memory is staged through host memory instead of FI_HMEM",
            );
            return Ok(Err(
                "the CUDA driver has no cuFlushGPUDirectRDMAWrites".to_string()
            ));
        }
        let req = mr::Request {
            addr: region.addr,
            len: region.len,
            access: fi::FI_WRITE as u64 | fi::FI_REMOTE_WRITE as u64,
            requested_key: self.request_key()?,
            cuda_device: Some(device),
        };
        let policy = self.policy;
        match mr::register(&mut ops.mr_ops(), &policy, &req) {
            Ok(m) => Ok(Ok(self.add_mr(m))),
            // A provider that claims FI_HMEM may still lack CUDA support in this build.
            Err(e) => {
                log_once(
                    &HMEM_FAILED_LOGGED,
                    &format!(
                        "net: {} reports FI_HMEM but registering CUDA memory failed ({e}): GPU memory is staged through host memory",
                        ops.provider
                    ),
                );
                Ok(Err(format!(
                    "{} reports FI_HMEM, but registering CUDA memory failed: {e}",
                    ops.provider
                )))
            }
        }
    }

    /// `Endpoint::import`, once the peer is known to exist.
    pub fn import(&mut self, peers: &Peers, peer: PeerId, blob: &[u8]) -> Result<RemoteId> {
        let b = MrBlob::decode(blob, self.policy.virt_addr, self.policy.key_size)
            .map_err(|e| Error::remote(format!("{}: {e}", peers.name(peer))))?;
        self.remotes.push(Some(Remote { peer, blob: b }));
        Ok(self.remotes.len() - 1)
    }

    /// `Endpoint::forget`, for the regions' part (`ops.outgoing` keeps the rest).
    pub fn forget(&mut self, ops: &Ops, dst: RemoteId) -> Result<()> {
        match self.remotes.get_mut(dst).and_then(Option::take) {
            Some(_) => Ok(()),
            None => Err(Error::internal(format!(
                "{}: forgetting remote region {dst}, which is not held",
                ops.describe()
            ))),
        }
    }

    /// The length an imported region's blob declares.
    pub fn remote_len(&self, dst: RemoteId) -> Option<u64> {
        self.remotes.get(dst)?.as_ref().map(|r| r.blob.len)
    }

    /// Imported regions held now (not forgotten).
    #[cfg(test)]
    pub fn remotes_held(&self) -> usize {
        self.remotes.iter().flatten().count()
    }

    /// The imported region `dst`, which must belong to `peer`.
    pub fn remote(&self, ops: &Ops, peers: &Peers, peer: PeerId, dst: RemoteId) -> Result<MrBlob> {
        let r = match self.remotes.get(dst) {
            Some(Some(r)) => r,
            Some(None) => {
                return Err(Error::invalid_arg(format!(
                    "remote region {dst} on {} was released",
                    ops.describe()
                )))
            }
            None => {
                return Err(Error::invalid_arg(format!(
                    "unknown remote region {dst} on {}",
                    ops.describe()
                )))
            }
        };
        if r.peer != peer {
            return Err(Error::invalid_arg(format!(
                "remote region {dst} belongs to {}, not {}",
                peers.name(r.peer),
                peers.name(peer)
            )));
        }
        Ok(r.blob)
    }

    /// `Endpoint::write`'s bounds: the source range inside its registration, a non-empty
    /// destination range inside the region imported from `peer`.
    #[allow(clippy::too_many_arguments)] // `write`'s arguments, the peers for the message
    pub fn check_write(
        &self,
        peers: &Peers,
        peer: PeerId,
        src: MrId,
        src_off: u64,
        remote: &MrBlob,
        dst_off: u64,
        size: u64,
    ) -> Result<()> {
        match self.get(src) {
            Some(r) if range_ok(src_off, size, r.region.len) => {}
            Some(r) => {
                return Err(Error::invalid_arg(format!(
                    "write refused: source range [{src_off}, {src_off}+{size}) outside the {}-byte registration",
                    r.region.len
                )))
            }
            None => {
                return Err(Error::invalid_arg(format!(
                    "unknown local registration {src}"
                )))
            }
        }
        if size == 0 || !range_ok(dst_off, size, remote.len) {
            return Err(Error::invalid_arg(format!(
                "write refused: destination range [{dst_off}, {dst_off}+{size}) outside the {}-byte region imported from {}",
                remote.len,
                peers.name(peer)
            )));
        }
        Ok(())
    }
}

/// `Endpoint::write_value`'s bounds: 8 bytes inside the region imported from `peer`, aligned
/// where the owner stores the value itself (a region that is not `Mode::Direct`).
pub(super) fn check_value(
    peers: &Peers,
    peer: PeerId,
    remote: &MrBlob,
    dst_off: u64,
) -> Result<()> {
    if !range_ok(dst_off, 8, remote.len) {
        return Err(Error::invalid_arg(format!(
            "flag write refused: 8 bytes at {dst_off} outside the {}-byte region imported from {}",
            remote.len,
            peers.name(peer)
        )));
    }
    if remote.mode != Mode::Direct && dst_off % 8 != 0 {
        return Err(Error::invalid_arg(format!(
            "flag write refused: offset {dst_off} is not 8-byte aligned"
        )));
    }
    Ok(())
}

/// Logged once per process each: why GPU memory is staged although the provider has FI_HMEM.
static NO_GDR_FLUSH_LOGGED: AtomicBool = AtomicBool::new(false);
static HMEM_FAILED_LOGGED: AtomicBool = AtomicBool::new(false);

fn log_once(flag: &AtomicBool, msg: &str) {
    // Relaxed: only "once" matters, nothing is published through the flag.
    if !flag.swap(true, AtOrd::Relaxed) {
        crate::info!("{msg}");
    }
}

fn check_region(region: Region) -> Result<()> {
    if region.addr == 0 || region.len == 0 || region.addr.checked_add(region.len).is_none() {
        return Err(Error::invalid_arg(format!(
            "cannot register {:#x}+{} bytes",
            region.addr, region.len
        )));
    }
    Ok(())
}

pub(super) fn range_ok(off: u64, size: u64, len: u64) -> bool {
    off.checked_add(size).is_some_and(|e| e <= len)
}
