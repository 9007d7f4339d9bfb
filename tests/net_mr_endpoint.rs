//! `MSCCLPP_TEST_FORCE_MR_ENDPOINT=1` through the public `net::open`: the FI_MR_ENDPOINT
//! sequence (fi_mr_regattr, fi_mr_bind to the endpoint, fi_mr_enable, key/desc read afterwards,
//! MRs closed before the endpoint) runs on tcp and shm, which answer -FI_ENOSYS to bind/enable;
//! that answer is accepted only in this mode. One test in this binary: it sets the variable for
//! the whole process.

use mscclpp::transport::net;
use mscclpp::transport::{Endpoint, MemKind, Region};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn region(v: &[u64]) -> Region {
    Region {
        addr: v.as_ptr() as u64,
        len: (v.len() * 8) as u64,
        kind: MemKind::Host,
    }
}

fn word(v: &[u64], i: usize) -> u64 {
    // SAFETY: in bounds and aligned; written through RMA, hence atomic.
    unsafe { AtomicU64::from_ptr(v.as_ptr().add(i) as *mut u64) }.load(Ordering::Acquire)
}

#[test]
fn forced_endpoint_mrs_work_on_tcp_and_shm() {
    std::env::set_var("MSCCLPP_TEST_FORCE_MR_ENDPOINT", "1");
    for shm in [false, true] {
        let open = || {
            if shm {
                net::open(None, true, None)
            } else {
                net::open(Some("lo"), false, None)
            }
            .unwrap()
        };
        let (mut a, mut b): (Box<dyn Endpoint>, Box<dyn Endpoint>) = (open(), open());
        let pa = a.add_peer(1, &b.address().unwrap()).unwrap();
        b.add_peer(0, &a.address().unwrap()).unwrap();
        let src: Vec<u64> = (0..1024).map(|i| i * 7).collect();
        let dst = vec![0u64; 1024];
        let flag = vec![0u64; 2];
        let s = a.register(region(&src)).unwrap().0;
        let d = a.import(pa, &b.register(region(&dst)).unwrap().1).unwrap();
        let f = a.import(pa, &b.register(region(&flag)).unwrap().1).unwrap();
        // The target's proxy: progress until told to stop (Release/Acquire on `stop`).
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let target = std::thread::spawn(move || {
            while !stop2.load(Ordering::Acquire) {
                b.progress().unwrap();
                std::thread::yield_now();
            }
            b
        });
        a.write(pa, s, 0, d, 0, 8192).unwrap();
        a.write_value(pa, f, 8, 1).unwrap();
        a.flush(pa).unwrap();
        let t0 = Instant::now();
        // Ends when the flag is there or after 20 s.
        while word(&flag, 1) != 1 {
            a.progress().unwrap();
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "shm={shm}: flag never arrived"
            );
            std::thread::yield_now();
        }
        for (i, want) in src.iter().enumerate() {
            assert_eq!(word(&dst, i), *want, "word {i}");
        }
        stop.store(true, Ordering::Release);
        let b = target.join().unwrap();
        // Drop order inside each endpoint: MRs, endpoint, CQ, AV, domain, fabric.
        drop(a);
        drop(b);
    }
}
