//! Fault injection: a rank process SIGKILLed at each stage of a communicator's life, over real
//! libfabric providers (tcp and shm). For every case the survivors fail (or complete, where
//! the protocol allows) well within the timeouts, nobody hangs, data a sender had flushed is
//! intact at the receiver, and each survivor then runs a fresh exchange in the same process.
//!
//! Ranks are processes (`common::spawn`); the parent and the ranks meet through marker files
//! (`fault_util`). Timeouts are large enough (5-8 s) that "failed in < 3 s" proves the death
//! was noticed, not waited out.
//!
//! shm only: a peer killed while it holds one of the provider's locks in shared memory wedges
//! the survivor's endpoint (libfabric 1.17; docs/RELIABILITY.md). The survivor's call then
//! ends at the wait timeout instead, its proxy is abandoned when stopped, and destroy and a
//! fresh exchange still work: `finish_survivor` checks that branch too.

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

const BOOT_S: f64 = 8.0;
/// Bootstrap timeout of the tests where a rank waits it out.
const BOOT_FAST_S: f64 = 3.0;
const WAIT_S: f64 = 5.0;
/// A failure noticed through the peer watch or a closed socket, not a timeout.
const PROMPT: Duration = Duration::from_secs(3);
const DEADLINE: Duration = Duration::from_secs(45);

fn rank() -> usize {
    env_usize("MSCCLPP_TEST_RANK")
}
fn nranks() -> usize {
    env_usize("MSCCLPP_TEST_NRANKS")
}
fn root() -> String {
    std::env::var("MSCCLPP_TEST_ROOT").unwrap()
}

/// `mscclppCommInitRank` that may fail; the comm on success.
fn try_init(root: &str, rank: usize, n: usize) -> Result<mscclpp::capi::mscclppComm_t, String> {
    let mut c = std::ptr::null_mut();
    let a = CString::new(root).unwrap();
    match mscclppCommInitRank(&mut c, n as i32, a.as_ptr(), rank as i32) {
        mscclppSuccess => Ok(c),
        r => Err(format!("{r:?}: {}", last_error())),
    }
}

/// The end of a survivor whose call failed after `el` (since the kill): the death was noticed
/// promptly, or (shm) the provider was wedged by the dead peer and the call ended at the wait
/// timeout, in which case stopping the proxy abandons it. Either way stop and destroy are
/// bounded, and a fresh exchange works.
fn finish_survivor(c: mscclpp::capi::mscclppComm_t, el: Duration, provider: &str) {
    let wait = Duration::from_secs_f64(WAIT_S);
    let wedged = el >= PROMPT;
    if wedged {
        assert_eq!(provider, "shm", "the death was not noticed: {el:?}");
        // (Measured from the kill, which may come a little after the call began.)
        assert!(
            el + Duration::from_millis(500) >= wait && el < wait + PROMPT,
            "{el:?}"
        );
        println!(
            "KNOWN LIMIT: the shm endpoint was wedged by the dead peer; call ended at the timeout"
        );
    } else {
        // The peer watch (RemoteError) or the transport (tcp: connection reset, SystemError)
        // reports first.
        assert_ne!(async_error(c), mscclppSuccess);
    }
    let (r, t) = timed(|| mscclppProxyStop(c));
    println!(
        "survivor: mscclppProxyStop -> {r:?} in {t:?}: {}",
        last_error()
    );
    assert_ne!(r, mscclppSuccess);
    assert!(t < PROMPT, "mscclppProxyStop took {t:?}");
    if wedged {
        assert!(
            last_error().contains("stuck inside the transport"),
            "{}",
            last_error()
        );
    }
    let (r, t) = timed(|| mscclppCommDestroy(c));
    assert_eq!(r, mscclppSuccess);
    assert!(t < PROMPT, "mscclppCommDestroy took {t:?}");
    fresh_exchange_in_process();
}

// ---- (a) during bootstrap ---------------------------------------------------------------------

