//! Causal attention over the paged KV cache for a flattened mixed batch.

use crate::quant::{vec_axpy_f32, vec_dot_f32};
use crate::{CacheLayout, QkvLayout};
use rayon::prelude::*;
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
    pub k_cache: &'a [f32],
    pub v_cache: &'a [f32],
    pub scale: f32,
}

impl PagedAttention<'_> {
    /// Fills `out` (`[rows, num_heads * head_dim]`), one task per (token, head).
    pub fn run(&self, out: &mut [f32]) {
        let QkvLayout {
            num_heads,
            num_kv_heads,
            head_dim,
        } = self.layout;
        let group = num_heads / num_kv_heads;
        let num_seqs = self.seq_lens.len();
        out[..self.rows * num_heads * head_dim]
            .par_chunks_mut(head_dim)
            .enumerate()
            .for_each(|(task, out)| {
                let (row, head) = (task / num_heads, task % num_heads);
                // The sequence whose query range holds this row.
                let s =
                    self.query_start_loc[1..=num_seqs].partition_point(|&end| end as usize <= row);
                let q_start = self.query_start_loc[s] as usize;
                let q_len = self.query_start_loc[s + 1] as usize - q_start;
                let ctx = self.seq_lens[s] as usize;
                let pos = ctx - q_len + (row - q_start);
                let q = &self.qkv[row * self.layout.row_len() + head * head_dim..][..head_dim];
                let table =
                    &self.block_tables[s * self.max_blocks_per_seq..][..self.max_blocks_per_seq];
                self.attend(q, head / group, table, pos + 1, out);
            });
    }

    fn attend(&self, q: &[f32], kv_head: usize, table: &[i32], len: usize, out: &mut [f32]) {
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
                let s = vec_dot_f32(q, &self.k_cache[at..][..hd]) * self.scale;
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
                vec_axpy_f32(out, w, &self.v_cache[at..][..hd]);
            }
            let inv = 1.0 / sum;
            out.iter_mut().for_each(|o| *o *= inv);
        });
    }
}
