//! Device buffers and the ops a model step is made of.
//!
//! The trait is shaped for GPUs: every op enqueues work over buffers that were allocated
//! once at start, nothing allocates per op, and the host only reads results back with
//! [`Backend::download_f32`] at the end of a step. On the CPU backend "enqueue" means
//! "run now", which keeps it a plain reference for the GPU backends.

pub mod collective;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod dtype;
mod host_buffer;
pub mod quant;
pub mod sampling;
#[cfg(feature = "wgpu")]
pub mod wgpu;

pub use collective::Collective;
pub use dtype::DType;
pub use host_buffer::HostBuffer;
pub use sampling::{LogitEdit, SampleRow};
use std::sync::Arc;

/// Index of the largest value, the first among equals (as `torch.argmax`).
pub fn first_argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// How the fused QKV projection output is laid out: each token row holds
/// `num_heads` query heads, then `num_kv_heads` key heads, then `num_kv_heads` value heads,
/// each `head_dim` wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QkvLayout {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl QkvLayout {
    pub const fn row_len(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }
    pub const fn q_len(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub const fn kv_len(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// The paged KV cache geometry of one layer: `[num_blocks, block_size, num_kv_heads, head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLayout {
    pub num_blocks: usize,
    pub block_size: usize,
}

/// Per-step attention metadata for a flattened batch of `num_seqs` sequences.
///
/// Sequence `s` owns token rows `query_start_loc[s]..query_start_loc[s+1]`; those are its
/// last tokens, so its context after this step is `seq_lens[s]` tokens and its first new
/// token sits at position `seq_lens[s] - q_len`. A prefill chunk that continues an existing
/// context and a single-token decode look the same here.
pub struct AttentionMetadata<'a, B: Backend + ?Sized> {
    /// i32 `[num_seqs + 1]`.
    pub query_start_loc: &'a B::Buffer,
    /// i32 `[num_seqs]`.
    pub seq_lens: &'a B::Buffer,
    /// i32 `[num_seqs, max_blocks_per_seq]`: physical block of each logical block.
    pub block_tables: &'a B::Buffer,
    pub num_seqs: usize,
    pub max_blocks_per_seq: usize,
    /// The most query tokens of one sequence in this step (1 in a decode-only step).
    pub max_query_len: usize,
}

/// A matmul's destination: row `i` of the product goes to
/// `out[i * row_stride + col_offset ..][..n]`, so several projections can fill one fused row.
pub struct MatmulOut<'a, B: Backend + ?Sized> {
    pub buf: &'a mut B::Buffer,
    pub row_stride: usize,
    pub col_offset: usize,
}

/// Scratch of [`Backend::gated_mlp`]: the gate/up product and the SiLU·mul, each written
/// only where the backend needs it.
pub struct MlpScratch<'a, B: Backend + ?Sized> {
    pub gate_up: &'a mut B::Buffer,
    pub act: &'a mut B::Buffer,
}

/// [`Backend::gated_mlp`]'s default: [`Backend::matmul`] into `scratch.gate_up`, then
/// [`Backend::silu_mul_matmul`]; also the path of a backend whose fusion does not take the
/// shape.
#[allow(clippy::too_many_arguments)]
pub fn gated_mlp_in_two_products<B: Backend + ?Sized>(
    b: &B,
    x: &B::Buffer,
    gate_up: &B::Buffer,
    down: &B::Buffer,
    m: usize,
    k: usize,
    ffn: usize,
    n: usize,
    scratch: MlpScratch<'_, B>,
    out: MatmulOut<'_, B>,
) {
    let gu = MatmulOut {
        buf: &mut *scratch.gate_up,
        row_stride: 2 * ffn,
        col_offset: 0,
    };
    b.matmul(x, gate_up, None, m, 2 * ffn, k, gu);
    b.silu_mul_matmul(scratch.gate_up, scratch.act, down, m, n, ffn, out);
}

/// [`Backend::rms_norm_matmul`]'s default: [`Backend::rms_norm`] into `normed`, then
/// [`Backend::matmul`]; also the path of a backend whose fusion does not take the shape.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_then_matmul<B: Backend + ?Sized>(
    b: &B,
    x: &B::Buffer,
    unit: &B::Buffer,
    eps: f32,
    w: &B::Buffer,
    bias: Option<&B::Buffer>,
    m: usize,
    n: usize,
    k: usize,
    normed: &mut B::Buffer,
    out: MatmulOut<'_, B>,
) {
    b.rms_norm(x, unit, eps, m, k, normed);
    b.matmul(normed, w, bias, m, n, k, out);
}

