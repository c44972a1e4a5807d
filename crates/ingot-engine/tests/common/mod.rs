//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

use ingot_backend::cpu::CpuBackend;
use ingot_backend::Backend;
use ingot_engine::{ModelRunner, RunnerConfig, StepInput};
use ingot_model::testing::fixtures_dir;
use ingot_model::WeightDType;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use std::path::Path;

pub fn runner(
    path: &Path,
    dtype: WeightDType,
    budget: usize,
    max_seqs: usize,
    max_len: usize,
    num_blocks: usize,
) -> ModelRunner<CpuBackend> {
    runner_on(
        CpuBackend::new(None).unwrap(),
        path,
        dtype,
        budget,
        max_seqs,
        max_len,
        num_blocks,
    )
}

/// The CPU computing the model `device` computes: with norm weights folded where the
/// device folds them ([`Backend::folds_norm_weights`]).
pub fn cpu_reference_of<B: Backend>(device: &B) -> CpuBackend {
    CpuBackend::new(None)
        .unwrap()
        .folding_norm_weights(device.folds_norm_weights())
}

/// A runner on `backend` with the KV cache in the model's activation dtype.
pub fn runner_on<B: Backend>(
    backend: B,
    path: &Path,
    dtype: WeightDType,
    budget: usize,
    max_seqs: usize,
    max_len: usize,
    num_blocks: usize,
) -> ModelRunner<B> {
    runner_with_cache(
        backend, path, dtype, None, budget, max_seqs, max_len, num_blocks,
    )
}

/// A runner on `backend` with the KV cache in `kv` (None: the model's activation dtype).
#[allow(clippy::too_many_arguments)]
pub fn runner_with_cache<B: Backend>(
    backend: B,
    path: &Path,
    dtype: WeightDType,
    kv: Option<ingot_backend::DType>,
    budget: usize,
    max_seqs: usize,
    max_len: usize,
    num_blocks: usize,
) -> ModelRunner<B> {
    let (model, _) = ingot_model::load(&backend, path, dtype).unwrap();
    let cfg = RunnerConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: max_seqs,
        max_model_len: max_len,
        block_size: 16,
        num_blocks,
        kv_cache_dtype: kv.unwrap_or(model.weights.activation_dtype),
        enforce_eager: false,
        head: ingot_model::Head::Logits,
    };
    ModelRunner::new(backend, model, cfg).unwrap()
}

/// Sequences of random token ids below `vocab`, of the given lengths, from `seed`.
pub fn random_seqs(seed: u64, lens: &[usize], vocab: usize) -> Vec<Vec<u32>> {
    let mut rng = StdRng::seed_from_u64(seed);
    lens.iter()
        .map(|&n| (0..n).map(|_| rng.random_range(0..vocab as u32)).collect())
        .collect()
}

/// Largest |a - b| relative to the largest |b|.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let mag = b.iter().map(|y| y.abs()).fold(0f32, f32::max);
    diff / mag.max(1e-6)
}

/// One sequence's logits at a position, as returned by a step.
pub struct Observed {
    pub seq: usize,
    pub pos: usize,
    pub logits: Vec<f32>,
}

/// Runs `seqs` through both runners with `run_mixed` and returns how many logit rows they
/// produced (the same rows, checked) and the largest relative error of `got`'s against
/// `want`'s.
pub fn mixed_logit_error<A: Backend, B: Backend>(
    want: &mut ModelRunner<A>,
    got: &mut ModelRunner<B>,
    seqs: &[Vec<u32>],
) -> (usize, f32) {
    let want = run_mixed(want, seqs, 11);
    let got = run_mixed(got, seqs, 11);
    assert_eq!(got.len(), want.len());
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| {
            assert_eq!((g.seq, g.pos), (w.seq, w.pos));
            rel_err(&g.logits, &w.logits)
        })
        .fold(0f32, f32::max);
    (got.len(), worst)
}

