//! The engine on the real test model: each request's tokens do not depend on the batch it
//! runs in, the chunking of its prompt, prefix-cache hits or preemption (f32, exact), and
//! the sampling and stopping rules hold. After every test all KV blocks are free.

use ingot_backend::cpu::CpuBackend;
use ingot_core::{FinishReason, SamplingParams};
use ingot_engine::{Engine, EngineConfig};
use ingot_model::testing::{fixtures_dir, test_model_path};
use ingot_model::WeightDType;
use std::sync::Arc;

fn engine(dtype: WeightDType, config: EngineConfig) -> Option<Engine<CpuBackend>> {
    let path = test_model_path()?;
    let backend = CpuBackend::new(None).unwrap();
    let (model, tokenizer) = ingot_model::load(&backend, &path, dtype).unwrap();
    Some(Engine::new(backend, model, Arc::new(tokenizer), config).unwrap())
}

fn config(budget: usize, kv_blocks: usize, prefix_caching: bool) -> EngineConfig {
    // f32 KV of this model: 2 * 4 bytes * 16 tokens * 192 * 30 layers per block.
    let block_bytes = 2 * 4 * 16 * 192 * 30;
    EngineConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: Some(16),
        max_model_len: Some(4096),
        block_size: 16,
        kv_cache_memory: Some(kv_blocks * block_bytes),
        prefix_caching,
        ..EngineConfig::default()
    }
}

/// Real token sequences of many lengths, cut from the fixture prompts.
fn corpus() -> Vec<u32> {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures_dir().join("logits.json")).unwrap())
            .unwrap();
    let mut all = vec![];
    for c in v["cases"].as_array().unwrap().iter().rev() {
        all.extend(
            c["prompt_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32),
        );
    }
    all
}

fn prompts(lengths: &[usize]) -> Vec<Vec<u32>> {
    let c = corpus();
    lengths
        .iter()
        .enumerate()
        .map(|(i, &n)| c[i * 37..i * 37 + n].to_vec())
        .collect()
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    }
}

fn run(e: &mut Engine<CpuBackend>, prompts: &[Vec<u32>], params: &SamplingParams) -> Vec<Vec<u32>> {
    let outs = e
        .generate(prompts.to_vec(), &vec![params.clone(); prompts.len()])
        .unwrap();
    assert_idle(e);
    outs.into_iter()
        .map(|o| o.completions[0].token_ids.clone())
        .collect()
}

fn assert_idle(e: &Engine<CpuBackend>) {
    let s = e.stats();
    assert_eq!((s.num_running, s.num_waiting), (0, 0));
    assert_eq!(s.free_blocks, s.total_blocks, "KV blocks still in use");
}

#[test]
fn batch_composition_does_not_change_greedy_tokens() {
    let Some(mut e) = engine(WeightDType::F32, config(2048, 512, true)) else {
        return;
    };
    let ps = prompts(&[5, 90, 17, 33, 160, 1, 64, 15, 16, 250, 48, 120, 7, 200, 31]);
    let params = greedy(10);
    let alone: Vec<Vec<u32>> = ps
        .iter()
        .map(|p| run(&mut e, std::slice::from_ref(p), &params).remove(0))
        .collect();
    for size in [1, 3, 5, 7, 9, 12, 15] {
        // A different subset each time, so every prompt meets different neighbours.
        let pick: Vec<usize> = (0..size).map(|i| (i * 7 + size) % ps.len()).collect();
        let batch: Vec<Vec<u32>> = pick.iter().map(|&i| ps[i].clone()).collect();
        let got = run(&mut e, &batch, &params);
        for (k, &i) in pick.iter().enumerate() {
            assert_eq!(got[k], alone[i], "prompt {i} in a batch of {size}");
        }
    }
    // Streamed text deltas add up to the decode of the tokens.
    let outs = e
        .generate(ps[..3].to_vec(), &vec![params.clone(); 3])
        .unwrap();
    for o in outs {
        let c = &o.completions[0];
        assert_eq!(c.text, e.tokenizer().decode(&c.token_ids, true).unwrap());
    }
}

#[test]
fn mixed_lengths_and_token_budgets_do_not_change_greedy_tokens() {
    let ps = prompts(&[32, 128, 512, 2048]);
    let params = greedy(6);
    let Some(mut e) = engine(WeightDType::F32, config(8192, 512, false)) else {
        return;
    };
    let alone: Vec<Vec<u32>> = ps
        .iter()
        .map(|p| run(&mut e, std::slice::from_ref(p), &params).remove(0))
        .collect();
    drop(e);
    for budget in [16, 64, 256, 8192] {
        let mut e = engine(WeightDType::F32, config(budget, 512, false)).unwrap();
        assert_eq!(run(&mut e, &ps, &params), alone, "budget {budget}");
    }
}

