//! Every CPU op against a naive scalar implementation on random inputs, odd sizes included.
#![allow(clippy::needless_range_loop)] // naive references read best as index loops

use half::{bf16, f16};
use ingot_backend::cpu::{CpuBackend, CpuBuffer, GEMV_MAX_ROWS};
use ingot_backend::quant::{
    dequantize_row, testing::random_quant_row, ActivationBlocks, QuantizedRows,
};
use ingot_backend::{AttentionMetadata, Backend, CacheLayout, DType, MatmulOut, QkvLayout};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

fn backend() -> CpuBackend {
    CpuBackend::new(Some(2)).unwrap()
}

fn randn(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn f32_buf(b: &CpuBackend, v: &[f32]) -> CpuBuffer {
    let mut buf = b.alloc(DType::F32, v.len()).unwrap();
    b.upload(&mut buf, bytemuck::cast_slice(v)).unwrap();
    buf
}

fn i32_buf(b: &CpuBackend, v: &[i32]) -> CpuBuffer {
    let mut buf = b.alloc(DType::I32, v.len().max(1)).unwrap();
    b.upload(&mut buf, bytemuck::cast_slice(v)).unwrap();
    buf
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

/// Weight bytes of `[n, k]` in `dtype` plus their exact f32 values.
fn random_weight(rng: &mut StdRng, dtype: DType, n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    let bytes: Vec<u8> = match dtype {
        DType::F32 => bytemuck::cast_slice(&randn(rng, n * k)).to_vec(),
        DType::F16 => randn(rng, n * k)
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        DType::BF16 => randn(rng, n * k)
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        q => (0..n).flat_map(|_| random_quant_row(q, k, rng)).collect(),
    };
    let mut vals = vec![0f32; n * k];
    let rb = dtype.bytes_for(k);
    for (j, row) in vals.chunks_mut(k).enumerate() {
        dequantize_row(dtype, &bytes[j * rb..(j + 1) * rb], row);
    }
    (bytes, vals)
}

/// What the integer kernels compute with: activations rounded through the 8-bit blocks of
/// `dtype`'s kernel.
fn q8_round_trip(dtype: DType, x: &[f32]) -> Vec<f32> {
    QuantizedRows::default()
        .quantize(dtype, x, 1, x.len())
        .dequantized()
}

fn naive_matmul(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k)
                .map(|l| x[i * k + l] as f64 * w[j * k + l] as f64)
                .sum::<f64>() as f32;
        }
    }
    out
}

