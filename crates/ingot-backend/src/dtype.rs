//! Element types of device buffers, including GGUF block-quantized formats.

use std::fmt;

/// The element type of a buffer. Quantized types store rows as consecutive blocks; a row's
/// length must be a multiple of [`DType::block_len`]. The GGUF formats are laid out as GGUF
/// defines them; [`DType::Fp8`] is ingot's own (`crate::quant::fp8`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    I32,
    Q8_0,
    Q4_0,
    Q4_1,
    Q4K,
    Q5K,
    Q6K,
    /// FP8 e4m3 values behind an f32 scale, 128 values a block (`--quantization fp8`).
    Fp8,
}

impl DType {
    /// Elements per quantization block (1 for plain types).
    pub const fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 | DType::I32 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => 32,
            DType::Fp8 => 128,
            DType::Q4K | DType::Q5K | DType::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q4K => 144,
            DType::Q5K => 176,
            DType::Q6K => 210,
            DType::Fp8 => 132,
        }
    }

    pub const fn is_quantized(self) -> bool {
        self.block_len() > 1
    }

    /// Bytes taken by `numel` elements; `numel` must be a whole number of blocks.
    pub fn bytes_for(self, numel: usize) -> usize {
        debug_assert_eq!(numel % self.block_len(), 0, "{self} needs whole blocks");
        numel / self.block_len() * self.block_bytes()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q4K => "Q4_K",
            DType::Q5K => "Q5_K",
            DType::Q6K => "Q6_K",
            DType::Fp8 => "fp8",
        };
        f.write_str(s)
    }
}
