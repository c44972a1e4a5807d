//! Block formats kept on the device (`kernels/quant.cu`): GGUF's Q8_0, Q4_0, Q4_1, Q4_K and
//! Q6_K matrices stay quantized, so a model takes about its file's size in GPU memory (a
//! Q4_K_M file mixes Q4_K and Q6_K), and so do FP8 ones (`--quantization fp8`). At upload each buffer's blocks are split into two runs, every
//! block's quants and then every block's scales, so that the kernels read the quants in
//! whole 16-byte pieces (the file's 18-, 20-, 34- and 210-byte blocks cannot be). Decode
//! products read the blocks once and dequantize them in registers: one row on the CUDA
//! cores (`quant_gemv`; Q4_K and Q6_K as int8 dot products against the row quantized per 32
//! values, `quant_gemv_q8`), up to 32 or [`MMA_MAX_ROWS`] rows ([`mma_max_rows`]) on tensor
//! cores (`quant_mma`). Larger ones (prefill) dequantize the matrix, [`SCRATCH_VALUES`]
//! values at a time, into an f16 scratch buffer and run as f16 products (cuBLASLt). The
//! three paths sum in different orders, so a row's result depends on which one its step
//! takes. Activations are f16.

use super::{suffix, CudaBackend, CudaBuffer};
use crate::{DType, MatmulOut};
use anyhow::{ensure, Context, Result};
use cudarc::driver::DevicePtr;

/// The block formats kept as they are; other formats (Q5_K) become f16 at load.
pub const KEPT: [DType; 6] = [
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q4K,
    DType::Q6K,
    DType::Fp8,
];
/// Most rows a product runs through `quant_gemv`: from two rows on `quant_mma` is faster
/// (H100, random Llama-3.1-8B-shaped GGUF, decode tok/s with `quant_gemv` against
/// `quant_mma`: Q4_0 B=1 253.7 against 215.6, B=4 537.9 against 811.0; Q4_K B=1 195.7
/// against 160.4, B=4 294.7 against 615.9).
pub const GEMV_MAX_ROWS: usize = 1;
/// Rows of the matrix one `quant_gemv` block computes (QUANT_ROWS): each activation value it
/// reads serves that many weight rows.
pub const GEMV_ROWS: usize = 4;
/// Rows of an FP8 matrix one `quant_gemv` block computes (QUANT_FP8_ROWS) and its warps
/// (QUANT_FP8_WARPS): small blocks, many to an SM, whose loads overlap other blocks'
/// reductions (H200, Llama-3.1-8B shapes, `--quantization fp8`, B=1 decode tok/s, warps ×
/// rows: 8 × 4 296.1, 4 × 4 312.2 and 316.1, 8 × 8 273.1, 4 × 8 242.8, 2 × 4 324.7, 4 × 2
/// 314.1, 2 × 2 334.3 and 331.3, 1 × 2 319.9; figures of one call side by side).
pub const GEMV_FP8_ROWS: usize = 2;
pub const GEMV_FP8_WARPS: usize = 2;
/// Rows of a Q4_K matrix one `quant_gemv_q8` block computes (QUANT_Q8_ROWS): a block
/// quantizes the whole activation row before its products, which eight rows share better
/// than four (H200, random Q4_K file, B=1 decode: 382 against 350 tok/s). Q6_K keeps
/// [`GEMV_ROWS`].
pub const GEMV_Q8_ROWS: usize = 8;
/// Most rows a product runs through `quant_mma` (8 rows an n8 tile, up to 8 tiles).
pub const MMA_MAX_ROWS: usize = 64;
/// Most rows a product of `dtype` blocks runs through `quant_mma`; larger ones take the f16
/// scratch. At 33 to 64 rows the K-quants' separate dequantizing pass costs more than the
/// tensor-core product's dequantization in registers, and the 32-value formats' less (H100,
/// random Llama-3.1-8B-shaped GGUF, B=64 decode against the scratch: Q4_K 3,027 against
/// 2,880 tok/s, Q4_0 3,124 against 3,798). FP8's dequantization in registers is a byte
/// permute and two masks a pair, and it gains most (H200, Llama-3.1-8B shapes,
/// `--quantization fp8`, B=64: 6,440 and 6,438 against 4,349 tok/s).
fn mma_max_rows(dtype: DType) -> usize {
    match dtype {
        DType::Q4K | DType::Q6K | DType::Fp8 => MMA_MAX_ROWS,
        _ => 32,
    }
}
/// Warps of a `quant_mma` block (QMMA_WARPS), an m16 tile of weight rows each.
pub const MMA_WARPS: usize = 8;
/// Rows of the matrix one `quant_mma` block computes (QMMA_ROWS): every x value the block
/// copies into shared memory serves that many weight rows.
pub const MMA_ROWS: usize = 16 * MMA_WARPS;
/// Values of k a `quant_mma` block takes at a time (QMMA_CHUNK): one K-quant block a row.
pub const MMA_CHUNK: usize = 256;
/// Values a row of x takes in `quant_mma`'s shared memory (QMMA_XS_ROW): a chunk and 16 of
/// padding, so that the eight rows a fragment load reads start 32 bytes apart in the banks.
pub const MMA_XS_ROW: usize = MMA_CHUNK + 16;
/// Blocks of `quant_mma` an SM should have: products of fewer row tiles split k.
const MMA_BLOCKS_PER_SM: usize = 2;
/// Values of the f16 scratch that larger products dequantize into (64 MiB): a matrix larger
/// than that is multiplied in runs of rows, so the scratch does not grow with the model.
pub const SCRATCH_VALUES: usize = 32 << 20;
/// Threads of the dequantizing and embedding kernels' blocks.
const THREADS: u32 = 256;

