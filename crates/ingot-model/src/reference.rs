//! A plain f32 forward pass — dense causal attention over one sequence, no paging, no
//! batching, no fused weights — that the paged engine is tested against.

use crate::checkpoint::{Checkpoint, Role};
use crate::config::{ModelConfig, MoeConfig};
use anyhow::{Context, Result};
use rayon::prelude::*;

struct Layer {
    attn_norm: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    o: Vec<f32>,
    ffn_norm: Vec<f32>,
    mlp: Mlp,
}

/// A gated MLP's gate, up and down projections.
struct Ffn {
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
}

impl Ffn {
    /// `down(silu(gate x) * up x)` for rows `x` of `d`.
    fn forward(&self, x: &[f32], d: usize) -> Vec<f32> {
        let g = linear(x, &self.gate, None, d);
        let u = linear(x, &self.up, None, d);
        let act: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        linear(&act, &self.down, None, self.gate.len() / d)
    }
}

enum Mlp {
    Dense(Ffn),
    /// A router `[experts, d]` and the experts.
    Experts {
        router: Vec<f32>,
        experts: Vec<Ffn>,
    },
}

pub struct ReferenceModel {
    pub config: ModelConfig,
    embed: Vec<f32>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Vec<f32>,
}

/// `y[t] = W x[t] (+ b)` for `W` of `[n, k]`.
fn linear(x: &[f32], w: &[f32], b: Option<&Vec<f32>>, k: usize) -> Vec<f32> {
    let n = w.len() / k;
    let rows = x.len() / k;
    let mut y = vec![0f32; rows * n];
    y.par_chunks_mut(n).enumerate().for_each(|(t, yr)| {
        let xr = &x[t * k..(t + 1) * k];
        for (j, y) in yr.iter_mut().enumerate() {
            let wr = &w[j * k..(j + 1) * k];
            *y = xr.iter().zip(wr).map(|(a, b)| a * b).sum::<f32>() + b.map_or(0.0, |b| b[j]);
        }
    });
    y
}

fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    for row in x.chunks_mut(dim) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        row.iter_mut().zip(w).for_each(|(v, g)| *v = *v * inv * g);
    }
}

/// A mixture of experts over rows `x` of `d`: each row's chosen experts, weighted.
fn moe_forward(x: &[f32], router: &[f32], experts: &[Ffn], moe: &MoeConfig, d: usize) -> Vec<f32> {
    let logits = linear(x, router, None, d);
    let mut out = vec![0f32; x.len()];
    for ((row, scores), o) in x
        .chunks(d)
        .zip(logits.chunks(experts.len()))
        .zip(out.chunks_mut(d))
    {
        for (e, w) in ingot_backend::cpu::moe::route(scores, moe.experts_per_token, moe.renormalize)
        {
            let y = experts[e].forward(row, d);
            o.iter_mut().zip(&y).for_each(|(o, y)| *o += w * y);
        }
    }
    out
}

