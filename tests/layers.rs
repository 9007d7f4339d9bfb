//! The library's layers (docs/DESIGN.md, "The layers"), kept acyclic: a module of `src/` may
//! use only modules below it in `ORDER`. Reads the sources: every `crate::name` path (in `use`
//! lines, `use crate::{a, b}` groups, inline paths and `crate::info!`-style macros) outside
//! comments and string literals counts as a use of `name`. Also: only `config` reads the
//! environment, and only `capi` exports C symbols.

use std::path::{Path, PathBuf};

/// Bottom to top.
const ORDER: &[&str] = &[
    "abi",
    "error",
    "config",
    "sync",
    "log",
    "wire",
    "mem",
    "cuda",
    "bootstrap",
    "fifo",
    "transport",
    "proxy",
    "host",
    "comm",
    "capi",
];

/// The logging macros (`#[macro_export]`ed from `log`, so they are `crate::info!`).
const LOG_MACROS: &[&str] = &["warn", "info", "trace"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The source with comments and the contents of string and char literals blanked out (kept
/// as spaces, so that positions and line numbers stay).
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let blank = |c: u8| if c == b'\n' { b'\n' } else { b' ' };
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    out.extend([b' ', b' ']);
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    out.extend([b' ', b' ']);
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if c == b'r' && matches!(b.get(i + 1), Some(b'#') | Some(b'"')) && {
            let mut j = i + 1;
            while b.get(j) == Some(&b'#') {
                j += 1;
            }
            b.get(j) == Some(&b'"')
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
        } {
            // Raw string: r"..." or r#"..."#.
            let mut hashes = 0;
            i += 1;
            while b[i] == b'#' {
                hashes += 1;
                i += 1;
            }
            i += 1;
            out.extend(std::iter::repeat_n(b' ', hashes + 2));
            loop {
                if i >= b.len() {
                    break;
                }
                if b[i] == b'"'
                    && b[i + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == b'#')
                        .count()
                        == hashes
                {
                    out.extend(std::iter::repeat_n(b' ', hashes + 1));
                    i += 1 + hashes;
                    break;
                }
                out.push(blank(b[i]));
                i += 1;
            }
        } else if c == b'"' {
            out.push(b' ');
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    out.push(b' ');
                    i += 1;
                }
                if i < b.len() {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
            out.push(b' ');
            i += 1;
        } else if c == b'\'' && (b.get(i + 2) == Some(&b'\'') || b.get(i + 1) == Some(&b'\\')) {
            // A char literal ('"', '\'', '\n'); lifetimes ('a) are left alone.
            out.push(b' ');
            i += 1;
            while i < b.len() && b[i] != b'\'' {
                if b[i] == b'\\' {
                    out.push(b' ');
                    i += 1;
                }
                out.push(b' ');
                i += 1;
            }
            out.push(b' ');
            i += 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The top-level modules `code` names through `crate::`, with the line of each use.
fn crate_uses(code: &str) -> Vec<(String, usize)> {
    uses_after(code, "crate::")
}

/// The names `code` reaches through `prefix` (`crate::`, `super::`, ...), with the line of each
/// use: the first name of a path, every name at depth 0 of a `prefix{a, b::c}` group, and
/// `log` for its macros.
fn uses_after(code: &str, prefix: &str) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    for (pos, _) in code.match_indices(prefix) {
        if pos > 0 {
            let prev = code.as_bytes()[pos - 1];
            // `$crate::` inside a macro of `log`, a longer name ending in the prefix, or the
            // prefix inside a longer path (`super::super::`).
            if prev == b'$' || prev.is_ascii_alphanumeric() || prev == b'_' || prev == b':' {
                continue;
            }
        }
        let line = code[..pos].matches('\n').count() + 1;
        let rest = code[pos + prefix.len()..].trim_start();
        if let Some(group) = rest.strip_prefix('{') {
            // `crate::{a, b::{c, d}, e}`: the names at depth 0 of the group.
            let mut depth = 0;
            let mut at_start = true;
            for (k, ch) in group.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => at_start = true,
                    c if at_start && (c.is_ascii_alphanumeric() || c == '_') => {
                        found.push((ident_at(&group[k..]).to_string(), line));
                        at_start = false;
                    }
                    c if !c.is_whitespace() => at_start = false,
                    _ => {}
                }
            }
        } else {
            let name = ident_at(rest);
            let after = &rest[name.len()..];
            if LOG_MACROS.contains(&name) && after.starts_with('!') {
                found.push(("log".to_string(), line));
            } else if !name.is_empty() {
                found.push((name.to_string(), line));
            }
        }
    }
    found
}

/// `src/comm/setup.rs` -> "comm"; `src/log.rs` -> "log"; `src/lib.rs` -> None.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel.components().next()?.as_os_str().to_str()?.to_string();
    if first == "lib.rs" {
        return None;
    }
    Some(first.trim_end_matches(".rs").to_string())
}

