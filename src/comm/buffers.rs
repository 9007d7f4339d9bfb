//! Registered buffers (`mscclppRegisterBuffer`, `mscclppRegisteredBufferWrite`,
//! `mscclppUnregisterBuffer`): regions every connected peer registers and exchanges after
//! setup, written to from the host, and released again by all of them.

use super::{Comm, Conn, RegState, Registered, TAG_REG, TAG_UNREG};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::transport::{MrId, Region};
use crate::wire::{Reader, Writer};

impl Comm {
    /// Registers `[ptr, ptr+size)` with every connection and exchanges it with each peer, which
    /// must make the same call in the same order (mscclppRegisterBuffer). Returns a handle.
    pub fn register_buffer(&mut self, ptr: u64, size: u64) -> Result<u64> {
        self.require_ready("mscclppRegisterBuffer")?;
        self.check_sticky()?;
        if ptr == 0 || size == 0 || ptr.checked_add(size).is_none() {
            return Err(Error::invalid_arg(format!(
                "cannot register buffer {ptr:#x} of {size} bytes"
            )));
        }
        let kind = crate::cuda::mem_kind(ptr);
        let seq = self.registered.len() as u64;
        let tag_of = |c: &Conn| TAG_REG | (seq & 0xff_ffff) << 32 | c.tag as u32 as u64;
        let mut locals = Vec::with_capacity(self.conns.len());
        for c in &self.conns {
            let (mr, blob) = lock(&self.slots[c.slot].ep).register(Region {
                addr: ptr,
                len: size,
                kind,
            })?;
            locals.push((c.slot, mr));
            let msg = Writer::new().u64(seq).u64(size).bytes(&blob).finish();
            self.boot.send(c.remote_rank, tag_of(c), &msg)?;
        }
        let mut remotes = Vec::with_capacity(self.conns.len());
        for c in &self.conns {
            let msg = self.boot.recv(c.remote_rank, tag_of(c))?;
            let mut rd = Reader::new(&msg, "registered-buffer blob");
            let (rseq, rsize, blob) = (rd.u64()?, rd.u64()?, rd.bytes()?);
            rd.finish()?;
            if rseq != seq || rsize == 0 {
                return Err(Error::remote(format!("rank {}: registered-buffer blob for registration {rseq} of {rsize} bytes, expected registration {seq}", c.remote_rank)));
            }
            let id = lock(&self.slots[c.slot].ep).import(c.peer, blob)?;
            remotes.push((c.slot, c.peer, id, rsize));
        }
        // Counted only now: a registration that failed half-way is not unregistered (the
        // endpoints keep what it registered until destroy, or until a later registration of
        // the same region is unregistered).
        for &(slot, mr) in &locals {
            self.hold_region(slot, mr);
        }
        self.registered.push(Registered {
            remotes,
            locals,
            state: RegState::Live,
            writes_unfinished: false,
        });
        Ok(seq + 1)
    }

