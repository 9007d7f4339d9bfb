//! Striping over two rails on loopback (two tcp endpoints on `lo` per side, which is what the
//! rails need: separate endpoints, each ordered only with itself). Every byte is checked; the
//! rails' counters say who carried what. Across network namespaces with 2 and 4 veth pairs:
//! `tests/net_rails_netns.rs`.

use super::*;
use crate::transport::net::tests::{connect, region, word};
use std::sync::atomic::{AtomicBool, Ordering as AtOrd};
use std::time::{Duration, Instant};

const CHUNK: u64 = 64 << 10;

fn cfg() -> NetConfig {
    NetConfig {
        stripe_chunk: CHUNK,
        ..Default::default()
    }
}

fn pair() -> (Rails, Rails) {
    let c = cfg();
    let a = Rails::open(&["lo", "lo"], None, &c).unwrap();
    let b = Rails::open(&["lo", "lo"], None, &c).unwrap();
    (a, b)
}

fn pattern(round: u64, i: usize) -> u64 {
    round.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64
}

/// What a put lands in: `words` words and a flag word registered by the target, imported
/// by the initiator.
struct Target {
    dst: Vec<u64>,
    flag: Vec<u64>,
    /// The destination's region blob, as the target handed it out.
    dst_blob: Vec<u8>,
    d: RemoteId,
    f: RemoteId,
}

/// Registers a `Target` on `b` and imports it into `a` (whose peer `pa` is `b`).
fn target(a: &mut dyn Endpoint, b: &mut dyn Endpoint, pa: PeerId, words: usize) -> Target {
    let (dst, flag) = (vec![0u64; words], vec![0u64; 1]);
    let (_, dst_blob) = b.register(region(&dst)).unwrap();
    let (_, fb) = b.register(region(&flag)).unwrap();
    let d = a.import(pa, &dst_blob).unwrap();
    let f = a.import(pa, &fb).unwrap();
    Target {
        dst,
        flag,
        dst_blob,
        d,
        f,
    }
}

/// Progresses `b` on a thread until `body` returns (the target's proxy).
fn with_target<B: Endpoint + 'static, R>(b: B, body: impl FnOnce() -> R) -> (R, B) {
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let t = std::thread::spawn(move || {
        let mut b = b;
        // Ends when the test sets `stop` (Release below, Acquire here).
        while !s2.load(AtOrd::Acquire) {
            b.progress().unwrap();
            b.poll_incoming().unwrap();
            std::thread::yield_now();
        }
        b
    });
    let r = body();
    stop.store(true, AtOrd::Release);
    (r, t.join().unwrap())
}

fn wait_word(v: &[u64], i: usize, want: u64, what: &str) {
    let t0 = Instant::now();
    // Ends when the word arrives, or fails after 20 s.
    while word(v, i) < want {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{what}: never arrived"
        );
        std::thread::yield_now();
    }
}

#[test]
fn large_puts_stripe_over_both_rails_and_small_ones_stay_on_rail_0() {
    let (mut a, mut b) = pair();
    let pa = connect(&mut a, &mut b);
    let words = (1usize << 20) / 8;
    let Target {
        dst, flag, d, f, ..
    } = target(&mut a, &mut b, pa, words);
    let mut src = vec![0u64; words];
    let s = a.register(region(&src)).unwrap().0;
    let ((), b) = with_target(b, || {
        for round in 1..=4u64 {
            for (i, w) in src.iter_mut().enumerate() {
                *w = pattern(round, i);
            }
            a.write(pa, s, 0, d, 0, (words * 8) as u64).unwrap();
            a.write_value(pa, f, 0, round).unwrap();
            wait_word(&flag, 0, round, "flag");
            for i in 0..words {
                assert_eq!(word(&dst, i), pattern(round, i), "round {round} word {i}");
            }
        }
        // A put of one chunk or less: rail 0 alone.
        a.write(pa, s, 0, d, 0, CHUNK).unwrap();
        a.flush(pa).unwrap();
    });
    let st = a.rail_stats();
    let per_round = (words * 8) as u64 / 2;
    assert_eq!(st[0].bytes, 4 * per_round + CHUNK, "{st:?}");
    assert_eq!(st[1].bytes, 4 * per_round, "{st:?}");
    assert_eq!(st[1].writes, 4 * per_round / CHUNK, "{st:?}");
    // Nothing went the other way.
    assert!(b.rail_stats().iter().all(|r| r.bytes == 0));
}

