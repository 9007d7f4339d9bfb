//! The bootstrap wire format, public so that protocol tests and tools can speak it.
//!
//! Every message is one frame: a fixed 32-byte header followed by `len` payload bytes.
//!
//! | bytes  | field   | meaning                                                        |
//! |--------|---------|----------------------------------------------------------------|
//! | 0..8   | magic   | u64 LE, identifies the communicator (unique id or address)     |
//! | 8..12  | kind    | u32 LE, a [`Kind`]                                             |
//! | 12..16 | sender  | u32 LE, rank of the sender                                     |
//! | 16..24 | tag     | u64 LE, message tag (P2P: the caller's; collectives: sequence) |
//! | 24..32 | len     | u64 LE, payload bytes, at most [`MAX_PAYLOAD`]                 |
//!
//! The decoder is pure (byte slices in, headers and frames out) so that it can be fed arbitrary
//! bytes in tests; it never allocates more than the length it has validated.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 32;
/// Largest payload a frame may carry (and so the most one frame can make a receiver allocate).
pub const MAX_PAYLOAD: usize = 64 << 20;
/// Bytes of an encoded socket address (see [`encode_addr`]).
pub const ADDR_LEN: usize = 24;
/// Payload bytes of a [`Kind::Hello`]: nranks (u64 LE) then the sender's listen address.
pub const HELLO_LEN: usize = 8 + ADDR_LEN;
/// Longest reason text an [`Kind::Abort`] frame may carry.
pub const MAX_ABORT_LEN: usize = 4096;
/// Largest payload of a [`Kind::Report`] (one rank's hang report: its connections' signal
/// counts and its pending waits).
pub const MAX_REPORT_LEN: usize = 1 << 20;
/// Most ranks a communicator may have: the root's address table must fit in one frame.
pub const MAX_RANKS: usize = MAX_PAYLOAD / ADDR_LEN;

/// What a frame is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Kind {
    /// Rank -> root: "I am rank `sender`", payload nranks + listen address.
    Hello = 1,
    /// Root -> rank: the listen addresses of all ranks, `nranks * ADDR_LEN` bytes.
    Table = 2,
    /// Either way: the sender gives up (or the root rejects a connection); payload is UTF-8 why.
    Abort = 3,
    /// First frame on a rank-to-rank connection, authenticating the sender; no payload.
    Open = 4,
    /// A tagged point-to-point message.
    P2p = 5,
    /// One step of a collective (all-gather, barrier); tag = sequence << 32 | step.
    Coll = 6,
    /// Rank -> rank, no payload: "watch this connection": the sender keeps it open for the
    /// communicator's lifetime, so the receiver learns of the sender's death by its closing.
    Watch = 7,
    /// Rank -> rank, no payload, the last frame on a connection: the sender is closing it on
    /// purpose (communicator destroyed), so its closing is not a loss.
    Bye = 8,
    /// Rank -> rank, no payload, on the sender's connection to the receiver: "send me your hang
    /// report"; tag = the request's number. The receiver's mailbox thread answers it itself.
    ReportAsk = 9,
    /// The answer to a `ReportAsk`, on the connection the question came on (the only frame that
    /// travels against a connection's direction); tag = the request's number, payload the
    /// report (at most [`MAX_REPORT_LEN`] bytes; empty: the rank has no report to give).
    Report = 10,
}

impl Kind {
    pub fn from_u32(v: u32) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Table,
            3 => Kind::Abort,
            4 => Kind::Open,
            5 => Kind::P2p,
            6 => Kind::Coll,
            7 => Kind::Watch,
            8 => Kind::Bye,
            9 => Kind::ReportAsk,
            10 => Kind::Report,
            _ => return None,
        })
    }

    /// The inclusive range of payload lengths a frame of this kind may declare.
    fn len_range(self, nranks: usize) -> (usize, usize) {
        match self {
            Kind::Hello => (HELLO_LEN, HELLO_LEN),
            Kind::Table => {
                let n = nranks.saturating_mul(ADDR_LEN).min(MAX_PAYLOAD);
                (n, n)
            }
            Kind::Abort => (0, MAX_ABORT_LEN),
            Kind::Open | Kind::Watch | Kind::Bye | Kind::ReportAsk => (0, 0),
            Kind::Report => (0, MAX_REPORT_LEN),
            Kind::P2p | Kind::Coll => (0, MAX_PAYLOAD),
        }
    }
}

/// A validated header: `len` is within the limits of its kind, so at most [`MAX_PAYLOAD`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub magic: u64,
    pub kind: Kind,
    pub sender: u32,
    pub tag: u64,
    pub len: usize,
}

/// What a receiver accepts on one connection.
#[derive(Clone, Copy, Debug)]
pub struct Expect<'a> {
    pub magic: u64,
    pub nranks: usize,
    /// The rank this connection belongs to, once known.
    pub from: Option<usize>,
    pub kinds: &'a [Kind],
}

