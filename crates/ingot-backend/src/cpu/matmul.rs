//! `out = x · wᵀ` for f32 activations and weights of any dtype.
//!
//! f32 weights go to the `gemm` crate, whose result for a row does not depend on how many
//! rows are multiplied (checked in the op tests), so f32 runs are batch-invariant.
//! Other weights, few rows (decode): each weight row is read once and dotted with every
//! activation row, four at a time, on integers where the weight type allows
//! ([`crate::quant::dot_rows_multi`]); split over the worker team by weight rows. Many rows
//! (prefill): weight rows are dequantized a tile at a time into f32 and multiplied with
//! `gemm`, tiles split over the team; the tile stays in cache while all activation rows
//! pass over it.

use super::team::Team;
use super::SendPtr;
use crate::quant::{self, QuantizedRows, MULTI_ROWS};
use crate::DType;
use std::cell::RefCell;

/// Up to this many activation rows take the dot-product path. Its cost grows with the rows
/// (each weight block is decoded once per 4 rows); the GEMM path pays a dequantization of
/// the whole weight per call, then little per row. Measured with `ingot bench latency`
/// (SmolLM2 Q4_1, 2-core EPYC, decode tok/s, dot vs GEMM): 48 rows 181 vs 137, 64 rows 208
/// vs 149; prefill chunks of a few hundred rows are faster through the GEMM.
pub const GEMV_MAX_ROWS: usize = 64;
/// Weight rows per parallel task in the dot-product path.
const GEMV_CHUNK: usize = 32;
/// Weight rows dequantized per tile in the GEMM path.
const TILE_ROWS: usize = 64;

thread_local! {
    /// Per-thread scratch, grown to the largest shape seen and then reused.
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// A single activation row padded to two, and its two output rows.
    static PAIR: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

fn rayon_parallelism() -> gemm::Parallelism {
    gemm::Parallelism::Rayon(rayon::current_num_threads())
}

/// Destination of a matmul: row `i` lands at `ptr[i * ld + j]` for `j < n`.
#[derive(Clone, Copy)]
pub struct Dst {
    pub ptr: SendPtr,
    pub ld: usize,
}

/// Weight data in whichever form the backend stores it.
pub enum Weight<'a> {
    F32(&'a [f32]),
    Bytes(DType, &'a [u8]),
}

/// Quantized copies of the activation rows for integer dot products; reused across calls.
#[derive(Default)]
pub struct ActivationScratch {
    rows: QuantizedRows,
}

/// # Safety
/// `dst` must be valid for writes of `m` rows of `n` elements at stride `ld`, and no other
/// reference may alias those elements during the call.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul(
    x: &[f32],
    w: Weight<'_>,
    m: usize,
    n: usize,
    k: usize,
    dst: Dst,
    scratch: &mut ActivationScratch,
    team: &Team,
) {
    assert!(x.len() >= m * k);
    if m == 0 || n == 0 {
        return;
    }
    if let Weight::F32(_) = w {
        // The GEMM runs on rayon's threads; the team's would only compete with them.
        team.rest();
    }
    match w {
        Weight::F32(wf) if m > 1 => gemm_f32(x, wf, m, n, k, dst, rayon_parallelism()),
        Weight::F32(wf) => {
            // `gemm` takes a separate route for a single row that rounds differently; two
            // rows go through the same kernel as any batch, so a sequence's logits do not
            // depend on how many others share its step.
            PAIR.with_borrow_mut(|(x2, out2)| {
                x2.clear();
                x2.extend_from_slice(&x[..k]);
                x2.resize(2 * k, 0.0);
                out2.resize(2 * n, 0.0);
                let pair = Dst {
                    ptr: SendPtr(out2.as_mut_ptr()),
                    ld: n,
                };
                gemm_f32(x2, wf, 2, n, k, pair, rayon_parallelism());
                for (j, &v) in out2[..n].iter().enumerate() {
                    dst.write(0, j, v);
                }
            });
        }
        Weight::Bytes(dtype, wb) if m <= GEMV_MAX_ROWS => {
            let row_bytes = dtype.bytes_for(k);
            let xq = scratch.rows.quantize(dtype, &x[..m * k], m, k);
            team.run(n.div_ceil(GEMV_CHUNK), |c| {
                let j0 = c * GEMV_CHUNK;
                let rows = GEMV_CHUNK.min(n - j0);
                let w = &wb[j0 * row_bytes..(j0 + rows) * row_bytes];
                let mut buf = [0f32; GEMV_CHUNK * MULTI_ROWS];
                for i in (0..m).step_by(MULTI_ROWS) {
                    let g = MULTI_ROWS.min(m - i);
                    let xqi = xq.rows(i, i + g, k);
                    let xi = &x[i * k..(i + g) * k];
                    quant::dot_rows_multi(dtype, w, xqi, xi, g, rows, &mut buf[..g * rows]);
                    for r in 0..g {
                        for (jj, &v) in buf[r * rows..(r + 1) * rows].iter().enumerate() {
                            dst.write(i + r, j0 + jj, v);
                        }
                    }
                }
            });
        }
        Weight::Bytes(dtype, wb) => {
            let row_bytes = dtype.bytes_for(k);
            let tiles = n.div_ceil(TILE_ROWS);
            team.run(tiles, |t| {
                let j0 = t * TILE_ROWS;
                let rows = TILE_ROWS.min(n - j0);
                TILE.with_borrow_mut(|tile| {
                    tile.resize(TILE_ROWS * k, 0.0);
                    for r in 0..rows {
                        let src = &wb[(j0 + r) * row_bytes..(j0 + r + 1) * row_bytes];
                        quant::dequantize_row(dtype, src, &mut tile[r * k..(r + 1) * k]);
                    }
                    let sub = dst.columns_from(j0);
                    // SAFETY: tiles cover disjoint column ranges of the destination.
                    unsafe {
                        gemm_f32(
                            x,
                            &tile[..rows * k],
                            m,
                            rows,
                            k,
                            sub,
                            gemm::Parallelism::None,
                        )
                    };
                });
            });
        }
    }
}

impl Dst {
    /// The same rows, starting at column `j0`.
    fn columns_from(self, j0: usize) -> Dst {
        Dst {
            ptr: SendPtr(self.ptr.0.wrapping_add(j0)),
            ld: self.ld,
        }
    }

    /// # Safety
    /// See [`matmul`]; callers write each `(i, j)` from one thread only.
    #[inline(always)]
    unsafe fn write(&self, i: usize, j: usize, v: f32) {
        *self.ptr.0.add(i * self.ld + j) = v;
    }
}

/// # Safety
/// As for [`matmul`].
unsafe fn gemm_f32(
    x: &[f32],
    w: &[f32],
    m: usize,
    n: usize,
    k: usize,
    dst: Dst,
    par: gemm::Parallelism,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst.ptr.0,
        1,
        dst.ld as isize,
        false,
        x.as_ptr(),
        1,
        k as isize,
        w.as_ptr(),
        k as isize,
        1,
        0.0f32,
        1.0f32,
        false,
        false,
        false,
        par,
    );
}