impl ReferenceModel {
    pub fn load(ckpt: &Checkpoint) -> Result<ReferenceModel> {
        let cfg = ckpt.config()?;
        let get = |r: Role, l: usize| -> Result<Vec<f32>> {
            Ok(ckpt
                .tensor(r, l, &cfg)?
                .with_context(|| format!("missing {r:?} of layer {l}"))?
                .to_f32())
        };
        let opt = |r: Role, l: usize| -> Result<Option<Vec<f32>>> {
            Ok(ckpt.tensor(r, l, &cfg)?.map(|t| t.to_f32()))
        };
        let layers = (0..cfg.num_layers)
            .map(|l| {
                Ok(Layer {
                    attn_norm: get(Role::AttnNorm, l)?,
                    q: get(Role::Q, l)?,
                    k: get(Role::K, l)?,
                    v: get(Role::V, l)?,
                    q_bias: opt(Role::QBias, l)?,
                    k_bias: opt(Role::KBias, l)?,
                    v_bias: opt(Role::VBias, l)?,
                    q_norm: if cfg.qk_norm {
                        Some(get(Role::QNorm, l)?)
                    } else {
                        None
                    },
                    k_norm: if cfg.qk_norm {
                        Some(get(Role::KNorm, l)?)
                    } else {
                        None
                    },
                    o: get(Role::O, l)?,
                    ffn_norm: get(Role::FfnNorm, l)?,
                    mlp: match &cfg.moe {
                        Some(moe) if moe.is_sparse(l) => Mlp::Experts {
                            router: get(Role::Router, l)?,
                            experts: (0..moe.num_experts)
                                .map(|e| {
                                    Ok(Ffn {
                                        gate: get(Role::ExpertGate(e), l)?,
                                        up: get(Role::ExpertUp(e), l)?,
                                        down: get(Role::ExpertDown(e), l)?,
                                    })
                                })
                                .collect::<Result<_>>()?,
                        },
                        _ => Mlp::Dense(Ffn {
                            gate: get(Role::Gate, l)?,
                            up: get(Role::Up, l)?,
                            down: get(Role::Down, l)?,
                        }),
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = get(Role::Embed, 0)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            get(Role::LmHead, 0)?
        };
        Ok(ReferenceModel {
            embed,
            layers,
            norm: get(Role::FinalNorm, 0)?,
            lm_head,
            config: cfg,
        })
    }

    /// Logits `[tokens.len(), vocab]` for every position of one sequence.
    pub fn forward(&self, tokens: &[u32]) -> Vec<f32> {
        let c = &self.config;
        let (d, hd, t) = (c.hidden_size, c.head_dim, tokens.len());
        let inv_freq = crate::rope::inv_freq(c);
        let mut h: Vec<f32> = tokens
            .iter()
            .flat_map(|&id| self.embed[id as usize * d..][..d].to_vec())
            .collect();
        for l in &self.layers {
            let mut x = h.clone();
            rms_norm(&mut x, &l.attn_norm, c.rms_norm_eps);
            let mut q = linear(&x, &l.q, l.q_bias.as_ref(), d);
            let mut k = linear(&x, &l.k, l.k_bias.as_ref(), d);
            let v = linear(&x, &l.v, l.v_bias.as_ref(), d);
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                rms_norm(&mut q, qn, c.rms_norm_eps);
                rms_norm(&mut k, kn, c.rms_norm_eps);
            }
            for (heads, buf) in [(c.num_heads, &mut q), (c.num_kv_heads, &mut k)] {
                for p in 0..t {
                    for hh in 0..heads {
                        let x = &mut buf[(p * heads + hh) * hd..][..hd];
                        for (i, f) in inv_freq.iter().enumerate() {
                            let (cos, sin) = ((p as f32 * f).cos(), (p as f32 * f).sin());
                            let (a, b) = (x[i], x[i + hd / 2]);
                            x[i] = a * cos - b * sin;
                            x[i + hd / 2] = b * cos + a * sin;
                        }
                    }
                }
            }
            let group = c.num_heads / c.num_kv_heads;
            let mut attn = vec![0f32; t * c.q_size()];
            attn.par_chunks_mut(hd).enumerate().for_each(|(idx, out)| {
                let (p, hh) = (idx / c.num_heads, idx % c.num_heads);
                let qv = &q[(p * c.num_heads + hh) * hd..][..hd];
                let kvh = hh / group;
                let scores: Vec<f32> = (0..=p)
                    .map(|s| {
                        qv.iter()
                            .zip(&k[(s * c.num_kv_heads + kvh) * hd..][..hd])
                            .map(|(a, b)| a * b)
                            .sum::<f32>()
                            / (hd as f32).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f32 = e.iter().sum();
                for (s, w) in e.iter().enumerate() {
                    let vv = &v[(s * c.num_kv_heads + kvh) * hd..][..hd];
                    out.iter_mut().zip(vv).for_each(|(o, x)| *o += w / sum * x);
                }
            });
            let o = linear(&attn, &l.o, None, c.q_size());
            h.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let mut x = h.clone();
            rms_norm(&mut x, &l.ffn_norm, c.rms_norm_eps);
            let down = match &l.mlp {
                Mlp::Dense(ffn) => ffn.forward(&x, d),
                Mlp::Experts { router, experts } => {
                    let moe = c.moe.as_ref().expect("experts come with a MoE config");
                    moe_forward(&x, router, experts, moe, d)
                }
            };
            h.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }
        rms_norm(&mut h, &self.norm, c.rms_norm_eps);
        linear(&h, &self.lm_head, None, d)
    }
}
