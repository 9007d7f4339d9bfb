//! Stopping proxies and releasing a communicator, in an order that neither hangs on a dead
//! peer or a stuck kernel nor frees memory something may still use: the abort words are raised
//! so that kernels and host threads spinning on our FIFOs return, proxies stop (bounded, all
//! against one deadline), network endpoints linger for peers' last flushes, endpoints close
//! (their registrations first), CUDA IPC peers confirm they closed their mappings of our memory
//! (bounded), then FIFOs and epoch memory go. What a dead peer may have wedged, a live one may
//! still map, or a kernel, our SM engine, a copy or a host thread may still touch, is leaked
//! (said at WARN), never freed under it.

use super::{Comm, Conn, Slot, TAG_UNMAPPED};
use crate::abi::mscclppTransport_t;
use crate::proxy::SharedEndpoint;
use crate::sync::lock;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a destroyed communicator keeps progressing its network endpoints before closing
/// them. A peer that signalled us and then flushes confirms delivery with a marker write that
/// our endpoint must still accept (software providers move it only while we progress); closing
/// at once would cancel it and fail the peer's flush. The marker follows the signal by
/// microseconds in the usual put-signal-flush sequence.
const LINGER: Duration = Duration::from_millis(50);
/// How long stopping a proxy may take once a peer of it died (see `stop_all`).
const STOP_AFTER_LOSS: Duration = Duration::from_secs(2);
/// How long a stop lets the proxies execute what is queued: a FIFO that does not go quiet
/// within it (a kernel that keeps pushing) stops being served. The abort is then raised: what
/// comes is retired unexecuted.
pub(super) const DRAIN: Duration = Duration::from_secs(1);
/// How long after it began a stop still lets the transport waits of its final flushes run
/// (a flush to a peer that does not progress, a host thread inside one): past it they end at
/// once, as an error.
pub(super) const CUT: Duration = Duration::from_secs(3);
/// A stop returns within `MSCCLPP_WAIT_TIMEOUT` plus this (the drain, then the final flushes,
/// which share one deadline); a proxy thread still running then is abandoned.
pub(super) const STOP_SLACK: Duration = Duration::from_secs(2);
/// How long destroy waits, after the stop, for the host threads and kernels its abort
/// released to leave our memory; what one still uses then is leaked.
const RELEASED_LEAVE: Duration = Duration::from_secs(2);

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
        let t0 = Instant::now();
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
        let peers: Vec<usize> = s.peers.keys().map(|k| k.0).collect();
        self.boot.lost_peer_among(&peers).is_some()
    }

    /// Stops every running proxy, all against one deadline: each executes what its FIFO holds
    /// (for `DRAIN` at most), flushes its peers and quiesces its endpoint. If they are not all
    /// done within `DRAIN`, the abort is raised (what still comes is retired unexecuted); within
    /// `CUT`, transport waits end too. A thread still running at `MSCCLPP_WAIT_TIMEOUT` +
    /// `STOP_SLACK` (2 s after the stop began when a peer of it died) is abandoned. Unless
    /// `destroying` (destroy raised the abort before), the abort words are raised at the end,
    /// releasing every kernel and host thread still spinning on a FIFO.
    pub(super) fn stop_all(&mut self, destroying: bool) {
        let t0 = Instant::now();
        let lost: Vec<bool> = self.slots.iter().map(|s| self.lost_a_peer(s)).collect();
        for s in &self.slots {
            if let Some(r) = &s.running {
                r.ask_stop();
            }
        }
        let done = |slots: &[Slot]| {
            slots
                .iter()
                .all(|s| s.running.as_ref().is_none_or(|r| r.is_finished()))
        };
        let until = |slots: &[Slot], bound: Duration| {
            // Ends when every proxy finished, or at the bound.
            while !done(slots) && t0.elapsed() < bound {
                std::thread::sleep(Duration::from_millis(1));
            }
            done(slots)
        };
        if !until(&self.slots, DRAIN) {
            if !destroying {
                crate::info!(
                    "rank {}: the proxies did not go quiet within {DRAIN:?} of the stop: raising the abort (what is pushed from now on is not executed)",
                    self.rank()
                );
                self.sticky.release(false);
            }
            if !until(&self.slots, CUT) {
                crate::warn!(
                    "rank {}: the proxies' final flushes did not end within {CUT:?} of the stop: ending them (their peers may not have everything)",
                    self.rank()
                );
                self.sticky.release(true);
            }
        }
        let healthy = t0 + crate::config::wait_timeout().saturating_add(STOP_SLACK);
        for (s, lost) in self.slots.iter_mut().zip(lost) {
            if let Some(r) = s.running.take() {
                let deadline = if lost { t0 + STOP_AFTER_LOSS } else { healthy };
                // The thread records its own failure (`Sticky::abort`); a panic or an
                // abandoned thread is recorded here.
                let (r, abandoned) =
                    r.stop_within(deadline.saturating_duration_since(Instant::now()));
                if let Err(e) = r {
                    self.sticky
                        .abort(e.code(), format!("proxy for {:?}: {e}", s.key));
                }
                s.abandoned |= abandoned;
            }
        }
        self.proxies_running = false;
        if !destroying {
            self.sticky.release(false);
        }
    }

    /// Per slot, why its FIFO and the GPU memory of its connections may still be in use after
    /// the stop (None: free it): our SM engine or copies still running (`Endpoint::gpu_busy`),
    /// or a kernel of this process on its device not ended by `deadline`
    /// (`cuda::blocking_work_done_by`); a host FIFO whose consumer a host thread still holds
    /// (it is inside a call on one of its connections) until `deadline`.
    fn still_in_use(&self, skip: &[bool], deadline: Instant) -> Vec<Option<String>> {
        let mut kernels: Vec<(i32, bool)> = Vec::new();
        self.slots
            .iter()
            .zip(skip)
            .map(|(s, &skip)| {
                let Some(d) = s.key.device() else {
                    // A host FIFO: the communicator and the proxy thread (joined, or abandoned
                    // and then its FIFO is its) hold the consumer; a host call holds it too.
                    let held = |s: &Slot| !s.abandoned && Arc::strong_count(&s.work) > 1;
                    // Ends when no host call holds it, or at the deadline.
                    while held(s) && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    return held(s).then(|| "a host thread is still inside a call on one of its connections".to_string());
                };
                if !skip {
                    if let Some(why) = lock(&s.ep).gpu_busy() {
                        return Some(why);
                    }
                }
                let ended = match kernels.iter().find(|k| k.0 == d) {
                    Some(k) => k.1,
                    None => {
                        let e = crate::cuda::blocking_work_done_by(d, deadline).unwrap_or_else(|e| {
                            crate::warn!("rank {}: cannot tell whether the kernels on CUDA device {d} ended: {e}", self.rank());
                            false
                        });
                        kernels.push((d, e));
                        e
                    }
                };
                (!ended).then(|| format!("a kernel on CUDA device {d} has not ended (it was released by the abort word but still runs, or it runs on a stream that waits behind one that does)"))
            })
            .collect()
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        let t0 = Instant::now();
        // First, while everything it reads still lives: a hang report still wanted is written
        // (a program that destroys its communicator after a timeout sees it), and the report's
        // source is closed.
        if let Some(h) = self.hang.take() {
            super::hang::close(&h);
        }
        // The abort: kernels and host threads still spinning on our FIFOs return, and the
        // proxies execute nothing pushed from now on. No error: peers see our goodbye.
        self.sticky.closing();
        self.sticky.release(false);
        self.end_keeper();
        self.stop_all(true);
        self.close_inboxes();
        self.linger();
        self.registered.clear();
        self.dev_conns.clear();
        let skip = self.untouchable();
        let in_use = self.still_in_use(&skip, Instant::now() + RELEASED_LEAVE);
        // CUDA IPC peers of slots not skipped: they map our epoch blocks (`wait_for_unmaps`).
        let ipc: Vec<bool> = self
            .slots
            .iter()
            .zip(&skip)
            .map(|(s, skip)| !skip && s.key.transport() == mscclppTransport_t::mscclppTransportP2P)
            .collect();
        let busy: Vec<bool> = in_use.iter().map(Option::is_some).collect();
        let links = self.conns.iter().map(|c| (c.slot, c.remote_rank));
        let (ipc_peers, withheld) = unmap_peers(&ipc, &busy, links);
        // No later abort (an abandoned proxy thread's) may touch a FIFO from here on.
        self.sticky.detach();
        let slots = std::mem::take(&mut self.slots);
        // An untouchable endpoint is leaked, not closed (closing calls into it). Peers may
        // still write into its connections' epoch blocks (shm writes straight into our
        // memory): those are kept too. So are the epoch blocks of a slot whose memory is still
        // in use (a kernel, a host thread). The FIFO goes unless it is still in use.
        let (keep, conns): (Vec<Conn>, Vec<Conn>) = std::mem::take(&mut self.conns)
            .into_iter()
            .partition(|c| skip[c.slot] || in_use[c.slot].is_some());
        std::mem::forget(keep);
        for ((s, skip), in_use) in slots.into_iter().zip(skip).zip(in_use) {
            let p2p = s.key.transport() == mscclppTransport_t::mscclppTransportP2P;
            if skip {
                crate::warn!(
                    "rank {}: leaking endpoint {:?}: a peer died and the endpoint may be wedged",
                    self.rank(),
                    s.key
                );
                std::mem::forget(s.ep);
            } else if let Some(why) = &in_use {
                // The P2P endpoint holds the IPC mappings kernels store through
                // (`remoteBuff`), and its engine stores into the FIFO's done word.
                crate::warn!(
                    "rank {}: leaking the FIFO of endpoint {:?}, its connections' epoch blocks{}, rather than free them under a user: {why}",
                    self.rank(),
                    s.key,
                    if p2p { " and the endpoint with its CUDA IPC mappings" } else { "" }
                );
                if p2p {
                    std::mem::forget(s.ep.clone());
                }
                if !s.abandoned {
                    lock(&s.work).fifo.leak_memory();
                }
                drop(s.ep);
            } else {
                drop(s.ep);
            }
            drop(s.work);
        }
        // Epoch memory goes after the endpoints that registered it, and after every CUDA IPC
        // peer has closed its mapping of it; a peer that does not say so in time keeps it. The
        // wait shares the stop's deadline (at least a second of it is left for it).
        let unmaps_by = (t0 + crate::config::wait_timeout().saturating_add(STOP_SLACK))
            .max(Instant::now() + Duration::from_secs(1));
        if !withheld.is_empty() {
            crate::warn!(
                "rank {}: not telling ranks {withheld:?} that their memory is unmapped: an endpoint of ours that maps it is still in use (above); they keep it, and we keep the epoch blocks they map",
                self.rank()
            );
            // Said, not left unsaid: our goodbye follows, and a peer that sees it without an
            // answer takes us for gone with our mappings (a process that ended).
            for &p in &withheld {
                let _ = self.boot.send(p, TAG_UNMAPPED, KEPT);
            }
        }
        let mut unanswered = self.wait_for_unmaps(&ipc_peers, unmaps_by);
        unanswered.extend(withheld);
        let (keep, conns): (Vec<Conn>, Vec<Conn>) = conns
            .into_iter()
            .partition(|c| ipc[c.slot] && unanswered.contains(&c.remote_rank));
        std::mem::forget(keep);
        drop(conns);
        crate::info!(
            "rank {}: communicator destroyed in {:?}",
            self.rank(),
            t0.elapsed()
        );
    }
}

