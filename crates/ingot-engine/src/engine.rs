//! The engine: requests in, per-sequence output deltas out, one scheduled step at a time.

use crate::detokenizer::Detokenizer;
use crate::embedding::PooledSeq;
use crate::mask_job::MaskJob;
use crate::runner::{ModelRunner, RunnerConfig, StepInput};
use crate::sampler::{Sampler, TokenLogprobs};
use crate::step_phases::{lap, StepPhases};
use crate::structured::{Constraint, Grammar, Grammars};
use anyhow::{anyhow, bail, Context, Result};
use ingot_backend::sampling::mask_words;
use ingot_backend::{host_available_memory, Backend, DType, HostBuffer, LogitEdit, SampleRow};
use ingot_core::{
    FinishReason, SamplingParams, Scheduler, SchedulerConfig, SchedulerOutput, SeqId, Sequence,
};
use ingot_model::{Activations, Head, KvCache, Model, Pooling, PoolingType, Tokenizer};
use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub type RequestId = u64;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub max_num_batched_tokens: usize,
    /// Defaults to [`default_max_num_seqs`]: 64 on a GPU, 16 on the CPU.
    pub max_num_seqs: Option<usize>,
    /// Defaults to the model's context length (at most 4096 on the CPU).
    pub max_model_len: Option<usize>,
    pub block_size: usize,
    /// Bytes for the KV cache. Defaults: on a GPU what `gpu_memory_utilization` leaves; on
    /// the CPU what `max_num_seqs` sequences of `max_model_len` tokens use (at most half
    /// the available memory); elsewhere a quarter of the available memory, capped at that.
    pub kv_cache_memory: Option<usize>,
    /// The KV cache's element type; `None` is the model's activation dtype.
    pub kv_cache_dtype: Option<DType>,
    /// On a GPU, the share of its memory ingot may take; the KV cache gets what the
    /// weights and activations leave of it.
    pub gpu_memory_utilization: f64,
    pub prefix_caching: bool,
    /// Run decode steps op by op instead of replaying recorded (CUDA graph) steps.
    pub enforce_eager: bool,
    /// Refuse a request whose sequences would take the number waiting beyond this.
    pub max_waiting: Option<usize>,
    /// Serve embeddings with this pooling instead of generating (`--task embed`).
    pub pooling: Option<Pooling>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_num_batched_tokens: 2048,
            max_num_seqs: None,
            max_model_len: None,
            block_size: 16,
            kv_cache_memory: None,
            kv_cache_dtype: None,
            gpu_memory_utilization: 0.9,
            prefix_caching: true,
            enforce_eager: false,
            max_waiting: None,
            pooling: None,
        }
    }
}

/// New output of one sequence of a request since the last delta.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqDelta {
    pub request_id: RequestId,
    /// Which of the request's `n` samples.
    pub index: usize,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub logprobs: Vec<TokenLogprobs>,
    pub finish_reason: Option<FinishReason>,
    /// On a sequence's first delta: how long it waited from arrival to its first step.
    pub queue_time: Option<Duration>,
    /// An embedding request's vector for input `index`, on its only delta.
    pub embedding: Option<Vec<f32>>,
}

/// A finished sample, as the offline API returns it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Completion {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub logprobs: Vec<TokenLogprobs>,
    pub finish_reason: Option<FinishReason>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestOutput {
    pub request_id: RequestId,
    pub prompt_token_ids: Vec<u32>,
    pub completions: Vec<Completion>,
    /// From the start of the `generate` call to this request's first token.
    pub time_to_first_token: Duration,
    /// From the start of the `generate` call to this request's last token.
    pub time_to_finish: Duration,
}

struct SeqState {
    request_id: RequestId,
    index: usize,
    sampler: Sampler,
    /// The request's structured-output constraint, advanced with every token.
    constraint: Option<Constraint>,
    detok: Detokenizer,
    /// Output text so far (cut at a stop string once one is found).
    text: String,
    /// Bytes of `text` already sent.
    sent: usize,
    /// Taken when the sequence first runs, which sets `queue_time`.
    arrival: Option<Instant>,
    /// Taken by the sequence's first delta.
    queue_time: Option<Duration>,
}

/// What the step whose deltas the last [`Engine::step`] returned ran: prompt tokens
/// (including recomputed ones) and decode tokens; and how long that call spent in the model
/// runner (waiting for the step and reading it back, uploading and queueing the next one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepInfo {
    pub prefill_tokens: usize,
    pub decode_tokens: usize,
    pub execute: Duration,
}

/// A request refused because the queue is full: the client may retry later.
#[derive(Debug, thiserror::Error)]
#[error("the server is at capacity: {waiting} sequences are waiting and this request adds {adds} (limit {limit})")]
pub struct QueueFull {
    pub waiting: usize,
    pub adds: usize,
    pub limit: usize,
}

/// Counts of sequences (each of a request's `n` samples is one) and of requests: a request
/// runs while any of its sequences runs, and waits otherwise.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineStats {
    pub num_running: usize,
    /// Sequences in the queue, and samples 2..n of requests whose first sample is still in
    /// its prefill.
    pub num_waiting: usize,
    pub num_requests_running: usize,
    pub num_requests_waiting: usize,
    pub num_preemptions: u64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub kv_cache_usage: f64,
    pub free_blocks: usize,
    pub total_blocks: usize,
    pub structured: StructuredStats,
    pub phases: StepPhases,
}

/// Structured-output work since start: token masks computed, the steps that computed them,
/// and the time they took.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StructuredStats {
    pub masks: u64,
    pub steps: u64,
    /// Summed over masks.
    pub mask_seconds: f64,
    /// Summed over steps: the wall time of each step's masks, computed in parallel.
    pub step_seconds: f64,
    /// Summed over sequences: the time of advancing their grammars past their new tokens.
    pub accept_seconds: f64,
}

/// Samples 2..n of a request, made only once the first sample's prefill is done: then they
/// find the prompt's blocks in the prefix cache, and a queued request costs the same
/// whatever its `n`.
struct Siblings {
    /// The first sample's sequence.
    first: SeqId,
    prompt: Vec<u32>,
    params: SamplingParams,
    grammar: Option<Grammar>,
    arrival: Instant,
}

/// A request's live sequences, and its siblings still to be made.
#[derive(Default)]
struct RequestState {
    seqs: Vec<SeqId>,
    siblings: Option<Siblings>,
}

impl RequestState {
    fn num_siblings(&self) -> usize {
        self.siblings.as_ref().map_or(0, |s| s.params.n - 1)
    }
}

