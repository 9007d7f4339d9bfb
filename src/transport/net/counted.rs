//! Signals counted by the receiver (docs/DESIGN.md 3.6), for a provider that orders no write
//! and carries only 4 bytes of remote CQ data, each write of it consuming a receive the target
//! posted (EFA's RDM endpoint). There a flag written after its data may land first, so without
//! this every signal waits in a queue until the peer has acknowledged every write before it
//! (`Peers::defer_flag`): a round trip per signal and a second write. Here every write to a
//! peer carries a 4-byte tag in its remote CQ data, and a signal is the tag of the write that
//! ends its put (or of an 8-byte write into the peer's scratch word, when alone): the receiver
//! counts the tagged writes it reads and applies a signal once every write posted before it
//! has been read. Nothing waits at the sender.
//!
//! The writes to one peer are cut into *epochs*: an epoch ends with a write whose tag says so
//! (a *closer*), carrying how many writes the epoch had and, for a signal, which word the
//! value goes into. Every other write's tag carries only its epoch. The receiver counts the
//! writes of each epoch; an epoch whose closer has arrived and whose count reached the
//! closer's is complete, and complete epochs are applied in order, so a signal applies after
//! every write before it has landed, whatever order they arrived in. The value is not in the
//! tag: counts into a word grow by one per signal (`proxy/work.rs`), so the receiver stores the
//! number of signals it applied into that word, and a store never moves a word back (a flush
//! writes the sender's latest count itself, which a late store then leaves alone).
//!
//! The tag names its writer: the receiver gives each peer rank a *stream* number when it
//! makes its address for that rank (`Endpoint::address_for`), and the writer puts it in every
//! tag. (FI_SOURCE would name the writer without it, but tcp;ofi_rxm 1.17 reports address 0
//! for every peer's CQ data: measured here, 4 ranks.) A peer without a stream number (more
//! than `STREAMS` ranks, or an address not made for us) gets no tags: its signals are flags
//! of their own, queued behind their data.
//!
//! Tag layout (32 bits): bit 31 closer; 30..24 the epoch's low 7 bits; 23..16 the stream;
//! closers only: 15..12 the epoch's write count (1..=15; an epoch reaching 15 writes is
//! closed by its 15th without a value), 11..0 the word: the receiver's region id (below 1024)
//! and the word's index in it (epoch blocks: below 4), `NO_WORD` for none.
//!
//! Why 7 bits of epoch are enough: the sender lets at most `OPEN_EPOCHS` epochs be open (a
//! write of theirs not yet complete) and every write carries FI_DELIVERY_COMPLETE on such a
//! provider (`order::Plan::needs_dc`), so when the receiver reads a write of epoch `e`, every
//! write of the epochs before `e - OPEN_EPOCHS` was already in its completion queue and read:
//! the epochs it has not applied are fewer than 128 and the low bits name one of them.
//!
//! Pure: the tags, the sender's epochs and the receiver's counts; the endpoint posts and reads.

use std::collections::VecDeque;

/// Bytes of remote CQ data the layout needs.
pub(super) const CQ_DATA_BYTES: u64 = 4;
const CLOSER: u32 = 1 << 31;
const EPOCH_SHIFT: u32 = 24;
const EPOCH_MASK: u32 = 0x7f;
const STREAM_SHIFT: u32 = 16;
/// Peer ranks an endpoint can number (`stream`'s 8 bits).
pub(super) const STREAMS: usize = 256;
const COUNT_SHIFT: u32 = 12;
/// The most writes of one epoch (its count field is 4 bits).
pub(super) const MAX_COUNT: u32 = 15;
const WORD_MASK: u32 = (1 << COUNT_SHIFT) - 1;
/// The word field of a closer that carries no value.
pub(super) const NO_WORD: u16 = WORD_MASK as u16;
/// Regions whose words a tag can name (10 bits), and words per region (2 bits).
const REGIONS: u32 = 1 << 10;
const WORDS: u64 = 4;
/// Epochs the receiver keeps counts for (the tag's 7 bits).
const WINDOW: u64 = 128;
/// Epochs the sender lets be open at once (module doc): below `WINDOW`, with room.
pub(super) const OPEN_EPOCHS: usize = 64;
// The fields fill the 32 bits without overlap.
const _: () = assert!(EPOCH_SHIFT + 7 == 31 && STREAM_SHIFT + 8 == EPOCH_SHIFT);
const _: () = assert!(COUNT_SHIFT + 4 == STREAM_SHIFT && MAX_COUNT == (1 << 4) - 1);
const _: () = assert!((OPEN_EPOCHS as u64) < WINDOW && WINDOW == EPOCH_MASK as u64 + 1);

