//! Model files on disk — an HF safetensors directory or a single GGUF file — seen through
//! one interface: the config and each weight by its role.

use crate::config::{Arch, ModelConfig, MoeConfig, RopeScaling};
use crate::fp8_checkpoint::{self, Fp8Format};
use crate::gguf::{GgufFile, Value};
use crate::tensor_parallel::Cut;
use anyhow::{bail, ensure, Context, Result};
use ingot_backend::DType;
use memmap2::Mmap;
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What a weight does in the model; `layer` is `None` for the model-level ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Embed,
    FinalNorm,
    LmHead,
    AttnNorm,
    Q,
    K,
    V,
    O,
    QBias,
    KBias,
    VBias,
    QNorm,
    KNorm,
    FfnNorm,
    Gate,
    Up,
    Down,
    /// A mixture of experts' router: `[num_experts, hidden]`.
    Router,
    /// Expert `e`'s gate, up and down projections.
    ExpertGate(usize),
    ExpertUp(usize),
    ExpertDown(usize),
}

impl Role {
    fn hf_name(self, layer: usize, arch: Arch) -> String {
        let l = |s: &str| format!("model.layers.{layer}.{s}");
        match (self, arch) {
            (Role::Router, Arch::Mixtral) => return l("block_sparse_moe.gate.weight"),
            (Role::ExpertGate(e), Arch::Mixtral) => {
                return l(&format!("block_sparse_moe.experts.{e}.w1.weight"))
            }
            (Role::ExpertUp(e), Arch::Mixtral) => {
                return l(&format!("block_sparse_moe.experts.{e}.w3.weight"))
            }
            (Role::ExpertDown(e), Arch::Mixtral) => {
                return l(&format!("block_sparse_moe.experts.{e}.w2.weight"))
            }
            _ => {}
        }
        match self {
            Role::Embed => "model.embed_tokens.weight".into(),
            Role::FinalNorm => "model.norm.weight".into(),
            Role::LmHead => "lm_head.weight".into(),
            Role::AttnNorm => l("input_layernorm.weight"),
            Role::Q => l("self_attn.q_proj.weight"),
            Role::K => l("self_attn.k_proj.weight"),
            Role::V => l("self_attn.v_proj.weight"),
            Role::O => l("self_attn.o_proj.weight"),
            Role::QBias => l("self_attn.q_proj.bias"),
            Role::KBias => l("self_attn.k_proj.bias"),
            Role::VBias => l("self_attn.v_proj.bias"),
            Role::QNorm => l("self_attn.q_norm.weight"),
            Role::KNorm => l("self_attn.k_norm.weight"),
            Role::FfnNorm => l("post_attention_layernorm.weight"),
            Role::Gate => l("mlp.gate_proj.weight"),
            Role::Up => l("mlp.up_proj.weight"),
            Role::Down => l("mlp.down_proj.weight"),
            Role::Router => l("mlp.gate.weight"),
            Role::ExpertGate(e) => l(&format!("mlp.experts.{e}.gate_proj.weight")),
            Role::ExpertUp(e) => l(&format!("mlp.experts.{e}.up_proj.weight")),
            Role::ExpertDown(e) => l(&format!("mlp.experts.{e}.down_proj.weight")),
        }
    }

    fn gguf_name(self, layer: usize) -> String {
        let l = |s: &str| format!("blk.{layer}.{s}");
        match self {
            Role::Embed => "token_embd.weight".into(),
            Role::FinalNorm => "output_norm.weight".into(),
            Role::LmHead => "output.weight".into(),
            Role::AttnNorm => l("attn_norm.weight"),
            Role::Q => l("attn_q.weight"),
            Role::K => l("attn_k.weight"),
            Role::V => l("attn_v.weight"),
            Role::O => l("attn_output.weight"),
            Role::QBias => l("attn_q.bias"),
            Role::KBias => l("attn_k.bias"),
            Role::VBias => l("attn_v.bias"),
            Role::QNorm => l("attn_q_norm.weight"),
            Role::KNorm => l("attn_k_norm.weight"),
            Role::FfnNorm => l("ffn_norm.weight"),
            Role::Gate => l("ffn_gate.weight"),
            Role::Up => l("ffn_up.weight"),
            Role::Down => l("ffn_down.weight"),
            Role::Router => l("ffn_gate_inp.weight"),
            // llama.cpp stacks a layer's experts in one 3-D tensor per projection;
            // `Checkpoint::tensor` cuts expert e's matrix out of it.
            Role::ExpertGate(_) => l("ffn_gate_exps.weight"),
            Role::ExpertUp(_) => l("ffn_up_exps.weight"),
            Role::ExpertDown(_) => l("ffn_down_exps.weight"),
        }
    }

