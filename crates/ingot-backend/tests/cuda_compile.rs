//! Every CUDA kernel source compiles with NVRTC for Ampere and Hopper. NVRTC is a host
//! library, so this runs without a GPU (CI fetches it with `scripts/fetch-nvrtc`).
#![cfg(feature = "cuda")]

use ingot_backend::cuda::{compile, load_nvrtc, search_dirs, PROGRAMS};

#[test]
fn kernels_compile_for_sm80_and_sm90() {
    if let Err(e) = load_nvrtc() {
        assert!(
            std::env::var("CI").is_err(),
            "NVRTC is needed in CI: {e:#} (searched {:?})",
            search_dirs()
        );
        eprintln!("SKIPPED: {e:#}");
        return;
    }
    for arch in ["sm_80", "sm_90"] {
        for (name, src) in PROGRAMS {
            let cubin = compile(name, src, arch).unwrap_or_else(|e| panic!("{e:#}"));
            assert!(cubin.starts_with(b"\x7fELF"), "{name}: not a cubin");
        }
    }
}
