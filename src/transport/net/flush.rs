//! What a flush and a flag rest on, for one peer: ordering a flag, staging record or marker after
//! the peer's earlier writes (`order::Plan`), the queue of flags waiting for those writes
//! (`Peers::defer_flag`, posted by `post_ready`), the delivery marker, and the bounded waits.
//! Above `ops` and `peers`, which it joins: the peer table itself posts nothing.

use super::ops::{Op, Ops};
use super::order::FlagOrder;
use super::peers::{Deferred, Peers};
use crate::error::Result;
use crate::transport::PeerId;

impl Peers {
    /// Orders the next write to `peer` (a flag or a staging record) after every earlier one,
    /// as `ops.plan` says for the largest of them since the last drain: nothing, FI_FENCE on
    /// it (returns true), or wait until every earlier write has completed (those the plan
    /// does not order carried FI_DELIVERY_COMPLETE, so they have arrived).
    pub fn order_before_flag(&mut self, ops: &mut Ops, peer: PeerId) -> Result<bool> {
        match ops.plan.after(self[peer].largest_since_drain) {
            FlagOrder::Plain => Ok(false),
            FlagOrder::Fence => Ok(true),
            FlagOrder::Drain => {
                ops.stats.order_drains += 1;
                self.wait_completed(ops, peer)?;
                Ok(false)
            }
        }
    }

    /// Queues flag `d` (its `after` set here) behind the writes to `peer` posted so far, where
    /// the plan would drain before it, or where earlier flags wait already (the flags keep
    /// their order): the proxy serves everything else meanwhile, and `post_ready` posts it once
    /// those writes have completed (the unordered ones carried FI_DELIVERY_COMPLETE, so they
    /// have arrived). False: post it now, ordered as `order_before_flag` says.
    pub fn defer_flag(&mut self, ops: &mut Ops, peer: PeerId, mut d: Deferred) -> bool {
        let p = &mut self[peer];
        let drain = ops.plan.after(p.largest_since_drain) == FlagOrder::Drain;
        if !drain && p.deferred.is_empty() {
            return false;
        }
        d.after = p.next_seq;
        p.deferred.push_back(d);
        ops.stats.deferred_flags += 1;
        true
    }

    /// Posts `peer`'s deferred flags whose writes before them have all completed, oldest
    /// first. Where one 8-byte write is not ordered after another, the next flag also waits
    /// for the one just posted (an older count landing last would step the count back).
    pub fn post_ready(&mut self, ops: &mut Ops, peer: PeerId) -> Result<()> {
        // Ends when the queue is empty or its oldest flag still waits.
        while let Some(mut d) = self[peer].deferred.front().copied() {
            if d.after > self[peer].done_upto {
                return Ok(());
            }
            self[peer].deferred.pop_front();
            // Later flags into the same word that are ready too: only the newest count goes
            // (counts only grow, and its writes before it include theirs), one write instead
            // of several, each of which would wait for the one before it where 8-byte writes
            // are not ordered. Ends at the first flag not ready or into another word.
            while let Some(n) = self[peer].deferred.front().copied() {
                if n.after > self[peer].done_upto || (n.raddr, n.key) != (d.raddr, d.key) {
                    break;
                }
                self[peer].deferred.pop_front();
                d = n;
                ops.stats.coalesced_flags += 1;
            }
            ops.post(
                self,
                &Op::inline(peer, &d.value.to_ne_bytes(), d.raddr, d.key),
            )?;
            if ops.plan.after(8) != FlagOrder::Plain {
                let posted = self[peer].next_seq;
                if let Some(next) = self[peer].deferred.front_mut() {
                    next.after = next.after.max(posted);
                }
            }
        }
        Ok(())
    }

    /// `post_ready` for every peer with deferred flags.
    pub fn post_ready_all(&mut self, ops: &mut Ops) -> Result<()> {
        for p in 0..self.len() {
            if !self[p].deferred.is_empty() {
                self.post_ready(ops, p)?;
            }
        }
        Ok(())
    }

    /// Waits (bounded) until every write to `peer` has arrived (`flush` without the staging
    /// acknowledgements; see the module doc for what "arrived" rests on): posts its deferred
    /// flags as they become ready, then the marker, then waits for every completion.
    pub fn drain_writes(&mut self, ops: &mut Ops, peer: PeerId) -> Result<()> {
        self.post_deferred(ops, peer, |n, rank| {
            format!("{n} signals to rank {rank} wait for the writes before them to complete: no completion (is the peer's proxy running?)")
        })?;
        self.post_marker(ops, peer)?;
        self.wait_completed(ops, peer)
    }

    /// Waits (bounded) until every flag queued for `peer` is posted: each waits for the
    /// completions of the writes before it, which the wait reads. `what(queued, rank)` names
    /// the wait in its error.
    pub fn post_deferred(
        &mut self,
        ops: &mut Ops,
        peer: PeerId,
        what: impl Fn(usize, usize) -> String,
    ) -> Result<()> {
        ops.wait_until(
            self,
            |ops, peers| {
                peers.post_ready(ops, peer)?;
                Ok(peers[peer].deferred.is_empty().then_some(()))
            },
            |peers| what(peers[peer].deferred.len(), peers[peer].rank),
        )
    }

    /// Waits (bounded) until every write posted to `peer` has completed.
    fn wait_completed(&mut self, ops: &mut Ops, peer: PeerId) -> Result<()> {
        ops.wait_until(
            self,
            |_, peers| Ok((peers[peer].outstanding == 0).then_some(())),
            |peers| {
                format!(
                    "waiting for {} writes to rank {} to complete: no completion (is the peer's proxy running?)",
                    peers[peer].outstanding, peers[peer].rank
                )
            },
        )
    }

    /// Where the last write to `peer` was a plain one, posts the delivery marker after it:
    /// once every write to the peer has completed, all of them have arrived.
    pub fn post_marker(&mut self, ops: &mut Ops, peer: PeerId) -> Result<()> {
        if ops.delivery_complete && self[peer].unconfirmed {
            // The marker: ordered after every earlier write to the peer as the plan says
            // (plain, fenced; under a drain plan the writes it does not follow in order
            // carried FI_DELIVERY_COMPLETE themselves, and the flush waits for them too), and
            // its completion waits for delivery, so all of them have arrived when the flush's
            // wait ends.
            let sc = self[peer].scratch;
            let fence = ops.plan.after(self[peer].largest_since_drain) == FlagOrder::Fence;
            ops.post(
                self,
                &Op {
                    fence,
                    confirm: true,
                    ..Op::inline(peer, &0u64.to_ne_bytes(), sc.base, sc.key)
                },
            )?;
        }
        Ok(())
    }
}