/// Rank 2 of 4 is killed while it waits inside mscclppCommInitRank for the last rank, once the
/// root has counted it in: ranks 0 and 1 fail at once (the root sees rank 2's connection
/// close) instead of waiting for the timeout; rank 3, started after they failed, finds no root
/// and fails at its bootstrap timeout.
#[test]
fn rank_killed_during_bootstrap() {
    const NAME: &str = "rank_killed_during_bootstrap";
    if is_rank(NAME) {
        if rank() == 2 {
            mark("r2_init", "");
        }
        let t0 = Instant::now();
        let r = try_init(&root(), rank(), nranks());
        assert!(rank() != 2, "rank 2 must have been killed: {r:?}");
        let e = r.expect_err("bootstrap with a dead rank succeeded");
        println!("rank {}: init failed after {:?}: {e}", rank(), t0.elapsed());
        mark(&format!("r{}_failed", rank()), "");
        assert!(e.contains("RemoteError"), "{e}");
        // Ranks 0 and 1 hear from the root as soon as rank 2's connection to it closes;
        // rank 3, started after the kill, finds no root and gives up at its timeout.
        let el = t0.elapsed();
        if rank() == 3 {
            assert!(e.contains("timed out"), "{e}");
            assert!(
                el < Duration::from_secs_f64(BOOT_FAST_S * 1.25 + 2.0),
                "{el:?}"
            );
        } else {
            assert!(e.contains("rank 2") && e.contains("disconnected"), "{e}");
        }
        fresh_exchange_in_process();
        return;
    }
    let dir = Dir::new(NAME);
    let root = format!("127.0.0.1:{}", free_port());
    let mut env = rank_env("tcp", BOOT_FAST_S, WAIT_S);
    env.push(dir.env());
    // Ranks 0-2 connect to the root, send their hellos and wait for the table: rank 2 is
    // killed once the root logged the third of them joined (a fixed sleep could kill it
    // before, and then it is missing, not disconnected; killed as soon as it alone joined,
    // rank 1 may not have, and finds the root gone).
    let (r0, joined) = spawn_rank_watched(NAME, 0, 4, &root, &env, "), 3/4");
    let mut kids = vec![r0];
    kids.extend((1..3).map(|r| spawn_rank(NAME, r, 4, &root, &env)));
    if joined.recv_timeout(Duration::from_secs(20)).is_err() {
        for k in &mut kids {
            let _ = k.kill();
        }
        panic!("the root never logged that ranks 0-2 joined");
    }
    let t0 = Instant::now();
    kids[2].kill().unwrap();
    // Rank 3 only once the root is gone (ranks 0 and 1 failed): before, it could still reach
    // the failing root and be told so, instead of finding nobody.
    for r in [0, 1] {
        wait_mark_in(&dir.0, &format!("r{r}_failed"), DEADLINE)
            .unwrap_or_else(|| panic!("rank {r} did not fail after rank 2 was killed"));
    }
    kids.push(spawn_rank(NAME, 3, 4, &root, &env));
    let codes: Vec<_> = kids
        .iter_mut()
        .map(|k| wait_child(k, DEADLINE).map(|s| s.code()))
        .collect();
    println!("codes {codes:?} after {:?}", t0.elapsed());
    assert_eq!(codes[2], Some(None), "rank 2 was killed");
    for r in [0, 1, 3] {
        assert_eq!(codes[r], Some(Some(0)), "rank {r}: {codes:?}");
    }
}

