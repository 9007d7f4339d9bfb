//! Every variant of every `#[repr(C)]` enum of `src/abi.rs` has the same value in
//! `include/mscclpp.h`, and each enum has the same size (build.rs generates both sides).
#![allow(
    dead_code,
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals
)]

// The C halves of the checks are static libraries bundled into this package's library.
extern crate mscclpp_abi_test;

// src/abi.rs on its own (it uses no crate); the library crate lints it.
#[allow(dead_code, clippy::all)]
#[path = "../../src/abi.rs"]
mod abi;
use abi::*;

use std::ffi::{c_char, CStr};

/// One enumerator as the C compiler sees it (layout shared with the generated C file).
#[repr(C)]
struct CEnumValue {
    name: *const c_char,
    value: i64,
    size: u64,
}

include!(concat!(env!("OUT_DIR"), "/enums.rs"));

#[test]
fn enum_values_and_sizes_match_the_header() {
    assert!(
        !RUST_ENUM_VALUES.is_empty(),
        "build.rs found no enum in src/abi.rs"
    );
    // SAFETY: the C array has exactly RUST_ENUM_VALUES.len() elements (both generated together)
    // and is immutable.
    let c_values = unsafe { &*std::ptr::addr_of!(mscclpp_abi_enum_values) };
    let mut bad = Vec::new();
    for ((name, value, size), c) in RUST_ENUM_VALUES.iter().zip(c_values) {
        // SAFETY: the generated C file stores string literals.
        let c_name = unsafe { CStr::from_ptr(c.name) }.to_str().unwrap();
        assert_eq!(*name, c_name, "generated tables out of step");
        if *value != c.value || *size as u64 != c.size {
            bad.push(format!(
                "{name}: Rust value {value} size {size}, C value {} size {}",
                c.value, c.size
            ));
        }
    }
    assert!(bad.is_empty(), "enum mismatches:\n{}", bad.join("\n"));
}
