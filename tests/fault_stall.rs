//! Fault injection without a death: the root's port held by another process, and a peer that
//! stops (SIGSTOP) for less, then for more, than `MSCCLPP_WAIT_TIMEOUT`. In every case the
//! ranks finish or fail within their timeouts, and afterwards the same two processes form a
//! new communicator and exchange data.

mod common;
mod fault_util;

use common::api::*;
use common::*;
use fault_util::*;
use mscclpp::abi::mscclppResult_t::*;
use mscclpp::capi::comm::*;
use mscclpp::capi::conn::*;
use mscclpp::capi::devconn::*;
use std::ffi::CString;
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(45);

fn rank() -> usize {
    env_usize("MSCCLPP_TEST_RANK")
}

/// Both ranks, after a failure: meet at `MSCCLPP_TEST_ROOT2` once the other one has failed
/// too (marker `r{rank}_failed`), and exchange 64 KiB each way.
fn regroup() {
    let me = rank();
    mark(&format!("r{me}_failed"), "");
    wait_mark(&format!("r{}_failed", 1 - me), Duration::from_secs(20))
        .expect("the other rank never finished failing");
    let root2 = std::env::var("MSCCLPP_TEST_ROOT2").unwrap();
    exchange_rank(&root2, me, 5);
    println!("rank {me}: regrouped and exchanged");
}

fn root2_env() -> (&'static str, String) {
    ("MSCCLPP_TEST_ROOT2", format!("127.0.0.1:{}", free_port()))
}

// ---- (f) the root's port is taken ------------------------------------------------------------

/// Another process listens on the root address (accepting and ignoring connections): rank 0
/// fails at once with a system error naming the address, rank 1 (which reaches the stranger)
/// fails at its bootstrap timeout; then both meet at a free address and exchange data.
#[test]
fn root_port_taken_by_another_process() {
    const NAME: &str = "root_port_taken_by_another_process";
    const BOOT_S: f64 = 3.0;
    if is_rank(NAME) {
        let root = std::env::var("MSCCLPP_TEST_ROOT").unwrap();
        let a = CString::new(root.clone()).unwrap();
        let mut c = std::ptr::null_mut();
        let (r, el) = timed(|| mscclppCommInitRank(&mut c, 2, a.as_ptr(), rank() as i32));
        println!(
            "rank {}: init -> {r:?} after {el:?}: {}",
            rank(),
            last_error()
        );
        assert!(c.is_null(), "no comm on failure");
        if rank() == 0 {
            assert_eq!(r, mscclppSystemError);
            assert!(last_error().contains(&root), "{}", last_error());
            assert!(el < Duration::from_secs(1), "{el:?}");
        } else {
            assert_eq!(r, mscclppRemoteError);
            assert!(el < Duration::from_secs_f64(BOOT_S * 1.25 + 2.0), "{el:?}");
        }
        regroup();
        return;
    }
    let dir = Dir::new(NAME);
    let root = format!("127.0.0.1:{}", free_port());
    let mut holder = spawn_rank("port_holder", 0, 1, &root, &[dir.env()]);
    wait_mark_in(&dir.0, "holding", Duration::from_secs(20)).expect("holder never bound");
    let mut env = rank_env("tcp", BOOT_S, 5.0);
    env.push(dir.env());
    env.push(root2_env());
    let codes = spawn_wrapped(NAME, 2, &root, &env, |_| Vec::new()).wait(DEADLINE);
    mark_in(&dir.0, "release", "");
    let h = wait_child(&mut holder, Duration::from_secs(10)).map(|s| s.code());
    assert_eq!(codes, vec![Some(0), Some(0)]);
    assert_eq!(h, Some(Some(0)), "holder");
}

/// The stranger of `root_port_taken_by_another_process` (does nothing in a normal run).
#[test]
fn port_holder() {
    if !is_rank("port_holder") {
        return;
    }
    let l = std::net::TcpListener::bind(std::env::var("MSCCLPP_TEST_ROOT").unwrap()).unwrap();
    l.set_nonblocking(true).unwrap();
    mark("holding", "");
    let mut held = Vec::new();
    // Ends: the parent releases us, or after 40 s.
    let t0 = Instant::now();
    while wait_mark("release", Duration::from_millis(20)).is_none()
        && t0.elapsed() < Duration::from_secs(40)
    {
        if let Ok((s, _)) = l.accept() {
            held.push(s);
        }
    }
    println!("holder: held {} connections", held.len());
}

// ---- (g) a slow peer: SIGSTOP, then SIGCONT ----------------------------------------------------

const SLOTS: usize = 16;
const ROUNDS: u64 = 800;
/// The round at whose start rank 1 stops itself (SIGSTOP), until the parent continues it.
const STOP_AT: u64 = 200;