/// The root (rank 0) is killed while rank 1 waits for the table: rank 1 fails at once (the
/// root's connection closes); rank 2, started afterwards, finds no root and fails at its
/// bootstrap timeout.
#[test]
fn root_killed_during_bootstrap() {
    const NAME: &str = "root_killed_during_bootstrap";
    if is_rank(NAME) {
        mark(&format!("r{}_init", rank()), "");
        let t0 = Instant::now();
        let r = try_init(&root(), rank(), nranks());
        assert!(rank() != 0, "rank 0 must have been killed: {r:?}");
        let e = r.expect_err("bootstrap without its root succeeded");
        let el = t0.elapsed();
        println!("rank {}: init failed after {el:?}: {e}", rank());
        if rank() == 2 {
            assert!(e.contains("RemoteError"), "{e}");
            assert!(
                el < Duration::from_secs_f64(BOOT_FAST_S * 1.25 + 2.0),
                "{el:?}"
            );
        }
        fresh_exchange_in_process();
        return;
    }
    let dir = Dir::new(NAME);
    let root = format!("127.0.0.1:{}", free_port());
    let mut env = rank_env("tcp", BOOT_FAST_S, WAIT_S);
    env.push(dir.env());
    let mut kids: Vec<_> = (0..2)
        .map(|r| spawn_rank(NAME, r, 3, &root, &env))
        .collect();
    for r in 0..2 {
        wait_mark_in(&dir.0, &format!("r{r}_init"), Duration::from_secs(20)).expect("no start");
    }
    std::thread::sleep(Duration::from_millis(400));
    let t0 = Instant::now();
    kids[0].kill().unwrap();
    // Rank 1 fails at once: no waiting for rank 2 to show that.
    let c1 = wait_child(&mut kids[1], DEADLINE).map(|s| s.code());
    let el = t0.elapsed();
    println!("rank 1 exited {c1:?} {el:?} after the root was killed");
    assert_eq!(c1, Some(Some(0)));
    let mut k2 = spawn_rank(NAME, 2, 3, &root, &env);
    let c2 = wait_child(&mut k2, DEADLINE).map(|s| s.code());
    assert_eq!(c2, Some(Some(0)));
    assert_eq!(
        wait_child(&mut kids[0], DEADLINE).map(|s| s.code()),
        Some(None)
    );
    // Rank 1's exit includes its fresh exchange; its failure itself is checked to be prompt
    // by the time it took overall.
    assert!(el < Duration::from_secs(15), "{el:?}");
}

/// Runs 2 ranks of test `name`; once every mark in `marks` is there (each within
/// `mark_wait`) and another `settle` has passed, SIGKILLs rank 1 and marks the time
/// ("killed") for the survivor. Returns the exit codes.
fn kill_rank1_when(
    name: &str,
    provider: &str,
    marks: &[&str],
    mark_wait: Duration,
    settle: Duration,
) -> Vec<Option<i32>> {
    let dir = Dir::new(name);
    let mut env = rank_env(provider, BOOT_S, WAIT_S);
    env.push(dir.env());
    let mut ranks = spawn(name, 2, &env);
    for m in marks {
        wait_mark_in(&dir.0, m, mark_wait).expect(m);
    }
    std::thread::sleep(settle);
    ranks.children[1].1.kill().unwrap();
    mark_in(&dir.0, "killed", &now_ms().to_string());
    ranks.wait(DEADLINE)
}

// ---- (b) during connection setup -----------------------------------------------------------

/// Rank 1 declares a second connection that rank 0 never declares, so it stays inside
/// mscclppConnectionSetup (waiting for that blob) until it is killed; rank 0, which waits for
/// rank 1's acknowledgement, fails as soon as rank 1's bootstrap connection closes.
fn killed_during_setup(name: &str, provider: &str) {
    if is_rank(name) {
        let c = init(&root(), rank(), 2);
        let mut buf = vec![0u8; 4096];
        ok(connect(c, 1 - rank(), 0, &mut buf));
        if rank() == 1 {
            ok(connect(c, 0, 1, &mut buf));
            mark("r1_setup", "");
            let r = mscclppConnectionSetup(c);
            panic!("rank 1 must be killed inside setup, it returned {r:?}");
        }
        mark("r0_setup", "");
        let (r, el) = timed(|| mscclppConnectionSetup(c));
        let killed_at: u64 = wait_mark("killed", Duration::from_secs(20))
            .expect("no kill marker")
            .parse()
            .unwrap();
        let since_kill = now_ms().saturating_sub(killed_at);
        println!(
            "rank 0: setup -> {r:?} after {el:?} ({since_kill} ms after the kill): {}",
            last_error()
        );
        assert_ne!(r, mscclppSuccess);
        assert!(last_error().contains("rank 1"), "{}", last_error());
        assert!(since_kill < PROMPT.as_millis() as u64, "{since_kill} ms");
        // The failed comm refuses further use and is destroyed cleanly.
        assert_eq!(mscclppProxyLaunch(c), mscclppInvalidUsage);
        ok(mscclppCommDestroy(c));
        fresh_exchange_in_process();
        return;
    }
    let codes = kill_rank1_when(
        name,
        provider,
        &["r0_setup", "r1_setup"],
        Duration::from_secs(20),
        Duration::from_millis(300),
    );
    assert_eq!(
        codes,
        vec![Some(0), None],
        "rank 0 survives, rank 1 was killed"
    );
}

