//! Stuck jobs tear down (docs/RELIABILITY.md, "Stuck jobs and teardown"): host threads blocked
//! in `wait`, `flush` or a push loop are released by `mscclppProxyStop` and
//! `mscclppCommDestroy` within seconds, not at the wait timeout (30 s here); nothing pushed
//! after the abort is executed; a stopped communicator launches again; and an error on one
//! transport aborts the whole communicator and reaches its peers. Two ranks as processes,
//! host memory, libfabric's tcp and shm providers.

mod common;
mod fault_util;

use common::api::*;
use common::*;
use fault_util::*;
use mscclpp::abi::mscclppResult_t::*;
use mscclpp::abi::*;
use mscclpp::capi::comm::*;
use mscclpp::capi::conn::*;
use mscclpp::capi::devconn::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The wait timeout of every rank: a release must come long before it.
const WAIT_S: f64 = 30.0;
/// What "promptly" means here: far below the wait timeout, with room for a loaded 2-core
/// machine (a stop drains for 1 s at most, and cuts its transport waits at 3 s).
const PROMPT: Duration = Duration::from_secs(8);

/// Runs `body` as both ranks of test `name` (in children), or launches them (in the parent).
fn ranks(name: &str, provider: &str, body: fn(Env)) {
    if skip_missing_provider(name, provider) {
        return;
    }
    if is_rank(name) {
        return body(env());
    }
    let d = Dir::new(name);
    let mut env = rank_env(provider, 30.0, WAIT_S);
    env.push(d.env());
    spawn(name, 2, &env).expect_success(Duration::from_secs(120));
}

/// A copy of a connection that a thread may take along (the host device API may be called from
/// any thread; each test's comm outlives, or releases, every call made through it).
#[derive(Clone, Copy)]
struct Conn(mscclppDevConn);
// SAFETY: the pointers name library memory whose calls are thread-safe (RELIABILITY.md,
// "Threads"); a call on a destroyed communicator's connection is an error, not an access.
unsafe impl Send for Conn {}

/// Runs `f` on its own thread with connection `d`: its result, how long it took, and the
/// thread's last error text. `started` is set just before the call.
fn on_thread(
    d: mscclppDevConn,
    started: Arc<AtomicBool>,
    f: fn(*mut mscclppDevConn) -> mscclppResult_t,
) -> std::thread::JoinHandle<(mscclppResult_t, Duration, String)> {
    let c = Conn(d);
    std::thread::spawn(move || {
        let mut c = c;
        started.store(true, Ordering::Release);
        let (r, t) = timed(|| f(&mut c.0));
        (r, t, last_error())
    })
}

fn wait_until(flag: &AtomicBool) {
    // Ends when the thread started (it does at once).
    while !flag.load(Ordering::Acquire) {
        std::thread::yield_now();
    }
}

/// A trigger pushed straight into the FIFO, as a kernel's `push` does: no look at the abort
/// word while there is room (a kernel reads it only while the FIFO is full).
fn raw_push(d: &mscclppDevConn, ty: u64, dst: u64, src: u64, size: u64) {
    let w = trigger_encode(ty, dst, src, size, d.fifo.connId as u64);
    // SAFETY: a live host FIFO of this process (its comm is not destroyed); head, tail and the
    // slots are aligned u64s that producers and the proxy touch only atomically.
    unsafe {
        let h = AtomicU64::from_ptr(d.fifo.triggerFifoHead).fetch_add(1, Ordering::Relaxed);
        let tail = AtomicU64::from_ptr(d.fifo.triggerFifoTail).load(Ordering::Acquire);
        assert!(
            h < tail + MSCCLPP_PROXY_FIFO_SIZE,
            "the test fills at most the FIFO"
        );
        let p = d
            .fifo
            .triggerFifo
            .add((h % MSCCLPP_PROXY_FIFO_SIZE) as usize) as *mut u64;
        assert_eq!(
            AtomicU64::from_ptr(p).load(Ordering::Acquire),
            0,
            "slot free"
        );
        AtomicU64::from_ptr(p.add(1)).store(w[1], Ordering::Relaxed);
        AtomicU64::from_ptr(p).store(w[0], Ordering::Release);
    }
}

/// The signal count that arrived on `d` (its epoch block's `proxy` word).
fn signals_seen(d: &mscclppDevConn) -> u64 {
    // SAFETY: the connection's live epoch block (host memory), written atomically by the peer.
    unsafe { AtomicU64::from_ptr(std::ptr::addr_of_mut!((*d.localSignalEpochId).proxy)) }
        .load(Ordering::Acquire)
}

// ---- mscclppProxyStop releases a waiter; a later launch executes nothing pushed after it -----

