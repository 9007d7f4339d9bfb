//! Per peer, which path carries an operation, and the ordering between the paths. The kernel
//! itself (the direct path: puts up to `MSCCLPP_P2P_DIRECT_BYTES`, signals and flushes while
//! nothing of the connection is in the proxy's hands; decided here once per connection,
//! `direct_limit`, then by the kernel, include/mscclpp/devconn_methods.inc), else the proxy:
//! the SM engine or the peer's copy-engine stream. Work that must follow earlier work of the
//! other proxy path waits for it first, and the done word is claimed only by work ordered
//! after every earlier trigger's (docs/DESIGN.md 3.2, "The paths of a P2P put and signal").

use super::ce::FlagMode;
use super::regions::{FlagTarget, PutTarget};
use super::stats::Stats;
use super::{peer_mut, P2p};
use crate::abi::MSCCLPP_EPOCH_DIRECT;
use crate::error::Result;
use crate::mem::MemKind;
use crate::transport::{DirectLimits, PeerId, RemoteId};

impl P2p {
    /// `Endpoint::direct_limits`: the configured limits (`MSCCLPP_P2P_DIRECT_BYTES`,
    /// `MSCCLPP_P2P_DIRECT_BLOCK_BYTES`) where our kernels can store into `dst` and add into
    /// word 3 of the peer's epoch block `epoch` (`direct_decision`), else none. Says which, and
    /// why not, once per peer at INFO.
    pub(super) fn direct_limit(
        &mut self,
        peer: PeerId,
        dst: RemoteId,
        epoch: RemoteId,
    ) -> DirectLimits {
        let view = |r| self.regions.kernel_view(r, peer);
        let device_of = |ptr: u64| match crate::cuda::mem_kind(ptr) {
            MemKind::Device(d) => Some(d),
            MemKind::Host => None,
        };
        let reach = match (view(dst), view(epoch)) {
            (Some((dp, _, dm)), Some((ep, elen, em))) => Some(Reach {
                mapped: dm && em,
                dst_device: device_of(dp),
                epoch_device: device_of(ep),
                epoch_len: elen,
            }),
            _ => None,
        };
        let me = self.device;
        let d = direct_decision(self.cfg.direct_bytes, me, reach, |a, b| {
            crate::cuda::native_atomics_between(a, b)
        });
        let block = self.cfg.direct_block_bytes;
        let Ok(p) = self.peer(peer) else {
            return DirectLimits::default();
        };
        if !p.direct_said {
            p.direct_said = true;
            match &d {
                Ok(n) => crate::info!(
                    "p2p:cuda{me}: to rank {}, kernels store puts of up to {n} bytes (a whole block's: {block}), signals and flushes themselves while the proxy holds nothing of the connection (MSCCLPP_P2P_DIRECT_BYTES, MSCCLPP_P2P_DIRECT_BLOCK_BYTES)",
                    p.rank
                ),
                Err(why) => crate::info!(
                    "p2p:cuda{me}: to rank {}, every put and signal goes through the proxy: {why}",
                    p.rank
                ),
            }
        }
        match d {
            Ok(thread) => DirectLimits { thread, block },
            Err(_) => DirectLimits::default(),
        }
    }

    /// Whether the SM engine may carry work for `peer` into a remote region now. Starts the
    /// engine when it is off (this operation then goes by the copy engines; later ones by the
    /// SMs once every block is resident).
    pub(super) fn sm_route(&mut self, peer: PeerId, mapped: bool) -> Result<bool> {
        let sm_ok = self.peer(peer)?.sm_ok;
        let Some(e) = self.engine.as_mut() else {
            return Ok(false);
        };
        if !mapped || !sm_ok {
            return Ok(false);
        }
        if e.ready()? {
            return Ok(true);
        }
        e.start()?;
        Ok(false)
    }

    /// Waits for the peer's SM-engine jobs: before its copy engine stream takes over, and in
    /// a flush.
    pub(super) fn drain_sm(&mut self, peer: PeerId) -> Result<()> {
        let last = self.peer(peer)?.sm_last;
        if let Some(e) = &self.engine {
            if e.done() < last {
                let t = self.stats.start();
                e.wait(last, "P2P puts by the SM copy engine")?;
                Stats::add(&mut self.stats.sm_waits, t);
            }
        }
        Ok(())
    }

