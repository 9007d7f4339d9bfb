//! How ranks find each other through the bootstrap root (`mscclpp::bootstrap`): root address
//! forms (IPv4, IPv6, host names, unique ids), join order, bad input refused at once, ports in
//! use, communicators side by side, and a root that strangers and malformed frames cannot stop.
//! Ranks are threads.

mod common;

use common::boot::{check_all_gather, local_addr, with_ranks};
use common::free_port;
use mscclpp::abi::MSCCLPP_UNIQUE_ID_BYTES;
use mscclpp::bootstrap::{self, frame, Bootstrap};
use mscclpp::error::Error;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

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
    let addr = format!("localhost:{}", free_port());
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