#[test]
fn matmul_matches_dequantize_then_f32_for_every_dtype_and_path() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(1);
    let cases: &[(DType, &[usize])] = &[
        (DType::F32, &[3, 37, 64]),
        (DType::F16, &[5, 33]),
        (DType::BF16, &[7, 65]),
        (DType::Q8_0, &[32, 96]),
        (DType::Q4_0, &[32, 160]),
        (DType::Q4_1, &[64, 96]),
        (DType::Q4K, &[256, 512]),
        (DType::Q5K, &[256]),
        (DType::Q6K, &[256, 768]),
        (DType::Fp8, &[128, 384]),
    ];
    for &(dtype, ks) in cases {
        for &k in ks {
            for m in [1, 2, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 13] {
                for n in [1, 17, 131] {
                    let (wb, wf) = random_weight(&mut rng, dtype, n, k);
                    let mut w = b.alloc(dtype, n * k).unwrap();
                    b.upload(&mut w, &wb).unwrap();
                    let x = randn(&mut rng, m * k);
                    let bias = randn(&mut rng, n);
                    // Write into columns 3..3+n of rows of n+5, as a fused projection would.
                    let ld = n + 5;
                    let mut out = f32_buf(&b, &vec![9.0; m * ld]);
                    let biasb = f32_buf(&b, &bias);
                    b.matmul(
                        &f32_buf(&b, &x),
                        &w,
                        Some(&biasb),
                        m,
                        n,
                        k,
                        MatmulOut {
                            buf: &mut out,
                            row_stride: ld,
                            col_offset: 3,
                        },
                    );
                    let got = b.download_f32(&out, m * ld).unwrap();
                    let integer =
                        ActivationBlocks::of(dtype) != ActivationBlocks::None && m <= GEMV_MAX_ROWS;
                    let xr = if integer {
                        x.chunks(k).flat_map(|x| q8_round_trip(dtype, x)).collect()
                    } else {
                        x.clone()
                    };
                    let want = naive_matmul(&xr, &wf, m, n, k);
                    let tol = if dtype == DType::F32 { 1e-5 } else { 2e-5 };
                    for i in 0..m {
                        let row = &got[i * ld..(i + 1) * ld];
                        assert!(
                            row[..3].iter().chain(&row[3 + n..]).all(|&v| v == 9.0),
                            "{dtype}: wrote outside its columns"
                        );
                        let want_row: Vec<f32> = want[i * n..(i + 1) * n]
                            .iter()
                            .zip(&bias)
                            .map(|(a, b)| a + b)
                            .collect();
                        let scale = (k as f32).sqrt();
                        assert_close(
                            &row[3..3 + n],
                            &want_row,
                            tol * scale,
                            &format!("{dtype} m={m} n={n} k={k}"),
                        );
                    }
                    if integer {
                        // Against pure f32 the 8-bit activations may cost at most half a
                        // quantization step per element: |err| <= Σ |w| · d / 2.
                        let exact = naive_matmul(&x, &wf, m, n, k);
                        for i in 0..m {
                            let steps: Vec<f32> = x[i * k..(i + 1) * k]
                                .chunks(32)
                                .map(|c| c.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0)
                                .collect();
                            for j in 0..n {
                                let bound: f32 = (0..k)
                                    .map(|l| wf[j * k + l].abs() * steps[l / 32] / 2.0)
                                    .sum();
                                let err = (got[i * ld + 3 + j] - bias[j] - exact[i * n + j]).abs();
                                assert!(
                                    err <= bound * 1.001 + 1e-4,
                                    "{dtype}: q8 activation error {err} over its bound {bound}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn f32_matmul_rows_do_not_depend_on_the_batch_size() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(11);
    let (n, k) = (131, 576);
    let (wb, _) = random_weight(&mut rng, DType::F32, n, k);
    let mut w = b.alloc(DType::F32, n * k).unwrap();
    b.upload(&mut w, &wb).unwrap();
    let x = randn(&mut rng, 16 * k);
    let run = |m: usize| {
        let mut out = b.alloc(DType::F32, m * n).unwrap();
        b.matmul(
            &f32_buf(&b, &x[..m * k]),
            &w,
            None,
            m,
            n,
            k,
            MatmulOut {
                buf: &mut out,
                row_stride: n,
                col_offset: 0,
            },
        );
        b.download_f32(&out, m * n).unwrap()
    };
    let all = run(16);
    for m in [1, 2, 3, 4, 5, 7, 9, 15] {
        assert_eq!(
            run(m),
            all[..m * n],
            "rows of a batch of {m} differ from the same rows in a batch of 16"
        );
    }
}

#[test]
fn embedding_gathers_and_dequantizes_rows() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(2);
    for dtype in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_1,
        DType::Q6K,
        DType::Fp8,
    ] {
        let (vocab, dim) = (11, dtype.block_len().max(96));
        let (wb, wf) = random_weight(&mut rng, dtype, vocab, dim);
        let mut table = b.alloc(dtype, vocab * dim).unwrap();
        b.upload(&mut table, &wb).unwrap();
        let ids = [3, 0, 10, 3, 7];
        let mut out = b.alloc(DType::F32, ids.len() * dim).unwrap();
        b.embedding(
            &table,
            &i32_buf(&b, &ids),
            ids.len(),
            dim,
            0..vocab,
            &mut out,
        );
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&i| wf[i as usize * dim..][..dim].to_vec())
            .collect();
        assert_eq!(b.download_f32(&out, want.len()).unwrap(), want, "{dtype}");
    }
}

#[test]
fn rms_norm_matches_naive() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(3);
    for (rows, dim) in [(1, 1), (3, 7), (5, 576), (2, 1001)] {
        let x = randn(&mut rng, rows * dim);
        let w = randn(&mut rng, dim);
        let mut out = b.alloc(DType::F32, rows * dim).unwrap();
        b.rms_norm(
            &f32_buf(&b, &x),
            &f32_buf(&b, &w),
            1e-5,
            rows,
            dim,
            &mut out,
        );
        let mut want = vec![0f32; rows * dim];
        for r in 0..rows {
            let xs = &x[r * dim..(r + 1) * dim];
            let ms = xs.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dim as f64;
            let inv = 1.0 / (ms + 1e-5).sqrt();
            for c in 0..dim {
                want[r * dim + c] = (xs[c] as f64 * inv * w[c] as f64) as f32;
            }
        }
        assert_close(
            &b.download_f32(&out, rows * dim).unwrap(),
            &want,
            1e-5,
            "rms_norm",
        );
    }
}

#[test]
fn add_rms_norm_is_the_add_then_the_norm() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(7);
    let (rows, dim) = (3, 577);
    let (r, x, w) = (
        randn(&mut rng, rows * dim),
        randn(&mut rng, rows * dim),
        randn(&mut rng, dim),
    );
    let mut residual = f32_buf(&b, &r);
    let mut out = b.alloc(DType::F32, rows * dim).unwrap();
    let (xb, wb) = (f32_buf(&b, &x), f32_buf(&b, &w));
    b.add_rms_norm(&mut residual, &xb, &wb, 1e-6, rows, dim, &mut out);
    let mut sum = f32_buf(&b, &r);
    b.add_assign(&mut sum, &xb, rows * dim);
    let mut want = b.alloc(DType::F32, rows * dim).unwrap();
    b.rms_norm(&sum, &wb, 1e-6, rows, dim, &mut want);
    let n = rows * dim;
    assert_eq!(
        b.download_f32(&residual, n).unwrap(),
        b.download_f32(&sum, n).unwrap()
    );
    assert_eq!(
        b.download_f32(&out, n).unwrap(),
        b.download_f32(&want, n).unwrap()
    );
}

#[test]
fn silu_mul_add_and_gather_match_naive() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(4);
    let (rows, ffn) = (3, 37);
    let gu = randn(&mut rng, rows * 2 * ffn);
    let mut out = b.alloc(DType::F32, rows * ffn).unwrap();
    b.silu_mul(&f32_buf(&b, &gu), rows, ffn, &mut out);
    let want: Vec<f32> = (0..rows * ffn)
        .map(|i| {
            let (r, c) = (i / ffn, i % ffn);
            let g = gu[r * 2 * ffn + c] as f64;
            (g / (1.0 + (-g).exp()) * gu[r * 2 * ffn + ffn + c] as f64) as f32
        })
        .collect();
    assert_close(
        &b.download_f32(&out, rows * ffn).unwrap(),
        &want,
        1e-6,
        "silu_mul",
    );

    let (x, y) = (randn(&mut rng, 101), randn(&mut rng, 101));
    let mut acc = f32_buf(&b, &x);
    b.add_assign(&mut acc, &f32_buf(&b, &y), 101);
    let want: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    assert_eq!(b.download_f32(&acc, 101).unwrap(), want);

    let src = randn(&mut rng, 5 * 9);
    let mut out = b.alloc(DType::F32, 3 * 9).unwrap();
    b.gather_rows(&f32_buf(&b, &src), &i32_buf(&b, &[4, 0, 4]), 3, 9, &mut out);
    let want: Vec<f32> = [4, 0, 4]
        .iter()
        .flat_map(|&r| src[r * 9..(r + 1) * 9].to_vec())
        .collect();
    assert_eq!(b.download_f32(&out, 27).unwrap(), want);

    let mut sums = b.alloc(DType::F32, 2 * 9).unwrap();
    b.segment_sum(
        &f32_buf(&b, &src),
        &i32_buf(&b, &[0, 1, 5]),
        2,
        9,
        &mut sums,
    );
    let want: Vec<f32> = (0..18)
        .map(|i| match i / 9 {
            0 => src[i],
            _ => (1..5).fold(0.0, |acc, r| acc + src[r * 9 + i % 9]),
        })
        .collect();
    assert_eq!(b.download_f32(&sums, 18).unwrap(), want);
}

fn cos_sin_table(max_pos: usize, rot: usize, theta: f32) -> Vec<f32> {
    let mut t = vec![0f32; max_pos * rot];
    for p in 0..max_pos {
        for i in 0..rot / 2 {
            let ang = p as f64 / (theta as f64).powf(2.0 * i as f64 / rot as f64);
            t[p * rot + i] = ang.cos() as f32;
            t[p * rot + rot / 2 + i] = ang.sin() as f32;
        }
    }
    t
}

#[test]
fn rope_and_qk_norm_touch_only_query_and_key_heads() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(5);
    for (layout, rot) in [
        (
            QkvLayout {
                num_heads: 4,
                num_kv_heads: 2,
                head_dim: 8,
            },
            8,
        ),
        (
            QkvLayout {
                num_heads: 3,
                num_kv_heads: 1,
                head_dim: 10,
            },
            6,
        ),
    ] {
        let rows = 5;
        let rl = layout.row_len();
        let qkv = randn(&mut rng, rows * rl);
        let pos = [0, 7, 3, 19, 2];
        let table = cos_sin_table(20, rot, 10000.0);
        let mut buf = f32_buf(&b, &qkv);
        b.rope(
            &mut buf,
            layout,
            &i32_buf(&b, &pos),
            rows,
            &f32_buf(&b, &table),
            rot,
        );
        let got = b.download_f32(&buf, rows * rl).unwrap();
        let mut want = qkv.clone();
        for r in 0..rows {
            for h in 0..layout.num_heads + layout.num_kv_heads {
                let base = r * rl + h * layout.head_dim;
                for i in 0..rot / 2 {
                    let ang = pos[r] as f64 / 10000f64.powf(2.0 * i as f64 / rot as f64);
                    let (x1, x2) = (qkv[base + i] as f64, qkv[base + i + rot / 2] as f64);
                    want[base + i] = (x1 * ang.cos() - x2 * ang.sin()) as f32;
                    want[base + i + rot / 2] = (x2 * ang.cos() + x1 * ang.sin()) as f32;
                }
            }
        }
        assert_close(&got, &want, 1e-5, "rope");

        let (qw, kw) = (
            randn(&mut rng, layout.head_dim),
            randn(&mut rng, layout.head_dim),
        );
        let mut buf = f32_buf(&b, &qkv);
        b.qk_norm(
            &mut buf,
            layout,
            rows,
            &f32_buf(&b, &qw),
            &f32_buf(&b, &kw),
            1e-6,
        );
        let got = b.download_f32(&buf, rows * rl).unwrap();
        let mut want = qkv.clone();
        let hd = layout.head_dim;
        for r in 0..rows {
            for h in 0..layout.num_heads + layout.num_kv_heads {
                let w = if h < layout.num_heads { &qw } else { &kw };
                let x = &qkv[r * rl + h * hd..][..hd];
                let inv = 1.0
                    / (x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / hd as f64 + 1e-6)
                        .sqrt();
                for c in 0..hd {
                    want[r * rl + h * hd + c] = (x[c] as f64 * inv * w[c] as f64) as f32;
                }
            }
        }
        assert_close(&got, &want, 1e-5, "qk_norm");
    }
}

