//! The CUDA backend: device buffers, CUDA C kernels compiled by NVRTC at start, GEMMs
//! through cuBLASLt, all enqueued on one stream. The CUDA libraries are opened at run
//! time (cudarc's dynamic loading), so this compiles and links without a CUDA toolkit.
//!
//! Activations run in the model's dtype (bf16, f16, or f32 for exact comparisons) with f32
//! accumulation everywhere; matrices are kept in the activation dtype, or as GGUF Q8_0,
//! Q4_0, Q4_1, Q4_K and Q6_K blocks with f16 activations (`quant.rs`; Q5_K is dequantized at
//! load); the KV cache may be f32, f16 or bf16.

mod gemm;
mod library;
mod module;
mod nccl;
mod peer_all_reduce;
mod pinned;
mod tma_product;

pub use library::search_dirs;
pub use module::{compile, PROGRAMS};
pub(crate) use pinned::PinnedWords;

use crate::{
    rms_norm_moe_then_add, rms_norm_qkv_then_rope_kv_write, rms_norm_then_matmul,
    AttentionMetadata, Backend, CacheLayout, DType, HostBuffer, MatmulOut, MemoryInfo, MlpScratch,
    MoeLayer, MoeScratch, MoeShape, QkvLayout, RopeKvWrite,
};
use anyhow::{bail, ensure, Context, Result};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Splits of a token's context in split-KV attention: enough blocks to fill the GPU at
/// batch 1, few enough partial results to merge cheaply.
const NUM_SPLITS: usize = 16;
const _: () = assert!(
    NUM_SPLITS <= 32,
    "split_kv_reduce weighs one split per lane"
);
/// Fewest tokens one split takes, so short contexts are not cut into slivers and a block
/// runs long enough over its keys to hide their loading. Same-machine A/B runs at
/// Llama-3.1-8B shapes (contexts of 1,024 to 1,152 tokens), decode tok/s at batch 1, 16
/// and 64: 64 gave 161.9, 1,988 and 5,159 against 128's 161.2, 2,034 and 5,543 (256:
/// 157.0, 1,994, 5,735); later, with the tensor-core kernel, 96 gave 178.0, 2,204 and
/// 6,084 against 128's 176.2, 2,176 and 6,114 (112: 176.8, 2,192, 6,092), plausibly as its 12
/// splits a context there fill the SMs' block slots at batch 16, where 9 left a quarter empty.
const MIN_SPLIT: i32 = 96;
/// Query heads one split-KV block serves: in the CUDA-core kernel, and in the tensor-core
/// kernel (the n8 of its products).
const HEADS_PER_BLOCK: usize = 16;
const HEADS_PER_MMA_BLOCK: usize = 8;
/// Head sizes the attention kernels are instantiated for.
const HEAD_DIMS: [usize; 3] = [32, 64, 128];
/// Most rows a matmul runs through the GEMV kernels instead of cuBLASLt.
const GEMV_MAX_ROWS: usize = 4;
/// Values of a row each thread of `silu_mul_normed` computes.
const SILU_VALUES: usize = 8;
/// The constants above that kernels are written against, given to NVRTC as definitions, so
/// that the grids the host computes and the kernels' indexing come from one value.
const KERNEL_DEFINITIONS: [(&str, usize); 37] = [
    ("GMAX", HEADS_PER_BLOCK),
    ("MMA_HEADS", HEADS_PER_MMA_BLOCK),
    ("SILU_VALUES", SILU_VALUES),
    ("TMA_BN", tma_product::BN),
    ("TMA_BK", tma_product::BK),
    ("TMA_STAGES", tma_product::STAGES),
    ("TMA_WARPS", tma_product::WARPS),
    ("TMA_KW", tma_product::K_WARPS),
    ("TMA_ROWS", tma_product::BOX_ROWS),
    ("MOE_TILE", moe::TILE),
    ("MOE_WARPS", moe::WARPS),
    ("MOE_GATE_COLS", moe::GATE_COLS),
    ("MOE_DOWN_COLS", moe::DOWN_COLS),
    ("MOE_ROUTE_WARPS", moe::ROUTE_WARPS),
    ("MOE_MMA_BK", moe::MMA_BK),
    ("MOE_SMALL_BM", moe::SMALL.slots),
    ("MOE_SMALL_BN", moe::SMALL.rows),
    ("MOE_SMALL_WM", moe::SMALL.warps.0),
    ("MOE_SMALL_WN", moe::SMALL.warps.1),
    ("MOE_SMALL_STAGES", moe::SMALL.stages),
    ("MOE_LARGE_BM", moe::LARGE.slots),
    ("MOE_LARGE_BN", moe::LARGE.rows),
    ("MOE_LARGE_WM", moe::LARGE.warps.0),
    ("MOE_LARGE_WN", moe::LARGE.warps.1),
    ("MOE_LARGE_STAGES", moe::LARGE.stages),
    ("QUANT_ROWS", quant::GEMV_ROWS),
    ("QUANT_Q8_ROWS", quant::GEMV_Q8_ROWS),
    ("QUANT_FP8_ROWS", quant::GEMV_FP8_ROWS),
    ("QUANT_FP8_WARPS", quant::GEMV_FP8_WARPS),
    ("QMMA_ROWS", quant::MMA_ROWS),
    ("QMMA_WARPS", quant::MMA_WARPS),
    ("QMMA_CHUNK", quant::MMA_CHUNK),
    ("QMMA_XS_ROW", quant::MMA_XS_ROW),
    ("AR_MAX_RANKS", peer_all_reduce::MAX_RANKS),
    ("AR_MAX_BLOCKS", peer_all_reduce::MAX_BLOCKS),
    ("AR_THREADS", peer_all_reduce::THREADS),
    ("AR_VECTORS", peer_all_reduce::VECTORS),
];
/// Most rows `rope_kv_write` runs with a block per head; more take a block per row.
const DECODE_ROPE_ROWS: usize = 64;

/// Output columns one block of GEMV kernel family `kernel` computes for `m` rows (the
/// kernel's COLS; SILU_COLS_M1 for one row of `gemv_silu`).
fn gemv_columns(kernel: &str, m: usize) -> usize {
    match (kernel, m) {
        ("gemv_silu", 1) => 8,
        (_, 1) => 2,
        _ => 4,
    }
}
/// cuBLASLt's workspace (what it recommends for Hopper).
const GEMM_WORKSPACE: usize = 32 << 20;

/// Loads the CUDA libraries and NVRTC, for a compile check without a GPU.
pub fn load_nvrtc() -> Result<()> {
    library::load(&library::NVRTC)
}

