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
    // One thread a program and architecture (NVRTC allows concurrent compilations): one
    // after another they took over three minutes of a 2-core CI run.
    std::thread::scope(|scope| {
        let jobs: Vec<_> = ["sm_80", "sm_90"]
            .into_iter()
            .flat_map(|arch| PROGRAMS.iter().map(move |&(name, src)| (arch, name, src)))
            .map(|(arch, name, src)| (arch, name, scope.spawn(move || compile(name, src, arch))))
            .collect();
        for (arch, name, job) in jobs {
            let cubin = job
                .join()
                .expect("compile thread")
                .unwrap_or_else(|e| panic!("{name} for {arch}: {e:#}"));
            assert!(
                cubin.starts_with(b"\x7fELF"),
                "{name} for {arch}: not a cubin"
            );
            // For kernel work: the cubins, to read their machine code with `cuobjdump -sass`.
            if let Some(dir) = std::env::var_os("INGOT_CUBIN_DIR") {
                let path = std::path::Path::new(&dir).join(format!("{name}_{arch}.cubin"));
                std::fs::write(&path, &cubin).expect("write the cubin");
            }
        }
    });
}
