//! The conformance suite every device backend passes: each op against the CPU op on the
//! same random inputs (odd sizes, GQA 1 to 8, head_dim 32/64/128, shuffled block tables,
//! contexts crossing blocks, mixed prefill/decode batches, decode contexts up to 8k), in
//! each dtype the backend runs. Inputs are rounded to the dtype under test before both
//! run, so the difference left is the device's arithmetic: ‖gpu − cpu‖ / ‖cpu‖ ≤ 1e-5
//! where everything is f32, ≤ 1e-2 where activations or the cache are 16-bit. Outputs
//! start as NaN, so an element a kernel fails to write fails the check.
//!
//! `cuda_ops.rs` and `wgpu_ops.rs` run it on their backends.
#![allow(clippy::too_many_arguments, dead_code)]

use half::{bf16, f16};
use ingot_backend::cpu::CpuBackend;
use ingot_backend::quant::dequantize_row;
use ingot_backend::quant::testing::random_quant_row_scaled;
use ingot_backend::sampling;
use ingot_backend::{
    AttentionMetadata, Backend, CacheLayout, DType, LogitEdit, MatmulOut, MlpScratch, MoeLayer,
    MoeScratch, MoeShape, QkvLayout, RopeKvWrite, SampleRow,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// The dtypes a backend runs: activations, and for each activation dtype the weights and
/// KV caches it takes.
pub struct Dtypes {
    pub activations: &'static [DType],
    pub weights: fn(DType) -> Vec<DType>,
    pub caches: fn(DType) -> Vec<DType>,
    /// The dtype the backend rounds the inputs of an (m, k) product with these weights to
    /// (wgpu's cooperative matrices take f16): the reference rounds x and the weights'
    /// values alike, so the tolerance stays that of the activations.
    pub product_inputs: fn(usize, usize, DType) -> DType,
}

/// Products that take their inputs as given.
pub fn as_given(_m: usize, _k: usize, _weights: DType) -> DType {
    DType::F32
}

/// The less precise of two float dtypes (f32 is the most precise).
fn worse(a: DType, b: DType) -> DType {
    if a == DType::F32 {
        b
    } else {
        a
    }
}

fn cpu() -> CpuBackend {
    CpuBackend::new(None).unwrap()
}

fn randn(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// The values a buffer of `dtype` holds for `v`.
fn round(v: &[f32], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F16 => v.iter().map(|&x| f16::from_f32(x).to_f32()).collect(),
        DType::BF16 => v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect(),
        _ => v.to_vec(),
    }
}

fn bytes(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => bytemuck::cast_slice(v).to_vec(),
        DType::F16 => v
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect(),
        DType::BF16 => v
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect(),
        other => panic!("no test data for {other}"),
    }
}

/// A random `[rows, k]` matrix in `dtype` as uploaded and as f32 values: floats of about
/// 1/√k rounded to the dtype, or random GGUF blocks whose scales shrink as 1/√k (so that
/// f16 activations do not overflow) and their dequantization. `None` where `k` is not
/// whole blocks of the dtype.
fn matrix(rng: &mut StdRng, dtype: DType, rows: usize, k: usize) -> Option<(Vec<u8>, Vec<f32>)> {
    if !k.is_multiple_of(dtype.block_len()) {
        return None;
    }
    if dtype.is_quantized() {
        // Q6_K's signed 8-bit sub-block scales make its values about 8 times those of the
        // other formats at the same d.
        let spread = if dtype == DType::Q6K { 8.0 } else { 1.0 };
        let scale = 0.05 / (k as f32).sqrt() / spread;
        let data = random_quant_row_scaled(dtype, rows * k, scale, rng);
        let mut values = vec![0.0; rows * k];
        dequantize_row(dtype, &data, &mut values);
        return Some((data, values));
    }
    let w: Vec<f32> = randn(rng, rows * k)
        .iter()
        .map(|v| v / (k as f32).sqrt())
        .collect();
    let w = round(&w, dtype);
    Some((bytes(&w, dtype), w))
}

fn up_raw<B: Backend>(b: &B, data: &[u8], dtype: DType, numel: usize) -> B::Buffer {
    let mut buf = b.alloc(dtype, numel).unwrap();
    b.upload(&mut buf, data).unwrap();
    buf
}

fn up<B: Backend>(b: &B, v: &[f32], dtype: DType) -> B::Buffer {
    let mut buf = b.alloc(dtype, v.len().max(1)).unwrap();
    b.upload(&mut buf, &bytes(v, dtype)).unwrap();
    buf
}

fn up_i32<B: Backend>(b: &B, v: &[i32]) -> B::Buffer {
    let mut buf = b.alloc(DType::I32, v.len().max(1)).unwrap();
    b.upload(&mut buf, bytemuck::cast_slice(v)).unwrap();
    buf
}

/// A buffer of `n` NaNs (all bits set), so unwritten elements show.
fn poisoned<G: Backend>(g: &G, dtype: DType, n: usize) -> G::Buffer {
    let mut buf = g.alloc(dtype, n.max(1)).unwrap();
    g.upload(&mut buf, &vec![0xff; dtype.bytes_for(n)]).unwrap();
    buf
}

fn tol(dtype: DType) -> f64 {
    if dtype == DType::F32 {
        1e-5
    } else {
        1e-2
    }
}

/// The tolerance of an op of `dtype` whose products (m rows, each k of `ks`) with
/// `weights` the backend may take in rounded inputs ([`Dtypes::product_inputs`]), where
/// the reference cannot round them alike (the op's own intermediate rows: a normed x, an
/// activation): f16 inputs are each within 2^-11 of their value, which leaves random
/// products ~5e-4 from the exact ones (the products alone are held to the activations'
/// tolerance against rounded inputs, in the matmul test); 2e-3 still fails a wrong tile or
/// row, whose errors are ~1e-1 and more.
fn op_tol(d: &Dtypes, dtype: DType, m: usize, ks: &[usize], weights: DType) -> f64 {
    let rounded = ks
        .iter()
        .any(|&k| (d.product_inputs)(m, k, weights) != DType::F32);
    if rounded {
        tol(dtype).max(2e-3)
    } else {
        tol(dtype)
    }
}

/// ‖got − want‖ / ‖want‖ within the dtype's tolerance, and no NaN.
fn check(got: &[f32], want: &[f32], dtype: DType, what: &str) {
    check_within(got, want, tol(dtype), what);
}

/// ‖got − want‖ / ‖want‖ within `tol`, and no NaN.
fn check_within(got: &[f32], want: &[f32], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("{what}: element {i} is {} (unwritten?)", got[i]);
    }
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let norm: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().sqrt();
    let rel = diff / norm.max(1e-30);
    println!("{what}: relative error {rel:.2e}");
    assert!(rel <= tol, "{what}: relative error {rel:.2e}");
}

