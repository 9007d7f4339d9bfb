//! A proxy thread driving the network transport: triggers pushed by a host producer move data
//! and flags over tcp;ofi_rxm (loopback), and an out-of-range trigger is refused by the proxy
//! before it reaches the transport, as a sticky error.

mod common;

use common::raw::{region, word};
use mscclpp::abi::{mscclppData, mscclppFlag, mscclppResult_t, mscclppSync, trigger_encode};
use mscclpp::bootstrap::Bootstrap;
use mscclpp::fifo::Fifo;
use mscclpp::host::{host_push, host_wait_retired};
use mscclpp::proxy::{self, ProxyConn, ProxyWork, SharedEndpoint, Sticky};
use mscclpp::transport::net;
use mscclpp::transport::Endpoint;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[test]
fn proxy_moves_data_and_refuses_out_of_range_triggers() {
    let a: Box<dyn Endpoint> = net::open(Some("lo"), false, None).unwrap();
    let b: Box<dyn Endpoint> = net::open(Some("lo"), false, None).unwrap();
    let (a, b): (SharedEndpoint, SharedEndpoint) =
        (Arc::new(Mutex::new(a)), Arc::new(Mutex::new(b)));
    let peer = {
        let (mut a, mut b) = (a.lock().unwrap(), b.lock().unwrap());
        let pa = a.add_peer(1, &b.address().unwrap()).unwrap();
        b.add_peer(0, &a.address().unwrap()).unwrap();
        pa
    };
    let n = 1 << 16; // words
    let src: Vec<u64> = (0..n as u64).map(|i| i ^ 0x5a5a).collect();
    let dst = vec![0u64; n];
    let epoch = vec![0u64; 2];
    let (s, d, e) = {
        let (mut a, mut b) = (a.lock().unwrap(), b.lock().unwrap());
        let s = a.register(region(&src)).unwrap().0;
        let d = a
            .import(peer, &b.register(region(&dst)).unwrap().1)
            .unwrap();
        let e = a
            .import(peer, &b.register(region(&epoch)).unwrap().1)
            .unwrap();
        (s, d, e)
    };
    // The target's proxy: only progress.
    let stop = Arc::new(AtomicBool::new(false));
    let (b2, s2) = (b.clone(), stop.clone());
    let target = std::thread::spawn(move || {
        // Ends when the test sets `stop` (Release below).
        while !s2.load(Ordering::Acquire) {
            b2.lock().unwrap().progress().unwrap();
            std::thread::yield_now();
        }
    });
    let fifo = Fifo::new_host().unwrap();
    let view = fifo.producer_view(0);
    let conn = ProxyConn {
        index: 0,
        remote_rank: 1,
        peer,
        src: s,
        local_size: (n * 8) as u64,
        dst: d,
        remote_size: (n * 8) as u64,
        remote_epoch: e,
        signals: 0,
        direct: None,
        outbox: None,
        inline: Default::default(),
        wait_for_room_above: 0,
        inbox: None,
        undelivered: false,
        regain_direct: false,
    };
    // The proxy watches its bootstrap for lost peers: a one-rank communicator on a free port.
    let port = common::free_port();
    let boot = Arc::new(Bootstrap::from_addr(&format!("127.0.0.1:{port}"), 0, 1).unwrap());
    let sticky = Arc::new(Sticky::new(boot.clone()));
    let work = ProxyWork::new(
        fifo,
        a.clone(),
        boot,
        sticky.clone(),
        "net-proxy-test".into(),
        true,
    );
    mscclpp::sync::lock(&work).conns.push(conn);
    let running = proxy::launch(work).unwrap();
    // Data + Flag + Sync: half the buffer at an offset.
    let half = (n * 8 / 2) as u64;
    let w = trigger_encode(mscclppData | mscclppFlag | mscclppSync, half, half, half, 0);
    // SAFETY: `view` belongs to a live host FIFO owned by the running proxy.
    let h = unsafe { host_push(&view, w) }.unwrap();
    // SAFETY: as above.
    unsafe { host_wait_retired(&view, h) }.unwrap();
    let t0 = Instant::now();
    // Ends when the flag arrives or after 20 s.
    while word(&epoch, 1) != 1 {
        assert!(t0.elapsed() < Duration::from_secs(20), "flag never arrived");
        std::thread::yield_now();
    }
    for (i, want) in src.iter().enumerate().skip(n / 2) {
        assert_eq!(word(&dst, i), *want, "word {i}");
    }
    assert_eq!(word(&dst, n / 2 - 1), 0, "nothing before the offset");
    // One byte past the peer's buffer: refused by the proxy, nothing sent.
    let bad = trigger_encode(mscclppData, half + 1, 0, half, 0);
    // SAFETY: as above.
    let _ = unsafe { host_push(&view, bad) };
    // Refused by whichever thread ran it (the proxy's, or this one pushing it), with the same
    // code either way.
    match running.stop() {
        Err(e) => {
            assert_eq!(e.code(), mscclppResult_t::mscclppInvalidArgument, "{e}");
            assert!(e.to_string().contains("outside"), "{e}");
        }
        other => panic!("expected the proxy to refuse the trigger, got {other:?}"),
    }
    assert!(sticky.get().is_some(), "the refusal is sticky");
    stop.store(true, Ordering::Release);
    target.join().unwrap();
}
