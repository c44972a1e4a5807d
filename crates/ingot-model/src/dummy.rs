//! `--load-format dummy`: every weight a model of a config would have, filled with
//! reproducible random values (a hash of the tensor and the element index), so GPU
//! benchmarks at real shapes need no download. The values keep activations in range:
//! matrices are scaled by 1/sqrt(fan-in), norms sit near 1.

use crate::checkpoint::{HostTensor, Role};
use crate::config::ModelConfig;
use crate::tensor_parallel::Cut;
use half::{bf16, f16};
use ingot_backend::DType;
use rayon::prelude::*;
use std::borrow::Cow;

/// The shape of `role` in `cfg`, or `None` when this model has no such weight.
fn shape(role: Role, cfg: &ModelConfig) -> Option<Vec<usize>> {
    let (d, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (q, kv, hd) = (cfg.q_size(), cfg.kv_size(), cfg.head_dim);
    Some(match role {
        Role::Embed => vec![v, d],
        Role::LmHead if cfg.tie_word_embeddings => return None,
        Role::LmHead => vec![v, d],
        Role::FinalNorm | Role::AttnNorm | Role::FfnNorm => vec![d],
        Role::Q => vec![q, d],
        Role::K | Role::V => vec![kv, d],
        Role::O => vec![d, q],
        Role::QBias if cfg.qkv_bias => vec![q],
        Role::KBias | Role::VBias if cfg.qkv_bias => vec![kv],
        Role::QNorm | Role::KNorm if cfg.qk_norm => vec![hd],
        Role::QBias | Role::KBias | Role::VBias | Role::QNorm | Role::KNorm => return None,
        Role::Gate | Role::Up => vec![f, d],
        Role::Down => vec![d, f],
        Role::Router => vec![cfg.moe.as_ref()?.num_experts, d],
        Role::ExpertGate(_) | Role::ExpertUp(_) => {
            vec![cfg.moe.as_ref()?.expert_intermediate_size, d]
        }
        Role::ExpertDown(_) => vec![d, cfg.moe.as_ref()?.expert_intermediate_size],
    })
}

const LAYER_ROLES: [Role; 14] = [
    Role::AttnNorm,
    Role::Q,
    Role::K,
    Role::V,
    Role::O,
    Role::QBias,
    Role::KBias,
    Role::VBias,
    Role::QNorm,
    Role::KNorm,
    Role::FfnNorm,
    Role::Gate,
    Role::Up,
    Role::Down,
];

pub fn tensor_count(cfg: &ModelConfig) -> usize {
    let per_layer = LAYER_ROLES
        .iter()
        .filter(|&&r| shape(r, cfg).is_some())
        .count();
    let global = [Role::Embed, Role::FinalNorm, Role::LmHead]
        .iter()
        .filter(|&&r| shape(r, cfg).is_some())
        .count();
    // A sparse layer has a router and three matrices per expert in place of the dense
    // MLP's three.
    let moe = cfg.moe.as_ref().map_or(0, |m| {
        let sparse = (0..cfg.num_layers).filter(|&l| m.is_sparse(l)).count();
        sparse * (1 + 3 * m.num_experts) - sparse * 3
    });
    global + per_layer * cfg.num_layers + moe
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Uniform in [-1, 1), a pure function of the tensor's seed and the index.
fn uniform(seed: u64, i: usize) -> f32 {
    let bits = splitmix64(seed ^ splitmix64(i as u64)) >> 40;
    bits as f32 / (1u64 << 23) as f32 - 1.0
}

/// A number per weight of a layer, for its seed (the dense roles keep the numbers their
/// enum had, so dummy weights stay what they were).
fn role_number(role: Role) -> u64 {
    match role {
        Role::Embed => 0,
        Role::FinalNorm => 1,
        Role::LmHead => 2,
        Role::AttnNorm => 3,
        Role::Q => 4,
        Role::K => 5,
        Role::V => 6,
        Role::O => 7,
        Role::QBias => 8,
        Role::KBias => 9,
        Role::VBias => 10,
        Role::QNorm => 11,
        Role::KNorm => 12,
        Role::FfnNorm => 13,
        Role::Gate => 14,
        Role::Up => 15,
        Role::Down => 16,
        Role::Router => 17,
        Role::ExpertGate(e) => 18 + 3 * e as u64,
        Role::ExpertUp(e) => 19 + 3 * e as u64,
        Role::ExpertDown(e) => 20 + 3 * e as u64,
    }
}

/// Part `cut` of the weight in `role` of layer `layer`: a rank of a tensor-parallel group
/// makes only its own part, with the values the whole tensor has there.
pub fn tensor(
    role: Role,
    layer: usize,
    cfg: &ModelConfig,
    dtype: DType,
    cut: &Cut,
) -> Option<HostTensor<'static>> {
    let whole = shape(role, cfg)?;
    let shape = cut.shape(&whole);
    let n: usize = shape.iter().product();
    let (offset, scale) = match role {
        Role::FinalNorm | Role::AttnNorm | Role::FfnNorm | Role::QNorm | Role::KNorm => (1.0, 0.1),
        Role::QBias | Role::KBias | Role::VBias => (0.0, 0.1),
        Role::Embed => (0.0, 1.0),
        _ => (0.0, (3.0 / whole[1] as f32).sqrt()),
    };
    let seed = splitmix64((role_number(role) << 32) ^ layer as u64);
    let value = |i: usize| offset + scale * uniform(seed, cut.source_index(&whole, i));
    // 1-D weights are read as f32 (norms, biases); matrices come in the config's dtype.
    let dtype = if shape.len() == 1 { DType::F32 } else { dtype };
    let width = dtype.bytes_for(1);
    let mut data = vec![0u8; n * width];
    data.par_chunks_mut(width << 16)
        .enumerate()
        .for_each(|(c, chunk)| {
            let base = c << 16;
            for (j, out) in chunk.chunks_exact_mut(width).enumerate() {
                let v = value(base + j);
                match dtype {
                    DType::BF16 => out.copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
                    DType::F16 => out.copy_from_slice(&f16::from_f32(v).to_le_bytes()),
                    _ => out.copy_from_slice(&v.to_le_bytes()),
                }
            }
        });
    Some(HostTensor {
        dtype,
        shape,
        data: Cow::Owned(data),
        mapped: &[],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    fn config() -> ModelConfig {
        ModelConfig::from_hf_json(
            r#"{"model_type":"qwen2","hidden_size":64,"intermediate_size":96,"num_hidden_layers":2,
                "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"tie_word_embeddings":true}"#,
        )
        .unwrap()
    }

    #[test]
    fn weights_are_reproducible_and_follow_the_config() {
        let cfg = config();
        let q = tensor(Role::Q, 1, &cfg, DType::BF16, &Cut::Whole).unwrap();
        assert_eq!((q.dtype, q.shape.clone()), (DType::BF16, vec![64, 64]));
        assert_eq!(
            q.data,
            tensor(Role::Q, 1, &cfg, DType::BF16, &Cut::Whole)
                .unwrap()
                .data
        );
        assert_ne!(
            q.data,
            tensor(Role::Q, 0, &cfg, DType::BF16, &Cut::Whole)
                .unwrap()
                .data
        );
        let norm = tensor(Role::AttnNorm, 0, &cfg, DType::BF16, &Cut::Whole).unwrap();
        assert!(norm.dtype == DType::F32 && norm.to_f32().iter().all(|v| (0.9..=1.1).contains(v)));
        // Qwen2 has q/k/v biases and tied embeddings, no q/k norms.
        assert!(tensor(Role::QBias, 0, &cfg, DType::BF16, &Cut::Whole).is_some());
        assert!(tensor(Role::LmHead, 0, &cfg, DType::BF16, &Cut::Whole).is_none());
        assert!(tensor(Role::QNorm, 0, &cfg, DType::BF16, &Cut::Whole).is_none());
        assert_eq!(tensor_count(&cfg), 2 + 2 * 12);
    }

    /// A rank's part holds the values the whole tensor has there.
    #[test]
    fn parts_are_slices_of_the_whole() {
        let cfg = config();
        for cut in [Cut::Columns(16..40), Cut::Rows(3..9)] {
            let part = tensor(Role::O, 0, &cfg, DType::F32, &cut).unwrap();
            let whole = tensor(Role::O, 0, &cfg, DType::F32, &Cut::Whole).unwrap();
            let want = cut.apply(whole).unwrap();
            assert_eq!(part.shape, want.shape);
            assert_eq!(part.to_f32(), want.to_f32());
        }
    }

    #[test]
    fn moe_configs_get_routers_and_experts() {
        let cfg = ModelConfig::from_hf_json(
            r#"{"model_type":"qwen3_moe","hidden_size":64,"intermediate_size":96,"num_hidden_layers":2,
                "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":100,
                "num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":24,"mlp_only_layers":[1]}"#,
        )
        .unwrap();
        let shape = |r: Role| tensor(r, 0, &cfg, DType::BF16, &Cut::Whole).unwrap().shape;
        assert_eq!(shape(Role::Router), [4, 64]);
        assert_eq!(shape(Role::ExpertUp(3)), [24, 64]);
        assert_eq!(shape(Role::ExpertDown(0)), [64, 24]);
        let (a, b) = (
            tensor(Role::ExpertGate(0), 0, &cfg, DType::BF16, &Cut::Whole),
            tensor(Role::ExpertGate(1), 0, &cfg, DType::BF16, &Cut::Whole),
        );
        assert_ne!(a.unwrap().data, b.unwrap().data);
        // 3 global; per layer 8 (two norms, q/k/v/o, q/k norms), then the sparse layer's
        // router and 12 expert matrices and the dense layer's 3.
        assert_eq!(tensor_count(&cfg), 3 + 2 * 8 + 13 + 3);
    }
}
