//! Whole models on the wgpu backend (lavapipe in CI, a GPU elsewhere): every synthetic
//! architecture against the CPU, the real test model against the transformers fixtures,
//! and the engine against the CPU engine. Activations are f32 on wgpu as on the CPU, so
//! the models agree to f32 rounding whatever the weights' dtype.
#![cfg(feature = "wgpu")]

mod common;

use common::{cases, top_ids};
use ingot_backend::wgpu::{Options, WgpuBackend};
use ingot_backend::DType;
use ingot_model::synthetic::Dtype;
use ingot_model::testing::test_model_path;
use ingot_model::WeightDType;

/// The backend as INGOT_WGPU_* set it (cooperative matrices on GPUs by default).
fn gpu() -> WgpuBackend {
    WgpuBackend::new(0, Options::from_env().unwrap())
        .unwrap_or_else(|e| panic!("no wgpu adapter: {e:#}"))
}

#[test]
fn synthetic_models_match_the_cpu() {
    let auto = WeightDType::Auto;
    common::synthetic_models_match_the_cpu(
        gpu,
        &[
            (Dtype::F32, auto, 1e-4),
            (Dtype::BF16, auto, 1e-4),
            (Dtype::F16, auto, 1e-4),
        ],
    );
}

/// `--quantization fp8`: the FP8 blocks dequantized in the shaders, f32 activations as on
/// the CPU.
#[test]
fn fp8_models_match_the_cpu() {
    common::fp8_models_match_the_cpu(gpu, 1e-4);
}

#[test]
fn embeddings_match_transformers() {
    common::embeddings_match_transformers(gpu, 0.99999, 1e-5);
}

/// Every fixture with `INGOT_WGPU_ALL_FIXTURES=1` (scripts/gpu/run on a GPU); otherwise
/// [`LAVAPIPE_FIXTURES`].
#[test]
fn f32_real_model_gives_the_transformers_greedy_tokens() {
    real_model_gives_the_transformers_greedy_tokens(WeightDType::F32);
}

/// The test model's GGUF blocks (Q4_1, and Q8_0 for the tied embedding) kept as they are
/// and dequantized in the shaders: the same weight values as the f32 run, in other
/// summation orders.
#[test]
fn gguf_blocks_real_model_gives_the_transformers_greedy_tokens() {
    real_model_gives_the_transformers_greedy_tokens(WeightDType::Auto);
}

/// What lavapipe runs of the fixtures: one of each kind (a single token, a prompt past a
/// KV block, multi-byte text, a chat template). All seven short ones took it 528 s in f32
/// and 326 s in GGUF blocks on a 2-core VM, the longest part of CI; every fixture takes it
/// most of an hour.
const LAVAPIPE_FIXTURES: [&str; 4] = ["single_token", "len17", "chinese", "chat_haiku"];

