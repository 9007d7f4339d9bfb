//! A kernel's wait that lasts. A kernel whose `wait()`, `flush()` or push into a full FIFO has
//! lasted `MSCCLPP_WAIT_TIMEOUT` writes what it waits for into its FIFO's wait record
//! (`fifo::WaitRecord`, include/mscclpp/device.h `WaitWatch`); at `MSCCLPP_DEVICE_WAIT_TIMEOUT`
//! it marks the record expired, raises its FIFO's abort word and returns. The proxy looks at
//! the record once per peer-watch period (`ProxyWork::service`): a pending record is reported
//! at WARN once, an expired one fails the communicator (sticky `Timeout`, the abort word)
//! through the proxy's ordinary error path, which releases every other kernel waiting on it.

use super::pending::{PendingWait, WaitOp};
use super::work::ProxyWork;
use crate::abi::*;
use crate::error::{Error, Result};
use crate::fifo::WaitRecord;
use std::time::{Duration, Instant};

/// What the proxy remembers of the record between two looks.
#[derive(Debug, Default)]
pub(crate) struct Watched {
    /// SEQ of the record last reported at WARN: each published record is reported once.
    warned: Option<u64>,
    /// SEQ of the pending record and when the proxy first saw it: the record says how long
    /// the kernel had waited when it wrote it, and it is written only twice.
    since: Option<(u64, Instant)>,
}

impl ProxyWork {
    /// The kernel wait this FIFO's record shows (pending, or expired), with how long it has
    /// waited; None when no kernel wait on this FIFO has lasted the wait timeout (or the
    /// record is being written right now). One record per FIFO: the first wait that lasted;
    /// other kernels' waits on it may be pending too.
    pub fn pending_wait(&self) -> Option<PendingWait> {
        let r = self.fifo.wait_record()?;
        if r.state != MSCCLPP_RECORD_PENDING && r.state != MSCCLPP_RECORD_EXPIRED {
            return None;
        }
        let op = match r.op {
            MSCCLPP_WAIT_OP_WAIT => WaitOp::Wait,
            MSCCLPP_WAIT_OP_FLUSH => WaitOp::Flush,
            MSCCLPP_WAIT_OP_PUSH => WaitOp::Push,
            _ => return None,
        };
        let c = self.conns.get(r.conn_id)?;
        Some(PendingWait {
            conn: c.index,
            remote_rank: c.remote_rank,
            op,
            wanted: r.wanted,
            seen: r.seen,
            direct: r.direct,
            waited: waited(&self.watched, &r),
            device: true,
        })
    }

    /// One look at the record: WARN once for a newly pending one; an error (which the caller
    /// turns into the communicator's failure) for an expired one, or when a kernel wait that
    /// did not own the record ended at the device timeout.
    pub(super) fn watch_device_wait(&mut self) -> Result<()> {
        let Some(r) = self.fifo.wait_record() else {
            return Ok(()); // being written: the next look reads it
        };
        match r.state {
            MSCCLPP_RECORD_EXPIRED => {
                return Err(Error::timeout(
                    format!(
                        "{}: a kernel's {}; it ended at MSCCLPP_DEVICE_WAIT_TIMEOUT ({}) and the communicator is aborted",
                        self.name,
                        self.describe(&r),
                        limit_text()
                    ),
                    r.waited,
                ))
            }
            MSCCLPP_RECORD_PENDING => {
                if self.watched.since.is_none_or(|(seq, _)| seq != r.seq) {
                    self.watched.since = Some((r.seq, Instant::now()));
                }
                if self.watched.warned != Some(r.seq) {
                    self.watched.warned = Some(r.seq);
                    crate::warn!(
                        "{}: a kernel has waited {:.1} s in {} (MSCCLPP_WAIT_TIMEOUT); it ends at MSCCLPP_DEVICE_WAIT_TIMEOUT ({}) and the communicator fails, unless what it waits for comes",
                        self.name,
                        r.waited.as_secs_f64(),
                        self.describe(&r),
                        limit_text()
                    );
                    // Every rank's side of it, combined where the bootstrap still works.
                    super::request_hang_report(
                        self.fifo.producer_view(0).triggerFifoHead as usize,
                        format!("a kernel's {}", self.describe(&r)),
                    );
                }
            }
            _ => self.watched.since = None,
        }
        if r.others_expired {
            let pending = match r.state {
                MSCCLPP_RECORD_PENDING => format!("still pending: {}", self.describe(&r)),
                _ => "no other wait recorded".into(),
            };
            let limit = crate::config::device_wait_timeout().unwrap_or_default();
            return Err(Error::timeout(
                format!(
                    "{}: a kernel's wait on this FIFO ended at MSCCLPP_DEVICE_WAIT_TIMEOUT ({}) and the communicator is aborted ({pending})",
                    self.name,
                    limit_text()
                ),
                limit,
            ));
        }
        Ok(())
    }

