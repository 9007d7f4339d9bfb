//! Types, constants and layouts shared with C and CUDA.
//!
//! This file is the single source of truth for `include/mscclpp.h`: cbindgen emits every item
//! below, ctest compares them with the header, and the const asserts at the bottom pin the 2023
//! layout. It uses no external crate so that ctest can read it on its own.
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

use core::ffi::{c_char, c_int, c_void};

pub const MSCCLPP_MAJOR: c_int = 0;
pub const MSCCLPP_MINOR: c_int = 1;
pub const MSCCLPP_PATCH: c_int = 0;
pub const MSCCLPP_VERSION: c_int = MSCCLPP_MAJOR * 10000 + MSCCLPP_MINOR * 100 + MSCCLPP_PATCH;

/// Number of trigger slots in one proxy FIFO.
pub const MSCCLPP_PROXY_FIFO_SIZE: u64 = 128;
/// The proxy publishes its tail to the producers every this many triggers (and on every Sync).
pub const MSCCLPP_PROXY_FIFO_FLUSH_COUNTER: u64 = 4;
pub const MSCCLPP_UNIQUE_ID_BYTES: usize = 128;

/// Trigger type bits (`type` field of a trigger, a mask).
pub const mscclppData: u64 = 0x1;
pub const mscclppFlag: u64 = 0x2;
pub const mscclppSync: u64 = 0x4;

/// Trigger word layout. word0 = dataSize | srcDataOffset << 32;
/// word1 = dstDataOffset | connId << 32 | type << 42. Shifts and masks, never bit-fields.
pub const MSCCLPP_BITS_SIZE: u32 = 32;
pub const MSCCLPP_BITS_OFFSET: u32 = 32;
pub const MSCCLPP_BITS_CONNID: u32 = 10;
pub const MSCCLPP_BITS_TYPE: u32 = 3;
pub const MSCCLPP_TRIGGER_SIZE_MASK: u64 = (1u64 << MSCCLPP_BITS_SIZE) - 1;
pub const MSCCLPP_TRIGGER_OFFSET_MASK: u64 = (1u64 << MSCCLPP_BITS_OFFSET) - 1;
pub const MSCCLPP_TRIGGER_CONNID_SHIFT: u32 = MSCCLPP_BITS_OFFSET;
pub const MSCCLPP_TRIGGER_CONNID_MASK: u64 = (1u64 << MSCCLPP_BITS_CONNID) - 1;
pub const MSCCLPP_TRIGGER_TYPE_SHIFT: u32 = MSCCLPP_BITS_OFFSET + MSCCLPP_BITS_CONNID;
pub const MSCCLPP_TRIGGER_TYPE_MASK: u64 = (1u64 << MSCCLPP_BITS_TYPE) - 1;

/// Result codes, values 0..8 as in 2023.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum mscclppResult_t {
    mscclppSuccess = 0,
    mscclppUnhandledCudaError = 1,
    mscclppSystemError = 2,
    mscclppInternalError = 3,
    mscclppInvalidArgument = 4,
    mscclppInvalidUsage = 5,
    mscclppRemoteError = 6,
    mscclppInProgress = 7,
    mscclppNumResults = 8,
}

/// Transport types. SHM (unimplemented in 2023) is libfabric's shared-memory provider here.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum mscclppTransport_t {
    mscclppTransportP2P = 0,
    mscclppTransportSHM = 1,
    mscclppTransportIB = 2,
}

/// Epoch counters of one side of a connection. Every `signal()` increments `device`; the proxy
/// (or a peer GPU) writes the peer's signal count into `proxy`; `wait()` spins on `proxy`.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default)]
pub struct mscclppDevConnSignalEpochId {
    pub device: u64,
    pub proxy: u64,
}

/// One FIFO slot: two u64 words written by one 16-byte store; word0 == 0 means empty.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default)]
pub struct mscclppTrigger {
    pub value: [u64; 2],
}