struct Source {
    path: PathBuf,
    module: String,
    code: String,
}

fn sources() -> Vec<Source> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    files
        .into_iter()
        .filter_map(|path| {
            let module = module_of(&src, &path)?;
            let code = code_only(&std::fs::read_to_string(&path).unwrap());
            Some(Source { path, module, code })
        })
        .collect()
}

/// Every use of a module at or above the user's own layer, as "file:line: a uses b".
fn upward_uses(sources: &[Source]) -> Vec<String> {
    let rank = |m: &str| ORDER.iter().position(|o| *o == m);
    let mut bad = Vec::new();
    for s in sources {
        let Some(me) = rank(&s.module) else {
            bad.push(format!(
                "{}: module `{}` is not in tests/layers.rs ORDER: give it a layer",
                s.path.display(),
                s.module
            ));
            continue;
        };
        for (used, line) in crate_uses(&s.code) {
            if used == s.module {
                continue;
            }
            match rank(&used) {
                Some(u) if u < me => {}
                Some(_) => bad.push(format!(
                    "{}:{line}: `{}` uses `{used}`, which is not below it in the layer order",
                    s.path.display(),
                    s.module
                )),
                None => bad.push(format!(
                    "{}:{line}: `{}` uses `crate::{used}`, which is not a layer",
                    s.path.display(),
                    s.module
                )),
            }
        }
    }
    bad
}

#[test]
fn layers_have_no_upward_use() {
    let bad = upward_uses(&sources());
    assert!(
        bad.is_empty(),
        "layer order {ORDER:?} broken:\n{}",
        bad.join("\n")
    );
}

#[test]
fn every_layer_exists_and_lib_declares_it() {
    let lib =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    let mods = sources();
    for m in ORDER {
        assert!(
            mods.iter().any(|s| s.module == *m),
            "layer `{m}` has no source"
        );
        assert!(
            lib.contains(&format!("mod {m};")),
            "src/lib.rs does not declare `{m}`"
        );
    }
}

