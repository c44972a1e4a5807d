//! Matrix products through cuBLASLt: `out = x · wᵀ (+ bias)` with row-major `x` `[m, k]`,
//! `w` `[n, k]` and `out` rows `ld` apart, f32 accumulation. In cuBLAS's column-major
//! terms that is `outᵀ (n × m) = wᵀᵀ · xᵀ`: A = w transposed, B = x. Descriptors and the
//! algorithm are chosen once per shape and kept. For skinny products (decode steps) the
//! heuristic's first choice is often not the fastest, so the first eager call of such a
//! shape times the heuristic's candidates on the real operands and keeps the fastest.
//! A product may also add into `out` (`beta = 1`): the residual connection in the GEMM's
//! epilogue instead of a kernel of its own.

use crate::DType;
use anyhow::{anyhow, Result};
use cudarc::cublaslt::result;
use cudarc::cublaslt::sys::{
    self, cublasComputeType_t, cublasLtEpilogue_t, cublasLtMatmulAlgo_t,
    cublasLtMatmulDescAttributes_t as Desc, cublasLtMatmulPreferenceAttributes_t as Pref,
    cudaDataType_t,
};
use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;

pub fn cuda_type(dtype: DType) -> cudaDataType_t {
    match dtype {
        DType::F32 => cudaDataType_t::CUDA_R_32F,
        DType::F16 => cudaDataType_t::CUDA_R_16F,
        DType::BF16 => cudaDataType_t::CUDA_R_16BF,
        other => panic!("no cuBLASLt type for {other}"),
    }
}

/// Everything that selects a plan.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Shape {
    pub x: DType,
    pub w: DType,
    pub out: DType,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub ld: usize,
    pub bias: bool,
    /// `out += x · wᵀ` instead of `out = x · wᵀ`.
    pub accumulate: bool,
    /// Largest power of two (≤ 256) dividing every pointer, which limits the algorithms.
    pub align: usize,
}

/// Products of up to this many rows are timed over the heuristic's candidates; larger
/// ones (prefill, any chunk size) keep its first choice, which suits them and costs no
/// timing per new size.
const TUNE_MAX_ROWS: usize = 128;
/// Candidates asked of the heuristic for a tuned shape.
const TUNE_CANDIDATES: usize = 8;

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    algo: cublasLtMatmulAlgo_t,
    /// The heuristic's candidates in its order, until they have been timed.
    untimed: Vec<cublasLtMatmulAlgo_t>,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created for this plan and is destroyed once.
        unsafe {
            let _ = result::destroy_matrix_layout(self.a);
            let _ = result::destroy_matrix_layout(self.b);
            let _ = result::destroy_matrix_layout(self.c);
            let _ = result::destroy_matmul_desc(self.desc);
        }
    }
}

pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    workspace: u64,
    workspace_bytes: usize,
    plans: HashMap<Shape, Option<Plan>>,
}

// SAFETY: the handle and plans are used by one thread at a time (the backend holds the
// Gemm behind a mutex).
unsafe impl Send for Gemm {}

fn err(what: &str) -> impl Fn(result::CublasError) -> anyhow::Error + '_ {
    move |e| anyhow!("cuBLASLt {what}: {e:?}")
}

unsafe fn set_desc<T>(desc: sys::cublasLtMatmulDesc_t, attr: Desc, v: &T) -> Result<()> {
    result::set_matmul_desc_attribute(desc, attr, (v as *const T).cast(), size_of::<T>())
        .map_err(err("matmul descriptor"))
}

impl Gemm {
    /// `workspace` is a device allocation of `workspace_bytes` that outlives the Gemm.
    pub fn new(workspace: u64, workspace_bytes: usize) -> Result<Gemm> {
        Ok(Gemm {
            handle: result::create_handle().map_err(err("handle"))?,
            workspace,
            workspace_bytes,
            plans: HashMap::new(),
        })
    }

    /// A plan for `shape`, or `None` when cuBLASLt has no algorithm for it (a bias
    /// epilogue on some types); the caller then adds the bias itself.
    fn plan(&mut self, s: Shape) -> Result<Option<&mut Plan>> {
        if !self.plans.contains_key(&s) {
            let plan = self.make_plan(s)?;
            self.plans.insert(s, plan);
        }
        Ok(self.plans.get_mut(&s).and_then(Option::as_mut))
    }

