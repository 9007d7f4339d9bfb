//! Fault injection between two "hosts": ranks in two network namespaces joined by a veth pair
//! (bootstrap and data over libfabric's tcp provider), the link taken down while a stream of
//! puts runs. Down briefly: the stream completes. Down beyond `MSCCLPP_WAIT_TIMEOUT`: both ranks
//! fail within the timeout. Either way nothing the sender had flushed is lost, and after the
//! link is back the same two processes form a new communicator and exchange data. Needs root
//! (CI has it); elsewhere the tests print why they are skipped.

mod common;
mod fault_util;

use common::api::*;
use common::netns::Hosts;
use common::*;
use fault_util::*;
use mscclpp::abi::mscclppResult_t::*;
use mscclpp::capi::comm::*;
use mscclpp::capi::conn::*;
use mscclpp::capi::devconn::*;
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(50);
const SLOTS: usize = 8;
const SLOT: usize = 64 << 10;
const PIECES: usize = 4;
/// Rounds the sender still runs after the link is back (short outage).
const AFTER_UP: u64 = 300;
/// Set in a slot's first word on the sender's last round.
const LAST: u64 = 1 << 63;

fn slot_byte(round: u64, i: usize) -> u8 {
    pattern((round % 251) as usize, i) ^ (round >> 8) as u8
}

fn fill(slot: &mut [u8], round: u64, last: bool) {
    for (i, b) in slot.iter_mut().enumerate().skip(8) {
        *b = slot_byte(round, i);
    }
    slot[..8].copy_from_slice(&(round | if last { LAST } else { 0 }).to_le_bytes());
}

/// The round in a received slot (and whether it was the last), after checking its bytes.
fn check(slot: &[u8], round: u64) -> bool {
    let head = u64::from_le_bytes(slot[..8].try_into().unwrap());
    assert_eq!(head & !LAST, round, "slot header");
    for (i, &b) in slot.iter().enumerate().skip(8) {
        assert_eq!(b, slot_byte(round, i), "round {round} byte {i}");
    }
    head & LAST != 0
}

fn signals_arrived(d: &mscclpp::abi::mscclppDevConn) -> u64 {
    // SAFETY: the epoch block lives as long as the comm; the peer's proxy writes it.
    unsafe {
        std::sync::atomic::AtomicU64::from_ptr(std::ptr::addr_of_mut!(
            (*d.localSignalEpochId).proxy
        ))
    }
    .load(std::sync::atomic::Ordering::Acquire)
}

/// A rank. Rank 1 streams rounds (PIECES puts, a signal, a flush) into slot round % SLOTS,
/// at most SLOTS - 1 rounds ahead of rank 0's acknowledgements, and publishes the rounds it has
/// flushed; rank 0 checks every round and acknowledges it. Returns the first failure's code.
fn stream(wait_s: f64) -> Option<i32> {
    let (me, root) = (
        env_usize("MSCCLPP_TEST_RANK"),
        std::env::var("MSCCLPP_TEST_ROOT").unwrap(),
    );
    let c = init(&root, me, 2);
    let mut buf = vec![0u8; SLOTS * SLOT];
    ok(connect(c, 1 - me, 0, &mut buf));
    ok(mscclppConnectionSetup(c));
    ok(mscclppProxyLaunch(c));
    let d = &mut dev_conns(c)[0];
    let limit = Duration::from_secs_f64(wait_s) + Duration::from_secs(2);
    let mut longest = Duration::ZERO;
    let mut err = None;
    if me == 1 {
        let ctr = Counter::create(&dir().join("flushed"));
        let mut up_at: Option<u64> = None;
        for round in 0u64.. {
            if up_at.is_none() && wait_mark("up", Duration::ZERO).is_some() {
                up_at = Some(round);
            }
            let last = up_at.is_some_and(|u| round >= u + AFTER_UP);
            let t0 = Instant::now();
            let r = (|| {
                if round >= SLOTS as u64 - 1 {
                    let r = mscclppDevConnWait(d);
                    if r != mscclppSuccess {
                        return r;
                    }
                }
                let s = round as usize % SLOTS;
                fill(&mut buf[s * SLOT..(s + 1) * SLOT], round, last);
                for p in 0..PIECES {
                    let o = (s * SLOT + p * SLOT / PIECES) as u64;
                    let r = mscclppDevConnPut(d, o, o, (SLOT / PIECES) as u64);
                    if r != mscclppSuccess {
                        return r;
                    }
                }
                let r = mscclppDevConnSignal(d);
                if r != mscclppSuccess {
                    return r;
                }
                mscclppDevConnFlush(d)
            })();
            let el = t0.elapsed();
            longest = longest.max(el);
            assert!(el < limit, "one round took {el:?}");
            if r != mscclppSuccess {
                err = Some(r as i32);
                break;
            }
            ctr.set(round + 1);
            if last {
                break;
            }
        }
    } else {
        for round in 0u64.. {
            let t0 = Instant::now();
            let r = mscclppDevConnWait(d);
            let el = t0.elapsed();
            longest = longest.max(el);
            assert!(el < limit, "one wait took {el:?}");
            if r != mscclppSuccess {
                err = Some(r as i32);
                break;
            }
            let s = round as usize % SLOTS;
            let last = check(&buf[s * SLOT..(s + 1) * SLOT], round);
            if round == 100 {
                mark("receiving", "");
            }
            if last {
                break;
            }
            let r = mscclppDevConnSignal(d);
            if r != mscclppSuccess {
                err = Some(r as i32);
                break;
            }
        }
        mark("arrived", &signals_arrived(d).to_string());
    }
    println!(
        "rank {me}: stream ended with {err:?} {}; longest call {longest:?}",
        if err.is_some() {
            last_error()
        } else {
            String::new()
        }
    );
    if err.is_none() {
        ok(mscclppBootstrapBarrier(c));
        ok(mscclppProxyStop(c));
    } else {
        let _ = mscclppProxyStop(c);
    }
    ok(mscclppCommDestroy(c));
    err
}

