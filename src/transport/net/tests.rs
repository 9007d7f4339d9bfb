//! Unit tests of `NetEndpoint` internals that the trait does not show: the -FI_EAGAIN retry
//! path, chunking, the forced FI_MR_ENDPOINT sequence on real providers, teardown order.
//! Trait-level tests live in `tests/net_*.rs`.

use super::*;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

#[derive(Clone, Copy, Debug)]
enum Kind {
    Tcp,
    Shm,
}

fn open(kind: Kind, t: &Tuning) -> NetEndpoint {
    match kind {
        Kind::Tcp => NetEndpoint::open(Some("lo"), false, None, t),
        Kind::Shm => NetEndpoint::open(None, true, None, t),
    }
    .unwrap_or_else(|e| panic!("opening {kind:?}: {e}"))
}

fn region(v: &[u64]) -> Region {
    Region {
        addr: v.as_ptr() as u64,
        len: (v.len() * 8) as u64,
        kind: MemKind::Host,
    }
}

fn word(v: &[u64], i: usize) -> u64 {
    // SAFETY: in bounds and aligned; the peer writes this memory, hence an atomic load.
    unsafe { AtomicU64::from_ptr(v.as_ptr().add(i) as *mut u64) }.load(AtOrd::Acquire)
}

/// Runs `f` with an initiator `a` while a thread progresses the target `b` (as its proxy
/// would); returns `a` and `b` for inspection.
fn with_pair(
    kind: Kind,
    ta: &Tuning,
    body: impl FnOnce(&mut NetEndpoint, &Mutex<NetEndpoint>, PeerId),
) -> (NetEndpoint, NetEndpoint) {
    let mut a = open(kind, ta);
    let mut b = open(kind, &Tuning::default());
    let pa = a.add_peer(1, &b.address().unwrap()).unwrap();
    b.add_peer(0, &a.address().unwrap()).unwrap();
    let b = Arc::new(Mutex::new(b));
    let stop = Arc::new(AtomicBool::new(false));
    let (b2, s2) = (b.clone(), stop.clone());
    let t = std::thread::spawn(move || {
        // Ends when the test sets `stop` (Release below, Acquire here).
        while !s2.load(AtOrd::Acquire) {
            b2.lock().unwrap().progress().unwrap();
            std::thread::yield_now();
        }
    });
    body(&mut a, &b, pa);
    stop.store(true, AtOrd::Release);
    t.join().unwrap();
    let b = Arc::try_unwrap(b).ok().unwrap().into_inner().unwrap();
    (a, b)
}

/// Writes `n` 8-byte words one write each (far more than the provider queue), checks them.
fn many_writes(kind: Kind) {
    let n = 20_000usize;
    let src: Vec<u64> = (0..n as u64).map(|i| i * 3 + 1).collect();
    let dst = vec![0u64; n];
    // More op slots than the provider's tx queue, so the provider itself says -FI_EAGAIN.
    let t = Tuning {
        depth: Some(16384),
        ..Default::default()
    };
    let (a, _b) = with_pair(kind, &t, |a, b, pa| {
        let (_, blob) = b.lock().unwrap().register(region(&dst)).unwrap();
        let d = a.import(pa, &blob).unwrap();
        let s = a.register(region(&src)).unwrap().0;
        for i in 0..n as u64 {
            a.write(pa, s, i * 8, d, i * 8, 8).unwrap();
        }
        a.flush(pa).unwrap();
        let t0 = Instant::now();
        // Ends when the last word arrives (ordered writes) or after 20 s.
        while word(&dst, n - 1) != src[n - 1] {
            a.progress().unwrap();
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "last word never arrived"
            );
            std::thread::yield_now();
        }
    });
    for (i, want) in src.iter().enumerate() {
        assert_eq!(word(&dst, i), *want, "word {i}");
    }
    let s = a.stats();
    // n writes and the flush's delivery marker.
    assert_eq!(s.posted, n as u64 + 1);
    assert_eq!(s.completed, n as u64 + 1);
    assert!(
        s.eagain > 0,
        "{kind:?}: expected the provider to answer -FI_EAGAIN at least once: {s:?}"
    );
    assert_eq!(a.outstanding, 0);
}

