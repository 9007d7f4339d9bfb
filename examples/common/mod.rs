//! Shared by the Rust examples (`put_bench`, `signal_ratio`, `soak`): exit on a failed call
//! with the library's message, `--name value` arguments, and a two-rank connection.

use mscclpp::abi::mscclppResult_t::{self, mscclppSuccess};
use mscclpp::capi::comm::mscclppGetLastError;
use std::ffi::CStr;

/// Exits 1 with `what` and the library's last error unless `r` is success.
pub fn ok(r: mscclppResult_t, what: &str) {
    if r != mscclppSuccess {
        // SAFETY: the library returns a NUL-terminated string owned by this thread.
        let e = unsafe { CStr::from_ptr(mscclppGetLastError()) }.to_string_lossy();
        eprintln!("{} failed: {e}", what);
        std::process::exit(1);
    }
}

/// The value after `name` on the command line, or `default`.
pub fn arg(name: &str, default: &str) -> String {
    let a: Vec<String> = std::env::args().collect();
    a.iter()
        .position(|x| x == name)
        .and_then(|i| a.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

/// In a rank started by [`spawn_ranks`] with `prefix`: its rank and the root's `ip:port`.
/// None in the parent (no `<prefix>_RANK`).
pub fn rank_env(prefix: &str) -> Option<(usize, std::ffi::CString)> {
    let rank = std::env::var(format!("{prefix}_RANK")).ok()?;
    let rank = rank.parse().expect("a numeric rank");
    let root = std::env::var(format!("{prefix}_ROOT")).expect("the root address");
    Some((
        rank,
        std::ffi::CString::new(root).expect("no NUL in the root address"),
    ))
}

/// Runs `n` copies of this program with the same arguments as the ranks of one communicator
/// rooted on a free loopback port (`<prefix>_RANK`, `<prefix>_ROOT`), over libfabric provider
/// `provider` unless it is `shm`; true if every rank succeeded.
pub fn spawn_ranks(n: usize, prefix: &str, provider: &str) -> bool {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port();
    let exe = std::env::current_exe().expect("this program's path");
    let kids: Vec<_> = (0..n)
        .map(|r| {
            let mut c = std::process::Command::new(&exe);
            c.args(std::env::args().skip(1))
                .env(format!("{prefix}_RANK"), r.to_string())
                .env(format!("{prefix}_ROOT"), format!("127.0.0.1:{port}"));
            if provider != "shm" {
                c.env("MSCCLPP_NET_PROVIDER", provider);
            }
            c.spawn().expect("starting a rank")
        })
        .collect();
    let mut all_ok = true;
    for mut k in kids {
        all_ok &= k.wait().is_ok_and(|s| s.success());
    }
    all_ok
}

/// The transport a `--provider` selects: SHM for `shm`, libfabric (IB) for any other.
pub fn transport(provider: &str) -> mscclpp::abi::mscclppTransport_t {
    use mscclpp::abi::mscclppTransport_t::*;
    if provider == "shm" {
        mscclppTransportSHM
    } else {
        mscclppTransportIB
    }
}

/// Rank `rank` of a two-rank communicator rooted at `root`: connects `buf` to the other rank
/// over `tr`, sets the connection up, starts the proxy; returns the communicator and the
/// device connection to the other rank.
#[allow(dead_code)] // `soak` connects to every rank, not to one other.
pub fn connect_pair(
    rank: usize,
    root: &std::ffi::CStr,
    buf: &mut [u8],
    tr: mscclpp::abi::mscclppTransport_t,
) -> (
    mscclpp::capi::mscclppComm_t,
    *mut mscclpp::abi::mscclppDevConn,
) {
    let (comm, conns) = connect_peers(rank, 2, root, &[1 - rank], buf, tr);
    (comm, conns[0])
}

/// Rank `rank` of an `nranks`-rank communicator rooted at `root`: connects `buf` to each rank
/// of `peers` over `tr`, sets the connections up, starts the proxy; returns the communicator
/// and the device connections, in the order of `peers`.
#[allow(dead_code)] // Not every example uses it.
pub fn connect_peers(
    rank: usize,
    nranks: usize,
    root: &std::ffi::CStr,
    peers: &[usize],
    buf: &mut [u8],
    tr: mscclpp::abi::mscclppTransport_t,
) -> (
    mscclpp::capi::mscclppComm_t,
    Vec<*mut mscclpp::abi::mscclppDevConn>,
) {
    use mscclpp::capi::conn::*;
    let mut comm = std::ptr::null_mut();
    ok(
        mscclpp::capi::comm::mscclppCommInitRank(
            &mut comm,
            nranks as i32,
            root.as_ptr(),
            rank as i32,
        ),
        "init",
    );
    for &p in peers {
        connect_to(comm, p, buf, tr);
    }
    ok(mscclppConnectionSetup(comm), "setup");
    ok(mscclppProxyLaunch(comm), "proxy");
    let conns = peers
        .iter()
        .map(|&p| {
            let mut d = std::ptr::null_mut();
            ok(
                mscclppGetDeviceConnection(comm, p as i32, 0, &mut d),
                "conn",
            );
            d
        })
        .collect();
    (comm, conns)
}

/// Connects `buf` to rank `peer` (tag 0) over `tr`.
pub fn connect_to(
    comm: mscclpp::capi::mscclppComm_t,
    peer: usize,
    buf: &mut [u8],
    tr: mscclpp::abi::mscclppTransport_t,
) {
    ok(
        mscclpp::capi::conn::mscclppConnect(
            comm,
            peer as i32,
            0,
            buf.as_mut_ptr().cast(),
            buf.len() as u64,
            tr as i32,
            std::ptr::null(),
        ),
        "connect",
    );
}
