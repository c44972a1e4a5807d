//! Mixtures of experts from GGUF files as llama.cpp writes them: the synthetic Qwen3-MoE
//! (`qwen3moe`) and Mixtral (a `llama` with experts, q/k rows permuted for llama.cpp's
//! RoPE) converted to GGUF, each layer's experts stacked in `ffn_{gate,up,down}_exps`, give
//! the logits of their safetensors directories bit for bit; experts kept as GGUF blocks load
//! as blocks on the CPU; a file marked as having no vocabulary (llama.cpp's random
//! benchmark files) loads with ids alone.

use ingot_backend::cpu::CpuBackend;
use ingot_backend::DType;
use ingot_model::reference::ReferenceModel;
use ingot_model::synthetic::SyntheticSpec;
use ingot_model::weights::Mlp;
use ingot_model::{Arch, Checkpoint, Tokenizer, WeightDType};
use rand::SeedableRng;
use safetensors::SafeTensors;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A metadata value of the GGUF being written.
enum Meta {
    U32(u32),
    F32(f32),
    Str(&'static str),
}

/// A tensor of the GGUF being written: GGUF dims (innermost first), type id, bytes.
struct Tensor {
    dims: Vec<u64>,
    ty: u32,
    data: Vec<u8>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A GGUF v3 file of `meta` and `tensors`, data aligned to 32 bytes.
fn gguf_bytes(meta: &[(String, Meta)], tensors: &BTreeMap<String, Tensor>) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((meta.len() as u64).to_le_bytes());
    for (key, value) in meta {
        put_str(&mut out, key);
        match value {
            Meta::U32(v) => {
                out.extend(4u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::F32(v) => {
                out.extend(6u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::Str(v) => {
                out.extend(8u32.to_le_bytes());
                put_str(&mut out, v);
            }
        }
    }
    let mut offset = 0u64;
    for (name, t) in tensors {
        put_str(&mut out, name);
        out.extend((t.dims.len() as u32).to_le_bytes());
        t.dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
        out.extend(t.ty.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offset += (t.data.len() as u64).next_multiple_of(32);
    }
    out.resize(out.len().next_multiple_of(32), 0);
    for t in tensors.values() {
        out.extend(&t.data);
        out.resize(out.len().next_multiple_of(32), 0);
    }
    out
}

/// llama.cpp's row order for a q/k projection of `heads` heads: within each head, row
/// 2i + j holds HF row j * head_dim / 2 + i (its GPT-J style RoPE pairs).
fn permute_rows(data: &[u8], rows: usize, heads: usize) -> Vec<u8> {
    let (row, hd) = (data.len() / rows, rows / heads);
    let mut out = vec![0u8; data.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let (dst, src) = (h * hd + 2 * i + j, h * hd + j * (hd / 2) + i);
                out[dst * row..][..row].copy_from_slice(&data[src * row..][..row]);
            }
        }
    }
    out
}

/// The GGUF name of an HF tensor and, for an expert's matrix, its projection and expert.
fn gguf_name(hf: &str) -> (String, Option<usize>) {
    let Some(rest) = hf.strip_prefix("model.layers.") else {
        let name = match hf {
            "model.embed_tokens.weight" => "token_embd.weight",
            "model.norm.weight" => "output_norm.weight",
            "lm_head.weight" => "output.weight",
            other => panic!("unexpected tensor {other}"),
        };
        return (name.into(), None);
    };
    let (layer, what) = rest.split_once('.').unwrap();
    let expert = what
        .strip_prefix("mlp.experts.")
        .or_else(|| what.strip_prefix("block_sparse_moe.experts."))
        .and_then(|s| s.split_once('.'));
    if let Some((e, proj)) = expert {
        let e: usize = e.parse().unwrap();
        let stack = match proj {
            "gate_proj.weight" | "w1.weight" => "ffn_gate_exps",
            "up_proj.weight" | "w3.weight" => "ffn_up_exps",
            "down_proj.weight" | "w2.weight" => "ffn_down_exps",
            other => panic!("unexpected expert tensor {other}"),
        };
        return (format!("blk.{layer}.{stack}.weight"), Some(e));
    }
    let name = match what {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "mlp.gate.weight" | "block_sparse_moe.gate.weight" => "ffn_gate_inp.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        other => panic!("unexpected layer tensor {other}"),
    };
    (format!("blk.{layer}.{name}"), None)
}

/// Converts the f32 safetensors model `spec` wrote in `dir` to `out` as llama.cpp lays out
/// a GGUF; with `blocks`, each expert stack becomes random Q8_0 blocks of its shape.
fn write_gguf(spec: &SyntheticSpec, dir: &Path, out: &Path, blocks: bool) {
    write_gguf_with(spec, dir, out, blocks, &[]);
}

/// [`write_gguf`] with `extra` metadata.
fn write_gguf_with(
    spec: &SyntheticSpec,
    dir: &Path,
    out: &Path,
    blocks: bool,
    extra: &[(&str, &'static str)],
) {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (experts, per_token, width) = spec.experts.unwrap();
    let llama = spec.arch == Arch::Mixtral;
    let mut tensors: BTreeMap<String, Tensor> = BTreeMap::new();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    // Experts in index order, so each stack is expert 0, 1, ...
    names.sort_by_key(|n| (gguf_name(n).0, gguf_name(n).1));
    for hf in names {
        let t = st.tensor(&hf).unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::F32);
        let shape = t.shape().to_vec();
        let (name, expert) = gguf_name(&hf);
        let mut data = t.data().to_vec();
        if llama && (name.ends_with("attn_q.weight") || name.ends_with("attn_k.weight")) {
            let heads = if name.ends_with("attn_q.weight") {
                spec.num_heads
            } else {
                spec.num_kv_heads
            };
            data = permute_rows(&data, shape[0], heads);
        }
        let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        match expert {
            Some(_) => {
                let stack = tensors.entry(name).or_insert(Tensor {
                    dims: [dims.clone(), vec![experts as u64]].concat(),
                    ty: 0,
                    data: vec![],
                });
                stack.data.extend(data);
            }
            None => {
                tensors.insert(name, Tensor { dims, ty: 0, data });
            }
        }
    }
    if blocks {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for (name, t) in tensors.iter_mut().filter(|(n, _)| n.contains("_exps")) {
            let numel: u64 = t.dims.iter().product();
            t.data = ingot_backend::quant::testing::random_quant_row(
                DType::Q8_0,
                numel as usize,
                &mut rng,
            );
            t.ty = 8;
            assert!(t.dims[0] % 32 == 0, "{name}: rows of whole Q8_0 blocks");
        }
    }
    // Mixtral's experts are its MLP: `feed_forward_length` is their width.
    let (arch, ffn) = if llama {
        ("llama", width)
    } else {
        ("qwen3moe", spec.intermediate_size)
    };
    let key = |k: &str| format!("{arch}.{k}");
    let mut meta = vec![
        ("general.architecture".to_string(), Meta::Str(arch)),
        (key("vocab_size"), Meta::U32(spec.vocab_size as u32)),
        (key("embedding_length"), Meta::U32(spec.hidden_size as u32)),
        (key("feed_forward_length"), Meta::U32(ffn as u32)),
        (key("block_count"), Meta::U32(spec.num_layers as u32)),
        (
            key("attention.head_count"),
            Meta::U32(spec.num_heads as u32),
        ),
        (
            key("attention.head_count_kv"),
            Meta::U32(spec.num_kv_heads as u32),
        ),
        (key("attention.key_length"), Meta::U32(spec.head_dim as u32)),
        (key("attention.layer_norm_rms_epsilon"), Meta::F32(1e-6)),
        (key("rope.freq_base"), Meta::F32(10000.0)),
        (key("context_length"), Meta::U32(512)),
        (key("expert_count"), Meta::U32(experts as u32)),
        (key("expert_used_count"), Meta::U32(per_token as u32)),
    ];
    if !llama {
        meta.push((key("expert_feed_forward_length"), Meta::U32(width as u32)));
    }
    meta.extend(extra.iter().map(|&(k, v)| (k.to_string(), Meta::Str(v))));
    std::fs::write(out, gguf_bytes(&meta, &tensors)).unwrap();
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("ingot-moe-gguf-{name}-{}", std::process::id()))
}

fn gguf_equals_safetensors(arch: Arch) {
    let spec = SyntheticSpec::tiny(arch);
    let dir = temp(&format!("{arch:?}"));
    spec.write(&dir).unwrap();
    let file = dir.join("model.gguf");
    write_gguf(&spec, &dir, &file, false);
    let st = Checkpoint::open(&dir).unwrap();
    let gguf = Checkpoint::open(&file).unwrap();
    let (want, got) = (st.config().unwrap(), gguf.config().unwrap());
    assert_eq!(got.arch, arch);
    assert_eq!(format!("{:?}", got.moe), format!("{:?}", want.moe));
    let (st, gguf) = (
        ReferenceModel::load(&st).unwrap(),
        ReferenceModel::load(&gguf).unwrap(),
    );
    let tokens: Vec<u32> = (0..23)
        .map(|i| (i * 37 + 5) % spec.vocab_size as u32)
        .collect();
    let (want, got) = (st.forward(&tokens), gguf.forward(&tokens));
    assert!(
        want.iter()
            .zip(&got)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{arch:?}: the GGUF's logits differ from the safetensors directory's"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn qwen3moe_gguf_equals_its_safetensors_directory() {
    gguf_equals_safetensors(Arch::Qwen3Moe);
}

#[test]
fn mixtral_gguf_equals_its_safetensors_directory() {
    gguf_equals_safetensors(Arch::Mixtral);
}

#[test]
fn quantized_experts_stay_blocks_on_the_cpu() {
    let spec = SyntheticSpec::tiny(Arch::Qwen3Moe);
    let dir = temp("q8");
    spec.write(&dir).unwrap();
    let file = dir.join("model.gguf");
    write_gguf(&spec, &dir, &file, true);
    let b = CpuBackend::new(Some(1)).unwrap();
    let model =
        ingot_model::load_model(&b, &Checkpoint::open(&file).unwrap(), WeightDType::Auto).unwrap();
    let Mlp::Experts(moe) = &model.weights.layers[0].mlp else {
        panic!("layer 0 is sparse");
    };
    assert_eq!(
        (moe.gate_up.dtype(), moe.down.dtype()),
        (DType::Q8_0, DType::Q8_0)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// llama.cpp writes `tokenizer.ggml.model = "none"` into files without a vocabulary (its
/// random benchmark files): ingot loads them with a tokenizer of the model's vocabulary
/// size, as it does dummy weights, so one file serves both engines' benchmarks; a file with
/// no tokenizer metadata at all is still an error.
#[test]
fn a_gguf_without_a_vocabulary_loads_with_ids_alone() {
    let spec = SyntheticSpec::tiny(Arch::Qwen3Moe);
    let dir = temp("none");
    spec.write(&dir).unwrap();
    let (none, missing) = (dir.join("none.gguf"), dir.join("missing.gguf"));
    write_gguf_with(
        &spec,
        &dir,
        &none,
        false,
        &[("tokenizer.ggml.model", "none")],
    );
    write_gguf(&spec, &dir, &missing, false);
    let tok = Tokenizer::from_checkpoint(&Checkpoint::open(&none).unwrap()).unwrap();
    assert_eq!(tok.vocab_size(), spec.vocab_size);
    let ids = [3, 7, spec.vocab_size as u32 - 1];
    let text = tok.decode(&ids, false).unwrap();
    assert_eq!(tok.encode(&text, false).unwrap(), ids);
    let err = Tokenizer::from_checkpoint(&Checkpoint::open(&missing).unwrap())
        .err()
        .expect("no tokenizer metadata");
    assert!(
        format!("{err:#}").contains("tokenizer.ggml.model"),
        "{err:#}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
