//! Tests of a proxy's consumer (`ProxyWork`) on a host FIFO, and the consumer they share.

use crate::abi::*;
use crate::error::Error;
use crate::fifo::Fifo;
use crate::proxy::{ProxyConn, ProxyWork, SharedEndpoint, Sticky};
use crate::sync::lock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The registered region of every `work()`: it must outlive the endpoint, which the returned
/// work keeps (and a test may drop at any point), so it lives for the process. A static rather
/// than a leaked box: valgrind's sanitize step counts a leaked box as a definite leak. Nothing
/// is put through it, so the tests may share it; atomics keep it in writable memory.
static REGION: [AtomicU64; 8] = [const { AtomicU64::new(0) }; 8];

/// A consumer of a host FIFO with one connection (index 3 in the communicator, to rank 1)
/// over a real tcp endpoint that nothing is sent through: what the consumer reads from its
/// FIFO is what is tested.
pub(crate) fn work() -> crate::proxy::SharedWork {
    let ep: SharedEndpoint = Arc::new(Mutex::new(
        crate::transport::net::open(Some("lo"), false, None).unwrap(),
    ));
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let boot = Arc::new(
        crate::bootstrap::Bootstrap::from_addr(&format!("127.0.0.1:{port}"), 0, 1).unwrap(),
    );
    let (src, dst) = {
        let mut e = lock(&ep);
        let region = crate::mem::Region {
            addr: REGION.as_ptr() as u64,
            len: 64,
            kind: crate::mem::MemKind::Host,
        };
        let (src, blob) = e.register(region).unwrap();
        let addr = e.address().unwrap();
        let peer = e.add_peer(1, &addr).unwrap();
        (src, (peer, e.import(peer, &blob).unwrap()))
    };
    let w = ProxyWork::new(
        Fifo::new_host().unwrap(),
        ep,
        boot.clone(),
        Arc::new(Sticky::new(boot.clone())),
        "proxy-test".into(),
        false,
    );
    lock(&w).conns.push(ProxyConn {
        index: 3,
        remote_rank: 1,
        peer: dst.0,
        src,
        local_size: 64,
        dst: dst.1,
        remote_size: 64,
        remote_epoch: dst.1,
        signals: 0,
        direct: None,
        outbox: None,
        inline: Default::default(),
        wait_for_room_above: 0,
        inbox: None,
        undelivered: false,
        regain_direct: false,
    });
    w
}

#[test]
fn a_refused_trigger_fails_the_round_naming_connection_peer_and_value() {
    let shared = work();
    let mut w = lock(&shared);
    // What a kernel's pushPut queues for a put at srcDataOffset 2^40 (include/mscclpp).
    w.fifo.push_for_test(trigger_encode_refused(
        MSCCLPP_REFUSED_SRC_OFFSET,
        1 << 40,
        0,
    ));
    let Err(e) = w.service(false, false) else {
        panic!("the refused trigger was not reported");
    };
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    let text = e.to_string();
    for part in [
        "connection 3 (to rank 1)",
        "srcDataOffset 1099511627776",
        "2^40",
    ] {
        assert!(text.contains(part), "{part:?} missing in {text}");
    }
    assert!(
        !w.fifo.is_empty(),
        "the refused trigger stays, as any failed trigger"
    );
}

/// A slot's zero means "executed" to every waiter, so triggers the abort leaves are not
/// zeroed: a host thread that pushed a put and a Sync just before a stop or destroy raised the
/// abort, and whose assist then finds them (the review's scenario: the abort lands between the
/// push's check and its assist), must not read them as done (its wait then ends on the abort
/// with an error, not success for work never done). `mscclppProxyLaunch` later retires them,
/// still unexecuted.
#[test]
fn triggers_the_abort_leaves_are_never_reported_done() {
    let shared = work();
    let mut w = lock(&shared);
    let view = w.fifo.producer_view(3);
    w.fifo
        .push_for_test(trigger_encode(mscclppData, 0, 0, 8, 0));
    w.fifo
        .push_for_test(trigger_encode(mscclppFlag | mscclppSync, 0, 0, 1, 0));
    w.sticky.release(false);
    assert!(w.service(false, false).is_ok());
    assert_eq!(w.fifo.queued(), 2, "nothing executed, nothing retired");
    // What every waiter on the Sync reads (`host_wait_retired`, the kernels' `waitCompleted`):
    // its slot's word0 and the published tail. Neither may say "done"; the waiter then ends
    // on the abort word with an error.
    // SAFETY: `view` is the producer view of this live host FIFO: slot 1 and the tail are
    // live words, touched only atomically.
    let (slot, tail) = unsafe {
        (
            AtomicU64::from_ptr(view.triggerFifo.add(1) as *mut u64).load(Ordering::Acquire),
            AtomicU64::from_ptr(view.triggerFifoTail).load(Ordering::Acquire),
        )
    };
    assert!(
        slot != 0 && tail <= 1,
        "the Sync reads as done: slot {slot:#x}, tail {tail}"
    );
    assert_eq!(w.fifo.ticket(), 0);
    w.retire_released();
    assert_eq!((w.fifo.queued(), w.fifo.ticket()), (0, 2));
    assert_eq!(w.conns[0].signals, 0, "the flag was not sent");
}
