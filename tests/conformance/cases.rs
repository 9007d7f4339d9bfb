//! The cases of the `Endpoint` conformance suite, each over any [`Opener`]: the trait's
//! contract (`src/transport/mod.rs`) checked on real bytes. Every wait is bounded
//! ([`super::DEADLINE`], and MSCCLPP_WAIT_TIMEOUT inside the endpoints).

use super::{assert_bytes, pattern_bytes, Group, Opener, DEADLINE};
use mscclpp::error::Error;
use mscclpp::transport::{MemKind, Region};
use std::sync::Arc;
use std::time::Instant;

/// What the destination holds before anything is written to it.
const SENTINEL: u8 = 0xEE;

/// Writes of 1 byte up to more than the largest single transfer, at odd offsets, each followed
/// by a value and a flush: once the value is seen, the destination holds exactly the bytes
/// written so far (every other byte untouched). Then a flush with nothing outstanding returns
/// and progress is harmless.
pub fn bytes_arrive(o: &Opener) {
    let n = o.big + 64;
    let (src, dst, flag) = (o.alloc(n), o.alloc(n), o.alloc(16));
    dst.fill(SENTINEL);
    let mut g = Group::new(o, 1);
    let p = g.p();
    let s = g.source(&src);
    let d = g.target_region(0, &dst);
    let f = g.target_region(0, &flag);
    let mut want = vec![SENTINEL; n];
    // (size, source offset, destination offset)
    let writes = [
        (1, 0, 0),
        (1, 13, n - 1),
        (7, 3, 5),
        (8, 8, 16),
        (4096 + 3, 1, 2),
        (65536, 0, 4096),
        (o.big, 0, 0),
        (o.big, 17, 40),
    ];
    for (k, &(size, so, doff)) in writes.iter().enumerate() {
        let round = k as u64 + 1;
        let bytes = pattern_bytes(round, size);
        src.write(so, &bytes);
        want[doff..doff + size].copy_from_slice(&bytes);
        g.a.write(p, s, so as u64, d, doff as u64, size as u64)
            .unwrap();
        g.a.write_value(p, f, 8, round).unwrap();
        g.a.flush(p).unwrap();
        g.wait_word(&flag, 1, round, "the value after the bytes");
        let what = format!("{size} bytes from {so} to {doff}");
        assert_bytes(&dst.read(0, n), &want, &what);
    }
    // Nothing outstanding: flush returns; progress is harmless.
    g.a.flush(p).unwrap();
    g.progress_a();
    let name = g.a.describe();
    assert!(!name.is_empty());
    if o.libfabric {
        assert!(name.starts_with("net:"), "{name}");
    }
}

/// Many rounds of data then a value, the target checking every byte of round r as soon as it
/// sees value r, then acknowledging into `a` (a write back, flushed), which gates the next
/// round: whoever sees the value sees the data.
pub fn value_after_data(o: &Opener) {
    values_after_data(o, false)
}

/// As [`value_after_data`], each round a large write, then a second write and the value as one
/// `write_then_value` (where the transport carries the value with that write): the value is
/// seen only once both writes are in place, whichever of them is large (rounds alternate).
pub fn value_rides_with_data(o: &Opener) {
    values_after_data(o, true)
}

