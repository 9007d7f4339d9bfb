//! The network transport's staging protocol (GPU memory without FI_HMEM), run over host memory
//! with `MSCCLPP_TEST_FORCE_STAGING=1`: every put goes sender buffer -> bounce slot -> the
//! receiver's staging ring -> (the receiver's proxy) its buffer, every signal is a record the
//! receiver's proxy stores after those copies. Ranks are processes; tcp and shm; small rings
//! and inboxes so that wrapping and flow control run all the time.

mod common;

use common::api::*;
use common::*;
use mscclpp::abi::mscclppResult_t::*;
use mscclpp::abi::mscclppTransport_t;
use mscclpp::capi::buffer::*;
use mscclpp::capi::comm::*;
use mscclpp::capi::conn::*;
use mscclpp::capi::devconn::*;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(120);

/// Staging forced, a 64 KiB ring (16 KiB chunks) and 8 inbox slots.
fn staging_env(provider: &str) -> Vec<(&'static str, String)> {
    let mut v = vec![
        ("MSCCLPP_TEST_TRANSPORT", provider.to_string()),
        ("MSCCLPP_TEST_FORCE_STAGING", "1".into()),
        ("MSCCLPP_NET_STAGING_BYTES", "65536".into()),
        ("MSCCLPP_NET_STAGING_SLOTS", "8".into()),
        ("MSCCLPP_WAIT_TIMEOUT", "30".into()),
        ("MSCCLPP_BOOTSTRAP_TIMEOUT", "30".into()),
        ("MSCCLPP_DEBUG", "INFO".into()),
    ];
    if provider != "shm" {
        v.push(("MSCCLPP_NET_PROVIDER", provider.to_string()));
    }
    v
}

fn ranks_with(name: &str, n: usize, env_vars: &[(&'static str, String)], body: fn(Env)) {
    if is_rank(name) {
        capture_logs();
        body(env());
        return;
    }
    spawn(name, n, env_vars).expect_success(DEADLINE);
}

fn ranks(name: &str, n: usize, provider: &str, body: fn(Env)) {
    if skip_missing_provider(name, provider) {
        return;
    }
    ranks_with(name, n, &staging_env(provider), body);
}

// ---- log capture: proof that the staging path (not the direct one) ran -------------------

fn assert_staged() {
    let logs = logged();
    assert!(
        logs.iter()
            .any(|l| l.contains("host memory, staged (MSCCLPP_TEST_FORCE_STAGING=1)")),
        "no region was staged; log:\n{}",
        logs.join("\n")
    );
}

// ---- many puts with gaps, one signal; rounds; a put larger than the ring -------------------

const PIECES: usize = 48;
const PIECE: usize = 3000;
/// Pieces start every STRIDE bytes: the STRIDE - PIECE bytes between them are never written.
const STRIDE: usize = 4096;
/// After the pieces: one put four times the ring (chunked, wraps the ring repeatedly).
const BIG: usize = 256 * 1024 + 40;
const BIG_AT: usize = PIECES * STRIDE;
const SENTINEL: u8 = 0xEE;
const ROUNDS: usize = 4;

fn fill(buf: &mut [u8], round: usize) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern(round + 1, i);
    }
}

/// Rank 0 sends; rank 1 keeps SENTINEL in its gaps and checks every byte after each wait,
/// then signals back so that the next round cannot overwrite what it is checking.
fn gaps_and_rounds(e: Env) {
    let mut buf = vec![SENTINEL; BIG_AT + BIG];
    let c = connected_pair(&e, 3, &mut buf);
    let d = &mut dev_conns(c)[0];
    for round in 0..ROUNDS {
        if e.rank == 0 {
            fill(&mut buf, round);
            // Out of address order: nothing may depend on puts arriving in address order.
            for k in (0..PIECES).rev() {
                let o = (k * STRIDE) as u64;
                put(d, o, o, PIECE as u64);
            }
            put(d, BIG_AT as u64, BIG_AT as u64, BIG as u64);
            signal(d);
            // The receiver's answer: it has checked this round.
            wait(d);
        } else {
            wait(d);
            for k in 0..PIECES {
                for j in 0..STRIDE {
                    let i = k * STRIDE + j;
                    let want = if j < PIECE {
                        pattern(round + 1, i)
                    } else {
                        SENTINEL
                    };
                    assert_eq!(buf[i], want, "round {round} byte {i} (piece {k}, +{j})");
                }
            }
            for (i, b) in buf.iter().enumerate().skip(BIG_AT) {
                assert_eq!(*b, pattern(round + 1, i), "round {round} big byte {i}");
            }
            signal(d);
            flush(d);
        }
    }
    flush(d);
    ok(mscclppBootstrapBarrier(c));
    assert_eq!(async_error(c), mscclppSuccess);
    ok(mscclppProxyStop(c));
    ok(mscclppCommDestroy(c));
    assert_staged();
}

