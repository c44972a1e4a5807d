//! A tensor-parallel rank that fails (injected with `INGOT_FAIL_RANK`) stops its group: the
//! step's requests get that rank's error, the engine thread ends with it, and later
//! requests are refused, with no rank left waiting. Its own binary, as the variable is read
//! by every group the process starts.

use ingot_backend::cpu::CpuBackend;
use ingot_core::SamplingParams;
use ingot_engine::{Engine, EngineConfig, EngineHandle, SubmitError};
use ingot_model::synthetic::SyntheticSpec;
use ingot_model::{Arch, Checkpoint, Tokenizer, WeightDType};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[test]
fn a_failing_rank_stops_the_engine_with_its_error() {
    std::env::set_var("INGOT_FAIL_RANK", "1:3");
    let dir = std::env::temp_dir().join(format!("ingot-tp-failure-{}", std::process::id()));
    SyntheticSpec::tiny(Arch::Llama).write(&dir).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let devices = (0..2).map(|_| CpuBackend::new(Some(1)).unwrap()).collect();
    let ranks = ingot_model::load_tensor_parallel(devices, &ckpt, WeightDType::F32).unwrap();
    let tokenizer = Arc::new(Tokenizer::from_checkpoint(&ckpt).unwrap());
    std::fs::remove_dir_all(&dir).ok();
    let config = EngineConfig {
        max_num_batched_tokens: 32,
        max_num_seqs: Some(4),
        kv_cache_memory: Some(1 << 20),
        ..Default::default()
    };
    let handle = EngineHandle::spawn(Engine::with_ranks(ranks, tokenizer, config).unwrap());
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(10)
    };
    // Step 1 is the prompt, step 2 its first decode; rank 1 fails step 3.
    let (_, mut events) = handle
        .add_request((2..22).collect(), params.clone())
        .unwrap();
    let mut tokens = 0;
    let err = loop {
        match events
            .blocking_recv()
            .expect("an error before the stream ends")
        {
            Ok(e) => tokens += e.token_ids.len(),
            Err(e) => break e.to_string(),
        }
    };
    // The engine queues a step before it reads the last one's tokens, so the second may
    // not come out before the third step's error.
    assert!(
        (1..=2).contains(&tokens),
        "{tokens} tokens before the failure"
    );
    assert!(
        err.contains("tensor-parallel rank 1: failure injected at step 3"),
        "{err}"
    );
    assert_eq!(
        handle.group_failure().as_deref(),
        Some("rank 1: failure injected at step 3")
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let why = loop {
        if let Some(why) = handle.stopped() {
            break why;
        }
        assert!(
            Instant::now() < deadline,
            "the engine thread is still running"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(why, "rank 1: failure injected at step 3");
    assert!(matches!(
        handle.add_request(vec![2, 3], params),
        Err(SubmitError::Stopped)
    ));
}
