//! Connection epoch blocks: the 32 bytes (`mscclppDevConnSignalEpochId`, then `waitEpochId`)
//! where a connection's waiter spins and its peer, or the peer's proxy, stores signal counts.
//! Where a block lives is the transport's answer ([`Endpoint::epoch_block`]): host memory for
//! host connections (shared memory for SHM ones, so the peer can store into it directly),
//! device memory for GPU ones (with a host word for P2P ones, see [`SignaledEpoch`]).
//!
//! [`Endpoint::epoch_block`]: super::Endpoint::epoch_block

use crate::cuda::{self, DeviceMem, HostRegistration};
use crate::error::Result;
use crate::mem::{HostBlock, MemKind, SharedBlock};
use std::sync::Arc;

/// Bytes of an epoch block: 16 of epoch ids (`device`, `proxy`), `waitEpochId`, and a word the
/// P2P block uses for its host word's address.
pub const EPOCH_BYTES: usize = 32;

/// The plain block for a connection over `kind` memory: host memory for host connections,
/// device memory of the buffer's GPU for device ones (the kernel polls it in its L2; the
/// peer's copy engine or the local proxy writes it).
pub fn plain(kind: MemKind) -> Result<EpochMem> {
    match kind {
        MemKind::Host => Ok(EpochMem::Host(HostBlock::zeroed(EPOCH_BYTES, 16)?)),
        MemKind::Device(d) => {
            cuda::require("a GPU connection")?;
            Ok(EpochMem::Device(DeviceMem::zeroed(d, EPOCH_BYTES)?))
        }
    }
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

/// The epoch block of a P2P connection whose peer's proxy may also deliver signals into host
/// memory: the device block, whose word 3 holds the device address of the host word (the
/// `proxy` word of the shared block, offset 8) and word 4 wait()'s poll hint, and that shared
/// block, registered so this GPU's wait() can poll it (include/mscclpp/devconn_methods.inc). Fields drop in order: the
/// registration before the mapping it covers.
pub struct SignaledEpoch {
    dev: DeviceMem,
    _reg: HostRegistration,
    host: SharedBlock,
}

/// A connection's epoch block: host memory for host connections (shared memory for SHM ones),
/// device memory for GPU ones (with a host word for P2P ones, see [`SignaledEpoch`]).
pub enum EpochMem {
    Host(HostBlock),
    Shared(Arc<SharedBlock>),
    Device(DeviceMem),
    Signaled(SignaledEpoch),
}

impl EpochMem {
    /// A [`SignaledEpoch`] on `device`.
    pub fn signaled(device: i32) -> Result<Self> {
        // [device, proxy, waitEpochId, host word address, poll hint]
        let dev = DeviceMem::zeroed(device, 64)?;
        // Mapped by the peer with EPOCH_BYTES (`comm::setup::map_peer_epoch`).
        let host = SharedBlock::create(EPOCH_BYTES)?;
        let reg = HostRegistration::new(device, host.ptr(), host.len())?;
        dev.write_u64(24, reg.dev() + 8)?;
        Ok(EpochMem::Signaled(SignaledEpoch {
            dev,
            _reg: reg,
            host,
        }))
    }
}

impl EpochMem {
    /// The block's address (a host pointer, or a device address as a pointer: never
    /// dereferenced on the host in that case).
    pub fn ptr(&self) -> *mut u8 {
        match self {
            EpochMem::Host(h) => h.ptr(),
            EpochMem::Shared(h) => h.ptr(),
            EpochMem::Device(d) => d.ptr() as usize as *mut u8,
            EpochMem::Signaled(s) => s.dev.ptr() as usize as *mut u8,
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

    /// The shared-memory name a peer maps the block (or its host word) by.
    pub fn shared_name(&self) -> Option<&str> {
        match self {
            EpochMem::Shared(h) => Some(h.name()),
            EpochMem::Signaled(s) => Some(s.host.name()),
            _ => None,
        }
    }

    /// Removes the shared-memory name once the peer mapped the block.
    pub fn unlink_shared(&self) {
        match self {
            EpochMem::Shared(h) => h.unlink(),
            EpochMem::Signaled(s) => s.host.unlink(),
            _ => {}
        }
    }
}

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
        assert!(crate::fifo::Fifo::for_device(Some(0)).is_err());
    }
}
