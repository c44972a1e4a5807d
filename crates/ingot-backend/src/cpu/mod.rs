//! The CPU backend: plain Rust over host memory. Ops split their work over a spinning
//! worker team ([`team`]); f32 GEMMs run on the `gemm` crate's rayon parallelism.
//! It is both a serving backend and the reference the GPU backends are tested against.

mod attention;
mod attention16;
mod buffer;
mod collective;
mod matmul;
pub mod moe;
mod profile;
mod team;
mod topology;

pub use buffer::CpuBuffer;
pub use collective::{HostGroup, HostRank};
pub use matmul::GEMV_MAX_ROWS;
pub use topology::default_threads;

use crate::quant::dequantize_row;
use crate::{
    AttentionMetadata, Backend, CacheLayout, DType, LogitEdit, MatmulOut, MoeShape, QkvLayout,
    SampleRow,
};
use half::slice::HalfFloatSliceExt;
use std::ops::Range;
use std::sync::Mutex;

/// A raw pointer that parallel tasks may share because each writes a disjoint part.
pub struct SendPtr<T = f32>(pub *mut T);
// SAFETY: only used for disjoint writes, see the users.
unsafe impl<T: Send> Send for SendPtr<T> {}
unsafe impl<T: Send> Sync for SendPtr<T> {}

impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so that closures capture the `Sync` wrapper, not the field).
    pub fn get(self) -> *mut T {
        self.0
    }
}

pub struct CpuBackend {
    pool: rayon::ThreadPool,
    team: team::Team,
    scratch: Mutex<matmul::ActivationScratch>,
    profile: profile::OpProfiler,
    fold_norms: bool,
}

/// Matrix `i` of `n` rows of `k` in a buffer of such matrices stacked (a plain matrix is
/// matrix 0), as the matmul reads it.
fn stacked_matrix(w: &CpuBuffer, i: usize, n: usize, k: usize) -> matmul::Weight<'_> {
    match w.dtype() {
        DType::F32 => matmul::Weight::F32(&w.f32()[i * n * k..][..n * k]),
        d => {
            let len = d.bytes_for(n * k);
            matmul::Weight::Bytes(d, &w.bytes()[i * len..][..len])
        }
    }
}

impl CpuBackend {
    /// [`matmul::matmul`] on the worker pool with the backend's activation scratch.
    ///
    /// # Safety
    /// As [`matmul::matmul`]: `dst` is valid for writes of `m` rows of `n` at its stride,
    /// and nothing else aliases them during the call.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run_matmul(
        &self,
        x: &[f32],
        w: matmul::Weight<'_>,
        m: usize,
        n: usize,
        k: usize,
        dst: matmul::Dst,
    ) {
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let scratch: &mut matmul::ActivationScratch = &mut guard;
        // SAFETY: the caller's guarantee.
        self.pool
            .install(|| unsafe { matmul::matmul(x, w, m, n, k, dst, scratch, &self.team) });
    }

    /// A backend running on `threads` threads (one per physical core when `None`).
    pub fn new(threads: Option<usize>) -> anyhow::Result<Self> {
        let threads = threads.unwrap_or_else(topology::default_threads);
        anyhow::ensure!(threads > 0, "--threads must be at least 1");
        crate::quant::Isa::from_env()?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("ingot-cpu-{i}"))
            .build()?;
        Ok(CpuBackend {
            pool,
            team: team::Team::new(threads)?,
            scratch: Mutex::new(matmul::ActivationScratch::default()),
            profile: profile::OpProfiler::default(),
            fold_norms: false,
        })
    }

    /// This backend with models loaded as [`Backend::folds_norm_weights`] says: the CPU
    /// reference of a GPU that folds them computes the same model.
    pub fn folding_norm_weights(mut self, fold: bool) -> Self {
        self.fold_norms = fold;
        self
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }
}