fn values_after_data(o: &Opener, ride: bool) {
    let len = o.big;
    let src = o.alloc(len);
    let dst = Arc::new(o.alloc(len));
    let epoch = Arc::new(o.alloc(16));
    let ack = o.alloc(8);
    let mut g = Group::new(o, 1);
    let p = g.p();
    let s = g.source(&src);
    let d = g.target_region(0, &dst);
    let e = g.target_region(0, &epoch);
    let (_, ack_blob) = g.a.register(ack.region()).unwrap();
    let (b, b_peer) = (g.targets[0].ep.clone(), g.targets[0].to_a);
    let ack_r = b.lock().unwrap().import(b_peer, &ack_blob).unwrap();
    let rounds = 20u64;
    let (dst2, epoch2) = (dst.clone(), epoch.clone());
    let mut checker = Some(std::thread::spawn(move || -> Result<(), String> {
        for r in 1..=rounds {
            let t0 = Instant::now();
            // Ends when value r arrives, or fails at the deadline.
            while epoch2.word(1) < r {
                if t0.elapsed() > DEADLINE {
                    return Err(format!("round {r}: the value never arrived"));
                }
                std::thread::yield_now();
            }
            let got = dst2.read(0, len);
            let want = pattern_bytes(r, len);
            if let Some(i) = (0..len).find(|&i| got[i] != want[i]) {
                return Err(format!(
                    "round {r}: value seen, but byte {i} is {:#04x}, want {:#04x}",
                    got[i], want[i]
                ));
            }
            let mut b = b.lock().unwrap();
            b.write_value(b_peer, ack_r, 0, r)
                .map_err(|e| e.to_string())?;
            b.flush(b_peer).map_err(|e| e.to_string())?;
        }
        Ok(())
    }));
    for r in 1..=rounds {
        src.write(0, &pattern_bytes(r, len));
        if ride {
            // Cut at 64 bytes from one end or the other: a large write then a small one with
            // the value, or a small one then a large one with it.
            let cut = if r % 2 == 0 { len - 64 } else { 64 };
            g.a.write(p, s, 0, d, 0, cut as u64).unwrap();
            let rest = (len - cut) as u64;
            g.a.write_then_value(p, s, cut as u64, d, cut as u64, rest, (e, 8, r))
                .unwrap();
        } else {
            g.a.write(p, s, 0, d, 0, len as u64).unwrap();
            g.a.write_value(p, e, 8, r).unwrap();
        }
        // Reusing `src` needs its writes complete; the ack gates the next overwrite of dst.
        g.a.flush(p).unwrap();
        // The value too has arrived at the flush (also one that rode with its write).
        assert!(
            epoch.word(1) >= r,
            "round {r}: the value had not arrived at flush"
        );
        g.wait_word_from(&ack, 0, r, "the target's acknowledgement", &mut checker);
    }
    // The checker's last flush may need `a`'s progress.
    let checker = checker.expect("the checker ended without failing");
    g.progress_until(&checker, "the checker");
    checker.join().unwrap().unwrap();
}

/// When flush returns, every earlier write has arrived: checked at once, without waiting or
/// progressing, after rounds that end with a value and rounds that end with data.
pub fn flush_means_arrived(o: &Opener) {
    let len = o.big;
    let (src, dst, flag) = (o.alloc(len), o.alloc(len), o.alloc(16));
    let mut g = Group::new(o, 1);
    let p = g.p();
    let s = g.source(&src);
    let d = g.target_region(0, &dst);
    let f = g.target_region(0, &flag);
    for r in 1..=6u64 {
        let bytes = pattern_bytes(r, len);
        src.write(0, &bytes);
        let with_value = r % 2 == 1;
        if with_value {
            g.a.write(p, s, 0, d, 0, len as u64).unwrap();
            g.a.write_value(p, f, 8, r).unwrap();
        } else {
            // Data last: a value first, then the data.
            g.a.write_value(p, f, 8, r).unwrap();
            g.a.write(p, s, 0, d, 0, len as u64).unwrap();
        }
        g.a.flush(p).unwrap();
        assert_eq!(
            flag.word(1),
            r,
            "round {r}: the value had not arrived at flush"
        );
        let what = format!(
            "round {r} (ends with {})",
            if with_value { "a value" } else { "data" }
        );
        assert_bytes(&dst.read(0, len), &bytes, &what);
    }
}

/// More small writes than any queue or ring holds, without a flush in between: the endpoint
/// makes room (progress, retry, flow control) and never drops one.
pub fn many_small_writes(o: &Opener) {
    let n = 6000usize;
    let (src, dst) = (o.alloc(n * 8), o.alloc(n * 8));
    let bytes = pattern_bytes(3, n * 8);
    src.write(0, &bytes);
    let mut g = Group::new(o, 1);
    let p = g.p();
    let s = g.source(&src);
    let d = g.target_region(0, &dst);
    for i in 0..n as u64 {
        g.a.write(p, s, i * 8, d, i * 8, 8).unwrap();
    }
    g.a.flush(p).unwrap();
    assert_bytes(&dst.read(0, n * 8), &bytes, "after 6000 writes of 8 bytes");
}

