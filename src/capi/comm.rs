//! Communicator lifetime, bootstrap collectives, errors and version.

use super::{
    check_null, ffi_boundary, get_comm, mscclppComm_t, opt_str, put_out, register_comm, take_comm,
    with_comm,
};
use crate::abi::*;
use crate::bootstrap::{self, Bootstrap};
use crate::comm::Comm;
use crate::error::Error;
use std::ffi::{c_char, c_int, c_void};

fn check_ranks(nranks: c_int, rank: c_int) -> Result<(usize, usize), Error> {
    if nranks <= 0 {
        return Err(Error::invalid_arg(format!(
            "nranks must be > 0, got {nranks}"
        )));
    }
    if rank < 0 || rank >= nranks {
        return Err(Error::invalid_arg(format!(
            "rank {rank} is outside [0, {nranks})"
        )));
    }
    Ok((rank as usize, nranks as usize))
}

/// Creates a unique id (root address and a random magic) for `mscclppCommInitRankFromId`. Call
/// it on one process and pass the 128 bytes to every rank. The calling process becomes the root:
/// rank 0 must run on this host. `MSCCLPP_SOCKET_IFNAME` picks the interface.
/// `uniqueId` must not be NULL; it is written only on success.
#[no_mangle]
pub extern "C" fn mscclppGetUniqueId(uniqueId: *mut mscclppUniqueId) -> mscclppResult_t {
    ffi_boundary!("mscclppGetUniqueId", {
        check_null!(uniqueId);
        let bytes = bootstrap::new_unique_id()?;
        let mut id = mscclppUniqueId {
            internal: [0; MSCCLPP_UNIQUE_ID_BYTES],
        };
        for (d, s) in id.internal.iter_mut().zip(bytes) {
            *d = s as c_char;
        }
        put_out(uniqueId, id);
        Ok(())
    })
}

/// Joins an `nranks`-rank communicator whose rank 0 listens on `ipPortPair` (`"ip:port"`,
/// `"[ipv6]:port"` or `"host:port"`). Every rank calls it; it returns once all have joined, or
/// fails within the bootstrap timeout. `comm` is written only on success; destroy it with
/// `mscclppCommDestroy`. Thread-safe; several communicators may coexist.
#[no_mangle]
pub extern "C" fn mscclppCommInitRank(
    comm: *mut mscclppComm_t,
    nranks: c_int,
    ipPortPair: *const c_char,
    rank: c_int,
) -> mscclppResult_t {
    ffi_boundary!("mscclppCommInitRank", {
        check_null!(comm, ipPortPair);
        let (rank, nranks) = check_ranks(nranks, rank)?;
        let addr = opt_str(ipPortPair, "ipPortPair")?.unwrap_or_default();
        let boot = Bootstrap::from_addr(&addr, rank, nranks)?;
        put_out(comm, register_comm(Comm::new(boot)));
        Ok(())
    })
}

/// As `mscclppCommInitRank`, with the root given by a unique id from `mscclppGetUniqueId`.
#[no_mangle]
pub extern "C" fn mscclppCommInitRankFromId(
    comm: *mut mscclppComm_t,
    nranks: c_int,
    id: mscclppUniqueId,
    rank: c_int,
) -> mscclppResult_t {
    ffi_boundary!("mscclppCommInitRankFromId", {
        check_null!(comm);
        let (rank, nranks) = check_ranks(nranks, rank)?;
        let bytes: [u8; MSCCLPP_UNIQUE_ID_BYTES] = id.internal.map(|c| c as u8);
        let boot = Bootstrap::from_id(&bytes, rank, nranks)?;
        put_out(comm, register_comm(Comm::new(boot)));
        Ok(())
    })
}

/// Ring all-gather over the bootstrap sockets: `data` holds `nranks * size` bytes; this rank's
/// `size` bytes at `rank * size` go to every rank. Collective; bounded by the bootstrap timeout.
#[no_mangle]
pub extern "C" fn mscclppBootstrapAllGather(
    comm: mscclppComm_t,
    data: *mut c_void,
    size: c_int,
) -> mscclppResult_t {
    ffi_boundary!("mscclppBootstrapAllGather", {
        check_null!(data);
        if size <= 0 {
            return Err(Error::invalid_arg(format!("size must be > 0, got {size}")));
        }
        with_comm(comm, |c| {
            let total = (size as usize)
                .checked_mul(c.nranks())
                .ok_or_else(|| Error::invalid_arg("size * nranks overflows"))?;
            // SAFETY: the caller provides nranks * size writable bytes (API contract).
            let buf = unsafe { std::slice::from_raw_parts_mut(data as *mut u8, total) };
            c.bootstrap_to_block().all_gather(buf)
        })
    })
}

