//! ctest's checks of every struct, type alias and constant of `src/abi.rs` against the C
//! compiler's view of `include/mscclpp.h` (see build.rs).
#![allow(
    dead_code,
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals
)]
#![allow(clippy::all)]

// The C halves of the checks are static libraries bundled into this package's library.
extern crate mscclpp_abi_test;

// src/abi.rs on its own (it uses no crate); the library crate lints it.
#[allow(dead_code, clippy::all)]
#[path = "../../src/abi.rs"]
mod abi;
use abi::*;

include!(concat!(env!("OUT_DIR"), "/layout.rs"));
