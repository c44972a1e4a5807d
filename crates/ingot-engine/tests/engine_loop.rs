//! The engine thread: concurrent submitters get the same outputs as offline generation,
//! admission errors come back synchronously, and dropped receivers abort their requests.

use ingot_backend::cpu::CpuBackend;
use ingot_core::SamplingParams;
use ingot_engine::{Engine, EngineConfig, EngineHandle};
use ingot_model::synthetic::SyntheticSpec;
use ingot_model::{Arch, WeightDType};
use std::sync::Arc;

fn engine(dir: &std::path::Path) -> Engine<CpuBackend> {
    let backend = CpuBackend::new(Some(1)).unwrap();
    let (model, tok) = ingot_model::load(&backend, dir, WeightDType::F32).unwrap();
    let config = EngineConfig {
        max_num_batched_tokens: 32,
        max_num_seqs: 4,
        kv_cache_memory: Some(64 * 2 * 4 * 16 * 64 * 2),
        ..Default::default()
    };
    Engine::new(backend, model, Arc::new(tok), config).unwrap()
}

#[test]
fn concurrent_requests_match_offline_generation_and_disconnects_free_blocks() {
    let dir = std::env::temp_dir().join(format!("ingot-loop-{}", std::process::id()));
    SyntheticSpec::tiny(Arch::Llama).write(&dir).unwrap();
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|i| (0..(5 + 7 * i)).map(|t| 2 + (t * 13 + i) % 90).collect())
        .collect();
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(12)
    };
    let want = engine(&dir)
        .generate(prompts.clone(), &vec![params.clone(); prompts.len()])
        .unwrap();

    let handle = EngineHandle::spawn(engine(&dir));
    let threads: Vec<_> = prompts
        .iter()
        .cloned()
        .map(|p| {
            let (h, params) = (handle.clone(), params.clone());
            std::thread::spawn(move || {
                let (_, mut rx) = h.add_request(p, params).unwrap();
                let mut tokens = vec![];
                while let Some(e) = rx.blocking_recv() {
                    tokens.extend(e.unwrap().token_ids);
                }
                tokens
            })
        })
        .collect();
    for (t, w) in threads.into_iter().zip(&want) {
        assert_eq!(t.join().unwrap(), w.completions[0].token_ids);
    }

    let err = handle
        .add_request(vec![1; 600], params.clone())
        .unwrap_err();
    assert!(err.to_string().contains("maximum context length"), "{err}");
    let err = handle
        .add_request(
            vec![1],
            SamplingParams {
                top_p: 2.0,
                ..params.clone()
            },
        )
        .unwrap_err();
    assert!(err.to_string().contains("top_p"), "{err}");

    // Clients that go away mid-stream: their requests are aborted and their blocks freed.
    for _ in 0..20 {
        let (_, mut rx) = handle
            .add_request(
                prompts[5].clone(),
                SamplingParams {
                    max_tokens: 200,
                    ..params.clone()
                },
            )
            .unwrap();
        rx.blocking_recv().unwrap().unwrap();
        drop(rx);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let s = handle.stats();
        if s.num_running == 0 && s.num_waiting == 0 && s.free_blocks == s.total_blocks {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "blocks still in use: {s:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    drop(handle);
    std::fs::remove_dir_all(&dir).ok();
}
