//! Activation rows quantized to 8 bits for the integer dot products, in the block shape of
//! the weight type they meet: 32-element [`Q8Block`]s for Q8_0/Q4_0/Q4_1, 256-element
//! [`Q8KBlock`]s for the K-quants (as llama.cpp's Q8_K).

use super::Isa;
use crate::DType;

pub const Q8_BLOCK: usize = 32;
pub const Q8K_BLOCK: usize = 256;

/// 32 activations as `d * qs[i]`, with `sum = d * Σ qs` kept for the weight offsets of
/// Q4_0 (−8) and Q4_1 (`m`).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(32))]
pub struct Q8Block {
    pub qs: [i8; Q8_BLOCK],
    pub d: f32,
    pub sum: f32,
}

/// 256 activations as `d * qs[i]`, with the sum of each 16 quants (`bsums`) kept for the
/// K-quants' per-sub-block offsets (Q4_K/Q5_K mins, Q6_K's −32).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(32))]
pub struct Q8KBlock {
    pub qs: [i8; Q8K_BLOCK],
    pub d: f32,
    pub bsums: [i16; 16],
}

impl Default for Q8KBlock {
    fn default() -> Self {
        Q8KBlock {
            qs: [0; Q8K_BLOCK],
            d: 0.0,
            bsums: [0; 16],
        }
    }
}

/// The step `d` that maps `xs` onto −127..=127, and its inverse.
fn scale(xs: &[f32]) -> (f32, f32) {
    let amax = xs.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let d = amax / 127.0;
    (d, if d > 0.0 { 1.0 / d } else { 0.0 })
}

/// Quantizes `x` (a multiple of 32 long) into `out`, one block per 32 values.
pub fn quantize_row_q8(x: &[f32], out: &mut [Q8Block]) {
    assert_eq!(x.len(), out.len() * Q8_BLOCK);
    #[cfg(target_arch = "x86_64")]
    if Isa::selected() >= Isa::Avx2 {
        // SAFETY: the CPU has AVX2 (checked when the ISA was chosen).
        return unsafe { super::avx2::quantize_row_q8(x, out) };
    }
    quantize_row_q8_portable(x, out)
}

pub(super) fn quantize_row_q8_portable(x: &[f32], out: &mut [Q8Block]) {
    for (b, xs) in out.iter_mut().zip(x.chunks_exact(Q8_BLOCK)) {
        let (d, inv) = scale(xs);
        let mut s = 0i32;
        for (q, &v) in b.qs.iter_mut().zip(xs) {
            *q = (v * inv).round() as i8;
            s += *q as i32;
        }
        b.d = d;
        b.sum = d * s as f32;
    }
}

/// Quantizes `x` (a multiple of 256 long) into `out`, one block per 256 values.
pub fn quantize_row_q8k(x: &[f32], out: &mut [Q8KBlock]) {
    assert_eq!(x.len(), out.len() * Q8K_BLOCK);
    for (b, xs) in out.iter_mut().zip(x.chunks_exact(Q8K_BLOCK)) {
        let (d, inv) = scale(xs);
        for (q, &v) in b.qs.iter_mut().zip(xs) {
            *q = (v * inv).round() as i8;
        }
        for (s, qs) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = qs.iter().map(|&q| q as i16).sum();
        }
        b.d = d;
    }
}

/// Which activation blocks the integer kernel of `dtype` takes, if it has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationBlocks {
    /// The kernel dequantizes the weights and dots them with f32 activations.
    None,
    Q8,
    Q8K,
}

impl ActivationBlocks {
    pub fn of(dtype: DType) -> ActivationBlocks {
        match dtype {
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => ActivationBlocks::Q8,
            DType::Q4K | DType::Q5K | DType::Q6K => ActivationBlocks::Q8K,
            _ => ActivationBlocks::None,
        }
    }
}

