//! `ingot bench latency`: a fixed batch of random prompts run to a fixed length, timed from
//! the engine's own steps. Every figure is measured: time to first token and end-to-end per
//! request, time per output token between a request's first and last token, prefill
//! throughput up to the batch's last first token, and decode throughput over the steps
//! that ran decodes only.

use super::{ms, print_text, summary};
use crate::device::{devices_name, ModelArgs, OnBackend};
use crate::generate::{EngineArgs, Format};
use anyhow::{ensure, Result};
use ingot_backend::Backend;
use ingot_core::SamplingParams;
use ingot_engine::{default_max_num_seqs, Engine};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct LatencyArgs {
    #[command(flatten)]
    pub(super) model: ModelArgs,
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Prompt tokens per request (random ids).
    #[arg(long, default_value_t = 32)]
    input_len: usize,
    /// Tokens generated per request (EOS is ignored).
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    /// 0 is greedy; above it every token is drawn, on the device where the backend can.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// 0 keeps all tokens.
    #[arg(long, default_value_t = 0)]
    top_k: i32,
    /// Untimed batches run first.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Timed batches.
    #[arg(long, default_value_t = 3)]
    iters: usize,
    #[arg(long, value_enum, default_value = "text")]
    pub(super) format: Format,
    /// Time every op on the device during the timed batches (needs --enforce-eager) and
    /// print the time per op.
    #[arg(long)]
    profile_ops: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

/// One timed batch.
pub(crate) struct Iteration {
    pub ttft: Vec<Duration>,
    pub e2e: Vec<Duration>,
    /// Time from each request's first token to its last, over the tokens between.
    pub tpot: Vec<Duration>,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// Share of the decode steps' time spent outside the model runner (scheduling,
    /// sampling, detokenization); on a device that runs steps asynchronously, most of it
    /// overlaps the device's work on the next step.
    pub decode_host_share: f64,
}

impl OnBackend for LatencyArgs {
    type Output = ();
    fn run<B: Backend + 'static>(self, devices: Vec<B>) -> Result<()> {
        latency(self, devices)
    }
}

/// Runs `prompts` together to `params.max_tokens` (EOS should be ignored) and times them
/// from the engine's steps; request ids start at `base`.
pub(crate) fn timed_batch<B: Backend>(
    engine: &mut Engine<B>,
    prompts: Vec<Vec<u32>>,
    params: &SamplingParams,
    base: u64,
) -> Result<Iteration> {
    let b = prompts.len();
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    for (i, prompt) in prompts.into_iter().enumerate() {
        engine.add_request(base + i as u64, prompt, params.clone())?;
    }
    let start = Instant::now();
    let (mut first, mut last) = (vec![None; b], vec![Duration::ZERO; b]);
    let (mut decode_tokens, mut decode_time, mut decode_execute) =
        (0usize, Duration::ZERO, Duration::ZERO);
    while engine.has_work() {
        let t = Instant::now();
        let deltas = engine.step()?;
        let took = t.elapsed();
        // The call's time is the interval in which the step whose deltas it returns
        // finished: steps overlap the host's work with the device's.
        let info = engine.last_step();
        if info.decode_tokens > 0 && info.prefill_tokens == 0 {
            decode_tokens += info.decode_tokens;
            decode_time += took;
            decode_execute += info.execute;
        }
        let now = start.elapsed();
        for d in deltas {
            let i = (d.request_id - base) as usize;
            first[i].get_or_insert(now);
            last[i] = now;
        }
    }
    let ttft: Vec<Duration> = first
        .into_iter()
        .map(|f| f.expect("every request produced a token"))
        .collect();
    let prefill_end = ttft.iter().max().copied().unwrap_or_default();
    let tpot = ttft
        .iter()
        .zip(&last)
        .map(|(&f, &l)| (l - f) / (params.max_tokens.max(2) - 1) as u32)
        .collect();
    Ok(Iteration {
        prefill_tok_s: prompt_tokens as f64 / prefill_end.as_secs_f64(),
        decode_tok_s: decode_tokens as f64 / decode_time.as_secs_f64().max(f64::MIN_POSITIVE),
        decode_host_share: 1.0
            - decode_execute.as_secs_f64() / decode_time.as_secs_f64().max(f64::MIN_POSITIVE),
        ttft,
        e2e: last,
        tpot,
    })
}

