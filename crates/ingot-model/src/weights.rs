//! Model weights on a backend: loaded once, converted to the requested dtype, with the
//! q/k/v and gate/up projections fused into single matrices where their dtypes agree.

use crate::checkpoint::{Checkpoint, HostTensor, Role};
use crate::config::ModelConfig;
use crate::moe::{MoeBuffers, MoeWeights};
use crate::tensor_parallel::TpRank;
use anyhow::{bail, ensure, Context, Result};
use half::{bf16, f16};
use indicatif::{ProgressBar, ProgressStyle};
use ingot_backend::quant::{dequantize_row, fp8};
use ingot_backend::{host_available_memory, Backend, DType, MatmulOut, MlpScratch};
use rayon::prelude::*;
use std::str::FromStr;

/// `--dtype`: `Auto` keeps the checkpoint's type (GGUF stays quantized). `Fp8` is
/// `--quantization fp8`: a 16- or 32-bit checkpoint's projections quantized to
/// [`DType::Fp8`] blocks at load, its embedding table, output projection and routers kept
/// as `Auto` keeps them (as vLLM's FP8 leaves them unquantized).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDType {
    Auto,
    F32,
    F16,
    BF16,
    Fp8,
}

impl WeightDType {
    /// The dtype asked for, or `None` for `auto`.
    pub fn fixed(self) -> Option<DType> {
        match self {
            WeightDType::Auto => None,
            WeightDType::F32 => Some(DType::F32),
            WeightDType::F16 => Some(DType::F16),
            WeightDType::BF16 => Some(DType::BF16),
            WeightDType::Fp8 => Some(DType::Fp8),
        }
    }

    /// The dtype a matrix stored as `stored` is converted to.
    pub fn apply(self, stored: DType) -> DType {
        self.fixed().unwrap_or(stored)
    }

    /// What the matrices that stay unquantized (embedding table, output projection,
    /// routers) are converted by.
    fn unquantized(self) -> WeightDType {
        match self {
            WeightDType::Fp8 => WeightDType::Auto,
            other => other,
        }
    }
}

impl FromStr for WeightDType {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => WeightDType::Auto,
            "f32" | "float32" => WeightDType::F32,
            "f16" | "float16" | "half" => WeightDType::F16,
            "bf16" | "bfloat16" => WeightDType::BF16,
            "fp8" | "fp8_e4m3" => WeightDType::Fp8,
            other => bail!("unknown dtype `{other}` (expected auto, f32, f16, bf16 or fp8)"),
        })
    }
}

/// Bytes of a backend's largest buffer left unused by the parts of a split matrix: room for
/// a backend's own block layout and padding (wgpu regroups Q8_0 blocks in pairs).
const PART_HEADROOM: usize = 256;

/// One stored matrix of a linear layer: `rows` output features, optional bias.
pub struct LinearPart<B: Backend> {
    pub weight: B::Buffer,
    pub rows: usize,
    pub bias: Option<B::Buffer>,
}

/// A linear layer whose output row is the concatenation of its parts' outputs.
pub struct Linear<B: Backend> {
    pub parts: Vec<LinearPart<B>>,
    pub in_features: usize,
}

impl<B: Backend> Linear<B> {
    pub fn out_features(&self) -> usize {
        self.parts.iter().map(|p| p.rows).sum()
    }

    /// `out[:rows, :out_features] = x · Wᵀ + b` with `out` rows of `out_features`.
    pub fn forward(&self, b: &B, x: &B::Buffer, rows: usize, out: &mut B::Buffer) {
        let ld = self.out_features();
        let mut col = 0;
        for p in &self.parts {
            let dst = MatmulOut {
                buf: &mut *out,
                row_stride: ld,
                col_offset: col,
            };
            b.matmul(
                x,
                &p.weight,
                p.bias.as_ref(),
                rows,
                p.rows,
                self.in_features,
                dst,
            );
            col += p.rows;
        }
    }

