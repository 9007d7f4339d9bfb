//! Device calls that need no state of their own: waiting on a user's stream, a device's NUMA
//! node, the GPUDirect RDMA flush, whether one GPU's kernels have native atomics on another's
//! memory.

use super::{available, check, has_symbol_loaded, need_driver, stream, CtxGuard};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::ffi::CStr;

/// `cudaStreamLegacy` and `cudaStreamPerThread`: the runtime's special handles, which the
/// driver takes as `CUstream` values too (`CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`).
const STREAM_LEGACY: i64 = 1;
const STREAM_PER_THREAD: i64 = 2;

/// Waits (bounded by `MSCCLPP_WAIT_TIMEOUT`) for the work queued on a user's `cudaStream_t`:
/// `0`, the legacy default stream (what 0 means to the driver, whatever the caller was compiled
/// with: a program built with `--default-stream per-thread` passes `cudaStreamPerThread`),
/// `1` (`cudaStreamLegacy`), `2` (`cudaStreamPerThread`: the calling thread's, which is ours,
/// the call being synchronous), or a stream handle; a negative value is none of these. Host
/// mode: nothing can be queued, returns at once.
pub fn sync_stream(stream: i64) -> Result<()> {
    if stream < 0 {
        return Err(Error::invalid_arg(format!(
            "stream {stream:#x} is not a cudaStream_t (0, cudaStreamLegacy, cudaStreamPerThread or a stream handle)"
        )));
    }
    if !available() {
        return Ok(());
    }
    let s = stream as usize as sys::CUstream;
    // The special handles mean "the current context's" stream; with none current, use the
    // first device whose primary context is active (a user thread that never touched CUDA).
    let special = matches!(stream, 0 | STREAM_LEGACY | STREAM_PER_THREAD);
    let _g = if special {
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

/// Whether the work this process queued on `device`'s blocking streams before this call (its
/// kernels on the legacy default stream, per-thread default streams and streams created
/// without `cudaStreamNonBlocking`) has ended, waiting for it until `deadline` at most: an event
/// recorded on the legacy stream completes only after all of it. Never blocks in the driver
/// (`cuMemFree` and `cuMemFreeHost` may wait for a running kernel; this check lets teardown
/// leak what such a kernel may still touch instead). Kernels on non-blocking streams are not
/// seen. Host mode: true.
pub fn blocking_work_done_by(device: i32, deadline: std::time::Instant) -> Result<bool> {
    if !available() {
        return Ok(true);
    }
    let _g = CtxGuard::enter(device)?;
    let ev = stream::Event::new(device)?;
    ev.record_legacy()?;
    let bound = deadline.saturating_duration_since(std::time::Instant::now());
    // A kernel released by the abort ends within microseconds; one that does not may take
    // the whole bound, which naps rather than holds a core.
    let poll = crate::sync::Policy {
        spins: 64,
        yield_for: std::time::Duration::from_millis(1),
        nap: crate::sync::Nap::Fixed(std::time::Duration::from_micros(200)),
    };
    let mut b = crate::sync::Backoff::new(poll, bound);
    // Ends when the event completes, or at the deadline.
    while !ev.query()? {
        if b.expired() {
            return Ok(false);
        }
        b.pause();
    }
    Ok(true)
}

/// The PCI address of a device as the driver writes it (`00000000:1b:00.0`, lower-cased);
/// None without a driver or device.
pub fn pci_bus_id(device: i32) -> Option<String> {
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
    Some(bus)
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

/// Whether kernels on device `from` can access device `to`'s memory and run atomics on it
/// natively (NVLink, or PCIe with atomics), as the driver says
/// (`cuDeviceGetP2PAttribute`; probed, an older driver without it answers false). The same
/// device: true. Without a driver: false.
pub fn native_atomics_between(from: i32, to: i32) -> bool {
    if !available() {
        return false;
    }
    if from == to {
        return true;
    }
    if !has_symbol_loaded("cuDeviceGetP2PAttribute") {
        return false;
    }
    let (mut a, mut b): (sys::CUdevice, sys::CUdevice) = (0, 0);
    // SAFETY: out-pointers valid; the driver is initialised (`available`) and rejects ordinals
    // it does not know.
    let ok = unsafe { sys::cuDeviceGet(&mut a, from) } == sys::CUresult::CUDA_SUCCESS
        // SAFETY: as above.
        && unsafe { sys::cuDeviceGet(&mut b, to) } == sys::CUresult::CUDA_SUCCESS;
    if !ok {
        return false;
    }
    let attr = |which| {
        let mut v: std::ffi::c_int = 0;
        // SAFETY: the symbol exists (probed above); out-pointer valid for one int; both
        // devices come from cuDeviceGet.
        let r = unsafe { sys::cuDeviceGetP2PAttribute(&mut v, which, a, b) };
        r == sys::CUresult::CUDA_SUCCESS && v != 0
    };
    attr(sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED)
        && attr(sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)
}
