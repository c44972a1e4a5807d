//! The model runner: owns the KV cache and the activation buffers, uploads each step's
//! metadata and returns the logits of the sampled rows.

use anyhow::{bail, ensure, Result};
use ingot_backend::sampling::mask_words;
use ingot_backend::{Backend, CacheLayout, DType, HostBuffer, LogitEdit, SampleRow};
use ingot_model::{Activations, Head, KvCache, Model, StepBuffers};
use std::sync::{mpsc, Arc};

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
    /// Run every step op by op, without recorded (CUDA graph) decode steps.
    pub enforce_eager: bool,
    /// Logits for sampling, or pooled rows for embeddings.
    pub head: Head,
}

pub struct ModelRunner<B: Backend> {
    pub backend: B,
    pub model: Model<B>,
    pub config: RunnerConfig,
    acts: Activations<B>,
    kv: KvCache<B>,
    step: StepBuffers<B>,
    /// i32 `[max_num_seqs]`: the greedy (or sampled) token of each sampled row.
    greedy: B::Buffer,
    /// `[max_num_seqs]` [`SampleRow`]s for sampling on the device.
    sample_rows: B::Buffer,
    /// [`LogitEdit`]s for sampling on the device, grown when a step needs more.
    logit_edits: B::Buffer,
    logit_edits_capacity: usize,
    /// Token bitmasks of the constrained rows ([`mask_words`] words each), grown when a
    /// step needs more rows.
    masks: B::Buffer,
    mask_rows_capacity: usize,
    /// Sampled rows of the submitted step.
    num_sampled: usize,
    /// The step's block tables at the device's row stride, kept from step to step: at 256
    /// sequences of 4,096 tokens they are 256 KiB, which a fresh vector would take from the
    /// system (and fault in) again every step.
    host_tables: Vec<u32>,
    /// Decode batch sizes that have run once, so their next step may be recorded.
    warm_buckets: Vec<usize>,
    /// The other ranks of a tensor-parallel group, which run every step beside this one.
    peers: Vec<Peer>,
}

/// A tensor-parallel rank other than the first: a runner of its own (computing the layers
/// only) on a thread of its own, given each step this one runs.
struct Peer {
    rank: usize,
    steps: Option<mpsc::Sender<Arc<StepInput>>>,
    /// Each step's outcome on the peer: queued on its device, or its error.
    submitted: mpsc::Receiver<Result<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Closing the channel ends the peer's loop.
        self.steps = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

const SAMPLE_ROW_WORDS: usize = size_of::<SampleRow>() / 4;
const EDIT_WORDS: usize = size_of::<LogitEdit>() / 4;

fn upload_u32<B: Backend>(b: &B, buf: &mut B::Buffer, v: &[u32]) -> Result<()> {
    b.upload(buf, bytemuck::cast_slice(v))
}

impl<B: Backend + 'static> ModelRunner<B> {
    /// The first rank of a tensor-parallel group whose other ranks run `peers`' models:
    /// each gets a runner of `config` computing the layers only, on its own thread.
    pub fn with_peers(
        backend: B,
        model: Model<B>,
        peers: Vec<(B, Model<B>)>,
        config: RunnerConfig,
    ) -> Result<Self> {
        let mut runner = Self::new(backend, model, config)?;
        for (backend, model) in peers {
            let rank = model.collective.as_ref().map_or(0, |c| c.rank());
            let peer = ModelRunner::new(
                backend,
                model,
                RunnerConfig {
                    head: Head::Layers,
                    ..config
                },
            )?;
            let (steps, inbox) = mpsc::channel::<Arc<StepInput>>();
            let (outcome, submitted) = mpsc::channel();
            let fail_at = injected_failure(rank);
            let thread = std::thread::Builder::new()
                .name(format!("rank {rank}"))
                .spawn(move || {
                    let mut peer = peer;
                    for (step, input) in (1..).zip(inbox) {
                        let r = match fail_at {
                            Some(at) if at == step => {
                                Err(anyhow::anyhow!("failure injected at step {step}"))
                            }
                            _ => peer.submit(&input),
                        };
                        if let (Err(e), Some(c)) = (&r, &peer.model.collective) {
                            c.abort(&format!("{e:#}"));
                        }
                        if outcome.send(r).is_err() {
                            break;
                        }
                    }
                    if peer.stopped().is_some() {
                        // See `Engine`'s drop: a failed group's device memory is not freed.
                        std::mem::forget(peer);
                    }
                })?;
            runner.peers.push(Peer {
                rank,
                steps: Some(steps),
                submitted,
                thread: Some(thread),
            });
        }
        Ok(runner)
    }
}

