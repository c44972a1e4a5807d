//! Deciding which tokens run in each step.
//!
//! Running sequences go first, in admission order: a decode needs one token, a prompt
//! still being prefilled needs its remaining tokens (cut to the budget). Then waiting
//! sequences are admitted first come, first served, each as a prefill chunk that starts
//! after its longest cached prefix. The step never exceeds `max_num_batched_tokens` tokens
//! or `max_num_seqs` sequences. When a running sequence needs a block and none is free,
//! the most recently admitted running sequence is preempted: its blocks are freed and it
//! waits at the head of the queue to be recomputed.

use crate::block_pool::{block_hashes, BlockHash, BlockPool};
use crate::sequence::{SeqId, Sequence};
use std::collections::VecDeque;

#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub prefix_caching: bool,
}

/// Why a sequence can never run.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum AdmissionError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, your request has {prompt} input tokens and asks for {max_tokens} output tokens ({} in total)",
        prompt + max_tokens
    )]
    TooLong {
        max_model_len: usize,
        prompt: usize,
        max_tokens: usize,
    },
    #[error("the request needs {needed} KV cache blocks but the cache holds only {available}")]
    CacheTooSmall { needed: usize, available: usize },
    #[error(
        "invalid `n`: {n} samples of this prompt need {needed} KV cache blocks together, but the cache holds only {available}"
    )]
    TooManySamples {
        n: usize,
        needed: usize,
        available: usize,
    },
}

/// One sequence's share of a step: tokens `start..start + len` of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub id: SeqId,
    pub start: usize,
    pub len: usize,
}

#[derive(Clone, Debug, Default)]
pub struct SchedulerOutput {
    pub seqs: Vec<ScheduledSeq>,
    pub num_tokens: usize,
    /// Sequences preempted while building this step.
    pub preempted: Vec<SeqId>,
}

pub struct Scheduler {
    pub config: SchedulerConfig,
    pub pool: BlockPool,
    waiting: VecDeque<Sequence>,
    /// In admission order: the last is the first to be preempted.
    running: Vec<Sequence>,
    pub num_preemptions: u64,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Scheduler {
        assert!(config.max_num_batched_tokens > 0 && config.max_num_seqs > 0);
        Scheduler {
            pool: BlockPool::new(config.num_blocks, config.block_size, config.prefix_caching),
            config,
            waiting: VecDeque::new(),
            running: vec![],
            num_preemptions: 0,
        }
    }

    /// Checks that `n` samples of this prompt, each up to `max_tokens` long, can all be in
    /// the cache at once (sharing the prompt's full blocks when prefix caching is on).
    pub fn check_admissible(
        &self,
        prompt_len: usize,
        max_tokens: usize,
        n: usize,
    ) -> Result<(), AdmissionError> {
        let c = &self.config;
        if prompt_len == 0 {
            return Err(AdmissionError::EmptyPrompt);
        }
        if prompt_len + max_tokens > c.max_model_len {
            return Err(AdmissionError::TooLong {
                max_model_len: c.max_model_len,
                prompt: prompt_len,
                max_tokens,
            });
        }
        // The last sampled token is never fed back, so it needs no slot (a prompt that
        // samples nothing, an embedding input, needs its own slots only).
        let needed = (prompt_len + max_tokens.saturating_sub(1)).div_ceil(c.block_size);
        if needed > c.num_blocks {
            return Err(AdmissionError::CacheTooSmall {
                needed,
                available: c.num_blocks,
            });
        }
        // A sibling finds the prompt's full blocks in the cache, except one holding the last
        // prompt token: that token is always computed.
        let shared = if c.prefix_caching {
            (prompt_len - 1) / c.block_size
        } else {
            0
        };
        let together = shared + n.saturating_mul(needed - shared);
        if together > c.num_blocks {
            return Err(AdmissionError::TooManySamples {
                n,
                needed: together,
                available: c.num_blocks,
            });
        }
        Ok(())
    }

