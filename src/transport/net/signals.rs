//! Signals carried as remote CQ data (docs/DESIGN.md 3.6): a `putWithSignal` is one RMA write
//! whose 8 bytes of remote CQ data name the signal word and the count, and the receiver's
//! endpoint stores the count when it reads that write's completion, which the provider
//! reports once the write's data is in place: no second write per signal. A lone signal stays
//! an 8-byte write of the count into the word (riding alone on a write into the peer's scratch
//! word measured slower), and a flush writes the latest riding value of each word again, so
//! that what it waits for covers it; the two ways mix because a rebuilt value is stored only
//! if it is ahead of the word's (below).
//!
//! Pure: the CQ-data layout, the sender's check that a value can be carried, and the
//! receiver's table of words it stores into ([`Incoming`]); the endpoint posts and reads.
//!
//! On providers whose writes move only while the target progresses (tcp, shm: software), every
//! other data write (not the 8-byte flags, markers and records) carries [`ACTIVITY`] instead,
//! so that the target sees writes arriving: its idle proxy then keeps polling instead of
//! napping between progress calls, which slowed tcp streams into a rank whose threads were
//! not waiting (bench/RESULTS.md, session 16).
//!
//! The layout (64 bits, so only providers with `cq_data_size >= 8`): bits 63..56 the tag
//! `TAG` (CQ data from anything else is refused, never stored), 55..36 the receiver's region
//! id (its index in the region table, `MrBlob::id`), 35..32 the word (offset / 8, regions of
//! up to 128 bytes: epoch blocks are 16 or 32), 31..0 the count's low 32 bits. The receiver
//! rebuilds the count from the word's current value: the one ahead of it by less than 2^31
//! (counts only grow, by one per signal); an older one, which a later value overtook, changes
//! nothing. So a value stored late never steps a count back, whatever order the receiver
//! reads the completions in.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of remote CQ data the layout needs.
pub(super) const CQ_DATA_BYTES: u64 = 8;
const TAG: u64 = 0x5a;
const TAG_SHIFT: u32 = 56;
const REGION_BITS: u32 = 20;
const REGION_SHIFT: u32 = 36;
const WORD_BITS: u32 = 4;
const WORD_SHIFT: u32 = 32;
const VALUE_BITS: u32 = 32;
// The fields fill the 64 bits without overlap.
const _: () = assert!(VALUE_BITS == WORD_SHIFT && WORD_SHIFT + WORD_BITS == REGION_SHIFT);
const _: () = assert!(REGION_SHIFT + REGION_BITS == TAG_SHIFT && TAG < 1 << (64 - TAG_SHIFT));

/// The CQ data of a write that carries no value: it only tells the target that writes arrive.
pub(super) const ACTIVITY: u64 = (TAG + 1) << TAG_SHIFT;

/// Whether CQ data is [`ACTIVITY`].
pub(super) fn is_activity(data: u64) -> bool {
    data == ACTIVITY
}

/// The largest step between two values into one word that the receiver can rebuild.
pub(super) const MAX_STEP: u64 = (1 << (VALUE_BITS - 1)) - 1;

/// The CQ data for `value` into word `off` of the receiver's region `region`, or None where the
/// layout cannot name it (the value then goes as a write of its own).
pub(super) fn encode(region: u32, off: u64, value: u64) -> Option<u64> {
    let word = off / 8;
    if off % 8 != 0 || word >= 1 << WORD_BITS || u64::from(region) >= 1 << REGION_BITS {
        return None;
    }
    Some(
        TAG << TAG_SHIFT
            | u64::from(region) << REGION_SHIFT
            | word << WORD_SHIFT
            | (value & ((1 << VALUE_BITS) - 1)),
    )
}

/// `(region, offset, value's low bits)` of CQ data, or None if it is not ours.
pub(super) fn decode(data: u64) -> Option<(u32, u64, u32)> {
    if data >> TAG_SHIFT != TAG {
        return None;
    }
    let region = (data >> REGION_SHIFT) & ((1 << REGION_BITS) - 1);
    let word = (data >> WORD_SHIFT) & ((1 << WORD_BITS) - 1);
    Some((region as u32, word * 8, data as u32))
}

