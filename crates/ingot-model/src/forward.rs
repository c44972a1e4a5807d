//! The paged forward pass of one engine step, as a sequence of backend ops.

use crate::config::ModelConfig;
use crate::moe::MoeBuffers;
use crate::pooling::PoolingType;
use crate::weights::{MlpBuffers, Weights};
use anyhow::Result;
use ingot_backend::{
    AttentionMetadata, Backend, CacheLayout, Collective, DType, MlpScratch, QkvLayout, RopeKvWrite,
};
use std::sync::Arc;

/// The per-step inputs on the device. Sequence `s` owns token rows
/// `query_start_loc[s]..query_start_loc[s+1]`; `logits_indices` picks the rows whose next
/// token is wanted (usually each sequence's last).
pub struct StepBuffers<B: Backend> {
    pub token_ids: B::Buffer,
    pub positions: B::Buffer,
    pub slot_mapping: B::Buffer,
    pub query_start_loc: B::Buffer,
    pub seq_lens: B::Buffer,
    pub block_tables: B::Buffer,
    pub logits_indices: B::Buffer,
    pub num_tokens: usize,
    pub num_seqs: usize,
    pub max_blocks_per_seq: usize,
    pub max_query_len: usize,
    pub num_logits: usize,
}

/// What a step computes at its end: the logits of the rows in `logits_indices` (a
/// generating model), or pooled hidden states (an embedding model; the lm_head is not run).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Head {
    Logits,
    /// Last-token and CLS pooling take the final-normed rows in `logits_indices`; mean
    /// pooling sums each sequence's final-normed rows of the step.
    Pool(PoolingType),
    /// Only the layers: a tensor-parallel rank other than the first, which computes the
    /// head from the same residual stream.
    Layers,
}

/// Every intermediate of a step, sized once from the token budget: in the model's
/// activation dtype, but for the f32 logits, pooled sums and RoPE table.
pub struct Activations<B: Backend> {
    hidden: B::Buffer,
    normed: B::Buffer,
    proj: B::Buffer,
    qkv: B::Buffer,
    attn: B::Buffer,
    gate_up: B::Buffer,
    act: B::Buffer,
    last: B::Buffer,
    last_normed: B::Buffer,
    attn_workspace: B::Buffer,
    /// A mixture of experts' buffers, where the model has one.
    moe: Option<MoeBuffers<B>>,
    pub logits: B::Buffer,
    /// f32 `[max_logits, hidden]`: each sequence's sum of final-normed rows (mean pooling).
    sums: B::Buffer,
    cos_sin: B::Buffer,
    pub max_tokens: usize,
    pub max_logits: usize,
    pub max_positions: usize,
    pub bytes: usize,
}

impl<B: Backend> Activations<B> {
    /// Where a step with `head` left its rows: logits, pooled `[rows, hidden]` (in the
    /// activation dtype for last-token and CLS pooling, f32 sums for mean pooling), or the
    /// residual stream of every token after the layers.
    pub fn output(&self, head: Head) -> &B::Buffer {
        match head {
            Head::Logits => &self.logits,
            Head::Layers => &self.hidden,
            Head::Pool(PoolingType::Mean) => &self.sums,
            Head::Pool(_) => &self.last_normed,
        }
    }

    /// Element counts of the activation-dtype buffers, in field order.
    fn sizes(cfg: &ModelConfig, max_tokens: usize, max_logits: usize) -> [usize; 9] {
        let (d, f) = (cfg.hidden_size, cfg.intermediate_size);
        let qkv_len = cfg.q_size() + 2 * cfg.kv_size();
        [
            max_tokens * d,
            max_tokens * d,
            max_tokens * d,
            max_tokens * qkv_len,
            max_tokens * cfg.q_size(),
            max_tokens * 2 * f,
            max_tokens * f,
            max_logits * d,
            max_logits * d,
        ]
    }

    fn layout(cfg: &ModelConfig) -> QkvLayout {
        QkvLayout {
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        }
    }

    /// Bytes [`Activations::new`] allocates, known before it runs (to size the KV cache).
    pub fn bytes_needed(
        b: &B,
        cfg: &ModelConfig,
        dtype: DType,
        max_tokens: usize,
        max_logits: usize,
        max_positions: usize,
    ) -> usize {
        let acts: usize = Self::sizes(cfg, max_tokens, max_logits).iter().sum();
        let moe: usize = match &cfg.moe {
            Some(moe) => MoeBuffers::sizes(b, moe.shape(max_tokens, cfg.hidden_size))
                .iter()
                .sum(),
            None => 0,
        };
        let f32s = moe
            + max_logits * cfg.vocab_size
            + max_logits * cfg.hidden_size
            + max_positions * cfg.head_dim
            + b.attention_workspace_len(Self::layout(cfg), max_logits);
        dtype.bytes_for(acts) + 4 * f32s
    }

