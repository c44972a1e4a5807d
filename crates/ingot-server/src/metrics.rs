//! Prometheus metrics in the OpenMetrics text format, encoded by the Prometheus project's
//! client (`prometheus-client`): the engine's gauges and counters, read when scraped, and
//! the latencies, lengths and finish reasons of every finished sequence. The names follow
//! vLLM's in the `ingot:` namespace (README: the table maps each to vLLM's).

use ingot_core::FinishReason;
use ingot_engine::EngineStats;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// The response's content type: what Prometheus asks for first.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Seconds, for every latency: from a millisecond (a decode step of a small model) to ten
/// minutes (a long queue behind long prompts on a CPU).
const SECONDS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
];

/// Token counts: 1, 2, 5, 10, … 500,000, as vLLM's length buckets.
fn token_buckets() -> impl Iterator<Item = f64> {
    (0..6).flat_map(|e| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(e)))
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Finished {
    finished_reason: &'static str,
}

/// What one sequence did, reported when it ends.
pub struct SequenceEnd {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    pub generation_tokens: usize,
    /// From arrival to its first scheduled step.
    pub queue: Duration,
    /// From its first scheduled step to its first token.
    pub prefill: Duration,
    /// From its first token to its last.
    pub decode: Duration,
    /// From arrival to its last token.
    pub e2e: Duration,
}

pub struct Metrics {
    registry: Registry,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
    e2e_latency: Histogram,
    queue_time: Histogram,
    prefill_time: Histogram,
    decode_time: Histogram,
    prompt_len: Histogram,
    generation_len: Histogram,
    finished: Family<Finished, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        let seconds = || Histogram::new(SECONDS.iter().copied());
        let tokens = || Histogram::new(token_buckets());
        let mut m = Metrics {
            registry: Registry::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            time_to_first_token: seconds(),
            inter_token_latency: seconds(),
            e2e_latency: seconds(),
            queue_time: seconds(),
            prefill_time: seconds(),
            decode_time: seconds(),
            prompt_len: tokens(),
            generation_len: tokens(),
            finished: Family::default(),
        };
        let r = &mut m.registry;
        r.register(
            "ingot:prompt_tokens",
            "Prompt tokens of admitted requests",
            m.prompt_tokens.clone(),
        );
        r.register(
            "ingot:generation_tokens",
            "Tokens generated",
            m.generation_tokens.clone(),
        );
        r.register(
            "ingot:request_success",
            "Sequences (each prompt and sample of a request) ended, by finish reason; abort counts the ones whose client left",
            m.finished.clone(),
        );
        r.register(
            "ingot:time_to_first_token_seconds",
            "Time from a request's arrival to a sequence's first token",
            m.time_to_first_token.clone(),
        );
        r.register(
            "ingot:inter_token_latency_seconds",
            "Time between a sequence's successive outputs",
            m.inter_token_latency.clone(),
        );
        r.register(
            "ingot:e2e_request_latency_seconds",
            "Time from a request's arrival to a sequence's last token",
            m.e2e_latency.clone(),
        );
        r.register(
            "ingot:request_queue_time_seconds",
            "Time a sequence waited from arrival to its first scheduled step",
            m.queue_time.clone(),
        );
        r.register(
            "ingot:request_prefill_time_seconds",
            "Time from a sequence's first scheduled step to its first token",
            m.prefill_time.clone(),
        );
        r.register(
            "ingot:request_decode_time_seconds",
            "Time from a sequence's first token to its last",
            m.decode_time.clone(),
        );
        r.register(
            "ingot:request_prompt_tokens",
            "Prompt length of a finished sequence",
            m.prompt_len.clone(),
        );
        r.register(
            "ingot:request_generation_tokens",
            "Tokens a finished sequence generated",
            m.generation_len.clone(),
        );
        m
    }
}