pub fn row_ops_match_the_cpu<G: Backend>(g: &G, d: &Dtypes) {
    let c = cpu();
    let mut rng = StdRng::seed_from_u64(1);
    for &dtype in d.activations {
        for (dim, wd) in [64, 67, 512, 576]
            .into_iter()
            .flat_map(|dim| (d.weights)(dtype).into_iter().map(move |w| (dim, w)))
        {
            let vocab = 37;
            let Some((data, table)) = matrix(&mut rng, wd, vocab, dim) else {
                continue;
            };
            let ids: Vec<i32> = (0..9).map(|_| rng.random_range(0..vocab as i32)).collect();
            let n = ids.len() * dim;
            let gids = up_i32(g, &ids);
            let mut out = poisoned(g, dtype, n);
            g.embedding(
                &up_raw(g, &data, wd, vocab * dim),
                &gids,
                ids.len(),
                dim,
                0..vocab,
                &mut out,
            );
            // The table in two buffers (rows 0..split and split..vocab), each filling the
            // rows whose ids it holds.
            let split = 20;
            let row_bytes = data.len() / vocab;
            let mut parts_out = poisoned(g, dtype, n);
            for rows in [0..split, split..vocab] {
                let part = &data[rows.start * row_bytes..rows.end * row_bytes];
                let buf = up_raw(g, part, wd, rows.len() * dim);
                g.embedding(&buf, &gids, ids.len(), dim, rows, &mut parts_out);
            }
            let mut want = c.alloc(DType::F32, n).unwrap();
            c.embedding(
                &up(&c, &table, DType::F32),
                &up_i32(&c, &ids),
                ids.len(),
                dim,
                0..vocab,
                &mut want,
            );
            let want = c.download_f32(&want, n).unwrap();
            check(
                &g.download_f32(&out, n).unwrap(),
                &want,
                dtype,
                &format!("embedding {wd}->{dtype} dim {dim}"),
            );
            check(
                &g.download_f32(&parts_out, n).unwrap(),
                &want,
                dtype,
                &format!("embedding {wd}->{dtype} dim {dim}, table in two parts"),
            );
        }
        for (rows, dim) in [
            (1, 1),
            (3, 7),
            (5, 576),
            (2, 1001),
            (4, 4096),
            (3, 5120),
            (1, 8192),
            (2, 8196),
        ] {
            let n = rows * dim;
            let (x, r) = (
                round(&randn(&mut rng, n), dtype),
                round(&randn(&mut rng, n), dtype),
            );
            let w = randn(&mut rng, dim);
            let mut out = poisoned(g, dtype, n);
            g.rms_norm(
                &up(g, &x, dtype),
                &up(g, &w, DType::F32),
                1e-5,
                rows,
                dim,
                &mut out,
            );
            let mut want = c.alloc(DType::F32, n).unwrap();
            c.rms_norm(
                &up(&c, &x, DType::F32),
                &up(&c, &w, DType::F32),
                1e-5,
                rows,
                dim,
                &mut want,
            );
            check(
                &g.download_f32(&out, n).unwrap(),
                &c.download_f32(&want, n).unwrap(),
                dtype,
                &format!("rms_norm {dtype} {rows}x{dim}"),
            );

            let mut gr = up(g, &r, dtype);
            let mut out = poisoned(g, dtype, n);
            g.add_rms_norm(
                &mut gr,
                &up(g, &x, dtype),
                &up(g, &w, DType::F32),
                1e-5,
                rows,
                dim,
                &mut out,
            );
            let mut cr = up(&c, &r, DType::F32);
            let mut want = c.alloc(DType::F32, n).unwrap();
            c.add_rms_norm(
                &mut cr,
                &up(&c, &x, DType::F32),
                &up(&c, &w, DType::F32),
                1e-5,
                rows,
                dim,
                &mut want,
            );
            check(
                &g.download_f32(&gr, n).unwrap(),
                &c.download_f32(&cr, n).unwrap(),
                dtype,
                &format!("add_rms_norm residual {dtype} {rows}x{dim}"),
            );
            check(
                &g.download_f32(&out, n).unwrap(),
                &c.download_f32(&want, n).unwrap(),
                dtype,
                &format!("add_rms_norm {dtype} {rows}x{dim}"),
            );
        }
        let n = 100_003;
        let (x, y) = (
            round(&randn(&mut rng, n), dtype),
            round(&randn(&mut rng, n), dtype),
        );
        let mut acc = up(g, &x, dtype);
        g.add_assign(&mut acc, &up(g, &y, dtype), n);
        let mut cacc = up(&c, &x, DType::F32);
        c.add_assign(&mut cacc, &up(&c, &y, DType::F32), n);
        check(
            &g.download_f32(&acc, n).unwrap(),
            &c.download_f32(&cacc, n).unwrap(),
            dtype,
            &format!("add_assign {dtype}"),
        );
        for (rows, ffn) in [(1, 37), (3, 4864), (17, 130)] {
            let gu = round(&randn(&mut rng, rows * 2 * ffn), dtype);
            let mut out = poisoned(g, dtype, rows * ffn);
            g.silu_mul(&up(g, &gu, dtype), rows, ffn, &mut out);
            let mut want = c.alloc(DType::F32, rows * ffn).unwrap();
            c.silu_mul(&up(&c, &gu, DType::F32), rows, ffn, &mut want);
            check(
                &g.download_f32(&out, rows * ffn).unwrap(),
                &c.download_f32(&want, rows * ffn).unwrap(),
                dtype,
                &format!("silu_mul {dtype} {rows}x{ffn}"),
            );
        }
        let (src, idx) = (round(&randn(&mut rng, 9 * 131), dtype), [4, 0, 8, 4]);
        let mut out = poisoned(g, dtype, 4 * 131);
        g.gather_rows(&up(g, &src, dtype), &up_i32(g, &idx), 4, 131, &mut out);
        let mut want = c.alloc(DType::F32, 4 * 131).unwrap();
        c.gather_rows(
            &up(&c, &src, DType::F32),
            &up_i32(&c, &idx),
            4,
            131,
            &mut want,
        );
        check(
            &g.download_f32(&out, 4 * 131).unwrap(),
            &c.download_f32(&want, 4 * 131).unwrap(),
            dtype,
            &format!("gather_rows {dtype}"),
        );
        // Sequences of 1, 5, 300 and 2 rows: one row, a few, more than a workgroup.
        let qsl = [0, 1, 6, 306, 308];
        let src = round(&randn(&mut rng, 308 * 131), dtype);
        let mut out = poisoned(g, DType::F32, 4 * 131);
        g.segment_sum(&up(g, &src, dtype), &up_i32(g, &qsl), 4, 131, &mut out);
        let mut want = c.alloc(DType::F32, 4 * 131).unwrap();
        c.segment_sum(
            &up(&c, &src, DType::F32),
            &up_i32(&c, &qsl),
            4,
            131,
            &mut want,
        );
        check(
            &g.download_f32(&out, 4 * 131).unwrap(),
            &c.download_f32(&want, 4 * 131).unwrap(),
            DType::F32,
            &format!("segment_sum {dtype}"),
        );
        // A step of prompt chunks that ends no prompt has no logits rows: the row ops take
        // zero rows and do nothing.
        let x = up(g, &src, dtype);
        let mut none = poisoned(g, dtype, 131);
        g.gather_rows(&x, &up_i32(g, &idx), 0, 131, &mut none);
        let w = up(g, &vec![1.0; 131], DType::F32);
        g.rms_norm(&x, &w, 1e-6, 0, 131, &mut none);
        let mut ids = g.alloc(DType::I32, 1).unwrap();
        g.argmax(&up(g, &src, DType::F32), 0, 131, &mut ids);
        g.synchronize().expect("ops over zero rows");
    }
}

fn cos_sin_table(max_pos: usize, rot: usize) -> Vec<f32> {
    let mut t = vec![0f32; max_pos * rot];
    for p in 0..max_pos {
        for i in 0..rot / 2 {
            let ang = p as f64 / 10000f64.powf(2.0 * i as f64 / rot as f64);
            t[p * rot + i] = ang.cos() as f32;
            t[p * rot + rot / 2 + i] = ang.sin() as f32;
        }
    }
    t
}

const LAYOUTS: [QkvLayout; 6] = [
    QkvLayout {
        num_heads: 4,
        num_kv_heads: 4,
        head_dim: 64,
    },
    QkvLayout {
        num_heads: 8,
        num_kv_heads: 2,
        head_dim: 64,
    },
    QkvLayout {
        num_heads: 16,
        num_kv_heads: 2,
        head_dim: 128,
    },
    QkvLayout {
        num_heads: 12,
        num_kv_heads: 3,
        head_dim: 128,
    },
    QkvLayout {
        num_heads: 4,
        num_kv_heads: 1,
        head_dim: 32,
    },
    QkvLayout {
        num_heads: 14,
        num_kv_heads: 2,
        head_dim: 64,
    },
];

pub fn rope_qk_norm_and_kv_write_match_the_cpu<G: Backend>(g: &G, d: &Dtypes) {
    let c = cpu();
    let mut rng = StdRng::seed_from_u64(2);
    for &dtype in d.activations {
        // 7 rows (a decode batch) and 70 (prefill): backends may pick kernels by rows.
        for (layout, rows) in LAYOUTS.iter().flat_map(|&l| [(l, 7), (l, 70)]) {
            let (rl, hd) = (layout.row_len(), layout.head_dim);
            let qkv = round(&randn(&mut rng, rows * rl), dtype);
            let pos: Vec<i32> = (0..rows).map(|_| rng.random_range(0..50)).collect();
            let table = cos_sin_table(50, hd);
            let mut gq = up(g, &qkv, dtype);
            g.rope(
                &mut gq,
                layout,
                &up_i32(g, &pos),
                rows,
                &up(g, &table, DType::F32),
                hd,
            );
            let mut cq = up(&c, &qkv, DType::F32);
            c.rope(
                &mut cq,
                layout,
                &up_i32(&c, &pos),
                rows,
                &up(&c, &table, DType::F32),
                hd,
            );
            check(
                &g.download_f32(&gq, rows * rl).unwrap(),
                &c.download_f32(&cq, rows * rl).unwrap(),
                dtype,
                &format!("rope {dtype} {layout:?}"),
            );

            let (qw, kw) = (randn(&mut rng, hd), randn(&mut rng, hd));
            let mut gq = up(g, &qkv, dtype);
            g.qk_norm(
                &mut gq,
                layout,
                rows,
                &up(g, &qw, DType::F32),
                &up(g, &kw, DType::F32),
                1e-6,
            );
            let mut cq = up(&c, &qkv, DType::F32);
            c.qk_norm(
                &mut cq,
                layout,
                rows,
                &up(&c, &qw, DType::F32),
                &up(&c, &kw, DType::F32),
                1e-6,
            );
            check(
                &g.download_f32(&gq, rows * rl).unwrap(),
                &c.download_f32(&cq, rows * rl).unwrap(),
                dtype,
                &format!("qk_norm {dtype} {layout:?}"),
            );

            for cache_dtype in (d.caches)(dtype) {
                let cache = CacheLayout {
                    num_blocks: 5,
                    block_size: 16,
                };
                let n = cache.num_blocks * cache.block_size * layout.kv_len();
                let init = round(&randn(&mut rng, n), cache_dtype);
                let mut slots: Vec<i32> = (0..80).collect();
                slots.shuffle(&mut rng);
                slots.truncate(rows);
                slots[3] = -1;
                let (mut gk, mut gv) = (up(g, &init, cache_dtype), up(g, &init, cache_dtype));
                g.kv_write(
                    &up(g, &qkv, dtype),
                    layout,
                    &up_i32(g, &slots),
                    rows,
                    cache,
                    &mut gk,
                    &mut gv,
                );
                let (mut ck, mut cv) = (up(&c, &init, DType::F32), up(&c, &init, DType::F32));
                c.kv_write(
                    &up(&c, &qkv, DType::F32),
                    layout,
                    &up_i32(&c, &slots),
                    rows,
                    cache,
                    &mut ck,
                    &mut cv,
                );
                let worse = worse(dtype, cache_dtype);
                for (gb, cb, what) in [(&gk, &ck, "keys"), (&gv, &cv, "values")] {
                    let want = round(&c.download_f32(cb, n).unwrap(), cache_dtype);
                    check(
                        &g.download_f32(gb, n).unwrap(),
                        &want,
                        worse,
                        &format!("kv_write {what} {dtype} into {cache_dtype} {layout:?}"),
                    );
                }

                // The fused rope + kv_write against the two CPU ops, over the whole head
                // and over half of it (partial rotary: the rest is copied).
                for rot in [hd, hd / 2] {
                    let table = cos_sin_table(50, rot);
                    let (mut gk, mut gv) = (up(g, &init, cache_dtype), up(g, &init, cache_dtype));
                    let mut gq = up(g, &qkv, dtype);
                    g.rope_kv_write(
                        &mut gq,
                        layout,
                        &up_i32(g, &pos),
                        rows,
                        &up(g, &table, DType::F32),
                        rot,
                        &up_i32(g, &slots),
                        cache,
                        &mut gk,
                        &mut gv,
                    );
                    let (mut ck, mut cv) = (up(&c, &init, DType::F32), up(&c, &init, DType::F32));
                    let mut cq = up(&c, &qkv, DType::F32);
                    c.rope(
                        &mut cq,
                        layout,
                        &up_i32(&c, &pos),
                        rows,
                        &up(&c, &table, DType::F32),
                        rot,
                    );
                    c.kv_write(
                        &cq,
                        layout,
                        &up_i32(&c, &slots),
                        rows,
                        cache,
                        &mut ck,
                        &mut cv,
                    );
                    check(
                        &g.download_f32(&gq, rows * rl).unwrap(),
                        &c.download_f32(&cq, rows * rl).unwrap(),
                        dtype,
                        &format!("rope_kv_write queries {dtype} {layout:?} rot {rot}"),
                    );
                    for (gb, cb, what) in [(&gk, &ck, "keys"), (&gv, &cv, "values")] {
                        let want = round(&c.download_f32(cb, n).unwrap(), cache_dtype);
                        check(
                            &g.download_f32(gb, n).unwrap(),
                            &want,
                            worse,
                            &format!(
                                "rope_kv_write {what} {dtype} into {cache_dtype} {layout:?} rot {rot}"
                            ),
                        );
                    }

                    // The fused q/k norm + rope + kv_write gives the bits of its two ops.
                    let (qw_buf, kw_buf) = (up(g, &qw, DType::F32), up(g, &kw, DType::F32));
                    let mut both = vec![];
                    for fused in [false, true] {
                        let (mut gk, mut gv) =
                            (up(g, &init, cache_dtype), up(g, &init, cache_dtype));
                        let mut gq = up(g, &qkv, dtype);
                        let (p, t) = (up_i32(g, &pos), up(g, &table, DType::F32));
                        let s = up_i32(g, &slots);
                        let rope = RopeKvWrite {
                            layout,
                            positions: &p,
                            cos_sin: &t,
                            rotary_dim: rot,
                            slot_mapping: &s,
                            cache,
                            k_cache: &mut gk,
                            v_cache: &mut gv,
                        };
                        if fused {
                            g.qk_norm_rope_kv_write(&mut gq, rows, &qw_buf, &kw_buf, 1e-6, rope);
                        } else {
                            g.qk_norm(&mut gq, layout, rows, &qw_buf, &kw_buf, 1e-6);
                            rope.apply(g, &mut gq, rows);
                        }
                        both.push([
                            g.download_f32(&gq, rows * rl).unwrap(),
                            g.download_f32(&gk, n).unwrap(),
                            g.download_f32(&gv, n).unwrap(),
                        ]);
                    }
                    for (i, what) in ["queries", "keys", "values"].iter().enumerate() {
                        assert!(
                            both[0][i]
                                .iter()
                                .zip(&both[1][i])
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "qk_norm_rope_kv_write {what} {dtype} into {cache_dtype} \
                             {layout:?} rot {rot} {rows} rows: not the bits of its two ops"
                        );
                    }
                }
            }
        }
    }
}

