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

/// Trigger word layout (2023). word0 = dataSize | srcDataOffset << 32;
/// word1 = dstDataOffset | connId << 32 | type << 42, offsets' bits 0..32; bits 45..61 carry
/// their bits 32..40 (`MSCCLPP_TRIGGER_OFFSET_BITS`). Shifts and masks, never bit-fields.
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

/// Offsets wider than the 2023 layout's 32 bits: bits 32..40 of srcDataOffset go to word1 bits
/// 45..53, those of dstDataOffset to bits 53..61 (bits the 2023 layout leaves 0, so a trigger
/// in that layout decodes as before). A trigger addresses offsets below 2^40 (1 TiB).
pub const MSCCLPP_TRIGGER_OFFSET_BITS: u32 = 40;
pub const MSCCLPP_TRIGGER_OFFSET_HIGH_MASK: u64 =
    (1u64 << (MSCCLPP_TRIGGER_OFFSET_BITS - MSCCLPP_BITS_OFFSET)) - 1;
pub const MSCCLPP_TRIGGER_SRC_HIGH_SHIFT: u32 = MSCCLPP_TRIGGER_TYPE_SHIFT + MSCCLPP_BITS_TYPE;
pub const MSCCLPP_TRIGGER_DST_HIGH_SHIFT: u32 =
    MSCCLPP_TRIGGER_SRC_HIGH_SHIFT + MSCCLPP_TRIGGER_OFFSET_BITS - MSCCLPP_BITS_OFFSET;
/// A put must end within this many bytes of both buffers' starts (its last byte below 2^40).
pub const MSCCLPP_TRIGGER_MAX_END: u64 = 1u64 << MSCCLPP_TRIGGER_OFFSET_BITS;
/// A put of more than `MSCCLPP_TRIGGER_SIZE_MASK` bytes goes as triggers of this many bytes
/// (Data only), then one trigger with the rest that carries the put's Flag and Sync.
pub const MSCCLPP_TRIGGER_CHUNK: u64 = 1u64 << 31;
/// Word1 bit 63: a *refused* trigger. A producer that cannot encode a put queues this instead,
/// so the proxy reports it (the communicator's sticky error) rather than moving wrapped
/// offsets. word0 = the value refused (never 0), word1 = this bit | connId << 32 | what.
pub const MSCCLPP_TRIGGER_REFUSED: u64 = 1u64 << 63;
/// `what` of a refused trigger (word1 bits 0..32).
pub const MSCCLPP_REFUSED_SIZE: u64 = 1;
pub const MSCCLPP_REFUSED_SRC_OFFSET: u64 = 2;
pub const MSCCLPP_REFUSED_DST_OFFSET: u64 = 3;
/// A trigger of 0 bytes (word0 = 1; a zero word0 would read as an empty slot).
pub const MSCCLPP_REFUSED_ZERO_SIZE: u64 = 4;
/// A put of more than one trigger whose source (`_SRC`) or destination (`_DST`) range does not
/// fit the connection's buffer, found before its first trigger (value: where it would end).
pub const MSCCLPP_REFUSED_RANGE_SRC: u64 = 5;
pub const MSCCLPP_REFUSED_RANGE_DST: u64 = 6;

/// Words of a CUDA FIFO's device block (`triggerFifoHead[...]`) that bound device waits,
/// written when the FIFO is made and read by a kernel only once it has been waiting:
/// nanoseconds after which a wait publishes its record (`MSCCLPP_WAIT_TIMEOUT`), after which
/// it ends (`MSCCLPP_DEVICE_WAIT_TIMEOUT`; 0: never), and the word a waiter claims (0 -> 1,
/// device-scope CAS) to own the record.
pub const MSCCLPP_FIFO_DEV_WARN_NS: usize = 5;
pub const MSCCLPP_FIFO_DEV_LIMIT_NS: usize = 6;
pub const MSCCLPP_FIFO_DEV_RECORD_OWNER: usize = 7;
/// Word of a CUDA FIFO's device block where a trigger with work that no connection method
/// queued is recorded: 1 + the ticket of the last such trigger that `fifo.push()` or
/// `fifo.pushPut()` called directly queued (atomicMax; 0: none). The direct path of every
/// connection on the FIFO waits until the FIFO's done word has passed it
/// (include/mscclpp/devconn_methods.inc, `directPath`): it cannot tell whose work it is.
pub const MSCCLPP_FIFO_DEV_RAW: usize = 8;
/// Word of a CUDA FIFO's device block where a push that gave up records its ticket: 1 + the
/// highest ticket a producer took but never wrote, because the abort found it waiting for room
/// (atomicMax; 0: none). Its slot may hold the zero that an earlier trigger's retirement left,
/// which a wait would take for its own completion: while the word is not 0, no device wait on
/// the FIFO reports completion (`waitCompleted`). `mscclppProxyLaunch` retires every ticket
/// below it as a no-op and clears it (`Fifo::retire_abandoned`).
pub const MSCCLPP_FIFO_DEV_ABANDONED: usize = 9;

