//! The copy-engine path of the P2P endpoint: one non-blocking stream per peer. Data is
//! `cuMemcpyAsync` on it; a Flag is an 8-byte write queued after the data
//! (`cuStreamWriteValue64`, or a copy from a pinned staging ring).

use super::regions::{FlagTarget, PutTarget};
use crate::config::P2pConfig;
use crate::cuda::{PinnedHost, Stream};
use crate::error::Result;
use std::sync::atomic::{AtomicU64, Ordering};

/// Staging values per peer for Flag writes done by copy: a slot is reused only after the
/// stream has been seen idle since it was queued (see `write_value`).
const RING: u64 = 512;

/// How a Flag reaches the peer's epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FlagMode {
    /// `cuStreamWriteValue64`: no copy engine and no staging; the stream's memory barrier
    /// orders it after the data.
    WriteValue,
    /// An 8-byte `cuMemcpyAsync` from the pinned staging ring.
    Copy,
}

impl FlagMode {
    /// `MSCCLPP_P2P_FLAG=copy`, or a driver without `cuStreamWriteValue64`: copies.
    pub(super) fn choose(cfg: &P2pConfig) -> Self {
        if cfg.flag_by_copy || !crate::cuda::has_write_value64() {
            FlagMode::Copy
        } else {
            FlagMode::WriteValue
        }
    }
}

/// A peer's copy-engine stream, with its staging values for `FlagMode::Copy`.
pub(super) struct PeerStream {
    stream: Stream,
    /// Pinned staging values for `FlagMode::Copy`, made on first use.
    ring: Option<PinnedHost>,
    ring_next: u64,
    /// Staging slots queued since the stream was last seen idle.
    ring_busy: u64,
    /// Work was queued since the stream was last seen idle (a flush with nothing queued
    /// returns without asking the driver).
    dirty: bool,
}

impl PeerStream {
    pub(super) fn new(device: i32) -> Result<PeerStream> {
        Ok(PeerStream {
            stream: Stream::new(device)?,
            ring: None,
            ring_next: 0,
            ring_busy: 0,
            dirty: false,
        })
    }

    /// Work was queued since the stream was last seen idle.
    pub(super) fn dirty(&self) -> bool {
        self.dirty
    }

    /// Waits for the stream if work was queued since it was last seen idle (for rank `rank`'s
    /// errors). False: nothing was queued, no driver call.
    pub(super) fn drain(&mut self, rank: usize) -> Result<bool> {
        if !self.dirty {
            // Nothing queued since the stream was last seen idle.
            return Ok(false);
        }
        self.stream.wait(|| format!("P2P copies to rank {rank}"))?;
        self.ring_busy = 0;
        self.dirty = false;
        Ok(true)
    }

    /// Waits for everything queued, whether or not it was seen (teardown).
    pub(super) fn wait(&self, what: impl FnOnce() -> String) -> Result<()> {
        self.stream.wait(what)
    }

    /// True once everything queued has completed (never waits); an error if some failed.
    pub(super) fn idle(&self) -> Result<bool> {
        self.stream.query()
    }

    /// Queues the put.
    pub(super) fn copy(&mut self, put: &PutTarget) -> Result<()> {
        self.stream.copy(put.dst, put.src, put.size, put.d2d)?;
        self.dirty = true;
        Ok(())
    }

    /// Queues the flag after the data queued before it, as `mode` says; when the driver refuses
    /// a stream write-value, `mode` becomes `Copy` for good (`device` for the staging ring).
    pub(super) fn flag(
        &mut self,
        mode: &mut FlagMode,
        device: i32,
        flag: &FlagTarget,
    ) -> Result<()> {
        if *mode == FlagMode::WriteValue {
            match self.stream.write_value64(flag.addr, flag.value) {
                Ok(()) => {
                    self.dirty = true;
                    return Ok(());
                }
                Err(e) => {
                    crate::info!(
                        "p2p:cuda{}: cuStreamWriteValue64 to a peer mapping refused ({e}); flags go by staged copies from now on",
                        device
                    );
                    *mode = FlagMode::Copy;
                }
            }
        }
        self.flag_by_copy(device, flag.addr, flag.value)
    }

    /// Switches to staging copies after the driver refused a stream write-value.
    fn flag_by_copy(&mut self, device: i32, addr: u64, value: u64) -> Result<()> {
        if self.ring.is_none() {
            self.ring = Some(PinnedHost::zeroed(device, (RING * 8) as usize)?);
        }
        if self.ring_busy >= RING {
            // Every slot may still be read by a queued copy: let them finish first.
            self.stream
                .wait(|| "P2P copies (staging ring full)".into())?;
            self.ring_busy = 0;
        }
        let ring = self.ring.as_ref().expect("made above");
        let slot = self.ring_next % RING;
        // SAFETY: slot < RING, the ring holds RING u64s; no queued copy reads this slot (the
        // ring_busy check above). The Relaxed store is ordered before the copy that reads it
        // by the driver call that queues the copy (a full barrier in the driver's submission).
        unsafe { AtomicU64::from_ptr(ring.host().cast::<u64>().add(slot as usize)) }
            .store(value, Ordering::Relaxed);
        self.stream.copy(addr, ring.dev() + slot * 8, 8, false)?;
        self.ring_next += 1;
        self.ring_busy += 1;
        self.dirty = true;
        Ok(())
    }

    /// Queues the store of `value` into the done word `word` (`Endpoint::use_done_word`).
    pub(super) fn write_done(&self, word: u64, value: u64) -> Result<()> {
        // The stream's memory barrier orders the store after the copies queued before it.
        self.stream.write_value64(word, value)
    }
}
