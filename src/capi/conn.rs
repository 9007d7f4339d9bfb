//! Connections and proxies.

use super::{
    check_null, ffi_boundary, mscclppComm_t, mscclppDevConn_t, opt_str, put_out, with_comm,
};
use crate::abi::*;
use crate::error::Error;
use crate::transport::transport_from_c;
use std::ffi::{c_char, c_int, c_void};

/// Declares a connection to `remoteRank` over `localBuff[0, buffSize)`, identified by
/// (`remoteRank`, `tag`); the peer must declare the counterpart with the same tag and transport.
/// Nothing is created until `mscclppConnectionSetup`. `ibDev` names a libfabric domain for
/// `mscclppTransportIB` (NULL: the first suitable one) and must be NULL otherwise.
/// (Declared by hand in the header: C may pass any integer as the transport, and C++ callers
/// may omit `ibDev`.)
#[no_mangle]
pub extern "C" fn mscclppConnect(
    comm: mscclppComm_t,
    remoteRank: c_int,
    tag: c_int,
    localBuff: *mut c_void,
    buffSize: u64,
    transportType: c_int,
    ibDev: *const c_char,
) -> mscclppResult_t {
    ffi_boundary!("mscclppConnect", {
        check_null!(localBuff);
        let tr = transport_from_c(transportType)
            .ok_or_else(|| Error::invalid_arg(format!("unknown transport type {transportType}")))?;
        let dev = opt_str(ibDev, "ibDev")?;
        with_comm(comm, |c| {
            c.check_sticky()?;
            c.connect(remoteRank, tag, localBuff as u64, buffSize, tr, dev)
        })
    })
}

/// Establishes every connection declared with `mscclppConnect` (collective between the peers of
/// each connection; any order of declarations works). Returns once both sides of every
/// connection are ready, or fails within the bootstrap timeout naming the connection.
#[no_mangle]
pub extern "C" fn mscclppConnectionSetup(comm: mscclppComm_t) -> mscclppResult_t {
    ffi_boundary!("mscclppConnectionSetup", { with_comm(comm, |c| c.setup()) })
}

/// Writes the host array of all connections (in `mscclppConnect` order) and its length. The
/// array is owned by `comm` and lives until `mscclppCommDestroy`; copy it to the device (e.g.
/// `cudaMemcpyToSymbol` into `__constant__` memory) for kernels. Outputs written on success only.
#[no_mangle]
pub extern "C" fn mscclppGetAllDeviceConnections(
    comm: mscclppComm_t,
    devConns: *mut *mut mscclppDevConn_t,
    nConns: *mut c_int,
) -> mscclppResult_t {
    ffi_boundary!("mscclppGetAllDeviceConnections", {
        check_null!(devConns, nConns);
        let (p, n) = with_comm(comm, |c| {
            let v = c.dev_conns()?;
            Ok((v.as_mut_ptr(), v.len()))
        })?;
        put_out(devConns, p);
        put_out(nConns, n as c_int);
        Ok(())
    })
}

/// Writes a pointer to the connection with (`remoteRank`, `tag`), owned by `comm`.
#[no_mangle]
pub extern "C" fn mscclppGetDeviceConnection(
    comm: mscclppComm_t,
    remoteRank: c_int,
    tag: c_int,
    devConn: *mut *mut mscclppDevConn_t,
) -> mscclppResult_t {
    ffi_boundary!("mscclppGetDeviceConnection", {
        check_null!(devConn);
        let p = with_comm(comm, |c| {
            Ok(c.dev_conn(remoteRank, tag)? as *mut mscclppDevConn_t)
        })?;
        put_out(devConn, p);
        Ok(())
    })
}

/// Starts one proxy thread per endpoint (per transport and device) after
/// `mscclppConnectionSetup`. Kernels and host producers may push triggers once it returns.
#[no_mangle]
pub extern "C" fn mscclppProxyLaunch(comm: mscclppComm_t) -> mscclppResult_t {
    ffi_boundary!("mscclppProxyLaunch", {
        with_comm(comm, |c| c.proxy_launch())
    })
}

/// Lets every proxy finish the triggers already pushed, joins the threads, and returns the first
/// error any proxy met (also kept for `mscclppCommGetAsyncError`).
#[no_mangle]
pub extern "C" fn mscclppProxyStop(comm: mscclppComm_t) -> mscclppResult_t {
    ffi_boundary!("mscclppProxyStop", { with_comm(comm, |c| c.proxy_stop()) })
}