    /// Waits for the peer's copy-engine stream: before the SM engine takes over, and in a
    /// flush.
    pub(super) fn drain_ce(&mut self, peer: PeerId) -> Result<()> {
        let t = self.stats.start();
        let p = self.peer(peer)?;
        let rank = p.rank;
        if p.ce.drain(rank)? {
            Stats::add(&mut self.stats.flushes, t);
        }
        Ok(())
    }

    /// Posts the put (and `flag` after it) as one SM-engine job if the engine may carry it:
    /// device memory on both ends, 16-byte aligned (the kernel copies 16-byte words), at most
    /// `max_bytes`. False: nothing was done.
    pub(super) fn sm_put(
        &mut self,
        peer: PeerId,
        put: &PutTarget,
        flag: Option<(u64, u64)>,
    ) -> Result<bool> {
        let small = self
            .engine
            .as_ref()
            .is_some_and(|e| put.size <= e.max_bytes);
        if !(put.d2d
            && small
            && (put.dst | put.src) % 16 == 0
            && self.sm_route(peer, put.mapped)?)
        {
            return Ok(false);
        }
        self.drain_ce(peer)?;
        self.sm_post(peer, (put.dst, put.src, put.size), flag)?;
        Ok(true)
    }

    /// Posts a job for `peer` (`sm_route` said yes) and records it as the peer's last.
    pub(super) fn sm_post(
        &mut self,
        peer: PeerId,
        (dst, src, size): (u64, u64, u64),
        flag: Option<(u64, u64)>,
    ) -> Result<()> {
        let done = self.claim(None);
        let e = self.engine.as_mut().expect("sm_route said yes");
        let k = e.post((dst, src, size), flag, done)?;
        let p = self.peer(peer)?;
        p.sm_last = k;
        p.sm_flag |= flag.is_some();
        Ok(())
    }

    /// Queues the put on the peer's copy-engine stream (after the peer's SM jobs).
    pub(super) fn ce_put(&mut self, peer: PeerId, put: &PutTarget) -> Result<()> {
        self.drain_sm(peer)?;
        let t = self.stats.start();
        self.peer(peer)?.ce.copy(put)?;
        Stats::add(&mut self.stats.copies, t);
        Ok(())
    }

    /// Queues the flag on the peer's stream, after its data (and after the peer's SM jobs and
    /// their flags: the signal count must never step back).
    pub(super) fn ce_flag(&mut self, peer: PeerId, flag: &FlagTarget) -> Result<()> {
        self.drain_sm(peer)?;
        if self.peer(peer)?.sm_flag {
            if let Some(e) = self.engine.as_mut() {
                e.order_flags()?;
            }
            self.peer(peer)?.sm_flag = false;
        }
        let t = self.stats.start();
        let p = peer_mut(&mut self.peers, peer)?;
        p.ce.flag(&mut self.mode, self.device, flag)?;
        Stats::add(&mut self.stats.values, t);
        Ok(())
    }

    /// The value the work queued next for the current trigger may store into the done word
    /// (0: none), recorded as claimed: `ticket + 1` (none before the first trigger), "every
    /// trigger up to this one has completed", which holds once that work has only if every earlier trigger's work is
    /// ordered before it: earlier SM-engine jobs are (the engine runs jobs in order), except
    /// for work queued on a copy-engine stream (`ce_peer`: this stream's own earlier work is
    /// ordered too). So: no other busy stream, and for a stream store no unfinished engine job.
    fn claim(&mut self, ce_peer: Option<PeerId>) -> u64 {
        self.claim_below(self.done.through_current(), ce_peer)
    }

    /// As `claim`, for "every trigger below `v` has completed".
    pub(super) fn claim_below(&mut self, v: u64, ce_peer: Option<PeerId>) -> u64 {
        // Called for every engine job: no allocation (the peers' flags as an iterator).
        let busy = self.peers.iter().map(|p| p.ce.dirty());
        let engine_idle = self.engine.as_ref().is_none_or(|e| e.idle());
        self.done.claim_below(v, busy, ce_peer, engine_idle)
    }

    /// After copy-engine work for `peer` was queued for the current trigger: queues the done
    /// word's store (`Endpoint::use_done_word`) behind it on the same stream, if every earlier
    /// trigger's work is then ordered before it: no other peer's stream may still be busy and
    /// no SM-engine job still running. Otherwise the producers' flush() waits for the proxy.
    pub(super) fn ce_done(&mut self, peer: PeerId) -> Result<()> {
        if self.mode != FlagMode::WriteValue {
            return Ok(());
        }
        let value = self.claim(Some(peer));
        if value == 0 {
            return Ok(());
        }
        let t = self.stats.start();
        let word = self.done.word;
        self.peer(peer)?.ce.write_done(word, value)?;
        Stats::add(&mut self.stats.values, t);
        Ok(())
    }
}