/// The value waits for the other rail's data: while the target progresses rail 0 only, rail
/// 1's data cannot be confirmed delivered, so the value (on rail 0) must not arrive; once it
/// progresses both, value and data arrive. Without the delivery flush before the value this
/// fails (the value would arrive over rail 0 at once). Both rails' connections are made first,
/// while the target progresses both: a rail whose connection is still being made holds the
/// sender up by itself, and the test would then pass without the flush.
#[test]
fn value_waits_for_the_other_rails_data() {
    let (mut a, mut b) = pair();
    let pa = connect(&mut a, &mut b);
    let words = (512usize << 10) / 8;
    let Target {
        dst, flag, d, f, ..
    } = target(&mut a, &mut b, pa, words);
    let src: Vec<u64> = (0..words).map(|i| pattern(7, i)).collect();
    let s = a.register(region(&src)).unwrap().0;
    let zeros = vec![0u64; words];
    let z = a.register(region(&zeros)).unwrap().0;
    let ((), mut b) = with_target(b, || {
        a.write(pa, z, 0, d, 0, (words * 8) as u64).unwrap();
        a.flush(pa).unwrap();
    });
    assert_eq!(a.rail_stats()[1].writes, 4, "the warm-up used both rails");
    let sender = std::thread::spawn(move || {
        a.write(pa, s, 0, d, 0, (words * 8) as u64).unwrap();
        a.write_value(pa, f, 0, 1).unwrap();
        a.flush(pa).unwrap();
        a
    });
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        b.rails[0].ep.progress().unwrap();
        assert_eq!(word(&flag, 0), 0, "the value overtook rail 1's data");
        std::thread::yield_now();
    }
    let t0 = Instant::now();
    // Ends when the value arrives (both rails progressed), or fails after 20 s.
    while word(&flag, 0) == 0 {
        b.progress().unwrap();
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "value never arrived"
        );
        std::thread::yield_now();
    }
    for i in 0..words {
        assert_eq!(word(&dst, i), pattern(7, i), "word {i}");
    }
    let t0 = Instant::now();
    // The sender's flush needs our progress; ends when it has returned.
    while !sender.is_finished() {
        b.progress().unwrap();
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "flush never returned"
        );
        std::thread::yield_now();
    }
    let a = sender.join().unwrap();
    assert!(a.rail_stats()[1].bytes > 0);
}

/// A rank with one rail and a rank with two talk over rail 0, both ways.
#[test]
fn one_rail_and_two_rails_talk_over_rail_0() {
    let mut a = Rails::open(&["lo", "lo"], None, &cfg()).unwrap();
    let mut b = NetEndpoint::open(Some("lo"), false, None, &cfg()).unwrap();
    let pa = connect(&mut a, &mut b);
    let words = (1usize << 20) / 8;
    let Target {
        dst, flag, d, f, ..
    } = target(&mut a, &mut b, pa, words);
    let src: Vec<u64> = (0..words).map(|i| pattern(3, i)).collect();
    let s = a.register(region(&src)).unwrap().0;
    // Our region blob lists two rails; the one-rail side imports rail 0's.
    let back = vec![0u64; 4];
    let (_, bb) = a.register(region(&back)).unwrap();
    let pb = b.peers.of_rank(0).unwrap();
    let rb = b.import(pb, &bb).unwrap();
    let ((), b) = with_target(b, || {
        a.write(pa, s, 0, d, 0, (words * 8) as u64).unwrap();
        a.write_value(pa, f, 0, 1).unwrap();
        wait_word(&flag, 0, 1, "flag");
    });
    for i in 0..words {
        assert_eq!(word(&dst, i), pattern(3, i), "word {i}");
    }
    let st = a.rail_stats();
    assert_eq!(
        (st[0].bytes, st[1].bytes),
        ((words * 8) as u64, 0),
        "{st:?}"
    );
    let mut b = b;
    let ((), _a) = with_target(a, || {
        b.write_value(pb, rb, 8, 42).unwrap();
        b.flush(pb).unwrap();
        wait_word(&back, 1, 42, "value from the one-rail side");
    });
}

