//! Hostile input at connection setup: a fake rank (this test's thread, speaking the bootstrap
//! through `mscclpp::bootstrap::Bootstrap` and owning a real network endpoint) joins a 2-rank
//! communicator whose other rank uses the C API, and answers its `mscclppConnectionSetup` with
//! corrupt setup blobs on the setup tag space (`comm::TAG_CONN`). Every one is refused with an
//! error, quickly (or, for a blob that never comes, at the bootstrap timeout), never a crash
//! or a hang, and the real rank's process stays usable: a correct fake rank then sets up,
//! receives data, and a peer that lies about its buffer size cannot make the real rank write
//! beyond the region it registered.
//!
//! The net transport's blob layouts change with its version; the cases below find the fields
//! they corrupt (the region length, the address fields) rather than hard-coding offsets.

mod common;
mod fault_util;

use common::api::*;
use common::*;
use fault_util::*;
use mscclpp::abi::mscclppResult_t::{self, *};
use mscclpp::abi::mscclppTransport_t;
use mscclpp::bootstrap::Bootstrap;
use mscclpp::capi::comm::*;
use mscclpp::capi::conn::*;
use mscclpp::comm::{ConnBlob, TAG_ACK, TAG_CONN, TAG_REG};
use mscclpp::transport::{net, Endpoint, MemKind, Region};
use mscclpp::wire::{Reader, Writer};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TAG: i32 = 5;
const BOOT_S: f64 = 5.0;
/// Bytes the real rank connects; the fake registers the same, inside a larger canary block.
const BUF: usize = 4096;

fn provider() -> String {
    std::env::var("MSCCLPP_TEST_TRANSPORT").unwrap()
}
fn is_shm() -> bool {
    provider() == "shm"
}
fn transport() -> mscclppTransport_t {
    if is_shm() {
        mscclppTransport_t::mscclppTransportSHM
    } else {
        mscclppTransport_t::mscclppTransportIB
    }
}
fn open_endpoint(shm: bool) -> Box<dyn Endpoint> {
    net::open(None, shm, None).unwrap()
}

/// What the real rank must do with a case.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Want {
    /// Refuse at once, without acknowledging.
    Refuse,
    /// Nothing arrives on its tag: fail at the bootstrap timeout.
    TimeOut,
    /// Accept the blob, then refuse the bad acknowledgement.
    BadAck,
}

struct Case {
    name: String,
    /// Bootstrap tag the fake sends on.
    tag: u64,
    msg: Vec<u8>,
    want: Want,
    /// Text the real rank's error must contain.
    says: &'static str,
}

/// The fake rank's valid half of the connection, and the pieces it is made of.
struct Fake {
    ep: Box<dyn Endpoint>,
    /// 2 * BUF bytes; the first BUF are registered, the rest is a canary nobody may write.
    mem: Vec<u64>,
    /// Epoch block (the real rank's signals land in word 1).
    epoch: Vec<u64>,
    addr: Vec<u8>,
    data: Vec<u8>,
    epoch_blob: Vec<u8>,
    other_addr: Vec<u8>,
}

impl Fake {
    fn new() -> Self {
        let mut ep = open_endpoint(is_shm());
        let mem = vec![0u64; 2 * BUF / 8];
        // 24 bytes (the protocol uses 16): a length no key or address of this test collides
        // with, so the cases can find it in the blob.
        let epoch = vec![0u64; 3];
        let region = |p: *const u64, len: usize| Region {
            addr: p as u64,
            len: len as u64,
            kind: MemKind::Host,
        };
        let addr = ep.address().unwrap();
        let (_, data) = ep.register(region(mem.as_ptr(), BUF)).unwrap();
        let (_, epoch_blob) = ep.register(region(epoch.as_ptr(), 24)).unwrap();
        let other_addr = open_endpoint(!is_shm()).address().unwrap();
        Fake {
            ep,
            mem,
            epoch,
            addr,
            data,
            epoch_blob,
            other_addr,
        }
    }

