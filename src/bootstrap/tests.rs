//! Unit tests that need the bootstrap's internals (the root on its own, a rank's listener).
//! The wire format's property tests live in `frame/tests.rs`; end-to-end tests in
//! `tests/bootstrap_*.rs`.

use super::frame::{self, encode_addr, encode_frame, Kind, HEADER_LEN};
use super::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Instant;

#[test]
fn rank_checks() {
    assert!(check_ranks(0, 1).is_ok());
    assert!(check_ranks(1, 1).is_err());
    assert!(check_ranks(0, 0).is_err());
    assert!(check_ranks(0, MAX_RANKS + 1).is_err());
}

/// A hand-made rank talking to a root directly.
struct Raw(TcpStream);

impl Raw {
    fn connect(addr: SocketAddr) -> Raw {
        let t = Instant::now();
        // Ends: connected, or panics after 10 s.
        loop {
            match TcpStream::connect(addr) {
                Ok(s) => {
                    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                    return Raw(s);
                }
                Err(e) if t.elapsed() > Duration::from_secs(10) => panic!("{addr}: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }

    fn hello(&mut self, magic: u64, rank: u32, nranks: u64) {
        let mut p = nranks.to_le_bytes().to_vec();
        p.extend_from_slice(&encode_addr(&"127.0.0.1:9".parse().unwrap()));
        self.0
            .write_all(&encode_frame(magic, Kind::Hello, rank, 0, &p))
            .unwrap();
    }

    /// The root's reply: (kind, payload), or None on EOF.
    fn reply(&mut self) -> Option<(u32, Vec<u8>)> {
        let mut h = [0u8; HEADER_LEN];
        self.0.read_exact(&mut h).ok()?;
        let kind = u32::from_le_bytes(h[8..12].try_into().unwrap());
        let len = u64::from_le_bytes(h[24..32].try_into().unwrap()) as usize;
        assert!(len <= 1 << 20);
        let mut p = vec![0u8; len];
        self.0.read_exact(&mut p).ok()?;
        Some((kind, p))
    }
}

fn start_root(magic: u64, nranks: usize) -> (root::Root, SocketAddr) {
    // Bind-then-drop finds a free port; the root binds it again at once.
    let a = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    (
        root::Root::start(a, magic, nranks, Duration::from_secs(20)).unwrap(),
        a,
    )
}

#[test]
fn root_rejects_duplicates_and_mismatches_then_finishes() {
    let magic = 0x5151;
    let (root, a) = start_root(magic, 2);
    let mut first = Raw::connect(a);
    first.hello(magic, 1, 2);
    // Accepted in order, so the first claim to rank 1 wins and this one is refused.
    let mut dup = Raw::connect(a);
    dup.hello(magic, 1, 2);
    let (k, why) = dup.reply().expect("no reason given");
    assert_eq!(k, Kind::Abort as u32);
    assert!(
        String::from_utf8_lossy(&why).contains("duplicate rank 1"),
        "{why:?}"
    );
    let mut wrong_n = Raw::connect(a);
    wrong_n.hello(magic, 0, 3);
    let (_, why) = wrong_n.reply().unwrap();
    assert!(String::from_utf8_lossy(&why).contains("nranks"), "{why:?}");
    let mut zero = Raw::connect(a);
    zero.hello(magic, 0, 2);
    for r in [&mut first, &mut zero] {
        let (k, table) = r.reply().unwrap();
        assert_eq!(k, Kind::Table as u32);
        assert_eq!(table.len(), 2 * frame::ADDR_LEN);
    }
    root.finish().unwrap();
}

#[test]
fn root_aborts_when_a_joined_rank_leaves() {
    let magic = 0x7777;
    let (root, a) = start_root(magic, 3);
    let mut zero = Raw::connect(a);
    zero.hello(magic, 0, 3);
    let mut two = Raw::connect(a);
    two.hello(magic, 2, 3);
    drop(two);
    let t = Instant::now();
    let err = root.finish().unwrap_err().to_string();
    assert!(
        err.contains("rank 2") && err.contains("disconnected"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(10));
    // Rank 0 is told why, unless the root saw rank 2 leave before rank 0's hello.
    if let Some((k, why)) = zero.reply() {
        assert_eq!(k, Kind::Abort as u32);
        assert!(String::from_utf8_lossy(&why).contains("rank 2"), "{why:?}");
    }
}

#[test]
fn root_cancel_joins_its_thread() {
    let (root, a) = start_root(1, 4);
    let mut r = Raw::connect(a);
    r.hello(1, 3, 4);
    std::thread::sleep(Duration::from_millis(20));
    drop(root);
    // The joined rank hears about it (or sees the connection close).
    if let Some((k, _)) = r.reply() {
        assert_eq!(k, Kind::Abort as u32);
    }
}

/// The three ranks of a bootstrap rooted on a free loopback port.
fn three_ranks() -> [Bootstrap; 3] {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let (a1, a2) = (addr.clone(), addr.clone());
    let h1 = std::thread::spawn(move || Bootstrap::from_addr(&a1, 1, 3).unwrap());
    let h2 = std::thread::spawn(move || Bootstrap::from_addr(&a2, 2, 3).unwrap());
    let b0 = Bootstrap::from_addr(&addr, 0, 3).unwrap();
    [b0, h1.join().unwrap(), h2.join().unwrap()]
}

fn pair(addr: &str) -> (Bootstrap, Bootstrap) {
    let a = addr.to_string();
    let h = std::thread::spawn(move || Bootstrap::from_addr(&a, 1, 2).unwrap());
    let b0 = Bootstrap::from_addr(addr, 0, 2).unwrap();
    (b0, h.join().unwrap())
}

#[test]
fn strangers_at_a_rank_listener_are_dropped() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (b0, b1) = pair(&format!("127.0.0.1:{port}"));
    let target = b1.peers[1];
    let idle = TcpStream::connect(target).unwrap();
    let mut strays = Vec::new();
    for bytes in [
        b"\x00\x01garbage garbage garbage garbage garbage".to_vec(),
        frame::encode_raw(b1.magic ^ 4, Kind::Open as u32, 0, 0, 0).to_vec(),
        frame::encode_raw(b1.magic, Kind::P2p as u32, 0, 0, 1 << 50).to_vec(),
        frame::encode_raw(b1.magic, Kind::Open as u32, 1, 0, 0).to_vec(),
        frame::encode_raw(b1.magic, Kind::Open as u32, 9, 0, 0).to_vec(),
    ] {
        let mut s = TcpStream::connect(target).unwrap();
        s.write_all(&bytes).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        strays.push(s);
    }
    // Each is dropped: the reader closes it (EOF or reset), without answering.
    for mut s in strays {
        let mut b = [0u8; 8];
        assert!(matches!(s.read(&mut b), Ok(0) | Err(_)));
    }
    let t = std::thread::spawn(move || {
        b1.send(0, 5, b"to zero").unwrap();
        assert_eq!(b1.recv(0, 6).unwrap(), b"to one");
        b1.barrier().unwrap();
        b1
    });
    b0.send(1, 6, b"to one").unwrap();
    assert_eq!(b0.recv(1, 5).unwrap(), b"to zero");
    b0.barrier().unwrap();
    let b1 = t.join().unwrap();
    drop(idle);
    drop((b0, b1));
}

#[test]
fn self_messages_and_single_rank() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let b = Bootstrap::from_addr(&format!("127.0.0.1:{port}"), 0, 1).unwrap();
    b.send(0, 3, b"me").unwrap();
    assert_eq!(b.recv(0, 3).unwrap(), b"me");
    let mut d = [7u8; 5];
    b.all_gather(&mut d).unwrap();
    assert_eq!(d, [7; 5]);
    b.barrier().unwrap();
}

/// Polls `b.lost_peer()` until it reports something or 10 s pass.
fn wait_lost(b: &Bootstrap) -> Option<(usize, String)> {
    let t = Instant::now();
    // Ends: a loss is reported, or after 10 s.
    loop {
        if let Some(l) = b.lost_peer() {
            return Some(l);
        }
        if t.elapsed() > Duration::from_secs(10) {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A pair that watches each other, with a hand-made "rank 0" connection to rank 1 that sends
/// `frames` (each built by `f(magic)`) and then closes. Returns rank 1 after the closing, and
/// rank 0.
fn fake_rank0_then_close(frames: impl Fn(u64) -> Vec<u8>) -> (Bootstrap, Bootstrap) {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (b0, b1) = pair(&format!("127.0.0.1:{port}"));
    std::thread::scope(|s| {
        let h = s.spawn(|| b0.watch_peers(&[1, 0]).unwrap());
        b1.watch_peers(&[0]).unwrap();
        h.join().unwrap();
    });
    assert_eq!(b1.lost_peer(), None);
    let mut s = TcpStream::connect(b1.peers[1]).unwrap();
    s.write_all(&frames(b1.magic)).unwrap();
    drop(s);
    (b1, b0)
}

/// A named case: what to look for, and the bytes (given the magic) a fake rank 0 sends.
type Case = (&'static str, fn(u64) -> Vec<u8>);

fn open0(magic: u64) -> Vec<u8> {
    frame::encode_raw(magic, Kind::Open as u32, 0, 0, 0).to_vec()
}

#[test]
fn watched_peer_closing_without_goodbye_is_lost() {
    let cases: [Case; 4] = [
        ("without saying goodbye", |m| {
            let mut f = open0(m);
            f.extend(frame::encode_raw(m, Kind::Watch as u32, 0, 0, 0));
            f
        }),
        ("middle of a frame", |m| {
            let mut f = open0(m);
            f.extend(frame::encode_raw(m, Kind::P2p as u32, 0, 1, 10));
            f.extend([1, 2, 3]);
            f
        }),
        ("malformed", |m| {
            let mut f = open0(m);
            f.extend(frame::encode_raw(m, Kind::Watch as u32, 0, 0, 4));
            f.extend([0; 4]);
            f
        }),
        ("aborted its bootstrap", |m| {
            let mut f = open0(m);
            f.extend(encode_frame(m, Kind::Abort, 0, 0, b"test abort"));
            f
        }),
    ];
    for (want, frames) in cases {
        let (b1, _b0) = fake_rank0_then_close(frames);
        let (p, why) = wait_lost(&b1).unwrap_or_else(|| panic!("{want}: no loss reported"));
        assert_eq!(p, 0, "{want}: {why}");
        assert!(
            why.contains("rank 0") && why.contains(want),
            "{want}: {why}"
        );
    }
}

/// Two watched peers die one after the other: the second loss is reported too, to whoever
/// asks about that peer (a proxy whose peers do not include the first lost rank), not only
/// the first.
#[test]
fn every_lost_peer_is_reported_not_only_the_first() {
    let [b0, b1, b2] = three_ranks();
    std::thread::scope(|s| {
        let w0 = s.spawn(|| b0.watch_peers(&[2]).unwrap());
        let w1 = s.spawn(|| b1.watch_peers(&[2]).unwrap());
        b2.watch_peers(&[0, 1]).unwrap();
        w0.join().unwrap();
        w1.join().unwrap();
    });
    assert_eq!(b2.lost_peer(), None);
    // A connection in rank r's name closes without a goodbye: rank r is lost; rank 0 first.
    for r in [0u32, 1] {
        let mut s = TcpStream::connect(b2.peers[2]).unwrap();
        let mut f = frame::encode_raw(b2.magic, Kind::Open as u32, r, 0, 0).to_vec();
        f.extend(frame::encode_raw(b2.magic, Kind::Watch as u32, r, 0, 0));
        s.write_all(&f).unwrap();
        drop(s);
        let t = Instant::now();
        // Ends when rank r's loss is reported, or fails after 10 s.
        while b2.lost_peer_among(&[r as usize]).is_none() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "rank {r}'s loss never reported"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    assert_eq!(b2.lost_peer().map(|l| l.0), Some(0), "the first loss");
    let (p, why) = b2.lost_peer_among(&[1]).expect("the second loss");
    assert_eq!(p, 1);
    assert!(why.contains("rank 1"), "{why}");
    assert_eq!(b2.lost_peer_among(&[0, 1]).map(|l| l.0), Some(0));
    assert_eq!(b2.lost_peer_among(&[]), None);
    drop((b0, b1));
}

#[test]
fn goodbye_or_strangers_are_not_losses() {
    let cases: [Case; 3] = [
        ("bye", |m| {
            let mut f = open0(m);
            f.extend(encode_frame(m, Kind::P2p, 0, 77, b"sync"));
            f.extend(frame::encode_raw(m, Kind::Bye as u32, 0, 0, 0));
            f
        }),
        ("a frame after bye", |m| {
            let mut f = open0(m);
            f.extend(encode_frame(m, Kind::P2p, 0, 77, b"sync"));
            f.extend(frame::encode_raw(m, Kind::Bye as u32, 0, 0, 0));
            f.extend(encode_frame(m, Kind::P2p, 0, 78, b"late"));
            f
        }),
        ("stranger", |m| {
            frame::encode_raw(m ^ 1, Kind::Open as u32, 0, 0, 0).to_vec()
        }),
    ];
    for (what, frames) in cases {
        let (b1, b0) = fake_rank0_then_close(frames);
        if what != "stranger" {
            // The reader has reached the fake's frames; its close follows at once.
            assert_eq!(b1.recv(0, 77).unwrap(), b"sync", "{what}");
        }
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(b1.lost_peer(), None, "{what}");
        // The real rank 0 still works.
        b0.send(1, 5, b"still here").unwrap();
        assert_eq!(b1.recv(0, 5).unwrap(), b"still here", "{what}");
    }
}

#[test]
fn losses_of_unwatched_peers_are_kept_until_watched() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (_b0, b1) = pair(&format!("127.0.0.1:{port}"));
    let mut s = TcpStream::connect(b1.peers[1]).unwrap();
    let mut f = open0(b1.magic);
    f.extend(encode_frame(b1.magic, Kind::P2p, 0, 9, b"x"));
    s.write_all(&f).unwrap();
    assert_eq!(b1.recv(0, 9).unwrap(), b"x");
    drop(s);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(b1.lost_peer(), None, "rank 0 is not watched yet");
    // Watching it now reports the earlier loss (the real rank 0 is not asked to take part:
    // its Watch is not needed for the loss to show).
    b1.mailbox.watch_mark(&[0]);
    let (p, why) = wait_lost(&b1).expect("the earlier loss is reported once watched");
    assert_eq!(p, 0, "{why}");
}

/// A socket bound to a port and then connected to that same port is connected to itself
/// (Linux completes the handshake with itself); the check tells it from a real connection.
#[test]
fn a_connection_to_itself_is_told_apart() {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket calls on a descriptor this test owns; `sa` outlives every call that
    // reads it, and the descriptor is handed to exactly one TcpStream.
    let me = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0);
        let mut sa: libc::sockaddr_in = std::mem::zeroed();
        sa.sin_family = libc::AF_INET as libc::sa_family_t;
        sa.sin_addr.s_addr = u32::from_ne_bytes([127, 0, 0, 1]);
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let p = &mut sa as *mut libc::sockaddr_in as *mut libc::sockaddr;
        assert_eq!(libc::bind(fd, p, len), 0);
        let mut got = len;
        assert_eq!(libc::getsockname(fd, p, &mut got), 0);
        assert_eq!(
            libc::connect(fd, p, len),
            0,
            "{}",
            std::io::Error::last_os_error()
        );
        TcpStream::from_raw_fd(fd)
    };
    assert!(net::connected_to_itself(&me));

    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let real = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    assert!(!net::connected_to_itself(&real));
    let (accepted, _) = l.accept().unwrap();
    assert!(!net::connected_to_itself(&accepted));
}

/// Three ranks: rank 0 asks the others for their hang reports while nobody calls anything on
/// them (their mailbox threads answer); a late answer to an earlier request is not taken for
/// the answer to a later one; a rank that said goodbye is named as gone.
#[test]
fn hang_reports_are_answered_by_the_mailbox_thread() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let [b0, b1, b2] = three_ranks();
    // Rank 1 has no source yet: an empty report. Rank 2 is slow the first time it is asked
    // (a source must not block; this one does, to make an answer arrive late).
    let asked = Arc::new(AtomicU64::new(0));
    let n = asked.clone();
    b2.set_report_source(Some(Arc::new(move || {
        let i = n.fetch_add(1, Ordering::Relaxed);
        if i == 0 {
            std::thread::sleep(Duration::from_millis(600));
        }
        format!("rank 2, answer {i}").into_bytes()
    })));
    let got = b0.gather_reports(Duration::from_millis(200));
    assert_eq!(got[0], (1, Ok(Vec::new())));
    let (p, a) = &got[1];
    assert_eq!(*p, 2);
    let why = a.as_ref().unwrap_err();
    assert!(why.contains("not within 200ms"), "{why}");
    b1.set_report_source(Some(Arc::new(|| b"rank 1".to_vec())));
    // Ends once rank 2's first answer has been sent (and dropped by rank 0's reader).
    let t = Instant::now();
    while asked.load(Ordering::Relaxed) == 0 {
        assert!(t.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(5));
    }
    let got = b0.gather_reports(Duration::from_secs(10));
    assert_eq!(
        got,
        vec![
            (1, Ok(b"rank 1".to_vec())),
            (2, Ok(b"rank 2, answer 1".to_vec()))
        ]
    );
    drop(b2);
    let got = b0.gather_reports(Duration::from_secs(10));
    assert_eq!(got[0], (1, Ok(b"rank 1".to_vec())));
    let why = got[1].1.as_ref().unwrap_err();
    assert!(why.contains("rank 2") && why.contains("goodbye"), "{why}");
    assert!(b0.lost_peers().is_empty(), "a goodbye is not a loss");
    drop((b0, b1));
}
