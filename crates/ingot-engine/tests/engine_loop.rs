//! The engine thread: concurrent submitters get the same outputs as offline generation,
//! admission errors come back synchronously, and dropped receivers abort their requests.

use ingot_backend::cpu::CpuBackend;
use ingot_core::SamplingParams;
use ingot_engine::{Engine, EngineConfig, EngineHandle, Failure, SubmitError};
use ingot_model::synthetic::SyntheticSpec;
use ingot_model::{Arch, WeightDType};
use std::sync::Arc;

fn engine_with(dir: &std::path::Path, config: EngineConfig) -> Engine<CpuBackend> {
    let backend = CpuBackend::new(Some(1)).unwrap();
    let (model, tok) = ingot_model::load(&backend, dir, WeightDType::F32).unwrap();
    Engine::new(backend, model, Arc::new(tok), config).unwrap()
}

fn engine(dir: &std::path::Path) -> Engine<CpuBackend> {
    let config = EngineConfig {
        max_num_batched_tokens: 32,
        max_num_seqs: Some(4),
        kv_cache_memory: Some(64 * 2 * 4 * 16 * 64 * 2),
        ..Default::default()
    };
    engine_with(dir, config)
}

/// Waits until the engine holds no request, sequence or block.
fn wait_idle(handle: &EngineHandle) -> ingot_engine::EngineStats {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let s = handle.stats();
        if s.num_running == 0
            && s.num_waiting == 0
            && s.num_requests_running == 0
            && s.num_requests_waiting == 0
            && s.free_blocks == s.total_blocks
        {
            return s;
        }
        assert!(std::time::Instant::now() < deadline, "still busy: {s:?}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
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
    wait_idle(&handle);
    drop(handle);
    std::fs::remove_dir_all(&dir).ok();
}

/// A queued request whose receiver is dropped goes before it ever runs, all its samples
/// with it; the waiting limit counts samples; draining aborts what has not started.
#[test]
fn queued_requests_go_when_abandoned_and_on_drain() {
    let dir = std::env::temp_dir().join(format!("ingot-loop-queue-{}", std::process::id()));
    SyntheticSpec::tiny(Arch::Llama).write(&dir).unwrap();
    let config = EngineConfig {
        max_num_seqs: Some(1),
        max_waiting: Some(6),
        kv_cache_memory: Some(1 << 22),
        ..Default::default()
    };
    let handle = EngineHandle::spawn(engine_with(&dir, config));
    let long = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(60)
    };
    let four_samples = SamplingParams {
        n: 4,
        ..long.clone()
    };
    let (_, mut running) = handle.add_request(vec![5; 7], long.clone()).unwrap();
    let (_, queued) = handle
        .add_request(vec![6; 11], four_samples.clone())
        .unwrap();
    drop(queued);
    let mut tokens = 0;
    while let Some(e) = running.blocking_recv() {
        tokens += e.unwrap().token_ids.len();
    }
    assert_eq!(tokens, 60);
    // Only the running request's prompt was ever looked up in the prefix cache.
    assert_eq!(wait_idle(&handle).prefix_cache_queries, 7);

    // Four samples wait behind the running one: two more fit, three do not.
    let (_, mut running) = handle.add_request(vec![5; 7], long.clone()).unwrap();
    let mut tokens = running.blocking_recv().unwrap().unwrap().token_ids.len();
    let (_, mut queued) = handle.add_request(vec![6; 11], four_samples).unwrap();
    let err = handle
        .add_request(
            vec![7; 3],
            SamplingParams {
                n: 3,
                ..long.clone()
            },
        )
        .unwrap_err();
    assert!(matches!(err, SubmitError::AtCapacity(_)), "{err}");
    let (_, mut fits) = handle
        .add_request(
            vec![7; 3],
            SamplingParams {
                n: 2,
                ..long.clone()
            },
        )
        .unwrap();
    handle.drain();
    for rx in [&mut queued, &mut fits] {
        assert!(matches!(
            rx.blocking_recv(),
            Some(Err(Failure::ShuttingDown))
        ));
        assert!(rx.blocking_recv().is_none());
    }
    let err = handle.add_request(vec![5], long.clone()).unwrap_err();
    assert!(matches!(err, SubmitError::ShuttingDown), "{err}");
    while let Some(e) = running.blocking_recv() {
        tokens += e.unwrap().token_ids.len();
    }
    assert_eq!(tokens, 60, "the running request finishes");
    wait_idle(&handle);
    drop(handle);
    std::fs::remove_dir_all(&dir).ok();
}