#[test]
fn rank_killed_during_setup_tcp() {
    killed_during_setup("rank_killed_during_setup_tcp", "tcp");
}
#[test]
fn rank_killed_during_setup_shm() {
    killed_during_setup("rank_killed_during_setup_shm", "shm");
}

// ---- (c) in the middle of a stream of puts, the receiver in wait ---------------------------

/// Ring of slots the sender cycles through; it runs at most SLOTS - 1 rounds ahead of the
/// receiver's acknowledgements, so a slot is never rewritten before it was checked.
const SLOTS: usize = 8;
const SLOT: usize = 16 << 10;
/// Puts per round (each a quarter of the slot), then one signal and one flush.
const PIECES: usize = 4;

fn slot_byte(round: usize, i: usize) -> u8 {
    pattern(round % 251, i) ^ (round >> 8) as u8
}

/// The proxy side of this connection's epoch: signals that have arrived.
fn signals_arrived(d: &mscclpp::abi::mscclppDevConn) -> u64 {
    // SAFETY: the epoch block lives as long as the comm; the peer's proxy writes it.
    unsafe {
        std::sync::atomic::AtomicU64::from_ptr(std::ptr::addr_of_mut!(
            (*d.localSignalEpochId).proxy
        ))
    }
    .load(std::sync::atomic::Ordering::Acquire)
}

/// Sender (rank 1): rounds of PIECES puts + signal + flush into slot round % SLOTS, publishing
/// the number of flushed rounds in a counter file, until it is killed. Receiver (rank 0):
/// waits for each round, checks it, acknowledges it with a signal.
fn stream_until_killed(name: &str, provider: &str) {
    if is_rank(name) {
        let c = init(&root(), rank(), 2);
        let mut buf = vec![0u8; SLOTS * SLOT];
        ok(connect(c, 1 - rank(), 0, &mut buf));
        ok(mscclppConnectionSetup(c));
        ok(mscclppProxyLaunch(c));
        let d = &mut dev_conns(c)[0];
        let flushed = dir().join("flushed");
        if rank() == 1 {
            let ctr = Counter::create(&flushed);
            for round in 0.. {
                if round >= SLOTS - 1 {
                    wait(d);
                }
                let s = round % SLOTS;
                for (i, b) in buf[s * SLOT..(s + 1) * SLOT].iter_mut().enumerate() {
                    *b = slot_byte(round, i);
                }
                for p in 0..PIECES {
                    let o = (s * SLOT + p * SLOT / PIECES) as u64;
                    put(d, o, o, (SLOT / PIECES) as u64);
                }
                signal(d);
                flush(d);
                ctr.set(round as u64 + 1);
            }
            unreachable!();
        }
        let mut verified = 0usize;
        let (err, el) = loop {
            let (r, el) = timed(|| mscclppDevConnWait(d));
            if r != mscclppSuccess {
                break (r, el);
            }
            let s = verified % SLOTS;
            for i in 0..SLOT {
                assert_eq!(
                    buf[s * SLOT + i],
                    slot_byte(verified, i),
                    "round {verified} byte {i}"
                );
            }
            verified += 1;
            if verified == 100 {
                mark("receiving", "");
            }
            let r = mscclppDevConnSignal(d);
            if r != mscclppSuccess {
                let (r, el) = timed(|| mscclppDevConnWait(d));
                break (r, el);
            }
        };
        let got = signals_arrived(d) as usize;
        let f = read_counter(&flushed) as usize;
        println!(
            "rank 0: wait -> {err:?} after {el:?}; verified {verified} rounds, {got} signals arrived, sender had flushed {f}: {}",
            last_error()
        );
        // Nothing acknowledged was lost: every flushed round's signal arrived, and the slots
        // of the last rounds that arrived hold their data (round got's own data may have been
        // in flight and rewritten slot got % SLOTS).
        assert!(got >= f, "{f} rounds flushed, only {got} signals arrived");
        for round in (got + 1).saturating_sub(SLOTS - 1)..got {
            let s = round % SLOTS;
            for i in 0..SLOT {
                assert_eq!(buf[s * SLOT + i], slot_byte(round, i), "round {round}");
            }
        }
        finish_survivor(c, el, provider);
        return;
    }
    let dir = Dir::new(name);
    let mut env = rank_env(provider, BOOT_S, WAIT_S);
    env.push(dir.env());
    let mut ranks = spawn(name, 2, &env);
    let flushed = dir.0.join("flushed");
    wait_mark_in(&dir.0, "receiving", Duration::from_secs(30)).expect("stream never started");
    let t0 = Instant::now();
    // Ends: 200 more rounds went through, or 10 s passed (kill anyway).
    while read_counter(&flushed) < 300 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(2));
    }
    ranks.children[1].1.kill().unwrap();
    let codes = ranks.wait(DEADLINE);
    println!("after {} flushed rounds: {codes:?}", read_counter(&flushed));
    assert_eq!(codes, vec![Some(0), None]);
}

