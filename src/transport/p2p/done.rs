//! The proxy FIFO's done word (`Endpoint::use_done_word`): which value the work queued for a
//! trigger may store into it, so that the word never claims a trigger whose work may still run.

use crate::transport::PeerId;

/// The done word's address and what was claimed for it.
#[derive(Default)]
pub(super) struct DoneWord {
    /// The proxy FIFO's done word (`Endpoint::use_done_word`; 0: none), and the ticket of the
    /// trigger being handled or handled last (`Endpoint::set_ticket`). None before the first:
    /// work queued then (a host thread's `mscclppRegisteredBufferWrite`) follows no trigger,
    /// and a kernel's trigger 0 may still wait in the FIFO, so it may claim nothing.
    pub(super) word: u64,
    pub(super) ticket: Option<u64>,
    /// The largest value queued for the done word so far (values must never decrease).
    claimed: u64,
}

impl DoneWord {
    /// "Every trigger up to the current one has completed" (`ticket + 1`); 0, nothing to
    /// claim, before the first trigger.
    pub(super) fn through_current(&self) -> u64 {
        self.ticket.map_or(0, |t| t + 1)
    }

    /// "Every trigger before the current one has completed" (`ticket`); 0, nothing to claim,
    /// before the first trigger.
    pub(super) fn before_current(&self) -> u64 {
        self.ticket.unwrap_or(0)
    }

    /// The value `v` if the work queued next may store it (`may_claim`), recorded as claimed;
    /// 0 (none) when there is no done word or it may not. `busy` and `engine_idle` as in
    /// `may_claim`.
    pub(super) fn claim_below(
        &mut self,
        v: u64,
        busy: impl IntoIterator<Item = bool>,
        ce_peer: Option<PeerId>,
        engine_idle: bool,
    ) -> u64 {
        if self.word == 0 || !may_claim(v, self.claimed, busy, ce_peer, engine_idle) {
            return 0;
        }
        self.claimed = v;
        v
    }
}

/// Whether work queued now may store `v` ("every trigger below `v` has completed") into the done
/// word, once it has completed itself: `v` must exceed what was claimed before (the word never
/// decreases), and every earlier trigger's work must be ordered before this work. SM-engine
/// jobs run in order, so a job (`ce_peer` None) may claim unless a copy-engine stream may still
/// be busy (`busy[p]`: work was queued on peer p's stream since it was last seen idle); a store
/// queued on peer `ce_peer`'s stream follows that stream's own work, so only the other streams
/// must be idle, and no SM-engine job may be unfinished (`engine_idle`).
fn may_claim(
    v: u64,
    claimed: u64,
    busy: impl IntoIterator<Item = bool>,
    ce_peer: Option<PeerId>,
    engine_idle: bool,
) -> bool {
    let streams_idle = busy
        .into_iter()
        .enumerate()
        .all(|(i, b)| Some(i) == ce_peer || !b);
    v > claimed && streams_idle && (ce_peer.is_none() || engine_idle)
}

#[cfg(test)]
mod tests {
    use super::{may_claim, DoneWord};

    /// Work queued before the proxy handled any trigger (a host thread's registered write)
    /// claims nothing: with a ticket of 0 standing for "none yet", its store of 1 told a
    /// kernel whose put (ticket 0) was still in the FIFO that it had completed.
    #[test]
    fn work_before_the_first_trigger_claims_nothing() {
        let mut d = DoneWord {
            word: 0x1000,
            ..DoneWord::default()
        };
        assert_eq!(
            d.claim_below(d.through_current(), [false], Some(0), true),
            0
        );
        assert_eq!(d.claim_below(d.before_current(), [false], None, true), 0);
        d.ticket = Some(0);
        assert_eq!(d.claim_below(d.before_current(), [false], None, true), 0);
        assert_eq!(
            d.claim_below(d.through_current(), [false], Some(0), true),
            1
        );
        d.ticket = Some(1);
        assert_eq!(d.claim_below(d.through_current(), [false], None, true), 2);
    }

    #[test]
    fn done_word_claims_only_what_is_ordered_before_them() {
        // An engine job with every stream idle claims; not twice, and never a smaller value.
        assert!(may_claim(5, 4, [false, false], None, false));
        assert!(!may_claim(5, 5, [false, false], None, true));
        assert!(!may_claim(4, 5, [false, false], None, true));
        // Copy-engine work on some stream may still run: no engine job may claim past it.
        assert!(!may_claim(5, 0, [false, true], None, true));
        // A store on stream 1 follows stream 1's work, not stream 0's, nor the engine's jobs.
        assert!(may_claim(5, 0, [false, true], Some(1), true));
        assert!(!may_claim(5, 0, [true, true], Some(1), true));
        assert!(!may_claim(5, 0, [false, true], Some(1), false));
    }
}
