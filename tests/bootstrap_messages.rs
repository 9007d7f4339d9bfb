//! The bootstrap's data exchange between ranks that joined (`mscclpp::bootstrap`): all-gather,
//! barrier and tagged send/recv, ranks as threads.

mod common;

use common::boot::{check_all_gather, local_addr, with_ranks};
use mscclpp::error::Error;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[test]
fn all_gather_1_2_4_8_ranks() {
    for n in [1, 2, 4, 8] {
        with_ranks(&local_addr(), n, |b| {
            for (round, size) in [1, 13, 4096, 300_000].into_iter().enumerate() {
                check_all_gather(&b, size, round);
            }
            // Empty slices are legal and still synchronise.
            b.all_gather(&mut []).unwrap();
            let mut odd = vec![0u8; b.nranks() * 3 + 1];
            if b.nranks() > 1 {
                assert!(matches!(
                    b.all_gather(&mut odd),
                    Err(Error::InvalidArgument(_))
                ));
            }
            check_all_gather(&b, 5, 9);
        });
    }
}

#[test]
fn barrier_holds_everyone() {
    // Powers of two and not (the dissemination barrier's rounds wrap around differently).
    for n in [2, 4, 5, 7] {
        let arrived = Arc::new(AtomicUsize::new(0));
        let a = arrived.clone();
        with_ranks(&local_addr(), n, move |b| {
            for round in 1..=5 {
                if b.rank() == round % n {
                    std::thread::sleep(Duration::from_millis(30));
                }
                a.fetch_add(1, Ordering::SeqCst);
                b.barrier().unwrap();
                assert!(
                    a.load(Ordering::SeqCst) >= round * n,
                    "{n} ranks: rank {} left early",
                    b.rank()
                );
            }
        });
        assert_eq!(arrived.load(Ordering::SeqCst), 5 * n);
    }
}

fn msg(src: usize, dst: usize, tag: u64) -> Vec<u8> {
    let mut v = format!("{src}->{dst}#{tag}").into_bytes();
    if tag == 3 {
        v.resize(1 << 20, (src + dst) as u8);
    }
    if tag == 4 {
        v.clear();
    }
    v
}

#[test]
fn send_recv_any_order_of_tags_and_peers() {
    let n = 4;
    with_ranks(&local_addr(), n, move |b| {
        let me = b.rank();
        for peer in 0..n {
            for tag in 0..6u64 {
                b.send(peer, tag, &msg(me, peer, tag)).unwrap();
            }
        }
        for peer in (0..n).rev() {
            for tag in (0..6u64).rev() {
                assert_eq!(b.recv(peer, tag).unwrap(), msg(peer, me, tag));
            }
        }
        // Equal tags arrive in the order sent; large tags are fine.
        let big = u64::MAX - 1;
        let to = (me + 1) % n;
        let from = (me + n - 1) % n;
        b.send(to, big, b"first").unwrap();
        b.send(to, big, b"second").unwrap();
        assert_eq!(b.recv(from, big).unwrap(), b"first");
        assert_eq!(b.recv(from, big).unwrap(), b"second");
        assert!(matches!(b.send(n, 0, b"x"), Err(Error::InvalidArgument(_))));
        assert!(matches!(b.recv(n, 0), Err(Error::InvalidArgument(_))));
        b.barrier().unwrap();
    });
}

#[test]
fn sends_do_not_wait_for_receivers() {
    // Both ranks send 3 x 16 MiB before either receives: a send that waited for the matching
    // receive would deadlock here (and fail at the timeout).
    with_ranks(&local_addr(), 2, |b| {
        let peer = 1 - b.rank();
        let big = vec![b.rank() as u8 + 1; 16 << 20];
        for tag in 0..3 {
            b.send(peer, tag, &big).unwrap();
        }
        for tag in (0..3).rev() {
            let m = b.recv(peer, tag).unwrap();
            assert_eq!(m.len(), 16 << 20);
            assert!(m.iter().all(|&x| x == peer as u8 + 1));
        }
        b.barrier().unwrap();
    });
}

#[test]
fn mismatched_all_gather_sizes_fail_everywhere() {
    let res = with_ranks(&local_addr(), 2, |b| {
        let mut d = vec![0u8; 2 * (4 + 4 * b.rank())];
        let r = b.all_gather(&mut d).map_err(|e| e.to_string());
        // The failure is sticky.
        assert!(b.barrier().is_err());
        r
    });
    for r in res {
        assert!(r.is_err(), "{r:?}");
    }
}
