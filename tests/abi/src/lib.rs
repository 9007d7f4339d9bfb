//! ABI checks of `include/mscclpp.h` against `src/abi.rs`; the tests are `layout.rs` (generated
//! by ctest: sizes, alignments, field offsets and sizes, constants) and `enums.rs` (enum values
//! and sizes, which ctest does not cover). Run with `cargo test -p mscclpp-abi-test`.
