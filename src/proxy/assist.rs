//! Host threads doing the proxy's work (`fifo::Assist`): a producer executes its own trigger, a
//! waiter progresses the endpoint, a lone signal may be a plain store, and a small put on an
//! idle SHM connection a record in the peer's ring of inline puts.

use super::conn::{direct_flag, direct_put, ROOM_WAIT};
use super::thread::panic_error;
use super::work::ProxyWork;
use crate::fifo::Withdrawal;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard};

/// Host threads that push into, or wait on, a host FIFO do the proxy's work themselves when
/// nobody else is doing it: the trigger is executed on the producer's own core, and a waiter
/// progresses the endpoint through which its data arrives. On a machine with fewer cores than
/// busy threads this removes the hand-offs between threads from every round trip.
impl crate::fifo::Assist for Mutex<ProxyWork> {
    fn assist(&self) -> bool {
        // try_lock: if the proxy thread (or another producer) is consuming, it does the work.
        let Ok(mut w) = self.try_lock() else {
            return false;
        };
        if w.active {
            // A panic in the work (a bug) fails the communicator now, as an error does, not
            // only when the proxy is stopped. AssertUnwindSafe: after it the work is failed,
            // so nobody consumes from its state again.
            let r = catch_unwind(AssertUnwindSafe(|| w.service(false, true)))
                .unwrap_or_else(|p| Err(panic_error(p)));
            if let Err(e) = r {
                w.fail(&e);
            }
        }
        true
    }

    fn withdraw(&self, ticket: u64) -> Withdrawal {
        // Not `locked`'s few tries: this runs once, on a call's failure path, right when the
        // timeout that caused it has the hang reporter reading this very consumer (it holds
        // the lock up to 20 ms), and a busy proxy round is short. A lock still held after
        // WITHDRAW_WAIT (a proxy stuck in its transport) leaves the trigger queued, as before.
        let Some(mut w) = locked_within(self, WITHDRAW_WAIT) else {
            return Withdrawal::Queued;
        };
        if w.sticky.get().is_some() {
            // A failure may have come in the middle of this very trigger.
            return Withdrawal::Queued;
        }
        if ticket < w.fifo.ticket() {
            return Withdrawal::Retired;
        }
        // Holding the lock, nobody is executing it; not retired, so not started.
        if w.fifo.withdraw(ticket) {
            Withdrawal::Withdrawn
        } else {
            Withdrawal::Queued
        }
    }

    fn buffer_sizes(&self, conn: usize) -> Option<(u64, u64)> {
        // Fixed once the connection is set up; the lock is held for a round at most.
        let w = crate::sync::lock(self);
        w.conns.get(conn).map(|c| (c.local_size, c.remote_size))
    }

    fn direct_signal(&self, conn: usize) -> bool {
        idle(self).is_some_and(|mut w| w.conns.get_mut(conn).is_some_and(direct_flag))
    }

    fn direct_put(&self, conn: usize, dst: u64, src: u64, size: u64, signal: bool) -> bool {
        idle(self).is_some_and(|mut w| {
            let ProxyWork {
                conns,
                fifo,
                sticky,
                ..
            } = &mut *w;
            if conn >= conns.len() {
                return false;
            }
            // This connection mutably, and the other connections' rings into us, which a wait
            // for room in the peer's ring applies (two ranks putting into each other at once
            // each wait for the other, holding the lock our proxy thread would drain with).
            let (before, rest) = conns.split_at_mut(conn);
            let (c, after) = rest.split_first_mut().expect("conn < len");
            // The wait ends at an abort or failure as every wait does (`idle` checked them
            // only on the way in): nothing is delivered after it.
            let go_on = || {
                fifo.aborted() == 0
                    && !sticky.failed()
                    && before
                        .iter()
                        .chain(after.iter())
                        .filter_map(|x| x.inbox.as_deref())
                        .all(|i| i.drain_if_free().is_ok())
            };
            direct_put(c, src, dst, size, signal, ROOM_WAIT, go_on)
        })
    }
}

/// The consumer, locked, if it is active, its FIFO's abort word is down (after the abort
/// nothing is delivered, directly or not), and every ticket taken from its FIFO was retired (a
/// ticket taken and not yet written counts: with three threads on one FIFO, checking for an
/// empty ring let a thread's direct put overtake its own earlier trigger): then every trigger
/// the calling thread pushed before was executed, and a direct signal or put follows them as a trigger
/// would. None if the lock is not had after a few tries: the proxy thread takes it for each of
/// its rounds (short unless it is stuck in the transport), and the trigger path, which has
/// bounded waits, is always there.
fn idle(m: &Mutex<ProxyWork>) -> Option<MutexGuard<'_, ProxyWork>> {
    let w = locked(m)?;
    (w.active && w.fifo.aborted() == 0 && w.fifo.all_retired()).then_some(w)
}

/// How long taking back a timed-out trigger waits for the consumer's lock.
const WITHDRAW_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// The consumer, locked, if the lock is had within `limit` (yielding between tries).
fn locked_within(
    m: &Mutex<ProxyWork>,
    limit: std::time::Duration,
) -> Option<MutexGuard<'_, ProxyWork>> {
    let t0 = std::time::Instant::now();
    // Ends: the lock is had, or `limit` passed.
    loop {
        match m.try_lock() {
            Ok(w) => return Some(w),
            Err(_) if t0.elapsed() < limit => std::thread::yield_now(),
            Err(_) => return None,
        }
    }
}

/// The consumer, locked, if the lock is had within a few tries (see `idle`).
fn locked(m: &Mutex<ProxyWork>) -> Option<MutexGuard<'_, ProxyWork>> {
    let mut tries = 0;
    // Ends: the lock is had, or after 64 tries.
    loop {
        match m.try_lock() {
            Ok(w) => return Some(w),
            Err(_) if tries < 64 => {
                tries += 1;
                std::hint::spin_loop();
            }
            Err(_) => return None,
        }
    }
}
