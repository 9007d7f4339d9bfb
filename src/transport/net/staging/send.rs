//! The writer's side of staging: data into the peer's ring and records into its inbox, bounded
//! by the peer's acknowledgements, which a flush and a direct flag wait for.

use super::bounce::Source;
use super::Net;
use super::{Kind, Record, Staging, RECORD_BYTES};
use crate::error::{Error, Result};
use crate::sync::Backoff;
use crate::transport::net::blob::MrBlob;
use crate::transport::net::ops::{provider_wait, Op};
use crate::transport::net::peers::Peers;
use crate::transport::{MrId, PeerId};

/// Where a write's chunks go on the peer.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Dest {
    /// Straight into its registered memory at `base` (+ the chunk's offset in the write).
    Direct { base: u64, key: u64 },
    /// Into its staging ring, each chunk with a record that lands it at `dst_off` (+ the
    /// chunk's offset) in its staged region `remote`.
    Staged { remote: MrBlob, dst_off: u64 },
}

impl Staging {
    /// Our channel for `peer` and the peer's inbox and ring, or why staged writes to it are
    /// impossible.
    fn out_chan(&self, peers: &Peers, peer: PeerId) -> Result<(usize, MrBlob, MrBlob)> {
        let p = &peers[peer];
        let incoming = p.remote_chan.and_then(|c| c.incoming);
        match (p.chan, incoming) {
            (Some(ci), Some((inbox, ring))) => Ok((ci, inbox, ring)),
            _ => Err(Error::usage(format!(
                "rank {} stages this region, but the two endpoints did not exchange staging channels (addresses must come from address_for)",
                p.rank
            ))),
        }
    }

    /// One step of a wait for the peer's acknowledgements: reads our credit word, completes
    /// writes, applies incoming records (the peer may be waiting on ours), then backs off.
    fn ack_step(
        &mut self,
        net: &mut Net<'_>,
        ci: usize,
        wait: &mut Option<Backoff>,
        what: &str,
    ) -> Result<()> {
        let c = self.chans[ci].credit();
        self.chans[ci].out.ack(c);
        net.poll()?;
        self.apply_incoming(net)?;
        let (rank, limit) = (self.chans[ci].rank, net.ops.timeout);
        let (sent, acked) = (self.chans[ci].out.sent, self.chans[ci].out.acked);
        let w = wait.get_or_insert_with(|| provider_wait(limit));
        net.ops.pause(w, || {
            format!("{what}: rank {rank} has applied {acked} of our {sent} staged writes (is its proxy running?)")
        })
    }

    /// Waits (bounded) until the peer has acknowledged record `upto`.
    pub fn wait_acked(&mut self, net: &mut Net<'_>, ci: usize, upto: u64) -> Result<()> {
        let mut wait = None;
        // Ends when the count arrives, on an error, or at the deadline (`ack_step`).
        loop {
            let c = self.chans[ci].credit();
            self.chans[ci].out.ack(c);
            if self.chans[ci].out.acked >= upto {
                return Ok(());
            }
            self.ack_step(net, ci, &mut wait, "flush")?;
        }
    }

    /// Posts `rec` (its seq assigned here) into the peer's inbox, ordered after every earlier
    /// write to the peer; returns the seq.
    pub fn post_record(&mut self, net: &mut Net<'_>, peer: PeerId, mut rec: Record) -> Result<u64> {
        let (ci, inbox, _) = self.out_chan(net.peers, peer)?;
        let slots = inbox.len / RECORD_BYTES as u64;
        let mut wait = None;
        // Ends when a slot is free (the peer acknowledged the record that used it), on an
        // error, or at the deadline.
        while !self.chans[ci].out.room_for_record(slots) {
            self.ack_step(net, ci, &mut wait, "waiting for a free staging record slot")?;
        }
        let seq = self.chans[ci].out.sent + 1;
        rec.seq = seq;
        let bytes = rec.encode();
        let fence = net.order_before_flag(peer)?;
        let slot_addr = inbox.base + ((seq - 1) % slots) * RECORD_BYTES as u64;
        net.post(&Op {
            fence,
            ..Op::inline(peer, &bytes, slot_addr, inbox.key)
        })?;
        self.chans[ci].out.sent = seq;
        net.peers[peer].last_was_record = true;
        Ok(seq)
    }