#[test]
fn only_config_reads_the_environment() {
    let mut bad = Vec::new();
    for s in sources() {
        for needle in ["env::var", "env::var_os", "getenv"] {
            for (pos, _) in s.code.match_indices(needle) {
                if s.module != "config" {
                    let line = s.code[..pos].matches('\n').count() + 1;
                    bad.push(format!("{}:{line}: {needle}", s.path.display()));
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "environment read outside src/config.rs:\n{}",
        bad.join("\n")
    );
}

#[test]
fn only_capi_exports_c_symbols() {
    let mut bad = Vec::new();
    for s in sources() {
        if s.module != "capi" && s.code.contains("no_mangle") {
            bad.push(s.path.display().to_string());
        }
    }
    assert!(bad.is_empty(), "#[no_mangle] outside src/capi/: {bad:?}");
}

// The checker itself: a planted upward use, in each form it must see, is caught; comments and
// strings are not uses.
#[test]
fn the_checker_sees_planted_upward_uses() {
    let plant = |module: &str, code: &str| {
        upward_uses(&[Source {
            path: PathBuf::from(format!("src/{module}/planted.rs")),
            module: module.to_string(),
            code: code_only(code),
        }])
    };
    for code in [
        "use crate::comm::Comm;",
        "use crate::{error::Error, proxy::lock};",
        "fn f() { crate::capi::fail(\"x\", e); }",
        "use crate::{\n    abi::*,\n    host::{Conn, Spin},\n};",
    ] {
        assert_eq!(plant("fifo", code).len(), 1, "not caught: {code}");
    }
    // A macro of `log` from below `log`.
    assert_eq!(plant("config", "fn f() { crate::warn!(\"x\"); }").len(), 1);
    for code in [
        "// use crate::comm::Comm;",
        "/// see `crate::proxy::run`",
        "/* crate::capi */ fn f() {}",
        "const S: &str = \"crate::comm\";",
        "const R: &str = r#\"crate::comm\"#;",
        "fn f() -> char { '\"' } // crate::comm",
        "use crate::{abi::*, error::Result, mem::HostBlock};",
        "fn f() { crate::info!(\"{}\", 1); }",
    ] {
        assert!(plant("fifo", code).is_empty(), "false alarm: {code}");
    }
    assert_eq!(
        plant("nowhere", "").len(),
        1,
        "an unknown module must be placed"
    );
}

/// The modules of `src/transport/net`, bottom to top (docs/DESIGN.md, "The layers"): a file
/// may use only modules before it in this list (its own module aside), so the network
/// transport has no import circle. Leaves that carry the wire formats and pure rules first,
/// then the libfabric objects and the decisions made from them, the peer table, the writes in
/// flight, what a flush posts, registrations, staging, the endpoint, rails; `mod.rs` (the
/// root, which declares them all and opens endpoints) is not in the list.
const NET_ORDER: &[&str] = &[
    "record",
    "locality",
    "fabric",
    "counted",
    "signals",
    "blob",
    "profile",
    "order",
    "select",
    "mr",
    "unordered",
    "peers",
    "ops",
    "probe",
    "flush",
    "regions",
    "staging",
    "endpoint",
    "rails",
];

/// The net modules a file of `src/transport/net` (its module `module`) uses: `super::x` from a
/// file of the net directory itself, `super::super::x` from one of `staging/`, and
/// `crate::transport::net::x` from anywhere. A file's trailing `#[cfg(test)] mod tests` is
/// left out (its `super::` is the file itself).
fn net_uses(module: &str, code: &str) -> Vec<(String, usize)> {
    let code = match code.find("#[cfg(test)]\nmod tests") {
        Some(k) => &code[..k],
        None => code,
    };
    let mut used = uses_after(code, "crate::transport::net::");
    if module == "staging" {
        used.extend(uses_after(code, "super::super::"));
    } else {
        used.extend(
            uses_after(code, "super::")
                .into_iter()
                .filter(|(n, _)| n != "super"),
        );
    }
    used
}

/// `src/transport/net/staging/send.rs` -> "staging"; `.../net/ops.rs` -> "ops"; None for the
/// root (`mod.rs`) and test files.
fn net_module_of(net: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(net).ok()?;
    let parts: Vec<&str> = rel.iter().filter_map(|c| c.to_str()).collect();
    match parts.as_slice() {
        ["mod.rs"] | ["tests.rs"] | [_, "tests.rs"] => None,
        [f] => Some(f.trim_end_matches(".rs").to_string()),
        [dir, _] => Some(dir.to_string()),
        _ => None,
    }
}

/// Every use in `sources` (module, path, code) of a net module not below the user's own, as
/// "file:line: a uses b".
fn net_upward_uses(sources: &[(String, PathBuf, String)]) -> Vec<String> {
    let rank = |m: &str| NET_ORDER.iter().position(|o| *o == m);
    let mut bad = Vec::new();
    for (module, path, code) in sources {
        let Some(me) = rank(module) else {
            bad.push(format!(
                "{}: net module `{module}` is not in tests/layers.rs NET_ORDER: give it a layer",
                path.display()
            ));
            continue;
        };
        for (used, line) in net_uses(module, code) {
            if used == *module {
                continue;
            }
            match rank(&used) {
                Some(u) if u < me => {}
                Some(_) => bad.push(format!(
                    "{}:{line}: `{module}` uses `{used}`, which is not below it in NET_ORDER",
                    path.display()
                )),
                None => bad.push(format!(
                    "{}:{line}: `{module}` uses `{used}` of the net root (mod.rs): take it from the module that defines it",
                    path.display()
                )),
            }
        }
    }
    bad
}

fn net_sources() -> Vec<(String, PathBuf, String)> {
    let net = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/transport/net");
    let mut files = Vec::new();
    rust_files(&net, &mut files);
    files.sort();
    files
        .into_iter()
        .filter_map(|p| {
            let m = net_module_of(&net, &p)?;
            let code = code_only(&std::fs::read_to_string(&p).unwrap());
            Some((m, p, code))
        })
        .collect()
}

#[test]
fn net_modules_have_no_import_circle() {
    let sources = net_sources();
    let bad = net_upward_uses(&sources);
    assert!(
        bad.is_empty(),
        "net layer order {NET_ORDER:?} broken:\n{}",
        bad.join("\n")
    );
    for m in NET_ORDER {
        assert!(
            sources.iter().any(|s| s.0 == *m),
            "net module `{m}` in NET_ORDER has no source"
        );
    }
}

#[test]
fn the_net_checker_sees_planted_circles() {
    let plant = |module: &str, code: &str| {
        net_upward_uses(&[(
            module.to_string(),
            PathBuf::from(format!("src/transport/net/{module}.rs")),
            code_only(code),
        )])
    };
    for (module, code) in [
        ("peers", "use super::ops::{Op, Ops};"),
        ("ops", "use super::{fabric, staging::RECORD_BYTES};"),
        ("blob", "let n = x / super::staging::RECORD_BYTES;"),
        ("regions", "use crate::transport::net::staging::Staging;"),
        ("staging", "use super::super::endpoint::NetEndpoint;"),
        ("rails", "use super::NetEndpoint;"),
    ] {
        assert_eq!(plant(module, code).len(), 1, "not caught: {module}: {code}");
    }
    for (module, code) in [
        ("ops", "use super::peers::Peers;"),
        (
            "staging",
            "use super::{Kind, Record}; use super::super::regions::Backing;",
        ),
        (
            "order",
            "mod x {}\n#[cfg(test)]\nmod tests { use super::super::staging; }",
        ),
        ("flush", "// use super::staging::Net;"),
    ] {
        assert!(
            plant(module, code).is_empty(),
            "false alarm: {module}: {code}"
        );
    }
}
