//! The peers of one endpoint: our address, the peer table and its address vector entries, and
//! per peer what ordering and flushing need to know (writes in flight, the completed prefix,
//! queued flags). A table: what is posted from it lives in `flush.rs`.

use super::blob::{AddrBlob, ChanBlob, MrBlob};
use super::fabric::Objects;
use super::mr;
use super::select;
use crate::error::{Error, Result};
use crate::transport::PeerId;
use libfabric_sys as fi;
use std::collections::{BTreeSet, VecDeque};
use std::ops::{Index, IndexMut};

/// A flag that waits for the writes posted to its peer before it (`Peers::defer_flag`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Deferred {
    /// The peer's write sequence number it waits for: posted once every write up to it has
    /// completed (`Peer::done_upto`).
    pub after: u64,
    pub value: u64,
    pub raddr: u64,
    pub key: u64,
}

/// One peer (`Endpoint::add_peer`).
pub(super) struct Peer {
    pub rank: usize,
    pub addr: fi::fi_addr_t,
    raw: Vec<u8>,
    /// The peer's scratch word: target of flush markers.
    pub scratch: MrBlob,
    /// Posted operations to this peer whose completion has not been read yet.
    pub outstanding: usize,
    /// A write without FI_DELIVERY_COMPLETE was posted since the last delivery marker: a
    /// flush must post a marker before its completions mean "arrived".
    pub unconfirmed: bool,
    /// The largest write posted to the peer since every earlier one was known to be ordered
    /// before the next (all completed under a drain plan, or a fenced write posted): what
    /// `order::Plan::after` orders the next flag, record or marker after.
    pub largest_since_drain: u64,
    /// Staging acknowledgements to the peer not completed yet (`staging::apply`).
    pub acks_in_flight: u32,
    /// Writes posted to the peer so far: the sequence number of the latest.
    pub next_seq: u64,
    /// Every write up to this sequence number has completed; `done_ahead` holds the later
    /// ones that completed out of order.
    pub done_upto: u64,
    done_ahead: BTreeSet<u64>,
    /// Flags waiting for the writes before them, oldest first (`defer_flag`).
    pub deferred: VecDeque<Deferred>,
    /// Our staging channel for this peer (index into `Staging::chans`), once `link_for` made
    /// it.
    pub chan: Option<usize>,
    /// The staging channel the peer keeps for us (from its link, `link_to`).
    pub remote_chan: Option<ChanBlob>,
    /// The peer's link arrived (`link_to`).
    pub linked: bool,
    /// The last user write to the peer was a staging record: once the peer acknowledges it,
    /// every earlier write has arrived (no delivery marker needed).
    pub last_was_record: bool,
    /// Signals counted by the receiver (`counted.rs`): the epochs of our writes to the peer
    /// (the counts of its writes to us are kept by stream, `Peers::stream_counts`).
    pub epochs: super::counted::Epochs,
}

impl Peer {
    /// Write `seq` to the peer completed: advances the completed prefix (`done_upto`).
    pub fn completed(&mut self, seq: u64) {
        if seq != self.done_upto + 1 {
            self.done_ahead.insert(seq);
            return;
        }
        self.done_upto = seq;
        // Ends at the first sequence number not completed yet (the set is finite).
        while self.done_ahead.remove(&(self.done_upto + 1)) {
            self.done_upto += 1;
        }
    }
}

/// The peer table (`PeerId` indexes it) and our own address.
pub(super) struct Peers {
    /// The address blob of this endpoint (`Endpoint::address`).
    pub me: AddrBlob,
    list: Vec<Peer>,
    /// By stream number (`stream_for`): the peer, and the counts of its writes to us.
    streams: Vec<(PeerId, super::counted::Counts)>,
}

impl Index<PeerId> for Peers {
    type Output = Peer;
    fn index(&self, p: PeerId) -> &Peer {
        &self.list[p]
    }
}

impl IndexMut<PeerId> for Peers {
    fn index_mut(&mut self, p: PeerId) -> &mut Peer {
        &mut self.list[p]
    }
}

