//! Per peer, which path carries an operation (the SM engine or the peer's copy-engine stream),
//! and the ordering between the two: work that must follow earlier work of the other path
//! waits for it first, and the done word is claimed only by work ordered after every earlier
//! trigger's.

use super::ce::FlagMode;
use super::regions::{FlagTarget, PutTarget};
use super::stats::Stats;
use super::{peer_mut, P2p};
use crate::error::Result;
use crate::transport::PeerId;

impl P2p {
    /// Whether the SM engine may carry work for `peer` into a remote region now. Starts the
    /// engine when it is off (this operation then goes by the copy engines; later ones by the
    /// SMs once every block is resident).
    pub(super) fn sm_route(&mut self, peer: PeerId, mapped: bool) -> Result<bool> {
        let sm_ok = self.peer(peer)?.sm_ok;
        let Some(e) = self.engine.as_mut() else {
            return Ok(false);
        };
        if !mapped || !sm_ok {
            return Ok(false);
        }
        if e.ready()? {
            return Ok(true);
        }
        e.start()?;
        Ok(false)
    }

    /// Waits for the peer's SM-engine jobs: before its copy engine stream takes over, and in
    /// a flush.
    pub(super) fn drain_sm(&mut self, peer: PeerId) -> Result<()> {
        let last = self.peer(peer)?.sm_last;
        if let Some(e) = &self.engine {
            if e.done() < last {
                let t = self.stats.start();
                e.wait(last, "P2P puts by the SM copy engine")?;
                Stats::add(&mut self.stats.sm_waits, t);
            }
        }
        Ok(())
    }

    /// Waits for the peer's copy-engine stream: before the SM engine takes over, and in a
    /// flush.
    pub(super) fn drain_ce(&mut self, peer: PeerId) -> Result<()> {
        let t = self.stats.start();
        let p = self.peer(peer)?;
        let rank = p.rank;
        if p.ce.drain(rank)? {
            Stats::add(&mut self.stats.flushes, t);
        }
        Ok(())
    }

    /// Posts the put (and `flag` after it) as one SM-engine job if the engine may carry it:
    /// device memory on both ends, 16-byte aligned (the kernel copies 16-byte words), at most
    /// `max_bytes`. False: nothing was done.
    pub(super) fn sm_put(
        &mut self,
        peer: PeerId,
        put: &PutTarget,
        flag: Option<(u64, u64)>,
    ) -> Result<bool> {
        let small = self
            .engine
            .as_ref()
            .is_some_and(|e| put.size <= e.max_bytes);
        if !(put.d2d
            && small
            && (put.dst | put.src) % 16 == 0
            && self.sm_route(peer, put.mapped)?)
        {
            return Ok(false);
        }
        self.drain_ce(peer)?;
        self.sm_post(peer, (put.dst, put.src, put.size), flag)?;
        Ok(true)
    }

    /// Posts a job for `peer` (`sm_route` said yes) and records it as the peer's last.
    pub(super) fn sm_post(
        &mut self,
        peer: PeerId,
        (dst, src, size): (u64, u64, u64),
        flag: Option<(u64, u64)>,
    ) -> Result<()> {
        let done = self.claim(None);
        let e = self.engine.as_mut().expect("sm_route said yes");
        let k = e.post((dst, src, size), flag, done)?;
        let p = self.peer(peer)?;
        p.sm_last = k;
        p.sm_flag |= flag.is_some();
        Ok(())
    }

    /// Queues the put on the peer's copy-engine stream (after the peer's SM jobs).
    pub(super) fn ce_put(&mut self, peer: PeerId, put: &PutTarget) -> Result<()> {
        self.drain_sm(peer)?;
        let t = self.stats.start();
        self.peer(peer)?.ce.copy(put)?;
        Stats::add(&mut self.stats.copies, t);
        Ok(())
    }

    /// Queues the flag on the peer's stream, after its data (and after the peer's SM jobs and
    /// their flags: the signal count must never step back).
    pub(super) fn ce_flag(&mut self, peer: PeerId, flag: &FlagTarget) -> Result<()> {
        self.drain_sm(peer)?;
        if self.peer(peer)?.sm_flag {
            if let Some(e) = self.engine.as_mut() {
                e.order_flags()?;
            }
            self.peer(peer)?.sm_flag = false;
        }
        let t = self.stats.start();
        let p = peer_mut(&mut self.peers, peer)?;
        p.ce.flag(&mut self.mode, self.device, flag)?;
        Stats::add(&mut self.stats.values, t);
        Ok(())
    }

    /// The value the work queued next for the current trigger may store into the done word
    /// (0: none), recorded as claimed: `ticket + 1` (none before the first trigger), "every
    /// trigger up to this one has completed", which holds once that work has only if every earlier trigger's work is
    /// ordered before it: earlier SM-engine jobs are (the engine runs jobs in order), except
    /// for work queued on a copy-engine stream (`ce_peer`: this stream's own earlier work is
    /// ordered too). So: no other busy stream, and for a stream store no unfinished engine job.
    fn claim(&mut self, ce_peer: Option<PeerId>) -> u64 {
        self.claim_below(self.done.through_current(), ce_peer)
    }

    /// As `claim`, for "every trigger below `v` has completed".
    pub(super) fn claim_below(&mut self, v: u64, ce_peer: Option<PeerId>) -> u64 {
        // Called for every engine job: no allocation (the peers' flags as an iterator).
        let busy = self.peers.iter().map(|p| p.ce.dirty());
        let engine_idle = self.engine.as_ref().is_none_or(|e| e.idle());
        self.done.claim_below(v, busy, ce_peer, engine_idle)
    }

    /// After copy-engine work for `peer` was queued for the current trigger: queues the done
    /// word's store (`Endpoint::use_done_word`) behind it on the same stream, if every earlier
    /// trigger's work is then ordered before it: no other peer's stream may still be busy and
    /// no SM-engine job still running. Otherwise the producers' flush() waits for the proxy.
    pub(super) fn ce_done(&mut self, peer: PeerId) -> Result<()> {
        if self.mode != FlagMode::WriteValue {
            return Ok(());
        }
        let value = self.claim(Some(peer));
        if value == 0 {
            return Ok(());
        }
        let t = self.stats.start();
        let word = self.done.word;
        self.peer(peer)?.ce.write_done(word, value)?;
        Stats::add(&mut self.stats.values, t);
        Ok(())
    }
}