    /// `out = rms_norm(x) · Wᵀ + b` for a norm folded into W (`unit`: its weights, ones):
    /// one [`Backend::rms_norm_matmul`] for a matrix in one part; otherwise the norm into
    /// `normed`, then the parts.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_normed(
        &self,
        b: &B,
        x: &B::Buffer,
        unit: &B::Buffer,
        eps: f32,
        rows: usize,
        normed: &mut B::Buffer,
        out: &mut B::Buffer,
    ) {
        let k = self.in_features;
        match self.parts.as_slice() {
            [p] => {
                let dst = MatmulOut {
                    buf: out,
                    row_stride: p.rows,
                    col_offset: 0,
                };
                let bias = p.bias.as_ref();
                b.rms_norm_matmul(x, unit, eps, &p.weight, bias, rows, p.rows, k, normed, dst);
            }
            _ => {
                b.rms_norm(x, unit, eps, rows, k, normed);
                self.forward(b, normed, rows, out);
            }
        }
    }

    /// `acc += x · Wᵀ + b`, through `product` where the backend needs it.
    pub fn forward_add(
        &self,
        b: &B,
        x: &B::Buffer,
        rows: usize,
        product: &mut B::Buffer,
        acc: &mut B::Buffer,
    ) {
        match self.parts.as_slice() {
            [p] if p.bias.is_none() => {
                b.matmul_add(x, &p.weight, rows, p.rows, self.in_features, product, acc);
            }
            _ => {
                self.forward(b, x, rows, product);
                b.add_assign(acc, product, rows * self.out_features());
            }
        }
    }

    /// `out[i] = W[ids[i]]`: the matrix read as an embedding table, part by part.
    pub fn lookup(&self, b: &B, ids: &B::Buffer, n: usize, out: &mut B::Buffer) {
        let mut first = 0;
        for p in &self.parts {
            b.embedding(
                &p.weight,
                ids,
                n,
                self.in_features,
                first..first + p.rows,
                out,
            );
            first += p.rows;
        }
    }

    /// `out = (silu(gate) * up) · Wᵀ` for `gate_up` rows of `[gate | up]` (the MLP's down
    /// projection); `act` holds the product where it has to be written out.
    pub fn forward_silu(
        &self,
        b: &B,
        gate_up: &B::Buffer,
        act: &mut B::Buffer,
        rows: usize,
        out: &mut B::Buffer,
    ) {
        match self.parts.as_slice() {
            [p] if p.bias.is_none() => {
                let dst = MatmulOut {
                    buf: out,
                    row_stride: p.rows,
                    col_offset: 0,
                };
                b.silu_mul_matmul(gate_up, act, &p.weight, rows, p.rows, self.in_features, dst);
            }
            _ => {
                b.silu_mul(gate_up, rows, self.in_features, act);
                self.forward(b, act, rows, out);
            }
        }
    }
}

pub struct LayerWeights<B: Backend> {
    pub attn_norm: B::Buffer,
    pub qkv: Linear<B>,
    pub q_norm: Option<B::Buffer>,
    pub k_norm: Option<B::Buffer>,
    pub o: Linear<B>,
    pub ffn_norm: B::Buffer,
    pub mlp: Mlp<B>,
}

/// A layer's MLP: one gated MLP, or a mixture of experts.
pub enum Mlp<B: Backend> {
    Dense(DenseMlp<B>),
    Experts(MoeWeights<B>),
}

pub struct DenseMlp<B: Backend> {
    pub gate_up: Linear<B>,
    pub down: Linear<B>,
}

/// What a layer's MLP may write besides its output: the dense MLP's intermediates, and the
/// buffers of a mixture of experts where the model has one.
pub struct MlpBuffers<'a, B: Backend> {
    pub scratch: MlpScratch<'a, B>,
    pub moe: Option<&'a mut MoeBuffers<B>>,
}

impl<B: Backend> LayerWeights<B> {
    /// The layer's MLP of rows `x` into `out`.
    pub fn mlp(
        &self,
        b: &B,
        x: &B::Buffer,
        rows: usize,
        bufs: MlpBuffers<'_, B>,
        out: &mut B::Buffer,
    ) {
        match &self.mlp {
            Mlp::Dense(mlp) => mlp.forward(b, x, rows, bufs.scratch, out),
            Mlp::Experts(moe) => {
                let buf = bufs.moe.expect("a model with experts has their buffers");
                moe.forward(b, x, rows, buf, out, false)
            }
        }
    }

    /// `residual += mlp(rms_norm(residual))` with the norm folded into the matrices after
    /// it (`unit`: its weights, ones): one [`Backend::rms_norm_gated_mlp_add`] where the
    /// dense MLP is one gated MLP; otherwise the norm into `normed`, then the MLP into
    /// `product` and the add, or a mixture of experts adding into `residual` itself. Where
    /// `accumulate` is false (a tensor-parallel rank after the first),
    /// `residual = mlp(rms_norm(residual))`.
    #[allow(clippy::too_many_arguments)]
    pub fn mlp_add(
        &self,
        b: &B,
        residual: &mut B::Buffer,
        unit: &B::Buffer,
        eps: f32,
        rows: usize,
        bufs: MlpBuffers<'_, B>,
        normed: &mut B::Buffer,
        product: &mut B::Buffer,
        accumulate: bool,
    ) {
        match &self.mlp {
            Mlp::Dense(mlp) => mlp.forward_add(
                b,
                residual,
                unit,
                eps,
                rows,
                bufs.scratch,
                normed,
                product,
                accumulate,
            ),
            Mlp::Experts(moe) => {
                let buf = bufs.moe.expect("a model with experts has their buffers");
                moe.forward_add(b, residual, unit, eps, rows, buf, normed, accumulate);
            }
        }
    }
}