#[test]
fn eagain_is_retried_not_dropped_tcp() {
    many_writes(Kind::Tcp);
}

#[test]
fn eagain_is_retried_not_dropped_shm() {
    many_writes(Kind::Shm);
}

#[test]
fn large_writes_are_chunked() {
    for kind in [Kind::Tcp, Kind::Shm] {
        let t = Tuning {
            max_chunk: Some(64 << 10),
            depth: Some(4),
            ..Default::default()
        };
        let len = (1 << 20) / 8 + 3; // words
        let src: Vec<u64> = (0..len as u64).map(|i| !i).collect();
        let dst = vec![0u64; len];
        let (a, _b) = with_pair(kind, &t, |a, b, pa| {
            let (_, blob) = b.lock().unwrap().register(region(&dst)).unwrap();
            let d = a.import(pa, &blob).unwrap();
            let s = a.register(region(&src)).unwrap().0;
            // Only 4 slots: posting 17 chunks needs completions in between.
            a.write(pa, s, 0, d, 0, (len * 8) as u64).unwrap();
            a.flush(pa).unwrap();
        });
        // The chunks, then the flush's delivery marker.
        assert_eq!(a.stats().posted, ((len * 8) as u64).div_ceil(64 << 10) + 1);
        // Delivery-complete writes have arrived once flushed.
        assert!(
            a.delivery_complete,
            "{kind:?} should grant FI_DELIVERY_COMPLETE"
        );
        for (i, want) in src.iter().enumerate() {
            assert_eq!(word(&dst, i), *want, "{kind:?} word {i}");
        }
    }
}

#[test]
fn forced_mr_endpoint_sequence_on_real_providers() {
    // tcp and shm answer fi_mr_bind/fi_mr_enable with -FI_ENOSYS; the forced mode runs the
    // sequence, accepts that, reads key/desc afterwards and closes MRs before the endpoint.
    for kind in [Kind::Tcp, Kind::Shm] {
        let t = Tuning {
            force_mr_endpoint: true,
            ..Default::default()
        };
        let src: Vec<u64> = (0..512).collect();
        let dst = vec![0u64; 512];
        let flag = vec![0u64; 2];
        let (a, _b) = with_pair(kind, &t, |a, b, pa| {
            assert!(a.policy.endpoint && a.policy.forced);
            let (_, blob) = b.lock().unwrap().register(region(&dst)).unwrap();
            let (_, fblob) = b.lock().unwrap().register(region(&flag)).unwrap();
            let d = a.import(pa, &blob).unwrap();
            let f = a.import(pa, &fblob).unwrap();
            let s = a.register(region(&src)).unwrap().0;
            a.write(pa, s, 0, d, 0, 4096).unwrap();
            a.write_value(pa, f, 8, 5).unwrap();
            a.flush(pa).unwrap();
        });
        assert_eq!(word(&flag, 1), 5);
        assert_eq!(word(&dst, 511), 511);
        // Drop runs mr::teardown (MRs, then the endpoint) and then the other objects.
        drop(a);
    }
}

