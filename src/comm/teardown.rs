//! Stopping proxies and releasing a communicator, in an order that neither hangs on a dead
//! peer nor frees memory something may still write: proxies drain and stop (bounded), network
//! endpoints linger for peers' last flushes, endpoints close (their registrations first), CUDA
//! IPC peers confirm they closed their mappings of our memory (bounded), then FIFOs and epoch
//! memory go. What a dead peer may have wedged, or a live one may still map, is leaked, never
//! touched.

use super::{Comm, Conn, Slot, TAG_UNMAPPED};
use crate::abi::{mscclppResult_t, mscclppTransport_t};
use crate::proxy::SharedEndpoint;
use crate::sync::lock;

/// How long a destroyed communicator keeps progressing its network endpoints before closing
/// them. A peer that signalled us and then flushes confirms delivery with a marker write that
/// our endpoint must still accept (software providers move it only while we progress); closing
/// at once would cancel it and fail the peer's flush. The marker follows the signal by
/// microseconds in the usual put-signal-flush sequence.
const LINGER: std::time::Duration = std::time::Duration::from_millis(50);
/// How long stopping a proxy may take once a peer of it died (see `stop_all`).
const STOP_AFTER_LOSS: std::time::Duration = std::time::Duration::from_secs(2);

impl Comm {
    /// Progresses the endpoints that asked for it (`Caps::linger`) for `LINGER`.
    fn linger(&mut self) {
        let skip = self.untouchable();
        let lingering: Vec<&SharedEndpoint> = self
            .slots
            .iter()
            .zip(skip)
            .filter(|(s, skip)| s.caps.linger && !skip)
            .map(|(s, _)| &s.ep)
            .collect();
        if lingering.is_empty() || self.conns.is_empty() {
            return;
        }
        let t0 = std::time::Instant::now();
        // Ends after LINGER; errors (a peer already gone) do not matter any more.
        while t0.elapsed() < LINGER {
            for ep in &lingering {
                let mut ep = lock(ep);
                let _ = ep.progress();
                let _ = ep.poll_incoming();
            }
            std::thread::yield_now();
        }
    }

    /// Slots nothing may call into any more: their proxy thread was abandoned, or they may be
    /// wedged by a peer that died.
    pub(super) fn untouchable(&self) -> Vec<bool> {
        self.slots
            .iter()
            .map(|s| s.abandoned || (s.caps.may_wedge && self.lost_a_peer(s)))
            .collect()
    }

    /// Whether a peer of this slot's endpoint died (any of them, not only the first loss).
    fn lost_a_peer(&self, s: &Slot) -> bool {
        let peers: Vec<usize> = s.peers.keys().copied().collect();
        self.boot.lost_peer_among(&peers).is_some()
    }