pub fn matmul_matches_the_cpu_and_writes_only_its_columns<G: Backend>(g: &G, d: &Dtypes) {
    let c = cpu();
    let mut rng = StdRng::seed_from_u64(3);
    let shapes = [
        (1, 1, 16),
        (1, 17, 64),
        (2, 131, 96),
        (3, 100, 33),
        (7, 512, 576),
        (1, 45, 2056),
        (1, 45, 256),
        (9, 130, 768),
        (70, 33, 512),
        (8, 9, 1032),
        (13, 70, 264),
        (64, 256, 128),
        (66, 20, 37),
        (130, 33, 200),
        (257, 1000, 1024),
        (5, 33, 128),
        (12, 24, 264),
        (16, 40, 1032),
        (16, 72, 1056),
        (14, 300, 2048),
        (8, 128, 512),
        (7, 192, 1024),
        (5, 64, 4096),
        (8, 2048, 4096),
        (16, 96, 512),
        (11, 160, 768),
        (16, 4096, 1024),
        (24, 96, 512),
        (33, 40, 256),
        (48, 131, 768),
        (63, 64, 1024),
    ];
    for &dtype in d.activations {
        let mut outs = vec![dtype, DType::F32];
        outs.dedup();
        for (wd, out_dtype) in (d.weights)(dtype)
            .into_iter()
            .flat_map(|w| outs.iter().map(move |&o| (w, o)))
        {
            for (m, n, k) in shapes {
                for (bias, col) in [(false, 0), (true, 3)] {
                    let x = round(&randn(&mut rng, m * k), dtype);
                    let Some((wdata, w)) = matrix(&mut rng, wd, n, k) else {
                        continue;
                    };
                    let b = randn(&mut rng, n);
                    let ld = n + 2 * col;
                    let mut out = poisoned(g, out_dtype, m * ld);
                    let gb = up(g, &b, DType::F32);
                    g.matmul(
                        &up(g, &x, dtype),
                        &up_raw(g, &wdata, wd, n * k),
                        bias.then_some(&gb),
                        m,
                        n,
                        k,
                        MatmulOut {
                            buf: &mut out,
                            row_stride: ld,
                            col_offset: col,
                        },
                    );
                    let mut want = c.alloc(DType::F32, m * ld).unwrap();
                    let cb = up(&c, &b, DType::F32);
                    let inputs = (d.product_inputs)(m, k, wd);
                    c.matmul(
                        &up(&c, &round(&x, inputs), DType::F32),
                        &up(&c, &round(&w, inputs), DType::F32),
                        bias.then_some(&cb),
                        m,
                        n,
                        k,
                        MatmulOut {
                            buf: &mut want,
                            row_stride: ld,
                            col_offset: col,
                        },
                    );
                    let got = g.download_f32(&out, m * ld).unwrap();
                    let want = c.download_f32(&want, m * ld).unwrap();
                    let cols = |v: &[f32]| -> Vec<f32> {
                        v.chunks(ld)
                            .flat_map(|r| r[col..col + n].to_vec())
                            .collect()
                    };
                    let what =
                        format!("matmul {dtype}x{wd}->{out_dtype} m{m} n{n} k{k} bias {bias}");
                    let outside = got
                        .chunks(ld)
                        .all(|r| r[..col].iter().chain(&r[col + n..]).all(|v| v.is_nan()));
                    assert!(outside, "{what}: wrote outside its columns");
                    check(&cols(&got), &cols(&want), worse(dtype, out_dtype), &what);
                }
            }
        }
    }
}

/// A product of a matrix larger than a backend may dequantize at once (the CUDA backend's
/// 64 MiB f16 scratch holds 32 Mi values; this one has 34.6 Mi), with many rows and a bias:
/// multiplied in runs of rows, every run's columns written and the bias added once.
pub fn large_matmul_matches_the_cpu<G: Backend>(g: &G, d: &Dtypes) {
    let c = cpu();
    let mut rng = StdRng::seed_from_u64(21);
    let (m, n, k) = (70, 8448, 4096);
    for &dtype in d.activations {
        for wd in (d.weights)(dtype) {
            let x = round(&randn(&mut rng, m * k), dtype);
            let (wdata, w) = matrix(&mut rng, wd, n, k).expect("k is whole blocks");
            let b = randn(&mut rng, n);
            let mut out = poisoned(g, dtype, m * n);
            let gb = up(g, &b, DType::F32);
            let whole = MatmulOut {
                buf: &mut out,
                row_stride: n,
                col_offset: 0,
            };
            g.matmul(
                &up(g, &x, dtype),
                &up_raw(g, &wdata, wd, n * k),
                Some(&gb),
                m,
                n,
                k,
                whole,
            );
            let mut want = c.alloc(DType::F32, m * n).unwrap();
            let cb = up(&c, &b, DType::F32);
            let whole = MatmulOut {
                buf: &mut want,
                row_stride: n,
                col_offset: 0,
            };
            let inputs = (d.product_inputs)(m, k, wd);
            c.matmul(
                &up(&c, &round(&x, inputs), DType::F32),
                &up(&c, &round(&w, inputs), DType::F32),
                Some(&cb),
                m,
                n,
                k,
                whole,
            );
            let got = g.download_f32(&out, m * n).unwrap();
            let want = c.download_f32(&want, m * n).unwrap();
            check(
                &got,
                &want,
                dtype,
                &format!("matmul {dtype}x{wd} m{m} n{n} k{k} bias"),
            );
        }
    }
}

pub fn silu_mul_matmul_matches_the_cpu<G: Backend>(g: &G, d: &Dtypes) {
    let c = cpu();
    let mut rng = StdRng::seed_from_u64(8);
    for &dtype in d.activations {
        let shapes = [
            (1, 96, 64),
            (2, 131, 200),
            (4, 4096, 1408),
            (7, 33, 96),
            (3, 50, 512),
            (19, 70, 130),
            (11, 24, 96),
            (16, 48, 264),
            (6, 128, 512),
            (16, 64, 512),
        ];
        for ((m, n, ffn), wd) in shapes
            .into_iter()
            .flat_map(|s| (d.weights)(dtype).into_iter().map(move |w| (s, w)))
        {
            let gu = round(&randn(&mut rng, m * 2 * ffn), dtype);
            let Some((wdata, w)) = matrix(&mut rng, wd, n, ffn) else {
                continue;
            };
            let mut out = poisoned(g, dtype, m * n);
            let mut act = poisoned(g, dtype, m * ffn);
            g.silu_mul_matmul(
                &up(g, &gu, dtype),
                &mut act,
                &up_raw(g, &wdata, wd, n * ffn),
                m,
                n,
                ffn,
                MatmulOut {
                    buf: &mut out,
                    row_stride: n,
                    col_offset: 0,
                },
            );
            let mut want = c.alloc(DType::F32, m * n).unwrap();
            let mut cact = c.alloc(DType::F32, m * ffn).unwrap();
            c.silu_mul_matmul(
                &up(&c, &gu, DType::F32),
                &mut cact,
                &up(&c, &w, DType::F32),
                m,
                n,
                ffn,
                MatmulOut {
                    buf: &mut want,
                    row_stride: n,
                    col_offset: 0,
                },
            );
            check_within(
                &g.download_f32(&out, m * n).unwrap(),
                &c.download_f32(&want, m * n).unwrap(),
                op_tol(d, dtype, m, &[ffn], wd),
                &format!("silu_mul_matmul {dtype}x{wd} m{m} n{n} ffn{ffn}"),
            );
        }
    }
}

