//! The network transport's choices that the `Endpoint` conformance suite
//! (`tests/endpoint_conformance.rs`, which runs the trait's contract over tcp, net, shm, staged
//! and FI_MR_ENDPOINT endpoints) does not cover: naming a domain that does not exist, peers of
//! another provider, and endpoints made for a GPU's connections.

mod common;

use common::raw::region;
use mscclpp::error::Error;
use mscclpp::transport::net;
use mscclpp::transport::{MemKind, Region};

#[test]
fn unknown_domain_lists_the_domains() {
    let e = net::open(Some("no-such-nic0"), false, None)
        .err()
        .expect("must fail");
    match e {
        Error::InvalidArgument(m) => {
            eprintln!("{m}");
            assert!(m.contains("no-such-nic0"), "{m}");
            assert!(m.contains("lo"), "should list the loopback domain: {m}");
        }
        other => panic!("expected InvalidArgument, got {other}"),
    }
}

#[test]
fn mismatched_providers_are_refused() {
    let mut tcp = net::open(Some("lo"), false, None).unwrap();
    let shm = net::open(None, true, None).unwrap();
    match tcp.add_peer(1, &shm.address().unwrap()) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("shm"), "{m}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn gpu_endpoints_open_and_stage_device_memory() {
    // An endpoint for a GPU's connections opens on tcp (no FI_HMEM) and on shm (FI_HMEM, but
    // no CUDA in this libfabric build); device memory is staged through host memory, which
    // needs CUDA copies: without a driver (CI) that is a clear error, never a host
    // registration; host memory still registers.
    if mscclpp::cuda::available() {
        return;
    }
    for (domain, shm) in [(Some("lo"), false), (None, true)] {
        let mut ep = net::open(domain, shm, Some(0)).unwrap();
        let b = vec![0u64; 512];
        match ep.register(Region {
            kind: MemKind::Device(0),
            ..region(&b)
        }) {
            Err(Error::InvalidUsage(m)) => assert!(m.contains("needs a CUDA driver"), "{m}"),
            other => panic!("{}: expected InvalidUsage, got {other:?}", ep.describe()),
        }
        ep.register(region(&b)).unwrap();
    }
}
