//! Finding the CUDA libraries at start. cudarc opens them by name (`libnvrtc.so.13`, …),
//! which the dynamic loader resolves through `LD_LIBRARY_PATH` and the system's cache.
//! Toolkits outside those paths (`/usr/local/cuda/lib64`, a Python wheel's
//! `nvidia/cu13/lib`, or the directories in `INGOT_CUDA_LIB_DIR`) are opened here by full
//! path first: a library already loaded under the same name is the one the later
//! by-name open returns.

use anyhow::{bail, Result};
use std::path::{Path, PathBuf};

/// NVRTC, its builtins first: NVRTC opens them by name when it compiles.
pub const NVRTC: [&str; 2] = ["libnvrtc-builtins.so.13.0", "libnvrtc.so.13"];
/// cuBLASLt and the cuBLAS it depends on.
pub const CUBLAS: [&str; 2] = ["libcublas.so.13", "libcublasLt.so.13"];
/// NCCL, for tensor parallelism (its Python wheel `nvidia-nccl-cu13` ships it in
/// `nvidia/nccl/lib`).
pub const NCCL: [&str; 1] = ["libnccl.so.2"];

/// Directories searched beside the loader's own path, most specific first.
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var("INGOT_CUDA_LIB_DIR")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    if let Some(home) = std::env::var_os("CUDA_HOME").or_else(|| std::env::var_os("CUDA_PATH")) {
        dirs.push(Path::new(&home).join("lib64"));
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs
}

fn open_global(path: &Path) -> bool {
    // SAFETY: opening a CUDA library runs only its initializers; the handle is leaked so
    // the library stays loaded for the process's life, as cudarc expects.
    match unsafe {
        libloading::os::unix::Library::open(
            Some(path),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
        )
    } {
        Ok(lib) => {
            std::mem::forget(lib);
            true
        }
        Err(_) => false,
    }
}

fn loads_by_name(name: &str) -> bool {
    // SAFETY: as in `open_global`; this handle is dropped, the library stays if in use.
    unsafe { libloading::Library::new(name) }.is_ok()
}

/// Whether the NVIDIA driver library can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: probing for the driver library only.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Makes each library loadable by name, or says which is missing and where it looked.
pub fn load(names: &[&str]) -> Result<()> {
    let dirs = search_dirs();
    for &name in names {
        if loads_by_name(name) {
            continue;
        }
        if !dirs.iter().any(|d| open_global(&d.join(name))) {
            bail!(
                "{name} was not found on the loader's path nor in {}; set INGOT_CUDA_LIB_DIR to the directory that holds the CUDA 13 libraries",
                dirs.iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    Ok(())
}