impl Peers {
    pub fn new(me: AddrBlob) -> Self {
        Peers {
            me,
            list: Vec::new(),
            streams: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn get(&self, p: PeerId) -> Option<&Peer> {
        self.list.get(p)
    }

    pub fn get_mut(&mut self, p: PeerId) -> Option<&mut Peer> {
        self.list.get_mut(p)
    }

    /// The peer of rank `rank`, if added.
    #[cfg(test)]
    pub fn of_rank(&self, rank: usize) -> Option<PeerId> {
        self.list.iter().position(|p| p.rank == rank)
    }

    /// Our stream number for `peer` (made on first call, for the link we make for it): the
    /// peer's writes name it in their tags (`counted.rs`). None once `counted::STREAMS` peers
    /// have one.
    pub fn stream_for(&mut self, peer: PeerId) -> Option<u8> {
        if let Some(s) = self.streams.iter().position(|x| x.0 == peer) {
            return Some(s as u8);
        }
        if self.streams.len() == super::counted::STREAMS {
            return None;
        }
        self.streams.push((peer, Default::default()));
        Some((self.streams.len() - 1) as u8)
    }

    /// The rank of the peer whose writes name stream `s`, and the counts of its writes.
    pub fn stream_counts(&mut self, s: u8) -> Option<(usize, &mut super::counted::Counts)> {
        let (p, counts) = self.streams.get_mut(usize::from(s))?;
        Some((self.list[*p].rank, counts))
    }

    /// Takes `peer`'s link (`blob::LinkBlob`): the channel it keeps for us and the stream our
    /// tags name there. Once only, before anything was written to the peer; the same link again
    /// (a second connection between the same two endpoints) changes nothing.
    pub fn link_to(
        &mut self,
        peer: PeerId,
        chan: Option<ChanBlob>,
        stream: Option<u8>,
    ) -> Result<()> {
        let p = &mut self.list[peer];
        if p.linked {
            if p.remote_chan != chan || p.epochs.stream != stream {
                return Err(Error::remote(format!(
                    "rank {}: a second, different link from the same endpoint",
                    p.rank
                )));
            }
            return Ok(());
        }
        if p.next_seq != 0 {
            return Err(Error::internal(format!(
                "rank {}: its link arrived after writes to it",
                p.rank
            )));
        }
        p.remote_chan = chan;
        p.epochs = super::counted::Epochs::new(stream);
        p.linked = true;
        Ok(())
    }

    /// The peer's scratch word (flush markers; lone counted signals, `counted.rs`).
    pub fn scratch(&self, p: PeerId) -> MrBlob {
        self.list[p].scratch
    }

    /// `rank N` for errors and logs.
    pub fn name(&self, p: PeerId) -> String {
        self.list
            .get(p)
            .map_or_else(|| format!("peer {p}"), |x| format!("rank {}", x.rank))
    }

    /// `Endpoint::add_peer`: validates the peer's address against ours and inserts it into the
    /// address vector of `objs`. A peer is an endpoint, not a rank: a rank whose two endpoints
    /// talk to us is two peers, each with its own address vector entry, link and counts.
    /// Returns the peer and whether it is new (an address seen before returns the same peer).
    pub fn add(
        &mut self,
        objs: &Objects,
        who: &str,
        policy: &mr::Policy,
        remote_rank: usize,
        address: &[u8],
    ) -> Result<(PeerId, bool)> {
        let a = AddrBlob::decode(address, policy.virt_addr, policy.key_size)
            .map_err(|e| Error::remote(format!("rank {remote_rank}: {e}")))?;
        if a.provider != self.me.provider || a.addr_format != self.me.addr_format {
            return Err(Error::invalid_arg(format!(
                "rank {remote_rank} uses libfabric provider {} (address format {}) but this endpoint is {} (format {}): set MSCCLPP_NET_PROVIDER / ibDev alike on every rank",
                a.provider, a.addr_format, who, self.me.addr_format
            )));
        }
        let mut raw = a.raw;
        if self.me.addr_format == fi::FI_ADDR_STR {
            // A C string: no interior NUL, terminated.
            let body = raw.strip_suffix(&[0]).unwrap_or(&raw);
            if body.is_empty() || body.contains(&0) {
                return Err(Error::remote(format!(
                    "rank {remote_rank}: malformed string address"
                )));
            }
            raw = [body, &[0]].concat();
        } else if raw.len() != self.me.raw.len() {
            return Err(Error::remote(format!(
                "rank {remote_rank}: address of {} bytes, this provider's are {}",
                raw.len(),
                self.me.raw.len()
            )));
        }
        let fmt = self.me.addr_format;
        let (here_lo, there_lo) = (
            select::is_loopback(fmt, &self.me.raw),
            select::is_loopback(fmt, &raw),
        );
        if here_lo != there_lo {
            return Err(Error::invalid_arg(format!(
                "rank {remote_rank} listens on a {} address but this endpoint ({}) on a {} one: ranks on different hosts need a routable interface: set MSCCLPP_NET_IFACE (or MSCCLPP_NET_ADDR, or pass ibDev) on every rank",
                if there_lo { "loopback" } else { "non-loopback" },
                who,
                if here_lo { "loopback" } else { "non-loopback" },
            )));
        }
        if let Some(i) = self.list.iter().position(|p| p.raw == raw) {
            if self.list[i].rank != remote_rank {
                return Err(Error::remote(format!(
                    "rank {remote_rank} gave the address of rank {}'s endpoint",
                    self.list[i].rank
                )));
            }
            // Several connections between the same two endpoints: one peer.
            return Ok((i, false));
        }
        let addr = objs.av_insert(&raw, &format!("rank {remote_rank}"))?;
        self.list.push(Peer {
            rank: remote_rank,
            addr,
            raw,
            scratch: a.scratch,
            outstanding: 0,
            unconfirmed: false,
            largest_since_drain: 0,
            acks_in_flight: 0,
            next_seq: 0,
            done_upto: 0,
            done_ahead: BTreeSet::new(),
            deferred: VecDeque::new(),
            chan: None,
            remote_chan: None,
            linked: false,
            last_was_record: false,
            epochs: super::counted::Epochs::new(None),
        });
        Ok((self.list.len() - 1, true))
    }
}
