//! The only place that calls the CUDA driver (through cudarc's `driver::sys`, loaded at run time).
//!
//! Detection happens once ([`available`]): without `libcuda`, with a driver that lacks a symbol
//! this code calls, or with no device, the library runs in host mode (one INFO line says why) and
//! every buffer is host memory. With a driver, calls run in the *primary context* of the buffer's
//! device, the context the CUDA runtime gives the user's `cudaMalloc` pointers and streams: user
//! threads push it around each call ([`CtxGuard`]), proxy threads make it current once
//! ([`bind_proxy_thread`]). User pointers stay plain `u64`s: nothing here takes ownership of them.
//!
//! cudarc panics when `libcuda` or a symbol is missing, so nothing calls into cudarc before
//! [`available`] has checked both; optional symbols are probed before use.

mod ipc;
mod kernel;
mod mem;
mod stream;

pub(crate) use ipc::IPC_HANDLE_BYTES;
pub use ipc::{address_range, ipc_handle, IpcMapping};
pub use kernel::{Function, Module, P2P_ENGINE_PTX};
pub use mem::{DeviceMem, HostRegistration, PinnedHost};
pub use stream::{Event, Stream};

use crate::error::{Error, Result};
use crate::mem::MemKind;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::marker::PhantomData;
use std::sync::{Mutex, OnceLock};

/// What detection found; `None` in host mode.
struct Driver {
    devices: i32,
    /// `cuStreamWriteValue64_v2` is exported (absent from some drivers; probed, never assumed).
    write_value64: bool,
    /// `cuFlushGPUDirectRDMAWrites` is exported (CUDA >= 11.3 drivers).
    flush_rdma: bool,
}

/// Symbols every CUDA code path here calls. A driver missing one of them runs in host mode
/// rather than panicking inside cudarc on first use.
const REQUIRED: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetPCIBusId",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxGetState",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuPointerGetAttribute",
    "cuMemGetAddressRange_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostGetDevicePointer_v2",
    "cuMemsetD8Async",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamQuery",
    "cuMemcpyAsync",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventDestroy_v2",
];

static DRIVER: OnceLock<Option<Driver>> = OnceLock::new();

/// True if the loaded driver exports `name`. Only call after `is_culib_present()` said yes.
fn has_symbol(name: &str) -> bool {
    // SAFETY: the library was found (checked by the caller); looking a symbol up runs no code
    // of it, and the symbol's value is never called through this type.
    unsafe { sys::culib().get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_ok()
}

fn detect() -> Option<Driver> {
    if crate::config::get().disable_cuda {
        crate::info!("CUDA disabled by MSCCLPP_DISABLE_CUDA=1: host mode (host buffers only)");
        return None;
    }
    // SAFETY: only tries to dlopen the library; no CUDA code runs.
    if !unsafe { sys::is_culib_present() } {
        crate::info!("no CUDA driver (libcuda) found: host mode (host buffers only)");
        return None;
    }
    if let Some(missing) = REQUIRED.iter().find(|s| !has_symbol(s)) {
        crate::info!("the CUDA driver lacks {missing}: host mode (host buffers only); update the driver to use GPU buffers");
        return None;
    }
    // SAFETY: cuInit is exported (checked above); flags must be 0.
    let r = unsafe { sys::cuInit(0) };
    if r != sys::CUresult::CUDA_SUCCESS {
        crate::info!(
            "CUDA driver found but cuInit failed ({}): host mode (host buffers only)",
            describe(r)
        );
        return None;
    }
    let (mut n, mut ver) = (0i32, 0i32);
    // SAFETY: both out-pointers are valid for one int; the driver is initialised.
    let ok = unsafe { sys::cuDeviceGetCount(&mut n) } == sys::CUresult::CUDA_SUCCESS
        // SAFETY: as above.
        && unsafe { sys::cuDriverGetVersion(&mut ver) } == sys::CUresult::CUDA_SUCCESS;
    if !ok || n <= 0 {
        crate::info!("CUDA driver found but no device is visible: host mode (host buffers only)");
        return None;
    }
    let d = Driver {
        devices: n,
        write_value64: has_symbol("cuStreamWriteValue64_v2"),
        flush_rdma: has_symbol("cuFlushGPUDirectRDMAWrites"),
    };
    crate::info!(
        "CUDA driver {}.{} with {} device(s): GPU buffers enabled (stream write-value {}, GPUDirect RDMA flush {})",
        ver / 1000,
        (ver % 1000) / 10,
        n,
        if d.write_value64 { "yes" } else { "no" },
        if d.flush_rdma { "yes" } else { "no" }
    );
    Some(d)
}

/// True if the driver (found and initialised) exports `name`: for symbols used only by optional
/// features, checked before their first call.
fn has_symbol_loaded(name: &str) -> bool {
    driver().is_some() && has_symbol(name)
}

fn driver() -> Option<&'static Driver> {
    DRIVER.get_or_init(detect).as_ref()
}