/// Blobs that are not what the peer's register/address made are refused with an error; the
/// intact blob still imports and works.
pub fn malformed_blobs_rejected(o: &Opener) {
    let (src, dst) = (o.alloc(4096), o.alloc(4096));
    let mut g = Group::new(o, 1);
    let p = g.p();
    let (_, blob) = g.targets[0]
        .ep
        .lock()
        .unwrap()
        .register(dst.region())
        .unwrap();
    let mut bad = blob.clone();
    bad[0] ^= 0xff;
    assert!(g.a.import(p, &bad).is_err(), "bad magic");
    let mut long = blob.clone();
    long.extend_from_slice(&[0u8; 64]);
    assert!(g.a.import(p, &long).is_err(), "trailing bytes");
    for cut in 0..blob.len() {
        assert!(g.a.import(p, &blob[..cut]).is_err(), "truncated to {cut}");
    }
    assert!(g.a.import(p + 7, &blob).is_err(), "unknown peer");
    // (A striped endpoint's blob wraps one region blob per rail: "MSNR" first.)
    let striped = blob.starts_with(&0x4d53_4e52u32.to_le_bytes());
    if o.libfabric && !striped {
        // The region's length (bytes 24..32 of a network region blob) zeroed.
        let mut zero = blob.clone();
        zero[24..32].fill(0);
        assert!(g.a.import(p, &zero).is_err(), "empty region");
    }
    // Address blobs too.
    assert!(g.a.add_peer(5, b"not an address").is_err());
    let addr = g.targets[0].ep.lock().unwrap().address().unwrap();
    for cut in [0, 1, addr.len() / 2, addr.len() - 2, addr.len() - 1] {
        assert!(
            g.a.add_peer(5, &addr[..cut]).is_err(),
            "address cut to {cut}"
        );
    }
    // The intact blob imports, and writes through it arrive.
    let d = g.a.import(p, &blob).unwrap();
    let s = g.source(&src);
    let bytes = pattern_bytes(11, 4096);
    src.write(0, &bytes);
    g.a.write(p, s, 0, d, 0, 4096).unwrap();
    g.a.flush(p).unwrap();
    assert_bytes(&dst.read(0, 4096), &bytes, "through the intact blob");
}

/// Writes outside the source or the destination, to unknown regions, or values past the
/// end, are refused with an error and write nothing.
pub fn out_of_range_refused(o: &Opener) {
    let (src, dst) = (o.alloc(8192), o.alloc(4096));
    dst.fill(SENTINEL);
    let mut g = Group::new(o, 1);
    let p = g.p();
    let s = g.source(&src);
    let d = g.target_region(0, &dst);
    let mut bad = vec![
        (0, 4000, 200),
        (0, 0, 4097),
        (8000, 0, 200),
        (0, u64::MAX - 4, 8),
        (u64::MAX - 4, 0, 8),
    ];
    if o.libfabric {
        bad.push((0, 0, 0));
    }
    for (so, doff, n) in bad {
        match g.a.write(p, s, so, d, doff, n) {
            Err(Error::InvalidArgument(_)) => {}
            Err(_) if !o.libfabric => {}
            other => panic!("write {so}/{doff}/{n}: expected InvalidArgument, got {other:?}"),
        }
    }
    for off in [4090, 4096, u64::MAX - 4] {
        assert!(g.a.write_value(p, d, off, 1).is_err(), "value at {off}");
    }
    assert!(g.a.write(p, s, 0, d + 1, 0, 8).is_err(), "unknown remote");
    assert!(g.a.write(p, s + 100, 0, d, 0, 8).is_err(), "unknown source");
    assert!(
        g.a.write_value(p, d + 1, 0, 1).is_err(),
        "value to an unknown remote"
    );
    // Nothing was sent: the destination is untouched.
    g.a.flush(p).unwrap();
    assert_bytes(
        &dst.read(0, 4096),
        &[SENTINEL; 4096],
        "after refused writes",
    );
}

