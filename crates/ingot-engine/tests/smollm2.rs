//! The real test model against HF transformers fixtures (tests/fixtures/smollm2, written by
//! tools/reference/make_fixtures.py), through the paged runner.

mod common;

use common::{cases, top_ids};
use ingot_model::reference::ReferenceModel;
use ingot_model::testing::test_model_path;
use ingot_model::{Checkpoint, WeightDType};

fn runner(dtype: WeightDType) -> Option<ingot_engine::ModelRunner<ingot_backend::cpu::CpuBackend>> {
    let path = test_model_path()?;
    Some(common::runner(&path, dtype, 256, 1, 2048, 2048 / 16))
}

#[test]
fn f32_greedy_tokens_and_logits_match_transformers() {
    let Some(mut r) = runner(WeightDType::F32) else {
        return;
    };
    let cases = cases();
    assert!(cases.len() >= 10);
    let mut worst = 0f32;
    for c in &cases {
        let (tokens, logits) = common::greedy_with_logits(&mut r, &c.prompt, 32);
        assert_eq!(tokens, c.greedy, "{}: greedy tokens", c.name);
        let mut case_worst = 0f32;
        for (step, (logits, want)) in logits.iter().zip(&c.top5).enumerate() {
            let want_ids: Vec<u32> = want.iter().map(|p| p.0).collect();
            assert_eq!(
                top_ids(logits, 5),
                want_ids,
                "{} step {step}: top-5 ids",
                c.name
            );
            for &(id, l) in want {
                case_worst = case_worst.max((logits[id as usize] - l).abs());
            }
        }
        println!("{:>12}: {} prompt tokens, 32/32 greedy tokens equal, max top-5 logit diff {case_worst:.2e}", c.name, c.prompt.len());
        worst = worst.max(case_worst);
    }
    println!("largest logit difference from transformers: {worst:.2e}");
    assert!(
        worst <= 2e-3,
        "largest logit difference {worst} exceeds 2e-3"
    );
}

#[test]
fn quantized_weights_track_transformers() {
    let Some(mut r) = runner(WeightDType::Auto) else {
        return;
    };
    let mut checked = 0;
    for c in &cases() {
        let (tokens, logits) = common::greedy_with_logits(&mut r, &c.prompt, 32);
        let first = &c.top5[0];
        if first[0].1 - first[1].1 > 0.5 {
            assert_eq!(
                tokens[0], c.greedy[0],
                "{}: first token with a clear top-2 gap",
                c.name
            );
            checked += 1;
        }
        let matched = tokens
            .iter()
            .zip(&c.greedy)
            .take_while(|(a, b)| a == b)
            .count();
        // Overlap of top-5 sets while the continuations still agree.
        let overlap: f32 = logits[..matched.max(1)]
            .iter()
            .zip(&c.top5)
            .map(|(l, w)| {
                top_ids(l, 5)
                    .iter()
                    .filter(|id| w.iter().any(|p| p.0 == **id))
                    .count() as f32
                    / 5.0
            })
            .sum::<f32>()
            / matched.max(1) as f32;
        println!("{:>12}: {matched:>2}/32 steps equal before divergence, mean top-5 overlap {overlap:.2}", c.name);
    }
    assert!(
        checked >= 5,
        "only {checked} fixtures have a clear first token"
    );
}

#[test]
fn paged_f32_matches_reference_forward_on_the_real_model() {
    let Some(path) = test_model_path() else {
        return;
    };
    let reference = ReferenceModel::load(&Checkpoint::open(&path).unwrap()).unwrap();
    let mut runner = common::runner(&path, WeightDType::F32, 48, 3, 256, 32);
    let case = cases().into_iter().find(|c| c.name == "code").unwrap();
    let seqs = vec![
        case.prompt[..40].to_vec(),
        case.prompt[10..27].to_vec(),
        case.prompt[50..83].to_vec(),
    ];
    let want: Vec<Vec<f32>> = seqs.iter().map(|s| reference.forward(s)).collect();
    let v = runner.vocab_size();
    let mut worst = 0f32;
    for o in common::run_mixed(&mut runner, &seqs, 5) {
        worst = worst.max(common::rel_err(
            &o.logits,
            &want[o.seq][o.pos * v..(o.pos + 1) * v],
        ));
    }
    println!("paged vs reference, real model: max relative logit error {worst:.2e}");
    assert!(worst <= 1e-4, "relative error {worst}");
}
