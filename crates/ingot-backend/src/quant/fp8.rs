//! FP8 weight blocks (`--quantization fp8`, [`DType::Fp8`]): 128 consecutive values of a row
//! as e4m3 bytes behind one f32 scale, value = scale · e4m3. A block is the scale (4 bytes,
//! little-endian) then the 128 bytes.
//!
//! A scale a block of 128 rather than vLLM's one a row (its dynamic FP8): each block is
//! scaled to its own largest value, so a row with a few large weights loses less, for 3 %
//! more bytes, and the checkpoints published in FP8 convert exactly (a scale per row, or
//! DeepSeek's and Qwen's per 128 × 128 tile, is the same scale in each of a row's blocks).
//! e4m3 is the OCP format NVIDIA's FP8 tensor cores take: 4 exponent bits (bias 7), 3
//! mantissa bits, ±448 at most, no infinities; 0x7f and 0xff are NaN.

use crate::DType;
use float8::F8E4M3;

/// Values a block.
pub const BLOCK: usize = 128;
/// The largest finite e4m3 value: a block's largest |value| is scaled to it.
pub const E4M3_MAX: f32 = 448.0;

/// Every e4m3 byte as f32 (NaN for 0x7f and 0xff).
static E4M3: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = F8E4M3::from_bits(i as u8).to_f32();
        i += 1;
    }
    t
};

/// The value of e4m3 byte `b`.
pub fn e4m3_to_f32(b: u8) -> f32 {
    E4M3[b as usize]
}

/// `v` rounded to the nearest e4m3 (ties to even), saturating at ±448 as CUDA's
/// `__nv_cvt_float_to_fp8(.., __NV_SATFINITE, __NV_E4M3)`.
pub fn f32_to_e4m3(v: f32) -> u8 {
    F8E4M3::from_f32(v).to_bits()
}

/// Quantizes [`BLOCK`] values into one block of [`DType::Fp8`] (`out`: 132 bytes). The
/// scale is the largest |value| over 448, so that value becomes ±448 exactly; an all-zero
/// block has scale 0.
pub fn quantize_block(v: &[f32], out: &mut [u8]) {
    assert_eq!(v.len(), BLOCK);
    assert_eq!(out.len(), DType::Fp8.block_bytes());
    let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    let scale = amax / E4M3_MAX;
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    out[..4].copy_from_slice(&scale.to_le_bytes());
    for (o, &x) in out[4..].iter_mut().zip(v) {
        *o = f32_to_e4m3(x * inv);
    }
}

/// Dequantizes one block (132 bytes) into [`BLOCK`] values.
pub fn dequantize_block(b: &[u8], y: &mut [f32]) {
    let scale = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (y, &q) in y.iter_mut().zip(&b[4..4 + BLOCK]) {
        *y = scale * e4m3_to_f32(q);
    }
}

/// Quantizes a row (a whole number of blocks) into `out`.
pub fn quantize_row(v: &[f32], out: &mut [u8]) {
    let bb = DType::Fp8.block_bytes();
    assert_eq!(out.len(), DType::Fp8.bytes_for(v.len()));
    for (x, o) in v.chunks_exact(BLOCK).zip(out.chunks_exact_mut(bb)) {
        quantize_block(x, o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The format's landmarks: its largest value, smallest normal and subnormal, one, and a
    /// sign; values past 448 saturate; a tie rounds to the even neighbour.
    #[test]
    fn e4m3_encodes_the_ocp_format() {
        for (v, bits) in [
            (448.0, 0x7e),
            (-448.0, 0xfe),
            (1.0, 0x38),
            (-1.0, 0xb8),
            (2f32.powi(-6), 0x08),
            (2f32.powi(-9), 0x01),
            (0.0, 0x00),
            (1e6, 0x7e),
            (1.0625, 0x38), // halfway between 1 and 1.125: the even mantissa
            (1.1875, 0x3a), // halfway between 1.125 and 1.25
        ] {
            assert_eq!(f32_to_e4m3(v), bits, "{v}");
        }
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        for b in (0u8..=255).filter(|b| b & 0x7f != 0x7f) {
            assert_eq!(f32_to_e4m3(e4m3_to_f32(b)), b, "byte {b:#04x} round trips");
        }
    }

    /// A block keeps its largest value exactly and every value within half a step of e4m3
    /// (3 mantissa bits: 1/16 of the value, or half the subnormal step below 2^-6 · scale).
    #[test]
    fn blocks_round_trip_within_half_a_step() {
        let mut rng = StdRng::seed_from_u64(8);
        for spread in [1e-3f32, 0.05, 3.0] {
            let v: Vec<f32> = (0..BLOCK)
                .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * spread)
                .collect();
            let mut block = vec![0u8; DType::Fp8.block_bytes()];
            quantize_block(&v, &mut block);
            let mut y = vec![0f32; BLOCK];
            dequantize_block(&block, &mut y);
            let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
            let scale = amax / E4M3_MAX;
            for (a, b) in v.iter().zip(&y) {
                let step = (a.abs() / 16.0).max(scale * 2f32.powi(-10));
                assert!(
                    (a - b).abs() <= step * 1.0001,
                    "{a} became {b} (scale {scale})"
                );
                if a.abs() == amax {
                    assert!((a - b).abs() <= amax * 1e-6, "the largest value is kept");
                }
            }
        }
        let mut block = vec![0xaa; DType::Fp8.block_bytes()];
        quantize_block(&[0.0; BLOCK], &mut block);
        let mut y = vec![1f32; BLOCK];
        dequantize_block(&block, &mut y);
        assert!(y.iter().all(|&x| x == 0.0), "an all-zero block stays zero");
    }
}
