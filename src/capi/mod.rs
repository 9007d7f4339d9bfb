//! The C API: the only place with `extern "C"`. Every export runs inside `ffi_boundary!`,
//! which turns errors into `mscclppResult_t`, records the thread's last error text, logs it, and
//! stops panics at the boundary.
#![allow(non_camel_case_types, non_snake_case)]
// Exports take raw pointers from C and cannot be `unsafe fn` for C callers; each one checks
// NULL first and documents what the pointer must be. Clippy's lint assumes Rust callers.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

pub mod buffer;
pub mod comm;
pub mod conn;
pub mod devconn;
pub mod log;

use crate::abi::mscclppResult_t;
use crate::comm::Comm;
use crate::error::Error;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

/// Opaque communicator. C holds only `mscclppComm_t` pointers, made by `mscclppCommInitRank` /
/// `mscclppCommInitRankFromId` and released by `mscclppCommDestroy`; a destroyed or foreign
/// handle is `mscclppInvalidArgument`, not a crash. Handles are never reused in a process, so a
/// destroyed one never names a newer communicator.
// (The pointer is a number looked up in `COMMS`, never dereferenced.)
pub struct mscclppComm {
    _private: [u8; 0],
}

/// A communicator handle (2023 name).
pub type mscclppComm_t = *mut mscclppComm;
/// A connection as kernels see it (2023 name); arrays of it come from `mscclppGetAllDeviceConnections`.
pub type mscclppDevConn_t = crate::abi::mscclppDevConn;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

pub(crate) fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

pub(crate) fn last_error_ptr() -> *const c_char {
    // The pointer stays valid until this thread's next failing call replaces the string.
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// Records, logs and converts a failure of export `func`.
pub(crate) fn fail(func: &str, e: Error) -> mscclppResult_t {
    let msg = format!("{func}: {e}");
    crate::warn!("{msg}");
    set_last_error(&msg);
    e.code()
}

pub(crate) fn panicked(func: &str, p: Box<dyn std::any::Any + Send>) -> mscclppResult_t {
    let what = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    fail(
        func,
        Error::internal(format!("panic inside the library: {what}")),
    )
}

/// Runs `$body` (an expression of type `Result<(), Error>`) for export `$name`: no panic
/// escapes, errors become result codes and the thread's last error.
macro_rules! ffi_boundary {
    ($name:literal, $body:block) => {{
        match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(
            || -> $crate::error::Result<()> { $body },
        )) {
            Ok(Ok(())) => $crate::abi::mscclppResult_t::mscclppSuccess,
            Ok(Err(e)) => $crate::capi::fail($name, e),
            Err(p) => $crate::capi::panicked($name, p),
        }
    }};
}
pub(crate) use ffi_boundary;

/// Returns early with `mscclppInvalidArgument` when a pointer argument is NULL.
macro_rules! check_null {
    ($($p:ident),+) => {
        $(if $p.is_null() {
            return Err($crate::error::Error::invalid_arg(concat!(stringify!($p), " is NULL")));
        })+
    };
}
pub(crate) use check_null;

/// A live communicator; the sticky error is reachable without the comm's lock.
pub(crate) struct Entry {
    pub comm: Mutex<Comm>,
    pub sticky: Arc<crate::proxy::Sticky>,
}
type CommCell = Arc<Entry>;

/// Live communicators by handle value.
static COMMS: LazyLock<Mutex<HashMap<usize, CommCell>>> = LazyLock::new(Default::default);

/// The number in the next communicator handle. A handle is a number, never an address, and
/// never handed out twice in a process: a destroyed communicator's handle never names a later
/// one, so a second destroy (or any call) with it is an error and cannot reach a newer
/// communicator. (A freed allocation as the handle was reused by the next communicator's;
/// one never freed would be a leak to every leak checker.) Relaxed: only uniqueness matters.
static NEXT_HANDLE: AtomicUsize = AtomicUsize::new(1);

pub(crate) fn register_comm(c: Comm) -> mscclppComm_t {
    // Multiples of 16, as an allocation's address would be; never dereferenced.
    let token = std::ptr::without_provenance_mut::<mscclppComm>(
        NEXT_HANDLE.fetch_add(1, Ordering::Relaxed) << 4,
    );
    let sticky = c.sticky_handle();
    crate::sync::lock(&COMMS).insert(
        token as usize,
        Arc::new(Entry {
            comm: Mutex::new(c),
            sticky,
        }),
    );
    token
}

/// Looks a handle up; NULL, destroyed and foreign handles are errors.
pub(crate) fn get_comm(h: mscclppComm_t) -> Result<CommCell, Error> {
    if h.is_null() {
        return Err(Error::invalid_arg("comm is NULL"));
    }
    crate::sync::lock(&COMMS)
        .get(&(h as usize))
        .cloned()
        .ok_or_else(|| {
            Error::invalid_arg(format!(
                "{h:p} is not a live communicator (destroyed already, or never created)"
            ))
        })
}

/// Runs `f` on the communicator behind `h`, one API call at a time per communicator.
pub(crate) fn with_comm<T>(
    h: mscclppComm_t,
    f: impl FnOnce(&mut Comm) -> Result<T, Error>,
) -> Result<T, Error> {
    let cell = get_comm(h)?;
    let mut g = crate::sync::lock(&cell.comm);
    f(&mut g)
}

pub(crate) fn take_comm(h: mscclppComm_t) -> Result<CommCell, Error> {
    if h.is_null() {
        return Err(Error::invalid_arg("comm is NULL"));
    }
    crate::sync::lock(&COMMS)
        .remove(&(h as usize))
        .ok_or_else(|| {
            Error::invalid_arg(format!(
                "{h:p} is not a live communicator (destroyed already?)"
            ))
        })
}

/// Converts a C string argument; NULL gives None.
pub(crate) fn opt_str(p: *const c_char, what: &str) -> Result<Option<String>, Error> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller passes a NUL-terminated string (API contract).
    let s = unsafe { std::ffi::CStr::from_ptr(p) };
    s.to_str()
        .map(|s| Some(s.to_owned()))
        .map_err(|_| Error::invalid_arg(format!("{what} is not valid UTF-8")))
}

/// Writes `v` to an out-parameter (only on success, by construction of the callers).
pub(crate) fn put_out<T>(p: *mut T, v: T) {
    // SAFETY: callers checked `p` for NULL; the C caller provides writable storage.
    unsafe { p.write(v) }
}
