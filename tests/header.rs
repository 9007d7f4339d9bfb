//! `include/mscclpp.h` is generated and committed. This test regenerates it with the pinned
//! cbindgen (the dev-dependency `cbindgen = "=0.29.4"`, the version `scripts/gen-header.sh`
//! installs) and fails on any difference, so a change to `src/abi.rs`, `src/capi/` or
//! `cbindgen.toml` cannot land without the header that goes with it.

use std::path::Path;

const REGENERATE: &str = "scripts/gen-header.sh";

fn generate(root: &Path) -> Vec<u8> {
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml"))
        .unwrap_or_else(|e| panic!("reading cbindgen.toml: {e}"));
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(root.join("scripts/header-sources.rs"))
        .generate()
        .unwrap_or_else(|e| panic!("cbindgen failed on scripts/header-sources.rs: {e}"));
    let mut out = Vec::new();
    bindings.write(&mut out);
    out
}

/// A short report of where two texts part: the first differing line, with a little context.
fn first_difference(committed: &str, fresh: &str) -> String {
    let (old, new): (Vec<&str>, Vec<&str>) = (committed.lines().collect(), fresh.lines().collect());
    let at = old
        .iter()
        .zip(&new)
        .position(|(a, b)| a != b)
        .unwrap_or(old.len().min(new.len()));
    let mut s = format!("first difference at line {}:\n", at + 1);
    for (sign, lines) in [("-", &old), ("+", &new)] {
        for l in lines.iter().skip(at).take(8) {
            s.push_str(&format!("{sign} {l}\n"));
        }
    }
    s
}

#[test]
fn committed_header_matches_cbindgen_output() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fresh = generate(root);
    let committed = std::fs::read(root.join("include/mscclpp.h")).unwrap_or_default();
    if fresh == committed {
        return;
    }
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("mscclpp.h");
    std::fs::write(&out, &fresh).expect("writing the regenerated header");
    panic!(
        "include/mscclpp.h is out of date with src/abi.rs, src/capi/ and cbindgen.toml.\n\
         {}\n\
         Whole diff: diff -u include/mscclpp.h {}\n\
         Regenerate: {REGENERATE}",
        first_difference(
            &String::from_utf8_lossy(&committed),
            &String::from_utf8_lossy(&fresh)
        ),
        out.display()
    );
}
