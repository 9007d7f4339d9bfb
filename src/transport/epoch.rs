//! Connection epoch blocks: where a connection's waiter spins and its peer, or the peer's
//! proxy, stores signal counts (`mscclppDevConnSignalEpochId`, then `waitEpochId`). Where a
//! block lives is the transport's answer ([`Endpoint::epoch_block`]): host memory for host
//! connections (shared memory for SHM ones, so the peer can store into it directly), device
//! memory for GPU ones, whose words are `MSCCLPP_EPOCH_*` (src/abi.rs): on P2P the peer's
//! kernels add their own signals into word 3, and words 4..10 hold the direct path's settings
//! and the kernels' state ([`EpochMem::write_setup`]).
//!
//! [`Endpoint::epoch_block`]: super::Endpoint::epoch_block

use super::DirectLimits;
use crate::abi::{
    MSCCLPP_EPOCH_DEVICE_BYTES, MSCCLPP_EPOCH_DIRECT, MSCCLPP_EPOCH_DIRECT_BLOCK_BYTES,
    MSCCLPP_EPOCH_DIRECT_BYTES, MSCCLPP_EPOCH_LOCAL_SIZE, MSCCLPP_EPOCH_REMOTE_SIZE,
};
use crate::cuda::{self, DeviceMem};
use crate::error::{Error, Result};
use crate::mem::{HostBlock, MemKind, SharedBlock};
use std::sync::Arc;

/// Bytes of a host epoch block: 16 of epoch ids (`device`, `proxy`), `waitEpochId`, a spare
/// word. Device blocks have `MSCCLPP_EPOCH_DEVICE_BYTES`.
pub const EPOCH_BYTES: usize = 32;

/// The plain block for a connection over `kind` memory: host memory for host connections,
/// device memory of the buffer's GPU for device ones (the kernel polls it in its L2; the
/// peer's copy engine or the local proxy writes it). A device block's direct path stays off.
pub fn plain(kind: MemKind) -> Result<EpochMem> {
    match kind {
        MemKind::Host => Ok(EpochMem::Host(HostBlock::zeroed(EPOCH_BYTES, 16)?)),
        MemKind::Device(d) => device(d, false),
    }
}

/// A device block on `device` whose word 3 the peer's kernels may add their signals into
/// (`direct`: exported with it, see [`EpochMem::export_len`]).
pub fn device(device: i32, direct: bool) -> Result<EpochMem> {
    cuda::require("a GPU connection")?;
    Ok(EpochMem::Device {
        mem: DeviceMem::zeroed(device, MSCCLPP_EPOCH_DEVICE_BYTES)?,
        direct,
    })
}

/// A block in POSIX shared memory, which the peer maps by name and stores signals into; with
/// `ring`, followed by the ring the peer writes inline puts into (`transport::inbox`).
pub fn shared(ring: bool) -> Result<EpochMem> {
    let len = if ring {
        super::inbox::BLOCK_BYTES
    } else {
        EPOCH_BYTES
    };
    Ok(EpochMem::Shared(Arc::new(SharedBlock::create(len)?)))
}

/// A connection's epoch block: host memory for host connections (shared memory for SHM ones),
/// device memory for GPU ones.
pub enum EpochMem {
    Host(HostBlock),
    Shared(Arc<SharedBlock>),
    /// `direct`: the peer's kernels may add signals into word 3 (P2P).
    Device {
        mem: DeviceMem,
        direct: bool,
    },
}

impl EpochMem {
    /// The block's address (a host pointer, or a device address as a pointer: never
    /// dereferenced on the host in that case).
    pub fn ptr(&self) -> *mut u8 {
        match self {
            EpochMem::Host(h) => h.ptr(),
            EpochMem::Shared(h) => h.ptr(),
            EpochMem::Device { mem, .. } => mem.ptr() as usize as *mut u8,
        }
    }

    /// The bytes registered for the peer to write: the two epoch ids, and on a block with the
    /// direct path also words 2 and 3 (the peer's kernels add into word 3; one region).
    pub fn export_len(&self) -> u64 {
        match self {
            EpochMem::Device { direct: true, .. } => (MSCCLPP_EPOCH_DIRECT as u64 + 1) * 8,
            _ => 16,
        }
    }