    fn blob(&self) -> ConnBlob<'_> {
        ConnBlob {
            transport: transport() as u32,
            tag: TAG,
            rank: 1,
            size: BUF as u64,
            addr: &self.addr,
            data: &self.data,
            epoch: &self.epoch_blob,
            epoch_shm: &[],
        }
    }

    fn word(&self, i: usize) -> u64 {
        // SAFETY: in bounds, aligned; written by the real rank's RMA writes.
        unsafe { AtomicU64::from_ptr(self.mem.as_ptr().add(i) as *mut u64) }.load(Ordering::Acquire)
    }
    fn signals(&self) -> u64 {
        // SAFETY: as in `word`.
        unsafe { AtomicU64::from_ptr(self.epoch.as_ptr().add(1) as *mut u64) }
            .load(Ordering::Acquire)
    }
}

/// The byte offset of the u64 LE `v` inside `blob` (the only one at a 4-byte boundary).
fn find_u64(blob: &[u8], v: u64) -> usize {
    // Fields sit at multiples of 4 in every blob version.
    let at: Vec<usize> = (0..blob.len().saturating_sub(7))
        .step_by(4)
        .filter(|&i| blob[i..i + 8] == v.to_le_bytes())
        .collect();
    assert_eq!(at.len(), 1, "u64 {v:#x} in region blob {blob:02x?}");
    at[0]
}

fn with_u64(blob: &[u8], at: usize, v: u64) -> Vec<u8> {
    let mut b = blob.to_vec();
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    b
}

fn with_u32(blob: &[u8], at: usize, v: u32) -> Vec<u8> {
    let mut b = blob.to_vec();
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    b
}

/// An address blob as (magic, version, format) and its length-prefixed fields: provider, raw
/// address, scratch region, then whatever this version adds.
fn split_addr(b: &[u8]) -> ([u32; 3], Vec<Vec<u8>>) {
    let mut r = Reader::new(b, "test");
    let head = [r.u32().unwrap(), r.u32().unwrap(), r.u32().unwrap()];
    let mut fields = Vec::new();
    while let Ok(f) = r.bytes() {
        fields.push(f.to_vec());
    }
    (head, fields)
}

fn join_addr(head: [u32; 3], fields: &[Vec<u8>]) -> Vec<u8> {
    let mut w = Writer::new().u32(head[0]).u32(head[1]).u32(head[2]);
    for f in fields {
        w = w.bytes(f);
    }
    w.finish()
}

fn addr_with(f: &Fake, i: usize, v: Vec<u8>) -> Vec<u8> {
    let (h, mut fields) = split_addr(&f.addr);
    fields[i] = v;
    join_addr(h, &fields)
}