/// Registering one region twice gives the same id (and, on libfabric, the same blob); a
/// region of another length is another registration; the second blob works like the first.
pub fn register_twice_same_id(o: &Opener) {
    let (src, dst) = (o.alloc(4096), o.alloc(4096));
    let mut g = Group::new(o, 1);
    let p = g.p();
    let r = dst.region();
    let (blob1, blob2) = {
        let mut t = g.targets[0].ep.lock().unwrap();
        let (id1, blob1) = t.register(r).unwrap();
        let (id2, blob2) = t.register(r).unwrap();
        assert_eq!(id1, id2, "the same region twice");
        let (id3, _) = t.register(Region { len: 4000, ..r }).unwrap();
        assert_ne!(id1, id3, "a shorter region");
        (blob1, blob2)
    };
    if o.libfabric {
        assert_eq!(blob1, blob2);
        let mut t = g.targets[0].ep.lock().unwrap();
        assert!(t.register(Region { len: 0, ..r }).is_err(), "zero bytes");
        assert!(t.register(Region { addr: 0, ..r }).is_err(), "address 0");
        // GPU memory on an endpoint made for host memory: refused, never registered as if it
        // were host memory (a GPU's connections get their own endpoint, which stages it).
        if r.kind == MemKind::Host {
            match t.register(Region {
                kind: MemKind::Device(0),
                ..r
            }) {
                Err(Error::InvalidUsage(m)) => assert!(m.contains("not CUDA device 0"), "{m}"),
                other => panic!("expected InvalidUsage, got {other:?}"),
            }
        }
    }
    let (d1, d2) = (
        g.a.import(p, &blob1).unwrap(),
        g.a.import(p, &blob2).unwrap(),
    );
    let s = g.source(&src);
    let bytes = pattern_bytes(5, 4096);
    src.write(0, &bytes);
    g.a.write(p, s, 0, d1, 0, 2048).unwrap();
    g.a.write(p, s, 2048, d2, 2048, 2048).unwrap();
    g.a.flush(p).unwrap();
    assert_bytes(&dst.read(0, 4096), &bytes, "halves through each blob");
}

/// One endpoint with two peers: each gets its own bytes, and flushes are per peer; then both
/// write into one region of the first endpoint, each its half, each followed by its value.
pub fn two_peers(o: &Opener) {
    let len = 64 << 10;
    let src = o.alloc(2 * len);
    let dsts = [o.alloc(len), o.alloc(len)];
    let flags = [o.alloc(16), o.alloc(16)];
    let back = Arc::new(o.alloc(2 * len));
    let back_flags = o.alloc(16);
    let mut g = Group::new(o, 2);
    assert_ne!(g.peers[0], g.peers[1], "two peers, two ids");
    let all = pattern_bytes(21, 2 * len);
    src.write(0, &all);
    let s = g.source(&src);
    for k in 0..2 {
        let d = g.target_region(k, &dsts[k]);
        let f = g.target_region(k, &flags[k]);
        let p = g.peers[k];
        g.a.write(p, s, (k * len) as u64, d, 0, len as u64).unwrap();
        g.a.write_value(p, f, 8, 1 + k as u64).unwrap();
    }
    g.a.flush(g.peers[1]).unwrap();
    assert_eq!(flags[1].word(1), 2, "peer 1's value at its flush");
    assert_bytes(&dsts[1].read(0, len), &all[len..], "peer 1");
    g.a.flush(g.peers[0]).unwrap();
    assert_eq!(flags[0].word(1), 1, "peer 0's value at its flush");
    assert_bytes(&dsts[0].read(0, len), &all[..len], "peer 0");

    // Back: each target writes its half of `back` and its word of `back_flags`.
    let (_, back_blob) = g.a.register(back.region()).unwrap();
    let (_, flags_blob) = g.a.register(back_flags.region()).unwrap();
    let mut srcs = Vec::new();
    for k in 0..2 {
        let m = Arc::new(o.alloc(len));
        m.write(0, &pattern_bytes(30 + k as u64, len));
        srcs.push(m.clone());
        let (bb, fb) = (back_blob.clone(), flags_blob.clone());
        g.on_target(k, move |t, to_a| {
            let s = t.register(m.region()).unwrap().0;
            let d = t.import(to_a, &bb).unwrap();
            let f = t.import(to_a, &fb).unwrap();
            t.write(to_a, s, 0, d, (k * len) as u64, len as u64)
                .unwrap();
            t.write_value(to_a, f, 8 * k as u64, 7).unwrap();
            t.flush(to_a).unwrap();
        });
    }
    for k in 0..2 {
        g.wait_word(&back_flags, k, 7, "a target's value");
        let what = format!("from target {k}");
        let got = back.read(k * len, len);
        assert_bytes(&got, &pattern_bytes(30 + k as u64, len), &what);
    }
    drop(g);
    drop(srcs);
}
