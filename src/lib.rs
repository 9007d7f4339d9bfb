#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
//! libmscclpp: a drop-in implementation of the 2023 MSCCL++ C API.
//!
//! Layers, bottom up: `abi` (shared layouts), `bootstrap` (TCP rendezvous), `cuda` (driver
//! calls), `fifo` (trigger queue), `transport` (P2P, libfabric), `proxy` (the threads that
//! execute triggers), `comm` (the communicator), and `capi` (the C exports, nothing else).
//! See docs/DESIGN.md.

#[macro_use]
pub mod log;
pub mod abi;
pub mod bootstrap;
pub mod capi;
pub mod comm;
pub mod config;
pub mod cuda;
pub mod error;
pub mod fifo;
pub mod host;
pub mod mem;
pub mod proxy;
pub mod sync;
pub mod transport;
pub mod wire;