fn cases(f: &Fake, own: &[u8]) -> Vec<Case> {
    let valid = f.blob().encode();
    let conn = TAG_CONN | TAG as u32 as u64;
    let mut v: Vec<Case> = Vec::new();
    let mut add = |name: &str, msg: Vec<u8>, says: &'static str| {
        v.push(Case {
            name: name.into(),
            tag: conn,
            msg,
            want: Want::Refuse,
            says,
        })
    };
    let with_blob = |b: ConnBlob<'_>| b.encode();
    // The envelope.
    add("empty message", vec![], "truncated");
    add("wrong magic", with_u32(&valid, 0, 0x1234_5678), "foreign");
    add("wrong version", with_u32(&valid, 4, 99), "foreign");
    add("truncated header", valid[..10].to_vec(), "truncated");
    add(
        "truncated in a blob",
        valid[..valid.len() - 5].to_vec(),
        "truncated",
    );
    let mut long = valid.clone();
    long.extend_from_slice(&[0; 7]);
    add("trailing bytes", long, "trailing");
    // Fixed fields (20 + 8 bytes) then a length prefix of u32::MAX.
    let mut huge = valid[..28].to_vec();
    huge.extend_from_slice(&u32::MAX.to_le_bytes());
    huge.extend_from_slice(&[0; 64]);
    add("field length 4 GiB", huge, "exceeds");
    let mut big = valid[..28].to_vec();
    big.extend_from_slice(&5000u32.to_le_bytes());
    big.extend_from_slice(&vec![7; 5000]);
    add("field of 5000 bytes", big, "exceeds");
    add("8 MiB of junk", vec![0xab; 8 << 20], "foreign");
    add(
        "another rank",
        with_blob(ConnBlob {
            rank: 0,
            ..f.blob()
        }),
        "names rank 0",
    );
    add(
        "rank out of range",
        with_blob(ConnBlob {
            rank: 7,
            ..f.blob()
        }),
        "names rank 7",
    );
    add(
        "another tag",
        with_blob(ConnBlob {
            tag: TAG + 1,
            ..f.blob()
        }),
        "tag 6",
    );
    let other = if is_shm() {
        mscclppTransport_t::mscclppTransportIB
    } else {
        mscclppTransport_t::mscclppTransportSHM
    };
    add(
        "another transport",
        with_blob(ConnBlob {
            transport: other as u32,
            ..f.blob()
        }),
        "transports differ",
    );
    add(
        "unknown transport",
        with_blob(ConnBlob {
            transport: 99,
            ..f.blob()
        }),
        "transports differ",
    );
    add(
        "zero size",
        with_blob(ConnBlob {
            size: 0,
            ..f.blob()
        }),
        "0-byte",
    );
    add(
        "the real rank's own blob, replayed",
        own.to_vec(),
        "names rank 0",
    );
    // The endpoint address.
    let addr = |a: &[u8]| {
        with_blob(ConnBlob {
            addr: a,
            ..f.blob()
        })
    };
    add(
        "address: wrong magic",
        addr(&with_u32(&f.addr, 0, 1)),
        "not a network endpoint address",
    );
    add("address: empty", addr(&[]), "truncated");
    add(
        "address: truncated",
        addr(&f.addr[..f.addr.len() - 1]),
        "truncated",
    );
    let mut a = f.addr.clone();
    a.push(0);
    add("address: trailing byte", addr(&a), "trailing");
    add(
        "address: another provider's",
        addr(&f.other_addr),
        "provider",
    );
    add(
        "address: provider name not UTF-8",
        addr(&addr_with(f, 0, vec![0xff, 0xfe])),
        "UTF-8",
    );
    add(
        "address: raw address empty",
        addr(&addr_with(f, 1, vec![])),
        "address",
    );
    let (_, fields) = split_addr(&f.addr);
    let mut raw = fields[1].clone();
    raw.extend_from_slice(&[1, 2, 3, 4]);
    add(
        "address: raw address 4 bytes longer",
        addr(&addr_with(f, 1, raw)),
        "address",
    );
    add(
        "address: raw address of 2000 bytes",
        addr(&addr_with(f, 1, vec![1; 2000])),
        "address",
    );
    let scratch = &fields[2];
    let s_len = find_u64(scratch, 8);
    add(
        "address: scratch word of 16 bytes",
        addr(&addr_with(f, 2, with_u64(scratch, s_len, 16))),
        "scratch",
    );
    add(
        "address: scratch region garbage",
        addr(&addr_with(f, 2, vec![9; scratch.len()])),
        "region blob",
    );
    // The data and epoch regions.
    let data = |d: &[u8]| {
        with_blob(ConnBlob {
            data: d,
            ..f.blob()
        })
    };
    let len_at = find_u64(&f.data, BUF as u64);
    add(
        "region: wrong magic",
        data(&with_u32(&f.data, 0, 7)),
        "not a network region blob",
    );
    add(
        "region: zero length",
        data(&with_u64(&f.data, len_at, 0)),
        "empty region",
    );
    add(
        "region: truncated",
        data(&f.data[..f.data.len() - 1]),
        "region blob of",
    );
    let mut d = f.data.clone();
    d.push(0);
    add("region: one byte longer", data(&d), "region blob of");
    let flags = u32::from_le_bytes(f.data[8..12].try_into().unwrap());
    add(
        "region: other addressing mode",
        data(&with_u32(&f.data, 8, flags ^ 1)),
        "addresses by",
    );
    add(
        "region: unknown flag",
        data(&with_u32(&f.data, 8, flags | 0x8000_0000)),
        "unknown flags",
    );
    if flags & 1 != 0 {
        // Virtual addressing (FI_MR_VIRT_ADDR): a region that wraps the address space, and
        // one at address 0.
        let base_at = find_u64(&f.data, f.mem.as_ptr() as u64);
        add(
            "region: wraps the address space",
            data(&with_u64(&f.data, base_at, u64::MAX - 100)),
            "wraps",
        );
        add(
            "region: at address 0",
            data(&with_u64(&f.data, base_at, 0)),
            "virtual address 0",
        );
    } else {
        // Offset addressing: the base must be 0. The base is the u64 before the length.
        add(
            "region: offset mode with a base",
            data(&with_u64(&f.data, len_at - 8, 4096)),
            "base",
        );
    }
    add(
        "epoch region: garbage",
        with_blob(ConnBlob {
            epoch: &[3; 40],
            ..f.blob()
        }),
        "region blob",
    );
    let elen = find_u64(&f.epoch_blob, 24);
    let zero_epoch = with_u64(&f.epoch_blob, elen, 0);
    add(
        "epoch region: zero length",
        with_blob(ConnBlob {
            epoch: &zero_epoch,
            ..f.blob()
        }),
        "empty region",
    );
    // The name of a shared epoch block: only on SHM, only one this library makes, only one
    // that exists.
    if is_shm() {
        add(
            "shared epoch: a foreign name",
            with_blob(ConnBlob {
                epoch_shm: b"/dev/../etc/passwd",
                ..f.blob()
            }),
            "not one this library creates",
        );
        add(
            "shared epoch: no such object",
            with_blob(ConnBlob {
                epoch_shm: b"/mscclpp-epoch-999999999-0",
                ..f.blob()
            }),
            "shm_open",
        );
    } else {
        add(
            "shared epoch on a network connection",
            with_blob(ConnBlob {
                epoch_shm: b"/mscclpp-epoch-1-0",
                ..f.blob()
            }),
            "shared epoch block",
        );
    }
    // A valid blob on the wrong tag space: nothing arrives where the real rank listens.
    v.push(Case {
        name: "valid blob on the registration tag space".into(),
        tag: TAG_REG | TAG as u32 as u64,
        msg: valid.clone(),
        want: Want::TimeOut,
        says: "no matching mscclppConnect",
    });
    v.push(Case {
        name: "valid blob, bad acknowledgement".into(),
        tag: conn,
        msg: valid,
        want: Want::BadAck,
        says: "acknowledgement",
    });
    v
}

