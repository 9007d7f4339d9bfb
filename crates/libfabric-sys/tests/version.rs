//! The libfabric a binary runs on is the one its bindings were generated from: same major
//! version (1.x and 2.x differ in struct layouts, so a mix would be undefined behaviour), and,
//! where `MSCCLPP_TEST_EXPECT_LIBFABRIC` names one (`scripts/test.sh`'s 2.x run: `2.`), that
//! version, so that a run meant for 2.x cannot pass on the system's 1.x by accident.

#[test]
fn runs_on_the_libfabric_it_was_built_against() {
    // SAFETY: fi_version takes nothing and returns the library's FI_VERSION.
    let v = unsafe { libfabric_sys::fi_version() };
    let running = format!("{}.{}", v >> 16, v & 0xffff);
    let built = libfabric_sys::BUILT_AGAINST;
    println!("libfabric: built against {built}, running {running}");
    let major = |s: &str| s.split('.').next().unwrap().to_string();
    assert_eq!(
        major(&running),
        major(built),
        "built against libfabric {built}, running on {running}"
    );
    if let Ok(want) = std::env::var("MSCCLPP_TEST_EXPECT_LIBFABRIC") {
        assert!(
            running.starts_with(&want) && built.starts_with(&want),
            "expected libfabric {want}*, built against {built}, running {running}"
        );
    }
}