/// What setup found about where a connection's kernels would store: the peer's buffer and its
/// epoch block as this process sees them.
#[derive(Clone, Copy, Debug)]
struct Reach {
    /// Both are mapped through CUDA IPC (else they are this process's own memory).
    mapped: bool,
    /// The devices their memory lives on, in this process's numbering (None: unknown).
    dst_device: Option<i32>,
    epoch_device: Option<i32>,
    /// Bytes of the epoch block the peer exported.
    epoch_len: u64,
}

/// The direct path's limit for one connection from `device`'s kernels: `limit` (the setting)
/// where they can store into the peer's buffer and add into its epoch block's word 3 with
/// native atomics (several threads may signal at once, and the count must be exact), else
/// why not. `reach` None: the regions are not this peer's. `atomics(a, b)`: kernels of device
/// `a` have native atomics on device `b`'s memory (`cuda::native_atomics_between`).
fn direct_decision(
    limit: u64,
    device: i32,
    reach: Option<Reach>,
    atomics: impl Fn(i32, i32) -> bool,
) -> Result<u64, String> {
    if limit == 0 {
        return Err("MSCCLPP_P2P_DIRECT_BYTES=0".into());
    }
    let r = reach.ok_or("its regions are unknown to this endpoint")?;
    if r.epoch_len < (MSCCLPP_EPOCH_DIRECT as u64 + 1) * 8 {
        return Err(format!(
            "its epoch block exports {} bytes, without the word for direct signals",
            r.epoch_len
        ));
    }
    let (Some(dd), Some(ed)) = (r.dst_device, r.epoch_device) else {
        return Err("the driver does not say which GPU its memory is on".into());
    };
    if dd != ed {
        return Err(format!(
            "its buffer (GPU {dd}) and epoch block (GPU {ed}) are on different GPUs"
        ));
    }
    if dd == device {
        return Ok(limit);
    }
    if !r.mapped {
        return Err(format!(
            "a rank of this process on GPU {dd}: its memory is not mapped for our kernels"
        ));
    }
    if !atomics(device, dd) {
        return Err(format!(
            "no native atomics from GPU {device} to GPU {dd} (cuDeviceGetP2PAttribute)"
        ));
    }
    Ok(limit)
}

#[cfg(test)]
mod tests {
    use super::{direct_decision, Reach};

    fn reach(dst: i32, epoch: i32, mapped: bool) -> Option<Reach> {
        Some(Reach {
            mapped,
            dst_device: Some(dst),
            epoch_device: Some(epoch),
            epoch_len: 32,
        })
    }

    #[test]
    fn direct_path_only_where_kernels_reach_the_peer_with_atomics() {
        let yes = |_, _| true;
        let no = |_, _| false;
        // The same GPU (2 ranks under MPS, or ranks as threads): no atomics question.
        assert_eq!(direct_decision(2048, 0, reach(0, 0, true), no), Ok(2048));
        assert_eq!(direct_decision(2048, 0, reach(0, 0, false), no), Ok(2048));
        // Another GPU through CUDA IPC: only with native atomics (NVLink, PCIe atomics).
        assert_eq!(direct_decision(64, 0, reach(1, 1, true), yes), Ok(64));
        let e = direct_decision(64, 0, reach(1, 1, true), no).unwrap_err();
        assert!(e.contains("native atomics"), "{e}");
        // Another GPU of this process: our context has no peer access to it.
        let e = direct_decision(64, 0, reach(1, 1, false), yes).unwrap_err();
        assert!(e.contains("not mapped"), "{e}");
        // Off by the setting, unknown regions, an epoch block without word 3, split GPUs,
        // unknown devices.
        assert!(direct_decision(0, 0, reach(0, 0, true), yes).is_err());
        assert!(direct_decision(64, 0, None, yes).is_err());
        let mut short = reach(0, 0, true);
        short.as_mut().unwrap().epoch_len = 16;
        assert!(direct_decision(64, 0, short, yes).is_err());
        assert!(direct_decision(64, 0, reach(0, 1, true), yes).is_err());
        let mut unknown = reach(0, 0, true);
        unknown.as_mut().unwrap().dst_device = None;
        assert!(direct_decision(64, 0, unknown, yes).is_err());
    }
}
