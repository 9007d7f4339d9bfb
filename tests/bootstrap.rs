//! Integration tests of the TCP bootstrap (`mscclpp::bootstrap`) and of the C entry points
//! that use it. Ranks are threads unless a test needs a process to die or its own
//! process-wide timeout; those re-run this binary as a child with `BOOT_TEST_ROLE` set (see
//! `child_entry`).

use mscclpp::abi::{mscclppResult_t, mscclppUniqueId, MSCCLPP_UNIQUE_ID_BYTES};
use mscclpp::bootstrap::{self, frame, Bootstrap};
use mscclpp::capi::comm as c;
use mscclpp::error::Error;
use std::ffi::CString;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// A port that was free a moment ago.
fn free_port(host: &str) -> u16 {
    TcpListener::bind((host, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn local_addr() -> String {
    format!("127.0.0.1:{}", free_port("127.0.0.1"))
}

/// Runs `f(bootstrap)` on `n` rank threads that join `addr`; returns the results by rank.
fn with_ranks<T: Send + 'static>(
    addr: &str,
    n: usize,
    f: impl Fn(Bootstrap) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let hs: Vec<_> = (0..n)
        .map(|r| {
            let (addr, f) = (addr.to_string(), f.clone());
            std::thread::spawn(move || {
                let b = Bootstrap::from_addr(&addr, r, n)
                    .unwrap_or_else(|e| panic!("rank {r}/{n} at {addr}: {e}"));
                assert_eq!((b.rank(), b.nranks()), (r, n));
                f(b)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn pattern(rank: usize, i: usize, round: usize) -> u8 {
    (rank * 31 + i * 7 + round * 13) as u8
}

fn check_all_gather(b: &Bootstrap, per_rank: usize, round: usize) {
    let n = b.nranks();
    let mut data = vec![0xEEu8; per_rank * n];
    for i in 0..per_rank {
        data[b.rank() * per_rank + i] = pattern(b.rank(), i, round);
    }
    b.all_gather(&mut data).unwrap();
    for r in 0..n {
        for i in 0..per_rank {
            assert_eq!(
                data[r * per_rank + i],
                pattern(r, i, round),
                "rank {} sees slice {r} byte {i} wrong",
                b.rank()
            );
        }
    }
}

#[test]
fn all_gather_1_2_4_8_ranks() {
    for n in [1, 2, 4, 8] {
        with_ranks(&local_addr(), n, |b| {
            for (round, size) in [1, 13, 4096, 300_000].into_iter().enumerate() {
                check_all_gather(&b, size, round);
            }
            // Empty slices are legal and still synchronise.
            b.all_gather(&mut []).unwrap();
            let mut odd = vec![0u8; b.nranks() * 3 + 1];
            if b.nranks() > 1 {
                assert!(matches!(
                    b.all_gather(&mut odd),
                    Err(Error::InvalidArgument(_))
                ));
            }
            check_all_gather(&b, 5, 9);
        });
    }
}

#[test]
fn barrier_holds_everyone() {
    let n = 4;
    let arrived = Arc::new(AtomicUsize::new(0));
    let a = arrived.clone();
    with_ranks(&local_addr(), n, move |b| {
        for round in 1..=5 {
            if b.rank() == round % n {
                std::thread::sleep(Duration::from_millis(30));
            }
            a.fetch_add(1, Ordering::SeqCst);
            b.barrier().unwrap();
            assert!(
                a.load(Ordering::SeqCst) >= round * n,
                "rank {} left early",
                b.rank()
            );
        }
    });
    assert_eq!(arrived.load(Ordering::SeqCst), 5 * n);
}

fn msg(src: usize, dst: usize, tag: u64) -> Vec<u8> {
    let mut v = format!("{src}->{dst}#{tag}").into_bytes();
    if tag == 3 {
        v.resize(1 << 20, (src + dst) as u8);
    }
    if tag == 4 {
        v.clear();
    }
    v
}

#[test]
fn send_recv_any_order_of_tags_and_peers() {
    let n = 4;
    with_ranks(&local_addr(), n, move |b| {
        let me = b.rank();
        for peer in 0..n {
            for tag in 0..6u64 {
                b.send(peer, tag, &msg(me, peer, tag)).unwrap();
            }
        }
        for peer in (0..n).rev() {
            for tag in (0..6u64).rev() {
                assert_eq!(b.recv(peer, tag).unwrap(), msg(peer, me, tag));
            }
        }
        // Equal tags arrive in the order sent; large tags are fine.
        let big = u64::MAX - 1;
        let to = (me + 1) % n;
        let from = (me + n - 1) % n;
        b.send(to, big, b"first").unwrap();
        b.send(to, big, b"second").unwrap();
        assert_eq!(b.recv(from, big).unwrap(), b"first");
        assert_eq!(b.recv(from, big).unwrap(), b"second");
        assert!(matches!(b.send(n, 0, b"x"), Err(Error::InvalidArgument(_))));
        assert!(matches!(b.recv(n, 0), Err(Error::InvalidArgument(_))));
        b.barrier().unwrap();
    });
}

#[test]
fn sends_do_not_wait_for_receivers() {
    // Both ranks send 3 x 16 MiB before either receives: a send that waited for the matching
    // receive would deadlock here (and fail at the timeout).
    with_ranks(&local_addr(), 2, |b| {
        let peer = 1 - b.rank();
        let big = vec![b.rank() as u8 + 1; 16 << 20];
        for tag in 0..3 {
            b.send(peer, tag, &big).unwrap();
        }
        for tag in (0..3).rev() {
            let m = b.recv(peer, tag).unwrap();
            assert_eq!(m.len(), 16 << 20);
            assert!(m.iter().all(|&x| x == peer as u8 + 1));
        }
        b.barrier().unwrap();
    });
}

#[test]
fn root_may_start_last() {
    let n = 4;
    let addr = local_addr();
    let hs: Vec<_> = (0..n)
        .rev()
        .map(|r| {
            let a = addr.clone();
            let h = std::thread::spawn(move || {
                let b = Bootstrap::from_addr(&a, r, n).unwrap();
                check_all_gather(&b, 4, 3);
            });
            if r == 1 {
                // Ranks 3..1 are already retrying their connects when rank 0 starts.
                std::thread::sleep(Duration::from_millis(300));
            }
            h
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

#[test]
fn mismatched_all_gather_sizes_fail_everywhere() {
    let res = with_ranks(&local_addr(), 2, |b| {
        let mut d = vec![0u8; 2 * (4 + 4 * b.rank())];
        let r = b.all_gather(&mut d).map_err(|e| e.to_string());
        // The failure is sticky.
        assert!(b.barrier().is_err());
        r
    });
    for r in res {
        assert!(r.is_err(), "{r:?}");
    }
}

#[test]
fn ipv6_loopback() {
    let Ok(l) = TcpListener::bind("[::1]:0") else {
        println!("SKIPPED: ::1 is not available here");
        return;
    };
    let addr = format!("[::1]:{}", l.local_addr().unwrap().port());
    drop(l);
    with_ranks(&addr, 3, |b| check_all_gather(&b, 64, 0));
}

#[test]
fn hostname_localhost() {
    let addr = format!("localhost:{}", free_port("127.0.0.1"));
    with_ranks(&addr, 3, |b| {
        check_all_gather(&b, 8, 1);
        b.barrier().unwrap();
    });
}

#[test]
fn malformed_input_is_invalid_argument_at_once() {
    let t = Instant::now();
    for bad in [
        "",
        "127.0.0.1",
        "127.0.0.1:",
        ":5000",
        "127.0.0.1:0",
        "127.0.0.1:65536",
        "127.0.0.1:-1",
        "127.0.0.1:abc",
        "::1:5000",
        "[::1]",
        "[::1:5000",
        "[zz]:5000",
        "300.1.1.1:80",
        "host name:80",
        " 127.0.0.1:5000",
        "http://x:80",
    ] {
        for rank in [0, 1] {
            match Bootstrap::from_addr(bad, rank, 2) {
                Err(Error::InvalidArgument(m)) => assert!(!m.is_empty()),
                other => panic!("{bad:?} as rank {rank}: {:?}", other.map(|_| ())),
            }
        }
    }
    let a = local_addr();
    assert!(matches!(
        Bootstrap::from_addr(&a, 2, 2),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Bootstrap::from_addr(&a, 0, 0),
        Err(Error::InvalidArgument(_))
    ));
    let mut id = [0u8; MSCCLPP_UNIQUE_ID_BYTES];
    assert!(matches!(
        Bootstrap::from_id(&id, 0, 1),
        Err(Error::InvalidArgument(_))
    ));
    id.fill(0xA5);
    assert!(matches!(
        Bootstrap::from_id(&id, 0, 1),
        Err(Error::InvalidArgument(_))
    ));
    let mut good = bootstrap::new_unique_id().unwrap();
    good[5] ^= 1;
    assert!(matches!(
        Bootstrap::from_id(&good, 0, 1),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        bootstrap::set_timeout(0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        bootstrap::set_timeout(-5),
        Err(Error::InvalidArgument(_))
    ));
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn unique_id_joins() {
    let id = bootstrap::new_unique_id().unwrap();
    assert_ne!(id, bootstrap::new_unique_id().unwrap());
    let n = 3;
    let hs: Vec<_> = (0..n)
        .map(|r| {
            std::thread::spawn(move || {
                let b = Bootstrap::from_id(&id, r, n).unwrap();
                check_all_gather(&b, 10, 2);
                b.send((r + 1) % n, 7, &[r as u8]).unwrap();
                assert_eq!(
                    b.recv((r + n - 1) % n, 7).unwrap(),
                    [((r + n - 1) % n) as u8]
                );
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

#[test]
fn communicators_side_by_side_and_one_after_another() {
    let (a1, a2) = (local_addr(), local_addr());
    let t1 = std::thread::spawn(move || with_ranks(&a1, 3, |b| check_all_gather(&b, 100, 1)));
    let t2 = std::thread::spawn(move || with_ranks(&a2, 4, |b| check_all_gather(&b, 50, 2)));
    t1.join().unwrap();
    t2.join().unwrap();
    // The same root address again, twice, right after the previous communicator finished.
    let a = local_addr();
    for round in 0..2 {
        with_ranks(&a, 3, move |b| check_all_gather(&b, 20, round));
    }
}

#[test]
fn port_already_taken_is_system_error() {
    let holder = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = holder.local_addr().unwrap().to_string();
    for n in [1, 3] {
        match Bootstrap::from_addr(&addr, 0, n) {
            Err(e @ Error::System { .. }) => {
                let m = e.to_string();
                assert!(m.contains(&addr), "message does not name {addr}: {m}");
            }
            other => panic!("expected a System error, got {:?}", other.map(|_| ())),
        }
    }
}

#[test]
fn rank_dropped_after_init_fails_the_others() {
    let n = 4;
    let addr = local_addr();
    let gate = Arc::new(Barrier::new(n));
    let t = Instant::now();
    let res = with_ranks(&addr, n, move |b| {
        if b.rank() == 2 {
            drop(b);
            gate.wait();
            return None;
        }
        gate.wait();
        let mut d = vec![0u8; 4 * n];
        Some(b.all_gather(&mut d).map_err(|e| e.to_string()))
    });
    for (r, x) in res.into_iter().enumerate() {
        if let Some(x) = x {
            let m = x.expect_err("all-gather without rank 2 succeeded");
            assert!(
                m.contains("rank 2"),
                "rank {r}: error does not name rank 2: {m}"
            );
        }
    }
    // Nobody waited for the 30 s default timeout.
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
}

/// Reads one frame header from a root that rejected us, or EOF.
fn root_reply(s: &mut TcpStream) -> Option<(u32, String)> {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut h = [0u8; frame::HEADER_LEN];
    if s.read_exact(&mut h).is_err() {
        return None;
    }
    let kind = u32::from_le_bytes(h[8..12].try_into().unwrap());
    let len = u64::from_le_bytes(h[24..32].try_into().unwrap()) as usize;
    assert!(len <= frame::MAX_ABORT_LEN);
    let mut p = vec![0u8; len];
    s.read_exact(&mut p).unwrap();
    Some((kind, String::from_utf8_lossy(&p).into_owned()))
}

fn connect_until_up(addr: &str) -> TcpStream {
    let t = Instant::now();
    // Ends: connected, or panics after 10 s.
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => return s,
            Err(_) if t.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("root at {addr} never came up: {e}"),
        }
    }
}

#[test]
fn strangers_at_the_root_do_not_stop_real_ranks() {
    let n = 3;
    let addr = local_addr();
    let magic = frame::addr_magic(&addr, n);
    let hello = |rank: u32, nranks: u64| {
        let mut p = nranks.to_le_bytes().to_vec();
        p.extend_from_slice(&frame::encode_addr(&"127.0.0.1:9".parse().unwrap()));
        frame::encode_frame(magic, frame::Kind::Hello, rank, 0, &p)
    };
    let spawn = |r: usize| {
        let a = addr.clone();
        std::thread::spawn(move || {
            let b = Bootstrap::from_addr(&a, r, n).unwrap();
            check_all_gather(&b, 33, 4);
            b.barrier().unwrap();
        })
    };
    let mut ranks = vec![spawn(0), spawn(1)];
    // A client that connects and stays silent must not stall anyone.
    let idle = connect_until_up(&addr);
    let mut strays: Vec<(&str, Vec<u8>, bool)> = vec![
        (
            "garbage",
            b"GET / HTTP/1.0\r\n\r\n and then some more bytes".to_vec(),
            false,
        ),
        (
            "wrong magic",
            frame::encode_frame(magic ^ 1, frame::Kind::Hello, 1, 0, &[0; frame::HELLO_LEN]),
            false,
        ),
        ("truncated", hello(2, n as u64)[..40].to_vec(), false),
        (
            "oversized",
            frame::encode_raw(magic, frame::Kind::Hello as u32, 1, 0, 1 << 40).to_vec(),
            true,
        ),
        (
            "wrong kind",
            frame::encode_raw(magic, frame::Kind::P2p as u32, 1, 0, 8).to_vec(),
            true,
        ),
        ("rank out of range", hello(7, n as u64), true),
        ("nranks mismatch", hello(2, 5), true),
    ];
    strays.push((
        "bad address",
        {
            let mut f = hello(2, n as u64);
            f[frame::HEADER_LEN + 8] = 9;
            f
        },
        true,
    ));
    for (what, bytes, told) in strays {
        let mut s = connect_until_up(&addr);
        s.write_all(&bytes).unwrap();
        if what == "truncated" {
            // Half a frame, then close: the root must drop it, not wait.
            drop(s);
            continue;
        }
        match root_reply(&mut s) {
            Some((kind, why)) => {
                assert!(told, "{what}: a stranger was told {why:?}");
                assert_eq!(kind, frame::Kind::Abort as u32, "{what}");
                assert!(!why.is_empty());
            }
            None => assert!(!told, "{what}: the root closed without saying why"),
        }
    }
    ranks.push(spawn(2));
    for h in ranks {
        h.join().unwrap();
    }
    drop(idle);
}

// ----- peer loss -------------------------------------------------------------------------

/// Polls `lost_peer` every 10 ms until it reports a loss or `bound` passes.
fn poll_lost(b: &Bootstrap, bound: Duration) -> Option<(usize, String)> {
    let t = Instant::now();
    // Ends: a loss is reported, or at `bound`.
    loop {
        if let Some(l) = b.lost_peer() {
            return Some(l);
        }
        if t.elapsed() >= bound {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn watch_peers_arguments() {
    with_ranks(&local_addr(), 3, |b| {
        let n = b.nranks();
        assert!(matches!(
            b.watch_peers(&[n]),
            Err(Error::InvalidArgument(_))
        ));
        // Nothing, or only this rank: nothing to wait for.
        b.watch_peers(&[]).unwrap();
        b.watch_peers(&[b.rank()]).unwrap();
        // Duplicates and this rank are ignored; a second call with the same peers is harmless.
        let others: Vec<usize> = (0..n).filter(|&p| p != b.rank()).collect();
        let mut with_dups = others.clone();
        with_dups.extend(&others);
        with_dups.push(b.rank());
        b.watch_peers(&with_dups).unwrap();
        b.watch_peers(&others).unwrap();
        assert_eq!(b.lost_peer(), None);
        b.barrier().unwrap();
    });
}

#[test]
fn goodbye_among_three_threads_is_not_a_loss() {
    let n = 3;
    let left = Arc::new(Barrier::new(n));
    let res = with_ranks(&local_addr(), n, move |b| {
        let me = b.rank();
        let others: Vec<usize> = (0..n).filter(|&p| p != me).collect();
        b.watch_peers(&others).unwrap();
        if me == 2 {
            // Destroyed normally: says goodbye to ranks 0 and 1.
            drop(b);
            left.wait();
            return (0, None);
        }
        // A proxy-like thread polls lost_peer through an Arc while this thread keeps using
        // the bootstrap.
        let b = Arc::new(b);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let poller = {
            let (b, stop) = (b.clone(), stop.clone());
            std::thread::spawn(move || {
                let (mut polls, mut seen) = (0usize, None);
                // Ends: when the API thread sets `stop`.
                while !stop.load(Ordering::Relaxed) {
                    polls += 1;
                    if let Some(l) = b.lost_peer() {
                        seen.get_or_insert(l);
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                (polls, seen)
            })
        };
        left.wait();
        // Fails at once (not at the timeout) and says why: rank 2's goodbye, then its close,
        // have been read by the time this returns.
        let t = Instant::now();
        let e = b.recv(2, 99).unwrap_err().to_string();
        assert!(e.contains("rank 2") && e.contains("goodbye"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        let peer = 1 - me;
        for tag in 0..20u64 {
            b.send(peer, tag, &[me as u8; 100]).unwrap();
            assert_eq!(b.recv(peer, tag).unwrap(), vec![peer as u8; 100]);
            std::thread::sleep(Duration::from_millis(15));
        }
        stop.store(true, Ordering::Relaxed);
        let (polls, seen) = poller.join().unwrap();
        assert_eq!(b.lost_peer(), None);
        (polls, seen)
    });
    for (r, (polls, seen)) in res.into_iter().enumerate().take(2) {
        assert_eq!(seen, None, "rank {r} reported a loss");
        assert!(polls > 5, "rank {r}: the poller ran {polls} times");
    }
}

#[test]
fn new_frame_kinds_with_payloads_are_rejected() {
    use frame::{Expect, FrameError, Kind};
    let e = Expect {
        magic: 42,
        nranks: 4,
        from: Some(3),
        kinds: &[Kind::Watch, Kind::Bye, Kind::P2p],
    };
    for k in [Kind::Watch, Kind::Bye] {
        let ok = frame::encode_frame(42, k, 3, 0, &[]);
        let (frames, partial) = frame::decode_all(&ok, &e).unwrap();
        assert_eq!((frames.len(), partial), (1, 0));
        assert_eq!(frames[0].0.kind, k);
        for len in [1u64, 32, 1 << 20, u64::MAX] {
            let bad = frame::encode_raw(42, k as u32, 3, 0, len);
            assert!(
                matches!(
                    frame::decode_all(&bad, &e),
                    Err(FrameError::BadLength { .. })
                ),
                "{k:?} with {len} payload bytes"
            );
        }
        // Like the others: wrong sender and wrong magic are rejected too.
        assert!(frame::decode_all(&frame::encode_frame(42, k, 2, 0, &[]), &e).is_err());
        assert!(frame::decode_all(&frame::encode_frame(43, k, 3, 0, &[]), &e).is_err());
    }
}

// ----- the C API -------------------------------------------------------------------------

#[test]
fn capi_three_ranks() {
    let n = 3;
    let addr = CString::new(local_addr()).unwrap();
    let hs: Vec<_> = (0..n)
        .map(|r| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut comm = std::ptr::null_mut();
                let rc = c::mscclppCommInitRank(&mut comm, n, addr.as_ptr(), r);
                assert_eq!(rc, mscclppResult_t::mscclppSuccess);
                assert!(!comm.is_null());
                let (mut rank, mut size) = (-1, -1);
                assert_eq!(
                    c::mscclppCommRank(comm, &mut rank),
                    mscclppResult_t::mscclppSuccess
                );
                assert_eq!(
                    c::mscclppCommSize(comm, &mut size),
                    mscclppResult_t::mscclppSuccess
                );
                assert_eq!((rank, size), (r, n));
                let mut data = vec![0u32; n as usize * 2];
                data[r as usize * 2] = 100 + r as u32;
                data[r as usize * 2 + 1] = 200 + r as u32;
                let rc = c::mscclppBootstrapAllGather(comm, data.as_mut_ptr().cast(), 8);
                assert_eq!(rc, mscclppResult_t::mscclppSuccess);
                for q in 0..n as usize {
                    assert_eq!(&data[q * 2..q * 2 + 2], &[100 + q as u32, 200 + q as u32]);
                }
                assert_eq!(
                    c::mscclppBootstrapBarrier(comm),
                    mscclppResult_t::mscclppSuccess
                );
                assert_eq!(c::mscclppCommDestroy(comm), mscclppResult_t::mscclppSuccess);
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

#[test]
fn capi_unique_id_two_ranks() {
    let mut id = mscclppUniqueId {
        internal: [0; MSCCLPP_UNIQUE_ID_BYTES],
    };
    assert_eq!(
        c::mscclppGetUniqueId(&mut id),
        mscclppResult_t::mscclppSuccess
    );
    let hs: Vec<_> = (0..2)
        .map(|r| {
            let id = mscclppUniqueId {
                internal: id.internal,
            };
            std::thread::spawn(move || {
                let mut comm = std::ptr::null_mut();
                let rc = c::mscclppCommInitRankFromId(&mut comm, 2, id, r);
                assert_eq!(rc, mscclppResult_t::mscclppSuccess);
                assert_eq!(
                    c::mscclppBootstrapBarrier(comm),
                    mscclppResult_t::mscclppSuccess
                );
                assert_eq!(c::mscclppCommDestroy(comm), mscclppResult_t::mscclppSuccess);
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

#[test]
fn capi_bad_input_then_still_usable() {
    use mscclppResult_t::mscclppInvalidArgument as Inval;
    let addr = CString::new(local_addr()).unwrap();
    let mut comm = std::ptr::null_mut();
    assert_eq!(
        c::mscclppCommInitRank(std::ptr::null_mut(), 1, addr.as_ptr(), 0),
        Inval
    );
    assert_eq!(
        c::mscclppCommInitRank(&mut comm, 1, std::ptr::null(), 0),
        Inval
    );
    assert_eq!(
        c::mscclppCommInitRank(&mut comm, 0, addr.as_ptr(), 0),
        Inval
    );
    assert_eq!(
        c::mscclppCommInitRank(&mut comm, -3, addr.as_ptr(), 0),
        Inval
    );
    assert_eq!(
        c::mscclppCommInitRank(&mut comm, 2, addr.as_ptr(), 2),
        Inval
    );
    assert_eq!(
        c::mscclppCommInitRank(&mut comm, 2, addr.as_ptr(), -1),
        Inval
    );
    for bad in ["127.0.0.1", "127.0.0.1:99999", "nonsense", "[::1:80"] {
        let b = CString::new(bad).unwrap();
        assert_eq!(
            c::mscclppCommInitRank(&mut comm, 1, b.as_ptr(), 0),
            Inval,
            "{bad}"
        );
    }
    assert!(comm.is_null(), "comm written on failure");
    assert_eq!(c::mscclppGetUniqueId(std::ptr::null_mut()), Inval);
    let garbage = mscclppUniqueId {
        internal: [7; MSCCLPP_UNIQUE_ID_BYTES],
    };
    assert_eq!(
        c::mscclppCommInitRankFromId(&mut comm, 1, garbage, 0),
        Inval
    );
    assert_eq!(c::mscclppSetBootstrapConnTimeout(0), Inval);
    assert_eq!(c::mscclppSetBootstrapConnTimeout(-1), Inval);
    assert!(comm.is_null());
    // Still usable: a real communicator, bad collective arguments on it, then destroy.
    assert_eq!(
        c::mscclppCommInitRank(&mut comm, 1, addr.as_ptr(), 0),
        mscclppResult_t::mscclppSuccess
    );
    let mut x = [1u8; 4];
    assert_eq!(
        c::mscclppBootstrapAllGather(comm, std::ptr::null_mut(), 4),
        Inval
    );
    assert_eq!(
        c::mscclppBootstrapAllGather(comm, x.as_mut_ptr().cast(), 0),
        Inval
    );
    assert_eq!(
        c::mscclppBootstrapAllGather(comm, x.as_mut_ptr().cast(), 4),
        mscclppResult_t::mscclppSuccess
    );
    assert_eq!(
        c::mscclppBootstrapBarrier(comm),
        mscclppResult_t::mscclppSuccess
    );
    assert_eq!(c::mscclppCommDestroy(comm), mscclppResult_t::mscclppSuccess);
    assert_eq!(c::mscclppBootstrapBarrier(comm), Inval, "destroyed handle");
}

// ----- tests in child processes ----------------------------------------------------------

/// Re-runs this test binary with only `child_entry` and `BOOT_TEST_ROLE=role`.
fn child(role: &str, envs: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "child_entry",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("BOOT_TEST_ROLE", role)
    .env_remove("MSCCLPP_BOOTSTRAP_TIMEOUT")
    .env_remove("MSCCLPP_SOCKET_IFNAME");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd
}

fn run_child(role: &str, envs: &[(&str, &str)]) {
    let out = child(role, envs).output().unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child {role} failed:\n{text}");
    assert!(
        text.contains(&format!("CHILD {role} OK")),
        "child {role} did not run:\n{text}"
    );
}

#[test]
fn timeouts_in_a_child() {
    run_child("timeouts", &[("MSCCLPP_BOOTSTRAP_TIMEOUT", "7")]);
}

#[test]
fn env_timeout_alone_bounds_an_absent_root() {
    run_child("env_timeout", &[("MSCCLPP_BOOTSTRAP_TIMEOUT", "1")]);
}

#[test]
fn socket_ifname_in_a_child() {
    run_child("ifname_lo", &[("MSCCLPP_SOCKET_IFNAME", "lo")]);
    run_child("ifname_none", &[("MSCCLPP_SOCKET_IFNAME", "=no-such-if9")]);
}

#[test]
fn no_thread_or_fd_leaks_in_a_child() {
    run_child("leaks", &[]);
}

#[test]
fn killed_rank_process_fails_the_others() {
    let n = 3;
    let addr = local_addr();
    let mut kid = child("rank2", &[("BOOT_TEST_ADDR", &addr)])
        .stdout(Stdio::piped())
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let gate = Arc::new(Barrier::new(n));
    let g2 = gate.clone();
    let a2 = addr.clone();
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            let (a, g) = (a2.clone(), g2.clone());
            std::thread::spawn(move || {
                let b = Bootstrap::from_addr(&a, r, n).unwrap();
                g.wait();
                let mut d = vec![0u8; 3 * n];
                b.all_gather(&mut d).map_err(|e| e.to_string())
            })
        })
        .collect();
    // Wait for the child to finish joining, then kill it before the all-gather.
    let mut lines = BufReader::new(kid.stdout.take().unwrap()).lines();
    let t = Instant::now();
    // Ends: at the child's line, or panics when its stdout closes (it exited).
    loop {
        let l = lines.next().expect("child exited before joining").unwrap();
        if l.contains("RANK2 JOINED") {
            break;
        }
    }
    kid.kill().unwrap();
    kid.wait().unwrap();
    gate.wait();
    for (r, h) in ranks.into_iter().enumerate() {
        let m = h
            .join()
            .unwrap()
            .expect_err("all-gather with a dead rank succeeded");
        assert!(
            m.contains("rank 2"),
            "rank {r}: error does not name rank 2: {m}"
        );
    }
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
}

/// Runs rank 0 here and rank 1 as a child with `role`; both watch each other. Returns rank 0
/// and the child, whose stdout has shown "WATCHED".
fn watched_child(role: &str) -> (Bootstrap, std::process::Child) {
    let addr = local_addr();
    let mut kid = child(role, &[("BOOT_TEST_ADDR", &addr)])
        .stdout(Stdio::piped())
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let b = Bootstrap::from_addr(&addr, 0, 2).unwrap();
    b.watch_peers(&[1]).unwrap();
    let mut lines = BufReader::new(kid.stdout.take().unwrap()).lines();
    // Ends: at the child's line, or panics when its stdout closes (it exited).
    loop {
        let l = lines.next().expect("child exited before watching").unwrap();
        if l.contains("WATCHED") {
            break;
        }
    }
    // Keep draining its stdout, so that it never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    (b, kid)
}

fn check_reported_lost(b: &Bootstrap, kid: &mut std::process::Child, how: &str) {
    let t = Instant::now();
    let lost = poll_lost(b, Duration::from_secs(10));
    let el = t.elapsed();
    let status = kid.wait().unwrap();
    assert!(!status.success(), "{how}: child exited with {status}");
    let (p, why) = lost.unwrap_or_else(|| panic!("{how}: no loss reported within 10 s"));
    println!("{how}: loss reported after {el:?}: {why}");
    assert_eq!(p, 1, "{why}");
    assert!(why.contains("rank 1") && why.contains("goodbye"), "{why}");
    // It stays reported, and bootstrap calls that wait on rank 1 fail at once.
    assert_eq!(b.lost_peer().map(|l| l.0), Some(1));
    let e = b.recv(1, 5).unwrap_err().to_string();
    assert!(e.contains("rank 1"), "{e}");
}

#[test]
fn aborted_child_is_reported_lost() {
    let (b, mut kid) = watched_child("watch_abort");
    check_reported_lost(&b, &mut kid, "abort()");
}

#[test]
fn sigkilled_child_is_reported_lost() {
    let (b, mut kid) = watched_child("watch_wait");
    assert_eq!(b.lost_peer(), None);
    kid.kill().unwrap();
    check_reported_lost(&b, &mut kid, "SIGKILL");
}

#[test]
fn child_saying_goodbye_is_not_lost() {
    let (b, mut kid) = watched_child("watch_bye");
    // The child drops its bootstrap when its stdin closes, then exits 0.
    drop(kid.stdin.take());
    let status = kid.wait().unwrap();
    assert!(status.success(), "child exited with {status}");
    // Its last message arrived before its goodbye.
    assert_eq!(b.recv(1, 7).unwrap(), b"last words");
    let t = Instant::now();
    assert_eq!(poll_lost(&b, Duration::from_millis(500)), None);
    assert!(t.elapsed() >= Duration::from_millis(500));
    let e = b.recv(1, 8).unwrap_err().to_string();
    assert!(e.contains("goodbye"), "{e}");
}

fn role_watch(addr: &str) -> Bootstrap {
    let b = Bootstrap::from_addr(addr, 1, 2).unwrap();
    b.watch_peers(&[0]).unwrap();
    println!("WATCHED");
    std::io::stdout().flush().unwrap();
    b
}

fn role_watch_abort() {
    let _b = role_watch(&std::env::var("BOOT_TEST_ADDR").unwrap());
    // No core file for this deliberate crash.
    let no_core = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: setrlimit reads a valid rlimit.
    unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
    std::process::abort();
}

fn role_watch_wait() {
    let b = role_watch(&std::env::var("BOOT_TEST_ADDR").unwrap());
    // Wait to be killed (or for the parent to go away).
    let mut s = String::new();
    let _ = std::io::stdin().read_line(&mut s);
    drop(b);
}

fn role_watch_bye() {
    let b = role_watch(&std::env::var("BOOT_TEST_ADDR").unwrap());
    b.send(0, 7, b"last words").unwrap();
    // Ends: when the parent closes our stdin.
    let mut s = String::new();
    let _ = std::io::stdin().read_line(&mut s);
    drop(b);
}

fn role_timeouts() {
    // The environment overrides the default, set_timeout overrides the environment.
    assert_eq!(bootstrap::timeout(), Duration::from_secs(7));
    bootstrap::set_timeout(1).unwrap();
    assert_eq!(bootstrap::timeout(), Duration::from_secs(1));
    let limit = Duration::from_secs(10);

    // No root ever appears.
    let t = Instant::now();
    let r = Bootstrap::from_addr(&local_addr(), 1, 2);
    let el = t.elapsed();
    println!("absent root: {el:?}: {:?}", r.as_ref().map(|_| ()));
    assert!(
        matches!(r, Err(Error::Timeout { .. })),
        "{:?}",
        r.map(|_| ())
    );
    assert!(el < limit, "{el:?}");

    // A rank never shows up: the ranks that did fail within the timeout.
    let addr = local_addr();
    let t = Instant::now();
    let hs: Vec<_> = (0..2)
        .map(|r| {
            let a = addr.clone();
            std::thread::spawn(move || Bootstrap::from_addr(&a, r, 3).map(|_| ()))
        })
        .collect();
    for h in hs {
        let r = h.join().unwrap();
        assert!(r.is_err(), "joined without rank 2");
        println!("missing rank: {:?}", r);
    }
    assert!(t.elapsed() < limit, "{:?}", t.elapsed());

    // A peer that never sends: recv and all-gather time out instead of hanging.
    let addr = local_addr();
    let res = with_ranks(&addr, 2, move |b| {
        let t = Instant::now();
        let r = if b.rank() == 0 {
            b.recv(1, 42).map(|_| ())
        } else {
            // Stay alive, silent, until rank 0 has given up.
            std::thread::sleep(Duration::from_millis(2500));
            Ok(())
        };
        (r.map_err(|e| e.to_string()), t.elapsed())
    });
    let (r0, el) = &res[0];
    println!("silent peer: {el:?}: {r0:?}");
    assert!(r0.as_ref().unwrap_err().contains("timed out"), "{r0:?}");
    assert!(*el < limit);

    let addr = local_addr();
    let res = with_ranks(&addr, 2, move |b| {
        if b.rank() == 0 {
            let mut d = [0u8; 2];
            let r = b.all_gather(&mut d).map_err(|e| e.to_string());
            // Sticky: the bootstrap stays failed.
            assert!(b.barrier().is_err());
            r
        } else {
            std::thread::sleep(Duration::from_millis(2500));
            Ok(())
        }
    });
    assert!(res[0].is_err(), "{:?}", res[0]);

    // A peer that never calls watch_peers: bounded by the timeout, naming the peer.
    let addr = local_addr();
    let res = with_ranks(&addr, 2, move |b| {
        let t = Instant::now();
        let r = if b.rank() == 0 {
            b.watch_peers(&[1]).map_err(|e| e.to_string())
        } else {
            std::thread::sleep(Duration::from_millis(2500));
            Ok(())
        };
        (r, t.elapsed())
    });
    let (r0, el) = &res[0];
    println!("unwatched peer: {el:?}: {r0:?}");
    let e = r0.as_ref().unwrap_err();
    assert!(e.contains("rank 1") && e.contains("timed out"), "{e}");
    assert!(*el < limit);
}

fn role_env_timeout() {
    assert_eq!(bootstrap::timeout(), Duration::from_secs(1));
    let t = Instant::now();
    let id = bootstrap::new_unique_id().unwrap();
    let r = Bootstrap::from_id(&id, 1, 2);
    assert!(
        matches!(r, Err(Error::Timeout { .. })),
        "{:?}",
        r.map(|_| ())
    );
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

fn role_ifname_lo() {
    let id = bootstrap::new_unique_id().unwrap();
    let hs: Vec<_> = (0..2)
        .map(|r| {
            std::thread::spawn(move || Bootstrap::from_id(&id, r, 2).unwrap().barrier().unwrap())
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

fn role_ifname_none() {
    match bootstrap::new_unique_id() {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("no-such-if9"), "{m}"),
        other => panic!("{other:?}"),
    }
}

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).unwrap().count()
}

fn role_leaks() {
    let cycle = || {
        with_ranks(&local_addr(), 3, |b| {
            check_all_gather(&b, 16, 0);
            b.send((b.rank() + 1) % 3, 1, b"x").unwrap();
            b.recv((b.rank() + 2) % 3, 1).unwrap();
            b.barrier().unwrap();
        });
    };
    cycle();
    let (threads, fds) = (count("/proc/self/task"), count("/proc/self/fd"));
    for _ in 0..20 {
        cycle();
    }
    // Threads exit a moment after join() returns in some kernels' accounting; give it a bit.
    let t = Instant::now();
    while count("/proc/self/task") != threads && t.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(count("/proc/self/task"), threads, "threads leaked");
    assert_eq!(count("/proc/self/fd"), fds, "file descriptors leaked");
}

fn role_rank2() {
    let addr = std::env::var("BOOT_TEST_ADDR").unwrap();
    let b = Bootstrap::from_addr(&addr, 2, 3).unwrap();
    println!("RANK2 JOINED");
    std::io::stdout().flush().unwrap();
    // Wait to be killed (or for the parent to go away).
    let mut s = String::new();
    let _ = std::io::stdin().read_line(&mut s);
    drop(b);
}

/// Entry point of the child processes; does nothing in a normal run.
#[test]
#[ignore = "run as a child process by other tests"]
fn child_entry() {
    let Ok(role) = std::env::var("BOOT_TEST_ROLE") else {
        return;
    };
    match role.as_str() {
        "timeouts" => role_timeouts(),
        "env_timeout" => role_env_timeout(),
        "ifname_lo" => role_ifname_lo(),
        "ifname_none" => role_ifname_none(),
        "leaks" => role_leaks(),
        "rank2" => role_rank2(),
        "watch_abort" => role_watch_abort(),
        "watch_wait" => role_watch_wait(),
        "watch_bye" => role_watch_bye(),
        other => panic!("unknown role {other}"),
    }
    println!("CHILD {role} OK");
}
