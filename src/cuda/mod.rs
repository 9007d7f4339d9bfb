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
//!
//! Files: this one detects and loads the driver; `result.rs` turns its result codes into our
//! errors, `ctx.rs` holds each device's primary context and utility stream (and binds proxy
//! threads to it), `pointer.rs` asks the driver where a pointer lives, `device.rs` has the
//! remaining device calls (a user's stream, NUMA node, GPUDirect RDMA flush, peer atomics); `ipc.rs`,
//! `kernel.rs`, `mem.rs` and `stream.rs` wrap those driver objects.

mod ctx;
mod device;
mod ipc;
mod kernel;
mod mem;
mod pointer;
mod result;
mod stream;

use ctx::with_util_stream;
pub use ctx::{bind_proxy_thread, Ctx, CtxGuard};
pub use device::{
    blocking_work_done_by, flush_gpudirect_rdma_writes, native_atomics_between, pci_bus_id,
    sync_stream,
};
pub(crate) use ipc::IPC_HANDLE_BYTES;
pub use ipc::{address_range, ipc_handle, IpcMapping};
pub use kernel::{Function, Module, P2P_ENGINE_PTX};
pub use mem::{DeviceMem, PinnedHost};
pub use pointer::{is_managed, mem_kind};
pub(crate) use result::check;
use result::describe;
pub use stream::{Event, Stream};

use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::sync::OnceLock;

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

/// `CUDA_DEVICE_MAX_CONNECTIONS=1`: this process's streams share one hardware work queue.
pub(crate) fn one_queue() -> bool {
    crate::config::get().p2p.cuda_max_connections == Some(1)
}

/// The other processes found on each of this process's GPUs under an MPS daemon, as (device,
/// process nonce), each once however many communicators or connections lead to it (the P2P
/// transport notes them as it adds peers). "The same GPU" is the P2P transport's test: the same
/// PCI address on the same host (`p2p::blob::Address::same_gpu`).
static MPS_SHARED_PEERS: std::sync::Mutex<Vec<(i32, u64)>> = std::sync::Mutex::new(Vec::new());

/// The fewest hardware work queues (`CUDA_DEVICE_MAX_CONNECTIONS`) seen to carry 3 and 4 ranks
/// sharing one GPU under MPS with every operation through the proxy (bench/RESULTS.md, issue
/// 44: at CUDA's default of 8 every such run stalled; at 16 none did; at 32 the fourth rank's
/// context could not be made, out of memory).
pub(crate) const MPS_SHARED_QUEUES: u32 = 16;

/// Whether `peers` other ranks on this GPU under MPS, with `max_connections` hardware work
/// queues asked for (None: CUDA's default of 8), make the shared-queue stall possible: MPS
/// clients share one pool of queues, so with three or more ranks a stream of this library's
/// can share a queue with another rank's spinning kernel and wait behind it.
pub(crate) fn mps_queues_short_for(peers: usize, max_connections: Option<u32>) -> bool {
    peers >= 2 && max_connections.unwrap_or(8) < MPS_SHARED_QUEUES
}

fn mps_queues_short() -> bool {
    let most = {
        let g = crate::sync::lock(&MPS_SHARED_PEERS);
        g.iter()
            .map(|&(d, _)| g.iter().filter(|&&(e, _)| e == d).count())
            .max()
            .unwrap_or(0)
    };
    mps_queues_short_for(most, crate::config::get().p2p.cuda_max_connections)
}

/// Adds (device, nonce) to `seen` unless it is there; returns the count of processes on
/// `device` it then holds, or None when it was there already.
fn note_in(seen: &mut Vec<(i32, u64)>, device: i32, nonce: u64) -> Option<usize> {
    if seen.contains(&(device, nonce)) {
        return None;
    }
    seen.push((device, nonce));
    Some(seen.iter().filter(|&&(d, _)| d == device).count())
}

