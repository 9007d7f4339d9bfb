//! The bootstrap frame decoder on arbitrary bytes: headers, the stream assembler (fed in
//! pieces whose sizes come from the input), and socket addresses.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mscclpp::bootstrap::frame::{self, Assembler, Expect, Kind};

const ALL: &[Kind] = &[
    Kind::Hello,
    Kind::Table,
    Kind::Abort,
    Kind::Open,
    Kind::P2p,
    Kind::Coll,
    Kind::Watch,
    Kind::Bye,
];

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let (nranks, piece) = (1 + data[0] as usize % 64, 1 + data[1] as usize % 97);
    let bytes = &data[2..];
    let e = Expect {
        magic: u64::from_le_bytes(
            bytes
                .get(..8)
                .and_then(|b| b.try_into().ok())
                .unwrap_or([0; 8]),
        ),
        nranks,
        from: None,
        kinds: ALL,
    };
    if let Ok(h) = frame::decode_header(bytes, &e) {
        assert!(h.len <= frame::MAX_PAYLOAD);
    }
    let mut asm = Assembler::new();
    for chunk in bytes.chunks(piece) {
        let mut c = chunk;
        while !c.is_empty() {
            match asm.feed(c, &e) {
                Ok((n, f)) => {
                    assert!(asm.reserved() <= frame::MAX_PAYLOAD);
                    if let Some((h, p)) = f {
                        assert_eq!(h.len, p.len());
                    } else {
                        assert!(n > 0);
                    }
                    c = &c[n..];
                }
                Err(_) => return,
            }
        }
    }
    if bytes.len() >= frame::ADDR_LEN {
        if let Ok(a) = frame::decode_addr(&bytes[..frame::ADDR_LEN]) {
            assert_eq!(&frame::encode_addr(&a)[..], &bytes[..frame::ADDR_LEN]);
        }
    }
});