/// Feeds every sequence's tokens through the runner in steps that mix prefill chunks of
/// random length (cut at arbitrary points) with single-token steps, several sequences per
/// step, with physical blocks handed out in shuffled order. Returns the logits of the last
/// token of each sequence's slice in each step.
pub fn run_mixed<B: Backend>(
    runner: &mut ModelRunner<B>,
    seqs: &[Vec<u32>],
    seed: u64,
) -> Vec<Observed> {
    let mut rng = StdRng::seed_from_u64(seed);
    let c = runner.config;
    let bs = c.block_size;
    let mut physical: Vec<u32> = (0..c.num_blocks as u32).collect();
    physical.shuffle(&mut rng);
    let mut tables: Vec<Vec<u32>> = vec![];
    for s in seqs {
        let n = s.len().div_ceil(bs);
        assert!(physical.len() >= n, "test KV cache too small");
        tables.push(physical.split_off(physical.len() - n));
    }
    let mut done = vec![0usize; seqs.len()];
    let mut observed = vec![];
    while done.iter().zip(seqs).any(|(d, s)| d < &s.len()) {
        let mut input = StepInput::default();
        let mut order: Vec<usize> = (0..seqs.len())
            .filter(|&i| done[i] < seqs[i].len())
            .collect();
        order.shuffle(&mut rng);
        order.truncate(c.max_num_seqs);
        let width = order.iter().map(|&i| tables[i].len()).max().unwrap();
        input.query_start_loc.push(0);
        let mut members = vec![];
        for &i in &order {
            let room = c.max_num_batched_tokens - input.token_ids.len();
            if room == 0 {
                break;
            }
            let left = seqs[i].len() - done[i];
            // Half the time a decode-sized step, otherwise a chunk of random length.
            let n = if rng.random_bool(0.5) {
                1
            } else {
                rng.random_range(1..=left)
            }
            .min(left)
            .min(room);
            for p in done[i]..done[i] + n {
                input.token_ids.push(seqs[i][p]);
                input.positions.push(p as u32);
                input
                    .slot_mapping
                    .push(tables[i][p / bs] * bs as u32 + (p % bs) as u32);
            }
            done[i] += n;
            input.query_start_loc.push(input.token_ids.len() as u32);
            input.seq_lens.push(done[i] as u32);
            let mut t = tables[i].clone();
            t.resize(width, 0);
            input.block_tables.extend(t);
            input.logits_indices.push(input.token_ids.len() as u32 - 1);
            members.push((i, done[i] - 1));
        }
        input.max_blocks_per_seq = width;
        let logits = runner.execute(&input).unwrap();
        let v = runner.vocab_size();
        for (k, (seq, pos)) in members.into_iter().enumerate() {
            observed.push(Observed {
                seq,
                pos,
                logits: logits[k * v..(k + 1) * v].to_vec(),
            });
        }
    }
    observed
}

/// Greedy generation of one sequence straight through the runner, keeping every step's
/// logits: the exact-logit comparisons with transformers need them.
pub fn greedy_with_logits<B: Backend>(
    runner: &mut ModelRunner<B>,
    prompt: &[u32],
    steps: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let c = runner.config;
    let bs = c.block_size;
    let table: Vec<u32> = (0..(prompt.len() + steps).div_ceil(bs) as u32).collect();
    let mut run = |tokens: &[u32], start: usize| {
        let n = tokens.len();
        let positions: Vec<u32> = (start as u32..(start + n) as u32).collect();
        let input = StepInput {
            token_ids: tokens.to_vec(),
            slot_mapping: positions
                .iter()
                .map(|&p| table[p as usize / bs] * bs as u32 + p % bs as u32)
                .collect(),
            positions,
            query_start_loc: vec![0, n as u32],
            seq_lens: vec![(start + n) as u32],
            block_tables: table.clone(),
            max_blocks_per_seq: table.len(),
            logits_indices: vec![n as u32 - 1],
        };
        runner.execute(&input).unwrap()
    };
    let mut logits = vec![];
    for (i, chunk) in prompt.chunks(c.max_num_batched_tokens).enumerate() {
        logits = run(chunk, i * c.max_num_batched_tokens);
    }
    let (mut tokens, mut all) = (vec![], vec![]);
    for step in 0..steps {
        let next = ingot_engine::sampler::argmax(&logits);
        tokens.push(next);
        all.push(std::mem::take(&mut logits));
        if step + 1 < steps {
            logits = run(&[next], prompt.len() + step);
        }
    }
    (tokens, all)
}

/// One transformers fixture: a prompt, its greedy continuation and top-5 logits per step.
pub struct Case {
    pub name: String,
    pub prompt: Vec<u32>,
    pub greedy: Vec<u32>,
    pub top5: Vec<Vec<(u32, f32)>>,
}