    /// Unregisters registration `handle` on this rank, which every connected peer does too
    /// (mscclppUnregisterBuffer), in this order: this rank's imports of the peers' regions are
    /// dropped, a "released" message goes to every peer, and once every peer's has come, our
    /// registration is released. So when it is released, no peer writes into it any more, nor
    /// ever will; if a peer's message does not come (a mismatch, a dead or slow peer), ours is
    /// kept until destroy and the handle is dead all the same.
    pub fn unregister_buffer(&mut self, handle: u64) -> Result<()> {
        self.require_ready("mscclppUnregisterBuffer")?;
        self.check_sticky()?;
        let seq = self.live_registration(handle)?;
        if self.registered[seq].writes_unfinished {
            return Err(Error::usage(format!(
                "registered buffer {handle}: a write through it failed (mscclppRegisteredBufferWrite) and may still be landing in the peers' buffers, so it cannot be unregistered: its registration is kept until the communicator is destroyed"
            )));
        }
        let reg = &mut self.registered[seq];
        // Dead from here: whatever fails below, its imports are going or gone.
        reg.state = RegState::Kept;
        let remotes = std::mem::take(&mut reg.remotes);
        // No write of ours into them is in flight: calls on a communicator are serialised,
        // and mscclppRegisteredBufferWrite returns once its bytes arrived.
        for &(slot, _, rid, _) in &remotes {
            lock(&self.slots[slot].ep).forget(rid)?;
        }
        let msg = Writer::new().u64(seq as u64).finish();
        for c in &self.conns {
            self.boot
                .send(c.remote_rank, TAG_UNREG | c.tag as u32 as u64, &msg)?;
        }
        let peers: Vec<(usize, i32)> = self.conns.iter().map(|c| (c.remote_rank, c.tag)).collect();
        for (rank, tag) in peers {
            self.await_released(handle, seq as u64, rank, tag)?;
        }
        let locals = std::mem::take(&mut self.registered[seq].locals);
        self.registered[seq].state = RegState::Released;
        // Every release is attempted: the peers are done with each of them.
        let mut first = Ok(());
        for (slot, mr) in locals {
            if let Err(e) = self.drop_region(slot, mr) {
                crate::warn!("unregistering registered buffer {handle}: {e}");
                first = first.and(Err(e));
            }
        }
        first
    }

    /// Waits for the "released" message of registration `seq` (handle `handle`) from the peer
    /// `rank` over the connection tagged `tag`. The messages of one connection come in the
    /// order the peer sent them, and not every one is read by the call it answers: a call that
    /// failed left the rest unread, and a peer that is ahead sent one for a registration this
    /// rank has not unregistered yet. So a message for a registration this rank already tried
    /// (released, or kept after a failure) is stale and skipped; one for a registration still
    /// live here is a mismatch, kept for the call that unregisters it.
    fn await_released(&mut self, handle: u64, seq: u64, rank: usize, tag: i32) -> Result<()> {
        let early = self.unreg_early.entry((rank, tag)).or_default();
        if let Some(i) = early.iter().position(|&r| r == seq) {
            early.swap_remove(i);
            return Ok(());
        }
        // Ends at our message, at a mismatch, or when a receive fails (each receive is bounded
        // by the bootstrap timeout; stale messages are as many as earlier calls that failed).
        loop {
            let m = self
                .boot
                .recv(rank, TAG_UNREG | tag as u32 as u64)
                .map_err(|e| {
                    Error::remote(format!(
                        "registered buffer {handle}: rank {rank} (connection tag {tag}) did not unregister it: {e}; this rank keeps its registration until the communicator is destroyed"
                    ))
                })?;
            let mut rd = Reader::new(&m, "unregister message");
            let rseq = rd.u64()?;
            rd.finish()?;
            if rseq == seq {
                return Ok(());
            }
            match self.registered.get(rseq as usize).map(|r| r.state) {
                Some(RegState::Released | RegState::Kept) => continue,
                Some(RegState::Live) => {
                    self.unreg_early.entry((rank, tag)).or_default().push(rseq);
                    return Err(Error::remote(format!(
                        "rank {rank} unregistered registered buffer {} where this rank unregistered {handle} (every connected rank unregisters the same one); this rank keeps its registration until the communicator is destroyed",
                        rseq.saturating_add(1)
                    )));
                }
                None => {
                    return Err(Error::remote(format!(
                        "rank {rank} unregistered registered buffer {}, which this rank never registered",
                        rseq.saturating_add(1)
                    )))
                }
            }
        }
    }

    /// The index of registration `handle`, if it is live.
    fn live_registration(&self, handle: u64) -> Result<usize> {
        let i = handle
            .checked_sub(1)
            .filter(|&i| i < self.registered.len() as u64)
            .ok_or_else(|| {
                Error::invalid_arg(format!("unknown registered-memory handle {handle}"))
            })? as usize;
        match self.registered[i].state {
            RegState::Live => Ok(i),
            RegState::Released => Err(Error::invalid_arg(format!(
                "registered-memory handle {handle} was unregistered (mscclppUnregisterBuffer)"
            ))),
            RegState::Kept => Err(Error::invalid_arg(format!(
                "registered-memory handle {handle} was unregistered (mscclppUnregisterBuffer failed: its registration is kept until the communicator is destroyed)"
            ))),
        }
    }

