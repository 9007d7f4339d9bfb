//! One staging channel's state: the writer's side (records sent and acknowledged, ring space in
//! use) and the receiver's side (its inbox, ring and the records being applied).

use crate::mem::HostBlock;
use crate::transport::net::blob::ChanBlob;
use crate::transport::net::record::{Record, RECORD_BYTES};
use crate::transport::staging::StageMem;
use crate::transport::PeerId;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering as AtOrd};

/// Ring allocations are rounded up to this (cache lines: no two chunks share one).
const RING_ALIGN: u64 = 64;

/// The writer's side of one channel: records posted to the peer's inbox and ring space used.
#[derive(Debug, Default)]
pub(crate) struct Outgoing {
    /// Records posted so far (the last one has seq `sent`).
    pub sent: u64,
    /// Records the peer has acknowledged (applied and complete).
    pub acked: u64,
    /// Ring bytes allocated / freed, monotonic (positions are modulo the ring length).
    head: u64,
    tail: u64,
    /// (seq, `head` after its data) of every unacknowledged data record, oldest first.
    ends: VecDeque<(u64, u64)>,
}

impl Outgoing {
    /// Takes an acknowledgement count read from the credit word into account and frees the
    /// ring space of acknowledged data records. Counts only grow; one beyond `sent` (a peer
    /// bug) is capped.
    pub fn ack(&mut self, acked: u64) {
        if acked <= self.acked {
            return;
        }
        self.acked = acked.min(self.sent);
        while let Some(&(seq, end)) = self.ends.front() {
            if seq > self.acked {
                break;
            }
            self.tail = end;
            self.ends.pop_front();
        }
    }

    /// Room for `n` bytes (`n <= len / 2`) in a ring of `len` bytes: the position, or None
    /// until more is acknowledged. A chunk never wraps: the rest of the ring is skipped.
    pub fn alloc(&mut self, len: u64, n: u64) -> Option<u64> {
        let need = n.next_multiple_of(RING_ALIGN);
        let pos = self.head % len;
        let skip = if pos + need > len { len - pos } else { 0 };
        if self.head + skip + need - self.tail > len {
            return None;
        }
        self.head += skip;
        let p = self.head % len;
        self.head += need;
        Some(p)
    }

    /// Remembers that the data of record `seq` ends at the current head.
    pub fn data_sent(&mut self, seq: u64) {
        self.ends.push_back((seq, self.head));
    }

    pub fn room_for_record(&self, slots: u64) -> bool {
        self.sent - self.acked < slots
    }
}

/// The receiver's side of one channel.
pub(crate) struct Incoming {
    pub(super) inbox: HostBlock,
    pub(super) ring: StageMem,
    pub(super) slots: u64,
    /// Records taken so far: the next one has seq `read + 1`.
    pub(super) read: u64,
    /// (seq, copier ticket): records up to seq are complete once the ticket is.
    pub(super) pending: VecDeque<(u64, u64)>,
    /// Records complete, and the count last reported to the writer.
    pub(super) complete: u64,
    pub(super) reported: u64,
}

impl Incoming {
    /// The next record, if it has fully arrived.
    pub(super) fn peek(&self) -> Option<Record> {
        let slot = (self.read % self.slots) as usize;
        let mut w = [0u64; 8];
        for (i, x) in w.iter_mut().enumerate() {
            // SAFETY: slot < slots and the inbox holds slots * RECORD_BYTES bytes, 64-aligned;
            // the peer (its provider, in our progress or by DMA) writes them, hence atomics.
            // Acquire pairs with nothing in Rust: the writer is the provider; the load only has
            // to be a fresh read, and the check word rejects a record that is still arriving.
            *x = unsafe {
                AtomicU64::from_ptr(self.inbox.ptr().add(slot * RECORD_BYTES + i * 8).cast())
            }
            .load(AtOrd::Acquire);
        }
        Record::decode(&w).filter(|r| r.seq == self.read + 1)
    }
}

/// Everything this endpoint keeps for one peer endpoint.
pub(crate) struct Chan {
    /// The peer's rank (for messages).
    pub rank: usize,
    /// The peer it is kept for, whose records it takes and to whom it acknowledges them.
    pub peer: PeerId,
    /// Our acknowledgement count from the peer; written by the peer only.
    pub(super) credit: HostBlock,
    pub blob: ChanBlob,
    pub incoming: Option<Incoming>,
    pub out: Outgoing,
}

impl Chan {
    pub(super) fn credit(&self) -> u64 {
        // SAFETY: an 8-byte aligned word owned by this Chan. Acquire: the peer's write of the
        // count (posted only after its copies completed) is the pair; the count alone is what
        // we use, no data of the peer is read through it.
        unsafe { AtomicU64::from_ptr(self.credit.ptr().cast()) }.load(AtOrd::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_allocation_wraps_and_waits_for_acks() {
        let mut o = Outgoing::default();
        let len = 1024;
        // Four 200-byte chunks (256 each after alignment) fill the ring.
        let mut seqs = Vec::new();
        for k in 0..4 {
            let p = o.alloc(len, 200).expect("room");
            assert_eq!(p, k * 256);
            o.sent += 1;
            o.data_sent(o.sent);
            seqs.push(o.sent);
        }
        assert_eq!(o.alloc(len, 1), None, "full until acknowledged");
        o.ack(1);
        // 256 bytes free at the start; a 300-byte chunk does not fit there...
        assert_eq!(o.alloc(len, 300), None);
        // ...but 256 do, after wrapping.
        assert_eq!(o.alloc(len, 256), Some(0));
        o.sent += 1;
        o.data_sent(o.sent);
        o.ack(3);
        // Unacknowledged: seq 4 at [768, 1024), seq 5 at [0, 256); free: [256, 768).
        assert_eq!(o.alloc(len, 600), None);
        assert_eq!(o.alloc(len, 500), Some(256));
        // Acks never go back, nor beyond what was sent.
        o.ack(2);
        assert_eq!(o.acked, 3);
        o.ack(99);
        assert_eq!(o.acked, o.sent);
        assert!(o.room_for_record(1));
    }

    #[test]
    fn record_slots_bound_outstanding_records() {
        let mut o = Outgoing::default();
        for _ in 0..4 {
            assert!(o.room_for_record(4));
            o.sent += 1;
        }
        assert!(!o.room_for_record(4));
        o.ack(1);
        assert!(o.room_for_record(4));
    }
}
