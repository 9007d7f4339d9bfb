//! Host threads doing the proxy's work (`fifo::Assist`): a producer executes its own trigger, a
//! waiter progresses the endpoint, and a lone signal may be a plain store.

use super::conn::direct_flag;
use super::work::ProxyWork;
use std::sync::Mutex;

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
            if let Err(e) = w.service(false) {
                w.fail(&e);
            }
        }
        true
    }

    fn direct_signal(&self, conn: usize) -> bool {
        // The lock (try_lock: never wait) keeps the proxy out of this connection's state, and
        // an empty FIFO means every trigger this thread pushed before was executed: the signal
        // then follows them as a trigger would.
        // The proxy thread takes the lock for each of its rounds (short unless it is stuck in
        // the transport): a few tries, then the trigger path, which has bounded waits.
        let mut tries = 0;
        let mut w = loop {
            match self.try_lock() {
                Ok(w) => break w,
                Err(_) if tries < 64 => {
                    tries += 1;
                    std::hint::spin_loop();
                }
                Err(_) => return false,
            }
        };
        if !w.active || !w.fifo.is_empty() {
            return false;
        }
        w.conns.get_mut(conn).is_some_and(direct_flag)
    }
}
