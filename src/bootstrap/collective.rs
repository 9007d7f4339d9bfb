//! The collectives: a ring all-gather over the rank-to-rank connections, and the barrier as
//! an all-gather of one byte. A collective that fails poisons the bootstrap (`teardown.rs`).

use super::frame::{Kind, MAX_PAYLOAD};
use super::Bootstrap;
use crate::error::{Error, Result};
use crate::sync::lock;
use std::time::Instant;

impl Bootstrap {
    /// Ring all-gather: `data` holds nranks slices of `data.len() / nranks` bytes; slice `rank`
    /// is ours, the others are filled from the other ranks. Collective, bounded by the timeout.
    pub fn all_gather(&self, data: &mut [u8]) -> Result<()> {
        if data.len() % self.nranks != 0 {
            return Err(Error::invalid_arg(format!(
                "rank {}: all-gather buffer of {} bytes is not {} equal slices",
                self.rank,
                data.len(),
                self.nranks
            )));
        }
        if data.len() / self.nranks > MAX_PAYLOAD {
            return Err(Error::invalid_arg(format!(
                "rank {}: all-gather slices of {} bytes exceed the bootstrap's {MAX_PAYLOAD}",
                self.rank,
                data.len() / self.nranks
            )));
        }
        self.collective(data, "all-gather")
    }

    /// Returns once every rank has entered the barrier (bounded by the timeout).
    pub fn barrier(&self) -> Result<()> {
        self.collective(&mut vec![0u8; self.nranks], "barrier")
    }

    pub(super) fn collective(&self, data: &mut [u8], op: &str) -> Result<()> {
        self.check_sticky(op)?;
        if self.nranks == 1 {
            return Ok(());
        }
        let mut seq = lock(&self.coll);
        let s = *seq;
        *seq = seq.wrapping_add(1);
        let r = self.ring(data, s, op);
        if let Err(e) = &r {
            self.poison(&format!("rank {} failed in {op} #{s}: {e}", self.rank));
        }
        r
    }

    fn ring(&self, data: &mut [u8], seq: u32, op: &str) -> Result<()> {
        let n = self.nranks;
        let chunk = data.len() / n;
        let next = (self.rank + 1) % n;
        let prev = (self.rank + n - 1) % n;
        let deadline = Instant::now() + self.timeout;
        // Step s forwards the slice received in step s-1 (our own in step 0).
        for step in 0..n - 1 {
            let out = (self.rank + n - step) % n;
            let inn = (self.rank + n - step - 1) % n;
            let tag = (seq as u64) << 32 | step as u64;
            self.send_frame(
                next,
                Kind::Coll,
                tag,
                &data[out * chunk..][..chunk],
                deadline,
                op,
            )?;
            let what = || format!("rank {}: {op} step {step}: from rank {prev}", self.rank);
            let m = self
                .mailbox
                .take((Kind::Coll, prev, tag), deadline, self.timeout, &what)?;
            if m.len() != chunk {
                return Err(Error::remote(format!(
                    "{}: got {} bytes per rank, this rank has {chunk} (did the ranks pass different sizes?)",
                    what(),
                    m.len()
                )));
            }
            data[inn * chunk..][..chunk].copy_from_slice(&m);
        }
        Ok(())
    }
}
