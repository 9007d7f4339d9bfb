//! Soak: N local ranks (processes) exchange data through the C API for a bounded time, mixing
//! sizes, offsets and patterns, and verify a checksum of every transfer; each rank's resident
//! memory is sampled after warm-up and at the end and must stay flat.
//!
//! `cargo run --release --example soak -- [--provider tcp|net|shm] [--ranks 4] [--seconds 60]`
//!
//! Every round, each rank puts one chunk to every peer with `putWithSignal` (size, offset and
//! content drawn from a generator seeded by (round, sender, receiver), so the receiver knows
//! what must arrive), flushes, waits for every peer and verifies what arrived. Rounds alternate
//! between two halves of the buffer: a peer can be at most one round ahead, so it never writes
//! the half being verified. Chunks leave from a separate send area, one slot per peer, which
//! is reused only after the flush. Prints operations, bytes, errors and RSS; exit 1 on any
//! error.

use mscclpp::abi::*;
use mscclpp::capi::comm::*;
use mscclpp::capi::conn::*;
use mscclpp::capi::devconn::*;
use std::time::{Duration, Instant};

mod common;
use common::{arg, connect_to, ok, rank_env, spawn_ranks, transport};

/// Each sender owns a region of SLOT bytes in each half of every receiver's buffer.
const SLOT: usize = 256 * 1024;
/// RSS may grow by at most this much between warm-up and the end.
const RSS_SLACK_KIB: u64 = 8 * 1024;

/// splitmix64: a tiny, good-enough generator that every rank evaluates identically.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// (offset inside the slot, size, seed) of what `from` sends `to` in `round`.
fn plan(round: u64, from: usize, to: usize) -> (usize, usize, u64) {
    let h = mix(round << 16 | (from as u64) << 8 | to as u64);
    // Sizes from 1 byte to the whole slot, skewed towards small ones.
    let size = match h % 4 {
        0 => 1 + (h >> 8) as usize % 64,
        1 => 1 + (h >> 8) as usize % 4096,
        2 => 1 + (h >> 8) as usize % 65536,
        _ => 1 + (h >> 8) as usize % SLOT,
    };
    let off = (h >> 40) as usize % (SLOT - size + 1);
    (off, size, h)
}

fn fill(buf: &mut [u8], seed: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (mix(seed ^ (i as u64 >> 3)) >> ((i & 7) * 8)) as u8;
    }
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn main() {
    let provider = arg("--provider", "tcp");
    let n: usize = arg("--ranks", "4").parse().unwrap();
    let seconds: f64 = arg("--seconds", "60").parse().unwrap();
    let Some((rank, root)) = rank_env("SOAK") else {
        // Parent: start the ranks and wait.
        let all_ok = spawn_ranks(n, "SOAK", &provider);
        println!(
            "soak {provider} {n} ranks {seconds}s: {}",
            if all_ok { "OK" } else { "FAILED" }
        );
        std::process::exit(!all_ok as i32);
    };
    let mut comm = std::ptr::null_mut();
    ok(
        mscclppCommInitRank(&mut comm, n as i32, root.as_ptr(), rank as i32),
        "init",
    );
    // Layout: [half 0 | half 1 | send area], each half has one SLOT per sender rank, the send
    // area one SLOT per destination.
    let half = n * SLOT;
    let send = 2 * half;
    let mut buf = vec![0u8; 2 * half + n * SLOT];
    let tr = transport(&provider);
    let peers: Vec<usize> = (0..n).filter(|&p| p != rank).collect();
    for &p in &peers {
        connect_to(comm, p, &mut buf, tr);
    }
    ok(mscclppConnectionSetup(comm), "setup");
    ok(mscclppProxyLaunch(comm), "proxy");
    let mut conns: *mut mscclppDevConn = std::ptr::null_mut();
    let mut nconns = 0;
    ok(
        mscclppGetAllDeviceConnections(comm, &mut conns, &mut nconns),
        "conns",
    );
    // SAFETY: the array lives until mscclppCommDestroy.
    let conns = unsafe { std::slice::from_raw_parts_mut(conns, nconns as usize) };

    let t0 = Instant::now();
    let (mut ops, mut bytes, mut errors) = (0u64, 0u64, 0u64);
    let mut rss_warm = 0;
    let mut round = 0u64;
    // Rank 0 decides when to stop and tells the others through an all-gather, so that every
    // rank runs the same number of rounds.
    loop {
        if round % 64 == 0 {
            let mut go = vec![0u8; n];
            go[rank] = (t0.elapsed() < Duration::from_secs_f64(seconds)) as u8;
            ok(
                mscclppBootstrapAllGather(comm, go.as_mut_ptr().cast(), 1),
                "allgather",
            );
            if go[0] == 0 {
                break;
            }
            if rss_warm == 0 && t0.elapsed() > Duration::from_secs_f64(seconds * 0.2) {
                rss_warm = rss_kib();
            }
        }
        let h = (round % 2) as usize * half;
        for (i, &p) in peers.iter().enumerate() {
            let (off, size, seed) = plan(round, rank, p);
            let (src, dst) = (send + p * SLOT + off, h + rank * SLOT + off);
            fill(&mut buf[src..src + size], seed);
            ok(
                mscclppDevConnPutWithSignal(&mut conns[i], dst as u64, src as u64, size as u64),
                "put",
            );
            ops += 1;
            bytes += size as u64;
        }
        for c in conns.iter_mut() {
            ok(mscclppDevConnFlush(c), "flush");
        }
        for (i, &p) in peers.iter().enumerate() {
            ok(mscclppDevConnWait(&mut conns[i]), "wait");
            let (off, size, seed) = plan(round, p, rank);
            let at = h + p * SLOT + off;
            let mut want = vec![0u8; size];
            fill(&mut want, seed);
            if buf[at..at + size] != want[..] {
                errors += 1;
                eprintln!(
                    "soak: rank {rank} round {round}: {size} bytes from rank {p} at {at} differ"
                );
            }
        }
        round += 1;
    }
    let rss_end = rss_kib();
    ok(mscclppBootstrapBarrier(comm), "barrier");
    ok(mscclppProxyStop(comm), "stop");
    ok(mscclppCommDestroy(comm), "destroy");
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "soak rank {rank}: {round} rounds, {ops} puts, {:.1} MiB sent, {errors} errors, {:.0} puts/s, RSS after warm-up {rss_warm} KiB, at end {rss_end} KiB",
        bytes as f64 / (1 << 20) as f64,
        ops as f64 / secs
    );
    let grew = rss_end.saturating_sub(rss_warm);
    if rss_warm == 0 || grew > RSS_SLACK_KIB {
        eprintln!(
            "soak: rank {rank}: RSS grew by {grew} KiB after warm-up (limit {RSS_SLACK_KIB} KiB)"
        );
        std::process::exit(1);
    }
    std::process::exit((errors > 0) as i32);
}
