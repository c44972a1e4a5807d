//! The conformance suite (`conformance/mod.rs`) on the wgpu backend: f32 activations,
//! f32/f16/bf16 and GGUF Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K weights, f32/f16/bf16 KV caches,
//! once with the adapter's SHADER_F16 and SUBGROUP features and once without (packed f16
//! pairs, workgroup-memory reductions).
//!
//! They run on the first adapter wgpu finds: Mesa's lavapipe in CI (`make test` installs
//! it), a GPU through Vulkan or Metal elsewhere. Without any adapter they fail.
#![cfg(feature = "wgpu")]

mod conformance;

use conformance::{Dtypes, FLOATS};
use ingot_backend::wgpu::{self, shader, CooperativeMatrices, Options, WgpuBackend};
use ingot_backend::{DType, QkvLayout};

const DTYPES: Dtypes = Dtypes {
    activations: &[DType::F32],
    weights: |_| [&FLOATS[..], shader::BLOCKS].concat(),
    caches: |_| FLOATS.to_vec(),
    product_inputs: conformance::as_given,
};

/// The same, for products on cooperative matrices.
const COOP_DTYPES: Dtypes = Dtypes {
    product_inputs: wgpu::cooperative_product_inputs,
    ..DTYPES
};

/// The backend with every feature it uses by default (or as INGOT_WGPU_* set them);
/// without cooperative matrices, where it has them; and with no feature at all. Each with the dtypes its products take.
fn backends() -> Vec<(WgpuBackend, &'static Dtypes)> {
    let open = |o: Options| {
        let b = WgpuBackend::new(0, o).unwrap_or_else(|e| panic!("no wgpu adapter: {e:#}"));
        println!(
            "{} with {:?}",
            ingot_backend::Backend::name(&b),
            b.features()
        );
        b
    };
    // INGOT_WGPU_COOPERATIVE_MATRIX=1 asks for them on lavapipe (make test's run on
    // scripts/fetch-coop-lavapipe), and fails here where they are missing.
    let all = open(Options::from_env().unwrap());
    let mut out = vec![];
    if all.features().cooperative_matrix.is_some() {
        out.push((all, &COOP_DTYPES));
        let without = Options {
            cooperative_matrix: CooperativeMatrices::Off,
            ..Options::default()
        };
        out.push((open(without), &DTYPES));
    } else {
        out.push((all, &DTYPES));
    }
    let none = Options {
        shader_f16: false,
        subgroup: false,
        cooperative_matrix: CooperativeMatrices::Off,
        ..Options::default()
    };
    out.push((open(none), &DTYPES));
    out
}

#[test]
fn row_ops_match_the_cpu() {
    for (g, d) in backends() {
        conformance::row_ops_match_the_cpu(&g, d);
    }
}

#[test]
fn rope_qk_norm_and_kv_write_match_the_cpu() {
    for (g, d) in backends() {
        conformance::rope_qk_norm_and_kv_write_match_the_cpu(&g, d);
    }
}

#[test]
fn matmul_matches_the_cpu_and_writes_only_its_columns() {
    for (g, d) in backends() {
        conformance::matmul_matches_the_cpu_and_writes_only_its_columns(&g, d);
    }
}

/// Decode batches go through the wide GEMV, whose sums per row do not depend on the other
/// rows: up to 64 rows, or 8 where products past them run on cooperative matrices.
#[test]
fn decode_matmul_rows_do_not_depend_on_the_batch() {
    for (g, _) in backends() {
        let rows = g.batch_invariant_rows();
        conformance::decode_matmul_rows_do_not_depend_on_the_batch(&g, rows);
    }
}

#[test]
fn silu_mul_matmul_matches_the_cpu() {
    for (g, d) in backends() {
        conformance::silu_mul_matmul_matches_the_cpu(&g, d);
    }
}

#[test]
fn gated_mlp_matches_the_cpu() {
    for (g, d) in backends() {
        conformance::gated_mlp_matches_the_cpu(&g, d);
    }
}

#[test]
fn attention_input_matches_the_cpu() {
    for (g, d) in backends() {
        conformance::attention_input_matches_the_cpu(&g, d);
    }
}

#[test]
fn residual_stream_ops_match_the_cpu() {
    for (g, d) in backends() {
        conformance::residual_stream_ops_match_the_cpu(&g, d);
    }
}

#[test]
fn paged_attention_matches_the_cpu() {
    for (g, d) in backends() {
        conformance::paged_attention_matches_the_cpu(&g, d);
    }
}

/// Shapes the tiled attention kernels do not take (a query group of 16 heads, head_dim
/// not a multiple of 8) run through the general one; head_dim 256 takes the decode
/// kernel's 16-key tiles and the general prefill kernel.
#[test]
fn attention_of_other_shapes_matches_the_cpu() {
    let layouts = [
        QkvLayout {
            num_heads: 16,
            num_kv_heads: 1,
            head_dim: 64,
        },
        QkvLayout {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 36,
        },
        QkvLayout {
            num_heads: 4,
            num_kv_heads: 1,
            head_dim: 256,
        },
    ];
    for (g, d) in backends() {
        conformance::paged_attention_matches_the_cpu_in(&g, d, &layouts);
    }
}

/// A device limited to Metal's 32 KiB of workgroup memory: decode attention runs its
/// shorter key tiles (16 keys for head_dim 64 and 128, 8 for 256; that they fit is checked
/// statically in `shader.rs`, as lavapipe does not enforce the limit) and still matches
/// the CPU.
#[test]
fn decode_attention_fits_32_kib_of_workgroup_memory() {
    let small = Options {
        max_workgroup_memory: Some(32 << 10),
        ..Options::default()
    };
    let g = WgpuBackend::new(0, small).unwrap_or_else(|e| panic!("no wgpu adapter: {e:#}"));
    // One KV head at 256, so that the longest contexts fit lavapipe's 128 MiB binding.
    let layouts = [(8, 2, 64), (8, 2, 128), (4, 1, 256)].map(|(q, kv, head_dim)| QkvLayout {
        num_heads: q,
        num_kv_heads: kv,
        head_dim,
    });
    conformance::paged_attention_matches_the_cpu_in(&g, &DTYPES, &layouts);
}

#[test]
fn decode_attention_does_not_depend_on_the_batch() {
    for (g, _) in backends() {
        conformance::decode_attention_does_not_depend_on_the_batch(&g, DType::F32, DType::F16);
    }
}

#[test]
fn argmax_picks_the_first_maximum_like_the_cpu() {
    for (g, _) in backends() {
        conformance::argmax_picks_the_first_maximum_like_the_cpu(&g);
    }
}

#[test]
fn sampling_picks_the_cpu_reference_token() {
    for (g, _) in backends() {
        conformance::sampling_picks_the_cpu_reference_token(&g, false);
    }
}

#[test]
fn host_buffer_uploads_what_was_written() {
    for (g, _) in backends() {
        conformance::host_buffer_uploads_what_was_written(&g, 1);
    }
}

#[test]
fn recorded_steps_replay_on_new_inputs() {
    for (g, _) in backends() {
        conformance::recorded_steps_replay_on_new_inputs(&g, DType::F32);
    }
}

#[test]
fn moe_ops_match_the_cpu() {
    for (g, d) in backends() {
        conformance::moe_ops_match_the_cpu(&g, d, false);
    }
}