/// A batch of sequences, each with a context already in the cache and new query tokens.
struct Seq {
    cached: usize,
    new: usize,
}

#[test]
fn paged_attention_matches_dense_causal_attention_on_mixed_batches() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(6);
    for (layout, block_size) in [
        (
            QkvLayout {
                num_heads: 4,
                num_kv_heads: 4,
                head_dim: 8,
            },
            16,
        ),
        (
            QkvLayout {
                num_heads: 6,
                num_kv_heads: 2,
                head_dim: 12,
            },
            4,
        ),
        (
            QkvLayout {
                num_heads: 9,
                num_kv_heads: 3,
                head_dim: 64,
            },
            16,
        ),
    ] {
        // Prefill from zero, a chunk continuing a context across a block boundary, decodes.
        let seqs = [
            Seq { cached: 0, new: 21 },
            Seq { cached: 15, new: 2 },
            Seq { cached: 33, new: 1 },
            Seq { cached: 0, new: 1 },
            Seq {
                cached: 16,
                new: 17,
            },
        ];
        let rl = layout.row_len();
        let (hd, kvl) = (layout.head_dim, layout.kv_len());
        let max_blocks = seqs
            .iter()
            .map(|s| (s.cached + s.new).div_ceil(block_size))
            .max()
            .unwrap();
        let num_blocks = seqs.len() * max_blocks + 3;
        let cache = CacheLayout {
            num_blocks,
            block_size,
        };
        let mut physical: Vec<i32> = (0..num_blocks as i32).collect();
        physical.shuffle(&mut rng);
        let mut tables = vec![0i32; seqs.len() * max_blocks];
        for (s, t) in tables.chunks_mut(max_blocks).enumerate() {
            t.copy_from_slice(&physical[s * max_blocks..(s + 1) * max_blocks]);
        }
        let slot_of = |s: usize, p: usize| {
            tables[s * max_blocks + p / block_size] as usize * block_size + p % block_size
        };
        // Full per-sequence K/V (cached part and new part) and the new queries.
        let mut k_cache = vec![0f32; num_blocks * block_size * kvl];
        let mut v_cache = k_cache.clone();
        let mut full_k = vec![];
        let mut full_v = vec![];
        let (mut qkv, mut slots, mut qsl, mut lens) = (vec![], vec![], vec![0i32], vec![]);
        for (s, seq) in seqs.iter().enumerate() {
            let total = seq.cached + seq.new;
            let k = randn(&mut rng, total * kvl);
            let v = randn(&mut rng, total * kvl);
            for p in 0..seq.cached {
                k_cache[slot_of(s, p) * kvl..][..kvl].copy_from_slice(&k[p * kvl..][..kvl]);
                v_cache[slot_of(s, p) * kvl..][..kvl].copy_from_slice(&v[p * kvl..][..kvl]);
            }
            for p in seq.cached..total {
                qkv.extend(randn(&mut rng, layout.q_len()));
                qkv.extend_from_slice(&k[p * kvl..][..kvl]);
                qkv.extend_from_slice(&v[p * kvl..][..kvl]);
                slots.push(slot_of(s, p) as i32);
            }
            qsl.push(qsl.last().unwrap() + seq.new as i32);
            lens.push(total as i32);
            full_k.push(k);
            full_v.push(v);
        }
        let rows = slots.len();
        let (mut kc, mut vc) = (f32_buf(&b, &k_cache), f32_buf(&b, &v_cache));
        let qkvb = f32_buf(&b, &qkv);
        b.kv_write(
            &qkvb,
            layout,
            &i32_buf(&b, &slots),
            rows,
            cache,
            &mut kc,
            &mut vc,
        );
        let (qslb, lensb, tb) = (i32_buf(&b, &qsl), i32_buf(&b, &lens), i32_buf(&b, &tables));
        let meta = AttentionMetadata {
            query_start_loc: &qslb,
            seq_lens: &lensb,
            block_tables: &tb,
            num_seqs: seqs.len(),
            max_blocks_per_seq: max_blocks,
            max_query_len: seqs.iter().map(|s| s.new).max().unwrap(),
        };
        let mut out = b.alloc(DType::F32, rows * layout.q_len()).unwrap();
        let scale = 1.0 / (hd as f32).sqrt();
        let mut ws = b
            .alloc(DType::F32, b.attention_workspace_len(layout, seqs.len()))
            .unwrap();
        b.paged_attention(
            &qkvb, layout, rows, &meta, cache, &kc, &vc, scale, &mut ws, &mut out,
        );
        let got = b.download_f32(&out, rows * layout.q_len()).unwrap();

        let group = layout.num_heads / layout.num_kv_heads;
        let mut want = vec![0f32; rows * layout.q_len()];
        for (s, seq) in seqs.iter().enumerate() {
            for t in 0..seq.new {
                let row = qsl[s] as usize + t;
                let pos = seq.cached + t;
                for h in 0..layout.num_heads {
                    let q = &qkv[row * rl + h * hd..][..hd];
                    let kh = h / group;
                    let scores: Vec<f64> = (0..=pos)
                        .map(|p| {
                            (0..hd)
                                .map(|c| q[c] as f64 * full_k[s][p * kvl + kh * hd + c] as f64)
                                .sum::<f64>()
                                * scale as f64
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for c in 0..hd {
                        let o: f64 = (0..=pos)
                            .map(|p| e[p] * full_v[s][p * kvl + kh * hd + c] as f64)
                            .sum::<f64>()
                            / sum;
                        want[row * layout.q_len() + h * hd + c] = o as f32;
                    }
                }
            }
        }
        assert_close(
            &got,
            &want,
            1e-5,
            &format!("paged attention {layout:?} block {block_size}"),
        );
    }
}

#[test]
fn argmax_takes_the_first_maximum() {
    let b = backend();
    let logits = [1.0, 3.0, 3.0, -1.0, 0.0, 0.0, 0.0, 0.0, 2.0, -5.0, 7.0, 7.0];
    let mut out = b.alloc(DType::I32, 3).unwrap();
    b.argmax(&f32_buf(&b, &logits), 3, 4, &mut out);
    assert_eq!(b.download_i32(&out, 3).unwrap(), [1, 0, 2]);
}

/// `moe_experts` over stacked experts in every weight layout (GGUF blocks included) equals
/// each row's chosen experts run one at a time through `matmul` on their own matrices, at a
/// decode and a prefill row count.
#[test]
fn moe_experts_equal_each_rows_experts_through_matmul() {
    use ingot_backend::MoeShape;
    let b = backend();
    let mut rng = StdRng::seed_from_u64(31);
    let (experts, k, dim, ffn) = (8, 2, 256, 256);
    for dtype in [
        DType::F32,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_1,
        DType::Q4K,
    ] {
        let (gu_bytes, _) = random_weight(&mut rng, dtype, experts * 2 * ffn, dim);
        let (down_bytes, _) = random_weight(&mut rng, dtype, experts * dim, ffn);
        let upload = |bytes: &[u8], numel: usize| {
            let mut w = b.alloc(dtype, numel).unwrap();
            b.upload(&mut w, bytes).unwrap();
            w
        };
        let gate_up = upload(&gu_bytes, experts * 2 * ffn * dim);
        let down = upload(&down_bytes, experts * dim * ffn);
        for rows in [5, 70] {
            let shape = MoeShape {
                rows,
                experts,
                experts_per_token: k,
                dim,
                ffn,
            };
            let x = randn(&mut rng, rows * dim);
            let ids: Vec<i32> = (0..rows)
                .flat_map(|r| [(r % experts) as i32, ((r * 3 + 1) % experts) as i32])
                .collect();
            let weights: Vec<f32> = (0..rows).flat_map(|_| [0.75, 0.25]).collect();
            let mut ws = b.alloc(DType::F32, b.moe_workspace_len(shape)).unwrap();
            let mut out = f32_buf(&b, &vec![f32::NAN; rows * dim]);
            b.moe_experts(
                &f32_buf(&b, &x),
                &i32_buf(&b, &ids),
                &f32_buf(&b, &weights),
                shape,
                &gate_up,
                &down,
                &mut ws,
                &mut out,
                false,
            );
            let got = b.download_f32(&out, rows * dim).unwrap();
            let (gu_rows, down_rows) = (dtype.bytes_for(2 * ffn * dim), dtype.bytes_for(dim * ffn));
            let mut want = vec![0f32; rows * dim];
            for s in 0..rows * k {
                let (r, e) = (s / k, ids[s] as usize);
                let product = |input: &[f32], w: &CpuBuffer, n: usize, len: usize| {
                    let mut o = f32_buf(&b, &vec![0.0; n]);
                    let dst = MatmulOut {
                        buf: &mut o,
                        row_stride: n,
                        col_offset: 0,
                    };
                    b.matmul(&f32_buf(&b, input), w, None, 1, n, len, dst);
                    b.download_f32(&o, n).unwrap()
                };
                let gu_e = upload(&gu_bytes[e * gu_rows..][..gu_rows], 2 * ffn * dim);
                let gu = product(&x[r * dim..][..dim], &gu_e, 2 * ffn, dim);
                let act: Vec<f32> = (0..ffn)
                    .map(|j| gu[j] / (1.0 + (-gu[j]).exp()) * gu[ffn + j])
                    .collect();
                let down_e = upload(&down_bytes[e * down_rows..][..down_rows], dim * ffn);
                let y = product(&act, &down_e, dim, ffn);
                for (o, y) in want[r * dim..][..dim].iter_mut().zip(y) {
                    *o += weights[s] * y;
                }
            }
            let err = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            let scale = want.iter().map(|v| v.abs()).fold(0f32, f32::max);
            assert!(
                err <= 1e-2 * scale,
                "{dtype} rows {rows}: max error {err} of {scale}"
            );
        }
    }
}