    pub(super) fn stop_all(&mut self) {
        let lost: Vec<bool> = self.slots.iter().map(|s| self.lost_a_peer(s)).collect();
        for (s, lost) in self.slots.iter_mut().zip(lost) {
            if let Some(r) = s.running.take() {
                // A healthy proxy stops within its final flushes, each bounded by the wait
                // timeout; after a peer of it died they end at once.
                let bound = if lost {
                    STOP_AFTER_LOSS
                } else {
                    crate::config::wait_timeout()
                        .saturating_mul(1 + s.peers.len() as u32)
                        .saturating_add(STOP_AFTER_LOSS)
                };
                // The thread records its own failure (sticky error, abort word); a panic or
                // an abandoned thread is recorded here.
                let (r, abandoned) = r.stop_within(bound);
                if let Err(e) = r {
                    let code = e.code();
                    self.sticky.set(code, format!("proxy for {:?}: {e}", s.key));
                    s.abort.set(code);
                }
                s.abandoned |= abandoned;
            }
        }
        self.proxies_running = false;
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // First, while everything it reads still lives: a hang report still wanted is written
        // (a program that destroys its communicator after a timeout sees it), and the report's
        // source is closed.
        if let Some(h) = self.hang.take() {
            super::hang::close(&h);
        }
        // Producers still spinning on our FIFOs must stop; proxies drain, then endpoints close
        // (their registrations before the endpoint), then FIFOs and epoch memory go.
        for s in &self.slots {
            if s.running.is_some() {
                s.abort.set(mscclppResult_t::mscclppInvalidUsage);
            }
        }
        self.stop_all();
        self.close_inboxes();
        self.linger();
        self.registered.clear();
        self.dev_conns.clear();
        let skip = self.untouchable();
        // CUDA IPC peers of healthy slots: they map our epoch blocks (`wait_for_unmaps`).
        let ipc: Vec<bool> = self
            .slots
            .iter()
            .zip(&skip)
            .map(|(s, skip)| !skip && s.key.transport() == mscclppTransport_t::mscclppTransportP2P)
            .collect();
        let mut ipc_peers: Vec<usize> = self
            .conns
            .iter()
            .filter(|c| ipc[c.slot])
            .map(|c| c.remote_rank)
            .collect();
        ipc_peers.sort_unstable();
        ipc_peers.dedup();
        let slots = std::mem::take(&mut self.slots);
        // An untouchable endpoint is leaked, not closed (closing calls into it). Peers may
        // still write into its connections' epoch blocks (shm writes straight into our
        // memory): those are kept too. The FIFO goes; no transport call is involved.
        let (keep, conns): (Vec<Conn>, Vec<Conn>) = std::mem::take(&mut self.conns)
            .into_iter()
            .partition(|c| skip[c.slot]);
        std::mem::forget(keep);
        for (s, skip) in slots.into_iter().zip(skip) {
            if skip {
                crate::warn!(
                    "rank {}: leaking endpoint {:?}: a peer died and the endpoint may be wedged",
                    self.rank(),
                    s.key
                );
                std::mem::forget(s.ep);
            } else {
                drop(s.ep);
            }
            drop(s.work);
        }
        // Epoch memory goes after the endpoints that registered it, and after every CUDA IPC
        // peer has closed its mapping of it; a peer that does not say so in time keeps it.
        let unanswered = self.wait_for_unmaps(&ipc_peers);
        let (keep, conns): (Vec<Conn>, Vec<Conn>) = conns
            .into_iter()
            .partition(|c| ipc[c.slot] && unanswered.contains(&c.remote_rank));
        std::mem::forget(keep);
        drop(conns);
    }
}

impl Comm {
    /// SHM peers' inline puts (`transport::inbox`): once the proxies are stopped (their last
    /// round applied what was there), what is left is applied and each ring is closed: later
    /// drains write nothing (the user may free the buffers when destroy returns), and a peer's
    /// flush that still waits reports its lost puts instead of waiting out its timeout.
    fn close_inboxes(&self) {
        for c in &self.conns {
            if let Some(Err(e)) = c.inbox.as_ref().map(|i| i.close()) {
                crate::warn!("rank {}: at destroy: {e}", self.rank());
            }
        }
    }

    /// CUDA IPC peers map our epoch blocks (device memory) and store signals into them until
    /// their proxies stop: freeing a block while a peer still maps it would let such a store
    /// land in whatever the driver hands that memory to next. Called once our endpoints are
    /// closed (our own mappings of the peers' memory with them): tells each peer so, then
    /// waits, at most `MSCCLPP_WAIT_TIMEOUT` for all, until each says the same or is gone (it
    /// destroyed its communicator or died: its mappings went with it). Returns the peers that
    /// did neither; their blocks are leaked, with a warning, rather than freed under them.
    fn wait_for_unmaps(&self, peers: &[usize]) -> Vec<usize> {
        if peers.is_empty() {
            return Vec::new();
        }
        for &p in peers {
            // A peer already gone cannot take it and needs no answer.
            let _ = self.boot.send(p, TAG_UNMAPPED, b"");
        }
        let t0 = std::time::Instant::now();
        let bound = crate::config::wait_timeout();
        let mut unanswered = Vec::new();
        for &p in peers {
            let left = bound.saturating_sub(t0.elapsed());
            match self.boot.recv_unless_gone(p, TAG_UNMAPPED, left) {
                Ok(_) => {}
                Err(e) => {
                    crate::warn!(
                        "rank {}: leaking the GPU memory rank {p} maps through CUDA IPC (its epoch blocks): it did not close its mapping in time: {e}",
                        self.rank()
                    );
                    unanswered.push(p);
                }
            }
        }
        crate::info!(
            "rank {}: {} CUDA IPC peers closed their mappings of our memory in {:?} ({} did not)",
            self.rank(),
            peers.len() - unanswered.len(),
            t0.elapsed(),
            unanswered.len()
        );
        unanswered
    }
}
