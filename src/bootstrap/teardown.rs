//! How a rank's bootstrap ends: failing for good (the sticky error, an `Abort` to the peers,
//! every connection closed), or being dropped (a `Bye` on every open connection).

use super::frame::{self, Kind};
use super::{net, root, Bootstrap, Out};
use crate::error::{Error, Result};
use crate::sync::lock;
use std::net::Shutdown;
use std::time::{Duration, Instant};

impl Bootstrap {
    /// Fails with the error that broke this bootstrap, if one did (here or at a peer).
    pub(super) fn check_sticky(&self, op: &str) -> Result<()> {
        if let Some(s) = &*lock(&self.sticky) {
            return Err(Error::remote(format!(
                "rank {}: {op}: the bootstrap failed earlier: {s}",
                self.rank
            )));
        }
        if let Some(a) = self.mailbox.aborted() {
            self.poison(&a);
            return Err(Error::remote(format!("rank {}: {op}: {a}", self.rank)));
        }
        Ok(())
    }

    /// Gives up on the whole communicator because of `why` (the communicator's abort after an
    /// error, `proxy::Sticky::abort`): as a failed collective does, this bootstrap fails for
    /// good and tells the peers (an `Abort`, then every connection closed without a goodbye),
    /// so each connected peer records this rank as lost, with `why`, and its proxies fail as
    /// for a dead peer. Bounded (at most a second). Idempotent.
    pub fn abort(&self, why: &str) {
        self.poison(why);
    }

    /// Makes the failure sticky and spreads it: an Abort to every open connection and to both
    /// ring neighbours, then every connection closed. Ranks blocked on this one fail at once
    /// instead of at their deadline.
    pub(super) fn poison(&self, why: &str) {
        {
            let mut st = lock(&self.sticky);
            if st.is_some() {
                return;
            }
            *st = Some(why.to_string());
        }
        crate::warn!(
            "rank {}: bootstrap failed, telling the peers: {why}",
            self.rank
        );
        let n = self.nranks;
        let (next, prev) = ((self.rank + 1) % n, (self.rank + n - 1) % n);
        let abort = root::abort_frame(self.magic, why);
        let mut abort_from_us = abort.clone();
        abort_from_us[12..16].copy_from_slice(&(self.rank as u32).to_le_bytes());
        let deadline = Instant::now() + self.timeout.min(Duration::from_secs(1));
        for p in (0..n).filter(|&p| p != self.rank) {
            // A peer whose lock is held has a send in progress; that send fails or finishes
            // on its own, and the mailbox closing below still reaches the peer.
            let Ok(mut g) = self.out[p].try_lock() else {
                continue;
            };
            match &*g {
                Out::Open(s) => {
                    let _ = net::write_all_by(s, &abort_from_us, deadline);
                    let _ = s.shutdown(Shutdown::Both);
                }
                Out::Idle if p == next || p == prev => {
                    if let Ok(s) = net::connect(&self.peers[p], deadline) {
                        let mut f = frame::encode_raw(
                            self.magic,
                            Kind::Open as u32,
                            self.rank as u32,
                            0,
                            0,
                        )
                        .to_vec();
                        f.extend_from_slice(&abort_from_us);
                        let _ = net::write_all_by(&s, &f, deadline);
                    }
                }
                _ => {}
            }
            *g = Out::Broken(why.to_string());
        }
        self.mailbox.close_all();
    }
}

/// Longest that dropping a [`Bootstrap`] spends saying goodbye to all its peers together.
const BYE_BUDGET: Duration = Duration::from_secs(1);

impl Drop for Bootstrap {
    /// Says goodbye on every open connection, so that the peers do not take this rank's
    /// closing for a crash, then closes them. Bounded: a Bye is one 32-byte frame that fits
    /// in the socket buffer, so it is handed to the kernel at once; only a peer that stopped
    /// reading can make it wait, and then at most `BYE_BUDGET` in all (plus a few ms per
    /// connection), after which that peer sees a close without goodbye, as for a crash.
    fn drop(&mut self) {
        let t0 = Instant::now();
        let shared = t0 + self.timeout.min(BYE_BUDGET);
        let bye = frame::encode_raw(self.magic, Kind::Bye as u32, self.rank as u32, 0, 0);
        let mut said = 0;
        for (p, o) in self.out.iter_mut().enumerate() {
            let o = o.get_mut().unwrap_or_else(|e| e.into_inner());
            if let Out::Open(s) = &*o {
                // Every connection gets at least one try, even after the shared budget.
                let deadline = shared.max(Instant::now() + Duration::from_millis(5));
                match net::write_all_by(s, &bye, deadline) {
                    Ok(()) => said += 1,
                    Err(e) => crate::trace!("rank {}: goodbye to rank {p}: {e}", self.rank),
                }
                // Sends FIN behind the Bye. The peer never writes on this connection, so no
                // unread data can turn the later close into a reset that would discard it.
                let _ = s.shutdown(Shutdown::Both);
            }
            *o = Out::Broken("the bootstrap was dropped".into());
        }
        crate::trace!(
            "rank {}: said goodbye to {said} peers in {:?}",
            self.rank,
            t0.elapsed()
        );
    }
}