/// The gated MLP (gate/up product, SiLU·mul, down product) against the CPU's matmuls:
/// decode batches within and past the GEMVs' rows, k with and without 16-byte pieces,
/// widths that leave partial workgroups.
pub fn gated_mlp_matches_the_cpu<G: Backend>(g: &G, d: &Dtypes) {
    let c = cpu();
    let mut rng = StdRng::seed_from_u64(9);
    for &dtype in d.activations {
        // (m, k, ffn, n)
        let shapes = [
            (1, 64, 96, 64),
            (1, 256, 1408, 256),
            (3, 96, 37, 33),
            (8, 128, 100, 48),
            (9, 64, 264, 40),
            (19, 40, 70, 24),
            (64, 32, 96, 64),
            (70, 64, 64, 32),
            (8, 1024, 1024, 1024),
            (16, 256, 512, 64),
        ];
        for ((m, k, ffn, n), wd) in shapes
            .into_iter()
            .flat_map(|s| (d.weights)(dtype).into_iter().map(move |w| (s, w)))
        {
            let x = round(&randn(&mut rng, m * k), dtype);
            let Some((gu_data, gu)) = matrix(&mut rng, wd, 2 * ffn, k) else {
                continue;
            };
            let Some((down_data, down)) = matrix(&mut rng, wd, n, ffn) else {
                continue;
            };
            let mut out = poisoned(g, dtype, m * n);
            let (mut gu_s, mut act_s) =
                (poisoned(g, dtype, m * 2 * ffn), poisoned(g, dtype, m * ffn));
            g.gated_mlp(
                &up(g, &x, dtype),
                &up_raw(g, &gu_data, wd, 2 * ffn * k),
                &up_raw(g, &down_data, wd, n * ffn),
                m,
                k,
                ffn,
                n,
                MlpScratch {
                    gate_up: &mut gu_s,
                    act: &mut act_s,
                },
                MatmulOut {
                    buf: &mut out,
                    row_stride: n,
                    col_offset: 0,
                },
            );
            let mut want = c.alloc(DType::F32, m * n).unwrap();
            let mut cgu = c.alloc(DType::F32, m * 2 * ffn).unwrap();
            let mut cact = c.alloc(DType::F32, m * ffn).unwrap();
            c.gated_mlp(
                &up(&c, &x, DType::F32),
                &up(&c, &gu, DType::F32),
                &up(&c, &down, DType::F32),
                m,
                k,
                ffn,
                n,
                MlpScratch {
                    gate_up: &mut cgu,
                    act: &mut cact,
                },
                MatmulOut {
                    buf: &mut want,
                    row_stride: n,
                    col_offset: 0,
                },
            );
            check_within(
                &g.download_f32(&out, m * n).unwrap(),
                &c.download_f32(&want, m * n).unwrap(),
                op_tol(d, dtype, m, &[k, ffn], wd),
                &format!("gated_mlp {dtype}x{wd} m{m} k{k} ffn{ffn} n{n}"),
            );
        }
    }
}

/// The ops of a layer whose norms are folded into its matrices
/// ([`Backend::folds_norm_weights`]): `rms_norm_matmul` (with and without bias),
/// `matmul_add` and `rms_norm_gated_mlp_add` (adding and not), against the CPU's (the default compositions
/// of rms_norm, matmul, gated_mlp and add_assign), at decode and prefill row counts and at
/// k that the GEMVs do not take (k % 8 != 0).
pub fn residual_stream_ops_match_the_cpu<G: Backend>(g: &G, d: &Dtypes) {
    let c = cpu();
    let mut rng = StdRng::seed_from_u64(11);
    let eps = 1e-5;
    for &dtype in d.activations {
        // (m, k, ffn)
        let shapes = [
            (1, 64, 96),
            (1, 256, 1408),
            (3, 96, 37),
            (9, 64, 264),
            (19, 40, 70),
            (64, 32, 96),
            (70, 64, 64),
            (16, 64, 128),
            (8, 256, 512),
            (16, 256, 512),
        ];
        for ((m, k, ffn), wd) in shapes
            .into_iter()
            .flat_map(|s| (d.weights)(dtype).into_iter().map(move |w| (s, w)))
        {
            let what = format!("{dtype}x{wd} m{m} k{k} ffn{ffn}");
            // Rows of different scales, so that each row's own norm matters.
            let x: Vec<f32> = randn(&mut rng, m * k)
                .iter()
                .enumerate()
                .map(|(i, v)| v * (1 + i / k % 5) as f32)
                .collect();
            let x = round(&x, dtype);
            let unit = vec![1f32; k];
            let (Some((w_data, w)), Some((gu_data, gu)), Some((down_data, down))) = (
                matrix(&mut rng, wd, ffn, k),
                matrix(&mut rng, wd, 2 * ffn, k),
                matrix(&mut rng, wd, k, ffn),
            ) else {
                continue;
            };
            let bias = round(&randn(&mut rng, ffn), dtype);
            for with_bias in [false, true] {
                let mut out = poisoned(g, dtype, m * ffn);
                let mut normed = poisoned(g, dtype, m * k);
                let gb = up(g, &bias, DType::F32);
                g.rms_norm_matmul(
                    &up(g, &x, dtype),
                    &up(g, &unit, DType::F32),
                    eps,
                    &up_raw(g, &w_data, wd, ffn * k),
                    with_bias.then_some(&gb),
                    m,
                    ffn,
                    k,
                    &mut normed,
                    MatmulOut {
                        buf: &mut out,
                        row_stride: ffn,
                        col_offset: 0,
                    },
                );
                let mut want = c.alloc(DType::F32, m * ffn).unwrap();
                let mut cnormed = c.alloc(DType::F32, m * k).unwrap();
                let cb = up(&c, &bias, DType::F32);
                c.rms_norm_matmul(
                    &up(&c, &x, DType::F32),
                    &up(&c, &unit, DType::F32),
                    eps,
                    &up(&c, &w, DType::F32),
                    with_bias.then_some(&cb),
                    m,
                    ffn,
                    k,
                    &mut cnormed,
                    MatmulOut {
                        buf: &mut want,
                        row_stride: ffn,
                        col_offset: 0,
                    },
                );
                check_within(
                    &g.download_f32(&out, m * ffn).unwrap(),
                    &c.download_f32(&want, m * ffn).unwrap(),
                    op_tol(d, dtype, m, &[k], wd),
                    &format!("rms_norm_matmul {what} bias {with_bias}"),
                );
            }
            // acc += act · downᵀ, with act [m, ffn] and acc [m, k].
            let act = round(&randn(&mut rng, m * ffn), dtype);
            let acc0 = round(&randn(&mut rng, m * k), dtype);
            let mut acc = up(g, &acc0, dtype);
            let mut product = poisoned(g, dtype, m * k);
            let gdown = up_raw(g, &down_data, wd, k * ffn);
            g.matmul_add(
                &up(g, &act, dtype),
                &gdown,
                m,
                k,
                ffn,
                &mut product,
                &mut acc,
            );
            let mut cacc = up(&c, &acc0, DType::F32);
            let mut cproduct = c.alloc(DType::F32, m * k).unwrap();
            let cdown = up(&c, &down, DType::F32);
            c.matmul_add(
                &up(&c, &act, DType::F32),
                &cdown,
                m,
                k,
                ffn,
                &mut cproduct,
                &mut cacc,
            );
            check_within(
                &g.download_f32(&acc, m * k).unwrap(),
                &c.download_f32(&cacc, m * k).unwrap(),
                op_tol(d, dtype, m, &[ffn], wd),
                &format!("matmul_add {what}"),
            );
            // residual += mlp(rms_norm(residual)), and residual = mlp(rms_norm(residual)).
            for accumulate in [true, false] {
                let mut residual = up(g, &x, dtype);
                let (mut gu_s, mut act_s) =
                    (poisoned(g, dtype, m * 2 * ffn), poisoned(g, dtype, m * ffn));
                let (mut normed, mut product) =
                    (poisoned(g, dtype, m * k), poisoned(g, dtype, m * k));
                g.rms_norm_gated_mlp_add(
                    &mut residual,
                    &up(g, &unit, DType::F32),
                    eps,
                    &up_raw(g, &gu_data, wd, 2 * ffn * k),
                    &gdown,
                    m,
                    k,
                    ffn,
                    MlpScratch {
                        gate_up: &mut gu_s,
                        act: &mut act_s,
                    },
                    &mut normed,
                    &mut product,
                    accumulate,
                );
                let mut cresidual = up(&c, &x, DType::F32);
                let mut cgu = c.alloc(DType::F32, m * 2 * ffn).unwrap();
                let mut cact = c.alloc(DType::F32, m * ffn).unwrap();
                let mut cnormed = c.alloc(DType::F32, m * k).unwrap();
                c.rms_norm_gated_mlp_add(
                    &mut cresidual,
                    &up(&c, &unit, DType::F32),
                    eps,
                    &up(&c, &gu, DType::F32),
                    &cdown,
                    m,
                    k,
                    ffn,
                    MlpScratch {
                        gate_up: &mut cgu,
                        act: &mut cact,
                    },
                    &mut cnormed,
                    &mut cproduct,
                    accumulate,
                );
                check_within(
                    &g.download_f32(&residual, m * k).unwrap(),
                    &c.download_f32(&cresidual, m * k).unwrap(),
                    op_tol(d, dtype, m, &[k, ffn], wd),
                    &format!("rms_norm_gated_mlp_add {what} accumulate {accumulate}"),
                );
            }
        }
    }
}