fn real_model_gives_the_transformers_greedy_tokens(dtype: WeightDType) {
    let path = test_model_path().expect("the test model (INGOT_TEST_MODEL)");
    let mut r = common::runner_on(gpu(), &path, dtype, 256, 1, 2048, 2048 / 16);
    let all = std::env::var_os("INGOT_WGPU_ALL_FIXTURES").is_some();
    let cases: Vec<_> = cases()
        .into_iter()
        .filter(|c| all || LAVAPIPE_FIXTURES.contains(&c.name.as_str()))
        .collect();
    assert!(
        cases.len() >= LAVAPIPE_FIXTURES.len(),
        "fixtures missing: {} found",
        cases.len()
    );
    // On cooperative matrices, products of more than 8 rows with block weights round their
    // inputs to f16 (as CUDA's tensor-core block products do), so near-ties among the top
    // tokens may swap: held to what CUDA's runs of 16-bit inputs are.
    if r.backend.features().cooperative_matrix.is_some() && dtype == WeightDType::Auto {
        let checked = common::greedy_tracks_transformers(&mut r, &cases, "Q4_1");
        assert!(checked >= 1, "no fixture with a clear first token");
        return;
    }
    let mut worst = 0f32;
    for c in &cases {
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

/// The engines on the CPU and on wgpu give the same greedy text at f32: the scheduler,
/// prefix cache and sampling path on top of the wgpu ops.
#[test]
fn cpu_and_wgpu_engines_agree() {
    common::cpu_engine_agrees_in_f32(gpu());
}

/// Sampling in the `sample` shader on a real model (three prompts of 12 tokens: lavapipe
/// is slow, and this test was CI's longest at 24 tokens).
#[test]
fn seeded_sampling_on_the_device() {
    common::seeded_sampling_on_the_device(gpu(), 3, 12);
}

/// Structured-output masks in the `sample` shader: the CPU engine's greedy tokens.
#[test]
fn constrained_greedy_on_the_device_matches_the_cpu() {
    common::constrained_greedy_on_the_device_matches_the_cpu(gpu());
}

/// A device whose buffers hold 384 KiB: the embedding table, the output projection and the
/// MLP matrices of this synthetic model go in several buffers each (rows split over
/// parts), and its logits still match the CPU's.
#[test]
fn matrices_split_over_buffers_match_the_cpu() {
    use ingot_model::synthetic::SyntheticSpec;
    use ingot_model::Arch;
    for arch in [Arch::Llama, Arch::Qwen2] {
        let spec = SyntheticSpec {
            vocab_size: 4099,
            intermediate_size: 1600,
            ..SyntheticSpec::tiny(arch)
        };
        let dir =
            std::env::temp_dir().join(format!("ingot-wgpu-split-{arch:?}-{}", std::process::id()));
        spec.write(&dir).unwrap();
        let small = Options {
            max_binding: Some(384 << 10),
            ..Options::default()
        };
        let g = WgpuBackend::new(0, small).unwrap();
        let seqs: Vec<Vec<u32>> = [1u32, 15, 40, 150]
            .iter()
            .map(|&n| (0..n).map(|i| (i * 37 + n) % 4099).collect())
            .collect();
        let reference = common::cpu_reference_of(&g);
        let mut cpu = common::runner_on(reference, &dir, WeightDType::Auto, 24, 4, 512, 64);
        let mut gpu = common::runner_on(g, &dir, WeightDType::Auto, 24, 4, 512, 64);
        let embed_parts = gpu.model.weights.embed.parts.len();
        assert!(
            embed_parts >= 3,
            "{arch:?}: embedding in {embed_parts} parts"
        );
        let ingot_model::weights::Mlp::Dense(mlp) = &gpu.model.weights.layers[0].mlp else {
            panic!("{arch:?} has a dense MLP");
        };
        assert!(mlp.gate_up.parts.len() >= 3 && mlp.down.parts.len() >= 2);
        let (_, worst) = common::mixed_logit_error(&mut cpu, &mut gpu, &seqs);
        println!(
            "{arch:?}: embedding in {embed_parts} parts, max relative logit error {worst:.2e}"
        );
        assert!(worst <= 1e-4, "{arch:?}: relative logit error {worst}");
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// Products on cooperative matrices (f16 inputs, f32 sums: steps past 8 rows with 16-bit
/// weights, prefill and decode batches, k split where tiles are few) keep dense synthetic
/// models' logits near the f32 CPU's: on lavapipe 3.9e-5 to 1.9e-4 for four prompts of up
/// to 200 tokens and 7.0e-5 to 4.1e-4 for twelve short sequences at once (steps of 9-64
/// rows), where the same steps without them give 3.2e-7 to 6.3e-7 (x and the layer's
/// intermediate rows rounded to f16 in every product); each also with an f16 KV cache,
/// whose prefill attention runs on them too (`prefill_coop`: 5.5e-5 to 4.0e-4, the CPU
/// reading the same f16 cache). Runs where the backend uses them
/// (`make test` runs it again on a lavapipe that has them, scripts/fetch-coop-lavapipe,
/// with INGOT_WGPU_COOPERATIVE_MATRIX=1, which makes opening the backend fail where they
/// are missing).
#[test]
fn products_on_cooperative_matrices_stay_near_the_cpu() {
    use ingot_model::synthetic::SyntheticSpec;
    use ingot_model::Arch;
    let gpu = || {
        WgpuBackend::new(0, Options::from_env().unwrap())
            .unwrap_or_else(|e| panic!("no wgpu adapter: {e:#}"))
    };
    if gpu().features().cooperative_matrix.is_none() {
        println!("skipped: this backend runs no product on cooperative matrices");
        return;
    }
    let prefill = [200, 130, 90, 7];
    let batch = [3, 40, 17, 25, 9, 31, 12, 5, 38, 22, 14, 28];
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
        for stored in [Dtype::F16, Dtype::BF16] {
            // Wide enough that a step of 9-64 rows splits k (256 and 640 are 2 and 5 runs).
            let spec = SyntheticSpec {
                dtype: stored,
                hidden_size: 256,
                intermediate_size: 640,
                head_dim: 64,
                ..SyntheticSpec::tiny(arch)
            };
            let dir = std::env::temp_dir().join(format!(
                "ingot-wgpu-coop-{arch:?}-{stored:?}-{}",
                std::process::id()
            ));
            spec.write(&dir).unwrap();
            let runs = [&prefill[..], &batch[..]]
                .into_iter()
                .flat_map(|lens| [(lens, DType::F32), (lens, DType::F16)]);
            for (lens, kv) in runs {
                let seqs = common::random_seqs(5, lens, spec.vocab_size);
                let g = gpu();
                let reference = common::cpu_reference_of(&g);
                let (auto, n) = (WeightDType::Auto, lens.len());
                let mut cpu =
                    common::runner_with_cache(reference, &dir, auto, Some(kv), 256, n, 512, 64);
                let mut gpu = common::runner_with_cache(g, &dir, auto, Some(kv), 256, n, 512, 64);
                let (rows, worst) = common::mixed_logit_error(&mut cpu, &mut gpu, &seqs);
                println!(
                    "{arch:?} {stored:?}, {n} sequences, {kv} cache: {rows} logit rows, max \
                     relative error {worst:.2e}"
                );
                assert!(
                    worst <= 2e-3,
                    "{arch:?} {stored:?}, {n} sequences, {kv} cache: relative logit error {worst}"
                );
            }
            std::fs::remove_dir_all(&dir).ok();
        }
    }
}