/// The count `low` stands for, given the word holds `cur`: the value ahead of `cur` by less than
/// 2^31 with those low bits, or None if `low` is `cur`'s or an older one's.
pub(super) fn rebuild(cur: u64, low: u32) -> Option<u64> {
    let step = u64::from(low.wrapping_sub(cur as u32));
    (step != 0 && step <= MAX_STEP).then(|| cur.wrapping_add(step))
}

/// One region this endpoint accepts CQ-data values into: host memory it registered and
/// exported, `len` bytes at `addr`.
#[derive(Clone, Copy, Debug)]
struct Target {
    addr: u64,
    len: u64,
}

/// The receiver's side: the regions values may name, and what arrived.
#[derive(Default)]
pub(super) struct Incoming {
    /// Indexed by region id.
    targets: Vec<Option<Target>>,
    /// Values stored, values that arrived after a later one to the same word, and writes that
    /// carried [`ACTIVITY`].
    pub stored: u64,
    pub stale: u64,
    pub activity: u64,
    /// Peers' writes with a counted tag read (`counted.rs`).
    pub counted: u64,
}

impl Incoming {
    /// Peers' writes with CQ data read so far (values and marks).
    pub fn arrived(&self) -> u64 {
        self.activity + self.counted + self.stored + self.stale
    }

    /// Region `id` (host memory, `len` bytes at `addr`, registered and exported until `refuse`
    /// or the endpoint closes) may be named by CQ-data values.
    pub fn accept(&mut self, id: u32, addr: u64, len: u64) {
        let i = id as usize;
        if self.targets.len() <= i {
            self.targets.resize(i + 1, None);
        }
        self.targets[i] = Some(Target { addr, len });
    }

    /// Region `id` was deregistered: a value naming it is refused from now on rather than
    /// stored into memory its user may have freed (and `accept` may give the id to another).
    pub fn refuse(&mut self, id: u32) {
        if let Some(t) = self.targets.get_mut(id as usize) {
            *t = None;
        }
    }

    /// Stores the value CQ data `data` carries (module doc), or says why it cannot.
    pub fn apply(&mut self, data: u64) -> Result<(), String> {
        if is_activity(data) {
            self.activity += 1;
            return Ok(());
        }
        let (region, off, low) =
            decode(data).ok_or_else(|| format!("remote CQ data {data:#x} is not a signal"))?;
        let addr = self.word_addr(region, off)?;
        // SAFETY: as `word_addr` says.
        let w = unsafe { AtomicU64::from_ptr(addr as *mut u64) };
        // Acquire: the value we rebuild from is the latest store. Release on success pairs
        // with the waiter's Acquire load of the count: the data of the write that carried
        // this value, placed before its completion was reported to this thread, is visible
        // before the count. Ends when stored, or when the word holds this value or a later one.
        let mut cur = w.load(Ordering::Acquire);
        loop {
            let Some(new) = rebuild(cur, low) else {
                self.stale += 1;
                return Ok(());
            };
            match w.compare_exchange_weak(cur, new, Ordering::Release, Ordering::Acquire) {
                Ok(_) => {
                    self.stored += 1;
                    return Ok(());
                }
                Err(now) => cur = now,
            }
        }
    }

    /// Stores `value` into word `off` of region `region` unless the word already holds it or
    /// a later one (a signal counted by the receiver, `counted.rs`: every write before it has
    /// been read).
    pub fn store_counted(&mut self, region: u32, off: u64, value: u64) -> Result<(), String> {
        let addr = self.word_addr(region, off)?;
        // SAFETY: as `word_addr` says.
        let w = unsafe { AtomicU64::from_ptr(addr as *mut u64) };
        // Release pairs with the waiter's Acquire load of the count, as in `apply`: the
        // writes counted before this store completed before this thread read them.
        if w.fetch_max(value, Ordering::Release) < value {
            self.stored += 1;
        } else {
            self.stale += 1;
        }
        Ok(())
    }

    /// The address of the word at `off` of region `region`, if values may go there: an
    /// aligned word (regions start 8-aligned: `accept`'s callers register epoch blocks and
    /// user buffers) inside host memory that stays registered, exported and alive until
    /// `refuse` or the endpoint closes (`accept`). Every other writer (an older value's RMA write, a waiter's
    /// reads) uses it atomically as well.
    fn word_addr(&self, region: u32, off: u64) -> Result<u64, String> {
        let t = self
            .targets
            .get(region as usize)
            .copied()
            .flatten()
            .ok_or_else(|| format!("a signal into region {region}, which takes none"))?;
        if off + 8 > t.len || off % 8 != 0 {
            return Err(format!(
                "a signal at offset {off} of the {}-byte region {region}",
                t.len
            ));
        }
        Ok(t.addr + off)
    }
}

