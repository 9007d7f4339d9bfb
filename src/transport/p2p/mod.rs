//! CUDA IPC transport (stub: being written).

use super::Endpoint;
use crate::error::{Error, Result};

/// Opens the P2P endpoint of CUDA device `device` (one copy-engine stream).
pub fn open(_device: i32) -> Result<Box<dyn Endpoint>> {
    Err(Error::usage("the P2P transport is not implemented yet"))
}