/// Notes process `nonce` (not this one) on this process's GPU `device` under MPS; true exactly
/// once per device, when the count of such processes makes the shared-queue stall possible
/// (the caller warns then).
pub(crate) fn note_mps_shared_peer(device: i32, nonce: u64) -> bool {
    let n = note_in(&mut crate::sync::lock(&MPS_SHARED_PEERS), device, nonce);
    n == Some(2) && mps_queues_short_for(2, crate::config::get().p2p.cuda_max_connections)
}

/// What to add to a timeout of this library's GPU work where its streams can wait behind a
/// running kernel. With one hardware work queue (`CUDA_DEVICE_MAX_CONNECTIONS=1`) every
/// stream feeds that queue in order, so the proxy's copy-engine work waits behind the
/// program's running kernel, and a kernel that waits for it never lets it run (measured:
/// bench/RESULTS.md, session 13; the SM engine, a kernel too, was seen running alongside the
/// program's on two GPUs, session 17). With three or more ranks on one GPU under MPS, whose
/// clients share one pool of queues, the same can happen behind another rank's kernel
/// (`mps_queues_short_for`). Empty otherwise.
pub(crate) fn queue_hint() -> &'static str {
    if one_queue() {
        " (CUDA_DEVICE_MAX_CONNECTIONS=1 is set: this library's copy-engine work queues behind the program's running kernel, so a kernel that waits for it stalls it; unset it or set 2 or more)"
    } else if mps_queues_short() {
        " (three or more ranks share this GPU under MPS, whose clients share one pool of hardware work queues: this library's copy-engine work can queue behind another rank's running kernel; set CUDA_DEVICE_MAX_CONNECTIONS=16 in every rank's environment)"
    } else {
        ""
    }
}

/// `queue_hint` for a report about another rank's copy-engine work (a hang report's "signal
/// sent but not arrived"): what holds in this process, said as such, since the sender's own
/// condition is not known here.
pub(crate) fn queue_hint_for_sender() -> &'static str {
    if one_queue() {
        " (CUDA_DEVICE_MAX_CONNECTIONS=1 is set here: where the sender has it too, its copy-engine work queues behind its running kernel)"
    } else if mps_queues_short() {
        " (three or more ranks share this rank's GPU under MPS with fewer than 16 hardware work queues: if the sender is one of them, its copy-engine work can wait behind another rank's running kernel; set CUDA_DEVICE_MAX_CONNECTIONS=16 in every rank's environment)"
    } else {
        ""
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::MemKind;

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
    fn a_process_is_counted_once_per_gpu() {
        let mut seen = Vec::new();
        assert_eq!(note_in(&mut seen, 0, 1), Some(1), "one other process");
        assert_eq!(
            note_in(&mut seen, 0, 1),
            None,
            "the same one again (another communicator)"
        );
        assert_eq!(note_in(&mut seen, 1, 2), Some(1), "another GPU's");
        assert_eq!(
            note_in(&mut seen, 0, 3),
            Some(2),
            "a second on GPU 0: the warning's count"
        );
        assert_eq!(note_in(&mut seen, 0, 4), Some(3));
    }

    #[test]
    fn the_shared_queue_hint_needs_three_ranks_and_fewer_than_16_queues() {
        assert!(!mps_queues_short_for(0, None));
        assert!(
            !mps_queues_short_for(1, None),
            "two ranks on a GPU ran at 8 queues"
        );
        assert!(
            mps_queues_short_for(2, None),
            "three ranks stalled at CUDA's default of 8"
        );
        assert!(mps_queues_short_for(3, Some(8)));
        assert!(mps_queues_short_for(3, Some(15)));
        assert!(
            !mps_queues_short_for(3, Some(16)),
            "four ranks passed at 16"
        );
        assert!(!mps_queues_short_for(3, Some(32)));
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
        assert_eq!(pci_bus_id(0), None);
        assert_eq!(device_count(), 0);
    }
}
