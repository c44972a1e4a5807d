//! AVX2 kernels: integer dots with `maddubs`/`madd` (32 weights a step) and f32 dots.

use super::activations::{Q8Block, Q8KBlock};
use super::PREFETCH;
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
    super::dot::axpy_f32_portable(out, w, x)
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
            _mm_prefetch::<_MM_HINT_T0>(wj.wrapping_add(68 * i + PREFETCH) as *const i8);
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
            _mm_prefetch::<_MM_HINT_T0>(wj.wrapping_add(2 * bb * i + PREFETCH) as *const i8);
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

/// `Σ u·s` over each pair of bytes, times `scale` per pair of i16 lanes, into eight i32
/// lanes: one `maddubs` and one `madd` for 32 products and their sub-block scales.
#[inline(always)]
unsafe fn scaled_dot(u: __m256i, s: __m256i, scale: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale)
}

/// Adds `d · Σ_i lanes(acc_i)` of one block to each row's f32 accumulator.
#[inline(always)]
unsafe fn add_scaled<const R: usize>(acc: &mut [__m256; R], isum: &[__m256i; R], d: [f32; R]) {
    for r in 0..R {
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d[r]), _mm256_cvtepi32_ps(isum[r]), acc[r]);
    }
}

/// Q4_K (`high_bit` false) or Q5_K rows against `R` rows of Q8_K activations: per block,
/// `d·Σ sc·Σq·x` on integers and `dmin·Σ m·Σx` from the activations' `bsums`, in the
/// order of the scalar reference's terms.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows_q45k_multi<const R: usize>(
    w: &[u8],
    row_bytes: usize,
    xq: &[Q8KBlock],
    nb: usize,
    high_bit: bool,
    n: usize,
    out: &mut [f32],
) {
    let bb = if high_bit { 176 } else { 144 };
    let low = _mm256_set1_epi8(0x0F);
    for j in 0..n {
        let wj = w.as_ptr().add(j * row_bytes);
        let mut acc = [_mm256_setzero_ps(); R];
        let mut off = [0f32; R];
        for blk in 0..nb {
            let b = wj.add(blk * bb);
            let (d, dmin) = f16_pair(b);
            let scales = std::slice::from_raw_parts(b.add(4), 12);
            let mut sc = [0i16; 8];
            let mut mins = [0i32; 8];
            for (k, (sc, m)) in sc.iter_mut().zip(&mut mins).enumerate() {
                let (s, mi) = super::scale_min_k4(k, scales);
                (*sc, *m) = (s as i16, mi as i32);
            }
            let (qh, qs) = if high_bit {
                (b.add(16), b.add(48))
            } else {
                (b, b.add(16))
            };
            let qhv = if high_bit {
                _mm256_loadu_si256(qh as *const __m256i)
            } else {
                _mm256_setzero_si256()
            };
            let mut isum = [_mm256_setzero_si256(); R];
            for g in 0..4 {
                let q = _mm256_loadu_si256(qs.add(32 * g) as *const __m256i);
                let mut lo = _mm256_and_si256(q, low);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
                if high_bit {
                    // Bit 2g of qh is the fifth bit of the low nibbles, bit 2g+1 of the high.
                    let bit = |k: i32| {
                        let m = _mm256_set1_epi8((1u8 << k) as i8);
                        _mm256_and_si256(
                            _mm256_cmpeq_epi8(_mm256_and_si256(qhv, m), m),
                            _mm256_set1_epi8(16),
                        )
                    };
                    lo = _mm256_or_si256(lo, bit(2 * g as i32));
                    hi = _mm256_or_si256(hi, bit(2 * g as i32 + 1));
                }
                let (s_lo, s_hi) = (
                    _mm256_set1_epi16(sc[2 * g]),
                    _mm256_set1_epi16(sc[2 * g + 1]),
                );
                for (r, isum) in isum.iter_mut().enumerate() {
                    let x = xq.get_unchecked(r * nb + blk).qs.as_ptr().add(64 * g);
                    let x_lo = _mm256_load_si256(x as *const __m256i);
                    let x_hi = _mm256_load_si256(x.add(32) as *const __m256i);
                    let p =
                        _mm256_add_epi32(scaled_dot(lo, x_lo, s_lo), scaled_dot(hi, x_hi, s_hi));
                    *isum = _mm256_add_epi32(*isum, p);
                }
            }
            let mut dx = [0f32; R];
            for r in 0..R {
                let x = xq.get_unchecked(r * nb + blk);
                let msum: i32 = (0..8)
                    .map(|k| mins[k] * (x.bsums[2 * k] as i32 + x.bsums[2 * k + 1] as i32))
                    .sum();
                dx[r] = x.d * d;
                off[r] += x.d * dmin * msum as f32;
            }
            add_scaled(&mut acc, &isum, dx);
        }
        for r in 0..R {
            out[r * n + j] = hsum(acc[r]) - off[r];
        }
    }
}