    /// The record in words: the operation, the connection and peer, what it waits for and
    /// what it has, the FIFO's head and how long.
    fn describe(&self, r: &WaitRecord) -> String {
        let conn = self.conn_name(r.conn_id);
        let (wanted, seen) = (r.wanted, r.seen);
        let what = match r.op {
            MSCCLPP_WAIT_OP_WAIT => {
                format!("wait() on {conn} for signal {wanted}, has {seen}")
            }
            MSCCLPP_WAIT_OP_FLUSH => format!(
                "flush() on {conn} for ticket {wanted} to complete, the proxy's tail at {seen}"
            ),
            MSCCLPP_WAIT_OP_PUSH => format!(
                "push on {conn} into the full FIFO for ticket {wanted}, the proxy's tail at {seen}"
            ),
            op => format!("wait of unknown kind {op} on {conn} (wanted {wanted}, seen {seen})"),
        };
        format!(
            "{what} (FIFO head {}, waited {:.1} s)",
            r.head,
            waited(&self.watched, r).as_secs_f64()
        )
    }
}

/// How long the recorded wait has lasted: what the kernel wrote, plus the time since the proxy
/// first saw that record while it is pending.
fn waited(w: &Watched, r: &WaitRecord) -> Duration {
    match w.since {
        Some((seq, t)) if seq == r.seq && r.state == MSCCLPP_RECORD_PENDING => {
            r.waited + t.elapsed()
        }
        _ => r.waited,
    }
}

