//! Which libfabric a binary runs on, next to the headers its bindings were generated from.
//! libfabric keeps its ABI across versions (versioned symbols), so a 1.17 build also runs on
//! 2.x; what this guards is a run meant for one version silently using another: where
//! `MSCCLPP_TEST_EXPECT_LIBFABRIC` names a version prefix (`scripts/test.sh`'s 2.x run: `2.`),
//! both the headers and the library loaded must be of it.

#[test]
fn runs_on_the_expected_libfabric() {
    // SAFETY: fi_version takes nothing and returns the library's FI_VERSION.
    let v = unsafe { libfabric_sys::fi_version() };
    let running = format!("{}.{}", v >> 16, v & 0xffff);
    let built = libfabric_sys::BUILT_AGAINST;
    println!("libfabric: built against {built}, running {running}");
    assert!(v >> 16 >= 1, "fi_version() returned {v:#x}");
    if let Ok(want) = std::env::var("MSCCLPP_TEST_EXPECT_LIBFABRIC") {
        assert!(
            running.starts_with(&want) && built.starts_with(&want),
            "expected libfabric {want}*, built against {built}, running {running}"
        );
    }
}
