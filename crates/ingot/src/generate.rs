//! `ingot generate`: one prompt through the paged runner, printed as text or JSON.

use anyhow::{Context, Result};
use clap::{ArgGroup, ValueEnum};
use ingot_backend::cpu::CpuBackend;
use ingot_engine::{GenerateOptions, Generator, ModelRunner, RunnerConfig};
use ingot_model::chat::Message;
use ingot_model::WeightDType;
use std::path::PathBuf;

#[derive(Clone, Copy, ValueEnum)]
pub enum Format {
    Text,
    Json,
}

#[derive(clap::Args)]
#[command(group(ArgGroup::new("input").required(true).args(["prompt", "prompt_file"])))]
pub struct Args {
    /// An HF model directory or a .gguf file.
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    prompt: Option<String>,
    /// Read the prompt from this file.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Wrap the prompt as one user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Keep generating past the end-of-sequence token (for benchmarks).
    #[arg(long)]
    ignore_eos: bool,
    /// auto keeps the checkpoint's dtype (GGUF stays quantized); f32, f16 or bf16 convert.
    #[arg(long, default_value = "auto")]
    dtype: WeightDType,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
    /// The token budget of one step: longer prompts are prefilled in chunks of this size.
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
}

pub fn run(args: Args) -> Result<()> {
    let backend = CpuBackend::new(args.threads)?;
    let (model, tokenizer) = ingot_model::load(&backend, &args.model, args.dtype)?;
    let text = match (&args.prompt, &args.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => {
            std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))?
        }
        (None, None) => unreachable!("clap requires one"),
    };
    let prompt_text = if args.chat {
        tokenizer.apply_chat_template(&[Message {
            role: "user".into(),
            content: text,
        }])?
    } else {
        text
    };
    // A chat template already carries its special tokens.
    let prompt = tokenizer.encode(&prompt_text, !args.chat)?;
    let max_model_len = model.config.max_position_embeddings;
    anyhow::ensure!(
        prompt.len() + args.max_tokens <= max_model_len,
        "the prompt has {} tokens and {} more were asked for, but the model's context is {max_model_len} tokens",
        prompt.len(),
        args.max_tokens
    );
    let config = RunnerConfig {
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: 1,
        max_model_len,
        block_size: args.block_size,
        num_blocks: (prompt.len() + args.max_tokens).div_ceil(args.block_size),
    };
    let mut generator = Generator::new(ModelRunner::new(backend, model, config)?);
    let opts = GenerateOptions {
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        seed: args.seed,
        stop_token_ids: if args.ignore_eos {
            vec![]
        } else {
            tokenizer.eos_token_ids.clone()
        },
    };
    let out = generator.generate(&prompt, &opts, false)?;
    let text = tokenizer.decode(&out.token_ids, true)?;
    let prefill_tok_s = prompt.len() as f64 / out.prefill_time.as_secs_f64();
    // The first token comes from the prefill step; each later one from a decode step.
    let decode_steps = out.token_ids.len().saturating_sub(1);
    let decode_tok_s = if decode_steps > 0 {
        decode_steps as f64 / out.decode_time.as_secs_f64()
    } else {
        0.0
    };
    match args.format {
        Format::Text => {
            println!("{text}");
            tracing::info!(
                "prompt {} tokens ({prefill_tok_s:.1} tok/s), generated {} tokens ({decode_tok_s:.1} tok/s)",
                prompt.len(),
                out.token_ids.len()
            );
        }
        Format::Json => {
            let v = serde_json::json!({
                "prompt_token_ids": prompt,
                "token_ids": out.token_ids,
                "text": text,
                "prefill_tok_s": prefill_tok_s,
                "decode_tok_s": decode_tok_s,
            });
            println!("{v}");
        }
    }
    Ok(())
}