/// [`Backend::rms_norm_qkv_rope_kv_write`]'s default: [`Backend::rms_norm_matmul`] into
/// `qkv`, then [`Backend::rope_kv_write`]; also the path of a backend whose fusion does not
/// take the shape.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_qkv_then_rope_kv_write<B: Backend + ?Sized>(
    b: &B,
    x: &B::Buffer,
    unit: &B::Buffer,
    eps: f32,
    w: &B::Buffer,
    bias: Option<&B::Buffer>,
    m: usize,
    k: usize,
    normed: &mut B::Buffer,
    qkv: &mut B::Buffer,
    rope: RopeKvWrite<'_, B>,
) {
    let n = rope.layout.row_len();
    let out = MatmulOut {
        buf: &mut *qkv,
        row_stride: n,
        col_offset: 0,
    };
    b.rms_norm_matmul(x, unit, eps, w, bias, m, n, k, normed, out);
    rope.apply(b, qkv, m);
}

/// [`Backend::matmul_add`]'s default: [`Backend::matmul`] into `product`, then
/// [`Backend::add_assign`]; also the path of a backend whose fusion does not take the shape.
#[allow(clippy::too_many_arguments)]
pub fn matmul_then_add<B: Backend + ?Sized>(
    b: &B,
    x: &B::Buffer,
    w: &B::Buffer,
    m: usize,
    n: usize,
    k: usize,
    product: &mut B::Buffer,
    acc: &mut B::Buffer,
) {
    let out = MatmulOut {
        buf: &mut *product,
        row_stride: n,
        col_offset: 0,
    };
    b.matmul(x, w, None, m, n, k, out);
    b.add_assign(acc, product, m * n);
}

/// [`Backend::rms_norm_gated_mlp_add`]'s default: [`Backend::rms_norm`] into `normed`,
/// [`Backend::gated_mlp`] into `product`, then [`Backend::add_assign`] (or the MLP straight
/// into `residual` where it does not `accumulate`); also the path of a backend whose fusion
/// does not take the shape.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_gated_mlp_then_add<B: Backend + ?Sized>(
    b: &B,
    residual: &mut B::Buffer,
    unit: &B::Buffer,
    eps: f32,
    gate_up: &B::Buffer,
    down: &B::Buffer,
    m: usize,
    k: usize,
    ffn: usize,
    scratch: MlpScratch<'_, B>,
    normed: &mut B::Buffer,
    product: &mut B::Buffer,
    accumulate: bool,
) {
    b.rms_norm(residual, unit, eps, m, k, normed);
    let out = MatmulOut {
        buf: if accumulate {
            &mut *product
        } else {
            &mut *residual
        },
        row_stride: k,
        col_offset: 0,
    };
    b.gated_mlp(normed, gate_up, down, m, k, ffn, k, scratch, out);
    if accumulate {
        b.add_assign(residual, product, m * k);
    }
}

/// What a mixture of experts' layer writes besides its output: the router's f32 logits
/// (`[rows, experts]`), each slot's expert (i32) and weight (f32), and the backend's
/// workspace ([`Backend::moe_workspace_len`]).
pub struct MoeScratch<'a, B: Backend + ?Sized> {
    pub logits: &'a mut B::Buffer,
    pub ids: &'a mut B::Buffer,
    pub weights: &'a mut B::Buffer,
    pub workspace: &'a mut B::Buffer,
}

/// The weights of a mixture of experts' layer as [`Backend::rms_norm_moe_add`] takes them:
/// the router (`[experts, dim]`) and every expert's stacked matrices (see
/// [`Backend::moe_experts`]).
pub struct MoeLayer<'a, B: Backend + ?Sized> {
    pub router: &'a B::Buffer,
    pub gate_up: &'a B::Buffer,
    pub down: &'a B::Buffer,
    pub renormalize: bool,
}

