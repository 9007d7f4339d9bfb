//! Gives the shared library its soname, `libmscclpp.so.<major>` (libmscclpp.so.0 for 0.x),
//! so that programs linked against it record the soname and the installed symlink chain
//! libmscclpp.so -> libmscclpp.so.0 -> libmscclpp.so.0.1.0 (see CMakeLists.txt) works.
//! Applies to every `cargo build`, not only to builds through CMake.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if os == "linux" || os == "android" || os.ends_with("bsd") {
        let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libmscclpp.so.{major}");
    }
}
