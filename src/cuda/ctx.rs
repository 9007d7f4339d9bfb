//! Per-device state: the retained primary context (`Ctx`), entered around calls by user threads
//! (`CtxGuard`) and made current once on proxy threads (`bind_proxy_thread`), and a private
//! utility stream for the library's own small jobs (`with_util_stream`).

use super::{available, check, describe, need_driver, Stream};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Mutex;

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
pub(super) fn with_util_stream<T>(device: i32, f: impl FnOnce(&Stream) -> Result<T>) -> Result<T> {
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