pub fn cases() -> Vec<Case> {
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures_dir().join("logits.json")).unwrap())
            .unwrap();
    let ids = |v: &Value| {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect::<Vec<_>>()
    };
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap().into(),
            prompt: ids(&c["prompt_ids"]),
            greedy: ids(&c["greedy_ids"]),
            top5: c["top5"]
                .as_array()
                .unwrap()
                .iter()
                .map(|step| {
                    step.as_array()
                        .unwrap()
                        .iter()
                        .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
                        .collect()
                })
                .collect(),
        })
        .collect()
}

/// Per fixture, the greedy steps equal to transformers' before the first divergence
/// (printed after `label`), and the first token wherever transformers' top-2 gap is clear
/// (asserted); returns how many fixtures had one. For runs whose rounding differs from
/// transformers' f32 (16-bit weights, f16 activations), where near-ties may swap.
pub fn greedy_tracks_transformers<B: Backend>(
    r: &mut ModelRunner<B>,
    cases: &[Case],
    label: &str,
) -> usize {
    let mut checked = 0;
    for c in cases {
        let (tokens, _) = greedy_with_logits(r, &c.prompt, 32);
        let matched = tokens
            .iter()
            .zip(&c.greedy)
            .take_while(|(a, b)| a == b)
            .count();
        println!(
            "{label} {:>12}: {matched:>2}/32 steps equal before divergence",
            c.name
        );
        if c.top5[0][0].1 - c.top5[0][1].1 > 0.5 {
            assert_eq!(tokens[0], c.greedy[0], "{}: first token", c.name);
            checked += 1;
        }
    }
    checked
}

/// Ids of the `k` largest logits, largest first.
pub fn top_ids(logits: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    idx.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    idx.truncate(k);
    idx
}

/// Every synthetic architecture in each `(stored, dtype, tolerance)` case, on a backend
/// `device()` opens, against the CPU: mixed prefill/decode steps, logits within the
/// case's relative tolerance.
pub fn synthetic_models_match_the_cpu<B: Backend>(
    device: impl Fn() -> B,
    cases: &[(ingot_model::synthetic::Dtype, WeightDType, f32)],
) {
    use ingot_model::synthetic::SyntheticSpec;
    use ingot_model::Arch;
    for arch in [
        Arch::Llama,
        Arch::Mistral,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Qwen3Moe,
        Arch::Mixtral,
    ] {
        for &(stored, dtype, tol) in cases {
            let spec = SyntheticSpec {
                dtype: stored,
                ..SyntheticSpec::tiny(arch)
            };
            let dir = std::env::temp_dir().join(format!(
                "ingot-device-{arch:?}-{stored:?}-{}",
                std::process::id()
            ));
            spec.write(&dir).unwrap();
            let seqs = random_seqs(3, &[1, 15, 16, 17, 40, 33, 150], spec.vocab_size);
            let device = device();
            let reference = cpu_reference_of(&device);
            let mut cpu = runner_on(reference, &dir, dtype, 24, 4, 512, 64);
            let mut gpu = runner_on(device, &dir, dtype, 24, 4, 512, 64);
            // 16-bit activations reaching the router flip near-tied choices among the tiny
            // models' experts against the f32 CPU, which moves logits far past rounding
            // (7.7e-2 for Qwen3-MoE in bf16 on an H200, when the router's logits were also
            // rounded; they are f32 now): mixtures of experts are compared in f32.
            let activations = gpu.model.weights.activation_dtype;
            if gpu.model.config.moe.is_some() && activations != ingot_backend::DType::F32 {
                println!("{arch:?} {stored:?}: skipped ({activations} activations)");
                std::fs::remove_dir_all(&dir).ok();
                continue;
            }
            let (rows, worst) = mixed_logit_error(&mut cpu, &mut gpu, &seqs);
            println!("{arch:?} {stored:?}: {rows} logit rows, max relative error {worst:.2e}");
            assert!(
                worst <= tol,
                "{arch:?} {stored:?}: relative logit error {worst}"
            );
            std::fs::remove_dir_all(&dir).ok();
        }
    }
}

/// A tiny synthetic model whose matrices are whole FP8 blocks (128 values): hidden 128,
/// MLP 256, four heads of 32.
pub fn fp8_spec(arch: ingot_model::Arch) -> ingot_model::synthetic::SyntheticSpec {
    ingot_model::synthetic::SyntheticSpec {
        hidden_size: 128,
        intermediate_size: 256,
        ..ingot_model::synthetic::SyntheticSpec::tiny(arch)
    }
}

