//! Structured output without a mask first. A plain greedy row's token is the argmax of its
//! logits wherever the grammar allows that token, for the masked argmax is then the same
//! token. Such rows are picked on the device without their mask, and each pick is checked
//! against the grammar once read back; only a pick the grammar refuses gets a mask, and is
//! picked again under it from the same logits before the next step is submitted (llama.cpp
//! samples the same way). Only rows whose last mask allowed most tokens go unmasked: there
//! (inside a JSON string, say) nearly any pick stands, and a mask costs the most, a walk of
//! nearly the whole token trie (100–500 µs against under 5 µs where few tokens are
//! allowed). The check is on the step's path, so the other rows keep their masks, computed
//! while the device runs the step.

use crate::sampler::Sampler;
use crate::structured::Constraint;
use anyhow::anyhow;
use ingot_core::SeqId;
use rayon::prelude::*;
use std::time::{Duration, Instant};

/// A sampled row picked without its grammar's mask.
pub(crate) struct CheckedPick {
    /// The row among the step's sampled rows.
    pub row: usize,
    pub id: SeqId,
    /// Taken from the sequence while it is checked.
    pub constraint: Constraint,
    /// The token picked, and in the end the token that stands.
    pub token: u32,
    pub outcome: Outcome,
}

pub(crate) enum Outcome {
    /// Not checked yet.
    Unchecked,
    /// The grammar took the token; whether it is now complete.
    Accepted(bool),
    /// The grammar refused the token; its mask is staged for a pick again.
    Refused,
    /// The grammar failed (a mask past its fuel, or in an error state): the sequence ends
    /// without a token.
    Failed(anyhow::Error),
}

/// What checking a step's picks cost: the masks of refused picks, and their time and that
/// of the grammars' advances, summed over rows.
#[derive(Default)]
pub(crate) struct CheckTimes {
    pub masks: usize,
    pub mask_time: Duration,
    pub accept_time: Duration,
}

/// Checks each pick against its grammar, in parallel: an allowed token advances the grammar;
/// a refused one leaves the grammar where it was and computes its mask. The refused picks'
/// masks end up back to back at the start of `staging` (`words` words each), in row order.
pub(crate) fn check(picks: &mut [CheckedPick], staging: &mut Vec<u32>, words: usize) -> CheckTimes {
    // Rows are written whole where a mask is computed, so what they held is not cleared.
    staging.resize(picks.len() * words, 0);
    let times: Vec<(Duration, Option<Duration>)> = picks
        .par_iter_mut()
        .zip(staging.par_chunks_mut(words))
        .map(|(p, row)| {
            let started = Instant::now();
            let checked = p.constraint.try_accept(p.token);
            let accept_time = started.elapsed();
            let mut mask_time = None;
            p.outcome = match checked {
                Ok(Some(complete)) => Outcome::Accepted(complete),
                Ok(None) => {
                    mask_time = Some(p.constraint.compute_mask());
                    if p.constraint.write_mask(row) {
                        Outcome::Refused
                    } else {
                        Outcome::Failed(p.constraint.allowed().err().unwrap_or_else(|| {
                            anyhow!("structured output: no mask for a refused token")
                        }))
                    }
                }
                Err(e) => Outcome::Failed(e),
            };
            (accept_time, mask_time)
        })
        .collect();
    let mut t = CheckTimes::default();
    let mut refused = 0;
    for (i, (p, (accept, mask))) in picks.iter().zip(times).enumerate() {
        t.accept_time += accept;
        if let Some(took) = mask {
            t.masks += 1;
            t.mask_time += took;
        }
        if matches!(p.outcome, Outcome::Refused) {
            staging.copy_within(i * words..(i + 1) * words, refused * words);
            refused += 1;
        }
    }
    staging.truncate(refused * words);
    t
}

/// Advances the grammars of the refused picks past the tokens picked again under their
/// masks (`tokens`, in row order); returns the time it took, summed over rows.
pub(crate) fn accept_repicked(picks: &mut [CheckedPick], tokens: &[u32]) -> Duration {
    let mut refused: Vec<&mut CheckedPick> = picks
        .iter_mut()
        .filter(|p| matches!(p.outcome, Outcome::Refused))
        .collect();
    debug_assert_eq!(refused.len(), tokens.len());
    refused
        .par_iter_mut()
        .zip(tokens)
        .map(|(p, &token)| {
            let started = Instant::now();
            p.token = token;
            p.outcome = match p.constraint.accept(token) {
                Ok(complete) => Outcome::Accepted(complete),
                Err(e) => Outcome::Failed(e),
            };
            started.elapsed()
        })
        .sum()
}

/// Whether a constrained row's token after `num_output` outputs is picked without its
/// grammar's mask and checked after: a plain greedy row in a step picked on the device (a
/// host sampler masks logits it holds already) whose last mask allowed most tokens. Such a
/// row stays unmasked while the grammar takes its picks; a refused pick's mask decides
/// again. Elsewhere masks are cheap, computed while the device runs the step, and a pick
/// the grammar refused would cost a pick again on the step's path.
pub(crate) fn checks_pick(
    on_device: bool,
    sampler: &Sampler,
    num_output: usize,
    constraint: &Constraint,
) -> bool {
    on_device && sampler.is_plain_greedy(num_output) && constraint.last_mask_wide()
}

/// The refused picks' rows among the step's sampled rows, in order.
pub(crate) fn refused_rows(picks: &[CheckedPick]) -> Vec<u32> {
    picks
        .iter()
        .filter(|p| matches!(p.outcome, Outcome::Refused))
        .map(|p| p.row as u32)
        .collect()
}
