//! `ingot validate`: the eight tests of the seeds' validation reports, run against one
//! model on one device, each with measured figures and a verdict by a stated criterion.
//! Writes report.md, report.json and SVG charts into `--out`; exits non-zero when a test
//! fails.

mod charts;
mod http;
mod offline;
mod report;

use crate::device::{devices_name, ModelArgs, OnBackend};
use crate::generate::{EngineArgs, Format};
use anyhow::{bail, Context, Result};
use indicatif::ProgressBar;
use ingot_backend::Backend;
use ingot_engine::{Engine, EngineHandle};
use ingot_model::WeightDType;
use report::{Section, Status};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Smaller sweeps (prompts up to 512, contexts up to 2048 at batch 1 and 4, one minute
    /// of load, 8 clients): minutes on a laptop CPU for a small model.
    #[arg(long)]
    quick: bool,
    /// Minutes of continuous load in the memory test (default 5; 1 with --quick).
    #[arg(long)]
    minutes: Option<f64>,
    /// Directory for report.md, report.json and the charts.
    #[arg(long, default_value = "validation-report")]
    out: PathBuf,
    /// transformers fixtures (a logits.json written by tools/reference/make_fixtures.py)
    /// for the numerical test (default: the one under tests/fixtures made from this model
    /// file, if any).
    #[arg(long)]
    fixtures: Option<PathBuf>,
    /// Concurrent HTTP clients in the concurrency test (default 16; 8 with --quick).
    #[arg(long)]
    clients: Option<usize>,
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
    #[command(flatten)]
    engine: EngineArgs,
}

/// The sizes of every sweep.
pub struct Plan {
    prompt_lens: Vec<usize>,
    batches: Vec<usize>,
    /// Longest context in the knee sweep and in the token-cap test.
    context_cap: usize,
    knee_batches: Vec<usize>,
    /// Tokens generated per request where a test times decoding.
    decode_len: usize,
    minutes: f64,
    clients: usize,
    requests_per_client: usize,
    edge_batches: Vec<usize>,
    repeats: usize,
}

impl Plan {
    fn new(args: &Args) -> Plan {
        let q = args.quick;
        Plan {
            prompt_lens: if q {
                vec![32, 128, 512]
            } else {
                vec![32, 128, 512, 2048]
            },
            batches: vec![1, 2, 4, 8],
            context_cap: if q { 2048 } else { 8192 },
            knee_batches: if q { vec![1, 4] } else { vec![1, 4, 8] },
            decode_len: if q { 16 } else { 32 },
            minutes: args.minutes.unwrap_or(if q { 1.0 } else { 5.0 }),
            clients: args.clients.unwrap_or(if q { 8 } else { 16 }),
            requests_per_client: if q { 2 } else { 4 },
            edge_batches: vec![3, 5, 7, 9, 12, 15],
            repeats: 3,
        }
    }
}

/// Runs `f` as section `number`, timing it; an error becomes a failed section.
fn section(
    number: u8,
    title: &'static str,
    progress: &ProgressBar,
    f: impl FnOnce() -> Result<Section>,
) -> Section {
    progress.set_message(format!("{number}. {title}"));
    let start = Instant::now();
    let mut s = f().unwrap_or_else(|e| Section::failed(&e));
    s.number = number;
    s.title = title;
    s.seconds = start.elapsed().as_secs_f64();
    progress.inc(1);
    s
}

/// Section 4 on its own model load, at f32 as the fixtures were made.
struct Numerics<'a> {
    args: &'a Args,
    /// `args.model` at f32.
    model: ModelArgs,
    progress: &'a ProgressBar,
}

impl OnBackend for Numerics<'_> {
    type Output = Section;
    fn run<B: Backend + 'static>(self, devices: Vec<B>) -> Result<Section> {
        let fixtures =
            offline::find_fixtures(self.args.fixtures.as_deref(), &self.args.model.model)?;
        Ok(section(4, offline::NUMERICS, self.progress, || {
            let Some(fixtures) = fixtures else {
                return Ok(offline::no_fixtures(&self.args.model.model));
            };
            let (ranks, tokenizer) = self.model.load(devices)?;
            let engine = Engine::with_ranks(ranks, Arc::new(tokenizer), self.args.engine.config())?;
            offline::numerics(engine, &fixtures)
        }))
    }
}

/// Every other section on one engine: the offline ones first, then the engine moves
/// behind an in-process HTTP server for the concurrency and token-cap tests.
struct Suite<'a> {
    args: &'a Args,
    plan: &'a Plan,
    progress: &'a ProgressBar,
}

