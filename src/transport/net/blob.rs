//! The blobs the net transport hands to peers: its address; once a peer is added, the link this
//! endpoint keeps for that peer (its staging channel, `staging/`, and its counting stream,
//! `counted.rs`); and one per registered region. Each starts with a magic and a version and is
//! parsed with `crate::wire::Reader`, so a blob from another transport, another version or a
//! corrupted one is refused with a message.

use crate::error::{Error, Result};
use crate::wire::{Reader, Writer};

const ADDR_MAGIC: u32 = 0x4d53_4e41; // "MSNA"
const MR_MAGIC: u32 = 0x4d53_4e4d; // "MSNM"
const CHAN_MAGIC: u32 = 0x4d53_4e43; // "MSNC"
const LINK_MAGIC: u32 = 0x4d53_4e4c; // "MSNL"
/// 2: region blobs carry a mode and an id; addresses may carry a staging channel. 3: and a
/// stream. 4: the channel and the stream moved from the address to the link, which an
/// endpoint makes per peer (a peer endpoint, not a peer rank) once it has added it.
const VERSION: u32 = 4;
/// Region blob: magic, version, flags, id (u32 each), base, len, key (u64 each).
pub(super) const MR_BLOB_LEN: usize = 4 * 4 + 3 * 8;
const FLAG_VIRT_ADDR: u32 = 1;
/// Mode flags (at most one): see [`Mode`].
const FLAG_RELAY_VALUES: u32 = 2;
const FLAG_STAGED: u32 = 4;
/// The owner stores values that name this region in remote CQ data (`signals.rs`).
const FLAG_CQ_VALUES: u32 = 8;
const KNOWN_FLAGS: u32 = FLAG_VIRT_ADDR | FLAG_RELAY_VALUES | FLAG_STAGED | FLAG_CQ_VALUES;
/// Bounds on a peer's staging channel (sanity, not policy: the owner chose the sizes).
const MAX_INBOX_SLOTS: u64 = 1 << 16;
const MIN_RING: u64 = 4096;
const RAILS_MAGIC: u32 = 0x4d53_4e52; // "MSNR"
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
        if scratch.len != 8 || scratch.mode != Mode::Direct {
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

/// What one endpoint keeps for one peer endpoint and the peer must know to write to it, handed
/// over once each has added the other (connection setup's acknowledgement): the staging
/// channel (`staging/`) and the stream number that peer's writes name in their counted tags
/// (`counted.rs`). Keyed by the peer's endpoint, not its rank: two endpoints of one rank
/// writing to us each have their own (issue 40, finding 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct LinkBlob {
    pub chan: Option<ChanBlob>,
    pub stream: Option<u8>,
}

impl LinkBlob {
    pub fn encode(&self) -> Vec<u8> {
        Writer::new()
            .u32(LINK_MAGIC)
            .u32(VERSION)
            .bytes(&self.chan.as_ref().map_or_else(Vec::new, ChanBlob::encode))
            .bytes(self.stream.as_slice())
            .finish()
    }

    /// Parses a peer's link; an empty one (a peer that keeps nothing for us) is none of
    /// either. Its channel regions are checked like any region blob.
    pub fn decode(b: &[u8], virt_addr: bool, key_size: usize) -> Result<Self> {
        if b.is_empty() {
            return Ok(LinkBlob {
                chan: None,
                stream: None,
            });
        }
        let mut r = Reader::new(b, "network endpoint link");
        let (magic, ver) = (r.u32()?, r.u32()?);
        if magic != LINK_MAGIC || ver != VERSION {
            return Err(Error::remote(format!(
                "not a network endpoint link (magic {magic:#x}, version {ver})"
            )));
        }
        let chan = match r.bytes()? {
            [] => None,
            b => Some(ChanBlob::decode(b, virt_addr, key_size)?),
        };
        let stream = match r.bytes()? {
            [] => None,
            [s] => Some(*s),
            b => {
                return Err(Error::remote(format!(
                    "network endpoint link: a stream number of {} bytes",
                    b.len()
                )))
            }
        };
        r.finish()?;
        Ok(LinkBlob { chan, stream })
    }
}