/// Quantized activation rows, as a kernel takes them.
#[derive(Clone, Copy)]
pub enum Quantized<'a> {
    None,
    Q8(&'a [Q8Block]),
    Q8K(&'a [Q8KBlock]),
}

/// What [`Quantized`] and [`QuantizedRows`] need of both block kinds.
trait Block: Copy + Default {
    const LEN: usize;
    fn quantize_row(x: &[f32], out: &mut [Self]);
    fn values(&self) -> impl Iterator<Item = f32>;
}

impl Block for Q8Block {
    const LEN: usize = Q8_BLOCK;
    fn quantize_row(x: &[f32], out: &mut [Self]) {
        quantize_row_q8(x, out)
    }
    fn values(&self) -> impl Iterator<Item = f32> {
        self.qs.iter().map(|&q| self.d * q as f32)
    }
}

impl Block for Q8KBlock {
    const LEN: usize = Q8K_BLOCK;
    fn quantize_row(x: &[f32], out: &mut [Self]) {
        quantize_row_q8k(x, out)
    }
    fn values(&self) -> impl Iterator<Item = f32> {
        self.qs.iter().map(|&q| self.d * q as f32)
    }
}

/// Rows `r0..r1` of blocks for rows `k` elements long.
fn rows_of<B: Block>(q: &[B], r0: usize, r1: usize, k: usize) -> &[B] {
    let nb = k / B::LEN;
    &q[r0 * nb..r1 * nb]
}

/// `x` (`rows` rows of `k`) quantized into `buf`.
fn quantize_rows<'a, B: Block>(buf: &'a mut Vec<B>, x: &[f32], rows: usize, k: usize) -> &'a [B] {
    let nb = k / B::LEN;
    buf.resize(rows * nb, B::default());
    for (x, q) in x.chunks_exact(k).zip(buf.chunks_exact_mut(nb)) {
        B::quantize_row(x, q);
    }
    buf
}

impl<'a> Quantized<'a> {
    /// Rows `r0..r1` of rows `k` elements long.
    pub fn rows(self, r0: usize, r1: usize, k: usize) -> Quantized<'a> {
        match self {
            Quantized::None => Quantized::None,
            Quantized::Q8(q) => Quantized::Q8(rows_of(q, r0, r1, k)),
            Quantized::Q8K(q) => Quantized::Q8K(rows_of(q, r0, r1, k)),
        }
    }

    /// The values the integer kernels multiply with (for tests and references).
    pub fn dequantized(self) -> Vec<f32> {
        match self {
            Quantized::None => vec![],
            Quantized::Q8(q) => q.iter().flat_map(Block::values).collect(),
            Quantized::Q8K(q) => q.iter().flat_map(Block::values).collect(),
        }
    }
}

/// Buffers for quantized activation rows, reused from call to call.
#[derive(Default)]
pub struct QuantizedRows {
    q8: Vec<Q8Block>,
    q8k: Vec<Q8KBlock>,
}

impl QuantizedRows {
    /// `x` (`rows` rows of `k`) in the blocks `dtype`'s kernel takes; nothing for f32 ones.
    pub fn quantize(&mut self, dtype: DType, x: &[f32], rows: usize, k: usize) -> Quantized<'_> {
        match ActivationBlocks::of(dtype) {
            ActivationBlocks::None => Quantized::None,
            ActivationBlocks::Q8 => Quantized::Q8(quantize_rows(&mut self.q8, x, rows, k)),
            ActivationBlocks::Q8K => Quantized::Q8K(quantize_rows(&mut self.q8k, x, rows, k)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn simd_quantization_gives_the_portable_quants() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        // Random values, exact halves of a step (the rounding ties), zeros and a lone value.
        let mut x: Vec<f32> = (0..32 * 64).map(|_| rng.random_range(-3.0..3.0)).collect();
        for (i, v) in x[..64].iter_mut().enumerate() {
            *v = (i as f32 - 31.5) * 0.5;
        }
        x[64..96].fill(0.0);
        x[96..128].fill(0.0);
        x[100] = -2.5;
        let mut want = vec![Q8Block::default(); x.len() / 32];
        quantize_row_q8_portable(&x, &mut want);
        let mut got = vec![Q8Block::default(); x.len() / 32];
        quantize_row_q8(&x, &mut got);
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(
                (g.qs, g.d.to_bits(), g.sum.to_bits()),
                (w.qs, w.d.to_bits(), w.sum.to_bits())
            );
        }
    }

    #[test]
    fn q8_quantization_round_trips_within_half_a_step() {
        let x: Vec<f32> = (0..256).map(|i| (i as f32 - 130.0) * 0.37).collect();
        let mut xq = vec![Q8Block::default(); 8];
        quantize_row_q8(&x, &mut xq);
        for (b, xs) in xq.iter().zip(x.chunks(32)) {
            for (&q, &v) in b.qs.iter().zip(xs) {
                assert!((b.d * q as f32 - v).abs() <= b.d * 0.5 + 1e-6);
            }
            let s: i32 = b.qs.iter().map(|&q| q as i32).sum();
            assert_eq!(b.sum, b.d * s as f32);
        }
        let mut xk = vec![Q8KBlock::default(); 1];
        quantize_row_q8k(&x, &mut xk);
        let b = &xk[0];
        for (&q, &v) in b.qs.iter().zip(&x) {
            assert!((b.d * q as f32 - v).abs() <= b.d * 0.5 + 1e-5);
        }
        for (j, &s) in b.bsums.iter().enumerate() {
            assert_eq!(
                s as i32,
                b.qs[16 * j..16 * j + 16]
                    .iter()
                    .map(|&q| q as i32)
                    .sum::<i32>()
            );
        }
    }
}