/// The wait record: 8 words of pinned host memory at `triggerFifoTail + 8` (the cache line
/// after `[tail, abort]`), where a kernel whose wait has lasted the warn threshold says what it
/// waits for. Written by the owner only, as a sequence lock: SEQ odd while it writes.
pub const MSCCLPP_FIFO_RECORD_WORD: usize = 8;
pub const MSCCLPP_RECORD_SEQ: usize = 0;
/// op (`MSCCLPP_WAIT_OP_*`, bits 0..16) | state << 16 | connId << 32; the state is 0 (none,
/// or withdrawn: the wait ended), `MSCCLPP_RECORD_PENDING` or `MSCCLPP_RECORD_EXPIRED`.
pub const MSCCLPP_RECORD_WHAT: usize = 1;
/// wait: of the count seen, the signals the peer's kernels stored themselves (the epoch's
/// direct word, `MSCCLPP_EPOCH_DIRECT`); 0 for the other operations.
pub const MSCCLPP_RECORD_DIRECT: usize = 2;
/// Where the state sits in `MSCCLPP_RECORD_WHAT`.
pub const MSCCLPP_RECORD_STATE_SHIFT: u32 = 16;
/// wait: the signal count wanted and the count seen; flush: the Sync's ticket and the tail;
/// push: the ticket and the tail.
pub const MSCCLPP_RECORD_WANTED: usize = 3;
pub const MSCCLPP_RECORD_SEEN: usize = 4;
/// The FIFO's ticket counter (the next ticket) when written.
pub const MSCCLPP_RECORD_HEAD: usize = 5;
/// How long the wait had lasted when written, in ns.
pub const MSCCLPP_RECORD_WAITED_NS: usize = 6;
/// Non-zero once a wait that did not own the record ended at the device timeout.
pub const MSCCLPP_RECORD_OTHERS_EXPIRED: usize = 7;
pub const MSCCLPP_RECORD_PENDING: u64 = 1;
pub const MSCCLPP_RECORD_EXPIRED: u64 = 2;
/// Words of a GPU connection's epoch block (`localSignalEpochId` points at word 0, in device
/// memory of the buffer's GPU; `MSCCLPP_EPOCH_DEVICE_BYTES` bytes, zeroed at setup). Words 0
/// and 1 are `mscclppDevConnSignalEpochId`, word 2 is `waitEpochId`. Word 3: signals the
/// peer's kernels stored themselves (the direct path, P2P): each adds 1 there, and `wait()`
/// counts `proxy + direct`. Words 4..7, written at setup and read-only for kernels: the largest
/// put one thread makes itself on this connection (0: none, every operation through the
/// proxy), this side's and the peer's buffer sizes, and the largest put a whole block makes
/// itself (`putBlock`; 0: block puts go through the proxy). Words 8 to 10, this side's
/// kernels' own: 1 + the FIFO ticket of the connection's last trigger with work (Data or
/// Flag), a ticket below which every trigger of the connection is known complete (a flush of
/// it returned), and the signal count the connection's waiting thread last read with acquire
/// (`wait()` returns at once while its target is not above it); word 11, of that count, the
/// part the proxy carried (word 0 when it was read: `wait()` acquires word 0 again only when
/// it grew since).
pub const MSCCLPP_EPOCH_DEVICE_BYTES: usize = 128;
pub const MSCCLPP_EPOCH_DIRECT: usize = 3;
pub const MSCCLPP_EPOCH_DIRECT_BYTES: usize = 4;
pub const MSCCLPP_EPOCH_LOCAL_SIZE: usize = 5;
pub const MSCCLPP_EPOCH_REMOTE_SIZE: usize = 6;
pub const MSCCLPP_EPOCH_DIRECT_BLOCK_BYTES: usize = 7;
pub const MSCCLPP_EPOCH_PROXIED: usize = 8;
pub const MSCCLPP_EPOCH_FLUSHED: usize = 9;
pub const MSCCLPP_EPOCH_ACQUIRED: usize = 10;
pub const MSCCLPP_EPOCH_ACQUIRED_PROXY: usize = 11;
pub const MSCCLPP_WAIT_OP_WAIT: u64 = 1;
pub const MSCCLPP_WAIT_OP_FLUSH: u64 = 2;
pub const MSCCLPP_WAIT_OP_PUSH: u64 = 3;

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
/// (or a peer GPU's copy engine or SM engine) writes the count of the peer's signals it
/// delivered into `proxy`. On a P2P connection with the direct path the peer's kernels also
/// add their own signals into the word after `waitEpochId` (`MSCCLPP_EPOCH_DIRECT`), so
/// `wait()` spins on `proxy + direct`: code that polls the epoch itself must sum the two
/// (README, "Polling the epoch yourself").
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

