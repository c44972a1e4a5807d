//! `ingot bench`: measured performance of the engine, from its own timestamps.

mod embed;
pub(crate) mod latency;
mod masks;
pub(crate) mod serve;
mod throughput;

use crate::generate::Format;
use anyhow::{ensure, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::rngs::StdRng;
use rand::Rng;
use serde_json::json;
use std::time::Duration;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Time a fixed batch: TTFT, TPOT, end-to-end, prefill and decode throughput.
    Latency(latency::LatencyArgs),
    /// Run many requests of given or random lengths at once: requests/s and tokens/s.
    Throughput(throughput::ThroughputArgs),
    /// Embed batches of random inputs with an embedding model (`--task embed`'s engine):
    /// inputs/s and tokens/s.
    Embed(embed::EmbedArgs),
    /// Step rows of one JSON-schema constraint through the structured-output mask job
    /// alone, no model: µs a mask and an advance, wall time a step, the kernel's TLB
    /// shootdowns and page faults.
    Masks(masks::MasksArgs),
    /// Load an OpenAI-compatible server over HTTP (ingot, llama-server, vLLM): TTFT, TPOT,
    /// ITL and end-to-end latency under a request rate or a concurrency cap.
    Serve(serve::ServeArgs),
}

pub fn run(cmd: Command) -> Result<()> {
    match cmd {
        Command::Latency(args) => args.model.clone().on_backend(args),
        Command::Throughput(args) => args.model.clone().on_backend(args),
        Command::Embed(args) => args.model.clone().on_backend(args),
        Command::Masks(args) => masks::run(args),
        Command::Serve(args) => serve::run(args),
    }
}

/// The random requests of `bench throughput` and `bench serve`: how many, and how long.
#[derive(clap::Args)]
pub struct RandomDataset {
    /// Requests in the run.
    #[arg(long, default_value_t = 200)]
    pub num_prompts: usize,
    /// Prompt tokens per request (random token ids).
    #[arg(long, default_value_t = 256)]
    pub input_len: usize,
    /// Tokens generated per request (EOS ignored).
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    /// Lengths drawn uniformly from [len × (1 − r), len × (1 + r)]; 0 keeps them fixed.
    #[arg(long, default_value_t = 0.0)]
    pub range_ratio: f64,
}

impl RandomDataset {
    pub fn check(&self) -> Result<()> {
        ensure!(
            self.num_prompts > 0 && self.input_len > 0 && self.output_len > 0,
            "--num-prompts, --input-len and --output-len must be at least 1"
        );
        ensure!(
            (0.0..1.0).contains(&self.range_ratio),
            "--range-ratio must be in [0, 1), got {}",
            self.range_ratio
        );
        Ok(())
    }

    /// One request's prompt and output lengths.
    pub fn lengths(&self, rng: &mut StdRng) -> (usize, usize) {
        (
            length(rng, self.input_len, self.range_ratio),
            length(rng, self.output_len, self.range_ratio),
        )
    }
}

/// `n` prompts of `len` random token ids below `vocab`.
pub(crate) fn random_prompts(rng: &mut StdRng, n: usize, len: usize, vocab: u32) -> Vec<Vec<u32>> {
    (0..n)
        .map(|_| (0..len).map(|_| rng.random_range(0..vocab)).collect())
        .collect()
}

/// A length around `len`, at least 1: uniform in [len × (1 − ratio), len × (1 + ratio)].
fn length(rng: &mut StdRng, len: usize, ratio: f64) -> usize {
    let lo = ((len as f64 * (1.0 - ratio)).round() as usize).max(1);
    let hi = ((len as f64 * (1.0 + ratio)).round() as usize).max(lo);
    rng.random_range(lo..=hi)
}

/// A progress bar on stderr counting `len` `unit`s; hidden with `--format json` (and by
/// indicatif when stderr is not a terminal).
pub(crate) fn progress(len: usize, unit: &str, format: Format) -> ProgressBar {
    if matches!(format, Format::Json) {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len as u64), ProgressDrawTarget::stderr());
    let template = format!("{{bar:40}} {{pos}}/{{len}} {unit} {{elapsed_precise}} {{msg}}");
    if let Ok(style) = ProgressStyle::with_template(&template) {
        bar.set_style(style);
    }
    bar
}

fn percentile(values: &[f64], p: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// Mean, median, p99, min and max.
fn summary(values: &[f64]) -> serde_json::Value {
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    json!({
        "mean": mean,
        "median": percentile(values, 50.0),
        "p99": percentile(values, 99.0),
        "min": values.iter().cloned().fold(f64::INFINITY, f64::min),
        "max": values.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
    })
}

pub(crate) fn ms(d: &[Duration]) -> Vec<f64> {
    d.iter().map(|d| d.as_secs_f64() * 1e3).collect()
}

/// One line per summary of `report`: `(label, key)`.
fn print_text(report: &serde_json::Value, rows: &[(&str, &str)]) {
    for (name, key) in rows {
        let s = &report[*key];
        println!(
            "  {name:<16} median {:>10.2}  p99 {:>10.2}  mean {:>10.2}",
            s["median"].as_f64().unwrap_or(0.0),
            s["p99"].as_f64().unwrap_or(0.0),
            s["mean"].as_f64().unwrap_or(0.0)
        );
    }
}