/// Returns once every rank has called it (bounded by the bootstrap timeout).
#[no_mangle]
pub extern "C" fn mscclppBootstrapBarrier(comm: mscclppComm_t) -> mscclppResult_t {
    ffi_boundary!("mscclppBootstrapBarrier", {
        with_comm(comm, |c| c.bootstrap_to_block().barrier())
    })
}

/// Stops the proxies (after they drain), closes connections and frees everything the
/// communicator owns, including its `mscclppDevConn_t` arrays and registered-memory handles.
/// NULL is accepted and does nothing; a handle destroyed already is `mscclppInvalidArgument`.
#[no_mangle]
pub extern "C" fn mscclppCommDestroy(comm: mscclppComm_t) -> mscclppResult_t {
    ffi_boundary!("mscclppCommDestroy", {
        if comm.is_null() {
            return Ok(());
        }
        let cell = take_comm(comm)?;
        drop(cell);
        Ok(())
    })
}

/// Static text for a result code; unknown codes give "unknown result code". Never NULL.
/// (Declared by hand in the header: C may pass any integer, so Rust takes a plain int.)
#[no_mangle]
pub extern "C" fn mscclppGetErrorString(result: c_int) -> *const c_char {
    let s: &'static [u8] = match result {
        0 => b"no error\0",
        1 => b"unhandled cuda error\0",
        2 => b"unhandled system error\0",
        3 => b"internal error - please report this issue to the MSCCL++ developers\0",
        4 => b"invalid argument\0",
        5 => b"invalid usage\0",
        6 => b"remote process exited or there was a network error\0",
        7 => b"MSCCL++ operation in progress\0",
        _ => b"unknown result code\0",
    };
    s.as_ptr().cast()
}

/// The rank of this process in `comm`. `rank` is written only on success.
#[no_mangle]
pub extern "C" fn mscclppCommRank(comm: mscclppComm_t, rank: *mut c_int) -> mscclppResult_t {
    ffi_boundary!("mscclppCommRank", {
        check_null!(rank);
        let r = with_comm(comm, |c| Ok(c.rank()))?;
        put_out(rank, r as c_int);
        Ok(())
    })
}

/// The number of ranks of `comm`. `size` is written only on success.
#[no_mangle]
pub extern "C" fn mscclppCommSize(comm: mscclppComm_t, size: *mut c_int) -> mscclppResult_t {
    ffi_boundary!("mscclppCommSize", {
        check_null!(size);
        let n = with_comm(comm, |c| Ok(c.nranks()))?;
        put_out(size, n as c_int);
        Ok(())
    })
}

/// Sets the bound, in seconds (> 0), on every bootstrap connect, accept and receive of
/// communicators created afterwards, process-wide (default 30, or `MSCCLPP_BOOTSTRAP_TIMEOUT`).
#[no_mangle]
pub extern "C" fn mscclppSetBootstrapConnTimeout(timeout: c_int) -> mscclppResult_t {
    ffi_boundary!("mscclppSetBootstrapConnTimeout", {
        bootstrap::set_timeout(timeout)
    })
}

/// Writes `MSCCLPP_VERSION` of the library (not of the header) to `version`.
#[no_mangle]
pub extern "C" fn mscclppGetVersion(version: *mut c_int) -> mscclppResult_t {
    ffi_boundary!("mscclppGetVersion", {
        check_null!(version);
        put_out(version, MSCCLPP_VERSION);
        Ok(())
    })
}

/// Text of the last failure of an API call on the calling thread ("" if none). The pointer is
/// valid until the next failing call on this thread. Never NULL.
#[no_mangle]
pub extern "C" fn mscclppGetLastError() -> *const c_char {
    super::last_error_ptr()
}

/// The first asynchronous error (a proxy thread's) of `comm`, or `mscclppSuccess`. Such an error
/// is sticky: every later call on `comm` that needs the proxies fails with it. When it reports
/// one, `mscclppGetLastError()` on this thread then gives that error's text (the call itself
/// succeeded: the text is of the failure it reports).
#[no_mangle]
pub extern "C" fn mscclppCommGetAsyncError(
    comm: mscclppComm_t,
    asyncError: *mut mscclppResult_t,
) -> mscclppResult_t {
    ffi_boundary!("mscclppCommGetAsyncError", {
        check_null!(asyncError);
        let cell = get_comm(comm)?;
        // Not through `with_comm`'s lock on the whole comm: reading the sticky error must work
        // while another thread is inside a long call on the same comm.
        let r = match cell.sticky.get() {
            Some((code, msg)) => {
                super::set_last_error(&format!("mscclppCommGetAsyncError: {msg}"));
                code
            }
            None => mscclppResult_t::mscclppSuccess,
        };
        put_out(asyncError, r);
        Ok(())
    })
}