    /// Buffers of `dtype` for steps of up to `max_tokens` tokens, `max_logits` sampled
    /// rows (at most one per sequence) and positions below `max_positions`.
    pub fn new(
        b: &B,
        cfg: &ModelConfig,
        dtype: DType,
        max_tokens: usize,
        max_logits: usize,
        max_positions: usize,
    ) -> Result<Self> {
        let mut bufs = Self::sizes(cfg, max_tokens, max_logits)
            .iter()
            .map(|&n| b.alloc(dtype, n))
            .collect::<Result<Vec<_>>>()?
            .into_iter();
        let logits = b.alloc(DType::F32, max_logits * cfg.vocab_size)?;
        let sums = b.alloc(DType::F32, max_logits * cfg.hidden_size)?;
        let attn_workspace = b.alloc(
            DType::F32,
            b.attention_workspace_len(Self::layout(cfg), max_logits),
        )?;
        let mut cos_sin = b.alloc(DType::F32, max_positions * cfg.head_dim)?;
        b.upload(
            &mut cos_sin,
            bytemuck::cast_slice(&crate::rope::cos_sin_table(cfg, max_positions)),
        )?;
        let moe = match &cfg.moe {
            Some(moe) => Some(MoeBuffers::new(b, moe.shape(max_tokens, cfg.hidden_size))?),
            None => None,
        };
        let mut next = || bufs.next().expect("one buffer per size");
        Ok(Activations {
            hidden: next(),
            normed: next(),
            proj: next(),
            qkv: next(),
            attn: next(),
            gate_up: next(),
            act: next(),
            last: next(),
            last_normed: next(),
            attn_workspace,
            moe,
            logits,
            sums,
            cos_sin,
            max_tokens,
            max_logits,
            max_positions,
            bytes: Self::bytes_needed(b, cfg, dtype, max_tokens, max_logits, max_positions),
        })
    }
}

/// The paged KV cache: per layer a key and a value buffer of
/// `[num_blocks, block_size, num_kv_heads, head_dim]` in `dtype`.
pub struct KvCache<B: Backend> {
    pub layers: Vec<(B::Buffer, B::Buffer)>,
    pub layout: CacheLayout,
    pub dtype: DType,
    pub bytes: usize,
}

