//! The P2P endpoint's regions: local registrations (exported as IPC handles of their
//! allocation), peers' regions imported through CUDA IPC (one mapping per allocation), and the
//! checked addresses of a put or a flag into them.

use super::blob::{process_nonce, RegionBlob};
use crate::cuda::{self, IpcMapping, IPC_HANDLE_BYTES};
use crate::error::{Error, Result};
use crate::transport::slots::Slots;
use crate::transport::{MemKind, MrId, PeerId, Region, RemoteId};
use std::collections::HashMap;

struct Local {
    region: Region,
    /// Registered by `register_source`: released after its call.
    source: bool,
}

struct Remote {
    peer: PeerId,
    /// This process's address of the region (mapped, or the peer's own when same process).
    ptr: u64,
    len: u64,
    /// Mapped through CUDA IPC (peer access enabled), so kernels may store to it.
    mapped: bool,
}

/// A checked put: this process's addresses of both ends.
pub(super) struct PutTarget {
    pub(super) dst: u64,
    pub(super) src: u64,
    pub(super) size: u64,
    /// The destination is mapped through CUDA IPC (kernels may store to it).
    pub(super) mapped: bool,
    /// The source is device memory.
    pub(super) d2d: bool,
}

/// A checked flag write.
pub(super) struct FlagTarget {
    pub(super) addr: u64,
    pub(super) value: u64,
    pub(super) mapped: bool,
}

/// Mapping cache key: exporting process, allocation base there, handle.
type MapKey = (u64, u64, [u8; IPC_HANDLE_BYTES]);

/// Local registrations and imported remote regions, with the mappings that back the latter.
pub(super) struct Regions {
    /// The endpoint's device: peers' allocations are mapped there.
    device: i32,
    /// Regions of `register` (deduplicated by `local_ids`, kept) and of `register_source`
    /// (until `release_source`); `MrId` indexes this, and a released id is reused, so that a
    /// registration per call does not grow it.
    locals: Slots<Local>,
    local_ids: HashMap<Region, MrId>,
    remotes: Vec<Remote>,
    maps: HashMap<MapKey, IpcMapping>,
}

impl Regions {
    pub(super) fn new(device: i32) -> Regions {
        Regions {
            device,
            locals: Slots::default(),
            local_ids: HashMap::new(),
            remotes: Vec::new(),
            maps: HashMap::new(),
        }
    }

    /// `Endpoint::register`: the region's id (the same for the same region) and its blob.
    pub(super) fn register(&mut self, region: Region) -> Result<(MrId, Vec<u8>)> {
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
        let id = match self.local_ids.get(&region) {
            Some(id) => *id,
            None => {
                let id = self.hold(Local {
                    region,
                    source: false,
                });
                self.local_ids.insert(region, id);
                id
            }
        };
        Ok((id, blob.encode()))
    }

    /// `Endpoint::register_source`: only bookkeeping (the copy reads the source through this
    /// process's own address; nothing is exported, so no IPC handle is made).
    pub(super) fn register_source(&mut self, region: Region) -> Result<MrId> {
        if region.addr == 0 || region.len == 0 || region.addr.checked_add(region.len).is_none() {
            return Err(Error::invalid_arg(format!(
                "cannot register {:#x}+{} bytes",
                region.addr, region.len
            )));
        }
        Ok(self.hold(Local {
            region,
            source: true,
        }))
    }

    /// `Endpoint::release_source`.
    pub(super) fn release_source(&mut self, id: MrId) -> Result<()> {
        match self.locals.remove_if(id, |l| l.source) {
            Some(_) => Ok(()),
            None => Err(Error::internal(format!(
                "P2P: releasing local region {id}, which is not a held source"
            ))),
        }
    }

    /// Keeps `l` (in a released id's place if there is one); returns its id.
    fn hold(&mut self, l: Local) -> MrId {
        self.locals.insert(l)
    }

