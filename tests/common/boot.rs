//! Helpers of the bootstrap tests (`tests/bootstrap_*.rs`): ranks as threads joined through
//! `mscclpp::bootstrap`, the all-gather check they share, and children for the tests that need
//! a process to die or a process-wide setting of their own.
#![allow(dead_code)]

use mscclpp::bootstrap::Bootstrap;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A root address on 127.0.0.1 whose port was free a moment ago.
pub fn local_addr() -> String {
    format!("127.0.0.1:{}", super::free_port())
}

/// Runs `f(bootstrap)` on `n` rank threads that join `addr`; returns the results by rank.
pub fn with_ranks<T: Send + 'static>(
    addr: &str,
    n: usize,
    f: impl Fn(Bootstrap) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let hs: Vec<_> = (0..n)
        .map(|r| {
            let (addr, f) = (addr.to_string(), f.clone());
            std::thread::spawn(move || {
                let b = Bootstrap::from_addr(&addr, r, n)
                    .unwrap_or_else(|e| panic!("rank {r}/{n} at {addr}: {e}"));
                assert_eq!((b.rank(), b.nranks()), (r, n));
                f(b)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

pub fn pattern(rank: usize, i: usize, round: usize) -> u8 {
    (rank * 31 + i * 7 + round * 13) as u8
}

/// An all-gather of `per_rank` bytes from every rank, every byte checked.
pub fn check_all_gather(b: &Bootstrap, per_rank: usize, round: usize) {
    let n = b.nranks();
    let mut data = vec![0xEEu8; per_rank * n];
    for i in 0..per_rank {
        data[b.rank() * per_rank + i] = pattern(b.rank(), i, round);
    }
    b.all_gather(&mut data).unwrap();
    for r in 0..n {
        for i in 0..per_rank {
            assert_eq!(
                data[r * per_rank + i],
                pattern(r, i, round),
                "rank {} sees slice {r} byte {i} wrong",
                b.rank()
            );
        }
    }
}

/// Polls `lost_peer` every 10 ms until it reports a loss or `bound` passes.
pub fn poll_lost(b: &Bootstrap, bound: Duration) -> Option<(usize, String)> {
    let t = Instant::now();
    // Ends: a loss is reported, or at `bound`.
    loop {
        if let Some(l) = b.lost_peer() {
            return Some(l);
        }
        if t.elapsed() >= bound {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Re-runs test `test` alone as a child that plays `role` (see [`super::child_role`]), without
/// the bootstrap settings of this process's environment, with `envs` instead.
pub fn child(test: &str, role: &str, envs: &[(&str, &str)]) -> Command {
    let mut cmd = super::child_command(test, role);
    cmd.env_remove("MSCCLPP_BOOTSTRAP_TIMEOUT")
        .env_remove("MSCCLPP_SOCKET_IFNAME");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd
}

/// What a child prints once its role is done, so that its parent knows the role ran.
pub fn child_done(role: &str) {
    println!("CHILD {role} OK");
}

/// Runs test `test` as a child playing `role` to its end (killed after 120 s) and checks that
/// it succeeded and printed that the role ran.
pub fn run_child(test: &str, role: &str, envs: &[(&str, &str)]) {
    let (status, text) = super::output_within(child(test, role, envs), Duration::from_secs(120));
    assert!(
        status.is_some_and(|s| s.success()),
        "child {role} failed ({status:?}, None = killed at the deadline):\n{text}"
    );
    assert!(
        text.contains(&format!("CHILD {role} OK")),
        "child {role} did not run:\n{text}"
    );
}
