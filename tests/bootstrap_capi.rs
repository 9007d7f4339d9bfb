//! The C entry points over the bootstrap: mscclppCommInitRank / InitRankFromId, rank and size,
//! mscclppBootstrapAllGather / Barrier, and bad arguments refused with the handle still usable.
//! Ranks are threads.

mod common;

use common::boot::local_addr;
use mscclpp::abi::{mscclppResult_t, mscclppUniqueId, MSCCLPP_UNIQUE_ID_BYTES};
use mscclpp::capi::comm as c;
use std::ffi::CString;

#[test]
fn capi_three_ranks() {
    let n = 3;
    let addr = CString::new(local_addr()).unwrap();
    let hs: Vec<_> = (0..n)
        .map(|r| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut comm = std::ptr::null_mut();
                let rc = c::mscclppCommInitRank(&mut comm, n, addr.as_ptr(), r);
                assert_eq!(rc, mscclppResult_t::mscclppSuccess);
                assert!(!comm.is_null());
                let (mut rank, mut size) = (-1, -1);
                assert_eq!(
                    c::mscclppCommRank(comm, &mut rank),
                    mscclppResult_t::mscclppSuccess
                );
                assert_eq!(
                    c::mscclppCommSize(comm, &mut size),
                    mscclppResult_t::mscclppSuccess
                );
                assert_eq!((rank, size), (r, n));
                let mut data = vec![0u32; n as usize * 2];
                data[r as usize * 2] = 100 + r as u32;
                data[r as usize * 2 + 1] = 200 + r as u32;
                let rc = c::mscclppBootstrapAllGather(comm, data.as_mut_ptr().cast(), 8);
                assert_eq!(rc, mscclppResult_t::mscclppSuccess);
                for q in 0..n as usize {
                    assert_eq!(&data[q * 2..q * 2 + 2], &[100 + q as u32, 200 + q as u32]);
                }
                assert_eq!(
                    c::mscclppBootstrapBarrier(comm),
                    mscclppResult_t::mscclppSuccess
                );
                assert_eq!(c::mscclppCommDestroy(comm), mscclppResult_t::mscclppSuccess);
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

#[test]
fn capi_unique_id_two_ranks() {
    let mut id = mscclppUniqueId {
        internal: [0; MSCCLPP_UNIQUE_ID_BYTES],
    };
    assert_eq!(
        c::mscclppGetUniqueId(&mut id),
        mscclppResult_t::mscclppSuccess
    );
    let hs: Vec<_> = (0..2)
        .map(|r| {
            let id = mscclppUniqueId {
                internal: id.internal,
            };
            std::thread::spawn(move || {
                let mut comm = std::ptr::null_mut();
                let rc = c::mscclppCommInitRankFromId(&mut comm, 2, id, r);
                assert_eq!(rc, mscclppResult_t::mscclppSuccess);
                assert_eq!(
                    c::mscclppBootstrapBarrier(comm),
                    mscclppResult_t::mscclppSuccess
                );
                assert_eq!(c::mscclppCommDestroy(comm), mscclppResult_t::mscclppSuccess);
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

#[test]
fn capi_bad_input_then_still_usable() {
    use mscclppResult_t::mscclppInvalidArgument as Inval;
    let addr = CString::new(local_addr()).unwrap();
    let mut comm = std::ptr::null_mut();
    assert_eq!(
        c::mscclppCommInitRank(std::ptr::null_mut(), 1, addr.as_ptr(), 0),
        Inval
    );
    assert_eq!(
        c::mscclppCommInitRank(&mut comm, 1, std::ptr::null(), 0),
        Inval
    );
    assert_eq!(
        c::mscclppCommInitRank(&mut comm, 0, addr.as_ptr(), 0),
        Inval
    );
    assert_eq!(
        c::mscclppCommInitRank(&mut comm, -3, addr.as_ptr(), 0),
        Inval
    );
    assert_eq!(
        c::mscclppCommInitRank(&mut comm, 2, addr.as_ptr(), 2),
        Inval
    );
    assert_eq!(
        c::mscclppCommInitRank(&mut comm, 2, addr.as_ptr(), -1),
        Inval
    );
    for bad in ["127.0.0.1", "127.0.0.1:99999", "nonsense", "[::1:80"] {
        let b = CString::new(bad).unwrap();
        assert_eq!(
            c::mscclppCommInitRank(&mut comm, 1, b.as_ptr(), 0),
            Inval,
            "{bad}"
        );
    }
    assert!(comm.is_null(), "comm written on failure");
    assert_eq!(c::mscclppGetUniqueId(std::ptr::null_mut()), Inval);
    let garbage = mscclppUniqueId {
        internal: [7; MSCCLPP_UNIQUE_ID_BYTES],
    };
    assert_eq!(
        c::mscclppCommInitRankFromId(&mut comm, 1, garbage, 0),
        Inval
    );
    assert_eq!(c::mscclppSetBootstrapConnTimeout(0), Inval);
    assert_eq!(c::mscclppSetBootstrapConnTimeout(-1), Inval);
    assert!(comm.is_null());
    // Still usable: a real communicator, bad collective arguments on it, then destroy.
    assert_eq!(
        c::mscclppCommInitRank(&mut comm, 1, addr.as_ptr(), 0),
        mscclppResult_t::mscclppSuccess
    );
    let mut x = [1u8; 4];
    assert_eq!(
        c::mscclppBootstrapAllGather(comm, std::ptr::null_mut(), 4),
        Inval
    );
    assert_eq!(
        c::mscclppBootstrapAllGather(comm, x.as_mut_ptr().cast(), 0),
        Inval
    );
    assert_eq!(
        c::mscclppBootstrapAllGather(comm, x.as_mut_ptr().cast(), 4),
        mscclppResult_t::mscclppSuccess
    );
    assert_eq!(
        c::mscclppBootstrapBarrier(comm),
        mscclppResult_t::mscclppSuccess
    );
    assert_eq!(c::mscclppCommDestroy(comm), mscclppResult_t::mscclppSuccess);
    assert_eq!(c::mscclppBootstrapBarrier(comm), Inval, "destroyed handle");
}

/// A destroyed communicator's handle never names a later one: 32 times, a one-rank
/// communicator A is created and destroyed, then B is created; destroying A again is
/// `mscclppInvalidArgument` and B still answers. Before, B got A's freed handle within a few
/// rounds (the 5th, measured on this machine), and the second destroy destroyed B.
#[test]
fn destroyed_handle_never_names_a_newer_communicator() {
    use mscclppResult_t::{mscclppInvalidArgument, mscclppSuccess};
    let mut handles = std::collections::HashSet::new();
    for round in 0..32 {
        let mut a = std::ptr::null_mut();
        let addr = CString::new(local_addr()).unwrap();
        assert_eq!(
            c::mscclppCommInitRank(&mut a, 1, addr.as_ptr(), 0),
            mscclppSuccess
        );
        assert_eq!(c::mscclppCommDestroy(a), mscclppSuccess);
        let mut b = std::ptr::null_mut();
        let addr = CString::new(local_addr()).unwrap();
        assert_eq!(
            c::mscclppCommInitRank(&mut b, 1, addr.as_ptr(), 0),
            mscclppSuccess
        );
        assert!(
            handles.insert(a as usize) && handles.insert(b as usize),
            "round {round}: a handle was handed out twice"
        );
        assert_eq!(
            c::mscclppCommDestroy(a),
            mscclppInvalidArgument,
            "round {round}: second destroy"
        );
        let mut rank = -1;
        assert_eq!(
            c::mscclppCommRank(b, &mut rank),
            mscclppSuccess,
            "round {round}: B"
        );
        assert_eq!(rank, 0);
        assert_eq!(c::mscclppCommDestroy(b), mscclppSuccess);
    }
}