impl Metrics {
    pub fn admitted(&self, prompt_tokens: usize) {
        self.prompt_tokens.inc_by(prompt_tokens as u64);
    }

    /// A sequence's output of `tokens`; `since` is the time from arrival for its first
    /// output, else from its previous one.
    pub fn output(&self, tokens: usize, since: Duration, first: bool) {
        self.generation_tokens.inc_by(tokens as u64);
        let h = if first {
            &self.time_to_first_token
        } else {
            &self.inter_token_latency
        };
        h.observe(since.as_secs_f64());
    }

    /// A sequence ended: a finish reason for every one; times and lengths for the ones
    /// that ran to a stop or their length.
    pub fn ended(&self, end: &SequenceEnd) {
        self.count_finished(end.reason);
        if end.reason == FinishReason::Abort {
            return;
        }
        self.queue_time.observe(end.queue.as_secs_f64());
        self.prefill_time.observe(end.prefill.as_secs_f64());
        self.decode_time.observe(end.decode.as_secs_f64());
        self.e2e_latency.observe(end.e2e.as_secs_f64());
        self.prompt_len.observe(end.prompt_tokens as f64);
        self.generation_len.observe(end.generation_tokens as f64);
    }

    /// A sequence whose client left before it ended.
    pub fn abandoned(&self) {
        self.count_finished(FinishReason::Abort);
    }

    fn count_finished(&self, reason: FinishReason) {
        self.finished
            .get_or_create(&Finished {
                finished_reason: reason.as_str(),
            })
            .inc();
    }

