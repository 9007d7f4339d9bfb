//! What a signal costs a stream of puts (issue 29): through the C API over host memory, two
//! local processes, per size the time of 64 puts then one `signal` and a `flush` ("unsignalled")
//! against 64 `putWithSignal`s then a `flush` ("signalled"), alternating, medians of `--reps`.
//! Also the 8-byte `signal` half round trip (ping-pong median). With `--peers N`, rank 0 streams
//! to N peers at once (N + 1 processes), each put and signal going to each peer in turn. With
//! `--wait-after`, the peers wait for the signals only once rank 0's flush has returned (behind
//! a barrier, outside the timing): what the stream costs without a consumer waking per signal.
//!
//! `cargo run --release --example signal_ratio -- [--provider tcp|net|shm] [--ib] [--reps 9]
//!  [--min-kib 16] [--max-mib 4] [--peers 1] [--wait-after] [--only signalled|unsignalled]
//!  [--max-kib N] [--print-reps]`
//!
//! `--provider shm` is mscclppTransportSHM; with `--ib` (and `MSCCLPP_NET_PROVIDER=shm` in the
//! environment) it is mscclppTransportIB over libfabric's shm provider.
//!
//! Prints per size: the two medians (GB/s: peers x 64 x size over the time from the first put to
//! the last flush's return) and the median of the runs' paired ratios (signalled /
//! unsignalled).

use mscclpp::abi::*;
use mscclpp::capi::comm::*;
use mscclpp::capi::conn::*;
use mscclpp::capi::devconn::*;
use std::time::Instant;

mod common;
use common::{arg, connect_peers, ok, rank_env, spawn_ranks, transport};

const PUTS: usize = 64;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let provider = arg("--provider", "tcp");
    let ib = std::env::args().any(|a| a == "--ib");
    let reps: usize = arg("--reps", "9").parse().unwrap();
    let min_kib: usize = arg("--min-kib", "16").parse().unwrap();
    let max_mib: usize = arg("--max-mib", "4").parse().unwrap();
    let npeers: usize = arg("--peers", "1").parse().unwrap();
    let wait_after = std::env::args().any(|a| a == "--wait-after");
    // Each rep's two GB/s figures, and which stream ran first (to see one stream's effect on
    // the next).
    let print_reps = std::env::args().any(|a| a == "--print-reps");
    // For profiling one stream at a time: `--only signalled` or `--only unsignalled`.
    let only = arg("--only", "both");
    assert!(
        ["both", "signalled", "unsignalled"].contains(&only.as_str()),
        "--only: both, signalled or unsignalled"
    );
    let Some((rank, root)) = rank_env("SIGNAL_RATIO") else {
        let all_ok = spawn_ranks(npeers + 1, "SIGNAL_RATIO", &provider);
        std::process::exit(!all_ok as i32);
    };
    // `--max-kib` (profiling one size) takes precedence over `--max-mib`.
    let max = arg("--max-kib", "0").parse::<usize>().unwrap() << 10;
    let max = if max > 0 { max } else { max_mib << 20 };
    let mut buf = vec![1u8; 2 * max + 4096];
    let tr = if ib {
        mscclppTransport_t::mscclppTransportIB
    } else {
        transport(&provider)
    };
    // Rank 0 connects to every other rank, each of them to rank 0 only.
    let peers: Vec<usize> = if rank == 0 {
        (1..=npeers).collect()
    } else {
        vec![0]
    };
    let (comm, conns) = connect_peers(rank, npeers + 1, &root, &peers, &mut buf, tr);
    // The ping-pong runs between ranks 0 and 1; other ranks only join the barriers.
    let d = conns[0];
    let pinging = rank <= 1;

    // The 8-byte signal half round trip.
    let rounds = 2000;
    let mut samples = Vec::with_capacity(rounds);
    ok(mscclppBootstrapBarrier(comm), "barrier");
    for i in 0..rounds + 100 {
        if !pinging {
            break;
        }
        let t = Instant::now();
        if rank == 0 {
            ok(mscclppDevConnSignal(d), "signal");
            ok(mscclppDevConnWait(d), "wait");
        } else {
            ok(mscclppDevConnWait(d), "wait");
            ok(mscclppDevConnSignal(d), "signal");
        }
        if i >= 100 {
            samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    ok(mscclppDevConnFlush(d), "flush");
    let mut label = if ib {
        format!("{provider} (IB transport)")
    } else {
        provider.clone()
    };
    if npeers > 1 {
        label += &format!(", {npeers} peers");
    }
    if rank == 0 {
        println!(
            "{label}: signal half round trip median {:.2} us",
            median(&mut samples)
        );
        println!(
            "{:>10} {:>12} {:>12} {:>7}",
            "bytes", "puts+signal", "putWithSig", "ratio"
        );
    }
    let mut size = min_kib << 10;
    while size <= max {
        let (mut plain, mut signalled, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..reps {
            let mut t = [0.0f64; 2];
            // Alternate which goes first, so neither always runs on a warmer path.
            for k in 0..2 {
                let with_signal = (k + r) % 2 == 1;
                if only != "both" && with_signal != (only == "signalled") {
                    continue;
                }
                ok(mscclppBootstrapBarrier(comm), "barrier");
                if rank == 0 {
                    let t0 = Instant::now();
                    for p in 0..PUTS {
                        let off = ((p % 2) * size) as u64;
                        for &c in &conns {
                            if with_signal {
                                ok(mscclppDevConnPutWithSignal(c, off, off, size as u64), "pws");
                            } else {
                                ok(mscclppDevConnPut(c, off, off, size as u64), "put");
                            }
                        }
                    }
                    for &c in &conns {
                        if !with_signal {
                            ok(mscclppDevConnSignal(c), "signal");
                        }
                    }
                    for &c in &conns {
                        ok(mscclppDevConnFlush(c), "flush");
                    }
                    t[usize::from(with_signal)] = t0.elapsed().as_secs_f64();
                    if wait_after {
                        ok(mscclppBootstrapBarrier(comm), "barrier");
                    }
                } else {
                    if wait_after {
                        ok(mscclppBootstrapBarrier(comm), "barrier");
                    }
                    for _ in 0..if with_signal { PUTS } else { 1 } {
                        ok(mscclppDevConnWait(d), "wait");
                    }
                }
            }
            if rank == 0 {
                let gbs = |s: f64| (npeers * PUTS * size) as f64 / s / 1e9;
                if print_reps {
                    let first = if r % 2 == 0 {
                        "unsignalled"
                    } else {
                        "signalled"
                    };
                    eprintln!(
                        "rep {r} ({first} first): unsignalled {:.3} signalled {:.3} GB/s",
                        gbs(t[0]),
                        gbs(t[1])
                    );
                }
                plain.push(gbs(t[0]));
                signalled.push(gbs(t[1]));
                ratios.push(t[0] / t[1]);
            }
        }
        if rank == 0 {
            println!(
                "{:>10} {:>12.3} {:>12.3} {:>7.2}",
                size,
                median(&mut plain),
                median(&mut signalled),
                median(&mut ratios)
            );
        }
        size *= 4;
    }
    ok(mscclppBootstrapBarrier(comm), "barrier");
    ok(mscclppProxyStop(comm), "stop");
    ok(mscclppCommDestroy(comm), "destroy");
}
