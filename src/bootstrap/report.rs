//! Hang reports over the bootstrap: a request to every other rank, answered by each rank's
//! mailbox thread itself (`mailbox`), so that ranks whose user threads and kernels are stuck
//! still answer; a rank that is dead, gone or silent is named with why. The bytes are the
//! layer above's (`comm::hang`); the bootstrap only carries them.

use super::frame::Kind;
use super::mailbox::ReportSource;
use super::Bootstrap;
use std::time::{Duration, Instant};

/// One rank's answer to a hang-report request: its report, or why there is none.
pub type Answer = Result<Vec<u8>, String>;

impl Bootstrap {
    /// Sets what this rank answers peers' hang-report requests with (None: an empty report).
    /// It runs on the mailbox's thread: it must not block (see [`ReportSource`]).
    pub fn set_report_source(&self, f: Option<ReportSource>) {
        self.mailbox.set_report_source(f);
    }

    /// Asks every other rank for its hang report and waits at most `bound` for all the
    /// answers: per rank (this one left out), its report, or why none came (lost, gone,
    /// unreachable, or silent until the bound). Works on a failed bootstrap too, as far as
    /// its connections still carry frames.
    pub fn gather_reports(&self, bound: Duration) -> Vec<(usize, Answer)> {
        let deadline = Instant::now() + bound;
        let asked = self.mailbox.begin_report();
        let mut out: Vec<(usize, Option<Answer>)> = Vec::with_capacity(self.nranks);
        // All questions first: each is one small frame, so the answers come in parallel.
        for p in (0..self.nranks).filter(|&p| p != self.rank) {
            let why_not = match self.mailbox.gone(p) {
                Some(g) => Some(g),
                None => self
                    .send_frame(p, Kind::ReportAsk, asked, &[], deadline, "hang report")
                    .err()
                    .map(|e| format!("unreachable: {e}")),
            };
            out.push((p, why_not.map(Err)));
        }
        out.into_iter()
            .map(|(p, a)| {
                let a = a.unwrap_or_else(|| self.mailbox.take_report(p, asked, deadline, bound));
                (p, a)
            })
            .collect()
    }

    /// Every peer whose bootstrap connection to this rank ended without a goodbye (its process
    /// died, or it was dropped), with why; watched or not.
    pub fn lost_peers(&self) -> Vec<(usize, String)> {
        self.mailbox.lost_peers()
    }
}
