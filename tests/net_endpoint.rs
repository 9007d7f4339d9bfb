//! The network transport through the `Endpoint` trait: two endpoints in one process, over
//! `tcp;ofi_rxm` on loopback and over `shm`. The target endpoint is progressed by a thread of
//! its own, as its proxy would (manual-progress providers move nothing otherwise).

use mscclpp::error::Error;
use mscclpp::transport::net;
use mscclpp::transport::{Endpoint, MemKind, MrId, PeerId, Region, RemoteId};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Shared = Arc<Mutex<Box<dyn Endpoint>>>;

/// Which transport a test runs on.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// tcp;ofi_rxm on the loopback domain (named explicitly, as ibDev would).
    Tcp,
    /// tcp with the default choice (no domain named): must also land on loopback.
    TcpDefault,
    Shm,
}

fn open(kind: Kind) -> Box<dyn Endpoint> {
    match kind {
        Kind::Tcp => net::open(Some("lo"), false, None),
        Kind::TcpDefault => net::open(None, false, None),
        Kind::Shm => net::open(None, true, None),
    }
    .unwrap_or_else(|e| panic!("opening {kind:?}: {e}"))
}

/// A host buffer whose address stays fixed (the peer writes into it while we read it).
struct Buf {
    mem: Vec<u64>,
}

impl Buf {
    fn new(bytes: usize) -> Self {
        Buf {
            mem: vec![0; bytes.div_ceil(8)],
        }
    }
    fn region(&self) -> Region {
        Region {
            addr: self.mem.as_ptr() as u64,
            len: (self.mem.len() * 8) as u64,
            kind: MemKind::Host,
        }
    }
    /// Atomic view of word `i` (the peer's RMA writes race with our reads).
    fn word(&self, i: usize) -> &AtomicU64 {
        // SAFETY: in bounds, 8-aligned; the memory lives as long as &self.
        unsafe { AtomicU64::from_ptr(self.mem.as_ptr().add(i) as *mut u64) }
    }
    fn fill(&mut self, seed: u64) {
        for (i, w) in self.mem.iter_mut().enumerate() {
            *w = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64;
        }
    }
    fn check(&self, seed: u64, words: usize) -> Result<(), String> {
        for i in 0..words {
            let want = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64;
            let got = self.word(i).load(Ordering::Acquire);
            if got != want {
                return Err(format!(
                    "word {i}: got {got:#x}, want {want:#x} (seed {seed})"
                ));
            }
        }
        Ok(())
    }
}

/// Initiator `a` (driven by the test thread) and target `b` (progressed in the background).
struct Pair {
    a: Box<dyn Endpoint>,
    b: Shared,
    a_peer: PeerId,
    b_peer: PeerId,
    stop: Arc<AtomicBool>,
    progress: Option<JoinHandle<()>>,
}

impl Pair {
    fn new(kind: Kind) -> Self {
        let mut a = open(kind);
        let mut b = open(kind);
        let (aa, ba) = (a.address().unwrap(), b.address().unwrap());
        let a_peer = a.add_peer(1, &ba).unwrap();
        let b_peer = b.add_peer(0, &aa).unwrap();
        let b: Shared = Arc::new(Mutex::new(b));
        let stop = Arc::new(AtomicBool::new(false));
        let (b2, stop2) = (b.clone(), stop.clone());
        let progress = std::thread::spawn(move || {
            // Ends when the test drops the pair (stop flag, Release/Acquire pair with Drop).
            while !stop2.load(Ordering::Acquire) {
                b2.lock().unwrap().progress().expect("target progress");
                std::thread::yield_now();
            }
        });
        Pair {
            a,
            b,
            a_peer,
            b_peer,
            stop,
            progress: Some(progress),
        }
    }
    /// Registers `buf` on the target and imports it on the initiator.
    fn target_region(&mut self, buf: &Buf) -> RemoteId {
        let (_, blob) = self.b.lock().unwrap().register(buf.region()).unwrap();
        self.a.import(self.a_peer, &blob).unwrap()
    }
    fn source(&mut self, buf: &Buf) -> MrId {
        self.a.register(buf.region()).unwrap().0
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.progress.take() {
            let _ = h.join();
        }
    }
}

