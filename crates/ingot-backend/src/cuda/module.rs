//! The CUDA C kernels: embedded sources compiled by NVRTC for the device's architecture at
//! start, with the cubins cached on disk by source hash and architecture.

use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{sys as nvrtc_sys, Ptx};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

const COMMON: &str = include_str!("kernels/common.cuh");

/// Each program compiles on its own thread; `common.cuh` is prepended to each.
pub const PROGRAMS: [(&str, &str); 8] = [
    ("elementwise", include_str!("kernels/elementwise.cu")),
    ("attention", include_str!("kernels/attention.cu")),
    ("sampling", include_str!("kernels/sampling.cu")),
    ("gemv", include_str!("kernels/gemv.cu")),
    ("tma_product", include_str!("kernels/tma_product.cu")),
    ("moe", include_str!("kernels/moe.cu")),
    ("quant", include_str!("kernels/quant.cu")),
    ("all_reduce", include_str!("kernels/all_reduce.cu")),
];

/// The program that defines kernel `name` (an index into [`PROGRAMS`]), from the name's
/// prefix, so a lookup never asks a module for a kernel it lacks.
fn program_of(name: &str) -> usize {
    if name.starts_with("split_kv_") || name.starts_with("prefill_attention_") {
        1
    } else if name.starts_with("argmax_") || name.starts_with("sample_") {
        2
    } else if name.starts_with("gemv_") {
        3
    } else if name.starts_with("tma_product") {
        4
    } else if name.starts_with("moe_") {
        5
    } else if name.starts_with("quant_") {
        6
    } else if name.starts_with("all_reduce_") {
        7
    } else {
        0
    }
}

/// FNV-1a: a hash that stays the same across Rust releases, for cache file names.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for &b in *part {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        h = (h ^ 0xff).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| anyhow!("nvrtcVersion: {e:?}"))?;
    Ok((major, minor))
}

/// `INGOT_PTXAS_VERBOSE=1` prints each kernel's registers, shared memory and spills when
/// it is compiled (for kernel work; the cache is keyed by the options, so it recompiles).
fn verbose() -> bool {
    std::env::var_os("INGOT_PTXAS_VERBOSE").is_some()
}

fn options(arch: &str) -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--extra-device-vectorization".into(),
    ];
    opts.extend(
        super::KERNEL_DEFINITIONS
            .iter()
            .map(|(name, value)| format!("--define-macro={name}={value}")),
    );
    if verbose() {
        opts.push("--ptxas-options=-v".into());
    }
    opts
}

/// The compiler's messages for `prog`.
///
/// # Safety
/// `prog` must be a live NVRTC program.
unsafe fn program_log(prog: nvrtc_sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    nvrtc_sys::nvrtcGetProgramLogSize(prog, &mut size);
    let mut log = vec![0u8; size.max(1)];
    nvrtc_sys::nvrtcGetProgramLog(prog, log.as_mut_ptr().cast());
    CStr::from_bytes_until_nul(&log)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Compiles one program to a cubin for `arch` (e.g. `sm_90`).
pub fn compile(name: &str, source: &str, arch: &str) -> Result<Vec<u8>> {
    let src = CString::new(format!("{COMMON}\n{source}"))?;
    let cname = CString::new(format!("{name}.cu"))?;
    let opts: Vec<CString> = options(arch)
        .into_iter()
        .map(CString::new)
        .collect::<Result<_, _>>()?;
    let opt_ptrs: Vec<*const std::ffi::c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog = std::ptr::null_mut();
    // SAFETY: the strings outlive the program, which is destroyed before returning.
    unsafe {
        nvrtc_sys::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            cname.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
        .result()
        .map_err(|e| anyhow!("nvrtcCreateProgram: {e:?}"))?;
        let compiled =
            nvrtc_sys::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr());
        let result = if compiled.result().is_err() {
            let log = program_log(prog);
            Err(anyhow!(
                "NVRTC could not compile {name}.cu for {arch}:\n{log}"
            ))
        } else {
            if verbose() {
                eprintln!("{name}.cu for {arch}:\n{}", program_log(prog));
            }
            let mut size = 0usize;
            nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
                .result()
                .map_err(|e| anyhow!("nvrtcGetCUBINSize: {e:?}"))?;
            let mut cubin = vec![0u8; size];
            nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast())
                .result()
                .map_err(|e| anyhow!("nvrtcGetCUBIN: {e:?}"))
                .map(|_| cubin)
        };
        nvrtc_sys::nvrtcDestroyProgram(&mut prog);
        result
    }
}

fn cache_dir() -> PathBuf {
    std::env::var_os("INGOT_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/ingot")))
        .unwrap_or_else(|| std::env::temp_dir().join("ingot"))
        .join("kernels")
}

