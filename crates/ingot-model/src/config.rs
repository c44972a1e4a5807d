//! Model hyper-parameters, read from an HF `config.json` or from GGUF metadata.

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// The transformer families ingot runs. They share one forward pass and differ in
/// projection biases, per-head q/k normalization and (Qwen3-MoE, Mixtral) a mixture of
/// experts in place of the MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Mixtral,
}

impl Arch {
    /// From an HF `model_type` / `architectures` entry or a GGUF `general.architecture`.
    pub fn from_name(name: &str) -> Result<Arch> {
        Ok(match name {
            "llama" | "LlamaForCausalLM" => Arch::Llama,
            "mistral" | "MistralForCausalLM" => Arch::Mistral,
            "qwen2" | "Qwen2ForCausalLM" => Arch::Qwen2,
            "qwen3" | "Qwen3ForCausalLM" => Arch::Qwen3,
            "qwen3_moe" | "Qwen3MoeForCausalLM" => Arch::Qwen3Moe,
            "mixtral" | "MixtralForCausalLM" => Arch::Mixtral,
            other => bail!("unsupported model architecture `{other}` (supported: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral)"),
        })
    }
}

/// How rotary frequencies are rescaled for long contexts.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1's wavelength-dependent rescaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: usize,
    },
    /// Per-frequency divisors as stored by GGUF (`rope_freqs.weight`).
    FreqFactors(Vec<f32>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Biases on the q, k and v projections (Qwen2, some Llama variants).
    pub qkv_bias: bool,
    /// Per-head RMSNorm of queries and keys before RoPE (Qwen3).
    pub qk_norm: bool,
    /// The mixture of experts of the sparse layers (Qwen3-MoE, Mixtral).
    pub moe: Option<MoeConfig>,
}

/// A mixture-of-experts MLP: a router scores `num_experts` experts per token, the
/// `experts_per_token` best (softmax over all, then the top k) each run a gated MLP of
/// `expert_intermediate_size`, and their outputs are summed with those weights.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub expert_intermediate_size: usize,
    /// Rescale the chosen experts' weights to sum to 1 (Mixtral always; Qwen3-MoE's
    /// `norm_topk_prob`).
    pub renormalize: bool,
    /// Layers with a dense MLP of `intermediate_size` instead (Qwen3-MoE's
    /// `mlp_only_layers` and `decoder_sparse_step`).
    pub dense_layers: Vec<usize>,
}

impl MoeConfig {
    pub fn is_sparse(&self, layer: usize) -> bool {
        !self.dense_layers.contains(&layer)
    }

    /// The backend's view of a step of `rows` rows of `hidden` through these experts.
    pub fn shape(&self, rows: usize, hidden: usize) -> ingot_backend::MoeShape {
        ingot_backend::MoeShape {
            rows,
            experts: self.num_experts,
            experts_per_token: self.experts_per_token,
            dim: hidden,
            ffn: self.expert_intermediate_size,
        }
    }

    fn from_hf(
        v: &Value,
        arch: Arch,
        num_layers: usize,
        intermediate: usize,
    ) -> Result<Option<MoeConfig>> {
        // Hub files and transformers 5 name the expert count either way.
        let experts = v
            .get("num_experts")
            .or_else(|| v.get("num_local_experts"))
            .and_then(Value::as_u64);
        let moe = match arch {
            Arch::Qwen3Moe => {
                let step = v
                    .get("decoder_sparse_step")
                    .and_then(Value::as_u64)
                    .unwrap_or(1);
                let mlp_only: Vec<usize> = match v.get("mlp_only_layers") {
                    Some(l) if !l.is_null() => serde_json::from_value(l.clone())
                        .context("config.json: `mlp_only_layers` must be a list of layers")?,
                    _ => vec![],
                };
                if step == 0 {
                    bail!("config.json: `decoder_sparse_step` must be at least 1");
                }
                MoeConfig {
                    num_experts: experts.context("config.json: qwen3_moe needs `num_experts`")?
                        as usize,
                    experts_per_token: get_usize(v, "num_experts_per_tok")?,
                    expert_intermediate_size: get_usize(v, "moe_intermediate_size")?,
                    renormalize: v
                        .get("norm_topk_prob")
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                    dense_layers: (0..num_layers)
                        .filter(|l| mlp_only.contains(l) || !(l + 1).is_multiple_of(step as usize))
                        .collect(),
                }
            }
            Arch::Mixtral => MoeConfig {
                num_experts: experts.context("config.json: mixtral needs `num_local_experts`")?
                    as usize,
                experts_per_token: get_usize(v, "num_experts_per_tok")?,
                expert_intermediate_size: intermediate,
                renormalize: true,
                dense_layers: vec![],
            },
            _ => return Ok(None),
        };
        if v.get("shared_expert_intermediate_size")
            .and_then(Value::as_u64)
            .is_some_and(|n| n > 0)
        {
            bail!(
                "config.json: shared experts (`shared_expert_intermediate_size`) are not supported"
            );
        }
        Ok(Some(moe))
    }
}

