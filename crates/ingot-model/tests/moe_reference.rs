//! The reference forward of the mixture-of-experts architectures (Qwen3-MoE, Mixtral) on
//! tiny random models gives transformers' greedy tokens
//! (tools/reference/make_moe_fixtures.py), compared up to the first step whose top-two
//! logit margin in transformers is below 1e-3 (random routers make near-ties).

use ingot_model::reference::ReferenceModel;
use ingot_model::synthetic::SyntheticSpec;
use ingot_model::{Arch, Checkpoint};
use serde_json::Value;
use sha2::Digest;
use std::path::Path;

const NEAR_TIE: f64 = 1e-3;

fn greedy_matches_transformers(arch: Arch, name: &str) {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../tests/fixtures/moe/{name}.json"));
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let dir = std::env::temp_dir().join(format!("ingot-moe-{name}-{}", std::process::id()));
    SyntheticSpec::tiny(arch).write(&dir).unwrap();
    let weights = std::fs::read(dir.join("model.safetensors")).unwrap();
    assert_eq!(
        format!("{:x}", sha2::Sha256::digest(&weights)),
        fixture["meta"]["weights_sha256"].as_str().unwrap(),
        "the synthetic {name} is not the model the fixture was made from: remake it (tools/reference/README.md)"
    );
    let model = ReferenceModel::load(&Checkpoint::open(&dir).unwrap()).unwrap();
    let vocab = model.config.vocab_size;
    let (mut compared, mut total) = (0, 0);
    for case in fixture["cases"].as_array().unwrap() {
        let ids = |k: &str| -> Vec<u32> { serde_json::from_value(case[k].clone()).unwrap() };
        let (mut tokens, want) = (ids("prompt"), ids("greedy"));
        let margins: Vec<f64> = serde_json::from_value(case["margins"].clone()).unwrap();
        let steps = margins.iter().take_while(|&&m| m >= NEAR_TIE).count();
        for (step, &w) in want.iter().enumerate().take(steps) {
            let logits = model.forward(&tokens);
            let last = &logits[logits.len() - vocab..];
            let got = ingot_backend::first_argmax(last);
            assert_eq!(
                got,
                w,
                "{name}, prompt of {}: step {step}",
                case["prompt"].as_array().unwrap().len()
            );
            tokens.push(got);
        }
        compared += steps;
        total += want.len();
    }
    println!("{name}: {compared} of {total} greedy steps compared (the rest follow a near-tie)");
    assert!(
        compared * 2 >= total,
        "{name}: too few steps before a near-tie"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn qwen3_moe_reference_gives_the_transformers_greedy_tokens() {
    greedy_matches_transformers(Arch::Qwen3Moe, "qwen3_moe");
}

#[test]
fn mixtral_reference_gives_the_transformers_greedy_tokens() {
    greedy_matches_transformers(Arch::Mixtral, "mixtral");
}