/// The stream a tag's writer has at the receiver (`Peers::stream_for`).
pub(super) fn stream_of(tag: u32) -> u8 {
    (tag >> STREAM_SHIFT) as u8
}

/// Marks the `cq_data` of an `Op` as "this write closes an epoch with a value into `word`":
/// the tag itself is made when the write is posted (`Epochs::tag`), once the writes before it
/// are counted. Above 32 bits, so never a tag.
pub(super) fn ask(word: u16) -> u64 {
    1 << 63 | u64::from(word)
}

/// The word an `ask` names, or None for a `cq_data` that is not one.
pub(super) fn asked(cq_data: Option<u64>) -> Option<u16> {
    cq_data
        .filter(|d| d >> 63 == 1)
        .map(|d| (d & u64::from(WORD_MASK)) as u16)
}

/// The tag's name for word `off` of the receiver's region `region`, or None where the layout
/// cannot name it (then values into that word are never counted: always flags of their own).
pub(super) fn word(region: u32, off: u64) -> Option<u16> {
    if off % 8 != 0 || off / 8 >= WORDS || region >= REGIONS {
        return None;
    }
    Some((region << 2 | (off / 8) as u32) as u16).filter(|&w| w != NO_WORD)
}

/// `(region, offset)` of a tag's word.
pub(super) fn word_place(w: u16) -> (u32, u64) {
    (u32::from(w) >> 2, u64::from(w & 3) * 8)
}

/// The sender's side, for one peer: the epoch its next write belongs to.
#[derive(Default)]
pub(super) struct Epochs {
    /// Our stream at the peer (from its address): None, no tags (module doc).
    pub stream: Option<u8>,
    epoch: u64,
    /// Writes of the current epoch posted so far.
    in_epoch: u32,
    /// The sequence number (`Peer::next_seq`) of each open epoch's closer, oldest first.
    open: VecDeque<u64>,
    /// Signals sent as closers.
    pub signals: u64,
}

impl Epochs {
    /// For a peer that gave us stream `stream` (module doc).
    pub fn new(stream: Option<u8>) -> Self {
        Epochs {
            stream,
            ..Default::default()
        }
    }

    /// Whether another write may be posted now: fewer than `OPEN_EPOCHS` epochs have a write
    /// not yet complete, given that every write up to `done_upto` has completed.
    pub fn room(&mut self, done_upto: u64) -> bool {
        // Ends: each turn removes one.
        while self.open.front().is_some_and(|&s| s <= done_upto) {
            self.open.pop_front();
        }
        self.open.len() < OPEN_EPOCHS
    }

    /// Where the epochs stand, to `undo` a tag whose write was not posted.
    pub fn mark(&self) -> Mark {
        Mark {
            epoch: self.epoch,
            in_epoch: self.in_epoch,
            open: self.open.len(),
            signals: self.signals,
        }
    }

    /// Takes back every tag made since `m` (their writes were not posted): the receiver counts
    /// only writes that reach it, and an epoch's count must match its closer's.
    pub fn undo(&mut self, m: Mark) {
        self.epoch = m.epoch;
        self.in_epoch = m.in_epoch;
        self.open.truncate(m.open);
        self.signals = m.signals;
    }

    /// The tag of the next write to the peer, whose sequence number is `seq`; `word`: it
    /// closes the epoch with a value into that word. Callers check `room` first, and that
    /// the peer has a stream.
    pub fn tag(&mut self, seq: u64, word: Option<u16>) -> u32 {
        self.in_epoch += 1;
        let e = (self.epoch & u64::from(EPOCH_MASK)) as u32;
        let head = e << EPOCH_SHIFT | u32::from(self.stream.unwrap_or(0)) << STREAM_SHIFT;
        if word.is_none() && self.in_epoch < MAX_COUNT {
            return head;
        }
        let t = CLOSER | head | self.in_epoch << COUNT_SHIFT | u32::from(word.unwrap_or(NO_WORD));
        self.open.push_back(seq);
        self.epoch += 1;
        self.in_epoch = 0;
        if word.is_some() {
            self.signals += 1;
        }
        t
    }
}