/// [`Backend::rms_norm_moe_add`]'s default: [`Backend::rms_norm`] into `normed`, the
/// router's [`Backend::matmul`] into `scratch.logits`, then [`Backend::moe`] adding into
/// `residual`; also the path of a backend whose fusion does not take the step.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_moe_then_add<B: Backend + ?Sized>(
    b: &B,
    residual: &mut B::Buffer,
    unit: &B::Buffer,
    eps: f32,
    layer: MoeLayer<'_, B>,
    shape: MoeShape,
    scratch: MoeScratch<'_, B>,
    normed: &mut B::Buffer,
) {
    let (rows, dim, experts) = (shape.rows, shape.dim, shape.experts);
    b.rms_norm(residual, unit, eps, rows, dim, normed);
    let logits = MatmulOut {
        buf: &mut *scratch.logits,
        row_stride: experts,
        col_offset: 0,
    };
    b.matmul(normed, layer.router, None, rows, experts, dim, logits);
    b.moe(
        normed,
        scratch.logits,
        shape,
        layer.renormalize,
        layer.gate_up,
        layer.down,
        scratch.ids,
        scratch.weights,
        scratch.workspace,
        residual,
        true,
    );
}

/// Where a step's new keys and values go, rotated: the arguments of
/// [`Backend::rope_kv_write`] besides the qkv rows.
pub struct RopeKvWrite<'a, B: Backend + ?Sized> {
    pub layout: QkvLayout,
    pub positions: &'a B::Buffer,
    pub cos_sin: &'a B::Buffer,
    pub rotary_dim: usize,
    pub slot_mapping: &'a B::Buffer,
    pub cache: CacheLayout,
    pub k_cache: &'a mut B::Buffer,
    pub v_cache: &'a mut B::Buffer,
}

impl<B: Backend + ?Sized> RopeKvWrite<'_, B> {
    /// [`Backend::rope_kv_write`] of `m` rows of `qkv` with these arguments.
    pub fn apply(self, b: &B, qkv: &mut B::Buffer, m: usize) {
        b.rope_kv_write(
            qkv,
            self.layout,
            self.positions,
            m,
            self.cos_sin,
            self.rotary_dim,
            self.slot_mapping,
            self.cache,
            self.k_cache,
            self.v_cache,
        );
    }
}

/// The shape of a step's mixture of experts: `rows` rows of `dim`, each routed to
/// `experts_per_token` of `experts` experts whose gated MLPs are `ffn` wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeShape {
    pub rows: usize,
    pub experts: usize,
    pub experts_per_token: usize,
    pub dim: usize,
    pub ffn: usize,
}

impl MoeShape {
    /// The step's (row, expert) pairs: slot `r * experts_per_token + j` is row `r`'s `j`-th
    /// expert.
    pub const fn slots(&self) -> usize {
        self.rows * self.experts_per_token
    }
}

/// Device memory as the backend sees it, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    pub free: usize,
    pub total: usize,
}

/// The host memory the kernel reports available (`MemAvailable` of /proc/meminfo): what a
/// backend that runs on the host's cores can still allocate without swapping or being
/// killed. `None` where it cannot be read.
pub fn host_available_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// A compute device: buffers plus the ops of a transformer step.
///
/// Shapes are given in elements. Activations (and the KV cache) are in the dtype the
/// backend picks with [`Backend::activation_dtype`]; weights may be any [`DType`] the
/// backend keeps ([`Backend::weight_dtype`]); norm weights, biases and the RoPE table are
/// f32. Every op accumulates in f32. Ops panic on shape or dtype mismatches: those are
/// programming errors, not input errors.
pub trait Backend: Send + Sync {
    type Buffer: Send + Sync;

    fn name(&self) -> String;

    /// The dtype activations run in when the model's matrices are `weights`.
    fn activation_dtype(&self, weights: DType) -> DType;

    /// The dtype a matrix stored as `stored` is kept in when activations are `activation`:
    /// the CPU keeps every format; a GPU converts what it has no kernels for at load.
    fn weight_dtype(&self, stored: DType, activation: DType) -> DType;

    /// [`Backend::weight_dtype`] for the expert matrices of a mixture of experts, where a
    /// backend's expert kernels read fewer formats than its products.
    fn expert_weight_dtype(&self, stored: DType, activation: DType) -> DType {
        self.weight_dtype(stored, activation)
    }