/// Threads of a `quant_gemv` block of `dtype` (32 × GemvShape's WARPS in `quant.cu`): a warp
/// step covers 1,024 values of a K-quant row and 512 of the 32-value formats.
fn gemv_threads(dtype: DType) -> u32 {
    match dtype {
        DType::Q4K | DType::Q6K => 128,
        DType::Fp8 => 32 * GEMV_FP8_WARPS as u32,
        _ => 256,
    }
}

/// Rows of the matrix one `quant_gemv` block of `dtype` computes (GemvShape's ROWS).
fn gemv_rows(dtype: DType) -> usize {
    match dtype {
        DType::Fp8 => GEMV_FP8_ROWS,
        _ => GEMV_ROWS,
    }
}

/// Rows of the matrix one `quant_gemv_q8` block of `dtype` computes (GemvShape's Q8_ROWS).
fn gemv_q8_rows(dtype: DType) -> usize {
    match dtype {
        DType::Q4K => GEMV_Q8_ROWS,
        _ => GEMV_ROWS,
    }
}

/// Shared memory of `quant_gemv_q8` for a row of `k` activations: their int8 values and an f32
/// scale per 32.
fn q8_row_bytes(k: usize) -> usize {
    k + 4 * k.div_ceil(32)
}
/// Most shared memory a kernel gets without opting in; longer rows take `quant_gemv`.
const Q8_MAX_BYTES: usize = 47 << 10;

/// The kernels' name for format `dtype`.
fn format(dtype: DType) -> &'static str {
    match dtype {
        DType::Q8_0 => "q8_0",
        DType::Q4_0 => "q4_0",
        DType::Q4_1 => "q4_1",
        DType::Q4K => "q4_k",
        DType::Q6K => "q6_k",
        DType::Fp8 => "fp8",
        other => panic!("no CUDA kernels for {other} blocks"),
    }
}

/// Where a block of `dtype` keeps its scales (and minimums) and its quants: the two
/// runs the upload splits blocks into.
fn block_layout(dtype: DType) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    match dtype {
        DType::Q8_0 => (0..2, 2..34),
        DType::Q4_0 => (0..2, 2..18),
        DType::Q4_1 => (0..4, 4..20),
        DType::Q4K => (0..16, 16..144),
        DType::Q6K => (192..210, 0..192),
        DType::Fp8 => (0..4, 4..132),
        other => panic!("no CUDA kernels for {other} blocks"),
    }
}

