//! libfabric transport (stub: being written).

use super::Endpoint;
use crate::error::{Error, Result};

/// Opens a libfabric RDM endpoint on `domain` (None: first suitable); `shm` selects the shm
/// provider. `device` is the CUDA device whose memory will be registered, if any.
pub fn open(_domain: Option<&str>, _shm: bool, _device: Option<i32>) -> Result<Box<dyn Endpoint>> {
    Err(Error::usage("the network transport is not implemented yet"))
}
