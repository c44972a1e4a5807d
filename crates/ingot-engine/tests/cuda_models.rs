//! Whole models on the CUDA backend: every synthetic architecture against the CPU, the
//! real test model against the transformers fixtures, and the engine's greedy tokens
//! across batch sizes and token budgets. Run with `--ignored` on the GPU machine.
#![cfg(feature = "cuda")]

mod common;

use common::{cases, top_ids};
use ingot_backend::cuda::CudaBackend;
use ingot_backend::DType;
use ingot_core::SamplingParams;
use ingot_engine::{Engine, EngineConfig};
use ingot_model::synthetic::Dtype;
use ingot_model::testing::test_model_path;
use ingot_model::WeightDType;
use std::sync::Arc;

fn gpu() -> CudaBackend {
    CudaBackend::new(0).unwrap_or_else(|e| panic!("these tests need a CUDA GPU: {e:#}"))
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn synthetic_models_match_the_cpu() {
    common::synthetic_models_match_the_cpu(
        gpu,
        &[
            (Dtype::F32, WeightDType::F32, 1e-4),
            (Dtype::BF16, WeightDType::Auto, 3e-2),
            (Dtype::F16, WeightDType::Auto, 1e-2),
        ],
    );
}

/// `--quantization fp8` on the GPU (f16 activations on FP8 blocks) against the CPU's f32
/// activations on the same blocks.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fp8_models_match_the_cpu() {
    common::fp8_models_match_the_cpu(gpu, 2e-2);
}

fn gpus(n: usize) -> Vec<CudaBackend> {
    (0..n)
        .map(|i| CudaBackend::new(i).unwrap_or_else(|e| panic!("this test needs {n} GPUs: {e:#}")))
        .collect()
}

/// Needs `INGOT_TP_GPUS` GPUs (2 unless set) and NCCL (`libnccl.so.2` on the loader's
/// path or in `INGOT_CUDA_LIB_DIR`).
#[test]
#[ignore = "needs several NVIDIA GPUs"]
fn tensor_parallel_matches_one_gpu() {
    use ingot_model::Arch;
    let size = std::env::var("INGOT_TP_GPUS").map_or(2, |v| v.parse().unwrap());
    common::tensor_parallel_matches_one_device(
        gpus,
        size,
        &[
            Arch::Llama,
            Arch::Qwen2,
            Arch::Qwen3,
            Arch::Qwen3Moe,
            Arch::Mixtral,
        ],
        1e-5,
    );
}

