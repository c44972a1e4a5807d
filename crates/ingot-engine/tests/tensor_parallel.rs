//! Tensor parallelism on CPU ranks ([`ingot_backend::cpu::HostGroup`]): a model split over
//! 2 or 4 ranks gives the logits and tokens of the whole model on one device.

mod common;

use ingot_backend::cpu::CpuBackend;
use ingot_engine::StepInput;
use ingot_model::synthetic::SyntheticSpec;
use ingot_model::{Arch, WeightDType};

fn cpus(n: usize) -> Vec<CpuBackend> {
    (0..n).map(|_| CpuBackend::new(Some(1)).unwrap()).collect()
}

/// Llama's plain heads, Qwen2's q/k/v biases (split with their heads) and Qwen3's q/k
/// norms (run on each rank's heads).
#[test]
fn models_split_over_two_ranks_equal_one_device() {
    common::tensor_parallel_matches_one_device(
        cpus,
        2,
        &[Arch::Llama, Arch::Qwen2, Arch::Qwen3],
        1e-5,
    );
}

/// `--quantization fp8` over two ranks: each rank quantizes its own share, whose column
/// cuts (o_proj's heads, down_proj's MLP width) fall on whole 128-value blocks, so its
/// blocks are the one-device model's and the split model equals it to summation order.
#[test]
fn fp8_models_split_over_two_ranks_equal_one_device() {
    let spec = SyntheticSpec {
        hidden_size: 256,
        intermediate_size: 512,
        num_heads: 8,
        num_kv_heads: 2,
        head_dim: 32,
        ..SyntheticSpec::tiny(Arch::Llama)
    };
    let dir = std::env::temp_dir().join(format!("ingot-tp2-fp8-{}", std::process::id()));
    spec.write(&dir).unwrap();
    let seqs = common::random_seqs(5, &[1, 15, 17, 40], spec.vocab_size);
    let mut whole = common::tensor_parallel_runner(cpus(1), &dir, WeightDType::Fp8);
    assert_eq!(whole.model.weights.matrix_dtype, ingot_backend::DType::Fp8);
    let mut split = common::tensor_parallel_runner(cpus(2), &dir, WeightDType::Fp8);
    let (rows, worst) = common::mixed_logit_error(&mut whole, &mut split, &seqs);
    std::fs::remove_dir_all(&dir).ok();
    println!("fp8 over 2 ranks: {rows} logit rows, max relative error {worst:.2e}");
    assert!(
        worst <= 1e-5,
        "fp8 over 2 ranks: relative logit error {worst}"
    );
}

/// Four ranks: one attention head and one KV head each.
#[test]
fn models_split_over_four_ranks_equal_one_device() {
    common::tensor_parallel_matches_one_device(
        cpus,
        4,
        &[Arch::Llama, Arch::Qwen2, Arch::Qwen3],
        1e-5,
    );
}

/// Ranks that fold the norms into the products (as CUDA does): the first adds its partial
/// sums into the residual stream, the others write theirs in its place.
#[test]
fn ranks_folding_norms_equal_one_device() {
    let folding = |n| {
        (0..n)
            .map(|_| CpuBackend::new(Some(1)).unwrap().folding_norm_weights(true))
            .collect()
    };
    common::tensor_parallel_matches_one_device(
        folding,
        2,
        &[Arch::Llama, Arch::Qwen2, Arch::Qwen3],
        1e-5,
    );
}

/// A rank that fails aborts its group (as a peer's runner does with its error): the other
/// ranks' collectives return instead of waiting for it, and the step fails with the cause.
#[test]
fn an_aborted_group_fails_the_step_with_the_cause_instead_of_hanging() {
    let spec = SyntheticSpec::tiny(Arch::Llama);
    let dir = std::env::temp_dir().join(format!("ingot-tp-abort-{}", std::process::id()));
    spec.write(&dir).unwrap();
    let mut r = common::tensor_parallel_runner(cpus(2), &dir, WeightDType::F32);
    std::fs::remove_dir_all(&dir).ok();
    let prompt = StepInput {
        token_ids: vec![5, 7, 9],
        positions: vec![0, 1, 2],
        slot_mapping: vec![0, 1, 2],
        query_start_loc: vec![0, 3],
        seq_lens: vec![3],
        block_tables: vec![0],
        max_blocks_per_seq: 1,
        logits_indices: vec![2],
    };
    assert_eq!(r.execute(&prompt).unwrap().len(), spec.vocab_size);
    r.model
        .collective
        .as_ref()
        .unwrap()
        .abort("injected failure");
    let err = r.execute(&prompt).unwrap_err();
    assert_eq!(
        format!("{err:#}"),
        "tensor-parallel group stopped: rank 0: injected failure"
    );
}

/// Mixtures of experts: every expert split by its width, the router whole on every rank;
/// on plain ranks and on ranks that fold the norms (the first adds into the residual
/// stream, the others write in its place).
#[test]
fn mixtures_of_experts_split_over_ranks_equal_one_device() {
    let archs = [Arch::Qwen3Moe, Arch::Mixtral];
    common::tensor_parallel_matches_one_device(cpus, 2, &archs, 1e-5);
    common::tensor_parallel_matches_one_device(cpus, 4, &archs, 1e-5);
    let folding = |n| {
        (0..n)
            .map(|_| CpuBackend::new(Some(1)).unwrap().folding_norm_weights(true))
            .collect()
    };
    common::tensor_parallel_matches_one_device(folding, 2, &archs, 1e-5);
}

/// Four ranks over two KV heads: each KV head on the two ranks whose query heads read it.
#[test]
fn ranks_past_the_kv_heads_replicate_them() {
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
        let spec = SyntheticSpec {
            num_heads: 8,
            num_kv_heads: 2,
            ..SyntheticSpec::tiny(arch)
        };
        common::spec_over_ranks_matches_one_device(cpus, 4, &spec, 1e-5);
    }
}