    /// The exposition: the engine's state as of now, then the request metrics.
    pub fn render(&self, s: &EngineStats) -> String {
        let mut engine = Registry::default();
        let mut gauge = |name: &str, help: &str, v: f64| {
            engine.register(name, help, ConstGauge::new(v));
        };
        gauge(
            "ingot:num_requests_running",
            "Requests with a sequence in the running batch (a request has one sequence per prompt and sample)",
            s.num_requests_running as f64,
        );
        gauge(
            "ingot:num_requests_waiting",
            "Requests none of whose sequences runs yet",
            s.num_requests_waiting as f64,
        );
        gauge(
            "ingot:num_sequences_running",
            "Sequences in the running batch",
            s.num_running as f64,
        );
        gauge(
            "ingot:num_sequences_waiting",
            "Sequences waiting to be scheduled, samples of a prompt still in prefill included; --max-waiting bounds this",
            s.num_waiting as f64,
        );
        gauge(
            "ingot:kv_cache_blocks_in_use",
            "KV cache blocks held by sequences",
            (s.total_blocks - s.free_blocks) as f64,
        );
        gauge(
            "ingot:kv_cache_blocks_total",
            "KV cache blocks reserved at start",
            s.total_blocks as f64,
        );
        gauge(
            "ingot:kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (0 to 1)",
            s.kv_cache_usage,
        );
        let mut counter = |name: &str, help: &str, v: u64| {
            engine.register(name, help, ConstCounter::new(v));
        };
        counter(
            "ingot:num_preemptions",
            "Sequences preempted",
            s.num_preemptions,
        );
        counter(
            "ingot:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            s.prefix_cache_queries,
        );
        counter(
            "ingot:prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            s.prefix_cache_hits,
        );
        counter(
            "ingot:structured_output_masks",
            "Token masks computed for structured output (one per constrained token)",
            s.structured.masks,
        );
        counter(
            "ingot:structured_output_mask_steps",
            "Steps that computed structured-output token masks",
            s.structured.steps,
        );
        let mut seconds = |name: &str, help: &str, v: f64| {
            engine.register(name, help, ConstCounter::new(v));
        };
        seconds(
            "ingot:structured_output_mask_seconds",
            "Time spent computing structured-output token masks, summed over masks",
            s.structured.mask_seconds,
        );
        seconds(
            "ingot:structured_output_mask_step_seconds",
            "Wall time of each step's structured-output masks (computed in parallel while the device runs the step), summed over steps",
            s.structured.step_seconds,
        );
        seconds(
            "ingot:structured_output_accept_seconds",
            "Time of advancing the structured-output grammars past their new tokens, summed over sequences",
            s.structured.accept_seconds,
        );
        engine.register(
            "ingot:engine_steps",
            "Engine steps that read back or submitted work",
            ConstCounter::new(s.phases.steps),
        );
        let phases = Family::<[(&str, &str); 1], Counter<f64, AtomicU64>>::default();
        for (phase, time) in s.phases.named() {
            phases
                .get_or_create(&[("phase", phase)])
                .inc_by(time.as_secs_f64());
        }
        engine.register(
            "ingot:engine_step_phase_seconds",
            "The engine thread's time in each phase of its steps, summed over steps",
            phases,
        );
        let mut out = String::with_capacity(16 << 10);
        // Writing into a String cannot fail.
        let _ = encode_registry(&mut out, &engine)
            .and_then(|()| encode_registry(&mut out, &self.registry))
            .and_then(|()| encode_eof(&mut out));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("{series} missing from\n{text}"))
            .parse()
            .unwrap()
    }

    #[test]
    fn exposition_has_engine_state_lengths_and_finish_reasons() {
        let m = Metrics::default();
        m.admitted(7);
        m.output(1, Duration::from_millis(30), true);
        m.output(2, Duration::from_millis(5), false);
        m.ended(&SequenceEnd {
            reason: FinishReason::Length,
            prompt_tokens: 7,
            generation_tokens: 3,
            queue: Duration::from_millis(2),
            prefill: Duration::from_millis(28),
            decode: Duration::from_millis(5),
            e2e: Duration::from_millis(35),
        });
        m.abandoned();
        let stats = EngineStats {
            num_running: 2,
            total_blocks: 10,
            free_blocks: 7,
            num_preemptions: 4,
            phases: ingot_engine::StepPhases {
                steps: 5,
                wait_device: Duration::from_millis(6),
                wait_masks: Duration::from_micros(250),
                ..Default::default()
            },
            ..EngineStats::default()
        };
        let text = m.render(&stats);
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert_eq!(value(&text, "ingot:num_sequences_running"), 2.0);
        assert_eq!(value(&text, "ingot:kv_cache_blocks_in_use"), 3.0);
        assert_eq!(value(&text, "ingot:num_preemptions_total"), 4.0);
        assert_eq!(value(&text, "ingot:prompt_tokens_total"), 7.0);
        assert_eq!(value(&text, "ingot:engine_steps_total"), 5.0);
        let phase = |p: &str| {
            let series = format!("ingot:engine_step_phase_seconds_total{{phase=\"{p}\"}}");
            value(&text, &series)
        };
        assert!((phase("wait_device") - 0.006).abs() < 1e-12);
        assert!((phase("wait_masks") - 0.00025).abs() < 1e-12);
        assert_eq!(phase("between_steps"), 0.0);
        assert_eq!(value(&text, "ingot:generation_tokens_total"), 3.0);
        assert_eq!(
            value(
                &text,
                "ingot:request_success_total{finished_reason=\"length\"}"
            ),
            1.0
        );
        assert_eq!(
            value(
                &text,
                "ingot:request_success_total{finished_reason=\"abort\"}"
            ),
            1.0
        );
        assert_eq!(
            value(&text, "ingot:request_generation_tokens_bucket{le=\"2.0\"}"),
            0.0
        );
        assert_eq!(
            value(&text, "ingot:request_generation_tokens_bucket{le=\"5.0\"}"),
            1.0
        );
        assert_eq!(value(&text, "ingot:time_to_first_token_seconds_count"), 1.0);
        // The aborted sequence has no latency.
        assert_eq!(value(&text, "ingot:e2e_request_latency_seconds_count"), 1.0);
    }
}