/// What the peer's side of a region expects from writers (the region's owner decides).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// Host memory (or FI_HMEM device memory, see `RelayValues`): data and values are RMA
    /// writes to `base`/`key`.
    Direct,
    /// FI_HMEM device memory: data is written directly, values go through the owner's
    /// staging channel, which flushes GPUDirect writes before storing them (module doc of
    /// `staging/mod.rs`).
    RelayValues,
    /// Device memory without FI_HMEM (or any region under `MSCCLPP_TEST_FORCE_STAGING=1`):
    /// data and values go through the owner's staging channel; `base`/`key` are unused (0).
    Staged,
}

/// The staging channel one endpoint keeps for one peer endpoint: the 8-byte `credit` word where
/// the peer reports how many of our records it has applied, and, on endpoints that stage
/// (GPU memory without FI_HMEM, or the test switch), the `inbox` of records and the data
/// `ring` the peer writes into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ChanBlob {
    pub credit: MrBlob,
    pub incoming: Option<(MrBlob, MrBlob)>,
}

impl ChanBlob {
    pub fn encode(&self) -> Vec<u8> {
        let w = Writer::new().u32(CHAN_MAGIC).bytes(&self.credit.encode());
        match &self.incoming {
            None => w.u32(0),
            Some((inbox, ring)) => w.u32(1).bytes(&inbox.encode()).bytes(&ring.encode()),
        }
        .finish()
    }

    pub fn decode(b: &[u8], virt_addr: bool, key_size: usize) -> Result<Self> {
        let mut r = Reader::new(b, "network staging channel");
        if r.u32()? != CHAN_MAGIC {
            return Err(Error::remote("not a network staging channel"));
        }
        let credit = MrBlob::decode(r.bytes()?, virt_addr, key_size)?;
        let incoming = match r.u32()? {
            0 => None,
            1 => Some((
                MrBlob::decode(r.bytes()?, virt_addr, key_size)?,
                MrBlob::decode(r.bytes()?, virt_addr, key_size)?,
            )),
            x => {
                return Err(Error::remote(format!(
                    "network staging channel: unknown layout {x}"
                )))
            }
        };
        r.finish()?;
        let direct = |m: &MrBlob| m.mode == Mode::Direct;
        if credit.len != 8 || !direct(&credit) {
            return Err(Error::remote(format!(
                "network staging channel: credit word of {} bytes",
                credit.len
            )));
        }
        if let Some((inbox, ring)) = &incoming {
            let slots = inbox.len / super::record::RECORD_BYTES as u64;
            if !direct(inbox)
                || !direct(ring)
                || inbox.len % super::record::RECORD_BYTES as u64 != 0
                || !(1..=MAX_INBOX_SLOTS).contains(&slots)
                || ring.len < MIN_RING
            {
                return Err(Error::remote(format!(
                    "network staging channel: inbox of {} bytes, ring of {} bytes",
                    inbox.len, ring.len
                )));
            }
        }
        Ok(ChanBlob { credit, incoming })
    }
}

/// A registered region as a peer sees it: the remote address of byte 0 (`base`: the virtual
/// address under FI_MR_VIRT_ADDR, else 0 = offset mode), its length and key; how writers must
/// reach it (`mode`) and its index in the owner's region table (`id`, which staging records
/// name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct MrBlob {
    pub virt_addr: bool,
    pub base: u64,
    pub len: u64,
    pub key: u64,
    pub mode: Mode,
    pub id: u32,
    /// Values into it may ride as remote CQ data (`signals.rs`): the owner reads them from its
    /// completion queue and stores them itself. Only on `Mode::Direct` regions.
    pub cq_values: bool,
}

