//! Every architecture, as a tiny random HF directory: the paged forward over mixed batches
//! equals the plain reference forward.

mod common;

use ingot_model::reference::ReferenceModel;
use ingot_model::synthetic::{Dtype, SyntheticSpec};
use ingot_model::{Arch, Checkpoint, WeightDType};

fn temp_dir(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("ingot-synthetic-{tag}-{}", std::process::id()))
}

fn check_arch(arch: Arch) {
    let spec = SyntheticSpec::tiny(arch);
    let dir = temp_dir(&format!("{arch:?}"));
    spec.write(&dir).unwrap();
    check(&spec, &dir, &dir, WeightDType::F32);
    std::fs::remove_dir_all(&dir).ok();
}

/// The paged runner on the checkpoint in `dir` (loaded as `dtype`) against the reference
/// forward of the checkpoint in `reference_dir`.
fn check(
    spec: &SyntheticSpec,
    dir: &std::path::Path,
    reference_dir: &std::path::Path,
    dtype: WeightDType,
) {
    let arch = spec.arch;
    let reference = ReferenceModel::load(&Checkpoint::open(reference_dir).unwrap()).unwrap();
    let mut runner = common::runner(dir, dtype, 24, 4, 512, 64);
    // Lengths around the 16-token block boundary and beyond two blocks.
    let seqs = common::random_seqs(9, &[1, 15, 16, 17, 40, 33], spec.vocab_size);
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
    std::fs::remove_dir_all(dir).ok();
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

#[test]
fn qwen3_moe_experts_and_a_dense_layer_paged_equal_reference() {
    check_arch(Arch::Qwen3Moe);
}

#[test]
fn mixtral_experts_paged_equal_reference() {
    check_arch(Arch::Mixtral);
}

#[test]
fn sharded_bf16_and_f16_checkpoints_run_in_their_own_dtype() {
    for (arch, dtype) in [(Arch::Llama, Dtype::BF16), (Arch::Qwen2, Dtype::F16)] {
        let spec = SyntheticSpec {
            dtype,
            shards: 3,
            ..SyntheticSpec::tiny(arch)
        };
        let dir = temp_dir(&format!("{arch:?}-{dtype:?}-sharded"));
        spec.write(&dir).unwrap();
        assert!(dir.join("model.safetensors.index.json").exists());
        // `auto` keeps bf16/f16 weights; the reference reads the same values as f32.
        check(&spec, &dir, &dir, WeightDType::Auto);
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn dtype_flag_converts_f32_checkpoints_at_load() {
    for (target, stored) in [
        (WeightDType::F16, Dtype::F16),
        (WeightDType::BF16, Dtype::BF16),
    ] {
        let spec = SyntheticSpec::tiny(Arch::Qwen3);
        let (f32_dir, low_dir) = (
            temp_dir(&format!("f32-for-{stored:?}")),
            temp_dir(&format!("stored-{stored:?}")),
        );
        spec.write(&f32_dir).unwrap();
        SyntheticSpec {
            dtype: stored,
            ..SyntheticSpec::tiny(Arch::Qwen3)
        }
        .write(&low_dir)
        .unwrap();
        // Converting at load must give exactly the weights a checkpoint stored in that dtype has.
        check(&spec, &f32_dir, &low_dir, target);
        std::fs::remove_dir_all(&f32_dir).ok();
        std::fs::remove_dir_all(&low_dir).ok();
    }
}

/// `--quantization fp8` on the CPU: the projections become FP8 blocks and the embedding
/// table and output projection stay as stored, so logits move from the f32 model's by e4m3's
/// rounding (3 mantissa bits: a few percent), not by a misplaced scale's (order one); a
/// 16-bit checkpoint quantizes from its own values.
#[test]
fn fp8_quantization_at_load_stays_near_the_f32_model() {
    use ingot_backend::DType;
    for (arch, stored, kept) in [
        (Arch::Llama, Dtype::F32, DType::F32),
        (Arch::Qwen2, Dtype::BF16, DType::BF16),
        (Arch::Qwen3, Dtype::F32, DType::F32),
    ] {
        let spec = SyntheticSpec {
            dtype: stored,
            ..common::fp8_spec(arch)
        };
        let dir = temp_dir(&format!("fp8-{arch:?}"));
        spec.write(&dir).unwrap();
        let seqs = common::random_seqs(5, &[1, 16, 17, 40], spec.vocab_size);
        let mut plain = common::runner(&dir, WeightDType::F32, 24, 4, 512, 64);
        let mut fp8 = common::runner(&dir, WeightDType::Fp8, 24, 4, 512, 64);
        let w = &fp8.model.weights;
        assert_eq!(w.matrix_dtype, DType::Fp8);
        assert_eq!(w.embed.parts[0].weight.dtype(), kept, "{arch:?}");
        assert_eq!(w.layers[0].qkv.parts[0].weight.dtype(), DType::Fp8);
        let (rows, worst) = common::mixed_logit_error(&mut plain, &mut fp8, &seqs);
        println!("{arch:?} {stored:?} fp8: {rows} logit rows, max relative error {worst:.2e}");
        assert!(worst <= 0.1, "{arch:?}: relative logit error {worst}");
        assert!(
            worst >= 1e-3,
            "{arch:?}: {worst}: the matrices were not quantized"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// Checkpoints published in FP8, in each convention of scales (128 × 128 tiles, one a
/// channel, one a tensor; experts too), load as the model they store: their logits equal
/// those of the same values written unquantized, to f32 summation order.
#[test]
fn fp8_checkpoints_load_as_the_model_they_store() {
    use ingot_model::synthetic::{Fp8Scales, SyntheticFp8};
    for (arch, scales) in [
        (Arch::Llama, Fp8Scales::Tile128),
        (Arch::Qwen3, Fp8Scales::Channel),
        (Arch::Qwen2, Fp8Scales::Tensor),
        (Arch::Qwen3Moe, Fp8Scales::Tile128),
    ] {
        let spec = |dequantized| SyntheticSpec {
            experts: Some((4, 2, 128)),
            fp8: Some(SyntheticFp8 {
                scales,
                dequantized,
            }),
            ..common::fp8_spec(arch)
        };
        let (fp8_dir, plain_dir) = (
            temp_dir(&format!("fp8-ckpt-{arch:?}")),
            temp_dir(&format!("fp8-twin-{arch:?}")),
        );
        spec(false).write(&fp8_dir).unwrap();
        spec(true).write(&plain_dir).unwrap();
        let seqs = common::random_seqs(5, &[1, 16, 17, 40], spec(false).vocab_size);
        let mut plain = common::runner(&plain_dir, WeightDType::Auto, 24, 4, 512, 64);
        let mut fp8 = common::runner(&fp8_dir, WeightDType::Auto, 24, 4, 512, 64);
        assert_eq!(fp8.model.weights.matrix_dtype, ingot_backend::DType::Fp8);
        let (rows, worst) = common::mixed_logit_error(&mut plain, &mut fp8, &seqs);
        println!("{arch:?} {scales:?}: {rows} logit rows, max relative error {worst:.2e}");
        assert!(
            worst <= 1e-4,
            "{arch:?} {scales:?}: relative logit error {worst}"
        );
        std::fs::remove_dir_all(&fp8_dir).ok();
        std::fs::remove_dir_all(&plain_dir).ok();
    }
}

/// `--quantization fp8` needs matrices to quantize from: a block-quantized checkpoint is
/// refused, and so is a matrix whose rows are not whole 128-value blocks.
#[test]
fn fp8_quantization_refuses_what_it_cannot_quantize() {
    let dir = temp_dir("fp8-refused");
    SyntheticSpec::tiny(Arch::Llama).write(&dir).unwrap();
    let b = ingot_backend::cpu::CpuBackend::new(Some(1)).unwrap();
    let e = ingot_model::load(&b, &dir, WeightDType::Fp8)
        .err()
        .expect("64 columns are not whole blocks")
        .to_string();
    assert!(e.contains("not whole fp8 blocks"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
    if let Some(gguf) = ingot_model::testing::test_model_path() {
        let e = ingot_model::load(&b, &gguf, WeightDType::Fp8)
            .err()
            .expect("a Q4_1 file")
            .to_string();
        assert!(e.contains("quantizes 16- and 32-bit checkpoints"), "{e}");
    }
}

/// A model loaded with its norm weights folded into the matrices after them (as wgpu loads
/// it) against the same model loaded as is, both on the CPU: at f32 the fold moves logits
/// by f32 rounding; with 16-bit weights by the rounding of `w · g` to the weight dtype
/// (one rounding of each folded weight, the size of the checkpoint's own).
#[test]
fn folded_norms_change_logits_by_rounding_alone() {
    use ingot_backend::cpu::CpuBackend;
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Qwen3Moe] {
        for (stored, tol) in [(Dtype::F32, 1e-5), (Dtype::F16, 1e-3), (Dtype::BF16, 1e-2)] {
            let spec = SyntheticSpec {
                dtype: stored,
                ..SyntheticSpec::tiny(arch)
            };
            let dir = temp_dir(&format!("folded-{arch:?}-{stored:?}"));
            spec.write(&dir).unwrap();
            let seqs = common::random_seqs(5, &[1, 16, 17, 40], spec.vocab_size);
            let auto = WeightDType::Auto;
            let mut plain = common::runner(&dir, auto, 24, 4, 512, 64);
            let folding = CpuBackend::new(None).unwrap().folding_norm_weights(true);
            let mut folded = common::runner_on(folding, &dir, auto, 24, 4, 512, 64);
            assert!(folded.model.weights.unit_norm.is_some());
            let (rows, worst) = common::mixed_logit_error(&mut plain, &mut folded, &seqs);
            println!("{arch:?} {stored:?}: {rows} logit rows, max relative error {worst:.2e}");
            assert!(worst <= tol, "{arch:?} {stored:?}: {worst}");
            std::fs::remove_dir_all(&dir).ok();
        }
    }
}
