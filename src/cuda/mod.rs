//! The only place that calls the CUDA driver (stub: host mode only until the GPU path lands).

use crate::transport::MemKind;

/// True when a CUDA driver was found and initialised (checked once).
pub fn available() -> bool {
    false
}

/// Where `ptr` lives: host memory unless the driver says it is device memory.
pub fn mem_kind(_ptr: u64) -> MemKind {
    MemKind::Host
}

/// Makes the device's primary context current on a proxy thread (no-op in host mode).
pub fn bind_proxy_thread() {}

/// A FIFO whose producers are kernels on `device` (pinned host memory mapped into the device).
pub fn new_fifo(device: i32) -> crate::error::Result<crate::fifo::Fifo> {
    Err(crate::error::Error::usage(format!(
        "CUDA device {device} buffers need the GPU path, which this build does not have yet"
    )))
}

/// Memory for one connection's epoch block (`mscclppDevConnSignalEpochId` then `waitEpochId`),
/// reachable by whoever produces and waits on that connection.
pub fn alloc_epoch(kind: MemKind) -> crate::error::Result<crate::mem::HostBlock> {
    match kind {
        MemKind::Host => crate::mem::HostBlock::zeroed(32, 16),
        MemKind::Device(d) => Err(crate::error::Error::usage(format!(
            "CUDA device {d} epochs need the GPU path"
        ))),
    }
}

/// Where the epoch block of a connection over `kind` memory lives.
pub fn epoch_kind(kind: MemKind) -> MemKind {
    kind
}

/// Waits for the work queued on a user's `cudaStream_t` (no-op in host mode).
pub fn sync_stream(_stream: i64) -> crate::error::Result<()> {
    Ok(())
}