    /// Whether the KV cache may be kept in `dtype`.
    fn supports_kv_cache_dtype(&self, dtype: DType) -> bool;

    /// The KV cache dtype of `--kv-cache-dtype auto` for a model whose matrices are kept
    /// as `weights` and whose activations run in `activation`.
    fn auto_kv_cache_dtype(&self, _weights: DType, activation: DType) -> DType {
        activation
    }

    /// Free and total device memory, for backends whose memory is their own (GPUs).
    fn memory_info(&self) -> Option<MemoryInfo> {
        None
    }

    /// Joins `devices` into a tensor-parallel group, `devices[r]` as rank `r`: each rank's
    /// [`Collective`], in rank order.
    fn tensor_parallel_group(devices: &[Self]) -> anyhow::Result<Vec<Arc<dyn Collective<Self>>>>
    where
        Self: Sized + 'static,
    {
        anyhow::bail!(
            "tensor parallelism is not supported on {}",
            devices.first().map_or_else(String::new, |d| d.name())
        )
    }

    /// Whether the ops run on the host's cores, in the host's memory: the engine then sizes
    /// its batch and KV cache for what a CPU serves.
    fn runs_on_host_cpu(&self) -> bool {
        false
    }

    /// The largest buffer one op may bind, where the device limits it (wgpu adapters): the
    /// KV cache of one layer is sized to fit.
    fn max_buffer_bytes(&self) -> Option<usize> {
        None
    }

    /// Whether models loaded here fold each RMSNorm's weights into the matrices that read
    /// its output (`w[j, c] * g[c]`, rounded to the matrix dtype) and run their layers
    /// through [`Backend::rms_norm_matmul`], [`Backend::matmul_add`] and
    /// [`Backend::rms_norm_gated_mlp_add`]: a GPU then computes a norm inside a kernel that
    /// runs anyway (the product that reads the row, or the kernel that reads the product:
    /// `rms_norm(x) · wᵀ = (x · wᵀ) / rms(x)`) instead of in a kernel of its own, which costs
    /// a decode step a dispatch and a barrier per norm.
    fn folds_norm_weights(&self) -> bool {
        false
    }

    fn alloc(&self, dtype: DType, numel: usize) -> anyhow::Result<Self::Buffer>;
    /// Copies raw bytes in the buffer's own layout into the start of `dst`.
    fn upload(&self, dst: &mut Self::Buffer, bytes: &[u8]) -> anyhow::Result<()>;
    /// Host memory for `capacity` words of a step's inputs, kept from step to step and
    /// uploaded with [`Backend::upload_host`]: page-locked where the device then copies
    /// from it without the host (CUDA).
    fn alloc_host(&self, capacity: usize) -> anyhow::Result<HostBuffer> {
        Ok(HostBuffer::with_capacity(capacity))
    }
    /// Copies `src`'s words into the start of `dst` (an i32/u32 buffer).
    fn upload_host(&self, dst: &mut Self::Buffer, src: &HostBuffer) -> anyhow::Result<()> {
        self.upload(dst, bytemuck::cast_slice(src.as_slice()))
    }
    fn download_f32(&self, src: &Self::Buffer, numel: usize) -> anyhow::Result<Vec<f32>>;
    /// Waits for enqueued work and reports any error it raised.
    fn synchronize(&self) -> anyhow::Result<()>;

    /// Runs `f`, which enqueues the ops of one step, inside the backend's execution
    /// context: the CPU backend runs it on its worker pool so that per-op dispatch is cheap;
    /// a GPU backend can record the ops into one command stream.
    fn run_step<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// Runs the ops `record` enqueues as one recorded command stream kept under `key`: a
    /// GPU captures them (a CUDA graph) on the first call and replays the capture on every
    /// later call with the key, without calling `record`. So every call with a key must
    /// enqueue the same ops on the same buffers with the same shapes; only the contents of
    /// the buffers may differ. Backends without recording run `record` each time.
    fn run_recorded(&self, _key: u64, record: &mut (dyn FnMut() + Send)) -> anyhow::Result<()> {
        self.run_step(record);
        Ok(())
    }

    /// Whether [`Backend::run_recorded`] replays captures; when it does, decode steps are
    /// padded to a few batch sizes so that each size is captured once.
    fn records_steps(&self) -> bool {
        false
    }

