//! End-to-end tests through the C API with host memory: ranks as processes, connections over
//! libfabric (tcp, net, shm), the host-driven device API, every byte verified.

mod common;
mod fault_util;

use common::api::*;
use common::*;
use fault_util::{mark, timed, wait_mark, Dir};
use mscclpp::abi::mscclppResult_t::*;
use mscclpp::capi::buffer::*;
use mscclpp::capi::comm::*;
use mscclpp::capi::conn::*;
use mscclpp::capi::devconn::*;
use std::time::Duration;

/// How long the ranks of a test may go without progress: from the start, or since a long test's
/// ranks last reported some (`common::api::progress`), up to `CAP` in all.
const DEADLINE: Duration = Duration::from_secs(120);
const CAP: Duration = Duration::from_secs(900);

/// Transport settings for a provider name: `shm` is mscclppTransportSHM, anything else is
/// mscclppTransportIB over that libfabric provider.
fn transport_env(provider: &str) -> Vec<(&'static str, String)> {
    let mut v = vec![
        ("MSCCLPP_TEST_TRANSPORT", provider.to_string()),
        ("MSCCLPP_WAIT_TIMEOUT", "30".into()),
        ("MSCCLPP_BOOTSTRAP_TIMEOUT", "30".into()),
    ];
    if provider != "shm" {
        v.push(("MSCCLPP_NET_PROVIDER", provider.to_string()));
    }
    v
}