fn limit_text() -> String {
    crate::config::device_wait_timeout().map_or("none".into(), |d| format!("{d:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::tests::work;
    use crate::sync::lock;

    fn record(seq: u64, state: u64, op: u64, wanted: u64, seen: u64, others: u64) -> [u64; 8] {
        let mut w = [0u64; 8];
        w[MSCCLPP_RECORD_SEQ] = seq;
        w[MSCCLPP_RECORD_WHAT] = op | state << MSCCLPP_RECORD_STATE_SHIFT;
        w[MSCCLPP_RECORD_WANTED] = wanted;
        w[MSCCLPP_RECORD_SEEN] = seen;
        w[MSCCLPP_RECORD_HEAD] = 7;
        w[MSCCLPP_RECORD_WAITED_NS] = 2_000_000_000;
        w[MSCCLPP_RECORD_OTHERS_EXPIRED] = others;
        w
    }

    #[test]
    fn a_pending_record_is_reported_and_an_expired_one_fails_the_communicator() {
        let shared = work();
        let mut w = lock(&shared);
        // Nothing recorded: nothing pending, nothing to do.
        assert_eq!(w.pending_wait(), None);
        w.watch_device_wait().unwrap();
        // A kernel's wait() for signal 18 that has 17, past the warn threshold.
        w.fifo.write_record_for_test(record(
            2,
            MSCCLPP_RECORD_PENDING,
            MSCCLPP_WAIT_OP_WAIT,
            18,
            17,
            0,
        ));
        w.watch_device_wait().unwrap();
        assert_eq!(w.watched.warned, Some(2), "reported once");
        let p = w.pending_wait().unwrap();
        assert_eq!(
            (p.conn, p.remote_rank, p.op, p.wanted, p.seen, p.device),
            (3, 1, WaitOp::Wait, 18, 17, true)
        );
        assert!(p.waited >= Duration::from_secs(2));
        // Withdrawn (the signal came): nothing pending.
        w.fifo
            .write_record_for_test(record(4, 0, MSCCLPP_WAIT_OP_WAIT, 18, 18, 0));
        w.watch_device_wait().unwrap();
        assert_eq!(w.pending_wait(), None);
        // The next wait expires: the error carries the record, with the timeout's code.
        w.fifo.write_record_for_test(record(
            8,
            MSCCLPP_RECORD_EXPIRED,
            MSCCLPP_WAIT_OP_FLUSH,
            40,
            39,
            0,
        ));
        assert_eq!(w.pending_wait().map(|p| p.op), Some(WaitOp::Flush));
        let e = w.watch_device_wait().unwrap_err();
        assert!(matches!(e, Error::Timeout { after_ms: 2000, .. }), "{e:?}");
        assert_eq!(e.code(), mscclppResult_t::mscclppRemoteError);
        let text = e.to_string();
        for part in [
            "flush() on connection 3 (to rank 1) for ticket 40",
            "tail at 39",
            "FIFO head 7",
            "MSCCLPP_DEVICE_WAIT_TIMEOUT",
        ] {
            assert!(text.contains(part), "{part:?} missing in {text}");
        }
        // The proxy's error path: sticky for the communicator, abort word raised.
        w.fail(&e);
        let (code, msg) = w.sticky.get().unwrap();
        assert_eq!(code, mscclppResult_t::mscclppRemoteError);
        assert!(msg.contains("ticket 40"), "{msg}");
        let view = w.fifo.producer_view(0);
        // SAFETY: the abort word follows the tail in the live FIFO's control block.
        let abort = unsafe { *view.triggerFifoTail.add(1) };
        assert_eq!(abort, mscclppResult_t::mscclppRemoteError as u64);
    }

    #[test]
    fn another_waiter_expiring_fails_too_and_the_service_round_reports_it() {
        let shared = work();
        let mut w = lock(&shared);
        w.fifo.write_record_for_test(record(
            2,
            MSCCLPP_RECORD_PENDING,
            MSCCLPP_WAIT_OP_PUSH,
            200,
            71,
            1,
        ));
        let e = w.watch_device_wait().unwrap_err();
        assert!(e.to_string().contains("push on connection 3"), "{e}");
        // Through `service`: the round that looks at the record fails (the proxy thread then
        // calls `fail`), within WATCH_EVERY rounds once the peer-watch period has passed.
        w.last_watch_for_test();
        let mut failed = None;
        for _ in 0..2 * super::super::work::WATCH_EVERY {
            if let Err(e) = w.service(false, false) {
                failed = Some(e);
                break;
            }
        }
        let e = failed.expect("the service round reports the expired wait");
        assert_eq!(e.code(), mscclppResult_t::mscclppRemoteError);
    }

    #[test]
    fn a_record_of_no_known_connection_is_no_pending_wait_but_still_fails() {
        let shared = work();
        let mut w = lock(&shared);
        w.fifo.write_record_for_test(record(
            2,
            MSCCLPP_RECORD_EXPIRED,
            MSCCLPP_WAIT_OP_WAIT | 9 << 32,
            1,
            0,
            0,
        ));
        assert_eq!(w.pending_wait(), None);
        let e = w.watch_device_wait().unwrap_err();
        assert!(e.to_string().contains("connection id 9"), "{e}");
    }
}