/// The one buffer of a stack of experts' matrices, as [`Backend::moe_experts`] reads them.
fn expert_stack<B: Backend>(linear: Linear<B>, what: &str) -> Result<B::Buffer> {
    let count = linear.parts.len();
    let mut parts = linear.parts.into_iter();
    match (parts.next(), parts.next()) {
        (Some(p), None) => Ok(p.weight),
        _ => bail!(
            "{what}: the experts' matrices make {count} buffers, not one (mixed dtypes, or \
             larger than this backend's largest buffer); a mixture of experts needs them in one"
        ),
    }
}

impl<B: Backend> DenseMlp<B> {
    /// The gated MLP, `out = down(silu(gate(x)) * up(x))`: one [`Backend::gated_mlp`]
    /// where gate/up and down are each one matrix without bias, so the backend can fuse.
    pub fn forward(
        &self,
        b: &B,
        x: &B::Buffer,
        rows: usize,
        scratch: MlpScratch<'_, B>,
        out: &mut B::Buffer,
    ) {
        match (self.gate_up.parts.as_slice(), self.down.parts.as_slice()) {
            ([gu], [d]) if gu.bias.is_none() && d.bias.is_none() => {
                let dst = MatmulOut {
                    buf: out,
                    row_stride: d.rows,
                    col_offset: 0,
                };
                let (k, ffn) = (self.gate_up.in_features, self.down.in_features);
                b.gated_mlp(x, &gu.weight, &d.weight, rows, k, ffn, d.rows, scratch, dst);
            }
            _ => {
                self.gate_up.forward(b, x, rows, scratch.gate_up);
                self.down
                    .forward_silu(b, scratch.gate_up, scratch.act, rows, out);
            }
        }
    }

    /// `residual += forward(rms_norm(residual))` with the norm folded into gate/up, or
    /// `residual = …` where it does not `accumulate`.
    #[allow(clippy::too_many_arguments)]
    fn forward_add(
        &self,
        b: &B,
        residual: &mut B::Buffer,
        unit: &B::Buffer,
        eps: f32,
        rows: usize,
        scratch: MlpScratch<'_, B>,
        normed: &mut B::Buffer,
        product: &mut B::Buffer,
        accumulate: bool,
    ) {
        let (k, ffn) = (self.gate_up.in_features, self.down.in_features);
        match (self.gate_up.parts.as_slice(), self.down.parts.as_slice()) {
            ([gu], [d]) if gu.bias.is_none() && d.bias.is_none() && d.rows == k => {
                let (gu, d) = (&gu.weight, &d.weight);
                b.rms_norm_gated_mlp_add(
                    residual, unit, eps, gu, d, rows, k, ffn, scratch, normed, product, accumulate,
                );
            }
            _ => {
                b.rms_norm(residual, unit, eps, rows, k, normed);
                let out = if accumulate {
                    &mut *product
                } else {
                    &mut *residual
                };
                self.forward(b, normed, rows, scratch, out);
                if accumulate {
                    b.add_assign(residual, product, rows * self.down.out_features());
                }
            }
        }
    }
}

pub struct Weights<B: Backend> {
    /// The dtype activations run in with these weights on their backend.
    pub activation_dtype: DType,
    /// The dtype the layers' matrices are kept in (the first query projection's).
    pub matrix_dtype: DType,
    /// The embedding table (also the output projection where the two are tied).
    pub embed: Linear<B>,
    pub layers: Vec<LayerWeights<B>>,
    pub final_norm: B::Buffer,
    /// `None` when the output projection is tied to the embedding.
    pub lm_head: Option<Linear<B>>,
    /// Where the layers' norm weights are folded into their qkv and gate/up matrices
    /// ([`Backend::folds_norm_weights`]): `hidden_size` ones, the weights those norms then
    /// take.
    pub unit_norm: Option<B::Buffer>,
    pub bytes: usize,
}