    fn make_plan(&self, s: Shape) -> Result<Option<Plan>> {
        // SAFETY: descriptors are created, configured and owned by the returned plan.
        unsafe {
            let compute = cublasComputeType_t::CUBLAS_COMPUTE_32F;
            let desc = result::create_matmul_desc(compute, cudaDataType_t::CUDA_R_32F)
                .map_err(err("matmul descriptor"))?;
            let mut plan = Plan {
                desc,
                a: result::create_matrix_layout(cuda_type(s.w), s.k as u64, s.n as u64, s.k as i64)
                    .map_err(err("layout"))?,
                b: result::create_matrix_layout(cuda_type(s.x), s.k as u64, s.m as u64, s.k as i64)
                    .map_err(err("layout"))?,
                c: result::create_matrix_layout(
                    cuda_type(s.out),
                    s.n as u64,
                    s.m as u64,
                    s.ld as i64,
                )
                .map_err(err("layout"))?,
                algo: std::mem::zeroed(),
                untimed: vec![],
            };
            set_desc(desc, Desc::CUBLASLT_MATMUL_DESC_TRANSA, &1i32)?;
            set_desc(desc, Desc::CUBLASLT_MATMUL_DESC_TRANSB, &0i32)?;
            if s.bias {
                set_desc(
                    desc,
                    Desc::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    &cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
                )?;
                set_desc(
                    desc,
                    Desc::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                    &cudaDataType_t::CUDA_R_32F,
                )?;
            }
            let pref = result::create_matmul_pref().map_err(err("preference"))?;
            // The workspace size is a uint64_t attribute, the alignments uint32_t ones.
            let workspace = self.workspace_bytes as u64;
            let found = result::set_matmul_pref_attribute(
                pref,
                Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace as *const u64).cast(),
                size_of::<u64>(),
            )
            .map_err(err("preference"))
            .and_then(|_| {
                let align = s.align as u32;
                for attr in [
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                ] {
                    result::set_matmul_pref_attribute(
                        pref,
                        attr,
                        (&align as *const u32).cast(),
                        size_of::<u32>(),
                    )
                    .map_err(err("preference"))?;
                }
                Ok(())
            })
            .map(|_| {
                let wanted = if s.m <= TUNE_MAX_ROWS {
                    TUNE_CANDIDATES
                } else {
                    1
                };
                let mut found: Vec<sys::cublasLtMatmulHeuristicResult_t> =
                    vec![std::mem::zeroed(); wanted];
                let mut count = 0;
                let status = sys::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    desc,
                    plan.a,
                    plan.b,
                    plan.c,
                    plan.c,
                    pref,
                    wanted as i32,
                    found.as_mut_ptr(),
                    &mut count,
                );
                found.truncate(count.max(0) as usize);
                found.retain(|h| h.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS);
                (status, found)
            });
            let _ = result::destroy_matmul_pref(pref);
            let (status, found) = found?;
            match found.first() {
                Some(best) if status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS => {
                    plan.algo = best.algo;
                    if found.len() > 1 {
                        plan.untimed = found.iter().map(|h| h.algo).collect();
                    }
                    Ok(Some(plan))
                }
                _ if s.bias => Ok(None),
                _ => Err(anyhow!("cuBLASLt has no algorithm for {s:?}: {status:?}")),
            }
        }
    }

    /// Times each untimed candidate of `plan` on these operands (a few runs each, between
    /// two events) and keeps the fastest. Skipped while the stream is being captured into a
    /// graph, where nothing may wait for the device; a later eager call does it. A product
    /// that adds into its output is timed on a scratch copy of the output's shape, as each
    /// run would add to the real one.
    ///
    /// # Safety
    /// As for [`Gemm::matmul`].
    unsafe fn tune(plan: &mut Plan, ops: &Operands, s: Shape) -> Result<()> {
        use cudarc::driver::result::stream as cu_stream;
        use cudarc::driver::result::{free_sync, malloc_sync, memset_d8_sync};
        use cudarc::driver::sys::{CUstream, CUstreamCaptureStatus};
        if plan.untimed.is_empty() {
            return Ok(());
        }
        if cu_stream::is_capturing(ops.stream as CUstream)?
            != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
        {
            return Ok(());
        }
        if !s.accumulate {
            return Self::time_candidates(plan, ops);
        }
        let bytes = s.out.bytes_for((s.m - 1) * s.ld + s.n);
        let scratch = malloc_sync(bytes)?;
        memset_d8_sync(scratch, 0, bytes)?;
        let timed = Self::time_candidates(
            plan,
            &Operands {
                out: scratch,
                ..*ops
            },
        );
        free_sync(scratch)?;
        timed
    }

    /// [`Gemm::tune`]'s timing: each of `plan`'s untimed candidates on `ops`, the fastest kept.
    ///
    /// # Safety
    /// As for [`Gemm::matmul`].
    unsafe fn time_candidates(plan: &mut Plan, ops: &Operands) -> Result<()> {
        use cudarc::driver::result::event;
        use cudarc::driver::sys::{CUevent_flags, CUstream};
        let cu = ops.stream as CUstream;
        let start = event::create(CUevent_flags::CU_EVENT_DEFAULT)?;
        let end = event::create(CUevent_flags::CU_EVENT_DEFAULT)?;
        let mut best = (f32::INFINITY, plan.algo);
        for algo in &plan.untimed {
            let run = || ops.launch(plan, algo);
            // A candidate that fails to launch is passed over.
            if run().is_err() || run().is_err() {
                continue;
            }
            event::record(start, cu)?;
            let ok = (0..5).all(|_| run().is_ok());
            event::record(end, cu)?;
            event::synchronize(end)?;
            let ms = event::elapsed(start, end)?;
            if ok && ms < best.0 {
                best = (ms, *algo);
            }
        }
        let _ = event::destroy(start);
        let _ = event::destroy(end);
        plan.algo = best.1;
        plan.untimed.clear();
        Ok(())
    }

    /// Enqueues the product on `stream`. Returns `false` when the bias was not applied
    /// (no epilogue for this shape), so the caller adds it.
    ///
    /// # Safety
    /// The pointers must address device buffers large enough for `shape`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul(
        &mut self,
        shape: Shape,
        x: u64,
        w: u64,
        bias: Option<u64>,
        out: u64,
        stream: sys::cudaStream_t,
    ) -> Result<bool> {
        let ops = Operands {
            handle: self.handle,
            x,
            w,
            out,
            accumulate: shape.accumulate,
            workspace: self.workspace,
            workspace_bytes: self.workspace_bytes,
            stream,
        };
        let plan = match self.plan(shape)? {
            Some(p) => p,
            None => {
                let plain = Shape {
                    bias: false,
                    ..shape
                };
                return self.matmul(plain, x, w, None, out, stream).map(|_| false);
            }
        };
        if let Some(b) = bias {
            set_desc(plan.desc, Desc::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &b)?;
        }
        Self::tune(plan, &ops, shape)?;
        ops.launch(plan, &plan.algo).map_err(err("matmul"))?;
        Ok(true)
    }
}

