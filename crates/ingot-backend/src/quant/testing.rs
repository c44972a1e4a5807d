//! Random quantized data for kernel tests (here and in the backends built on this crate).

use crate::DType;
use half::f16;

/// A random row of `n` elements in `dtype`: random quant bytes with scales in a sane range,
/// so every code path of the format (high bits, negative scales, mins) is exercised.
pub fn random_quant_row(dtype: DType, n: usize, rng: &mut impl rand::Rng) -> Vec<u8> {
    random_quant_row_scaled(dtype, n, 0.05, rng)
}

/// [`random_quant_row`] with block scales (and mins) in `-max_scale..max_scale`: products
/// of long rows stay inside f16's range where the scale shrinks with the row length.
pub fn random_quant_row_scaled(
    dtype: DType,
    n: usize,
    max_scale: f32,
    rng: &mut impl rand::Rng,
) -> Vec<u8> {
    let mut bytes: Vec<u8> = (0..dtype.bytes_for(n))
        .map(|_| rng.random::<u8>())
        .collect();
    let bb = dtype.block_bytes();
    if dtype == DType::Fp8 {
        // e4m3 reaches 448 where Q8_0's quants reach 128: the same range of values. The NaN
        // bytes become the largest finite ones.
        for block in bytes.chunks_exact_mut(bb) {
            let scale = (rng.random::<f32>() * 2.0 - 1.0) * max_scale * 128.0 / 448.0;
            block[..4].copy_from_slice(&scale.to_le_bytes());
            for q in &mut block[4..] {
                if *q & 0x7f == 0x7f {
                    *q -= 1;
                }
            }
        }
        return bytes;
    }
    let scale_at: &[usize] = match dtype {
        DType::Q8_0 | DType::Q4_0 => &[0],
        DType::Q4_1 | DType::Q4K | DType::Q5K => &[0, 2],
        DType::Q6K => &[208],
        _ => panic!("{dtype} is not quantized"),
    };
    for block in bytes.chunks_exact_mut(bb) {
        for &at in scale_at {
            let v = (rng.random::<f32>() * 2.0 - 1.0) * max_scale;
            block[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        }
    }
    bytes
}
