//! A call that failed changes nothing: every host call that can time out does so here
//! (`MSCCLPP_WAIT_TIMEOUT=1`, against a proxy or a peer that is not there yet), and then the
//! retry works: no FIFO ticket is left unwritten, no signal is consumed, no put is sent
//! twice. 2 ranks as processes, over tcp and shm; every byte checked.

mod common;
mod fault_util;

use common::api::*;
use common::*;
use fault_util::*;
use mscclpp::abi::mscclppResult_t::{self, *};
use mscclpp::capi::buffer::*;
use mscclpp::capi::comm::*;
use mscclpp::capi::conn::*;
use mscclpp::capi::devconn::*;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(90);
/// The wait timeout of every rank here, in seconds: what times out does so after a second.
const WAIT_S: f64 = 1.0;
/// The bootstrap timeout: long enough for a rank that waits in a barrier while its peer runs
/// into several wait timeouts in a row on a loaded host.
const BOOT_S: f64 = 40.0;

/// Runs `body` as both ranks of test `name` (in children), or starts them (in the parent).
fn ranks(name: &str, provider: &str, body: fn(Env)) {
    if is_rank(name) {
        body(env());
        return;
    }
    spawn(name, 2, &rank_env(provider, BOOT_S, WAIT_S)).expect_success(DEADLINE);
}

/// Asserts that `r` is a host call's timeout (mscclppRemoteError, "timed out" in its text).
#[track_caller]
fn timed_out(r: mscclppResult_t, what: &str) {
    let text = last_error();
    assert_eq!(r, mscclppRemoteError, "{what}: {text}");
    assert!(text.contains("timed out"), "{what}: {text}");
}

/// The FIFO's slots: the 129th host push before the proxy runs finds no room.
const SLOTS: usize = mscclpp::abi::MSCCLPP_PROXY_FIFO_SIZE as usize;
const PIECE: usize = 1024;

/// Rank 0, its proxy not launched yet, fills the FIFO with 128 puts of distinct pieces; then
/// a put, a signal, a putWithSignal, a putWithSignalAndFlush and a flush each time out waiting
/// for room. Once the proxy is launched a flush succeeds (before the fix the proxy stopped at
/// the unwritten slot of the first of them, and every flush timed out), and one signal
/// follows. Rank 1 gets every byte of the 128 puts, none of the timed-out ones, and exactly
/// one signal.
fn push_timeout(e: Env) {
    let mut buf = vec![0u8; (SLOTS + 3) * PIECE];
    let c = init(&e.root, e.rank, e.n);
    ok(connect(c, 1 - e.rank, 0, &mut buf));
    ok(mscclppConnectionSetup(c));
    let d = &mut dev_conns(c)[0];
    let off = |k: usize| (k * PIECE) as u64;
    if e.rank == 0 {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = pattern(3, i);
        }
        for k in 0..SLOTS {
            put(d, off(k), off(k), PIECE as u64);
        }
        timed_out(
            mscclppDevConnPut(d, off(SLOTS), off(SLOTS), PIECE as u64),
            "put 129",
        );
        timed_out(mscclppDevConnSignal(d), "signal into a full FIFO");
        timed_out(
            mscclppDevConnPutWithSignal(d, off(SLOTS + 1), off(SLOTS + 1), PIECE as u64),
            "putWithSignal into a full FIFO",
        );
        timed_out(
            mscclppDevConnPutWithSignalAndFlush(d, off(SLOTS + 2), off(SLOTS + 2), PIECE as u64),
            "putWithSignalAndFlush into a full FIFO",
        );
        timed_out(mscclppDevConnFlush(d), "flush into a full FIFO");
        ok(mscclppProxyLaunch(c));
        flush(d);
        signal(d);
        flush(d);
        ok(mscclppBootstrapBarrier(c));
    } else {
        // Our proxy progresses the endpoint the peer's puts arrive through.
        ok(mscclppProxyLaunch(c));
        ok(mscclppBootstrapBarrier(c));
        wait(d);
        for (i, b) in buf.iter().enumerate() {
            let want = if i < SLOTS * PIECE { pattern(3, i) } else { 0 };
            assert_eq!(*b, want, "byte {i} (piece {})", i / PIECE);
        }
        timed_out(
            mscclppDevConnWait(d),
            "a second wait: the timed-out signals must never be sent",
        );
    }
    finish(c);
}