/// `--quantization fp8` on `device` against the same quantized model on the CPU (f32
/// activations): mixed prefill/decode steps, logits within `tol`.
pub fn fp8_models_match_the_cpu<B: Backend>(device: impl Fn() -> B, tol: f32) {
    use ingot_model::Arch;
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
        let spec = fp8_spec(arch);
        let dir =
            std::env::temp_dir().join(format!("ingot-device-fp8-{arch:?}-{}", std::process::id()));
        spec.write(&dir).unwrap();
        let seqs = random_seqs(3, &[1, 15, 16, 17, 40, 33, 150], spec.vocab_size);
        let device = device();
        let mut cpu = runner_on(
            cpu_reference_of(&device),
            &dir,
            WeightDType::Fp8,
            24,
            4,
            512,
            64,
        );
        let mut gpu = runner_on(device, &dir, WeightDType::Fp8, 24, 4, 512, 64);
        assert_eq!(gpu.model.weights.matrix_dtype, ingot_backend::DType::Fp8);
        let (rows, worst) = mixed_logit_error(&mut cpu, &mut gpu, &seqs);
        println!("{arch:?} fp8: {rows} logit rows, max relative error {worst:.2e}");
        assert!(worst <= tol, "{arch:?} fp8: relative logit error {worst}");
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// Engines of the real test model at f32 on the CPU reference of `backend` and on
/// `backend` itself, with the same configuration.
fn f32_engines<B: Backend + 'static>(
    backend: B,
) -> (ingot_engine::Engine<CpuBackend>, ingot_engine::Engine<B>) {
    use ingot_engine::{Engine, EngineConfig};
    use std::sync::Arc;
    let path = ingot_model::testing::test_model_path().expect("the test model (INGOT_TEST_MODEL)");
    let config = EngineConfig {
        max_num_seqs: Some(8),
        max_model_len: Some(1024),
        kv_cache_memory: Some(256 << 20),
        ..EngineConfig::default()
    };
    let cpu = cpu_reference_of(&backend);
    let (m, t) = ingot_model::load(&cpu, &path, WeightDType::F32).unwrap();
    let ce = Engine::new(cpu, m, Arc::new(t), config.clone()).unwrap();
    let (m, t) = ingot_model::load(&backend, &path, WeightDType::F32).unwrap();
    let ge = Engine::new(backend, m, Arc::new(t), config).unwrap();
    (ce, ge)
}

/// The CPU engine and an engine on `backend` give the same greedy text for the first
/// fixtures' prompts at f32.
pub fn cpu_engine_agrees_in_f32<B: Backend + 'static>(backend: B) {
    use ingot_core::SamplingParams;
    let ps: Vec<Vec<u32>> = cases().iter().take(4).map(|c| c.prompt.clone()).collect();
    let (mut ce, mut ge) = f32_engines(backend);
    let params = SamplingParams::greedy(12);
    let want = ce
        .generate(ps.clone(), &vec![params.clone(); ps.len()])
        .unwrap();
    let got = ge.generate(ps.clone(), &vec![params; ps.len()]).unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.completions[0].token_ids, w.completions[0].token_ids);
        assert_eq!(g.completions[0].text, w.completions[0].text);
    }
}

