//! `ingot generate`: prompts through the engine, printed as text or JSON lines.

use crate::device::{ModelArgs, OnBackend};
use anyhow::{Context, Result};
use clap::{ArgGroup, ValueEnum};
use ingot_backend::Backend;
use ingot_core::SamplingParams;
use ingot_engine::{Engine, EngineConfig};
use ingot_model::chat::Message;
use ingot_model::WeightDType;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Clone, Copy, ValueEnum)]
pub enum Format {
    Text,
    Json,
}

#[derive(clap::Args)]
#[command(group(ArgGroup::new("input").required(true).args(["prompt", "prompt_file", "prompts_file"])))]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long)]
    prompt: Option<String>,
    /// Read the prompt from this file.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// A JSON list of prompt strings, run together as one batch.
    #[arg(long)]
    prompts_file: Option<PathBuf>,
    /// Wrap each prompt as one user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: i32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Stop before this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    #[arg(long)]
    seed: Option<u64>,
    /// Samples per prompt.
    #[arg(long, default_value_t = 1)]
    n: usize,
    /// Keep generating past the end-of-sequence token (for benchmarks).
    #[arg(long)]
    ignore_eos: bool,
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
    #[command(flatten)]
    engine: EngineArgs,
}

/// Engine flags shared by every command that runs the engine.
#[derive(clap::Args)]
pub struct EngineArgs {
    /// The token budget of one step: longer prompts are prefilled in chunks.
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    /// Most sequences in one step (default: 64 on a GPU, 16 on the CPU).
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Context limit (default: the model's; on the CPU at most 4096).
    #[arg(long)]
    max_model_len: Option<usize>,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Bytes for the KV cache, allocated at start (default: on a GPU what
    /// --gpu-memory-utilization leaves after weights and activations; on the CPU what
    /// max-num-seqs sequences of max-model-len tokens use, at most half the available
    /// memory; on wgpu a quarter of the available memory, capped at that).
    #[arg(long)]
    kv_cache_memory: Option<usize>,
    /// Element type of the KV cache: auto (on the CPU f16, or f32 for f32 models; on a GPU the
    /// model's activation dtype), f32, f16 or bf16 (fp8 is refused: no backend's attention
    /// reads it yet).
    #[arg(long, default_value = "auto")]
    kv_cache_dtype: WeightDType,
    /// Share of the GPU's memory ingot may use.
    #[arg(long, default_value_t = 0.9)]
    gpu_memory_utilization: f64,
    #[arg(long)]
    no_prefix_caching: bool,
    /// Run decode steps op by op instead of replaying CUDA graphs.
    #[arg(long)]
    pub enforce_eager: bool,
}

impl EngineArgs {
    pub fn config(&self) -> EngineConfig {
        EngineConfig {
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_model_len: self.max_model_len,
            block_size: self.block_size,
            kv_cache_memory: self.kv_cache_memory,
            kv_cache_dtype: self.kv_cache_dtype.fixed(),
            gpu_memory_utilization: self.gpu_memory_utilization,
            prefix_caching: !self.no_prefix_caching,
            enforce_eager: self.enforce_eager,
            max_waiting: None,
            pooling: None,
        }
    }
}

fn read_prompts(args: &Args) -> Result<Vec<String>> {
    Ok(
        match (&args.prompt, &args.prompt_file, &args.prompts_file) {
            (Some(p), _, _) => vec![p.clone()],
            (_, Some(f), _) => vec![std::fs::read_to_string(f)
                .with_context(|| format!("cannot read {}", f.display()))?],
            (_, _, Some(f)) => {
                let text = std::fs::read_to_string(f)
                    .with_context(|| format!("cannot read {}", f.display()))?;
                serde_json::from_str(&text)
                    .with_context(|| format!("{} is not a JSON list of strings", f.display()))?
            }
            _ => unreachable!("clap requires one"),
        },
    )
}

pub fn run(args: Args) -> Result<()> {
    args.model.clone().on_backend(args)
}

impl OnBackend for Args {
    type Output = ();
    fn run<B: Backend + 'static>(self, devices: Vec<B>) -> Result<()> {
        generate(self, devices)
    }
}

fn generate<B: Backend + 'static>(args: Args, devices: Vec<B>) -> Result<()> {
    let texts = read_prompts(&args)?;
    let (ranks, tokenizer) = args.model.load(devices)?;
    let tokenizer = Arc::new(tokenizer);
    let prompts = texts
        .into_iter()
        .map(|text| {
            if args.chat {
                // A chat template already carries its special tokens.
                let rendered =
                    tokenizer.apply_chat_template(&[Message::new("user", text)], None)?;
                tokenizer.encode(&rendered, false)
            } else {
                tokenizer.encode(&text, true)
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        stop: args.stop.clone(),
        seed: args.seed,
        max_tokens: args.max_tokens,
        ignore_eos: args.ignore_eos,
        n: args.n,
        ..Default::default()
    };
    let mut engine = Engine::with_ranks(ranks, tokenizer, args.engine.config())?;
    let params = vec![params; prompts.len()];
    let outputs = engine.generate(prompts, &params)?;
    let stats = engine.stats();
    tracing::info!(
        "prefix cache: {} of {} prompt tokens hit; {} preemptions",
        stats.prefix_cache_hits,
        stats.prefix_cache_queries,
        stats.num_preemptions
    );
    for out in &outputs {
        let prompt_len = out.prompt_token_ids.len();
        let prefill_tok_s = prompt_len as f64 / out.time_to_first_token.as_secs_f64();
        let decode_time = (out.time_to_finish - out.time_to_first_token).as_secs_f64();
        // Each sample's first token comes from the prefill step, the rest from decode steps.
        let decode_steps = out
            .completions
            .iter()
            .map(|c| c.token_ids.len().saturating_sub(1))
            .max()
            .unwrap_or(0);
        let decode_tok_s = if decode_steps > 0 && decode_time > 0.0 {
            decode_steps as f64 / decode_time
        } else {
            0.0
        };
        for c in &out.completions {
            match args.format {
                Format::Text => println!("{}", c.text),
                Format::Json => println!(
                    "{}",
                    serde_json::json!({
                        "prompt_token_ids": out.prompt_token_ids,
                        "token_ids": c.token_ids,
                        "text": c.text,
                        "finish_reason": c.finish_reason,
                        "prefill_tok_s": prefill_tok_s,
                        "decode_tok_s": decode_tok_s,
                    })
                ),
            }
        }
        tracing::info!(
            "prompt {prompt_len} tokens ({prefill_tok_s:.1} tok/s to the first token), {} generated ({decode_tok_s:.1} tok/s)",
            out.completions.iter().map(|c| c.token_ids.len()).sum::<usize>()
        );
    }
    Ok(())
}