/// True when a CUDA driver was found and initialised (checked once, logged once).
pub fn available() -> bool {
    driver().is_some()
}

/// Number of visible devices (0 in host mode).
pub fn device_count() -> i32 {
    driver().map_or(0, |d| d.devices)
}

/// Whether `cuStreamWriteValue64_v2` may be called.
pub(crate) fn has_write_value64() -> bool {
    driver().is_some_and(|d| d.write_value64)
}

/// Whether `cuFlushGPUDirectRDMAWrites` may be called ([`flush_gpudirect_rdma_writes`]).
pub fn has_flush_gpudirect_rdma() -> bool {
    driver().is_some_and(|d| d.flush_rdma)
}

/// The driver's name and text for a result code.
fn describe(r: sys::CUresult) -> String {
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

/// Fails with a clear error naming `what` when this process runs in host mode.
pub fn require(what: &str) -> Result<()> {
    need_driver(what).map(|_| ())
}

fn need_driver(what: &str) -> Result<&'static Driver> {
    driver().ok_or_else(|| {
        Error::usage(format!(
            "{what} needs a CUDA driver and device; this process runs in host mode (see the INFO log)"
        ))
    })
}

/// Per device: the retained primary context and a private stream for our own small jobs.
struct DeviceState {
    ctx: usize,
    util: Option<Stream>,
}

/// Primary contexts are retained once per device and kept for the process lifetime, as the CUDA
/// runtime does: releasing them while user kernels run would tear the context down.
static DEVICES: Mutex<Option<HashMap<i32, DeviceState>>> = Mutex::new(None);

fn primary_ctx(device: i32) -> Result<sys::CUcontext> {
    let drv = need_driver("this call")?;
    if device < 0 || device >= drv.devices {
        return Err(Error::invalid_arg(format!(
            "CUDA device {device} does not exist ({} visible)",
            drv.devices
        )));
    }
    let mut g = crate::sync::lock(&DEVICES);
    let map = g.get_or_insert_with(HashMap::new);
    if let Some(s) = map.get(&device) {
        return Ok(s.ctx as sys::CUcontext);
    }
    let mut dev: sys::CUdevice = 0;
    // SAFETY: out-pointer valid; ordinal range checked above.
    check(unsafe { sys::cuDeviceGet(&mut dev, device) }, || {
        format!("cuDeviceGet({device})")
    })?;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    check(
        // SAFETY: out-pointer valid; `dev` came from cuDeviceGet. Never released (see DEVICES).
        unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
        || format!("cuDevicePrimaryCtxRetain(device {device})"),
    )?;
    map.insert(
        device,
        DeviceState {
            ctx: ctx as usize,
            util: None,
        },
    );
    Ok(ctx)
}