/// What a rank sends instead of "unmapped" (`TAG_UNMAPPED`'s empty message) to a CUDA IPC peer
/// whose memory it still maps at destroy (`unmap_peers`): keep it.
const KEPT: &[u8] = b"kept";

/// The CUDA IPC peers told that we unmapped their memory, and those withheld, from each slot's
/// `ipc` (a P2P slot not skipped) and `busy` (still in use: its endpoint, with its mappings of
/// the peer's memory, is leaked, not closed) and each connection's (slot, peer): a peer of a
/// busy slot is withheld, whatever its other slots, since a kernel, engine or copy of ours may
/// still store through the mapping (docs/RELIABILITY.md, who owns what). A withheld peer is
/// not waited for either: it keeps its memory until its own deadline, and we keep the epoch
/// blocks it maps (it was not asked to unmap them). Both sorted, without repeats.
fn unmap_peers(
    ipc: &[bool],
    busy: &[bool],
    links: impl Iterator<Item = (usize, usize)>,
) -> (Vec<usize>, Vec<usize>) {
    let (mut told, mut withheld) = (Vec::new(), Vec::new());
    for (slot, peer) in links.filter(|l| ipc[l.0]) {
        match busy[slot] {
            true => withheld.push(peer),
            false => told.push(peer),
        }
    }
    for v in [&mut told, &mut withheld] {
        v.sort_unstable();
        v.dedup();
    }
    told.retain(|p| withheld.binary_search(p).is_err());
    (told, withheld)
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
    /// waits, until `deadline` for all, until each says the same or is gone (it
    /// destroyed its communicator or died: its mappings went with it). Returns the peers that
    /// did neither by `deadline`, or said they keep their mappings (`KEPT`: something of theirs
    /// still runs); their blocks are leaked, with a warning, rather than freed under them.
    fn wait_for_unmaps(&self, peers: &[usize], deadline: Instant) -> Vec<usize> {
        if peers.is_empty() {
            return Vec::new();
        }
        for &p in peers {
            // A peer already gone cannot take it and needs no answer.
            let _ = self.boot.send(p, TAG_UNMAPPED, b"");
        }
        let t0 = Instant::now();
        let mut unanswered = Vec::new();
        for &p in peers {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.boot.recv_unless_gone(p, TAG_UNMAPPED, left) {
                Ok(Some(m)) if m == KEPT => {
                    crate::warn!(
                        "rank {}: leaking the GPU memory rank {p} maps through CUDA IPC (its epoch blocks): its communicator is destroyed, but something of it still runs and may store through its mappings of our memory; rank {p} may also still write into the buffers this communicator connected: free them only once rank {p} has ended",
                        self.rank()
                    );
                    unanswered.push(p);
                }
                Ok(_) => {}
                Err(e) => {
                    crate::warn!(
                        "rank {}: leaking the GPU memory rank {p} maps through CUDA IPC (its epoch blocks): it did not close its mapping in time: {e}; rank {p} may also still write into the buffers this communicator connected: free them only once rank {p} has ended",
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

#[cfg(test)]
mod tests {
    use super::unmap_peers;

    /// A peer is told we unmapped its memory only where no slot of ours still maps it: slot 0
    /// (P2P, a kernel still running) to rank 1 withholds rank 1, though slot 2 to rank 1 is
    /// idle; slot 1 to rank 2 is told; slot 3 (skipped: not IPC) to rank 3 is neither.
    #[test]
    fn a_busy_slot_withholds_its_peer() {
        let ipc = [true, true, true, false];
        let busy = [true, false, false, true];
        let links = [(0, 1), (1, 2), (2, 1), (3, 3), (1, 2)];
        let (told, withheld) = unmap_peers(&ipc, &busy, links.into_iter());
        assert_eq!((told, withheld), (vec![2], vec![1]));
        let (told, withheld) = unmap_peers(&ipc, &[false; 4], links.into_iter());
        assert_eq!((told, withheld), (vec![1, 2], vec![]));
    }
}
