//! Dot products of weight rows with one activation row, or with a few at once.
//!
//! For Q8_0/Q4_0/Q4_1 weights the activation row is quantized once per matmul into 8-bit
//! blocks ([`Q8Block`]) and the dot product runs on integers (AVX2 `maddubs`/`madd`), as
//! llama.cpp does: decode is bound by weight bytes, and integer dots keep the compute
//! below the memory time. Other weight types are dequantized block by block and dotted in
//! f32.

use super::{dequantize_row, f16_at};
use crate::DType;

pub const Q8_BLOCK: usize = 32;

/// 32 activations as `d * qs[i]`, with `sum = d * Σ qs` kept for the weight offsets of
/// Q4_0 (−8) and Q4_1 (`m`).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(32))]
pub struct Q8Block {
    pub qs: [i8; Q8_BLOCK],
    pub d: f32,
    pub sum: f32,
}

/// Quantizes `x` (a multiple of 32 long) into `out`, one block per 32 values.
pub fn quantize_row_q8(x: &[f32], out: &mut [Q8Block]) {
    assert_eq!(x.len(), out.len() * Q8_BLOCK);
    for (b, xs) in out.iter_mut().zip(x.chunks_exact(Q8_BLOCK)) {
        let amax = xs.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut s = 0i32;
        for (q, &v) in b.qs.iter_mut().zip(xs) {
            *q = (v * inv).round() as i8;
            s += *q as i32;
        }
        b.d = d;
        b.sum = d * s as f32;
    }
}

/// Whether `dtype` rows are dotted against quantized activations.
pub fn uses_q8_activations(dtype: DType) -> bool {
    matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1)
}

/// Dot product of weight row `w` (`dtype`, `xf.len()` elements) with an activation row
/// given both as f32 (`xf`) and, for integer types, quantized (`xq`).
pub fn vec_dot(dtype: DType, w: &[u8], xq: &[Q8Block], xf: &[f32]) -> f32 {
    let mut out = [0f32];
    dot_rows(dtype, w, xq, xf, &mut out);
    out[0]
}

/// Whether the AVX2 kernels can run here (detected once, then a cached flag).
#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// Dot products of consecutive weight rows (`out.len()` of them, `xf.len()` elements each)
/// with one activation row. Keeping the row loop inside the SIMD kernels lets them run
/// with no per-row dispatch.
pub fn dot_rows(dtype: DType, w: &[u8], xq: &[Q8Block], xf: &[f32], out: &mut [f32]) {
    let row_bytes = dtype.bytes_for(xf.len());
    assert!(w.len() >= out.len() * row_bytes);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports the features the kernels were compiled for.
        unsafe {
            match dtype {
                DType::Q8_0 => {
                    return avx2::rows_q8_0_multi::<1>(w, row_bytes, xq, xq.len(), out.len(), out)
                }
                DType::Q4_0 => {
                    return avx2::rows_q4_multi::<1>(
                        w,
                        row_bytes,
                        xq,
                        xq.len(),
                        false,
                        out.len(),
                        out,
                    )
                }
                DType::Q4_1 => {
                    return avx2::rows_q4_multi::<1>(
                        w,
                        row_bytes,
                        xq,
                        xq.len(),
                        true,
                        out.len(),
                        out,
                    )
                }
                _ => {}
            }
        }
    }
    for (j, o) in out.iter_mut().enumerate() {
        let row = &w[j * row_bytes..(j + 1) * row_bytes];
        *o = match dtype {
            DType::Q8_0 => dot_q8_0_scalar(row, xq),
            DType::Q4_0 => dot_q4_scalar(row, xq, false),
            DType::Q4_1 => dot_q4_scalar(row, xq, true),
            _ => dot_dequantized(dtype, row, xf),
        };
    }
}

/// Activation rows one [`dot_rows_multi`] call takes at most.
pub const MULTI_ROWS: usize = 4;