/// Producer view of a proxy's trigger FIFO. Many producers (GPU threads, or host threads for
/// host-memory connections) push; one proxy thread consumes. The u64 after `*triggerFifoTail`
/// is the communicator's abort word: non-zero (an `mscclppResult_t`) ends every spin loop.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct mscclppConcurrentFifo {
    pub triggerFifo: *mut mscclppTrigger,
    pub triggerFifoTail: *mut u64,
    pub triggerFifoHead: *mut u64,
    pub connId: c_int,
}

/// The 2023 `mscclppBaseConn` fields, kept for code that names the base type.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct mscclppBaseConn {
    pub remoteRank: c_int,
    pub tag: c_int,
    pub localBuff: *mut c_void,
    pub localSignalEpochId: *mut mscclppDevConnSignalEpochId,
    pub remoteSignalEpochId: *mut mscclppDevConnSignalEpochId,
    pub waitEpochId: *mut u64,
    pub remoteBuff: *mut c_void,
}

/// A connection as a kernel (or a host thread) sees it: the `mscclppBaseConn` fields in their
/// 2023 order, then the FIFO. 80 bytes, `fifo` at offset 48.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct mscclppDevConn {
    pub remoteRank: c_int,
    pub tag: c_int,
    pub localBuff: *mut c_void,
    pub localSignalEpochId: *mut mscclppDevConnSignalEpochId,
    pub remoteSignalEpochId: *mut mscclppDevConnSignalEpochId,
    pub waitEpochId: *mut u64,
    pub remoteBuff: *mut c_void,
    pub fifo: mscclppConcurrentFifo,
}

/// 128 opaque bytes produced by `mscclppGetUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct mscclppUniqueId {
    pub internal: [c_char; MSCCLPP_UNIQUE_ID_BYTES],
}

/// A buffer registered with `mscclppRegisterBuffer`. The 2023 struct held a `std::vector`, which
/// C cannot declare; this one holds a handle owned by the communicator (released by
/// `mscclppCommDestroy`). Zero-initialise it before use.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct mscclppRegisteredMemory {
    pub handle: u64,
}

/// Receives every log line (NUL-terminated, no trailing newline).
pub type mscclppLogHandler_t = Option<unsafe extern "C" fn(msg: *const c_char)>;

// Trigger encoding, shared by the host producer, the proxy and the tests.
#[inline]
pub const fn trigger_encode(ty: u64, dst: u64, src: u64, size: u64, conn_id: u64) -> [u64; 2] {
    [
        (size & MSCCLPP_TRIGGER_SIZE_MASK)
            | ((src & MSCCLPP_TRIGGER_OFFSET_MASK) << MSCCLPP_BITS_SIZE),
        (dst & MSCCLPP_TRIGGER_OFFSET_MASK)
            | ((conn_id & MSCCLPP_TRIGGER_CONNID_MASK) << MSCCLPP_TRIGGER_CONNID_SHIFT)
            | ((ty & MSCCLPP_TRIGGER_TYPE_MASK) << MSCCLPP_TRIGGER_TYPE_SHIFT),
    ]
}

// The 2023 layout, pinned. ctest checks the header against these same items.
const _: () = {
    use core::mem::{align_of, offset_of, size_of};
    assert!(size_of::<mscclppDevConnSignalEpochId>() == 16);
    assert!(align_of::<mscclppDevConnSignalEpochId>() == 16);
    assert!(size_of::<mscclppTrigger>() == 16);
    assert!(size_of::<mscclppConcurrentFifo>() == 32);
    assert!(size_of::<mscclppBaseConn>() == 48);
    assert!(size_of::<mscclppDevConn>() == 80);
    assert!(offset_of!(mscclppDevConn, remoteBuff) == 40);
    assert!(offset_of!(mscclppDevConn, fifo) == 48);
    assert!(offset_of!(mscclppDevConn, waitEpochId) == 32);
    assert!(size_of::<mscclppUniqueId>() == 128);
    assert!(size_of::<mscclppResult_t>() == 4);
    assert!(size_of::<mscclppTransport_t>() == 4);
    assert!(MSCCLPP_BITS_SIZE + MSCCLPP_BITS_OFFSET == 64);
    assert!(MSCCLPP_BITS_OFFSET + MSCCLPP_BITS_CONNID + MSCCLPP_BITS_TYPE <= 64);
};
