//! The peer-death watch: each watched peer keeps a connection to this rank open, and one that
//! closes without a goodbye means the peer's process died.

use super::frame::Kind;
use super::Bootstrap;
use crate::error::Result;
use std::time::Instant;

impl Bootstrap {
    /// Makes sure each listed peer has a connection to this rank that stays open while both
    /// live, and remembers them as watched: from then on [`Bootstrap::lost_peer`] reports a
    /// listed peer whose connection closes without a goodbye (its process died).
    ///
    /// Collective between the pairs: every listed peer must call it with this rank in its
    /// list (each side sends a `Watch` frame on its connection to the other, then waits for
    /// the other's). Bounded by the bootstrap timeout. Calling it again with the same peers is
    /// harmless. This rank itself, if listed, is ignored.
    pub fn watch_peers(&self, peers: &[usize]) -> Result<()> {
        for &p in peers {
            self.check_peer(p, "watch_peers")?;
        }
        self.check_sticky("watch_peers")?;
        let mut others: Vec<usize> = peers.iter().copied().filter(|&p| p != self.rank).collect();
        others.sort_unstable();
        others.dedup();
        // Marked before the sends and waits: if one of them fails because a peer died, that
        // loss is still reported by lost_peer.
        self.mailbox.watch_mark(&others);
        let deadline = Instant::now() + self.timeout;
        // All sends first: they never wait for the peer, so the pairs cannot deadlock.
        for &p in &others {
            self.send_frame(p, Kind::Watch, 0, &[], deadline, "watch_peers")?;
        }
        for &p in &others {
            let what = || format!("rank {}: watch_peers: waiting for rank {p}", self.rank);
            self.mailbox.wait_watch(p, deadline, self.timeout, &what)?;
        }
        crate::trace!("rank {}: watching ranks {others:?}", self.rank);
        Ok(())
    }

    /// The first watched peer (see [`Bootstrap::watch_peers`]) whose connection to this rank
    /// closed or failed without a goodbye, with a message saying so; None while all are fine.
    /// One atomic load while nothing was lost, so a proxy thread may poll it often.
    pub fn lost_peer(&self) -> Option<(usize, String)> {
        self.mailbox.lost_peer(None)
    }

    /// As [`Bootstrap::lost_peer`], for the first lost peer among `ranks`: every loss is kept,
    /// so a proxy whose peers are others than the first lost one still sees its own.
    pub fn lost_peer_among(&self, ranks: &[usize]) -> Option<(usize, String)> {
        self.mailbox.lost_peer(Some(ranks))
    }
}