/// `rms_norm_qkv_rope_kv_write` (a layer's attention input with its norm folded into the
/// QKV matrix) against the CPU's default (rms_norm_matmul then rope_kv_write): the qkv
/// rows and both caches, with and without bias, at decode and prefill row counts, every
/// weight and cache dtype (a backend may fuse where they agree), shuffled slots with a
/// padding row (-1), and k % 8 != 0.
pub fn attention_input_matches_the_cpu<G: Backend>(g: &G, d: &Dtypes) {
    let c = cpu();
    let mut rng = StdRng::seed_from_u64(13);
    let eps = 1e-5;
    for &dtype in d.activations {
        let cases = [
            (LAYOUTS[1], 64, 1),
            (LAYOUTS[2], 96, 7),
            (LAYOUTS[3], 40, 9),
            (LAYOUTS[4], 64, 70),
            (LAYOUTS[5], 128, 3),
            (LAYOUTS[0], 36, 5),
            (LAYOUTS[1], 256, 8),
            (LAYOUTS[1], 256, 16),
            (LAYOUTS[3], 512, 12),
            (LAYOUTS[4], 256, 6),
        ];
        for (layout, k, m) in cases {
            let n = layout.row_len();
            let x: Vec<f32> = randn(&mut rng, m * k)
                .iter()
                .enumerate()
                .map(|(i, v)| v * (1 + i / k % 3) as f32)
                .collect();
            let x = round(&x, dtype);
            let unit = vec![1f32; k];
            let bias = round(&randn(&mut rng, n), dtype);
            let pos: Vec<i32> = (0..m).map(|_| rng.random_range(0..50)).collect();
            let table = cos_sin_table(50, layout.head_dim);
            let cache = CacheLayout {
                num_blocks: 5,
                block_size: 16,
            };
            let cache_n = cache.num_blocks * cache.block_size * layout.kv_len();
            let mut slots: Vec<i32> = (0..80).collect();
            slots.shuffle(&mut rng);
            slots.truncate(m);
            slots[m / 2] = -1;
            for wd in (d.weights)(dtype).into_iter().filter(|w| !w.is_quantized()) {
                let Some((w_data, w)) = matrix(&mut rng, wd, n, k) else {
                    continue;
                };
                for (cache_dtype, with_bias) in (d.caches)(dtype)
                    .into_iter()
                    .flat_map(|c| [(c, false), (c, true)])
                {
                    let what = format!("attention input {dtype}x{wd} into {cache_dtype} {layout:?} k{k} m{m} bias {with_bias}");
                    let init = round(&randn(&mut rng, cache_n), cache_dtype);
                    let (mut gk, mut gv) = (up(g, &init, cache_dtype), up(g, &init, cache_dtype));
                    let mut gqkv = poisoned(g, dtype, m * n);
                    let mut gnormed = poisoned(g, dtype, m * k);
                    let (gpos, gtable, gslots) = (
                        up_i32(g, &pos),
                        up(g, &table, DType::F32),
                        up_i32(g, &slots),
                    );
                    let gb = up(g, &bias, DType::F32);
                    g.rms_norm_qkv_rope_kv_write(
                        &up(g, &x, dtype),
                        &up(g, &unit, DType::F32),
                        eps,
                        &up_raw(g, &w_data, wd, n * k),
                        with_bias.then_some(&gb),
                        m,
                        k,
                        &mut gnormed,
                        &mut gqkv,
                        RopeKvWrite {
                            layout,
                            positions: &gpos,
                            cos_sin: &gtable,
                            rotary_dim: layout.head_dim,
                            slot_mapping: &gslots,
                            cache,
                            k_cache: &mut gk,
                            v_cache: &mut gv,
                        },
                    );
                    let (mut ck, mut cv) = (up(&c, &init, DType::F32), up(&c, &init, DType::F32));
                    let mut cqkv = c.alloc(DType::F32, m * n).unwrap();
                    let mut cnormed = c.alloc(DType::F32, m * k).unwrap();
                    let (cpos, ctable, cslots) = (
                        up_i32(&c, &pos),
                        up(&c, &table, DType::F32),
                        up_i32(&c, &slots),
                    );
                    let cb = up(&c, &bias, DType::F32);
                    c.rms_norm_qkv_rope_kv_write(
                        &up(&c, &x, DType::F32),
                        &up(&c, &unit, DType::F32),
                        eps,
                        &up(&c, &w, DType::F32),
                        with_bias.then_some(&cb),
                        m,
                        k,
                        &mut cnormed,
                        &mut cqkv,
                        RopeKvWrite {
                            layout,
                            positions: &cpos,
                            cos_sin: &ctable,
                            rotary_dim: layout.head_dim,
                            slot_mapping: &cslots,
                            cache,
                            k_cache: &mut ck,
                            v_cache: &mut cv,
                        },
                    );
                    check_within(
                        &g.download_f32(&gqkv, m * n).unwrap(),
                        &c.download_f32(&cqkv, m * n).unwrap(),
                        op_tol(d, dtype, m, &[k], wd),
                        &format!("{what}: qkv"),
                    );
                    let worse = worse(dtype, cache_dtype);
                    for (gbuf, cbuf, part) in [(&gk, &ck, "keys"), (&gv, &cv, "values")] {
                        let want = round(&c.download_f32(cbuf, cache_n).unwrap(), cache_dtype);
                        check_within(
                            &g.download_f32(gbuf, cache_n).unwrap(),
                            &want,
                            op_tol(d, worse, m, &[k], wd),
                            &format!("{what}: {part}"),
                        );
                    }
                }
            }
        }
    }
}

/// A sequence of a batch: `cached` tokens already in the cache, `new` query tokens.
#[derive(Clone, Copy, Debug)]
struct Seq {
    cached: usize,
    new: usize,
}

/// One paged-attention case: a cache holding every sequence's context but the new tokens,
/// whose keys and values are in the queries' QKV rows.
struct AttentionCase {
    layout: QkvLayout,
    cache: CacheLayout,
    seqs: Vec<Seq>,
    max_blocks: usize,
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
    qkv: Vec<f32>,
    slots: Vec<i32>,
    qsl: Vec<i32>,
    lens: Vec<i32>,
    tables: Vec<i32>,
}

impl AttentionCase {
    fn new(
        rng: &mut StdRng,
        layout: QkvLayout,
        block_size: usize,
        seqs: &[Seq],
        dtype: DType,
        cache_dtype: DType,
    ) -> AttentionCase {
        let kvl = layout.kv_len();
        let max_blocks = seqs
            .iter()
            .map(|s| (s.cached + s.new).div_ceil(block_size))
            .max()
            .unwrap();
        let num_blocks = seqs.len() * max_blocks + 3;
        let mut physical: Vec<i32> = (0..num_blocks as i32).collect();
        physical.shuffle(rng);
        let mut tables = vec![0i32; seqs.len() * max_blocks];
        for (s, t) in tables.chunks_mut(max_blocks).enumerate() {
            t.copy_from_slice(&physical[s * max_blocks..(s + 1) * max_blocks]);
        }
        let n_cache = num_blocks * block_size * kvl;
        // Keys larger than the queries make the softmax peaked, as in real models.
        let k: Vec<f32> = randn(rng, n_cache).iter().map(|v| v * 2.0).collect();
        let (k_cache, v_cache) = (
            round(&k, cache_dtype),
            round(&randn(rng, n_cache), cache_dtype),
        );
        let (mut qkv, mut slots, mut qsl, mut lens) = (vec![], vec![], vec![0i32], vec![]);
        for (s, seq) in seqs.iter().enumerate() {
            for p in seq.cached..seq.cached + seq.new {
                qkv.extend(randn(rng, layout.row_len()));
                let block = tables[s * max_blocks + p / block_size] as usize;
                slots.push((block * block_size + p % block_size) as i32);
            }
            qsl.push(qsl.last().unwrap() + seq.new as i32);
            lens.push((seq.cached + seq.new) as i32);
        }
        AttentionCase {
            layout,
            cache: CacheLayout {
                num_blocks,
                block_size,
            },
            seqs: seqs.to_vec(),
            max_blocks,
            k_cache,
            v_cache,
            qkv: round(&qkv, dtype),
            slots,
            qsl,
            lens,
            tables,
        }
    }

    /// Attention of the first `num_seqs` sequences on `b`, in `dtype` with a `cache_dtype`
    /// cache; `out` is the (poisoned) output buffer.
    fn run<B: Backend>(
        &self,
        b: &B,
        num_seqs: usize,
        dtype: DType,
        cache_dtype: DType,
        mut out: B::Buffer,
    ) -> Vec<f32> {
        let layout = self.layout;
        let rows = self.qsl[num_seqs] as usize;
        let (mut kc, mut vc) = (
            up(b, &self.k_cache, cache_dtype),
            up(b, &self.v_cache, cache_dtype),
        );
        let q = up(b, &self.qkv[..rows * layout.row_len()], dtype);
        b.kv_write(
            &q,
            layout,
            &up_i32(b, &self.slots[..rows]),
            rows,
            self.cache,
            &mut kc,
            &mut vc,
        );
        let (qslb, lensb, tb) = (
            up_i32(b, &self.qsl[..=num_seqs]),
            up_i32(b, &self.lens[..num_seqs]),
            up_i32(b, &self.tables[..num_seqs * self.max_blocks]),
        );
        let meta = AttentionMetadata {
            query_start_loc: &qslb,
            seq_lens: &lensb,
            block_tables: &tb,
            num_seqs,
            max_blocks_per_seq: self.max_blocks,
            max_query_len: self.seqs[..num_seqs].iter().map(|s| s.new).max().unwrap(),
        };
        let mut ws = b
            .alloc(
                DType::F32,
                b.attention_workspace_len(layout, num_seqs).max(1),
            )
            .unwrap();
        let scale = 1.0 / (layout.head_dim as f32).sqrt();
        b.paged_attention(
            &q, layout, rows, &meta, self.cache, &kc, &vc, scale, &mut ws, &mut out,
        );
        b.download_f32(&out, rows * layout.q_len()).unwrap()
    }

    fn rows(&self) -> usize {
        *self.qsl.last().unwrap() as usize
    }
}

pub fn paged_attention_matches_the_cpu<G: Backend>(g: &G, d: &Dtypes) {
    paged_attention_matches_the_cpu_in(g, d, &LAYOUTS);
}

