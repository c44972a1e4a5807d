//! A mixture of experts on the GPU (moe.cu): the slots of a step (row, chosen expert) are
//! grouped by expert on the device, then each expert's gated MLP runs over its group, and
//! nothing is read back, so every step can be recorded in a CUDA graph.
//!
//! Steps of up to [`ROW_PATH_ROWS`] rows of bf16/f16 experts skip the grouping: each slot
//! runs as matrix-vector products of its own (`moe_row_*`), routed inside the gate/up
//! kernel, two launches fewer than the grouped path (route, group); where the layer's norm
//! comes with it ([`crate::Backend::rms_norm_moe_add`]), the router's GEMV and the gate/up
//! kernel take the norm too, so no norm kernel runs. They sum in another k order than the
//! grouped tiles, so a row's outputs in such a small step may differ from the same row's in
//! a larger step by the rounding of the f32 sums, as the dense GEMV's differ from the dense
//! tensor-core products'.
//!
//! Two kinds of grouped product kernels, chosen by the model's dtype and widths alone, never
//! by the step's size, so among grouped steps a row's result does not depend on the other
//! rows of its step:
//! - bf16/f16 experts whose widths are whole slabs of [`MMA_BK`] take the tensor-core
//!   kernels (`moe_mma_*`): each expert's weights are read once per tile of [`SMALL`] or
//!   [`LARGE`] of its slots (the tile shapes give the same bits), the gate/up product and
//!   the activation rounded to the activation dtype as the dense MLP rounds them;
//! - f32 experts and other widths take the tile kernels (`moe_gate_up_*`, `moe_down_*`):
//!   f32 throughout, each expert's weights read once per [`TILE`] of its slots.

use super::{suffix, CudaBackend, CudaBuffer};
use crate::{DType, MoeShape};
use anyhow::Context;

/// Grouped slots per tile of the tile kernels (moe.cu's `MOE_TILE`).
pub const TILE: usize = 8;
/// Warps per block of the tile kernels (`MOE_WARPS`).
pub const WARPS: usize = 8;
/// Columns each warp of the gate/up tile kernel and of the slot-by-slot one computes, gate
/// and up each (`MOE_GATE_COLS`).
pub const GATE_COLS: usize = 2;
/// Columns each warp of the down tile kernel and of the slot-by-slot one computes
/// (`MOE_DOWN_COLS`).
pub const DOWN_COLS: usize = 4;
/// Threads of a `moe_combine` block, a column each.
const COMBINE_THREADS: usize = 256;
/// Rows `moe_route` routes per block, a warp each (`MOE_ROUTE_WARPS`).
pub const ROUTE_WARPS: usize = 4;
/// The k slab of the tensor-core kernels (`MOE_MMA_BK`): both widths must be multiples.
pub const MMA_BK: usize = 64;

/// A tile shape of the tensor-core kernels.
pub struct MmaTile {
    /// Grouped slots per tile (`BM`).
    pub slots: usize,
    /// Weight rows per block (`BN`; half gate, half up in the gate/up kernel).
    pub rows: usize,
    /// Warps along the slots and along the weight rows.
    pub warps: (usize, usize),
    /// Slabs of k in the ring of shared memory.
    pub stages: usize,
    name: &'static str,
}

/// Decode batches, where an expert gets a few slots: narrow blocks, a deep ring, so that
/// many weight bytes are in flight with few blocks.
pub const SMALL: MmaTile = MmaTile {
    slots: 16,
    rows: 32,
    warps: (1, 2),
    stages: 6,
    name: "small",
};
/// Prefill, where an expert gets many slots.
pub const LARGE: MmaTile = MmaTile {
    slots: 64,
    rows: 128,
    warps: (2, 4),
    stages: 3,
    name: "large",
};

/// Steps of up to this many rows run slot by slot: an expert then gets about one slot, so
/// grouping saves few weight reads and costs two launches (H200, `configs/qwen3-moe-24l`,
/// decode tok/s against the grouped tiles in the same call: B=1 572.2 against 490.4, B=4
/// 1,071.4 against 932.7).
pub const ROW_PATH_ROWS: usize = 4;

impl MmaTile {
    /// The dynamic shared memory of a block: the ring of both operands' slabs, each row
    /// padded by 8 elements.
    fn shared_bytes(&self) -> u32 {
        (self.stages * (self.slots + self.rows) * (MMA_BK + 8) * 2) as u32
    }

    fn threads(&self) -> u32 {
        (32 * self.warps.0 * self.warps.1) as u32
    }

    /// The tile shape for a step: large tiles once an expert averages a small tile's slots.
    fn for_step(shape: MoeShape) -> &'static MmaTile {
        if shape.slots() >= SMALL.slots * shape.experts {
            &LARGE
        } else {
            &SMALL
        }
    }
}

/// Whether a step runs slot by slot (`moe_row_*`).
pub fn slot_by_slot(dtype: DType, shape: MoeShape) -> bool {
    on_tensor_cores(dtype, shape) && shape.rows <= ROW_PATH_ROWS
}

