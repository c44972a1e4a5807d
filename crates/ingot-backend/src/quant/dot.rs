//! Dot products of weight rows with one activation row, or with a few at once.
//!
//! For the GGUF block types the activation row is quantized once per matmul into 8-bit
//! blocks (of 32 for Q8_0/Q4_0/Q4_1, of 256 for the K-quants; `super::activations`) and the
//! dot product runs on integers (AVX-512 VNNI `vpdpbusd` or AVX2 `maddubs`/`madd`, see
//! [`Isa`]), as llama.cpp does: decode is bound by weight bytes, and integer dots keep the
//! compute below the memory time. FP8 blocks are converted to f32 eight values at a time
//! (through f16: F16C) against the f32 activations; f16/bf16 weights are converted block by
//! block and dotted in f32.

use super::activations::{Q8Block, Q8KBlock, Quantized, Q8K_BLOCK, Q8_BLOCK};
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
use super::{dequantize_row, f16_at, scale_min_k4, Isa};
use crate::DType;

/// Dot product of weight row `w` (`dtype`, `xf.len()` elements) with an activation row
/// given both as f32 (`xf`) and, for integer types, quantized (`xq`).
pub fn vec_dot(dtype: DType, w: &[u8], xq: Quantized<'_>, xf: &[f32]) -> f32 {
    let mut out = [0f32];
    dot_rows(dtype, w, xq, xf, &mut out);
    out[0]
}

/// Dot products of consecutive weight rows (`out.len()` of them, `xf.len()` elements each)
/// with one activation row.
pub fn dot_rows(dtype: DType, w: &[u8], xq: Quantized<'_>, xf: &[f32], out: &mut [f32]) {
    let n = out.len();
    dot_rows_multi(dtype, w, xq, xf, 1, n, out)
}

/// Activation rows one [`dot_rows_multi`] call takes at most.
pub const MULTI_ROWS: usize = 4;

/// Dot products of `n` consecutive weight rows with `rows` (≤ [`MULTI_ROWS`]) activation
/// rows: `out[r * n + j]` = weight row `j` · activation row `r`. Activations come as f32
/// (`xf`, `rows` × k) and, for integer types, quantized (`xq`, see [`super::QuantizedRows`]). The
/// integer kernels decode each weight block once for all the rows (decode batches pay the
/// nibble unpacking once instead of once per sequence), in the same order of operations as
/// one row alone, so every result is bitwise the one a row gets alone.
pub fn dot_rows_multi(
    dtype: DType,
    w: &[u8],
    xq: Quantized<'_>,
    xf: &[f32],
    rows: usize,
    n: usize,
    out: &mut [f32],
) {
    dot_rows_multi_on(Isa::selected(), dtype, w, xq, xf, rows, n, out)
}

