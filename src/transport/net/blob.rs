//! The two blobs the net transport hands to peers: its address, and one per registered region.
//! Both start with a magic and a version and are parsed with `crate::wire::Reader`, so a blob
//! from another transport, another version or a corrupted one is refused with a message.

use crate::error::{Error, Result};
use crate::wire::{Reader, Writer};

const ADDR_MAGIC: u32 = 0x4d53_4e41; // "MSNA"
const MR_MAGIC: u32 = 0x4d53_4e4d; // "MSNM"
const VERSION: u32 = 1;
/// Region blob: magic, version, flags (u32 each), base, len, key (u64 each).
pub(super) const MR_BLOB_LEN: usize = 3 * 4 + 3 * 8;
const FLAG_VIRT_ADDR: u32 = 1;
/// The longest raw endpoint address accepted (sockaddr_in6 is 28 bytes, shm names < 64; some
/// hardware providers use a few hundred).
pub(super) const MAX_RAW_ADDR: usize = 1024;

/// An endpoint address as exchanged between ranks: provider, raw libfabric address, and the
/// endpoint's scratch word (where peers write flush markers).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct AddrBlob {
    pub provider: String,
    pub addr_format: u32,
    pub raw: Vec<u8>,
    pub scratch: MrBlob,
}

impl AddrBlob {
    pub fn encode(&self) -> Vec<u8> {
        Writer::new()
            .u32(ADDR_MAGIC)
            .u32(VERSION)
            .u32(self.addr_format)
            .bytes(self.provider.as_bytes())
            .bytes(&self.raw)
            .bytes(&self.scratch.encode())
            .finish()
    }
    /// Parses and validates a peer's address; its scratch region is checked like any region
    /// blob against this endpoint's addressing mode and key size.
    pub fn decode(b: &[u8], virt_addr: bool, key_size: usize) -> Result<Self> {
        let mut r = Reader::new(b, "network endpoint address");
        let (magic, ver, addr_format) = (r.u32()?, r.u32()?, r.u32()?);
        if magic != ADDR_MAGIC || ver != VERSION {
            return Err(Error::remote(format!(
                "not a network endpoint address (magic {magic:#x}, version {ver})"
            )));
        }
        let provider = String::from_utf8(r.bytes()?.to_vec())
            .map_err(|_| Error::remote("network endpoint address: provider name is not UTF-8"))?;
        let raw = r.bytes()?.to_vec();
        let scratch = MrBlob::decode(r.bytes()?, virt_addr, key_size)?;
        r.finish()?;
        if scratch.len != 8 {
            return Err(Error::remote(format!(
                "network endpoint address: scratch word of {} bytes",
                scratch.len
            )));
        }
        if raw.is_empty() || raw.len() > MAX_RAW_ADDR {
            return Err(Error::remote(format!(
                "network endpoint address of {} bytes (1..={MAX_RAW_ADDR} expected)",
                raw.len()
            )));
        }
        Ok(AddrBlob {
            provider,
            addr_format,
            raw,
            scratch,
        })
    }
}

/// A registered region as a peer sees it: the remote address of byte 0 (`base`: the virtual
/// address under FI_MR_VIRT_ADDR, else 0 = offset mode), its length and key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct MrBlob {
    pub virt_addr: bool,
    pub base: u64,
    pub len: u64,
    pub key: u64,
}

impl MrBlob {
    pub fn encode(&self) -> Vec<u8> {
        Writer::new()
            .u32(MR_MAGIC)
            .u32(VERSION)
            .u32(if self.virt_addr { FLAG_VIRT_ADDR } else { 0 })
            .u64(self.base)
            .u64(self.len)
            .u64(self.key)
            .finish()
    }

