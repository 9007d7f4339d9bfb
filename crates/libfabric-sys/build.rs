//! Generates the bindings against the libfabric that pkg-config finds, and compiles the C
//! wrappers that make the headers' `static inline` functions (most of the fi_* API) linkable.

use std::env;
use std::path::PathBuf;

/// Oldest libfabric these bindings are used with (Debian bookworm ships 1.17).
const MIN_VERSION: &str = "1.17";

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");

    let lib = match pkg_config::Config::new()
        .atleast_version(MIN_VERSION)
        .probe("libfabric")
    {
        Ok(lib) => lib,
        Err(e) => panic!(
            "\n\nlibfabric-sys needs libfabric >= {MIN_VERSION} with its development files \
             (pkg-config module `libfabric`): {e}\n\
             On Debian/Ubuntu: apt-get install libfabric-dev libclang-dev pkg-config\n\
             For a libfabric installed elsewhere, add its lib/pkgconfig to PKG_CONFIG_PATH.\n\n"
        ),
    };

    // libfabric 2.0 put `fi_mr_attr.mr_iov` into an anonymous union (with `dmabuf`); the
    // crate's `mr_attr_set_iov` picks the field by this cfg.
    println!("cargo::rustc-check-cfg=cfg(fi_mr_iov_in_union)");
    let major: u32 = lib
        .version
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(1);
    if major >= 2 {
        println!("cargo:rustc-cfg=fi_mr_iov_in_union");
    }
    println!(
        "cargo:rustc-env=LIBFABRIC_SYS_BUILT_AGAINST={}",
        lib.version
    );

    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    let wrap_c = out.join("fi_static_wrappers.c");
    let clang_includes: Vec<String> = lib
        .include_paths
        .iter()
        .map(|p| format!("-I{}", p.display()))
        .collect();

    let bindings = bindgen::Builder::default()
        .header("wrapper.h")
        .clang_args(&clang_includes)
        // Only libfabric's own names: keeps the output (and the compile) small.
        .allowlist_function("fi_.*")
        .allowlist_type("fi_.*|fid.*")
        .allowlist_var("FI_.*")
        // The fi_* data-path calls are `static inline` dispatchers through ops tables; bindgen
        // emits a C file of extern wrappers for them, compiled below.
        .wrap_static_fns(true)
        .wrap_static_fns_path(&wrap_c)
        .derive_default(true)
        .layout_tests(false)
        .prepend_enum_name(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .generate()
        .expect("bindgen failed on the libfabric headers");
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("writing bindings.rs");

    // bindgen writes `#include "wrapper.h"` at the top of the wrapper file: make it findable.
    let mut build = cc::Build::new();
    build
        .file(&wrap_c)
        .include(env::var("CARGO_MANIFEST_DIR").expect("manifest dir"))
        .warnings(false);
    for p in &lib.include_paths {
        build.include(p);
    }
    build.compile("fabric_static_wrappers");
    // pkg_config already printed `cargo:rustc-link-lib=fabric`; the wrapper archive uses it, so
    // repeat it after the archive for linkers that resolve in order.
    for l in &lib.libs {
        println!("cargo:rustc-link-lib={l}");
    }
}
