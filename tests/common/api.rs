//! Thin test helpers over the C exports (called as Rust functions, exactly as C would).
#![allow(dead_code)]

use mscclpp::abi::mscclppResult_t::{self, *};
use mscclpp::abi::*;
use mscclpp::capi::buffer::*;
use mscclpp::capi::comm::*;
use mscclpp::capi::conn::*;
use mscclpp::capi::devconn::*;
use mscclpp::capi::mscclppComm_t;
use std::ffi::{c_char, CStr, CString};
use std::sync::Mutex;

pub fn last_error() -> String {
    unsafe { CStr::from_ptr(mscclppGetLastError()) }
        .to_string_lossy()
        .into_owned()
}

#[track_caller]
pub fn ok(r: mscclppResult_t) {
    assert_eq!(r, mscclppSuccess, "call failed: {}", last_error());
}

/// The library's log lines since `capture_logs` (a process-wide handler).
static LOGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn keep_log(msg: *const c_char) {
    // SAFETY: the library passes a NUL-terminated line.
    let s = unsafe { CStr::from_ptr(msg) }
        .to_string_lossy()
        .into_owned();
    LOGS.lock().unwrap_or_else(|p| p.into_inner()).push(s);
}

/// From now on, keeps every line the library logs (`logged`), through
/// `mscclppSetLogHandler`, as a program would.
pub fn capture_logs() {
    ok(mscclpp::capi::log::mscclppSetLogHandler(Some(keep_log)));
}

/// The lines kept since `capture_logs`.
pub fn logged() -> Vec<String> {
    LOGS.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

pub fn init(root: &str, rank: usize, n: usize) -> mscclppComm_t {
    let mut c: mscclppComm_t = std::ptr::null_mut();
    let a = CString::new(root).unwrap();
    ok(mscclppCommInitRank(
        &mut c,
        n as i32,
        a.as_ptr(),
        rank as i32,
    ));
    c
}

/// The transport under test, from `MSCCLPP_TEST_TRANSPORT` (`shm`, or a libfabric provider
/// name used with mscclppTransportIB), and for IB the `ibDev` name `MSCCLPP_TEST_IBDEV` gives
/// (NULL without it).
pub fn transport() -> (i32, Option<String>) {
    match std::env::var("MSCCLPP_TEST_TRANSPORT").as_deref() {
        Ok("shm") => (mscclppTransport_t::mscclppTransportSHM as i32, None),
        _ => (
            mscclppTransport_t::mscclppTransportIB as i32,
            std::env::var("MSCCLPP_TEST_IBDEV").ok(),
        ),
    }
}

pub fn connect(c: mscclppComm_t, peer: usize, tag: i32, buf: &mut [u8]) -> mscclppResult_t {
    let (t, dev) = transport();
    let dev = dev.map(|d| CString::new(d).unwrap());
    connect_dev(c, peer, tag, buf, t, dev.as_deref())
}

/// Connects `buf` to `peer` over transport `t` (an `mscclppTransport_t` as i32), `ibDev` `dev`.
pub fn connect_dev(
    c: mscclppComm_t,
    peer: usize,
    tag: i32,
    buf: &mut [u8],
    t: i32,
    dev: Option<&CStr>,
) -> mscclppResult_t {
    mscclppConnect(
        c,
        peer as i32,
        tag,
        buf.as_mut_ptr().cast(),
        buf.len() as u64,
        t,
        dev.map_or(std::ptr::null(), |d| d.as_ptr()),
    )
}

/// Connects `buf` to `peer` over transport `t` (no `ibDev`); fails the test unless it succeeds.
pub fn connect_over(
    c: mscclppComm_t,
    peer: usize,
    tag: i32,
    buf: &mut [u8],
    t: mscclppTransport_t,
) {
    ok(connect_dev(c, peer, tag, buf, t as i32, None));
}

pub fn dev_conns(c: mscclppComm_t) -> &'static mut [mscclppDevConn] {
    let mut p: *mut mscclppDevConn = std::ptr::null_mut();
    let mut n = 0;
    ok(mscclppGetAllDeviceConnections(c, &mut p, &mut n));
    unsafe { std::slice::from_raw_parts_mut(p, n as usize) }
}

pub fn put_signal(d: &mut mscclppDevConn, dst: u64, src: u64, size: u64) {
    ok(mscclppDevConnPutWithSignal(d, dst, src, size));
}
pub fn put(d: &mut mscclppDevConn, dst: u64, src: u64, size: u64) {
    ok(mscclppDevConnPut(d, dst, src, size));
}
pub fn signal(d: &mut mscclppDevConn) {
    ok(mscclppDevConnSignal(d));
}
pub fn flush(d: &mut mscclppDevConn) {
    ok(mscclppDevConnFlush(d));
}
pub fn wait(d: &mut mscclppDevConn) {
    ok(mscclppDevConnWait(d));
}
pub fn register(c: mscclppComm_t, buf: &mut [u8]) -> mscclppRegisteredMemory {
    let mut m = mscclppRegisteredMemory { handle: 0 };
    ok(mscclppRegisterBuffer(
        c,
        buf.as_mut_ptr().cast(),
        buf.len(),
        &mut m,
    ));
    m
}