#[test]
fn rank_killed_mid_stream_tcp() {
    stream_until_killed("rank_killed_mid_stream_tcp", "tcp");
}
#[test]
fn rank_killed_mid_stream_shm() {
    stream_until_killed("rank_killed_mid_stream_shm", "shm");
}

// ---- (d) killed while it waits; the survivor keeps putting -----------------------------------

/// Rank 1 sits in wait() (no signal ever comes) and is killed there; rank 0, putting and
/// flushing into it all along, gets an error from flush promptly.
fn killed_in_wait(name: &str, provider: &str) {
    if is_rank(name) {
        let c = init(&root(), rank(), 2);
        let mut buf = vec![0u8; 1 << 16];
        ok(connect(c, 1 - rank(), 0, &mut buf));
        ok(mscclppConnectionSetup(c));
        ok(mscclppProxyLaunch(c));
        let d = &mut dev_conns(c)[0];
        if rank() == 1 {
            mark("r1_waiting", "");
            let r = mscclppDevConnWait(d);
            panic!("rank 1 must be killed inside wait, it returned {r:?}");
        }
        let t0 = Instant::now();
        let mut rounds = 0u64;
        let err = loop {
            let o = (rounds % 16) * 4096;
            let r = mscclppDevConnPut(d, o, o, 4096);
            if r != mscclppSuccess {
                break r;
            }
            let r = mscclppDevConnFlush(d);
            if r != mscclppSuccess {
                break r;
            }
            rounds += 1;
            if rounds == 50 {
                mark("r0_putting", "");
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "never failed");
        };
        let killed_at: u64 = wait_mark("killed", Duration::from_secs(5))
            .expect("failed before the kill")
            .parse()
            .unwrap();
        let since = now_ms().saturating_sub(killed_at);
        println!(
            "rank 0: {err:?} after {rounds} put+flush rounds, {since} ms after the kill: {}",
            last_error()
        );
        finish_survivor(c, Duration::from_millis(since), provider);
        return;
    }
    let codes = kill_rank1_when(
        name,
        provider,
        &["r1_waiting", "r0_putting"],
        Duration::from_secs(30),
        Duration::from_millis(100),
    );
    assert_eq!(codes, vec![Some(0), None]);
}

#[test]
fn rank_killed_in_wait_tcp() {
    killed_in_wait("rank_killed_in_wait_tcp", "tcp");
}
#[test]
fn rank_killed_in_wait_shm() {
    killed_in_wait("rank_killed_in_wait_shm", "shm");
}

