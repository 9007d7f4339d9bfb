//! Kernels this library runs itself. Their PTX is generated offline from the CUDA sources in
//! `kernels/` (`scripts/gen-ptx.sh`; the Rust build has no CUDA compiler) and embedded here; the
//! driver compiles it for the GPU when the module loads. Loading is optional: a driver that
//! lacks the symbols or refuses the PTX (older than the PTX's CUDA version) gets an error the
//! caller turns into "use the copy engines", never a panic.

use super::{check, has_symbol_loaded, CtxGuard, Stream};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::ffi::{c_void, CStr, CString};

/// The P2P transport's SM copy engine (`kernels/p2p_engine.cu`).
pub const P2P_ENGINE_PTX: &str = include_str!("kernels/p2p_engine.ptx");

/// Driver calls this module needs beyond the ones detection requires.
const SYMBOLS: &[&str] = &[
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuMemsetD32Async",
];

/// A loaded module, unloaded on drop (after its kernels stopped: the owner's duty).
pub struct Module {
    raw: sys::CUmodule,
    device: i32,
}

// SAFETY: module and function handles may be used from any thread with the module's context
// current; `Module` only hands them to the driver.
unsafe impl Send for Module {}

/// A kernel of a [`Module`]; valid while the module is loaded.
#[derive(Clone, Copy)]
pub struct Function(sys::CUfunction);

// SAFETY: as for `Module`.
unsafe impl Send for Function {}

impl Module {
    /// Loads `ptx` into the primary context of `device` (the driver compiles it now).
    pub fn load_ptx(device: i32, ptx: &str) -> Result<Self> {
        if let Some(missing) = SYMBOLS.iter().find(|s| !has_symbol_loaded(s)) {
            return Err(Error::usage(format!("the CUDA driver lacks {missing}")));
        }
        let text = CString::new(ptx).map_err(|_| Error::internal("PTX with a NUL byte"))?;
        let _g = CtxGuard::enter(device)?;
        let mut raw: sys::CUmodule = std::ptr::null_mut();
        check(
            // SAFETY: out-pointer valid; `text` is NUL-terminated PTX and outlives the call (the
            // driver copies what it keeps); context current (guard).
            unsafe { sys::cuModuleLoadData(&mut raw, text.as_ptr().cast::<c_void>()) },
            || format!("cuModuleLoadData (embedded PTX, device {device})"),
        )?;
        Ok(Module { raw, device })
    }

    pub fn function(&self, name: &CStr) -> Result<Function> {
        let mut f: sys::CUfunction = std::ptr::null_mut();
        check(
            // SAFETY: live module; NUL-terminated name; out-pointer valid.
            unsafe { sys::cuModuleGetFunction(&mut f, self.raw, name.as_ptr()) },
            || format!("cuModuleGetFunction({name:?})"),
        )?;
        Ok(Function(f))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let g = CtxGuard::enter(self.device);
        // SAFETY: loaded in `load_ptx`, unloaded once; its kernels have finished (owner).
        let r = unsafe { sys::cuModuleUnload(self.raw) };
        if r != sys::CUresult::CUDA_SUCCESS {
            crate::warn!("cuModuleUnload failed: {}", super::describe(r));
        }
        drop(g);
    }
}

impl Stream {
    /// Queues `f` with `grid` x `block` threads. `params` holds one pointer per kernel
    /// parameter, to a value of exactly that parameter's type.
    ///
    /// # Safety
    /// `params` must match the kernel's signature, and the memory the kernel touches must stay
    /// valid until it finishes. The stream's context must be current (see `stream.rs`).
    pub unsafe fn launch(
        &self,
        f: Function,
        grid: u32,
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: forwarded to the caller (function doc).
        check(
            unsafe {
                sys::cuLaunchKernel(
                    f.0,
                    grid,
                    1,
                    1,
                    block,
                    1,
                    1,
                    0,
                    self.raw(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            || format!("cuLaunchKernel({grid} x {block})"),
        )
    }

    /// Queues a fill of `count` 32-bit words at `addr` with `value`.
    pub fn memset_u32(&self, addr: u64, value: u32, count: u64) -> Result<()> {
        // SAFETY: `addr..addr + 4 count` is device memory owned by the caller; the symbol was
        // checked when the module loaded (its only users hold a Module); context current.
        check(
            unsafe { sys::cuMemsetD32Async(addr, value, count as usize, self.raw()) },
            || format!("cuMemsetD32Async({addr:#x}, {count})"),
        )
    }
}
