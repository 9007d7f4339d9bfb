//! Memory this library allocates through the driver: device memory (epochs, FIFO heads) and
//! pinned host memory mapped into the device (FIFO slots, staging values).

use super::{check, describe, with_util_stream, CtxGuard};
use crate::error::Result;
use cudarc::driver::sys;
use std::ffi::c_void;

/// Owned device memory (`cuMemAlloc`), zeroed at creation, freed on drop. Being a whole
/// allocation, it can be exported through CUDA IPC.
pub struct DeviceMem {
    ptr: u64,
    len: usize,
    device: i32,
}

impl DeviceMem {
    /// `len` zeroed bytes on `device`; the zero fill has completed when this returns.
    pub fn zeroed(device: i32, len: usize) -> Result<Self> {
        let _g = CtxGuard::enter(device)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer valid; context current (guard).
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, len.max(1)) }, || {
            format!("cuMemAlloc({len} bytes on device {device})")
        })?;
        let m = DeviceMem { ptr, len, device };
        // A private stream and a wait: the fill must be complete before a peer or a kernel on
        // any stream can see this memory, and the legacy stream would wait for user work.
        with_util_stream(device, |s| {
            s.memset0(ptr, len as u64)?;
            s.wait(|| "zeroing a new device allocation".into())
        })?;
        Ok(m)
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Stores `value` at byte `offset` (8-byte aligned, inside the allocation); done when this
    /// returns. Setup only: a private stream and a wait, as in `zeroed`.
    pub fn write_u64(&self, offset: usize, value: u64) -> Result<()> {
        self.write_words(offset, &[value])
    }
    /// Stores `values` at byte `offset` on (consecutive u64s, 8-byte aligned, inside the
    /// allocation); done when this returns. Setup only: a private stream and a wait, as in
    /// `zeroed`.
    pub fn write_words(&self, offset: usize, values: &[u64]) -> Result<()> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
        if offset % 8 != 0 || offset + bytes.len() > self.len {
            return Err(crate::error::Error::internal(format!(
                "{}-byte store at offset {offset} of a {}-byte device allocation",
                bytes.len(),
                self.len
            )));
        }
        let _g = CtxGuard::enter(self.device)?;
        with_util_stream(self.device, |s| s.upload(self.ptr + offset as u64, &bytes))
    }
    /// Reads the u64 at byte `offset` (8-byte aligned, inside the allocation): a private
    /// stream and a wait, as in `write_words`; not for the hot path.
    pub fn read_u64(&self, offset: usize) -> Result<u64> {
        if offset % 8 != 0 || offset + 8 > self.len {
            return Err(crate::error::Error::internal(format!(
                "8-byte load at offset {offset} of a {}-byte device allocation",
                self.len
            )));
        }
        let mut b = [0u8; 8];
        let _g = CtxGuard::enter(self.device)?;
        with_util_stream(self.device, |s| {
            s.download(self.ptr + offset as u64, &mut b)
        })?;
        Ok(u64::from_ne_bytes(b))
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn device(&self) -> i32 {
        self.device
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        let g = CtxGuard::enter(self.device);
        // SAFETY: allocated by cuMemAlloc in `zeroed`, freed once.
        let r = unsafe { sys::cuMemFree_v2(self.ptr) };
        if r != sys::CUresult::CUDA_SUCCESS {
            crate::warn!("cuMemFree({:#x}) failed: {}", self.ptr, describe(r));
        }
        drop(g);
    }
}

/// Owned pinned host memory, mapped into every context (`cuMemHostAlloc` with DEVICEMAP |
/// PORTABLE), zeroed. The CPU uses [`PinnedHost::host`], kernels and copies [`PinnedHost::dev`].
pub struct PinnedHost {
    host: *mut u8,
    dev: u64,
    len: usize,
    device: i32,
}

// SAFETY: an owned allocation; all access goes through raw pointers whose users document their
// synchronisation (atomics, or the stream order of the copies that read it).
unsafe impl Send for PinnedHost {}
// SAFETY: as above.
unsafe impl Sync for PinnedHost {}

impl PinnedHost {
    /// `len` zeroed bytes, page aligned, mapped for `device`.
    pub fn zeroed(device: i32, len: usize) -> Result<Self> {
        let _g = CtxGuard::enter(device)?;
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        check(
            // SAFETY: out-pointer valid; context current.
            unsafe { sys::cuMemHostAlloc(&mut p, len.max(1), flags) },
            || format!("cuMemHostAlloc({len} bytes, DEVICEMAP|PORTABLE)"),
        )?;
        // SAFETY: `p` is a fresh allocation of at least `len` bytes.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, len) };
        let mut m = PinnedHost {
            host: p.cast(),
            dev: 0,
            len,
            device,
        };
        let mut dev: sys::CUdeviceptr = 0;
        check(
            // SAFETY: `p` is mapped (DEVICEMAP); flags must be 0.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, p, 0) },
            || "cuMemHostGetDevicePointer".into(),
        )?;
        m.dev = dev;
        Ok(m)
    }
    pub fn host(&self) -> *mut u8 {
        self.host
    }
    pub fn dev(&self) -> u64 {
        self.dev
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        let g = CtxGuard::enter(self.device);
        // SAFETY: allocated by cuMemHostAlloc in `zeroed`, freed once.
        let r = unsafe { sys::cuMemFreeHost(self.host.cast()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            crate::warn!("cuMemFreeHost failed: {}", describe(r));
        }
        drop(g);
    }
}