/// The latest value sent into one word (`Outgoing`).
#[derive(Clone, Copy)]
struct Sent {
    /// The peer the word's region was imported from.
    peer: usize,
    value: u64,
    /// It rode as remote CQ data (else it was a write of its own).
    rode: bool,
}

/// The sender's side: the latest value it sent per word (imported region, offset) of regions
/// that take riding values, and whether it rode, so that it never sends a value the receiver
/// would rebuild wrong, and a flush knows what to write again.
#[derive(Default)]
pub(super) struct Outgoing {
    last: std::collections::HashMap<(usize, u64), Sent>,
    /// Words whose values are no longer counted (`take_counted`).
    uncounted: std::collections::HashSet<(usize, u64)>,
}

impl Outgoing {
    /// Records `value` into word `off` of region `remote` imported from `peer`, riding (`rode`)
    /// or as a write of its own, or says why the layout cannot carry it (a value that does not
    /// grow from the last one, or jumps too far).
    pub fn take(
        &mut self,
        peer: usize,
        (remote, off): (usize, u64),
        value: u64,
        rode: bool,
    ) -> Result<(), String> {
        let prev = self.last.get(&(remote, off)).map_or(0, |l| l.value);
        if value < prev || value - prev > MAX_STEP {
            return Err(format!(
                "a signal value {value} after {prev} into the same word: values into a word that signals ride as remote CQ data into must grow by at most {MAX_STEP} per write"
            ));
        }
        self.last.insert((remote, off), Sent { peer, value, rode });
        Ok(())
    }

    /// Records `value` into word `off` of region `remote` imported from `peer` as a signal the
    /// receiver counts (`counted.rs`) and returns true, where it can be: the receiver stores
    /// the number of signals it applied, so only a value one above the word's last can (the
    /// proxy's signals always are). Else false, for this value and every later one into the
    /// word: they go as writes of their own (`take`), which a late counted store never undoes
    /// (it only raises a word).
    pub fn take_counted(&mut self, peer: usize, (remote, off): (usize, u64), value: u64) -> bool {
        let prev = self.last.get(&(remote, off)).map_or(0, |l| l.value);
        if self.uncounted.contains(&(remote, off)) || value != prev + 1 {
            self.uncounted.insert((remote, off));
            return false;
        }
        self.last.insert(
            (remote, off),
            Sent {
                peer,
                value,
                rode: true,
            },
        );
        true
    }

    /// Imported region `remote` was dropped: a flush must not write its values again
    /// (`rode_to`) into memory its owner has released.
    pub fn forget(&mut self, remote: usize) {
        self.last.retain(|&(r, _), _| r != remote);
        self.uncounted.retain(|&(r, _)| r != remote);
    }

