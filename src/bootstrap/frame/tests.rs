//! The wire format's unit and property tests.

use super::*;
use proptest::prelude::*;

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

fn expect(magic: u64, nranks: usize) -> Expect<'static> {
    Expect {
        magic,
        nranks,
        from: None,
        kinds: ALL,
    }
}

#[test]
fn roundtrip_each_kind() {
    let e = expect(77, 3);
    let table = vec![0u8; 3 * ADDR_LEN];
    let cases: Vec<(Kind, Vec<u8>)> = vec![
        (Kind::Hello, vec![1; HELLO_LEN]),
        (Kind::Table, table),
        (Kind::Abort, b"why".to_vec()),
        (Kind::Open, vec![]),
        (Kind::P2p, vec![9; 1000]),
        (Kind::Coll, vec![]),
        (Kind::Watch, vec![]),
        (Kind::Bye, vec![]),
        (Kind::ReportAsk, vec![]),
        (Kind::Report, vec![3; 100]),
    ];
    for (k, p) in cases {
        let f = encode_frame(77, k, 2, 0xdead_beef_0000_0001, &p);
        let (frames, partial) = decode_all(&f, &e).unwrap();
        assert_eq!(partial, 0);
        assert_eq!(frames.len(), 1);
        let (h, payload) = &frames[0];
        assert_eq!(
            (h.kind, h.sender, h.tag, h.len),
            (k, 2, 0xdead_beef_0000_0001, p.len())
        );
        assert_eq!(payload, &p);
    }
}

#[test]
fn rejects_each_malformation() {
    let e = Expect {
        magic: 5,
        nranks: 4,
        from: Some(1),
        kinds: &[Kind::P2p, Kind::Coll],
    };
    let d = |m, k, s, l| decode_header(&encode_raw(m, k, s, 0, l), &e);
    assert_eq!(d(6, 5, 1, 0), Err(FrameError::WrongMagic { got: 6 }));
    assert_eq!(d(5, 99, 1, 0), Err(FrameError::UnknownKind(99)));
    assert_eq!(d(5, 1, 1, 0), Err(FrameError::UnexpectedKind(Kind::Hello)));
    assert!(matches!(
        d(5, 5, 4, 0),
        Err(FrameError::SenderOutOfRange { .. })
    ));
    assert!(matches!(d(5, 5, 2, 0), Err(FrameError::WrongSender { .. })));
    assert!(matches!(
        d(5, 5, 1, MAX_PAYLOAD as u64 + 1),
        Err(FrameError::BadLength { .. })
    ));
    assert!(matches!(
        d(5, 5, 1, u64::MAX),
        Err(FrameError::BadLength { .. })
    ));
    assert_eq!(d(5, 5, 1, MAX_PAYLOAD as u64).unwrap().len, MAX_PAYLOAD);
    assert_eq!(
        decode_header(&[0; 10], &e),
        Err(FrameError::Truncated { have: 10 })
    );
    // An Open frame must be empty; a Hello exactly HELLO_LEN; a Table nranks entries.
    let all = expect(5, 4);
    assert!(decode_header(&encode_raw(5, 4, 0, 0, 1), &all).is_err());
    assert!(decode_header(&encode_raw(5, 1, 0, 0, 3), &all).is_err());
    assert!(decode_header(&encode_raw(5, 2, 0, 0, 3 * ADDR_LEN as u64), &all).is_err());
    assert!(decode_header(&encode_raw(5, 2, 0, 0, 4 * ADDR_LEN as u64), &all).is_ok());
    // Watch, Bye and ReportAsk carry nothing: any declared payload is rejected, as for Open.
    for k in [Kind::Watch, Kind::Bye, Kind::ReportAsk] {
        assert!(decode_header(&encode_raw(5, k as u32, 0, 0, 0), &all).is_ok());
        for len in [1, 8, MAX_PAYLOAD as u64, u64::MAX] {
            assert!(matches!(
                decode_header(&encode_raw(5, k as u32, 0, 0, len), &all),
                Err(FrameError::BadLength { kind, .. }) if kind == k
            ));
        }
    }
    // A report is bounded far below other payloads.
    assert!(decode_header(&encode_raw(5, 10, 0, 0, MAX_REPORT_LEN as u64), &all).is_ok());
    assert!(matches!(
        decode_header(&encode_raw(5, 10, 0, 0, MAX_REPORT_LEN as u64 + 1), &all),
        Err(FrameError::BadLength {
            kind: Kind::Report,
            ..
        })
    ));
    assert_eq!(
        decode_header(&encode_raw(5, 11, 0, 0, 0), &all),
        Err(FrameError::UnknownKind(11))
    );
}