/// [`dot_rows_multi`] on the kernels of `isa` (which this CPU must support).
#[allow(clippy::too_many_arguments)]
pub(super) fn dot_rows_multi_on(
    isa: Isa,
    dtype: DType,
    w: &[u8],
    xq: Quantized<'_>,
    xf: &[f32],
    rows: usize,
    n: usize,
    out: &mut [f32],
) {
    assert!((1..=MULTI_ROWS).contains(&rows) && out.len() >= rows * n);
    let k = xf.len() / rows;
    let row_bytes = dtype.bytes_for(k);
    assert!(w.len() >= n * row_bytes);
    #[cfg(target_arch = "x86_64")]
    if isa > Isa::Portable {
        // SAFETY (all arms): `isa` is one this CPU supports (checked when it was chosen);
        // the weight size was checked above and the activation blocks are checked here.
        macro_rules! by_rows {
            ($m:ident :: $f:ident, $x:expr, $nb:expr $(, $arg:expr)*) => {{
                let (x, nb) = ($x, $nb);
                assert!(x.len() >= rows * nb);
                unsafe {
                    match rows {
                        1 => $m::$f::<1>(w, row_bytes, x, nb, $($arg,)* n, out),
                        2 => $m::$f::<2>(w, row_bytes, x, nb, $($arg,)* n, out),
                        3 => $m::$f::<3>(w, row_bytes, x, nb, $($arg,)* n, out),
                        _ => $m::$f::<4>(w, row_bytes, x, nb, $($arg,)* n, out),
                    }
                }
                return;
            }};
        }
        if dtype == DType::Fp8 {
            assert!(xf.len() >= rows * k);
            // SAFETY: as above; the activations' length was checked here.
            unsafe {
                match rows {
                    1 => avx2::rows_fp8_multi::<1>(w, row_bytes, xf, k, n, out),
                    2 => avx2::rows_fp8_multi::<2>(w, row_bytes, xf, k, n, out),
                    3 => avx2::rows_fp8_multi::<3>(w, row_bytes, xf, k, n, out),
                    _ => avx2::rows_fp8_multi::<4>(w, row_bytes, xf, k, n, out),
                }
            }
            return;
        }
        let (nb, nbk) = (k / Q8_BLOCK, k / Q8K_BLOCK);
        match (isa, dtype, xq) {
            (Isa::Avx512Vnni, DType::Q4_0, Quantized::Q8(x)) => {
                by_rows!(avx512::rows_q4_multi, x, nb, false)
            }
            (Isa::Avx512Vnni, DType::Q4_1, Quantized::Q8(x)) => {
                by_rows!(avx512::rows_q4_multi, x, nb, true)
            }
            // Q8_0's signed weights cost `vpdpbusd` a sign transfer onto the activations and
            // its pairs two cross-lane inserts: the AVX2 kernel measured faster (lm_head
            // 49152 × 576: 1.40–1.50 ms against 1.63–1.65 ms on one thread).
            (_, DType::Q8_0, Quantized::Q8(x)) => by_rows!(avx2::rows_q8_0_multi, x, nb),
            (_, DType::Q4_0, Quantized::Q8(x)) => by_rows!(avx2::rows_q4_multi, x, nb, false),
            (_, DType::Q4_1, Quantized::Q8(x)) => by_rows!(avx2::rows_q4_multi, x, nb, true),
            // K-quants scale every 16 or 32 products: `pmaddwd` folds that scale into the
            // pair sums in one instruction, which `vpdpbusd` cannot, so AVX-512 machines
            // run the AVX2 kernels for them.
            (_, DType::Q4K, Quantized::Q8K(x)) => by_rows!(avx2::rows_q45k_multi, x, nbk, false),
            (_, DType::Q5K, Quantized::Q8K(x)) => by_rows!(avx2::rows_q45k_multi, x, nbk, true),
            (_, DType::Q6K, Quantized::Q8K(x)) => by_rows!(avx2::rows_q6k_multi, x, nbk),
            _ => {}
        }
    }
    for r in 0..rows {
        let xr = &xf[r * k..(r + 1) * k];
        let xqr = xq.rows(r, r + 1, k);
        for j in 0..n {
            let row = &w[j * row_bytes..(j + 1) * row_bytes];
            out[r * n + j] = match (dtype, xqr) {
                (DType::Q8_0, Quantized::Q8(x)) => dot_q8_0_scalar(row, x),
                (DType::Q4_0, Quantized::Q8(x)) => dot_q4_scalar(row, x, false),
                (DType::Q4_1, Quantized::Q8(x)) => dot_q4_scalar(row, x, true),
                (DType::Q4K, Quantized::Q8K(x)) => dot_q45k_scalar(row, x, false),
                (DType::Q5K, Quantized::Q8K(x)) => dot_q45k_scalar(row, x, true),
                (DType::Q6K, Quantized::Q8K(x)) => dot_q6k_scalar(row, x),
                _ => dot_dequantized(dtype, row, xr),
            };
        }
    }
}

fn dot_dequantized(dtype: DType, w: &[u8], xf: &[f32]) -> f32 {
    const CHUNK: usize = 256;
    let mut buf = [0f32; CHUNK];
    let bytes_per_chunk = dtype.bytes_for(CHUNK);
    let mut acc = 0f32;
    let mut wi = 0;
    for xs in xf.chunks(CHUNK) {
        let nb = dtype.bytes_for(xs.len());
        dequantize_row(dtype, &w[wi..wi + nb], &mut buf[..xs.len()]);
        wi += nb.min(bytes_per_chunk);
        acc += vec_dot_f32(&buf[..xs.len()], xs);
    }
    acc
}

/// f32 dot product with several accumulators (FMA on AVX2 machines).
pub fn vec_dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if Isa::selected() >= Isa::Avx2 {
        // SAFETY: the CPU has AVX2 (checked when the ISA was chosen).
        return unsafe { avx2::dot_f32(a, b) };
    }
    dot_f32_portable(a, b)
}

/// `out[i] += w * x[i]`, the product and the sum each rounded as the plain loop rounds them
/// (no fused multiply-add), so every path gives the same bits; 8 lanes at a time on AVX2.
pub fn vec_axpy_f32(out: &mut [f32], w: f32, x: &[f32]) {
    assert_eq!(out.len(), x.len());
    #[cfg(target_arch = "x86_64")]
    if Isa::selected() >= Isa::Avx2 {
        // SAFETY: the CPU has AVX2 (checked when the ISA was chosen).
        return unsafe { avx2::axpy_f32(out, w, x) };
    }
    axpy_f32_portable(out, w, x)
}