/// Sampling on `backend`'s device for the first `prompts` fixtures, `tokens` a sample: a
/// seed repeats its tokens and another seed changes them, top-k 1 is greedy (over two
/// thirds as many), and a logit bias reaches the kernel.
pub fn seeded_sampling_on_the_device<B: Backend + 'static>(
    backend: B,
    prompts: usize,
    tokens: usize,
) {
    use ingot_core::SamplingParams;
    use ingot_engine::{Engine, EngineConfig};
    use std::sync::Arc;
    assert!(
        backend.samples_on_device(),
        "{} samples on the host",
        backend.name()
    );
    let path = ingot_model::testing::test_model_path().expect("the test model (INGOT_TEST_MODEL)");
    let (m, t) = ingot_model::load(&backend, &path, WeightDType::F32).unwrap();
    let config = EngineConfig {
        max_num_seqs: Some(16),
        max_model_len: Some(1024),
        kv_cache_memory: Some(256 << 20),
        ..EngineConfig::default()
    };
    let mut e = Engine::new(backend, m, Arc::new(t), config).unwrap();
    let ps: Vec<Vec<u32>> = cases()
        .iter()
        .take(prompts)
        .map(|c| c.prompt.clone())
        .collect();
    let run = |e: &mut Engine<B>, params: SamplingParams| -> Vec<Vec<u32>> {
        e.generate(ps.clone(), &vec![params; ps.len()])
            .unwrap()
            .into_iter()
            .map(|o| o.completions[0].token_ids.clone())
            .collect()
    };
    let seeded = |seed| SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        min_p: 0.02,
        repetition_penalty: 1.1,
        seed: Some(seed),
        ignore_eos: true,
        max_tokens: tokens,
        ..SamplingParams::default()
    };
    let a = run(&mut e, seeded(1));
    assert_eq!(a, run(&mut e, seeded(1)), "a seed repeats");
    assert_ne!(a, run(&mut e, seeded(2)), "another seed differs");
    let greedy = run(
        &mut e,
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(tokens * 2 / 3)
        },
    );
    let top1 = run(
        &mut e,
        SamplingParams {
            temperature: 1.0,
            top_k: 1,
            seed: Some(3),
            ignore_eos: true,
            max_tokens: tokens * 2 / 3,
            ..SamplingParams::default()
        },
    );
    assert_eq!(top1, greedy, "top_k 1 is greedy");
    let forced = run(
        &mut e,
        SamplingParams {
            temperature: 1.0,
            logit_bias: [(42, 100.0)].into(),
            ignore_eos: true,
            max_tokens: 5,
            ..SamplingParams::default()
        },
    );
    assert!(forced.iter().all(|t| t == &[42; 5]), "{forced:?}");
}

/// Structured output sampled on `backend`'s device (the masks in its sampling kernel) gives
/// the tokens the CPU engine picks on the host, greedy, for a JSON schema, a regex and a
/// choice sharing steps with an unconstrained row; a seeded draw under a JSON-object
/// constraint gives JSON.
pub fn constrained_greedy_on_the_device_matches_the_cpu<B: Backend + 'static>(backend: B) {
    use ingot_core::{SamplingParams, StructuredOutput};
    use serde_json::json;
    assert!(
        backend.samples_on_device(),
        "{} samples on the host",
        backend.name()
    );
    let (mut ce, mut ge) = f32_engines(backend);
    let person = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150}
        },
        "required": ["name", "age"],
        "additionalProperties": false
    });
    let specs = [
        Some(StructuredOutput::JsonSchema(person)),
        Some(StructuredOutput::Regex(
            "[A-Z][a-z]{1,8} is [0-9]{1,3}".into(),
        )),
        Some(StructuredOutput::Choice(vec![
            "yes".into(),
            "no".into(),
            "maybe".into(),
        ])),
        None,
    ];
    let ps: Vec<Vec<u32>> = cases()
        .iter()
        .cycle()
        .take(specs.len())
        .map(|c| c.prompt.clone())
        .collect();
    let params: Vec<SamplingParams> = specs
        .iter()
        .map(|s| SamplingParams {
            structured: s.clone(),
            ..SamplingParams::greedy(24)
        })
        .collect();
    let want = ce.generate(ps.clone(), &params).unwrap();
    let got = ge.generate(ps.clone(), &params).unwrap();
    for ((g, w), s) in got.iter().zip(&want).zip(&specs) {
        let (g, w) = (&g.completions[0], &w.completions[0]);
        assert_eq!(g.token_ids, w.token_ids, "{s:?}");
        assert_eq!(g.text, w.text, "{s:?}");
    }
    let choice = &got[2].completions[0].text;
    assert!(
        ["yes", "no", "maybe"].contains(&choice.as_str()),
        "{choice}"
    );
    let drawn = SamplingParams {
        temperature: 0.8,
        seed: Some(5),
        structured: Some(StructuredOutput::JsonObject),
        max_tokens: 48,
        ..SamplingParams::default()
    };
    let out = ge.generate(vec![ps[0].clone()], &[drawn]).unwrap();
    let c = &out[0].completions[0];
    if c.finish_reason == Some(ingot_core::FinishReason::Stop) {
        let v: serde_json::Value =
            serde_json::from_str(&c.text).unwrap_or_else(|e| panic!("`{}`: {e}", c.text));
        assert!(v.is_object(), "{}", c.text);
    } else {
        assert!(c.text.starts_with('{'), "{}", c.text);
    }
}