/// [`paged_attention_matches_the_cpu`] over `layouts`: a backend whose kernels take some
/// shapes only tests its general path with the others.
pub fn paged_attention_matches_the_cpu_in<G: Backend>(g: &G, d: &Dtypes, layouts: &[QkvLayout]) {
    let c = cpu();
    let mut rng = StdRng::seed_from_u64(4);
    let s = |cached, new| Seq { cached, new };
    let batches: [(&str, Vec<Seq>); 4] = [
        (
            "mixed",
            vec![
                s(0, 21),
                s(15, 2),
                s(33, 1),
                s(0, 1),
                s(16, 17),
                s(100, 130),
            ],
        ),
        (
            "decode",
            [0, 1, 14, 15, 16, 99, 512, 1000, 4095, 8191]
                .iter()
                .map(|&n| s(n, 1))
                .collect(),
        ),
        (
            "prefix",
            vec![s(300, 200), s(0, 257), s(1000, 64), s(63, 65)],
        ),
        ("one", vec![s(0, 1)]),
    ];
    for &layout in layouts {
        for (name, seqs) in &batches {
            for &dtype in d.activations {
                for cache_dtype in (d.caches)(dtype) {
                    if cache_dtype == DType::F32 && dtype == DType::F32 && name == &"one" {
                        continue;
                    }
                    let block_size = if layout.head_dim == 32 { 8 } else { 16 };
                    let case =
                        AttentionCase::new(&mut rng, layout, block_size, seqs, dtype, cache_dtype);
                    let n = case.rows() * layout.q_len();
                    let got = case.run(g, seqs.len(), dtype, cache_dtype, poisoned(g, dtype, n));
                    let want = case.run(
                        &c,
                        seqs.len(),
                        DType::F32,
                        DType::F32,
                        c.alloc(DType::F32, n).unwrap(),
                    );
                    check(
                        &got,
                        &want,
                        worse(dtype, cache_dtype),
                        &format!(
                            "attention {name} {dtype}/{cache_dtype} {layout:?} block {block_size}"
                        ),
                    );
                }
            }
        }
    }
}

/// A decode's attention is bitwise the same alone and in any batch: its context split
/// depends on its own length only.
pub fn decode_attention_does_not_depend_on_the_batch<G: Backend>(
    g: &G,
    dtype: DType,
    cache_dtype: DType,
) {
    let mut rng = StdRng::seed_from_u64(5);
    let layout = LAYOUTS[2];
    for first in [5usize, 700, 3000] {
        let seqs: Vec<Seq> = [first, 64, 5000, 1]
            .iter()
            .map(|&n| Seq { cached: n, new: 1 })
            .collect();
        let case = AttentionCase::new(&mut rng, layout, 16, &seqs, dtype, cache_dtype);
        let n = layout.q_len();
        let together = case.run(
            g,
            seqs.len(),
            dtype,
            cache_dtype,
            poisoned(g, dtype, seqs.len() * n),
        );
        let alone = case.run(g, 1, dtype, cache_dtype, poisoned(g, dtype, n));
        assert_eq!(together[..n], alone[..], "context {first}");
    }
}

/// A decode row's product is bitwise the same alone and in a batch of up to `max_rows`
/// rows, for backends that promise it for `k` a multiple of 8 (so that a decode step's
/// tokens do not depend on the other sequences in it).
pub fn decode_matmul_rows_do_not_depend_on_the_batch<G: Backend>(g: &G, max_rows: usize) {
    let mut rng = StdRng::seed_from_u64(9);
    // The product of m rows of x, plain or with each row normalized (rms_norm_matmul).
    let product = |x: &[f32], w: &G::Buffer, m: usize, n: usize, k: usize, normed: bool| {
        let mut out = poisoned(g, DType::F32, m * n);
        let o = MatmulOut {
            buf: &mut out,
            row_stride: n,
            col_offset: 0,
        };
        let x = up(g, &x[..m * k], DType::F32);
        if normed {
            let unit = up(g, &vec![1f32; k], DType::F32);
            let mut scratch = poisoned(g, DType::F32, m * k);
            g.rms_norm_matmul(&x, &unit, 1e-5, w, None, m, n, k, &mut scratch, o);
        } else {
            g.matmul(&x, w, None, m, n, k, o);
        }
        g.download_f32(&out, m * n).unwrap()
    };
    for (n, k) in [(33, 64), (300, 1000), (5, 4096), (3, 2600)] {
        for (wd, normed) in FLOATS.into_iter().flat_map(|d| [(d, false), (d, true)]) {
            let w = up(g, &round(&randn(&mut rng, n * k), wd), wd);
            let x = randn(&mut rng, max_rows * k);
            let alone: Vec<Vec<f32>> = x
                .chunks(k)
                .map(|row| product(row, &w, 1, n, k, normed))
                .collect();
            for m in [2, 5, 8, 9, 16, 37, max_rows]
                .into_iter()
                .filter(|&m| m <= max_rows)
            {
                let got = product(&x, &w, m, n, k, normed);
                for (r, want) in alone[..m].iter().enumerate() {
                    assert_eq!(
                        got[r * n..][..n]
                            .iter()
                            .map(|v| v.to_bits())
                            .collect::<Vec<_>>(),
                        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "row {r} of {m}, {n}x{k} {wd}, normed {normed}"
                    );
                }
            }
        }
    }
}

pub fn argmax_picks_the_first_maximum_like_the_cpu<G: Backend>(g: &G) {
    let c = cpu();
    let mut rng = StdRng::seed_from_u64(6);
    for vocab in [1, 2, 1000, 1023, 1025, 128256, 151936] {
        let rows = 5;
        let mut logits = randn(&mut rng, rows * vocab);
        // Ties: row 1 repeats its maximum later; row 2 is all equal; row 3 is all -inf.
        if vocab > 3 {
            let m = logits[vocab..2 * vocab]
                .iter()
                .cloned()
                .fold(f32::MIN, f32::max);
            logits[vocab + vocab / 2] = m;
            logits[vocab + vocab - 1] = m;
            logits[2 * vocab..3 * vocab]
                .iter_mut()
                .for_each(|v| *v = 0.5);
            logits[3 * vocab..4 * vocab]
                .iter_mut()
                .for_each(|v| *v = f32::NEG_INFINITY);
        }
        let mut out = g.alloc(DType::I32, rows).unwrap();
        g.argmax(&up(g, &logits, DType::F32), rows, vocab, &mut out);
        let mut want = c.alloc(DType::I32, rows).unwrap();
        c.argmax(&up(&c, &logits, DType::F32), rows, vocab, &mut want);
        assert_eq!(
            g.download_i32(&out, rows).unwrap(),
            c.download_i32(&want, rows).unwrap(),
            "vocab {vocab}"
        );
    }
}

/// Each upload from a backend's host buffer carries the words written before it, though the
/// host rewrites the buffer right after while the device is still busy with `busy` passes of
/// an argmax queued before each upload (a page-locked buffer's writes must wait for the
/// device's read), and past the buffer's capacity (it moves to ordinary memory).
pub fn host_buffer_uploads_what_was_written<G: Backend>(g: &G, busy: usize) {
    let (rows, vocab) = (64, 151936);
    let logits = up(g, &vec![0.5; rows * vocab], DType::F32);
    let mut picks = g.alloc(DType::I32, rows).unwrap();
    let capacity = 3 * 1536 + 7;
    let mut host = g.alloc_host(capacity).unwrap();
    let mut uploaded = vec![];
    for (round, len) in [capacity, 1, 1536, capacity + 100, 5]
        .into_iter()
        .enumerate()
    {
        let words: Vec<u32> = (0..len as u32)
            .map(|i| i.wrapping_mul(2654435761) ^ round as u32)
            .collect();
        host.clear();
        host.extend_from_slice(&words);
        for _ in 0..busy {
            g.argmax(&logits, rows, vocab, &mut picks);
        }
        let mut dev = g.alloc(DType::I32, len).unwrap();
        g.upload_host(&mut dev, &host).unwrap();
        uploaded.push((dev, words));
    }
    for (round, (dev, words)) in uploaded.iter().enumerate() {
        let got = g.download_i32(dev, words.len()).unwrap();
        let got: Vec<u32> = got.iter().map(|&w| w as u32).collect();
        assert!(&got == words, "upload {round} of {} words", words.len());
    }
}

/// Runs `Backend::sample` and returns the ids and the rows it leaves in `logits`.
fn sample_on<B: Backend>(
    b: &B,
    rows: &[SampleRow],
    edits: &[LogitEdit],
    masks: &[u32],
    logits: &[f32],
    vocab: usize,
) -> (Vec<i32>, Vec<f32>) {
    let mut l = up(b, logits, DType::F32);
    let p = up_i32(b, bytemuck::cast_slice(rows));
    let e = up_i32(b, bytemuck::cast_slice(edits));
    let m = up_i32(b, bytemuck::cast_slice(masks));
    let mut out = b.alloc(DType::I32, rows.len()).unwrap();
    b.sample(&mut l, rows.len(), vocab, &p, &e, &m, &mut out);
    let ids = b.download_i32(&out, rows.len()).unwrap();
    (ids, b.download_f32(&l, logits.len()).unwrap())
}

