//! The core error type. Every failure carries enough context (which call, which peer, which
//! errno) to act on; [`Error::code`] is its one mapping to `mscclppResult_t`.

use crate::abi::mscclppResult_t;
use std::io;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A caller passed something unusable (NULL, out of range, malformed).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A call made in the wrong state (e.g. `mscclppConnect` after setup).
    #[error("invalid usage: {0}")]
    InvalidUsage(String),
    /// A local OS call failed.
    #[error("{context}: {source}")]
    System {
        context: String,
        #[source]
        source: io::Error,
    },
    /// A peer misbehaved, vanished or did not answer in time.
    #[error("remote error: {0}")]
    Remote(String),
    /// A timeout while waiting for a peer or a rendezvous.
    #[error("timed out after {after_ms} ms: {what}")]
    Timeout { what: String, after_ms: u64 },
    /// A CUDA driver call failed.
    #[error("CUDA error in {call}: {detail}")]
    Cuda { call: String, detail: String },
    /// A libfabric call failed.
    #[error("libfabric {call} failed: {detail} ({code})")]
    Fabric {
        call: String,
        code: i64,
        detail: String,
    },
    /// A bug or an impossible state in this library.
    #[error("internal error: {0}")]
    Internal(String),
    /// An error the communicator's background work met earlier (a proxy, or a host thread doing
    /// its work), reported again by a later call with its original result code.
    #[error("{1}")]
    Earlier(mscclppResult_t, String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The C result code this error reports as: the one mapping from errors to
    /// `mscclppResult_t` (the C API, sticky proxy errors and the abort word all use it).
    pub fn code(&self) -> mscclppResult_t {
        use mscclppResult_t::*;
        match self {
            Error::InvalidArgument(_) => mscclppInvalidArgument,
            Error::InvalidUsage(_) => mscclppInvalidUsage,
            Error::System { .. } | Error::Fabric { .. } => mscclppSystemError,
            Error::Remote(_) | Error::Timeout { .. } => mscclppRemoteError,
            Error::Cuda { .. } => mscclppUnhandledCudaError,
            Error::Internal(_) => mscclppInternalError,
            Error::Earlier(code, _) => *code,
        }
    }

    pub fn invalid_arg(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }
    pub fn usage(msg: impl Into<String>) -> Self {
        Error::InvalidUsage(msg.into())
    }
    pub fn remote(msg: impl Into<String>) -> Self {
        Error::Remote(msg.into())
    }
    pub fn internal(msg: impl Into<String>) -> Self {
        Error::Internal(msg.into())
    }
    pub fn timeout(what: impl Into<String>, after: std::time::Duration) -> Self {
        Error::Timeout {
            what: what.into(),
            after_ms: after.as_millis() as u64,
        }
    }
    /// Wraps an `io::Error` with what was being done.
    pub fn sys(context: impl Into<String>, source: io::Error) -> Self {
        Error::System {
            context: context.into(),
            source,
        }
    }
    /// The last OS error, with context.
    pub fn last_os(context: impl Into<String>) -> Self {
        Error::sys(context, io::Error::last_os_error())
    }
    /// The same error (and result code) with `ctx` in front of its message: which part of
    /// something larger it came from (`rail 2 of 4 (eth2)`).
    pub fn within(self, ctx: &str) -> Self {
        match self {
            Error::InvalidArgument(m) => Error::InvalidArgument(format!("{ctx}: {m}")),
            Error::InvalidUsage(m) => Error::InvalidUsage(format!("{ctx}: {m}")),
            Error::System { context, source } => Error::System {
                context: format!("{ctx}: {context}"),
                source,
            },
            Error::Remote(m) => Error::Remote(format!("{ctx}: {m}")),
            Error::Timeout { what, after_ms } => Error::Timeout {
                what: format!("{ctx}: {what}"),
                after_ms,
            },
            Error::Cuda { call, detail } => Error::Cuda {
                call: format!("{ctx}: {call}"),
                detail,
            },
            Error::Fabric { call, code, detail } => Error::Fabric {
                call: format!("{ctx}: {call}"),
                code,
                detail,
            },
            Error::Internal(m) => Error::Internal(format!("{ctx}: {m}")),
            Error::Earlier(code, m) => Error::Earlier(code, format!("{ctx}: {m}")),
        }
    }
}

/// Adds context to I/O results: `stream.read_exact(..).ctx("reading header from rank 3")?`.
pub trait IoContext<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::sys(context(), e))
    }
}
