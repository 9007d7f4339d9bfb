//! Errors, version, logging and NULL handling of the C exports that need no peer.

use mscclpp::abi::mscclppResult_t::*;
use mscclpp::capi::comm::*;
use mscclpp::capi::log::*;
use std::ffi::{c_char, CStr};
use std::sync::Mutex;

fn text(p: *const c_char) -> String {
    assert!(!p.is_null());
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[test]
fn error_strings_cover_every_code_and_unknown_ones() {
    let known: Vec<String> = (0..8).map(|c| text(mscclppGetErrorString(c))).collect();
    let mut dedup = known.clone();
    dedup.sort();
    dedup.dedup();
    assert_eq!(dedup.len(), 8, "each code has its own text: {known:?}");
    for bad in [8, 42, -1, i32::MAX, i32::MIN] {
        assert_eq!(
            text(mscclppGetErrorString(bad)),
            "unknown result code",
            "code {bad}"
        );
    }
}

#[test]
fn version_and_null_out_pointers() {
    let mut v = -1;
    assert_eq!(mscclppGetVersion(&mut v), mscclppSuccess);
    assert_eq!(v, 100, "MSCCLPP_VERSION of 0.1.0");
    assert_eq!(
        mscclppGetVersion(std::ptr::null_mut()),
        mscclppInvalidArgument
    );
    let mut r = 77;
    assert_eq!(
        mscclppCommRank(std::ptr::null_mut(), &mut r),
        mscclppInvalidArgument
    );
    assert_eq!(r, 77, "outputs are written only on success");
    assert_eq!(
        mscclppCommSize(std::ptr::null_mut(), &mut r),
        mscclppInvalidArgument
    );
    assert!(
        text(mscclppGetLastError()).contains("mscclppCommSize"),
        "{}",
        text(mscclppGetLastError())
    );
    // A pointer that was never a communicator.
    let fake = 0x1000 as mscclpp::capi::mscclppComm_t;
    assert_eq!(mscclppCommRank(fake, &mut r), mscclppInvalidArgument);
    assert!(text(mscclppGetLastError()).contains("not a live communicator"));
    assert_eq!(mscclppCommDestroy(fake), mscclppInvalidArgument);
    assert_eq!(mscclppSetBootstrapConnTimeout(0), mscclppInvalidArgument);
    assert_eq!(mscclppSetBootstrapConnTimeout(-5), mscclppInvalidArgument);
    let mut id = mscclpp::abi::mscclppUniqueId { internal: [0; 128] };
    assert_eq!(
        mscclppCommInitRankFromId(std::ptr::null_mut(), 2, id, 0),
        mscclppInvalidArgument
    );
    let mut c = std::ptr::null_mut();
    assert_eq!(
        mscclppCommInitRankFromId(&mut c, 2, id, 0),
        mscclppInvalidArgument,
        "an all-zero id is malformed"
    );
    assert!(c.is_null());
    assert_eq!(
        mscclppGetUniqueId(std::ptr::null_mut()),
        mscclppInvalidArgument
    );
    assert_eq!(mscclppGetUniqueId(&mut id), mscclppSuccess);
    assert!(id.internal.iter().any(|&b| b != 0));
}

static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn keep(msg: *const c_char) {
    LINES.lock().unwrap().push(text(msg));
}

#[test]
fn log_handler_receives_every_line() {
    assert_eq!(mscclppSetLogHandler(Some(keep)), mscclppSuccess);
    let mut r = 0;
    assert_eq!(
        mscclppCommRank(std::ptr::null_mut(), &mut r),
        mscclppInvalidArgument
    );
    assert_eq!(mscclppSetLogHandler(None), mscclppSuccess);
    let lines = LINES.lock().unwrap().clone();
    assert!(
        lines.iter().any(|l| l.contains("WARN")
            && l.contains("mscclppCommRank")
            && l.contains("comm is NULL")),
        "{lines:?}"
    );
    // The default handler takes NULL without crashing.
    mscclppDefaultLogHandler(std::ptr::null());
}