#[test]
fn push_timeout_leaves_no_hole_tcp() {
    ranks("push_timeout_leaves_no_hole_tcp", "tcp", push_timeout);
}
#[test]
fn push_timeout_leaves_no_hole_shm() {
    ranks("push_timeout_leaves_no_hole_shm", "shm", push_timeout);
}

/// Rank 1's wait times out before rank 0 signals; then rank 0 signals once. Rank 1's second
/// wait returns that signal (before the fix the timed-out wait had consumed it, and this one
/// timed out too), and a third times out: exactly one signal.
fn wait_timeout(e: Env) {
    let mut buf = vec![0u8; 64];
    let c = connected_pair(&e, 1, &mut buf);
    let d = &mut dev_conns(c)[0];
    if e.rank == 1 {
        timed_out(mscclppDevConnWait(d), "wait before the peer signals");
        ok(mscclppBootstrapBarrier(c));
        wait(d);
        assert_eq!(&buf[..8], &0x5eed_0123_4567_89abu64.to_le_bytes());
        timed_out(
            mscclppDevConnWait(d),
            "a third wait: the peer signalled once",
        );
    } else {
        ok(mscclppBootstrapBarrier(c));
        buf[..8].copy_from_slice(&0x5eed_0123_4567_89abu64.to_le_bytes());
        put_signal(d, 0, 0, 8);
        flush(d);
    }
    finish(c);
}

#[test]
fn wait_timeout_consumes_no_signal_tcp() {
    ranks("wait_timeout_consumes_no_signal_tcp", "tcp", wait_timeout);
}
#[test]
fn wait_timeout_consumes_no_signal_shm() {
    ranks("wait_timeout_consumes_no_signal_shm", "shm", wait_timeout);
}

/// Rank 0 puts with its proxy not launched: the flush pushes its Sync and times out waiting
/// for its retirement. After the launch the retried flush succeeds and every byte arrived.
fn flush_timeout(e: Env) {
    const N: usize = 64 << 10;
    let mut buf = vec![0u8; N];
    let c = init(&e.root, e.rank, e.n);
    ok(connect(c, 1 - e.rank, 2, &mut buf));
    ok(mscclppConnectionSetup(c));
    let d = &mut dev_conns(c)[0];
    if e.rank == 0 {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = pattern(5, i);
        }
        put(d, 0, 0, N as u64);
        timed_out(mscclppDevConnFlush(d), "flush with no proxy running");
        ok(mscclppProxyLaunch(c));
        flush(d);
        ok(mscclppBootstrapBarrier(c));
    } else {
        ok(mscclppProxyLaunch(c));
        ok(mscclppBootstrapBarrier(c));
        for (i, b) in buf.iter().enumerate() {
            assert_eq!(*b, pattern(5, i), "byte {i}");
        }
    }
    finish(c);
}

#[test]
fn flush_timeout_then_retry_tcp() {
    ranks("flush_timeout_then_retry_tcp", "tcp", flush_timeout);
}
#[test]
fn flush_timeout_then_retry_shm() {
    ranks("flush_timeout_then_retry_shm", "shm", flush_timeout);
}

