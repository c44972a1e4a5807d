//! `ingot bench throughput`: many requests of random token ids, all submitted at once and
//! run to their lengths (EOS ignored) by the continuous-batching engine, offline. Reports
//! requests/s, output and total tokens/s over the wall time of the run, and each request's
//! time to first token and end-to-end latency from the start of the run.

use super::{ms, print_text, summary, RandomDataset};
use crate::device::{devices_name, ModelArgs, OnBackend};
use crate::generate::{EngineArgs, Format};
use anyhow::Result;
use ingot_backend::Backend;
use ingot_core::SamplingParams;
use ingot_engine::Engine;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct ThroughputArgs {
    #[command(flatten)]
    pub(super) model: ModelArgs,
    /// Submitted at once.
    #[command(flatten)]
    dataset: RandomDataset,
    /// Untimed requests run first (CUDA graph capture, kernel caches).
    #[arg(long, default_value_t = 8)]
    warmup: usize,
    /// 0 is greedy; above it every token is drawn.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Seeds the prompts, their lengths and the draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
    #[command(flatten)]
    engine: EngineArgs,
}

impl OnBackend for ThroughputArgs {
    type Output = ();
    fn run<B: Backend + 'static>(self, devices: Vec<B>) -> Result<()> {
        throughput(self, devices)
    }
}

/// `n` requests: random prompts and their sampling parameters.
fn requests(
    args: &ThroughputArgs,
    rng: &mut StdRng,
    vocab: u32,
    n: usize,
) -> (Vec<Vec<u32>>, Vec<SamplingParams>) {
    (0..n)
        .map(|i| {
            let (input, output) = args.dataset.lengths(rng);
            let prompt = (0..input).map(|_| rng.random_range(0..vocab)).collect();
            let params = SamplingParams {
                ignore_eos: true,
                temperature: args.temperature,
                seed: Some(args.seed.wrapping_add(i as u64)),
                ..SamplingParams::greedy(output)
            };
            (prompt, params)
        })
        .unzip()
}

fn throughput<B: Backend + 'static>(args: ThroughputArgs, devices: Vec<B>) -> Result<()> {
    args.dataset.check()?;
    let device = devices_name(&devices);
    let (ranks, tokenizer) = args.model.load(devices)?;
    let vocab = ranks[0].1.config.vocab_size as u32;
    let mut engine = Engine::with_ranks(ranks, Arc::new(tokenizer), args.engine.config())?;
    let mut rng = StdRng::seed_from_u64(args.seed);
    if args.warmup > 0 {
        let (prompts, params) = requests(&args, &mut rng, vocab, args.warmup);
        engine.generate(prompts, &params)?;
    }
    // `generate` numbers its requests from 2^63 up, so the timed ones can be 0..n.
    let (prompts, params) = requests(&args, &mut rng, vocab, args.dataset.num_prompts);
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let progress = super::progress(args.dataset.num_prompts, "requests", args.format);
    let n = prompts.len();
    for (i, (prompt, p)) in prompts.into_iter().zip(params).enumerate() {
        engine.add_request(i as u64, prompt, p)?;
    }
    let start = Instant::now();
    let (mut ttft, mut e2e) = (vec![None; n], vec![Duration::ZERO; n]);
    let mut output_tokens = 0;
    while engine.has_work() {
        for d in engine.step()? {
            let i = d.request_id as usize;
            ttft[i].get_or_insert(start.elapsed());
            output_tokens += d.token_ids.len();
            if d.finish_reason.is_some() {
                e2e[i] = start.elapsed();
                progress.inc(1);
            }
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    progress.finish_and_clear();
    let ttft: Vec<Duration> = ttft
        .into_iter()
        .map(|t| t.expect("every request produced a token"))
        .collect();
    let report = json!({
        "device": device,
        "model": args.model.model,
        "num_prompts": args.dataset.num_prompts,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "requests_per_s": args.dataset.num_prompts as f64 / elapsed,
        "output_tok_s": output_tokens as f64 / elapsed,
        "total_tok_s": (prompt_tokens + output_tokens) as f64 / elapsed,
        "ttft_ms": summary(&ms(&ttft)),
        "e2e_ms": summary(&ms(&e2e)),
    });
    match args.format {
        Format::Json => println!("{report}"),
        Format::Text => {
            println!(
                "{device}: {} requests, {prompt_tokens} prompt and {output_tokens} output tokens in {elapsed:.2} s",
                args.dataset.num_prompts
            );
            println!(
                "  {:.2} requests/s, {:.1} output tok/s, {:.1} total tok/s",
                report["requests_per_s"].as_f64().unwrap_or(0.0),
                report["output_tok_s"].as_f64().unwrap_or(0.0),
                report["total_tok_s"].as_f64().unwrap_or(0.0)
            );
            print_text(
                &report,
                &[("TTFT (ms)", "ttft_ms"), ("end-to-end (ms)", "e2e_ms")],
            );
        }
    }
    Ok(())
}
