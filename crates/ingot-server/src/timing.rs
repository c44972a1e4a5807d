//! Latency and length bookkeeping of each submitted prompt, for the metrics and the
//! request log.

use crate::metrics::{Metrics, SequenceEnd};
use ingot_engine::SeqDelta;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One sample's progress, for the metrics.
#[derive(Clone, Default)]
pub(crate) struct SampleClock {
    tokens: usize,
    queue: Duration,
    first: Option<Instant>,
    last: Option<Instant>,
    ended: bool,
}

/// Latency and length bookkeeping of one submitted prompt and its samples, for the metrics
/// and the request log. Samples that have not ended when it is dropped (the client left
/// and the engine aborts them) count as aborted.
pub(crate) struct Timing {
    metrics: Arc<Metrics>,
    start: Instant,
    prompt_tokens: usize,
    samples: Vec<SampleClock>,
}

impl Timing {
    pub(crate) fn new(metrics: Arc<Metrics>, prompt_tokens: usize, n: usize) -> Timing {
        Timing {
            metrics,
            start: Instant::now(),
            prompt_tokens,
            samples: vec![SampleClock::default(); n],
        }
    }

    pub(crate) fn token(&mut self, d: &SeqDelta) {
        let now = Instant::now();
        let s = &mut self.samples[d.index];
        if let Some(q) = d.queue_time {
            s.queue = q;
        }
        let n = d.token_ids.len();
        if n > 0 {
            let since = now - s.last.unwrap_or(self.start);
            self.metrics.output(n, since, s.first.is_none());
            s.first.get_or_insert(now);
            s.last = Some(now);
            s.tokens += n;
        }
        if let Some(reason) = d.finish_reason {
            s.ended = true;
            let first = s.first.unwrap_or(now);
            self.metrics.ended(&SequenceEnd {
                reason,
                prompt_tokens: self.prompt_tokens,
                generation_tokens: s.tokens,
                queue: s.queue,
                prefill: (first - self.start).saturating_sub(s.queue),
                decode: now - first,
                e2e: now - self.start,
            });
        }
    }

    pub(crate) fn finish(&self, id: &str) {
        let ttft = self.samples.iter().filter_map(|s| s.first).min();
        tracing::info!(
            request = id,
            prompt_tokens = self.prompt_tokens,
            generated_tokens = self.samples.iter().map(|s| s.tokens).sum::<usize>(),
            ttft_s = ttft.map_or(0.0, |f| (f - self.start).as_secs_f64()),
            total_s = self.start.elapsed().as_secs_f64(),
            "request finished"
        );
    }
}

impl Drop for Timing {
    fn drop(&mut self) {
        for _ in self.samples.iter().filter(|s| !s.ended) {
            self.metrics.abandoned();
        }
    }
}