#[test]
fn partial_frames_are_reported() {
    let e = expect(1, 2);
    let f = encode_frame(1, Kind::P2p, 0, 0, &[1, 2, 3]);
    for cut in 1..f.len() {
        let (frames, partial) = decode_all(&f[..cut], &e).unwrap();
        assert!(frames.is_empty());
        assert_eq!(partial, cut, "cut at {cut}");
    }
}

#[test]
fn addr_roundtrip_and_rejects() {
    for s in [
        "127.0.0.1:1",
        "[::1]:65535",
        "[fe80::1%7]:80",
        "10.1.2.3:4567",
    ] {
        let a: SocketAddr = match s.parse() {
            Ok(a) => a,
            // std cannot parse a scope suffix; build it by hand.
            Err(_) => SocketAddr::V6(SocketAddrV6::new("fe80::1".parse().unwrap(), 80, 0, 7)),
        };
        assert_eq!(decode_addr(&encode_addr(&a)).unwrap(), a);
    }
    let mut b = encode_addr(&"1.2.3.4:5".parse().unwrap());
    b[10] = 1;
    assert!(decode_addr(&b).is_err());
    assert!(decode_addr(&[0; ADDR_LEN]).is_err());
    assert!(decode_addr(&[4; 3]).is_err());
}

#[test]
fn addr_magic_with_a_secret_differs_and_none_is_the_plain_one() {
    let plain = addr_magic("127.0.0.1:5000", 4);
    assert_eq!(addr_magic_with("127.0.0.1:5000", 4, None), plain);
    let a = addr_magic_with("127.0.0.1:5000", 4, Some("s3cret"));
    assert_ne!(a, plain);
    assert_eq!(a, addr_magic_with("127.0.0.1:5000", 4, Some("s3cret")));
    assert_ne!(a, addr_magic_with("127.0.0.1:5000", 4, Some("s3cre")));
}

#[test]
fn addr_magic_depends_on_both_inputs() {
    let a = addr_magic("127.0.0.1:5000", 4);
    assert_eq!(a, addr_magic("127.0.0.1:5000", 4));
    assert_ne!(a, addr_magic("127.0.0.1:5000", 3));
    assert_ne!(a, addr_magic("127.0.0.1:5001", 4));
    assert_ne!(a, 0);
}