#[test]
fn gaps_and_rounds_tcp() {
    ranks("gaps_and_rounds_tcp", 2, "tcp", gaps_and_rounds);
}
#[test]
fn gaps_and_rounds_shm() {
    ranks("gaps_and_rounds_shm", 2, "shm", gaps_and_rounds);
}

/// Under the unordered test layer (`MSCCLPP_TEST_UNORDERED`): every record, value and
/// acknowledgement ordered as the profile demands; its log line proves the layer ran.
fn gaps_and_rounds_unordered(e: Env) {
    gaps_and_rounds(e);
    let logs = logged();
    assert!(
        logs.iter().any(|l| l.contains("unordered test layer")),
        "the unordered test layer did not run; log:\n{}",
        logs.join("\n")
    );
}

fn ranks_unordered(name: &str, provider: &str, profile: &str) {
    let mut env = staging_env(provider);
    env.push(("MSCCLPP_TEST_UNORDERED", profile.to_string()));
    ranks_with(name, 2, &env, gaps_and_rounds_unordered);
}

#[test]
fn gaps_and_rounds_unordered_efa_tcp() {
    ranks_unordered("gaps_and_rounds_unordered_efa_tcp", "tcp", "efa");
}
#[test]
fn gaps_and_rounds_unordered_psm3_shm() {
    ranks_unordered("gaps_and_rounds_unordered_psm3_shm", "shm", "psm3");
}
#[test]
fn gaps_and_rounds_unordered_efa_shm() {
    ranks_unordered("gaps_and_rounds_unordered_efa_shm", "shm", "efa");
}

// ---- putWithSignal ping-pong -----------------------------------------------------------------

const PP_ROUNDS: u64 = 3000;

fn pingpong(e: Env) {
    common::api::pingpong(&e, PP_ROUNDS);
    assert_staged();
}

#[test]
fn pingpong_tcp() {
    ranks("pingpong_tcp", 2, "tcp", pingpong);
}
#[test]
fn pingpong_shm() {
    ranks("pingpong_shm", 2, "shm", pingpong);
}

// ---- one side staged, the other direct --------------------------------------------------------

/// Only rank 1 stages (its sources through bounce slots, its destination through its ring);
/// rank 0 writes into rank 1's ring and receives directly. Both directions, checked.
fn asymmetric(e: Env) {
    if e.rank == 0 {
        std::env::remove_var("MSCCLPP_TEST_FORCE_STAGING");
    }
    let c = init(&e.root, e.rank, e.n);
    const N: usize = 200_000;
    let mut buf = vec![0u8; 2 * N];
    let peer = 1 - e.rank;
    let mine = e.rank * N;
    for i in 0..N {
        buf[mine + i] = pattern(e.rank, i);
    }
    ok(connect(c, peer, 0, &mut buf));
    ok(mscclppConnectionSetup(c));
    ok(mscclppProxyLaunch(c));
    let d = &mut dev_conns(c)[0];
    put_signal(d, mine as u64, mine as u64, N as u64);
    flush(d);
    wait(d);
    let theirs = peer * N;
    for i in 0..N {
        assert_eq!(
            buf[theirs + i],
            pattern(peer, i),
            "rank {} byte {i}",
            e.rank
        );
    }
    finish(c);
    if e.rank == 1 {
        assert_staged();
    }
}

#[test]
fn asymmetric_tcp() {
    ranks("asymmetric_tcp", 2, "tcp", asymmetric);
}
#[test]
fn asymmetric_shm() {
    ranks("asymmetric_shm", 2, "shm", asymmetric);
}

// ---- refusals ----------------------------------------------------------------------------------

