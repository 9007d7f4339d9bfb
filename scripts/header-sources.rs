//! What cbindgen reads to write include/mscclpp.h (see scripts/gen-header.sh); never compiled.
//!
//! Only the shared types and constants (src/abi.rs) and the C exports with their handle types
//! (src/capi/): a `pub` item elsewhere in the crate stays out of the public header.

#[path = "../src/abi.rs"]
mod abi;
#[path = "../src/capi/mod.rs"]
mod capi;