/// `env` with `key` set to `val` (replacing an earlier value).
fn with(
    mut env: Vec<(&'static str, String)>,
    key: &'static str,
    val: &str,
) -> Vec<(&'static str, String)> {
    env.retain(|(k, _)| *k != key);
    env.push((key, val.to_string()));
    env
}

/// Runs `body` as every rank of test `name` (in children), or launches the ranks (in the parent).
fn ranks(name: &str, n: usize, provider: &str, body: fn(Env)) {
    if skip_missing_provider(name, provider) {
        return;
    }
    if is_rank(name) {
        body(env());
        return;
    }
    let progress =
        std::env::temp_dir().join(format!("mscclpp-{name}-{}.progress", std::process::id()));
    let mut env = transport_env(provider);
    env.push(("MSCCLPP_TEST_PROGRESS", progress.display().to_string()));
    let codes = spawn(name, n, &env).wait_progressing(&progress, DEADLINE, CAP);
    let _ = std::fs::remove_file(&progress);
    assert_exited_0(codes);
}

// ---- all-to-all exchange -------------------------------------------------------------------

const CHUNK: usize = 256 * 1024 + 3;

fn alltoall(e: Env) {
    let c = init(&e.root, e.rank, e.n);
    let mut buf = vec![0u8; e.n * CHUNK];
    for i in 0..CHUNK {
        buf[e.rank * CHUNK + i] = pattern(e.rank, i);
    }
    for p in (0..e.n).filter(|&p| p != e.rank) {
        ok(connect(c, p, 0, &mut buf));
    }
    ok(mscclppConnectionSetup(c));
    ok(mscclppProxyLaunch(c));
    alltoall_and_finish(c, &buf, e.rank, e.n, CHUNK);
}

#[test]
fn alltoall_tcp_2() {
    ranks("alltoall_tcp_2", 2, "tcp", alltoall);
}
#[test]
fn alltoall_tcp_4() {
    ranks("alltoall_tcp_4", 4, "tcp", alltoall);
}
#[test]
fn alltoall_net_2() {
    ranks("alltoall_net_2", 2, "net", alltoall);
}
#[test]
fn alltoall_net_4() {
    ranks("alltoall_net_4", 4, "net", alltoall);
}
#[test]
fn alltoall_shm_2() {
    ranks("alltoall_shm_2", 2, "shm", alltoall);
}
#[test]
fn alltoall_shm_4() {
    ranks("alltoall_shm_4", 4, "shm", alltoall);
}

// ---- all-to-all over the unordered test layer -------------------------------------------

/// Rounds of an all-to-all over the unordered test layer (`MSCCLPP_TEST_UNORDERED`: writes
/// and completions delayed and reordered as an EFA-like or psm3-like provider may), each
/// chunk checked as soon as its signal is seen; the layer's own log line proves it ran.
fn alltoall_unordered(e: Env) {
    capture_logs();
    const ROUNDS_A2A: usize = 6;
    let c = init(&e.root, e.rank, e.n);
    let mut buf = vec![0u8; e.n * CHUNK];
    for p in (0..e.n).filter(|&p| p != e.rank) {
        ok(connect(c, p, 0, &mut buf));
    }
    ok(mscclppConnectionSetup(c));
    ok(mscclppProxyLaunch(c));
    let conns = dev_conns(c);
    let off = (e.rank * CHUNK) as u64;
    for r in 0..ROUNDS_A2A {
        let seed = |p: usize| 1 + r * 8 + p;
        for i in 0..CHUNK {
            buf[e.rank * CHUNK + i] = pattern(seed(e.rank), i);
        }
        for d in conns.iter_mut() {
            put_signal(d, off, off, CHUNK as u64);
        }
        for d in conns.iter_mut() {
            wait(d);
        }
        for p in (0..e.n).filter(|&p| p != e.rank) {
            for i in 0..CHUNK {
                // Volatile: the peers wrote these bytes behind the compiler's back.
                // SAFETY: within buf.
                let b = unsafe { buf.as_ptr().add(p * CHUNK + i).read_volatile() };
                assert_eq!(
                    b,
                    pattern(seed(p), i),
                    "round {r}: rank {} byte {i} of rank {p}'s chunk, right after its signal",
                    e.rank
                );
            }
        }
        // Our chunk's writes are done before it is refilled, and every rank has checked
        // this round before any writes the next one.
        for d in conns.iter_mut() {
            flush(d);
        }
        ok(mscclppBootstrapBarrier(c));
    }
    assert_eq!(async_error(c), mscclppSuccess);
    finish(c);
    let logs = logged();
    assert!(
        logs.iter().any(|l| l.contains("unordered test layer")),
        "the unordered test layer did not run; log:\n{}",
        logs.join("\n")
    );
    // The way signals travel under the profile (docs/PROVIDERS.md): counted by the receiver
    // where nothing is ordered and CQ data is 4 bytes (EFA-like); flags of their own, queued
    // behind writes above the ordered size, where the chunks (256 KiB) are above it
    // (psm3-like, verbs-like: a signal rides only a write that is itself ordered); flags of
    // their own where the provider refuses CQ data on writes, which the endpoint found out by
    // trying (cxi-like).
    let profile = std::env::var("MSCCLPP_TEST_UNORDERED").unwrap_or_default();
    let way = match profile.split(':').next().unwrap_or("") {
        "efa" => "counted by the receiver: ",
        "cxi" => "the provider refused a write carrying remote CQ data to the endpoint itself",
        _ => "flags were queued behind their writes",
    };
    assert!(
        logs.iter().any(|l| l.contains(way)),
        "{profile}: no {way:?} in the log:\n{}",
        logs.join("\n")
    );
}

/// `ranks` with the settings `vars` over `provider`, every rank bounded by `DEADLINE`.
fn ranks_env(name: &str, n: usize, provider: &str, vars: &[(&'static str, &str)], body: fn(Env)) {
    if skip_missing_provider(name, provider) {
        return;
    }
    if is_rank(name) {
        return body(env());
    }
    let env = vars
        .iter()
        .fold(transport_env(provider), |e, &(k, v)| with(e, k, v));
    spawn(name, n, &env).expect_success(DEADLINE);
}

/// `ranks` with `key` set to `val` over `provider`.
fn ranks_with(name: &str, n: usize, provider: &str, key: &'static str, val: &str, body: fn(Env)) {
    ranks_env(name, n, provider, &[(key, val)], body);
}

/// `ranks` with the unordered test layer of `profile` (`efa` or `psm3`) over `provider`,
/// logging at INFO (the body checks the layer ran, and which way signals went).
fn ranks_unordered(name: &str, n: usize, provider: &str, profile: &str, body: fn(Env)) {
    let vars = [
        ("MSCCLPP_TEST_UNORDERED", profile),
        ("MSCCLPP_DEBUG", "INFO"),
    ];
    ranks_env(name, n, provider, &vars, body);
}

#[test]
fn alltoall_unordered_efa_tcp_4() {
    ranks_unordered(
        "alltoall_unordered_efa_tcp_4",
        4,
        "tcp",
        "efa",
        alltoall_unordered,
    );
}
#[test]
fn alltoall_unordered_efa_shm_3() {
    ranks_unordered(
        "alltoall_unordered_efa_shm_3",
        3,
        "shm",
        "efa",
        alltoall_unordered,
    );
}
#[test]
fn alltoall_unordered_psm3_tcp_3() {
    ranks_unordered(
        "alltoall_unordered_psm3_tcp_3",
        3,
        "tcp",
        "psm3",
        alltoall_unordered,
    );
}
#[test]
fn alltoall_unordered_cxi_tcp_3() {
    ranks_unordered(
        "alltoall_unordered_cxi_tcp_3",
        3,
        "tcp",
        "cxi",
        alltoall_unordered,
    );
}
#[test]
fn alltoall_unordered_verbs_shm_3() {
    ranks_unordered(
        "alltoall_unordered_verbs_shm_3",
        3,
        "shm",
        "verbs",
        alltoall_unordered,
    );
}

// ---- two endpoints of one rank to one endpoint of its peer (issue 40, finding 3) -----------

/// Bytes each rank owns of each buffer: above every ordered size the unordered layer plays.
const TWO_EP_HALF: usize = 96 << 10;
const TWO_EP_ROUNDS: usize = 8;

/// Rank 0 connects to rank 1 twice over IB: buffer A with ibDev NULL (the library's choice, the
/// loopback domain) and buffer B with ibDev "lo" (named): two endpoints on rank 0. Rank 1
/// connects both with ibDev NULL: one endpoint, to which rank 0's two are two peers, each with
/// its own address vector entry, region keys, staging channel and counting stream. Rounds of
/// `putWithSignal` both ways on both connections, every byte checked right after its signal.
/// Keyed by rank, rank 1's writes on connection B went to rank 0's first endpoint with the
/// second's keys: an error over tcp ("Transport endpoint is not connected"), and with a
/// provider's per-endpoint keys (the cxi-like layer) bytes in the wrong buffer.
fn two_endpoints_one_peer(e: Env) {
    capture_logs();
    let c = init(&e.root, e.rank, e.n);
    let (me, peer) = (e.rank, 1 - e.rank);
    let mut bufs = [vec![0u8; 2 * TWO_EP_HALF], vec![0u8; 2 * TWO_EP_HALF]];
    let ib = mscclpp::abi::mscclppTransport_t::mscclppTransportIB as i32;
    let lo = std::ffi::CString::new("lo").unwrap();
    for (tag, buf) in bufs.iter_mut().enumerate() {
        let dev = (me == 0 && tag == 1).then_some(lo.as_c_str());
        ok(connect_dev(c, peer, tag as i32, buf, ib, dev));
    }
    ok(mscclppConnectionSetup(c));
    let endpoints = if me == 0 { 2 } else { 1 };
    let said = format!("2 connections set up over {endpoints} endpoints");
    assert!(
        logged().iter().any(|l| l.contains(&said)),
        "rank {me}: no {said:?} in the log:\n{}",
        logged().join("\n")
    );
    ok(mscclppProxyLaunch(c));
    let conns = dev_conns(c);
    let off = (me * TWO_EP_HALF) as u64;
    let seed = |r: usize, buf: usize, rank: usize| 3 + r * 16 + buf * 4 + rank;
    for r in 0..TWO_EP_ROUNDS {
        for (k, buf) in bufs.iter_mut().enumerate() {
            for i in 0..TWO_EP_HALF {
                buf[me * TWO_EP_HALF + i] = pattern(seed(r, k, me), i);
            }
        }
        for d in conns.iter_mut() {
            put_signal(d, off, off, TWO_EP_HALF as u64);
        }
        for (k, d) in conns.iter_mut().enumerate() {
            wait(d);
            for i in 0..TWO_EP_HALF {
                // Volatile: the peer wrote these bytes behind the compiler's back.
                // SAFETY: within the buffer.
                let b = unsafe { bufs[k].as_ptr().add(peer * TWO_EP_HALF + i).read_volatile() };
                assert_eq!(
                    b,
                    pattern(seed(r, k, peer), i),
                    "round {r}: rank {me}, buffer {k} (tag {k}), byte {i} of rank {peer}'s half, right after its signal"
                );
            }
        }
        for d in conns.iter_mut() {
            flush(d);
        }
        ok(mscclppBootstrapBarrier(c));
    }
    assert_eq!(async_error(c), mscclppSuccess);
    finish(c);
}

/// `two_endpoints_one_peer` over tcp, with `vars` added (logs at INFO, for the endpoint count).
fn two_endpoints(name: &str, vars: &[(&'static str, &str)]) {
    let mut all = vec![("MSCCLPP_DEBUG", "INFO")];
    all.extend_from_slice(vars);
    ranks_env(name, 2, "tcp", &all, two_endpoints_one_peer);
}

#[test]
fn two_endpoints_one_peer_tcp() {
    two_endpoints("two_endpoints_one_peer_tcp", &[]);
}

/// Keys as cxi keeps them (from 1 on every endpoint), where a write under the wrong endpoint's
/// key lands in another buffer instead of failing.
#[test]
fn two_endpoints_one_peer_unordered_cxi_tcp() {
    two_endpoints(
        "two_endpoints_one_peer_unordered_cxi_tcp",
        &[("MSCCLPP_TEST_UNORDERED", "cxi")],
    );
}

/// Signals counted by the receiver: a counting stream per writing endpoint.
#[test]
fn two_endpoints_one_peer_unordered_efa_tcp() {
    two_endpoints(
        "two_endpoints_one_peer_unordered_efa_tcp",
        &[("MSCCLPP_TEST_UNORDERED", "efa")],
    );
}

/// Every region staged: a staging channel per writing endpoint.
#[test]
fn two_endpoints_one_peer_staged_tcp() {
    two_endpoints(
        "two_endpoints_one_peer_staged_tcp",
        &[
            ("MSCCLPP_TEST_FORCE_STAGING", "1"),
            ("MSCCLPP_NET_STAGING_BYTES", "65536"),
        ],
    );
}

// ---- a peer that stops first (issue 40, finding 6) ----------------------------------------

/// The wait timeout of `peer_stopped_first`: what a flush waiting for a stopped peer would
/// take, and far above what it must take.
const STOPPED_FIRST_TIMEOUT_S: &str = "10";

/// Rank 1 takes rank 0's `putWithSignal` and stops its proxies at once, with no barrier before
/// (a 2023 program may: its flush was local). Rank 0 then flushes (which waits for delivery
/// here) and stops, after one more small put (inline over SHM). All return at once, well within
/// the wait timeout, and the put arrives: after its stop, rank 1's endpoints are still
/// progressed, and its inline-put rings applied (`proxy::Keeper`), until its next launch or
/// destroy. Before, rank 0's flush waited out the timeout and failed.
fn peer_stopped_first(e: Env) {
    const N: usize = 64 << 10;
    const SMALL: usize = 1024;
    let c = init(&e.root, e.rank, e.n);
    let mut buf = vec![0u8; N];
    ok(connect(c, 1 - e.rank, 0, &mut buf));
    ok(mscclppConnectionSetup(c));
    ok(mscclppProxyLaunch(c));
    let d = &mut dev_conns(c)[0];
    if e.rank == 0 {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = pattern(9, i);
        }
        put_signal(d, 0, 0, N as u64);
        // Rank 1 has stopped once it reaches this barrier.
        ok(mscclppBootstrapBarrier(c));
        // The flush of the put before (through the endpoint), then one more put, small: over
        // SHM it goes inline, through rank 1's ring, which rank 1 must still apply for the
        // second flush to end; then the stop.
        for (i, b) in buf[..SMALL].iter_mut().enumerate() {
            *b = pattern(11, i);
        }
        let (r, el) = timed(|| {
            let r = mscclppDevConnFlush(d);
            if r != mscclppSuccess {
                return r;
            }
            let r = mscclppDevConnPut(d, 0, 0, SMALL as u64);
            if r != mscclppSuccess {
                return r;
            }
            let r = mscclppDevConnFlush(d);
            if r != mscclppSuccess {
                return r;
            }
            mscclppProxyStop(c)
        });
        assert_eq!(
            r,
            mscclppSuccess,
            "flush and stop after the peer's stop: {}",
            last_error()
        );
        assert!(
            el < Duration::from_secs(3),
            "flush and stop after the peer's stop took {el:?}"
        );
    } else {
        wait(d);
        for (i, b) in buf.iter().enumerate() {
            assert_eq!(*b, pattern(9, i), "byte {i}");
        }
        ok(mscclppProxyStop(c));
        ok(mscclppBootstrapBarrier(c));
    }
    // Rank 1 destroys only once rank 0 is done; rank 0's last put has arrived by then.
    ok(mscclppBootstrapBarrier(c));
    if e.rank == 1 {
        for (i, b) in buf[..SMALL].iter().enumerate() {
            // Volatile: rank 0 wrote these bytes behind the compiler's back.
            // SAFETY: within buf.
            let b = unsafe { (b as *const u8).read_volatile() };
            assert_eq!(b, pattern(11, i), "byte {i} of the put after the stop");
        }
    }
    ok(mscclppCommDestroy(c));
}

#[test]
fn peer_stopped_first_tcp() {
    let t = STOPPED_FIRST_TIMEOUT_S;
    ranks_env(
        "peer_stopped_first_tcp",
        2,
        "tcp",
        &[("MSCCLPP_WAIT_TIMEOUT", t)],
        peer_stopped_first,
    );
}

#[test]
fn peer_stopped_first_shm() {
    let t = STOPPED_FIRST_TIMEOUT_S;
    ranks_env(
        "peer_stopped_first_shm",
        2,
        "shm",
        &[("MSCCLPP_WAIT_TIMEOUT", t)],
        peer_stopped_first,
    );
}

// ---- many puts, one signal ----------------------------------------------------------------

const PIECES: usize = 64;
const PIECE: usize = 4096;

fn many_puts_one_signal(e: Env) {
    many_puts_one_signal_after(e, Duration::ZERO);
}

/// `many_puts_one_signal`, rank 0 starting its puts `late`.
fn many_puts_one_signal_after(e: Env, late: Duration) {
    let c = init(&e.root, e.rank, e.n);
    let mut buf = vec![0u8; PIECES * PIECE];
    let peer = 1 - e.rank;
    if e.rank == 0 {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = pattern(7, i);
        }
    }
    ok(connect(c, peer, 5, &mut buf));
    ok(mscclppConnectionSetup(c));
    ok(mscclppProxyLaunch(c));
    let d = &mut dev_conns(c)[0];
    if e.rank == 0 {
        std::thread::sleep(late);
        // Reverse order, so nothing depends on the puts arriving in address order.
        for k in (0..PIECES).rev() {
            let o = (k * PIECE) as u64;
            put(d, o, o, PIECE as u64);
        }
        signal(d);
        flush(d);
    } else {
        wait(d);
        for (i, b) in buf.iter().enumerate() {
            assert_eq!(*b, pattern(7, i), "byte {i}");
        }
    }
    finish(c);
}

#[test]
fn many_puts_one_signal_tcp() {
    ranks("many_puts_one_signal_tcp", 2, "tcp", many_puts_one_signal);
}
#[test]
fn many_puts_one_signal_shm() {
    ranks("many_puts_one_signal_shm", 2, "shm", many_puts_one_signal);
}
#[test]
fn many_puts_one_signal_net() {
    ranks("many_puts_one_signal_net", 2, "net", many_puts_one_signal);
}

/// The receiver's one wait naps (`MSCCLPP_WAIT_MODE=sleep`, as on a crowded host) and the
/// puts start 50 ms into it: a napping helper steps out of the proxy's gate for each nap and
/// back in after it (`host::spin`), and over tcp the data still arrives, every byte.
#[test]
fn many_puts_one_signal_napping_receiver_tcp() {
    ranks_with(
        "many_puts_one_signal_napping_receiver_tcp",
        2,
        "tcp",
        "MSCCLPP_WAIT_MODE",
        "sleep",
        |e| many_puts_one_signal_after(e, Duration::from_millis(50)),
    );
}

// ---- 100,000 ping-pong rounds -----------------------------------------------------------

const ROUNDS: u64 = 100_000;

fn pingpong(e: Env) {
    common::api::pingpong(&e, ROUNDS);
}

#[test]
fn pingpong_100k_tcp() {
    ranks("pingpong_100k_tcp", 2, "tcp", pingpong);
}
#[test]
fn pingpong_100k_shm() {
    ranks("pingpong_100k_shm", 2, "shm", pingpong);
}
#[test]
fn pingpong_100k_net() {
    ranks("pingpong_100k_net", 2, "net", pingpong);
}

// ---- signals alone, and after data ------------------------------------------------------

/// Rank 0 sends a repeating pattern: a signal alone, a put with its signal, a signal right
/// after it (the put may not have arrived yet), a flush, a signal alone again; rank 1 waits for
/// every signal and checks each put's bytes. On SHM the lone signals after a flush are stores
/// into the peer's mapped epoch block while the others go through libfabric: a store that
/// overtook a put would fail the byte check, and one that overtook an earlier signal would make
/// the count step back and a later wait run into its timeout.
fn signals_mixed(e: Env) {
    const ROUNDS: u64 = 3000;
    let mut buf = vec![0u8; 64];
    let c = connected_pair(&e, 4, &mut buf);
    let d = &mut dev_conns(c)[0];
    let bp = buf.as_mut_ptr();
    for round in 0..ROUNDS {
        let off = (round as usize % 4) * 8;
        if e.rank == 0 {
            signal(d);
            // SAFETY: within buf; the peer reads this slot only after the next signal.
            unsafe { (bp.add(off) as *mut u64).write_volatile(round) };
            put_signal(d, off as u64, off as u64, 8);
            signal(d);
            if round % 3 == 0 {
                flush(d);
            }
            signal(d);
        } else {
            wait(d);
            wait(d);
            // SAFETY: within buf; written by the peer's put before its signal.
            let v = unsafe { (bp.add(off) as *const u64).read_volatile() };
            assert_eq!(v, round, "round {round}: slot holds {v}");
            wait(d);
            wait(d);
        }
        // Keep the sender at most a round ahead: its next put reuses a slot only after the
        // receiver read it.
        if round % 2 == 1 {
            ok(mscclppBootstrapBarrier(c));
        }
    }
    flush(d);
    finish(c);
}

#[test]
fn signals_mixed_shm() {
    ranks("signals_mixed_shm", 2, "shm", signals_mixed);
}
#[test]
fn signals_mixed_tcp() {
    ranks("signals_mixed_tcp", 2, "tcp", signals_mixed);
}

/// SHM: a signal that had to go through libfabric (a put was queued before it, so a store
/// could have overtaken the data) must not keep every later signal there until the user's
/// next flush: once idle the proxy confirms delivery and later lone signals are stores into
/// the peer's epoch block again, which push no trigger (the FIFO's head stays put).
fn signals_regain_direct(e: Env) {
    const ROUNDS: u64 = 2000;
    let mut buf = vec![0u8; 64];
    let c = connected_pair(&e, 5, &mut buf);
    let d = &mut dev_conns(c)[0];
    if e.rank == 0 {
        put(d, 0, 0, 8);
        signal(d);
        let mut direct = 0;
        for _ in 0..ROUNDS {
            let h = fifo_head(d);
            signal(d);
            direct += (fifo_head(d) == h) as u64;
            wait(d);
        }
        // Without the regain none would be; not all need be: a signal that does not get the
        // proxy's lock at once (its thread descheduled holding it, on a loaded host) takes the
        // proxy, and the next ones wait for the regain again.
        assert!(
            direct >= ROUNDS / 10,
            "only {direct} of {ROUNDS} signals after a put were stores into the peer's epoch block"
        );
    } else {
        wait(d);
        for _ in 0..ROUNDS {
            wait(d);
            signal(d);
        }
    }
    flush(d);
    finish(c);
}

#[test]
fn signals_regain_direct_shm() {
    ranks("signals_regain_direct_shm", 2, "shm", signals_regain_direct);
}

// ---- inline puts over SHM -------------------------------------------------------------------

/// The FIFO head of a host connection: a put or signal that did not move it went without a
/// trigger (SHM: inline through the peer's ring, or a store into its epoch block).
fn fifo_head(d: &mscclpp::abi::mscclppDevConn) -> u64 {
    // SAFETY: the FIFO's control block lives as long as the communicator.
    unsafe { std::sync::atomic::AtomicU64::from_ptr(d.fifo.triggerFifoHead) }
        .load(std::sync::atomic::Ordering::Relaxed)
}

const INLINE_BUF: usize = 64 << 10;
/// Sizes around the inline limit (16 KiB by default): the larger ones take the proxy.
const INLINE_SIZES: [usize; 7] = [1, 8, 13, 1000, 16384, 16385, 20000];

/// SHM: small putWithSignal ping-pong whose bytes change every round, at moving offsets, with
/// sizes on both sides of the inline limit; each receiver checks every byte of every put, so a
/// record applied late, twice, to the wrong place, or after a later write fails. Also a large
/// put (through the proxy) overwritten at once by a small one at the same offset: the small
/// one must not overtake it. Counts which puts went inline: every size within the limit must
/// have gone inline at least once, not every time (a put that does not get the proxy's lock at
/// once, as on a loaded host, takes the proxy: `proxy::assist`).
fn inline_puts(e: Env) {
    const ROUNDS: usize = 1400;
    capture_logs();
    let inline_limit: usize = std::env::var("MSCCLPP_SHM_INLINE_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16384);
    let mut buf = vec![0u8; 2 * INLINE_BUF];
    let c = connected_pair(&e, 6, &mut buf);
    let d = &mut dev_conns(c)[0];
    let bp = buf.as_mut_ptr();
    // Per size of INLINE_SIZES: puts sent, and how many of them went inline.
    let (mut sent, mut went) = ([0usize; INLINE_SIZES.len()], [0usize; INLINE_SIZES.len()]);
    // Rank r sends from its half r of the buffer into the peer's half r.
    let half = (e.rank * INLINE_BUF) as u64;
    let fill = |round: usize, size: usize, off: usize| {
        (0..size).map(move |i| (round * 7 + i * 13 + off) as u8)
    };
    for round in 0..ROUNDS {
        let k = round % INLINE_SIZES.len();
        let size = INLINE_SIZES[k];
        let off = (round * 4099) % (INLINE_BUF - size);
        let sender = round % 2;
        if e.rank == sender {
            for (i, v) in fill(round, size, off).enumerate() {
                // SAFETY: within our half of buf; the peer reads its own copy.
                unsafe { bp.add(half as usize + off + i).write_volatile(v) };
            }
            let h = fifo_head(d);
            put_signal(d, half + off as u64, half + off as u64, size as u64);
            sent[k] += 1;
            went[k] += (fifo_head(d) == h) as usize;
            // The sender may change its source only after a flush (the put may still read it).
            flush(d);
        } else {
            wait(d);
            let from = sender * INLINE_BUF + off;
            for (i, v) in fill(round, size, off).enumerate() {
                // SAFETY: within buf, written by the peer's put before its signal.
                let got = unsafe { bp.add(from + i).read_volatile() };
                assert_eq!(
                    got, v,
                    "round {round}: byte {i} of a {size}-byte put at {off}"
                );
            }
        }
    }
    // An inline put, then at once a large put (through the proxy) over the same bytes: the
    // large one waits until the peer applied the inline one, so it lands last. And a small put
    // right after a large one does not go inline (the large one may still be on its way).
    // (Two puts through libfabric to overlapping bytes land in the provider's order: shm
    // sometimes reverses them, so this checks only what the inline path guarantees.)
    if inline_limit > 0 {
        if e.rank == 0 {
            // SAFETY: within our half; nothing reads it until the flushes below.
            unsafe {
                std::ptr::write_bytes(bp, 0xaa, 32 << 10);
                std::ptr::write_bytes(bp.add(40 << 10), 0xbb, 64);
            }
            // Repeated (with a flush) until it goes inline, which it does on an idle connection
            // unless the proxy's lock was busy (see above).
            let mut tries = 0;
            // Ends when the put went inline, or fails after 1000 tries.
            loop {
                let h = fifo_head(d);
                put(d, 0, 40 << 10, 64);
                if fifo_head(d) == h {
                    break;
                }
                flush(d);
                tries += 1;
                assert!(
                    tries < 1000,
                    "a small put on an idle connection never went inline"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            put_signal(d, 0, 0, 32 << 10);
            flush(d);
            put(d, 0, 0, 32 << 10);
            let h = fifo_head(d);
            put_signal(d, 32 << 10, 40 << 10, 64);
            assert_ne!(
                fifo_head(d),
                h,
                "a small put after an undelivered one went inline"
            );
            flush(d);
        } else {
            wait(d);
            // SAFETY: within buf, written by the peer's puts before its signal.
            let got = unsafe { std::slice::from_raw_parts(bp, 32 << 10) };
            assert!(
                got.iter().all(|b| *b == 0xaa),
                "an inline put landed after a later put"
            );
            wait(d);
            // SAFETY: as above.
            let got = unsafe { std::slice::from_raw_parts(bp.add(32 << 10), 64) };
            assert!(got.iter().all(|b| *b == 0xbb));
        }
    }
    println!(
        "rank {}: inline puts per size {INLINE_SIZES:?}: {went:?} of {sent:?}",
        e.rank
    );
    for (k, &size) in INLINE_SIZES.iter().enumerate() {
        if size > inline_limit {
            assert_eq!(
                went[k], 0,
                "a {size}-byte put, over the limit {inline_limit}, went inline"
            );
        } else {
            assert!(
                went[k] > 0,
                "none of {} {size}-byte puts went inline",
                sent[k]
            );
        }
    }
    finish(c);
    // The proxy's count at the stop covers at least the puts this test saw go inline.
    let logs = logged();
    let did = logs.iter().find_map(|l| {
        let rest = l.split("SHM puts small enough to go inline: ").nth(1)?;
        rest.split(' ').next()?.parse::<usize>().ok()
    });
    let seen: usize = went.iter().sum();
    match did {
        Some(n) => assert!(
            n >= seen,
            "the INFO line counts {n} inline puts, the test saw {seen}"
        ),
        None => assert_eq!(
            seen,
            0,
            "no INFO line on inline puts; log:\n{}",
            logs.join("\n")
        ),
    }
}

#[test]
fn inline_puts_shm() {
    // INFO: the proxy's count of inline puts at the stop.
    ranks_with(
        "inline_puts_shm",
        2,
        "shm",
        "MSCCLPP_DEBUG",
        "INFO",
        inline_puts,
    );
}

#[test]
fn inline_puts_off_shm() {
    ranks_with(
        "inline_puts_off_shm",
        2,
        "shm",
        "MSCCLPP_SHM_INLINE_BYTES",
        "0",
        inline_puts,
    );
}

/// SHM: rank 0 streams 16 KiB putWithSignals back to back into distinct slots, rank 1 checks
/// every byte of each slot after each wait, over several rounds (each rewriting the slots after
/// a barrier). The peer's ring holds two records of that size, so the stream fills it: a put
/// then waits for room while the receiver's wait applies records (`proxy::conn::direct_put`,
/// on a host with two cores per rank, or with `MSCCLPP_TEST_ROOMY`), or takes the proxy with
/// every later put of the round. Returns the proxy's counts (rank 0's: the sender) of puts
/// that went inline after waiting for room, and of puts that found the ring full and took the
/// proxy.
fn inline_stream(e: Env) -> Option<(usize, usize)> {
    const PUTS: usize = 24;
    const SIZE: usize = 16 << 10;
    const ROUNDS: usize = 6;
    capture_logs();
    let mut buf = vec![0u8; PUTS * SIZE];
    let c = connected_pair(&e, 7, &mut buf);
    let d = &mut dev_conns(c)[0];
    let bp = buf.as_mut_ptr();
    let byte = |round: usize, p: usize, i: usize| (round * 31 + p * 7 + i * 13) as u8;
    for round in 0..ROUNDS {
        if e.rank == 0 {
            for p in 0..PUTS {
                for i in 0..SIZE {
                    // SAFETY: within buf; the last round's puts were flushed.
                    unsafe { bp.add(p * SIZE + i).write_volatile(byte(round, p, i)) };
                }
            }
            for p in 0..PUTS {
                let off = (p * SIZE) as u64;
                put_signal(d, off, off, SIZE as u64);
            }
            flush(d);
        } else {
            for p in 0..PUTS {
                wait(d);
                for i in 0..SIZE {
                    // SAFETY: within buf, written by the peer's put before its signal.
                    let got = unsafe { bp.add(p * SIZE + i).read_volatile() };
                    assert_eq!(got, byte(round, p, i), "round {round}, put {p}, byte {i}");
                }
            }
        }
        ok(mscclppBootstrapBarrier(c));
    }
    finish(c);
    let logs = logged();
    let line = logs
        .iter()
        .find(|l| l.contains("SHM puts small enough to go inline"))?;
    println!("rank {}: {line}", e.rank);
    let waited = line
        .split(" did (")
        .nth(1)?
        .split(' ')
        .next()?
        .parse()
        .ok()?;
    let full = line.split("), ").nth(1)?.split(' ').next()?.parse().ok()?;
    Some((waited, full))
}

#[test]
fn inline_stream_shm() {
    // INFO: the proxy's count of inline puts at the stop.
    ranks_with(
        "inline_stream_shm",
        2,
        "shm",
        "MSCCLPP_DEBUG",
        "INFO",
        |e| {
            inline_stream(e);
        },
    );
}

#[test]
fn inline_stream_waits_for_room_shm() {
    // A roomy host's rule on any machine: the puts that find the ring full wait for room.
    ranks_env(
        "inline_stream_waits_for_room_shm",
        2,
        "shm",
        &[("MSCCLPP_DEBUG", "INFO"), ("MSCCLPP_TEST_ROOMY", "1")],
        |e| {
            let rank = e.rank;
            let counts = inline_stream(e);
            // Puts larger than 4 KiB that find the ring full wait for room; of 132 that
            // may (the first two of each round find room), some get it within the wait (a
            // receiver slower than the wait every time would fail this: the wait is 100 us).
            // On a tight host's rule none waits (`inline_stream_shm` there: none did).
            if rank == 0 {
                assert!(
                    counts.is_some_and(|(waited, _)| waited > 0),
                    "no put went inline after waiting for room in 144 puts of 16 KiB: {counts:?}"
                );
            }
        },
    );
}

/// SHM: more small puts without a signal than the ring holds, while the receiver applies
/// none (its proxy starts only after the sender saw a put take the proxy), then a put that
/// rewrites the first one's destination, a flush and a bootstrap barrier, after which the
/// receiver reads its buffer without calling wait(). Shows that the ring bounds the inline
/// puts, that the puts after them took the proxy without overtaking them (the last value
/// stays), and that flush returned only once the receiver had applied every inline one (flush
/// means "arrived").
///
/// A put goes inline only if it gets the proxy's lock within a few tries (`proxy::assist`);
/// on a loaded host the proxy thread may be descheduled holding it, and the put then takes the
/// proxy, and so does every later one until a flush. So how many went inline is printed, and
/// bounded above, not below: a lost race may stop them early, even at the first put (it cannot
/// be retried: a flush over SHM needs the receiver's proxy, which would apply the ring).
/// `inline_puts` asserts that puts do go inline.
fn inline_puts_fill_the_ring(e: Env) {
    const N: usize = 6000;
    /// 8-byte puts (8 bytes of header each) that fit in the 36 KiB ring (`transport::inbox`);
    /// with the default 16 KiB limit a sender's window (three such records) is larger, so the
    /// ring bounds them.
    const RING_PUTS: usize = 36 * 1024 / 16;
    const LAST: u64 = 0x5eed_0000_0000_0001;
    let value = |i: usize| i as u64 * 0x9e37_79b9 + 1;
    // Slot N is the source of the last put, which rewrites slot 0.
    let mut buf = vec![0u8; (N + 1) * 8];
    let c = init(&e.root, e.rank, e.n);
    ok(connect(c, 1 - e.rank, 7, &mut buf));
    ok(mscclppConnectionSetup(c));
    if e.rank == 1 {
        // Until the sender saw a put take the proxy, nothing applies our ring.
        ok(mscclppBootstrapBarrier(c));
        ok(mscclppProxyLaunch(c));
    } else {
        ok(mscclppProxyLaunch(c));
        let d = &mut dev_conns(c)[0];
        for (i, w) in buf.chunks_mut(8).enumerate() {
            w.copy_from_slice(&value(i).to_le_bytes());
        }
        buf[N * 8..].copy_from_slice(&LAST.to_le_bytes());
        let mut inline = N;
        for i in 0..N {
            let h = fifo_head(d);
            put(d, i as u64 * 8, i as u64 * 8, 8);
            if fifo_head(d) != h && inline == N {
                inline = i;
                // The receiver may start applying now (and our flush needs its proxy).
                ok(mscclppBootstrapBarrier(c));
            }
        }
        let h = fifo_head(d);
        put(d, 0, N as u64 * 8, 8);
        let proxied_last = fifo_head(d) != h;
        if inline == N {
            ok(mscclppBootstrapBarrier(c));
        }
        println!(
            "{inline} puts went inline before one took the proxy (the ring holds {RING_PUTS}){}",
            if inline == 0 {
                ": the first lost the race for the proxy's lock, the ring was not filled this run"
            } else {
                ""
            }
        );
        assert!(
            inline <= RING_PUTS,
            "{inline} puts went inline while the receiver applied none: more than the ring holds"
        );
        assert!(proxied_last, "a put went inline after a put took the proxy");
        flush(d);
    }
    ok(mscclppBootstrapBarrier(c));
    if e.rank == 1 {
        for (i, w) in buf[..N * 8].chunks(8).enumerate() {
            let v = u64::from_le_bytes(w.try_into().unwrap());
            let want = if i == 0 { LAST } else { value(i) };
            assert_eq!(v, want, "put {i}");
        }
    }
    finish(c);
}

#[test]
fn inline_puts_fill_the_ring_shm() {
    ranks(
        "inline_puts_fill_the_ring_shm",
        2,
        "shm",
        inline_puts_fill_the_ring,
    );
}

// ---- registered buffers --------------------------------------------------------------------

fn registered_write(e: Env) {
    let c = init(&e.root, e.rank, e.n);
    let mut conn_buf = vec![0u8; 64];
    for p in (0..e.n).filter(|&p| p != e.rank) {
        ok(connect(c, p, 9, &mut conn_buf));
    }
    ok(mscclppConnectionSetup(c));
    // The peers' proxies progress their endpoints (software providers move data only then).
    ok(mscclppProxyLaunch(c));
    let mut target = vec![0u8; e.n * 1000];
    let mut reg = register(c, &mut target);
    let mut src: Vec<u8> = (0..1100).map(|i| pattern(e.rank, i)).collect();
    // Bytes 100..1100 of src land at [rank*1000, rank*1000+1000) of every peer's target: on
    // stream 0, then the same write on cudaStreamLegacy (1) and cudaStreamPerThread (2), which
    // a program built with `--default-stream per-thread` passes; a negative stream is no
    // cudaStream_t.
    for stream in [0, 1, 2] {
        ok(mscclppRegisteredBufferWrite(
            c,
            &mut reg,
            src.as_mut_ptr().cast(),
            1000,
            100,
            (e.rank * 1000) as u32,
            stream,
        ));
    }
    assert_eq!(
        mscclppRegisteredBufferWrite(c, &mut reg, src.as_mut_ptr().cast(), 1000, 100, 0, -1),
        mscclppInvalidArgument
    );
    // Beyond the peer's registration: refused before anything is written.
    assert_eq!(
        mscclppRegisteredBufferWrite(
            c,
            &mut reg,
            src.as_mut_ptr().cast(),
            1000,
            0,
            (e.n * 1000 - 999) as u32,
            0
        ),
        mscclppInvalidArgument
    );
    let mut bogus = mscclpp::abi::mscclppRegisteredMemory { handle: 77 };
    assert_eq!(
        mscclppRegisteredBufferWrite(c, &mut bogus, src.as_mut_ptr().cast(), 1, 0, 0, 0),
        mscclppInvalidArgument
    );
    // 0 bytes: checked as any write (a dead handle, an offset past the peer's buffer and a
    // negative stream refused); at the end of the buffer it is in range, and over this rank's
    // slot, from source offset 0, it succeeds and moves nothing: a byte from there would
    // differ from the slot's pattern(rank, i + 100), checked on every peer below.
    assert_eq!(
        mscclppRegisteredBufferWrite(c, &mut bogus, src.as_mut_ptr().cast(), 0, 0, 0, 0),
        mscclppInvalidArgument
    );
    assert_eq!(
        mscclppRegisteredBufferWrite(
            c,
            &mut reg,
            src.as_mut_ptr().cast(),
            0,
            0,
            (e.n * 1000 + 1) as u32,
            0
        ),
        mscclppInvalidArgument
    );
    assert_eq!(
        mscclppRegisteredBufferWrite(c, &mut reg, src.as_mut_ptr().cast(), 0, 0, 0, -1),
        mscclppInvalidArgument
    );
    for dst in [e.n * 1000, e.rank * 1000] {
        ok(mscclppRegisteredBufferWrite(
            c,
            &mut reg,
            src.as_mut_ptr().cast(),
            0,
            0,
            dst as u32,
            0,
        ));
    }
    ok(mscclppBootstrapBarrier(c));
    for p in (0..e.n).filter(|&p| p != e.rank) {
        for i in 0..1000 {
            assert_eq!(
                target[p * 1000 + i],
                pattern(p, i + 100),
                "from rank {p} byte {i}"
            );
        }
    }
    assert!(
        target[e.rank * 1000..(e.rank + 1) * 1000]
            .iter()
            .all(|&b| b == 0),
        "nobody writes our own slot"
    );
    finish(c);
}

#[test]
fn registered_buffer_write_tcp_3() {
    ranks("registered_buffer_write_tcp_3", 3, "tcp", registered_write);
}
#[test]
fn registered_buffer_write_shm_2() {
    ranks("registered_buffer_write_shm_2", 2, "shm", registered_write);
}
#[test]
fn registered_buffer_write_net_2() {
    ranks("registered_buffer_write_net_2", 2, "net", registered_write);
}

/// Rank `e.rank` of 2, connected to the other (with `conn_buf`), proxies running, with
/// `target` registered.
fn registered_pair(
    e: &Env,
    conn_buf: &mut [u8],
    target: &mut [u8],
) -> (mscclpp::capi::mscclppComm_t, RegMem) {
    let c = init(&e.root, e.rank, e.n);
    ok(connect(c, 1 - e.rank, 9, conn_buf));
    ok(mscclppConnectionSetup(c));
    ok(mscclppProxyLaunch(c));
    let reg = register(c, target);
    (c, reg)
}

type RegMem = mscclpp::abi::mscclppRegisteredMemory;

/// Where a test's source memory comes from: malloc, or an anonymous mapping (new pages each
/// time, as a freed-and-reallocated large buffer gets).
#[derive(Clone, Copy, Debug)]
enum Alloc {
    Malloc,
    Mmap,
}

impl Alloc {
    /// `len` bytes, each `pattern(gen, i)`; a mapping is placed at `at` if that range is free
    /// (the caller compares the address it got).
    fn filled(self, len: usize, gen: usize, at: *mut u8) -> *mut u8 {
        let p = match self {
            // SAFETY: plain malloc; the result is checked for NULL below.
            Alloc::Malloc => unsafe { libc::malloc(len) }.cast::<u8>(),
            Alloc::Mmap => {
                let fixed = if at.is_null() {
                    0
                } else {
                    libc::MAP_FIXED_NOREPLACE
                };
                // SAFETY: a new private anonymous mapping; MAP_FIXED_NOREPLACE never replaces
                // an existing one (it fails instead, checked below).
                let p = unsafe {
                    libc::mmap(
                        at.cast(),
                        len,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | fixed,
                        -1,
                        0,
                    )
                };
                if p == libc::MAP_FAILED {
                    std::ptr::null_mut()
                } else {
                    p.cast::<u8>()
                }
            }
        };
        assert!(!p.is_null(), "{self:?} of {len} bytes failed");
        for i in 0..len {
            // SAFETY: i < len, inside the allocation.
            unsafe { p.add(i).write(pattern(gen, i)) };
        }
        p
    }

    /// Frees what `filled` returned (`len` bytes).
    fn free(self, p: *mut u8, len: usize) {
        match self {
            // SAFETY: from `filled`, freed once.
            Alloc::Malloc => unsafe { libc::free(p.cast()) },
            // SAFETY: from `filled` with this length, unmapped once.
            Alloc::Mmap => assert_eq!(unsafe { libc::munmap(p.cast(), len) }, 0),
        }
    }
}

/// A registered write from memory that was freed and allocated again at the same address
/// delivers the new bytes: the library keeps nothing of the first call's registration (on
/// NICs that pin, a kept one would send the old pages). Twice: a malloc block (glibc's
/// per-thread cache hands the same block back) and a 1 MiB mapping (unmapped, and a new one
/// placed at the same address).
fn registered_write_reused_address(e: Env) {
    const ROUNDS: [(Alloc, usize); 2] = [(Alloc::Malloc, 4000), (Alloc::Mmap, 1 << 20)];
    let (mut conn_buf, mut target) = (vec![0u8; 64], vec![0u8; 1 << 20]);
    let (c, mut reg) = registered_pair(&e, &mut conn_buf, &mut target);
    for (round, (how, len)) in ROUNDS.into_iter().enumerate() {
        let (old, new) = (2 * round, 2 * round + 1);
        if e.rank == 0 {
            let first = how.filled(len, old, std::ptr::null_mut());
            ok(mscclppRegisteredBufferWrite(
                c,
                &mut reg,
                first.cast(),
                len,
                0,
                0,
                0,
            ));
            ok(mscclppBootstrapBarrier(c));
            ok(mscclppBootstrapBarrier(c));
            how.free(first, len);
            let second = how.filled(len, new, first);
            if second != first {
                eprintln!(
                    "registered_write_reused_address: SKIPPED the reuse case ({how:?}, {len} bytes): got {second:p}, not the freed {first:p}; the bytes are still checked"
                );
            }
            ok(mscclppRegisteredBufferWrite(
                c,
                &mut reg,
                second.cast(),
                len,
                0,
                0,
                0,
            ));
            how.free(second, len);
            ok(mscclppBootstrapBarrier(c));
            // The next round's write may land only once rank 1 has checked this one.
            ok(mscclppBootstrapBarrier(c));
        } else {
            ok(mscclppBootstrapBarrier(c));
            assert!(
                (0..len).all(|i| target[i] == pattern(old, i)),
                "first write of {len} bytes"
            );
            ok(mscclppBootstrapBarrier(c));
            ok(mscclppBootstrapBarrier(c));
            for (i, &b) in target[..len].iter().enumerate() {
                assert_eq!(
                    b,
                    pattern(new, i),
                    "byte {i} of {len}: the write from the reused address must send its new bytes"
                );
            }
            ok(mscclppBootstrapBarrier(c));
        }
    }
    finish(c);
}

#[test]
fn registered_write_reused_address_tcp_2() {
    ranks(
        "registered_write_reused_address_tcp_2",
        2,
        "tcp",
        registered_write_reused_address,
    );
}
#[test]
fn registered_write_reused_address_shm_2() {
    ranks(
        "registered_write_reused_address_shm_2",
        2,
        "shm",
        registered_write_reused_address,
    );
}

/// 10^4 registered writes whose source ranges all differ leave the process with as many
/// libfabric registrations as before (each call's source is released after its flush), every
/// byte arrives, and destroy closes the rest.
fn registered_write_many_ranges(e: Env) {
    const N: usize = 10_000;
    let (mut conn_buf, mut target) = (vec![0u8; 64], vec![0u8; 8 * N]);
    let (c, mut reg) = registered_pair(&e, &mut conn_buf, &mut target);
    let mut src: Vec<u8> = (0..N + 8).map(|i| pattern(e.rank, i)).collect();
    if e.rank == 0 {
        let live = mscclpp::transport::net::live_registrations;
        let before = live();
        for i in 0..N {
            // The source range is [src, src + i + 8): a new one every call.
            ok(mscclppRegisteredBufferWrite(
                c,
                &mut reg,
                src.as_mut_ptr().cast(),
                8,
                i as u32,
                (8 * i) as u32,
                0,
            ));
            if i % 1000 == 999 {
                progress(i as u64);
                assert_eq!(live(), before, "registrations after {} writes", i + 1);
            }
        }
        assert_eq!(live(), before, "registrations after {N} writes");
    }
    ok(mscclppBootstrapBarrier(c));
    if e.rank == 1 {
        for i in 0..N {
            for k in 0..8 {
                assert_eq!(target[8 * i + k], pattern(0, i + k), "write {i} byte {k}");
            }
        }
    }
    finish(c);
    assert_eq!(
        mscclpp::transport::net::live_registrations(),
        0,
        "destroy closes every registration"
    );
}

#[test]
fn registered_write_many_ranges_tcp_2() {
    ranks(
        "registered_write_many_ranges_tcp_2",
        2,
        "tcp",
        registered_write_many_ranges,
    );
}
#[test]
fn registered_write_many_ranges_shm_2() {
    ranks(
        "registered_write_many_ranges_shm_2",
        2,
        "shm",
        registered_write_many_ranges,
    );
}

// ---- unregistering (mscclppUnregisterBuffer) -----------------------------------------------

/// `mscclppRegisteredBufferWrite` of `len` bytes from `src` (at `src_off`) to `dst_off`.
fn reg_write(
    c: mscclpp::capi::mscclppComm_t,
    reg: &mut RegMem,
    src: &mut [u8],
    len: usize,
    dst_off: usize,
) -> mscclpp::abi::mscclppResult_t {
    mscclppRegisteredBufferWrite(c, reg, src.as_mut_ptr().cast(), len, 0, dst_off as u32, 0)
}

/// Asserts that `r` is mscclppInvalidArgument with a text that contains `part`.
#[track_caller]
fn refused(r: mscclpp::abi::mscclppResult_t, part: &str) {
    assert_eq!(r, mscclppInvalidArgument, "{}", last_error());
    assert!(last_error().contains(part), "{part:?}: {}", last_error());
}

/// Two registered buffers, both written; the first unregistered on both ranks: its libfabric
/// registration is closed (the process's count goes back by what registering it added), a
/// write with its handle and a second unregister are refused naming it unregistered, and
/// writes through the second still arrive. NULL, unknown and zero handles are refused; none of
/// those refusals sends anything (the next unregister would take a stray message and fail).
/// Unregistering the second brings the count back to before either.
fn unregister_one_of_two(e: Env) {
    const LEN: usize = 1000;
    let live = mscclpp::transport::net::live_registrations;
    let peer = 1 - e.rank;
    let (mut conn_buf, mut first, mut second) = (vec![0u8; 64], vec![0u8; LEN], vec![0u8; LEN]);
    let c = connected_pair(&e, 9, &mut conn_buf);
    let base = live();
    let mut reg1 = register(c, &mut first);
    let one = live() - base;
    assert!(
        one > 0,
        "a registered buffer holds a libfabric registration"
    );
    let mut reg2 = register(c, &mut second);
    let mut src: Vec<u8> = (0..LEN).map(|i| pattern(e.rank, i)).collect();
    ok(reg_write(c, &mut reg1, &mut src, LEN, 0));
    ok(reg_write(c, &mut reg2, &mut src, LEN, 0));
    ok(mscclppBootstrapBarrier(c));
    for (name, buf) in [("first", &first), ("second", &second)] {
        for (i, &b) in buf.iter().enumerate() {
            assert_eq!(b, pattern(peer, i), "{name} buffer, byte {i}");
        }
    }
    ok(mscclppUnregisterBuffer(c, &mut reg1));
    assert_eq!(live(), base + one, "the first's registration is closed");
    refused(reg_write(c, &mut reg1, &mut src, LEN, 0), "unregistered");
    // The second still carries bytes, new ones.
    let mut src: Vec<u8> = (0..LEN).map(|i| pattern(e.rank + 2, i)).collect();
    ok(reg_write(c, &mut reg2, &mut src, LEN, 0));
    ok(mscclppBootstrapBarrier(c));
    for (i, &b) in second.iter().enumerate() {
        assert_eq!(
            b,
            pattern(peer + 2, i),
            "second buffer after the unregister, byte {i}"
        );
    }
    refused(mscclppUnregisterBuffer(c, &mut reg1), "unregistered");
    refused(mscclppUnregisterBuffer(c, std::ptr::null_mut()), "NULL");
    for handle in [0, 77] {
        let mut bogus = RegMem { handle };
        refused(mscclppUnregisterBuffer(c, &mut bogus), "unknown");
    }
    assert_eq!(live(), base + one, "the refusals changed nothing");
    ok(mscclppUnregisterBuffer(c, &mut reg2));
    assert_eq!(live(), base, "both registrations closed");
    // The library holds nothing of them: the memory may go.
    drop((first, second));
    refused(reg_write(c, &mut reg2, &mut src, LEN, 0), "unregistered");
    finish(c);
}

#[test]
fn unregister_one_of_two_tcp_2() {
    ranks(
        "unregister_one_of_two_tcp_2",
        2,
        "tcp",
        unregister_one_of_two,
    );
}
#[test]
fn unregister_one_of_two_shm_2() {
    ranks(
        "unregister_one_of_two_shm_2",
        2,
        "shm",
        unregister_one_of_two,
    );
}

/// A registered buffer that is also the connection's own buffer (the same range): registering
/// it adds no libfabric registration (the endpoint returns the connection's), unregistering it
/// closes none, and the connection's puts still move bytes both ways afterwards.
fn unregister_connection_buffer(e: Env) {
    const HALF: usize = 2048;
    let live = mscclpp::transport::net::live_registrations;
    let peer = 1 - e.rank;
    let mut buf = vec![0u8; 2 * HALF];
    let c = connected_pair(&e, 0, &mut buf);
    let base = live();
    let mut reg = register(c, &mut buf);
    assert_eq!(live(), base, "the connection's registration, shared");
    // Rank r's 512 bytes land at HALF + 512 r of the peer's buffer.
    let mut src: Vec<u8> = (0..512).map(|i| pattern(e.rank, i)).collect();
    ok(reg_write(c, &mut reg, &mut src, 512, HALF + 512 * e.rank));
    ok(mscclppBootstrapBarrier(c));
    for i in 0..512 {
        assert_eq!(
            buf[HALF + 512 * peer + i],
            pattern(peer, i),
            "registered write, byte {i}"
        );
    }
    ok(mscclppUnregisterBuffer(c, &mut reg));
    assert_eq!(live(), base, "the connection keeps its registration");
    refused(reg_write(c, &mut reg, &mut src, 512, 0), "unregistered");
    // Rank r's 1024 bytes go from [1024 r, +1024) of its buffer to the same place in the peer's.
    let d = &mut dev_conns(c)[0];
    let off = 1024 * e.rank;
    for i in 0..1024 {
        buf[off + i] = pattern(e.rank + 4, i);
    }
    put(d, off as u64, off as u64, 512);
    put_signal(d, (off + 512) as u64, (off + 512) as u64, 512);
    flush(d);
    wait(d);
    for i in 0..1024 {
        assert_eq!(
            buf[1024 * peer + i],
            pattern(peer + 4, i),
            "put after the unregister, byte {i}"
        );
    }
    finish(c);
    assert_eq!(live(), 0, "destroy closes the rest");
}

#[test]
fn unregister_connection_buffer_tcp_2() {
    ranks(
        "unregister_connection_buffer_tcp_2",
        2,
        "tcp",
        unregister_connection_buffer,
    );
}
#[test]
fn unregister_connection_buffer_shm_2() {
    ranks(
        "unregister_connection_buffer_shm_2",
        2,
        "shm",
        unregister_connection_buffer,
    );
}

/// The bootstrap timeout of the mismatch tests, in seconds.
const MISMATCH_BOOT_S: u64 = 5;

/// Rank 0 unregisters registration 1 while rank 1 unregisters registration 2: both fail at
/// once (not at the timeout), each naming what the other unregistered; each keeps its
/// registration (the peer may still hold it) and its handle is dead all the same. Rank 1's
/// message for registration 2 is kept by rank 0, so rank 0's own unregister of 2 later needs
/// no answer and succeeds. Then registration 3, which rank 1 unregisters only after rank 0 gave
/// up at its bootstrap timeout: rank 0 fails then, not later; rank 1 succeeds (rank 0's message
/// was waiting), and its own message stays unread at rank 0. Registration 4, unregistered by
/// both: rank 0 skips that stale message and both succeed. Destroy closes what was kept.
fn unregister_mismatch(e: Env) {
    let live = mscclpp::transport::net::live_registrations;
    let peer = 1 - e.rank;
    let (mut conn_buf, mut a, mut b) = (vec![0u8; 64], vec![0u8; 256], vec![0u8; 256]);
    let c = connected_pair(&e, 3, &mut conn_buf);
    let mut regs = [register(c, &mut a), register(c, &mut b)];
    let held = live();
    let (r, t) = timed(|| mscclppUnregisterBuffer(c, &mut regs[e.rank]));
    let why = last_error();
    println!(
        "rank {}: mismatched unregister {r:?} after {t:?}: {why}",
        e.rank
    );
    assert_eq!(r, mscclppRemoteError, "{why}");
    let theirs = format!("rank {peer} unregistered registered buffer {}", peer + 1);
    assert!(why.contains(&theirs), "{theirs:?}: {why}");
    assert!(t < Duration::from_secs(MISMATCH_BOOT_S), "took {t:?}");
    assert_eq!(live(), held, "kept: the peer may still write into it");
    let mut src = vec![1u8; 8];
    refused(
        reg_write(c, &mut regs[e.rank], &mut src, 8, 0),
        "unregistered",
    );
    refused(
        mscclppUnregisterBuffer(c, &mut regs[e.rank]),
        "unregistered",
    );
    if e.rank == 0 {
        // Rank 1 sent its message for registration 2 in its failed call: it needs no other.
        let (r, t) = timed(|| mscclppUnregisterBuffer(c, &mut regs[1]));
        assert_eq!(r, mscclppSuccess, "{}", last_error());
        assert!(t < Duration::from_secs(MISMATCH_BOOT_S), "took {t:?}");
        assert!(live() < held, "registration 2 released");
    }
    let mut third = vec![0u8; 256];
    let mut reg3 = register(c, &mut third);
    if e.rank == 0 {
        let (r, t) = timed(|| mscclppUnregisterBuffer(c, &mut reg3));
        let why = last_error();
        println!("rank 0: unanswered unregister {r:?} after {t:?}: {why}");
        assert_eq!(r, mscclppRemoteError, "{why}");
        assert!(
            why.contains("rank 1 (connection tag 3) did not unregister it"),
            "{why}"
        );
        let bound = Duration::from_secs(MISMATCH_BOOT_S);
        assert!(
            t >= bound - Duration::from_millis(500) && t < 4 * bound,
            "took {t:?}"
        );
        mark("r0_timed_out", "");
        wait_mark("r1_unregistered", Duration::from_secs(60)).expect("rank 1 never unregistered");
    } else {
        wait_mark("r0_timed_out", Duration::from_secs(60)).expect("rank 0 never timed out");
        ok(mscclppUnregisterBuffer(c, &mut reg3));
        mark("r1_unregistered", "");
    }
    let mut fourth = vec![0u8; 256];
    let mut reg4 = register(c, &mut fourth);
    let before = live();
    ok(mscclppUnregisterBuffer(c, &mut reg4));
    assert!(live() < before, "registration 4 released");
    finish(c);
    assert_eq!(live(), 0, "destroy closes what was kept");
}

/// Runs `unregister_mismatch` as test `name`'s two ranks over `provider`.
fn unregister_mismatch_ranks(name: &str, provider: &str) {
    if skip_missing_provider(name, provider) {
        return;
    }
    if is_rank(name) {
        return unregister_mismatch(env());
    }
    let d = Dir::new(name);
    let (k, v) = d.env();
    let boot = MISMATCH_BOOT_S.to_string();
    let e = with(transport_env(provider), "MSCCLPP_BOOTSTRAP_TIMEOUT", &boot);
    spawn(name, 2, &with(e, k, &v)).expect_success(DEADLINE);
}
#[test]
fn unregister_mismatch_fails_both_ranks_tcp() {
    unregister_mismatch_ranks("unregister_mismatch_fails_both_ranks_tcp", "tcp");
}
#[test]
fn unregister_mismatch_fails_both_ranks_shm() {
    unregister_mismatch_ranks("unregister_mismatch_fails_both_ranks_shm", "shm");
}

// ---- faults ---------------------------------------------------------------------------------

/// A put beyond the peer's buffer is refused by the sender's proxy: nothing is written, the
/// error is sticky and reported by flush, mscclppCommGetAsyncError and mscclppProxyStop. It
/// aborts the communicator, and the peer learns that as it learns of a lost peer: its proxy
/// fails at once, with the reason.
fn out_of_range_trigger(e: Env) {
    let mut buf = vec![0u8; 4096];
    let c = connected_pair(&e, 0, &mut buf);
    let d = &mut dev_conns(c)[0];
    if e.rank == 0 {
        buf.fill(0xAB);
        ok(mscclppDevConnPut(d, 4000, 0, 200));
        assert_eq!(
            mscclppDevConnFlush(d),
            mscclppRemoteError,
            "flush must fail once the proxy refused a trigger"
        );
        assert!(last_error().contains("aborted"), "{}", last_error());
        assert_eq!(async_error(c), mscclppInvalidArgument);
        // The query gives the sticky error's own text, not only its code.
        assert!(
            last_error().starts_with("mscclppCommGetAsyncError: ")
                && last_error().contains("put refused"),
            "{}",
            last_error()
        );
        assert_eq!(mscclppProxyStop(c), mscclppRemoteError);
        // Sticky: later calls that need the proxies report it too.
        assert_eq!(mscclppProxyLaunch(c), mscclppRemoteError);
    } else {
        // Bounded at 20 s, within the wait timeout of 30 s.
        assert_eq!(await_async_error(c, "the peer's abort"), mscclppRemoteError);
        assert!(
            buf.iter().all(|&b| b == 0),
            "a refused put must not write a byte"
        );
        assert_eq!(mscclppProxyStop(c), mscclppRemoteError);
        assert!(last_error().contains("put refused"), "{}", last_error());
    }
    ok(mscclppCommDestroy(c));
}

#[test]
fn out_of_range_trigger_is_refused_tcp() {
    ranks(
        "out_of_range_trigger_is_refused_tcp",
        2,
        "tcp",
        out_of_range_trigger,
    );
}

/// Calls out of order and bad sizes: clear errors, nothing changes.
fn bad_usage(e: Env) {
    let c = init(&e.root, e.rank, e.n);
    let peer = 1 - e.rank;
    let mut buf = vec![0u8; 1024];
    assert_eq!(
        mscclppProxyLaunch(c),
        mscclppInvalidUsage,
        "proxy before setup"
    );
    assert_eq!(
        mscclppProxyStop(c),
        mscclppInvalidUsage,
        "proxy stop before setup"
    );
    let mut p = std::ptr::null_mut();
    let mut n = 0;
    assert_eq!(
        mscclppGetAllDeviceConnections(c, &mut p, &mut n),
        mscclppInvalidUsage
    );
    let (t, _) = transport();
    assert_eq!(
        mscclppConnect(
            c,
            peer as i32,
            0,
            buf.as_mut_ptr().cast(),
            0,
            t,
            std::ptr::null()
        ),
        mscclppInvalidArgument,
        "zero size"
    );
    assert_eq!(
        mscclppConnect(
            c,
            peer as i32,
            0,
            std::ptr::null_mut(),
            8,
            t,
            std::ptr::null()
        ),
        mscclppInvalidArgument,
        "NULL buffer"
    );
    assert_eq!(
        mscclppConnect(c, 5, 0, buf.as_mut_ptr().cast(), 8, t, std::ptr::null()),
        mscclppInvalidArgument,
        "bad rank"
    );
    assert_eq!(
        mscclppConnect(
            c,
            e.rank as i32,
            0,
            buf.as_mut_ptr().cast(),
            8,
            t,
            std::ptr::null()
        ),
        mscclppInvalidArgument,
        "self"
    );
    assert_eq!(
        mscclppConnect(
            c,
            peer as i32,
            0,
            buf.as_mut_ptr().cast(),
            8,
            17,
            std::ptr::null()
        ),
        mscclppInvalidArgument,
        "bad transport"
    );
    assert_eq!(
        mscclppConnect(
            c,
            peer as i32,
            0,
            buf.as_mut_ptr().cast(),
            8,
            0,
            std::ptr::null()
        ),
        mscclppInvalidArgument,
        "P2P with host memory"
    );
    ok(connect(c, peer, 0, &mut buf));
    assert_eq!(
        connect(c, peer, 0, &mut buf),
        mscclppInvalidArgument,
        "duplicate (rank, tag)"
    );
    ok(mscclppConnectionSetup(c));
    assert_eq!(
        connect(c, peer, 1, &mut buf),
        mscclppInvalidUsage,
        "connect after setup"
    );
    assert_eq!(
        mscclppConnectionSetup(c),
        mscclppInvalidUsage,
        "setup twice"
    );
    assert_eq!(
        mscclppProxyStop(c),
        mscclppInvalidUsage,
        "stop before launch"
    );
    ok(mscclppProxyLaunch(c));
    assert_eq!(mscclppProxyLaunch(c), mscclppInvalidUsage, "launch twice");
    let d = &mut dev_conns(c)[0];
    // A put of 0 bytes does nothing, as the device method's: it succeeds and queues no
    // trigger (the FIFO's head does not move).
    let head = unsafe { *d.fifo.triggerFifoHead };
    ok(mscclppDevConnPut(d, 0, 0, 0));
    assert_eq!(
        unsafe { *d.fifo.triggerFifoHead },
        head,
        "zero-size put queued a trigger"
    );
    // Sizes past 4 GiB are split into several triggers (and then refused by the proxy's range
    // check against the registered buffer); a put reaching past 2^40 bytes, which no trigger
    // can address, is refused at once and queues nothing.
    assert_eq!(
        mscclppDevConnPut(d, 1 << 40, 0, 1),
        mscclppInvalidArgument,
        "offset at 2^40"
    );
    assert_eq!(
        mscclppDevConnPut(d, 0, (1 << 40) - 4, 8),
        mscclppInvalidArgument,
        "a put ending past 2^40"
    );
    assert_eq!(
        mscclppDevConnPut(std::ptr::null_mut(), 0, 0, 1),
        mscclppInvalidArgument,
        "NULL conn"
    );
    let mut fake = *d;
    fake.fifo.triggerFifoHead = 0x1000 as *mut u64;
    assert_eq!(
        mscclppDevConnPut(&mut fake, 0, 0, 1),
        mscclppInvalidUsage,
        "foreign conn"
    );
    let mut one: *mut mscclpp::abi::mscclppDevConn = std::ptr::null_mut();
    assert_eq!(
        mscclppGetDeviceConnection(c, peer as i32, 99, &mut one),
        mscclppInvalidArgument,
        "unknown tag"
    );
    assert!(one.is_null(), "outputs untouched on failure");
    ok(mscclppGetDeviceConnection(c, peer as i32, 0, &mut one));
    assert!(!one.is_null());
    // Still fully usable: one clean exchange.
    finish(c);
    assert_eq!(
        mscclppCommDestroy(c),
        mscclppInvalidArgument,
        "double destroy detected"
    );
    ok(mscclppCommDestroy(std::ptr::null_mut()));
}

#[test]
fn bad_usage_tcp() {
    ranks("bad_usage_tcp", 2, "tcp", bad_usage);
}

/// Communicators created and destroyed one after another in each rank process (each at its
/// own root from `MSCCLPP_TEST_ROOTS`), then one more, B, that stays: every destroyed one's
/// handle is refused by a second destroy, which leaves B alone; a copy of every destroyed
/// one's connection is refused by every host call and pushes nothing into B's FIFO; B then
/// exchanges data. Whether B got an old handle or FIFO head under the old code (freed and
/// reused) depends on the allocator: in this test it did not (printed); the tests that did hit
/// that reuse are `bootstrap_capi::destroyed_handle_never_names_a_newer_communicator` (handles)
/// and the unit test `host::producer::tests::a_stale_or_mixed_view_is_not_a_host_fifo`
/// (FIFO heads). This one checks the whole C API path.
fn stale_handles(e: Env) {
    let peer = 1 - e.rank;
    let roots: Vec<String> = std::env::var("MSCCLPP_TEST_ROOTS")
        .unwrap()
        .split(',')
        .map(String::from)
        .collect();
    let (old_roots, root_b) = roots.split_at(roots.len() - 1);
    let mut old = Vec::new();
    for root in old_roots {
        let mut buf = vec![0u8; 4096];
        let a = init(root, e.rank, e.n);
        ok(connect(a, peer, 0, &mut buf));
        ok(mscclppConnectionSetup(a));
        ok(mscclppProxyLaunch(a));
        let conn = dev_conns(a)[0];
        finish(a);
        old.push((a, conn));
    }
    let b = init(&root_b[0], e.rank, e.n);
    let mut buf_b = vec![0u8; 4096];
    ok(connect(b, peer, 0, &mut buf_b));
    ok(mscclppConnectionSetup(b));
    ok(mscclppProxyLaunch(b));
    let d = &mut dev_conns(b)[0];
    let reused = |f: &dyn Fn(&(_, mscclpp::abi::mscclppDevConn)) -> bool| {
        old.iter().filter(|o| f(o)).count()
    };
    println!(
        "rank {}: of {} destroyed communicators, {} had B's handle, {} B's FIFO head",
        e.rank,
        old.len(),
        reused(&|o| o.0 == b),
        reused(&|o| o.1.fifo.triggerFifoHead == d.fifo.triggerFifoHead)
    );
    let head = fifo_head(d);
    for (a, mut stale) in old.iter().copied() {
        assert_eq!(
            mscclppCommDestroy(a),
            mscclppInvalidArgument,
            "second destroy of {a:p}"
        );
        let mut rank = -1;
        ok(mscclppCommRank(b, &mut rank));
        assert_eq!(
            rank, e.rank as i32,
            "B survives the second destroy of {a:p}"
        );
        for (what, r) in [
            ("put", mscclppDevConnPut(&mut stale, 0, 0, 8)),
            ("signal", mscclppDevConnSignal(&mut stale)),
            (
                "putWithSignal",
                mscclppDevConnPutWithSignal(&mut stale, 0, 0, 8),
            ),
            (
                "putWithSignalAndFlush",
                mscclppDevConnPutWithSignalAndFlush(&mut stale, 0, 0, 8),
            ),
            ("flush", mscclppDevConnFlush(&mut stale)),
            ("wait", mscclppDevConnWait(&mut stale)),
        ] {
            assert_eq!(r, mscclppInvalidUsage, "{what} on {a:p}'s connection");
        }
    }
    assert_eq!(
        fifo_head(d),
        head,
        "a stale connection pushed into B's FIFO"
    );
    // B works: 64 bytes each way.
    let off = e.rank * 64;
    for i in 0..64 {
        buf_b[off + i] = pattern(e.rank, i);
    }
    put_signal(d, off as u64, off as u64, 64);
    flush(d);
    wait(d);
    for i in 0..64 {
        assert_eq!(buf_b[peer * 64 + i], pattern(peer, i), "byte {i} through B");
    }
    finish(b);
}

#[test]
fn stale_handles_are_refused_tcp() {
    let name = "stale_handles_are_refused_tcp";
    if is_rank(name) {
        return stale_handles(env());
    }
    let roots: Vec<String> = (0..5)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let e = with(transport_env("tcp"), "MSCCLPP_TEST_ROOTS", &roots.join(","));
    spawn(name, 2, &e).expect_success(DEADLINE);
}

/// `MSCCLPP_TEST_PROXY_PANIC=3`: the proxy's work panics at rank 0's third trigger (in the
/// proxy thread, or in a host thread doing its work). The communicator fails at once, as on a
/// proxy error: the flush that follows fails with the abort and mscclppCommGetAsyncError says
/// mscclppInternalError before any mscclppProxyStop (before, both waited for the stop that
/// joined the thread). The abort reaches rank 1 as a lost peer does (`Sticky::abort` tells the
/// peers through `Bootstrap::abort`): its wait for a signal that never comes fails at once, not
/// at the 30 s wait timeout. The abort poisons both ranks' bootstraps, so a later
/// mscclppBootstrapBarrier fails on both, naming it; the ranks order their steps after the
/// failure through marker files instead.
fn proxy_panic(e: Env) {
    // Puts over SHM's inline limit (16 KiB), so that each is a trigger.
    const N: u64 = 20000;
    // Far below the wait timeout (30 s, `transport_env`), with room for a loaded machine.
    const PROMPT: Duration = Duration::from_secs(8);
    let mut buf = vec![0u8; 3 * N as usize];
    let c = connected_pair(&e, 0, &mut buf);
    let d = &mut dev_conns(c)[0];
    if e.rank == 0 {
        put(d, 0, 0, N);
        put(d, N, N, N);
        // The third trigger: it panics whoever executes it; the push itself succeeded.
        put(d, 2 * N, 2 * N, N);
        assert_eq!(mscclppDevConnFlush(d), mscclppRemoteError);
        assert!(last_error().contains("aborted"), "{}", last_error());
        assert_eq!(async_error(c), mscclppInternalError);
        // Rank 1 learned of the abort, so this rank's bootstrap is poisoned by now (the
        // poison comes before the peers are told).
        wait_mark("r1_learned", Duration::from_secs(60)).expect("rank 1 never learned");
    } else {
        // Rank 0 never signals: only the abort ends this wait.
        let (r, t) = timed(|| mscclppDevConnWait(d));
        println!("rank 1: wait {r:?} after {t:?}: {}", last_error());
        assert_eq!(r, mscclppRemoteError);
        assert!(last_error().contains("aborted"), "{}", last_error());
        assert!(t < PROMPT, "rank 0's abort reached rank 1 after {t:?}");
        assert_eq!(async_error(c), mscclppRemoteError);
        mark("r1_learned", "");
    }
    // Both bootstraps fail, naming the panic (rank 1's through rank 0's abort).
    let (r, t) = timed(|| mscclppBootstrapBarrier(c));
    println!(
        "rank {}: barrier {r:?} after {t:?}: {}",
        e.rank,
        last_error()
    );
    assert_eq!(r, mscclppRemoteError, "{}", last_error());
    assert!(t < PROMPT, "the barrier failed after {t:?}");
    for part in ["aborted", "the proxy's work panicked"] {
        assert!(last_error().contains(part), "{part:?}: {}", last_error());
    }
    // The sticky error says why on both ranks: rank 1's names rank 0's abort and the panic.
    assert_eq!(mscclppProxyStop(c), mscclppRemoteError);
    let why = last_error();
    assert!(why.contains("the proxy's work panicked"), "{why}");
    if e.rank == 1 {
        assert!(why.contains("rank 0 aborted its bootstrap"), "{why}");
    }
    ok(mscclppCommDestroy(c));
}

/// Runs `proxy_panic` as test `name`'s two ranks over `provider`, the proxy made to panic.
fn proxy_panic_ranks(name: &str, provider: &str) {
    if is_rank(name) {
        return proxy_panic(env());
    }
    let d = Dir::new(name);
    let (k, v) = d.env();
    let e = with(transport_env(provider), "MSCCLPP_TEST_PROXY_PANIC", "3");
    spawn(name, 2, &with(e, k, &v)).expect_success(DEADLINE);
}
#[test]
fn proxy_panic_fails_the_communicator_at_once_tcp() {
    proxy_panic_ranks("proxy_panic_fails_the_communicator_at_once_tcp", "tcp");
}
#[test]
fn proxy_panic_fails_the_communicator_at_once_shm() {
    proxy_panic_ranks("proxy_panic_fails_the_communicator_at_once_shm", "shm");
}

/// A rank that never calls its counterpart mscclppConnect: setup fails within the timeout,
/// naming the connection.
fn missing_counterpart(e: Env) {
    let c = init(&e.root, e.rank, e.n);
    let mut buf = vec![0u8; 64];
    if e.rank == 0 {
        ok(connect(c, 1, 42, &mut buf));
        let t0 = std::time::Instant::now();
        assert_eq!(mscclppConnectionSetup(c), mscclppRemoteError);
        assert!(last_error().contains("tag 42"), "{}", last_error());
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "took {:?}",
            t0.elapsed()
        );
    } else {
        ok(mscclppConnectionSetup(c));
    }
    ok(mscclppCommDestroy(c));
}

#[test]
fn missing_counterpart_times_out() {
    let name = "missing_counterpart_times_out";
    if is_rank(name) {
        return missing_counterpart(env());
    }
    let e = with(transport_env("tcp"), "MSCCLPP_BOOTSTRAP_TIMEOUT", "3");
    spawn(name, 2, &e).expect_success(DEADLINE);
}

/// A peer that dies while we wait for its signal: wait() fails within the timeout instead of
/// hanging, and the communicator can still be destroyed.
fn peer_dies_during_transfer(e: Env) {
    let mut buf = vec![0u8; 4096];
    let c = connected_pair(&e, 0, &mut buf);
    let d = &mut dev_conns(c)[0];
    if e.rank == 1 {
        put_signal(d, 0, 0, 64);
        flush(d);
        // Die abruptly (no goodbye, no unwinding), with the proxy running and the peer about
        // to wait for a second signal.
        // SAFETY: signals this process only.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    wait(d);
    let t0 = std::time::Instant::now();
    let r = mscclppDevConnWait(d);
    assert_ne!(r, mscclppSuccess, "a wait on a dead peer must fail");
    // The wait timeout is 60 s: failing well before it shows the peer watch noticed the death.
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t0.elapsed()
    );
    assert_eq!(async_error(c), mscclppRemoteError);
    let _ = mscclppProxyStop(c);
    ok(mscclppCommDestroy(c));
}

#[test]
fn peer_dies_during_transfer_tcp() {
    let name = "peer_dies_during_transfer_tcp";
    if is_rank(name) {
        return peer_dies_during_transfer(env());
    }
    let e = with(transport_env("tcp"), "MSCCLPP_WAIT_TIMEOUT", "60");
    let codes = spawn(name, 2, &e).wait(DEADLINE);
    assert_eq!(
        codes[0],
        Some(0),
        "the survivor must finish cleanly: {codes:?}"
    );
    assert_ne!(codes[1], Some(0), "rank 1 aborts by design");
}