/// Whether experts of `dtype` and these widths run on the tensor-core kernels.
fn on_tensor_cores(dtype: DType, shape: MoeShape) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
        && shape.dim.is_multiple_of(MMA_BK)
        && shape.ffn.is_multiple_of(MMA_BK)
}

/// The most tiles of `tile` slots a step can have: every expert's last tile may be partial,
/// and no tile is empty.
fn max_tiles(shape: MoeShape, tile: usize) -> u32 {
    let s = shape.slots();
    u32::try_from(s.min(s.div_ceil(tile) + shape.experts)).expect("tiles fit the grid")
}

/// Where [`crate::Backend::moe_experts`]' intermediates lie in its workspace, in 4-byte
/// words: each expert's first grouped slot and first tile, the slot at each grouped
/// position, then the activations (f32, or the 16-bit activation dtype, `[slots, ffn]` in
/// grouped order) and the f32 outputs (`[slots, dim]` in slot order), 256-byte aligned.
pub struct Workspace {
    offsets: usize,
    tile_offsets: usize,
    order: usize,
    act: usize,
    y: usize,
    pub len: usize,
}

impl Workspace {
    /// The layout for `shape`, after checking the experts' dtype and that `workspace` holds
    /// it.
    fn checked(
        shape: MoeShape,
        x: &CudaBuffer,
        gate_up: &CudaBuffer,
        down: &CudaBuffer,
        workspace: &CudaBuffer,
    ) -> Self {
        assert!(
            gate_up.dtype == x.dtype && down.dtype == x.dtype,
            "experts' weights in the activation dtype"
        );
        let ws = Workspace::new(shape);
        assert!(workspace.numel >= ws.len, "MoE workspace too small");
        ws
    }

    pub fn new(shape: MoeShape) -> Self {
        let (e, s) = (shape.experts, shape.slots());
        let order = 2 * (e + 1);
        let act = (order + s).next_multiple_of(64);
        let y = (act + s * shape.ffn).next_multiple_of(64);
        Workspace {
            offsets: 0,
            tile_offsets: e + 1,
            order,
            act,
            y,
            len: y + s * shape.dim,
        }
    }
}

impl CudaBackend {
    pub(super) fn route(
        &self,
        logits: &CudaBuffer,
        shape: MoeShape,
        renormalize: bool,
        ids: &mut CudaBuffer,
        weights: &mut CudaBuffer,
    ) {
        let (l, rows, e, k, rn, i, w) = (
            logits.ptr,
            shape.rows as i32,
            shape.experts as i32,
            shape.experts_per_token as i32,
            renormalize as i32,
            ids.ptr,
            weights.ptr,
        );
        let blocks = shape.rows.div_ceil(ROUTE_WARPS) as u32;
        let shared = (4 * ROUTE_WARPS * shape.experts) as u32;
        launch!(self, "moe_route".into(), label = "moe_route".into(), shared = shared, (blocks, 1, 1), 32 * ROUTE_WARPS as u32; l, rows, e, k, rn, i, w);
    }