/// `Epochs::mark`.
#[derive(Clone, Copy)]
pub(super) struct Mark {
    epoch: u64,
    in_epoch: u32,
    open: usize,
    signals: u64,
}

/// The receiver's side, for one peer: writes counted per epoch, and the next epoch to apply.
pub(super) struct Counts {
    next: u64,
    /// Writes read per epoch, by `epoch % WINDOW`.
    count: Box<[u32]>,
    /// The closer of each epoch, once read: (its count, its word).
    closer: Box<[Option<(u32, u16)>]>,
    /// Signals applied per word (the value stored: module doc).
    applied: std::collections::HashMap<u16, u64>,
    /// The planted bug of the unordered layer's test: a signal stored as soon as its closer
    /// is read, whatever is still missing of its epoch.
    #[cfg(test)]
    pub eager: bool,
}

impl Default for Counts {
    fn default() -> Self {
        Counts {
            next: 0,
            count: vec![0; WINDOW as usize].into(),
            closer: vec![None; WINDOW as usize].into(),
            applied: Default::default(),
            #[cfg(test)]
            eager: false,
        }
    }
}

impl Counts {
    /// Counts one write whose tag is `tag` (of the stream these counts are for), then applies every epoch that is complete, in
    /// order: `store(word, value)` for each that ends with a signal, `value` being the number
    /// of signals applied into that word so far. An error for a tag no sender makes.
    pub fn take(
        &mut self,
        tag: u32,
        mut store: impl FnMut(u16, u64) -> Result<(), String>,
    ) -> Result<(), String> {
        let low = u64::from((tag >> EPOCH_SHIFT) & EPOCH_MASK);
        let e = self.next + (low.wrapping_sub(self.next) & (WINDOW - 1));
        let i = (e % WINDOW) as usize;
        self.count[i] += 1;
        if tag & CLOSER != 0 {
            let n = (tag >> COUNT_SHIFT) & MAX_COUNT;
            if n == 0 || self.closer[i].is_some() {
                return Err(format!(
                    "tag {tag:#x}: a second closer of epoch {e}, or one of no writes"
                ));
            }
            let w = (tag & WORD_MASK) as u16;
            #[cfg(test)]
            if self.eager && w != NO_WORD {
                let v = self.applied.entry(w).or_insert(0);
                *v += 1;
                store(w, *v)?;
                self.closer[i] = Some((n, NO_WORD));
                return self.apply_complete(&mut store);
            }
            self.closer[i] = Some((n, w));
        } else if tag & ((1 << STREAM_SHIFT) - 1) != 0 {
            return Err(format!("tag {tag:#x} is not one of a counted write"));
        }
        self.apply_complete(&mut store)
    }

    /// Applies every complete epoch, in order (`take`).
    fn apply_complete(
        &mut self,
        store: &mut impl FnMut(u16, u64) -> Result<(), String>,
    ) -> Result<(), String> {
        // Ends at the first epoch not complete yet (at most WINDOW turns: each applies one).
        loop {
            let j = (self.next % WINDOW) as usize;
            let Some((n, w)) = self.closer[j] else {
                return Ok(());
            };
            if self.count[j] > n {
                return Err(format!(
                    "epoch {}: {} writes read, its closer says {n}",
                    self.next, self.count[j]
                ));
            }
            if self.count[j] < n {
                return Ok(());
            }
            self.count[j] = 0;
            self.closer[j] = None;
            self.next += 1;
            if w != NO_WORD {
                let v = self.applied.entry(w).or_insert(0);
                *v += 1;
                store(w, *v)?;
            }
        }
    }