    /// Writes `size` bytes of local region `src` at `src_off` to `dest` on the peer, chunk by
    /// chunk. Each chunk's copy out (a staged source) starts before the chunk ahead of it is
    /// posted, so the copies run while the wire is busy. Chunks stay as large as the ring and
    /// the bounce slots allow: a ramp of smaller first chunks, tried to shorten the one copy
    /// nothing overlaps, measured slower (bench/RESULTS.md, issue 15), each chunk costing a
    /// record, a copy and an event on both sides.
    pub fn write_chunks(
        &mut self,
        net: &mut Net<'_>,
        peer: PeerId,
        (src, src_off): (MrId, u64),
        size: u64,
        dest: Dest,
        cq_data: Option<u64>,
    ) -> Result<()> {
        let limit = match dest {
            Dest::Direct { .. } => u64::MAX,
            Dest::Staged { .. } => {
                let (_, _, ring) = self.out_chan(net.peers, peer)?;
                // Our chunk size, but never more than half the peer's ring (one chunk on the
                // wire while the peer copies the other out).
                match self.sizes.chunk {
                    Some(c) => c.min(ring.len / 2),
                    None => ring.len / 4,
                }
                .max(1)
            }
        };
        let max = self.source_chunk(net, src, limit)?;
        let mut plan = (0..size)
            .step_by(max as usize)
            .map(move |off| (off, max.min(size - off)));
        let Some((off, n)) = plan.next() else {
            return Ok(());
        };
        let mut cur = (off, n, self.prepare_source(net, src, src_off + off, n)?);
        // Ends after the last chunk of the plan, or at the first error.
        loop {
            let next = match plan.next() {
                None => None,
                Some((off, n)) => match self.prepare_source(net, src, src_off + off, n) {
                    Ok(s) => Some((off, n, s)),
                    Err(e) => {
                        self.abandon(net, cur.2);
                        return Err(e);
                    }
                },
            };
            let (off, n, source) = cur;
            // A signal rides on the last chunk (only into a direct destination: the caller).
            let data = if next.is_none() { cq_data } else { None };
            if let Err(e) = self.send_chunk(net, peer, &dest, (off, n), source, data) {
                if let Some((_, _, s)) = next {
                    self.abandon(net, s);
                }
                return Err(e);
            }
            match next {
                Some(c) => cur = c,
                None => return Ok(()),
            }
        }
    }

    /// Sends one prepared chunk (`off`: its offset in the write) to `dest`: directly, or into
    /// free space of the peer's ring followed by its record.
    fn send_chunk(
        &mut self,
        net: &mut Net<'_>,
        peer: PeerId,
        dest: &Dest,
        (off, n): (u64, u64),
        source: Source,
        cq_data: Option<u64>,
    ) -> Result<()> {
        let (remote, dst_off) = match *dest {
            Dest::Direct { base, key } => {
                return self.post_source(net, peer, source, (base + off, key), cq_data)
            }
            Dest::Staged { remote, dst_off } => (remote, dst_off),
        };
        let (ci, _, ring) = match self.out_chan(net.peers, peer) {
            Ok(c) => c,
            Err(e) => {
                self.abandon(net, source);
                return Err(e);
            }
        };
        let mut wait = None;
        let since = std::time::Instant::now();
        // Ends when the ring has room (acknowledgements free it), on an error, or at the
        // deadline.
        let pos = loop {
            let c = self.chans[ci].credit();
            self.chans[ci].out.ack(c);
            if let Some(p) = self.chans[ci].out.alloc(ring.len, n) {
                if wait.is_some() {
                    net.ops.stats.ring_waits.add(since);
                }
                break p;
            }
            if let Err(e) =
                self.ack_step(net, ci, &mut wait, "waiting for room in the staging ring")
            {
                self.abandon(net, source);
                return Err(e);
            }
        };
        debug_assert!(
            cq_data.is_none(),
            "signals ride only into direct destinations"
        );
        self.post_source(net, peer, source, (ring.base + pos, ring.key), None)?;
        let seq = self.post_record(
            net,
            peer,
            Record {
                seq: 0,
                kind: Kind::Data,
                region: remote.id,
                off: dst_off + off,
                arg: n,
                ring_pos: pos,
            },
        )?;
        self.chans[ci].out.data_sent(seq);
        net.ops.stats.staged_chunks += 1;
        net.ops.stats.staged_bytes += n;
        Ok(())
    }

    /// Whether records sent to `peer` are still unacknowledged (a direct flag to that peer
    /// must then wait, or it could overtake staged data).
    pub fn records_pending(&self, peers: &Peers, peer: PeerId) -> Option<(usize, u64)> {
        let ci = peers[peer].chan?;
        let o = &self.chans[ci].out;
        (o.sent > o.acked.max(self.chans[ci].credit())).then_some((ci, o.sent))
    }
}