/// Slots of the triggers a "released kernel" pushes after the stop (never to arrive).
const LATE: u64 = 100;
const LATE_N: u64 = 20;

fn stop_releases_then_launch_resumes(e: Env) {
    let mut buf = vec![0u8; 4096];
    let c = connected_pair(&e, 0, &mut buf);
    let d = dev_conns(c)[0];
    if e.rank == 0 {
        capture_logs();
        // A thread waits for a signal that rank 1 does not send (yet).
        let started = Arc::new(AtomicBool::new(false));
        let waiter = on_thread(d, started.clone(), |d| mscclppDevConnWait(d));
        wait_until(&started);
        let (r, t) = timed(|| mscclppProxyStop(c));
        assert_eq!(r, mscclppSuccess, "a clean stop: {}", last_error());
        assert!(t < PROMPT, "mscclppProxyStop took {t:?}");
        let (r, t, why) = waiter.join().unwrap();
        println!("waiter: {r:?} after {t:?}: {why}");
        assert_ne!(r, mscclppSuccess, "the stop releases the waiter");
        assert!(t < PROMPT, "released after {t:?} (wait timeout {WAIT_S} s)");
        assert!(why.contains("released"), "{why}");
        assert_eq!(async_error(c), mscclppSuccess, "a clean stop is no error");
        // Host calls between the stop and the next launch are refused, not queued.
        let mut dd = d;
        assert_ne!(
            mscclppDevConnPutWithSignal(&mut dd, 0, 0, 8),
            mscclppSuccess
        );
        // A kernel released by the stop may still push: those triggers are never executed.
        for i in 0..LATE_N {
            raw_push(&d, mscclppData | mscclppFlag, (LATE + i) * 8, 8, 8);
        }
        buf[8..16].copy_from_slice(&[0xEE; 8]);
        ok(mscclppProxyLaunch(c));
        let said = logged()
            .into_iter()
            .filter(|l| l.contains("retired without being executed (at mscclppProxyLaunch)"))
            .collect::<Vec<_>>();
        assert!(
            said.iter()
                .any(|l| l.contains(&format!("{LATE_N} triggers"))),
            "the launch says it retired them: {said:?}"
        );
        // The communicator works again: one put with its signal.
        buf[..8].copy_from_slice(&0x5eed_u64.to_le_bytes());
        put_signal(&mut dd, 0, 0, 8);
        flush(&mut dd);
        mark("sent", "");
    } else {
        let mut dd = d;
        wait(&mut dd);
        assert_eq!(u64::from_le_bytes(buf[..8].try_into().unwrap()), 0x5eed);
        assert!(wait_mark("sent", PROMPT).is_some());
        assert_eq!(
            signals_seen(&d),
            1,
            "only the put after the launch signalled"
        );
        let late = &buf[(LATE * 8) as usize..((LATE + LATE_N) * 8) as usize];
        assert!(
            late.iter().all(|&b| b == 0),
            "no trigger pushed after the stop's abort arrived"
        );
    }
    finish(c);
}

#[test]
fn stop_releases_a_waiter_then_launch_resumes_tcp() {
    let name = "stop_releases_a_waiter_then_launch_resumes_tcp";
    ranks(name, "tcp", stop_releases_then_launch_resumes);
}

#[test]
fn stop_releases_a_waiter_then_launch_resumes_shm() {
    let name = "stop_releases_a_waiter_then_launch_resumes_shm";
    ranks(name, "shm", stop_releases_then_launch_resumes);
}

// ---- a flush stuck on a peer that never progresses -------------------------------------------

