//! A mixture of experts on the CPU: routing per row, then each expert's gated MLP over all
//! the rows routed to it at once, so its weights are read once per step.

use super::matmul::{Dst, Weight};
use super::{stacked_matrix, CpuBackend, CpuBuffer, SendPtr};
use crate::MoeShape;

/// Row `logits`' `k` experts and weights as [`crate::Backend::moe_route`] defines them:
/// softmax over every expert, the `k` largest in descending order (the lower index first
/// among equals), rescaled to sum to 1 where `renormalize`.
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

/// The workspace's pieces for one expert's rows (at most `shape.rows`): their inputs, the
/// gate/up product, the activation and the output, then every slot's output.
fn workspace_parts(shape: MoeShape) -> [usize; 5] {
    let (m, d, f) = (shape.rows, shape.dim, shape.ffn);
    [m * d, m * 2 * f, m * f, m * d, shape.slots() * d]
}

pub(super) fn workspace_len(shape: MoeShape) -> usize {
    workspace_parts(shape).iter().sum()
}

impl CpuBackend {
    /// `out = x · wᵀ` into the contiguous rows `out` (`[m, n]`).
    fn product(&self, x: &[f32], w: Weight<'_>, m: usize, n: usize, k: usize, out: &mut [f32]) {
        assert!(out.len() >= m * n);
        let dst = Dst {
            ptr: SendPtr(out.as_mut_ptr()),
            ld: n,
        };
        // SAFETY: `out` is borrowed mutably for the call and holds `m` rows of `n`.
        unsafe { self.run_matmul(x, w, m, n, k, dst) };
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_experts(
        &self,
        x: &CpuBuffer,
        ids: &CpuBuffer,
        weights: &CpuBuffer,
        shape: MoeShape,
        gate_up: &CpuBuffer,
        down: &CpuBuffer,
        workspace: &mut CpuBuffer,
        out: &mut CpuBuffer,
        add: bool,
    ) {
        let MoeShape {
            rows,
            experts,
            experts_per_token: k,
            dim: d,
            ffn: f,
        } = shape;
        assert_eq!(
            gate_up.numel(),
            experts * 2 * f * d,
            "gate/up is not stacked"
        );
        assert_eq!(down.numel(), experts * d * f, "down is not stacked");
        let slots = shape.slots();
        let ids = &ids.i32()[..slots];
        let x = &x.f32()[..rows * d];
        let [xs, gu, act, y, per_slot] = workspace_parts(shape);
        let ws = &mut workspace.f32_mut()[..workspace_len(shape)];
        let (xs_buf, rest) = ws.split_at_mut(xs);
        let (gu_buf, rest) = rest.split_at_mut(gu);
        let (act_buf, rest) = rest.split_at_mut(act);
        let (y_buf, slot_out) = rest.split_at_mut(y);
        let slot_out = &mut slot_out[..per_slot];
        // Each expert's slots in slot order, which is also row order.
        let mut routed: Vec<Vec<usize>> = vec![vec![]; experts];
        for (s, &e) in ids.iter().enumerate() {
            routed[e as usize].push(s);
        }
        for (e, slots_of_e) in routed.iter().enumerate() {
            let n = slots_of_e.len();
            if n == 0 {
                continue;
            }
            for (dst, &s) in xs_buf.chunks_mut(d).zip(slots_of_e) {
                dst.copy_from_slice(&x[s / k * d..][..d]);
            }
            let w = stacked_matrix(gate_up, e, 2 * f, d);
            self.product(&xs_buf[..n * d], w, n, 2 * f, d, gu_buf);
            for (a, g) in act_buf.chunks_mut(f).zip(gu_buf.chunks(2 * f)).take(n) {
                let (gate, up) = g.split_at(f);
                for ((a, &g), &u) in a.iter_mut().zip(gate).zip(up) {
                    *a = g / (1.0 + (-g).exp()) * u;
                }
            }
            let w = stacked_matrix(down, e, d, f);
            self.product(&act_buf[..n * f], w, n, d, f, y_buf);
            for (src, &s) in y_buf.chunks(d).zip(slots_of_e) {
                slot_out[s * d..][..d].copy_from_slice(src);
            }
        }
        let weights = &weights.f32()[..slots];
        for (r, o) in out.f32_mut()[..rows * d].chunks_mut(d).enumerate() {
            for (c, o) in o.iter_mut().enumerate() {
                let sum: f32 = (r * k..(r + 1) * k)
                    .map(|s| weights[s] * slot_out[s * d + c])
                    .sum();
                *o = if add { *o + sum } else { sum };
            }
        }
    }
}