impl OnBackend for Suite<'_> {
    type Output = (String, Vec<Section>);
    fn run<B: Backend + 'static>(self, devices: Vec<B>) -> Result<(String, Vec<Section>)> {
        let device = devices_name(&devices);
        // The CPU computes a row of an f32 model the same whatever else is in the batch;
        // quantized weights take a dot-product path for a few rows and a dequantizing GEMM
        // for many, which round differently.
        let exact = device.starts_with("cpu") && self.args.model.dtype == WeightDType::F32;
        let (ranks, tokenizer) = self.args.model.load(devices)?;
        let mut config = self.args.engine.config();
        let model_len = ranks[0].1.config.max_position_embeddings;
        let vocab = ranks[0].1.config.vocab_size as u32;
        config.max_model_len = Some(
            config
                .max_model_len
                .unwrap_or(model_len)
                .min(self.plan.context_cap),
        );
        let tokenizer = Arc::new(tokenizer);
        let mut engine = Engine::with_ranks(ranks, tokenizer.clone(), config)?;
        let mut t = offline::Tester::new(&mut engine, self.plan, exact, vocab);
        let (p, pr) = (self.plan, self.progress);
        let mut sections = vec![
            section(1, offline::PREFILL_DECODE, pr, || t.prefill_decode()),
            section(2, offline::CONTEXT_KNEE, pr, || t.context_knee()),
            section(3, offline::MEMORY, pr, || t.memory()),
            section(5, offline::BATCH_EDGES, pr, || t.batch_edges()),
            section(8, offline::DETERMINISM, pr, || t.determinism()),
        ];
        let max_len = engine.max_model_len();
        let handle = EngineHandle::spawn(engine);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let server = runtime.block_on(http::Server::start(handle))?;
        sections.push(section(6, http::CONCURRENCY, pr, || {
            runtime.block_on(server.concurrency(p, &tokenizer))
        }));
        sections.push(section(7, http::TOKEN_CAP, pr, || {
            runtime.block_on(server.token_cap(max_len, vocab))
        }));
        Ok((device, sections))
    }
}

pub fn run(args: Args) -> Result<()> {
    let plan = Plan::new(&args);
    let started = Instant::now();
    std::fs::create_dir_all(args.out.join("charts"))
        .with_context(|| format!("creating {}", args.out.display()))?;
    let progress = crate::bench::progress(8, "tests", args.format);
    let mut f32_model = args.model.clone();
    f32_model.dtype = WeightDType::F32;
    let numerics = f32_model.clone().on_backend(Numerics {
        args: &args,
        model: f32_model,
        progress: &progress,
    })?;
    let (device, mut sections) = args.model.on_backend(Suite {
        args: &args,
        plan: &plan,
        progress: &progress,
    })?;
    sections.push(numerics);
    sections.sort_by_key(|s| s.number);
    progress.finish_and_clear();

    let cpu = cpu_model();
    let header = format!(
        "Model `{}` (dtype {:?}) on `{device}`; CPU {cpu}; {}{:.1} minutes in all; ingot {}.",
        args.model.model.display(),
        args.model.dtype,
        if args.quick { "--quick; " } else { "" },
        started.elapsed().as_secs_f64() / 60.0,
        env!("CARGO_PKG_VERSION"),
    );
    let charts = charts::write(&args.out.join("charts"), &sections)?;
    let links: Vec<(&str, &str)> = charts.iter().map(|(t, f)| (*t, f.as_str())).collect();
    std::fs::write(
        args.out.join("report.md"),
        report::markdown(&header, &sections, &links),
    )?;
    let json = json!({
        "model": args.model.model,
        "dtype": format!("{:?}", args.model.dtype),
        "device": device,
        "cpu": cpu,
        "quick": args.quick,
        "seconds": started.elapsed().as_secs_f64(),
        "version": env!("CARGO_PKG_VERSION"),
        "status": report::worst(sections.iter().map(|s| s.status)),
        "sections": sections,
        "charts": charts.iter().map(|c| &c.1).collect::<Vec<_>>(),
    });
    std::fs::write(
        args.out.join("report.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    match args.format {
        Format::Json => println!("{json}"),
        Format::Text => {
            println!("{header}");
            for s in &sections {
                println!(
                    "  {}. {:<28} {}  {}",
                    s.number,
                    s.title,
                    s.status.label(),
                    s.finding
                );
            }
            println!("report: {}", args.out.join("report.md").display());
        }
    }
    let failed = sections.iter().filter(|s| s.status == Status::Fail).count();
    if failed > 0 {
        bail!("{failed} of {} tests failed", sections.len());
    }
    Ok(())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}
