//! CUDA streams this library creates, and bounded waits on any stream.
//!
//! Data-path methods (`copy`, `write_value64`, `query`, `wait`) expect the stream's context to be
//! current on the calling thread (a proxy thread bound with `bind_proxy_thread`, or a
//! [`super::CtxGuard`]): entering it on every call would cost the hot path a driver call.

use super::{check, describe, CtxGuard};
use crate::error::{Error, Result};
use crate::sync::{Backoff, Nap, Policy};
use cudarc::driver::sys;
use std::time::Duration;

/// An owned, non-blocking stream of one device (it does not synchronise with the legacy default
/// stream, so user work on stream 0 never delays the proxy's copies).
pub struct Stream {
    raw: sys::CUstream,
    device: i32,
}

// SAFETY: CUDA stream handles may be used from any thread whose current context is the
// stream's; `Stream` only hands the handle to the driver.
unsafe impl Send for Stream {}
// SAFETY: as above; every method takes `&self` and the driver serialises per stream.
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new(device: i32) -> Result<Self> {
        // Said once per process, when the library first needs a stream: from then on its GPU
        // work can stall behind the program's kernels (`super::queue_hint`).
        static ONE_QUEUE_TOLD: std::sync::Once = std::sync::Once::new();
        if super::one_queue() {
            ONE_QUEUE_TOLD.call_once(|| {
                crate::warn!(
                    "CUDA_DEVICE_MAX_CONNECTIONS=1 gives this process one hardware work queue, so this library's copy-engine work (P2P copies and flags, staging copies of the network transport) runs only once the program's kernel launched before it has ended: a kernel that waits for a put, signal or flush carried by them stalls until the wait timeout (ranks sharing a GPU always use them; the SM engine, itself a kernel, was seen running alongside). Unset it or set it to 2 or more"
                )
            });
        }
        let _g = CtxGuard::enter(device)?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        check(
            // SAFETY: out-pointer valid; context current (guard).
            unsafe {
                sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
            },
            || format!("cuStreamCreate(device {device})"),
        )?;
        Ok(Stream { raw, device })
    }

    pub fn device(&self) -> i32 {
        self.device
    }

    pub(super) fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// Queues a copy of `len` bytes; both addresses are unified (device, mapped peer or pinned
    /// host) addresses valid until the copy completes.
    pub fn copy(&self, dst: u64, src: u64, len: u64, device_to_device: bool) -> Result<()> {
        // SAFETY: the caller guarantees both ranges are valid for the copy's duration and the
        // stream's context is current (module doc).
        let r = unsafe {
            if device_to_device {
                sys::cuMemcpyDtoDAsync_v2(dst, src, len as usize, self.raw)
            } else {
                sys::cuMemcpyAsync(dst, src, len as usize, self.raw)
            }
        };
        check(r, || {
            format!("cuMemcpyAsync({dst:#x} <- {src:#x}, {len} bytes)")
        })
    }

    /// Queues an 8-byte store of `value` at `addr`, after all earlier work of the stream. The
    /// default flag puts a memory barrier before the store, so a reader that sees the value also
    /// sees every earlier copy of this stream. Only if `super::has_write_value64()`.
    pub fn write_value64(&self, addr: u64, value: u64) -> Result<()> {
        debug_assert!(super::has_write_value64());
        // SAFETY: the symbol was probed at detection (callers check has_write_value64); `addr` is
        // an 8-byte aligned device address valid for the write; context current (module doc).
        let r = unsafe {
            sys::cuStreamWriteValue64_v2(
                self.raw,
                addr,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        };
        check(r, || format!("cuStreamWriteValue64({addr:#x})"))
    }

    /// Copies `bytes` from host memory to device address `dst` and waits for the copy (bounded):
    /// for setup-time stores only.
    pub fn upload(&self, dst: u64, bytes: &[u8]) -> Result<()> {
        check(
            // SAFETY: `dst..dst + len` is device memory owned by the caller; `bytes` outlives the
            // copy, which the wait below completes before returning; context current.
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, bytes.as_ptr().cast(), bytes.len(), self.raw) },
            || format!("cuMemcpyHtoDAsync({dst:#x}, {} bytes)", bytes.len()),
        )?;
        self.wait(|| "a copy of a few bytes into device memory".into())
    }

    /// Copies `bytes.len()` bytes from device address `src` into `bytes` and waits for the copy
    /// (bounded): for reads of a few words outside the hot path.
    pub fn download(&self, src: u64, bytes: &mut [u8]) -> Result<()> {
        check(
            // SAFETY: `src..src + len` is device memory owned by the caller; `bytes` outlives the
            // copy, which the wait below completes before returning; context current.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(bytes.as_mut_ptr().cast(), src, bytes.len(), self.raw)
            },
            || format!("cuMemcpyDtoHAsync({src:#x}, {} bytes)", bytes.len()),
        )?;
        self.wait(|| "a copy of a few bytes out of device memory".into())
    }

    /// Queues a zero fill of `len` bytes at device address `addr`.
    pub fn memset0(&self, addr: u64, len: u64) -> Result<()> {
        // SAFETY: `addr..addr+len` is device memory owned by the caller; context current.
        check(
            unsafe { sys::cuMemsetD8Async(addr, 0, len as usize, self.raw) },
            || format!("cuMemsetD8Async({addr:#x}, {len})"),
        )
    }

    /// True once every queued operation has completed; an error if one failed.
    pub fn query(&self) -> Result<bool> {
        query_raw(self.raw)
    }

    /// Waits until the stream is idle, bounded by `MSCCLPP_WAIT_TIMEOUT`; `what` names the
    /// work in the timeout error (built only then: this is on the proxy's hot path).
    pub fn wait(&self, what: impl FnOnce() -> String) -> Result<()> {
        wait_raw(self.raw, what)
    }
}