    /// Starts timing every op on the device (steps run op by op only); an error where the
    /// backend has no such timer.
    fn start_op_profile(&self) -> anyhow::Result<()> {
        anyhow::bail!("{} has no op profiler", self.name())
    }

    /// Device time per op since the profile started: (op, calls, milliseconds), longest
    /// first.
    fn op_profile(&self) -> Vec<(String, u64, f64)> {
        vec![]
    }

    /// Copies `n` i32 values back to the host.
    fn download_i32(&self, src: &Self::Buffer, n: usize) -> anyhow::Result<Vec<i32>>;

    /// `out[i] = table[ids[i] - vocab_rows.start]` (rows of `dim`, dequantized) for the
    /// ids in `vocab_rows`, the rows of the vocabulary `table` holds; the other rows of `out`
    /// are left as they are, so a table split over several buffers fills `out` part by part.
    fn embedding(
        &self,
        table: &Self::Buffer,
        ids: &Self::Buffer,
        n: usize,
        dim: usize,
        vocab_rows: std::ops::Range<usize>,
        out: &mut Self::Buffer,
    );

    /// Row-wise RMSNorm: `out = x / rms(x) * weight`.
    fn rms_norm(
        &self,
        x: &Self::Buffer,
        weight: &Self::Buffer,
        eps: f32,
        rows: usize,
        dim: usize,
        out: &mut Self::Buffer,
    );