    /// Parses and validates a peer's region blob against this endpoint's addressing mode
    /// (`virt_addr`) and key size (bytes).
    pub fn decode(b: &[u8], virt_addr: bool, key_size: usize) -> Result<Self> {
        if b.len() != MR_BLOB_LEN {
            return Err(Error::remote(format!(
                "network region blob of {} bytes, expected {MR_BLOB_LEN}",
                b.len()
            )));
        }
        let mut r = Reader::new(b, "network region blob");
        let (magic, ver, flags) = (r.u32()?, r.u32()?, r.u32()?);
        let (base, len, key) = (r.u64()?, r.u64()?, r.u64()?);
        r.finish()?;
        if magic != MR_MAGIC || ver != VERSION {
            return Err(Error::remote(format!(
                "not a network region blob (magic {magic:#x}, version {ver})"
            )));
        }
        if flags & !FLAG_VIRT_ADDR != 0 {
            return Err(Error::remote(format!(
                "network region blob: unknown flags {flags:#x}"
            )));
        }
        let peer_virt = flags & FLAG_VIRT_ADDR != 0;
        if peer_virt != virt_addr {
            return Err(Error::remote(format!(
                "network region blob addresses by {} but this endpoint by {}: the two ranks use different providers or settings",
                if peer_virt { "virtual address" } else { "offset" },
                if virt_addr { "virtual address" } else { "offset" }
            )));
        }
        if len == 0 {
            return Err(Error::remote("network region blob: empty region"));
        }
        if base.checked_add(len).is_none() {
            return Err(Error::remote(format!(
                "network region blob: region {base:#x}+{len} wraps the address space"
            )));
        }
        if !virt_addr && base != 0 {
            return Err(Error::remote(format!(
                "network region blob: offset-mode region with base {base:#x}"
            )));
        }
        if virt_addr && base == 0 {
            return Err(Error::remote("network region blob: virtual address 0"));
        }
        if key_size > 0 && key_size < 8 && key >> (8 * key_size) != 0 {
            return Err(Error::remote(format!(
                "network region blob: key {key:#x} wider than the provider's {key_size}-byte keys"
            )));
        }
        Ok(MrBlob {
            virt_addr: peer_virt,
            base,
            len,
            key,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn mr_roundtrip_and_rejections() {
        let m = MrBlob {
            virt_addr: true,
            base: 0x7000_0000,
            len: 4096,
            key: 42,
        };
        let b = m.encode();
        assert_eq!(b.len(), MR_BLOB_LEN);
        assert_eq!(MrBlob::decode(&b, true, 8).unwrap(), m);
        // Wrong mode, truncated, oversized, bad magic, key too wide.
        assert!(MrBlob::decode(&b, false, 8).is_err());
        assert!(MrBlob::decode(&b[..20], true, 8).is_err());
        let mut big = b.clone();
        big.extend_from_slice(&[0; 100]);
        assert!(MrBlob::decode(&big, true, 8).is_err());
        let mut bad = b.clone();
        bad[0] ^= 1;
        assert!(MrBlob::decode(&bad, true, 8).is_err());
        let wide = MrBlob { key: 1 << 40, ..m }.encode();
        assert!(MrBlob::decode(&wide, true, 4).is_err());
        let wrap = MrBlob {
            base: u64::MAX - 10,
            ..m
        }
        .encode();
        assert!(MrBlob::decode(&wrap, true, 8).is_err());
        let off = MrBlob {
            virt_addr: false,
            base: 5,
            ..m
        }
        .encode();
        assert!(MrBlob::decode(&off, false, 8).is_err());
        let empty = MrBlob { len: 0, ..m }.encode();
        assert!(MrBlob::decode(&empty, true, 8).is_err());
    }

    #[test]
    fn addr_roundtrip() {
        let a = AddrBlob {
            provider: "tcp;ofi_rxm".into(),
            addr_format: 2,
            raw: vec![2, 0, 1, 2, 127, 0, 0, 1],
            scratch: MrBlob {
                virt_addr: false,
                base: 0,
                len: 8,
                key: 9,
            },
        };
        assert_eq!(AddrBlob::decode(&a.encode(), false, 8).unwrap(), a);
        assert!(
            AddrBlob::decode(&a.encode(), true, 8).is_err(),
            "addressing mode"
        );
        let empty = AddrBlob {
            raw: vec![],
            ..a.clone()
        };
        assert!(AddrBlob::decode(&empty.encode(), false, 8).is_err());
        let wide = AddrBlob {
            scratch: MrBlob {
                len: 16,
                ..a.scratch
            },
            ..a.clone()
        };
        assert!(AddrBlob::decode(&wide.encode(), false, 8).is_err());
        assert!(AddrBlob::decode(b"garbage!", false, 8).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_blobs_never_panic(data in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = MrBlob::decode(&data, true, 8);
            let _ = MrBlob::decode(&data, false, 4);
            let _ = AddrBlob::decode(&data, false, 8);
        }
    }
}
