//! Tickets of a host FIFO whose slot will never be written, so that a producer that gives up
//! never wedges the FIFO.
//!
//! Why this design: a host producer takes its ticket with a fetch-add and may then give up
//! (wait timeout, abort) before its slot is free. Writing a no-op trigger later instead would
//! need a thread that outlives the failed call and waits for room; making the give-up fatal
//! would turn a timeout that a retry could survive into a dead communicator. Here the producer
//! records the ticket and returns; the consumer, finding the slot at its tail empty and that
//! ticket recorded, retires it as a no-op (`Fifo::peek`). There is no race with a late write:
//! a ticket is recorded only by a producer that will never write its slot, or, for a trigger
//! taken back (`Fifo::withdraw`), by the consumer's own lock holder after clearing the slot.

use crate::sync::lock;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// The abandoned tickets of one host FIFO, shared by its consumer (`Fifo`) and its producers
/// (through the registry).
#[derive(Default)]
pub(crate) struct Abandoned {
    /// How many tickets `tickets` holds: the consumer reads it at every empty slot, and takes
    /// the lock only when it is not 0 (almost never).
    pending: AtomicUsize,
    tickets: Mutex<BTreeSet<u64>>,
}

impl Abandoned {
    /// Records that the slot of `ticket` will never be written.
    pub(crate) fn add(&self, ticket: u64) {
        let mut t = lock(&self.tickets);
        if t.insert(ticket) {
            // Relaxed: the set behind the lock is the data; a consumer that reads the old
            // count sees the ticket at its next look at the empty slot (it keeps looking while
            // anyone waits on the FIFO).
            self.pending.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// True (and forgotten) if `ticket` was abandoned: the consumer retires it as a no-op.
    pub(crate) fn take(&self, ticket: u64) -> bool {
        // Relaxed: see `add`.
        if self.pending.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let hit = lock(&self.tickets).remove(&ticket);
        if hit {
            self.pending.fetch_sub(1, Ordering::Relaxed);
        }
        hit
    }
}