/// Threads a block of `dtype` is read by in the kernels (PARTS).
fn parts(dtype: DType) -> usize {
    match dtype.block_len() {
        32 => 2,
        _ => 8,
    }
}

/// Blocks a buffer of `dtype` holding `numel` values has room for.
fn capacity(buf: &CudaBuffer) -> i64 {
    (buf.numel / buf.dtype.block_len()) as i64
}

impl CudaBackend {
    /// Grows the f16 scratch that larger products dequantize a matrix of `numel` elements
    /// into, up to [`SCRATCH_VALUES`]. Called as quantized matrices are allocated (at load),
    /// so that no product has to allocate, which a recorded step could not.
    pub(super) fn reserve_dequantized(&self, numel: usize) -> Result<()> {
        let numel = numel.min(SCRATCH_VALUES);
        let mut scratch = self.dequantized.lock().unwrap_or_else(|p| p.into_inner());
        if scratch
            .as_ref()
            .is_some_and(|s| s.slice.len() >= DType::F16.bytes_for(numel))
        {
            return Ok(());
        }
        // The smaller scratch goes first, so the two are never held at once.
        *scratch = None;
        let bytes = DType::F16.bytes_for(numel);
        let slice = self.stream.alloc_zeros::<u8>(bytes).with_context(|| {
            format!(
                "allocating {bytes} bytes on {} to dequantize into",
                self.name
            )
        })?;
        let ptr = slice.device_ptr(&self.stream).0;
        *scratch = Some(CudaBuffer {
            slice,
            ptr,
            dtype: DType::F16,
            numel,
        });
        Ok(())
    }

    /// Uploads blocks (as `crate::quant` lays them out) into the start of `dst`, repacked: their
    /// quants at the buffer's start, their scales after the quants of all the blocks the
    /// buffer has room for.
    pub(super) fn upload_blocks(&self, dst: &mut CudaBuffer, bytes: &[u8]) -> Result<()> {
        let (bb, (sc, qs)) = (dst.dtype.block_bytes(), block_layout(dst.dtype));
        ensure!(
            bytes.len().is_multiple_of(bb),
            "upload of {} bytes: not whole {} blocks",
            bytes.len(),
            dst.dtype
        );
        let blocks = bytes.len() / bb;
        let mut quants = Vec::with_capacity(blocks * qs.len());
        let mut scales = Vec::with_capacity(blocks * sc.len());
        for block in bytes.chunks_exact(bb) {
            scales.extend_from_slice(&block[sc.clone()]);
            quants.extend_from_slice(&block[qs.clone()]);
        }
        let scales_at = capacity(dst) as usize * qs.len();
        let mut view = dst.slice.slice_mut(..quants.len());
        self.stream.memcpy_htod(&quants, &mut view)?;
        let mut view = dst.slice.slice_mut(scales_at..scales_at + scales.len());
        self.stream.memcpy_htod(&scales, &mut view)?;
        Ok(())
    }