/// Runs `f` with the device's private utility stream (created on first use), context current.
/// The stream is made outside the DEVICES lock (creating it takes that lock for the context);
/// `f` runs under the lock, so jobs on one device's utility stream never interleave.
fn with_util_stream<T>(device: i32, f: impl FnOnce(&Stream) -> Result<T>) -> Result<T> {
    let _g = CtxGuard::enter(device)?;
    let exists = |g: &Option<HashMap<i32, DeviceState>>| {
        g.as_ref()
            .and_then(|m| m.get(&device))
            .is_some_and(|s| s.util.is_some())
    };
    if !exists(&crate::sync::lock(&DEVICES)) {
        let s = Stream::new(device)?;
        let spare = {
            let mut g = crate::sync::lock(&DEVICES);
            match g.as_mut().and_then(|m| m.get_mut(&device)) {
                Some(st) if st.util.is_none() => {
                    st.util = Some(s);
                    None
                }
                // A racing thread set one meanwhile: keep the first.
                _ => Some(s),
            }
        };
        // Dropped outside the lock: destroying a stream takes the lock (for its context).
        drop(spare);
    }
    let g = crate::sync::lock(&DEVICES);
    let s = g
        .as_ref()
        .and_then(|m| m.get(&device))
        .and_then(|st| st.util.as_ref())
        .ok_or_else(|| Error::internal("device state missing after CtxGuard::enter"))?;
    f(s)
}

/// A device's retained primary context, cheap to copy and to enter (no lookup).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ctx(usize);

impl Ctx {
    /// The primary context of `device`, retained on first use.
    pub fn primary(device: i32) -> Result<Self> {
        primary_ctx(device).map(|c| Ctx(c as usize))
    }
}

/// Makes the primary context of a device current on this thread for the guard's lifetime: pushed
/// only if another (or no) context is current, popped on drop. Not `Send`: contexts are a
/// per-thread stack.
pub struct CtxGuard {
    pushed: bool,
    _not_send: PhantomData<*const ()>,
}

impl CtxGuard {
    pub fn enter(device: i32) -> Result<Self> {
        Self::enter_ctx(Ctx::primary(device)?)
    }

    /// As `enter`, for a context looked up earlier (the proxy's hot path).
    pub fn enter_ctx(c: Ctx) -> Result<Self> {
        let ctx = c.0 as sys::CUcontext;
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: out-pointer valid; the driver is initialised (primary_ctx succeeded).
        check(unsafe { sys::cuCtxGetCurrent(&mut cur) }, || {
            "cuCtxGetCurrent".into()
        })?;
        if cur == ctx {
            return Ok(CtxGuard {
                pushed: false,
                _not_send: PhantomData,
            });
        }
        // SAFETY: `ctx` is a retained primary context that lives for the process.
        check(unsafe { sys::cuCtxPushCurrent_v2(ctx) }, || {
            "cuCtxPushCurrent".into()
        })?;
        Ok(CtxGuard {
            pushed: true,
            _not_send: PhantomData,
        })
    }
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if self.pushed {
            let mut old: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: pops exactly the context `enter` pushed on this same thread (not Send).
            let r = unsafe { sys::cuCtxPopCurrent_v2(&mut old) };
            if r != sys::CUresult::CUDA_SUCCESS {
                crate::warn!("cuCtxPopCurrent failed: {}", describe(r));
            }
        }
    }
}

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

/// Makes the primary context of `device` current on a proxy thread, once, for the thread's life.
/// `None` (a host-memory endpoint) or host mode: nothing to do. A failure is logged: the first
/// CUDA call of the proxy then reports it as the proxy's (sticky) error.
pub fn bind_proxy_thread(device: Option<i32>) {
    let Some(d) = device else { return };
    if !available() {
        return;
    }
    let r = primary_ctx(d).and_then(|ctx| {
        // SAFETY: a retained primary context, valid for the process lifetime.
        check(unsafe { sys::cuCtxSetCurrent(ctx) }, || {
            format!("cuCtxSetCurrent(device {d})")
        })
    });
    if let Err(e) = r {
        crate::warn!("proxy thread could not bind CUDA device {d}: {e}");
    }
}

