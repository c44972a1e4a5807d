//! Generation for one sequence through the paged runner: the prompt is prefilled in
//! chunks of the token budget, then tokens are decoded one step at a time. (The
//! continuous-batching engine replaces this driver; the runner and the cache stay.)

use crate::runner::{ModelRunner, StepInput};
use crate::sampler::Sampler;
use anyhow::{ensure, Result};
use ingot_backend::Backend;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub temperature: f32,
    pub seed: Option<u64>,
    /// Stop at these ids (EOS) unless empty.
    pub stop_token_ids: Vec<u32>,
}

#[derive(Clone, Debug, Default)]
pub struct Generation {
    pub token_ids: Vec<u32>,
    /// Logits behind each generated token, kept only when asked for.
    pub logits: Vec<Vec<f32>>,
    pub prefill_time: Duration,
    pub decode_time: Duration,
}

pub struct Generator<B: Backend> {
    pub runner: ModelRunner<B>,
}

impl<B: Backend> Generator<B> {
    pub fn new(runner: ModelRunner<B>) -> Self {
        Generator { runner }
    }

    /// Generates from `prompt`; `keep_logits` returns the logits of every step.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        keep_logits: bool,
    ) -> Result<Generation> {
        let c = self.runner.config;
        ensure!(!prompt.is_empty(), "the prompt is empty");
        ensure!(
            prompt.len() + opts.max_tokens <= c.max_model_len,
            "prompt of {} tokens plus {} new tokens exceeds the context of {} tokens",
            prompt.len(),
            opts.max_tokens,
            c.max_model_len
        );
        let needed = (prompt.len() + opts.max_tokens).div_ceil(c.block_size);
        ensure!(
            needed <= c.num_blocks,
            "the KV cache holds {} blocks, this request needs {needed}",
            c.num_blocks
        );
        // One sequence: its logical blocks map to physical blocks 0, 1, 2, ...
        let table: Vec<u32> = (0..needed as u32).collect();
        let mut sampler = Sampler::new(opts.temperature, opts.seed)?;
        let mut out = Generation::default();
        let mut step = |tokens: &[u32], start: usize| -> Result<Vec<f32>> {
            let n = tokens.len();
            let positions: Vec<u32> = (start as u32..(start + n) as u32).collect();
            let input = StepInput {
                token_ids: tokens.to_vec(),
                slot_mapping: positions
                    .iter()
                    .map(|&p| {
                        table[p as usize / c.block_size] * c.block_size as u32
                            + p % c.block_size as u32
                    })
                    .collect(),
                positions,
                query_start_loc: vec![0, n as u32],
                seq_lens: vec![(start + n) as u32],
                block_tables: table.clone(),
                max_blocks_per_seq: table.len(),
                logits_indices: vec![n as u32 - 1],
            };
            self.runner.execute(&input)
        };
        let t0 = Instant::now();
        let mut logits = vec![];
        for (i, chunk) in prompt.chunks(c.max_num_batched_tokens).enumerate() {
            logits = step(chunk, i * c.max_num_batched_tokens)?;
        }
        out.prefill_time = t0.elapsed();
        let t1 = Instant::now();
        let mut len = prompt.len();
        while out.token_ids.len() < opts.max_tokens {
            let next = sampler.sample(&logits);
            out.token_ids.push(next);
            if keep_logits {
                out.logits.push(std::mem::take(&mut logits));
            }
            if opts.stop_token_ids.contains(&next) || out.token_ids.len() == opts.max_tokens {
                break;
            }
            logits = step(&[next], len)?;
            len += 1;
        }
        out.decode_time = t1.elapsed();
        Ok(out)
    }
}
