//! The host side of `kernels/tma_product.cu`, the Hopper product for 5 to 8 rows: its
//! tile, ring and warps (given to NVRTC as definitions), the shared memory they take, how
//! far k is split, and the TMA tensor maps of its operands.

use crate::DType;
use anyhow::{bail, Result};
use cudarc::driver::sys;

/// Weight rows a work unit covers (four m16 tiles).
pub const BN: usize = 64;
/// k a ring stage holds (four 64-wide slabs).
pub const BK: usize = 256;
/// Stages in the ring: 5 x 40 KB, what shared memory holds beside the warps' sums.
pub const STAGES: usize = 5;
/// Consumer warps; one more warp issues the copies.
pub const WARPS: usize = 8;
/// Input rows a stage holds (the m16n8k16 products' two n8 tiles; rows past m read as
/// zeros).
pub const BOX_ROWS: usize = 16;
/// Most rows a product runs through `tma_product`. It computes 16, but at 16 rows its k
/// parts' sum kernels cost what it gains (H100, Llama-3.1-8B shapes, B=16 decode 2,206.4 /
/// 2,222.4 against cuBLASLt's 2,242.5 / 2,233.4 tok/s; B=8 1,239.7 / 1,238.0 against
/// 1,204.9 / 1,201.6).
pub const MAX_ROWS: usize = 8;
/// Consumer warps along k; the others split the m16 tiles.
pub const K_WARPS: usize = 4;
/// Bytes of the f32 partial sums of the k parts.
pub const PARTIALS_BYTES: usize = 32 << 20;

/// Threads a block.
pub const THREADS: u32 = (32 * (WARPS + 1)) as u32;

/// Dynamic shared memory a block takes: the ring (weight and input slabs), its full and
/// empty mbarriers, the warps' sums, and 1 KB to align the ring to the swizzle's 1024 bytes.
pub const SHARED_BYTES: u32 = (1024
    + STAGES * BK / 64 * (BN + BOX_ROWS) * 128
    + 2 * STAGES * 8
    + K_WARPS * BOX_ROWS * BN * 4) as u32;
const _: () = assert!(
    WARPS.is_multiple_of(K_WARPS) && (BN / 16).is_multiple_of(WARPS / K_WARPS),
    "tma_product's warps must split k and the m16 tiles evenly"
);
const _: () = assert!(
    SHARED_BYTES as usize <= 227 * 1024,
    "tma_product's ring does not fit in an SM's shared memory"
);

/// The k parts an n x k product is split into: the fewest that give every SM at least two
/// work units and leave the last round of units at least 95% full; failing that, the most
/// even split. k parts must hold whole stages. (H100, 16 rows at Llama-3.1-8B shapes: qkv
/// 4, o 8, gate/up 2, down 8, as measured best in scripts/gpu/tma_gemm.cu.)
pub fn k_parts(n: usize, k: usize, sms: usize) -> usize {
    let (tiles, steps) = (n / BN, k / BK);
    let fill = |parts: usize| {
        let units = tiles * parts;
        units as f64 / (units.div_ceil(sms) * sms) as f64
    };
    let valid = [1, 2, 4, 8, 16]
        .into_iter()
        .filter(|p| steps.is_multiple_of(*p));
    if let Some(p) = valid
        .clone()
        .find(|&p| tiles * p >= 2 * sms && fill(p) >= 0.95)
    {
        return p;
    }
    valid
        .max_by(|a, b| fill(*a).total_cmp(&fill(*b)))
        .unwrap_or(1)
}

/// A TMA tensor map of the row-major `rows` x `k` matrix at `ptr`, copied as boxes of 64
/// columns x `box_rows` rows (rows past `rows` read as zeros) with the 128-byte swizzle the
/// kernel reads.
pub fn tensor_map(
    ptr: u64,
    dtype: DType,
    rows: usize,
    k: usize,
    box_rows: usize,
) -> Result<[u64; 16]> {
    let data_type = match dtype {
        DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        other => bail!("tma_product takes bf16 or f16, not {other:?}"),
    };
    let dims = [k as u64, rows as u64];
    let strides = [(k * 2) as u64];
    let boxes = [64u32, box_rows as u32];
    let element_strides = [1u32, 1];
    // SAFETY: plain out-parameter and arrays of the rank given; the driver only encodes.
    unsafe {
        let mut map: sys::CUtensorMap = std::mem::zeroed();
        sys::cuTensorMapEncodeTiled(
            &mut map,
            data_type,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()?;
        Ok(map.opaque)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k_parts_give_every_sm_even_work() {
        // Llama-3.1-8B's decode products on 132 SMs.
        assert_eq!(k_parts(6144, 4096, 132), 4);
        assert_eq!(k_parts(4096, 4096, 132), 8);
        assert_eq!(k_parts(28672, 4096, 132), 2);
        assert_eq!(k_parts(4096, 14336, 132), 8);
        assert_eq!(k_parts(128256, 4096, 132), 2);
        // k of one stage cannot be split.
        assert_eq!(k_parts(64, 256, 132), 1);
    }
}