struct Loader<'a, B: Backend> {
    b: &'a B,
    ckpt: &'a Checkpoint,
    /// The whole model's config, which names and shapes the checkpoint's tensors (a
    /// tensor-parallel rank's are cut from them).
    full: &'a ModelConfig,
    tp: TpRank,
    dtype: WeightDType,
    activation: DType,
    bytes: usize,
    /// The host memory available now, on a backend whose buffers are host memory: a model
    /// larger than the machine is refused as it reaches the limit, with the sizes, instead
    /// of the process being killed for memory.
    available: Option<fn() -> Option<usize>>,
    progress: ProgressBar,
    /// Host buffers that stacked matrices were converted into, kept for the next stack:
    /// fresh ones as large as a layer's experts are page-faulted in anew for every layer
    /// (a 4-layer Qwen3-30B-A3B-shaped dummy model on the CPU, 2-core AMD VM: whole
    /// `bench latency` 33.8 and 28.0 s against 40.5 and 50.6 s, system time 15.0 against
    /// 23.1 s).
    spare: Vec<Vec<u8>>,
}

/// Host memory a host backend keeps free past the weights while loading them: the engine's
/// activations and KV cache come next.
const HOST_HEADROOM: usize = 1 << 30;

/// Elements converted per task: a multiple of every block length (32, 128, 256).
const CONVERT_CHUNK: usize = 1 << 16;

/// Appends `t`'s values in `target` (a float dtype, or FP8 blocks) to `out` (quantized data
/// dequantized first), each multiplied by `scale[c]` of its column `c` where `scale` is
/// given (a folded norm), converted on all cores: one thread took ~1.3 s for Qwen2-0.5B's
/// bf16 weights to f16 on a 2-core VM, so most of a minute for an 8B model.
fn convert_into(t: &HostTensor<'_>, target: DType, scale: Option<&[f32]>, out: &mut Vec<u8>) {
    if t.dtype == target && scale.is_none() {
        out.extend_from_slice(&t.data);
        return;
    }
    let width = target.block_bytes();
    let start = out.len();
    out.resize(start + target.bytes_for(t.numel()), 0);
    out[start..]
        .par_chunks_mut(target.bytes_for(CONVERT_CHUNK))
        .enumerate()
        .for_each(|(c, dst)| {
            let first = c * CONVERT_CHUNK;
            let len = dst.len() / width * target.block_len();
            let src = &t.data[t.dtype.bytes_for(first)..t.dtype.bytes_for(first + len)];
            let mut vals = vec![0f32; len];
            dequantize_row(t.dtype, src, &mut vals);
            if let Some(scale) = scale {
                for (i, v) in vals.iter_mut().enumerate() {
                    *v *= scale[(first + i) % scale.len()];
                }
            }
            if target == DType::Fp8 {
                fp8::quantize_row(&vals, dst);
                return;
            }
            let pieces = dst.chunks_exact_mut(width).zip(vals);
            match target {
                DType::F32 => pieces.for_each(|(o, v)| o.copy_from_slice(&v.to_le_bytes())),
                DType::F16 => {
                    pieces.for_each(|(o, v)| o.copy_from_slice(&f16::from_f32(v).to_le_bytes()))
                }
                DType::BF16 => {
                    pieces.for_each(|(o, v)| o.copy_from_slice(&bf16::from_f32(v).to_le_bytes()))
                }
                other => unreachable!("no conversion to {other}"),
            }
        });
}