fn real_runner(dtype: WeightDType) -> ingot_engine::ModelRunner<CudaBackend> {
    let path = test_model_path().expect("the test model (INGOT_TEST_MODEL)");
    common::runner_on(gpu(), &path, dtype, 256, 1, 2048, 2048 / 16)
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn f32_real_model_gives_the_transformers_greedy_tokens() {
    let mut r = real_runner(WeightDType::F32);
    let mut worst = 0f32;
    for c in &cases() {
        let (tokens, logits) = common::greedy_with_logits(&mut r, &c.prompt, 32);
        assert_eq!(tokens, c.greedy, "{}: greedy tokens", c.name);
        for (step, (l, want)) in logits.iter().zip(&c.top5).enumerate() {
            let ids: Vec<u32> = want.iter().map(|p| p.0).collect();
            assert_eq!(top_ids(l, 5), ids, "{} step {step}: top-5 ids", c.name);
            for &(id, v) in want {
                worst = worst.max((l[id as usize] - v).abs());
            }
        }
        println!("{:>12}: 32/32 greedy tokens equal", c.name);
    }
    println!("largest top-5 logit difference from transformers: {worst:.2e}");
    assert!(worst <= 2e-3, "largest logit difference {worst}");
}

/// Steps equal to transformers' greedy continuation before the first divergence, per
/// fixture; the first token must agree wherever transformers' top-2 gap is clear.
fn report_divergence(dtype: WeightDType) {
    let mut r = real_runner(dtype);
    let checked = common::greedy_tracks_transformers(&mut r, &cases(), &format!("{dtype:?}"));
    assert!(checked >= 5);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn bf16_and_quantized_real_model_track_transformers() {
    report_divergence(WeightDType::BF16);
    report_divergence(WeightDType::Auto);
}

/// The test model's GGUF blocks (Q4_1 matrices, a Q8_0 tied embedding) kept as they are on
/// the GPU with f16 activations: per fixture, the greedy steps equal to the CPU's run of the
/// same blocks (f32 activations) and to transformers' before the first divergence, and the
/// first token wherever transformers' top-2 gap is clear.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gguf_blocks_real_model_tracks_the_cpu_and_transformers() {
    let mut r = real_runner(WeightDType::Auto);
    assert_eq!(
        r.model.weights.matrix_dtype,
        DType::Q4_1,
        "the test model's matrices kept as Q4_1 blocks"
    );
    let path = test_model_path().expect("the test model (INGOT_TEST_MODEL)");
    let mut cpu = common::runner(&path, WeightDType::Auto, 256, 1, 2048, 2048 / 16);
    let (mut checked, mut same_as_cpu, mut steps) = (0, 0, 0);
    for c in &cases() {
        let (tokens, _) = common::greedy_with_logits(&mut r, &c.prompt, 32);
        let (on_cpu, _) = common::greedy_with_logits(&mut cpu, &c.prompt, 32);
        let prefix = |want: &[u32]| tokens.iter().zip(want).take_while(|(a, b)| a == b).count();
        let (cpu_steps, hf_steps) = (prefix(&on_cpu), prefix(&c.greedy));
        println!(
            "{:>12}: {cpu_steps:>2}/32 steps equal to the CPU's Q4_1 run, {hf_steps:>2}/32 to \
             transformers'",
            c.name
        );
        same_as_cpu += cpu_steps;
        steps += 32;
        if c.top5[0][0].1 - c.top5[0][1].1 > 0.5 {
            assert_eq!(tokens[0], c.greedy[0], "{}: first token", c.name);
            checked += 1;
        }
    }
    println!("{same_as_cpu}/{steps} steps equal to the CPU's before the first divergence");
    assert!(checked >= 5);
}

fn engine(budget: usize) -> Engine<CudaBackend> {
    let path = test_model_path().expect("the test model (INGOT_TEST_MODEL)");
    let backend = gpu();
    let (model, tok) = ingot_model::load(&backend, &path, WeightDType::BF16).unwrap();
    let config = EngineConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: Some(64),
        max_model_len: Some(4096),
        kv_cache_memory: Some(2 << 30),
        ..EngineConfig::default()
    };
    Engine::new(backend, model, Arc::new(tok), config).unwrap()
}

fn greedy_tokens(e: &mut Engine<CudaBackend>, prompts: &[Vec<u32>], n: usize) -> Vec<Vec<u32>> {
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(n)
    };
    e.generate(prompts.to_vec(), &vec![params; prompts.len()])
        .unwrap()
        .into_iter()
        .map(|o| o.completions[0].token_ids.clone())
        .collect()
}

