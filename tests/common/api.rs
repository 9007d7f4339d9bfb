//! Thin test helpers over the C exports (called as Rust functions, exactly as C would).
#![allow(dead_code)]

use mscclpp::abi::mscclppResult_t::{self, *};
use mscclpp::abi::*;
use mscclpp::capi::buffer::*;
use mscclpp::capi::comm::*;
use mscclpp::capi::conn::*;
use mscclpp::capi::devconn::*;
use mscclpp::capi::mscclppComm_t;
use std::ffi::{CStr, CString};

pub fn last_error() -> String {
    unsafe { CStr::from_ptr(mscclppGetLastError()) }
        .to_string_lossy()
        .into_owned()
}

#[track_caller]
pub fn ok(r: mscclppResult_t) {
    assert_eq!(r, mscclppSuccess, "call failed: {}", last_error());
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
/// name used with mscclppTransportIB).
pub fn transport() -> (i32, Option<String>) {
    match std::env::var("MSCCLPP_TEST_TRANSPORT").as_deref() {
        Ok("shm") => (mscclppTransport_t::mscclppTransportSHM as i32, None),
        _ => (mscclppTransport_t::mscclppTransportIB as i32, None),
    }
}

pub fn connect(c: mscclppComm_t, peer: usize, tag: i32, buf: &mut [u8]) -> mscclppResult_t {
    let (t, dev) = transport();
    let dev = dev.map(|d| CString::new(d).unwrap());
    mscclppConnect(
        c,
        peer as i32,
        tag,
        buf.as_mut_ptr().cast(),
        buf.len() as u64,
        t,
        dev.as_ref().map_or(std::ptr::null(), |d| d.as_ptr()),
    )
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
pub fn async_error(c: mscclppComm_t) -> mscclppResult_t {
    let mut r = mscclppSuccess;
    ok(mscclppCommGetAsyncError(c, &mut r));
    r
}

/// Fills a byte pattern unique to (rank, index).
pub fn pattern(rank: usize, i: usize) -> u8 {
    (rank as u8)
        .wrapping_mul(31)
        .wrapping_add(i as u8)
        .wrapping_add((i >> 8) as u8)
}