/// A put beyond the receiver's buffer is refused by the sender's proxy before anything is
/// staged: nothing arrives, the error is sticky. It aborts the communicator, and the receiver
/// learns that as it learns of a lost peer.
fn out_of_range(e: Env) {
    let mut buf = vec![0u8; 4096];
    let c = connected_pair(&e, 0, &mut buf);
    let d = &mut dev_conns(c)[0];
    if e.rank == 0 {
        buf.fill(0xAB);
        // In range first: it must arrive.
        put_signal(d, 0, 0, 100);
        flush(d);
        ok(mscclppDevConnPut(d, 4000, 0, 200));
        assert_eq!(mscclppDevConnFlush(d), mscclppRemoteError);
        assert_eq!(async_error(c), mscclppInvalidArgument);
        assert_eq!(mscclppProxyStop(c), mscclppRemoteError);
    } else {
        wait(d);
        await_async_error(c, "the sender's abort");
        assert!(
            buf[..100].iter().all(|&b| b == 0xAB),
            "the good put arrived"
        );
        assert!(
            buf[100..].iter().all(|&b| b == 0),
            "a refused put must not write a byte"
        );
        assert_eq!(mscclppProxyStop(c), mscclppRemoteError);
    }
    ok(mscclppCommDestroy(c));
}

#[test]
fn out_of_range_is_refused_tcp() {
    ranks("out_of_range_is_refused_tcp", 2, "tcp", out_of_range);
}

// ---- registered buffers -------------------------------------------------------------------------

/// mscclppRegisteredBufferWrite into staged registrations: when it returns, the bytes are in
/// every peer's buffer (flush waits for the peers' acknowledgements, sent after their copies).
fn registered(e: Env) {
    let c = init(&e.root, e.rank, e.n);
    let mut conn_buf = vec![0u8; 64];
    for p in (0..e.n).filter(|&p| p != e.rank) {
        ok(connect(c, p, 9, &mut conn_buf));
    }
    ok(mscclppConnectionSetup(c));
    ok(mscclppProxyLaunch(c));
    const CH: usize = 100_000;
    let mut target = vec![SENTINEL; e.n * CH];
    let mut reg = register(c, &mut target);
    let mut src: Vec<u8> = (0..CH + 7).map(|i| pattern(e.rank, i)).collect();
    ok(mscclppRegisteredBufferWrite(
        c,
        &mut reg,
        src.as_mut_ptr().cast(),
        CH,
        7,
        (e.rank * CH) as u32,
        0,
    ));
    ok(mscclppBootstrapBarrier(c));
    for p in 0..e.n {
        for i in 0..CH {
            let want = if p == e.rank {
                SENTINEL
            } else {
                pattern(p, i + 7)
            };
            assert_eq!(target[p * CH + i], want, "from rank {p} byte {i}");
        }
    }
    finish(c);
    assert_staged();
}

#[test]
fn registered_write_tcp_3() {
    ranks("registered_write_tcp_3", 3, "tcp", registered);
}

// ---- mixed transports in one communicator -----------------------------------------------------

/// Three ranks; the pair (a, b) uses SHM if a + b is even, IB (tcp) otherwise, so every rank
/// has endpoints of both kinds, each with its own proxy and staging channels. All-to-all.
fn mixed(e: Env) {
    let c = init(&e.root, e.rank, e.n);
    const CH: usize = 70_001;
    let mut buf = vec![0u8; e.n * CH];
    for i in 0..CH {
        buf[e.rank * CH + i] = pattern(e.rank, i);
    }
    for p in (0..e.n).filter(|&p| p != e.rank) {
        let t = if (p + e.rank) % 2 == 0 {
            mscclppTransport_t::mscclppTransportSHM
        } else {
            mscclppTransport_t::mscclppTransportIB
        };
        ok(mscclppConnect(
            c,
            p as i32,
            0,
            buf.as_mut_ptr().cast(),
            buf.len() as u64,
            t as i32,
            std::ptr::null(),
        ));
    }
    ok(mscclppConnectionSetup(c));
    ok(mscclppProxyLaunch(c));
    alltoall_and_finish(c, &buf, e.rank, e.n, CH);
    assert_staged();
}

#[test]
fn mixed_shm_and_tcp_3() {
    ranks("mixed_shm_and_tcp_3", 3, "tcp", mixed);
}