    /// The words of `peer`'s regions whose latest value rode: (region, offset, value).
    pub fn rode_to(&self, peer: usize) -> Vec<(usize, u64, u64)> {
        self.last
            .iter()
            .filter(|(_, s)| s.peer == peer && s.rode)
            .map(|(&(remote, off), s)| (remote, off, s.value))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_round_trips_and_refuses_what_it_cannot_name() {
        let d = encode(0xABCDE, 8 * 15, 0x1_2345_6789).unwrap();
        assert_eq!(decode(d), Some((0xABCDE, 120, 0x2345_6789)));
        assert_eq!(encode(1 << REGION_BITS, 8, 1), None);
        assert_eq!(encode(1, 128, 1), None);
        assert_eq!(encode(1, 12, 1), None);
        assert_eq!(decode(0), None, "plain CQ data is not a signal");
        assert_eq!(decode(ACTIVITY), None, "nor is the activity mark");
        assert!(is_activity(ACTIVITY) && !is_activity(d));
        assert_eq!(decode(d ^ 1 << 63), None);
    }

    #[test]
    fn rebuild_moves_forward_only() {
        assert_eq!(rebuild(0, 1), Some(1));
        assert_eq!(rebuild(5, 5), None);
        assert_eq!(rebuild(5, 4), None, "older");
        assert_eq!(
            rebuild(u32::MAX as u64, 0),
            Some(1 << 32),
            "across the low word"
        );
        assert_eq!(rebuild((7 << 32) + 3, 2), None);
        assert_eq!(rebuild(0, MAX_STEP as u32), Some(MAX_STEP));
        assert_eq!(
            rebuild(0, MAX_STEP as u32 + 1),
            None,
            "a step this large reads as older"
        );
    }

    /// Values of several words arriving in any order leave each word at its newest value, and
    /// every stored value is one that was sent.
    #[test]
    fn any_arrival_order_ends_at_the_newest_value() {
        let words: Vec<AtomicU64> = (0..4).map(|_| AtomicU64::new(0)).collect();
        let mut inc = Incoming::default();
        inc.accept(3, words.as_ptr() as u64, 32);
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        for round in 0..200u64 {
            // A burst per word, from where the word is, crossing 2^32 now and then.
            let start = [round << 31, round * 3, 1 << 32, 0];
            let mut sent: Vec<(u64, u64)> = Vec::new();
            for (w, s) in start.iter().enumerate() {
                let base = words[w].load(Ordering::Relaxed).max(*s);
                words[w].store(base, Ordering::Relaxed);
                for k in 1..=1 + next(20) {
                    sent.push((w as u64 * 8, base + k));
                }
            }
            // Shuffle, then deliver.
            for i in (1..sent.len()).rev() {
                sent.swap(i, next(i as u64 + 1) as usize);
            }
            for &(off, v) in &sent {
                inc.apply(encode(3, off, v).unwrap()).unwrap();
            }
            for (w, now) in words.iter().enumerate() {
                let newest = sent
                    .iter()
                    .filter(|s| s.0 == w as u64 * 8)
                    .map(|s| s.1)
                    .max();
                let now = now.load(Ordering::Relaxed);
                assert_eq!(Some(now), newest, "round {round} word {w}");
            }
        }
        assert!(inc.stale > 0 && inc.stored > 0);
    }

    #[test]
    fn values_into_unknown_regions_or_past_the_end_are_errors() {
        let mut words = [0u64; 2];
        let mut inc = Incoming::default();
        inc.accept(1, words.as_mut_ptr() as u64, 16);
        assert!(inc
            .apply(encode(2, 0, 1).unwrap())
            .unwrap_err()
            .contains("region 2"));
        assert!(inc
            .apply(encode(1, 16, 1).unwrap())
            .unwrap_err()
            .contains("offset 16"));
        assert!(inc.apply(7).unwrap_err().contains("not a signal"));
        inc.apply(encode(1, 8, 9).unwrap()).unwrap();
        assert_eq!(words, [0, 9]);
    }

    #[test]
    fn the_sender_refuses_values_the_receiver_would_rebuild_wrong() {
        let mut out = Outgoing::default();
        out.take(3, (0, 8), 1, true).unwrap();
        assert_eq!(out.rode_to(3), [(0, 8, 1)]);
        assert_eq!(out.rode_to(4), [], "another peer's");
        out.take(3, (0, 8), 2, false).unwrap();
        assert_eq!(out.rode_to(3), [], "the latest went as a write of its own");
        assert!(out.take(3, (0, 8), 1, true).is_err(), "backwards");
        assert!(
            out.take(3, (0, 8), 2 + MAX_STEP + 1, true).is_err(),
            "too far"
        );
        out.take(3, (1, 8), MAX_STEP, true).unwrap();
    }

    /// A deregistered region takes no more values; a forgotten import is not written again by
    /// a flush, and its words start afresh (nothing else is touched).
    #[test]
    fn released_regions_take_and_send_no_values() {
        let mut words = [0u64; 2];
        let mut inc = Incoming::default();
        inc.accept(1, words.as_mut_ptr() as u64, 16);
        inc.apply(encode(1, 0, 4).unwrap()).unwrap();
        inc.refuse(1);
        inc.refuse(9);
        assert!(inc
            .apply(encode(1, 0, 5).unwrap())
            .unwrap_err()
            .contains("region 1"));
        assert_eq!(words, [4, 0]);
        let mut out = Outgoing::default();
        out.take(3, (0, 8), 7, true).unwrap();
        out.take(3, (1, 8), 2, true).unwrap();
        assert!(!out.take_counted(3, (0, 16), 5));
        out.forget(0);
        assert_eq!(out.rode_to(3), [(1, 8, 2)]);
        assert!(
            out.take_counted(3, (0, 16), 1),
            "no longer marked uncounted"
        );
    }
}
