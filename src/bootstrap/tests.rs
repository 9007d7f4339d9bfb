//! Unit tests that need the bootstrap's internals (the root on its own, a rank's listener).
//! The wire format's property tests live in `frame.rs`; end-to-end tests in
//! `tests/bootstrap.rs`.

use super::frame::{self, encode_addr, encode_frame, Kind, HEADER_LEN};
use super::*;
use std::io::{Read, Write};
use std::net::TcpStream;

#[test]
fn timeout_env_values() {
    assert_eq!(parse_timeout("5"), Some(Duration::from_secs(5)));
    assert_eq!(parse_timeout(" 2.5 "), Some(Duration::from_millis(2500)));
    assert_eq!(parse_timeout("1e30"), Some(MAX_TIMEOUT));
    for bad in ["", "0", "-3", "abc", "NaN", "inf", "5s"] {
        assert_eq!(parse_timeout(bad), None, "{bad:?}");
    }
}

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