/// The real rank: a C-API communicator at `root` declaring one connection to rank 1; returns
/// what mscclppConnectionSetup returned, its error text and how long it took.
fn real_rank(root: String) -> (mscclppResult_t, String, Duration) {
    let c = init(&root, 0, 2);
    let mut buf = vec![0u8; BUF];
    ok(connect(c, 1, TAG, &mut buf));
    let (r, el) = timed(|| mscclppConnectionSetup(c));
    let e = last_error();
    ok(mscclppCommDestroy(c));
    (r, e, el)
}

fn run_case(case: &Case) -> (mscclppResult_t, String, Duration, bool) {
    let root = format!("127.0.0.1:{}", free_port());
    let r2 = root.clone();
    let real = std::thread::spawn(move || real_rank(r2));
    let boot = Bootstrap::from_addr(&root, 1, 2).unwrap();
    // The real rank's blob shows it is inside setup.
    boot.recv(0, TAG_CONN | TAG as u32 as u64).unwrap();
    boot.send(0, case.tag, &case.msg).unwrap();
    if case.want == Want::BadAck {
        boot.send(0, TAG_ACK | TAG as u32 as u64, b"no").unwrap();
    }
    // A real rank that accepted the blob acknowledges it.
    let acked = boot.recv(0, TAG_ACK | TAG as u32 as u64).is_ok();
    let (r, e, el) = real.join().expect("the real rank panicked");
    drop(boot);
    (r, e, el, acked)
}