/// Waits (bounded by `MSCCLPP_WAIT_TIMEOUT`) for the work queued on a user's `cudaStream_t`
/// (`0`: the legacy default stream, `1`/`2`: `cudaStreamLegacy`/`cudaStreamPerThread`). Host
/// mode: nothing can be queued, returns at once.
pub fn sync_stream(stream: i64) -> Result<()> {
    if !available() {
        return Ok(());
    }
    let s = stream as usize as sys::CUstream;
    // The special handles mean "the current context's" stream; with none current, use the
    // first device whose primary context is active (a user thread that never touched CUDA).
    let _g = if stream <= 2 {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: out-pointer valid; driver initialised.
        check(unsafe { sys::cuCtxGetCurrent(&mut cur) }, || {
            "cuCtxGetCurrent".into()
        })?;
        if cur.is_null() {
            Some(CtxGuard::enter(0)?)
        } else {
            None
        }
    } else {
        None
    };
    stream::wait_raw(s, || {
        "the user's stream passed to mscclppRegisteredBufferWrite".into()
    })
}

/// The NUMA node of a device, from sysfs; `None` where unknown or reported as -1 (as on some
/// virtual machines). Informational: nothing here depends on it.
pub fn numa_node(device: i32) -> Option<i32> {
    let _g = CtxGuard::enter(device).ok()?;
    let mut buf = [0 as std::ffi::c_char; 32];
    let mut dev: sys::CUdevice = 0;
    // SAFETY: out-pointers valid; buffer length passed.
    let ok = unsafe { sys::cuDeviceGet(&mut dev, device) } == sys::CUresult::CUDA_SUCCESS
        // SAFETY: as above; the driver NUL-terminates within `len`.
        && unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev) }
            == sys::CUresult::CUDA_SUCCESS;
    if !ok {
        return None;
    }
    // SAFETY: NUL-terminated by the driver (checked success).
    let bus = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .to_ascii_lowercase();
    let s = std::fs::read_to_string(format!("/sys/bus/pci/devices/{bus}/numa_node")).ok()?;
    s.trim().parse::<i32>().ok().filter(|n| *n >= 0)
}

/// Makes GPUDirect RDMA writes that already reached `device` visible to its kernels
/// (`cuFlushGPUDirectRDMAWrites`, owner scope). For the network transport's GPU buffers.
/// Errors if the driver lacks the call: never silently skipped.
pub fn flush_gpudirect_rdma_writes(device: i32) -> Result<()> {
    let drv = need_driver("a GPUDirect RDMA flush")?;
    if !drv.flush_rdma {
        return Err(Error::usage(
            "the CUDA driver has no cuFlushGPUDirectRDMAWrites (needs a CUDA 11.3+ driver)",
        ));
    }
    let _g = CtxGuard::enter(device)?;
    // SAFETY: the symbol exists (probed at detection); the context is current.
    check(
        unsafe {
            sys::cuFlushGPUDirectRDMAWrites(
                sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
            )
        },
        || format!("cuFlushGPUDirectRDMAWrites(device {device})"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    // These run on machines without a GPU (CI): they pin host-mode behaviour, and on a GPU
    // machine they still hold for host pointers.
    #[test]
    fn host_pointers_are_host() {
        let v = [0u8; 64];
        assert_eq!(mem_kind(v.as_ptr() as u64), MemKind::Host);
        assert_eq!(mem_kind(0), MemKind::Host);
        assert!(!is_managed(v.as_ptr() as u64));
    }

    #[test]
    fn legacy_stream_sync_is_fine_without_work() {
        if !available() {
            sync_stream(0).unwrap();
        }
    }

    #[test]
    fn proxy_binding_without_device_is_a_no_op() {
        bind_proxy_thread(None);
    }

    #[test]
    fn device_paths_fail_cleanly_in_host_mode() {
        if available() {
            return;
        }
        assert!(matches!(require("a test"), Err(Error::InvalidUsage(_))));
        assert!(flush_gpudirect_rdma_writes(0).is_err());
        assert_eq!(numa_node(0), None);
        assert_eq!(device_count(), 0);
    }
}
