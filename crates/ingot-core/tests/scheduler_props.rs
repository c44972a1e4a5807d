//! Property tests: after any interleaving of add / step / abort, no block is leaked or
//! double-freed, no step exceeds its limits, and every admitted sequence finishes.

use ingot_core::{Scheduler, SchedulerConfig, SeqId, Sequence};
use proptest::prelude::*;
use std::collections::HashMap;

#[derive(Clone, Debug)]
enum Op {
    /// Prompt = one of a few shared prefixes + a unique tail.
    Add {
        prefix: usize,
        prefix_len: usize,
        tail: usize,
        max_tokens: usize,
    },
    Step,
    Abort(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..3usize, 0..40usize, 1..30usize, 1..24usize).prop_map(
            |(prefix, prefix_len, tail, max_tokens)| Op::Add {
                prefix,
                prefix_len,
                tail,
                max_tokens
            }
        ),
        Just(Op::Step),
        Just(Op::Step),
        Just(Op::Step),
        (0..64usize).prop_map(Op::Abort),
    ]
}

/// Every block's reference count equals the number of block tables holding it.
fn check_refcounts(s: &Scheduler) {
    let mut holders: HashMap<u32, u32> = HashMap::new();
    for seq in s.running() {
        for &b in &seq.block_table {
            *holders.entry(b).or_default() += 1;
        }
        assert!(
            seq.block_table.len() * s.config.block_size >= seq.num_computed,
            "table shorter than the computed tokens"
        );
    }
    let mut free = 0;
    for b in 0..s.pool.num_blocks() as u32 {
        let want = holders.get(&b).copied().unwrap_or(0);
        assert_eq!(s.pool.ref_count(b), want, "block {b}");
        free += (want == 0) as usize;
    }
    assert_eq!(s.pool.num_free(), free);
}

struct Harness {
    s: Scheduler,
    next_id: SeqId,
    admitted: Vec<SeqId>,
    finished: Vec<SeqId>,
}

impl Harness {
    fn step(&mut self) {
        let c = self.s.config;
        let out = self.s.schedule();
        assert!(
            out.num_tokens <= c.max_num_batched_tokens,
            "token budget exceeded"
        );
        assert!(out.seqs.len() <= c.max_num_seqs, "max_num_seqs exceeded");
        if self.s.has_work() {
            assert!(
                out.num_tokens > 0 || !out.preempted.is_empty(),
                "a step with work scheduled nothing"
            );
        }
        for sch in &out.seqs {
            let seq = self.s.get(sch.id).unwrap();
            assert_eq!(sch.start, seq.num_computed);
            assert!(
                seq.block_table.len() * c.block_size >= sch.start + sch.len,
                "blocks do not cover the step"
            );
        }
        check_refcounts(&self.s);
        for id in self.s.commit(&out) {
            self.s.append(id, (id % 5) as u32);
            let seq = self.s.get(id).unwrap();
            if seq.num_output() >= seq.max_tokens {
                self.s.remove(id).unwrap();
                self.finished.push(id);
            }
        }
        check_refcounts(&self.s);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn any_interleaving_keeps_the_pool_consistent_and_finishes(
        ops in prop::collection::vec(op(), 1..80),
        budget in 1..48usize,
        max_seqs in 1..6usize,
        num_blocks in 8..40usize,
        prefix_caching in any::<bool>(),
    ) {
        let config = SchedulerConfig { max_num_batched_tokens: budget, max_num_seqs: max_seqs, max_model_len: 128, block_size: 4, num_blocks, prefix_caching };
        let mut h = Harness { s: Scheduler::new(config), next_id: 0, admitted: vec![], finished: vec![] };
        let prefixes: Vec<Vec<u32>> = (0..3).map(|p| (0..40).map(|i| 1000 * (p + 1) + i).collect()).collect();
        for op in ops {
            match op {
                Op::Add { prefix, prefix_len, tail, max_tokens } => {
                    let id = h.next_id;
                    h.next_id += 1;
                    let mut prompt = prefixes[prefix][..prefix_len].to_vec();
                    prompt.extend((0..tail as u32).map(|i| 50_000 + id as u32 * 100 + i));
                    if h.s.add(Sequence::new(id, prompt, max_tokens)).is_ok() {
                        h.admitted.push(id);
                    }
                }
                Op::Step => h.step(),
                Op::Abort(k) => {
                    if let Some(&id) = h.admitted.get(k) {
                        if h.s.remove(id).is_some() {
                            h.finished.push(id);
                        }
                    }
                    check_refcounts(&h.s);
                }
            }
        }
        // Everything admitted finishes within a bounded number of steps.
        let mut steps = 0;
        while h.s.has_work() {
            h.step();
            steps += 1;
            prop_assert!(steps < 10_000, "the scheduler stalled");
        }
        let mut done = h.finished.clone();
        done.sort_unstable();
        done.dedup();
        prop_assert_eq!(done.len(), h.admitted.len());
        prop_assert!(h.s.pool.all_free(), "blocks leaked");
    }
}