#[test]
fn prefix_cache_hits_give_the_tokens_of_a_cold_run() {
    let base = prompts(&[300]).remove(0);
    let variants: Vec<Vec<u32>> = vec![
        base.clone(),
        base[..200].to_vec(),
        [&base[..170], &corpus()[5..40]].concat(),
    ];
    let params = greedy(8);
    let Some(mut cold) = engine(WeightDType::F32, config(2048, 256, false)) else {
        return;
    };
    let want: Vec<Vec<u32>> = variants
        .iter()
        .map(|p| run(&mut cold, std::slice::from_ref(p), &params).remove(0))
        .collect();
    drop(cold);
    let mut warm = engine(WeightDType::F32, config(2048, 256, true)).unwrap();
    run(&mut warm, std::slice::from_ref(&base), &params);
    let before = warm.stats().prefix_cache_hits;
    for (p, w) in variants.iter().zip(&want) {
        assert_eq!(
            &run(&mut warm, std::slice::from_ref(p), &params).remove(0),
            w
        );
    }
    let hits = warm.stats().prefix_cache_hits - before;
    assert!(
        hits >= (18 + 12 + 10) * 16,
        "prefix cache hits: {hits} tokens"
    );
}

#[test]
fn preempted_requests_recompute_to_the_same_tokens() {
    let ps = prompts(&[100, 90, 110, 95]);
    let params = greedy(40);
    let Some(mut roomy) = engine(WeightDType::F32, config(2048, 256, false)) else {
        return;
    };
    let want: Vec<Vec<u32>> = ps
        .iter()
        .map(|p| run(&mut roomy, std::slice::from_ref(p), &params).remove(0))
        .collect();
    drop(roomy);
    // Each request needs 9 blocks by its end; 24 blocks cannot hold all four.
    let mut tight = engine(WeightDType::F32, config(2048, 24, false)).unwrap();
    assert_eq!(run(&mut tight, &ps, &params), want);
    assert!(tight.stats().num_preemptions > 0, "no preemption happened");
}

#[test]
fn seeded_sampling_reproduces_across_runs_and_batches() {
    let Some(mut e) = engine(WeightDType::F32, config(2048, 256, true)) else {
        return;
    };
    let ps = prompts(&[40, 12, 75]);
    let params = SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        seed: Some(1234),
        max_tokens: 16,
        ignore_eos: true,
        ..Default::default()
    };
    let alone = run(&mut e, &ps[..1], &params).remove(0);
    assert_eq!(run(&mut e, &ps[..1], &params).remove(0), alone);
    assert_eq!(run(&mut e, &ps, &params)[0], alone);
    let other = SamplingParams {
        seed: Some(99),
        ..params.clone()
    };
    assert_ne!(
        run(&mut e, &ps[..1], &other).remove(0),
        alone,
        "a different seed samples differently"
    );
}

