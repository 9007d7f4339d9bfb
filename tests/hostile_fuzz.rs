//! Property tests, many cases each (20,000 by default; `PROPTEST_CASES` overrides), over every
//! decoder that reads bytes from a peer: the bootstrap frame decoder (headers, the stream
//! assembler, addresses), the connection-setup envelope (`comm::ConnBlob::decode`), the
//! `wire::Reader` it is built on, and the network transport's address and region blobs, the
//! latter through a real endpoint's `add_peer` / `import` (the code path a peer's bytes take).
//! Properties: no panic, no allocation beyond the validated limits, and whatever is accepted
//! is consistent (re-encodes to the same bytes, names the expected peer).
//!
//! The crate's own unit tests run a few hundred cases of some of these; this file runs the
//! many-case sweep and the decoders those do not cover (the envelope, the endpoint path).

use mscclpp::abi::mscclppTransport_t;
use mscclpp::bootstrap::frame::{self, Assembler, Expect, Kind};
use mscclpp::comm::ConnBlob;
use mscclpp::transport::{net, Endpoint, MemKind, Region};
use mscclpp::wire::{Reader, MAX_FIELD};
use proptest::prelude::*;
use proptest::test_runner::Config;
use std::sync::Mutex;

fn config() -> Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    Config {
        cases,
        // A failure shrinks a little, then reports: the sweep must stay bounded in time.
        max_shrink_iters: 2_000,
        // Failures print their inputs; no regression files in the source tree.
        failure_persistence: None,
        ..Config::default()
    }
}

const ALL: &[Kind] = &[
    Kind::Hello,
    Kind::Table,
    Kind::Abort,
    Kind::Open,
    Kind::P2p,
    Kind::Coll,
    Kind::Watch,
    Kind::Bye,
    Kind::ReportAsk,
    Kind::Report,
];

/// Byte-level mutations of a valid message: flips, a cut, an extension.
fn mutate(mut b: Vec<u8>, flips: &[(usize, u8)], cut: Option<usize>, extra: &[u8]) -> Vec<u8> {
    if !b.is_empty() {
        for &(at, x) in flips {
            let n = b.len();
            b[at % n] ^= x;
        }
    }
    if let Some(c) = cut {
        b.truncate(c.min(b.len()));
    }
    b.extend_from_slice(extra);
    b
}

fn feed_all(
    bytes: &[u8],
    chunks: &[usize],
    e: &Expect<'_>,
) -> Result<Vec<(frame::Header, Vec<u8>)>, ()> {
    let mut asm = Assembler::new();
    let mut out = Vec::new();
    let (mut at, mut ci) = (0, 0);
    // Ends: `at` grows each round (a chunk is >= 1 byte and `feed` always consumes).
    while at < bytes.len() {
        let end = (at + chunks.get(ci).copied().unwrap_or(11).max(1)).min(bytes.len());
        ci += 1;
        let mut piece = &bytes[at..end];
        while !piece.is_empty() {
            let (n, f) = asm.feed(piece, e).map_err(|_| ())?;
            assert!(asm.reserved() <= frame::MAX_PAYLOAD);
            if let Some(f) = f {
                out.push(f);
            } else {
                assert!(n > 0, "no progress");
            }
            piece = &piece[n..];
        }
        at = end;
    }
    Ok(out)
}