/// Staged memory (here host memory under the test switch) is registered on rail 0 only, and
/// puts into it go on rail 0 through its staging channel, every byte arriving.
#[test]
fn staged_regions_use_rail_0_only() {
    let c = NetConfig {
        force_staging: true,
        ..cfg()
    };
    let mut a = Rails::open(&["lo", "lo"], None, &c).unwrap();
    let mut b = Rails::open(&["lo", "lo"], None, &c).unwrap();
    let pa = connect(&mut a, &mut b);
    let words = (1usize << 20) / 8;
    let Target {
        dst,
        flag,
        dst_blob,
        d,
        f,
    } = target(&mut a, &mut b, pa, words);
    assert_eq!(blob::decode_rails(&dst_blob).unwrap().len(), 1);
    let src: Vec<u64> = (0..words).map(|i| pattern(5, i)).collect();
    let s = a.register(region(&src)).unwrap().0;
    let (_, _b) = with_target(b, || {
        a.write(pa, s, 0, d, 0, (words * 8) as u64).unwrap();
        a.write_value(pa, f, 0, 1).unwrap();
        wait_word(&flag, 0, 1, "flag");
        a.flush(pa).unwrap();
    });
    for i in 0..words {
        assert_eq!(word(&dst, i), pattern(5, i), "word {i}");
    }
    assert_eq!(a.rail_stats()[1].bytes, 0);
}

/// Bad input is refused with an error and changes nothing: rail lists out of range, unknown
/// ids, a region of another peer.
#[test]
fn bad_rails_and_ids_are_refused() {
    for names in [&[][..], &["lo", ""][..], &["lo"; 17][..]] {
        match Rails::open(names, None, &cfg()) {
            Err(Error::InvalidArgument(_)) => {}
            Err(e) => panic!("{names:?}: {e}"),
            Ok(_) => panic!("{names:?} opened"),
        }
    }
    let (mut a, mut b) = pair();
    let pa = connect(&mut a, &mut b);
    for n in [0u32, 17] {
        let mut bad = Vec::new();
        for v in [0x4d53_4e52u32, 2, n] {
            bad.extend_from_slice(&v.to_le_bytes());
        }
        let e = a.add_peer(5, &bad).unwrap_err();
        assert!(e.to_string().contains("rails"), "{e}");
        assert!(a.import(pa, &bad).is_err());
    }
    let v = vec![0u64; 4];
    let s = a.register(region(&v)).unwrap().0;
    assert!(matches!(
        a.write(pa, s, 0, 99, 0, 8),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        a.write(pa, 99, 0, 0, 0, 8),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        a.write_value(7, 0, 0, 1),
        Err(Error::InvalidArgument(_))
    ));
    assert!(a.flush(7).is_err());
    // A striped put whose end lies outside the peer's region: refused before any chunk moves.
    let big = vec![0u64; (4 * CHUNK / 8) as usize];
    let dst = vec![0u64; (4 * CHUNK / 8) as usize];
    let (_, db) = b.register(region(&dst)).unwrap();
    let d = a.import(pa, &db).unwrap();
    let s2 = a.register(region(&big)).unwrap().0;
    let e = a.write(pa, s2, 0, d, 8, 4 * CHUNK).unwrap_err();
    assert!(e.to_string().contains("destination range"), "{e}");
    assert_eq!(a.peers.len(), 1);
    // The same region twice: one id, one blob.
    assert_eq!(
        a.register(region(&v)).unwrap(),
        a.register(region(&v)).unwrap()
    );
    assert!(a.rail_stats().iter().all(|r| r.writes == 0));
}

