//! CUDA IPC: exporting the allocation behind a device pointer and mapping a peer's.
//!
//! Handles name whole allocations, so they are taken on the allocation base
//! (`cuMemGetAddressRange`); the offset of the user's pointer travels beside the handle.

use super::{check, describe, CtxGuard};
use crate::error::{Error, Result};
use cudarc::driver::sys;

pub(crate) const IPC_HANDLE_BYTES: usize = 64;

/// The allocation containing device address `ptr`: `(base, size)`. `device` is `ptr`'s device.
pub fn address_range(device: i32, ptr: u64) -> Result<(u64, u64)> {
    let _g = CtxGuard::enter(device)?;
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    check(
        // SAFETY: out-pointers valid; context current.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) },
        || format!("cuMemGetAddressRange({ptr:#x})"),
    )?;
    Ok((base, size as u64))
}

/// The IPC handle of the allocation whose base is `base` on `device`.
pub fn ipc_handle(device: i32, base: u64) -> Result<[u8; IPC_HANDLE_BYTES]> {
    let _g = CtxGuard::enter(device)?;
    let mut h = sys::CUipcMemHandle {
        reserved: [0; IPC_HANDLE_BYTES],
    };
    // SAFETY: out-pointer valid; context current. Fails (no UB) for memory IPC cannot share:
    // managed, cuMemCreate/VMM and stream-ordered pool allocations.
    check(unsafe { sys::cuIpcGetMemHandle(&mut h, base) }, || {
        format!("cuIpcGetMemHandle({base:#x}) (CUDA IPC shares only cudaMalloc/cuMemAlloc memory)")
    })?;
    Ok(h.reserved.map(|c| c as u8))
}

/// A peer's allocation mapped into `device`'s primary context (peer access enabled lazily by
/// the driver), unmapped on drop.
pub struct IpcMapping {
    ptr: u64,
    size: u64,
    device: i32,
}

impl IpcMapping {
    /// Maps `handle`, whose exporter says it names `claimed_size` bytes. The mapped size, where
    /// the driver reports it, is the bound used for checks; a smaller claim is kept (the
    /// exporter's own view), a larger one is an error.
    pub fn open(device: i32, handle: &[u8; IPC_HANDLE_BYTES], claimed_size: u64) -> Result<Self> {
        let _g = CtxGuard::enter(device)?;
        let h = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        check(
            // SAFETY: out-pointer valid; context current. The driver validates the handle bytes
            // (an unknown or foreign handle is an error, not a mapping).
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            },
            || {
                "cuIpcOpenMemHandle (is the peer's GPU visible to this process, on this host?)"
                    .into()
            },
        )?;
        let m = IpcMapping {
            ptr,
            size: claimed_size,
            device,
        };
        match address_range(device, ptr) {
            Ok((base, size)) if base == ptr => {
                if size < claimed_size {
                    return Err(Error::remote(format!(
                        "IPC handle maps {size} bytes, but the exporter claims {claimed_size}"
                    )));
                }
            }
            Ok((base, _)) => crate::trace!(
                "IPC mapping at {ptr:#x} reports base {base:#x}: using the exporter's size"
            ),
            Err(e) => crate::trace!(
                "size of IPC mapping at {ptr:#x} unknown ({e}): using the exporter's size"
            ),
        }
        Ok(m)
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn size(&self) -> u64 {
        self.size
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let g = CtxGuard::enter(self.device);
        // SAFETY: `ptr` came from cuIpcOpenMemHandle in `open` and is closed once. Its owner
        // (the P2P endpoint) drops it only once its engine kernel and streams are seen ended,
        // and teardown drops that endpoint only once the process's kernels are (they may
        // store through the mapping, `remoteBuff`); on any other path the mapping is leaked,
        // except when the last region imported from it is forgotten (`Endpoint::forget`,
        // mscclppUnregisterBuffer): every copy into it was flushed, and no kernel was given
        // its address (a connection's region in it would still hold it).
        let r = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        if r != sys::CUresult::CUDA_SUCCESS {
            crate::warn!(
                "cuIpcCloseMemHandle({:#x}) failed: {}",
                self.ptr,
                describe(r)
            );
        }
        drop(g);
    }
}