/// Waits (bounded) until word `i` of `buf` equals `v`, progressing `a` meanwhile.
fn wait_word(a: &mut dyn Endpoint, buf: &Buf, i: usize, v: u64) {
    let t0 = Instant::now();
    // Ends when the value arrives or after 20 s.
    while buf.word(i).load(Ordering::Acquire) != v {
        a.progress().unwrap();
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "timed out waiting for word {i} == {v} (have {})",
            buf.word(i).load(Ordering::Acquire)
        );
        std::thread::yield_now();
    }
}

fn basic(kind: Kind) {
    let mut p = Pair::new(kind);
    let len = 3 << 20 | 24; // not a power of two, not page-aligned in length
    let mut src = Buf::new(len);
    src.fill(7);
    let dst = Buf::new(len);
    let epoch = Buf::new(16);
    let s = p.source(&src);
    let d = p.target_region(&dst);
    let e = p.target_region(&epoch);
    let words = len / 8;
    p.a.write(p.a_peer, s, 0, d, 0, (words * 8) as u64).unwrap();
    p.a.write_value(p.a_peer, e, 8, 1).unwrap();
    p.a.flush(p.a_peer).unwrap();
    // flush returned: with delivery-complete the data is there; the flag orders it anyway.
    wait_word(&mut *p.a, &epoch, 1, 1);
    dst.check(7, words).unwrap();
    // A partial write at offsets.
    src.fill(9);
    p.a.write(p.a_peer, s, 8 * 100, d, 8 * 200, 8 * 50).unwrap();
    p.a.write_value(p.a_peer, e, 8, 2).unwrap();
    p.a.flush(p.a_peer).unwrap();
    wait_word(&mut *p.a, &epoch, 1, 2);
    for i in 0..50 {
        let want = 9u64.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (100 + i) as u64;
        assert_eq!(
            dst.word(200 + i).load(Ordering::Acquire),
            want,
            "word {}",
            200 + i
        );
    }
    assert_eq!(
        dst.word(199).load(Ordering::Acquire),
        7u64.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 199
    );
    // Nothing outstanding: flush is immediate; progress is harmless.
    p.a.flush(p.a_peer).unwrap();
    p.a.progress().unwrap();
    assert!(p.a.describe().starts_with("net:"));
}

#[test]
fn tcp_write_flag_flush() {
    basic(Kind::Tcp);
}

#[test]
fn tcp_default_choice_is_loopback() {
    let ep = open(Kind::TcpDefault);
    assert!(
        ep.describe().contains("/lo"),
        "default choice should be the loopback domain of a software provider: {}",
        ep.describe()
    );
    drop(ep);
    basic(Kind::TcpDefault);
}

#[test]
fn shm_write_flag_flush() {
    basic(Kind::Shm);
}

