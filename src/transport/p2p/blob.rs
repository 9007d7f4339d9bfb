//! The P2P setup blobs (endpoint address, registered region) and their validation.
//!
//! A blob comes from another process; everything in it is checked before use: magic and version,
//! field sizes, that the peer is on this host, that a region's range lies inside the allocation
//! it names. The mapped size is checked again after `cuIpcOpenMemHandle` (see `IpcMapping`).

use crate::cuda::IPC_HANDLE_BYTES;
use crate::error::{Error, Result};
use crate::wire::{Reader, Writer};
use std::sync::OnceLock;

const ADDR_MAGIC: u32 = 0x4d50_3241; // "MP2A"
const REGION_MAGIC: u32 = 0x4d50_3252; // "MP2R"
const VERSION: u32 = 2; // 2: the address names its GPU by PCI address too

/// Identifies the running kernel instance: equal on two ranks iff they share a host (and so can
/// use CUDA IPC). Boot id, else the host name.
pub fn host_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_owned())
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| {
                let mut buf = [0u8; 256];
                // SAFETY: writable buffer of its length; NUL-terminated on success.
                let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
                let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
                if rc == 0 {
                    String::from_utf8_lossy(&buf[..end]).into_owned()
                } else {
                    "unknown-host".into()
                }
            })
    })
}

/// A random id of this process. Unlike the pid it is unique across pid namespaces, so "same
/// process" (memory usable without IPC) is never confused with "same pid in another container".
pub fn process_nonce() -> u64 {
    static N: OnceLock<u64> = OnceLock::new();
    *N.get_or_init(|| {
        crate::bootstrap::random_nonce().unwrap_or_else(|_| {
            // No entropy source: pid and time still separate processes in practice.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1);
            t ^ ((std::process::id() as u64) << 32) | 1
        })
    })
}

/// What a peer needs to know about this endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Address {
    pub host: String,
    pub nonce: u64,
    /// The CUDA ordinal, in the peer's own numbering (its `CUDA_VISIBLE_DEVICES`).
    pub device: i32,
    /// The GPU's PCI address (`cuda::pci_bus_id`), the same in every process; empty where the
    /// driver gave none.
    pub bus: String,
}

impl Address {
    /// Whether the peer at `peer` runs on this endpoint's GPU (`self`): by PCI address where
    /// both know it, since ordinals count only the GPUs each process sees (two ranks given one
    /// GPU each by `CUDA_VISIBLE_DEVICES` both call theirs 0); else by ordinal.
    pub fn same_gpu(&self, peer: &Address) -> bool {
        if self.bus.is_empty() || peer.bus.is_empty() {
            self.device == peer.device
        } else {
            self.bus == peer.bus
        }
    }
}

impl Address {
    pub fn encode(&self) -> Vec<u8> {
        Writer::new()
            .u32(ADDR_MAGIC)
            .u32(VERSION)
            .bytes(self.host.as_bytes())
            .u64(self.nonce)
            .u32(self.device as u32)
            .bytes(self.bus.as_bytes())
            .finish()
    }

    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = Reader::new(b, "P2P endpoint address");
        let (magic, ver) = (r.u32()?, r.u32()?);
        if magic != ADDR_MAGIC || ver != VERSION {
            return Err(Error::remote(format!(
                "P2P endpoint address: foreign blob (magic {magic:#x}, version {ver}); is the peer using a P2P connection of this library version?"
            )));
        }
        let host = String::from_utf8(r.bytes()?.to_vec())
            .map_err(|_| Error::remote("P2P endpoint address: host id is not UTF-8"))?;
        let nonce = r.u64()?;
        let device = r.u32()? as i32;
        let bus = String::from_utf8(r.bytes()?.to_vec())
            .map_err(|_| Error::remote("P2P endpoint address: PCI address is not UTF-8"))?;
        r.finish()?;
        if host.is_empty() || nonce == 0 || device < 0 {
            return Err(Error::remote(format!(
                "P2P endpoint address: invalid fields (host {host:?}, nonce {nonce}, device {device})"
            )));
        }
        Ok(Address {
            host,
            nonce,
            device,
            bus,
        })
    }
}

/// A registered region as a peer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionBlob {
    /// The exporting process (see [`process_nonce`]).
    pub nonce: u64,
    /// None for host memory, which P2P cannot share.
    pub device: Option<i32>,
    /// Allocation base and size in the exporter's address space.
    pub base: u64,
    pub alloc_size: u64,
    /// The region: `[base + offset, base + offset + len)`.
    pub offset: u64,
    pub len: u64,
    pub handle: [u8; IPC_HANDLE_BYTES],
}

