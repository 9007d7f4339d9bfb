//! The P2P endpoint's regions: local registrations (exported as IPC handles of their
//! allocation), peers' regions imported through CUDA IPC (one mapping per allocation, closed
//! when the last region imported from it is forgotten), and the checked addresses of a put or
//! a flag into them.

use super::blob::{process_nonce, RegionBlob};
use crate::cuda::{self, IpcMapping, IPC_HANDLE_BYTES};
use crate::error::{Error, Result};
use crate::transport::slots::Slots;
use crate::transport::{MemKind, MrId, PeerId, Region, RemoteId};
use std::collections::HashMap;
use std::hash::Hash;

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
    /// The mapping it lies in (`Regions::maps`), which it holds.
    map: Option<MapKey>,
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
    /// Regions of `register` (deduplicated by `local_ids`, kept until `deregister`) and of
    /// `register_source` (until `release_source`); `MrId` indexes this, and a released id is
    /// reused, so that a registration per call does not grow it.
    locals: Slots<Local>,
    local_ids: HashMap<Region, MrId>,
    /// Indexed by `RemoteId`; None once forgotten, never reused: connections and registered
    /// buffers hold ids, and a reused one would send their writes elsewhere.
    remotes: Vec<Option<Remote>>,
    /// A registered buffer and a connection's buffer may lie in one allocation of the peer's,
    /// mapped once: forgetting the one keeps the mapping the other uses.
    maps: Shared<MapKey, IpcMapping>,
}

/// Values opened once per key and kept while some user holds them (the CUDA IPC mappings,
/// held by the regions imported from them).
pub(super) struct Shared<K, V> {
    items: HashMap<K, (V, usize)>,
}

impl<K: Eq + Hash, V> Default for Shared<K, V> {
    fn default() -> Self {
        Shared {
            items: HashMap::new(),
        }
    }
}

impl<K: Eq + Hash + Copy, V> Shared<K, V> {
    /// One more user of `key`'s value, opened by `open` if none holds it.
    pub(super) fn acquire(&mut self, key: K, open: impl FnOnce() -> Result<V>) -> Result<&V> {
        let e = match self.items.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert((open()?, 0)),
        };
        e.1 += 1;
        Ok(&e.0)
    }

    /// One user fewer of `key`'s value; the value, to be dropped, when that was the last.
    pub(super) fn release(&mut self, key: &K) -> Option<V> {
        let e = self.items.get_mut(key)?;
        e.1 -= 1;
        if e.1 > 0 {
            return None;
        }
        self.items.remove(key).map(|(v, _)| v)
    }

    /// Values open now.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.items.len()
    }

    pub(super) fn clear(&mut self) {
        self.items.clear();
    }
}