/// Dot products of `n` consecutive weight rows with `rows` (≤ [`MULTI_ROWS`]) activation
/// rows: `out[r * n + j]` = weight row `j` · activation row `r`. Activations come as f32
/// (`xf`, `rows` × k) and, for integer types, as Q8 blocks (`xq`, `rows` × k/32). The
/// integer kernels decode each weight block once for all the rows (decode batches pay the
/// nibble unpacking once instead of once per sequence), in the same order of operations as
/// [`dot_rows`], so every result is bitwise the one a row gets alone.
pub fn dot_rows_multi(
    dtype: DType,
    w: &[u8],
    xq: &[Q8Block],
    xf: &[f32],
    rows: usize,
    n: usize,
    out: &mut [f32],
) {
    assert!((1..=MULTI_ROWS).contains(&rows) && out.len() >= rows * n);
    let k = xf.len() / rows;
    let nb = k / Q8_BLOCK;
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && uses_q8_activations(dtype) {
        let row_bytes = dtype.bytes_for(k);
        assert!(w.len() >= n * row_bytes && xq.len() >= rows * nb);
        // SAFETY: the CPU supports the features the kernels were compiled for; the sizes
        // were checked above.
        unsafe {
            macro_rules! by_rows {
                ($f:ident $(, $arg:expr)*) => {
                    match rows {
                        1 => avx2::$f::<1>(w, row_bytes, xq, nb, $($arg,)* n, out),
                        2 => avx2::$f::<2>(w, row_bytes, xq, nb, $($arg,)* n, out),
                        3 => avx2::$f::<3>(w, row_bytes, xq, nb, $($arg,)* n, out),
                        _ => avx2::$f::<4>(w, row_bytes, xq, nb, $($arg,)* n, out),
                    }
                };
            }
            match dtype {
                DType::Q8_0 => by_rows!(rows_q8_0_multi),
                DType::Q4_0 => by_rows!(rows_q4_multi, false),
                _ => by_rows!(rows_q4_multi, true),
            }
        }
        return;
    }
    for r in 0..rows {
        let xqr = if uses_q8_activations(dtype) {
            &xq[r * nb..(r + 1) * nb]
        } else {
            &[][..]
        };
        dot_rows(
            dtype,
            w,
            xqr,
            &xf[r * k..(r + 1) * k],
            &mut out[r * n..(r + 1) * n],
        );
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
    if has_avx2() {
        // SAFETY: features checked above.
        return unsafe { avx2::dot_f32(a, b) };
    }
    dot_f32_portable(a, b)
}

/// `out[i] += w * x[i]`, the product and the sum each rounded as the plain loop rounds them
/// (no fused multiply-add), so every path gives the same bits; 8 lanes at a time on AVX2.
pub fn vec_axpy_f32(out: &mut [f32], w: f32, x: &[f32]) {
    assert_eq!(out.len(), x.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: features checked above.
        return unsafe { avx2::axpy_f32(out, w, x) };
    }
    axpy_f32_portable(out, w, x)
}

#[inline(always)]
fn axpy_f32_portable(out: &mut [f32], w: f32, x: &[f32]) {
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Q8Block;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// The portable loop compiled for AVX2: Rust never fuses `w * v + o`, so this rounds
    /// exactly as it does.
    #[target_feature(enable = "avx2")]
    pub unsafe fn axpy_f32(out: &mut [f32], w: f32, x: &[f32]) {
        super::axpy_f32_portable(out, w, x)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (l, acc) in acc.iter_mut().enumerate() {
                let x = _mm256_loadu_ps(pa.add(i + 8 * l));
                let y = _mm256_loadu_ps(pb.add(i + 8 * l));
                *acc = _mm256_fmadd_ps(x, y, *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i)),
                _mm256_loadu_ps(pb.add(i)),
                acc[0],
            );
            i += 8;
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut total = hsum(s);
        while i < n {
            total += a[i] * b[i];
            i += 1;
        }
        total
    }

    /// Sums of `u8 × i8` pairs into eight i32 lanes, converted to f32.
    #[inline(always)]
    unsafe fn mul_sum_us8(ux: __m256i, sy: __m256i) -> __m256 {
        let dot16 = _mm256_maddubs_epi16(ux, sy);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(dot16, _mm256_set1_epi16(1)))
    }

    /// Two f16 values stored side by side (a block's `d` and `m`).
    #[inline(always)]
    unsafe fn f16_pair(p: *const u8) -> (f32, f32) {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }

    #[inline(always)]
    unsafe fn f16_one(p: *const u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
            (p as *const u16).read_unaligned() as i32,
        )))
    }

    /// A Q4_0/Q4_1 block's scale `d`, offset `m` (−8·d for Q4_0) and its 32 nibbles
    /// unpacked to bytes.
    #[inline(always)]
    unsafe fn q4_decode(b: *const u8, has_min: bool) -> (f32, f32, __m256i) {
        let (d, m, qs) = if has_min {
            let (d, m) = f16_pair(b);
            (d, m, b.add(4))
        } else {
            let d = f16_one(b);
            (d, -8.0 * d, b.add(2))
        };
        let q = _mm_loadu_si128(qs as *const __m128i);
        // Low nibbles are elements 0..16, high nibbles 16..32.
        let q = _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16(q, 4), q),
            _mm256_set1_epi8(0x0F),
        );
        (d, m, q)
    }

    /// Adds one Q8_0 block's `d·Σw·x` for each of `R` activation rows (block `blk` of
    /// each) to its accumulator, the weight block loaded once.
    #[inline(always)]
    unsafe fn q8_0_block_multi<const R: usize>(
        b: *const u8,
        xq: &[Q8Block],
        nb: usize,
        blk: usize,
        acc: &mut [__m256; R],
    ) {
        let wq = _mm256_loadu_si256(b.add(2) as *const __m256i);
        // maddubs needs an unsigned operand: move w's sign onto x.
        let wabs = _mm256_sign_epi8(wq, wq);
        let d = f16_one(b);
        for (r, acc) in acc.iter_mut().enumerate() {
            let x = xq.get_unchecked(r * nb + blk);
            let xv = _mm256_load_si256(x.qs.as_ptr() as *const __m256i);
            let p = mul_sum_us8(wabs, _mm256_sign_epi8(xv, wq));
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d), p, *acc);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows_q8_0_multi<const R: usize>(
        w: &[u8],
        row_bytes: usize,
        xq: &[Q8Block],
        nb: usize,
        n: usize,
        out: &mut [f32],
    ) {
        for j in 0..n {
            let wj = w.as_ptr().add(j * row_bytes);
            let (mut a0, mut a1) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
            let pairs = nb / 2;
            for i in 0..pairs {
                q8_0_block_multi(wj.add(68 * i), xq, nb, 2 * i, &mut a0);
                q8_0_block_multi(wj.add(68 * i + 34), xq, nb, 2 * i + 1, &mut a1);
            }
            if nb % 2 == 1 {
                q8_0_block_multi(wj.add(68 * pairs), xq, nb, 2 * pairs, &mut a0);
            }
            for r in 0..R {
                out[r * n + j] = hsum(_mm256_add_ps(a0[r], a1[r]));
            }
        }
    }

    /// Adds one Q4_0/Q4_1 block's `d·Σq·x` for each of `R` activation rows (block `blk`
    /// of each) to its accumulator and the offset term `m·Σx` to its `off`, the nibbles
    /// unpacked once.
    #[inline(always)]
    unsafe fn q4_block_multi<const R: usize>(
        b: *const u8,
        xq: &[Q8Block],
        nb: usize,
        blk: usize,
        has_min: bool,
        acc: &mut [__m256; R],
        off: &mut [f32; R],
    ) {
        let (d, m, q) = q4_decode(b, has_min);
        for r in 0..R {
            let x = xq.get_unchecked(r * nb + blk);
            let xv = _mm256_load_si256(x.qs.as_ptr() as *const __m256i);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d), mul_sum_us8(q, xv), acc[r]);
            off[r] += m * x.sum;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows_q4_multi<const R: usize>(
        w: &[u8],
        row_bytes: usize,
        xq: &[Q8Block],
        nb: usize,
        has_min: bool,
        n: usize,
        out: &mut [f32],
    ) {
        let bb = if has_min { 20 } else { 18 };
        for j in 0..n {
            let wj = w.as_ptr().add(j * row_bytes);
            let (mut a0, mut a1) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
            let (mut o0, mut o1) = ([0f32; R], [0f32; R]);
            let pairs = nb / 2;
            for i in 0..pairs {
                q4_block_multi(wj.add(2 * bb * i), xq, nb, 2 * i, has_min, &mut a0, &mut o0);
                q4_block_multi(
                    wj.add(2 * bb * i + bb),
                    xq,
                    nb,
                    2 * i + 1,
                    has_min,
                    &mut a1,
                    &mut o1,
                );
            }
            if nb % 2 == 1 {
                q4_block_multi(
                    wj.add(2 * bb * pairs),
                    xq,
                    nb,
                    2 * pairs,
                    has_min,
                    &mut a0,
                    &mut o0,
                );
            }
            for r in 0..R {
                out[r * n + j] = hsum(_mm256_add_ps(a0[r], a1[r])) + o0[r] + o1[r];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_row;
    use rand::{Rng, SeedableRng};

    pub(crate) fn random_row(dtype: DType, n: usize, rng: &mut impl Rng) -> Vec<u8> {
        crate::quant::testing::random_quant_row(dtype, n, rng)
    }

    fn q8_dequant(xq: &[Q8Block]) -> Vec<f32> {
        xq.iter()
            .flat_map(|b| b.qs.iter().map(move |&q| b.d * q as f32))
            .collect()
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

    #[test]
    fn integer_dots_match_dequantized_f32() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for dtype in [
            DType::Q8_0,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q4K,
            DType::Q5K,
            DType::Q6K,
        ] {
            for n in [256usize, 512, 768 + 256] {
                let w = random_row(dtype, n, &mut rng);
                let x: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
                let mut xq = vec![Q8Block::default(); n / Q8_BLOCK];
                quantize_row_q8(&x, &mut xq);
                let mut wf = vec![0f32; n];
                dequantize_row(dtype, &w, &mut wf);
                // Integer kernels see the quantized activations; the others see x itself.
                let xr = if uses_q8_activations(dtype) {
                    q8_dequant(&xq)
                } else {
                    x.clone()
                };
                let want: f64 = wf.iter().zip(&xr).map(|(a, b)| *a as f64 * *b as f64).sum();
                let got = vec_dot(dtype, &w, &xq, &x);
                let scale: f64 = wf
                    .iter()
                    .zip(&xr)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                assert!(
                    (got as f64 - want).abs() <= 1e-5 * scale.max(1.0),
                    "{dtype} n={n}: got {got}, want {want}"
                );
                let portable = match dtype {
                    DType::Q8_0 => dot_q8_0_scalar(&w, &xq),
                    DType::Q4_0 => dot_q4_scalar(&w, &xq, false),
                    DType::Q4_1 => dot_q4_scalar(&w, &xq, true),
                    _ => dot_dequantized(dtype, &w, &x),
                };
                assert!(
                    (portable as f64 - want).abs() <= 1e-5 * scale.max(1.0),
                    "{dtype} portable"
                );
            }
        }
    }

    #[test]
    fn multi_row_dots_equal_single_row_dots_bitwise() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q6K] {
            for k in [dtype.block_len() * 3, dtype.block_len() * 4] {
                let n = 7;
                let w: Vec<u8> = (0..n)
                    .flat_map(|_| random_row(dtype, k, &mut rng))
                    .collect();
                for rows in 1..=MULTI_ROWS {
                    let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-2.0..2.0)).collect();
                    let nb = k / Q8_BLOCK;
                    let mut xq = vec![Q8Block::default(); rows * nb];
                    for r in 0..rows {
                        quantize_row_q8(&x[r * k..(r + 1) * k], &mut xq[r * nb..(r + 1) * nb]);
                    }
                    let mut multi = vec![0f32; rows * n];
                    dot_rows_multi(dtype, &w, &xq, &x, rows, n, &mut multi);
                    for r in 0..rows {
                        let xqr = if uses_q8_activations(dtype) {
                            &xq[r * nb..(r + 1) * nb]
                        } else {
                            &[][..]
                        };
                        let mut one = vec![0f32; n];
                        dot_rows(dtype, &w, xqr, &x[r * k..(r + 1) * k], &mut one);
                        for j in 0..n {
                            assert_eq!(
                                multi[r * n + j].to_bits(),
                                one[j].to_bits(),
                                "{dtype} k={k} rows={rows} r={r} j={j}"
                            );
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

    #[test]
    fn q8_quantization_round_trips_within_half_a_step() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 30.0) * 0.37).collect();
        let mut xq = vec![Q8Block::default(); 2];
        quantize_row_q8(&x, &mut xq);
        for (b, xs) in xq.iter().zip(x.chunks(32)) {
            for (&q, &v) in b.qs.iter().zip(xs) {
                assert!((b.d * q as f32 - v).abs() <= b.d * 0.5 + 1e-6);
            }
            let s: i32 = b.qs.iter().map(|&q| q as i32).sum();
            assert_eq!(b.sum, b.d * s as f32);
        }
    }
}
