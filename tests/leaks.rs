//! Resource accounting: 100 create / connect / exchange / destroy cycles of a 2-rank
//! communicator (ranks as threads of this process, over libfabric tcp and shm) leave the
//! process with the same number of file descriptors and threads as before. scripts/sanitize.sh
//! also runs this binary under valgrind to check for leaked memory.

mod common;

use common::api::*;
use mscclpp::abi::mscclppResult_t::*;
use mscclpp::abi::mscclppTransport_t;
use mscclpp::capi::comm::*;
use mscclpp::capi::conn::*;
use mscclpp::capi::devconn::*;
use std::ffi::CString;

/// One communicator lifetime on rank `rank` of 2: connect, exchange 64 KiB each way, destroy.
fn cycle(root: &str, rank: usize, transport: mscclppTransport_t) {
    let c = init(root, rank, 2);
    let mut buf = vec![0u8; 2 << 16];
    let half = 1usize << 16;
    for i in 0..half {
        buf[rank * half + i] = pattern(rank, i);
    }
    ok(mscclppConnect(
        c,
        1 - rank as i32,
        0,
        buf.as_mut_ptr().cast(),
        buf.len() as u64,
        transport as i32,
        std::ptr::null(),
    ));
    ok(mscclppConnectionSetup(c));
    ok(mscclppProxyLaunch(c));
    let d = &mut dev_conns(c)[0];
    let off = (rank * half) as u64;
    ok(mscclppDevConnPutWithSignal(d, off, off, half as u64));
    ok(mscclppDevConnFlush(d));
    ok(mscclppDevConnWait(d));
    let peer = 1 - rank;
    for i in 0..half {
        assert_eq!(buf[peer * half + i], pattern(peer, i));
    }
    finish(c);
}

fn cycles(n: usize, transport: mscclppTransport_t) {
    for _ in 0..n {
        let root = format!("127.0.0.1:{}", common::free_port());
        let r2 = root.clone();
        let t = std::thread::spawn(move || cycle(&r2, 1, transport));
        cycle(&root, 0, transport);
        t.join().unwrap();
    }
}

#[test]
fn create_destroy_cycles_leave_no_fds_or_threads() {
    let n: usize = std::env::var("MSCCLPP_TEST_CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    std::env::set_var("MSCCLPP_NET_PROVIDER", "tcp");
    // Warm-up: libfabric and the CUDA probe set up process-wide state once (provider tables,
    // a few descriptors); that is not a per-communicator leak.
    cycles(2, mscclppTransport_t::mscclppTransportIB);
    cycles(2, mscclppTransport_t::mscclppTransportSHM);
    let (threads, fds) = common::threads_and_fds_steady();
    cycles(n / 2, mscclppTransport_t::mscclppTransportIB);
    cycles(n - n / 2, mscclppTransport_t::mscclppTransportSHM);
    let after =
        common::threads_and_fds_settled(std::time::Duration::from_secs(5), |(t, _)| t <= threads);
    assert_eq!(after.1, fds, "file descriptors after {n} cycles");
    assert_eq!(after.0, threads, "threads after {n} cycles");
    let bad = CString::new("127.0.0.1:1").unwrap();
    let mut c = std::ptr::null_mut();
    // And the library still answers bad input cleanly afterwards.
    assert_eq!(
        mscclppCommInitRank(&mut c, 0, bad.as_ptr(), 0),
        mscclppInvalidArgument
    );
}