    /// Local regions held now (registered and sources).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.locals.held()
    }

    /// Imports the region of blob `b` (decoded) from `peer`, the rank `rank` whose endpoint's
    /// process is `peer_nonce`: maps its allocation (once per allocation) unless it is ours.
    pub(super) fn import(
        &mut self,
        peer: PeerId,
        (rank, peer_nonce): (usize, u64),
        b: RegionBlob,
    ) -> Result<RemoteId> {
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
        let mapped = b.nonce != process_nonce();
        let ptr = if !mapped {
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
            mapped,
        });
        Ok(self.remotes.len() - 1)
    }

    /// `Endpoint::remote_len`.
    pub(super) fn remote_len(&self, remote: RemoteId) -> Option<u64> {
        self.remotes.get(remote).map(|r| r.len)
    }

    /// `Endpoint::remote_ptr`.
    pub(super) fn remote_ptr(&self, remote: RemoteId) -> Option<u64> {
        self.remotes.get(remote).map(|r| r.ptr)
    }

    /// Where a kernel of ours would reach region `r` of `peer`: its address, length, and
    /// whether it is mapped through CUDA IPC (else a region of this same process, used at the
    /// peer's own address). None: not that peer's region.
    pub(super) fn kernel_view(&self, r: RemoteId, peer: PeerId) -> Option<(u64, u64, bool)> {
        self.remote(r, peer).ok().map(|x| (x.ptr, x.len, x.mapped))
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

    /// The addresses of a put, checked against both regions (the proxy checked the ranges;
    /// re-checked because a stray write would land in another process's memory).
    pub(super) fn put_target(
        &self,
        peer: PeerId,
        src: MrId,
        src_off: u64,
        dst: RemoteId,
        dst_off: u64,
        size: u64,
    ) -> Result<PutTarget> {
        let l = self
            .locals
            .get(src)
            .ok_or_else(|| Error::internal(format!("P2P local region {src}")))?
            .region;
        let r = self.remote(dst, peer)?;
        if src_off.checked_add(size).is_none_or(|e| e > l.len)
            || dst_off.checked_add(size).is_none_or(|e| e > r.len)
        {
            return Err(Error::internal(format!(
                "P2P write out of range: src [{src_off}, +{size}) of {}, dst [{dst_off}, +{size}) of {}",
                l.len, r.len
            )));
        }
        Ok(PutTarget {
            dst: r.ptr + dst_off,
            src: l.addr + src_off,
            size,
            mapped: r.mapped,
            d2d: matches!(l.kind, MemKind::Device(_)),
        })
    }

    /// The address of a flag (8 bytes, aligned, inside the peer's epoch region).
    pub(super) fn flag_target(
        &self,
        peer: PeerId,
        dst: RemoteId,
        dst_off: u64,
        value: u64,
    ) -> Result<FlagTarget> {
        let r = self.remote(dst, peer)?;
        if dst_off.checked_add(8).is_none_or(|e| e > r.len) || (r.ptr + dst_off) % 8 != 0 {
            return Err(Error::internal(format!(
                "P2P value write at offset {dst_off} of a {}-byte region (or misaligned)",
                r.len
            )));
        }
        Ok(FlagTarget {
            addr: r.ptr + dst_off,
            value,
            mapped: r.mapped,
        })
    }

    /// Closes every mapping (once nothing queued or running uses them any more).
    pub(super) fn unmap(&mut self) {
        self.maps.clear();
        self.remotes.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(addr: u64, len: u64) -> Region {
        Region {
            addr,
            len,
            kind: MemKind::Host,
        }
    }

    /// mscclppRegisteredBufferWrite's sources, registered and released per call, do not grow
    /// the table; the connection's regions stay, deduplicated, and cannot be released.
    #[test]
    fn sources_released_per_call_do_not_grow_locals() {
        let mut r = Regions::new(0);
        let (conn, _) = r.register(host(0x10_0000, 4096)).unwrap();
        assert_eq!(r.register(host(0x10_0000, 4096)).unwrap().0, conn);
        for i in 0..10_000u64 {
            let s = r.register_source(host(0x20_0000, 8 + i)).unwrap();
            assert_ne!(s, conn);
            assert_eq!(r.locals.get(s).unwrap().region.len, 8 + i);
            r.release_source(s).unwrap();
            assert!(r.release_source(s).is_err(), "released twice");
            assert_eq!(r.held(), 1);
        }
        assert_eq!(r.locals.ids(), 2, "one slot for the sources, reused");
        // The same range as the connection's region is still a registration of its own.
        let s = r.register_source(host(0x10_0000, 4096)).unwrap();
        assert_ne!(s, conn);
        r.release_source(s).unwrap();
        assert!(
            r.release_source(conn).is_err(),
            "a connection region is not a source"
        );
        assert_eq!(r.locals.get(conn).unwrap().region, host(0x10_0000, 4096));
        assert!(r.register_source(host(0, 8)).is_err());
    }
}
