//! A mixture of experts in the engine: each token's router logits pick its experts (as
//! transformers picks them), each expert's gated MLP runs over the tokens routed to it, and
//! every token sums its experts' outputs by their weights.
//!
//! Two backend ops, with nothing read back: the router's product into f32 logits (so
//! near-tied experts are told apart as in f32 whatever the activation dtype), and
//! [`Backend::moe`], which routes, groups the tokens by expert on the device and adds the
//! experts' weighted sum into the residual stream. A decode step of a mixture is therefore
//! as recordable as a dense one.

use crate::weights::Linear;
use anyhow::Result;
use ingot_backend::{Backend, DType, MoeLayer, MoeScratch, MoeShape};

pub struct MoeWeights<B: Backend> {
    /// `[num_experts, hidden]`.
    pub router: Linear<B>,
    /// Every expert's `[gate; up]`: `[num_experts, 2 * ffn, hidden]`.
    pub gate_up: B::Buffer,
    /// Every expert's down projection: `[num_experts, hidden, ffn]`.
    pub down: B::Buffer,
    pub num_experts: usize,
    pub ffn: usize,
    pub experts_per_token: usize,
    pub renormalize: bool,
}

/// Buffers of a step's mixture of experts, sized for the token budget: the router's f32
/// logits, each token's experts and weights, and the backend's workspace.
pub struct MoeBuffers<B: Backend> {
    pub logits: B::Buffer,
    pub ids: B::Buffer,
    pub weights: B::Buffer,
    pub workspace: B::Buffer,
}

impl<B: Backend> MoeBuffers<B> {
    /// The 4-byte elements of the buffers: logits, ids, weights, workspace.
    pub fn sizes(b: &B, shape: MoeShape) -> [usize; 4] {
        [
            shape.rows * shape.experts,
            shape.slots(),
            shape.slots(),
            b.moe_workspace_len(shape),
        ]
    }

    pub fn new(b: &B, shape: MoeShape) -> Result<Self> {
        let [logits, ids, weights, workspace] = Self::sizes(b, shape);
        Ok(MoeBuffers {
            logits: b.alloc(DType::F32, logits)?,
            ids: b.alloc(DType::I32, ids)?,
            weights: b.alloc(DType::F32, weights)?,
            workspace: b.alloc(DType::F32, workspace)?,
        })
    }
}

impl<B: Backend> MoeBuffers<B> {
    fn scratch(&mut self) -> MoeScratch<'_, B> {
        MoeScratch {
            logits: &mut self.logits,
            ids: &mut self.ids,
            weights: &mut self.weights,
            workspace: &mut self.workspace,
        }
    }
}

impl<B: Backend> MoeWeights<B> {
    fn shape(&self, rows: usize) -> MoeShape {
        MoeShape {
            rows,
            experts: self.num_experts,
            experts_per_token: self.experts_per_token,
            dim: self.router.in_features,
            ffn: self.ffn,
        }
    }

    /// `residual += Σ_e w_e · expert_e(rms_norm(residual))` for a norm folded into the
    /// router and the experts (`unit`: its weights, ones): one
    /// [`Backend::rms_norm_moe_add`] where the router is one matrix without bias; otherwise
    /// the norm into `normed`, then [`MoeWeights::forward`]. Where `accumulate` is false (a
    /// tensor-parallel rank after the first), `residual = Σ_e …` instead.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_add(
        &self,
        b: &B,
        residual: &mut B::Buffer,
        unit: &B::Buffer,
        eps: f32,
        rows: usize,
        buf: &mut MoeBuffers<B>,
        normed: &mut B::Buffer,
        accumulate: bool,
    ) {
        match self.router.parts.as_slice() {
            [p] if p.bias.is_none() && accumulate => {
                let layer = MoeLayer {
                    router: &p.weight,
                    gate_up: &self.gate_up,
                    down: &self.down,
                    renormalize: self.renormalize,
                };
                let shape = self.shape(rows);
                b.rms_norm_moe_add(residual, unit, eps, layer, shape, buf.scratch(), normed);
            }
            _ => {
                b.rms_norm(residual, unit, eps, rows, self.router.in_features, normed);
                self.forward(b, normed, rows, buf, residual, accumulate);
            }
        }
    }

    /// `out[:rows] = Σ_e w_e · expert_e(x)` over each row's chosen experts, for rows `x`
    /// (`[rows, hidden]`, normed); where `add`, the sum is added to `out` (the residual
    /// stream).
    pub fn forward(
        &self,
        b: &B,
        x: &B::Buffer,
        rows: usize,
        buf: &mut MoeBuffers<B>,
        out: &mut B::Buffer,
        add: bool,
    ) {
        let shape = self.shape(rows);
        self.router.forward(b, x, rows, &mut buf.logits);
        b.moe(
            x,
            &buf.logits,
            shape,
            self.renormalize,
            &self.gate_up,
            &self.down,
            &mut buf.ids,
            &mut buf.weights,
            &mut buf.workspace,
            out,
            add,
        );
    }
}
