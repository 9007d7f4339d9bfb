//! Where a pointer lives, as the driver reports it: device memory (and which device), host
//! memory, or managed memory.

use super::{available, device_count, CtxGuard};
use crate::mem::MemKind;
use cudarc::driver::sys;
use std::ffi::c_void;

/// Where `ptr` lives: `Device(ordinal)` for CUDA device memory (including memory mapped from
/// another process), `Host` otherwise (pageable, pinned, or host mode).
pub fn mem_kind(ptr: u64) -> MemKind {
    if !available() || ptr == 0 {
        return MemKind::Host;
    }
    // Pointer attributes are context-independent under unified addressing, but a driver may
    // still want *a* current context: first try as we are, then inside each device's already
    // active primary context (never creating one just to ask).
    if let Some(k) = query_kind(ptr) {
        return k;
    }
    for d in 0..device_count() {
        let (mut flags, mut active) = (0u32, 0i32);
        let mut dev: sys::CUdevice = 0;
        // SAFETY: out-pointers valid; `d` is a visible ordinal.
        let ok = unsafe { sys::cuDeviceGet(&mut dev, d) } == sys::CUresult::CUDA_SUCCESS
            // SAFETY: as above.
            && unsafe { sys::cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active) }
                == sys::CUresult::CUDA_SUCCESS;
        if ok && active != 0 {
            if let Ok(_g) = CtxGuard::enter(d) {
                if let Some(k) = query_kind(ptr) {
                    return k;
                }
            }
        }
    }
    MemKind::Host
}

/// One attempt at classifying `ptr`; None when the driver could not say (e.g. no context).
fn query_kind(ptr: u64) -> Option<MemKind> {
    let mut ty: u32 = 0;
    // SAFETY: MEMORY_TYPE writes one unsigned int into `ty`.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut ty as *mut u32).cast::<c_void>(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr,
        )
    };
    match r {
        sys::CUresult::CUDA_SUCCESS => {}
        // Not memory the driver knows: ordinary pageable host memory.
        sys::CUresult::CUDA_ERROR_INVALID_VALUE => return Some(MemKind::Host),
        _ => return None,
    }
    if ty != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Some(MemKind::Host);
    }
    let mut ord: i32 = -1;
    // SAFETY: DEVICE_ORDINAL writes one int.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut ord as *mut i32).cast::<c_void>(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    };
    (r == sys::CUresult::CUDA_SUCCESS && ord >= 0).then_some(MemKind::Device(ord))
}

/// True if `ptr` is CUDA managed (unified) memory, which CUDA IPC cannot share.
pub fn is_managed(ptr: u64) -> bool {
    if !available() {
        return false;
    }
    let mut m: u32 = 0;
    // SAFETY: IS_MANAGED writes one unsigned int (a bool).
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut m as *mut u32).cast::<c_void>(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
            ptr,
        )
    };
    r == sys::CUresult::CUDA_SUCCESS && m != 0
}
