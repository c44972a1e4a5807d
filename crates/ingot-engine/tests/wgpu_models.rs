//! Whole models on the wgpu backend (lavapipe in CI, a GPU elsewhere): every synthetic
//! architecture against the CPU, the real test model against the transformers fixtures,
//! and the engine against the CPU engine. Activations are f32 on wgpu as on the CPU, so
//! the models agree to f32 rounding whatever the weights' dtype.
#![cfg(feature = "wgpu")]

mod common;

use common::{cases, top_ids};
use ingot_backend::cpu::CpuBackend;
use ingot_backend::wgpu::{Options, WgpuBackend};
use ingot_core::SamplingParams;
use ingot_engine::{Engine, EngineConfig};
use ingot_model::synthetic::{Dtype, SyntheticSpec};
use ingot_model::testing::test_model_path;
use ingot_model::{Arch, WeightDType};
use rand::{Rng, SeedableRng};
use std::sync::Arc;

fn gpu() -> WgpuBackend {
    WgpuBackend::new(0, Options::default()).unwrap_or_else(|e| panic!("no wgpu adapter: {e:#}"))
}

#[test]
fn synthetic_models_match_the_cpu() {
    for arch in [Arch::Llama, Arch::Mistral, Arch::Qwen2, Arch::Qwen3] {
        for stored in [Dtype::F32, Dtype::BF16, Dtype::F16] {
            let spec = SyntheticSpec {
                dtype: stored,
                ..SyntheticSpec::tiny(arch)
            };
            let dir = std::env::temp_dir().join(format!(
                "ingot-wgpu-{arch:?}-{stored:?}-{}",
                std::process::id()
            ));
            spec.write(&dir).unwrap();
            let mut rng = rand::rngs::StdRng::seed_from_u64(3);
            let seqs: Vec<Vec<u32>> = [1usize, 15, 16, 17, 40, 33, 150]
                .iter()
                .map(|&n| {
                    (0..n)
                        .map(|_| rng.random_range(0..spec.vocab_size as u32))
                        .collect()
                })
                .collect();
            let dtype = WeightDType::Auto;
            let mut cpu = common::runner(&dir, dtype, 24, 4, 512, 64);
            let mut gpu = common::runner_on(gpu(), &dir, dtype, 24, 4, 512, 64);
            let want = common::run_mixed(&mut cpu, &seqs, 11);
            let got = common::run_mixed(&mut gpu, &seqs, 11);
            assert_eq!(got.len(), want.len());
            let worst = got
                .iter()
                .zip(&want)
                .map(|(g, w)| {
                    assert_eq!((g.seq, g.pos), (w.seq, w.pos));
                    common::rel_err(&g.logits, &w.logits)
                })
                .fold(0f32, f32::max);
            println!(
                "{arch:?} {stored:?}: {} logit rows, max relative error {worst:.2e}",
                got.len()
            );
            assert!(
                worst <= 1e-4,
                "{arch:?} {stored:?}: relative logit error {worst}"
            );
            std::fs::remove_dir_all(&dir).ok();
        }
    }
}

/// Every fixture with `INGOT_WGPU_ALL_FIXTURES=1` (scripts/gpu/run on a GPU); otherwise
/// those with prompts under 64 tokens, which lavapipe runs in about a minute (all of them
/// take it most of an hour).
#[test]
fn f32_real_model_gives_the_transformers_greedy_tokens() {
    let path = test_model_path().expect("the test model (INGOT_TEST_MODEL)");
    let mut r = common::runner_on(gpu(), &path, WeightDType::F32, 256, 1, 2048, 2048 / 16);
    let all = std::env::var_os("INGOT_WGPU_ALL_FIXTURES").is_some();
    let cases: Vec<_> = cases()
        .into_iter()
        .filter(|c| all || c.prompt.len() < 64)
        .collect();
    assert!(cases.len() >= 4, "too few fixtures: {}", cases.len());
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
    let path = test_model_path().expect("the test model (INGOT_TEST_MODEL)");
    let config = EngineConfig {
        max_num_seqs: 8,
        max_model_len: Some(1024),
        kv_cache_memory: Some(64 << 20),
        ..EngineConfig::default()
    };
    let ps: Vec<Vec<u32>> = cases().iter().take(4).map(|c| c.prompt.clone()).collect();
    let cpu = CpuBackend::new(None).unwrap();
    let (m, t) = ingot_model::load(&cpu, &path, WeightDType::F32).unwrap();
    let mut ce = Engine::new(cpu, m, Arc::new(t), config.clone()).unwrap();
    let g = gpu();
    let (m, t) = ingot_model::load(&g, &path, WeightDType::F32).unwrap();
    let mut ge = Engine::new(g, m, Arc::new(t), config).unwrap();
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
