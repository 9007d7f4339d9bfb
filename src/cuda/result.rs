//! Driver result codes as our errors: the driver's own name and text for a code, and `check`,
//! which every driver call here goes through.

use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::ffi::CStr;

/// The driver's name and text for a result code.
pub(super) fn describe(r: sys::CUresult) -> String {
    let (mut name, mut text): (*const std::ffi::c_char, *const std::ffi::c_char) =
        (std::ptr::null(), std::ptr::null());
    // SAFETY: both functions only write a pointer to a static string (or leave it NULL on an
    // unknown code); the symbols were checked before any CUresult could exist.
    unsafe {
        sys::cuGetErrorName(r, &mut name);
        sys::cuGetErrorString(r, &mut text);
    }
    let s = |p: *const std::ffi::c_char| {
        if p.is_null() {
            None
        } else {
            // SAFETY: non-NULL results point to NUL-terminated static strings of the driver.
            Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        }
    };
    match (s(name), s(text)) {
        (Some(n), Some(t)) => format!("{n}: {t}"),
        _ => format!("CUDA error {}", r as u32),
    }
}

/// Turns a driver result into our error, naming the call.
pub(crate) fn check(r: sys::CUresult, call: impl FnOnce() -> String) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda {
            call: call(),
            detail: describe(r),
        })
    }
}