/// transformers' pooled vectors of the tiny random Qwen3 (tools/reference/make_embedding_fixtures.py).
pub struct EmbeddingFixture {
    pub weights_sha256: String,
    pub inputs: Vec<Vec<u32>>,
    /// Per pooling (`last`, `mean`, `cls`), one normalized vector per input.
    pub pooled: std::collections::HashMap<String, Vec<Vec<f32>>>,
}

pub fn embedding_fixture() -> EmbeddingFixture {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/embeddings/qwen3_tiny.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    EmbeddingFixture {
        weights_sha256: v["meta"]["weights_sha256"].as_str().unwrap().to_string(),
        inputs: serde_json::from_value(v["inputs"].clone()).unwrap(),
        pooled: serde_json::from_value(v["pooled"].clone()).unwrap(),
    }
}

pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot = |x: &[f32], y: &[f32]| {
        x.iter()
            .zip(y)
            .map(|(&p, &q)| p as f64 * q as f64)
            .sum::<f64>()
    };
    dot(a, b) / (dot(a, a).sqrt() * dot(b, b).sqrt())
}

/// An embedding engine on `backend` for the model in `dir`, with the pooling its files
/// declare and a small token budget, so that long inputs run in chunks.
pub fn embedding_engine<B: Backend + 'static>(
    backend: B,
    dir: &Path,
    budget: usize,
    prefix_caching: bool,
) -> ingot_engine::Engine<B> {
    use ingot_engine::{Engine, EngineConfig};
    let ckpt = ingot_model::Checkpoint::open(dir).unwrap();
    let pooling = ingot_model::Pooling::declared(&ckpt)
        .unwrap()
        .expect("pooling files");
    let (m, t) = ingot_model::load_checkpoint(&backend, &ckpt, WeightDType::F32).unwrap();
    let config = EngineConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: Some(8),
        max_model_len: Some(512),
        kv_cache_memory: Some(64 << 20),
        prefix_caching,
        pooling: Some(pooling),
        ..EngineConfig::default()
    };
    Engine::new(backend, m, std::sync::Arc::new(t), config).unwrap()
}