impl Regions {
    pub(super) fn new(device: i32) -> Regions {
        Regions {
            device,
            locals: Slots::default(),
            local_ids: HashMap::new(),
            remotes: Vec::new(),
            maps: Shared::default(),
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

    /// `Endpoint::deregister`: a `register` region's bookkeeping (its IPC handle names the
    /// allocation, which the peers' mappings keep until they forget their imports).
    pub(super) fn deregister(&mut self, id: MrId) -> Result<()> {
        let l = self.locals.remove_if(id, |l| !l.source).ok_or_else(|| {
            Error::internal(format!(
                "P2P: deregistering local region {id}, which is not a held registration"
            ))
        })?;
        self.local_ids.remove(&l.region);
        Ok(())
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
        let (ptr, map) = if !mapped {
            // Same process (ranks as threads): the exporter's address is ours.
            (b.base + b.offset, None)
        } else {
            let key = (b.nonce, b.base, b.handle);
            let device = self.device;
            let m = self.maps.acquire(key, || {
                IpcMapping::open(device, &b.handle, b.alloc_size).map_err(|e| {
                    Error::remote(format!("rank {rank}: opening its CUDA IPC handle: {e}"))
                })
            })?;
            let (base, size) = (m.ptr(), m.size());
            if b.offset.checked_add(b.len).is_none_or(|e| e > size) {
                self.maps.release(&key);
                return Err(Error::remote(format!(
                    "rank {rank}: region [{}, +{}) exceeds the {size}-byte allocation its handle maps",
                    b.offset, b.len,
                )));
            }
            (base + b.offset, Some(key))
        };
        self.remotes.push(Some(Remote {
            peer,
            ptr,
            len: b.len,
            mapped,
            map,
        }));
        Ok(self.remotes.len() - 1)
    }

    /// `Endpoint::forget`: the region's id is dead; its mapping closes (dropped here) when no
    /// other imported region holds it.
    pub(super) fn forget(&mut self, remote: RemoteId) -> Result<()> {
        let r = self
            .remotes
            .get_mut(remote)
            .and_then(Option::take)
            .ok_or_else(|| {
                Error::internal(format!(
                    "P2P: forgetting remote region {remote}, which is not held"
                ))
            })?;
        if let Some(key) = r.map {
            // Closed here if it was the last: nothing is in flight into this region (the
            // caller flushed), and kernels store only into connections' regions (`remoteBuff`),
            // which are never forgotten and hold the mapping of their own allocation.
            drop(self.maps.release(&key));
        }
        Ok(())
    }

    /// `Endpoint::remote_len`.
    pub(super) fn remote_len(&self, remote: RemoteId) -> Option<u64> {
        self.remotes.get(remote)?.as_ref().map(|r| r.len)
    }

    /// `Endpoint::remote_ptr`.
    pub(super) fn remote_ptr(&self, remote: RemoteId) -> Option<u64> {
        self.remotes.get(remote)?.as_ref().map(|r| r.ptr)
    }

    /// Where a kernel of ours would reach region `r` of `peer`: its address, length, and
    /// whether it is mapped through CUDA IPC (else a region of this same process, used at the
    /// peer's own address). None: not that peer's region.
    pub(super) fn kernel_view(&self, r: RemoteId, peer: PeerId) -> Option<(u64, u64, bool)> {
        self.remote(r, peer).ok().map(|x| (x.ptr, x.len, x.mapped))
    }

    fn remote(&self, r: RemoteId, peer: PeerId) -> Result<&Remote> {
        let rem = match self.remotes.get(r) {
            Some(Some(rem)) => rem,
            Some(None) => {
                return Err(Error::internal(format!(
                    "P2P remote region {r} was forgotten"
                )))
            }
            None => {
                return Err(Error::internal(format!(
                    "P2P remote id {r} of {}",
                    self.remotes.len()
                )))
            }
        };
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

    /// A deregistered region is gone (a second deregister is refused, a source never is one),
    /// and registering the same range again makes a new registration.
    #[test]
    fn deregistered_regions_are_gone_and_sources_refused() {
        let mut r = Regions::new(0);
        let (a, _) = r.register(host(0x10_0000, 4096)).unwrap();
        let (b, _) = r.register(host(0x30_0000, 64)).unwrap();
        let s = r.register_source(host(0x20_0000, 8)).unwrap();
        assert!(
            r.deregister(s).is_err(),
            "a source is released, not deregistered"
        );
        r.deregister(a).unwrap();
        assert!(r.deregister(a).is_err(), "deregistered twice");
        assert!(r.deregister(99).is_err(), "never handed out");
        assert_eq!(r.held(), 2, "the other region and the source stay");
        assert!(r.put_target(0, a, 0, 0, 0, 8).is_err());
        let (again, _) = r.register(host(0x10_0000, 4096)).unwrap();
        assert_eq!(r.locals.get(again).unwrap().region, host(0x10_0000, 4096));
        assert_eq!(r.register(host(0x30_0000, 64)).unwrap().0, b);
        r.release_source(s).unwrap();
    }

    /// Device memory of this same process (ranks as threads): imported at its own address,
    /// without a mapping; a forgotten region's id is dead and not reused, the others stay.
    #[test]
    fn forgotten_imports_are_dead_and_their_ids_never_reused() {
        let mut r = Regions::new(0);
        let blob = |base: u64, len: u64| RegionBlob {
            nonce: process_nonce(),
            device: Some(0),
            base,
            alloc_size: 1 << 20,
            offset: 0,
            len,
            handle: [0; IPC_HANDLE_BYTES],
        };
        let who = (1, process_nonce());
        let x = r.import(3, who, blob(0x40_0000, 4096)).unwrap();
        let y = r.import(3, who, blob(0x50_0000, 64)).unwrap();
        r.forget(x).unwrap();
        assert!(r.forget(x).is_err(), "forgotten twice");
        assert!(r.forget(7).is_err(), "never imported");
        assert_eq!((r.remote_len(x), r.remote_ptr(x)), (None, None));
        assert!(r.kernel_view(x, 3).is_none());
        assert!(r.flag_target(3, x, 0, 1).is_err());
        assert_eq!(r.remote_len(y), Some(64), "the other stays");
        let z = r.import(3, who, blob(0x40_0000, 4096)).unwrap();
        assert!(z != x && z != y, "a new id, not the forgotten one");
        assert_eq!(r.maps.len(), 0, "same process: nothing mapped");
    }

    /// A mapping shared by regions imported from one allocation is opened once and closed
    /// (dropped) with its last user, whatever order they go in; an open that fails holds
    /// nothing.
    #[test]
    fn shared_mappings_close_with_their_last_user() {
        use std::cell::Cell;
        use std::rc::Rc;
        struct Mapping(Rc<Cell<u32>>);
        impl Drop for Mapping {
            fn drop(&mut self) {
                self.0.set(self.0.get() + 1);
            }
        }
        let (opened, closed) = (Rc::new(Cell::new(0)), Rc::new(Cell::new(0)));
        let mut maps: Shared<u64, Mapping> = Shared::default();
        let open = || {
            opened.set(opened.get() + 1);
            Ok(Mapping(closed.clone()))
        };
        for _ in 0..3 {
            maps.acquire(1, open).unwrap();
        }
        maps.acquire(2, open).unwrap();
        assert_eq!((opened.get(), maps.len()), (2, 2));
        assert!(maps.release(&1).is_none());
        assert!(maps.release(&1).is_none());
        assert_eq!(closed.get(), 0, "allocation 1 still has a user");
        drop(maps.release(&1));
        assert_eq!((closed.get(), maps.len()), (1, 1));
        assert!(maps.release(&1).is_none(), "no user left to release");
        assert!(maps
            .acquire(3, || Err(Error::remote("cannot map")))
            .is_err());
        assert_eq!(maps.len(), 1, "a failed open holds nothing");
        maps.acquire(1, open).unwrap();
        assert_eq!(opened.get(), 3, "reopened after its close");
        maps.clear();
        assert_eq!(closed.get(), 3);
    }
}
