//! Shared by the Rust examples (`put_bench`, `soak`): exit on a failed call with the
//! library's message, and `--name value` arguments.

use mscclpp::abi::mscclppResult_t::{self, mscclppSuccess};
use mscclpp::capi::comm::mscclppGetLastError;
use std::ffi::CStr;

/// Exits 1 with `what` and the library's last error unless `r` is success.
pub fn ok(r: mscclppResult_t, what: &str) {
    if r != mscclppSuccess {
        // SAFETY: the library returns a NUL-terminated string owned by this thread.
        let e = unsafe { CStr::from_ptr(mscclppGetLastError()) }.to_string_lossy();
        eprintln!("{} failed: {e}", what);
        std::process::exit(1);
    }
}

/// The value after `name` on the command line, or `default`.
pub fn arg(name: &str, default: &str) -> String {
    let a: Vec<String> = std::env::args().collect();
    a.iter()
        .position(|x| x == name)
        .and_then(|i| a.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}