/// bf16 on the GPU: decode steps of up to 4 rows run our GEMV kernels and larger ones
/// cuBLASLt, which also picks its algorithm by the number of rows, so a request's logits can
/// round differently in another batch. This measures how often greedy tokens change across
/// batch sizes 1–64 and budgets 64–8192 and bounds it.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn greedy_tokens_across_batches_and_budgets() {
    let corpus: Vec<u32> = cases()
        .iter()
        .rev()
        .flat_map(|c| c.prompt.clone())
        .collect();
    let lens = [
        5, 90, 17, 33, 160, 1, 64, 15, 16, 250, 48, 120, 7, 200, 31, 700,
    ];
    let ps: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| corpus[i * 37..i * 37 + n].to_vec())
        .collect();
    let steps = 16;
    let mut e = engine(2048);
    let alone: Vec<Vec<u32>> = ps
        .iter()
        .map(|p| greedy_tokens(&mut e, std::slice::from_ref(p), steps).remove(0))
        .collect();
    let (mut same, mut total, mut tokens_same, mut tokens_total) = (0, 0, 0, 0);
    let mut diverged = std::collections::BTreeSet::new();
    let mut compare = |got: &[Vec<u32>], idx: &[usize], what: &str| {
        for (g, &i) in got.iter().zip(idx) {
            let m = g.iter().zip(&alone[i]).take_while(|(a, b)| a == b).count();
            total += 1;
            tokens_total += steps;
            tokens_same += m;
            if m == steps {
                same += 1;
            } else {
                println!("{what}: prompt {i} diverges at step {m}");
                diverged.insert(i);
            }
        }
    };
    for size in [1, 2, 3, 8, 16, 32, 64] {
        let idx: Vec<usize> = (0..size).map(|i| (i * 7 + size) % ps.len()).collect();
        let batch: Vec<Vec<u32>> = idx.iter().map(|&i| ps[i].clone()).collect();
        compare(
            &greedy_tokens(&mut e, &batch, steps),
            &idx,
            &format!("batch {size}"),
        );
    }
    drop(e);
    for budget in [64, 512, 8192] {
        let mut e = engine(budget);
        let idx: Vec<usize> = (0..ps.len()).collect();
        compare(
            &greedy_tokens(&mut e, &ps, steps),
            &idx,
            &format!("budget {budget}"),
        );
    }
    println!(
        "bf16 greedy invariance: {same}/{total} requests identical to their run alone, {tokens_same}/{tokens_total} tokens before the first divergence, prompts {diverged:?} of {} diverge somewhere",
        ps.len()
    );
    // Near-ties flip under bf16 rounding; a broken kernel diverges early and everywhere.
    // Batches repeat prompts (64 rows of 16), so one prompt whose near-tie flips counts up
    // to 11 times: the distinct prompts are the measure (main before the tensor-core decode
    // attention: 6 of 16, 2659/2784 tokens; with it: 7 of 16, 2502/2784).
    assert!(
        same * 10 >= total * 7 && diverged.len() * 2 <= ps.len(),
        "only {same}/{total} requests kept; prompts {diverged:?} diverge"
    );
}

/// A prompt longer than the token budget, alone: its first steps are chunks that end no
/// prompt and have no logits rows (launching their row kernels over an empty grid failed
/// until 2026-11-27). It runs to its tokens, which track the unchunked run's.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_prompt_longer_than_the_budget_runs_alone_in_chunks() {
    let prompt: Vec<u32> = cases()
        .iter()
        .flat_map(|c| c.prompt.clone())
        .take(300)
        .collect();
    let whole = greedy_tokens(&mut engine(2048), std::slice::from_ref(&prompt), 16).remove(0);
    let chunked = greedy_tokens(&mut engine(64), std::slice::from_ref(&prompt), 16).remove(0);
    assert_eq!(chunked.len(), 16);
    let same = chunked
        .iter()
        .zip(&whole)
        .take_while(|(a, b)| a == b)
        .count();
    println!("chunks of 64: {same}/16 tokens before the first divergence from one chunk");
    assert!(same >= 4, "chunked {chunked:?}, whole {whole:?}");
}

/// The CPU engine and the CUDA engine agree on a quick f32 generation.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cpu_and_cuda_engines_agree_in_f32() {
    common::cpu_engine_agrees_in_f32(gpu());
}

/// Sampling on the device: a seed repeats its tokens and another seed changes them, top-k 1
/// is greedy, and a logit bias reaches the kernel.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn embeddings_match_transformers() {
    common::embeddings_match_transformers(gpu, 0.99999, 1e-5);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn seeded_sampling_on_the_device() {
    common::seeded_sampling_on_the_device(gpu(), 6, 24);
}

/// Structured-output masks in the CUDA sampling kernel: the CPU engine's greedy tokens.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn constrained_greedy_on_the_device_matches_the_cpu() {
    common::constrained_greedy_on_the_device_matches_the_cpu(gpu());
}