/// Why bytes were not a frame this receiver accepts.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("header truncated ({have} of {HEADER_LEN} bytes)")]
    Truncated { have: usize },
    #[error("wrong magic {got:#018x} (another communicator, or not a bootstrap peer)")]
    WrongMagic { got: u64 },
    #[error("unknown frame kind {0}")]
    UnknownKind(u32),
    #[error("unexpected {0:?} frame here")]
    UnexpectedKind(Kind),
    #[error("sender rank {sender} is out of range (nranks {nranks})")]
    SenderOutOfRange { sender: u32, nranks: usize },
    #[error("frame claims sender rank {sender} on the connection of rank {expected}")]
    WrongSender { sender: u32, expected: usize },
    #[error("{kind:?} frame declares {len} payload bytes (allowed {min}..={max})")]
    BadLength {
        kind: Kind,
        len: u64,
        min: usize,
        max: usize,
    },
}

impl FrameError {
    /// True when the sender knew the communicator's magic, i.e. it is a confused member rather
    /// than a stranger; only those are told why they were rejected.
    pub fn knows_magic(&self) -> bool {
        !matches!(
            self,
            FrameError::Truncated { .. } | FrameError::WrongMagic { .. }
        )
    }
}

/// Encodes header fields as given, unchecked (tests use it to build malformed frames).
pub fn encode_raw(magic: u64, kind: u32, sender: u32, tag: u64, len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..8].copy_from_slice(&magic.to_le_bytes());
    h[8..12].copy_from_slice(&kind.to_le_bytes());
    h[12..16].copy_from_slice(&sender.to_le_bytes());
    h[16..24].copy_from_slice(&tag.to_le_bytes());
    h[24..32].copy_from_slice(&len.to_le_bytes());
    h
}

pub fn encode_header(h: &Header) -> [u8; HEADER_LEN] {
    encode_raw(h.magic, h.kind as u32, h.sender, h.tag, h.len as u64)
}

/// Header followed by payload, in one buffer (one write for small frames).
pub fn encode_frame(magic: u64, kind: Kind, sender: u32, tag: u64, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER_LEN + payload.len());
    v.extend_from_slice(&encode_raw(
        magic,
        kind as u32,
        sender,
        tag,
        payload.len() as u64,
    ));
    v.extend_from_slice(payload);
    v
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

/// Decodes and validates the first [`HEADER_LEN`] bytes of `bytes`. On success `len` is within
/// the limits of the kind: this is the length a receiver will allocate.
pub fn decode_header(bytes: &[u8], expect: &Expect<'_>) -> Result<Header, FrameError> {
    if bytes.len() < HEADER_LEN {
        return Err(FrameError::Truncated { have: bytes.len() });
    }
    let magic = le_u64(&bytes[0..8]);
    if magic != expect.magic {
        return Err(FrameError::WrongMagic { got: magic });
    }
    let raw_kind = le_u32(&bytes[8..12]);
    let kind = Kind::from_u32(raw_kind).ok_or(FrameError::UnknownKind(raw_kind))?;
    if !expect.kinds.contains(&kind) {
        return Err(FrameError::UnexpectedKind(kind));
    }
    let sender = le_u32(&bytes[12..16]);
    if sender as usize >= expect.nranks {
        return Err(FrameError::SenderOutOfRange {
            sender,
            nranks: expect.nranks,
        });
    }
    if let Some(from) = expect.from {
        if sender as usize != from {
            return Err(FrameError::WrongSender {
                sender,
                expected: from,
            });
        }
    }
    let tag = le_u64(&bytes[16..24]);
    let len = le_u64(&bytes[24..32]);
    let (min, max) = kind.len_range(expect.nranks);
    if len < min as u64 || len > max as u64 {
        return Err(FrameError::BadLength {
            kind,
            len,
            min,
            max,
        });
    }
    Ok(Header {
        magic,
        kind,
        sender,
        tag,
        len: len as usize,
    })
}

/// Reassembles frames from a byte stream that arrives in arbitrary pieces.
#[derive(Debug)]
pub struct Assembler {
    head: [u8; HEADER_LEN],
    have: usize,
    cur: Option<Header>,
    payload: Vec<u8>,
}

impl Default for Assembler {
    fn default() -> Self {
        Self::new()
    }
}

impl Assembler {
    pub fn new() -> Self {
        Assembler {
            head: [0; HEADER_LEN],
            have: 0,
            cur: None,
            payload: Vec::new(),
        }
    }

    /// True between frames (an EOF here is clean; anywhere else it truncates a frame).
    pub fn is_idle(&self) -> bool {
        self.have == 0 && self.cur.is_none()
    }

    /// Bytes currently reserved for the payload being assembled (never above [`MAX_PAYLOAD`]).
    pub fn reserved(&self) -> usize {
        self.payload.capacity()
    }

