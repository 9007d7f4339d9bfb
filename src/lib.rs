//! libmscclpp: a drop-in implementation of the 2023 MSCCL++ C API.
//!
//! Layers, bottom up; each uses only those before it (`tests/layers.rs` checks it, and
//! docs/DESIGN.md explains it):
//!
//! | layer | owns |
//! |---|---|
//! | `abi` | structs, enums and constants shared with C and CUDA |
//! | `error` | the error type and its C result code |
//! | `config` | every environment variable, read once and validated |
//! | `sync` | the poison-tolerant lock and `Backoff`, the shape of every bounded wait |
//! | `log` | levels, the user's log handler |
//! | `wire` | the byte encoding of blobs exchanged with peers |
//! | `mem` | memory the library allocates (host, POSIX shared), `MemKind` and `Region` |
//! | `cuda` | every CUDA driver call |
//! | `bootstrap` | TCP rendezvous, tagged messages, barrier, peer-death watch |
//! | `fifo` | the trigger ring, and how host producers find its consumer |
//! | `transport` | the `Endpoint` trait and what each transport answers; `p2p`, `net` |
//! | `proxy` | the threads that execute triggers; sticky errors |
//! | `host` | the device API called from host threads |
//! | `comm` | the communicator: setup, registered buffers, teardown |
//! | `capi` | the C exports, and nothing else |

// Every unsafe operation sits in an `unsafe` block of its own, with the reason it is sound.
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod abi;
pub mod config;
pub mod error;
pub mod sync;
#[macro_use]
pub(crate) mod log;
pub mod bootstrap;
pub mod capi;
pub mod comm;
pub mod cuda;
pub mod fifo;
pub mod host;
pub(crate) mod mem;
pub mod proxy;
pub mod transport;
pub mod wire;