/// Both ranks stripe 32 MiB to each other at once with 16 op slots per rail: a rank waiting
/// for a slot on one rail must keep the other rails moving, or each waits for the other (both
/// failed after the wait timeout before `reserve`). Every byte is checked.
#[test]
fn both_ways_at_once_with_few_op_slots() {
    let c = NetConfig {
        tx_depth: Some(16),
        stripe_chunk: 256 << 10,
        ..Default::default()
    };
    let mut a = Rails::open(&["lo", "lo"], None, &c).unwrap();
    let mut b = Rails::open(&["lo", "lo"], None, &c).unwrap();
    let pa = connect(&mut a, &mut b);
    let pb = b.peers.iter().position(|p| p.rank == 0).unwrap();
    let words = (32usize << 20) / 8;
    let ends: Vec<(Vec<u64>, Vec<u64>, Vec<u64>)> = (0..2u64)
        .map(|k| {
            let src = (0..words).map(|i| pattern(10 + k, i)).collect();
            (src, vec![0u64; words], vec![0u64; 1])
        })
        .collect();
    let (sa, da, fa) = &ends[0];
    let (sb, db, fb) = &ends[1];
    let (_, dab) = a.register(region(da)).unwrap();
    let (_, fab) = a.register(region(fa)).unwrap();
    let (_, dbb) = b.register(region(db)).unwrap();
    let (_, fbb) = b.register(region(fb)).unwrap();
    let s_a = a.register(region(sa)).unwrap().0;
    let s_b = b.register(region(sb)).unwrap().0;
    let (d_b, f_b) = (a.import(pa, &dbb).unwrap(), a.import(pa, &fbb).unwrap());
    let (d_a, f_a) = (b.import(pb, &dab).unwrap(), b.import(pb, &fab).unwrap());
    let bytes = (words * 8) as u64;
    #[allow(clippy::too_many_arguments)] // one side: its endpoint, ids and buffer
    fn side(
        ep: &mut Rails,
        p: PeerId,
        s: MrId,
        d: RemoteId,
        f: RemoteId,
        mine: &[u64],
        bytes: u64,
    ) {
        ep.write(p, s, 0, d, 0, bytes).unwrap();
        ep.write_value(p, f, 0, 1).unwrap();
        ep.flush(p).unwrap();
        let t0 = Instant::now();
        // Ends when the other side's value has arrived here, or fails after 30 s.
        while word(mine, 0) == 0 {
            ep.progress().unwrap();
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no value from the peer"
            );
        }
        // The peer's flush may still need us: keep going a moment.
        let t1 = Instant::now();
        while t1.elapsed() < Duration::from_millis(200) {
            ep.progress().unwrap();
        }
    }
    std::thread::scope(|sc| {
        sc.spawn(|| side(&mut a, pa, s_a, d_b, f_b, fa, bytes));
        sc.spawn(|| side(&mut b, pb, s_b, d_a, f_a, fb, bytes));
    });
    for i in 0..words {
        assert_eq!(word(da, i), pattern(11, i), "at rank 0, word {i}");
        assert_eq!(word(db, i), pattern(10, i), "at rank 1, word {i}");
    }
}

