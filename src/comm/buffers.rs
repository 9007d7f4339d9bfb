//! Registered buffers (`mscclppRegisterBuffer`, `mscclppRegisteredBufferWrite`): regions every
//! connected peer registers and exchanges after setup, written to from the host.

use super::{Comm, Conn, Registered, TAG_REG};
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
        for c in &self.conns {
            let (_, blob) = lock(&self.slots[c.slot].ep).register(Region {
                addr: ptr,
                len: size,
                kind,
            })?;
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
        self.registered.push(Registered { remotes });
        Ok(seq + 1)
    }

    /// Writes `size` bytes from `src + src_off` into every peer's buffer of registration
    /// `handle` at `dst_off`, and returns once they have arrived.
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
        let reg = handle
            .checked_sub(1)
            .and_then(|i| self.registered.get(i as usize))
            .ok_or_else(|| {
                Error::invalid_arg(format!("unknown registered-memory handle {handle}"))
            })?;
        if src == 0 || size == 0 {
            return Err(Error::invalid_arg("srcBuff is NULL or size is 0"));
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
            let peers = || reg.remotes.iter().filter(move |r| r.0 == s);
            let sent = peers()
                .try_for_each(|&(_, peer, rid, _)| ep.write(peer, mr, src_off, rid, dst_off, size))
                .and_then(|()| peers().try_for_each(|&(_, peer, _, _)| ep.flush(peer)));
            // Released only after a flush that succeeded: a write still in flight reads the
            // registration (the endpoint's teardown closes it after its drain otherwise).
            sent?;
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