// ---- reproduction: shm wedged by a peer killed inside the provider ---------------------------

/// Not run by default (`--ignored`): kills a peer streaming small signals over shm, 12 times
/// on the SHM transport and 12 on the IB transport over the same provider
/// (`MSCCLPP_NET_PROVIDER=shm`), and counts how the survivor ends. libfabric 1.17's shm
/// provider keeps its locks in shared memory; a peer killed while holding one leaves it held,
/// and every later call into the survivor's endpoint spins forever. Measured here (2 cores):
/// about 1 kill in 5 wedges the endpoint. Only the proxy thread may be the one caught (host
/// threads stay out of such endpoints, `Caps::may_wedge`): the survivor's wait ends at the
/// timeout and stop/destroy abandon the proxy (bounded: this test passes). A host thread
/// caught there (as host waiters were before, about 1 kill in 40) never returns from its call:
/// this test then fails with a "hung" count.
#[test]
#[ignore = "reproduces a libfabric 1.17 shm limitation; run explicitly"]
fn shm_peer_killed_inside_the_provider() {
    const NAME: &str = "shm_peer_killed_inside_the_provider";
    if is_rank(NAME) {
        let c = init(&root(), rank(), 2);
        let mut buf = vec![0u8; 4096];
        ok(connect(c, 1 - rank(), 0, &mut buf));
        ok(mscclppConnectionSetup(c));
        ok(mscclppProxyLaunch(c));
        let d = &mut dev_conns(c)[0];
        if rank() == 1 {
            mark("go", "");
            // Ends when killed.
            loop {
                let _ = mscclppDevConnPutWithSignal(d, 0, 0, 8);
            }
        }
        let el = loop {
            let (r, el) = timed(|| mscclppDevConnWait(d));
            if r != mscclppSuccess {
                break el;
            }
        };
        let (_, stop) = timed(|| mscclppProxyStop(c));
        let (_, destroy) = timed(|| mscclppCommDestroy(c));
        println!("SURVIVOR wait ended after {el:?}; stop {stop:?}; destroy {destroy:?}");
        mark("survived", &format!("{}", el >= PROMPT));
        return;
    }
    // The IB transport with libfabric's shm provider under it: the SHM ranks' settings, the
    // transport named by key (not by its place in `rank_env`'s list).
    let mut ib_over_shm = rank_env("shm", BOOT_S, 3.0);
    for (k, v) in &mut ib_over_shm {
        if *k == "MSCCLPP_TEST_TRANSPORT" {
            *v = "ib".into();
        }
    }
    ib_over_shm.push(("MSCCLPP_NET_PROVIDER", "shm".into()));
    let mut hung_total = 0;
    for (what, base) in [
        ("SHM transport", rank_env("shm", BOOT_S, 3.0)),
        ("IB over shm", ib_over_shm),
    ] {
        let (mut prompt, mut wedged, mut hung) = (0, 0, 0);
        for round in 0..12 {
            let dir = Dir::new(&format!("{NAME}{round}"));
            let mut env = base.clone();
            env.push(dir.env());
            let root = format!("127.0.0.1:{}", free_port());
            let mut kids: Vec<_> = (0..2)
                .map(|r| spawn_rank(NAME, r, 2, &root, &env))
                .collect();
            wait_mark_in(&dir.0, "go", Duration::from_secs(20)).expect("never started");
            std::thread::sleep(Duration::from_millis(200));
            kids[1].kill().unwrap();
            let codes: Vec<_> = kids
                .iter_mut()
                .map(|k| wait_child(k, Duration::from_secs(15)).map(|s| s.code()))
                .collect();
            match wait_mark_in(&dir.0, "survived", Duration::ZERO).as_deref() {
                Some("false") => prompt += 1,
                Some(_) => wedged += 1,
                None => hung += 1,
            }
            println!("round {round}: {codes:?}");
        }
        println!(
            "{what}, 12 kills: {prompt} noticed promptly, {wedged} wedged (bounded), {hung} hung"
        );
        hung_total += hung;
    }
    assert_eq!(hung_total, 0, "a survivor's own call never returned");
}
