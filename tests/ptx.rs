//! The embedded PTX (src/cuda/kernels/*.ptx): it declares PTX ISA 8.0, which drivers of CUDA
//! 12.0 and newer load (checked everywhere, CI included), and it is what scripts/gen-ptx.sh
//! makes from the CUDA sources beside it. That second check needs CUDA 13.0's nvcc (NVCC=... or
//! on PATH) and CUDA 12.0's ptxas (PTXAS12=...; the script's header has the pip recipe for
//! both); it is skipped, saying so, where either is missing (CI has neither).

use std::process::Command;

/// The ISA every embedded PTX file declares (scripts/gen-ptx.sh's `ISA`).
const ISA: &str = "8.0";

fn ptx_files() -> Vec<std::path::PathBuf> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/cuda/kernels");
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .expect("src/cuda/kernels")
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "ptx"))
        .collect();
    v.sort();
    v
}

/// CUDA 13's nvcc writes ISA 9.0, which a driver older than 13.0 refuses (the SM engine would
/// then be off on most fleets): a file regenerated without gen-ptx.sh's ISA line fails here.
#[test]
fn embedded_ptx_declares_isa_8_0() {
    let files = ptx_files();
    assert!(!files.is_empty(), "no PTX under src/cuda/kernels");
    for f in files {
        let text = std::fs::read_to_string(&f).expect("reading the PTX");
        let versions: Vec<&str> = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix(".version "))
            .collect();
        assert_eq!(
            versions,
            [ISA],
            "{}: the PTX must declare ISA {ISA} once (run scripts/gen-ptx.sh)",
            f.display()
        );
    }
}

fn tool(var: &str, on_path: Option<&str>) -> Option<String> {
    std::env::var(var)
        .ok()
        .or_else(|| {
            let out = Command::new("sh")
                .args(["-c", &format!("command -v {}", on_path?)])
                .output()
                .ok()?;
            out.status
                .success()
                .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        })
        .filter(|p| !p.is_empty())
}

#[test]
fn embedded_ptx_is_current() {
    let (Some(nvcc), Some(ptxas12)) = (tool("NVCC", Some("nvcc")), tool("PTXAS12", None)) else {
        eprintln!("SKIPPED embedded_ptx_is_current: set NVCC=/path/to/nvcc of CUDA 13.0 and PTXAS12=/path/to/ptxas of CUDA 12.0 (scripts/gen-ptx.sh)");
        return;
    };
    let root = env!("CARGO_MANIFEST_DIR");
    let st = Command::new("bash")
        .arg(format!("{root}/scripts/gen-ptx.sh"))
        .arg("--check")
        .env("NVCC", &nvcc)
        .env("PTXAS12", &ptxas12)
        .status()
        .expect("running scripts/gen-ptx.sh");
    assert!(
        st.success(),
        "the embedded PTX is stale, or an assembler refuses it: see scripts/gen-ptx.sh's output"
    );
}
