//! The receiver's side of staging: records taken from the inbox in order, checked, queued on
//! the copier, and acknowledged to the writer once their copies are complete.

use super::Net;
use super::{Kind, Record, Staging};
use crate::error::{Error, Result};
use crate::transport::net::ops::Op;
use crate::transport::net::order::FlagOrder;
use crate::transport::net::regions::{range_ok, Backing};

/// Records applied per channel per call, so one busy peer cannot starve the others.
const APPLY_BATCH: usize = 64;

impl Staging {
    /// `Endpoint::poll_incoming`: applies what has arrived, if this endpoint has an inbox.
    pub fn poll_incoming(&mut self, net: &mut Net<'_>) -> Result<()> {
        if self.chans.iter().any(|c| c.incoming.is_some()) {
            self.apply_incoming(net)?;
        }
        Ok(())
    }

    /// Applies the records that have arrived on every channel and acknowledges completed ones
    /// (the receiver's half of the protocol; see the module doc).
    pub(super) fn apply_incoming(&mut self, net: &mut Net<'_>) -> Result<()> {
        for ci in 0..self.chans.len() {
            if self.chans[ci].incoming.is_some() {
                self.apply_chan(net, ci)?;
                self.acknowledge(net, ci)?;
            }
        }
        Ok(())
    }

    fn apply_chan(&mut self, net: &mut Net<'_>, ci: usize) -> Result<()> {
        let mut taken = 0;
        // Ends at the first record that has not (fully) arrived, or after APPLY_BATCH records.
        while taken < APPLY_BATCH {
            let Some(inc) = self.chans[ci].incoming.as_ref() else {
                return Ok(());
            };
            let Some(rec) = inc.peek() else { break };
            self.apply_record(net, ci, &rec)?;
            net.ops.stats.records_applied += 1;
            if let Some(inc) = self.chans[ci].incoming.as_mut() {
                inc.read += 1;
            }
            taken += 1;
        }
        if taken > 0 {
            let t = self.copier(net.ops)?.mark()?;
            if let Some(inc) = self.chans[ci].incoming.as_mut() {
                inc.pending.push_back((inc.read, t));
            }
        }
        Ok(())
    }

    /// Validates one record against the region table and the ring, then queues it.
    fn apply_record(&mut self, net: &mut Net<'_>, ci: usize, rec: &Record) -> Result<()> {
        let rank = self.chans[ci].rank;
        let bad = |why: String| Error::remote(format!("rank {rank}: staged write refused: {why}"));
        let Some(r) = net.regions.exported(rec.region as usize) else {
            return Err(bad(format!(
                "record {} names unknown region {}",
                rec.seq, rec.region
            )));
        };
        let (addr, len, backing) = (r.region.addr, r.region.len, r.backing);
        match rec.kind {
            Kind::Data => {
                if backing != Backing::Staged {
                    return Err(bad(format!("region {} is not staged", rec.region)));
                }
                if rec.arg == 0 || !range_ok(rec.off, rec.arg, len) {
                    return Err(bad(format!(
                        "range [{}, {}+{}) outside the {len}-byte region",
                        rec.off, rec.off, rec.arg
                    )));
                }
                let Some(inc) = self.chans[ci].incoming.as_ref() else {
                    return Err(Error::internal("applying without an inbox"));
                };
                if !range_ok(rec.ring_pos, rec.arg, inc.ring.len() as u64) {
                    return Err(bad(format!(
                        "ring range [{}, {}+{}) outside the {}-byte ring",
                        rec.ring_pos,
                        rec.ring_pos,
                        rec.arg,
                        inc.ring.len()
                    )));
                }
                // SAFETY: within the ring (checked above).
                let from = unsafe { inc.ring.ptr().add(rec.ring_pos as usize) };
                let c = self.copier(net.ops)?;
                // SAFETY: the destination range lies in a registered staged region (checked
                // above), which its user must keep alive while connected; the ring bytes stay
                // unchanged until we acknowledge this record, which we do only once the copy's
                // ticket is done (`acknowledge`); the ring lives until the copier is drained.
                unsafe { c.copy_in(addr + rec.off, from, rec.arg) }
            }
            Kind::Value => {
                if !matches!(backing, Backing::Staged | Backing::Hmem(..)) {
                    return Err(bad(format!(
                        "region {} takes no relayed values",
                        rec.region
                    )));
                }
                if rec.off % 8 != 0 || !range_ok(rec.off, 8, len) {
                    return Err(bad(format!(
                        "value at {} outside (or unaligned in) the {len}-byte region",
                        rec.off
                    )));
                }
                if let Backing::Hmem(_, d) = backing {
                    // The NIC wrote the data before this record (ordering); make those writes
                    // visible to the device's kernels before the value can be seen. A flush
                    // that fails fails the endpoint: the value is never stored without it.
                    (self.gdr_flush)(d).map_err(|e| {
                        Error::remote(format!(
                            "rank {rank}: GPUDirect RDMA flush of CUDA device {d} before a relayed value failed: {e}"
                        ))
                    })?;
                    net.ops.stats.gdr_flushes += 1;
                }
                let c = self.copier(net.ops)?;
                // SAFETY: an aligned word inside a registered region (checked above), which
                // the local waiter reads atomically.
                unsafe { c.value_in(addr + rec.off, rec.arg) }
            }
        }
    }

    /// Reports completed records to the writer (one 8-byte write of the count into its credit
    /// word), once per change.
    fn acknowledge(&mut self, net: &mut Net<'_>, ci: usize) -> Result<()> {
        let peer = self.chans[ci].peer;
        // Completed tickets, oldest first; ends at the first incomplete one or an empty queue.
        while let Some(&(seq, t)) = self.chans[ci]
            .incoming
            .as_ref()
            .and_then(|i| i.pending.front())
        {
            if !self.copier(net.ops)?.done(t)? {
                break;
            }
            if let Some(inc) = self.chans[ci].incoming.as_mut() {
                inc.complete = seq;
                inc.pending.pop_front();
            }
        }
        let Some(inc) = self.chans[ci].incoming.as_mut() else {
            return Ok(());
        };
        if inc.complete == inc.reported {
            return Ok(());
        }
        // Two acknowledgements in flight land in either order where the plan does not order
        // one 8-byte write after another, and the older count would then overwrite the newer
        // one in the credit word: one at a time then (under such a plan it carries
        // FI_DELIVERY_COMPLETE, so completed means arrived; a later call sends the newest
        // count), or fenced.
        let fence = match net.ops.plan.after(8) {
            FlagOrder::Plain => false,
            FlagOrder::Fence => true,
            FlagOrder::Drain if net.peers[peer].acks_in_flight > 0 => return Ok(()),
            FlagOrder::Drain => false,
        };
        let n = inc.complete;
        inc.reported = n;
        let Some(credit) = net.peers[peer].remote_chan.map(|c| c.credit) else {
            return Err(Error::remote(format!(
                "rank {} writes staged records but offered no credit word",
                self.chans[ci].rank
            )));
        };
        net.post(&Op {
            internal: true,
            ack: true,
            fence,
            ..Op::inline(peer, &n.to_ne_bytes(), credit.base, credit.key)
        })
    }
}
