//! `ingot bench masks`: the structured-output work of a step alone, on the host: rows of
//! one JSON-schema constraint stepped together through the engine's mask job (each row's
//! grammar advances past its token, then computes its next mask, on the worker threads), no
//! model. Every row walks the tokens of one answer valid under the schema (a model's: the
//! masks' cost depends on where in the grammar a row is, and a random walk through one's
//! masks stays mostly in whitespace, where they are cheap). Reports the time of a mask, of
//! an advance and of a whole step, and what the host's kernel did meanwhile (TLB shootdowns
//! and page faults of the process), which is where threads of one process slow each other
//! down (docs/benchmarks.md, 2026-12-03).

use super::{percentile, print_text, summary};
use crate::generate::Format;
use anyhow::{bail, ensure, Context, Result};
use ingot_backend::sampling::mask_words;
use ingot_backend::HostBuffer;
use ingot_core::StructuredOutput;
use ingot_engine::structured::Constraint;
use ingot_engine::{Grammars, MaskJob};
use ingot_model::Tokenizer;
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct MasksArgs {
    /// The tokenizer: an HF directory or a .gguf file.
    #[arg(long)]
    tokenizer: PathBuf,
    /// The JSON schema every row is constrained by.
    #[arg(long)]
    json_schema: PathBuf,
    /// The answer every row walks, a token a step: text valid under the schema, e.g. a
    /// model's (`bench/schemas/records-answer.txt` for `bench/schemas/records.json`).
    #[arg(long)]
    text: PathBuf,
    /// Rows stepped together (a step's constrained sequences).
    #[arg(long, default_value_t = 256)]
    rows: usize,
    /// Timed steps, an advance past a token of the text and a mask a row each (default:
    /// the text's tokens). The rows' parsers start in an untimed step before them.
    #[arg(long)]
    steps: Option<usize>,
    /// Worker threads (default: one a CPU, as `ingot serve`).
    #[arg(long)]
    threads: Option<usize>,
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
}

pub fn run(args: MasksArgs) -> Result<()> {
    ensure!(
        args.rows > 0 && args.steps != Some(0),
        "--rows and --steps must be at least 1"
    );
    if let Some(n) = args.threads {
        ensure!(n > 0, "--threads must be at least 1");
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("the worker threads were started already")?;
    }
    let tokenizer = Arc::new(Tokenizer::open(&args.tokenizer)?);
    let text = std::fs::read_to_string(&args.json_schema)
        .with_context(|| format!("cannot read {}", args.json_schema.display()))?;
    let schema = serde_json::from_str(&text)
        .with_context(|| format!("{} is not JSON", args.json_schema.display()))?;
    let answer = std::fs::read_to_string(&args.text)
        .with_context(|| format!("cannot read {}", args.text.display()))?;
    let mut tokens = tokenizer.encode(&answer, false)?;
    let steps = args.steps.unwrap_or(tokens.len());
    ensure!(
        steps <= tokens.len(),
        "--steps {steps}: the text has {} tokens",
        tokens.len()
    );
    tokens.truncate(steps);
    let vocab = tokenizer.vocab_size();
    let grammar = Grammars::new(tokenizer, vocab).compile(&StructuredOutput::JsonSchema(schema))?;
    let words = mask_words(vocab);
    // One walk first, as a server's first request: its lexer becomes the grammar's warm one,
    // which later rows start from.
    let mut rows = vec![(0, Constraint::new(&grammar))];
    start(&mut rows, words)?;
    walk(&mut rows, &tokens, words)?;
    rows = (1..=args.rows as u64)
        .map(|id| (id, Constraint::new(&grammar)))
        .collect();
    // The rows' parsers start before the timed steps: each start copies the warm lexer
    // under the warm parser's lock, which the rows of one step queue on (a burst of
    // requests does, a steady stream does not), and timed with the masks those waits read
    // as slow masks.
    let start_wall = start(&mut rows, words)?;
    let kernel = KernelCounters::now();
    let timed = walk(&mut rows, &tokens, words)?;
    let kernel = KernelCounters::now().since(&kernel);
    let threads = rayon::current_num_threads();
    let masks = timed.masks.max(1) as f64;
    let wall_us: Vec<f64> = timed.walls.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    let report = json!({
        "tokenizer": args.tokenizer,
        "json_schema": args.json_schema,
        "rows": args.rows,
        "steps": steps,
        "threads": threads,
        "masks": timed.masks,
        "mask_us": timed.mask.as_secs_f64() * 1e6 / masks,
        "advance_us": timed.advance.as_secs_f64() * 1e6 / masks,
        "step_wall_us": summary(&wall_us),
        "start_wall_us": start_wall.as_secs_f64() * 1e6,
        "tlb_shootdowns_per_mask": kernel.tlb_shootdowns.map(|n| n as f64 / masks),
        "minor_faults_per_mask": kernel.minor_faults.map(|n| n as f64 / masks),
    });
    match args.format {
        Format::Json => println!("{report}"),
        Format::Text => {
            println!(
                "{} rows x {} steps on {} threads: {} masks, {:.1} µs a mask, {:.1} µs an advance (each on its worker thread)",
                args.rows,
                steps,
                threads,
                timed.masks,
                report["mask_us"].as_f64().unwrap_or(0.0),
                report["advance_us"].as_f64().unwrap_or(0.0),
            );
            print_text(&report, &[("step wall µs", "step_wall_us")]);
            println!(
                "  p90 step wall {:.0} µs (the rows' parsers started in {:.0} µs before); TLB shootdowns {} a mask, minor page faults {} a mask",
                percentile(&wall_us, 90.0),
                start_wall.as_secs_f64() * 1e6,
                per_mask(&report["tlb_shootdowns_per_mask"]),
                per_mask(&report["minor_faults_per_mask"]),
            );
        }
    }
    Ok(())
}

