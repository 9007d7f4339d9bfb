//! Registered buffers.

use super::{check_null, ffi_boundary, mscclppComm_t, put_out, with_comm};
use crate::abi::*;
use std::ffi::c_void;

/// Registers `local_memory[0, size)` (exactly that range) with every connection of `comm` and
/// exchanges it with each connected peer; every connected rank makes the same calls in the same
/// order, after `mscclppConnectionSetup`. `regMem` receives a handle owned by `comm`, written
/// only on success.
#[no_mangle]
pub extern "C" fn mscclppRegisterBuffer(
    comm: mscclppComm_t,
    local_memory: *mut c_void,
    size: usize,
    regMem: *mut mscclppRegisteredMemory,
) -> mscclppResult_t {
    ffi_boundary!("mscclppRegisterBuffer", {
        check_null!(local_memory, regMem);
        let h = with_comm(comm, |c| {
            c.register_buffer(local_memory as u64, size as u64)
        })?;
        put_out(regMem, mscclppRegisteredMemory { handle: h });
        Ok(())
    })
}

/// Unregisters the registration `regMem` (an extension of the 2023 API): a collective between
/// the connected peers, as `mscclppRegisterBuffer` is, every connected rank unregistering the
/// same registration (ranks may unregister registrations in any order, as long as both ends of
/// each connection unregister the same one at a time). This rank first drops what it holds of
/// the peers' buffers of that registration, then tells each peer so over the bootstrap, then
/// waits for each peer to say the same (each within the bootstrap timeout), and only then
/// releases its own registration. On `mscclppSuccess` no peer writes into this rank's buffer
/// through the registration any more and the library holds nothing of it: the memory may be
/// freed. A region that is also a connection's buffer (`mscclppConnect`) stays registered for
/// the connection. Neither side's proxy needs to run.
///
/// Afterwards the handle is dead: `mscclppRegisteredBufferWrite` and a second
/// `mscclppUnregisterBuffer` with it return `mscclppInvalidArgument` (its text says it was
/// unregistered), changing nothing. If a peer unregisters a different registration, or none
/// within the bootstrap timeout, the call fails (`mscclppRemoteError`), the handle is dead all
/// the same, and this rank keeps its registration until `mscclppCommDestroy`: the buffer must
/// then stay allocated until the communicator is destroyed, since the peer may still hold it.
/// A registration that a failed `mscclppRegisteredBufferWrite` wrote through is refused
/// (`mscclppInvalidUsage`, nothing sent): its writes may still be landing in the peers'
/// buffers; it is released at destroy.
/// NULL `regMem`, a handle this communicator never returned, a call before
/// `mscclppConnectionSetup` or after an asynchronous error: an error before anything is sent,
/// the handle unchanged. `*regMem` itself is never modified. Thread-safety as every call on
/// `comm` (serialised with them).
#[no_mangle]
pub extern "C" fn mscclppUnregisterBuffer(
    comm: mscclppComm_t,
    regMem: *mut mscclppRegisteredMemory,
) -> mscclppResult_t {
    ffi_boundary!("mscclppUnregisterBuffer", {
        check_null!(regMem);
        // SAFETY: checked non-NULL; the caller passes the struct `mscclppRegisterBuffer` filled.
        let handle = unsafe { (*regMem).handle };
        with_comm(comm, |c| c.unregister_buffer(handle))
    })
}

/// Writes `size` bytes from `srcBuff + srcOffset` to offset `dstOffset` of every connected
/// peer's buffer of the registration `regMem`, and returns once the bytes have arrived. With
/// CUDA memory, work already queued on `stream` completes first: a `cudaStream_t`, or 0 for
/// the legacy default stream, `cudaStreamLegacy` (1), `cudaStreamPerThread` (2, the calling
/// thread's default stream). 0 here always means the legacy stream: a program built with
/// `nvcc --default-stream per-thread` (or `CUDA_API_PER_THREAD_DEFAULT_STREAM`) whose kernel
/// filled `srcBuff` on its default stream must pass `(int64_t)cudaStreamPerThread`, or the
/// write may read the buffer before that kernel ends. A negative `stream` is
/// `mscclppInvalidArgument`. A write of 0 bytes checks its arguments as any other and moves
/// nothing. `srcBuff` may be freed once the call returns: the library keeps
/// no registration of it. The peers' proxies must be running (`mscclppProxyLaunch`): software
/// libfabric providers move data only while the target progresses its endpoint.
#[no_mangle]
pub extern "C" fn mscclppRegisteredBufferWrite(
    comm: mscclppComm_t,
    regMem: *mut mscclppRegisteredMemory,
    srcBuff: *mut c_void,
    size: usize,
    srcOffset: u32,
    dstOffset: u32,
    stream: i64,
) -> mscclppResult_t {
    ffi_boundary!("mscclppRegisteredBufferWrite", {
        check_null!(regMem, srcBuff);
        // SAFETY: checked non-NULL; the caller passes the struct `mscclppRegisterBuffer` filled.
        let handle = unsafe { (*regMem).handle };
        crate::cuda::sync_stream(stream)?;
        with_comm(comm, |c| {
            c.registered_write(
                handle,
                srcBuff as u64,
                size as u64,
                srcOffset as u64,
                dstOffset as u64,
            )
        })
    })
}