/// A value relayed into memory that stands for FI_HMEM (the owner applies it after a
/// GPUDirect flush, here a no-op) while the owner stripes to the sender and signals: the
/// owner's wait for its other rail must also apply the sender's record, and the sender's flush
/// must keep the owner's rails moving. Both complete; every byte and value is checked.
#[test]
fn relayed_value_while_the_peer_stripes() {
    // The switch that makes endpoints keep staging channels, which relayed values use.
    let c = NetConfig {
        force_staging: true,
        ..cfg()
    };
    let mk = || {
        let mut x = Rails::open(&["lo", "lo"], None, &c).unwrap();
        for r in &mut x.rails {
            r.ep.regions.host_as_hmem = Some(0);
            r.ep.staging.gdr_flush = Box::new(|_| Ok(()));
        }
        x
    };
    let (mut a, mut b) = (mk(), mk());
    let pa = connect(&mut a, &mut b);
    let pb = b.peers.iter().position(|p| p.rank == 0).unwrap();
    let words = (8 * CHUNK / 8) as usize;
    let src: Vec<u64> = (0..words).map(|i| pattern(21, i)).collect();
    let (flag_a, dst_b, flag_b) = (vec![0u64; 1], vec![0u64; words], vec![0u64; 1]);
    let (_, fab) = a.register(region(&flag_a)).unwrap();
    let (_, dbb) = b.register(region(&dst_b)).unwrap();
    let (_, fbb) = b.register(region(&flag_b)).unwrap();
    let s = a.register(region(&src)).unwrap().0;
    let (d_b, f_b) = (a.import(pa, &dbb).unwrap(), a.import(pa, &fbb).unwrap());
    let f_a = b.import(pb, &fab).unwrap();
    // Each side, once done, keeps progressing (as its proxy would) until both are done.
    let done = std::sync::atomic::AtomicUsize::new(0);
    let linger = |ep: &mut Rails| {
        done.fetch_add(1, AtOrd::AcqRel);
        let t0 = Instant::now();
        // Ends when both sides are done (AcqRel above, Acquire here), or fails after 30 s.
        while done.load(AtOrd::Acquire) < 2 {
            ep.progress().unwrap();
            ep.poll_incoming().unwrap();
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the other side never finished"
            );
        }
    };
    std::thread::scope(|sc| {
        sc.spawn(|| {
            b.write_value(pb, f_a, 0, 7).unwrap();
            b.flush(pb).unwrap();
            linger(&mut b);
        });
        sc.spawn(|| {
            a.write(pa, s, 0, d_b, 0, 8 * CHUNK).unwrap();
            a.write_value(pa, f_b, 0, 1).unwrap();
            a.flush(pa).unwrap();
            linger(&mut a);
        });
    });
    assert_eq!(word(&flag_b, 0), 1);
    assert_eq!(word(&flag_a, 0), 7);
    for i in 0..words {
        assert_eq!(word(&dst_b, i), pattern(21, i), "word {i}");
    }
}

/// Sources of registered writes (`register_source`) are registered on both rails, so a large
/// put from one stripes; released after the flush, on every rail: 20 calls leave the rails'
/// registrations and the region table as they were after the first.
#[test]
fn sources_stripe_and_are_released_on_every_rail() {
    let (mut a, mut b) = pair();
    let pa = connect(&mut a, &mut b);
    let words = (4 * CHUNK / 8) as usize;
    let Target { dst, d, .. } = target(&mut a, &mut b, pa, words);
    let mut src = vec![0u64; words];
    let held = |a: &Rails| {
        let rails: Vec<_> = a.rails.iter().map(|r| r.ep.regions.held()).collect();
        (rails, a.regions.held(), a.regions.ids())
    };
    let ((), _b) = with_target(b, || {
        let mut first = None;
        for round in 1..=20u64 {
            for (i, w) in src.iter_mut().enumerate() {
                *w = pattern(round, i);
            }
            // A different source range each call: the last `round` words left out.
            let len = (words as u64 - round) * 8;
            let s = a
                .register_source(Region {
                    len,
                    ..region(&src)
                })
                .unwrap();
            assert_eq!(
                a.region(s).unwrap().ids.len(),
                2,
                "registered on both rails"
            );
            a.write(pa, s, 0, d, 0, len).unwrap();
            a.flush(pa).unwrap();
            a.release_source(s).unwrap();
            assert!(a.release_source(s).is_err(), "released twice");
            for i in 0..len as usize / 8 {
                assert_eq!(word(&dst, i), pattern(round, i), "round {round} word {i}");
            }
            let h = held(&a);
            assert_eq!(h, *first.get_or_insert(h.clone()), "after round {round}");
        }
    });
    assert!(a.rail_stats()[1].bytes > 0, "the sources' puts striped");
}

