//! Every architecture, as a tiny random HF directory: the paged forward over mixed batches
//! equals the plain reference forward.

mod common;

use ingot_model::reference::ReferenceModel;
use ingot_model::synthetic::SyntheticSpec;
use ingot_model::{Arch, Checkpoint, WeightDType};
use rand::{Rng, SeedableRng};

fn check_arch(arch: Arch) {
    let dir = std::env::temp_dir().join(format!("ingot-synthetic-{arch:?}-{}", std::process::id()));
    let spec = SyntheticSpec::tiny(arch);
    spec.write(&dir).unwrap();
    let reference = ReferenceModel::load(&Checkpoint::open(&dir).unwrap()).unwrap();
    let mut runner = common::runner(&dir, WeightDType::F32, 24, 4, 512, 64);
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    // Lengths around the 16-token block boundary and beyond two blocks.
    let seqs: Vec<Vec<u32>> = [1usize, 15, 16, 17, 40, 33]
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| rng.random_range(0..spec.vocab_size as u32))
                .collect()
        })
        .collect();
    let want: Vec<Vec<f32>> = seqs.iter().map(|s| reference.forward(s)).collect();
    let observed = common::run_mixed(&mut runner, &seqs, 11);
    assert!(
        observed.len() > seqs.len(),
        "some sequences took several steps"
    );
    let v = spec.vocab_size;
    let mut worst = 0f32;
    for o in &observed {
        let err = common::rel_err(&o.logits, &want[o.seq][o.pos * v..(o.pos + 1) * v]);
        worst = worst.max(err);
        assert!(
            err <= 1e-4,
            "{arch:?}: seq {} pos {}: relative logit error {err}",
            o.seq,
            o.pos
        );
    }
    println!(
        "{arch:?}: {} logit rows, max relative error {worst:.2e}",
        observed.len()
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn llama_paged_equals_reference() {
    check_arch(Arch::Llama);
}

#[test]
fn mistral_paged_equals_reference() {
    check_arch(Arch::Mistral);
}

#[test]
fn qwen2_with_qkv_bias_paged_equals_reference() {
    check_arch(Arch::Qwen2);
}

#[test]
fn qwen3_with_qk_norm_paged_equals_reference() {
    check_arch(Arch::Qwen3);
}