pub struct Engine<B: Backend> {
    /// Dropped with the engine unless its tensor-parallel group failed (see the drop).
    runner: ManuallyDrop<ModelRunner<B>>,
    scheduler: Scheduler,
    tokenizer: Arc<Tokenizer>,
    grammars: Grammars,
    seqs: HashMap<SeqId, SeqState>,
    /// The inputs of embedding requests (an engine with a pooling runs only those).
    pooled: HashMap<SeqId, PooledSeq>,
    pooling: Option<Pooling>,
    requests: HashMap<RequestId, RequestState>,
    max_waiting: Option<usize>,
    next_seq: SeqId,
    /// Ids for `generate`'s requests, kept apart from callers' ids.
    next_offline_request: RequestId,
    last_step: StepInfo,
    structured_stats: StructuredStats,
    phases: StepPhases,
    /// The step on the device whose tokens the next [`Engine::step`] reads back.
    in_flight: Option<InFlight>,
    /// Structured-output masks being computed for the step being submitted; their
    /// sequences' constraints are away meanwhile.
    mask_jobs: Vec<MaskJob>,
    /// Whether each grammar that advanced past the tokens last read back is now complete
    /// (or why it refused its token), until settled.
    advanced: HashMap<SeqId, Result<bool>>,
    /// The masks of a step's constrained rows as uploaded, kept from step to step so that
    /// their megabytes are not allocated (and faulted in) anew each time, in the memory the
    /// backend uploads from fastest (page-locked on CUDA).
    mask_rows: HostBuffer,
}

impl<B: Backend> Drop for Engine<B> {
    fn drop(&mut self) {
        // A failed tensor-parallel group may leave a collective of a replayed graph
        // running on a device, waiting for the rank that failed: freeing memory waits for
        // the device and would hang. Such an engine's device state is left to the
        // process's exit.
        if self.runner.stopped().is_none() {
            // SAFETY: dropped once, here, and not used after.
            unsafe { ManuallyDrop::drop(&mut self.runner) };
        }
    }
}

/// How a step's tokens come back from the device.
enum Picks {
    /// Picked on the device (greedy or drawn): only the ids are read back.
    Ids,
    /// The sampled rows' logits, sampled on the host (which reports logprobs).
    Logits,
    /// Pooled rows of an embedding model.
    Pooled,
}

/// A submitted step whose results have not been read back.
struct InFlight {
    out: SchedulerOutput,
    /// The sequences whose next token the step samples (or whose rows it pools), in row
    /// order.
    sampled: Vec<SeqId>,
    picks: Picks,
    info: StepInfo,
    /// The rows and edits of a step sampled on the device, queued with its masks once
    /// they are in; taken then.
    device_rows: Option<(Vec<SampleRow>, Vec<LogitEdit>)>,
}

/// A sampled sequence's token, before it is committed.
struct Pick {
    id: SeqId,
    /// The sequence's output tokens before this one.
    num_before: usize,
    /// The token and its logprobs, or why the sequence cannot go on.
    picked: Result<(u32, Option<TokenLogprobs>)>,
}

/// A token committed to its sequence, whose text and stop strings are still to be checked.
struct NewToken {
    id: SeqId,
    /// `None` when the sequence's constraint failed and it ends without a token.
    token: Option<u32>,
    logprobs: Option<TokenLogprobs>,
    /// The sequence's output tokens, this one included.
    num_output: usize,
    /// A stop token (EOS or `stop_token_ids`) once `min_tokens` are out.
    stop_token: bool,
    /// The sequence has `max_tokens` outputs.
    at_length: bool,
    /// The sequence's structured-output grammar is complete.
    grammar_done: bool,
}

/// Sequences in one step by default on a GPU.
const GPU_MAX_NUM_SEQS: usize = 64;
/// On the CPU a few cores share every step, so batches stay small (16, as llama-server's
/// slots in the CPU comparison of docs/benchmarks.md), and every sequence's context is
/// committed host memory.
const CPU_MAX_NUM_SEQS: usize = 16;
/// On the CPU the default context is capped as llama.cpp's is: a long context on a few
/// cores takes minutes to prefill, and the KV cache is reserved for every sequence's.
const CPU_MAX_MODEL_LEN: usize = 4096;