impl<'a, B: Backend> Loader<'a, B> {
    fn get(&self, role: Role, layer: usize) -> Result<Option<HostTensor<'a>>> {
        let cut = self.tp.cut(role, self.full)?;
        let t = self.ckpt.tensor_part(role, layer, self.full, &cut)?;
        if t.is_some() {
            self.progress.inc(1);
        }
        Ok(t)
    }

    fn require(&self, role: Role, layer: usize) -> Result<HostTensor<'a>> {
        self.get(role, layer)?.with_context(|| {
            format!(
                "{}: missing weight {role:?} of layer {layer}",
                self.ckpt.path().display()
            )
        })
    }

    fn upload(&mut self, dtype: DType, numel: usize, bytes: &[u8]) -> Result<B::Buffer> {
        if let Some(avail) = self.available.and_then(|available| available()) {
            let gib = |n: usize| n as f64 / (1u64 << 30) as f64;
            ensure!(
                avail >= 2 * bytes.len() + HOST_HEADROOM,
                "{}: the weights do not fit in this machine's memory: {:.2} GiB loaded, {:.2} GiB \
                 available, and the next tensor takes {:.2} GiB (loading holds about twice a \
                 tensor's size while it converts the next, and leaves {:.0} GiB for the rest)",
                self.ckpt.path().display(),
                gib(self.bytes),
                gib(avail),
                gib(bytes.len()),
                gib(HOST_HEADROOM)
            );
        }
        let mut buf = self.b.alloc(dtype, numel)?;
        self.b.upload(&mut buf, bytes)?;
        self.bytes += bytes.len();
        Ok(buf)
    }

    /// Values as the requested dtype holds them: a converted checkpoint is the same model
    /// whichever tensors the kernels keep in f32 (norms, biases).
    fn rounded_f32(&self, mut v: Vec<f32>) -> Vec<f32> {
        match self.dtype {
            WeightDType::Auto | WeightDType::F32 | WeightDType::Fp8 => {}
            WeightDType::F16 => v.iter_mut().for_each(|x| *x = f16::from_f32(*x).to_f32()),
            WeightDType::BF16 => v.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32()),
        }
        v
    }

    /// A 1-D weight (norm or bias) as f32, checked to have `len` values.
    fn vector(&mut self, t: &HostTensor<'_>, len: usize, what: &str) -> Result<B::Buffer> {
        Ok(self.vector_and_values(t, len, what)?.0)
    }

    /// [`Loader::vector`] and its values on the host (a norm to fold).
    fn vector_and_values(
        &mut self,
        t: &HostTensor<'_>,
        len: usize,
        what: &str,
    ) -> Result<(B::Buffer, Vec<f32>)> {
        ensure!(
            t.numel() == len,
            "{what}: expected {len} values, found shape {:?}",
            t.shape
        );
        let data = self.rounded_f32(t.to_f32());
        self.ckpt.release(t);
        let buf = self.upload(DType::F32, len, bytemuck::cast_slice(&data))?;
        Ok((buf, data))
    }

    /// The dtype a matrix is kept in on the backend.
    fn matrix_dtype(&self, t: &HostTensor<'_>) -> DType {
        self.b
            .weight_dtype(self.dtype.apply(t.dtype), self.activation)
    }

    /// Stacks matrices with the same input width into as few parts as their dtypes allow;
    /// with `norm`, the weights of the norm before them folded in (column `c` times
    /// `norm[c]`), which needs float matrices: a block-format one is kept in the activation
    /// dtype.
    fn linear(
        &mut self,
        mats: Vec<(HostTensor<'_>, Option<HostTensor<'_>>, usize)>,
        in_features: usize,
        norm: Option<&[f32]>,
        what: &str,
    ) -> Result<Linear<B>> {
        self.stack(mats, in_features, norm, what, B::weight_dtype, self.dtype)
    }

    /// [`Loader::linear`] for a matrix that `--quantization` leaves as it is (the embedding
    /// table, the output projection, a router).
    fn unquantized_linear(
        &mut self,
        mats: Vec<(HostTensor<'_>, Option<HostTensor<'_>>, usize)>,
        in_features: usize,
        norm: Option<&[f32]>,
        what: &str,
    ) -> Result<Linear<B>> {
        let dtype = self.dtype.unquantized();
        self.stack(mats, in_features, norm, what, B::weight_dtype, dtype)
    }

    /// [`Loader::linear`] with `kept(backend, stored, activation)` the dtype each matrix is
    /// kept in ([`Backend::expert_weight_dtype`] for a mixture's experts), converted by
    /// `asked`.
    fn stack(
        &mut self,
        mats: Vec<(HostTensor<'_>, Option<HostTensor<'_>>, usize)>,
        in_features: usize,
        norm: Option<&[f32]>,
        what: &str,
        kept: fn(&B, DType, DType) -> DType,
        asked: WeightDType,
    ) -> Result<Linear<B>> {
        let mut parts: Vec<LinearPart<B>> = vec![];
        // (dtype, stacked rows, row count, stacked biases)
        type Stack = (DType, Vec<u8>, usize, Option<Vec<f32>>);
        let mut pending: Vec<Stack> = vec![];
        for (w, bias, rows) in mats {
            ensure!(
                w.shape == [rows, in_features],
                "{what}: expected shape [{rows}, {in_features}], found {:?}",
                w.shape
            );
            let mut dtype = kept(self.b, asked.apply(w.dtype), self.activation);
            ensure!(
                asked != WeightDType::Fp8 || dtype == DType::Fp8,
                "--quantization fp8 is not supported for {what} on {}: it has no FP8 kernels \
                 for them",
                self.b.name()
            );
            if norm.is_some() && dtype.block_len() > 1 {
                tracing::warn!(
                    "{what}: {dtype} kept as {} to fold its norm",
                    self.activation
                );
                dtype = self.activation;
            }
            ensure!(
                in_features.is_multiple_of(dtype.block_len()),
                "{what}: {in_features} columns are not whole {dtype} blocks"
            );
            let bias = match bias {
                Some(b) => {
                    ensure!(
                        b.numel() == rows,
                        "{what}: bias of {} values for {rows} rows",
                        b.numel()
                    );
                    let v = self.rounded_f32(b.to_f32());
                    self.ckpt.release(&b);
                    Some(v)
                }
                None => None,
            };
            let joins_last = pending
                .last()
                .is_some_and(|last| last.0 == dtype && last.3.is_some() == bias.is_some());
            if !joins_last {
                let mut data = self.spare.pop().unwrap_or_default();
                data.clear();
                pending.push((dtype, data, 0, bias.as_ref().map(|_| vec![])));
            }
            let last = pending.last_mut().expect("a stack to join");
            convert_into(&w, dtype, norm, &mut last.1);
            self.ckpt.release(&w);
            last.2 += rows;
            if let (Some(acc), Some(b)) = (last.3.as_mut(), bias) {
                acc.extend(b);
            }
        }
        // A stack larger than the backend's largest buffer goes in several, by rows.
        let max = self.b.max_buffer_bytes();
        for (dtype, data, rows, bias) in pending {
            let row_bytes = dtype.bytes_for(in_features);
            let per_part = match max {
                Some(max) => {
                    let n = max.saturating_sub(PART_HEADROOM) / row_bytes;
                    ensure!(
                        n > 0,
                        "{what}: a row of {row_bytes} bytes does not fit this backend's largest \
                         buffer of {max} bytes"
                    );
                    n.min(rows)
                }
                None => rows,
            };
            if per_part < rows {
                tracing::debug!("{what}: {rows} rows in parts of {per_part}");
            }
            for r0 in (0..rows).step_by(per_part) {
                let r1 = (r0 + per_part).min(rows);
                let bytes = &data[r0 * row_bytes..r1 * row_bytes];
                let weight = self.upload(dtype, (r1 - r0) * in_features, bytes)?;
                let bias = match &bias {
                    Some(b) => {
                        Some(self.upload(DType::F32, r1 - r0, bytemuck::cast_slice(&b[r0..r1]))?)
                    }
                    None => None,
                };
                parts.push(LinearPart {
                    weight,
                    rows: r1 - r0,
                    bias,
                });
            }
            self.spare.push(data);
        }
        Ok(Linear { parts, in_features })
    }
}