/// Data then flag, many rounds: whoever sees flag i must see the data of round i.
fn ordering(kind: Kind) {
    let mut p = Pair::new(kind);
    let len = 256 << 10;
    let words = len / 8;
    let mut src = Buf::new(len);
    let dst = Arc::new(Buf::new(len));
    let epoch = Arc::new(Buf::new(16));
    let ack = Buf::new(8);
    let s = p.source(&src);
    let d = p.target_region(&dst);
    let e = p.target_region(&epoch);
    // The target acknowledges each round into `ack` on the initiator.
    let (_, ack_blob) = p.a.register(ack.region()).unwrap();
    let ack_r = p.b.lock().unwrap().import(p.b_peer, &ack_blob).unwrap();
    let rounds = 40u64;
    let (b, b_peer, dst2, epoch2) = (p.b.clone(), p.b_peer, dst.clone(), epoch.clone());
    let checker = std::thread::spawn(move || -> Result<(), String> {
        for r in 1..=rounds {
            let t0 = Instant::now();
            // Ends when flag r arrives or after 20 s.
            while epoch2.word(1).load(Ordering::Acquire) < r {
                if t0.elapsed() > Duration::from_secs(20) {
                    return Err(format!("round {r}: flag never arrived"));
                }
                std::thread::yield_now();
            }
            dst2.check(r, words)?;
            let mut b = b.lock().unwrap();
            b.write_value(b_peer, ack_r, 0, r)
                .map_err(|e| e.to_string())?;
            b.flush(b_peer).map_err(|e| e.to_string())?;
        }
        Ok(())
    });
    for r in 1..=rounds {
        src.fill(r);
        p.a.write(p.a_peer, s, 0, d, 0, len as u64).unwrap();
        p.a.write_value(p.a_peer, e, 8, r).unwrap();
        // Reuse of `src` needs its writes complete; the ack gates the next overwrite of dst.
        p.a.flush(p.a_peer).unwrap();
        wait_word(&mut *p.a, &ack, 0, r);
    }
    // The checker's flush of its last ack confirms delivery with a marker write into us: keep
    // progressing until it is done (software providers move data only while the target
    // progresses).
    let t0 = Instant::now();
    while !checker.is_finished() && t0.elapsed() < Duration::from_secs(20) {
        p.a.progress().unwrap();
        std::thread::yield_now();
    }
    checker.join().unwrap().unwrap();
}

#[test]
fn tcp_data_before_flag() {
    ordering(Kind::Tcp);
}

#[test]
fn shm_data_before_flag() {
    ordering(Kind::Shm);
}

#[test]
fn many_small_writes_without_flush() {
    // More writes than any queue holds: the endpoint must progress and retry, never drop.
    for kind in [Kind::Tcp, Kind::Shm] {
        let mut p = Pair::new(kind);
        let n = 6000usize;
        let mut src = Buf::new(n * 8);
        src.fill(3);
        let dst = Buf::new(n * 8);
        let s = p.source(&src);
        let d = p.target_region(&dst);
        for i in 0..n as u64 {
            p.a.write(p.a_peer, s, i * 8, d, i * 8, 8).unwrap();
        }
        p.a.flush(p.a_peer).unwrap();
        let e = p.target_region(&Buf::new(16));
        let _ = e;
        // Ordered delivery: the last word arriving means all did.
        wait_word(
            &mut *p.a,
            &dst,
            n - 1,
            3u64.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (n as u64 - 1),
        );
        dst.check(3, n).unwrap();
    }
}

#[test]
fn unknown_domain_lists_the_domains() {
    let e = net::open(Some("no-such-nic0"), false, None)
        .err()
        .expect("must fail");
    match e {
        Error::InvalidArgument(m) => {
            eprintln!("{m}");
            assert!(m.contains("no-such-nic0"), "{m}");
            assert!(m.contains("lo"), "should list the loopback domain: {m}");
        }
        other => panic!("expected InvalidArgument, got {other}"),
    }
}

#[test]
fn corrupted_and_oversized_blobs_are_rejected() {
    let mut p = Pair::new(Kind::Tcp);
    let dst = Buf::new(4096);
    let (_, blob) = p.b.lock().unwrap().register(dst.region()).unwrap();
    let mut bad = blob.clone();
    bad[0] ^= 0xff;
    assert!(p.a.import(p.a_peer, &bad).is_err(), "bad magic");
    let mut long = blob.clone();
    long.extend_from_slice(&[0u8; 64]);
    assert!(p.a.import(p.a_peer, &long).is_err(), "trailing bytes");
    assert!(
        p.a.import(p.a_peer, &blob[..blob.len() - 1]).is_err(),
        "truncated"
    );
    assert!(p.a.import(p.a_peer, &[]).is_err(), "empty");
    assert!(p.a.import(p.a_peer + 7, &blob).is_err(), "unknown peer");
    // Length field zeroed (bytes 20..28 hold the length).
    let mut zero = blob.clone();
    zero[20..28].fill(0);
    assert!(p.a.import(p.a_peer, &zero).is_err(), "empty region");
    // Address blobs too.
    assert!(p.a.add_peer(5, b"not an address").is_err());
    let addr = p.b.lock().unwrap().address().unwrap();
    assert!(p.a.add_peer(5, &addr[..addr.len() - 2]).is_err());
    // The intact blob still imports.
    p.a.import(p.a_peer, &blob).unwrap();
}

