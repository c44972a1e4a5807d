//! The all-reduce of a tensor-parallel group of GPUs (`INGOT_TP_GPUS` of them, 2 unless
//! set): the one-shot kernel over peer memory for small messages and NCCL for the others,
//! run eagerly and replayed from CUDA graphs, against the sum on the host; and a rank
//! waiting in the one-shot kernel for a peer that never comes, released by the abort.
//!
//! These need several NVIDIA GPUs and NCCL: run with `--ignored` on the GPU machine.
#![cfg(feature = "cuda")]

use half::{bf16, f16};
use ingot_backend::cuda::CudaBackend;
use ingot_backend::{Backend, Collective, DType};
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest message of the one-shot path (its default `INGOT_ONE_SHOT_MAX_BYTES`).
const ONE_SHOT_MAX_BYTES: usize = 1 << 20;

fn group() -> (Vec<CudaBackend>, Vec<Arc<dyn Collective<CudaBackend>>>) {
    let n = std::env::var("INGOT_TP_GPUS").map_or(2, |v| v.parse().unwrap());
    let gpus: Vec<CudaBackend> = (0..n)
        .map(|i| CudaBackend::new(i).unwrap_or_else(|e| panic!("this test needs {n} GPUs: {e:#}")))
        .collect();
    let ranks = CudaBackend::tensor_parallel_group(&gpus).expect("a group of the GPUs");
    (gpus, ranks)
}

/// `values` as the bytes of a `dtype` buffer, and the values the buffer then holds.
fn encode(values: &[f32], dtype: DType) -> (Vec<u8>, Vec<f32>) {
    match dtype {
        DType::F32 => (bytemuck::cast_slice(values).to_vec(), values.to_vec()),
        DType::BF16 => {
            let h: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
            (
                bytemuck::cast_slice(&h).to_vec(),
                h.iter().map(|v| v.to_f32()).collect(),
            )
        }
        DType::F16 => {
            let h: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
            (
                bytemuck::cast_slice(&h).to_vec(),
                h.iter().map(|v| v.to_f32()).collect(),
            )
        }
        other => panic!("no all-reduce of {other}"),
    }
}

/// Each element's f32 sum over the ranks in rank order, rounded once to `dtype`.
fn rank_order_sum(held: &[Vec<f32>], dtype: DType) -> Vec<f32> {
    let sums: Vec<f32> = (0..held[0].len())
        .map(|i| held.iter().fold(0f32, |acc, r| acc + r[i]))
        .collect();
    encode(&sums, dtype).1
}

/// Every rank's result for one message of `numel` values, `calls` times with new values
/// each time: eagerly, or through `run_recorded` (captured on the first call, replayed
/// after) under `key`.
fn check(
    gpus: &[CudaBackend],
    ranks: &[Arc<dyn Collective<CudaBackend>>],
    dtype: DType,
    numel: usize,
    graph: Option<u64>,
) {
    let n = gpus.len();
    let mut rng = rand::rngs::StdRng::seed_from_u64(numel as u64);
    let mut bufs: Vec<_> = gpus
        .iter()
        .map(|g| g.alloc(dtype, numel).unwrap())
        .collect();
    let one_shot =
        dtype.bytes_for(numel) <= ONE_SHOT_MAX_BYTES && dtype.bytes_for(numel).is_multiple_of(16);
    for call in 0..3 {
        let held: Vec<Vec<f32>> = (0..n)
            .map(|_| {
                let values: Vec<f32> = (0..numel).map(|_| rng.random_range(-4.0..4.0)).collect();
                encode(&values, dtype).1
            })
            .collect();
        for ((g, buf), values) in gpus.iter().zip(&mut bufs).zip(&held) {
            g.upload(buf, &encode(values, dtype).0).unwrap();
            g.synchronize().unwrap();
        }
        let want = rank_order_sum(&held, dtype);
        let got: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = gpus
                .iter()
                .zip(&mut bufs)
                .zip(ranks)
                .map(|((g, buf), rank)| {
                    s.spawn(move || {
                        let mut reduce = || rank.all_reduce_sum(g, buf, dtype, numel);
                        match graph {
                            Some(key) => g.run_recorded(key, &mut reduce).unwrap(),
                            None => reduce(),
                        }
                        g.synchronize().unwrap();
                        g.download_f32(buf, numel).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, got) in got.iter().enumerate() {
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                // The one-shot kernel adds in rank order in f32 as `rank_order_sum` does;
                // NCCL picks its order, so over more than two ranks its sum may round
                // otherwise.
                let ok = if one_shot || n == 2 {
                    g.to_bits() == w.to_bits()
                } else {
                    (g - w).abs() <= 4.0 * n as f32 * f32::from(bf16::EPSILON)
                };
                assert!(
                    ok,
                    "{dtype} x {numel} ({}), call {call}, rank {r}, element {i}: {g} != {w}",
                    if graph.is_some() { "graph" } else { "eager" }
                );
            }
        }
    }
}

#[test]
#[ignore = "needs several NVIDIA GPUs"]
fn all_reduce_sums_every_size_eagerly_and_in_graphs() {
    let (gpus, ranks) = group();
    // One row of 8B and 70B shapes, 64 rows of them, odd sizes (a tail under a 16-byte
    // vector goes to NCCL), and messages past the one-shot limit.
    let cases = [
        (DType::BF16, 8),
        (DType::BF16, 4096),
        (DType::BF16, 8192),
        (DType::BF16, 4100),
        (DType::BF16, 64 * 4096),
        (DType::BF16, 64 * 8192),
        (DType::BF16, 1 << 20),
        (DType::F16, 4096 * 3),
        (DType::F32, 4),
        (DType::F32, 4096),
        (DType::F32, 1_000_003),
    ];
    for (key, &(dtype, numel)) in cases.iter().enumerate() {
        println!("{dtype} x {numel}: eager");
        check(&gpus, &ranks, dtype, numel, None);
        println!("{dtype} x {numel}: graph");
        check(&gpus, &ranks, dtype, numel, Some(key as u64));
    }
    println!("every size summed");
    // The graphs holding NCCL's calls go before the communicators.
    drop(gpus);
    drop(ranks);
}

#[test]
#[ignore = "needs several NVIDIA GPUs"]
fn abort_releases_a_rank_waiting_for_its_peers() {
    let (gpus, ranks) = group();
    let mut buf = gpus[0].alloc(DType::BF16, 4096).unwrap();
    // Rank 0 enters the one-shot kernel; no other rank does.
    ranks[0].all_reduce_sum(&gpus[0], &mut buf, DType::BF16, 4096);
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    ranks[1].abort("test: rank 1 never joins");
    gpus[0]
        .synchronize()
        .expect("rank 0's stream after the abort");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "rank 0 returned {:?} after the abort",
        start.elapsed()
    );
    assert_eq!(
        ranks[0].failure().as_deref(),
        Some("rank 1: test: rank 1 never joins")
    );
    // A failed group's device memory is left to the process's exit, as the engine does.
    std::mem::forget(buf);
    std::mem::forget(ranks);
    std::mem::forget(gpus);
}