/// Whether a CUDA device can be used here: the driver loads and reports a GPU.
pub fn device_count() -> usize {
    if !library::driver_present() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// A device allocation and what it holds.
pub struct CudaBuffer {
    slice: CudaSlice<u8>,
    ptr: u64,
    dtype: DType,
    numel: usize,
}

impl CudaBuffer {
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Address of element `i`.
    fn at(&self, i: usize) -> u64 {
        self.ptr + self.dtype.bytes_for(i) as u64
    }
}

/// Device events around each op while profiling, resolved at the next synchronize.
#[derive(Default)]
struct Profiler {
    pending: Vec<(String, CudaEvent, CudaEvent)>,
    totals: HashMap<String, (u64, f64)>,
    /// Per step size (rows) of a mixture of experts' layers: the layers run, the experts
    /// they touched in all, and the experts a layer has (the expert bytes a step reads).
    experts_touched: std::collections::BTreeMap<usize, (u64, u64, usize)>,
}

/// A captured step, replayed on the backend's stream.
struct Graph(CudaGraph);

// SAFETY: a graph is launched only on the backend's stream, under the backend's mutex.
unsafe impl Send for Graph {}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: module::Kernels,
    gemm: Mutex<gemm::Gemm>,
    _gemm_workspace: CudaSlice<u8>,
    /// Products of a few rows past the GEMV's run through `tma_product` (sm_90 and later).
    tma_products: bool,
    /// The first error an enqueued op raised, reported by the next `synchronize`.
    error: Mutex<Option<anyhow::Error>>,
    graphs: Mutex<HashMap<u64, Graph>>,
    profiler: Mutex<Option<Profiler>>,
    name: String,
    sm_count: u32,
    /// Kernels are launched with programmatic stream serialization (sm_90 and later, unless
    /// `INGOT_CUDA_PDL=0`).
    dependent_launch: bool,
    /// f16 scratch that products of many rows dequantize a GGUF-block matrix into
    /// (`quant.rs`), as large as the largest such matrix allocated.
    dequantized: Mutex<Option<CudaBuffer>>,
}

/// Suffix of kernels instantiated per element type.
fn suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        other => panic!("no CUDA kernels for {other} buffers"),
    }
}

/// Whether `x` and `w` are 16-bit operands of one type at 16-byte aligned addresses, as the
/// GEMV's and `tma_product`'s 16-byte loads and copies need.
fn streams_16bit(x: &CudaBuffer, w: &CudaBuffer) -> bool {
    matches!(x.dtype, DType::F16 | DType::BF16)
        && x.dtype == w.dtype
        && [x.ptr, w.ptr].iter().all(|p| p % 16 == 0)
}