/// The tiny random Qwen3 with each pooling (last-token, mean, CLS; normalized) on the
/// backend `device()` opens gives transformers' vectors (cosine ≥ `min_cosine`) for inputs
/// of 1 to 333 tokens, each alone and all in one batch whose long inputs run in chunks;
/// the batch's vectors equal the lone ones within `batch_tol` (a device's products may
/// sum in another order for another number of rows).
pub fn embeddings_match_transformers<B: Backend + 'static>(
    device: impl Fn() -> B,
    min_cosine: f64,
    batch_tol: f32,
) {
    use ingot_model::synthetic::SyntheticSpec;
    use ingot_model::{Arch, PoolingType};
    use sha2::Digest;
    let fixture = embedding_fixture();
    let dir = std::env::temp_dir().join(format!("ingot-embed-{}", std::process::id()));
    let spec = SyntheticSpec::tiny(Arch::Qwen3);
    spec.write(&dir).unwrap();
    let weights = std::fs::read(dir.join("model.safetensors")).unwrap();
    assert_eq!(
        format!("{:x}", sha2::Sha256::digest(&weights)),
        fixture.weights_sha256,
        "the synthetic Qwen3 is not the model the fixture was made from: remake it (tools/reference/README.md)"
    );
    for (kind, name) in [
        (PoolingType::Last, "last"),
        (PoolingType::Mean, "mean"),
        (PoolingType::Cls, "cls"),
    ] {
        ingot_model::pooling::write_sentence_transformers(&dir, kind, true, spec.hidden_size)
            .unwrap();
        let mut engine = embedding_engine(device(), &dir, 64, true);
        let alone: Vec<Vec<f32>> = fixture
            .inputs
            .iter()
            .map(|i| engine.embed(vec![i.clone()], None).unwrap().remove(0))
            .collect();
        let batch = engine.embed(fixture.inputs.clone(), None).unwrap();
        let (mut worst, mut worst_batch) = (1f64, 0f32);
        for (i, want) in fixture.pooled[name].iter().enumerate() {
            let c = cosine(&alone[i], want);
            worst = worst.min(c);
            assert!(
                c >= min_cosine,
                "{name} pooling, input of {} tokens: cosine {c} to transformers",
                fixture.inputs[i].len()
            );
            let diff = alone[i]
                .iter()
                .zip(&batch[i])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            worst_batch = worst_batch.max(diff);
            assert!(
                diff <= batch_tol,
                "{name} pooling, input {i}: batch differs by {diff}"
            );
        }
        println!("{name} pooling: worst cosine to transformers {worst:.9}, batch against alone {worst_batch:.1e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A runner over a tensor-parallel group of `devices` (rank order) with the checkpoint in
/// `dir` split across them; one device runs the whole model.
pub fn tensor_parallel_runner<B: Backend + 'static>(
    devices: Vec<B>,
    dir: &Path,
    dtype: WeightDType,
) -> ModelRunner<B> {
    let ckpt = ingot_model::Checkpoint::open(dir).unwrap();
    let mut ranks = ingot_model::load_tensor_parallel(devices, &ckpt, dtype)
        .unwrap()
        .into_iter();
    let (backend, model) = ranks.next().unwrap();
    let config = RunnerConfig {
        max_num_batched_tokens: 24,
        max_num_seqs: 4,
        max_model_len: 512,
        block_size: 16,
        num_blocks: 64,
        kv_cache_dtype: model.weights.activation_dtype,
        enforce_eager: false,
        head: ingot_model::Head::Logits,
    };
    ModelRunner::with_peers(backend, model, ranks.collect(), config).unwrap()
}

/// Each synthetic f32 model of `archs` split over `open(size)`'s devices gives the logits
/// (within `tol` of the largest) and greedy tokens of the whole model on `open(1)`'s,
/// over mixed prefill and decode steps.
pub fn tensor_parallel_matches_one_device<B: Backend + 'static>(
    open: impl Fn(usize) -> Vec<B>,
    size: usize,
    archs: &[ingot_model::Arch],
    tol: f32,
) {
    use ingot_model::synthetic::SyntheticSpec;
    for &arch in archs {
        // As many KV heads as ranks at least, so that each rank has whole ones.
        let mut spec = SyntheticSpec::tiny(arch);
        spec.num_kv_heads = spec.num_kv_heads.max(size);
        spec.num_heads = spec.num_heads.max(size);
        spec_over_ranks_matches_one_device(&open, size, &spec, tol);
    }
}

/// [`tensor_parallel_matches_one_device`] for one model, `spec`, over `size` ranks.
pub fn spec_over_ranks_matches_one_device<B: Backend + 'static>(
    open: impl Fn(usize) -> Vec<B>,
    size: usize,
    spec: &ingot_model::synthetic::SyntheticSpec,
    tol: f32,
) {
    // Tests of one binary run at once in one process: two that split the same spec over
    // the same ranks (plain and folding norms) would otherwise rewrite a checkpoint the
    // other has mapped, which kills the process with SIGBUS.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let arch = spec.arch;
    let dir = std::env::temp_dir().join(format!(
        "ingot-tp{size}-{arch:?}-kv{}-{}-{call}",
        spec.num_kv_heads,
        std::process::id()
    ));
    spec.write(&dir).unwrap();
    let seqs = random_seqs(5, &[1, 15, 17, 40], spec.vocab_size);
    let mut whole = tensor_parallel_runner(open(1), &dir, WeightDType::F32);
    let whole = run_mixed(&mut whole, &seqs, 3);
    let mut split = tensor_parallel_runner(open(size), &dir, WeightDType::F32);
    let split = run_mixed(&mut split, &seqs, 3);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(whole.len(), split.len());
    let mut worst = 0f32;
    for (w, s) in whole.iter().zip(&split) {
        assert_eq!((w.seq, w.pos), (s.seq, s.pos), "the same schedule");
        let err = rel_err(&s.logits, &w.logits);
        worst = worst.max(err);
        let at = format!("{arch:?} over {size} ranks: seq {} pos {}", w.seq, w.pos);
        assert!(err <= tol, "{at}: relative logit error {err}");
        assert_eq!(
            ingot_backend::first_argmax(&s.logits),
            ingot_backend::first_argmax(&w.logits),
            "{at}: greedy token"
        );
    }
    println!(
        "{arch:?} ({} KV heads) over {size} ranks: {} logit rows, max relative error {worst:.2e}",
        spec.num_kv_heads,
        whole.len()
    );
}