    /// Writes what this connection's kernels read at setup (src/abi.rs, `MSCCLPP_EPOCH_*`):
    /// the buffer sizes, `local` and `remote` bytes (every device block: a put split into
    /// several triggers is checked whole against them before its first is queued), and the
    /// direct path's limits: puts of at most `limits` (and signals, flushes) that they may do
    /// with their own stores (`limits.thread` 0 leaves it off). Setup only, before any kernel
    /// sees the block: kernels read these words through the read-only cache. Host blocks
    /// (driven by host threads, whose calls check against the proxy's sizes) get nothing.
    pub fn write_setup(&self, limits: DirectLimits, local: u64, remote: u64) -> Result<()> {
        match self {
            EpochMem::Device { mem, direct } => {
                if limits.thread != 0 && !direct {
                    return Err(Error::internal(
                        "the direct path asked for an epoch block that has none",
                    ));
                }
                mem.write_words(
                    MSCCLPP_EPOCH_DIRECT_BYTES * 8,
                    &[limits.thread, local, remote, limits.block],
                )
            }
            _ if limits.thread != 0 => Err(Error::internal(
                "the direct path asked for an epoch block that has none",
            )),
            _ => Ok(()),
        }
    }

    /// The block's address where the host may read it (host and shared-memory blocks): the hang
    /// report reads the counts there; None for device memory.
    pub fn host_ptr(&self) -> Option<*mut u8> {
        match self {
            EpochMem::Host(h) => Some(h.ptr()),
            EpochMem::Shared(h) => Some(h.ptr()),
            _ => None,
        }
    }

    /// The block in shared memory of an SHM connection over host memory (with its ring of
    /// inline puts).
    pub fn shm_block(&self) -> Option<&Arc<SharedBlock>> {
        match self {
            EpochMem::Shared(h) => Some(h),
            _ => None,
        }
    }

    /// The shared-memory name a peer maps the block by.
    pub fn shared_name(&self) -> Option<&str> {
        match self {
            EpochMem::Shared(h) => Some(h.name()),
            _ => None,
        }
    }

    /// Removes the shared-memory name once the peer mapped the block.
    pub fn unlink_shared(&self) {
        if let EpochMem::Shared(h) = self {
            h.unlink()
        }
    }
}

// The words `write_setup` writes are consecutive, from DIRECT_BYTES to DIRECT_BLOCK_BYTES.
const _: () = assert!(
    MSCCLPP_EPOCH_LOCAL_SIZE == MSCCLPP_EPOCH_DIRECT_BYTES + 1
        && MSCCLPP_EPOCH_REMOTE_SIZE == MSCCLPP_EPOCH_DIRECT_BYTES + 2
        && MSCCLPP_EPOCH_DIRECT_BLOCK_BYTES == MSCCLPP_EPOCH_DIRECT_BYTES + 3
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_epochs_are_zeroed_and_aligned() {
        for e in [plain(MemKind::Host).unwrap(), shared(true).unwrap()] {
            let p = e.ptr();
            assert_eq!(p as usize % 16, 0);
            // SAFETY: EPOCH_BYTES of host memory owned by `e`.
            let s = unsafe { std::slice::from_raw_parts(p, EPOCH_BYTES) };
            assert!(s.iter().all(|b| *b == 0));
        }
    }

    #[test]
    fn device_epochs_and_fifos_fail_cleanly_in_host_mode() {
        if cuda::available() {
            return;
        }
        assert!(matches!(
            plain(MemKind::Device(0)),
            Err(crate::error::Error::InvalidUsage(_))
        ));
        assert!(device(0, true).is_err());
        assert!(crate::fifo::Fifo::for_device(Some(0)).is_err());
    }

    /// Host blocks export the two epoch ids only and never take the direct path's words (a
    /// transport that asked would be a bug, reported rather than ignored).
    #[test]
    fn only_a_direct_device_block_takes_the_direct_path() {
        for e in [plain(MemKind::Host).unwrap(), shared(false).unwrap()] {
            assert_eq!(e.export_len(), 16);
            let limits = |thread, block| DirectLimits { thread, block };
            assert!(
                e.write_setup(limits(0, 0), 8, 8).is_ok(),
                "0: off, nothing to write"
            );
            assert!(e.write_setup(limits(4096, 0), 8, 8).is_err());
        }
    }
}
