//! Embeddings on the CPU: a tiny random Qwen3 with last-token, mean and CLS pooling
//! against transformers' vectors, and what a pooled input must not depend on.

mod common;

use common::*;
use ingot_backend::cpu::CpuBackend;
use ingot_model::synthetic::SyntheticSpec;
use ingot_model::{Arch, PoolingType};

fn cpu() -> CpuBackend {
    CpuBackend::new(None).unwrap()
}

#[test]
fn pooled_vectors_match_transformers() {
    embeddings_match_transformers(cpu, 0.99999, 1e-6);
}

/// A last-token vector is the same (within 1e-6) whether the input's prefix comes from the
/// cache or not, whatever the chunk size.
#[test]
fn last_token_vectors_survive_the_prefix_cache_and_chunking() {
    let dir = std::env::temp_dir().join(format!("ingot-embed-inv-{}", std::process::id()));
    let spec = SyntheticSpec::tiny(Arch::Qwen3);
    spec.write(&dir).unwrap();
    ingot_model::pooling::write_sentence_transformers(&dir, PoolingType::Last, true, 64).unwrap();
    let inputs = random_seqs(5, &[40, 200, 3, 97], spec.vocab_size);
    let mut plain = embedding_engine(cpu(), &dir, 512, false);
    let want: Vec<Vec<f32>> = inputs
        .iter()
        .map(|i| plain.embed(vec![i.clone()], None).unwrap().remove(0))
        .collect();
    let close = |got: &[Vec<f32>], what: &str| {
        for (g, w) in got.iter().zip(&want) {
            let d = g
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(d <= 1e-6, "{what}: differs by {d}");
        }
    };
    // The same inputs twice: the second time their full blocks are cache hits.
    let mut cached = embedding_engine(cpu(), &dir, 512, true);
    cached.embed(inputs.clone(), None).unwrap();
    let hits_before = cached.stats().prefix_cache_hits;
    close(&cached.embed(inputs.clone(), None).unwrap(), "prefix cache");
    assert!(cached.stats().prefix_cache_hits > hits_before);
    close(
        &embedding_engine(cpu(), &dir, 7, false)
            .embed(inputs.clone(), None)
            .unwrap(),
        "chunks of 7",
    );
    std::fs::remove_dir_all(&dir).ok();
}
