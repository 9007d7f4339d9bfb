//! Log handler exports.

use super::ffi_boundary;
use crate::abi::*;
use std::ffi::c_char;

/// Writes `msg` and a newline to stderr. NULL is ignored.
#[no_mangle]
pub extern "C" fn mscclppDefaultLogHandler(msg: *const c_char) {
    if msg.is_null() {
        return;
    }
    // SAFETY: non-NULL; the caller passes a NUL-terminated string (API contract).
    crate::log::default_handler(unsafe { std::ffi::CStr::from_ptr(msg) })
}

/// Sends every later log line of this process to `handler` (NULL restores the default). The
/// handler may be called from any thread, including proxy threads, and must be thread-safe.
#[no_mangle]
pub extern "C" fn mscclppSetLogHandler(handler: mscclppLogHandler_t) -> mscclppResult_t {
    ffi_boundary!("mscclppSetLogHandler", {
        crate::log::set_handler(handler);
        Ok(())
    })
}
