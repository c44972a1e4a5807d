//! Causal attention over the paged KV cache for a flattened mixed batch.
//!
//! An f32 cache takes the exact path here: one task per (token, query head), each in a
//! fixed order of operations, so f32 runs are bit-identical whatever the batch or thread
//! count. A 16-bit cache takes the grouped, context-split path of [`super::attention16`].

use super::attention16;
use super::team::Team;
use crate::quant::{vec_axpy_f32, vec_dot_f32, Isa};
use crate::{CacheLayout, QkvLayout};
use half::{bf16, f16};
use std::cell::RefCell;

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

pub struct PagedAttention<'a> {
    pub qkv: &'a [f32],
    pub layout: QkvLayout,
    pub rows: usize,
    pub query_start_loc: &'a [i32],
    pub seq_lens: &'a [i32],
    pub block_tables: &'a [i32],
    pub max_blocks_per_seq: usize,
    pub cache: CacheLayout,
    pub kv: KvData<'a>,
    pub scale: f32,
    /// The kernels a 16-bit cache is read with.
    pub isa: Isa,
}

/// One layer's key and value caches in their element type.
pub enum KvData<'a> {
    F32(&'a [f32], &'a [f32]),
    F16(&'a [f16], &'a [f16]),
    BF16(&'a [bf16], &'a [bf16]),
}

impl PagedAttention<'_> {
    /// Fills `out` (`[rows, num_heads * head_dim]`).
    pub fn run(&self, out: &mut [f32], team: &Team) {
        let (k, v) = match self.kv {
            KvData::F32(k, v) => (k, v),
            KvData::F16(k, v) => return attention16::run(self, k, v, out, team),
            KvData::BF16(k, v) => return attention16::run(self, k, v, out, team),
        };
        let QkvLayout {
            num_heads,
            num_kv_heads,
            head_dim,
        } = self.layout;
        let group = num_heads / num_kv_heads;
        team.chunks_mut(
            &mut out[..self.rows * num_heads * head_dim],
            head_dim,
            |task, out| {
                let (row, head) = (task / num_heads, task % num_heads);
                let (s, len) = self.row_context(row);
                let q = &self.qkv[row * self.layout.row_len() + head * head_dim..][..head_dim];
                self.attend(q, head / group, self.block_table(s), len, (k, v), out);
            },
        );
    }

    /// The sequence whose query range holds token `row`, and how many positions that token
    /// attends to (its own included).
    pub(super) fn row_context(&self, row: usize) -> (usize, usize) {
        let num_seqs = self.seq_lens.len();
        let s = self.query_start_loc[1..=num_seqs].partition_point(|&end| end as usize <= row);
        let q_start = self.query_start_loc[s] as usize;
        let q_len = self.query_start_loc[s + 1] as usize - q_start;
        let ctx = self.seq_lens[s] as usize;
        (s, ctx - q_len + (row - q_start) + 1)
    }

    pub(super) fn block_table(&self, s: usize) -> &[i32] {
        &self.block_tables[s * self.max_blocks_per_seq..][..self.max_blocks_per_seq]
    }

    fn attend(
        &self,
        q: &[f32],
        kv_head: usize,
        table: &[i32],
        len: usize,
        (k_cache, v_cache): (&[f32], &[f32]),
        out: &mut [f32],
    ) {
        let hd = self.layout.head_dim;
        let kv_len = self.layout.kv_len();
        let bs = self.cache.block_size;
        // Where positions 0..len start in the cache, walked block by block (a division per
        // position cost as much as its dot product at head size 64).
        let rows = || {
            (0..len.div_ceil(bs)).flat_map(move |b| {
                let base = table[b] as usize * bs;
                (base..base + bs.min(len - b * bs)).map(move |slot| slot * kv_len + kv_head * hd)
            })
        };
        SCORES.with_borrow_mut(|scores| {
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for at in rows() {
                let s = vec_dot_f32(q, &k_cache[at..][..hd]) * self.scale;
                max = max.max(s);
                scores.push(s);
            }
            let mut sum = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            out.fill(0.0);
            for (at, &w) in rows().zip(scores.iter()) {
                vec_axpy_f32(out, w, &v_cache[at..][..hd]);
            }
            let inv = 1.0 / sum;
            out.iter_mut().for_each(|o| *o *= inv);
        });
    }
}