impl MrBlob {
    /// A plainly registered region (internal ones and host memory).
    pub fn direct(virt_addr: bool, base: u64, len: u64, key: u64) -> Self {
        MrBlob {
            virt_addr,
            base,
            len,
            key,
            mode: Mode::Direct,
            id: 0,
            cq_values: false,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mode = match self.mode {
            Mode::Direct => 0,
            Mode::RelayValues => FLAG_RELAY_VALUES,
            Mode::Staged => FLAG_STAGED,
        };
        Writer::new()
            .u32(MR_MAGIC)
            .u32(VERSION)
            .u32(
                if self.virt_addr { FLAG_VIRT_ADDR } else { 0 }
                    | mode
                    | if self.cq_values { FLAG_CQ_VALUES } else { 0 },
            )
            .u32(self.id)
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
        let (magic, ver, flags, id) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        let (base, len, key) = (r.u64()?, r.u64()?, r.u64()?);
        r.finish()?;
        if magic != MR_MAGIC || ver != VERSION {
            return Err(Error::remote(format!(
                "not a network region blob (magic {magic:#x}, version {ver})"
            )));
        }
        if flags & !KNOWN_FLAGS != 0 {
            return Err(Error::remote(format!(
                "network region blob: unknown flags {flags:#x}"
            )));
        }
        let mode = match flags & (FLAG_RELAY_VALUES | FLAG_STAGED) {
            0 => Mode::Direct,
            FLAG_RELAY_VALUES => Mode::RelayValues,
            FLAG_STAGED => Mode::Staged,
            _ => {
                return Err(Error::remote(format!(
                    "network region blob: conflicting mode flags {flags:#x}"
                )))
            }
        };
        let peer_virt = flags & FLAG_VIRT_ADDR != 0;
        let cq_values = flags & FLAG_CQ_VALUES != 0;
        if cq_values && mode != Mode::Direct {
            return Err(Error::remote(format!(
                "network region blob: CQ-data values into a region of mode {mode:?}"
            )));
        }
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
        if mode == Mode::Staged {
            // Nothing is written to it directly: only its length and id matter.
            if base != 0 || key != 0 {
                return Err(Error::remote(
                    "network region blob: a staged region with an address or key",
                ));
            }
            return Ok(MrBlob {
                virt_addr: peer_virt,
                base,
                len,
                key,
                mode,
                id,
                cq_values,
            });
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
            mode,
            id,
            cq_values,
        })
    }
}

/// The blobs of an endpoint striped over several rails (`rails.rs`: one endpoint per NIC),
/// rail 0 first: its address, or a region as registered on each rail. A plain blob reads as
/// one rail, and an endpoint of one rail reads rail 0 of a list, so ranks with different rail
/// counts still talk (over the rails both have).
pub(super) fn encode_rails(parts: &[Vec<u8>]) -> Vec<u8> {
    parts
        .iter()
        .fold(
            Writer::new()
                .u32(RAILS_MAGIC)
                .u32(VERSION)
                .u32(parts.len() as u32),
            |w, p| w.bytes(p),
        )
        .finish()
}

/// The rails of a blob (see `encode_rails`): one for a plain blob, each checked by its own
/// decoder later.
pub(super) fn decode_rails(b: &[u8]) -> Result<Vec<&[u8]>> {
    if b.len() < 4 || b[..4] != RAILS_MAGIC.to_le_bytes() {
        return Ok(vec![b]);
    }
    let mut r = Reader::new(b, "list of rails");
    let (_, ver, n) = (r.u32()?, r.u32()?, r.u32()?);
    if ver != VERSION {
        return Err(Error::remote(format!(
            "list of rails of version {ver}, expected {VERSION}"
        )));
    }
    if n == 0 || n as usize > crate::config::MAX_RAILS {
        return Err(Error::remote(format!(
            "list of {n} rails (1..={} expected)",
            crate::config::MAX_RAILS
        )));
    }
    let parts = (0..n).map(|_| r.bytes()).collect::<Result<Vec<_>>>()?;
    r.finish()?;
    Ok(parts)
}