/// A peer whose setup envelope declares another buffer size than the region its blob
/// registered (a larger one would let kernels aim past the region, a smaller one hides part of
/// it) is refused by `mscclppConnectionSetup`, naming both sizes; nothing is acknowledged.
fn lying_size_is_refused(size: u64) {
    let f = Fake::new();
    let root = format!("127.0.0.1:{}", free_port());
    let r2 = root.clone();
    let real = std::thread::spawn(move || {
        let c = init(&r2, 0, 2);
        let mut buf = vec![0u8; BUF];
        ok(connect(c, 1, TAG, &mut buf));
        let r = mscclppConnectionSetup(c);
        let e = last_error();
        ok(mscclppCommDestroy(c));
        (r, e)
    });
    let boot = Bootstrap::from_addr(&root, 1, 2).unwrap();
    let own = boot.recv(0, TAG_CONN | TAG as u32 as u64).unwrap();
    let theirs = ConnBlob::decode(&own, 0, TAG, transport(), is_shm()).unwrap();
    let mut f = f;
    f.ep.add_peer(0, theirs.addr).unwrap();
    let msg = ConnBlob { size, ..f.blob() }.encode();
    boot.send(0, TAG_CONN | TAG as u32 as u64, &msg).unwrap();
    let acked = boot.recv(0, TAG_ACK | TAG as u32 as u64).is_ok();
    let (r, e) = real.join().expect("the real rank panicked");
    assert_eq!(r, mscclppRemoteError, "{e}");
    assert!(
        e.contains(&format!("{size}-byte buffer")) && e.contains(&format!("{BUF} bytes")),
        "{e}"
    );
    assert!(!acked, "a refused setup acknowledged");
    drop(boot);
}

/// The fake rank's half of a correct setup, then data: the real rank puts 1 KiB with a
/// signal, which arrives.
fn good_setup() {
    let mut f = Fake::new();
    let root = format!("127.0.0.1:{}", free_port());
    let r2 = root.clone();
    let real = std::thread::spawn(move || {
        let c = init(&r2, 0, 2);
        let mut buf: Vec<u8> = (0..BUF).map(|i| pattern(3, i)).collect();
        ok(connect(c, 1, TAG, &mut buf));
        ok(mscclppConnectionSetup(c));
        ok(mscclppProxyLaunch(c));
        let d = &mut dev_conns(c)[0];
        put_signal(d, 1024, 1024, 1024);
        flush(d);
        ok(mscclppBootstrapBarrier(c));
        ok(mscclppProxyStop(c));
        ok(mscclppCommDestroy(c));
    });
    let boot = Bootstrap::from_addr(&root, 1, 2).unwrap();
    let own = boot.recv(0, TAG_CONN | TAG as u32 as u64).unwrap();
    let theirs = ConnBlob::decode(&own, 0, TAG, transport(), is_shm()).unwrap();
    f.ep.add_peer(0, theirs.addr).unwrap();
    let msg = f.blob().encode();
    boot.send(0, TAG_CONN | TAG as u32 as u64, &msg).unwrap();
    // An acknowledgement with no link (this fake keeps nothing for the real rank); the real
    // rank's carries its link after the "ok".
    boot.send(0, TAG_ACK | TAG as u32 as u64, b"ok").unwrap();
    let ack = boot.recv(0, TAG_ACK | TAG as u32 as u64).unwrap();
    assert!(ack.starts_with(b"ok"), "{ack:?}");
    boot.watch_peers(&[0]).unwrap();
    // Our "proxy": progress the endpoint until the signal arrives.
    let ep = Arc::new(Mutex::new(std::mem::replace(
        &mut f.ep,
        open_endpoint(is_shm()),
    )));
    // (`f.ep` is now a spare, unused endpoint; `ep` is the one the real rank writes to.)
    let stop = Arc::new(AtomicBool::new(false));
    let (ep2, stop2) = (ep.clone(), stop.clone());
    let progress = std::thread::spawn(move || {
        // Ends when the test sets `stop` (Release below).
        while !stop2.load(Ordering::Acquire) {
            ep2.lock().unwrap().progress().unwrap();
            std::thread::yield_now();
        }
    });
    let t0 = Instant::now();
    // Ends when the signal arrives, or panics after 20 s.
    while f.signals() != 1 {
        assert!(t0.elapsed() < Duration::from_secs(20), "no signal");
        std::thread::yield_now();
    }
    for i in 0..BUF / 8 {
        let want = if (128..256).contains(&i) {
            u64::from_le_bytes(std::array::from_fn(|k| pattern(3, i * 8 + k)))
        } else {
            0
        };
        assert_eq!(f.word(i), want, "word {i} of the fake's region");
    }
    boot.barrier().unwrap();
    real.join().expect("real rank");
    for i in BUF / 8..2 * BUF / 8 {
        assert_eq!(f.word(i), 0, "canary word {i} was written");
    }
    stop.store(true, Ordering::Release);
    progress.join().unwrap();
    drop(boot);
    // The endpoint goes before the memory it registered.
    drop(ep);
    drop(f);
}