/// Rank `e.rank` of a 2-rank test: a communicator with one connection (tag `tag`, buffer
/// `buf`) to the other rank, set up, its proxy running.
pub fn connected_pair(e: &super::Env, tag: i32, buf: &mut [u8]) -> mscclppComm_t {
    let c = init(&e.root, e.rank, e.n);
    ok(connect(c, 1 - e.rank, tag, buf));
    ok(mscclppConnectionSetup(c));
    ok(mscclppProxyLaunch(c));
    c
}

/// The end of a test rank: wait for every rank, stop the proxies, destroy the communicator.
pub fn finish(c: mscclppComm_t) {
    ok(mscclppBootstrapBarrier(c));
    ok(mscclppProxyStop(c));
    ok(mscclppCommDestroy(c));
}

pub fn async_error(c: mscclppComm_t) -> mscclppResult_t {
    let mut r = mscclppSuccess;
    ok(mscclppCommGetAsyncError(c, &mut r));
    r
}

/// Waits until `c` has an asynchronous error (a peer's abort arrives in milliseconds) and
/// returns it; fails the test after 20 s, saying `what` never arrived.
pub fn await_async_error(c: mscclppComm_t, what: &str) -> mscclppResult_t {
    let t0 = std::time::Instant::now();
    // Ends when an error is set, or fails at 20 s.
    loop {
        let r = async_error(c);
        if r != mscclppSuccess {
            return r;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(20),
            "{what} never arrived"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Fills a byte pattern unique to (rank, index).
pub fn pattern(rank: usize, i: usize) -> u8 {
    (rank as u8)
        .wrapping_mul(31)
        .wrapping_add(i as u8)
        .wrapping_add((i >> 8) as u8)
}

/// 2 ranks: rank 0 sends round numbers in slots 0..16 of `buf`, rank 1 answers in slots 16..32,
/// `rounds` times; each side checks every value, so a lost, duplicated or reordered put or
/// signal fails. Ends with a flush, a barrier, proxy stop and destroy.
pub fn pingpong(e: &super::Env, rounds: u64) {
    const SLOTS: usize = 16;
    let mut buf = vec![0u8; 2 * SLOTS * 8];
    let c = connected_pair(e, 1, &mut buf);
    let d = &mut dev_conns(c)[0];
    let base = |r: usize| if r == 0 { 0 } else { SLOTS * 8 };
    let bp = buf.as_mut_ptr();
    let send = |d: &mut _, round: u64, rank: usize| {
        let off = base(rank) + (round as usize % SLOTS) * 8;
        // SAFETY: within buf; the peer only reads this slot after our signal.
        unsafe { (bp.add(off) as *mut u64).write_volatile(round) };
        put_signal(d, off as u64, off as u64, 8);
    };
    let recv = |d: &mut _, round: u64, from: usize| {
        wait(d);
        let off = base(from) + (round as usize % SLOTS) * 8;
        // SAFETY: within buf; written by the peer (or our staging proxy) before the signal.
        let v = unsafe { (bp.add(off) as *const u64).read_volatile() };
        assert_eq!(v, round, "round {round}: slot holds {v}");
    };
    for round in 0..rounds {
        if round % 1000 == 0 {
            progress(round);
        }
        if e.rank == 0 {
            send(d, round, 0);
            recv(d, round, 1);
        } else {
            recv(d, round, 0);
            send(d, round, 1);
        }
    }
    flush(d);
    finish(c);
}

/// Tells the parent this rank got to `n` (of a long loop), if it gave a file for that
/// (`MSCCLPP_TEST_PROGRESS`, read by `Ranks::wait_progressing`).
pub fn progress(n: u64) {
    if let Ok(p) = std::env::var("MSCCLPP_TEST_PROGRESS") {
        // A torn read by the parent only looks like progress too; each rank writes its own
        // number, and any change counts.
        let _ = std::fs::write(p, n.to_le_bytes());
    }
}

/// The all-to-all step of the end-to-end tests, once connections are set up and proxies run:
/// put our chunk (at `rank * chunk` of `buf`, the connected buffer) to every connection with a
/// signal, flush them all, wait for every peer, and check every byte of every rank's chunk.
/// Then barrier, proxy stop and destroy.
pub fn alltoall_and_finish(c: mscclppComm_t, buf: &[u8], rank: usize, n: usize, chunk: usize) {
    let conns = dev_conns(c);
    assert_eq!(conns.len(), n - 1);
    let off = (rank * chunk) as u64;
    for d in conns.iter_mut() {
        put_signal(d, off, off, chunk as u64);
    }
    for d in conns.iter_mut() {
        flush(d);
    }
    for d in conns.iter_mut() {
        wait(d);
    }
    for p in 0..n {
        for i in 0..chunk {
            // Volatile: the peers wrote these bytes behind the compiler's back.
            // SAFETY: within buf.
            let b = unsafe { buf.as_ptr().add(p * chunk + i).read_volatile() };
            assert_eq!(b, pattern(p, i), "rank {rank} byte {i} of rank {p}'s chunk");
        }
    }
    finish(c);
}