#[test]
fn writes_beyond_the_region_are_refused() {
    let mut p = Pair::new(Kind::Tcp);
    let src = Buf::new(8192);
    let dst = Buf::new(4096);
    let s = p.source(&src);
    let d = p.target_region(&dst);
    for (so, doff, n) in [
        (0, 4000, 200),
        (0, 0, 4097),
        (8000, 0, 200),
        (0, u64::MAX - 4, 8),
        (0, 0, 0),
    ] {
        match p.a.write(p.a_peer, s, so, d, doff, n) {
            Err(Error::InvalidArgument(_)) => {}
            other => panic!("write {so}/{doff}/{n}: expected InvalidArgument, got {other:?}"),
        }
    }
    assert!(p.a.write_value(p.a_peer, d, 4090, 1).is_err());
    assert!(
        p.a.write(p.a_peer, s, 0, d + 1, 0, 8).is_err(),
        "unknown remote"
    );
    assert!(
        p.a.write(p.a_peer, s + 100, 0, d, 0, 8).is_err(),
        "unknown source"
    );
    // Nothing was sent: the destination is untouched.
    p.a.flush(p.a_peer).unwrap();
    assert!(dst.mem.iter().all(|&w| w == 0));
}

#[test]
fn registration_is_exact_and_deduplicated() {
    let mut ep = open(Kind::Tcp);
    let b = Buf::new(4096);
    let r = b.region();
    let (id1, blob1) = ep.register(r).unwrap();
    let (id2, blob2) = ep.register(r).unwrap();
    assert_eq!((id1, &blob1), (id2, &blob2));
    let (id3, _) = ep.register(Region { len: 4000, ..r }).unwrap();
    assert_ne!(id1, id3);
    assert!(ep.register(Region { len: 0, ..r }).is_err());
    assert!(ep.register(Region { addr: 0, ..r }).is_err());
    // GPU memory on an endpoint made for host memory: refused, never registered as if it
    // were host memory (a GPU's connections get their own endpoint, which stages it).
    match ep.register(Region {
        kind: MemKind::Device(0),
        ..r
    }) {
        Err(Error::InvalidUsage(m)) => assert!(m.contains("not CUDA device 0"), "{m}"),
        other => panic!("expected InvalidUsage, got {other:?}"),
    }
}

#[test]
fn mismatched_providers_are_refused() {
    let mut tcp = open(Kind::Tcp);
    let shm = open(Kind::Shm);
    match tcp.add_peer(1, &shm.address().unwrap()) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("shm"), "{m}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn gpu_endpoints_open_and_stage_device_memory() {
    // An endpoint for a GPU's connections opens on tcp (no FI_HMEM) and on shm (FI_HMEM, but
    // no CUDA in this libfabric build); device memory is staged through host memory, which
    // needs CUDA copies: without a driver (CI) that is a clear error, never a host
    // registration; host memory still registers.
    if mscclpp::cuda::available() {
        return;
    }
    for (domain, shm) in [(Some("lo"), false), (None, true)] {
        let mut ep = net::open(domain, shm, Some(0)).unwrap();
        let b = Buf::new(4096);
        match ep.register(Region {
            kind: MemKind::Device(0),
            ..b.region()
        }) {
            Err(Error::InvalidUsage(m)) => assert!(m.contains("needs a CUDA driver"), "{m}"),
            other => panic!("{}: expected InvalidUsage, got {other:?}", ep.describe()),
        }
        ep.register(b.region()).unwrap();
    }
}
