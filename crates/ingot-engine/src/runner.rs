//! The model runner: owns the KV cache and the activation buffers, uploads each step's
//! metadata and returns the logits of the sampled rows.

use anyhow::{ensure, Result};
use ingot_backend::{Backend, CacheLayout, DType};
use ingot_model::{Activations, KvCache, Model, StepBuffers};

/// One step on the host: a flattened batch of sequences. Sequence `s` contributes token
/// rows `query_start_loc[s]..query_start_loc[s+1]`, which are the last tokens of its
/// context of `seq_lens[s]` tokens.
#[derive(Clone, Debug, Default)]
pub struct StepInput {
    pub token_ids: Vec<u32>,
    pub positions: Vec<u32>,
    /// Cache slot of each token (`block * block_size + offset`).
    pub slot_mapping: Vec<u32>,
    pub query_start_loc: Vec<u32>,
    pub seq_lens: Vec<u32>,
    /// Row-major `[num_seqs, max_blocks_per_seq]`, padded with 0.
    pub block_tables: Vec<u32>,
    pub max_blocks_per_seq: usize,
    /// Token rows whose logits are returned, in order.
    pub logits_indices: Vec<u32>,
}

#[derive(Clone, Copy, Debug)]
pub struct RunnerConfig {
    /// The token budget: most tokens in one step.
    pub max_num_batched_tokens: usize,
    /// Most sequences in one step.
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub kv_cache_dtype: DType,
}

pub struct ModelRunner<B: Backend> {
    pub backend: B,
    pub model: Model<B>,
    pub config: RunnerConfig,
    acts: Activations<B>,
    kv: KvCache<B>,
    step: StepBuffers<B>,
}

fn upload_u32<B: Backend>(b: &B, buf: &mut B::Buffer, v: &[u32]) -> Result<()> {
    b.upload(buf, bytemuck::cast_slice(v))
}

impl<B: Backend> ModelRunner<B> {
    pub fn new(backend: B, model: Model<B>, config: RunnerConfig) -> Result<Self> {
        let cfg = &model.config;
        ensure!(
            config.block_size > 0 && config.num_blocks > 0,
            "the KV cache needs at least one block"
        );
        ensure!(
            config.max_num_batched_tokens > 0 && config.max_num_seqs > 0,
            "empty token budget"
        );
        let max_blocks = config.max_model_len.div_ceil(config.block_size);
        let b = &backend;
        let acts = Activations::new(
            b,
            cfg,
            model.weights.activation_dtype,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.max_model_len,
        )?;
        let kv = KvCache::new(
            b,
            cfg,
            CacheLayout {
                num_blocks: config.num_blocks,
                block_size: config.block_size,
            },
            config.kv_cache_dtype,
        )?;
        let t = config.max_num_batched_tokens;
        let s = config.max_num_seqs;
        let step = StepBuffers {
            token_ids: b.alloc(DType::I32, t)?,
            positions: b.alloc(DType::I32, t)?,
            slot_mapping: b.alloc(DType::I32, t)?,
            query_start_loc: b.alloc(DType::I32, s + 1)?,
            seq_lens: b.alloc(DType::I32, s)?,
            block_tables: b.alloc(DType::I32, s * max_blocks)?,
            logits_indices: b.alloc(DType::I32, s)?,
            num_tokens: 0,
            num_seqs: 0,
            max_blocks_per_seq: max_blocks,
            max_query_len: 0,
            num_logits: 0,
        };
        tracing::info!(
            "runner on {}: KV cache {} blocks x {} tokens in {} ({:.1} MiB), {} activations for {} tokens ({:.1} MiB)",
            backend.name(),
            config.num_blocks,
            config.block_size,
            config.kv_cache_dtype,
            kv.bytes as f64 / (1 << 20) as f64,
            model.weights.activation_dtype,
            t,
            acts.bytes as f64 / (1 << 20) as f64
        );
        Ok(ModelRunner {
            backend,
            model,
            config,
            acts,
            kv,
            step,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }

    /// Runs one step and returns `[logits_indices.len(), vocab]` logits.
    pub fn execute(&mut self, input: &StepInput) -> Result<Vec<f32>> {
        let n = input.token_ids.len();
        let s = input.seq_lens.len();
        let c = &self.config;
        ensure!(
            n > 0 && n <= c.max_num_batched_tokens,
            "step of {n} tokens outside the budget of {}",
            c.max_num_batched_tokens
        );
        ensure!(
            s > 0 && s <= c.max_num_seqs,
            "step of {s} sequences outside the limit of {}",
            c.max_num_seqs
        );
        ensure!(
            input.positions.len() == n && input.slot_mapping.len() == n,
            "positions/slots do not match the tokens"
        );
        ensure!(
            input.query_start_loc.len() == s + 1 && input.query_start_loc[s] as usize == n,
            "query_start_loc does not cover the tokens"
        );
        ensure!(
            input.query_start_loc[0] == 0 && input.query_start_loc.windows(2).all(|w| w[0] < w[1]),
            "query_start_loc must rise from 0, one token or more per sequence"
        );
        ensure!(
            input.max_blocks_per_seq <= self.step.max_blocks_per_seq,
            "block tables wider than max_model_len allows"
        );
        ensure!(
            input.block_tables.len() == s * input.max_blocks_per_seq,
            "block tables are not [num_seqs, max_blocks_per_seq]"
        );
        ensure!(
            input.logits_indices.len() <= c.max_num_seqs,
            "more logits rows than sequences"
        );
        let vocab = self.model.config.vocab_size as u32;
        ensure!(
            input.token_ids.iter().all(|&t| t < vocab),
            "token id outside the vocabulary of {vocab}"
        );
        ensure!(
            input
                .positions
                .iter()
                .all(|&p| (p as usize) < c.max_model_len),
            "position beyond max_model_len {}",
            c.max_model_len
        );
        let slots = (c.num_blocks * c.block_size) as u32;
        ensure!(
            input.slot_mapping.iter().all(|&x| x < slots),
            "slot outside the KV cache"
        );
        ensure!(
            input
                .block_tables
                .iter()
                .all(|&x| (x as usize) < c.num_blocks),
            "block outside the KV cache"
        );

        // Re-lay the tables at the stride the device buffer was sized for.
        let stride = self.step.max_blocks_per_seq;
        let mut tables = vec![0u32; s * stride];
        for (dst, src) in tables
            .chunks_mut(stride)
            .zip(input.block_tables.chunks(input.max_blocks_per_seq.max(1)))
        {
            dst[..src.len()].copy_from_slice(src);
        }
        let b = &self.backend;
        let st = &mut self.step;
        upload_u32(b, &mut st.token_ids, &input.token_ids)?;
        upload_u32(b, &mut st.positions, &input.positions)?;
        upload_u32(b, &mut st.slot_mapping, &input.slot_mapping)?;
        upload_u32(b, &mut st.query_start_loc, &input.query_start_loc)?;
        upload_u32(b, &mut st.seq_lens, &input.seq_lens)?;
        upload_u32(b, &mut st.block_tables, &tables)?;
        upload_u32(b, &mut st.logits_indices, &input.logits_indices)?;
        st.num_tokens = n;
        st.num_seqs = s;
        st.max_query_len = input
            .query_start_loc
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0);
        st.num_logits = input.logits_indices.len();
        let (model, acts, kv) = (&self.model, &mut self.acts, &mut self.kv);
        b.run_step(|| model.forward(b, st, acts, kv));
        b.synchronize()?;
        b.download_f32(&self.acts.logits, st.num_logits * vocab as usize)
    }
}