// Trigger encoding, shared by the host producer, the proxy and the tests (the device side is
// `encodeTrigger` in include/mscclpp/fifo_methods.inc). Only for values that
// `trigger_refusal` accepts: others would be cut to their encoded bits.
#[inline]
pub const fn trigger_encode(ty: u64, dst: u64, src: u64, size: u64, conn_id: u64) -> [u64; 2] {
    let high = MSCCLPP_TRIGGER_OFFSET_HIGH_MASK;
    [
        (size & MSCCLPP_TRIGGER_SIZE_MASK)
            | ((src & MSCCLPP_TRIGGER_OFFSET_MASK) << MSCCLPP_BITS_SIZE),
        (dst & MSCCLPP_TRIGGER_OFFSET_MASK)
            | ((conn_id & MSCCLPP_TRIGGER_CONNID_MASK) << MSCCLPP_TRIGGER_CONNID_SHIFT)
            | ((ty & MSCCLPP_TRIGGER_TYPE_MASK) << MSCCLPP_TRIGGER_TYPE_SHIFT)
            | (((src >> MSCCLPP_BITS_OFFSET) & high) << MSCCLPP_TRIGGER_SRC_HIGH_SHIFT)
            | (((dst >> MSCCLPP_BITS_OFFSET) & high) << MSCCLPP_TRIGGER_DST_HIGH_SHIFT),
    ]
}

/// Why one trigger cannot carry these values (a `MSCCLPP_REFUSED_*` code and the value), or
/// None: offsets below 2^40, 1 <= size <= `MSCCLPP_TRIGGER_SIZE_MASK`.
#[inline]
pub const fn trigger_refusal(dst: u64, src: u64, size: u64) -> Option<(u64, u64)> {
    if size == 0 {
        Some((MSCCLPP_REFUSED_ZERO_SIZE, 0))
    } else if size > MSCCLPP_TRIGGER_SIZE_MASK {
        Some((MSCCLPP_REFUSED_SIZE, size))
    } else if src >= MSCCLPP_TRIGGER_MAX_END {
        Some((MSCCLPP_REFUSED_SRC_OFFSET, src))
    } else if dst >= MSCCLPP_TRIGGER_MAX_END {
        Some((MSCCLPP_REFUSED_DST_OFFSET, dst))
    } else {
        None
    }
}

/// The refused trigger for `what` / `value` (see `MSCCLPP_TRIGGER_REFUSED`); word0 is never 0.
#[inline]
pub const fn trigger_encode_refused(what: u64, value: u64, conn_id: u64) -> [u64; 2] {
    [
        if value == 0 { 1 } else { value },
        MSCCLPP_TRIGGER_REFUSED
            | ((conn_id & MSCCLPP_TRIGGER_CONNID_MASK) << MSCCLPP_TRIGGER_CONNID_SHIFT)
            | (what & MSCCLPP_TRIGGER_OFFSET_MASK),
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
    // The wide offsets' high bits sit above the type and below the refused bit.
    assert!(MSCCLPP_TRIGGER_SRC_HIGH_SHIFT == 45 && MSCCLPP_TRIGGER_DST_HIGH_SHIFT == 53);
    assert!(
        MSCCLPP_TRIGGER_DST_HIGH_SHIFT + MSCCLPP_TRIGGER_OFFSET_BITS - MSCCLPP_BITS_OFFSET < 63
    );
    assert!(MSCCLPP_TRIGGER_CHUNK <= MSCCLPP_TRIGGER_SIZE_MASK);
    // The device block has DEV_WORDS (16) words; the record fills one 64-byte line.
    assert!(MSCCLPP_FIFO_DEV_RAW < 16 && MSCCLPP_RECORD_OTHERS_EXPIRED < 8);
    assert!(
        MSCCLPP_FIFO_DEV_ABANDONED == MSCCLPP_FIFO_DEV_RAW + 1 && MSCCLPP_FIFO_DEV_ABANDONED < 16
    );
    // The epoch block: the peer's words (1, 3) in the first 32 bytes, which is what a P2P
    // block exports; the read-only words on the next 32; every word inside the block.
    assert!(MSCCLPP_EPOCH_DIRECT == 3 && MSCCLPP_EPOCH_DIRECT_BYTES == 4);
    assert!(MSCCLPP_EPOCH_DIRECT_BLOCK_BYTES < 8 && MSCCLPP_EPOCH_PROXIED >= 8);
    assert!(MSCCLPP_EPOCH_ACQUIRED == MSCCLPP_EPOCH_FLUSHED + 1);
    assert!(MSCCLPP_EPOCH_ACQUIRED_PROXY == MSCCLPP_EPOCH_ACQUIRED + 1);
    assert!((MSCCLPP_EPOCH_ACQUIRED_PROXY + 1) * 8 <= MSCCLPP_EPOCH_DEVICE_BYTES);
};