fn per_mask(v: &serde_json::Value) -> String {
    v.as_f64()
        .map_or_else(|| "not read".into(), |x| format!("{x:.3}"))
}

/// What a walk measured: the masks computed, their time and their advances' summed, and
/// each step's wall time.
struct Walk {
    masks: usize,
    mask: Duration,
    advance: Duration,
    walls: Vec<Duration>,
}

/// Starts each row's parser and computes its first mask, in one mask job; returns its wall
/// time.
fn start(rows: &mut Vec<(u64, Constraint)>, words: usize) -> Result<Duration> {
    let started = Instant::now();
    let advance = vec![None; rows.len()];
    let job = MaskJob::start(std::mem::take(rows), advance, HostBuffer::default(), words).wait()?;
    let wall = started.elapsed();
    ensure!(
        job.staged.iter().all(|&s| s),
        "the schema allows no first token"
    );
    *rows = job.rows;
    Ok(wall)
}

/// Steps started `rows` through one mask job a token of `tokens`: each row advances past
/// the token and computes its next mask. Fails where the schema refuses a token of the text
/// or its grammar ends before the text does.
fn walk(rows: &mut Vec<(u64, Constraint)>, tokens: &[u32], words: usize) -> Result<Walk> {
    let mut out = Walk {
        masks: 0,
        mask: Duration::ZERO,
        advance: Duration::ZERO,
        walls: vec![],
    };
    let mut staging = HostBuffer::default();
    for (i, &token) in tokens.iter().enumerate() {
        let advance = vec![Some((token, true)); rows.len()];
        let started = Instant::now();
        let job = MaskJob::start(std::mem::take(rows), advance, staging, words).wait()?;
        out.walls.push(started.elapsed());
        out.masks += job.computed;
        out.mask += job.total;
        out.advance += job.advance_total;
        for (_, outcome) in &job.advanced {
            match outcome {
                Err(e) => bail!("token {i} of the text: {e:#}"),
                Ok(true) if i + 1 < tokens.len() => {
                    bail!("the schema's grammar is complete at token {i}, before the text's end")
                }
                Ok(_) => {}
            }
        }
        ensure!(
            job.staged.iter().all(|&s| s) || i + 1 == tokens.len(),
            "no mask after token {i} of the text"
        );
        *rows = job.rows;
        staging = job.staging;
    }
    Ok(out)
}

/// The process's TLB shootdowns (all CPUs' count in `/proc/interrupts`, Linux) and minor
/// page faults (`getrusage`), where the host tells them.
struct KernelCounters {
    tlb_shootdowns: Option<u64>,
    minor_faults: Option<u64>,
}

impl KernelCounters {
    fn now() -> KernelCounters {
        let tlb = std::fs::read_to_string("/proc/interrupts")
            .ok()
            .and_then(|s| {
                let line = s.lines().find(|l| l.trim_start().starts_with("TLB:"))?;
                Some(
                    line.split_whitespace()
                        .skip(1)
                        .map_while(|w| w.parse::<u64>().ok())
                        .sum(),
                )
            });
        // SAFETY: getrusage fills the struct it is given.
        let faults = unsafe {
            let mut usage: libc::rusage = std::mem::zeroed();
            (libc::getrusage(libc::RUSAGE_SELF, &mut usage) == 0).then_some(usage.ru_minflt as u64)
        };
        KernelCounters {
            tlb_shootdowns: tlb,
            minor_faults: faults,
        }
    }

    fn since(&self, before: &KernelCounters) -> KernelCounters {
        let diff = |a: Option<u64>, b: Option<u64>| Some(a?.saturating_sub(b?));
        KernelCounters {
            tlb_shootdowns: diff(self.tlb_shootdowns, before.tlb_shootdowns),
            minor_faults: diff(self.minor_faults, before.minor_faults),
        }
    }
}