#[inline(always)]
pub(super) fn axpy_f32_portable(out: &mut [f32], w: f32, x: &[f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o += w * v;
    }
}

#[inline(always)]
fn dot_f32_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let ca = a.chunks_exact(16);
    let cb = b.chunks_exact(16);
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..16 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

fn dot_q8_0_scalar(w: &[u8], xq: &[Q8Block]) -> f32 {
    w.chunks_exact(34)
        .zip(xq)
        .map(|(b, x)| {
            let s: i32 = b[2..34]
                .iter()
                .zip(&x.qs)
                .map(|(&q, &v)| (q as i8) as i32 * v as i32)
                .sum();
            f16_at(b, 0) * x.d * s as f32
        })
        .sum()
}

/// Q4_0 is `d * (q - 8)`, Q4_1 is `d * q + m`: both are `d·Σq·x` plus an offset times Σx.
fn dot_q4_scalar(w: &[u8], xq: &[Q8Block], has_min: bool) -> f32 {
    let bb = if has_min { 20 } else { 18 };
    let qoff = bb - 16;
    w.chunks_exact(bb)
        .zip(xq)
        .map(|(b, x)| {
            let d = f16_at(b, 0);
            let m = if has_min { f16_at(b, 2) } else { -8.0 * d };
            let qs = &b[qoff..qoff + 16];
            let (lo, hi) = x.qs.split_at(16);
            let s: i32 = qs
                .iter()
                .zip(lo)
                .zip(hi)
                .map(|((&q, &l), &h)| (q & 0x0F) as i32 * l as i32 + (q >> 4) as i32 * h as i32)
                .sum();
            d * x.d * s as f32 + m * x.sum
        })
        .sum()
}

/// Q4_K is `d·sc·q − dmin·m` per sub-block of 32 (Q5_K the same with a fifth bit from
/// `qh`): `d·Σ sc·Σq·x − dmin·Σ m·Σx`, the sums of x taken from the activations' `bsums`.
fn dot_q45k_scalar(w: &[u8], xq: &[Q8KBlock], high_bit: bool) -> f32 {
    let bb = if high_bit { 176 } else { 144 };
    w.chunks_exact(bb)
        .zip(xq)
        .map(|(b, x)| {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let (qh, qs) = if high_bit {
                (&b[16..48], &b[48..176])
            } else {
                (&[][..], &b[16..144])
            };
            let (mut isum, mut msum) = (0i32, 0i32);
            for g in 0..4 {
                for (h, shift) in [(0usize, 0u32), (1, 4)] {
                    let j = 2 * g + h;
                    let (sc, m) = scale_min_k4(j, scales);
                    let mut s = 0i32;
                    for l in 0..32 {
                        let mut q = ((qs[g * 32 + l] >> shift) & 0x0F) as i32;
                        if high_bit && qh[l] & (1 << j) != 0 {
                            q += 16;
                        }
                        s += q * x.qs[g * 64 + h * 32 + l] as i32;
                    }
                    isum += sc as i32 * s;
                    msum += m as i32 * (x.bsums[2 * j] as i32 + x.bsums[2 * j + 1] as i32);
                }
            }
            x.d * (d * isum as f32 - dmin * msum as f32)
        })
        .sum()
}