    /// Consumes a prefix of `input` (never past the end of the current frame). Returns how many
    /// bytes it took and the frame, if that prefix completed one. After an error the assembler
    /// is unusable: drop the connection.
    #[allow(clippy::type_complexity)]
    pub fn feed(
        &mut self,
        input: &[u8],
        expect: &Expect<'_>,
    ) -> Result<(usize, Option<(Header, Vec<u8>)>), FrameError> {
        let mut used = 0;
        let h = match self.cur {
            Some(h) => h,
            None => {
                let take = (HEADER_LEN - self.have).min(input.len());
                self.head[self.have..self.have + take].copy_from_slice(&input[..take]);
                self.have += take;
                used = take;
                if self.have < HEADER_LEN {
                    return Ok((used, None));
                }
                let h = decode_header(&self.head, expect)?;
                // Exactly the validated length, so a lying header costs at most MAX_PAYLOAD of
                // address space (and pages are only touched as bytes really arrive).
                self.payload = Vec::with_capacity(h.len);
                self.cur = Some(h);
                h
            }
        };
        let take = (h.len - self.payload.len()).min(input.len() - used);
        self.payload.extend_from_slice(&input[used..used + take]);
        used += take;
        if self.payload.len() < h.len {
            return Ok((used, None));
        }
        self.have = 0;
        self.cur = None;
        Ok((used, Some((h, std::mem::take(&mut self.payload)))))
    }
}

/// Decodes every complete frame in `bytes`; returns them and the bytes left over (a partial
/// frame), or the first error.
#[allow(clippy::type_complexity)]
pub fn decode_all(
    bytes: &[u8],
    expect: &Expect<'_>,
) -> Result<(Vec<(Header, Vec<u8>)>, usize), FrameError> {
    let mut asm = Assembler::new();
    let mut frames = Vec::new();
    let mut at = 0;
    // Ends: every round consumes at least one byte or returns (feed takes >= 1 byte of
    // non-empty input unless the frame completed, and completed frames are pushed).
    while at < bytes.len() {
        let (n, f) = asm.feed(&bytes[at..], expect)?;
        at += n;
        match f {
            Some(f) => frames.push(f),
            None if n == 0 => break,
            None => {}
        }
    }
    let partial = if asm.is_idle() {
        0
    } else {
        asm.have + asm.payload.len()
    };
    Ok((frames, partial))
}

/// Encodes a socket address in [`ADDR_LEN`] bytes: family (4 or 6), pad, port u16 LE,
/// 16 address bytes (IPv4 in the first 4, the rest zero), IPv6 scope id u32 LE.
pub fn encode_addr(a: &SocketAddr) -> [u8; ADDR_LEN] {
    let mut b = [0u8; ADDR_LEN];
    b[2..4].copy_from_slice(&a.port().to_le_bytes());
    match a {
        SocketAddr::V4(v4) => {
            b[0] = 4;
            b[4..8].copy_from_slice(&v4.ip().octets());
        }
        SocketAddr::V6(v6) => {
            b[0] = 6;
            b[4..20].copy_from_slice(&v6.ip().octets());
            b[20..24].copy_from_slice(&v6.scope_id().to_le_bytes());
        }
    }
    b
}

/// Inverse of [`encode_addr`]; rejects unknown families, port 0 and stray bytes.
pub fn decode_addr(b: &[u8]) -> Result<SocketAddr, String> {
    if b.len() != ADDR_LEN {
        return Err(format!("address is {} bytes, expected {ADDR_LEN}", b.len()));
    }
    let port = u16::from_le_bytes([b[2], b[3]]);
    if port == 0 {
        return Err("address has port 0".into());
    }
    if b[1] != 0 {
        return Err("address has a non-zero pad byte".into());
    }
    match b[0] {
        4 => {
            if b[8..].iter().any(|&x| x != 0) {
                return Err("IPv4 address has stray bytes".into());
            }
            let ip = Ipv4Addr::new(b[4], b[5], b[6], b[7]);
            Ok(SocketAddr::new(IpAddr::V4(ip), port))
        }
        6 => {
            let mut o = [0u8; 16];
            o.copy_from_slice(&b[4..20]);
            let scope = le_u32(&b[20..24]);
            Ok(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(o),
                port,
                0,
                scope,
            )))
        }
        f => Err(format!("unknown address family byte {f}")),
    }
}

/// The magic of a communicator created from an `ip:port` string: every rank derives the same
/// value from the same string and rank count (FNV-1a 64 over a versioned prefix).
pub fn addr_magic(ip_port: &str, nranks: usize) -> u64 {
    addr_magic_with(ip_port, nranks, None)
}

/// As [`addr_magic`], with a shared secret mixed in (`MSCCLPP_BOOTSTRAP_SECRET`): ranks that do
/// not know it compute another magic, and every frame they send is refused.
pub fn addr_magic_with(ip_port: &str, nranks: usize, secret: Option<&str>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(b"mscclpp-bootstrap-addr/v1\0");
    eat(ip_port.as_bytes());
    eat(b"\0");
    eat(&(nranks as u64).to_le_bytes());
    if let Some(s) = secret {
        eat(b"\0secret\0");
        eat(s.as_bytes());
    }
    // 0 is never a valid magic, so a zeroed header cannot match.
    h.max(1)
}

#[cfg(test)]
mod tests;
