//! A mixture of experts in the engine: each token's router logits pick its experts (as
//! transformers picks them), each expert's gated MLP runs over the tokens routed to it, and
//! every token sums its experts' outputs by their weights.
//!
//! This first version is composed of the backend's dense ops and routes on the host: the
//! router's logits are read back, the tokens of each expert gathered by index, and the
//! weighted sums made on the host in a fixed order (a token's output does not depend on
//! the other tokens of its step). So it runs on every backend, with a read-back per layer;
//! device-side routing and grouped products are still to come.

use crate::weights::Linear;
use anyhow::Result;
use half::{bf16, f16};
use ingot_backend::{Backend, DType};

/// The experts a token's router logits choose and their weights, as transformers picks
/// them: softmax over every expert, the `k` largest (the lower index first among equals),
/// rescaled to sum to 1 where `renormalize`.
pub fn route(logits: &[f32], k: usize, renormalize: bool) -> Vec<(usize, f32)> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| e[b].total_cmp(&e[a]).then(a.cmp(&b)));
    let mut chosen: Vec<(usize, f32)> = order[..k].iter().map(|&i| (i, e[i] / sum)).collect();
    if renormalize {
        let total: f32 = chosen.iter().map(|c| c.1).sum();
        chosen.iter_mut().for_each(|c| c.1 /= total);
    }
    chosen
}

/// One expert's gated MLP.
pub struct Expert<B: Backend> {
    pub gate_up: Linear<B>,
    pub down: Linear<B>,
}

pub struct MoeWeights<B: Backend> {
    /// `[num_experts, hidden]`.
    pub router: Linear<B>,
    pub experts: Vec<Expert<B>>,
    pub experts_per_token: usize,
    pub renormalize: bool,
}

/// Buffers of a step's mixture of experts, sized for the token budget: the router's
/// logits, one expert's rows (their indices, inputs, gate/up product, activation and
/// output).
pub struct MoeBuffers<B: Backend> {
    pub logits: B::Buffer,
    pub rows: B::Buffer,
    pub x: B::Buffer,
    pub gate_up: B::Buffer,
    pub act: B::Buffer,
    pub y: B::Buffer,
}

impl<B: Backend> MoeBuffers<B> {
    /// Element counts in the activation dtype (the rows' indices are i32): logits, x,
    /// gate/up, act, y.
    pub fn sizes(tokens: usize, hidden: usize, experts: usize, width: usize) -> [usize; 5] {
        [
            tokens * experts,
            tokens * hidden,
            tokens * 2 * width,
            tokens * width,
            tokens * hidden,
        ]
    }

    pub fn new(
        b: &B,
        dtype: DType,
        tokens: usize,
        hidden: usize,
        experts: usize,
        width: usize,
    ) -> Result<Self> {
        let [logits, x, gate_up, act, y] = Self::sizes(tokens, hidden, experts, width);
        Ok(MoeBuffers {
            logits: b.alloc(dtype, logits)?,
            rows: b.alloc(DType::I32, tokens)?,
            x: b.alloc(dtype, x)?,
            gate_up: b.alloc(dtype, gate_up)?,
            act: b.alloc(dtype, act)?,
            y: b.alloc(dtype, y)?,
        })
    }
}

impl<B: Backend> MoeWeights<B> {
    /// `out[:rows] = Σ_e w_e · expert_e(x)` over each row's chosen experts, for rows `x`
    /// (`[rows, hidden]`, normed) in `dtype`.
    pub fn forward(
        &self,
        b: &B,
        x: &B::Buffer,
        rows: usize,
        dtype: DType,
        buf: &mut MoeBuffers<B>,
        out: &mut B::Buffer,
    ) -> Result<()> {
        let d = self.router.in_features;
        let n_experts = self.experts.len();
        self.router.forward(b, x, rows, &mut buf.logits);
        let logits = b.download_f32(&buf.logits, rows * n_experts)?;
        // Per expert, its (row, weight) pairs in row order.
        let mut routed: Vec<Vec<(usize, f32)>> = vec![vec![]; n_experts];
        let mut slots: Vec<Vec<usize>> = Vec::with_capacity(rows);
        for (r, scores) in logits.chunks(n_experts).enumerate() {
            let chosen = route(scores, self.experts_per_token, self.renormalize);
            slots.push(chosen.iter().map(|&(e, _)| e).collect());
            for (e, w) in chosen {
                routed[e].push((r, w));
            }
        }
        // Each row's expert outputs, weighted, by expert; summed in the row's slot order.
        let mut outputs: Vec<Vec<f32>> = vec![vec![]; n_experts];
        for (e, expert) in self.experts.iter().enumerate() {
            let routed = &routed[e];
            if routed.is_empty() {
                continue;
            }
            let n = routed.len();
            let idx: Vec<i32> = routed.iter().map(|&(r, _)| r as i32).collect();
            b.upload(&mut buf.rows, bytemuck::cast_slice(&idx))?;
            b.gather_rows(x, &buf.rows, n, d, &mut buf.x);
            expert.gate_up.forward(b, &buf.x, n, &mut buf.gate_up);
            expert
                .down
                .forward_silu(b, &buf.gate_up, &mut buf.act, n, &mut buf.y);
            outputs[e] = b.download_f32(&buf.y, n * d)?;
        }
        let mut next = vec![0usize; n_experts];
        let mut sum = vec![0f32; rows * d];
        for (r, experts) in slots.iter().enumerate() {
            let o = &mut sum[r * d..(r + 1) * d];
            for &e in experts {
                let j = next[e];
                next[e] += 1;
                let (row, w) = routed[e][j];
                debug_assert_eq!(row, r);
                let y = &outputs[e][j * d..(j + 1) * d];
                o.iter_mut().zip(y).for_each(|(o, y)| *o += w * y);
            }
        }
        let bytes: Vec<u8> = match dtype {
            DType::F16 => sum
                .iter()
                .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                .collect(),
            DType::BF16 => sum
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                .collect(),
            _ => bytemuck::cast_slice(&sum).to_vec(),
        };
        b.upload(out, &bytes)
    }
}