impl<B: Backend> KvCache<B> {
    pub fn new(b: &B, cfg: &ModelConfig, layout: CacheLayout, dtype: DType) -> Result<Self> {
        let numel = layout.num_blocks * layout.block_size * cfg.kv_size();
        let layers = (0..cfg.num_layers)
            .map(|_| Ok((b.alloc(dtype, numel)?, b.alloc(dtype, numel)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache {
            layers,
            layout,
            dtype,
            bytes: layout.num_blocks * Self::block_bytes(cfg, layout.block_size, dtype),
        })
    }

    /// Bytes one block takes across all layers (keys and values).
    pub fn block_bytes(cfg: &ModelConfig, block_size: usize, dtype: DType) -> usize {
        2 * dtype.bytes_for(block_size * cfg.kv_size()) * cfg.num_layers
    }
}

pub struct Model<B: Backend> {
    /// The shapes this device runs: the whole model's, or a tensor-parallel rank's share.
    pub config: ModelConfig,
    pub weights: Weights<B>,
    /// The tensor-parallel group this rank's partial sums are added across.
    pub collective: Option<Arc<dyn Collective<B>>>,
}

impl<B: Backend> Model<B> {
    /// Why this model's tensor-parallel group stopped, once a rank failed.
    pub fn group_failure(&self) -> Option<String> {
        self.collective.as_ref().and_then(|c| c.failure())
    }

    /// Completes a rank's partial output product: the sum over the group, in place.
    fn all_reduce(&self, b: &B, partial: &mut B::Buffer, numel: usize) {
        if let Some(c) = &self.collective {
            c.all_reduce_sum(b, partial, self.weights.activation_dtype, numel);
        }
    }

    /// Runs one step and leaves `head`'s rows in [`Activations::output`]: the logits of the
    /// `num_logits` selected rows as `[num_logits, vocab_size]`, or pooled rows.
    pub fn forward(
        &self,
        b: &B,
        step: &StepBuffers<B>,
        acts: &mut Activations<B>,
        kv: &mut KvCache<B>,
        head: Head,
    ) {
        let cfg = &self.config;
        let w = &self.weights;
        let t = step.num_tokens;
        let d = cfg.hidden_size;
        assert!(
            t <= acts.max_tokens && step.num_logits <= acts.max_logits,
            "step exceeds the sized activations"
        );
        let layout = Activations::<B>::layout(cfg);
        let meta = AttentionMetadata {
            query_start_loc: &step.query_start_loc,
            seq_lens: &step.seq_lens,
            block_tables: &step.block_tables,
            num_seqs: step.num_seqs,
            max_blocks_per_seq: step.max_blocks_per_seq,
            max_query_len: step.max_query_len,
        };
        let scale = 1.0 / (cfg.head_dim as f32).sqrt();
        let a = acts;
        let eps = cfg.rms_norm_eps;
        w.embed.lookup(b, &step.token_ids, t, &mut a.hidden);
        // With the norms folded into the products after them, each layer reads the residual
        // stream and adds into it; otherwise add + norm kernels sit between the products.
        let folded = w.unit_norm.as_ref();
        if folded.is_none() {
            b.rms_norm(&a.hidden, &w.layers[0].attn_norm, eps, t, d, &mut a.normed);
        }
        for (i, (layer, (kc, vc))) in w.layers.iter().zip(kv.layers.iter_mut()).enumerate() {
            let rope = RopeKvWrite {
                layout,
                positions: &step.positions,
                cos_sin: &a.cos_sin,
                rotary_dim: cfg.head_dim,
                slot_mapping: &step.slot_mapping,
                cache: kv.layout,
                k_cache: &mut *kc,
                v_cache: &mut *vc,
            };
            match (folded, layer.qkv.parts.as_slice()) {
                // The norm, the product, RoPE and the KV write as one op.
                (Some(unit), [p]) if layer.q_norm.is_none() => {
                    let (normed, qkv) = (&mut a.normed, &mut a.qkv);
                    let bias = p.bias.as_ref();
                    b.rms_norm_qkv_rope_kv_write(
                        &a.hidden, unit, eps, &p.weight, bias, t, d, normed, qkv, rope,
                    );
                }
                _ => {
                    match folded {
                        Some(unit) => {
                            let normed = &mut a.normed;
                            layer
                                .qkv
                                .forward_normed(b, &a.hidden, unit, eps, t, normed, &mut a.qkv);
                        }
                        None => layer.qkv.forward(b, &a.normed, t, &mut a.qkv),
                    }
                    match (&layer.q_norm, &layer.k_norm) {
                        (Some(qn), Some(kn)) => {
                            let eps = cfg.rms_norm_eps;
                            b.qk_norm_rope_kv_write(&mut a.qkv, t, qn, kn, eps, rope);
                        }
                        _ => rope.apply(b, &mut a.qkv, t),
                    }
                }
            }
            b.paged_attention(
                &a.qkv,
                layout,
                t,
                &meta,
                kv.layout,
                kc,
                vc,
                scale,
                &mut a.attn_workspace,
                &mut a.attn,
            );
            if let Some(unit) = folded {
                // Under tensor parallelism the first rank adds its partial sums into the
                // residual stream and the others write theirs in its place: the all-reduce
                // of the stream then completes both the products and the residual add.
                let first = self.collective.as_ref().is_none_or(|c| c.rank() == 0);
                if first {
                    layer
                        .o
                        .forward_add(b, &a.attn, t, &mut a.proj, &mut a.hidden);
                } else {
                    layer.o.forward(b, &a.attn, t, &mut a.hidden);
                }
                self.all_reduce(b, &mut a.hidden, t * d);
                let bufs = MlpBuffers {
                    scratch: MlpScratch {
                        gate_up: &mut a.gate_up,
                        act: &mut a.act,
                    },
                    moe: a.moe.as_mut(),
                };
                let (normed, proj) = (&mut a.normed, &mut a.proj);
                layer.mlp_add(b, &mut a.hidden, unit, eps, t, bufs, normed, proj, first);
                self.all_reduce(b, &mut a.hidden, t * d);
                continue;
            }
            layer.o.forward(b, &a.attn, t, &mut a.proj);
            self.all_reduce(b, &mut a.proj, t * d);
            let ffn_norm = &layer.ffn_norm;
            b.add_rms_norm(&mut a.hidden, &a.proj, ffn_norm, eps, t, d, &mut a.normed);
            let bufs = MlpBuffers {
                scratch: MlpScratch {
                    gate_up: &mut a.gate_up,
                    act: &mut a.act,
                },
                moe: a.moe.as_mut(),
            };
            layer.mlp(b, &a.normed, t, bufs, &mut a.proj);
            self.all_reduce(b, &mut a.proj, t * d);
            match w.layers.get(i + 1) {
                Some(next) => {
                    let norm = &next.attn_norm;
                    b.add_rms_norm(&mut a.hidden, &a.proj, norm, eps, t, d, &mut a.normed);
                }
                None => b.add_assign(&mut a.hidden, &a.proj, t * d),
            }
        }
        if head == Head::Layers {
            return;
        }
        if head == Head::Pool(PoolingType::Mean) {
            b.rms_norm(&a.hidden, &w.final_norm, eps, t, d, &mut a.normed);
            let (qsl, s) = (&step.query_start_loc, step.num_seqs);
            b.segment_sum(&a.normed, qsl, s, d, &mut a.sums);
            return;
        }
        // Only the sampled (or pooled) rows need the final norm and the vocabulary
        // projection.
        let n = step.num_logits;
        b.gather_rows(&a.hidden, &step.logits_indices, n, d, &mut a.last);
        b.rms_norm(
            &a.last,
            &w.final_norm,
            cfg.rms_norm_eps,
            n,
            d,
            &mut a.last_normed,
        );
        if head != Head::Logits {
            return;
        }
        w.lm_head
            .as_ref()
            .unwrap_or(&w.embed)
            .forward(b, &a.last_normed, n, &mut a.logits);
    }
}
