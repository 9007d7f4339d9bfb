//! The embedded PTX (src/cuda/kernels/*.ptx) is what scripts/gen-ptx.sh makes from the CUDA
//! sources beside it. Needs CUDA 13.0's nvcc (NVCC=... or on PATH); skipped, saying so, where
//! there is none (CI has none: there the PTX entry is checked by the library's unit test).

use std::process::Command;

#[test]
fn embedded_ptx_is_current() {
    let nvcc = std::env::var("NVCC").ok().or_else(|| {
        let out = Command::new("sh")
            .args(["-c", "command -v nvcc"])
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    });
    let Some(nvcc) = nvcc.filter(|p| !p.is_empty()) else {
        eprintln!("SKIPPED embedded_ptx_is_current: no nvcc (set NVCC=/path/to/nvcc of CUDA 13.0)");
        return;
    };
    let root = env!("CARGO_MANIFEST_DIR");
    let st = Command::new("bash")
        .arg(format!("{root}/scripts/gen-ptx.sh"))
        .arg("--check")
        .env("NVCC", &nvcc)
        .status()
        .expect("running scripts/gen-ptx.sh");
    assert!(
        st.success(),
        "the embedded PTX is stale: run scripts/gen-ptx.sh"
    );
}