/// Q6_K is `d·sc·(q − 32)` per sub-block of 16: `d·(Σ sc·Σq·x − 32·Σ sc·Σx)`.
fn dot_q6k_scalar(w: &[u8], xq: &[Q8KBlock]) -> f32 {
    w.chunks_exact(210)
        .zip(xq)
        .map(|(b, x)| {
            let d = f16_at(b, 208);
            let sc = |j: usize| b[192 + j] as i8 as i32;
            let mut isum = 0i32;
            for half in 0..2 {
                let (ql, qh) = (&b[half * 64..half * 64 + 64], &b[128 + half * 32..][..32]);
                for l in 0..32 {
                    let q = [
                        (ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                        (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                        (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                        (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                    ];
                    for (i, &q) in q.iter().enumerate() {
                        let e = half * 128 + i * 32 + l;
                        isum += sc(e / 16) * q as i32 * x.qs[e] as i32;
                    }
                }
            }
            let offset: i32 = (0..16).map(|j| sc(j) * x.bsums[j] as i32).sum();
            x.d * d * (isum - 32 * offset) as f32
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_row, QuantizedRows};
    use rand::{Rng, SeedableRng};

    pub(crate) fn random_row(dtype: DType, n: usize, rng: &mut impl Rng) -> Vec<u8> {
        crate::quant::testing::random_quant_row(dtype, n, rng)
    }

    #[test]
    fn axpy_rounds_like_the_scalar_loop() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for n in [1usize, 7, 8, 31, 64, 100, 129] {
            let x: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
            let start: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
            let w = rng.random_range(-1.0f32..1.0);
            let mut got = start.clone();
            vec_axpy_f32(&mut got, w, &x);
            let want: Vec<f32> = start.iter().zip(&x).map(|(o, v)| o + w * v).collect();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "n {n}");
        }
    }

    /// Every kernel path this CPU runs, with a note for those it cannot (so a run on a
    /// machine without AVX-512 says which kernels went untested).
    fn paths() -> Vec<Isa> {
        let isas = Isa::available();
        for missing in [Isa::Avx2, Isa::Avx512Vnni] {
            if !isas.contains(&missing) {
                eprintln!(
                    "note: this CPU lacks {}; its kernels are not tested here",
                    missing.name()
                );
            }
        }
        isas
    }

    const QUANTS: [DType; 7] = [
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
        DType::Fp8,
    ];

    /// Row lengths: odd block counts (1, 3, 9, 33 blocks of 32 and 1, 3, 5 of 256) take
    /// the paired kernels' single-block tail.
    fn lengths(dtype: DType) -> &'static [usize] {
        match dtype.block_len() {
            32 => &[32, 96, 256, 288, 1056],
            128 => &[128, 384, 1152],
            _ => &[256, 768, 1280],
        }
    }

    #[test]
    fn integer_dots_match_dequantized_f32() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut qrows = QuantizedRows::default();
        for isa in paths() {
            for dtype in QUANTS {
                for &n in lengths(dtype) {
                    let w = random_row(dtype, n, &mut rng);
                    let x: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
                    let xq = qrows.quantize(dtype, &x, 1, n);
                    let mut wf = vec![0f32; n];
                    dequantize_row(dtype, &w, &mut wf);
                    // Integer kernels see the quantized activations; FP8's f32 kernel the
                    // activations as they are.
                    let xr = if dtype == DType::Fp8 {
                        x.clone()
                    } else {
                        xq.dequantized()
                    };
                    assert_eq!(xr.len(), n, "{dtype} has an integer kernel");
                    let want: f64 = wf.iter().zip(&xr).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let mut got = [0f32];
                    dot_rows_multi_on(isa, dtype, &w, xq, &x, 1, 1, &mut got);
                    let scale: f64 = wf
                        .iter()
                        .zip(&xr)
                        .map(|(a, b)| (*a as f64 * *b as f64).abs())
                        .sum();
                    assert!(
                        (got[0] as f64 - want).abs() <= 1e-5 * scale.max(1.0),
                        "{} {dtype} n={n}: got {}, want {want}",
                        isa.name(),
                        got[0]
                    );
                }
            }
        }
    }

    #[test]
    fn multi_row_dots_equal_single_row_dots_bitwise() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut qrows = QuantizedRows::default();
        for isa in paths() {
            for dtype in QUANTS.into_iter().chain([DType::F16]) {
                for k in [dtype.block_len().max(32) * 3, dtype.block_len().max(32) * 4] {
                    let n = 7;
                    let w: Vec<u8> = (0..n)
                        .flat_map(|_| match dtype {
                            DType::F16 => (0..2 * k).map(|_| rng.random_range(0..0x3c)).collect(),
                            _ => random_row(dtype, k, &mut rng),
                        })
                        .collect();
                    for rows in 1..=MULTI_ROWS {
                        let x: Vec<f32> =
                            (0..rows * k).map(|_| rng.random_range(-2.0..2.0)).collect();
                        let xq = qrows.quantize(dtype, &x, rows, k);
                        let mut multi = vec![0f32; rows * n];
                        dot_rows_multi_on(isa, dtype, &w, xq, &x, rows, n, &mut multi);
                        for r in 0..rows {
                            let mut one = vec![0f32; n];
                            let xr = &x[r * k..(r + 1) * k];
                            dot_rows_multi_on(
                                isa,
                                dtype,
                                &w,
                                xq.rows(r, r + 1, k),
                                xr,
                                1,
                                n,
                                &mut one,
                            );
                            for j in 0..n {
                                assert_eq!(
                                    multi[r * n + j].to_bits(),
                                    one[j].to_bits(),
                                    "{} {dtype} k={k} rows={rows} r={r} j={j}",
                                    isa.name()
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn f32_dot_handles_odd_lengths() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for n in [0usize, 1, 7, 8, 31, 33, 100, 577] {
            let a: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((vec_dot_f32(&a, &b) - want).abs() < 1e-4, "n={n}");
            assert!((dot_f32_portable(&a, &b) - want).abs() < 1e-4, "n={n}");
        }
    }
}