/// The sequences a step takes when `max_num_seqs` is not given.
pub fn default_max_num_seqs<B: Backend>(backend: &B) -> usize {
    if backend.runs_on_host_cpu() {
        CPU_MAX_NUM_SEQS
    } else {
        GPU_MAX_NUM_SEQS
    }
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

impl<B: Backend> Engine<B> {
    pub fn new(
        backend: B,
        model: Model<B>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
    ) -> Result<Self>
    where
        B: 'static,
    {
        Self::with_peers(backend, model, vec![], tokenizer, config)
    }

    /// An engine on `ranks`' devices: one backend with its model, or a tensor-parallel
    /// group's backends with their shares, in rank order.
    pub fn with_ranks(
        ranks: Vec<(B, Model<B>)>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
    ) -> Result<Self>
    where
        B: 'static,
    {
        let mut ranks = ranks.into_iter();
        let (backend, model) = ranks.next().context("an engine needs a device")?;
        Self::with_peers(backend, model, ranks.collect(), tokenizer, config)
    }

    /// The engine of [`Engine::with_ranks`]: `model` is the first rank's share, on
    /// `backend`, and `peers` hold the other ranks' shares on theirs. The KV cache is sized
    /// from the first rank's device (every rank holds its heads' share of each block).
    fn with_peers(
        backend: B,
        model: Model<B>,
        peers: Vec<(B, Model<B>)>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
    ) -> Result<Self>
    where
        B: 'static,
    {
        let cfg = &model.config;
        let on_cpu = backend.runs_on_host_cpu();
        let max_model_len = match config.max_model_len {
            Some(len) => len,
            None if on_cpu && cfg.max_position_embeddings > CPU_MAX_MODEL_LEN => {
                tracing::info!(
                    "max_model_len {CPU_MAX_MODEL_LEN} on the CPU (the model's context is {} tokens; --max-model-len raises it)",
                    cfg.max_position_embeddings
                );
                CPU_MAX_MODEL_LEN
            }
            None => cfg.max_position_embeddings,
        };
        if max_model_len > cfg.max_position_embeddings {
            bail!(
                "--max-model-len {max_model_len} exceeds the model's context of {} tokens",
                cfg.max_position_embeddings
            );
        }
        let max_num_seqs = config
            .max_num_seqs
            .unwrap_or_else(|| default_max_num_seqs(&backend));
        if config.block_size == 0 || max_num_seqs == 0 || config.max_num_batched_tokens == 0 {
            bail!("--block-size, --max-num-seqs and --max-num-batched-tokens must be at least 1");
        }
        let activation = model.weights.activation_dtype;
        let kv_dtype = config
            .kv_cache_dtype
            .unwrap_or_else(|| backend.auto_kv_cache_dtype(model.weights.matrix_dtype, activation));
        if !backend.supports_kv_cache_dtype(kv_dtype) {
            bail!(
                "--kv-cache-dtype {kv_dtype} is not supported on {}",
                backend.name()
            );
        }
        if !(config.gpu_memory_utilization > 0.0 && config.gpu_memory_utilization <= 1.0) {
            bail!("--gpu-memory-utilization must be in (0, 1]");
        }
        let block_bytes = KvCache::<B>::block_bytes(cfg, config.block_size, kv_dtype);
        let useful = max_num_seqs * max_model_len.div_ceil(config.block_size);
        let num_blocks = match (config.kv_cache_memory, backend.memory_info()) {
            (Some(bytes), _) => bytes / block_bytes,
            (None, _) if on_cpu => {
                let half = host_available_memory().unwrap_or(8 << 30) / 2 / block_bytes;
                if half < useful {
                    tracing::warn!(
                        "{max_num_seqs} sequences of {max_model_len} tokens need {:.2} GiB of KV cache; taking half the available memory, {:.2} GiB (--kv-cache-memory, --max-num-seqs or --max-model-len set it)",
                        gib(useful * block_bytes),
                        gib(half * block_bytes)
                    );
                }
                useful.min(half)
            }
            (None, Some(mem)) => {
                // What is held already (weights, the context, library workspaces) and the
                // activations still to come are taken from the share first; the headroom
                // covers CUDA graphs and allocator rounding.
                let share = (mem.total as f64 * config.gpu_memory_utilization) as usize;
                let acts = Activations::<B>::bytes_needed(
                    &backend,
                    cfg,
                    activation,
                    config.max_num_batched_tokens,
                    max_num_seqs,
                    max_model_len,
                );
                let headroom = 256 << 20;
                let left = share.saturating_sub(mem.total - mem.free + acts + headroom);
                tracing::info!(
                    "device memory: {:.1} GiB total, {:.1} GiB free; {:.0}% share leaves {:.1} GiB for the KV cache",
                    gib(mem.total),
                    gib(mem.free),
                    config.gpu_memory_utilization * 100.0,
                    gib(left)
                );
                left / block_bytes
            }
            (None, None) => {
                (host_available_memory().unwrap_or(4 << 30) / 4 / block_bytes).min(useful)
            }
        };
        let num_blocks = match backend.max_buffer_bytes() {
            // Each layer's keys (and values) are one buffer.
            Some(max) => {
                let layer_block = kv_dtype.bytes_for(config.block_size * cfg.kv_size());
                let fit = max / layer_block;
                if num_blocks > fit {
                    tracing::info!("KV cache limited to {fit} blocks: one layer's keys must fit a buffer of {max} bytes on {}", backend.name());
                }
                num_blocks.min(fit)
            }
            None => num_blocks,
        };
        let min_blocks = max_model_len.div_ceil(config.block_size).min(useful);
        if num_blocks == 0 {
            bail!("no memory is left for one KV cache block ({block_bytes} bytes): raise --kv-cache-memory or --gpu-memory-utilization, or lower --max-num-batched-tokens");
        }
        if num_blocks < min_blocks {
            tracing::warn!("the KV cache holds {num_blocks} blocks: a sequence of max_model_len {max_model_len} tokens needs {min_blocks}");
        }
        let head = match &config.pooling {
            Some(p) => Head::Pool(p.kind),
            None => Head::Logits,
        };
        // A cached prefix skips tokens whose rows mean and CLS pooling need.
        let prefix_caching = match &config.pooling {
            Some(p) if p.kind != PoolingType::Last && config.prefix_caching => {
                tracing::info!(
                    "prefix caching off: {} pooling reads every prompt token",
                    p.kind.as_str()
                );
                false
            }
            _ => config.prefix_caching,
        };
        let runner = ModelRunner::with_peers(
            backend,
            model,
            peers,
            RunnerConfig {
                max_num_batched_tokens: config.max_num_batched_tokens,
                max_num_seqs,
                max_model_len,
                block_size: config.block_size,
                num_blocks,
                kv_cache_dtype: kv_dtype,
                enforce_eager: config.enforce_eager,
                head,
            },
        )?;
        let scheduler = Scheduler::new(SchedulerConfig {
            max_num_batched_tokens: config.max_num_batched_tokens,
            max_num_seqs,
            max_model_len,
            block_size: config.block_size,
            num_blocks,
            prefix_caching,
        });
        let grammars = Grammars::new(tokenizer.clone(), runner.vocab_size());
        let mask_rows = runner
            .backend
            .alloc_host(max_num_seqs * mask_words(runner.vocab_size()))
            .context("allocating the host memory of the structured-output masks")?;
        Ok(Engine {
            runner: ManuallyDrop::new(runner),
            scheduler,
            tokenizer,
            grammars,
            seqs: HashMap::new(),
            pooled: HashMap::new(),
            pooling: config.pooling,
            requests: HashMap::new(),
            max_waiting: config.max_waiting,
            next_seq: 0,
            next_offline_request: 1 << 63,
            last_step: StepInfo::default(),
            structured_stats: StructuredStats::default(),
            phases: StepPhases::default(),
            in_flight: None,
            mask_jobs: vec![],
            advanced: HashMap::new(),
            mask_rows,
        })
    }

    pub fn backend(&self) -> &B {
        &self.runner.backend
    }

    /// Why the engine can run no more steps, once a tensor-parallel rank failed.
    pub fn stopped(&self) -> Option<String> {
        self.runner.stopped()
    }

    /// [`Engine::stopped`] for another thread: it answers while this engine's thread waits
    /// on a device, as it may once a rank has failed.
    pub fn failure_watch(&self) -> impl Fn() -> Option<String> + Send + Sync + 'static
    where
        B: 'static,
    {
        let group = self.runner.model.collective.clone();
        move || group.as_ref().and_then(|c| c.failure())
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Compiles requests' structured-output constraints for this model's tokenizer.
    pub fn grammars(&self) -> &Grammars {
        &self.grammars
    }

    pub fn max_model_len(&self) -> usize {
        self.scheduler.config.max_model_len
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.scheduler.config.block_size
    }

    /// The pooling of an engine that serves embeddings; `None` where it generates.
    pub fn pooling(&self) -> Option<&Pooling> {
        self.pooling.as_ref()
    }

    /// The model's hidden size: an embedding's length before any `dimensions` cut.
    pub fn hidden_size(&self) -> usize {
        self.runner.model.config.hidden_size
    }

    pub fn last_step(&self) -> StepInfo {
        self.last_step
    }

    pub fn has_work(&self) -> bool {
        // Siblings wait on their first sample, which is in the scheduler until they are made.
        self.in_flight.is_some() || self.scheduler.has_work()
    }

    /// Sequences waiting: queued, and siblings not yet made.
    fn num_waiting(&self) -> usize {
        self.scheduler.num_waiting()
            + self
                .requests
                .values()
                .map(RequestState::num_siblings)
                .sum::<usize>()
    }

    pub fn stats(&self) -> EngineStats {
        let pool = &self.scheduler.pool;
        let running: std::collections::HashSet<RequestId> = self
            .scheduler
            .running()
            .iter()
            .map(|s| self.request_of(s.id))
            .collect();
        EngineStats {
            num_running: self.scheduler.num_running(),
            num_waiting: self.num_waiting(),
            num_requests_running: running.len(),
            num_requests_waiting: self.requests.len() - running.len(),
            num_preemptions: self.scheduler.num_preemptions,
            prefix_cache_queries: pool.stats.queries,
            prefix_cache_hits: pool.stats.hits,
            kv_cache_usage: pool.usage(),
            free_blocks: pool.num_free(),
            total_blocks: pool.num_blocks(),
            structured: self.structured_stats,
            phases: self.phases,
        }
    }

    /// The request a live sequence (or embedding input) belongs to.
    fn request_of(&self, id: SeqId) -> RequestId {
        match self.seqs.get(&id) {
            Some(st) => st.request_id,
            None => self.pooled[&id].request_id,
        }
    }

    /// Refuses a request that would take the sequences waiting beyond `max_waiting`.
    fn check_queue(&self, adds: usize) -> Result<()> {
        if let Some(limit) = self.max_waiting {
            let waiting = self.num_waiting();
            if waiting + adds > limit {
                return Err(QueueFull {
                    waiting,
                    adds,
                    limit,
                }
                .into());
            }
        }
        Ok(())
    }

    /// Queues an embedding request: each input runs through the model to its last token
    /// and comes back as one delta with its vector (cut to `dimensions` where given).
    pub fn add_embed_request(
        &mut self,
        request_id: RequestId,
        inputs: Vec<Vec<u32>>,
        dimensions: Option<usize>,
    ) -> Result<()> {
        let Some(pooling) = &self.pooling else {
            bail!("this server generates text: embeddings need a model served with --task embed");
        };
        if inputs.is_empty() {
            bail!("an embedding request needs at least one input");
        }
        if let Some(d) = dimensions {
            pooling.check_dimensions(d, self.runner.model.config.hidden_size)?;
        }
        let vocab = self.runner.vocab_size() as u32;
        for (i, input) in inputs.iter().enumerate() {
            if let Some(t) = input.iter().find(|&&t| t >= vocab) {
                bail!("input {i}: token id {t} is outside the vocabulary of {vocab}");
            }
            self.scheduler
                .check_admissible(input.len(), 0, 1)
                .map_err(|e| anyhow!(e).context(format!("input {i}")))?;
        }
        self.check_queue(inputs.len())?;
        let arrival = Instant::now();
        let mut seqs = Vec::with_capacity(inputs.len());
        for (index, input) in inputs.into_iter().enumerate() {
            let id = self.next_seq;
            self.next_seq += 1;
            self.pooled
                .insert(id, PooledSeq::new(request_id, index, dimensions, arrival));
            self.scheduler
                .add(Sequence::new(id, input, 0))
                .expect("admission checked every input");
            seqs.push(id);
        }
        self.requests.insert(
            request_id,
            RequestState {
                seqs,
                siblings: None,
            },
        );
        Ok(())
    }

    /// Queues a request; it is rejected here if its parameters are invalid, its
    /// structured-output constraint does not compile, it can never fit, or (with
    /// [`QueueFull`]) the queue is full.
    pub fn add_request(
        &mut self,
        request_id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<()> {
        let grammar = self.grammars.compile_for(params.structured.as_ref())?;
        self.add_compiled_request(request_id, prompt, params, grammar)
    }

    /// As [`add_request`](Self::add_request), with the constraint of `params` compiled
    /// already (by [`Engine::grammars`], off the engine's thread).
    pub fn add_compiled_request(
        &mut self,
        request_id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        grammar: Option<Grammar>,
    ) -> Result<()> {
        if self.pooling.is_some() {
            bail!("this server runs an embedding model (--task embed): it does not generate text; use /v1/embeddings");
        }
        params.validate(self.runner.vocab_size())?;
        if params.structured.is_some() != grammar.is_some() {
            bail!("a request's structured-output constraint must be compiled with it");
        }
        let vocab = self.runner.vocab_size() as u32;
        if let Some(t) = prompt.iter().find(|&&t| t >= vocab) {
            bail!("prompt token id {t} is outside the vocabulary of {vocab}");
        }
        self.scheduler
            .check_admissible(prompt.len(), params.max_tokens, params.n)?;
        self.check_queue(params.n)?;
        let arrival = Instant::now();
        let first = self.new_seq(request_id, 0, &prompt, &params, grammar.as_ref(), arrival);
        let siblings = (params.n > 1).then_some(Siblings {
            first,
            prompt,
            params,
            grammar,
            arrival,
        });
        self.requests.insert(
            request_id,
            RequestState {
                seqs: vec![first],
                siblings,
            },
        );
        Ok(())
    }

    /// Queues sample `index` of a request.
    fn new_seq(
        &mut self,
        request_id: RequestId,
        index: usize,
        prompt: &[u32],
        params: &SamplingParams,
        grammar: Option<&Grammar>,
        arrival: Instant,
    ) -> SeqId {
        let id = self.next_seq;
        self.next_seq += 1;
        let sampler = Sampler::new(params.clone(), &self.tokenizer.eos_token_ids, index as u64);
        let detok = Detokenizer::new(prompt, params.skip_special_tokens);
        self.seqs.insert(
            id,
            SeqState {
                request_id,
                index,
                sampler,
                constraint: grammar.map(|g| self.constraint(g, prompt, params)),
                detok,
                text: String::new(),
                sent: 0,
                arrival: Some(arrival),
                queue_time: None,
            },
        );
        self.scheduler
            .add(Sequence::new(id, prompt.to_vec(), params.max_tokens))
            .expect("admission checked every sample");
        id
    }

    /// A sequence's constraint: from its first token, or from the end of its reasoning where
    /// the model reasons first and the prompt has not closed the section.
    fn constraint(&self, grammar: &Grammar, prompt: &[u32], params: &SamplingParams) -> Constraint {
        let Some(m) = &params.reasoning else {
            return Constraint::new(grammar);
        };
        let ids = |text: &str| self.tokenizer.encode(text, false).unwrap_or_default();
        let (start, end) = (ids(&m.start), ids(&m.end));
        let last = |marker: &[u32]| {
            (!marker.is_empty())
                .then(|| prompt.windows(marker.len()).rposition(|w| w == marker))
                .flatten()
        };
        let closed = match (last(&start), last(&end)) {
            (Some(s), Some(e)) => e > s,
            (None, Some(_)) => true,
            _ => false,
        };
        if closed {
            Constraint::new(grammar)
        } else {
            Constraint::after(grammar, end)
        }
    }

    /// Makes and queues the siblings of a request whose first sample `first` has its
    /// prompt in the cache.
    fn release_siblings(&mut self, request_id: RequestId, first: SeqId) {
        let Some(req) = self.requests.get_mut(&request_id) else {
            return;
        };
        if req.siblings.as_ref().is_none_or(|s| s.first != first) {
            return;
        }
        let sib = req.siblings.take().expect("checked above");
        let ids: Vec<SeqId> = (1..sib.params.n)
            .map(|index| {
                self.new_seq(
                    request_id,
                    index,
                    &sib.prompt,
                    &sib.params,
                    sib.grammar.as_ref(),
                    sib.arrival,
                )
            })
            .collect();
        if let Some(req) = self.requests.get_mut(&request_id) {
            req.seqs.extend(ids);
        }
    }

    /// Forgets a finished (or aborted) sequence; the request goes when its last sequence
    /// does.
    fn finish_seq(&mut self, request_id: RequestId, id: SeqId) {
        self.scheduler.remove(id);
        self.seqs.remove(&id);
        self.pooled.remove(&id);
        if let Some(req) = self.requests.get_mut(&request_id) {
            req.seqs.retain(|&s| s != id);
            if req.seqs.is_empty() && req.siblings.is_none() {
                self.requests.remove(&request_id);
            }
        }
    }

    /// Aborts every sequence of a request, queued siblings included, and frees its blocks
    /// at once.
    pub fn abort(&mut self, request_id: RequestId) -> bool {
        let Some(req) = self.requests.remove(&request_id) else {
            return false;
        };
        for id in req.seqs {
            self.scheduler.remove(id);
            self.seqs.remove(&id);
            self.pooled.remove(&id);
        }
        true
    }

    /// Aborts every sequence that has not started: queued ones that have produced nothing
    /// (a preempted sequence keeps its place) and siblings not yet made. Returns, per
    /// request touched, how many samples it lost and whether it is gone.
    pub fn abort_unstarted(&mut self) -> Vec<(RequestId, usize, bool)> {
        let mut lost: HashMap<RequestId, usize> = HashMap::new();
        for (&request_id, req) in &mut self.requests {
            if let Some(sib) = req.siblings.take() {
                *lost.entry(request_id).or_default() += sib.params.n - 1;
            }
        }
        let unstarted: Vec<SeqId> = self
            .scheduler
            .waiting()
            .filter(|s| s.num_output() == 0)
            .map(|s| s.id)
            .collect();
        for id in unstarted {
            let request_id = self.request_of(id);
            *lost.entry(request_id).or_default() += 1;
            self.finish_seq(request_id, id);
        }
        lost.into_iter()
            .map(|(id, n)| (id, n, !self.requests.contains_key(&id)))
            .collect()
    }

    fn step_input(&self, out: &SchedulerOutput) -> (StepInput, Vec<SeqId>) {
        let bs = self.scheduler.config.block_size;
        let mut input = StepInput {
            query_start_loc: vec![0],
            ..Default::default()
        };
        let seqs: Vec<&Sequence> = out
            .seqs
            .iter()
            .map(|s| self.scheduler.get(s.id).expect("scheduled sequences run"))
            .collect();
        input.max_blocks_per_seq = seqs.iter().map(|s| s.block_table.len()).max().unwrap_or(0);
        let mut sampled = vec![];
        for (sch, seq) in out.seqs.iter().zip(seqs) {
            for p in sch.start..sch.start + sch.len {
                input.token_ids.push(seq.tokens[p]);
                input.positions.push(p as u32);
                input
                    .slot_mapping
                    .push(seq.block_table[p / bs] * bs as u32 + (p % bs) as u32);
            }
            input.query_start_loc.push(input.token_ids.len() as u32);
            input.seq_lens.push((sch.start + sch.len) as u32);
            let row_end = input.block_tables.len() + input.max_blocks_per_seq;
            input.block_tables.extend_from_slice(&seq.block_table);
            input.block_tables.resize(row_end, 0);
            let end = input.token_ids.len() as u32;
            let row = match self.pooling.as_ref().map(|p| p.kind) {
                // Every sequence of the step has its sum, in order.
                Some(PoolingType::Mean) => {
                    sampled.push(seq.id);
                    continue;
                }
                Some(PoolingType::Cls) => (sch.start == 0).then_some(end - sch.len as u32),
                Some(PoolingType::Last) | None => {
                    (sch.start + sch.len == seq.tokens.len()).then_some(end - 1)
                }
            };
            if let Some(row) = row {
                input.logits_indices.push(row);
                sampled.push(seq.id);
            }
        }
        (input, sampled)
    }

    /// Runs one step and returns the deltas of every sequence that produced output.
    ///
    /// The host's work overlaps the device's: a call reads back the tokens of the step the
    /// call before it submitted, commits them (stop tokens and `max_tokens` end sequences
    /// here), queues the next step's forward pass, and only then detokenizes and checks
    /// stop strings while the device runs it. Structured-output grammars advance past the
    /// tokens read back on the worker threads, each going on to its next mask, while this
    /// thread commits, schedules and submits; the step's token picks are queued once the
    /// masks are in, and the text is made after that, while the device samples. So a call
    /// returns the deltas of the step before; a sequence that a stop string or the end of
    /// its grammar ends has one more step in flight, whose token is dropped.
    pub fn step(&mut self) -> Result<Vec<SeqDelta>> {
        let mut in_runner = Duration::ZERO;
        let mut mark = Instant::now();
        let done = match self.in_flight.take() {
            Some(f) => {
                let picked = self.read_back(&f)?;
                in_runner += mark.elapsed();
                lap(&mut self.phases.wait_device, &mut mark);
                let info = f.info;
                let done = match picked {
                    Sampled::Pooled(rows) => (info, Done::Pooled(self.commit_pooled(f, rows))),
                    picked => (info, Done::Tokens(self.commit(f, picked))),
                };
                lap(&mut self.phases.commit, &mut mark);
                Some(done)
            }
            None => None,
        };
        let out = self.scheduler.schedule();
        lap(&mut self.phases.schedule, &mut mark);
        if !out.seqs.is_empty() {
            in_runner += self.submit(out)?;
            lap(&mut self.phases.submit, &mut mark);
        }
        if done.is_some() || self.in_flight.is_some() {
            self.phases.steps += 1;
        }
        // `finish_submit` laps its own phases.
        in_runner += self.finish_submit()?;
        mark = Instant::now();
        // The previous step's text is made while the device runs this step's forward pass
        // and sampling.
        let deltas = match done {
            Some((info, done)) => {
                self.last_step = info;
                match done {
                    Done::Tokens(mut tokens) => {
                        self.settle_grammars(&mut tokens);
                        lap(&mut self.phases.advance_grammars, &mut mark);
                        self.deliver(tokens)
                    }
                    Done::Pooled(deltas) => Ok(deltas),
                }
            }
            None => {
                self.last_step = StepInfo::default();
                Ok(vec![])
            }
        };
        lap(&mut self.phases.deliver, &mut mark);
        self.last_step.execute = in_runner;
        deltas
    }

    /// Starts the token masks that the constrained rows of a submitted step still lack
    /// (rows whose grammar did not just advance: their first token, or back from
    /// preemption) on the worker threads.
    fn start_masks(&mut self, sampled: &[SeqId]) {
        let rows: Vec<(SeqId, Constraint)> = sampled
            .iter()
            .filter_map(|id| {
                let st = self.seqs.get_mut(id)?;
                let c = st.constraint.as_ref()?;
                (c.is_active() && !c.has_mask()).then_some(())?;
                Some((*id, st.constraint.take()?))
            })
            .collect();
        if rows.is_empty() {
            return;
        }
        let words = mask_words(self.runner.vocab_size());
        let advance = vec![None; rows.len()];
        self.mask_jobs
            .push(MaskJob::start(rows, advance, HostBuffer::default(), words));
    }

    /// Completes the submitted step once its masks are in: the constraints go back to their
    /// sequences, and a step sampled on the device queues its pick with the masks. Returns
    /// the time spent in the model runner.
    fn finish_submit(&mut self) -> Result<Duration> {
        let mut mark = Instant::now();
        let (mut computed, mut wall) = (0, Duration::ZERO);
        let words = mask_words(self.runner.vocab_size());
        // The jobs' mask rows end to end (the first job's rows in place), and each staged
        // sequence's row among them. The advance's job took the rows kept from the last
        // step, and a step without it uses them here. The page-locked buffer is the one
        // kept, whichever job held it.
        let mut masks = std::mem::take(&mut self.mask_rows);
        masks.clear();
        let mut staged_rows = HashMap::new();
        for job in std::mem::take(&mut self.mask_jobs) {
            let job = job.wait()?;
            computed += job.computed;
            wall += job.wall;
            self.structured_stats.mask_seconds += job.total.as_secs_f64();
            self.structured_stats.accept_seconds += job.advance_total.as_secs_f64();
            self.advanced.extend(job.advanced);
            let first_row = masks.len() / words;
            let roomier = |b: &HostBuffer| (b.is_pinned(), b.capacity());
            if masks.is_empty() && roomier(&job.staging) >= roomier(&masks) {
                masks = job.staging;
            } else {
                masks.extend_from_slice(job.staging.as_slice());
            }
            for (i, ((id, c), staged)) in job.rows.into_iter().zip(job.staged).enumerate() {
                if staged {
                    staged_rows.insert(id, (first_row + i) as u32);
                }
                // A stop string may have ended the sequence meanwhile.
                if let Some(state) = self.seqs.get_mut(&id) {
                    state.constraint = Some(c);
                }
            }
        }
        if computed > 0 {
            let st = &mut self.structured_stats;
            st.masks += computed as u64;
            st.steps += 1;
            st.step_seconds += wall.as_secs_f64();
        }
        lap(&mut self.phases.wait_masks, &mut mark);
        let Some(f) = self.in_flight.as_mut() else {
            self.mask_rows = masks;
            return Ok(Duration::ZERO);
        };
        let Some((mut rows, edits)) = f.device_rows.take() else {
            self.mask_rows = masks;
            return Ok(Duration::ZERO);
        };
        for (row, id) in rows.iter_mut().zip(&f.sampled) {
            if let Some(&r) = staged_rows.get(id) {
                row.mask = r + 1;
                continue;
            }
            // A mask computed in an earlier step (a sequence back from preemption) is
            // copied here. A failed mask leaves the row unmasked: commit drops its token.
            let constraint = self.seqs.get(id).and_then(|s| s.constraint.as_ref());
            if let Some(c) = constraint {
                let start = masks.len();
                masks.resize(start + words);
                if c.write_mask(&mut masks.as_mut_slice()[start..]) {
                    row.mask = (masks.len() / words) as u32;
                } else {
                    masks.truncate(start);
                }
            }
        }
        let started = Instant::now();
        let sampled = self.runner.sample(&rows, &edits, &masks);
        let in_runner = started.elapsed();
        self.mask_rows = masks;
        sampled?;
        lap(&mut self.phases.sample, &mut mark);
        Ok(in_runner)
    }

    /// Queues a scheduled step's forward pass on the device and starts its masks; returns
    /// the time spent in the model runner.
    fn submit(&mut self, out: SchedulerOutput) -> Result<Duration> {
        if self.pooling.is_some() {
            return self.submit_pooled(out);
        }
        let (input, sampled) = self.step_input(&out);
        let mut info = StepInfo::default();
        for s in &out.seqs {
            let seq = self.scheduler.get(s.id).expect("scheduled sequences run");
            if s.len == 1 && s.start + 1 == seq.tokens.len() && seq.num_output() > 0 {
                info.decode_tokens += 1;
            } else {
                info.prefill_tokens += s.len;
            }
            let st = self.seqs.get_mut(&s.id).expect("every sequence has state");
            if let Some(arrival) = st.arrival.take() {
                st.queue_time = Some(arrival.elapsed());
            }
        }
        // Plain greedy rows need only their argmax, which the device sends back alone.
        let greedy = sampled.iter().all(|id| {
            let seq = self.scheduler.get(*id).expect("sampled sequences run");
            let st = &self.seqs[id];
            // The constraint itself may be away, computing its mask.
            st.sampler.params().structured.is_none() && st.sampler.is_plain_greedy(seq.num_output())
        });
        // Otherwise a device that samples picks the tokens (masked where a constraint
        // says) unless a row wants logprobs, which are computed from the logits on the
        // host.
        let on_device = self.runner.backend.samples_on_device()
            && sampled
                .iter()
                .all(|id| self.seqs[id].sampler.params().logprobs.is_none());
        let started = Instant::now();
        self.runner.submit(&input)?;
        let in_runner = started.elapsed();
        self.start_masks(&sampled);
        let (picks, device_rows) = if greedy {
            (Picks::Ids, None)
        } else if on_device {
            let mut rows = Vec::with_capacity(sampled.len());
            let mut edits = vec![];
            for id in &sampled {
                let seq = self.scheduler.get(*id).expect("sampled sequences run");
                let state = self.seqs.get_mut(id).expect("every sequence has state");
                rows.push(
                    state
                        .sampler
                        .device_row(&seq.tokens, seq.num_output(), &mut edits),
                );
            }
            (Picks::Ids, Some((rows, edits)))
        } else {
            (Picks::Logits, None)
        };
        self.in_flight = Some(InFlight {
            out,
            sampled,
            picks,
            info,
            device_rows,
        });
        Ok(in_runner)
    }

    /// Queues a step of embedding inputs; returns the time spent in the model runner.
    fn submit_pooled(&mut self, out: SchedulerOutput) -> Result<Duration> {
        for id in &out.preempted {
            if let Some(p) = self.pooled.get_mut(id) {
                p.restart();
            }
        }
        let (input, sampled) = self.step_input(&out);
        for s in &out.seqs {
            let p = self.pooled.get_mut(&s.id).expect("every input has state");
            if let Some(arrival) = p.arrival.take() {
                p.queue_time = Some(arrival.elapsed());
            }
        }
        let info = StepInfo {
            prefill_tokens: out.num_tokens,
            ..Default::default()
        };
        let started = Instant::now();
        self.runner.submit(&input)?;
        self.in_flight = Some(InFlight {
            out,
            sampled,
            picks: Picks::Pooled,
            info,
            device_rows: None,
        });
        Ok(started.elapsed())
    }

    /// Commits a step of embedding inputs: folds in their pooled rows, and each input whose
    /// prompt is now all computed ends with its vector (its blocks freed at once).
    fn commit_pooled(&mut self, f: InFlight, rows: Vec<f32>) -> Vec<SeqDelta> {
        let pooling = self.pooling.clone().expect("an embedding engine");
        let ready = self.scheduler.commit(&f.out);
        let d = self.runner.model.config.hidden_size;
        for (id, row) in f.sampled.iter().zip(rows.chunks(d)) {
            if let Some(p) = self.pooled.get_mut(id) {
                p.add(pooling.kind, row);
            }
        }
        let mut deltas = Vec::with_capacity(ready.len());
        for id in ready {
            let Some(p) = self.pooled.remove(&id) else {
                continue;
            };
            let num_tokens = self.scheduler.get(id).map_or(0, |s| s.prompt_len);
            let (request_id, index, queue_time) = (p.request_id, p.index, p.queue_time);
            deltas.push(SeqDelta {
                request_id,
                index,
                token_ids: vec![],
                text: String::new(),
                logprobs: vec![],
                finish_reason: Some(FinishReason::Stop),
                queue_time,
                embedding: Some(p.finish(&pooling, num_tokens)),
            });
            self.finish_seq(request_id, id);
        }
        deltas
    }

    /// Waits for a submitted step and reads back its tokens, its sampled rows' logits, or
    /// its pooled rows.
    fn read_back(&self, f: &InFlight) -> Result<Sampled> {
        let rows = f.sampled.len();
        Ok(match f.picks {
            Picks::Ids => Sampled::Tokens(self.runner.picked_ids(rows)?),
            Picks::Logits => Sampled::Logits(self.runner.logits(rows)?),
            Picks::Pooled => Sampled::Pooled(self.runner.pooled(rows)?),
        })
    }

    /// Commits a step that has run: its computed tokens, and the token of each sampled
    /// sequence, which a stop token or `max_tokens` may end here (so that the next step
    /// does not run it).
    fn commit(&mut self, f: InFlight, picked: Sampled) -> Vec<NewToken> {
        let ready = self.scheduler.commit(&f.out);
        let picks = self.picks(f.sampled, picked);
        self.advance_grammars(&picks);
        let mut tokens = Vec::with_capacity(picks.len());
        for Pick {
            id,
            num_before,
            picked,
        } in picks
        {
            let state = self.seqs.get_mut(&id).expect("every sequence has state");
            let request_id = state.request_id;
            let (token, logprobs) = match picked {
                Ok(picked) => picked,
                Err(e) => {
                    tracing::warn!("request {request_id}: {e:#}");
                    self.scheduler.remove(id);
                    tokens.push(NewToken {
                        id,
                        token: None,
                        logprobs: None,
                        num_output: num_before,
                        stop_token: false,
                        at_length: false,
                        grammar_done: false,
                    });
                    continue;
                }
            };
            let num_output = num_before + 1;
            let p = state.sampler.params();
            let stop_token = num_output >= p.min_tokens && state.sampler.is_stop_token(token);
            let at_length = num_output >= p.max_tokens;
            self.scheduler.append(id, token);
            if stop_token || at_length {
                self.scheduler.remove(id);
            }
            self.release_siblings(request_id, id);
            tokens.push(NewToken {
                id,
                token: Some(token),
                logprobs,
                num_output,
                stop_token,
                at_length,
                grammar_done: false,
            });
        }
        debug_assert_eq!(ready, tokens.iter().map(|t| t.id).collect::<Vec<_>>());
        tokens
    }

    /// The token of each sampled sequence still running, with its output count before:
    /// read back, or sampled here from its logits (masked by its constraint).
    fn picks(&mut self, sampled: Vec<SeqId>, picked: Sampled) -> Vec<Pick> {
        let vocab = self.runner.vocab_size();
        let mut picks = Vec::with_capacity(sampled.len());
        for (k, id) in sampled.into_iter().enumerate() {
            // A stop string or an abort ended this sequence while the step ran.
            let Some(seq) = self.scheduler.get(id) else {
                continue;
            };
            let state = self.seqs.get_mut(&id).expect("every sequence has state");
            let picked = match &picked {
                // A constrained row's token stands only where its mask did.
                Sampled::Tokens(ids) => match state.constraint.as_ref().map(|c| c.allowed()) {
                    Some(Err(e)) => Err(e),
                    _ => Ok((ids[k], None)),
                },
                Sampled::Pooled(_) => unreachable!("commit_pooled takes pooled steps"),
                Sampled::Logits(logits) => {
                    let mut row = logits[k * vocab..(k + 1) * vocab].to_vec();
                    state.sampler.sample(
                        &mut row,
                        &seq.tokens,
                        seq.num_output(),
                        state.constraint.as_ref(),
                    )
                }
            };
            picks.push(Pick {
                id,
                num_before: seq.num_output(),
                picked,
            });
        }
        picks
    }

    /// Starts advancing the constraints of the picked tokens' sequences past their tokens
    /// on the worker threads, each row going on to its next mask in the same task (a
    /// matcher's step takes microseconds). This thread commits, schedules and submits the
    /// next step meanwhile; [`finish_submit`](Self::finish_submit) takes the job's masks and
    /// outcome, and [`settle_grammars`](Self::settle_grammars) applies the outcome before the
    /// tokens are delivered.
    fn advance_grammars(&mut self, picks: &[Pick]) {
        let mut rows = Vec::with_capacity(picks.len());
        // Each row's token, and whether the sequence has a next token to mask (a stop token
        // or its last token ends it here).
        let mut advance = Vec::with_capacity(picks.len());
        for p in picks {
            let Ok((token, _)) = &p.picked else { continue };
            let Some(st) = self.seqs.get_mut(&p.id) else {
                continue;
            };
            if let Some(c) = st.constraint.take() {
                let params = st.sampler.params();
                let n = p.num_before + 1;
                let stops = n >= params.min_tokens && st.sampler.is_stop_token(*token);
                advance.push(Some((*token, n < params.max_tokens && !stops)));
                rows.push((p.id, c));
            }
        }
        if rows.is_empty() {
            return;
        }
        let staging = std::mem::take(&mut self.mask_rows);
        let words = mask_words(self.runner.vocab_size());
        self.mask_jobs
            .push(MaskJob::start(rows, advance, staging, words));
    }

    /// Applies the outcome of the grammars' advance past `tokens`: a complete grammar ends
    /// its sequence with this token, and a token the grammar refused ends it without the
    /// token, both as a stop string would (the step already submitted computes one more
    /// token for it, which is dropped).
    fn settle_grammars(&mut self, tokens: &mut [NewToken]) {
        for t in tokens {
            match self.advanced.remove(&t.id) {
                Some(Ok(complete)) => t.grammar_done = complete,
                Some(Err(e)) => {
                    let request_id = self.request_of(t.id);
                    tracing::warn!("request {request_id}: {e:#}");
                    t.token = None;
                    t.logprobs = None;
                }
                None => {}
            }
        }
        self.advanced.clear();
    }

    /// Detokenizes committed tokens into deltas; a stop string ends its sequence here.
    fn deliver(&mut self, tokens: Vec<NewToken>) -> Result<Vec<SeqDelta>> {
        let mut deltas = Vec::with_capacity(tokens.len());
        for t in tokens {
            let state = self
                .seqs
                .get_mut(&t.id)
                .expect("committed sequences have state");
            let id = t.id;
            let delta = Self::advance(&self.tokenizer, state, t)?;
            if delta.finish_reason.is_some() {
                self.finish_seq(delta.request_id, id);
            }
            deltas.push(delta);
        }
        Ok(deltas)
    }

    /// Folds a new token into a sequence's text, checking stop strings, and says whether
    /// and why the sequence ends.
    fn advance(tok: &Tokenizer, st: &mut SeqState, t: NewToken) -> Result<SeqDelta> {
        let p = st.sampler.params();
        let mut finish = None;
        let mut flush = false;
        match t.token {
            None => finish = Some(FinishReason::Error),
            Some(_) if t.stop_token => finish = Some(FinishReason::Stop),
            Some(token) => {
                let before = st.text.len();
                st.text.push_str(&st.detok.push(tok, token)?);
                if t.num_output >= p.min_tokens {
                    if let Some(cut) = find_stop(&st.text, &p.stop, before) {
                        st.text.truncate(cut);
                        finish = Some(FinishReason::Stop);
                    }
                }
                if finish.is_none() && t.grammar_done {
                    finish = Some(FinishReason::Stop);
                    flush = true;
                }
            }
        }
        if finish.is_none() && t.at_length {
            finish = Some(FinishReason::Length);
            flush = true;
        }
        if flush {
            st.text.push_str(&st.detok.flush(tok)?);
        }
        // Hold back what could still become a stop string.
        let hold = if finish.is_some() {
            0
        } else {
            p.stop.iter().map(|s| s.len() - 1).max().unwrap_or(0)
        };
        let mut end = st.text.len().saturating_sub(hold).max(st.sent);
        while !st.text.is_char_boundary(end) {
            end -= 1;
        }
        let text = st.text[st.sent..end].to_string();
        st.sent = end;
        Ok(SeqDelta {
            request_id: st.request_id,
            index: st.index,
            token_ids: t.token.into_iter().collect(),
            text,
            logprobs: t.logprobs.into_iter().collect(),
            finish_reason: finish,
            queue_time: st.queue_time.take(),
            embedding: None,
        })
    }

    /// Offline generation: runs every prompt to completion, batched, and returns the
    /// outputs in prompt order.
    pub fn generate(
        &mut self,
        prompts: Vec<Vec<u32>>,
        params: &[SamplingParams],
    ) -> Result<Vec<RequestOutput>> {
        assert_eq!(prompts.len(), params.len(), "one SamplingParams per prompt");
        let start = Instant::now();
        let base = self.next_offline_request;
        self.next_offline_request += prompts.len() as u64;
        let mut outputs: Vec<RequestOutput> = Vec::with_capacity(prompts.len());
        for (i, (prompt, p)) in prompts.into_iter().zip(params).enumerate() {
            let id = base + i as u64;
            outputs.push(RequestOutput {
                request_id: id,
                prompt_token_ids: prompt.clone(),
                completions: vec![Completion::default(); p.n],
                ..Default::default()
            });
            if let Err(e) = self.add_request(id, prompt, p.clone()) {
                for o in &outputs {
                    self.abort(o.request_id);
                }
                return Err(e.context(format!("prompt {i}")));
            }
        }
        while self.has_work() {
            for d in self.step()? {
                let out = &mut outputs[(d.request_id - base) as usize];
                if out.time_to_first_token.is_zero() {
                    out.time_to_first_token = start.elapsed();
                }
                out.time_to_finish = start.elapsed();
                let c = &mut out.completions[d.index];
                c.token_ids.extend(d.token_ids);
                c.text.push_str(&d.text);
                c.logprobs.extend(d.logprobs);
                c.finish_reason = d.finish_reason;
            }
        }
        Ok(outputs)
    }
}

impl<B: Backend> Engine<B> {
    /// Offline embeddings: runs every input to its vector, batched, and returns them in
    /// input order.
    pub fn embed(
        &mut self,
        inputs: Vec<Vec<u32>>,
        dimensions: Option<usize>,
    ) -> Result<Vec<Vec<f32>>> {
        let id = self.next_offline_request;
        self.next_offline_request += 1;
        let mut out = vec![vec![]; inputs.len()];
        self.add_embed_request(id, inputs, dimensions)?;
        while self.has_work() {
            for d in self.step()? {
                if let (true, Some(e)) = (d.request_id == id, d.embedding) {
                    out[d.index] = e;
                }
            }
        }
        Ok(out)
    }
}

/// What a step brings back: greedy tokens picked on the device, the sampled rows' logits,
/// or pooled rows.
enum Sampled {
    Tokens(Vec<u32>),
    Logits(Vec<f32>),
    Pooled(Vec<f32>),
}

/// A read-back step, committed: tokens whose text is still to make, or finished embeddings.
enum Done {
    Tokens(Vec<NewToken>),
    Pooled(Vec<SeqDelta>),
}

/// Byte offset of the earliest stop string that ends after `from`, if any.
fn find_stop(text: &str, stops: &[String], from: usize) -> Option<usize> {
    stops
        .iter()
        .filter_map(|s| {
            let mut start = from.saturating_sub(s.len() - 1);
            while !text.is_char_boundary(start) {
                start -= 1;
            }
            text[start..].find(s.as_str()).map(|i| start + i)
        })
        .min()
}

#[cfg(test)]
mod tests {
    use super::find_stop;

    #[test]
    fn stop_strings_are_found_across_deltas() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        assert_eq!(find_stop("abc EN", &stops, 4), None);
        assert_eq!(find_stop("abc END", &stops, 6), Some(4));
        assert_eq!(find_stop("héllo\n\nx", &stops, 6), Some(6));
    }
}
