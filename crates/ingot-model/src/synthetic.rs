//! Tiny random models written as HF directories, so every architecture is exercised
//! without downloads.

use crate::config::Arch;
use anyhow::{anyhow, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView;
use serde_json::json;
use std::path::Path;

pub use safetensors::Dtype;
pub struct SyntheticSpec {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub tie_word_embeddings: bool,
    /// `max_position_embeddings`: the longest context the model takes.
    pub max_positions: usize,
    /// For Qwen3-MoE and Mixtral: the experts, how many a token uses, and each one's MLP
    /// width.
    pub experts: Option<(usize, usize, usize)>,
    /// Storage type of the weights: F32, F16 or BF16.
    pub dtype: Dtype,
    /// Number of safetensors files (more than one writes `model.safetensors.index.json`).
    pub shards: usize,
    pub seed: u64,
    /// Projections stored as a published FP8 checkpoint stores them.
    pub fp8: Option<SyntheticFp8>,
}

/// How a synthetic checkpoint keeps its projections in FP8 (the embedding table, routers
/// and output projection stay in `dtype`, as published FP8 checkpoints keep them).
#[derive(Clone, Copy, Debug)]
pub struct SyntheticFp8 {
    pub scales: Fp8Scales,
    /// The e4m3 values times their scales written in `dtype`, without a
    /// `quantization_config`: the same model as an unquantized checkpoint.
    pub dequantized: bool,
}

/// The scales of [`SyntheticFp8`], each as a convention of published checkpoints has them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Scales {
    /// `weight_scale_inv` a 128 × 128 tile (`quant_method: fp8`, `weight_block_size`).
    Tile128,
    /// `weight_scale` an output channel (compressed-tensors `float-quantized`).
    Channel,
    /// One `weight_scale` a matrix (`quant_method: fp8`, vLLM's).
    Tensor,
}

impl Fp8Scales {
    /// Rows and columns one scale covers in a `[rows, cols]` matrix.
    fn tile(self, rows: usize, cols: usize) -> (usize, usize) {
        match self {
            Fp8Scales::Tile128 => (128, 128),
            Fp8Scales::Channel => (1, cols),
            Fp8Scales::Tensor => (rows, cols),
        }
    }

    fn quantization_config(self) -> serde_json::Value {
        match self {
            Fp8Scales::Tile128 => json!({"quant_method": "fp8", "fmt": "e4m3",
                "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
            Fp8Scales::Channel => json!({"quant_method": "compressed-tensors",
                "format": "float-quantized", "ignore": ["lm_head"], "config_groups":
                {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                "strategy": "channel", "symmetric": true}}}}),
            Fp8Scales::Tensor => json!({"quant_method": "fp8", "activation_scheme": "dynamic"}),
        }
    }
}

/// A `[rows, cols]` matrix in FP8 with a scale per tile of `scales`.
struct Fp8Matrix {
    /// The e4m3 bytes, row-major.
    quants: Vec<u8>,
    /// Each tile's largest |value| over 448, in row-major tile order.
    scales: Vec<f32>,
    /// The values the two stand for: e4m3 · scale.
    values: Vec<f32>,
}

fn quantize_fp8(values: &[f32], rows: usize, cols: usize, scales: Fp8Scales) -> Fp8Matrix {
    use ingot_backend::quant::fp8::{e4m3_to_f32, f32_to_e4m3, E4M3_MAX};
    let (tr, tc) = scales.tile(rows, cols);
    let (gr, gc) = (rows.div_ceil(tr), cols.div_ceil(tc));
    let tile = |i: usize| i / cols / tr * gc + i % cols / tc;
    let mut amax = vec![0f32; gr * gc];
    for (i, v) in values.iter().enumerate() {
        amax[tile(i)] = amax[tile(i)].max(v.abs());
    }
    let scales: Vec<f32> = amax.iter().map(|a| a / E4M3_MAX).collect();
    let quants: Vec<u8> = values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let s = scales[tile(i)];
            f32_to_e4m3(if s > 0.0 { v / s } else { 0.0 })
        })
        .collect();
    let values = quants
        .iter()
        .enumerate()
        .map(|(i, &q)| scales[tile(i)] * e4m3_to_f32(q))
        .collect();
    Fp8Matrix {
        quants,
        scales,
        values,
    }
}

