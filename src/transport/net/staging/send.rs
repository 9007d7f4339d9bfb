//! The writer's side of staging: data into the peer's ring and records into its inbox, bounded
//! by the peer's acknowledgements, which a flush and a direct flag wait for.

use super::{Kind, Record, Staging, RECORD_BYTES};
use crate::error::{Error, Result};
use crate::sync::Backoff;
use crate::transport::net::blob::MrBlob;
use crate::transport::net::ops::{provider_wait, Op};
use crate::transport::net::peers::Peers;
use crate::transport::net::Net;
use crate::transport::{MrId, PeerId};

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
        wait.get_or_insert_with(|| provider_wait(limit)).step(|| {
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
        let desc = net.ops.inline_desc;
        net.post(&Op {
            peer,
            local: 0,
            len: RECORD_BYTES as u64,
            desc,
            raddr: inbox.base + ((seq - 1) % slots) * RECORD_BYTES as u64,
            key: inbox.key,
            fence,
            confirm: false,
            inline: Some(&bytes),
            bounce: None,
            internal: false,
        })?;
        self.chans[ci].out.sent = seq;
        net.peers[peer].last_was_record = true;
        Ok(seq)
    }

    /// Writes `size` bytes of local region `src` at `src_off` into the peer's staged region
    /// `remote` at `dst_off`: data into its ring, then a record per chunk.
    #[allow(clippy::too_many_arguments)] // `Endpoint::write`'s arguments, and the endpoint's parts
    pub fn write_staged(
        &mut self,
        net: &mut Net<'_>,
        peer: PeerId,
        src: MrId,
        src_off: u64,
        remote: MrBlob,
        dst_off: u64,
        size: u64,
    ) -> Result<()> {
        let (ci, _, ring) = self.out_chan(net.peers, peer)?;
        let chunk = self.source_chunk(net, src, (ring.len / 4).max(1))?;
        let mut done = 0;
        while done < size {
            let n = (size - done).min(chunk);
            let mut wait = None;
            // Ends when the ring has room (acknowledgements free it), on an error, or at the
            // deadline.
            let pos = loop {
                let c = self.chans[ci].credit();
                self.chans[ci].out.ack(c);
                if let Some(p) = self.chans[ci].out.alloc(ring.len, n) {
                    break p;
                }
                self.ack_step(net, ci, &mut wait, "waiting for room in the staging ring")?;
            };
            self.post_from(net, peer, src, src_off + done, n, ring.base + pos, ring.key)?;
            let seq = self.post_record(
                net,
                peer,
                Record {
                    seq: 0,
                    kind: Kind::Data,
                    region: remote.id,
                    off: dst_off + done,
                    arg: n,
                    ring_pos: pos,
                },
            )?;
            self.chans[ci].out.data_sent(seq);
            done += n;
        }
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
