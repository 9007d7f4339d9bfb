//! Put bandwidth and signal latency through the C API over host memory (two local processes).
//!
//! `cargo run --release --example put_bench -- [--provider tcp|net|shm] [--max-mib 64]
//!  [--min-kib 4] [--volume-mib 256]` (sizes and volume per size as in raw_rma)
//!
//! Bandwidth: rank 0 issues `iters` back-to-back `put`s of one size, then `signal` + `flush`;
//! rank 1 `wait`s. Time from the first put to the flush's return, bytes / time; the same
//! schedule as the raw baseline (crates/libfabric-sys/examples/raw_rma.rs).
//! Latency: 8-byte `putWithSignal` ping-pong, half the round trip, median of many rounds.

use mscclpp::capi::comm::*;
use mscclpp::capi::conn::*;
use mscclpp::capi::devconn::*;
use std::time::Instant;

mod common;
use common::{arg, connect_pair, ok, rank_env, spawn_ranks, transport};

fn main() {
    let provider = arg("--provider", "tcp");
    let max_mib: usize = arg("--max-mib", "64").parse().unwrap();
    let min_kib: usize = arg("--min-kib", "4").parse().unwrap();
    let volume_mib: usize = arg("--volume-mib", "256").parse().unwrap();
    let Some((rank, root)) = rank_env("PUT_BENCH") else {
        // Parent: start the ranks and wait.
        let all_ok = spawn_ranks(2, "PUT_BENCH", &provider);
        std::process::exit(!all_ok as i32);
    };
    let max = max_mib << 20;
    let mut buf = vec![1u8; max + 4096];
    let tr = transport(&provider);
    let (comm, d) = connect_pair(rank, &root, &mut buf, tr);

    // Latency: ping-pong of signal() (one 8-byte write, as the raw baseline's), then of
    // 8-byte putWithSignal (data write + signal).
    let rounds = 2000;
    for with_data in [false, true] {
        let mut samples = Vec::with_capacity(rounds);
        ok(mscclppBootstrapBarrier(comm), "barrier");
        let send = || {
            if with_data {
                ok(mscclppDevConnPutWithSignal(d, 0, 0, 8), "put");
            } else {
                ok(mscclppDevConnSignal(d), "signal");
            }
        };
        for i in 0..rounds + 100 {
            let t = Instant::now();
            if rank == 0 {
                send();
                ok(mscclppDevConnWait(d), "wait");
            } else {
                ok(mscclppDevConnWait(d), "wait");
                send();
            }
            if i >= 100 {
                samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        }
        ok(mscclppDevConnFlush(d), "flush");
        samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
        if rank == 0 {
            let what = if with_data {
                "8-byte putWithSignal"
            } else {
                "signal (8-byte flag write)"
            };
            println!("provider {provider}: {what} half round trip: median {:.2} us, p10 {:.2} us, p90 {:.2} us", samples[rounds / 2], samples[rounds / 10], samples[rounds * 9 / 10]);
        }
    }
    if rank == 0 {
        println!("{:>10} {:>12} {:>10}", "bytes", "GB/s", "iters");
    }
    // Bandwidth sweep, with raw_rma's schedule so the two compare: per size an untimed pass
    // of up to 8 puts, then (volume / size) puts clamped to 8..4000, alternating between two
    // destination ranges where the buffer holds two.
    let mut size = min_kib << 10;
    while size <= max {
        let iters = ((volume_mib << 20) / size).clamp(8, 4000);
        for timed in [false, true] {
            let n = if timed { iters } else { iters.min(8) };
            ok(mscclppBootstrapBarrier(comm), "barrier");
            if rank == 0 {
                let t = Instant::now();
                for k in 0..n {
                    let off = if size * 2 <= max { (k % 2) * size } else { 0 } as u64;
                    ok(mscclppDevConnPut(d, off, off, size as u64), "put");
                }
                ok(mscclppDevConnSignal(d), "signal");
                ok(mscclppDevConnFlush(d), "flush");
                let s = t.elapsed().as_secs_f64();
                if timed {
                    println!(
                        "{:>10} {:>12.3} {:>10}",
                        size,
                        (size * n) as f64 / s / 1e9,
                        n
                    );
                }
            } else {
                ok(mscclppDevConnWait(d), "wait");
            }
        }
        size *= 4;
    }
    ok(mscclppBootstrapBarrier(comm), "barrier");
    ok(mscclppProxyStop(comm), "stop");
    ok(mscclppCommDestroy(comm), "destroy");
}
