//! AVX-512 VNNI kernels: Q4_0/Q4_1 integer dots with `vpdpbusd`, two GGUF blocks (64
//! weights) a step.
//!
//! A step's two weight blocks fill one 512-bit register (block 0 in the low half), so the
//! 16 i32 lanes of `vpdpbusd` hold 8 partial sums of each block, and one permute spreads
//! the two blocks' scales over the same halves. The scales and the Q4 offsets of both
//! blocks are computed together in one 4-lane product: `[d0·xd0, m0·xs0, d1·xd1, m1·xs1]`.

use super::activations::Q8Block;
use super::PREFETCH;
use std::arch::x86_64::*;

/// Lanes 0..8 get element 0 of `s`, lanes 8..16 element 2: each block's scale over its
/// half of a `vpdpbusd` result.
#[inline(always)]
unsafe fn spread_scales(s: __m128) -> __m512 {
    let idx = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(s))
}

/// Two activation blocks' quants side by side and their `[d0, sum0, d1, sum1]`.
#[inline(always)]
unsafe fn x_pair(x0: &Q8Block, x1: &Q8Block) -> (__m512i, __m128) {
    let q = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_load_si256(x0.qs.as_ptr() as *const __m256i)),
        _mm256_load_si256(x1.qs.as_ptr() as *const __m256i),
        1,
    );
    // `d` and `sum` are adjacent: one 8-byte load each.
    let ds = _mm_castpd_ps(_mm_loadh_pd(
        _mm_load_sd(&x0.d as *const f32 as *const f64),
        &x1.d as *const f32 as *const f64,
    ));
    (q, ds)
}

/// Q4_0/Q4_1 blocks at `b0` and `b1` (`bb` bytes each): their 64 nibbles as bytes in
/// element order (block 0's in the low half) and `[d0, m0, d1, m1]`, m = −8·d for Q4_0.
#[inline(always)]
unsafe fn q4_pair(b0: *const u8, b1: *const u8, bb: usize, has_min: bool) -> (__m512i, __m128) {
    let qoff = bb - 16;
    let q = _mm256_set_m128i(
        _mm_loadu_si128(b1.add(qoff) as *const __m128i),
        _mm_loadu_si128(b0.add(qoff) as *const __m128i),
    );
    // Low nibbles are elements 0..16 of a block, high ones 16..32: order the 128-bit
    // quarters as [low 0, high 0, low 1, high 1].
    let order = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
    let w = _mm512_permutex2var_epi64(
        _mm512_castsi256_si512(q),
        order,
        _mm512_castsi256_si512(_mm256_srli_epi16(q, 4)),
    );
    let w = _mm512_and_si512(w, _mm512_set1_epi8(0x0F));
    let dm = if has_min {
        let raw = _mm_set_epi32(0, 0, read_u32(b1), read_u32(b0));
        _mm_cvtph_ps(raw)
    } else {
        let raw = _mm_set_epi32(0, 0, read_u16(b1), read_u16(b0));
        let d = _mm_moveldup_ps(_mm_cvtph_ps(raw));
        _mm_mul_ps(d, _mm_set_ps(-8.0, 1.0, -8.0, 1.0))
    };
    (w, dm)
}

#[inline(always)]
unsafe fn read_u32(p: *const u8) -> i32 {
    (p as *const i32).read_unaligned()
}

#[inline(always)]
unsafe fn read_u16(p: *const u8) -> i32 {
    (p as *const u16).read_unaligned() as i32
}

/// Lanes 1 + 3 of `o`: the two blocks' offset terms.
#[inline(always)]
unsafe fn odd_lanes_sum(o: __m128) -> f32 {
    let t = _mm_add_ps(o, _mm_movehl_ps(o, o));
    _mm_cvtss_f32(_mm_movehdup_ps(t))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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
        let mut acc = [_mm512_setzero_ps(); R];
        let mut off = [_mm_setzero_ps(); R];
        // Block pairs; an odd last block is paired with itself, its copy's scale and offset
        // masked to zero.
        let mut blk = 0;
        while blk < nb {
            let last = blk + 1 == nb;
            let next = if last { blk } else { blk + 1 };
            _mm_prefetch::<_MM_HINT_T0>(wj.wrapping_add(blk * bb + PREFETCH) as *const i8);
            let (q, dm) = q4_pair(wj.add(blk * bb), wj.add(next * bb), bb, has_min);
            for r in 0..R {
                let (xv, xds) = x_pair(
                    xq.get_unchecked(r * nb + blk),
                    xq.get_unchecked(r * nb + next),
                );
                let mut s = _mm_mul_ps(dm, xds);
                if last {
                    s = _mm_maskz_mov_ps(0b0011, s);
                }
                let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), spread_scales(s), acc[r]);
                off[r] = _mm_add_ps(off[r], s);
            }
            blk += 2;
        }
        for r in 0..R {
            out[r * n + j] = _mm512_reduce_add_ps(acc[r]) + odd_lanes_sum(off[r]);
        }
    }
}
