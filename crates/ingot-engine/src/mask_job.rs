//! The structured-output work of one step on the worker threads, while the device runs the
//! step: each constrained row's grammar advances past the token it just sampled, and its
//! mask of the tokens allowed next is computed into the row of a staging buffer that the
//! device takes as it is.

use crate::structured::Constraint;
use anyhow::{anyhow, Result};
use ingot_backend::HostBuffer;
use ingot_core::SeqId;
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

/// Masks being computed on the worker threads.
pub struct MaskJob(mpsc::Receiver<Masks>);

/// A mask job's outcome: the constraints that hold the masks (and that the job took for any
/// other reason); the same masks as the device takes them (`rows[i]`'s in row `i`, where
/// `staged[i]`); for the rows it advanced past a token, whether their grammar is now
/// complete (or why it refused the token); how many masks, the sum of their times and of
/// the advances', and the wall time of the whole.
pub struct Masks {
    pub rows: Vec<(SeqId, Constraint)>,
    pub staging: HostBuffer,
    pub staged: Vec<bool>,
    pub advanced: Vec<(SeqId, Result<bool>)>,
    pub computed: usize,
    pub total: Duration,
    pub advance_total: Duration,
    pub wall: Duration,
}

/// One row of a mask job: its grammar's advance (the outcome and its time), if it
/// advanced, and its mask's time, if it computed and staged one.
type RowDone = (Option<(Result<bool>, Duration)>, Option<Duration>);

/// A row as a worker thread takes it: its place in the job, its constraint, its row of the
/// staging buffer and its advance.
type RowWork<'a> = (
    usize,
    &'a mut Constraint,
    &'a mut [u32],
    Option<(u32, bool)>,
);

impl MaskJob {
    /// Starts a job on the worker threads: where `advance[i]` holds a token (and whether
    /// the sequence goes on after it), row `i`'s grammar first advances past it and computes
    /// its next mask only if the sequence goes on and the grammar neither completed nor
    /// refused; other rows compute their mask. Each mask is written into its row of
    /// `staging` (`words` words a row) by the thread that computed it, so that the engine
    /// thread uploads the masks without gathering megabytes itself.
    pub fn start(
        rows: Vec<(SeqId, Constraint)>,
        advance: Vec<Option<(u32, bool)>>,
        staging: HostBuffer,
        words: usize,
    ) -> MaskJob {
        assert_eq!(rows.len(), advance.len(), "an advance (or none) a row");
        let (tx, rx) = mpsc::channel();
        rayon::spawn(move || {
            // The engine waits for this unless it failed and went away.
            let _ = tx.send(run(rows, &advance, staging, words));
        });
        MaskJob(rx)
    }

    /// Waits for the job's outcome.
    pub fn wait(self) -> Result<Masks> {
        self.0
            .recv()
            .map_err(|_| anyhow!("a structured-output mask worker failed"))
    }
}

/// The worker thread that steps a sequence's grammar, the same one every step.
///
/// A grammar's parser lives in memory its thread allocated: its lexer's states, its Earley
/// rows, the masks it frees a step later. Dealt out by a parallel iterator, a row moved to
/// another core most steps, and its frees crossed threads. Kept on one thread, a mask took
/// 26–27 µs where it took 34–35, and an advance 28 % less (`ingot serve --device cuda`, 256
/// clients of the records schema, an H200 host's 16 vCPUs; docs/benchmarks.md, 2026-12-03).
fn worker_of(id: SeqId, threads: usize) -> usize {
    (id % threads as u64) as usize
}

fn run(
    mut rows: Vec<(SeqId, Constraint)>,
    advance: &[Option<(u32, bool)>],
    mut staging: HostBuffer,
    words: usize,
) -> Masks {
    let start = Instant::now();
    // Every row a mask is staged in is overwritten whole (`Constraint::write_mask`).
    staging.resize_for_overwrite(rows.len() * words);
    let threads = rayon::current_num_threads();
    let mut groups: Vec<Vec<RowWork>> = (0..threads).map(|_| vec![]).collect();
    for (i, (((id, c), row), step)) in rows
        .iter_mut()
        .zip(staging.as_mut_slice().chunks_mut(words))
        .zip(advance)
        .enumerate()
    {
        groups[worker_of(*id, threads)].push((i, c, row, *step));
    }
    // Each worker takes its own group; the lock is never contended.
    let groups: Vec<Mutex<Vec<RowWork>>> = groups.into_iter().map(Mutex::new).collect();
    let done = rayon::broadcast(|ctx| {
        let mut group = groups[ctx.index()]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        group
            .iter_mut()
            .map(|(i, c, row, step)| (*i, step_row(c, row, *step)))
            .collect::<Vec<_>>()
    });
    drop(groups);
    let mut by_row: Vec<Option<RowDone>> = (0..rows.len()).map(|_| None).collect();
    for (i, d) in done.into_iter().flatten() {
        by_row[i] = Some(d);
    }
    let mut advanced = Vec::new();
    let mut advance_total = Duration::ZERO;
    let mut staged = Vec::with_capacity(rows.len());
    let (mut computed, mut total) = (0, Duration::ZERO);
    for ((id, _), d) in rows.iter().zip(by_row) {
        let (outcome, mask) = d.expect("every row is in one worker's group");
        if let Some((outcome, took)) = outcome {
            advanced.push((*id, outcome));
            advance_total += took;
        }
        staged.push(mask.is_some());
        if let Some(took) = mask {
            computed += 1;
            total += took;
        }
    }
    Masks {
        rows,
        staging,
        staged,
        advanced,
        computed,
        total,
        advance_total,
        wall: start.elapsed(),
    }
}