    /// `residual += x`, then `out = rms_norm(residual) * weight`: the residual connection
    /// and the next norm in one pass.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(
        &self,
        residual: &mut Self::Buffer,
        x: &Self::Buffer,
        weight: &Self::Buffer,
        eps: f32,
        rows: usize,
        dim: usize,
        out: &mut Self::Buffer,
    );

    /// `out = x · wᵀ (+ bias)`: `x` is `[m, k]` activations, `w` is `[n, k]`; `out` is in
    /// the activation dtype or f32 (logits).
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        x: &Self::Buffer,
        w: &Self::Buffer,
        bias: Option<&Self::Buffer>,
        m: usize,
        n: usize,
        k: usize,
        out: MatmulOut<'_, Self>,
    );

    /// `acc += x` over `numel` elements (residual connection).
    fn add_assign(&self, acc: &mut Self::Buffer, x: &Self::Buffer, numel: usize);

    /// `out[i, j] = silu(gate_up[i, j]) * gate_up[i, ffn + j]`.
    fn silu_mul(&self, gate_up: &Self::Buffer, rows: usize, ffn: usize, out: &mut Self::Buffer);

    /// Per-head RMSNorm of the query and key heads of a fused QKV buffer (Qwen3).
    #[allow(clippy::too_many_arguments)]
    fn qk_norm(
        &self,
        qkv: &mut Self::Buffer,
        layout: QkvLayout,
        rows: usize,
        q_weight: &Self::Buffer,
        k_weight: &Self::Buffer,
        eps: f32,
    );

    /// NeoX-style rotary embedding of the query and key heads in place. `cos_sin` is
    /// `[max_positions, rotary_dim]`: `rotary_dim / 2` cosines then as many sines.
    fn rope(
        &self,
        qkv: &mut Self::Buffer,
        layout: QkvLayout,
        positions: &Self::Buffer,
        rows: usize,
        cos_sin: &Self::Buffer,
        rotary_dim: usize,
    );

    /// Writes each token's key and value heads to its slot (`block * block_size + offset`).
    #[allow(clippy::too_many_arguments)]
    fn kv_write(
        &self,
        qkv: &Self::Buffer,
        layout: QkvLayout,
        slot_mapping: &Self::Buffer,
        rows: usize,
        cache: CacheLayout,
        k_cache: &mut Self::Buffer,
        v_cache: &mut Self::Buffer,
    );

    /// [`Backend::rope`] then [`Backend::kv_write`]: the rotated keys and the values go to
    /// their cache slots. GPUs do both in one pass.
    #[allow(clippy::too_many_arguments)]
    fn rope_kv_write(
        &self,
        qkv: &mut Self::Buffer,
        layout: QkvLayout,
        positions: &Self::Buffer,
        rows: usize,
        cos_sin: &Self::Buffer,
        rotary_dim: usize,
        slot_mapping: &Self::Buffer,
        cache: CacheLayout,
        k_cache: &mut Self::Buffer,
        v_cache: &mut Self::Buffer,
    ) {
        self.rope(qkv, layout, positions, rows, cos_sin, rotary_dim);
        self.kv_write(qkv, layout, slot_mapping, rows, cache, k_cache, v_cache);
    }

    /// [`Backend::qk_norm`] then [`Backend::rope_kv_write`] (Qwen3's attention input), with
    /// the same results. GPUs fuse them where a step is a decode batch.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_kv_write(
        &self,
        qkv: &mut Self::Buffer,
        rows: usize,
        q_weight: &Self::Buffer,
        k_weight: &Self::Buffer,
        eps: f32,
        rope: RopeKvWrite<'_, Self>,
    ) {
        self.qk_norm(qkv, rope.layout, rows, q_weight, k_weight, eps);
        rope.apply(self, qkv, rows);
    }

    /// `out = (silu(gate) * up) · wᵀ` for `gate_up` rows of `[gate | up]`, each `ffn` wide:
    /// [`Backend::silu_mul`] into `act` then [`Backend::matmul`]. GPUs can feed the product
    /// to the matmul without writing `act`.
    #[allow(clippy::too_many_arguments)]
    fn silu_mul_matmul(
        &self,
        gate_up: &Self::Buffer,
        act: &mut Self::Buffer,
        w: &Self::Buffer,
        m: usize,
        n: usize,
        ffn: usize,
        out: MatmulOut<'_, Self>,
    ) {
        self.silu_mul(gate_up, m, ffn, act);
        self.matmul(act, w, None, m, n, ffn, out);
    }

    /// The gated MLP after its norm, `out = (silu(x · gateᵀ) * (x · upᵀ)) · downᵀ`, for
    /// `gate_up` = `[gate; up]` (`2 * ffn` rows of `k` weights) and `down` (`n` rows of
    /// `ffn`): [`Backend::matmul`] into `scratch.gate_up` (`[m, 2 * ffn]`), then
    /// [`Backend::silu_mul_matmul`] through `scratch.act` (`[m, ffn]`). A backend fuses the
    /// SiLU·mul where it pays: into the down product's reads, or the gate/up product's
    /// writes.
    #[allow(clippy::too_many_arguments)]
    fn gated_mlp(
        &self,
        x: &Self::Buffer,
        gate_up: &Self::Buffer,
        down: &Self::Buffer,
        m: usize,
        k: usize,
        ffn: usize,
        n: usize,
        scratch: MlpScratch<'_, Self>,
        out: MatmulOut<'_, Self>,
    ) {
        gated_mlp_in_two_products(self, x, gate_up, down, m, k, ffn, n, scratch, out);
    }

    /// `out = rms_norm(x) · wᵀ (+ bias)` for a norm whose weights are folded into `w`
    /// (`unit` holds `k` ones): [`Backend::rms_norm`] into `normed` (`[m, k]`), then
    /// [`Backend::matmul`].
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul(
        &self,
        x: &Self::Buffer,
        unit: &Self::Buffer,
        eps: f32,
        w: &Self::Buffer,
        bias: Option<&Self::Buffer>,
        m: usize,
        n: usize,
        k: usize,
        normed: &mut Self::Buffer,
        out: MatmulOut<'_, Self>,
    ) {
        rms_norm_then_matmul(self, x, unit, eps, w, bias, m, n, k, normed, out);
    }

    /// The attention input of a layer whose norm is folded into `w` (the fused QKV matrix,
    /// `layout.row_len()` rows): [`Backend::rms_norm_matmul`] into `qkv`, then
    /// [`Backend::rope_kv_write`].
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_qkv_rope_kv_write(
        &self,
        x: &Self::Buffer,
        unit: &Self::Buffer,
        eps: f32,
        w: &Self::Buffer,
        bias: Option<&Self::Buffer>,
        m: usize,
        k: usize,
        normed: &mut Self::Buffer,
        qkv: &mut Self::Buffer,
        rope: RopeKvWrite<'_, Self>,
    ) {
        rms_norm_qkv_then_rope_kv_write(self, x, unit, eps, w, bias, m, k, normed, qkv, rope);
    }

    /// `acc += x · wᵀ` (rows of `n`): [`Backend::matmul`] into `product`, then
    /// [`Backend::add_assign`].
    #[allow(clippy::too_many_arguments)]
    fn matmul_add(
        &self,
        x: &Self::Buffer,
        w: &Self::Buffer,
        m: usize,
        n: usize,
        k: usize,
        product: &mut Self::Buffer,
        acc: &mut Self::Buffer,
    ) {
        matmul_then_add(self, x, w, m, n, k, product, acc);
    }

    /// `residual += gated_mlp(rms_norm(residual))` for a norm whose weights are folded into
    /// `gate_up` (`unit` holds `k` ones; `down` has `k` rows): [`Backend::rms_norm`] into
    /// `normed`, [`Backend::gated_mlp`] into `product`, then [`Backend::add_assign`]. Where
    /// `accumulate` is false, `residual = gated_mlp(rms_norm(residual))`: a tensor-parallel
    /// rank after the first, whose partial sum the all-reduce adds to the first rank's
    /// residual.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_gated_mlp_add(
        &self,
        residual: &mut Self::Buffer,
        unit: &Self::Buffer,
        eps: f32,
        gate_up: &Self::Buffer,
        down: &Self::Buffer,
        m: usize,
        k: usize,
        ffn: usize,
        scratch: MlpScratch<'_, Self>,
        normed: &mut Self::Buffer,
        product: &mut Self::Buffer,
        accumulate: bool,
    ) {
        rms_norm_gated_mlp_then_add(
            self, residual, unit, eps, gate_up, down, m, k, ffn, scratch, normed, product,
            accumulate,
        );
    }

    /// `residual += moe(rms_norm(residual))` for a norm whose weights are folded into the
    /// router and the experts (`unit` holds `shape.dim` ones): [`Backend::rms_norm`] into
    /// `normed`, the router's product into `scratch.logits`, then [`Backend::moe`], with the
    /// routing in `scratch.ids` and `scratch.weights`. A backend may take the norm inside
    /// its router and expert kernels instead (then `normed` is not written).
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_moe_add(
        &self,
        residual: &mut Self::Buffer,
        unit: &Self::Buffer,
        eps: f32,
        layer: MoeLayer<'_, Self>,
        shape: MoeShape,
        scratch: MoeScratch<'_, Self>,
        normed: &mut Self::Buffer,
    ) {
        rms_norm_moe_then_add(self, residual, unit, eps, layer, shape, scratch, normed);
    }

    /// f32 elements of scratch [`Backend::paged_attention`] needs for steps of up to
    /// `max_seqs` sequences (split-context partial results on GPUs).
    fn attention_workspace_len(&self, _layout: QkvLayout, _max_seqs: usize) -> usize {
        0
    }

    /// Causal attention of every query token over its sequence's paged context.
    /// `out` is `[rows, num_heads * head_dim]`; `workspace` holds
    /// [`Backend::attention_workspace_len`] f32 elements.
    #[allow(clippy::too_many_arguments)]
    fn paged_attention(
        &self,
        qkv: &Self::Buffer,
        layout: QkvLayout,
        rows: usize,
        meta: &AttentionMetadata<'_, Self>,
        cache: CacheLayout,
        k_cache: &Self::Buffer,
        v_cache: &Self::Buffer,
        scale: f32,
        workspace: &mut Self::Buffer,
        out: &mut Self::Buffer,
    );

    /// `out[r] = argmax(logits[r, ..vocab])` as i32 for f32 `logits`: the first index of the
    /// largest value, as `torch.argmax` picks it.
    fn argmax(&self, logits: &Self::Buffer, rows: usize, vocab: usize, out: &mut Self::Buffer);

    /// Picks one token per row of f32 `logits` (`rows` rows of `vocab`) as
    /// [`sampling::sample_row`] does, with row `r`'s [`SampleRow`] from `params`, its
    /// [`LogitEdit`]s from `edits` and its token bitmask (if it has one) from `masks`, rows
    /// of [`sampling::mask_words`] words (all uploaded as raw words into I32 buffers); the
    /// edits and masks change `logits` in place. The ids go to i32 `out`.
    #[allow(clippy::too_many_arguments)]
    fn sample(
        &self,
        logits: &mut Self::Buffer,
        rows: usize,
        vocab: usize,
        params: &Self::Buffer,
        edits: &Self::Buffer,
        masks: &Self::Buffer,
        out: &mut Self::Buffer,
    );

    /// Whether [`Backend::sample`] runs on a device, where picking there saves sending the
    /// logits back; the engine then samples through it.
    fn samples_on_device(&self) -> bool {
        false
    }

    /// `out[i] = x[indices[i]]` for rows of `dim`.
    fn gather_rows(
        &self,
        x: &Self::Buffer,
        indices: &Self::Buffer,
        n: usize,
        dim: usize,
        out: &mut Self::Buffer,
    );

    /// `out[s] = Σ x[r]` over the rows `query_start_loc[s]..query_start_loc[s+1]` of
    /// sequence `s` (rows of `dim`), summed in f32 in row order into f32 `out`: mean
    /// pooling's sum, with no atomics, so a sequence's sum does not depend on its batch.
    fn segment_sum(
        &self,
        x: &Self::Buffer,
        query_start_loc: &Self::Buffer,
        num_seqs: usize,
        dim: usize,
        out: &mut Self::Buffer,
    );
    /// Routes each row of f32 router `logits` (`[shape.rows, shape.experts]`) to
    /// `shape.experts_per_token` experts as transformers' Qwen3-MoE and Mixtral do: softmax
    /// over every expert, the largest in descending order (the lower index first among
    /// equals), rescaled to sum to 1 where `renormalize`. The experts go to i32 `ids` and
    /// their weights to f32 `weights`, one per slot ([`MoeShape::slots`]).
    fn moe_route(
        &self,
        logits: &Self::Buffer,
        shape: MoeShape,
        renormalize: bool,
        ids: &mut Self::Buffer,
        weights: &mut Self::Buffer,
    );

    /// f32 elements of scratch [`Backend::moe_experts`] needs for steps up to `shape`.
    fn moe_workspace_len(&self, shape: MoeShape) -> usize;

    /// A mixture of experts' output, `out[r] = Σ_j weights[s] · expert_e(x[r])` over row
    /// `r`'s slots `s = r * experts_per_token + j` with `e = ids[s]`, summed in f32 in slot
    /// order, where `expert_e(x) = down_e · (silu(gate_e · x) * (up_e · x))`; where `add`,
    /// the sum, rounded to the activation dtype, is added to what `out` holds (the residual
    /// connection, as a product and an add would round it). `gate_up` stacks every expert's
    /// `[gate; up]` (`[experts, 2 * ffn, dim]`) and `down` every expert's down projection
    /// (`[experts, dim, ffn]`). The backend groups the slots by expert as it likes, so each
    /// expert's weights are read once for many of its rows. In a step of up to 64 rows (a
    /// decode batch) a row's result does not depend on the other rows; the CUDA and wgpu
    /// backends keep that at every step size.
    #[allow(clippy::too_many_arguments)]
    fn moe_experts(
        &self,
        x: &Self::Buffer,
        ids: &Self::Buffer,
        weights: &Self::Buffer,
        shape: MoeShape,
        gate_up: &Self::Buffer,
        down: &Self::Buffer,
        workspace: &mut Self::Buffer,
        out: &mut Self::Buffer,
        add: bool,
    );

    /// A mixture of experts' layer from its router's f32 `logits`: [`Backend::moe_route`]
    /// into `ids` and `weights`, then [`Backend::moe_experts`], with the same results. A
    /// backend may fuse the two where a step is small (CUDA routes inside its expert kernels
    /// at decode batch sizes, with the same bits as the separate ops).
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &self,
        x: &Self::Buffer,
        logits: &Self::Buffer,
        shape: MoeShape,
        renormalize: bool,
        gate_up: &Self::Buffer,
        down: &Self::Buffer,
        ids: &mut Self::Buffer,
        weights: &mut Self::Buffer,
        workspace: &mut Self::Buffer,
        out: &mut Self::Buffer,
        add: bool,
    ) {
        self.moe_route(logits, shape, renormalize, ids, weights);
        self.moe_experts(x, ids, weights, shape, gate_up, down, workspace, out, add);
    }
}