#[test]
fn token_cap_rejects_overlong_prompts_without_disturbing_others() {
    let Some(mut e) = engine(
        WeightDType::Auto,
        EngineConfig {
            max_model_len: Some(64),
            ..config(2048, 64, true)
        },
    ) else {
        return;
    };
    let c = corpus();
    let ok = e.generate(vec![c[..63].to_vec()], &[greedy(1)]).unwrap();
    assert_eq!(ok[0].completions[0].token_ids.len(), 1);
    // One request in flight while bad ones arrive.
    let inflight = c[100..120].to_vec();
    let want = run(&mut e, std::slice::from_ref(&inflight), &greedy(8)).remove(0);
    e.add_request(1, inflight, greedy(8)).unwrap();
    let mut got: Vec<u32> = e
        .step()
        .unwrap()
        .into_iter()
        .flat_map(|d| d.token_ids)
        .collect();
    for len in [64, 65] {
        let err = e
            .add_request(2, c[..len].to_vec(), greedy(1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("maximum context length is 64 tokens"), "{err}");
    }
    while e.has_work() {
        got.extend(e.step().unwrap().into_iter().flat_map(|d| d.token_ids));
    }
    assert_eq!(got, want, "the in-flight request continues undisturbed");
    assert_idle(&e);
}

/// Steps overlap: a call submits the next step before it detokenizes the last one's
/// tokens, so a sequence that a stop string or an abort ends has a step in flight. That
/// step's token is dropped, its blocks are freed, and the other sequences go on unchanged.
/// In f32, where a row's result does not depend on its batch: the later runs find the
/// first prompt in the prefix cache and prefill fewer rows, and with quantized weights
/// fewer rows take another product path, which on AVX-512 turned a token of the other
/// request.
#[test]
fn sequences_ended_with_a_step_in_flight_drop_its_token() {
    let Some(mut e) = engine(WeightDType::F32, config(2048, 256, true)) else {
        return;
    };
    let ps = prompts(&[40, 25]);
    let alone = run(&mut e, &ps, &greedy(12));
    e.add_request(9, ps[0].clone(), greedy(12)).unwrap();
    let mut deltas = vec![];
    while e.has_work() {
        deltas.extend(e.step().unwrap());
    }
    // A stop string that the 5th token completes: its text without the first character.
    let text4: String = deltas[..4].iter().map(|d| d.text.as_str()).collect();
    let stop: String = deltas[4].text.chars().skip(1).collect();
    assert!(!stop.is_empty() && !text4.contains(&stop));
    let stopping = SamplingParams {
        stop: vec![stop],
        ..greedy(12)
    };
    e.add_request(0, ps[0].clone(), stopping).unwrap();
    e.add_request(1, ps[1].clone(), greedy(12)).unwrap();
    let mut got = [vec![], vec![]];
    let mut finish = [None, None];
    while e.has_work() {
        for d in e.step().unwrap() {
            got[d.request_id as usize].extend(d.token_ids);
            finish[d.request_id as usize] = d.finish_reason;
        }
    }
    assert_eq!(got[0], alone[0][..5], "no token after the stop string");
    assert_eq!(finish[0], Some(FinishReason::Stop));
    assert_eq!(got[1], alone[1], "the other request is undisturbed");
    assert_idle(&e);

    e.add_request(2, ps[0].clone(), greedy(12)).unwrap();
    e.add_request(3, ps[1].clone(), greedy(12)).unwrap();
    let mut got = vec![];
    for _ in 0..4 {
        got.extend(e.step().unwrap());
    }
    assert!(e.abort(2), "aborted with a step in flight");
    while e.has_work() {
        got.extend(e.step().unwrap());
    }
    let tokens = |id| -> Vec<u32> {
        got.iter()
            .filter(|d| d.request_id == id)
            .flat_map(|d| d.token_ids.clone())
            .collect()
    };
    assert_eq!(
        tokens(2),
        alone[0][..3],
        "the aborted request's last step is dropped"
    );
    assert_eq!(tokens(3), alone[1]);
    assert_idle(&e);
}

#[test]
fn stop_strings_n_and_logprobs() {
    let Some(mut e) = engine(WeightDType::Auto, config(2048, 256, true)) else {
        return;
    };
    let tok = e.tokenizer().clone();
    let prompt = prompts(&[40]).remove(0);
    let full = e
        .generate(vec![prompt.clone()], &[greedy(24)])
        .unwrap()
        .remove(0)
        .completions
        .remove(0);
    // A stop string that starts inside one token and ends inside a later one.
    let first = tok.decode(&full.token_ids[..4], true).unwrap();
    let cut = first.len() - 2;
    let stop = full.text[cut..cut + 5].to_string();
    assert!(
        first.len() < cut + 5,
        "the stop string spans a token boundary"
    );
    let params = SamplingParams {
        stop: vec![stop.clone()],
        ..greedy(24)
    };
    let stopped = e
        .generate(vec![prompt.clone()], &[params])
        .unwrap()
        .remove(0)
        .completions
        .remove(0);
    assert_eq!(stopped.finish_reason, Some(FinishReason::Stop));
    assert_eq!(stopped.text, full.text[..full.text.find(&stop).unwrap()]);

    let n3 = SamplingParams {
        n: 3,
        temperature: 0.8,
        seed: Some(5),
        max_tokens: 8,
        ignore_eos: true,
        ..Default::default()
    };
    let hits = e.stats().prefix_cache_hits;
    let out = e.generate(vec![prompt.clone()], &[n3]).unwrap().remove(0);
    assert_eq!(out.completions.len(), 3);
    // Samples 2 and 3 share the prompt's two full blocks with the first.
    assert!(e.stats().prefix_cache_hits - hits >= 2 * 32);
    assert!(out.completions.iter().all(|c| c.token_ids.len() == 8));

    let lp = SamplingParams {
        logprobs: Some(5),
        ..greedy(6)
    };
    let c = e
        .generate(vec![prompt], &[lp])
        .unwrap()
        .remove(0)
        .completions
        .remove(0);
    assert_eq!(c.logprobs.len(), 6);
    for (l, &t) in c.logprobs.iter().zip(&c.token_ids) {
        assert_eq!(l.token, t);
        assert_eq!(l.top.len(), 5);
        assert_eq!(
            l.top[0].1, l.logprob,
            "the greedy token has the largest logprob"
        );
    }
    assert_idle(&e);
}