    /// `out (+)= x · wᵀ (+ bias)` for a matrix `w` of blocks and f16 activations `x`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn quantized_product(
        &self,
        x: &CudaBuffer,
        w: &CudaBuffer,
        bias: Option<&CudaBuffer>,
        m: usize,
        n: usize,
        k: usize,
        out: MatmulOut<'_, Self>,
        accumulate: bool,
    ) {
        assert_eq!(
            x.dtype,
            DType::F16,
            "{} weights take f16 activations",
            w.dtype
        );
        assert!(bias.is_none_or(|b| b.dtype == DType::F32), "biases are f32");
        let (xp, wp, nb) = (x.ptr, w.ptr, capacity(w));
        let (mm, nn, kk, ldl) = (m as i32, n as i32, k as i32, out.row_stride as i64);
        let (bp, acc) = (bias.map_or(0, |b| b.ptr), i32::from(accumulate));
        let (f, o) = (format(w.dtype), out.buf.at(out.col_offset));
        let q8_bytes = q8_row_bytes(k);
        if m == 1 && matches!(w.dtype, DType::Q4K | DType::Q6K) && q8_bytes <= Q8_MAX_BYTES {
            let name = format!("quant_gemv_q8_{f}_{}", suffix(out.buf.dtype));
            launch!(self, name, label = format!("quant_gemv_q8 {} n{n} k{k}", w.dtype),
                shared = q8_bytes as u32,
                (n.div_ceil(gemv_q8_rows(w.dtype)) as u32, 1, 1), gemv_threads(w.dtype);
                xp, wp, nb, bp, nn, kk, o, ldl, acc);
            return;
        }
        if m <= GEMV_MAX_ROWS {
            let name = format!("quant_gemv_{f}_{}_m{m}", suffix(out.buf.dtype));
            launch!(self, name, label = format!("quant_gemv {} m{m} n{n} k{k}", w.dtype),
                (n.div_ceil(gemv_rows(w.dtype)) as u32, 1, 1), gemv_threads(w.dtype);
                xp, wp, nb, bp, nn, kk, o, ldl, acc);
            return;
        }
        if m <= mma_max_rows(w.dtype) {
            let tiles = [1, 2, 4, 8]
                .into_iter()
                .find(|t| 8 * t >= m)
                .expect("m ≤ 64");
            let (splits, per_split) = self.mma_splits(n, k);
            let mut scratch = self.dequantized.lock().unwrap_or_else(|p| p.into_inner());
            let scratch = scratch
                .as_mut()
                .expect("the dequantizing scratch is reserved as quantized matrices are allocated");
            // The split products' sums wait in the scratch, which the larger products'
            // dequantized matrices use: it holds splits·m·n f32 (splits ≤ k / 128).
            assert!(splits == 1 || 4 * splits * m * n <= scratch.slice.len());
            let (pp, ps, ss) = (scratch.ptr, per_split as i32, splits as i32);
            let name = format!("quant_mma_{f}_{}_n{tiles}", suffix(out.buf.dtype));
            launch!(self, name, label = format!("quant_mma {} m{m} n{n} k{k}", w.dtype),
                shared = (2 * 8 * tiles * MMA_XS_ROW * 2) as u32,
                (n.div_ceil(MMA_ROWS) as u32, splits as u32, 1), (32 * MMA_WARPS) as u32;
                xp, wp, nb, bp, mm, nn, kk, o, ldl, acc, pp, ps);
            if splits > 1 {
                launch!(self, format!("quant_mma_reduce_{}", suffix(out.buf.dtype)),
                    label = format!("quant_mma_reduce m{m} n{n}"),
                    ((m * n).div_ceil(THREADS as usize) as u32, 1, 1), THREADS;
                    pp, ss, bp, mm, nn, o, ldl, acc);
            }
            return;
        }
        let mut scratch = self.dequantized.lock().unwrap_or_else(|p| p.into_inner());
        let scratch = scratch
            .as_mut()
            .expect("the dequantizing scratch is reserved as quantized matrices are allocated");
        let capacity_values = scratch.slice.len() / DType::F16.bytes_for(1);
        // Runs of whole 256 rows keep every run's output columns as aligned as the first's.
        let run_rows = if n * k <= capacity_values {
            n
        } else {
            capacity_values / k / 256 * 256
        };
        assert!(
            run_rows > 0,
            "a row of {k} values does not fit the dequantizing scratch"
        );
        let row_blocks = (k / w.dtype.block_len()) as i64;
        let whole = run_rows == n;
        for first in (0..n).step_by(run_rows) {
            let rows = run_rows.min(n - first);
            // It now holds these rows, which the f16 product checks its shape against.
            scratch.numel = rows * k;
            let (start, count, sp) = (
                first as i64 * row_blocks,
                rows as i64 * row_blocks,
                scratch.ptr,
            );
            let threads = count as u64 * parts(w.dtype) as u64;
            launch!(self, format!("quant_dequantize_{f}"),
                label = format!("quant_dequantize {} n{rows} k{k}", w.dtype),
                (threads.div_ceil(THREADS as u64) as u32, 1, 1), THREADS;
                wp, nb, start, count, sp);
            let run_out = MatmulOut {
                buf: &mut *out.buf,
                row_stride: out.row_stride,
                col_offset: out.col_offset + first,
            };
            // A bias is added in the product when there is one run, else after all of them.
            self.product(
                x,
                scratch,
                bias.filter(|_| whole),
                m,
                rows,
                k,
                run_out,
                accumulate,
            );
        }
        if let (false, Some(b)) = (whole, bias) {
            self.bias_add(o, out.buf.dtype, b, m, n, out.row_stride);
        }
    }

    /// How `quant_mma` splits k for a matrix of `n` rows of `k` values: into how many runs
    /// of how many chunks, so that products of few row tiles still give every SM
    /// [`MMA_BLOCKS_PER_SM`] blocks. A run keeps two chunks at least, so the next chunk's
    /// loads have one to hide behind. It depends on the shape only, so a row's sum does not
    /// depend on the rows beside it.
    fn mma_splits(&self, n: usize, k: usize) -> (usize, usize) {
        let chunks = k.div_ceil(MMA_CHUNK);
        let want = (MMA_BLOCKS_PER_SM * self.sm_count as usize).div_ceil(n.div_ceil(MMA_ROWS));
        let per_split = chunks.div_ceil(want.clamp(1, (chunks / 2).max(1)));
        (chunks.div_ceil(per_split), per_split)
    }

    /// [`crate::Backend::embedding`] from a table of blocks, into f16 rows.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn quantized_embedding(
        &self,
        table: &CudaBuffer,
        ids: &CudaBuffer,
        n: usize,
        dim: usize,
        vocab_rows: std::ops::Range<usize>,
        out: &mut CudaBuffer,
    ) {
        assert_eq!(
            out.dtype,
            DType::F16,
            "{} tables give f16 rows",
            table.dtype
        );
        let (t, nb, i, d, o) = (table.ptr, capacity(table), ids.ptr, dim as i32, out.ptr);
        let (first, rows) = (vocab_rows.start as i32, vocab_rows.len() as i32);
        let parts = parts(table.dtype) * dim / table.dtype.block_len();
        let threads = parts.div_ceil(32).clamp(1, 8) as u32 * 32;
        launch!(self, format!("quant_embedding_{}", format(table.dtype)), (n as u32, 1, 1), threads; t, nb, i, first, rows, d, o);
    }
}

