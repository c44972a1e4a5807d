//! A mixture of experts on the GPU (moe.cu): the slots of a step (row, chosen expert) are
//! grouped by expert on the device, then each expert's gated MLP runs over its group.
//!
//! Two paths for the products. Decode steps and whatever runs inside a CUDA graph take the
//! tile kernels: each expert's weights are read once per tile of up to [`TILE`] of its
//! slots, f32 throughout, and nothing is read back. Larger steps outside a graph (prefill)
//! read the group sizes back (one copy per layer) and run each expert's two products through
//! cuBLASLt on tensor cores, with the gate/up product, activation and output rounded to the
//! activation dtype as the dense MLP rounds them.

use super::{gemm, row_threads, suffix, CudaBackend, CudaBuffer};
use crate::MoeShape;
use anyhow::Context;
use std::sync::atomic::Ordering;

/// Grouped slots per tile of the tile kernels (moe.cu's `MOE_TILE`).
pub const TILE: usize = 8;
/// Warps per block of the tile kernels (`MOE_WARPS`).
pub const WARPS: usize = 8;
/// Columns each warp of the gate/up tile kernel computes, gate and up each (`MOE_GATE_COLS`).
pub const GATE_COLS: usize = 2;
/// Columns each warp of the down tile kernel computes (`MOE_DOWN_COLS`).
pub const DOWN_COLS: usize = 4;
/// Steps of at least this many rows take the cuBLASLt path where they may read back. A
/// decode batch of 64 rows stays on the tile kernels, which read each expert once per 8 of
/// its slots.
pub const GEMM_MIN_ROWS: usize = 256;

/// Where [`crate::Backend::moe_experts`]' intermediates lie in its workspace, in 4-byte
/// words: each expert's first grouped slot and first tile, the slot at each grouped position
/// and the grouped position of each slot, then the products' data (256-byte aligned).
pub struct Workspace {
    offsets: usize,
    tile_offsets: usize,
    order: usize,
    slot_pos: usize,
    data: usize,
    pub len: usize,
    /// The most tiles a step can have: every expert's last tile may be partial, and no
    /// tile is empty.
    max_tiles: usize,
}

impl Workspace {
    pub fn new(shape: MoeShape) -> Self {
        let (e, s) = (shape.experts, shape.slots());
        let order = 2 * (e + 1);
        let data = (order + 2 * s).next_multiple_of(64);
        // The tile path keeps f32 activations and outputs (s * (ffn + dim) words); the GEMM
        // path the gathered rows (reused for the outputs), the gate/up product and the
        // activations, at most 4 bytes an element.
        let products = s * (shape.dim + 3 * shape.ffn);
        Workspace {
            offsets: 0,
            tile_offsets: e + 1,
            order,
            slot_pos: order + s,
            data,
            len: data + products,
            max_tiles: s.min(s.div_ceil(TILE) + e),
        }
    }
}

impl CudaBackend {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_experts(
        &self,
        x: &CudaBuffer,
        ids: &CudaBuffer,
        weights: &CudaBuffer,
        shape: MoeShape,
        gate_up: &CudaBuffer,
        down: &CudaBuffer,
        workspace: &mut CudaBuffer,
        out: &mut CudaBuffer,
    ) {
        assert_eq!(
            gate_up.dtype, x.dtype,
            "experts' weights in the activation dtype"
        );
        assert_eq!(
            down.dtype, x.dtype,
            "experts' weights in the activation dtype"
        );
        let slots = shape.slots();
        if slots == 0 {
            return;
        }
        let ws = Workspace::new(shape);
        assert!(workspace.numel >= ws.len, "MoE workspace too small");
        let at = |words: usize| workspace.ptr + 4 * words as u64;
        let (offsets, tile_offsets, order, slot_pos) = (
            at(ws.offsets),
            at(ws.tile_offsets),
            at(ws.order),
            at(ws.slot_pos),
        );
        let (i, s, e) = (ids.ptr, slots as i32, shape.experts as i32);
        let shared = 8 * shape.experts as u32;
        launch!(self, "moe_group".into(), label = "moe_group".into(), shared = shared, (1, 1, 1), 1024; i, s, e, offsets, tile_offsets, order, slot_pos);
        let capturing = self.capturing.load(Ordering::Relaxed);
        if shape.rows >= GEMM_MIN_ROWS && !capturing {
            self.experts_by_gemm(x, weights, shape, gate_up, down, workspace, &ws, out);
            return;
        }
        let (k, dim, ffn) = (
            shape.experts_per_token as i32,
            shape.dim as i32,
            shape.ffn as i32,
        );
        let (act, y) = (at(ws.data), at(ws.data + slots * shape.ffn));
        let tiles = u32::try_from(ws.max_tiles).expect("tiles fit the grid");
        let sfx = suffix(x.dtype);
        let (xp, gu, dp) = (x.ptr, gate_up.ptr, down.ptr);
        let threads = 32 * WARPS as u32;
        let cols = shape.ffn.div_ceil(WARPS * GATE_COLS) as u32;
        launch!(self, format!("moe_gate_up_{sfx}"), (cols, tiles, 1), threads; xp, gu, order, offsets, tile_offsets, e, k, dim, ffn, act);
        let cols = shape.dim.div_ceil(WARPS * DOWN_COLS) as u32;
        launch!(self, format!("moe_down_{sfx}"), (cols, tiles, 1), threads; act, dp, order, offsets, tile_offsets, e, dim, ffn, y);
        let (w, o) = (weights.ptr, out.ptr);
        launch!(self, format!("moe_combine_{sfx}"), (shape.rows as u32, 1, 1), row_threads(shape.dim).min(256); y, w, k, dim, o);
    }