/// Rank 1 sets up but never launches its proxy (nor calls anything that would do its work),
/// so over tcp;ofi_rxm a flush to it cannot complete. Rank 0's thread is inside that flush
/// (doing the proxy's work itself); `mscclppProxyStop` ends it within seconds, as an error,
/// and destroy then returns at once.
fn stop_ends_stuck_flush(e: Env) {
    let mut buf = vec![0u8; 1 << 20];
    let c = init(&e.root, e.rank, e.n);
    ok(connect(c, 1 - e.rank, 0, &mut buf));
    ok(mscclppConnectionSetup(c));
    if e.rank == 1 {
        assert!(
            wait_mark("rank0-done", Duration::from_secs(60)).is_some(),
            "rank 0 finished"
        );
        ok(mscclppCommDestroy(c));
        return;
    }
    ok(mscclppProxyLaunch(c));
    let d = dev_conns(c)[0];
    let started = Arc::new(AtomicBool::new(false));
    let flusher = on_thread(d, started.clone(), |d| {
        let r = mscclppDevConnPut(d, 0, 0, 1 << 20);
        if r != mscclppSuccess {
            return r;
        }
        mscclppDevConnFlush(d)
    });
    wait_until(&started);
    // How long the flush lasted before the stop only shows that it is stuck; the assertions
    // below hold however soon the stop comes.
    std::thread::sleep(Duration::from_millis(300));
    let stuck = !flusher.is_finished();
    let (r, stop) = timed(|| mscclppProxyStop(c));
    let (fr, ft, why) = flusher.join().unwrap();
    println!("flush stuck before the stop: {stuck}; stop: {r:?} in {stop:?}; flush: {fr:?} after {ft:?}: {why}");
    assert!(stop < PROMPT, "mscclppProxyStop took {stop:?}");
    assert!(
        ft < PROMPT,
        "the flush ended after {ft:?} (wait timeout {WAIT_S} s)"
    );
    if stuck {
        assert_ne!(
            fr, mscclppSuccess,
            "a flush the stop ended did not complete"
        );
    }
    let (r, t) = timed(|| mscclppCommDestroy(c));
    assert_eq!(r, mscclppSuccess, "{}", last_error());
    assert!(t < PROMPT, "mscclppCommDestroy took {t:?}");
    mark("rank0-done", "");
}

#[test]
fn stop_ends_a_flush_stuck_on_a_peer_that_does_not_progress_tcp() {
    let name = "stop_ends_a_flush_stuck_on_a_peer_that_does_not_progress_tcp";
    ranks(name, "tcp", stop_ends_stuck_flush);
}

// ---- destroy while a thread pushes in a loop ----------------------------------------------

/// 8-byte slots of the push loop: put k carries value k + 1 into slot k.
const SLOTS: usize = 1 << 16;