/// `INGOT_FAIL_RANK=R:S` makes tensor-parallel rank R (not 0) fail its S-th step (from 1)
/// instead of running it: how the tests show that a failing rank stops its group with its
/// error rather than hanging it.
fn injected_failure(rank: usize) -> Option<usize> {
    let v = std::env::var("INGOT_FAIL_RANK").ok()?;
    let (r, s) = v.split_once(':')?;
    (r.parse() == Ok(rank)).then(|| s.parse().ok()).flatten()
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
            "runner on {}: KV cache {} blocks x {} tokens ({} tokens) in {} ({:.1} MiB, allocated now), {} activations for {} tokens ({:.1} MiB)",
            backend.name(),
            config.num_blocks,
            config.block_size,
            config.num_blocks * config.block_size,
            config.kv_cache_dtype,
            kv.bytes as f64 / (1 << 20) as f64,
            model.weights.activation_dtype,
            t,
            acts.bytes as f64 / (1 << 20) as f64
        );
        let greedy = backend.alloc(DType::I32, s)?;
        let sample_rows = backend.alloc(DType::I32, s * SAMPLE_ROW_WORDS)?;
        let logit_edits_capacity = 4096;
        let logit_edits = backend.alloc(DType::I32, logit_edits_capacity * EDIT_WORDS)?;
        let mask_rows_capacity = 1;
        let masks = backend.alloc(DType::I32, mask_words(cfg.vocab_size))?;
        Ok(ModelRunner {
            backend,
            model,
            config,
            acts,
            kv,
            step,
            greedy,
            sample_rows,
            logit_edits,
            logit_edits_capacity,
            masks,
            mask_rows_capacity,
            num_sampled: 0,
            host_tables: vec![],
            warm_buckets: vec![],
            peers: vec![],
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }

    /// Why the tensor-parallel group stopped, once a rank failed: no step runs after that.
    pub fn stopped(&self) -> Option<String> {
        self.model.group_failure()
    }

    /// Runs one step and returns `[logits_indices.len(), vocab]` logits.
    pub fn execute(&mut self, input: &StepInput) -> Result<Vec<f32>> {
        self.submit(input)?;
        self.logits(input.logits_indices.len())
    }

    /// Queues, after the submitted step, a pick of each sampled row's token on the device
    /// with its [`SampleRow`], edits and bitmask (`masks` holds the masked rows' bitmasks
    /// back to back, [`mask_words`] words each), replacing the greedy tokens.
    pub fn sample(
        &mut self,
        rows: &[SampleRow],
        edits: &[LogitEdit],
        masks: &HostBuffer,
    ) -> Result<()> {
        ensure!(
            rows.len() == self.num_sampled,
            "one sample row per sampled token of the submitted step"
        );
        let b = &self.backend;
        let vocab = self.model.config.vocab_size;
        let words = mask_words(vocab);
        ensure!(
            masks.len().is_multiple_of(words),
            "masks of {words} words each"
        );
        if edits.len() > self.logit_edits_capacity {
            self.logit_edits_capacity = edits.len().next_power_of_two();
            self.logit_edits = b.alloc(DType::I32, self.logit_edits_capacity * EDIT_WORDS)?;
        }
        if masks.len() / words > self.mask_rows_capacity {
            self.mask_rows_capacity = (masks.len() / words).next_power_of_two();
            self.masks = b.alloc(DType::I32, self.mask_rows_capacity * words)?;
        }
        b.upload(&mut self.sample_rows, bytemuck::cast_slice(rows))?;
        b.upload(&mut self.logit_edits, bytemuck::cast_slice(edits))?;
        b.upload_host(&mut self.masks, masks)?;
        b.run_step(|| {
            b.sample(
                &mut self.acts.logits,
                rows.len(),
                vocab,
                &self.sample_rows,
                &self.logit_edits,
                &self.masks,
                &mut self.greedy,
            )
        });
        Ok(())
    }

    /// The tokens the device picked for the first `n` sampled rows of the last submitted
    /// step, once it has run.
    pub fn picked_ids(&self, n: usize) -> Result<Vec<u32>> {
        let ids = self.backend.download_i32(&self.greedy, n)?;
        Ok(ids.into_iter().map(|t| t as u32).collect())
    }

    /// The first `rows` pooled rows of the last submitted step (`[rows, hidden]`, f32),
    /// once it has run: final-normed rows, or for mean pooling each sequence's sum of them.
    pub fn pooled(&self, rows: usize) -> Result<Vec<f32>> {
        let d = self.model.config.hidden_size;
        self.backend
            .download_f32(self.acts.output(self.config.head), rows * d)
    }

    /// The logits of the first `rows` sampled rows of the last submitted step, once it has
    /// run.
    pub fn logits(&self, rows: usize) -> Result<Vec<f32>> {
        self.backend
            .download_f32(&self.acts.logits, rows * self.vocab_size())
    }

    fn validate(&self, input: &StepInput) -> Result<()> {
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
        ensure!(
            input.logits_indices.iter().all(|&i| (i as usize) < n),
            "logits row outside the step"
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
        Ok(())
    }

    /// The CUDA-graph batch size a decode-only step of `seqs` sequences pads to, if any.
    fn graph_bucket(&self, input: &StepInput) -> Option<usize> {
        let s = input.seq_lens.len();
        let decode_only = input.token_ids.len() == s
            && input.logits_indices.len() == s
            && input
                .logits_indices
                .iter()
                .enumerate()
                .all(|(i, &r)| r as usize == i);
        let recorded = !self.config.enforce_eager && !matches!(self.config.head, Head::Pool(_));
        if !recorded || !decode_only || !self.backend.records_steps() {
            return None;
        }
        let c = &self.config;
        graph_buckets(c.max_num_seqs.min(c.max_num_batched_tokens))
            .into_iter()
            .find(|&b| b >= s)
    }

    /// Validates, uploads and queues one step on the device and returns without waiting
    /// for it: the logits of the sampled rows in `acts.logits` and their greedy tokens in
    /// `greedy`. The download of its results waits for it.
    pub fn submit(&mut self, input: &StepInput) -> Result<()> {
        self.validate(input)?;
        if self.peers.is_empty() {
            return self.submit_valid(input);
        }
        let shared = Arc::new(input.clone());
        for p in &self.peers {
            let sent = p.steps.as_ref().map(|s| s.send(shared.clone()));
            ensure!(
                matches!(sent, Some(Ok(()))),
                "tensor-parallel rank {} has stopped",
                p.rank
            );
        }
        let mine = self.submit_valid(input);
        if let (Err(e), Some(c)) = (&mine, &self.model.collective) {
            c.abort(&format!("{e:#}"));
        }
        // Every peer answers before the next step is sent, so that an error is this
        // step's.
        let mut first_error = mine.err();
        for p in &self.peers {
            let outcome = p.submitted.recv().unwrap_or_else(|_| {
                Err(anyhow::anyhow!(
                    "tensor-parallel rank {} has stopped",
                    p.rank
                ))
            });
            if let Err(e) = outcome {
                first_error.get_or_insert(e.context(format!("tensor-parallel rank {}", p.rank)));
            }
        }
        if let Some(why) = self.stopped() {
            first_error.get_or_insert(anyhow::anyhow!("tensor-parallel group stopped: {why}"));
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// [`ModelRunner::submit`] of a validated step on this rank alone.
    fn submit_valid(&mut self, input: &StepInput) -> Result<()> {
        let bucket = self.graph_bucket(input);
        let (s, n) = (input.seq_lens.len(), input.token_ids.len());
        // Decode steps pad to their bucket with one-token sequences whose key and value are
        // not kept (slot -1) and that attend to themselves only.
        let rows = bucket.unwrap_or(s);
        let pad = rows - s;
        let stride = self.step.max_blocks_per_seq;
        let mut tables = std::mem::take(&mut self.host_tables);
        tables.clear();
        tables.resize(rows * stride, 0);
        for (dst, src) in tables
            .chunks_mut(stride)
            .zip(input.block_tables.chunks(input.max_blocks_per_seq.max(1)))
        {
            dst[..src.len()].copy_from_slice(src);
        }
        let padded = |v: &[u32], fill: &dyn Fn(usize) -> u32| -> Vec<u32> {
            v.iter().copied().chain((0..pad).map(fill)).collect()
        };
        let b = &self.backend;
        let st = &mut self.step;
        upload_u32(b, &mut st.token_ids, &padded(&input.token_ids, &|_| 0))?;
        upload_u32(b, &mut st.positions, &padded(&input.positions, &|_| 0))?;
        upload_u32(
            b,
            &mut st.slot_mapping,
            &padded(&input.slot_mapping, &|_| u32::MAX),
        )?;
        upload_u32(
            b,
            &mut st.query_start_loc,
            &padded(&input.query_start_loc, &|i| (n + i + 1) as u32),
        )?;
        upload_u32(b, &mut st.seq_lens, &padded(&input.seq_lens, &|_| 1))?;
        let uploaded = upload_u32(b, &mut st.block_tables, &tables);
        self.host_tables = tables;
        uploaded?;
        upload_u32(
            b,
            &mut st.logits_indices,
            &padded(&input.logits_indices, &|i| (s + i) as u32),
        )?;
        st.num_tokens = n + pad;
        st.num_seqs = rows;
        st.max_query_len = input
            .query_start_loc
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0);
        st.num_logits = input.logits_indices.len() + pad;
        self.num_sampled = input.logits_indices.len();
        let vocab = self.model.config.vocab_size;
        let head = self.config.head;
        let (model, acts, kv, greedy) =
            (&self.model, &mut self.acts, &mut self.kv, &mut self.greedy);
        let mut step = || {
            model.forward(b, st, acts, kv, head);
            if head == Head::Logits {
                b.argmax(&acts.logits, st.num_logits, vocab, greedy);
            }
        };
        match bucket {
            // A bucket's first step runs eagerly, which also sets up what capture cannot
            // (kernel lookups, GEMM plans); later ones replay its graph.
            Some(bucket) if self.warm_buckets.contains(&bucket) => {
                // A graph queues its collectives without asking the group, so once the
                // group has failed (its communicators aborted) none is replayed.
                if let Some(why) = model.group_failure() {
                    bail!("tensor-parallel group stopped: {why}");
                }
                b.run_recorded(bucket as u64, &mut step)?
            }
            Some(bucket) => {
                b.run_step(step);
                self.warm_buckets.push(bucket);
            }
            None => b.run_step(step),
        }
        Ok(())
    }
}

/// Batch sizes decode steps are recorded at: fine steps where small batches are common,
/// then every 64, up to `limit` (the most sequences and tokens a step may hold).
pub fn graph_buckets(limit: usize) -> Vec<usize> {
    let mut buckets: Vec<usize> = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
        .into_iter()
        .chain((192..).step_by(64))
        .take_while(|&b| b < limit)
        .collect();
    buckets.push(limit);
    buckets
}

#[cfg(test)]
mod tests {
    use super::graph_buckets;

    #[test]
    fn graph_buckets_end_at_the_limit() {
        assert_eq!(graph_buckets(1), [1]);
        assert_eq!(graph_buckets(20), [1, 2, 4, 8, 16, 20]);
        assert_eq!(
            graph_buckets(256),
            [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
        );
        assert_eq!(graph_buckets(300).last(), Some(&300));
    }
}