proptest! {
    #![proptest_config(config())]

    /// Arbitrary bytes at the frame decoder: never a panic; an accepted header's length is
    /// within its kind's limit; the assembler never reserves more than the validated length.
    #[test]
    fn frame_decoder_arbitrary_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..400),
        chunks in proptest::collection::vec(1usize..80, 0..16),
        nranks in 1usize..64,
        magic_prefix in any::<bool>(),
        from in proptest::option::of(0usize..64),
    ) {
        let magic = 0x5eed_u64;
        let mut bytes = bytes;
        if magic_prefix && bytes.len() >= 8 {
            bytes[..8].copy_from_slice(&magic.to_le_bytes());
        }
        let e = Expect { magic, nranks, from: from.filter(|&f| f < nranks), kinds: ALL };
        if let Ok(h) = frame::decode_header(&bytes, &e) {
            prop_assert!(h.len <= frame::MAX_PAYLOAD);
            prop_assert!((h.sender as usize) < nranks);
        }
        if let Ok(frames) = feed_all(&bytes, &chunks, &e) {
            for (h, p) in frames {
                prop_assert_eq!(h.len, p.len());
            }
        }
        let _ = frame::decode_all(&bytes, &e);
    }

    /// Valid frame streams, mutated: the decoder either refuses or yields frames whose
    /// payloads are exactly their declared lengths, in order.
    #[test]
    fn frame_decoder_mutated_streams(
        frames in proptest::collection::vec((1u32..9, 0u32..4, any::<u64>(), proptest::collection::vec(any::<u8>(), 0..120)), 1..4),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        cut in proptest::option::of(any::<usize>()),
        extra in proptest::collection::vec(any::<u8>(), 0..40),
        chunks in proptest::collection::vec(1usize..64, 0..16),
    ) {
        let e = Expect { magic: 77, nranks: 4, from: None, kinds: ALL };
        let mut stream = Vec::new();
        for (k, s, tag, p) in &frames {
            stream.extend_from_slice(&frame::encode_raw(77, *k, *s, *tag, p.len() as u64));
            stream.extend_from_slice(p);
        }
        let stream = mutate(stream, &flips, cut.map(|c| c % 600), &extra);
        if let Ok(got) = feed_all(&stream, &chunks, &e) {
            for (h, p) in &got {
                prop_assert_eq!(h.len, p.len());
                prop_assert!(ALL.contains(&h.kind));
            }
        }
        if let Ok((got, partial)) = frame::decode_all(&stream, &e) {
            let used: usize = got.iter().map(|(h, _)| frame::HEADER_LEN + h.len).sum();
            prop_assert_eq!(used + partial, stream.len());
        }
    }

    /// Socket addresses in a root's table: any 24 bytes decode to an address that re-encodes
    /// to the same bytes, or are refused.
    #[test]
    fn frame_addresses(b in proptest::array::uniform24(any::<u8>()), family in prop_oneof![Just(4u8), Just(6u8), any::<u8>()]) {
        let mut b = b;
        b[0] = family;
        if let Ok(a) = frame::decode_addr(&b) {
            prop_assert_eq!(frame::encode_addr(&a), b);
        }
    }

    /// The reader under every blob: any sequence of reads over any bytes ends in a value or
    /// an error, never reads past the end, never returns a field over MAX_FIELD.
    #[test]
    fn wire_reader_any_reads(
        bytes in proptest::collection::vec(any::<u8>(), 0..300),
        ops in proptest::collection::vec(0u8..3, 0..12),
        big_prefix in any::<bool>(),
    ) {
        let mut bytes = bytes;
        if big_prefix && bytes.len() >= 4 {
            bytes[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        }
        let mut r = Reader::new(&bytes, "fuzz");
        let mut used = 0usize;
        for op in ops {
            let step = match op {
                0 => r.u32().map(|_| 4),
                1 => r.u64().map(|_| 8),
                _ => r.bytes().map(|f| {
                    assert!(f.len() <= MAX_FIELD);
                    4 + f.len()
                }),
            };
            match step {
                Ok(n) => used += n,
                Err(_) => break,
            }
            prop_assert!(used <= bytes.len());
        }
    }

    /// The connection-setup envelope: arbitrary bytes, and valid envelopes mutated. Whatever
    /// is accepted names the expected rank, tag and transport, has a non-zero size, and is the
    /// canonical encoding of what was decoded.
    #[test]
    fn setup_envelope(
        rank in 0usize..8,
        tag in any::<i32>(),
        shm in any::<bool>(),
        size in 1u64..,
        addr in proptest::collection::vec(any::<u8>(), 0..64),
        data in proptest::collection::vec(any::<u8>(), 0..64),
        epoch in proptest::collection::vec(any::<u8>(), 0..64),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        cut in proptest::option::of(any::<usize>()),
        extra in proptest::collection::vec(any::<u8>(), 0..8),
        raw in proptest::collection::vec(any::<u8>(), 0..120),
    ) {
        let tr = if shm { mscclppTransport_t::mscclppTransportSHM } else { mscclppTransport_t::mscclppTransportIB };
        let valid = ConnBlob { transport: tr as u32, tag, rank, size, addr: &addr, data: &data, epoch: &epoch, epoch_shm: &[] }.encode();
        let round = ConnBlob::decode(&valid, rank, tag, tr, shm).unwrap();
        prop_assert_eq!(round.encode(), valid.clone());
        let m = mutate(valid, &flips, cut.map(|c| c % 300), &extra);
        for msg in [&m, &raw] {
            if let Ok(b) = ConnBlob::decode(msg, rank, tag, tr, shm) {
                prop_assert_eq!((b.rank, b.tag, b.transport), (rank, tag, tr as u32));
                prop_assert!(b.size > 0);
                prop_assert!(b.addr.len() <= MAX_FIELD && b.data.len() <= MAX_FIELD && b.epoch.len() <= MAX_FIELD);
                prop_assert_eq!(&b.encode(), msg);
                prop_assert!(b.epoch_shm.is_empty() || shm, "an IB blob offering a shared epoch was accepted");
            }
        }
    }
}

