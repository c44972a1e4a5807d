//! An embedding request's input while the engine prefills it: its pooled row gathered
//! over the steps that compute its prompt, finished into a vector at the last one.

use crate::engine::RequestId;
use ingot_model::{Pooling, PoolingType};
use std::time::{Duration, Instant};

pub(crate) struct PooledSeq {
    pub(crate) request_id: RequestId,
    /// Which of the request's inputs.
    pub(crate) index: usize,
    /// The pooled row so far: the last (or first) token's final-normed hidden state, or
    /// for mean pooling the sum over the chunks computed so far.
    row: Vec<f32>,
    dimensions: Option<usize>,
    /// Taken when the input first runs, which sets `queue_time`.
    pub(crate) arrival: Option<Instant>,
    pub(crate) queue_time: Option<Duration>,
}

impl PooledSeq {
    pub(crate) fn new(
        request_id: RequestId,
        index: usize,
        dimensions: Option<usize>,
        arrival: Instant,
    ) -> PooledSeq {
        PooledSeq {
            request_id,
            index,
            row: vec![],
            dimensions,
            arrival: Some(arrival),
            queue_time: None,
        }
    }

    /// Folds in a step's pooled row for this input.
    pub(crate) fn add(&mut self, kind: PoolingType, row: &[f32]) {
        if kind == PoolingType::Mean && !self.row.is_empty() {
            self.row.iter_mut().zip(row).for_each(|(a, b)| *a += b);
        } else {
            self.row = row.to_vec();
        }
    }

    /// Forgets what was gathered: the input was preempted and its prompt runs again.
    pub(crate) fn restart(&mut self) {
        self.row.clear();
    }

    /// The embedding of a prompt of `num_tokens` tokens, once all of it has run.
    pub(crate) fn finish(self, pooling: &Pooling, num_tokens: usize) -> Vec<f32> {
        pooling.finish(self.row, num_tokens, self.dimensions)
    }
}