/// Sampling on the device picks the CPU reference's token for the same uniform draws:
/// edits, structured-output masks, argmax, top-k, top-p and min-p alone and together, on
/// real and odd vocab sizes.
///
/// With `exact` (CUDA: IEEE division, `expf` within 2 ulp) the edited logits are the CPU's
/// bit for bit and every token is the CPU's. Without it (WGSL allows 2.5 ulp divisions and
/// fused multiply-adds, and Vulkan drivers' `exp` loses bits with |x|), the edited logits and
/// probabilities agree to rounding, greedy tokens are the CPU's, and each drawn token is the
/// one the reference's integer selection ([`sampling::draw`]) picks from the probabilities
/// the device computed: the selection is checked exactly, the exponentials to a tolerance.
pub fn sampling_picks_the_cpu_reference_token<G: Backend>(g: &G, exact: bool) {
    let c = cpu();
    let mut rng = StdRng::seed_from_u64(7);
    for vocab in [7, 1000, 1025, 49152, 128256] {
        let mut rows = vec![];
        let mut edits = vec![];
        let words = sampling::mask_words(vocab);
        let mut masks: Vec<u32> = vec![];
        for r in 0..40 {
            let start = edits.len() as u32;
            let mut tokens: Vec<u32> = (0..vocab as u32).collect();
            tokens.shuffle(&mut rng);
            for &t in tokens.iter().take(rng.random_range(0..vocab.min(300))) {
                edits.push(LogitEdit {
                    token: t,
                    bias: rng.random_range(-2.0..2.0),
                    repetition: rng.random_range(0.8..1.5),
                    subtract: if rng.random_bool(0.05) {
                        f32::INFINITY
                    } else {
                        rng.random_range(0.0..1.0)
                    },
                });
            }
            rows.push(SampleRow {
                temperature: [0.0, 0.3, 0.7, 1.0, 1.5][r % 5],
                top_k: [0, 1, 5, 50, 2000][(r / 5) % 5],
                top_p: [1.0, 0.9, 0.5, 0.01][(r / 2) % 4],
                min_p: [0.0, 0.0, 0.05, 0.3][(r / 3) % 4],
                uniform: rng.random_range(0.0..1.0),
                edit_start: start,
                edit_end: edits.len() as u32,
                mask: 0,
            });
            // Every other row masked: half the tokens, one in a hundred, or a few at the
            // end of the vocabulary (the last word partly past it).
            if r % 2 == 1 {
                let mut mask = vec![0u32; words];
                for t in 0..vocab {
                    let allowed = match r % 3 {
                        0 => rng.random_bool(0.5),
                        1 => t == r % vocab || rng.random_bool(0.01),
                        _ => t + 3 >= vocab,
                    };
                    if allowed {
                        mask[t / 32] |= 1 << (t % 32);
                    }
                }
                masks.extend(mask);
                rows.last_mut().unwrap().mask = (masks.len() / words) as u32;
            }
        }
        let n = rows.len();
        let logits: Vec<f32> = (0..n * vocab)
            .map(|_| rng.random_range(-8.0f32..8.0))
            .collect();
        let (got, got_logits) = sample_on(g, &rows, &edits, &masks, &logits, vocab);
        let (want, want_logits) = sample_on(&c, &rows, &edits, &masks, &logits, vocab);
        // Greedy rows keep the edited logits; drawn rows their probabilities, which differ
        // by the last bits of the exponentials.
        for (r, p) in rows.iter().enumerate() {
            let (gl, wl) = (
                &got_logits[r * vocab..][..vocab],
                &want_logits[r * vocab..][..vocab],
            );
            if p.temperature == 0.0 && exact {
                assert_eq!(gl, wl, "edited logits, vocab {vocab}, row {r}");
            } else {
                let worst = gl
                    .iter()
                    .zip(wl)
                    .filter(|(a, b)| a != b)
                    .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
                    .fold(0.0, f32::max);
                let tol = if exact { 1e-6 } else { 1e-5 };
                assert!(worst <= tol, "vocab {vocab}, row {r}: {worst}");
            }
            let want = if p.temperature == 0.0 || exact {
                want[r]
            } else {
                let best = ingot_backend::first_argmax(gl);
                sampling::draw(gl, p, best) as i32
            };
            assert_eq!(got[r], want, "vocab {vocab}, row {r}: {p:?}");
            if p.mask > 0 {
                let mask = &masks[(p.mask as usize - 1) * words..][..words];
                let allowed = |t: usize| mask[t / 32] & (1 << (t % 32)) != 0;
                // Edits may rule out every allowed token (−∞, or probability 0).
                let ruled_out =
                    |x: f32| x == f32::NEG_INFINITY || (p.temperature > 0.0 && x == 0.0);
                let t = got[r] as usize;
                assert!(
                    allowed(t) || (0..vocab).filter(|&u| allowed(u)).all(|u| ruled_out(wl[u])),
                    "vocab {vocab}, row {r}: token {t} is masked out"
                );
            }
        }
    }
}

/// A recorded (graph) replay computes what the ops compute eagerly, on new buffer contents.
pub fn recorded_steps_replay_on_new_inputs<G: Backend>(g: &G, dtype: DType) {
    let mut rng = StdRng::seed_from_u64(7);
    let (rows, dim) = (4, 576);
    let w = up(g, &randn(&mut rng, dim), DType::F32);
    let mut x = g.alloc(dtype, rows * dim).unwrap();
    let mut out = g.alloc(dtype, rows * dim).unwrap();
    let mut eager = g.alloc(dtype, rows * dim).unwrap();
    for round in 0..3 {
        let v = randn(&mut rng, rows * dim);
        g.upload(&mut x, &bytes(&v, dtype)).unwrap();
        g.run_recorded(7, &mut || g.rms_norm(&x, &w, 1e-5, rows, dim, &mut out))
            .unwrap();
        g.rms_norm(&x, &w, 1e-5, rows, dim, &mut eager);
        assert_eq!(
            g.download_f32(&out, rows * dim).unwrap(),
            g.download_f32(&eager, rows * dim).unwrap(),
            "round {round}"
        );
    }
}

