//! Prometheus metrics: engine gauges and counters, and request latency histograms.

use ingot_engine::EngineStats;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

const BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];

#[derive(Default)]
pub struct Histogram {
    inner: Mutex<(Vec<u64>, u64, f64)>,
}

impl Histogram {
    pub fn observe(&self, seconds: f64) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if g.0.is_empty() {
            g.0 = vec![0; BUCKETS.len()];
        }
        for (b, &le) in g.0.iter_mut().zip(BUCKETS) {
            if seconds <= le {
                *b += 1;
            }
        }
        g.1 += 1;
        g.2 += seconds;
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, le) in BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{le}\"}} {}",
                g.0.get(i).copied().unwrap_or(0)
            );
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
            g.1, g.2, g.1
        );
    }
}

#[derive(Default)]
pub struct Metrics {
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_latency: Histogram,
    pub queue_time: Histogram,
}

impl Metrics {
    pub fn render(&self, s: &EngineStats) -> String {
        let mut out = String::new();
        let mut gauge = |name: &str, help: &str, kind: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP ingot:{name} {help}\n# TYPE ingot:{name} {kind}\ningot:{name} {v}"
            );
        };
        gauge(
            "num_requests_running",
            "Requests with a sequence in the running batch (a request has one sequence per prompt and sample).",
            "gauge",
            s.num_requests_running as f64,
        );
        gauge(
            "num_requests_waiting",
            "Requests none of whose sequences runs yet.",
            "gauge",
            s.num_requests_waiting as f64,
        );
        gauge(
            "num_sequences_running",
            "Sequences in the running batch.",
            "gauge",
            s.num_running as f64,
        );
        gauge(
            "num_sequences_waiting",
            "Sequences waiting to be scheduled, samples of a prompt still in prefill included; --max-waiting bounds this.",
            "gauge",
            s.num_waiting as f64,
        );
        gauge(
            "kv_cache_blocks_in_use",
            "KV cache blocks held by sequences.",
            "gauge",
            (s.total_blocks - s.free_blocks) as f64,
        );
        gauge(
            "kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (0 to 1).",
            "gauge",
            s.kv_cache_usage,
        );
        gauge(
            "prompt_tokens_total",
            "Prompt tokens processed.",
            "counter",
            self.prompt_tokens.load(Ordering::Relaxed) as f64,
        );
        gauge(
            "generation_tokens_total",
            "Tokens generated.",
            "counter",
            self.generation_tokens.load(Ordering::Relaxed) as f64,
        );
        gauge(
            "num_preemptions_total",
            "Sequences preempted.",
            "counter",
            s.num_preemptions as f64,
        );
        gauge(
            "prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
            "counter",
            s.prefix_cache_queries as f64,
        );
        gauge(
            "prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache.",
            "counter",
            s.prefix_cache_hits as f64,
        );
        self.time_to_first_token.render(
            "ingot:time_to_first_token_seconds",
            "Time to the first token.",
            &mut out,
        );
        self.inter_token_latency.render(
            "ingot:inter_token_latency_seconds",
            "Time between tokens.",
            &mut out,
        );
        self.e2e_latency.render(
            "ingot:e2e_request_latency_seconds",
            "Request latency.",
            &mut out,
        );
        out
    }
}
