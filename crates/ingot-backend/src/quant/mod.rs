//! Block formats — GGUF's, and ingot's FP8 ([`fp8`]): dequantization (the reference every
//! kernel is tested against) and the integer dot products the CPU matmul uses for decode.
//!
//! Layouts follow the GGUF specification; each row of a weight matrix is a run of blocks.

mod activations;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod dot;
pub mod fp8;
mod isa;
pub mod testing;

pub use activations::{
    quantize_row_q8, quantize_row_q8k, ActivationBlocks, Q8Block, Q8KBlock, Quantized,
    QuantizedRows, Q8K_BLOCK, Q8_BLOCK,
};
pub use dot::{dot_rows, dot_rows_multi, vec_axpy_f32, vec_dot, vec_dot_f32, MULTI_ROWS};
pub use isa::Isa;

use crate::DType;
use half::{bf16, f16};

/// How far ahead of the weight block being read the SIMD dot loops ask for its cache line.
/// Measured on the 2-core Xeon VM (Q4_1/Q8_0 rows coming from L3): without it cold rows ran
/// 15–20% slower than rows already in L2; with it, within 10%.
#[cfg(target_arch = "x86_64")]
const PREFETCH: usize = 2048;

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantizes one row (`out.len()` elements) stored as `dtype` in `src`.
pub fn dequantize_row(dtype: DType, src: &[u8], out: &mut [f32]) {
    let n = out.len();
    assert_eq!(src.len(), dtype.bytes_for(n), "{dtype} row of {n} elements");
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::I32 => panic!("i32 is not a weight type"),
        _ => {
            let (bl, bb) = (dtype.block_len(), dtype.block_bytes());
            for (o, b) in out.chunks_exact_mut(bl).zip(src.chunks_exact(bb)) {
                dequantize_block(dtype, b, o);
            }
        }
    }
}

/// Dequantizes one block of a quantized type.
pub fn dequantize_block(dtype: DType, b: &[u8], y: &mut [f32]) {
    match dtype {
        DType::Fp8 => fp8::dequantize_block(b, y),
        DType::Q8_0 => {
            let d = f16_at(b, 0);
            for (y, &q) in y.iter_mut().zip(&b[2..34]) {
                *y = d * (q as i8) as f32;
            }
        }
        DType::Q4_0 => {
            let d = f16_at(b, 0);
            let qs = &b[2..18];
            for j in 0..16 {
                y[j] = d * ((qs[j] & 0x0F) as i32 - 8) as f32;
                y[j + 16] = d * ((qs[j] >> 4) as i32 - 8) as f32;
            }
        }
        DType::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qs = &b[4..20];
            for j in 0..16 {
                y[j] = d * (qs[j] & 0x0F) as f32 + m;
                y[j + 16] = d * (qs[j] >> 4) as f32 + m;
            }
        }
        DType::Q4K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let qs = &b[16..144];
            for (g, y) in y.chunks_exact_mut(64).enumerate() {
                let q = &qs[g * 32..g * 32 + 32];
                let (sc1, m1) = scale_min_k4(2 * g, scales);
                let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
                let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
                let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
                for l in 0..32 {
                    y[l] = d1 * (q[l] & 0x0F) as f32 - m1;
                    y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
                }
            }
        }
        DType::Q5K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let qh = &b[16..48];
            let qs = &b[48..176];
            for (g, y) in y.chunks_exact_mut(64).enumerate() {
                let ql = &qs[g * 32..g * 32 + 32];
                let (u1, u2) = (1u8 << (2 * g), 2u8 << (2 * g));
                let (sc1, m1) = scale_min_k4(2 * g, scales);
                let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
                let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
                let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
                for l in 0..32 {
                    let hi1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                    let hi2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                    y[l] = d1 * ((ql[l] & 0x0F) + hi1) as f32 - m1;
                    y[l + 32] = d2 * ((ql[l] >> 4) + hi2) as f32 - m2;
                }
            }
        }
        DType::Q6K => {
            let d = f16_at(b, 208);
            for half in 0..2 {
                let ql = &b[half * 64..half * 64 + 64];
                let qh = &b[128 + half * 32..128 + half * 32 + 32];
                let sc = &b[192 + half * 8..192 + half * 8 + 8];
                let y = &mut y[half * 128..half * 128 + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
        DType::F32 | DType::F16 | DType::BF16 | DType::I32 => {
            panic!("{dtype} has no blocks")
        }
    }
}

/// The 6-bit scale and min of sub-block `j` in the packed 12-byte K-quant scales.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_block_decodes_scale_min_and_nibbles() {
        let mut b = vec![0u8; 20];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        b[4] = 0x3A; // low nibble 10 -> element 0, high nibble 3 -> element 16
        let mut y = [0f32; 32];
        dequantize_block(DType::Q4_1, &b, &mut y);
        assert_eq!(y[0], 0.5 * 10.0 - 1.0);
        assert_eq!(y[16], 0.5 * 3.0 - 1.0);
        assert_eq!(y[1], -1.0);
    }

    #[test]
    fn k4_scales_unpack_high_bits() {
        let mut q = [0u8; 12];
        q[0] = 0b1100_0001; // scale 1 for j=0, top bits feed j=4's scale
        q[4] = 0b1000_0010; // min 2 for j=0, top bits feed j=4's min
        q[8] = 0x53; // j=4: low scale bits 3, low min bits 5
        assert_eq!(scale_min_k4(0, &q), (1, 2));
        assert_eq!(scale_min_k4(4, &q), (3 | (3 << 4), 5 | (2 << 4)));
    }
}