    /// The expert a role belongs to.
    fn expert(self) -> Option<usize> {
        match self {
            Role::ExpertGate(e) | Role::ExpertUp(e) | Role::ExpertDown(e) => Some(e),
            _ => None,
        }
    }
}

/// A weight as stored: `shape` is `[rows, cols]` (row-major) or `[n]`.
pub struct HostTensor<'a> {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Cow<'a, [u8]>,
    /// The bytes of the mapped file it was read from (empty for generated weights), which
    /// [`Checkpoint::release`] drops from memory once the tensor is loaded.
    pub mapped: &'a [u8],
}

impl HostTensor<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// All values as f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.numel()];
        ingot_backend::quant::dequantize_row(self.dtype, &self.data, &mut out);
        out
    }
}

/// One memory-mapped safetensors file.
pub struct Shard {
    mmap: Mmap,
    header_len: usize,
}

/// How a safetensors tensor's values are stored.
#[derive(Clone, Copy)]
enum Stored {
    Plain(DType),
    /// e4m3 bytes, whose scales are another tensor ([`fp8_checkpoint`]).
    E4m3,
}

/// Where one tensor lies in the shards.
pub struct SafetensorsEntry {
    shard: usize,
    stored: Stored,
    shape: Vec<usize>,
    range: (usize, usize),
}

pub enum Checkpoint {
    Safetensors {
        dir: PathBuf,
        shards: Vec<Shard>,
        entries: HashMap<String, SafetensorsEntry>,
        /// Where `config.json` has an FP8 `quantization_config`.
        fp8: Option<Fp8Format>,
    },
    Gguf {
        path: PathBuf,
        file: GgufFile,
    },
    /// `--load-format dummy`: random weights at the shapes of an HF `config.json`.
    Dummy {
        dir: PathBuf,
        config: ModelConfig,
        dtype: DType,
    },
}

/// The stored bytes of entry `e` (named `name`, for errors).
fn entry_bytes<'a>(shards: &'a [Shard], e: &SafetensorsEntry, name: &str) -> Result<&'a [u8]> {
    let s = &shards[e.shard];
    s.mmap
        .get(s.header_len + e.range.0..s.header_len + e.range.1)
        .with_context(|| format!("{name}: data out of range"))
}

/// The e4m3 weight `e` (named `name`, its bytes `weight`) with its scales
/// (`{name}_scale_inv`, or `{name}_scale`) as [`DType::Fp8`] blocks.
fn e4m3_blocks(
    shards: &[Shard],
    entries: &HashMap<String, SafetensorsEntry>,
    name: &str,
    e: &SafetensorsEntry,
    weight: &[u8],
    format: Fp8Format,
) -> Result<Vec<u8>> {
    let (scale_name, scale) = ["_scale_inv", "_scale"]
        .iter()
        .map(|suffix| format!("{name}{suffix}"))
        .find_map(|n| entries.get(&n).map(|e| (n, e)))
        .with_context(|| format!("{name}: an FP8 weight without a weight_scale(_inv)"))?;
    let Stored::Plain(scale_dtype) = scale.stored else {
        bail!("{scale_name}: scales stored as FP8");
    };
    let mut values = vec![0f32; scale.shape.iter().product()];
    let raw = entry_bytes(shards, scale, &scale_name)?;
    ensure!(
        raw.len() == scale_dtype.bytes_for(values.len()),
        "{scale_name}: {} bytes for shape {:?}",
        raw.len(),
        scale.shape
    );
    ingot_backend::quant::dequantize_row(scale_dtype, raw, &mut values);
    fp8_checkpoint::blocks(name, weight, &e.shape, &values, &scale.shape, format)
}