    /// While ops are profiled (run eagerly and waited for one by one anyway), counts the
    /// experts the step's slots touch, from their routing: the expert bytes a decode step
    /// reads, for its roofline.
    fn count_touched_experts(&self, ids: &CudaBuffer, shape: MoeShape) {
        if self
            .profiler
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
        {
            return;
        }
        let mut ids = match self.read::<i32>(ids, shape.slots()) {
            Ok(ids) => ids,
            Err(e) => return self.record(Err(e.context("reading the routing back"))),
        };
        ids.sort_unstable();
        ids.dedup();
        let touched = ids.len() as u64;
        let mut profiler = self.profiler.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = profiler.as_mut() {
            let t = p.experts_touched.entry(shape.rows).or_default();
            *t = (t.0 + 1, t.1 + touched, shape.experts);
        }
    }

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
        add: bool,
    ) {
        let ws = Workspace::checked(shape, x, gate_up, down, workspace);
        let slots = shape.slots();
        if slots == 0 {
            return;
        }
        let at = |words: usize| workspace.ptr + 4 * words as u64;
        let (offsets, tile_offsets, order, act, y) = (
            at(ws.offsets),
            at(ws.tile_offsets),
            at(ws.order),
            at(ws.act),
            at(ws.y),
        );
        let mma = on_tensor_cores(x.dtype, shape).then(|| MmaTile::for_step(shape));
        let tile = mma.map_or(TILE, |m| m.slots);
        let (i, s, e, t) = (ids.ptr, slots as i32, shape.experts as i32, tile as i32);
        let shared = 8 * shape.experts as u32;
        launch!(self, "moe_group".into(), label = "moe_group".into(), shared = shared, (1, 1, 1), 1024; i, s, e, t, offsets, tile_offsets, order);
        self.count_touched_experts(ids, shape);
        let (k, dim, ffn) = (
            shape.experts_per_token as i32,
            shape.dim as i32,
            shape.ffn as i32,
        );
        let tiles = max_tiles(shape, tile);
        let sfx = suffix(x.dtype);
        let (xp, gu, dp) = (x.ptr, gate_up.ptr, down.ptr);
        match mma {
            Some(m) => {
                let (name, shared, threads) = (m.name, m.shared_bytes(), m.threads());
                let cols = shape.ffn.div_ceil(m.rows / 2) as u32;
                launch!(self, format!("moe_mma_gate_up_{name}_{sfx}"), label = format!("moe_mma_gate_up_{name}_{sfx}"), shared = shared, (cols, tiles, 1), threads; xp, gu, order, offsets, tile_offsets, e, k, dim, ffn, act);
                let cols = shape.dim.div_ceil(m.rows) as u32;
                launch!(self, format!("moe_mma_down_{name}_{sfx}"), label = format!("moe_mma_down_{name}_{sfx}"), shared = shared, (cols, tiles, 1), threads; act, dp, order, offsets, tile_offsets, e, dim, ffn, y);
            }
            None => {
                let threads = 32 * WARPS as u32;
                let cols = shape.ffn.div_ceil(WARPS * GATE_COLS) as u32;
                launch!(self, format!("moe_gate_up_{sfx}"), (cols, tiles, 1), threads; xp, gu, order, offsets, tile_offsets, e, k, dim, ffn, act);
                let cols = shape.dim.div_ceil(WARPS * DOWN_COLS) as u32;
                launch!(self, format!("moe_down_{sfx}"), (cols, tiles, 1), threads; act, dp, order, offsets, tile_offsets, e, dim, ffn, y);
            }
        }
        self.combine(y, weights, shape, out, add);
    }

    /// `moe_combine`: each row's weighted sum of its slots' f32 outputs `y` into `out`, or
    /// added to it where `add`.
    fn combine(
        &self,
        y: u64,
        weights: &CudaBuffer,
        shape: MoeShape,
        out: &mut CudaBuffer,
        add: bool,
    ) {
        let (w, k, dim, o, add) = (
            weights.ptr,
            shape.experts_per_token as i32,
            shape.dim as i32,
            out.ptr,
            add as i32,
        );
        let name = format!("moe_combine_{}", suffix(out.dtype));
        let columns = shape.dim.div_ceil(COMBINE_THREADS) as u32;
        launch!(self, name, (shape.rows as u32, columns, 1), COMBINE_THREADS as u32; y, w, k, dim, o, add);
    }

    /// [`crate::Backend::moe`] slot by slot ([`slot_by_slot`]) of rows at `x` (in the
    /// activation dtype; taken through an RMSNorm folded into the experts where `norm` gives
    /// its eps): the gate/up kernel routes each slot's row and writes `ids` and `weights`,
    /// then the down product of each slot and each row's weighted sum into `out`. `x` is a
    /// pointer so that it may be `out` itself (the residual stream): the gate/up kernel has
    /// read it before `moe_combine` writes.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_rows(
        &self,
        x: u64,
        logits: &CudaBuffer,
        shape: MoeShape,
        renormalize: bool,
        norm: Option<f32>,
        gate_up: &CudaBuffer,
        down: &CudaBuffer,
        ids: &mut CudaBuffer,
        weights: &mut CudaBuffer,
        workspace: &mut CudaBuffer,
        out: &mut CudaBuffer,
        add: bool,
    ) {
        let ws = Workspace::checked(shape, out, gate_up, down, workspace);
        let slots = shape.slots();
        if slots == 0 {
            return;
        }
        let (act, y) = (
            workspace.ptr + 4 * ws.act as u64,
            workspace.ptr + 4 * ws.y as u64,
        );
        let (e, k, dim, ffn) = (
            shape.experts as i32,
            shape.experts_per_token as i32,
            shape.dim as i32,
            shape.ffn as i32,
        );
        let sfx = suffix(out.dtype);
        let (l, gu, dp, i, w) = (logits.ptr, gate_up.ptr, down.ptr, ids.ptr, weights.ptr);
        let (rn, eps) = (renormalize as i32, norm.unwrap_or(0.0));
        let gate_up_kernel = match norm {
            Some(_) => format!("moe_row_gate_up_norm_{sfx}"),
            None => format!("moe_row_gate_up_{sfx}"),
        };
        let route_bytes = 4 * (shape.experts + 2 * shape.experts_per_token) as u32;
        let threads = 32 * WARPS as u32;
        let cols = shape.ffn.div_ceil(WARPS * GATE_COLS) as u32;
        launch!(self, gate_up_kernel.clone(), label = gate_up_kernel, shared = route_bytes, (cols, slots as u32, 1), threads; x, l, gu, e, k, rn, dim, ffn, eps, i, w, act);
        self.count_touched_experts(ids, shape);
        let cols = shape.dim.div_ceil(WARPS * DOWN_COLS) as u32;
        launch!(self, format!("moe_row_down_{sfx}"), label = format!("moe_row_down_{sfx}"), (cols, slots as u32, 1), threads; act, dp, i, dim, ffn, y);
        self.combine(y, weights, shape, out, add);
    }
}