/// One row's advance and mask. Advance and mask in one task a row (rather than all
/// advances, then all masks) leave no thread waiting for the slowest advance before it
/// starts on masks.
fn step_row(c: &mut Constraint, row: &mut [u32], step: Option<(u32, bool)>) -> RowDone {
    let advanced = step.map(|(token, _)| {
        let started = Instant::now();
        (c.accept(token), started.elapsed())
    });
    let wanted = match (step, &advanced) {
        (Some((_, goes_on)), Some((outcome, _))) => {
            goes_on && matches!(outcome, Ok(false)) && c.is_active()
        }
        _ => true,
    };
    if !wanted {
        return (advanced, None);
    }
    let took = c.compute_mask();
    (advanced, c.write_mask(row).then_some(took))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::structured::{Grammar, Grammars};
    use ingot_backend::sampling::mask_words;
    use ingot_core::StructuredOutput;
    use ingot_model::testing::test_model_path;
    use ingot_model::Tokenizer;
    use std::sync::Arc;

    const VOCAB: usize = 49152;

    /// The mask a sequence of `grammar` gets after `tokens`, as a staging row.
    fn mask_after(grammar: &Grammar, tokens: &[u32], words: usize) -> Vec<u32> {
        let mut c = Constraint::new(grammar);
        for &t in tokens {
            c.compute_mask();
            assert!(!c.accept(t).unwrap());
        }
        c.compute_mask();
        let mut row = vec![0; words];
        assert!(c.write_mask(&mut row));
        row
    }

    /// Rows of different grammars, spread over the worker threads by their ids, each get
    /// their own grammar's mask in their own staging row, and each advance comes back under
    /// its own row's id.
    #[test]
    fn each_row_gets_its_own_grammars_mask_whichever_thread_runs_it() {
        let Some(path) = test_model_path() else {
            return;
        };
        let grammars = Grammars::new(Arc::new(Tokenizer::open(&path).unwrap()), VOCAB);
        let words = mask_words(VOCAB);
        let compiled: Vec<Grammar> = [
            "[0-9]{2,5}",
            "[a-z]+ [a-z]+",
            "yes|no|maybe",
            "[A-Z][a-z]*!",
        ]
        .map(|r| {
            grammars
                .compile(&StructuredOutput::Regex(r.into()))
                .unwrap()
        })
        .into();
        let of = |i: usize| &compiled[i % compiled.len()];
        let n = 23;
        let ids: Vec<SeqId> = (0..n as u64).map(|i| i * 7 + 3).collect();
        let rows = ids
            .iter()
            .enumerate()
            .map(|(i, &id)| (id, Constraint::new(of(i))))
            .collect();
        let first = run(rows, &vec![None; n], HostBuffer::default(), words);
        assert_eq!(first.computed, n);
        let mut picked = vec![];
        for (i, (id, _)) in first.rows.iter().enumerate() {
            assert_eq!(*id, ids[i], "the rows come back in their order");
            assert!(first.staged[i]);
            let row = &first.staging.as_slice()[i * words..(i + 1) * words];
            assert!(row == mask_after(of(i), &[], words), "row {i}'s first mask");
            let word = row.iter().position(|&w| w != 0).unwrap();
            picked.push((word * 32) as u32 + row[word].trailing_zeros());
        }
        let advance: Vec<_> = picked.iter().map(|&t| Some((t, true))).collect();
        let second = run(first.rows, &advance, first.staging, words);
        assert_eq!(second.computed, n);
        let advanced: Vec<SeqId> = second.advanced.iter().map(|(id, _)| *id).collect();
        assert_eq!(advanced, ids);
        for (i, (_, outcome)) in second.advanced.iter().enumerate() {
            assert!(!outcome.as_ref().unwrap(), "row {i}'s grammar goes on");
            let row = &second.staging.as_slice()[i * words..(i + 1) * words];
            assert!(
                row == mask_after(of(i), &picked[i..=i], words),
                "row {i}'s mask after its token"
            );
        }
    }
}
