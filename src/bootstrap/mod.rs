//! TCP rendezvous between the ranks of a communicator (stub: being written; see the
//! signatures, which are the contract the rest of the library codes against).

use crate::error::{Error, Result};
use std::time::Duration;

/// The process-wide bootstrap timeout (`mscclppSetBootstrapConnTimeout`, `MSCCLPP_BOOTSTRAP_TIMEOUT`).
pub fn timeout() -> Duration {
    Duration::from_secs(30)
}
/// Sets the process-wide bootstrap timeout; `secs` must be > 0.
pub fn set_timeout(secs: i32) -> Result<()> {
    if secs <= 0 {
        return Err(Error::invalid_arg(format!(
            "bootstrap timeout must be > 0 seconds, got {secs}"
        )));
    }
    Ok(())
}

/// Creates the 128 bytes of a new unique id (root address + random magic).
pub fn new_unique_id() -> Result<[u8; crate::abi::MSCCLPP_UNIQUE_ID_BYTES]> {
    Err(Error::usage("bootstrap not implemented yet"))
}

pub struct Bootstrap {
    rank: usize,
    nranks: usize,
}

impl Bootstrap {
    /// Joins the communicator whose root listens on `ip_port` (rank 0 binds it).
    pub fn from_addr(_ip_port: &str, rank: usize, nranks: usize) -> Result<Self> {
        let _ = (rank, nranks);
        Err(Error::usage("bootstrap not implemented yet"))
    }
    /// Joins the communicator described by a unique id.
    pub fn from_id(
        _id: &[u8; crate::abi::MSCCLPP_UNIQUE_ID_BYTES],
        rank: usize,
        nranks: usize,
    ) -> Result<Self> {
        let _ = (rank, nranks);
        Err(Error::usage("bootstrap not implemented yet"))
    }
    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn nranks(&self) -> usize {
        self.nranks
    }
    /// `data` holds nranks slices of `data.len() / nranks` bytes; slice `rank` is ours.
    pub fn all_gather(&self, _data: &mut [u8]) -> Result<()> {
        Err(Error::usage("bootstrap not implemented yet"))
    }
    pub fn barrier(&self) -> Result<()> {
        Err(Error::usage("bootstrap not implemented yet"))
    }
    /// Sends a tagged message to `peer`; returns once the bytes are handed to the kernel.
    pub fn send(&self, _peer: usize, _tag: u64, _data: &[u8]) -> Result<()> {
        Err(Error::usage("bootstrap not implemented yet"))
    }
    /// Receives the message `peer` sent with `tag` (any order of tags), within the timeout.
    pub fn recv(&self, _peer: usize, _tag: u64) -> Result<Vec<u8>> {
        Err(Error::usage("bootstrap not implemented yet"))
    }
}