impl<B: Backend> Weights<B> {
    pub fn load(
        b: &B,
        ckpt: &Checkpoint,
        cfg: &ModelConfig,
        dtype: WeightDType,
    ) -> Result<Weights<B>> {
        Self::load_shard(b, ckpt, cfg, TpRank::SINGLE, dtype)
    }

    /// Rank `tp`'s share of the weights of the model `full` ([`crate::tensor_parallel`]):
    /// only that share is converted and placed on `b`.
    pub fn load_shard(
        b: &B,
        ckpt: &Checkpoint,
        full: &ModelConfig,
        tp: TpRank,
        dtype: WeightDType,
    ) -> Result<Weights<B>> {
        let available = b
            .runs_on_host_cpu()
            .then_some(host_available_memory as fn() -> Option<usize>);
        Self::load_within(b, ckpt, full, tp, dtype, available)
    }

    /// [`Weights::load_shard`], asking `available` for the memory left before each tensor
    /// is placed, where the backend's buffers are host memory.
    fn load_within(
        b: &B,
        ckpt: &Checkpoint,
        full: &ModelConfig,
        tp: TpRank,
        dtype: WeightDType,
        available: Option<fn() -> Option<usize>>,
    ) -> Result<Weights<B>> {
        let local = tp.shard_config(full)?;
        let cfg = &local;
        let progress = ProgressBar::new(ckpt.tensor_count() as u64).with_style(
            ProgressStyle::with_template("loading weights {bar:40} {pos}/{len} tensors")
                .expect("valid template"),
        );
        // The first layer's query projection stands for the checkpoint's matrix dtype.
        let q0 = ckpt
            .tensor(Role::Q, 0, full)?
            .with_context(|| format!("{}: missing weight Q of layer 0", ckpt.path().display()))?;
        ensure!(
            dtype != WeightDType::Fp8 || !q0.dtype.is_quantized() || q0.dtype == DType::Fp8,
            "--quantization fp8 quantizes 16- and 32-bit checkpoints; {} holds {} matrices",
            ckpt.path().display(),
            q0.dtype
        );
        let activation = b.activation_dtype(dtype.apply(q0.dtype));
        // Folding norms needs float matrices (the first query projection's dtype stands
        // for them).
        let fold = b.folds_norm_weights()
            && b.weight_dtype(dtype.apply(q0.dtype), activation)
                .block_len()
                == 1;
        let mut l = Loader {
            b,
            ckpt,
            full,
            tp,
            dtype,
            activation,
            bytes: 0,
            available,
            progress,
            spare: vec![],
        };
        let (d, f) = (cfg.hidden_size, cfg.intermediate_size);
        let embed_t = l.require(Role::Embed, 0)?;
        ensure!(
            embed_t.shape == [cfg.vocab_size, d],
            "embedding: expected [{}, {d}], found {:?}",
            cfg.vocab_size,
            embed_t.shape
        );
        let embed =
            l.unquantized_linear(vec![(embed_t, None, cfg.vocab_size)], d, None, "embedding")?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let what = |s: &str| format!("layer {i} {s}");
            let attn_norm = l.require(Role::AttnNorm, i)?;
            let (attn_norm, attn_g) =
                l.vector_and_values(&attn_norm, d, &what("attention norm"))?;
            let bias = |r: Role| {
                if cfg.qkv_bias {
                    l.require(r, i).map(Some)
                } else {
                    l.get(r, i)
                }
            };
            let (q, k, v) = (
                l.require(Role::Q, i)?,
                l.require(Role::K, i)?,
                l.require(Role::V, i)?,
            );
            let (qb, kb, vb) = (bias(Role::QBias)?, bias(Role::KBias)?, bias(Role::VBias)?);
            let qkv = l.linear(
                vec![
                    (q, qb, cfg.q_size()),
                    (k, kb, cfg.kv_size()),
                    (v, vb, cfg.kv_size()),
                ],
                d,
                fold.then_some(&attn_g[..]),
                &what("qkv"),
            )?;
            let (q_norm, k_norm) = if cfg.qk_norm {
                let (qn, kn) = (l.require(Role::QNorm, i)?, l.require(Role::KNorm, i)?);
                (
                    Some(l.vector(&qn, cfg.head_dim, &what("q norm"))?),
                    Some(l.vector(&kn, cfg.head_dim, &what("k norm"))?),
                )
            } else {
                (None, None)
            };
            let o = l.require(Role::O, i)?;
            let o = l.linear(vec![(o, None, d)], cfg.q_size(), None, &what("o_proj"))?;
            let ffn_norm = l.require(Role::FfnNorm, i)?;
            let (ffn_norm, ffn_g) = l.vector_and_values(&ffn_norm, d, &what("ffn norm"))?;
            let ffn_fold = fold.then_some(&ffn_g[..]);
            let mlp = match &cfg.moe {
                Some(moe) if moe.is_sparse(i) => {
                    let (n, ef) = (moe.num_experts, moe.expert_intermediate_size);
                    let router = l.require(Role::Router, i)?;
                    let router = l.unquantized_linear(
                        vec![(router, None, n)],
                        d,
                        ffn_fold,
                        &what("router"),
                    )?;
                    let mut gate_up = vec![];
                    let mut down = vec![];
                    for e in 0..n {
                        gate_up.push((l.require(Role::ExpertGate(e), i)?, None, ef));
                        gate_up.push((l.require(Role::ExpertUp(e), i)?, None, ef));
                        down.push((l.require(Role::ExpertDown(e), i)?, None, d));
                    }
                    let kept = B::expert_weight_dtype;
                    let gate_up =
                        l.stack(gate_up, d, ffn_fold, &what("experts' gate/up"), kept, dtype)?;
                    let down = l.stack(down, ef, None, &what("experts' down"), kept, dtype)?;
                    Mlp::Experts(MoeWeights {
                        router,
                        gate_up: expert_stack(gate_up, &what("experts' gate/up"))?,
                        down: expert_stack(down, &what("experts' down"))?,
                        num_experts: n,
                        ffn: ef,
                        experts_per_token: moe.experts_per_token,
                        renormalize: moe.renormalize,
                    })
                }
                _ => {
                    let (g, u) = (l.require(Role::Gate, i)?, l.require(Role::Up, i)?);
                    let gate_up = l.linear(
                        vec![(g, None, f), (u, None, f)],
                        d,
                        ffn_fold,
                        &what("gate/up"),
                    )?;
                    let down = l.require(Role::Down, i)?;
                    let down = l.linear(vec![(down, None, d)], f, None, &what("down_proj"))?;
                    Mlp::Dense(DenseMlp { gate_up, down })
                }
            };
            layers.push(LayerWeights {
                attn_norm,
                qkv,
                q_norm,
                k_norm,
                o,
                ffn_norm,
                mlp,
            });
        }
        let final_norm = l.require(Role::FinalNorm, 0)?;
        let final_norm = l.vector(&final_norm, d, "final norm")?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            let t = l.require(Role::LmHead, 0)?;
            Some(l.unquantized_linear(vec![(t, None, cfg.vocab_size)], d, None, "lm_head")?)
        };
        l.progress.finish_and_clear();
        let kept = l.matrix_dtype(&q0);
        if kept != dtype.apply(q0.dtype) {
            tracing::info!(
                "{} has no kernels for {} matrices: converted to {kept} at load",
                b.name(),
                dtype.apply(q0.dtype)
            );
        }
        let unit_norm = if fold {
            tracing::info!(
                "{}: norm weights folded into the matrices after them",
                b.name()
            );
            Some(l.upload(DType::F32, d, bytemuck::cast_slice(&vec![1f32; d]))?)
        } else {
            None
        };
        Ok(Weights {
            activation_dtype: activation,
            unit_norm,
            matrix_dtype: kept,
            embed,
            layers,
            final_norm,
            lm_head,
            bytes: l.bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ingot_backend::quant::testing::random_quant_row;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::borrow::Cow;

    /// Weights past the memory a host backend has are refused with the sizes; the same
    /// model loads with room for it, or where the memory cannot be read.
    #[test]
    fn weights_past_the_host_memory_are_refused() {
        use crate::synthetic::SyntheticSpec;
        use crate::Arch;
        let dir = std::env::temp_dir().join(format!("ingot-room-{}", std::process::id()));
        SyntheticSpec::tiny(Arch::Llama).write(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let cfg = ckpt.config().unwrap();
        let b = ingot_backend::cpu::CpuBackend::new(Some(1)).unwrap();
        let load = |available| {
            Weights::load_within(
                &b,
                &ckpt,
                &cfg,
                TpRank::SINGLE,
                WeightDType::Auto,
                available,
            )
        };
        let little: fn() -> Option<usize> = || Some(HOST_HEADROOM + 1000);
        let e = load(Some(little)).err().expect("no room").to_string();
        assert!(e.contains("do not fit in this machine's memory"), "{e}");
        let plenty: fn() -> Option<usize> = || Some(4 * HOST_HEADROOM);
        let unknown: fn() -> Option<usize> = || None;
        let all = load(None).unwrap().bytes;
        assert_eq!(load(Some(plenty)).unwrap().bytes, all);
        assert_eq!(load(Some(unknown)).unwrap().bytes, all);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The parallel conversion equals converting each value alone, over several chunks and
    /// a partial last one, from floats and from blocks.
    #[test]
    fn conversion_matches_value_by_value() {
        let mut rng = StdRng::seed_from_u64(3);
        let n = 3 * CONVERT_CHUNK + 256 * 5;
        for from in [DType::BF16, DType::F32, DType::Q8_0, DType::Q4K] {
            let t = HostTensor {
                dtype: from,
                shape: vec![n],
                data: Cow::Owned(match from {
                    DType::BF16 => (0..n)
                        .flat_map(|_| bf16::from_f32(rng.random::<f32>() - 0.5).to_le_bytes())
                        .collect(),
                    DType::F32 => (0..n)
                        .flat_map(|_| (rng.random::<f32>() - 0.5).to_le_bytes())
                        .collect(),
                    _ => random_quant_row(from, n, &mut rng),
                }),
                mapped: &[],
            };
            let vals = t.to_f32();
            for to in [DType::F32, DType::F16, DType::BF16] {
                let want: Vec<u8> = match to {
                    DType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    DType::F16 => vals
                        .iter()
                        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                        .collect(),
                    _ => vals
                        .iter()
                        .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                        .collect(),
                };
                // Appended after what the buffer holds.
                let mut got = vec![7u8; 3];
                convert_into(&t, to, None, &mut got);
                assert!(got[..3] == [7; 3] && got[3..] == want, "{from} -> {to}");
            }
            let mut want = vec![0u8; DType::Fp8.bytes_for(n)];
            fp8::quantize_row(&vals, &mut want);
            let mut got = vec![7u8; 3];
            convert_into(&t, DType::Fp8, None, &mut got);
            assert!(got[..3] == [7; 3] && got[3..] == want, "{from} -> fp8");
        }
    }
}