impl RegionBlob {
    pub fn encode(&self) -> Vec<u8> {
        Writer::new()
            .u32(REGION_MAGIC)
            .u32(VERSION)
            .u64(self.nonce)
            .u32(self.device.map_or(u32::MAX, |d| d as u32))
            .u64(self.base)
            .u64(self.alloc_size)
            .u64(self.offset)
            .u64(self.len)
            .bytes(&self.handle)
            .finish()
    }

    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = Reader::new(b, "P2P region blob");
        let (magic, ver) = (r.u32()?, r.u32()?);
        if magic != REGION_MAGIC || ver != VERSION {
            return Err(Error::remote(format!(
                "P2P region blob: foreign blob (magic {magic:#x}, version {ver})"
            )));
        }
        let nonce = r.u64()?;
        let dev = r.u32()?;
        let (base, alloc_size, offset, len) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?);
        let h = r.bytes()?;
        r.finish()?;
        let handle: [u8; IPC_HANDLE_BYTES] = h.try_into().map_err(|_| {
            Error::remote(format!(
                "P2P region blob: IPC handle of {} bytes, expected {IPC_HANDLE_BYTES}",
                h.len()
            ))
        })?;
        let device = match dev {
            u32::MAX => None,
            d if d <= i32::MAX as u32 => Some(d as i32),
            d => return Err(Error::remote(format!("P2P region blob: bad device {d}"))),
        };
        let b = RegionBlob {
            nonce,
            device,
            base,
            alloc_size,
            offset,
            len,
            handle,
        };
        b.validate()?;
        Ok(b)
    }

    /// Internal consistency: a non-empty range inside the allocation, a real handle.
    fn validate(&self) -> Result<()> {
        if self.device.is_none() {
            return Ok(());
        }
        let end = self.offset.checked_add(self.len);
        if self.len == 0 || end.is_none_or(|e| e > self.alloc_size) {
            return Err(Error::remote(format!(
                "P2P region blob: range [{}, +{}) outside its {}-byte allocation",
                self.offset, self.len, self.alloc_size
            )));
        }
        if self.base == 0 || self.base.checked_add(self.alloc_size).is_none() {
            return Err(Error::remote(format!(
                "P2P region blob: bad allocation base {:#x} / size {}",
                self.base, self.alloc_size
            )));
        }
        if self.handle.iter().all(|b| *b == 0) {
            return Err(Error::remote("P2P region blob: empty IPC handle"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn region() -> RegionBlob {
        RegionBlob {
            nonce: 7,
            device: Some(1),
            base: 0x7f00_0000_0000,
            alloc_size: 1 << 21,
            offset: 4096,
            len: 8192,
            handle: [3; IPC_HANDLE_BYTES],
        }
    }

    #[test]
    fn roundtrips() {
        let a = Address {
            host: host_id().into(),
            nonce: process_nonce(),
            device: 1,
            bus: "00000000:1b:00.0".into(),
        };
        assert_eq!(Address::decode(&a.encode()).unwrap(), a);
        let unknown = Address {
            bus: String::new(),
            ..a.clone()
        };
        assert_eq!(Address::decode(&unknown.encode()).unwrap(), unknown);
        let r = region();
        assert_eq!(RegionBlob::decode(&r.encode()).unwrap(), r);
        let h = RegionBlob {
            device: None,
            handle: [0; IPC_HANDLE_BYTES],
            ..region()
        };
        assert_eq!(RegionBlob::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn rejects_out_of_range_regions() {
        for bad in [
            RegionBlob { len: 0, ..region() },
            RegionBlob {
                offset: (1 << 21) - 10,
                ..region()
            },
            RegionBlob {
                offset: u64::MAX,
                ..region()
            },
            RegionBlob {
                handle: [0; IPC_HANDLE_BYTES],
                ..region()
            },
            RegionBlob {
                base: u64::MAX - 4,
                ..region()
            },
        ] {
            assert!(RegionBlob::decode(&bad.encode()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn rejects_foreign_and_truncated_blobs() {
        let mut b = region().encode();
        b[0] ^= 1;
        assert!(RegionBlob::decode(&b).is_err());
        let b = region().encode();
        assert!(RegionBlob::decode(&b[..b.len() - 1]).is_err());
        assert!(Address::decode(&b).is_err());
        let mut a = Address {
            host: "h".into(),
            nonce: 1,
            device: 0,
            bus: String::new(),
        }
        .encode();
        a.push(0);
        assert!(Address::decode(&a).is_err());
    }

    #[test]
    fn same_gpu_by_pci_address_where_known() {
        let at = |device, bus: &str| Address {
            host: "h".into(),
            nonce: 1,
            device,
            bus: bus.into(),
        };
        let (a, b) = ("00000000:1b:00.0", "00000000:43:00.0");
        // Two ranks each given one GPU by CUDA_VISIBLE_DEVICES: both ordinal 0, two GPUs.
        assert!(!at(0, a).same_gpu(&at(0, b)));
        // One GPU seen under two numberings (CUDA_VISIBLE_DEVICES=1,0 against 0,1).
        assert!(at(1, a).same_gpu(&at(0, a)));
        // Either side without a PCI address: the ordinals decide.
        assert!(at(0, "").same_gpu(&at(0, b)));
        assert!(!at(0, a).same_gpu(&at(1, "")));
    }

    #[test]
    fn nonce_is_stable_and_non_zero() {
        assert_ne!(process_nonce(), 0);
        assert_eq!(process_nonce(), process_nonce());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = RegionBlob::decode(&data);
            let _ = Address::decode(&data);
        }
    }
}