    /// One more use of registration `mr` of slot `slot`'s endpoint.
    pub(super) fn hold_region(&mut self, slot: usize, mr: MrId) {
        *self.region_uses.entry((slot, mr)).or_default() += 1;
    }

    /// One use fewer of registration `mr` of slot `slot`'s endpoint, which releases it with
    /// the last.
    fn drop_region(&mut self, slot: usize, mr: MrId) -> Result<()> {
        let n = self.region_uses.get_mut(&(slot, mr)).ok_or_else(|| {
            Error::internal(format!(
                "releasing registration {mr} of endpoint {slot}, which has no use"
            ))
        })?;
        *n -= 1;
        if *n > 0 {
            return Ok(());
        }
        self.region_uses.remove(&(slot, mr));
        lock(&self.slots[slot].ep).deregister(mr)
    }

    /// Writes `size` bytes from `src + src_off` into every peer's buffer of registration
    /// `handle` at `dst_off`, and returns once they have arrived. A write of 0 bytes checks
    /// its arguments as any other and moves nothing (a put of 0 bytes is no operation either).
    pub fn registered_write(
        &mut self,
        handle: u64,
        src: u64,
        size: u64,
        src_off: u64,
        dst_off: u64,
    ) -> Result<()> {
        self.require_ready("mscclppRegisteredBufferWrite")?;
        self.check_sticky()?;
        let idx = self.live_registration(handle)?;
        let reg = &self.registered[idx];
        if src == 0 {
            return Err(Error::invalid_arg("srcBuff is NULL"));
        }
        // Check every peer before writing to any, so a bad call changes nothing.
        for &(_, _, _, rsize) in &reg.remotes {
            if dst_off.checked_add(size).is_none_or(|e| e > rsize) {
                return Err(Error::invalid_arg(format!("write of {size} bytes at offset {dst_off} exceeds the peer's {rsize}-byte registered buffer")));
            }
        }
        let src_end = src_off
            .checked_add(size)
            .ok_or_else(|| Error::invalid_arg("srcOffset + size overflows"))?;
        if size == 0 {
            return Ok(());
        }
        let region = Region {
            addr: src,
            len: src_end,
            kind: crate::cuda::mem_kind(src),
        };
        // One registration of the source per endpoint and call, released once the flush has
        // covered every write from it. Nothing is kept: the memory may be freed when the call
        // returns, and a later source at the same address is other memory (a kept registration
        // would send the old pages on NICs that pin them, and each range would hold one).
        let mut slots: Vec<usize> = reg.remotes.iter().map(|r| r.0).collect();
        slots.sort_unstable();
        slots.dedup();
        for s in slots {
            let mut ep = lock(&self.slots[s].ep);
            let mr: MrId = ep.register_source(region)?;
            let reg = &self.registered[idx];
            let peers = || reg.remotes.iter().filter(move |r| r.0 == s);
            let sent = peers()
                .try_for_each(|&(_, peer, rid, _)| ep.write(peer, mr, src_off, rid, dst_off, size))
                .and_then(|()| peers().try_for_each(|&(_, peer, _, _)| ep.flush(peer)));
            // Released only after a flush that succeeded: a write still in flight reads the
            // registration (the endpoint's teardown closes it after its drain otherwise).
            if let Err(e) = sent {
                drop(ep);
                // A write may still be landing in the peers' buffers: unregistering must not
                // tell them they may free them (unregister_buffer refuses it).
                self.registered[idx].writes_unfinished = true;
                return Err(e);
            }
            if let Err(e) = ep.release_source(mr) {
                crate::warn!(
                    "mscclppRegisteredBufferWrite: the bytes arrived, but releasing the source's registration on {} failed: {e}",
                    ep.describe()
                );
            }
        }
        Ok(())
    }
}