/// Q6_K rows against `R` rows of Q8_K activations: `d·(Σ sc·Σq·x − 32·Σ sc·Σx)` per block.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows_q6k_multi<const R: usize>(
    w: &[u8],
    row_bytes: usize,
    xq: &[Q8KBlock],
    nb: usize,
    n: usize,
    out: &mut [f32],
) {
    let low = _mm256_set1_epi8(0x0F);
    let two = _mm256_set1_epi8(3);
    for j in 0..n {
        let wj = w.as_ptr().add(j * row_bytes);
        let mut acc = [_mm256_setzero_ps(); R];
        for blk in 0..nb {
            let b = wj.add(blk * 210);
            let d = f16_one(b.add(208));
            let sc = |k: usize| *b.add(192 + k) as i8 as i16;
            let mut isum = [_mm256_setzero_si256(); R];
            for half in 0..2 {
                let ql0 = _mm256_loadu_si256(b.add(64 * half) as *const __m256i);
                let ql1 = _mm256_loadu_si256(b.add(64 * half + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(b.add(128 + 32 * half) as *const __m256i);
                let high = |shift: i32| {
                    let h = match shift {
                        0 => qh,
                        2 => _mm256_srli_epi16(qh, 2),
                        4 => _mm256_srli_epi16(qh, 4),
                        _ => _mm256_srli_epi16(qh, 6),
                    };
                    _mm256_slli_epi16(_mm256_and_si256(h, two), 4)
                };
                let q = [
                    _mm256_or_si256(_mm256_and_si256(ql0, low), high(0)),
                    _mm256_or_si256(_mm256_and_si256(ql1, low), high(2)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), high(4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low), high(6)),
                ];
                for (i, q) in q.iter().enumerate() {
                    // Elements 0..16 of the 32 use one scale, 16..32 the next.
                    let k = half * 8 + 2 * i;
                    let s = _mm256_set_m128i(_mm_set1_epi16(sc(k + 1)), _mm_set1_epi16(sc(k)));
                    for (r, isum) in isum.iter_mut().enumerate() {
                        let x = xq
                            .get_unchecked(r * nb + blk)
                            .qs
                            .as_ptr()
                            .add(128 * half + 32 * i);
                        let xv = _mm256_load_si256(x as *const __m256i);
                        *isum = _mm256_add_epi32(*isum, scaled_dot(*q, xv, s));
                    }
                }
            }
            let mut dx = [0f32; R];
            for r in 0..R {
                let x = xq.get_unchecked(r * nb + blk);
                let offset: i32 = (0..16).map(|k| sc(k) as i32 * x.bsums[k] as i32).sum();
                isum[r] =
                    _mm256_sub_epi32(isum[r], _mm256_setr_epi32(32 * offset, 0, 0, 0, 0, 0, 0, 0));
                dx[r] = x.d * d;
            }
            add_scaled(&mut acc, &isum, dx);
        }
        for r in 0..R {
            out[r * n + j] = hsum(acc[r]);
        }
    }
}

/// [`super::quantize_row_q8`] eight lanes at a time, with the same quants: `round` (half
/// away from zero) as truncation plus a step away from zero where the dropped fraction is at
/// least one half (`v − trunc(v)` is exact).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize_row_q8(x: &[f32], out: &mut [Q8Block]) {
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let sign_mask = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
    let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    for (b, xs) in out.iter_mut().zip(x.chunks_exact(32)) {
        let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xs.as_ptr().add(8 * i)));
        let m = v.iter().fold(_mm256_setzero_ps(), |m, &v| {
            _mm256_max_ps(m, _mm256_and_ps(v, abs_mask))
        });
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let d = amax / 127.0;
        let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let q: [__m256i; 4] = std::array::from_fn(|i| {
            let s = _mm256_mul_ps(v[i], inv);
            let t = _mm256_round_ps(s, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            let away = _mm256_cmp_ps(
                _mm256_and_ps(_mm256_sub_ps(s, t), abs_mask),
                half,
                _CMP_GE_OQ,
            );
            let step = _mm256_and_ps(away, _mm256_or_ps(_mm256_and_ps(s, sign_mask), one));
            _mm256_cvttps_epi32(_mm256_add_ps(t, step))
        });
        let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let sum = _mm_add_epi32(
            _mm256_castsi256_si128(sum),
            _mm256_extracti128_si256(sum, 1),
        );
        let sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0b01_00_11_10));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0b10_11_00_01)));
        // The packs work within 128-bit lanes; the permute puts the 32 bytes back in order.
        let bytes = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(b.qs.as_mut_ptr() as *mut __m256i, bytes);
        b.d = d;
        b.sum = d * sum as f32;
    }
}

