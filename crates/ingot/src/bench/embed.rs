//! `ingot bench embed`: batches of random inputs embedded by the engine (an embedding
//! request's inputs scheduled like prompts, pooled at their last token), timed wall clock
//! from submission to the last vector: inputs/s and prompt tokens/s.

use super::{print_text, summary};
use crate::device::{devices_name, ModelArgs, OnBackend, Task, TaskArgs};
use crate::generate::{EngineArgs, Format};
use anyhow::{ensure, Result};
use ingot_backend::Backend;
use ingot_engine::{Engine, EngineConfig};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args)]
pub struct EmbedArgs {
    #[command(flatten)]
    pub(super) model: ModelArgs,
    /// Inputs per timed batch, submitted at once.
    #[arg(long, default_value_t = 256)]
    num_inputs: usize,
    /// Tokens per input (random ids).
    #[arg(long, default_value_t = 64)]
    input_len: usize,
    /// Untimed batches run first.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Timed batches.
    #[arg(long, default_value_t = 3)]
    iters: usize,
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
    #[command(flatten)]
    engine: EngineArgs,
}

impl OnBackend for EmbedArgs {
    type Output = ();
    fn run<B: Backend + 'static>(self, devices: Vec<B>) -> Result<()> {
        embed(self, devices)
    }
}

fn embed<B: Backend + 'static>(args: EmbedArgs, devices: Vec<B>) -> Result<()> {
    ensure!(
        args.num_inputs > 0 && args.input_len > 0 && args.iters > 0,
        "--num-inputs, --input-len and --iters must be at least 1"
    );
    let device = devices_name(&devices);
    let pooling = args.model.pooling(&TaskArgs {
        task: Task::Embed,
        hf_overrides: None,
    })?;
    let (ranks, tokenizer) = args.model.load(devices)?;
    let vocab = ranks[0].1.config.vocab_size as u32;
    let config = EngineConfig {
        pooling,
        ..args.engine.config()
    };
    let mut engine = Engine::with_ranks(ranks, Arc::new(tokenizer), config)?;
    let mut rng = StdRng::seed_from_u64(0);
    let (mut inputs_s, mut tokens_s) = (vec![], vec![]);
    let progress = super::progress(args.warmup + args.iters, "batches", args.format);
    for i in 0..args.warmup + args.iters {
        let inputs = super::random_prompts(&mut rng, args.num_inputs, args.input_len, vocab);
        let start = Instant::now();
        let vectors = engine.embed(inputs, None)?;
        let secs = start.elapsed().as_secs_f64();
        ensure!(
            vectors.iter().all(|v| !v.is_empty()),
            "an input came back without its vector"
        );
        if i >= args.warmup {
            inputs_s.push(args.num_inputs as f64 / secs);
            tokens_s.push((args.num_inputs * args.input_len) as f64 / secs);
        }
        progress.inc(1);
    }
    progress.finish_and_clear();
    let report = json!({
        "device": device,
        "model": args.model.model,
        "num_inputs": args.num_inputs,
        "input_len": args.input_len,
        "iters": args.iters,
        "inputs_per_s": summary(&inputs_s),
        "tokens_per_s": summary(&tokens_s),
    });
    match args.format {
        Format::Json => println!("{report}"),
        Format::Text => {
            println!(
                "{device}: {} inputs x {} tokens embedded, {} iterations",
                args.num_inputs, args.input_len, args.iters
            );
            print_text(
                &report,
                &[("inputs/s", "inputs_per_s"), ("tokens/s", "tokens_per_s")],
            );
        }
    }
    Ok(())
}
