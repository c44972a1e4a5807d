//! `ingot bench`: measured performance of the engine, from its own timestamps.

pub(crate) mod latency;
pub(crate) mod serve;
mod throughput;

use crate::generate::Format;
use anyhow::Result;
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
    /// Load an OpenAI-compatible server over HTTP (ingot, llama-server, vLLM): TTFT, TPOT,
    /// ITL and end-to-end latency under a request rate or a concurrency cap.
    Serve(serve::ServeArgs),
}

pub fn run(cmd: Command) -> Result<()> {
    match cmd {
        Command::Latency(args) => args.model.clone().on_backend(args),
        Command::Throughput(args) => args.model.clone().on_backend(args),
        Command::Serve(args) => serve::run(args),
    }
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