/// After the stream, both ranks (once the link is back) form a new communicator.
fn regroup() {
    let me = env_usize("MSCCLPP_TEST_RANK");
    mark(&format!("r{me}_done"), "");
    wait_mark(&format!("r{}_done", 1 - me), Duration::from_secs(30)).expect("peer not done");
    wait_mark("up", Duration::from_secs(30)).expect("link never restored");
    exchange_rank("10.98.0.1:29611", me, 9);
    println!("rank {me}: new communicator over the restored link works");
}

/// Runs the stream in two namespaces; takes host 0's link down once 100 rounds went through,
/// for `outage` (None: until both ranks have failed), then up again.
fn outage_test(name: &str, tag: char, wait_s: f64, outage: Option<Duration>) {
    if is_rank(name) {
        let err = stream(wait_s);
        match outage {
            Some(_) => assert_eq!(err, None, "a short outage must not fail the stream"),
            None => assert!(err.is_some(), "the link was down beyond the timeout"),
        }
        regroup();
        return;
    }
    let hosts = match Hosts::create(&format!("f{tag}"), "10.98.0") {
        Ok(h) => h,
        Err(e) => {
            println!("SKIPPED {name}: cannot create network namespaces here ({e})");
            return;
        }
    };
    let dir = Dir::new(name);
    let mut env = rank_env("tcp", 10.0, wait_s);
    env.push(dir.env());
    let ranks = spawn_wrapped(name, 2, "10.98.0.1:29610", &env, |r| {
        vec![
            "ip".into(),
            "netns".into(),
            "exec".into(),
            hosts.ns[r].clone(),
            "env".into(),
            format!("MSCCLPP_NET_IFACE={}", hosts.dev[r]),
            format!("MSCCLPP_SOCKET_IFNAME={}", hosts.dev[r]),
        ]
    });
    if wait_mark_in(&dir.0, "receiving", Duration::from_secs(30)).is_none() {
        let codes = ranks.wait(Duration::ZERO);
        panic!("the stream never started: {codes:?}");
    }
    hosts.link(false);
    let down = Instant::now();
    match outage {
        Some(d) => std::thread::sleep(d),
        None => {
            for r in 0..2 {
                let bound = Duration::from_secs_f64(wait_s * 2.0) + Duration::from_secs(10);
                wait_mark_in(&dir.0, &format!("r{r}_done"), bound);
            }
        }
    }
    hosts.link(true);
    println!("link was down for {:?}", down.elapsed());
    mark_in(&dir.0, "up", "");
    let codes = ranks.wait(DEADLINE);
    let flushed = read_counter(&dir.0.join("flushed"));
    let arrived: u64 =
        wait_mark_in(&dir.0, "arrived", Duration::ZERO).map_or(0, |s| s.parse().unwrap());
    println!("rank 1 flushed {flushed} rounds; {arrived} signals arrived at rank 0");
    assert_eq!(codes, vec![Some(0), Some(0)]);
    assert!(arrived >= flushed, "flushed rounds were lost");
    drop(hosts);
}

#[test]
fn link_down_briefly_during_stream_tcp() {
    outage_test(
        "link_down_briefly_during_stream_tcp",
        's',
        10.0,
        Some(Duration::from_secs(1)),
    );
}

#[test]
fn link_down_beyond_timeout_during_stream_tcp() {
    outage_test("link_down_beyond_timeout_during_stream_tcp", 'l', 3.0, None);
}