/// A region striped over both rails is deregistered on both (each rail's regions and MRs, and
/// the striped table, back to what they were), and a forgotten import is dead on every rail.
#[test]
fn deregistered_regions_are_released_on_every_rail() {
    let (mut a, mut b) = pair();
    let pa = connect(&mut a, &mut b);
    let words = (4 * CHUNK / 8) as usize;
    let dst = vec![0u64; words];
    let src: Vec<u64> = (0..words as u64).map(|i| pattern(7, i as usize)).collect();
    let held = |x: &Rails| {
        let rails: Vec<_> = x.rails.iter().map(|r| r.ep.regions.held()).collect();
        (rails, x.regions.held(), x.by_first.len())
    };
    let before = held(&b);
    let (id, blob) = b.register(region(&dst)).unwrap();
    assert_eq!(
        b.region(id).unwrap().ids.len(),
        2,
        "registered on both rails"
    );
    let d = a.import(pa, &blob).unwrap();
    let s = a.register(region(&src)).unwrap().0;
    let ((), mut b) = with_target(b, || {
        a.write(pa, s, 0, d, 0, words as u64 * 8).unwrap();
        a.flush(pa).unwrap();
    });
    assert_eq!(word(&dst, words - 1), src[words - 1]);
    assert!(a.rail_stats()[1].bytes > 0, "the put striped");
    let imported: Vec<usize> = a
        .rails
        .iter()
        .map(|r| r.ep.regions.remotes_held())
        .collect();
    a.forget(d).unwrap();
    assert!(a.forget(d).is_err(), "forgotten twice");
    for (r, n) in a.rails.iter().zip(imported) {
        assert_eq!(r.ep.regions.remotes_held(), n - 1, "{}", r.ep.describe());
    }
    assert!(a.write(pa, s, 0, d, 0, 8).is_err());
    assert_eq!(a.remote_len(d), None);
    b.deregister(id).unwrap();
    assert_eq!(held(&b), before, "released on both rails");
    assert!(b.deregister(id).is_err(), "deregistered twice");
    let (again, _) = b.register(region(&dst)).unwrap();
    assert_eq!(b.region(again).unwrap().ids.len(), 2, "registered anew");
}

/// A region registered directly on rail 0 but staged on a later rail (no FI_HMEM on that NIC;
/// here that rail alone under the test switch) is not striped, and what the other rails
/// registered for it is released at once: registering and deregistering it leaves every rail
/// as it was.
#[test]
fn a_region_staged_on_a_later_rail_keeps_nothing_there() {
    staged_on_rail(2, 1);
    // Three rails, staged on the last: rail 1's registration (the one between) is released too.
    staged_on_rail(3, 2);
}

fn staged_on_rail(rails: usize, staged: usize) {
    let mut b = Rails::open(&vec!["lo"; rails], None, &cfg()).unwrap();
    b.rails[staged].ep.staging.force_staging = true;
    let dst = vec![0u64; 64];
    let held = |x: &Rails| {
        let rails: Vec<_> = x.rails.iter().map(|r| r.ep.regions.held()).collect();
        (rails, x.regions.held(), x.by_first.len())
    };
    let before = held(&b);
    for round in 0..3 {
        let (id, blob) = b.register(region(&dst)).unwrap();
        assert_eq!(
            b.region(id).unwrap().ids.len(),
            1,
            "round {round}: rail 0 only"
        );
        assert_eq!(blob::decode_rails(&blob).unwrap().len(), 1, "round {round}");
        for r in 1..rails {
            assert_eq!(
                b.rails[r].ep.regions.held(),
                before.0[r],
                "round {round}: rail {r} of {rails} keeps no registration"
            );
        }
        b.deregister(id).unwrap();
        assert_eq!(held(&b), before, "round {round}: every rail as before");
    }
}