    pub fn add(&mut self, seq: Sequence) -> Result<(), AdmissionError> {
        self.check_admissible(seq.prompt_len, seq.max_tokens, 1)?;
        self.waiting.push_back(seq);
        Ok(())
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn running(&self) -> &[Sequence] {
        &self.running
    }

    pub fn waiting(&self) -> impl Iterator<Item = &Sequence> {
        self.waiting.iter()
    }

    pub fn get(&self, id: SeqId) -> Option<&Sequence> {
        self.running
            .iter()
            .find(|s| s.id == id)
            .or_else(|| self.waiting.iter().find(|s| s.id == id))
    }

    fn running_mut(&mut self, id: SeqId) -> &mut Sequence {
        self.running
            .iter_mut()
            .find(|s| s.id == id)
            .expect("a running sequence")
    }

    fn release(pool: &mut BlockPool, seq: &mut Sequence) {
        pool.free(&seq.block_table);
        seq.block_table.clear();
        seq.block_hashes.clear();
        seq.num_computed = 0;
    }

    /// Blocks `seq` needs beyond its table to hold its first `tokens` tokens.
    fn blocks_needed(&self, seq: &Sequence, tokens: usize) -> usize {
        tokens
            .div_ceil(self.config.block_size)
            .saturating_sub(seq.block_table.len())
    }

    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.config.max_num_batched_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let len = self.running[i].num_uncomputed().min(budget);
            let need = self.blocks_needed(&self.running[i], self.running[i].num_computed + len);
            let mut scheduled = true;
            let new_blocks = loop {
                if let Some(b) = self.pool.allocate(need) {
                    break b;
                }
                let mut victim = self.running.pop().expect("at least sequence i runs");
                Self::release(&mut self.pool, &mut victim);
                self.num_preemptions += 1;
                out.preempted.push(victim.id);
                let was_self = self.running.len() == i;
                self.waiting.push_front(victim);
                if was_self {
                    scheduled = false;
                    break vec![];
                }
            };
            if !scheduled {
                break;
            }
            let seq = &mut self.running[i];
            seq.block_table.extend(new_blocks);
            out.seqs.push(ScheduledSeq {
                id: seq.id,
                start: seq.num_computed,
                len,
            });
            budget -= len;
            i += 1;
        }
        // A step that preempted leaves the freed room to the sequences already running.
        while budget > 0
            && out.preempted.is_empty()
            && self.running.len() < self.config.max_num_seqs
        {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            // Cache hits stop short of the last token: its logits are needed.
            let bs = self.config.block_size;
            let hashes: Vec<BlockHash> = block_hashes(&seq.tokens[..seq.tokens.len() - 1], bs);
            let hit = self.pool.lookup(&hashes);
            let computed = hit.len() * bs;
            let len = (seq.tokens.len() - computed).min(budget);
            let need = (computed + len).div_ceil(bs) - hit.len();
            let hit_free = hit.iter().filter(|&&b| self.pool.ref_count(b) == 0).count();
            if self.pool.num_free() < need + hit_free {
                break;
            }
            let mut seq = self.waiting.pop_front().expect("front exists");
            self.pool.record_query(seq.tokens.len(), computed);
            self.pool.take(&hit);
            seq.block_hashes = hashes[..hit.len()].to_vec();
            seq.block_table = hit;
            seq.block_table
                .extend(self.pool.allocate(need).expect("counted above"));
            seq.num_computed = computed;
            out.seqs.push(ScheduledSeq {
                id: seq.id,
                start: computed,
                len,
            });
            budget -= len;
            self.running.push(seq);
        }
        out.num_tokens = out.seqs.iter().map(|s| s.len).sum();
        out
    }

    /// Records that the step ran: the scheduled tokens are now in the cache, and newly
    /// full blocks join the prefix cache. Returns the sequences that now need a sample.
    pub fn commit(&mut self, out: &SchedulerOutput) -> Vec<SeqId> {
        let bs = self.config.block_size;
        let mut ready = vec![];
        for s in &out.seqs {
            let Some(idx) = self.running.iter().position(|q| q.id == s.id) else {
                continue;
            };
            let seq = &mut self.running[idx];
            seq.num_computed += s.len;
            while (seq.block_hashes.len() + 1) * bs <= seq.num_computed {
                let k = seq.block_hashes.len();
                let h = BlockHash::of(
                    seq.block_hashes.last().copied(),
                    &seq.tokens[k * bs..(k + 1) * bs],
                );
                seq.block_hashes.push(h);
                self.pool.cache(seq.block_table[k], h);
            }
            if seq.num_computed == seq.tokens.len() {
                ready.push(seq.id);
            }
        }
        ready
    }

    /// Appends a sampled token to a running sequence.
    pub fn append(&mut self, id: SeqId, token: u32) {
        self.running_mut(id).tokens.push(token);
    }

    /// Removes a sequence (finished or aborted) and frees its blocks at once.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let mut seq = self.running.remove(i);
            Self::release(&mut self.pool, &mut seq);
            return Some(seq);
        }
        let i = self.waiting.iter().position(|s| s.id == id)?;
        self.waiting.remove(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(num_blocks: usize) -> SchedulerConfig {
        SchedulerConfig {
            max_num_batched_tokens: 64,
            max_num_seqs: 8,
            max_model_len: 64,
            block_size: 4,
            num_blocks,
            prefix_caching: true,
        }
    }

    /// Runs steps, sampling token 7, until nothing is left; returns the preempted ids.
    fn run(s: &mut Scheduler) -> Vec<SeqId> {
        let mut preempted = vec![];
        while s.has_work() {
            let out = s.schedule();
            preempted.extend(&out.preempted);
            for id in s.commit(&out) {
                s.append(id, 7);
                if s.get(id).unwrap().num_output() == s.get(id).unwrap().max_tokens {
                    s.remove(id);
                }
            }
        }
        preempted
    }

    #[test]
    fn the_newest_sequence_is_preempted_when_blocks_run_out() {
        let mut s = Scheduler::new(config(5));
        s.add(Sequence::new(1, vec![1; 8], 8)).unwrap();
        s.add(Sequence::new(2, vec![2; 8], 8)).unwrap();
        let preempted = run(&mut s);
        assert!(
            preempted.contains(&2) && !preempted.contains(&1),
            "{preempted:?}"
        );
        assert!(s.pool.all_free());
    }

    #[test]
    fn a_cached_prefix_is_reused_and_counted() {
        let mut s = Scheduler::new(config(16));
        s.add(Sequence::new(1, (0..10).collect(), 1)).unwrap();
        run(&mut s);
        s.add(Sequence::new(2, (0..12).collect(), 1)).unwrap();
        let out = s.schedule();
        // Blocks [0..4) and [4..8) are cached; the chunk starts after them.
        assert_eq!(
            out.seqs,
            vec![ScheduledSeq {
                id: 2,
                start: 8,
                len: 4
            }]
        );
        assert_eq!(s.pool.stats.hits, 8);
        s.remove(2);
        assert!(s.pool.all_free());
    }

    #[test]
    fn impossible_requests_are_rejected_at_admission() {
        let s = Scheduler::new(config(4));
        assert_eq!(
            s.check_admissible(0, 1, 1),
            Err(AdmissionError::EmptyPrompt)
        );
        assert!(matches!(
            s.check_admissible(64, 1, 1),
            Err(AdmissionError::TooLong { .. })
        ));
        assert!(matches!(
            s.check_admissible(20, 10, 1),
            Err(AdmissionError::CacheTooSmall { .. })
        ));
        assert_eq!(s.check_admissible(10, 6, 1), Ok(()));
        assert!(matches!(
            s.check_admissible(10, 6, 2),
            Err(AdmissionError::TooManySamples { n: 2, .. })
        ));
    }
}
