//! The conformance suite (`conformance/mod.rs`) on the CUDA backend: activations, weights
//! and caches in f32, f16 and bf16 (weights in the activation dtype, as cuBLASLt takes
//! them), and the GGUF blocks the backend keeps (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) under f16
//! activations.
//!
//! These need an NVIDIA GPU: run with `--ignored` on the GPU machine (scripts/gpu/run).
#![cfg(feature = "cuda")]

mod conformance;

use conformance::{Dtypes, FLOATS};
use ingot_backend::cuda::CudaBackend;
use ingot_backend::{Backend, DType};

const DTYPES: Dtypes = Dtypes {
    activations: &FLOATS,
    weights: |a| vec![a],
    caches: |_| FLOATS.to_vec(),
    product_inputs: conformance::as_given,
};

/// The block formats the backend keeps (GGUF's and FP8), which run under f16 activations.
const BLOCK_DTYPES: Dtypes = Dtypes {
    activations: &[DType::F16],
    weights: |_| {
        vec![
            DType::Q8_0,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q4K,
            DType::Q6K,
            DType::Fp8,
        ]
    },
    caches: |_| vec![DType::F16],
    product_inputs: conformance::as_given,
};

fn gpu() -> CudaBackend {
    CudaBackend::new(0).unwrap_or_else(|e| panic!("these tests need a CUDA GPU: {e:#}"))
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn row_ops_match_the_cpu() {
    conformance::row_ops_match_the_cpu(&gpu(), &DTYPES);
}

/// Every op that reads a matrix, on the block formats (GGUF's and FP8): products of 1 to
/// 257 rows (the GEMV's dequantization in registers, and the f16 scratch past it), with bias
/// and into columns of a wider output, the MLPs, the residual-stream ops and the embedding
/// gather.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gguf_blocks_match_the_cpu() {
    let g = gpu();
    conformance::matmul_matches_the_cpu_and_writes_only_its_columns(&g, &BLOCK_DTYPES);
    conformance::silu_mul_matmul_matches_the_cpu(&g, &BLOCK_DTYPES);
    conformance::gated_mlp_matches_the_cpu(&g, &BLOCK_DTYPES);
    conformance::residual_stream_ops_match_the_cpu(&g, &BLOCK_DTYPES);
    conformance::row_ops_match_the_cpu(&g, &BLOCK_DTYPES);
}

/// Prefill products of a block matrix larger than the f16 scratch it is dequantized into,
/// which run in runs of rows (apart from `gguf_blocks_match_the_cpu`, as memcheck takes long
/// over a matrix of this size).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn large_block_products_match_the_cpu() {
    conformance::large_matmul_matches_the_cpu(&gpu(), &BLOCK_DTYPES);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn rope_qk_norm_and_kv_write_match_the_cpu() {
    conformance::rope_qk_norm_and_kv_write_match_the_cpu(&gpu(), &DTYPES);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn matmul_matches_the_cpu_and_writes_only_its_columns() {
    conformance::matmul_matches_the_cpu_and_writes_only_its_columns(&gpu(), &DTYPES);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn silu_mul_matmul_matches_the_cpu() {
    conformance::silu_mul_matmul_matches_the_cpu(&gpu(), &DTYPES);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gated_mlp_matches_the_cpu() {
    conformance::gated_mlp_matches_the_cpu(&gpu(), &DTYPES);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn attention_input_matches_the_cpu() {
    conformance::attention_input_matches_the_cpu(&gpu(), &DTYPES);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn residual_stream_ops_match_the_cpu() {
    conformance::residual_stream_ops_match_the_cpu(&gpu(), &DTYPES);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn paged_attention_matches_the_cpu() {
    conformance::paged_attention_matches_the_cpu(&gpu(), &DTYPES);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn decode_attention_does_not_depend_on_the_batch() {
    conformance::decode_attention_does_not_depend_on_the_batch(&gpu(), DType::BF16, DType::BF16);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn argmax_picks_the_first_maximum_like_the_cpu() {
    conformance::argmax_picks_the_first_maximum_like_the_cpu(&gpu());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sampling_picks_the_cpu_reference_token() {
    conformance::sampling_picks_the_cpu_reference_token(&gpu(), true);
}

/// The host buffer is page-locked here: each upload is a DMA behind 50 argmax passes over
/// 39 MB (some hundreds of µs), while the host writes the next round's words.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn host_buffer_uploads_what_was_written() {
    let g = gpu();
    assert!(g.alloc_host(16).unwrap().is_pinned());
    conformance::host_buffer_uploads_what_was_written(&g, 50);
}

/// The products run through cuBLASLt here (more than the GEMV's 4 rows), whose kernels
/// sit in a recorded step between ours, which start early (programmatic dependent launch).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn recorded_products_replay_on_new_inputs() {
    for rows in [8, 16, 64] {
        conformance::recorded_products_replay_on_new_inputs(&gpu(), DType::BF16, rows);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn recorded_steps_replay_on_new_inputs() {
    conformance::recorded_steps_replay_on_new_inputs(&gpu(), DType::BF16);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn moe_ops_match_the_cpu() {
    conformance::moe_ops_match_the_cpu(&gpu(), &DTYPES, true);
}