/// FP8 blocks ([`crate::quant::fp8`]: an f32 scale, then 128 e4m3 bytes) dotted with `R` f32
/// activation rows of `k` values each: `out[r * n + j]` = weight row `j` · row `r`. Eight
/// bytes at a time become f16 (`(b & 0x80) << 8 | (b & 0x7f) << 7`: 2^-8 of each value,
/// subnormals included, exact) and f32 (`vcvtph2ps`); a block's products are summed, then
/// scaled once by 2^8 times its scale. A row's operations do not depend on `R`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows_fp8_multi<const R: usize>(
    w: &[u8],
    row_bytes: usize,
    xf: &[f32],
    k: usize,
    n: usize,
    out: &mut [f32],
) {
    use crate::{quant::fp8::BLOCK, DType};
    const BB: usize = DType::Fp8.block_bytes();
    let (sign, rest) = (_mm_set1_epi16(0x80), _mm_set1_epi16(0x7f));
    let x = xf.as_ptr();
    for j in 0..n {
        let wj = w.as_ptr().add(j * row_bytes);
        let mut total = [_mm256_setzero_ps(); R];
        for blk in 0..k / BLOCK {
            let b = wj.add(BB * blk);
            _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH) as *const i8);
            let scale = (b as *const f32).read_unaligned() * 256.0;
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            for c in 0..16 {
                let q = _mm_cvtepu8_epi16(_mm_loadl_epi64(b.add(4 + 8 * c) as *const __m128i));
                let h = _mm_or_si128(
                    _mm_slli_epi16(_mm_and_si128(q, sign), 8),
                    _mm_slli_epi16(_mm_and_si128(q, rest), 7),
                );
                let v = _mm256_cvtph_ps(h);
                for (r, acc) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(x.add(r * k + BLOCK * blk + 8 * c));
                    acc[c & 1] = _mm256_fmadd_ps(v, xv, acc[c & 1]);
                }
            }
            for (t, acc) in total.iter_mut().zip(&acc) {
                let s = _mm256_add_ps(acc[0], acc[1]);
                *t = _mm256_fmadd_ps(_mm256_set1_ps(scale), s, *t);
            }
        }
        for (r, t) in total.iter().enumerate() {
            out[r * n + j] = hsum(*t);
        }
    }
}