impl Checkpoint {
    /// Opens a `.gguf` file or an HF model directory.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        if !path.exists() {
            bail!("{}: no such file or directory", path.display())
        } else if path.is_dir() {
            Self::open_safetensors(path)
        } else if path.extension().is_some_and(|e| e == "gguf") {
            Ok(Checkpoint::Gguf {
                path: path.to_path_buf(),
                file: GgufFile::open(path)?,
            })
        } else {
            bail!(
                "{}: expected an HF model directory or a .gguf file",
                path.display()
            )
        }
    }

    fn open_safetensors(dir: &Path) -> Result<Checkpoint> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<String> = if index.exists() {
            let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index)?)
                .with_context(|| format!("{} is not valid JSON", index.display()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .context("index has no weight_map")?;
            let mut f: Vec<String> = map
                .values()
                .filter_map(|s| s.as_str().map(String::from))
                .collect();
            f.sort();
            f.dedup();
            f
        } else if dir.join("model.safetensors").exists() {
            vec!["model.safetensors".into()]
        } else {
            bail!(
                "{}: no model.safetensors or model.safetensors.index.json",
                dir.display()
            );
        };
        let config = dir.join("config.json");
        let fp8 = match std::fs::read_to_string(&config) {
            Ok(text) => {
                let v: serde_json::Value = serde_json::from_str(&text)
                    .with_context(|| format!("{} is not valid JSON", config.display()))?;
                fp8_checkpoint::format_of(&v).with_context(|| format!("{}", config.display()))?
            }
            Err(_) => None,
        };
        let mut shards = vec![];
        let mut entries = HashMap::new();
        for (i, name) in files.iter().enumerate() {
            let p = dir.join(name);
            let file =
                std::fs::File::open(&p).with_context(|| format!("cannot open {}", p.display()))?;
            // SAFETY: read-only map of a model file that is not modified while ingot runs.
            let mmap = unsafe { Mmap::map(&file) }?;
            let (header_len, meta) = safetensors::SafeTensors::read_metadata(&mmap)
                .map_err(|e| anyhow::anyhow!("{}: invalid safetensors header: {e}", p.display()))?;
            for (tname, info) in meta.tensors() {
                let stored = match info.dtype {
                    safetensors::Dtype::F32 => Stored::Plain(DType::F32),
                    safetensors::Dtype::F16 => Stored::Plain(DType::F16),
                    safetensors::Dtype::BF16 => Stored::Plain(DType::BF16),
                    safetensors::Dtype::F8_E4M3 => Stored::E4m3,
                    other => {
                        // Only weights ingot reads need a supported type; others are skipped.
                        tracing::debug!("{tname}: dtype {other:?} skipped");
                        continue;
                    }
                };
                entries.insert(
                    tname,
                    SafetensorsEntry {
                        shard: i,
                        stored,
                        shape: info.shape.clone(),
                        range: info.data_offsets,
                    },
                );
            }
            shards.push(Shard {
                mmap,
                header_len: 8 + header_len,
            });
        }
        Ok(Checkpoint::Safetensors {
            dir: dir.to_path_buf(),
            shards,
            entries,
            fp8,
        })
    }

    /// Random weights, seeded and reproducible, at the shapes of `dir/config.json` and in
    /// its `torch_dtype` (bf16 when it names none): for benchmarks without downloads.
    pub fn dummy(dir: &Path) -> Result<Checkpoint> {
        let p = dir.join("config.json");
        let text =
            std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
        let config = ModelConfig::from_hf_json(&text)?;
        let v: serde_json::Value = serde_json::from_str(&text)?;
        let dtype = match v
            .get("torch_dtype")
            .or_else(|| v.get("dtype"))
            .and_then(|d| d.as_str())
        {
            None | Some("bfloat16") => DType::BF16,
            Some("float16") => DType::F16,
            Some("float32") => DType::F32,
            Some(other) => bail!("{}: torch_dtype `{other}` is not supported", p.display()),
        };
        Ok(Checkpoint::Dummy {
            dir: dir.to_path_buf(),
            config,
            dtype,
        })
    }

    pub fn path(&self) -> &Path {
        match self {
            Checkpoint::Safetensors { dir, .. } | Checkpoint::Dummy { dir, .. } => dir,
            Checkpoint::Gguf { path, .. } => path,
        }
    }

    pub fn config(&self) -> Result<ModelConfig> {
        match self {
            Checkpoint::Safetensors { dir, .. } => {
                let p = dir.join("config.json");
                let text = std::fs::read_to_string(&p)
                    .with_context(|| format!("cannot read {}", p.display()))?;
                ModelConfig::from_hf_json(&text)
            }
            Checkpoint::Gguf { file, .. } => gguf_config(file),
            Checkpoint::Dummy { config, .. } => Ok(config.clone()),
        }
    }

    /// The weight with `role` in `layer`, or `None` when the checkpoint has none.
    pub fn tensor(
        &self,
        role: Role,
        layer: usize,
        cfg: &ModelConfig,
    ) -> Result<Option<HostTensor<'_>>> {
        match self {
            Checkpoint::Safetensors {
                shards,
                entries,
                fp8,
                ..
            } => {
                let name = role.hf_name(layer, cfg.arch);
                let Some(e) = entries.get(&name) else {
                    return Ok(None);
                };
                let data = entry_bytes(shards, e, &name)?;
                let dtype = match e.stored {
                    Stored::Plain(dtype) => dtype,
                    Stored::E4m3 => {
                        let format = fp8.unwrap_or_default();
                        let blocks = e4m3_blocks(shards, entries, &name, e, data, format)?;
                        return Ok(Some(HostTensor {
                            dtype: DType::Fp8,
                            shape: e.shape.clone(),
                            data: Cow::Owned(blocks),
                            mapped: data,
                        }));
                    }
                };
                let t = HostTensor {
                    dtype,
                    shape: e.shape.clone(),
                    data: Cow::Borrowed(data),
                    mapped: data,
                };
                ensure!(
                    t.dtype.bytes_for(t.numel()) == data.len(),
                    "{name}: {} bytes for shape {:?}",
                    data.len(),
                    t.shape
                );
                Ok(Some(t))
            }
            Checkpoint::Gguf { file, .. } => {
                let name = role.gguf_name(layer);
                let Some(info) = file.tensors.get(&name) else {
                    return Ok(None);
                };
                let mut shape: Vec<usize> = info.dims.iter().rev().copied().collect();
                let mut data = file.data(info);
                if let Some(e) = role.expert() {
                    ensure!(
                        shape.len() == 3 && e < shape[0],
                        "{name}: expected [experts, rows, cols] with expert {e}, found {shape:?}"
                    );
                    let bytes = info.dtype.bytes_for(shape[1] * shape[2]);
                    data = data
                        .get(e * bytes..(e + 1) * bytes)
                        .with_context(|| format!("{name}: expert {e} out of range"))?;
                    shape.remove(0);
                }
                let mut t = HostTensor {
                    dtype: info.dtype,
                    shape,
                    data: Cow::Borrowed(data),
                    mapped: data,
                };
                // llama.cpp's converter interleaves the rotary halves of each Llama q/k head
                // for its GPT-J style RoPE; undo it to run NeoX-style RoPE like HF.
                let heads = match role {
                    Role::Q | Role::QBias => Some(cfg.num_heads),
                    Role::K | Role::KBias => Some(cfg.num_kv_heads),
                    _ => None,
                };
                if let (Some(heads), "llama") = (heads, gguf_arch(file)?) {
                    t.data = Cow::Owned(unpermute_rows(&t, heads)?);
                }
                Ok(Some(t))
            }
            Checkpoint::Dummy { dtype, .. } => {
                Ok(crate::dummy::tensor(role, layer, cfg, *dtype, &Cut::Whole))
            }
        }
    }

    /// Part `cut` of [`Checkpoint::tensor`]: dummy weights make only that part.
    pub fn tensor_part(
        &self,
        role: Role,
        layer: usize,
        cfg: &ModelConfig,
        cut: &Cut,
    ) -> Result<Option<HostTensor<'_>>> {
        if let Checkpoint::Dummy { dtype, .. } = self {
            return Ok(crate::dummy::tensor(role, layer, cfg, *dtype, cut));
        }
        self.tensor(role, layer, cfg)?
            .map(|t| cut.apply(t))
            .transpose()
    }

    /// Drops the file pages of a tensor that has been copied to the backend from this
    /// process's resident memory. Otherwise every weight would be resident twice by the end
    /// of loading (the mapping and the backend's copy), doubling the peak RSS of a CPU run.
    /// The mapping stays valid: a later read of those bytes faults them back in from the
    /// page cache.
    pub fn release(&self, t: &HostTensor<'_>) {
        let maps: Vec<&Mmap> = match self {
            Checkpoint::Safetensors { shards, .. } => shards.iter().map(|s| &s.mmap).collect(),
            Checkpoint::Gguf { file, .. } => vec![file.mmap()],
            Checkpoint::Dummy { .. } => return,
        };
        let (at, len) = (t.mapped.as_ptr() as usize, t.mapped.len());
        for m in maps {
            let base = m.as_ptr() as usize;
            if len > 0 && at >= base && at + len <= base + m.len() {
                // SAFETY: the mapping is a read-only view of a file: after DONTNEED, a read
                // sees the same bytes again (from the file), so no live reference changes.
                // Failure only leaves the pages resident.
                let _ = unsafe {
                    m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, at - base, len)
                };
                return;
            }
        }
    }

    /// Tensor names present in the checkpoint.
    pub fn tensor_count(&self) -> usize {
        match self {
            Checkpoint::Safetensors { entries, .. } => entries.len(),
            Checkpoint::Gguf { file, .. } => file.tensors.len(),
            Checkpoint::Dummy { config, .. } => crate::dummy::tensor_count(config),
        }
    }
}