fn query_raw(s: sys::CUstream) -> Result<bool> {
    // SAFETY: `s` is a live stream handle (or a special handle) of the current context.
    match unsafe { sys::cuStreamQuery(s) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        r => Err(Error::Cuda {
            call: "cuStreamQuery".into(),
            detail: describe(r),
        }),
    }
}

/// Polling a stream: spin first (a copy of a few KiB completes in microseconds and the proxy's
/// latency is the product), then yield, then nap.
const STREAM_POLL: Policy = Policy {
    spins: 20_000,
    yield_for: Duration::from_millis(10),
    nap: Nap::Fixed(Duration::from_micros(20)),
};

/// Polls a stream until idle; ends at `MSCCLPP_WAIT_TIMEOUT` with an error.
pub(crate) fn wait_raw(s: sys::CUstream, what: impl FnOnce() -> String) -> Result<()> {
    let mut b = Backoff::new(STREAM_POLL, crate::config::wait_timeout());
    while !query_raw(s)? {
        if b.expired() {
            return Err(b.timeout(format!(
                "waiting for {} to complete{}",
                what(),
                super::queue_hint()
            )));
        }
        b.pause();
    }
    Ok(())
}

/// A CUDA event without timing, recorded on a [`Stream`] to learn, without blocking, when the
/// work queued before it has completed (the net transport's staging copies). Like the data-path
/// methods of `Stream`, `record` and `query` expect the event's context to be current.
pub struct Event {
    raw: sys::CUevent,
    device: i32,
}

// SAFETY: event handles may be used from any thread whose current context is the event's;
// `Event` only hands the handle to the driver.
unsafe impl Send for Event {}

impl Event {
    pub fn new(device: i32) -> Result<Self> {
        let _g = CtxGuard::enter(device)?;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        check(
            // SAFETY: out-pointer valid; context current (guard). DISABLE_TIMING: cheapest kind.
            unsafe {
                sys::cuEventCreate(&mut raw, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            },
            || format!("cuEventCreate(device {device})"),
        )?;
        Ok(Event { raw, device })
    }

    /// Captures the work queued on `stream` so far (`stream` must be of the event's device).
    pub fn record(&self, stream: &Stream) -> Result<()> {
        debug_assert_eq!(stream.device, self.device);
        // SAFETY: both handles are live and of the same context, which is current (type doc).
        check(unsafe { sys::cuEventRecord(self.raw, stream.raw) }, || {
            "cuEventRecord".into()
        })
    }

    /// Captures the work queued so far on the legacy default stream, which comes after all
    /// work queued before it on the context's blocking streams (the legacy stream, per-thread
    /// default streams, and streams created without `cudaStreamNonBlocking`).
    pub fn record_legacy(&self) -> Result<()> {
        // SAFETY: a live event; CU_STREAM_LEGACY (0x1) is a special handle the driver accepts
        // for any context; the event's context is current (type doc).
        check(
            unsafe { sys::cuEventRecord(self.raw, 1usize as sys::CUstream) },
            || "cuEventRecord(CU_STREAM_LEGACY)".into(),
        )
    }

    /// True once the captured work has completed; an error if it failed.
    pub fn query(&self) -> Result<bool> {
        // SAFETY: a live event of the current context.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(Error::Cuda {
                call: "cuEventQuery".into(),
                detail: describe(r),
            }),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let g = CtxGuard::enter(self.device);
        // SAFETY: created by cuEventCreate, destroyed once. An event whose work is pending may
        // be destroyed (the driver releases it once that work completes).
        let r = unsafe { sys::cuEventDestroy_v2(self.raw) };
        if r != sys::CUresult::CUDA_SUCCESS {
            crate::warn!(
                "cuEventDestroy(device {}) failed: {}",
                self.device,
                describe(r)
            );
        }
        drop(g);
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Destroying a busy stream is allowed (the driver finishes its work first); the owners
        // wait for their streams before freeing what the work touches.
        let g = CtxGuard::enter(self.device);
        // SAFETY: `raw` was created by cuStreamCreate and is destroyed once.
        let r = unsafe { sys::cuStreamDestroy_v2(self.raw) };
        if r != sys::CUresult::CUDA_SUCCESS {
            crate::warn!(
                "cuStreamDestroy(device {}) failed: {}",
                self.device,
                describe(r)
            );
        }
        drop(g);
    }
}