/// One product's operands, workspace and stream: what a launch of any algorithm needs.
#[derive(Clone, Copy)]
struct Operands {
    handle: sys::cublasLtHandle_t,
    x: u64,
    w: u64,
    out: u64,
    accumulate: bool,
    workspace: u64,
    workspace_bytes: usize,
    stream: sys::cudaStream_t,
}

impl Operands {
    /// Enqueues `out = x · wᵀ` with `plan`'s descriptors and `algo`.
    ///
    /// # Safety
    /// As for [`Gemm::matmul`].
    unsafe fn launch(
        &self,
        plan: &Plan,
        algo: &cublasLtMatmulAlgo_t,
    ) -> Result<(), result::CublasError> {
        let (alpha, beta) = (1f32, if self.accumulate { 1f32 } else { 0f32 });
        result::matmul(
            self.handle,
            plan.desc,
            (&alpha as *const f32).cast(),
            (&beta as *const f32).cast(),
            self.w as *const c_void,
            plan.a,
            self.x as *const c_void,
            plan.b,
            self.out as *const c_void,
            plan.c,
            self.out as *mut c_void,
            plan.c,
            algo,
            self.workspace as *mut c_void,
            self.workspace_bytes,
            self.stream,
        )
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: the handle was created in `new` and is destroyed once.
        unsafe {
            let _ = result::destroy_handle(self.handle);
        }
    }
}