/// Rail 0 of a blob (the blob itself unless it lists rails).
pub(super) fn first_rail(b: &[u8]) -> Result<&[u8]> {
    Ok(decode_rails(b)?[0])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rails_roundtrip_and_rejections() {
        let parts = vec![b"abc".to_vec(), Vec::new(), vec![7; 40]];
        let b = encode_rails(&parts);
        let got: Vec<Vec<u8>> = decode_rails(&b)
            .unwrap()
            .into_iter()
            .map(<[u8]>::to_vec)
            .collect();
        assert_eq!(got, parts);
        assert_eq!(first_rail(&b).unwrap(), b"abc");
        // A plain blob is one rail.
        let m = MrBlob::direct(true, 4096, 8, 1).encode();
        assert_eq!(decode_rails(&m).unwrap(), vec![&m[..]]);
        // Truncated, trailing bytes, zero or too many rails, another version.
        assert!(decode_rails(&b[..b.len() - 1]).is_err());
        assert!(decode_rails(&[b.clone(), vec![0]].concat()).is_err());
        assert!(decode_rails(&encode_rails(&[])).is_err());
        assert!(decode_rails(&encode_rails(&vec![Vec::new(); 17])).is_err());
        let mut v = b.clone();
        v[4] ^= 1;
        assert!(decode_rails(&v).is_err());
    }

    #[test]
    fn mr_roundtrip_and_rejections() {
        let m = MrBlob::direct(true, 0x7000_0000, 4096, 42);
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
        // Modes: round trip; a staged region has no address or key.
        for mode in [Mode::RelayValues, Mode::Staged] {
            let x = MrBlob {
                mode,
                id: 77,
                base: if mode == Mode::Staged { 0 } else { m.base },
                key: if mode == Mode::Staged { 0 } else { m.key },
                ..m
            };
            assert_eq!(MrBlob::decode(&x.encode(), true, 8).unwrap(), x);
        }
        let bad = MrBlob {
            mode: Mode::Staged,
            ..m
        };
        assert!(MrBlob::decode(&bad.encode(), true, 8).is_err());
        let mut both = m.encode();
        both[8] |= (FLAG_RELAY_VALUES | FLAG_STAGED) as u8;
        assert!(MrBlob::decode(&both, true, 8).is_err());
    }

    #[test]
    fn chan_roundtrip_and_rejections() {
        let credit = MrBlob::direct(false, 0, 8, 3);
        let inbox = MrBlob::direct(false, 0, 64 * 256, 4);
        let ring = MrBlob::direct(false, 0, 1 << 20, 5);
        for c in [
            ChanBlob {
                credit,
                incoming: None,
            },
            ChanBlob {
                credit,
                incoming: Some((inbox, ring)),
            },
        ] {
            assert_eq!(ChanBlob::decode(&c.encode(), false, 8).unwrap(), c);
        }
        let bad_inbox = ChanBlob {
            credit,
            incoming: Some((MrBlob { len: 100, ..inbox }, ring)),
        };
        assert!(ChanBlob::decode(&bad_inbox.encode(), false, 8).is_err());
        let small_ring = ChanBlob {
            credit,
            incoming: Some((inbox, MrBlob { len: 64, ..ring })),
        };
        assert!(ChanBlob::decode(&small_ring.encode(), false, 8).is_err());
        let wide_credit = ChanBlob {
            credit: MrBlob { len: 16, ..credit },
            incoming: None,
        };
        assert!(ChanBlob::decode(&wide_credit.encode(), false, 8).is_err());
    }

    #[test]
    fn addr_roundtrip() {
        let a = AddrBlob {
            provider: "tcp;ofi_rxm".into(),
            addr_format: 2,
            raw: vec![2, 0, 1, 2, 127, 0, 0, 1],
            scratch: MrBlob::direct(false, 0, 8, 9),
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

    #[test]
    fn link_roundtrip_and_rejections() {
        let none = LinkBlob {
            chan: None,
            stream: None,
        };
        assert_eq!(LinkBlob::decode(&[], false, 8).unwrap(), none);
        assert_eq!(LinkBlob::decode(&none.encode(), false, 8).unwrap(), none);
        let l = LinkBlob {
            chan: Some(ChanBlob {
                credit: MrBlob::direct(false, 0, 8, 10),
                incoming: None,
            }),
            stream: Some(255),
        };
        assert_eq!(LinkBlob::decode(&l.encode(), false, 8).unwrap(), l);
        assert!(
            LinkBlob::decode(&l.encode(), true, 8).is_err(),
            "addressing mode"
        );
        let mut two_byte_stream = l.encode();
        let n = two_byte_stream.len();
        two_byte_stream[n - 5] = 2;
        two_byte_stream.push(0);
        assert!(LinkBlob::decode(&two_byte_stream, false, 8).is_err());
        assert!(LinkBlob::decode(b"garbage!", false, 8).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_blobs_never_panic(data in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = MrBlob::decode(&data, true, 8);
            let _ = MrBlob::decode(&data, false, 4);
            let _ = AddrBlob::decode(&data, false, 8);
            let _ = ChanBlob::decode(&data, false, 8);
            let _ = LinkBlob::decode(&data, false, 8);
        }
    }
}