/// Rank 0's putWithSignalAndFlush, its proxy not launched, pushes its trigger and times out
/// waiting for it: the trigger is taken back, so nothing of it is ever sent. After the launch
/// the retry succeeds; rank 1 receives the bytes and exactly one signal (before the fix the
/// first trigger stayed queued and was executed too: two signals). `n` bytes: with 0, a signal
/// and a flush in one trigger, as on the device (before, a signal then a flush, whose timeout
/// left the signal queued).
fn signal_and_flush_timeout(e: Env, n: usize) {
    let mut buf = vec![0u8; n.max(64)];
    let c = init(&e.root, e.rank, e.n);
    ok(connect(c, 1 - e.rank, 3, &mut buf));
    ok(mscclppConnectionSetup(c));
    let d = &mut dev_conns(c)[0];
    if e.rank == 0 {
        for (i, b) in buf.iter_mut().enumerate().take(n) {
            *b = pattern(6, i);
        }
        timed_out(
            mscclppDevConnPutWithSignalAndFlush(d, 0, 0, n as u64),
            "putWithSignalAndFlush with no proxy running",
        );
        assert!(
            last_error().contains("nothing of it was sent"),
            "{}",
            last_error()
        );
        ok(mscclppProxyLaunch(c));
        ok(mscclppDevConnPutWithSignalAndFlush(d, 0, 0, n as u64));
        ok(mscclppBootstrapBarrier(c));
    } else {
        ok(mscclppProxyLaunch(c));
        ok(mscclppBootstrapBarrier(c));
        wait(d);
        for (i, b) in buf.iter().enumerate().take(n) {
            assert_eq!(*b, pattern(6, i), "byte {i}");
        }
        timed_out(
            mscclppDevConnWait(d),
            "a second wait: the timed-out putWithSignalAndFlush must not have been sent",
        );
    }
    finish(c);
}

fn put_with_signal_and_flush_timeout(e: Env) {
    signal_and_flush_timeout(e, 4096);
}

fn zero_byte_signal_and_flush_timeout(e: Env) {
    signal_and_flush_timeout(e, 0);
}

#[test]
fn put_with_signal_and_flush_timeout_then_retry_tcp() {
    ranks(
        "put_with_signal_and_flush_timeout_then_retry_tcp",
        "tcp",
        put_with_signal_and_flush_timeout,
    );
}
#[test]
fn put_with_signal_and_flush_timeout_then_retry_shm() {
    ranks(
        "put_with_signal_and_flush_timeout_then_retry_shm",
        "shm",
        put_with_signal_and_flush_timeout,
    );
}

#[test]
fn zero_byte_signal_and_flush_timeout_then_retry_tcp() {
    ranks(
        "zero_byte_signal_and_flush_timeout_then_retry_tcp",
        "tcp",
        zero_byte_signal_and_flush_timeout,
    );
}

/// tcp: rank 1 sets up and registers, but launches its proxy only after rank 0's
/// mscclppRegisteredBufferWrite timed out (tcp;ofi_rxm completes a write only with the
/// target's progress). The retry then succeeds and rank 1 has every byte.
fn registered_write_timeout(e: Env) {
    const N: usize = 8192;
    let mut conn_buf = vec![0u8; 64];
    let c = init(&e.root, e.rank, e.n);
    ok(connect(c, 1 - e.rank, 4, &mut conn_buf));
    ok(mscclppConnectionSetup(c));
    let mut target = vec![0u8; N];
    let mut reg = register(c, &mut target);
    if e.rank == 0 {
        ok(mscclppProxyLaunch(c));
        let mut src: Vec<u8> = (0..N).map(|i| pattern(8, i)).collect();
        let write = |reg: &mut _, src: &mut Vec<u8>| {
            mscclppRegisteredBufferWrite(c, reg, src.as_mut_ptr().cast(), N, 0, 0, 0)
        };
        timed_out(
            write(&mut reg, &mut src),
            "a write to a peer whose proxy is not running",
        );
        ok(mscclppBootstrapBarrier(c));
        ok(mscclppBootstrapBarrier(c));
        ok(write(&mut reg, &mut src));
        ok(mscclppBootstrapBarrier(c));
    } else {
        ok(mscclppBootstrapBarrier(c));
        ok(mscclppProxyLaunch(c));
        ok(mscclppBootstrapBarrier(c));
        ok(mscclppBootstrapBarrier(c));
        for (i, b) in target.iter().enumerate() {
            assert_eq!(*b, pattern(8, i), "byte {i}");
        }
    }
    finish(c);
}

#[test]
fn registered_write_timeout_then_retry_tcp() {
    ranks(
        "registered_write_timeout_then_retry_tcp",
        "tcp",
        registered_write_timeout,
    );
}