/// A program's cubin from the disk cache, or compiled and stored there.
fn cubin(name: &str, source: &str, arch: &str) -> Result<Vec<u8>> {
    let (major, minor) = nvrtc_version()?;
    let version = format!("{major}.{minor}");
    let opts = options(arch).join(" ");
    let key = fnv1a(&[
        COMMON.as_bytes(),
        source.as_bytes(),
        opts.as_bytes(),
        version.as_bytes(),
    ]);
    let path = cache_dir().join(format!("{name}-{key:016x}-{arch}.cubin"));
    if let Ok(bytes) = std::fs::read(&path) {
        return Ok(bytes);
    }
    let start = std::time::Instant::now();
    let bytes = compile(name, source, arch)?;
    tracing::info!(
        "compiled {name}.cu for {arch} with NVRTC {version} in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    // A cache that cannot be written only costs the next start a compile.
    let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
    if std::fs::create_dir_all(cache_dir()).is_ok() && std::fs::write(&tmp, &bytes).is_ok() {
        let _ = std::fs::rename(&tmp, &path);
    }
    Ok(bytes)
}

/// The kernels of every program, loaded on one context; functions are looked up by name
/// on first use.
pub struct Kernels {
    modules: Vec<Arc<CudaModule>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>, arch: &str) -> Result<Kernels> {
        let cubins: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
            let handles: Vec<_> = PROGRAMS
                .iter()
                .map(|&(name, src)| s.spawn(move || cubin(name, src, arch)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| bail!("NVRTC panicked")))
                .collect()
        });
        let mut modules = vec![];
        for ((name, _), bin) in PROGRAMS.iter().zip(cubins) {
            let module = ctx
                .load_module(Ptx::from_binary(bin?))
                .with_context(|| format!("loading the {name} kernels"))?;
            modules.push(module);
        }
        Ok(Kernels {
            modules,
            functions: Mutex::new(HashMap::new()),
        })
    }

    /// The kernel `name`; a missing name is a programming error.
    pub fn get(&self, name: &str) -> CudaFunction {
        let mut functions = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = functions.get(name) {
            return f.clone();
        }
        let f = self.modules[program_of(name)]
            .load_function(name)
            .unwrap_or_else(|e| panic!("no CUDA kernel named {name}: {e}"));
        functions.insert(name.to_string(), f.clone());
        f
    }
}

#[cfg(test)]
mod tests {
    use super::PROGRAMS;

    /// Kernels are launched to start before the previous kernel has finished
    /// (programmatic dependent launch): one that touched memory before
    /// `await_previous_kernel()` could read stale inputs or overwrite ones still being read,
    /// and only sometimes. So each kernel's body opens with the wait, except two that issue
    /// their first weight loads before it (no kernel writes weights) and then wait before
    /// they read the input or write: `tma_product` (its producer lane's first copies; the
    /// producer and the consumer warps each wait) and `quant_gemv_q8` (one wait).
    #[test]
    fn every_kernel_first_waits_for_the_previous_one() {
        const WAIT: &str = "await_previous_kernel();";
        // Kernels whose weight loads go out before the wait, and the waits each holds.
        const EARLY_WEIGHT_LOADS: [(&str, usize); 2] = [("tma_product", 2), ("quant_gemv_q8", 1)];
        let mut kernels = 0;
        for (name, source) in PROGRAMS {
            for (i, _) in source.match_indices("extern \"C\" __global__") {
                let signature = source[i..].lines().next().unwrap_or_default();
                let open = source[i..].find('{').expect("a kernel body");
                let early = EARLY_WEIGHT_LOADS
                    .iter()
                    .find(|(kernel, _)| source[i..][..open].contains(&format!("{kernel}_##")));
                if let Some((kernel, waits)) = early {
                    let start = source
                        .find(&format!("__device__ void {kernel}("))
                        .expect("the kernel's device function");
                    let end = start + source[start..].find("\n}\n").expect("its end");
                    assert_eq!(
                        source[start..end].matches(WAIT).count(),
                        *waits,
                        "{kernel} must hold {waits} wait(s)"
                    );
                    continue;
                }
                let body = &source[i..][open + 1..];
                let first: String = body
                    .chars()
                    .filter(|c| !c.is_whitespace() && *c != '\\')
                    .take(WAIT.len())
                    .collect();
                assert_eq!(
                    first, WAIT,
                    "{name}.cu: the kernel at `{signature}` does not open with `{WAIT}`"
                );
                kernels += 1;
            }
        }
        assert!(kernels >= 20, "found only {kernels} kernels");
    }
}