/// One endpoint per provider and its valid blobs, shared by the cases of a sweep (opening an
/// endpoint per case would dominate the time). Accepted mutated blobs only add entries.
struct Sweep {
    ep: Box<dyn Endpoint>,
    addr: Vec<u8>,
    region: Vec<u8>,
    /// The link `other` made for `ep` (its staging channel; `Endpoint::link_for`).
    link: Vec<u8>,
    peer: usize,
    next_rank: usize,
    accepted: (usize, usize, usize),
    _mem: Vec<u64>,
    _other: Box<dyn Endpoint>,
}

fn sweep(shm: bool) -> Sweep {
    let mut ep = if shm {
        net::open(None, true, None)
    } else {
        net::open(Some("lo"), false, None)
    }
    .unwrap();
    let mut other = if shm {
        net::open(None, true, None)
    } else {
        net::open(Some("lo"), false, None)
    }
    .unwrap();
    let mem = vec![0u64; 512];
    let (_, region) = other
        .register(Region {
            addr: mem.as_ptr() as u64,
            len: 4096,
            kind: MemKind::Host,
        })
        .unwrap();
    let addr = other.address().unwrap();
    let peer = ep.add_peer(1, &addr).unwrap();
    let to_ep = other.add_peer(0, &ep.address().unwrap()).unwrap();
    let link = other.link_for(to_ep).unwrap();
    Sweep {
        ep,
        addr,
        region,
        link,
        peer,
        next_rank: 2,
        accepted: (0, 0, 0),
        _mem: mem,
        _other: other,
    }
}

static TCP: Mutex<Option<Sweep>> = Mutex::new(None);
static SHM: Mutex<Option<Sweep>> = Mutex::new(None);

fn with_sweep<T>(shm: bool, f: impl FnOnce(&mut Sweep) -> T) -> T {
    let cell = if shm { &SHM } else { &TCP };
    let mut g = cell.lock().unwrap_or_else(|e| e.into_inner());
    f(g.get_or_insert_with(|| sweep(shm)))
}

fn net_blobs(shm: bool) {
    let mut runner = proptest::test_runner::TestRunner::new(config());
    let strat = (
        proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        proptest::option::of(any::<usize>()),
        proptest::collection::vec(any::<u8>(), 0..8),
        proptest::collection::vec(any::<u8>(), 0..120),
        0u8..3,
    );
    runner
        .run(&strat, |(flips, cut, extra, raw, which)| {
            with_sweep(shm, |s| {
                if which == 2 {
                    // Links: decoded before the peer's first link is taken or compared.
                    let m = mutate(s.link.clone(), &flips, cut.map(|c| c % 200), &extra);
                    for b in [&m, &raw] {
                        if s.ep.link_to(s.peer, b).is_ok() {
                            s.accepted.2 += 1;
                        }
                    }
                } else if which == 1 {
                    let m = mutate(s.addr.clone(), &flips, cut.map(|c| c % 200), &extra);
                    for b in [&m, &raw] {
                        let r = s.next_rank;
                        s.next_rank += 1;
                        if s.ep.add_peer(r, b).is_ok() {
                            s.accepted.0 += 1;
                        }
                    }
                } else {
                    let m = mutate(s.region.clone(), &flips, cut.map(|c| c % 100), &extra);
                    for b in [&m, &raw] {
                        if s.ep.import(s.peer, b).is_ok() {
                            s.accepted.1 += 1;
                        }
                    }
                }
            });
            Ok(())
        })
        .unwrap();
    with_sweep(shm, |s| {
        println!(
            "{}: accepted {} mutated addresses, {} mutated region blobs and {} mutated links",
            s.ep.describe(),
            s.accepted.0,
            s.accepted.1,
            s.accepted.2
        );
        // The unmutated blobs are still accepted (the endpoint is intact).
        s.ep.import(s.peer, &s.region.clone()).unwrap();
    });
}

/// The network transport's address and region blobs and links, mutated, through `add_peer`,
/// `import` and `link_to` of a tcp endpoint.
#[test]
fn net_blobs_through_a_tcp_endpoint() {
    net_blobs(false);
}

/// The same through an shm endpoint (string addresses, its own addressing mode).
#[test]
fn net_blobs_through_an_shm_endpoint() {
    net_blobs(true);
}