fn gguf_arch(file: &GgufFile) -> Result<&str> {
    file.get("general.architecture")
        .and_then(Value::as_str)
        .context("GGUF has no general.architecture")
}

/// Rows `h*hd + 2i + j` (GGUF order) go back to `h*hd + j*hd/2 + i` (HF order).
fn unpermute_rows(t: &HostTensor<'_>, heads: usize) -> Result<Vec<u8>> {
    let rows = t.shape[0];
    let row_bytes = t.data.len() / rows;
    ensure!(
        rows.is_multiple_of(heads) && (rows / heads).is_multiple_of(2),
        "cannot split {rows} rows into {heads} rotary heads"
    );
    let hd = rows / heads;
    let mut out = vec![0u8; t.data.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let src = h * hd + 2 * i + j;
                let dst = h * hd + j * (hd / 2) + i;
                out[dst * row_bytes..(dst + 1) * row_bytes]
                    .copy_from_slice(&t.data[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    Ok(out)
}

/// The mixture of experts of a GGUF's Qwen3-MoE or Mixtral: counts from the metadata (the
/// expert width is `expert_feed_forward_length`, or Mixtral's `feed_forward_length`), the
/// sparse layers those with a router (`ffn_gate_inp`). llama.cpp renormalizes the chosen
/// experts' weights for both unless `expert_weights_norm` says otherwise. `validate` checks
/// the counts.
fn gguf_moe(
    file: &GgufFile,
    arch: Arch,
    arch_name: &str,
    num: &dyn Fn(&str) -> Result<usize>,
) -> Result<Option<MoeConfig>> {
    let width = match arch {
        Arch::Qwen3Moe => num("expert_feed_forward_length")?,
        Arch::Mixtral => num("feed_forward_length")?,
        _ => {
            ensure!(
                !file.tensors.contains_key("blk.0.ffn_gate_inp.weight"),
                "this GGUF has a mixture of experts (ffn_gate_inp) in an architecture ingot runs \
                 dense; mixtures run as qwen3moe or llama (Mixtral)"
            );
            return Ok(None);
        }
    };
    let layers = num("block_count")?;
    Ok(Some(MoeConfig {
        num_experts: num("expert_count")?,
        experts_per_token: num("expert_used_count")?,
        expert_intermediate_size: width,
        renormalize: file
            .get(&format!("{arch_name}.expert_weights_norm"))
            .and_then(Value::as_bool)
            .unwrap_or(true),
        dense_layers: (0..layers)
            .filter(|l| {
                !file
                    .tensors
                    .contains_key(&format!("blk.{l}.ffn_gate_inp.weight"))
            })
            .collect(),
    }))
}

fn gguf_config(file: &GgufFile) -> Result<ModelConfig> {
    let arch_name = gguf_arch(file)?;
    let key = |k: &str| format!("{arch_name}.{k}");
    let num = |k: &str| -> Result<usize> {
        file.get(&key(k))
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .with_context(|| format!("GGUF metadata lacks `{}`", key(k)))
    };
    // llama.cpp names Qwen3-MoE `qwen3moe` and writes Mixtral as a `llama` with experts.
    let arch = match arch_name {
        "qwen3moe" => Arch::Qwen3Moe,
        "llama" if num("expert_count").is_ok_and(|n| n > 0) => Arch::Mixtral,
        other => Arch::from_name(other)?,
    };
    let float = |k: &str| file.get(&key(k)).and_then(Value::as_f32);
    let hidden_size = num("embedding_length")?;
    let num_heads = num("attention.head_count")?;
    let num_kv_heads = num("attention.head_count_kv").unwrap_or(num_heads);
    let head_dim = num("attention.key_length").unwrap_or(hidden_size / num_heads);
    let vocab_size = match num("vocab_size") {
        Ok(v) => v,
        Err(_) => file
            .get("tokenizer.ggml.tokens")
            .and_then(Value::as_array)
            .map(<[Value]>::len)
            .context("GGUF has no vocabulary size")?,
    };
    let rope_scaling = if let Some(t) = file.tensors.get("rope_freqs.weight") {
        ensure!(t.dtype == DType::F32, "rope_freqs.weight must be f32");
        let b = file.data(t);
        RopeScaling::FreqFactors(
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        )
    } else {
        match file.get(&key("rope.scaling.type")).and_then(Value::as_str) {
            None | Some("none") => RopeScaling::None,
            Some("linear") => RopeScaling::Linear { factor: float("rope.scaling.factor").context("linear rope scaling needs a factor")? },
            Some(other) => bail!("GGUF rope scaling `{other}` is not supported (supported: linear, llama3 frequency factors)"),
        }
    };
    let cfg = ModelConfig {
        arch,
        vocab_size,
        hidden_size,
        intermediate_size: num("feed_forward_length")?,
        num_layers: num("block_count")?,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps: float("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
        rope_theta: float("rope.freq_base").unwrap_or(10000.0),
        rope_scaling,
        max_position_embeddings: num("context_length")?,
        tie_word_embeddings: !file.tensors.contains_key("output.weight"),
        qkv_bias: file.tensors.contains_key("blk.0.attn_q.bias"),
        qk_norm: file.tensors.contains_key("blk.0.attn_q_norm.weight"),
        moe: gguf_moe(file, arch, arch_name, &num)?,
    };
    if let Some(dims) = file
        .get(&key("rope.dimension_count"))
        .and_then(Value::as_u64)
    {
        ensure!(
            dims as usize == head_dim,
            "partial rotary embeddings ({dims} of {head_dim} dims) are not supported"
        );
    }
    cfg.validate()?;
    Ok(cfg)
}