/// Threads for a row-wise kernel over rows of `dim`: a warp multiple, at most 1024.
fn row_threads(dim: usize) -> u32 {
    (dim.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// Launches kernel `$name` with the given grid, block size and arguments (locals whose
/// addresses cudarc passes to the driver).
macro_rules! launch {
    ($be:expr, $name:expr, $grid:expr, $block:expr; $($arg:ident),* $(,)?) => {{
        let name: String = $name;
        launch!($be, name.clone(), label = name, $grid, $block; $($arg),*)
    }};
    ($be:expr, $name:expr, label = $label:expr, $grid:expr, $block:expr; $($arg:ident),* $(,)?) => {{
        launch!($be, $name, label = $label, shared = 0, $grid, $block; $($arg),*)
    }};
    ($be:expr, $name:expr, label = $label:expr, shared = $shared:expr, $grid:expr, $block:expr; $($arg:ident),* $(,)?) => {{
        let name: String = $name;
        let label: String = $label;
        let f = $be.kernels.get(&name);
        let mut params = [$( &$arg as *const _ as *mut std::ffi::c_void ),*];
        $be.timed(&label, || {
            // SAFETY: the argument list matches the kernel's signature, and every pointer
            // addresses a live buffer large enough for the shapes passed beside it.
            unsafe { $be.launch_kernel(&f, $grid, $block, $shared, &mut params) }
                .with_context(|| format!("launching {name}"))
        });
    }};
}

// After `launch!`, which they use.
mod moe;
mod quant;

impl CudaBackend {
    /// Opens GPU `ordinal`: loads the libraries, compiles (or reads the cached) kernels
    /// for its architecture and sets up cuBLASLt.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        ensure!(
            library::driver_present(),
            "no NVIDIA driver: libcuda.so could not be loaded"
        );
        library::load(&library::NVRTC)?;
        library::load(&library::CUBLAS)?;
        let count = device_count();
        ensure!(
            ordinal < count,
            "cuda:{ordinal} does not exist ({count} CUDA devices found)"
        );
        let ctx = CudaContext::new(ordinal).context("creating the CUDA context")?;
        // One stream orders everything; cudarc's per-buffer events would only add work.
        // SAFETY: no buffer is shared between streams.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability()?;
        if major < 8 {
            bail!("the CUDA backend needs compute capability 8.0 or later (bf16 instructions); this GPU has {major}.{minor}");
        }
        let arch = format!("sm_{major}{minor}");
        let stream = ctx.new_stream()?;
        let kernels = module::Kernels::load(&ctx, &arch)?;
        let workspace = stream.alloc_zeros::<u8>(GEMM_WORKSPACE)?;
        let ws_ptr = workspace.device_ptr(&stream).0;
        let gemm = gemm::Gemm::new(ws_ptr, GEMM_WORKSPACE)?;
        let sm_count = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as u32;
        let name = format!("cuda:{ordinal} ({}, {arch})", ctx.name()?);
        let dependent_launch =
            major >= 9 && std::env::var("INGOT_CUDA_PDL").map_or(true, |v| v != "0");
        tracing::info!(
            "{name}: programmatic dependent launch {}",
            if dependent_launch { "on" } else { "off" }
        );
        Ok(CudaBackend {
            ctx,
            stream,
            kernels,
            gemm: Mutex::new(gemm),
            _gemm_workspace: workspace,
            tma_products: major >= 9,
            error: Mutex::new(None),
            graphs: Mutex::new(HashMap::new()),
            profiler: Mutex::new(None),
            name,
            sm_count,
            dependent_launch,
            dequantized: Mutex::new(None),
        })
    }

    /// The first `n` elements of `src`, read as `T`, once the work before them has run.
    fn read<T: bytemuck::Pod>(&self, src: &CudaBuffer, n: usize) -> Result<Vec<T>> {
        let mut host = vec![T::zeroed(); n];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut host);
        if !bytes.is_empty() {
            self.stream
                .memcpy_dtoh(&src.slice.slice(..bytes.len()), bytes)?;
        }
        self.synchronize()?;
        Ok(host)
    }

    /// Runs `enqueue` (one op), between two timing events while profiling.
    fn timed(&self, op: &str, enqueue: impl FnOnce() -> Result<()>) {
        let mut profiler = self.profiler.lock().unwrap_or_else(|p| p.into_inner());
        let Some(p) = profiler.as_mut() else {
            drop(profiler);
            return self.record(enqueue());
        };
        let event = || -> Result<CudaEvent> {
            let e = self.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            e.record(&self.stream)?;
            Ok(e)
        };
        let r = event().and_then(|start| {
            enqueue()?;
            p.pending.push((op.to_string(), start, event()?));
            Ok(())
        });
        drop(profiler);
        self.record(r);
    }

    fn record(&self, r: Result<()>) {
        if let Err(e) = r {
            let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                *slot = Some(e);
            }
        }
    }

    /// Enqueues kernel `f`. Where programmatic dependent launch is on, the kernel may start
    /// while the one before it finishes; every kernel waits in `await_previous_kernel`
    /// before it touches memory another kernel uses.
    ///
    /// # Safety
    /// `params` addresses values that match the kernel's parameters, and the buffers they
    /// point at are live and large enough for the shapes among them.
    unsafe fn launch_kernel(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        use cudarc::driver::sys;
        // CUDA refuses empty grids; a kernel over no rows (a step of prompt chunks that
        // ends no prompt has no logits rows) has nothing to do.
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        if shared > 0 {
            sys::cuFuncSetAttribute(
                f.cu_function(),
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared as i32,
            )
            .result()?;
        }
        let mut overlap: sys::CUlaunchAttribute = std::mem::zeroed();
        overlap.id =
            sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        overlap.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared,
            hStream: self.stream.cu_stream(),
            attrs: &mut overlap,
            numAttrs: u32::from(self.dependent_launch),
        };
        sys::cuLaunchKernelEx(
            &config,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()?;
        Ok(())
    }

    /// Blocks for a grid-stride loop over `n` elements.
    fn grid_for(&self, n: usize) -> u32 {
        (n.div_ceil(256) as u32).clamp(1, self.sm_count * 8)
    }

    /// Split-KV attention over rows `[offset, offset + rows)` of the step.
    #[allow(clippy::too_many_arguments)]
    fn split_kv(
        &self,
        qkv: &CudaBuffer,
        layout: QkvLayout,
        offset: usize,
        rows: usize,
        meta: &AttentionMetadata<'_, Self>,
        cache: CacheLayout,
        k_cache: &CudaBuffer,
        v_cache: &CudaBuffer,
        scale: f32,
        workspace: &mut CudaBuffer,
        out: &mut CudaBuffer,
    ) {
        let (t, c) = (suffix(qkv.dtype), suffix(k_cache.dtype));
        let d = layout.head_dim;
        let group = layout.num_heads / layout.num_kv_heads;
        let tensor_cores = k_cache.dtype != DType::F32;
        let heads = if tensor_cores {
            HEADS_PER_MMA_BLOCK
        } else {
            HEADS_PER_BLOCK
        };
        let heads_x = (layout.num_kv_heads * group.div_ceil(heads)) as u32;
        let (qkv_p, qsl, sl, bt) = (
            qkv.ptr,
            meta.query_start_loc.ptr,
            meta.seq_lens.ptr,
            meta.block_tables.ptr,
        );
        let (mb, ns, off) = (
            meta.max_blocks_per_seq as i32,
            meta.num_seqs as i32,
            offset as i32,
        );
        let (kc, vc, bs) = (k_cache.ptr, v_cache.ptr, cache.block_size as i32);
        let (nh, nkv, rl) = (
            layout.num_heads as i32,
            layout.num_kv_heads as i32,
            layout.row_len() as i32,
        );
        let (splits, min_part) = (NUM_SPLITS as i32, MIN_SPLIT);
        // Workspace: partial outputs, then (max, sum) pairs, for `rows` rows.
        let partials = rows * layout.num_heads * NUM_SPLITS;
        let ws_o = workspace.ptr;
        let ws_ml = workspace.at(partials * d);
        let grid = (heads_x, rows as u32, NUM_SPLITS as u32);
        if !tensor_cores {
            launch!(self, format!("split_kv_attention_{t}_{c}_d{d}"), grid, 128;
                qkv_p, qsl, sl, bt, mb, ns, off, kc, vc, bs, nh, nkv, rl, scale, splits,
                min_part, ws_o, ws_ml);
        } else {
            launch!(self, format!("split_kv_mma_{t}_{c}_d{d}"), grid, 32;
                qkv_p, qsl, sl, bt, mb, ns, off, kc, vc, bs, nh, nkv, rl, scale, splits,
                min_part, ws_o, ws_ml);
        }
        let (o, hd) = (out.ptr, d as i32);
        launch!(self, format!("split_kv_reduce_{t}"),
            (layout.num_heads as u32, rows as u32, 1), row_threads(d).min(128);
            qsl, sl, ns, off, nh, hd, splits, min_part, ws_o, ws_ml, o);
    }

    /// Whether a product of `m` rows runs through the GEMV kernels: a few rows of 16-bit
    /// activations, where they read the weights at full bandwidth and cuBLASLt's small-batch
    /// kernels fall short. Their f32 bias is added before the output is rounded.
    fn gemv_fits(
        &self,
        x: &CudaBuffer,
        w: &CudaBuffer,
        m: usize,
        k: usize,
        bias: Option<&CudaBuffer>,
    ) -> bool {
        m <= GEMV_MAX_ROWS
            && bias.is_none_or(|b| b.dtype == DType::F32)
            && k.is_multiple_of(8)
            && streams_16bit(x, w)
    }

    /// Whether a product of `m` rows past the GEMV's runs through `tma_product`: Hopper and
    /// later, 16-bit operands, an output in their dtype or f32, no bias, whole tiles and
    /// stages.
    #[allow(clippy::too_many_arguments)]
    fn tma_product_fits(
        &self,
        x: &CudaBuffer,
        w: &CudaBuffer,
        out: DType,
        m: usize,
        n: usize,
        k: usize,
        bias: Option<&CudaBuffer>,
    ) -> bool {
        self.tma_products
            && m <= tma_product::MAX_ROWS
            && bias.is_none()
            && (out == x.dtype || out == DType::F32)
            && n.is_multiple_of(tma_product::BN)
            && k.is_multiple_of(tma_product::BK)
            && streams_16bit(x, w)
    }

    /// `out (+)= x · wᵀ` through `tma_product`; with `silu` = Some(eps), `w` is a gated MLP's
    /// `n / 2` gate and `n / 2` up rows with its RMSNorm weights folded in, and `out` gets
    /// silu(gate) * up of x's normalized rows (`n / 2` columns).
    #[allow(clippy::too_many_arguments)]
    fn tma_product(
        &self,
        x: &CudaBuffer,
        w: &CudaBuffer,
        m: usize,
        n: usize,
        k: usize,
        out: MatmulOut<'_, Self>,
        accumulate: bool,
        silu: Option<f32>,
    ) {
        let (kernel, box_rows) = match silu {
            Some(_) => ("silu".to_string(), tma_product::BN / 2),
            None => (suffix(x.dtype).to_string(), tma_product::BN),
        };
        let maps = tma_product::tensor_map(w.ptr, w.dtype, n, k, box_rows).and_then(|wm| {
            Ok((
                wm,
                tma_product::tensor_map(x.ptr, x.dtype, m, k, tma_product::BOX_ROWS)?,
            ))
        });
        let (wmap, xmap) = match maps {
            Ok(maps) => maps,
            Err(e) => return self.record(Err(e.context("encoding tma_product's tensor maps"))),
        };
        let tiles = n / tma_product::BN;
        let (o, ldl, acc) = (
            out.buf.at(out.col_offset),
            out.row_stride as i64,
            i32::from(accumulate),
        );
        let (nn, kk, mm, eps) = (n as i32, k as i32, m as i32, silu.unwrap_or(0.0));
        launch!(self, format!("tma_product_{kernel}_{}", suffix(out.buf.dtype)),
            label = format!("tma_product_{kernel} m{m} n{n} k{k}"),
            shared = tma_product::SHARED_BYTES,
            (tiles.min(self.sm_count as usize) as u32, 1, 1), tma_product::THREADS;
            wmap, xmap, o, ldl, acc, nn, kk, mm, eps);
    }

    /// Launches GEMV kernel family `kernel` (`gemv`, `gemv_norm` with the norm's `eps`, or
    /// `gemv_silu`) for `m` rows, adding into `out` where `accumulate`.
    #[allow(clippy::too_many_arguments)]
    fn gemv(
        &self,
        kernel: &str,
        x: &CudaBuffer,
        w: &CudaBuffer,
        bias: Option<&CudaBuffer>,
        m: usize,
        n: usize,
        k: usize,
        out: MatmulOut<'_, Self>,
        accumulate: bool,
        eps: f32,
    ) {
        let o = out.buf.at(out.col_offset);
        let (xp, wp, nn, kk, ldl) = (x.ptr, w.ptr, n as i32, k as i32, out.row_stride as i64);
        let (bp, acc) = (bias.map_or(0, |b| b.ptr), i32::from(accumulate));
        launch!(self, format!("{kernel}_{}_{}_m{m}", suffix(x.dtype), suffix(out.buf.dtype)),
            label = format!("{kernel} m{m} n{n} k{k}"),
            (n.div_ceil(gemv_columns(kernel, m)) as u32, 1, 1), 256;
            xp, wp, bp, nn, kk, o, ldl, acc, eps);
    }

    /// `out = x · wᵀ (+ bias)`, or `out += x · wᵀ (+ bias)` where `accumulate`: through the
    /// GEMV kernels for a few rows, cuBLASLt otherwise.
    #[allow(clippy::too_many_arguments)]
    fn product(
        &self,
        x: &CudaBuffer,
        w: &CudaBuffer,
        bias: Option<&CudaBuffer>,
        m: usize,
        n: usize,
        k: usize,
        out: MatmulOut<'_, Self>,
        accumulate: bool,
    ) {
        assert_eq!(w.numel, n * k, "weight is not [{n}, {k}]");
        let MatmulOut {
            buf,
            row_stride: ld,
            col_offset,
        } = out;
        assert!(
            col_offset + n <= ld && (m == 0 || buf.numel >= (m - 1) * ld + col_offset + n),
            "matmul output too small"
        );
        if m == 0 {
            return;
        }
        if w.dtype.is_quantized() {
            let out = MatmulOut {
                buf,
                row_stride: ld,
                col_offset,
            };
            return self.quantized_product(x, w, bias, m, n, k, out, accumulate);
        }
        assert_eq!(x.dtype, w.dtype, "matmul operands must share a dtype");
        if self.gemv_fits(x, w, m, k, bias) {
            let out = MatmulOut {
                buf,
                row_stride: ld,
                col_offset,
            };
            return self.gemv("gemv", x, w, bias, m, n, k, out, accumulate, 0.0);
        }
        if self.tma_product_fits(x, w, buf.dtype, m, n, k, bias) {
            let out = MatmulOut {
                buf,
                row_stride: ld,
                col_offset,
            };
            return self.tma_product(x, w, m, n, k, out, accumulate, None);
        }
        let out_ptr = buf.at(col_offset);
        let align = [x.ptr, w.ptr, out_ptr, bias.map_or(256, |b| b.ptr)]
            .iter()
            .map(|p| 1usize << p.trailing_zeros().min(8))
            .min()
            .unwrap_or(1);
        let shape = gemm::Shape {
            x: x.dtype,
            w: w.dtype,
            out: buf.dtype,
            m,
            n,
            k,
            ld,
            bias: bias.is_some(),
            accumulate,
            align,
        };
        let stream = self.stream.cu_stream() as cudarc::cublaslt::sys::cudaStream_t;
        let mut applied = Ok(true);
        let op = format!(
            "matmul m{m} n{n} k{k}{}",
            if accumulate { " +=" } else { "" }
        );
        self.timed(&op, || {
            let mut gemm = self.gemm.lock().unwrap_or_else(|p| p.into_inner());
            // SAFETY: the shape was checked against the buffers above.
            let r =
                unsafe { gemm.matmul(shape, x.ptr, w.ptr, bias.map(|b| b.ptr), out_ptr, stream) };
            applied = r.as_ref().map(|&a| a).map_err(|e| anyhow::anyhow!("{e:#}"));
            r.map(|_| ())
        });
        if let (Ok(false), Some(b)) = (applied, bias) {
            self.bias_add(out_ptr, buf.dtype, b, m, n, ld);
        }
    }

    /// `out[i, j] += bias[j]` over columns `[0, n)` of `m` rows `ld` apart from `out`: the
    /// bias of a product that could not add it itself.
    fn bias_add(&self, out: u64, dtype: DType, bias: &CudaBuffer, m: usize, n: usize, ld: usize) {
        let (bp, nn, ldl) = (bias.ptr, n as i32, ld as i64);
        launch!(self, format!("bias_add_{}", suffix(dtype)), (m as u32, 1, 1), row_threads(n).min(256); out, bp, nn, ldl);
    }

    /// [`Backend::rope_kv_write`]; with `norm` = (x, dim, eps), the qkv rows are products of
    /// x's un-normalized rows whose RMSNorm weights are folded into the QKV matrix, and are
    /// first scaled by 1 / rms of x's rows; with `qk` = (query weights, key weights, eps), the
    /// heads then go through [`Backend::qk_norm`] (inside the kernel of decode batches).
    fn rope_kv_write_normed(
        &self,
        qkv: &mut CudaBuffer,
        rows: usize,
        rope: RopeKvWrite<'_, Self>,
        norm: Option<(&CudaBuffer, usize, f32)>,
        qk: Option<(&CudaBuffer, &CudaBuffer, f32)>,
    ) {
        let RopeKvWrite {
            layout,
            positions,
            cos_sin,
            rotary_dim,
            slot_mapping,
            cache,
            k_cache,
            v_cache,
        } = rope;
        assert!(
            k_cache.numel >= cache.num_blocks * cache.block_size * layout.kv_len(),
            "KV cache smaller than its layout"
        );
        let heads = layout.num_heads + layout.num_kv_heads;
        let (q, p, cs, nh, nkv, hd, rd) = (
            qkv.ptr,
            positions.ptr,
            cos_sin.ptr,
            layout.num_heads as i32,
            layout.num_kv_heads as i32,
            layout.head_dim as i32,
            rotary_dim as i32,
        );
        let (s, kc, vc) = (slot_mapping.ptr, k_cache.ptr, v_cache.ptr);
        let (nx, dim, eps) = norm.map_or((0, 0, 0.0), |(x, d, e)| {
            assert_eq!(x.dtype, qkv.dtype, "norm input and qkv dtypes");
            (x.ptr, d as i32, e)
        });
        let types = format!("{}_{}", suffix(qkv.dtype), suffix(k_cache.dtype));
        // Decode batches take a block per head (latency), prefill a block per row.
        if rows <= DECODE_ROPE_ROWS && layout.head_dim <= 1024 {
            let all_heads = heads + layout.num_kv_heads;
            let (qw, kw, qk_eps) = qk.map_or((0, 0, 0.0), |(qw, kw, e)| (qw.ptr, kw.ptr, e));
            launch!(self, format!("rope_kv_write_heads_{types}"),
                (rows as u32, all_heads as u32, 1), row_threads(layout.head_dim);
                q, p, cs, nh, nkv, hd, rd, s, kc, vc, nx, dim, eps, qw, kw, qk_eps);
        } else {
            assert!(
                norm.is_none() || qk.is_none(),
                "a folded norm and a q/k norm in one prefill launch"
            );
            if let Some((qw, kw, e)) = qk {
                self.qk_norm(qkv, layout, rows, qw, kw, e);
            }
            launch!(self, format!("rope_kv_write_{types}"),
                (rows as u32, 1, 1), row_threads(heads * rotary_dim / 2).min(256);
                q, p, cs, nh, nkv, hd, rd, s, kc, vc, nx, dim, eps);
        }
    }

    /// Workspace f32 elements one row of split-KV attention needs.
    fn workspace_per_row(layout: QkvLayout) -> usize {
        layout.num_heads * NUM_SPLITS * (layout.head_dim + 2)
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;

    fn name(&self) -> String {
        self.name.clone()
    }

    /// Floating-point models run in their own dtype; quantized ones in f16, the type of
    /// their block scales.
    fn activation_dtype(&self, weights: DType) -> DType {
        match weights {
            DType::F32 | DType::F16 | DType::BF16 => weights,
            _ => DType::F16,
        }
    }

    /// cuBLASLt multiplies matrices of the activation dtype; with f16 activations the
    /// [`quant::KEPT`] block formats stay as they are.
    fn weight_dtype(&self, stored: DType, activation: DType) -> DType {
        if activation == DType::F16 && quant::KEPT.contains(&stored) {
            stored
        } else {
            activation
        }
    }

    /// The expert kernels read matrices of the activation dtype.
    fn expert_weight_dtype(&self, _stored: DType, activation: DType) -> DType {
        activation
    }

    fn supports_kv_cache_dtype(&self, dtype: DType) -> bool {
        matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
    }

    fn memory_info(&self) -> Option<MemoryInfo> {
        let (free, total) = self.ctx.mem_get_info().ok()?;
        Some(MemoryInfo { free, total })
    }

    /// GPUs of one process joined by NCCL ([`nccl`]).
    fn tensor_parallel_group(devices: &[Self]) -> Result<Vec<Arc<dyn crate::Collective<Self>>>> {
        nccl::group(devices)
    }

    fn alloc(&self, dtype: DType, numel: usize) -> Result<CudaBuffer> {
        ensure!(
            !dtype.is_quantized() || quant::KEPT.contains(&dtype),
            "the CUDA backend keeps no {dtype} buffers (such weights are converted at load)"
        );
        if dtype.is_quantized() {
            self.reserve_dequantized(numel)?;
        }
        let bytes = dtype.bytes_for(numel).max(1);
        let slice = self
            .stream
            .alloc_zeros::<u8>(bytes)
            .with_context(|| format!("allocating {bytes} bytes on {}", self.name))?;
        let ptr = slice.device_ptr(&self.stream).0;
        Ok(CudaBuffer {
            slice,
            ptr,
            dtype,
            numel,
        })
    }

    fn upload(&self, dst: &mut CudaBuffer, bytes: &[u8]) -> Result<()> {
        ensure!(
            bytes.len() <= dst.slice.len(),
            "upload of {} bytes into {} bytes",
            bytes.len(),
            dst.slice.len()
        );
        if bytes.is_empty() {
            return Ok(());
        }
        if dst.dtype.is_quantized() {
            return self.upload_blocks(dst, bytes);
        }
        let mut view = dst.slice.slice_mut(..bytes.len());
        self.stream.memcpy_htod(bytes, &mut view)?;
        Ok(())
    }

    fn alloc_host(&self, capacity: usize) -> Result<HostBuffer> {
        Ok(HostBuffer::pinned(PinnedWords::new(&self.ctx, capacity)?))
    }

    fn upload_host(&self, dst: &mut CudaBuffer, src: &HostBuffer) -> Result<()> {
        self.upload(dst, bytemuck::cast_slice(src.as_slice()))?;
        if let Some(words) = src.pinned_words() {
            words.uploaded(&self.stream)?;
        }
        Ok(())
    }

    fn download_f32(&self, src: &CudaBuffer, numel: usize) -> Result<Vec<f32>> {
        Ok(match src.dtype {
            DType::F32 => self.read(src, numel)?,
            DType::F16 => self
                .read::<half::f16>(src, numel)?
                .iter()
                .map(|v| v.to_f32())
                .collect(),
            DType::BF16 => self
                .read::<half::bf16>(src, numel)?
                .iter()
                .map(|v| v.to_f32())
                .collect(),
            other => bail!("cannot read {other} buffers as f32"),
        })
    }

    fn records_steps(&self) -> bool {
        true
    }

    fn run_recorded(&self, key: u64, record: &mut (dyn FnMut() + Send)) -> Result<()> {
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        let graph = match graphs.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                // Relaxed: kernels looked up for the first time during capture are fine.
                self.stream
                    .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
                record();
                let graph = self
                    .stream
                    .end_capture(CUgraphInstantiate_flags(0))
                    .with_context(|| format!("capturing CUDA graph {key}"))?
                    .with_context(|| format!("CUDA graph {key} captured nothing"))?;
                if let Some(err) = self.error.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    return Err(err.context(format!("capturing CUDA graph {key}")));
                }
                e.insert(Graph(graph))
            }
        };
        graph.0.launch()?;
        Ok(())
    }

    fn download_i32(&self, src: &CudaBuffer, n: usize) -> Result<Vec<i32>> {
        self.read(src, n)
    }

    fn start_op_profile(&self) -> Result<()> {
        *self.profiler.lock().unwrap_or_else(|p| p.into_inner()) = Some(Profiler::default());
        Ok(())
    }

    fn op_profile(&self) -> Vec<(String, u64, f64)> {
        let profiler = self.profiler.lock().unwrap_or_else(|p| p.into_inner());
        let mut ops: Vec<(String, u64, f64)> = profiler
            .as_ref()
            .map(|p| {
                p.totals
                    .iter()
                    .map(|(k, &(n, ms))| (k.clone(), n, ms))
                    .collect()
            })
            .unwrap_or_default();
        ops.sort_by(|a, b| b.2.total_cmp(&a.2));
        for (rows, &(layers, touched, experts)) in profiler.iter().flat_map(|p| &p.experts_touched)
        {
            tracing::info!(
                "steps of {rows} rows: a mixture-of-experts layer touched {:.1} of its {experts} experts on average ({layers} layers)",
                touched as f64 / layers as f64
            );
        }
        ops
    }

    fn synchronize(&self) -> Result<()> {
        let synced = self.stream.synchronize();
        if let Some(p) = self
            .profiler
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
        {
            for (op, start, end) in p.pending.drain(..) {
                let ms = start.elapsed_ms(&end)? as f64;
                let t = p.totals.entry(op).or_default();
                t.0 += 1;
                t.1 += ms;
            }
        }
        if let Some(e) = self.error.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Err(e);
        }
        synced.with_context(|| format!("running a step on {}", self.name))
    }

    fn embedding(
        &self,
        table: &CudaBuffer,
        ids: &CudaBuffer,
        n: usize,
        dim: usize,
        vocab_rows: std::ops::Range<usize>,
        out: &mut CudaBuffer,
    ) {
        assert!(
            vocab_rows.len() * dim <= table.numel,
            "embedding table too small"
        );
        if table.dtype.is_quantized() {
            return self.quantized_embedding(table, ids, n, dim, vocab_rows, out);
        }
        assert_eq!(table.dtype, out.dtype, "embedding table and output dtypes");
        let (t, i, d, o) = (table.ptr, ids.ptr, dim as i32, out.ptr);
        let (first, rows) = (vocab_rows.start as i32, vocab_rows.len() as i32);
        launch!(self, format!("embedding_{}", suffix(out.dtype)), (n as u32, 1, 1), row_threads(dim).min(256); t, i, first, rows, d, o);
    }

    fn rms_norm(
        &self,
        x: &CudaBuffer,
        weight: &CudaBuffer,
        eps: f32,
        rows: usize,
        dim: usize,
        out: &mut CudaBuffer,
    ) {
        let (xp, w, d, o) = (x.ptr, weight.ptr, dim as i32, out.ptr);
        launch!(self, format!("rms_norm_{}", suffix(x.dtype)), (rows as u32, 1, 1), row_threads(dim); xp, w, eps, d, o);
    }

    fn add_rms_norm(
        &self,
        residual: &mut CudaBuffer,
        x: &CudaBuffer,
        weight: &CudaBuffer,
        eps: f32,
        rows: usize,
        dim: usize,
        out: &mut CudaBuffer,
    ) {
        let (r, xp, w, d, o) = (residual.ptr, x.ptr, weight.ptr, dim as i32, out.ptr);
        launch!(self, format!("add_rms_norm_{}", suffix(x.dtype)), (rows as u32, 1, 1), row_threads(dim); r, xp, w, eps, d, o);
    }

    fn matmul(
        &self,
        x: &CudaBuffer,
        w: &CudaBuffer,
        bias: Option<&CudaBuffer>,
        m: usize,
        n: usize,
        k: usize,
        out: MatmulOut<'_, Self>,
    ) {
        self.product(x, w, bias, m, n, k, out, false);
    }

    fn add_assign(&self, acc: &mut CudaBuffer, x: &CudaBuffer, numel: usize) {
        let (a, xp, n) = (acc.ptr, x.ptr, numel as i64);
        launch!(self, format!("add_assign_{}", suffix(x.dtype)), (self.grid_for(numel), 1, 1), 256; a, xp, n);
    }

    fn silu_mul(&self, gate_up: &CudaBuffer, rows: usize, ffn: usize, out: &mut CudaBuffer) {
        let (g, r, f, o) = (gate_up.ptr, rows as i64, ffn as i32, out.ptr);
        launch!(self, format!("silu_mul_{}", suffix(out.dtype)), (self.grid_for(rows * ffn), 1, 1), 256; g, r, f, o);
    }

    fn qk_norm(
        &self,
        qkv: &mut CudaBuffer,
        layout: QkvLayout,
        rows: usize,
        q_weight: &CudaBuffer,
        k_weight: &CudaBuffer,
        eps: f32,
    ) {
        let (q, nh, nkv, hd, rl) = (
            qkv.ptr,
            layout.num_heads as i32,
            layout.num_kv_heads as i32,
            layout.head_dim as i32,
            layout.row_len() as i32,
        );
        let (qw, kw) = (q_weight.ptr, k_weight.ptr);
        let heads = (layout.num_heads + layout.num_kv_heads) as u32;
        launch!(self, format!("qk_norm_{}", suffix(qkv.dtype)), (rows as u32, heads, 1), 32; q, nh, nkv, hd, rl, qw, kw, eps);
    }

    fn rope(
        &self,
        qkv: &mut CudaBuffer,
        layout: QkvLayout,
        positions: &CudaBuffer,
        rows: usize,
        cos_sin: &CudaBuffer,
        rotary_dim: usize,
    ) {
        let heads = layout.num_heads + layout.num_kv_heads;
        let (q, p, cs, h, hd, rd, rl) = (
            qkv.ptr,
            positions.ptr,
            cos_sin.ptr,
            heads as i32,
            layout.head_dim as i32,
            rotary_dim as i32,
            layout.row_len() as i32,
        );
        launch!(self, format!("rope_{}", suffix(qkv.dtype)), (rows as u32, 1, 1), row_threads(heads * rotary_dim / 2).min(256); q, p, cs, h, hd, rd, rl);
    }

    fn kv_write(
        &self,
        qkv: &CudaBuffer,
        layout: QkvLayout,
        slot_mapping: &CudaBuffer,
        rows: usize,
        cache: CacheLayout,
        k_cache: &mut CudaBuffer,
        v_cache: &mut CudaBuffer,
    ) {
        let slots = cache.num_blocks * cache.block_size;
        assert!(
            k_cache.numel >= slots * layout.kv_len(),
            "KV cache smaller than its layout"
        );
        let (q, s, ql, kvl, rl, kc, vc) = (
            qkv.ptr,
            slot_mapping.ptr,
            layout.q_len() as i32,
            layout.kv_len() as i32,
            layout.row_len() as i32,
            k_cache.ptr,
            v_cache.ptr,
        );
        launch!(self,
            format!("kv_write_{}_{}", suffix(qkv.dtype), suffix(k_cache.dtype)),
            (rows as u32, 1, 1), row_threads(layout.kv_len()).min(256);
            q, s, ql, kvl, rl, kc, vc);
    }

    fn rope_kv_write(
        &self,
        qkv: &mut CudaBuffer,
        layout: QkvLayout,
        positions: &CudaBuffer,
        rows: usize,
        cos_sin: &CudaBuffer,
        rotary_dim: usize,
        slot_mapping: &CudaBuffer,
        cache: CacheLayout,
        k_cache: &mut CudaBuffer,
        v_cache: &mut CudaBuffer,
    ) {
        let rope = RopeKvWrite {
            layout,
            positions,
            cos_sin,
            rotary_dim,
            slot_mapping,
            cache,
            k_cache,
            v_cache,
        };
        self.rope_kv_write_normed(qkv, rows, rope, None, None);
    }

    fn qk_norm_rope_kv_write(
        &self,
        qkv: &mut CudaBuffer,
        rows: usize,
        q_weight: &CudaBuffer,
        k_weight: &CudaBuffer,
        eps: f32,
        rope: RopeKvWrite<'_, Self>,
    ) {
        self.rope_kv_write_normed(qkv, rows, rope, None, Some((q_weight, k_weight, eps)));
    }

    fn silu_mul_matmul(
        &self,
        gate_up: &CudaBuffer,
        act: &mut CudaBuffer,
        w: &CudaBuffer,
        m: usize,
        n: usize,
        ffn: usize,
        out: MatmulOut<'_, Self>,
    ) {
        if self.gemv_fits(gate_up, w, m, ffn, None) {
            self.gemv("gemv_silu", gate_up, w, None, m, n, ffn, out, false, 0.0);
        } else {
            self.silu_mul(gate_up, m, ffn, act);
            self.matmul(act, w, None, m, n, ffn, out);
        }
    }

    /// Norm weights are folded into the products after each norm: a GEMV gathers the norm
    /// from its reads of x, `tma_product`'s gate/up product from the input it streams (and
    /// applies SiLU·mul), and a cuBLASLt product runs on the un-normalized rows with the
    /// kernel that reads its output (RoPE, SiLU·mul) scaling them by 1 / rms; the residual
    /// adds run in the products' epilogues. No norm or add kernel is left in a layer.
    fn folds_norm_weights(&self) -> bool {
        true
    }

    fn rms_norm_matmul(
        &self,
        x: &CudaBuffer,
        unit: &CudaBuffer,
        eps: f32,
        w: &CudaBuffer,
        bias: Option<&CudaBuffer>,
        m: usize,
        n: usize,
        k: usize,
        normed: &mut CudaBuffer,
        out: MatmulOut<'_, Self>,
    ) {
        if self.gemv_fits(x, w, m, k, bias) {
            self.gemv("gemv_norm", x, w, bias, m, n, k, out, false, eps);
        } else {
            rms_norm_then_matmul(self, x, unit, eps, w, bias, m, n, k, normed, out);
        }
    }

    fn rms_norm_qkv_rope_kv_write(
        &self,
        x: &CudaBuffer,
        unit: &CudaBuffer,
        eps: f32,
        w: &CudaBuffer,
        bias: Option<&CudaBuffer>,
        m: usize,
        k: usize,
        normed: &mut CudaBuffer,
        qkv: &mut CudaBuffer,
        rope: RopeKvWrite<'_, Self>,
    ) {
        // A GEMV takes the norm itself (`rms_norm_matmul`); a bias comes after the norm's
        // scale, which RoPE scaling a cuBLASLt product's output cannot give.
        if bias.is_some() || self.gemv_fits(x, w, m, k, bias) {
            return rms_norm_qkv_then_rope_kv_write(
                self, x, unit, eps, w, bias, m, k, normed, qkv, rope,
            );
        }
        let n = rope.layout.row_len();
        let out = MatmulOut {
            buf: &mut *qkv,
            row_stride: n,
            col_offset: 0,
        };
        self.product(x, w, None, m, n, k, out, false);
        self.rope_kv_write_normed(qkv, m, rope, Some((x, k, eps)), None);
    }

    fn matmul_add(
        &self,
        x: &CudaBuffer,
        w: &CudaBuffer,
        m: usize,
        n: usize,
        k: usize,
        _product: &mut CudaBuffer,
        acc: &mut CudaBuffer,
    ) {
        let out = MatmulOut {
            buf: acc,
            row_stride: n,
            col_offset: 0,
        };
        self.product(x, w, None, m, n, k, out, true);
    }

    fn rms_norm_gated_mlp_add(
        &self,
        residual: &mut CudaBuffer,
        _unit: &CudaBuffer,
        eps: f32,
        gate_up: &CudaBuffer,
        down: &CudaBuffer,
        m: usize,
        k: usize,
        ffn: usize,
        scratch: MlpScratch<'_, Self>,
        _normed: &mut CudaBuffer,
        _product: &mut CudaBuffer,
        accumulate: bool,
    ) {
        let gemv = self.gemv_fits(residual, gate_up, m, k, None)
            && self.gemv_fits(scratch.gate_up, down, m, ffn, None);
        let gu = MatmulOut {
            buf: &mut *scratch.gate_up,
            row_stride: 2 * ffn,
            col_offset: 0,
        };
        if gemv {
            // The norm's scale in the gate/up product, SiLU·mul in the down product's loads.
            self.gemv(
                "gemv_norm",
                residual,
                gate_up,
                None,
                m,
                2 * ffn,
                k,
                gu,
                false,
                eps,
            );
            let out = MatmulOut {
                buf: residual,
                row_stride: k,
                col_offset: 0,
            };
            self.gemv(
                "gemv_silu",
                scratch.gate_up,
                down,
                None,
                m,
                k,
                ffn,
                out,
                accumulate,
                0.0,
            );
            return;
        }
        if self.tma_product_fits(residual, gate_up, residual.dtype, m, 2 * ffn, k, None) {
            // SiLU·mul in the gate/up product's epilogue.
            let act = MatmulOut {
                buf: &mut *scratch.act,
                row_stride: ffn,
                col_offset: 0,
            };
            self.tma_product(residual, gate_up, m, 2 * ffn, k, act, false, Some(eps));
        } else {
            self.product(residual, gate_up, None, m, 2 * ffn, k, gu, false);
            let (g, f, x, d, o) = (
                scratch.gate_up.ptr,
                ffn as i32,
                residual.ptr,
                k as i32,
                scratch.act.ptr,
            );
            let chunks = ffn.div_ceil(SILU_VALUES * 256) as u32;
            launch!(self, format!("silu_mul_normed_{}", suffix(residual.dtype)),
                (chunks, m as u32, 1), 256; g, f, x, d, eps, o);
        }
        let out = MatmulOut {
            buf: residual,
            row_stride: k,
            col_offset: 0,
        };
        self.product(scratch.act, down, None, m, k, ffn, out, accumulate);
    }

    fn attention_workspace_len(&self, layout: QkvLayout, max_seqs: usize) -> usize {
        max_seqs * Self::workspace_per_row(layout)
    }

    fn paged_attention(
        &self,
        qkv: &CudaBuffer,
        layout: QkvLayout,
        rows: usize,
        meta: &AttentionMetadata<'_, Self>,
        cache: CacheLayout,
        k_cache: &CudaBuffer,
        v_cache: &CudaBuffer,
        scale: f32,
        workspace: &mut CudaBuffer,
        out: &mut CudaBuffer,
    ) {
        let d = layout.head_dim;
        assert!(
            HEAD_DIMS.contains(&d),
            "the CUDA attention kernels take head_dim {HEAD_DIMS:?}, not {d}"
        );
        let tensor_cores = matches!(qkv.dtype, DType::F16 | DType::BF16)
            && k_cache.dtype == qkv.dtype
            && meta.max_query_len > 1;
        if tensor_cores {
            let t = suffix(qkv.dtype);
            let (q, qsl, sl, bt) = (
                qkv.ptr,
                meta.query_start_loc.ptr,
                meta.seq_lens.ptr,
                meta.block_tables.ptr,
            );
            let (mb, ns) = (meta.max_blocks_per_seq as i32, meta.num_seqs as i32);
            let (kc, vc, bs) = (k_cache.ptr, v_cache.ptr, cache.block_size as i32);
            let (nh, nkv, rl) = (
                layout.num_heads as i32,
                layout.num_kv_heads as i32,
                layout.row_len() as i32,
            );
            let o = out.ptr;
            let tiles = (rows / 64 + meta.num_seqs) as u32;
            launch!(self, format!("prefill_attention_{t}_d{d}"),
                (tiles, layout.num_heads as u32, 1), 128;
                q, qsl, sl, bt, mb, ns, kc, vc, bs, nh, nkv, rl, scale, o);
            return;
        }
        // Split-KV over as many rows at a time as the workspace holds partials for.
        let chunk = workspace.numel / Self::workspace_per_row(layout);
        assert!(chunk > 0, "attention workspace too small");
        let mut offset = 0;
        while offset < rows {
            let n = chunk.min(rows - offset);
            self.split_kv(
                qkv, layout, offset, n, meta, cache, k_cache, v_cache, scale, workspace, out,
            );
            offset += n;
        }
    }

    fn argmax(&self, logits: &CudaBuffer, rows: usize, vocab: usize, out: &mut CudaBuffer) {
        assert_eq!(logits.dtype, DType::F32, "argmax reads f32 logits");
        let (l, v, o) = (logits.ptr, vocab as i32, out.ptr);
        launch!(self, "argmax_rows".to_string(), (rows as u32, 1, 1), 1024; l, v, o);
    }

    fn sample(
        &self,
        logits: &mut CudaBuffer,
        rows: usize,
        vocab: usize,
        params: &CudaBuffer,
        edits: &CudaBuffer,
        masks: &CudaBuffer,
        out: &mut CudaBuffer,
    ) {
        assert_eq!(logits.dtype, DType::F32, "sample reads f32 logits");
        let (l, v, p, e, m, o) = (
            logits.ptr,
            vocab as i32,
            params.ptr,
            edits.ptr,
            masks.ptr,
            out.ptr,
        );
        // SAMPLE_WARPS warps, as the kernel's histograms are laid out.
        launch!(self, "sample_rows".to_string(), (rows as u32, 1, 1), 512; l, v, p, e, m, o);
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn gather_rows(
        &self,
        x: &CudaBuffer,
        indices: &CudaBuffer,
        n: usize,
        dim: usize,
        out: &mut CudaBuffer,
    ) {
        let (xp, i, d, o) = (x.ptr, indices.ptr, dim as i32, out.ptr);
        launch!(self, format!("gather_rows_{}", suffix(x.dtype)), (n as u32, 1, 1), row_threads(dim).min(256); xp, i, d, o);
    }

    fn segment_sum(
        &self,
        x: &CudaBuffer,
        query_start_loc: &CudaBuffer,
        num_seqs: usize,
        dim: usize,
        out: &mut CudaBuffer,
    ) {
        let (xp, q, d, o) = (x.ptr, query_start_loc.ptr, dim as i32, out.ptr);
        launch!(self, format!("segment_sum_{}", suffix(x.dtype)), (num_seqs as u32, 1, 1), row_threads(dim).min(256); xp, q, d, o);
    }

    fn moe_route(
        &self,
        logits: &CudaBuffer,
        shape: MoeShape,
        renormalize: bool,
        ids: &mut CudaBuffer,
        weights: &mut CudaBuffer,
    ) {
        self.route(logits, shape, renormalize, ids, weights);
    }

    fn moe_workspace_len(&self, shape: MoeShape) -> usize {
        moe::Workspace::new(shape).len
    }

    fn moe_experts(
        &self,
        x: &CudaBuffer,
        ids: &CudaBuffer,
        weights: &CudaBuffer,
        shape: MoeShape,
        gate_up: &CudaBuffer,
        down: &CudaBuffer,
        workspace: &mut CudaBuffer,
        out: &mut CudaBuffer,
        add: bool,
    ) {
        self.run_experts(x, ids, weights, shape, gate_up, down, workspace, out, add);
    }

    fn moe(
        &self,
        x: &CudaBuffer,
        logits: &CudaBuffer,
        shape: MoeShape,
        renormalize: bool,
        gate_up: &CudaBuffer,
        down: &CudaBuffer,
        ids: &mut CudaBuffer,
        weights: &mut CudaBuffer,
        workspace: &mut CudaBuffer,
        out: &mut CudaBuffer,
        add: bool,
    ) {
        assert_eq!(x.dtype, out.dtype, "moe's output in the activation dtype");
        if moe::slot_by_slot(x.dtype, shape) {
            self.run_rows(
                x.ptr,
                logits,
                shape,
                renormalize,
                None,
                gate_up,
                down,
                ids,
                weights,
                workspace,
                out,
                add,
            );
        } else {
            self.route(logits, shape, renormalize, ids, weights);
            self.run_experts(x, ids, weights, shape, gate_up, down, workspace, out, add);
        }
    }

    /// Steps that run slot by slot take the norm inside the router's GEMV (`gemv_norm`) and
    /// the experts' gate/up kernel, so no norm kernel runs; larger steps norm first.
    fn rms_norm_moe_add(
        &self,
        residual: &mut CudaBuffer,
        unit: &CudaBuffer,
        eps: f32,
        layer: MoeLayer<'_, Self>,
        shape: MoeShape,
        scratch: MoeScratch<'_, Self>,
        normed: &mut CudaBuffer,
    ) {
        let (rows, dim, experts) = (shape.rows, shape.dim, shape.experts);
        if !(moe::slot_by_slot(residual.dtype, shape)
            && self.gemv_fits(residual, layer.router, rows, dim, None))
        {
            return rms_norm_moe_then_add(self, residual, unit, eps, layer, shape, scratch, normed);
        }
        let logits = MatmulOut {
            buf: &mut *scratch.logits,
            row_stride: experts,
            col_offset: 0,
        };
        self.gemv(
            "gemv_norm",
            residual,
            layer.router,
            None,
            rows,
            experts,
            dim,
            logits,
            false,
            eps,
        );
        self.run_rows(
            residual.ptr,
            scratch.logits,
            shape,
            layer.renormalize,
            Some(eps),
            layer.gate_up,
            layer.down,
            scratch.ids,
            scratch.weights,
            scratch.workspace,
            residual,
            true,
        );
    }
}
