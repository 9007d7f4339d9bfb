//! Time spent in driver calls by the P2P endpoint (`MSCCLPP_P2P_STATS=1`).

use crate::transport::Timed;
use std::time::{Duration, Instant};

/// Time spent in driver calls, for `MSCCLPP_P2P_STATS=1` (printed when the endpoint closes):
/// where the proxy's share of a put's latency goes.
#[derive(Default)]
pub(super) struct Stats {
    pub(super) on: bool,
    pub(super) copies: Timed,
    pub(super) values: Timed,
    pub(super) flushes: Timed,
    pub(super) sm_waits: Timed,
    pub(super) sm_jobs: u64,
    /// Launches of the SM engine's kernel (it stops after its linger without work).
    pub(super) sm_launches: u64,
    /// The SM engine's own timing sums (`Engine::timing`).
    pub(super) sm_timing: [u64; 7],
}

impl Stats {
    pub(super) fn add(slot: &mut Timed, since: Option<Instant>) {
        if let Some(t) = since {
            slot.add(t);
        }
    }
    pub(super) fn start(&self) -> Option<Instant> {
        self.on.then(Instant::now)
    }
    pub(super) fn report(&self, device: i32) {
        if !self.on {
            return;
        }
        let f = |t: Timed| format!("{} x {:.2} us", t.n, t.avg_us());
        let t = &self.sm_timing;
        let g = |ns: u64, n: u64| {
            f(Timed {
                n,
                time: Duration::from_nanos(ns),
            })
        };
        crate::info!(
            "p2p:cuda{device} stats: copy calls {}, flag and done-word calls {}, stream waits {}; SM engine jobs {}, launches {}, waits {}; in the kernel, read to DONE: grid jobs {} (block 0's share copied {}, workers joined {}, fenced {}), others {}",
            f(self.copies),
            f(self.values),
            f(self.flushes),
            self.sm_jobs,
            self.sm_launches,
            f(self.sm_waits),
            g(t[0], t[1]),
            g(t[4], t[1]),
            g(t[5], t[1]),
            g(t[6], t[1]),
            g(t[2], t[3])
        );
    }
}