fn body() {
    // Warm up (libfabric keeps some process-wide state), then count threads and descriptors.
    good_setup();
    let f = Fake::new();
    let before = threads_and_fds_steady();
    // The real rank's own blob, for the replay case.
    let own = {
        let root = format!("127.0.0.1:{}", free_port());
        let r2 = root.clone();
        let real = std::thread::spawn(move || real_rank(r2));
        let boot = Bootstrap::from_addr(&root, 1, 2).unwrap();
        let own = boot.recv(0, TAG_CONN | TAG as u32 as u64).unwrap();
        drop(boot);
        let _ = real.join().unwrap();
        own
    };
    let list = cases(&f, &own);
    let mut table = Vec::new();
    for case in &list {
        let (r, e, el, acked) = run_case(case);
        table.push(format!("{:<45} {r:?} in {el:.2?}: {e}", case.name));
        let msg = format!(
            "case {:?}: {r:?} after {el:?} (acked {acked}): {e}",
            case.name
        );
        assert_ne!(r, mscclppSuccess, "{msg}");
        assert!(e.contains(case.says), "{msg}");
        match case.want {
            Want::Refuse => {
                assert!(!acked, "{msg}");
                // Refused, not timed out: 2 s short of the timeout (room for a loaded host).
                assert!(el < Duration::from_secs_f64(BOOT_S - 2.0), "{msg}");
            }
            Want::TimeOut => {
                assert!(!acked, "{msg}");
                let t = Duration::from_secs_f64(BOOT_S);
                assert!(el >= t && el < t + Duration::from_secs(3), "{msg}");
            }
            Want::BadAck => assert!(acked, "{msg}"),
        }
    }
    for l in &table {
        println!("{l}");
    }
    // Still usable: a correct peer sets up and receives data; one that claims a larger buffer
    // than it registered is refused at setup.
    drop(f);
    good_setup();
    lying_size_is_refused(1 << 40);
    lying_size_is_refused(BUF as u64 - 8);
    fresh_exchange_in_process();
    let settled = |(t, f): (usize, usize)| t <= before.0 + 1 && f <= before.1 + 2;
    let after = threads_and_fds_settled(Duration::from_secs(5), settled);
    println!(
        "{} cases; threads/fds before {before:?}, after {after:?}",
        list.len()
    );
    assert!(
        settled(after),
        "leaked threads or descriptors: {before:?} -> {after:?}"
    );
}

fn run(name: &str, provider: &str) {
    if is_rank(name) {
        return body();
    }
    spawn(name, 1, &rank_env(provider, BOOT_S, 5.0)).expect_success(Duration::from_secs(55));
}

#[test]
fn corrupt_setup_blobs_are_refused_tcp() {
    run("corrupt_setup_blobs_are_refused_tcp", "tcp");
}

#[test]
fn corrupt_setup_blobs_are_refused_shm() {
    run("corrupt_setup_blobs_are_refused_shm", "shm");
}