#[cfg(test)]
mod tests {
    use super::{block_layout, format, parts, KEPT};

    /// The upload's split of each format's blocks and the kernels' reading of it
    /// (`Block<F>` in quant.cu: values, quant and scale bytes, lanes a block) agree, and the
    /// two runs cover the whole block.
    #[test]
    fn block_layouts_match_the_kernels() {
        let source = include_str!("kernels/quant.cu");
        for dtype in KEPT {
            let tag = format(dtype).to_uppercase();
            let line = source
                .lines()
                .find(|l| l.starts_with(&format!("template <> struct Block<{tag}>")))
                .unwrap_or_else(|| panic!("quant.cu has no Block<{tag}>"));
            let constant = |name: &str| -> usize {
                let at = line.find(&format!(" {name} = ")).expect(name) + name.len() + 4;
                let digits: String = line[at..]
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect();
                digits.parse().unwrap()
            };
            let (scales, quants) = block_layout(dtype);
            assert_eq!(constant("QK"), dtype.block_len(), "{dtype}: values a block");
            assert_eq!(constant("QS"), quants.len(), "{dtype}: quant bytes");
            assert_eq!(constant("SC"), scales.len(), "{dtype}: scale bytes");
            assert_eq!(constant("PARTS"), parts(dtype), "{dtype}: lanes a block");
            assert_eq!(
                constant("PARTS") * constant("VALS"),
                dtype.block_len(),
                "{dtype}: the parts cover the block"
            );
            let mut covered = [scales, quants];
            covered.sort_by_key(|r| r.start);
            assert_eq!(covered[0].start, 0, "{dtype}");
            assert_eq!(covered[0].end, covered[1].start, "{dtype}");
            assert_eq!(covered[1].end, dtype.block_bytes(), "{dtype}");
        }
    }
}