/// Ping-pong of round numbers (as in e2e_host): rank 0 sends round r and waits for rank 1's
/// answer; every value is checked. Returns the first failing call's code, the time that call
/// took, and the rounds completed.
fn pingpong(d: &mut mscclpp::abi::mscclppDevConn, buf: &mut [u8]) -> (Option<i32>, Duration, u64) {
    let me = rank();
    let bp = buf.as_mut_ptr();
    let base = |r: usize| r * SLOTS * 8;
    let mut longest = Duration::ZERO;
    for round in 0..ROUNDS {
        if me == 1 && round == STOP_AT {
            // Stopped here by itself, not by the parent at a round it reads from a file: the
            // parent could be descheduled past the last round on a loaded host, and rank 0
            // then waits for round STOP_AT's answer while rank 1 is stopped, every time.
            stop_self();
        }
        for step in 0..2 {
            let sending = (step == 0) == (me == 0);
            let t0 = Instant::now();
            let r = if sending {
                let off = base(me) + (round as usize % SLOTS) * 8;
                // SAFETY: within buf; the peer reads this slot only after our signal.
                unsafe { (bp.add(off) as *mut u64).write_volatile(round) };
                mscclppDevConnPutWithSignal(d, off as u64, off as u64, 8)
            } else {
                let r = mscclppDevConnWait(d);
                if r == mscclppSuccess {
                    let off = base(1 - me) + (round as usize % SLOTS) * 8;
                    // SAFETY: within buf; written by the peer before its signal.
                    let v = unsafe { (bp.add(off) as *const u64).read_volatile() };
                    assert_eq!(v, round, "round {round}");
                }
                r
            };
            let el = t0.elapsed();
            if r != mscclppSuccess {
                return (Some(r as i32), el, round);
            }
            longest = longest.max(el);
        }
    }
    println!("rank {me}: longest single call {longest:?}");
    (None, longest, ROUNDS)
}

/// Rank 1 stops itself at the start of round `STOP_AT`, and the parent continues it after
/// `stop` (if Some) or, if None, once rank 0 has failed; the wait timeout is `wait_s`.
fn slow_peer(name: &str, provider: &str, wait_s: f64, stop: Option<Duration>) {
    if is_rank(name) {
        let me = rank();
        let c = init(&std::env::var("MSCCLPP_TEST_ROOT").unwrap(), me, 2);
        let mut buf = vec![0u8; 2 * SLOTS * 8];
        ok(connect(c, 1 - me, 0, &mut buf));
        ok(mscclppConnectionSetup(c));
        ok(mscclppProxyLaunch(c));
        let d = &mut dev_conns(c)[0];
        let (err, el, rounds) = pingpong(d, &mut buf);
        println!(
            "rank {me}: {rounds} rounds, error {err:?} (that call took {el:?}) {}",
            if err.is_some() {
                last_error()
            } else {
                String::new()
            }
        );
        let limit = Duration::from_secs_f64(wait_s);
        if stop.is_some() {
            // Stopped for less than the timeout: everything completes.
            assert_eq!(err, None, "{}", last_error());
            assert_eq!(rounds, ROUNDS);
            finish(c);
            return;
        }
        // Stopped beyond the timeout: rank 0's wait gives up at the timeout, rank 1 fails
        // when it runs again (its wait's deadline has passed, or rank 0 never answers).
        let code = err.expect("a rank stopped beyond the timeout cannot complete");
        if me == 0 {
            mark("r0_gave_up", "");
            assert_eq!(code, mscclppRemoteError as i32);
            assert!(last_error().contains("timed out"), "{}", last_error());
            // Under the 8 s bootstrap timeout, with room for a loaded host: the wait's own
            // timeout is what ended it.
            assert!(
                el >= limit && el < limit + Duration::from_secs(4),
                "gave up after {el:?}, timeout {limit:?}"
            );
        }
        let _ = mscclppProxyStop(c);
        ok(mscclppCommDestroy(c));
        regroup();
        return;
    }
    let dir = Dir::new(name);
    let mut env = rank_env(provider, 8.0, wait_s);
    env.push(dir.env());
    env.push(root2_env());
    let ranks = spawn(name, 2, &env);
    let pid1 = ranks.children[1].1.id();
    if !wait_stopped(pid1, Duration::from_secs(20)) {
        panic!("rank 1 did not stop itself at round {STOP_AT} within 20 s");
    }
    let stopped = Instant::now();
    match stop {
        Some(d) => std::thread::sleep(d),
        None => {
            let gave_up = wait_mark_in(
                &dir.0,
                "r0_gave_up",
                Duration::from_secs_f64(wait_s) + Duration::from_secs(10),
            );
            if gave_up.is_none() {
                send_signal(pid1, libc::SIGCONT);
                panic!("rank 0 did not give up while its peer was stopped");
            }
        }
    }
    send_signal(pid1, libc::SIGCONT);
    println!("rank 1 was stopped for {:?}", stopped.elapsed());
    let codes = ranks.wait(DEADLINE);
    assert_eq!(codes, vec![Some(0), Some(0)]);
}

#[test]
fn peer_stopped_within_timeout_tcp() {
    slow_peer(
        "peer_stopped_within_timeout_tcp",
        "tcp",
        4.0,
        Some(Duration::from_secs(1)),
    );
}
#[test]
fn peer_stopped_within_timeout_shm() {
    slow_peer(
        "peer_stopped_within_timeout_shm",
        "shm",
        4.0,
        Some(Duration::from_secs(1)),
    );
}
#[test]
fn peer_stopped_beyond_timeout_tcp() {
    slow_peer("peer_stopped_beyond_timeout_tcp", "tcp", 2.0, None);
}
#[test]
fn peer_stopped_beyond_timeout_shm() {
    slow_peer("peer_stopped_beyond_timeout_shm", "shm", 2.0, None);
}