impl SyntheticSpec {
    /// A small model of `arch` with GQA and an explicit head_dim that differs from
    /// hidden/heads, so shape mistakes cannot cancel out.
    pub fn tiny(arch: Arch) -> SyntheticSpec {
        SyntheticSpec {
            arch,
            vocab_size: 97,
            hidden_size: 64,
            intermediate_size: 96,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 32,
            tie_word_embeddings: matches!(arch, Arch::Qwen2 | Arch::Qwen3),
            max_positions: 512,
            experts: match arch {
                Arch::Qwen3Moe => Some((8, 2, 32)),
                Arch::Mixtral => Some((4, 2, 48)),
                _ => None,
            },
            dtype: Dtype::F32,
            shards: 1,
            seed: 42,
            fp8: None,
        }
    }

    /// Whether `layer` has a mixture of experts: every layer of Mixtral; Qwen3-MoE's but
    /// its last (written as `mlp_only_layers`), so that both kinds of MLP run.
    fn sparse(&self, layer: usize) -> bool {
        match self.arch {
            Arch::Mixtral => true,
            Arch::Qwen3Moe => self.num_layers == 1 || layer + 1 < self.num_layers,
            _ => false,
        }
    }

    /// Writes config.json, model.safetensors and tokenizer.json into `dir`.
    pub fn write(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut rng = StdRng::seed_from_u64(self.seed);
        let (d, f, hd) = (self.hidden_size, self.intermediate_size, self.head_dim);
        let (q, kv) = (self.num_heads * hd, self.num_kv_heads * hd);
        let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = vec![];
        let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
            let n = shape.iter().product();
            let vals = (0..n)
                .map(|_| offset + scale * rng.random_range(-1.0f32..1.0))
                .collect();
            tensors.push((name, shape, vals));
        };
        let w = 1.0 / (d as f32).sqrt();
        add(
            "model.embed_tokens.weight".into(),
            vec![self.vocab_size, d],
            1.0,
            0.0,
        );
        for l in 0..self.num_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            add(p("input_layernorm.weight"), vec![d], 0.2, 1.0);
            add(p("self_attn.q_proj.weight"), vec![q, d], w, 0.0);
            add(p("self_attn.k_proj.weight"), vec![kv, d], w, 0.0);
            add(p("self_attn.v_proj.weight"), vec![kv, d], w, 0.0);
            if self.arch == Arch::Qwen2 {
                add(p("self_attn.q_proj.bias"), vec![q], 0.1, 0.0);
                add(p("self_attn.k_proj.bias"), vec![kv], 0.1, 0.0);
                add(p("self_attn.v_proj.bias"), vec![kv], 0.1, 0.0);
            }
            if matches!(self.arch, Arch::Qwen3 | Arch::Qwen3Moe) {
                add(p("self_attn.q_norm.weight"), vec![hd], 0.2, 1.0);
                add(p("self_attn.k_norm.weight"), vec![hd], 0.2, 1.0);
            }
            add(
                p("self_attn.o_proj.weight"),
                vec![d, q],
                1.0 / (q as f32).sqrt(),
                0.0,
            );
            add(p("post_attention_layernorm.weight"), vec![d], 0.2, 1.0);
            match self.experts {
                Some((experts, _, ef)) if self.sparse(l) => {
                    let (router, expert) = match self.arch {
                        Arch::Mixtral => ("block_sparse_moe.gate", "block_sparse_moe.experts"),
                        _ => ("mlp.gate", "mlp.experts"),
                    };
                    // Routers wider than the other products keep the experts' scores apart.
                    add(
                        p(&format!("{router}.weight")),
                        vec![experts, d],
                        4.0 * w,
                        0.0,
                    );
                    let names = match self.arch {
                        Arch::Mixtral => ["w1", "w3", "w2"],
                        _ => ["gate_proj", "up_proj", "down_proj"],
                    };
                    for e in 0..experts {
                        let n = |i: usize| p(&format!("{expert}.{e}.{}.weight", names[i]));
                        add(n(0), vec![ef, d], w, 0.0);
                        add(n(1), vec![ef, d], w, 0.0);
                        add(n(2), vec![d, ef], 1.0 / (ef as f32).sqrt(), 0.0);
                    }
                }
                _ => {
                    add(p("mlp.gate_proj.weight"), vec![f, d], w, 0.0);
                    add(p("mlp.up_proj.weight"), vec![f, d], w, 0.0);
                    add(
                        p("mlp.down_proj.weight"),
                        vec![d, f],
                        1.0 / (f as f32).sqrt(),
                        0.0,
                    );
                }
            }
        }
        add("model.norm.weight".into(), vec![d], 0.2, 1.0);
        if !self.tie_word_embeddings {
            add("lm_head.weight".into(), vec![self.vocab_size, d], w, 0.0);
        }
        let encode = |v: &[f32]| -> Result<Vec<u8>> {
            Ok(match self.dtype {
                Dtype::F32 => bytemuck::cast_slice(v).to_vec(),
                Dtype::F16 => v
                    .iter()
                    .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                    .collect(),
                Dtype::BF16 => v
                    .iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect(),
                other => {
                    return Err(anyhow!(
                        "synthetic models are f32, f16 or bf16, not {other:?}"
                    ))
                }
            })
        };
        // The projections (and experts), which published FP8 checkpoints quantize.
        let projection =
            |n: &str| n.ends_with(".weight") && (n.contains("_proj.") || n.contains(".experts."));
        let mut bytes = vec![];
        for (n, s, v) in tensors {
            match self.fp8 {
                Some(fp8) if projection(&n) => {
                    let (rows, cols) = (s[0], s[1]);
                    let m = quantize_fp8(&v, rows, cols, fp8.scales);
                    if fp8.dequantized {
                        bytes.push((n, s, self.dtype, encode(&m.values)?));
                        continue;
                    }
                    let (scale_name, scale_shape) = match fp8.scales {
                        Fp8Scales::Tile128 => (
                            format!("{n}_scale_inv"),
                            vec![rows.div_ceil(128), cols.div_ceil(128)],
                        ),
                        Fp8Scales::Channel => (format!("{n}_scale"), vec![rows, 1]),
                        Fp8Scales::Tensor => (format!("{n}_scale"), vec![]),
                    };
                    bytes.push((n, s, Dtype::F8_E4M3, m.quants));
                    let scale = bytemuck::cast_slice(&m.scales).to_vec();
                    bytes.push((scale_name, scale_shape, Dtype::F32, scale));
                }
                _ => bytes.push((n, s, self.dtype, encode(&v)?)),
            }
        }
        let shards = self.shards.max(1);
        let file_of = |i: usize| {
            if shards == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{shards:05}.safetensors", i + 1)
            }
        };
        let mut weight_map = serde_json::Map::new();
        for shard in 0..shards {
            let views = bytes
                .iter()
                .enumerate()
                .filter(|(i, _)| i % shards == shard)
                .map(|(_, (n, s, dtype, b))| {
                    weight_map.insert(n.clone(), json!(file_of(shard)));
                    Ok((
                        n.clone(),
                        TensorView::new(*dtype, s.clone(), b).map_err(|e| anyhow!("{e}"))?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            safetensors::serialize_to_file(views, None, &dir.join(file_of(shard)))
                .map_err(|e| anyhow!("{e}"))?;
        }
        if shards > 1 {
            let index = json!({"metadata": {}, "weight_map": weight_map});
            std::fs::write(
                dir.join("model.safetensors.index.json"),
                serde_json::to_string_pretty(&index)?,
            )?;
        }

        let model_type = match self.arch {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Mixtral => "mixtral",
        };
        let mut config = json!({
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": d,
            "intermediate_size": f,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": hd,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": self.max_positions,
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": 1,
        });
        if let Some((experts, per_token, ef)) = self.experts {
            let moe = match self.arch {
                Arch::Mixtral => json!({
                    "num_local_experts": experts,
                    "num_experts_per_tok": per_token,
                    "intermediate_size": ef,
                    "sliding_window": null,
                }),
                _ => json!({
                    "num_experts": experts,
                    "num_experts_per_tok": per_token,
                    "moe_intermediate_size": ef,
                    "norm_topk_prob": true,
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": (0..self.num_layers).filter(|&l| !self.sparse(l)).collect::<Vec<_>>(),
                }),
            };
            let obj = config.as_object_mut().expect("an object");
            obj.extend(moe.as_object().expect("an object").clone());
        }
        if let Some(fp8) = self.fp8.filter(|f| !f.dequantized) {
            let obj = config.as_object_mut().expect("an object");
            obj.insert(
                "quantization_config".into(),
                fp8.scales.quantization_config(),
            );
        }
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_string_pretty(&config)?,
        )?;

        let tok = crate::tokenizer::word_level(self.vocab_size)?;
        tok.save(dir.join("tokenizer.json"), false)
            .map_err(|e| anyhow!("{e}"))?;
        let tcfg = json!({"eos_token": "</s>", "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"});
        std::fs::write(
            dir.join("tokenizer_config.json"),
            serde_json::to_string_pretty(&tcfg)?,
        )?;
        Ok(())
    }
}