#[test]
fn flush_of_an_unreachable_peer_times_out() {
    // A peer that never progresses: the write cannot complete (delivery-complete needs the
    // target), and flush must give up at the deadline instead of hanging.
    let mut a = open(Kind::Tcp, &Tuning::default());
    a.timeout = Duration::from_millis(300);
    let mut b = open(Kind::Tcp, &Tuning::default());
    let pa = a.add_peer(1, &b.address().unwrap()).unwrap();
    let dst = vec![0u64; 8];
    let (_, blob) = b.register(region(&dst)).unwrap();
    let d = a.import(pa, &blob).unwrap();
    let t0 = Instant::now();
    // On tcp;ofi_rxm the connection itself needs the target's progress, so the write may
    // already be the call that times out (-FI_EAGAIN until the deadline); else the flush.
    match a.write_value(pa, d, 0, 1).and_then(|_| a.flush(pa)) {
        Err(Error::Timeout { .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(t0.elapsed() >= Duration::from_millis(300));
    // Both close cleanly (bounded drain) even with a write in flight.
    drop(b);
    drop(a);
}

/// The fallbacks for providers without WAW ordering, forced on providers that have it: the
/// flag with FI_FENCE, and the flag after draining every earlier write.
#[test]
fn fence_and_drain_orderings_deliver_data_before_flag() {
    for kind in [Kind::Tcp, Kind::Shm] {
        for ordering in [Ordering::Fence, Ordering::Drain] {
            let n = 32 << 10; // words
            let mut src = vec![0u64; n];
            let dst = vec![0u64; n];
            let flag = vec![0u64; 2];
            let (a, _b) = with_pair(kind, &Tuning::default(), |a, b, pa| {
                a.ordering = ordering;
                let d = a
                    .import(pa, &b.lock().unwrap().register(region(&dst)).unwrap().1)
                    .unwrap();
                let f = a
                    .import(pa, &b.lock().unwrap().register(region(&flag)).unwrap().1)
                    .unwrap();
                let s = a.register(region(&src)).unwrap().0;
                for r in 1..=10u64 {
                    // Same source buffer each round: its writes completed at the last flush.
                    for (i, w) in src.iter_mut().enumerate() {
                        *w = r * 1_000_000 + i as u64;
                    }
                    a.write(pa, s, 0, d, 0, (n * 8) as u64).unwrap();
                    a.write_value(pa, f, 8, r).unwrap();
                    // The flag arrived => all data of this round arrived.
                    let t0 = Instant::now();
                    while word(&flag, 1) != r {
                        a.progress().unwrap();
                        assert!(t0.elapsed() < Duration::from_secs(20));
                        std::thread::yield_now();
                    }
                    for i in (0..n).step_by(97).chain([n - 1]) {
                        assert_eq!(
                            word(&dst, i),
                            r * 1_000_000 + i as u64,
                            "{kind:?} {ordering:?} round {r} word {i}"
                        );
                    }
                    a.flush(pa).unwrap();
                }
            });
            assert_eq!(a.outstanding, 0);
        }
    }
}

/// A write the target rejects comes back as an error (an error completion naming the peer, or
/// at worst the bounded timeout), not as a hang or a silent success.
#[test]
fn rejected_write_is_an_error() {
    for kind in [Kind::Shm, Kind::Tcp] {
        for bad_key in [true, false] {
            let dst = vec![0u64; 64];
            let (a, _b) = with_pair(kind, &Tuning::default(), |a, b, pa| {
                // tcp answers with an error completion quickly (but its connection setup may be
                // slow on a loaded machine); shm never answers, so its wait is kept short.
                a.timeout = match kind {
                    Kind::Tcp => Duration::from_secs(20),
                    Kind::Shm => Duration::from_millis(500),
                };
                let (_, blob) = b.lock().unwrap().register(region(&dst)).unwrap();
                let mut mb = MrBlob::decode(&blob, a.policy.virt_addr, a.policy.key_size).unwrap();
                let off = if bad_key {
                    mb.key ^= 0x5555;
                    0
                } else {
                    // Claim a larger region than registered and write past the real end.
                    mb.len = 1 << 20;
                    1 << 19
                };
                let d = a.import(pa, &mb.encode()).unwrap();
                match (kind, a.write_value(pa, d, off, 1).and_then(|_| a.flush(pa))) {
                    // tcp;ofi_rxm reports an error completion (-FI_ECANCELED).
                    (Kind::Tcp, Err(Error::Fabric { call, .. })) => {
                        assert!(call.contains("rank 1"), "{call}")
                    }
                    // shm drops the write at the target without telling the initiator: the
                    // delivery-complete flag then never completes, and the flush deadline
                    // reports it.
                    (Kind::Shm, Err(Error::Timeout { what, .. })) => {
                        assert!(what.contains("rank 1"), "{what}")
                    }
                    (k, other) => {
                        panic!("{k:?} bad_key={bad_key}: expected an error, got {other:?}")
                    }
                }
            });
            // Retired (tcp) or still in flight at close (shm): either way no slot leaks into a
            // later operation, and the drop above closed everything.
            assert!(a.outstanding <= 1);
        }
    }
}