fn latency<B: Backend + 'static>(args: LatencyArgs, devices: Vec<B>) -> Result<()> {
    ensure!(
        args.batch_size > 0 && args.input_len > 0 && args.output_len > 0 && args.iters > 0,
        "--batch-size, --input-len, --output-len and --iters must be at least 1"
    );
    ensure!(
        !args.profile_ops || args.engine.enforce_eager,
        "--profile-ops times ops one by one: add --enforce-eager"
    );
    let device = devices_name(&devices);
    let (ranks, tokenizer) = args.model.load(devices)?;
    let vocab = ranks[0].1.config.vocab_size as u32;
    let mut config = args.engine.config();
    // The batch runs as one, also where it has more rows than the default sequences.
    config
        .max_num_seqs
        .get_or_insert(default_max_num_seqs(&ranks[0].0).max(args.batch_size));
    let mut engine = Engine::with_ranks(ranks, Arc::new(tokenizer), config)?;
    let mut rng = StdRng::seed_from_u64(0);
    let params = SamplingParams {
        ignore_eos: true,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: Some(0),
        ..SamplingParams::greedy(args.output_len)
    };
    let mut timed = vec![];
    let mut timed_wall = Duration::ZERO;
    let progress = super::progress(args.warmup + args.iters, "batches", args.format);
    for i in 0..args.warmup + args.iters {
        if args.profile_ops && i == args.warmup {
            engine.backend().start_op_profile()?;
        }
        let prompts = super::random_prompts(&mut rng, args.batch_size, args.input_len, vocab);
        let start = Instant::now();
        let it = timed_batch(&mut engine, prompts, &params, (i * args.batch_size) as u64)?;
        if i >= args.warmup {
            timed_wall += start.elapsed();
            timed.push(it);
        }
        progress.inc(1);
    }
    progress.finish_and_clear();
    let all = |f: fn(&Iteration) -> &Vec<Duration>| -> Vec<f64> {
        timed.iter().flat_map(|it| ms(f(it))).collect()
    };
    let (ttft, tpot, e2e) = (all(|i| &i.ttft), all(|i| &i.tpot), all(|i| &i.e2e));
    let prefill: Vec<f64> = timed.iter().map(|i| i.prefill_tok_s).collect();
    let decode: Vec<f64> = timed.iter().map(|i| i.decode_tok_s).collect();
    let host: Vec<f64> = timed.iter().map(|i| i.decode_host_share).collect();
    let report = json!({
        "device": device,
        "model": args.model.model,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "iters": args.iters,
        "ttft_ms": summary(&ttft),
        "tpot_ms": summary(&tpot),
        "e2e_ms": summary(&e2e),
        "prefill_tok_s": summary(&prefill),
        "decode_tok_s": summary(&decode),
        "decode_host_share": summary(&host),
    });
    if args.profile_ops {
        let ops = engine.backend().op_profile();
        let total: f64 = ops.iter().map(|o| o.2).sum();
        // The rest of the batches' wall time is spent between ops: scheduling, sampling on
        // the host, launches.
        eprintln!(
            "device time per op over the timed batches ({total:.1} ms in all, of {:.1} ms of wall time):",
            timed_wall.as_secs_f64() * 1e3
        );
        for (op, calls, ms) in ops {
            eprintln!(
                "  {:>6.2}%  {ms:>10.3} ms  {calls:>7} calls  {:>8.1} us/call  {op}",
                100.0 * ms / total,
                1e3 * ms / calls as f64
            );
        }
    }
    match args.format {
        Format::Json => println!("{report}"),
        Format::Text => {
            println!(
                "{device}: batch {} x {} prompt tokens -> {} tokens, {} iterations",
                args.batch_size, args.input_len, args.output_len, args.iters
            );
            print_text(
                &report,
                &[
                    ("TTFT (ms)", "ttft_ms"),
                    ("TPOT (ms)", "tpot_ms"),
                    ("end-to-end (ms)", "e2e_ms"),
                    ("prefill (tok/s)", "prefill_tok_s"),
                    ("decode (tok/s)", "decode_tok_s"),
                    ("decode host share", "decode_host_share"),
                ],
            );
        }
    }
    Ok(())
}