/// Rank 0's thread pushes puts with signals into consecutive slots while the main thread
/// destroys the communicator. Destroy returns promptly, the loop ends with an error, and rank
/// 1 received exactly the puts rank 0's proxy executed: a prefix of the loop, and none of
/// those it left unexecuted after the abort (counted in its log).
fn destroy_during_push_loop(e: Env) {
    let mut buf = vec![0u8; SLOTS * 8];
    if e.rank == 0 {
        for (k, w) in buf.chunks_mut(8).enumerate() {
            w.copy_from_slice(&(k as u64 + 1).to_le_bytes());
        }
    }
    let c = connected_pair(&e, 0, &mut buf);
    let d = dev_conns(c)[0];
    if e.rank == 1 {
        let counts = wait_mark("counts", Duration::from_secs(60)).expect("rank 0's counts");
        let (pushed, retired) = counts.split_once(' ').unwrap();
        let (pushed, retired): (u64, u64) = (pushed.parse().unwrap(), retired.parse().unwrap());
        // Inline puts still in our ring are applied by destroy.
        ok(mscclppCommDestroy(c));
        let got: Vec<u64> = buf
            .chunks(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
            .collect();
        let arrived = got.iter().take_while(|&&v| v != 0).count() as u64;
        println!("rank 0 pushed {pushed}, left {retired} unexecuted; {arrived} arrived");
        for (k, &v) in got.iter().enumerate() {
            let want = if (k as u64) < arrived {
                k as u64 + 1
            } else {
                0
            };
            assert_eq!(v, want, "slot {k}: what arrived is a prefix of the loop");
        }
        // The loop's last successful push may have found the proxy already stopped.
        assert!(
            arrived + retired == pushed || arrived + retired + 1 == pushed,
            "every successful push arrived or was left unexecuted: {arrived} + {retired} vs {pushed}"
        );
        return;
    }
    capture_logs();
    let pushed = Arc::new(AtomicU64::new(0));
    let p2 = pushed.clone();
    let conn = Conn(d);
    let pusher = std::thread::spawn(move || {
        let mut c = conn;
        let t0 = Instant::now();
        for k in 0..SLOTS as u64 {
            let r = mscclppDevConnPutWithSignal(&mut c.0, k * 8, k * 8, 8);
            if r != mscclppSuccess {
                return (r, t0.elapsed(), last_error());
            }
            p2.store(k + 1, Ordering::Release);
        }
        (mscclppSuccess, t0.elapsed(), String::new())
    });
    // Destroy in the middle of the loop.
    while pushed.load(Ordering::Acquire) < 1000 && !pusher.is_finished() {
        std::thread::yield_now();
    }
    let (r, destroy) = timed(|| mscclppCommDestroy(c));
    assert_eq!(r, mscclppSuccess, "{}", last_error());
    assert!(destroy < PROMPT, "mscclppCommDestroy took {destroy:?}");
    let (r, t, why) = pusher.join().unwrap();
    let n = pushed.load(Ordering::Acquire);
    println!("pusher: {n} pushes, then {r:?} after {t:?}: {why}; destroy took {destroy:?}");
    assert!(n < SLOTS as u64, "destroy came before the loop's end");
    assert_ne!(r, mscclppSuccess, "the loop ends with an error");
    let retired: u64 = logged()
        .iter()
        .filter(|l| l.contains("mscclpp-proxy-0.") && l.contains("left unexecuted"))
        .filter_map(|l| {
            let (_, rest) = l.split_once(": ")?;
            rest.split_whitespace().next()?.parse::<u64>().ok()
        })
        .sum();
    mark("counts", &format!("{n} {retired}"));
}

#[test]
fn destroy_during_a_push_loop_executes_nothing_after_the_abort_tcp() {
    let name = "destroy_during_a_push_loop_executes_nothing_after_the_abort_tcp";
    ranks(name, "tcp", destroy_during_push_loop);
}

#[test]
fn destroy_during_a_push_loop_executes_nothing_after_the_abort_shm() {
    let name = "destroy_during_a_push_loop_executes_nothing_after_the_abort_shm";
    ranks(name, "shm", destroy_during_push_loop);
}

// ---- one abort for the whole communicator, and for its peers ---------------------------------

/// Each rank has two connections to the other: tag 0 over IB (tcp), tag 1 over SHM. Rank 0's
/// proxy refuses an out-of-range put on IB: its thread waiting on the SHM connection returns
/// at once, and rank 1's wait on the IB connection fails at once too (the abort reaches it as
/// a lost peer does), with the reason; neither at the 30 s wait timeout.
fn error_aborts_every_transport_and_peer(e: Env) {
    let mut ib = vec![0u8; 4096];
    let mut shm = vec![0u8; 4096];
    let c = init(&e.root, e.rank, e.n);
    let peer = 1 - e.rank;
    connect_over(c, peer, 0, &mut ib, mscclppTransport_t::mscclppTransportIB);
    connect_over(
        c,
        peer,
        1,
        &mut shm,
        mscclppTransport_t::mscclppTransportSHM,
    );
    ok(mscclppConnectionSetup(c));
    ok(mscclppProxyLaunch(c));
    let conns = dev_conns(c);
    let (on_ib, on_shm) = (conns[0], conns[1]);
    assert_eq!((on_ib.tag, on_shm.tag), (0, 1));
    if e.rank == 0 {
        let started = Arc::new(AtomicBool::new(false));
        let waiter = on_thread(on_shm, started.clone(), |d| mscclppDevConnWait(d));
        wait_until(&started);
        let mut d = on_ib;
        // Beyond the peer's 4096 bytes: refused by the IB proxy, the communicator's error.
        ok(mscclppDevConnPut(&mut d, 4000, 0, 200));
        let (r, t, why) = waiter.join().unwrap();
        println!("rank 0: SHM waiter {r:?} after {t:?}: {why}");
        assert_ne!(r, mscclppSuccess);
        assert!(t < PROMPT, "the SHM waiter ended after {t:?}");
        assert!(why.contains("aborted"), "{why}");
        assert_eq!(async_error(c), mscclppInvalidArgument);
    } else {
        let mut d = on_ib;
        let (r, t) = timed(|| mscclppDevConnWait(&mut d));
        let why = last_error();
        println!("rank 1: IB wait {r:?} after {t:?}: {why}");
        assert_ne!(r, mscclppSuccess, "rank 0 never signals");
        assert!(t < PROMPT, "the peer's abort reached this rank after {t:?}");
        // Every transport of this rank is aborted too.
        let mut s = on_shm;
        let (r, t) = timed(|| mscclppDevConnWait(&mut s));
        assert_ne!(r, mscclppSuccess);
        assert!(t < PROMPT);
        assert_eq!(async_error(c), mscclppRemoteError);
    }
    // The sticky error says why, on both ranks (rank 1's names rank 0's refused put).
    assert_eq!(mscclppProxyStop(c), mscclppRemoteError);
    assert!(last_error().contains("put refused"), "{}", last_error());
    let (r, t) = timed(|| mscclppCommDestroy(c));
    assert_eq!(r, mscclppSuccess, "{}", last_error());
    assert!(t < PROMPT, "mscclppCommDestroy took {t:?}");
}

#[test]
fn an_error_on_one_transport_releases_every_transport_and_the_peer() {
    let name = "an_error_on_one_transport_releases_every_transport_and_the_peer";
    if skip_missing_provider(name, "shm") {
        return;
    }
    ranks(name, "tcp", error_aborts_every_transport_and_peer);
}