fn feed_in_chunks(bytes: &[u8], chunks: &[usize], e: &Expect<'_>) {
    let mut asm = Assembler::new();
    let mut at = 0;
    let mut ci = 0;
    // Ends: `at` grows by at least one per round, or the loop breaks.
    while at < bytes.len() {
        let want = chunks.get(ci).copied().unwrap_or(7).max(1);
        ci += 1;
        let end = (at + want).min(bytes.len());
        let mut piece = &bytes[at..end];
        while !piece.is_empty() {
            match asm.feed(piece, e) {
                Ok((n, f)) => {
                    assert!(asm.reserved() <= MAX_PAYLOAD);
                    if let Some((h, p)) = f {
                        assert_eq!(h.len, p.len());
                        assert!(h.len <= MAX_PAYLOAD);
                    } else {
                        assert!(n > 0, "no progress on {} bytes", piece.len());
                    }
                    piece = &piece[n..];
                }
                Err(_) => return,
            }
        }
        at = end;
    }
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic_or_overallocate(
        bytes in proptest::collection::vec(any::<u8>(), 0..300),
        chunks in proptest::collection::vec(1usize..64, 0..20),
        magic in prop_oneof![Just(0u64), Just(7u64), any::<u64>()],
        nranks in 1usize..10,
        with_magic in any::<bool>(),
    ) {
        let e = expect(magic, nranks);
        let mut bytes = bytes;
        // Half the inputs start with the right magic, so the later checks get exercised.
        if with_magic && bytes.len() >= 8 {
            bytes[..8].copy_from_slice(&magic.to_le_bytes());
        }
        if let Ok(h) = decode_header(&bytes, &e) {
            prop_assert!(h.len <= MAX_PAYLOAD);
        }
        feed_in_chunks(&bytes, &chunks, &e);
        let _ = decode_all(&bytes, &e);
    }

    #[test]
    fn mutated_valid_frames_never_panic_or_overallocate(
        kind in 1u32..12,
        sender in 0u32..4,
        tag in any::<u64>(),
        payload in proptest::collection::vec(any::<u8>(), 0..200),
        flips in proptest::collection::vec((0usize..300, any::<u8>()), 0..6),
        cut in proptest::option::of(0usize..300),
        chunks in proptest::collection::vec(1usize..64, 0..20),
    ) {
        let e = expect(0x1234_5678, 4);
        let mut f = encode_raw(0x1234_5678, kind, sender, tag, payload.len() as u64).to_vec();
        f.extend_from_slice(&payload);
        for (at, x) in flips {
            let n = f.len();
            f[at % n] ^= x;
        }
        if let Some(c) = cut {
            f.truncate(c.min(f.len()));
        }
        if let Ok(h) = decode_header(&f, &e) {
            prop_assert!(h.len <= MAX_PAYLOAD);
            prop_assert!(h.len <= h.kind.len_range(4).1);
        }
        feed_in_chunks(&f, &chunks, &e);
        if let Ok((frames, _)) = decode_all(&f, &e) {
            for (h, p) in frames {
                prop_assert_eq!(h.len, p.len());
            }
        }
    }

    #[test]
    fn empty_kinds_reject_any_payload(
        kind in prop_oneof![Just(Kind::Open), Just(Kind::Watch), Just(Kind::Bye), Just(Kind::ReportAsk)],
        len in 1u64..,
        payload in proptest::collection::vec(any::<u8>(), 0..64),
        chunks in proptest::collection::vec(1usize..64, 0..20),
    ) {
        // Open, Watch and Bye are bare headers; a length is a confused or hostile sender.
        let e = expect(3, 4);
        let mut f = encode_raw(3, kind as u32, 1, 0, len).to_vec();
        f.extend_from_slice(&payload);
        let is_bad_len = matches!(
            decode_header(&f, &e),
            Err(FrameError::BadLength { kind: k, .. }) if k == kind
        );
        prop_assert!(is_bad_len);
        prop_assert!(decode_all(&f, &e).is_err());
        feed_in_chunks(&f, &chunks, &e);
    }

    #[test]
    fn valid_frames_roundtrip(
        sender in 0u32..8,
        tag in any::<u64>(),
        payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..100), 1..5),
        chunks in proptest::collection::vec(1usize..50, 0..30),
    ) {
        let e = Expect { magic: 9, nranks: 8, from: Some(sender as usize), kinds: &[Kind::P2p] };
        let mut stream = Vec::new();
        for p in &payloads {
            stream.extend_from_slice(&encode_frame(9, Kind::P2p, sender, tag, p));
        }
        let mut asm = Assembler::new();
        let mut got = Vec::new();
        let mut at = 0;
        let mut ci = 0;
        // Ends: `at` grows by at least one chunk per round; feed always makes progress.
        while at < stream.len() {
            let end = (at + chunks.get(ci).copied().unwrap_or(13)).min(stream.len());
            ci += 1;
            let mut piece = &stream[at..end];
            while !piece.is_empty() {
                let (n, f) = asm.feed(piece, &e).unwrap();
                if let Some((_, p)) = f { got.push(p); }
                piece = &piece[n..];
            }
            at = end;
        }
        prop_assert!(asm.is_idle());
        prop_assert_eq!(got, payloads);
    }
}