/// A recorded chain of products and the kernels between them (norm, residual add) gives
/// on every replay, with new inputs, exactly what the same ops give run one by one: a
/// kernel that started before the one it reads had finished would read stale values.
pub fn recorded_products_replay_on_new_inputs<G: Backend>(g: &G, dtype: DType, rows: usize) {
    let mut rng = StdRng::seed_from_u64(11);
    let (dim, hidden) = (4096, 6144);
    let norm = up(g, &randn(&mut rng, dim), DType::F32);
    let w1 = up(g, &randn(&mut rng, hidden * dim), dtype);
    let w2 = up(g, &randn(&mut rng, dim * hidden), dtype);
    let w3 = up(g, &randn(&mut rng, dim * dim), dtype);
    let mut x = g.alloc(dtype, rows * dim).unwrap();
    let widths = [dim, hidden, dim, dim];
    let bufs = |g: &G| widths.map(|n| g.alloc(dtype, rows * n).unwrap());
    let (mut recorded, mut eager) = (bufs(g), bufs(g));
    let chain = |x: &G::Buffer, b: &mut [G::Buffer; 4]| {
        let [normed, up1, down, out] = b;
        g.rms_norm(x, &norm, 1e-5, rows, dim, normed);
        fn to<B: Backend>(buf: &mut B::Buffer, n: usize) -> MatmulOut<'_, B> {
            MatmulOut {
                buf,
                row_stride: n,
                col_offset: 0,
            }
        }
        g.matmul(normed, &w1, None, rows, hidden, dim, to::<G>(up1, hidden));
        g.matmul(up1, &w2, None, rows, dim, hidden, to::<G>(down, dim));
        g.add_assign(down, x, rows * dim);
        g.matmul(down, &w3, None, rows, dim, dim, to::<G>(out, dim));
    };
    // Run eagerly first, as the engine does before it records a step: a backend may choose
    // its kernels (and so its roundings) on a product's first eager call.
    chain(&x, &mut eager);
    let mut failures = vec![];
    for round in 0..3 {
        let v = randn(&mut rng, rows * dim);
        g.upload(&mut x, &bytes(&v, dtype)).unwrap();
        g.run_recorded(11, &mut || chain(&x, &mut recorded))
            .unwrap();
        chain(&x, &mut eager);
        for (i, n) in widths.iter().enumerate() {
            let r = g.download_f32(&recorded[i], rows * n).unwrap();
            let e = g.download_f32(&eager[i], rows * n).unwrap();
            let differ: Vec<f32> = r
                .iter()
                .zip(&e)
                .filter(|(a, b)| a != b)
                .map(|(a, b)| (a - b).abs())
                .collect();
            if !differ.is_empty() {
                failures.push(format!(
                    "round {round}, buffer {i}: {} of {} values differ, by up to {} ({} recorded zeros)",
                    differ.len(),
                    r.len(),
                    differ.iter().fold(0f32, |m, &d| m.max(d)),
                    r.iter().filter(|&&v| v == 0.0).count()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A mixture of experts' ops against the CPU's: `moe_route` on random router logits (and
/// on logits where one expert wins every row), then `moe_experts` on the CPU's routing, and
/// `moe` (routing and experts, added into a residual) on the logits, in every activation
/// and weight dtype: odd row counts, experts that get no row, one expert that gets every
/// row, top-k 1, 2 and 8 of 8 and 128 experts, and widths the 16-byte loads do not take,
/// widths that end partway through a block of output columns, decode-sized and
/// prefill-sized steps. Rows of every step are then recomputed alone through both ops and
/// must give the same bits: a row's result does not depend on the other rows of its step.
/// A backend whose `moe` runs one-row steps on a path of their own, summing in another
/// order (`one_row_path`), gives those rows within the dtype's tolerance of their rows in
/// the step instead.
pub fn moe_ops_match_the_cpu<G: Backend>(g: &G, d: &Dtypes, one_row_path: bool) {
    let c = cpu();
    let mut rng = StdRng::seed_from_u64(21);
    // (rows, experts, k, dim, ffn, one expert wins every row)
    let cases = [
        (1, 8, 2, 64, 32, false),
        (3, 128, 8, 128, 64, false),
        (4, 8, 2, 64, 128, true),
        (5, 8, 1, 64, 96, true),
        (7, 128, 8, 64, 32, false),
        (33, 8, 2, 40, 24, false),
        (3, 128, 2, 67, 33, false),
        (19, 8, 8, 64, 64, true),
        (64, 128, 8, 256, 64, false),
        (9, 8, 2, 192, 320, false),
        (6, 8, 2, 256, 256, false),
        (200, 8, 2, 192, 320, false),
        (300, 128, 8, 256, 64, false),
    ];
    for &dtype in d.activations {
        for (rows, experts, k, dim, ffn, one_wins) in cases {
            let shape = MoeShape {
                rows,
                experts,
                experts_per_token: k,
                dim,
                ffn,
            };
            let slots = shape.slots();
            let mut logits: Vec<f32> = randn(&mut rng, rows * experts)
                .iter()
                .map(|v| 4.0 * v)
                .collect();
            if one_wins {
                logits.chunks_mut(experts).for_each(|r| r[3] += 20.0);
            }
            let (mut gids, mut gw) = (
                poisoned(g, DType::I32, slots),
                poisoned(g, DType::F32, slots),
            );
            g.moe_route(&up(g, &logits, DType::F32), shape, true, &mut gids, &mut gw);
            let (ids, weights) = (
                g.download_i32(&gids, slots).unwrap(),
                g.download_f32(&gw, slots).unwrap(),
            );
            let (mut cids, mut cw) = (
                c.alloc(DType::I32, slots).unwrap(),
                c.alloc(DType::F32, slots).unwrap(),
            );
            c.moe_route(
                &up(&c, &logits, DType::F32),
                shape,
                true,
                &mut cids,
                &mut cw,
            );
            let (want_ids, want_w) = (
                c.download_i32(&cids, slots).unwrap(),
                c.download_f32(&cw, slots).unwrap(),
            );
            assert_eq!(ids, want_ids, "moe_route {rows}x{experts} top-{k}: experts");
            check(
                &weights,
                &want_w,
                DType::F32,
                &format!("moe_route {rows}x{experts} top-{k}: weights"),
            );
            if one_wins {
                assert!(ids.chunks(k).all(|r| r[0] == 3), "expert 3 wins every row");
            }
            let x = round(&randn(&mut rng, rows * dim), dtype);
            for wd in (d.weights)(dtype) {
                let Some((gu_data, gu)) = matrix(&mut rng, wd, experts * 2 * ffn, dim) else {
                    continue;
                };
                let Some((down_data, down)) = matrix(&mut rng, wd, experts * dim, ffn) else {
                    continue;
                };
                let (gu_buf, down_buf) = (
                    up_raw(g, &gu_data, wd, experts * 2 * ffn * dim),
                    up_raw(g, &down_data, wd, experts * dim * ffn),
                );
                let run = |x: &[f32], ids: &[i32], w: &[f32], shape: MoeShape| {
                    let mut ws = g.alloc(DType::F32, g.moe_workspace_len(shape)).unwrap();
                    let mut out = poisoned(g, dtype, shape.rows * dim);
                    g.moe_experts(
                        &up(g, x, dtype),
                        &up_i32(g, ids),
                        &up(g, w, DType::F32),
                        shape,
                        &gu_buf,
                        &down_buf,
                        &mut ws,
                        &mut out,
                        false,
                    );
                    g.download_f32(&out, shape.rows * dim).unwrap()
                };
                // `moe` from the logits, added to `residual`: the output and the routing.
                let fused = |x: &[f32], logits: &[f32], residual: &[f32], shape: MoeShape| {
                    let slots = shape.slots();
                    let mut ws = g.alloc(DType::F32, g.moe_workspace_len(shape)).unwrap();
                    let mut out = up(g, residual, dtype);
                    let (mut ids, mut w) = (
                        poisoned(g, DType::I32, slots),
                        poisoned(g, DType::F32, slots),
                    );
                    g.moe(
                        &up(g, x, dtype),
                        &up(g, logits, DType::F32),
                        shape,
                        true,
                        &gu_buf,
                        &down_buf,
                        &mut ids,
                        &mut w,
                        &mut ws,
                        &mut out,
                        true,
                    );
                    (
                        g.download_f32(&out, shape.rows * dim).unwrap(),
                        g.download_i32(&ids, slots).unwrap(),
                    )
                };
                let got = run(&x, &want_ids, &want_w, shape);
                let mut ws = c.alloc(DType::F32, c.moe_workspace_len(shape)).unwrap();
                let mut want = c.alloc(DType::F32, rows * dim).unwrap();
                c.moe_experts(
                    &up(&c, &x, DType::F32),
                    &cids,
                    &cw,
                    shape,
                    &up(&c, &gu, DType::F32),
                    &up(&c, &down, DType::F32),
                    &mut ws,
                    &mut want,
                    false,
                );
                let want = c.download_f32(&want, rows * dim).unwrap();
                let what =
                    format!("moe_experts {dtype}x{wd} {rows}x{experts} top-{k} dim{dim} ffn{ffn}");
                check(&got, &want, dtype, &what);
                let residual = round(&randn(&mut rng, rows * dim), dtype);
                let (added, fused_ids) = fused(&x, &logits, &residual, shape);
                assert_eq!(fused_ids, want_ids, "{what}: moe's routing");
                let want_added: Vec<f32> = residual
                    .iter()
                    .zip(&want)
                    .map(|(r, w)| r + round(&[*w], dtype)[0])
                    .collect();
                check(&added, &want_added, dtype, &format!("{what}: moe added"));
                for r in [0, rows / 2, rows - 1] {
                    let alone = MoeShape { rows: 1, ..shape };
                    let one = run(
                        &x[r * dim..][..dim],
                        &want_ids[r * k..][..k],
                        &want_w[r * k..][..k],
                        alone,
                    );
                    assert!(
                        one.iter()
                            .zip(&got[r * dim..][..dim])
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: row {r} alone differs from its row in the step"
                    );
                    let (one, _) = fused(
                        &x[r * dim..][..dim],
                        &logits[r * experts..][..experts],
                        &residual[r * dim..][..dim],
                        alone,
                    );
                    let in_step = &added[r * dim..][..dim];
                    if one_row_path {
                        check(
                            &one,
                            in_step,
                            dtype,
                            &format!("{what}: moe of row {r} alone"),
                        );
                    } else {
                        assert!(
                            one.iter()
                                .zip(in_step)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{what}: moe of row {r} alone differs from its row in the step"
                        );
                    }
                }
                norm_moe_add_matches_the_cpu(
                    g, d, &mut rng, dtype, wd, shape, &gu_buf, &gu, &down_buf, &down,
                );
            }
        }
    }
}

/// `rms_norm_moe_add` (`residual += moe(rms_norm(residual))`, the norm folded into the
/// router and the experts) against the CPU's composition, in three parts so that a near-tie
/// of the router cannot fail it: the router's logits, the routing of the backend's own
/// logits, and the residual after the experts' sum over the backend's own routing.
#[allow(clippy::too_many_arguments)]
fn norm_moe_add_matches_the_cpu<G: Backend>(
    g: &G,
    d: &Dtypes,
    rng: &mut StdRng,
    dtype: DType,
    wd: DType,
    shape: MoeShape,
    gu_buf: &G::Buffer,
    gu: &[f32],
    down_buf: &G::Buffer,
    down: &[f32],
) {
    let c = cpu();
    let (rows, experts, k, dim) = (
        shape.rows,
        shape.experts,
        shape.experts_per_token,
        shape.dim,
    );
    let slots = shape.slots();
    let Some((router_data, router)) = matrix(rng, wd, experts, dim) else {
        return;
    };
    let eps = 1e-5;
    let unit = vec![1.0; dim];
    let x = round(&randn(rng, rows * dim), dtype);
    let mut residual = up(g, &x, dtype);
    let (mut logits, mut ids, mut weights) = (
        poisoned(g, DType::F32, rows * experts),
        poisoned(g, DType::I32, slots),
        poisoned(g, DType::F32, slots),
    );
    let mut workspace = g.alloc(DType::F32, g.moe_workspace_len(shape)).unwrap();
    let mut normed = poisoned(g, dtype, rows * dim);
    let layer = MoeLayer {
        router: &up_raw(g, &router_data, wd, experts * dim),
        gate_up: gu_buf,
        down: down_buf,
        renormalize: true,
    };
    let scratch = MoeScratch {
        logits: &mut logits,
        ids: &mut ids,
        weights: &mut weights,
        workspace: &mut workspace,
    };
    let unit_buf = up(g, &unit, DType::F32);
    g.rms_norm_moe_add(
        &mut residual,
        &unit_buf,
        eps,
        layer,
        shape,
        scratch,
        &mut normed,
    );
    let what = format!("rms_norm_moe_add {dtype}x{wd} {rows}x{experts} top-{k} dim{dim}");
    let mut cnormed = c.alloc(DType::F32, rows * dim).unwrap();
    c.rms_norm(
        &up(&c, &x, DType::F32),
        &up(&c, &unit, DType::F32),
        eps,
        rows,
        dim,
        &mut cnormed,
    );
    let mut clogits = c.alloc(DType::F32, rows * experts).unwrap();
    let out = MatmulOut {
        buf: &mut clogits,
        row_stride: experts,
        col_offset: 0,
    };
    c.matmul(
        &cnormed,
        &up(&c, &router, DType::F32),
        None,
        rows,
        experts,
        dim,
        out,
    );
    let got_logits = g.download_f32(&logits, rows * experts).unwrap();
    let want_logits = c.download_f32(&clogits, rows * experts).unwrap();
    let logits_tol = op_tol(d, dtype, rows, &[dim], wd);
    check_within(
        &got_logits,
        &want_logits,
        logits_tol,
        &format!("{what}: logits"),
    );
    let (mut cids, mut cw) = (
        c.alloc(DType::I32, slots).unwrap(),
        c.alloc(DType::F32, slots).unwrap(),
    );
    c.moe_route(
        &up(&c, &got_logits, DType::F32),
        shape,
        true,
        &mut cids,
        &mut cw,
    );
    let got_ids = g.download_i32(&ids, slots).unwrap();
    assert_eq!(
        got_ids,
        c.download_i32(&cids, slots).unwrap(),
        "{what}: routing"
    );
    let got_w = g.download_f32(&weights, slots).unwrap();
    check(
        &got_w,
        &c.download_f32(&cw, slots).unwrap(),
        DType::F32,
        &format!("{what}: weights"),
    );
    let mut cws = c.alloc(DType::F32, c.moe_workspace_len(shape)).unwrap();
    let mut want = c.alloc(DType::F32, rows * dim).unwrap();
    c.moe_experts(
        &cnormed,
        &up_i32(&c, &got_ids),
        &up(&c, &got_w, DType::F32),
        shape,
        &up(&c, gu, DType::F32),
        &up(&c, down, DType::F32),
        &mut cws,
        &mut want,
        false,
    );
    let want: Vec<f32> = x
        .iter()
        .zip(c.download_f32(&want, rows * dim).unwrap())
        .map(|(r, w)| r + round(&[w], dtype)[0])
        .collect();
    check(
        &g.download_f32(&residual, rows * dim).unwrap(),
        &want,
        dtype,
        &what,
    );
}