/// `1 / sqrt(mean(x²) + eps)`.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = inv_rms(x, eps);
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * inv * g;
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;

    fn name(&self) -> String {
        format!(
            "cpu ({} threads, {} kernels)",
            self.threads(),
            crate::quant::Isa::selected().name()
        )
    }

    /// The CPU runs every model in f32: its integer and `gemm` kernels take f32 rows.
    fn activation_dtype(&self, _weights: DType) -> DType {
        DType::F32
    }

    fn weight_dtype(&self, stored: DType, _activation: DType) -> DType {
        stored
    }

    fn folds_norm_weights(&self) -> bool {
        self.fold_norms
    }

    fn supports_kv_cache_dtype(&self, dtype: DType) -> bool {
        matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
    }

    fn runs_on_host_cpu(&self) -> bool {
        true
    }

    /// Ranks meet in host memory ([`HostGroup`]).
    fn tensor_parallel_group(
        devices: &[Self],
    ) -> anyhow::Result<Vec<std::sync::Arc<dyn crate::Collective<Self>>>> {
        Ok(HostGroup::ranks(devices.len())
            .into_iter()
            .map(|r| std::sync::Arc::new(r) as std::sync::Arc<dyn crate::Collective<Self>>)
            .collect())
    }

    /// f32 models keep an f32 cache (exact, batch-invariant runs); a quantized or 16-bit
    /// model's values carry 16-bit precision at best, so its cache is f16: half the memory
    /// and half the bytes attention reads.
    fn auto_kv_cache_dtype(&self, weights: DType, _activation: DType) -> DType {
        if weights == DType::F32 {
            DType::F32
        } else {
            DType::F16
        }
    }

    fn alloc(&self, dtype: DType, numel: usize) -> anyhow::Result<CpuBuffer> {
        anyhow::ensure!(
            numel.is_multiple_of(dtype.block_len()),
            "{numel} elements are not whole {dtype} blocks"
        );
        CpuBuffer::zeroed(dtype, numel)
    }

    fn upload(&self, dst: &mut CpuBuffer, bytes: &[u8]) -> anyhow::Result<()> {
        let d = dst.bytes_mut();
        anyhow::ensure!(
            bytes.len() <= d.len(),
            "upload of {} bytes into {} bytes",
            bytes.len(),
            d.len()
        );
        d[..bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn download_f32(&self, src: &CpuBuffer, numel: usize) -> anyhow::Result<Vec<f32>> {
        Ok(src.f32()[..numel].to_vec())
    }

    fn synchronize(&self) -> anyhow::Result<()> {
        Ok(())
    }

    fn download_i32(&self, src: &CpuBuffer, n: usize) -> anyhow::Result<Vec<i32>> {
        Ok(src.i32()[..n].to_vec())
    }

    fn run_step<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        // The step runs on a pool thread, so the f32 GEMMs' rayon work needs no hand-off.
        self.pool.install(f)
    }

    fn start_op_profile(&self) -> anyhow::Result<()> {
        self.profile.start();
        Ok(())
    }

    /// Wall time per op (the CPU's ops finish inside their call).
    fn op_profile(&self) -> Vec<(String, u64, f64)> {
        self.profile.totals()
    }

    fn embedding(
        &self,
        table: &CpuBuffer,
        ids: &CpuBuffer,
        n: usize,
        dim: usize,
        vocab_rows: Range<usize>,
        out: &mut CpuBuffer,
    ) {
        let _t = self.profile.time(|| "embedding".into());
        let rb = table.row_bytes(dim);
        let bytes = table.bytes();
        assert!(
            vocab_rows.len() * rb <= bytes.len(),
            "embedding table of {} bytes holds fewer than {} rows",
            bytes.len(),
            vocab_rows.len()
        );
        let ids = &ids.i32()[..n];
        self.team
            .chunks_mut(&mut out.f32_mut()[..n * dim], dim, |i, o| {
                let id = ids[i] as usize;
                if vocab_rows.contains(&id) {
                    let r = id - vocab_rows.start;
                    dequantize_row(table.dtype(), &bytes[r * rb..(r + 1) * rb], o);
                }
            });
    }

    fn rms_norm(
        &self,
        x: &CpuBuffer,
        weight: &CpuBuffer,
        eps: f32,
        rows: usize,
        dim: usize,
        out: &mut CpuBuffer,
    ) {
        let _t = self.profile.time(|| "rms_norm".into());
        let (x, w) = (&x.f32()[..rows * dim], &weight.f32()[..dim]);
        self.team
            .chunks_mut(&mut out.f32_mut()[..rows * dim], dim, |i, o| {
                rms_norm_row(&x[i * dim..][..dim], w, eps, o)
            });
    }

    fn add_rms_norm(
        &self,
        residual: &mut CpuBuffer,
        x: &CpuBuffer,
        weight: &CpuBuffer,
        eps: f32,
        rows: usize,
        dim: usize,
        out: &mut CpuBuffer,
    ) {
        let _t = self.profile.time(|| "add_rms_norm".into());
        let (x, w) = (&x.f32()[..rows * dim], &weight.f32()[..dim]);
        let residual = SendPtr(residual.f32_mut()[..rows * dim].as_mut_ptr());
        self.team
            .chunks_mut(&mut out.f32_mut()[..rows * dim], dim, |i, o| {
                // SAFETY: row `i` of the residual, borrowed mutably above, is touched by
                // this task only.
                let r = unsafe { std::slice::from_raw_parts_mut(residual.get().add(i * dim), dim) };
                r.iter_mut()
                    .zip(&x[i * dim..][..dim])
                    .for_each(|(r, &x)| *r += x);
                rms_norm_row(r, w, eps, o)
            });
    }

    fn matmul(
        &self,
        x: &CpuBuffer,
        w: &CpuBuffer,
        bias: Option<&CpuBuffer>,
        m: usize,
        n: usize,
        k: usize,
        out: MatmulOut<'_, Self>,
    ) {
        let _t = self.profile.time(|| format!("matmul m{m} n{n} k{k}"));
        let MatmulOut {
            buf,
            row_stride: ld,
            col_offset,
        } = out;
        assert!(
            col_offset + n <= ld,
            "matmul output columns {col_offset}+{n} exceed the row of {ld}"
        );
        let o = buf.f32_mut();
        assert!(
            m == 0 || o.len() >= (m - 1) * ld + col_offset + n,
            "matmul output too small"
        );
        assert_eq!(w.numel(), n * k, "weight is not [{n}, {k}]");
        let dst = matmul::Dst {
            ptr: SendPtr(o[col_offset..].as_mut_ptr()),
            ld,
        };
        // SAFETY: `o` is borrowed mutably for the call and its size was checked above.
        unsafe { self.run_matmul(&x.f32()[..m * k], stacked_matrix(w, 0, n, k), m, n, k, dst) };
        if let Some(b) = bias {
            let b = &b.f32()[..n];
            for i in 0..m {
                for (o, &b) in o[i * ld + col_offset..][..n].iter_mut().zip(b) {
                    *o += b;
                }
            }
        }
    }

    fn add_assign(&self, acc: &mut CpuBuffer, x: &CpuBuffer, numel: usize) {
        let _t = self.profile.time(|| "add_assign".into());
        for (a, &b) in acc.f32_mut()[..numel].iter_mut().zip(&x.f32()[..numel]) {
            *a += b;
        }
    }

    fn silu_mul(&self, gate_up: &CpuBuffer, rows: usize, ffn: usize, out: &mut CpuBuffer) {
        let _t = self.profile.time(|| "silu_mul".into());
        // Pieces of a row rather than whole rows: a decode step's one row (an `exp` per
        // element) is then shared by the team.
        const PIECE: usize = 512;
        let gu = &gate_up.f32()[..rows * 2 * ffn];
        let pieces = ffn.div_ceil(PIECE);
        let out = SendPtr(out.f32_mut()[..rows * ffn].as_mut_ptr());
        self.team.run(rows * pieces, |t| {
            let (r, c0) = (t / pieces, (t % pieces) * PIECE);
            let len = PIECE.min(ffn - c0);
            let (g, u) = (
                &gu[r * 2 * ffn + c0..][..len],
                &gu[r * 2 * ffn + ffn + c0..][..len],
            );
            // SAFETY: each task writes its own piece of the output, borrowed mutably above.
            let o = unsafe { std::slice::from_raw_parts_mut(out.get().add(r * ffn + c0), len) };
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = g / (1.0 + (-g).exp()) * u;
            }
        });
    }

    fn qk_norm(
        &self,
        qkv: &mut CpuBuffer,
        layout: QkvLayout,
        rows: usize,
        q_weight: &CpuBuffer,
        k_weight: &CpuBuffer,
        eps: f32,
    ) {
        let _t = self.profile.time(|| "qk_norm".into());
        let hd = layout.head_dim;
        let (qw, kw) = (&q_weight.f32()[..hd], &k_weight.f32()[..hd]);
        for row in qkv.f32_mut()[..rows * layout.row_len()].chunks_mut(layout.row_len()) {
            for (h, x) in row[..(layout.num_heads + layout.num_kv_heads) * hd]
                .chunks_mut(hd)
                .enumerate()
            {
                let w = if h < layout.num_heads { qw } else { kw };
                let inv = inv_rms(x, eps);
                x.iter_mut().zip(w).for_each(|(v, g)| *v = *v * inv * g);
            }
        }
    }

    fn rope(
        &self,
        qkv: &mut CpuBuffer,
        layout: QkvLayout,
        positions: &CpuBuffer,
        rows: usize,
        cos_sin: &CpuBuffer,
        rotary_dim: usize,
    ) {
        let _t = self.profile.time(|| "rope".into());
        let half = rotary_dim / 2;
        let (hd, heads) = (layout.head_dim, layout.num_heads + layout.num_kv_heads);
        let table = cos_sin.f32();
        let pos = &positions.i32()[..rows];
        self.team.chunks_mut(
            &mut qkv.f32_mut()[..rows * layout.row_len()],
            layout.row_len(),
            |i, row| {
                let cs = &table[pos[i] as usize * rotary_dim..][..rotary_dim];
                let (cos, sin) = cs.split_at(half);
                for h in 0..heads {
                    let x = &mut row[h * hd..h * hd + rotary_dim];
                    for i in 0..half {
                        let (a, b) = (x[i], x[i + half]);
                        x[i] = a * cos[i] - b * sin[i];
                        x[i + half] = b * cos[i] + a * sin[i];
                    }
                }
            },
        );
    }

    fn kv_write(
        &self,
        qkv: &CpuBuffer,
        layout: QkvLayout,
        slot_mapping: &CpuBuffer,
        rows: usize,
        cache: CacheLayout,
        k_cache: &mut CpuBuffer,
        v_cache: &mut CpuBuffer,
    ) {
        let _t = self.profile.time(|| "kv_write".into());
        let (kvl, rl, ql) = (layout.kv_len(), layout.row_len(), layout.q_len());
        let slots = cache.num_blocks * cache.block_size;
        let dtype = k_cache.dtype();
        let (kc, vc) = (k_cache.bytes_mut(), v_cache.bytes_mut());
        let row_bytes = dtype.bytes_for(kvl);
        for (row, &slot) in qkv.f32()[..rows * rl]
            .chunks(rl)
            .zip(&slot_mapping.i32()[..rows])
        {
            // A negative slot marks a token whose KV is not kept (padding).
            if slot < 0 {
                continue;
            }
            let slot = slot as usize;
            assert!(slot < slots, "slot {slot} outside the cache of {slots}");
            for (cache, x) in [
                (&mut *kc, &row[ql..ql + kvl]),
                (&mut *vc, &row[ql + kvl..ql + 2 * kvl]),
            ] {
                let dst = &mut cache[slot * row_bytes..][..row_bytes];
                match dtype {
                    DType::F32 => dst.copy_from_slice(bytemuck::cast_slice(x)),
                    DType::F16 => {
                        bytemuck::cast_slice_mut::<u8, half::f16>(dst).convert_from_f32_slice(x)
                    }
                    DType::BF16 => {
                        bytemuck::cast_slice_mut::<u8, half::bf16>(dst).convert_from_f32_slice(x)
                    }
                    d => panic!("no {d} KV cache on the CPU"),
                }
            }
        }
    }

    fn paged_attention(
        &self,
        qkv: &CpuBuffer,
        layout: QkvLayout,
        rows: usize,
        meta: &AttentionMetadata<'_, Self>,
        cache: CacheLayout,
        k_cache: &CpuBuffer,
        v_cache: &CpuBuffer,
        scale: f32,
        _workspace: &mut CpuBuffer,
        out: &mut CpuBuffer,
    ) {
        let _t = self.profile.time(|| format!("paged_attention m{rows}"));
        let attn = attention::PagedAttention {
            qkv: qkv.f32(),
            layout,
            rows,
            query_start_loc: &meta.query_start_loc.i32()[..meta.num_seqs + 1],
            seq_lens: &meta.seq_lens.i32()[..meta.num_seqs],
            block_tables: &meta.block_tables.i32()[..meta.num_seqs * meta.max_blocks_per_seq],
            max_blocks_per_seq: meta.max_blocks_per_seq,
            cache,
            kv: match k_cache.dtype() {
                DType::F16 => attention::KvData::F16(k_cache.f16(), v_cache.f16()),
                DType::BF16 => attention::KvData::BF16(k_cache.bf16(), v_cache.bf16()),
                _ => attention::KvData::F32(k_cache.f32(), v_cache.f32()),
            },
            scale,
            isa: crate::quant::Isa::selected(),
        };
        attn.run(out.f32_mut(), &self.team);
    }

    fn argmax(&self, logits: &CpuBuffer, rows: usize, vocab: usize, out: &mut CpuBuffer) {
        let _t = self.profile.time(|| "argmax".into());
        let ids: Vec<i32> = logits.f32()[..rows * vocab]
            .chunks(vocab)
            .map(|row| crate::first_argmax(row) as i32)
            .collect();
        out.i32_mut()[..rows].copy_from_slice(&ids);
    }

    fn sample(
        &self,
        logits: &mut CpuBuffer,
        rows: usize,
        vocab: usize,
        params: &CpuBuffer,
        edits: &CpuBuffer,
        masks: &CpuBuffer,
        out: &mut CpuBuffer,
    ) {
        let _t = self.profile.time(|| "sample".into());
        let params: &[SampleRow] =
            bytemuck::cast_slice(&params.bytes()[..rows * size_of::<SampleRow>()]);
        let edits: &[LogitEdit] = bytemuck::cast_slice(edits.bytes());
        let masks: &[u32] = bytemuck::cast_slice(masks.bytes());
        let words = crate::sampling::mask_words(vocab);
        let ids: Vec<i32> = logits.f32_mut()[..rows * vocab]
            .chunks_mut(vocab)
            .zip(params)
            .map(|(row, p)| {
                let e = &edits[p.edit_start as usize..p.edit_end as usize];
                let mask = (p.mask > 0).then(|| &masks[(p.mask as usize - 1) * words..][..words]);
                crate::sampling::sample_row(row, p, e, mask) as i32
            })
            .collect();
        out.i32_mut()[..rows].copy_from_slice(&ids);
    }

    fn gather_rows(
        &self,
        x: &CpuBuffer,
        indices: &CpuBuffer,
        n: usize,
        dim: usize,
        out: &mut CpuBuffer,
    ) {
        let _t = self.profile.time(|| "gather_rows".into());
        let x = x.f32();
        for (o, &i) in out.f32_mut()[..n * dim]
            .chunks_mut(dim)
            .zip(&indices.i32()[..n])
        {
            o.copy_from_slice(&x[i as usize * dim..][..dim]);
        }
    }

    fn segment_sum(
        &self,
        x: &CpuBuffer,
        query_start_loc: &CpuBuffer,
        num_seqs: usize,
        dim: usize,
        out: &mut CpuBuffer,
    ) {
        let _t = self.profile.time(|| "segment_sum".into());
        let x = x.f32();
        let qsl = &query_start_loc.i32()[..num_seqs + 1];
        for (o, w) in out.f32_mut()[..num_seqs * dim]
            .chunks_mut(dim)
            .zip(qsl.windows(2))
        {
            o.fill(0.0);
            for row in x[w[0] as usize * dim..w[1] as usize * dim].chunks(dim) {
                for (a, v) in o.iter_mut().zip(row) {
                    *a += v;
                }
            }
        }
    }

    fn moe_route(
        &self,
        logits: &CpuBuffer,
        shape: MoeShape,
        renormalize: bool,
        ids: &mut CpuBuffer,
        weights: &mut CpuBuffer,
    ) {
        let _t = self.profile.time(|| "moe_route".into());
        let (e, k) = (shape.experts, shape.experts_per_token);
        let logits = &logits.f32()[..shape.rows * e];
        let mut chosen = Vec::with_capacity(shape.slots());
        for row in logits.chunks(e) {
            chosen.extend(moe::route(row, k, renormalize));
        }
        for ((i, w), (e, p)) in ids.i32_mut()[..shape.slots()]
            .iter_mut()
            .zip(&mut weights.f32_mut()[..shape.slots()])
            .zip(chosen)
        {
            (*i, *w) = (e as i32, p);
        }
    }

    fn moe_workspace_len(&self, shape: MoeShape) -> usize {
        moe::workspace_len(shape)
    }

    fn moe_experts(
        &self,
        x: &CpuBuffer,
        ids: &CpuBuffer,
        weights: &CpuBuffer,
        shape: MoeShape,
        gate_up: &CpuBuffer,
        down: &CpuBuffer,
        workspace: &mut CpuBuffer,
        out: &mut CpuBuffer,
        add: bool,
    ) {
        let _t = self.profile.time(|| "moe_experts".into());
        self.run_experts(x, ids, weights, shape, gate_up, down, workspace, out, add);
    }
}