    /// The cuBLASLt path: the rows gathered in grouped order, each expert's gate/up product
    /// over its group, the SiLU·mul over all groups, each expert's down product, and each
    /// row's weighted sum of its slots.
    #[allow(clippy::too_many_arguments)]
    fn experts_by_gemm(
        &self,
        x: &CudaBuffer,
        weights: &CudaBuffer,
        shape: MoeShape,
        gate_up: &CudaBuffer,
        down: &CudaBuffer,
        workspace: &CudaBuffer,
        ws: &Workspace,
        out: &mut CudaBuffer,
    ) {
        let MoeShape {
            rows,
            experts,
            experts_per_token,
            dim,
            ffn,
        } = shape;
        let slots = shape.slots();
        let es = x.dtype.bytes_for(1) as u64;
        let data = workspace.ptr + 4 * ws.data as u64;
        // Gathered rows, then (once they are read) the outputs; the gate/up product; the
        // activations.
        let xs = data;
        let gu = xs + es * (slots * dim) as u64;
        let act = gu + es * (slots * 2 * ffn) as u64;
        let sfx = suffix(x.dtype);
        let (xp, order, k, d) = (
            x.ptr,
            workspace.ptr + 4 * ws.order as u64,
            experts_per_token as i32,
            dim as i32,
        );
        launch!(self, format!("moe_gather_{sfx}"), (slots as u32, 1, 1), row_threads(dim).min(256); xp, order, k, d, xs);
        let offsets = match self
            .read::<i32>(workspace, experts + 1)
            .context("reading the experts' group sizes back")
        {
            Ok(o) => o,
            Err(e) => return self.record(Err(e)),
        };
        let groups = || {
            offsets
                .windows(2)
                .enumerate()
                .filter(|(_, w)| w[1] > w[0])
                .map(|(e, w)| (e as u64, w[0] as u64, (w[1] - w[0]) as usize))
        };
        for (e, first, n) in groups() {
            let w = gate_up.ptr + es * e * (2 * ffn * dim) as u64;
            let (xe, oe) = (
                xs + es * first * dim as u64,
                gu + es * first * (2 * ffn) as u64,
            );
            self.expert_product(x.dtype, n, 2 * ffn, dim, xe, w, oe);
        }
        let (rs, f) = (slots as i64, ffn as i32);
        launch!(self, format!("silu_mul_{sfx}"), (self.grid_for(slots * ffn), 1, 1), 256; gu, rs, f, act);
        let ys = xs;
        for (e, first, n) in groups() {
            let w = down.ptr + es * e * (dim * ffn) as u64;
            let (ae, oe) = (act + es * first * ffn as u64, ys + es * first * dim as u64);
            self.expert_product(x.dtype, n, dim, ffn, ae, w, oe);
        }
        let (probs, pos, o) = (weights.ptr, workspace.ptr + 4 * ws.slot_pos as u64, out.ptr);
        launch!(self, format!("moe_combine_grouped_{sfx}"), (rows as u32, 1, 1), row_threads(dim).min(256); ys, probs, pos, k, d, o);
    }

    /// `out = x · wᵀ` through cuBLASLt for `m` contiguous rows, all operands in `dtype`
    /// at raw device addresses.
    #[allow(clippy::too_many_arguments)]
    fn expert_product(
        &self,
        dtype: crate::DType,
        m: usize,
        n: usize,
        k: usize,
        x: u64,
        w: u64,
        out: u64,
    ) {
        let align = [x, w, out]
            .iter()
            .map(|p| 1usize << p.trailing_zeros().min(8))
            .min()
            .unwrap_or(1);
        let shape = gemm::Shape {
            x: dtype,
            w: dtype,
            out: dtype,
            m,
            n,
            k,
            ld: n,
            bias: false,
            accumulate: false,
            align,
        };
        let stream = self.stream.cu_stream() as cudarc::cublaslt::sys::cudaStream_t;
        self.timed(&format!("moe expert matmul n{n} k{k}"), || {
            let mut gemm = self.gemm.lock().unwrap_or_else(|p| p.into_inner());
            // SAFETY: the workspace and the stacked weights hold these rows (sized by
            // `Workspace::new` and checked at load).
            unsafe { gemm.matmul(shape, x, w, None, out, stream) }.map(|_| ())
        });
    }
}
