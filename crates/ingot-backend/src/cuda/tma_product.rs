//! The host side of `kernels/tma_product.cu`, the Hopper product for 5 to 16 rows: its
//! tile, ring and warps (given to NVRTC as definitions), the shared memory they take, and
//! the TMA tensor maps of its operands.

use crate::DType;
use anyhow::{bail, Result};
use cudarc::driver::sys;

/// Weight rows a tile covers (two m16 tiles). 32 rows give every SM of an H100 a tile of
/// Llama-3.1-8B's narrowest products (o and down, 4096 rows: 128 tiles) with no k split.
pub const BN: usize = 32;
/// k a ring stage holds (four 64-wide slabs).
pub const BK: usize = 256;
/// Stages in the ring: 8 x 24 KB, what shared memory holds beside the warps' sums.
pub const STAGES: usize = 8;
/// Consumer warps; one more warp issues the copies.
pub const WARPS: usize = 8;
/// Input rows a stage holds (the m16n8k16 products' two n8 tiles; rows past m read as
/// zeros).
pub const BOX_ROWS: usize = 16;
/// Most rows a product runs through `tma_product`: what a stage holds.
pub const MAX_ROWS: usize = BOX_ROWS;
/// Consumer warps along k; the others split the m16 tiles.
pub const K_WARPS: usize = 4;

/// Threads a block.
pub const THREADS: u32 = (32 * (WARPS + 1)) as u32;

/// Dynamic shared memory a block takes: the ring (weight and input slabs), its full and
/// empty mbarriers, the warps' sums and sums of squares, and 1 KB to align the ring to the
/// swizzle's 1024 bytes.
pub const SHARED_BYTES: u32 = (1024
    + STAGES * BK / 64 * (BN + BOX_ROWS) * 128
    + 2 * STAGES * 8
    + K_WARPS * BOX_ROWS * (BN + 1) * 4) as u32;
const _: () = assert!(
    WARPS.is_multiple_of(K_WARPS) && (BN / 16).is_multiple_of(WARPS / K_WARPS),
    "tma_product's warps must split k and the m16 tiles evenly"
);
const _: () = assert!(
    SHARED_BYTES as usize <= 227 * 1024,
    "tma_product's ring does not fit in an SM's shared memory"
);

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