fn get_usize(v: &Value, key: &str) -> Result<usize> {
    v.get(key)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .with_context(|| format!("config.json: missing or invalid `{key}`"))
}

fn opt_f32(v: &Value, key: &str) -> Option<f32> {
    v.get(key).and_then(Value::as_f64).map(|x| x as f32)
}

impl ModelConfig {
    /// Parses an HF `config.json`.
    pub fn from_hf_json(text: &str) -> Result<ModelConfig> {
        let v: Value = serde_json::from_str(text).context("config.json is not valid JSON")?;
        let name = v
            .get("model_type")
            .and_then(Value::as_str)
            .or_else(|| {
                v.get("architectures")
                    .and_then(|a| a.get(0))
                    .and_then(Value::as_str)
            })
            .context("config.json names no `model_type`")?;
        let arch = Arch::from_name(name)?;
        let hidden_size = get_usize(&v, "hidden_size")?;
        let num_heads = get_usize(&v, "num_attention_heads")?;
        let num_kv_heads = get_usize(&v, "num_key_value_heads").unwrap_or(num_heads);
        let head_dim = match v.get("head_dim") {
            Some(Value::Null) | None => hidden_size / num_heads,
            Some(_) => get_usize(&v, "head_dim")?,
        };
        let mut max_pos = get_usize(&v, "max_position_embeddings").unwrap_or(2048);
        if let Some(window) = v.get("sliding_window").and_then(Value::as_u64) {
            let used = v
                .get("use_sliding_window")
                .and_then(Value::as_bool)
                .unwrap_or(arch == Arch::Mistral);
            // Within the window, sliding-window attention is plain causal attention.
            if used && (window as usize) < max_pos {
                tracing::warn!("sliding-window attention is not implemented: context limited to the window of {window} tokens");
                max_pos = window as usize;
            }
        }
        // transformers 5 writes RoPE's settings under `rope_parameters`.
        let rope = v.get("rope_parameters").filter(|r| r.is_object());
        let rope_theta = opt_f32(&v, "rope_theta")
            .or_else(|| rope.and_then(|r| opt_f32(r, "rope_theta")))
            .unwrap_or(10000.0);
        let rope_scaling = v.get("rope_scaling").filter(|r| !r.is_null()).or(rope);
        let num_layers = get_usize(&v, "num_hidden_layers")?;
        let intermediate_size = get_usize(&v, "intermediate_size")?;
        if let Some(f) = opt_f32(&v, "partial_rotary_factor") {
            if f != 1.0 {
                bail!("config.json: partial_rotary_factor {f} is not supported");
            }
        }
        let cfg = ModelConfig {
            arch,
            vocab_size: get_usize(&v, "vocab_size")?,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: opt_f32(&v, "rms_norm_eps").unwrap_or(1e-6),
            rope_theta,
            rope_scaling: parse_hf_rope_scaling(rope_scaling)?,
            max_position_embeddings: max_pos,
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            qkv_bias: arch == Arch::Qwen2
                || v.get("attention_bias")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe),
            moe: MoeConfig::from_hf(&v, arch, num_layers, intermediate_size)?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<()> {
        let ok = self.num_heads > 0
            && self.num_kv_heads > 0
            && self.num_heads.is_multiple_of(self.num_kv_heads)
            && self.head_dim.is_multiple_of(2)
            && self.hidden_size > 0
            && self.num_layers > 0
            && self.vocab_size > 0;
        if !ok {
            bail!(
                "inconsistent model shape: {} heads, {} kv heads, head_dim {}, hidden {}, {} layers, vocab {}",
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.hidden_size,
                self.num_layers,
                self.vocab_size
            );
        }
        if let Some(moe) = &self.moe {
            if moe.experts_per_token == 0 || moe.experts_per_token > moe.num_experts {
                bail!(
                    "inconsistent mixture of experts: {} experts per token of {}",
                    moe.experts_per_token,
                    moe.num_experts
                );
            }
        }
        Ok(())
    }

    pub fn q_size(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_size(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

fn parse_hf_rope_scaling(v: Option<&Value>) -> Result<RopeScaling> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(RopeScaling::None);
    };
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(Value::as_str)
        .context("rope_scaling names no `rope_type`")?;
    let factor = opt_f32(v, "factor");
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: factor.context("linear rope_scaling needs `factor`")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: factor.context("llama3 rope_scaling needs `factor`")?,
            low_freq_factor: opt_f32(v, "low_freq_factor").unwrap_or(1.0),
            high_freq_factor: opt_f32(v, "high_freq_factor").unwrap_or(4.0),
            original_max_position: get_usize(v, "original_max_position_embeddings")?,
        },
        other => bail!("rope_scaling type `{other}` is not supported (supported: linear, llama3)"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_qwen2_config_with_defaults() {
        let c = ModelConfig::from_hf_json(
            r#"{"model_type":"qwen2","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
                "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"rope_theta":1000000.0,
                "tie_word_embeddings":true,"sliding_window":32768,"use_sliding_window":false}"#,
        )
        .unwrap();
        assert_eq!(
            (c.arch, c.head_dim, c.qkv_bias, c.qk_norm),
            (Arch::Qwen2, 16, true, false)
        );
        assert_eq!(c.rope_theta, 1e6);
    }

    #[test]
    fn reads_moe_configs_in_hub_and_transformers_5_spellings() {
        let c = ModelConfig::from_hf_json(
            r#"{"model_type":"qwen3_moe","hidden_size":64,"intermediate_size":128,"num_hidden_layers":4,
                "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"vocab_size":100,
                "num_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":48,"norm_topk_prob":true,
                "decoder_sparse_step":2,"mlp_only_layers":[3],
                "rope_parameters":{"rope_type":"default","rope_theta":1000000.0}}"#,
        )
        .unwrap();
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(
            (
                moe.num_experts,
                moe.experts_per_token,
                moe.expert_intermediate_size
            ),
            (8, 2, 48)
        );
        assert!(moe.renormalize && c.qk_norm);
        assert_eq!(moe.dense_layers, [0, 2, 3]);
        assert_eq!((c.rope_theta, &c.rope_scaling), (1e6, &RopeScaling::None));
        let m = ModelConfig::from_hf_json(
            r#"{"model_type":"mixtral","hidden_size":64,"intermediate_size":96,"num_hidden_layers":2,
                "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,
                "num_local_experts":4,"num_experts_per_tok":2,"sliding_window":null}"#,
        )
        .unwrap();
        let moe = m.moe.unwrap();
        assert_eq!((moe.num_experts, moe.expert_intermediate_size), (4, 96));
        assert!(moe.renormalize && moe.dense_layers.is_empty() && !m.qk_norm);
        let e = ModelConfig::from_hf_json(
            r#"{"model_type":"qwen3_moe","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
                "num_attention_heads":4,"vocab_size":100,"num_experts_per_tok":2,"moe_intermediate_size":48}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("num_experts"), "{e}");
        let e = ModelConfig::from_hf_json(
            r#"{"model_type":"mixtral","hidden_size":64,"intermediate_size":96,"num_hidden_layers":2,
                "num_attention_heads":4,"vocab_size":100,"num_local_experts":4,"num_experts_per_tok":5}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("5 experts per token of 4"), "{e}");
    }

    #[test]
    fn rejects_unknown_architecture_and_rope_type_by_name() {
        let e = ModelConfig::from_hf_json(r#"{"model_type":"gpt_neox"}"#).unwrap_err();
        assert!(e.to_string().contains("gpt_neox"), "{e}");
        let e = ModelConfig::from_hf_json(
            r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
                "num_attention_heads":4,"vocab_size":100,"rope_scaling":{"rope_type":"yarn","factor":4.0}}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("yarn"), "{e}");
    }
}