    /// Epochs applied so far.
    #[cfg(test)]
    pub fn applied_epochs(&self) -> u64 {
        self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sender's writes, with their tags, arriving in `order`; returns the stores in the
    /// order the receiver made them.
    fn deliver(tags: &[u32], order: &[usize]) -> Vec<(u16, u64, usize)> {
        let mut c = Counts::default();
        let mut out = Vec::new();
        for (k, &i) in order.iter().enumerate() {
            c.take(tags[i], |w, v| {
                out.push((w, v, k));
                Ok(())
            })
            .unwrap();
        }
        out
    }

    #[test]
    fn a_signal_applies_only_once_every_write_before_it_was_read() {
        let mut s = Epochs::default();
        // data, data, signal into word 5, data, signal into word 5
        let tags: Vec<u32> = (1..=5)
            .map(|seq| s.tag(seq, [None, None, Some(5), None, Some(5)][seq as usize - 1]))
            .collect();
        // The first signal arrives first, then the second epoch, then the first's data.
        let stores = deliver(&tags, &[2, 4, 3, 0, 1]);
        assert_eq!(
            stores,
            vec![(5, 1, 4), (5, 2, 4)],
            "both apply once write 1 is read, in order"
        );
        let stores = deliver(&tags, &[0, 1, 2, 3, 4]);
        assert_eq!(stores, vec![(5, 1, 2), (5, 2, 4)]);
    }

    #[test]
    fn long_epochs_close_themselves_and_the_window_wraps() {
        let mut s = Epochs::default();
        let mut c = Counts::default();
        let mut stored = 0;
        let mut seq = 0;
        // 300 rounds of 40 writes: three epochs each (the 15th and 30th writes close one
        // without a value, the signal the last), wrapping the 7-bit field several times;
        // every round delivered backwards.
        for round in 1..=300u64 {
            assert!(s.room(seq), "every earlier write completed");
            let tags: Vec<u32> = (0..40)
                .map(|k| {
                    seq += 1;
                    s.tag(seq, (k == 39).then_some(9))
                })
                .collect();
            for t in tags.iter().rev() {
                c.take(*t, |w, v| {
                    assert_eq!((w, v), (9, round));
                    stored += 1;
                    Ok(())
                })
                .unwrap();
            }
            assert_eq!(stored, round);
        }
        assert_eq!(c.applied_epochs(), 300 * 3);
    }

    #[test]
    fn a_tag_taken_back_leaves_the_epochs_as_before() {
        let mut s = Epochs::new(Some(3));
        let t1 = s.tag(1, None);
        let m = s.mark();
        s.tag(2, Some(4));
        s.undo(m);
        let mut again = Epochs::new(Some(3));
        again.tag(1, None);
        assert_eq!(s.tag(2, Some(4)), again.tag(2, Some(4)));
        assert_eq!((s.open.len(), s.signals, stream_of(t1)), (1, 1, 3));
    }

    #[test]
    fn the_sender_stops_at_open_epochs_until_the_oldest_completes() {
        let mut s = Epochs::default();
        for seq in 1..=OPEN_EPOCHS as u64 {
            assert!(s.room(0));
            s.tag(seq, Some(1));
        }
        assert!(
            !s.room(0),
            "one more open epoch, and two could alias at the receiver"
        );
        assert!(s.room(1), "the oldest closer completed");
    }

    #[test]
    fn tags_no_sender_makes_are_refused() {
        let mut c = Counts::default();
        let ok = |_: u16, _: u64| Ok(());
        assert!(c.take(CLOSER, ok).unwrap_err().contains("no writes"));
        let mut c = Counts::default();
        assert!(c.take(5, ok).unwrap_err().contains("not one of"));
        assert_eq!(stream_of(7 << STREAM_SHIFT | CLOSER), 7);
        let mut c = Counts::default();
        c.take(0, ok).unwrap();
        c.take(0, ok).unwrap();
        let closer_of_one = CLOSER | 1 << COUNT_SHIFT | 3;
        assert!(c
            .take(closer_of_one, ok)
            .unwrap_err()
            .contains("3 writes read"));
    }

    #[test]
    fn words_the_layout_cannot_name_are_never_counted() {
        assert_eq!(word(7, 8), Some(7 << 2 | 1));
        assert_eq!(word_place(word(1023, 16).unwrap()), (1023, 16));
        assert_eq!(word(1023, 24), None, "that is NO_WORD");
        assert_eq!(word(1024, 8), None);
        assert_eq!(word(1, 32), None);
        assert_eq!(word(1, 4), None);
        assert_eq!(asked(Some(ask(77))), Some(77));
        assert_eq!(asked(Some(0x7fff_ffff)), None);
        // A tag carries the sender's stream; a closer's count and word sit below it.
        let mut s = Epochs::new(Some(200));
        let t = s.tag(1, Some(word(5, 8).unwrap()));
        assert_eq!(stream_of(t), 200);
        assert_eq!(t & WORD_MASK, 5 << 2 | 1);
        assert_eq!(asked(None), None);
    }
}
