//! The tests that drive the engine directly: prefill vs decode, the context knee, memory
//! stability, numerical correctness against transformers, batch edge cases and
//! determinism.

use super::report::{self, Section, Status, Table};
use super::Plan;
use crate::bench::latency::timed_batch;
use anyhow::{bail, Context, Result};
use ingot_backend::Backend;
use ingot_core::SamplingParams;
use ingot_engine::Engine;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub const PREFILL_DECODE: &str = "prefill vs decode";
pub const CONTEXT_KNEE: &str = "context knee";
pub const MEMORY: &str = "memory stability";
pub const NUMERICS: &str = "numerical correctness";
pub const BATCH_EDGES: &str = "batch edge cases";
pub const DETERMINISM: &str = "determinism";

pub struct Tester<'a, B: Backend> {
    engine: &'a mut Engine<B>,
    plan: &'a Plan,
    /// Whether the backend promises bit-identical results whatever the batch (the CPU).
    exact: bool,
    rng: StdRng,
    vocab: u32,
    next_id: u64,
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    }
}

impl<'a, B: Backend> Tester<'a, B> {
    pub fn new(engine: &'a mut Engine<B>, plan: &'a Plan, exact: bool, vocab: u32) -> Self {
        Tester {
            engine,
            plan,
            exact,
            rng: StdRng::seed_from_u64(0),
            vocab,
            next_id: 1 << 40,
        }
    }

    fn prompt(&mut self, len: usize) -> Vec<u32> {
        (0..len)
            .map(|_| self.rng.random_range(0..self.vocab))
            .collect()
    }

    fn timed(
        &mut self,
        prompts: Vec<Vec<u32>>,
        params: &SamplingParams,
    ) -> Result<crate::bench::latency::Iteration> {
        let base = self.next_id;
        self.next_id += prompts.len() as u64;
        timed_batch(self.engine, prompts, params, base)
    }

    /// Tokens of each request's first completion.
    fn run(&mut self, prompts: &[Vec<u32>], params: &[SamplingParams]) -> Result<Vec<Vec<u32>>> {
        Ok(self
            .engine
            .generate(prompts.to_vec(), params)?
            .into_iter()
            .map(|o| o.completions[0].token_ids.clone())
            .collect())
    }

    /// Longest prompt that leaves room for `decode_len` tokens.
    fn room(&self) -> usize {
        self.engine.max_model_len() - self.plan.decode_len
    }

    pub fn prefill_decode(&mut self) -> Result<Section> {
        let params = greedy(self.plan.decode_len);
        let warm = vec![self.prompt(16)];
        self.timed(warm, &params)?;
        let mut table = Table::new(&[
            "prompt",
            "batch",
            "prefill tok/s",
            "decode tok/s",
            "decode ×batch 1",
        ]);
        let mut figures = vec![];
        let mut verdicts = vec![];
        let mut scaling = vec![];
        let (plan, room) = (self.plan, self.room());
        for &len in plan.prompt_lens.iter().filter(|&&l| l <= room) {
            let mut batch1 = None;
            let mut last = 0.0;
            for &b in &plan.batches {
                let prompts = (0..b).map(|_| self.prompt(len)).collect();
                let it = self.timed(prompts, &params)?;
                let base = *batch1.get_or_insert(it.decode_tok_s);
                last = it.decode_tok_s;
                table.row(vec![
                    len.to_string(),
                    b.to_string(),
                    format!("{:.1}", it.prefill_tok_s),
                    format!("{:.1}", it.decode_tok_s),
                    format!("{:.2}", it.decode_tok_s / base),
                ]);
                figures.push(json!({"prompt": len, "batch": b, "prefill_tok_s": it.prefill_tok_s, "decode_tok_s": it.decode_tok_s}));
            }
            let base = batch1.unwrap_or(0.0);
            verdicts.push(report::batch_scaling(base, last));
            scaling.push(format!("{:.2}× at prompt {len}", last / base));
        }
        if figures.is_empty() {
            bail!(
                "no prompt length fits max_model_len {}",
                self.engine.max_model_len()
            );
        }
        let largest = self.plan.batches.last().copied().unwrap_or(1);
        Ok(Section::new(
            format!("decode throughput at batch {largest} against batch 1, at every prompt length: PASS at ≥ 1.5×, WARN at ≥ 1×, FAIL below (batching must pay). Prefill is timed to the batch's last first token, decode over the steps that only decoded, {} tokens per request.", self.plan.decode_len),
            report::worst(verdicts),
            format!("decode at batch {largest} vs batch 1: {}", scaling.join(", ")),
            table,
            json!(figures),
        ))
    }

    pub fn context_knee(&mut self) -> Result<Section> {
        let room = self.room();
        let mut contexts: Vec<usize> = std::iter::successors(Some(512usize), |c| Some(c * 2))
            .take_while(|&c| c < room)
            .collect();
        contexts.push(room);
        let capacity = self.engine.stats().total_blocks * self.engine.block_size();
        let params = greedy(self.plan.decode_len);
        let mut table = Table::new(&["batch", "context", "decode tok/s", "vs shortest"]);
        let mut figures = vec![];
        let mut knees = vec![];
        let mut skipped = vec![];
        for &b in &self.plan.knee_batches {
            // Longer contexts extend the shorter ones' prompts, so the prefix cache saves
            // most of their prefill; decode, which is what is timed, reads every token.
            let bases: Vec<Vec<u32>> = (0..b).map(|_| self.prompt(room)).collect();
            let mut rates = vec![];
            for &c in &contexts {
                let need = b * (c + self.plan.decode_len);
                if need > capacity {
                    skipped.push(format!(
                        "batch {b} × context {c} ({need} tokens of KV, the cache holds {capacity})"
                    ));
                    continue;
                }
                let prompts = bases.iter().map(|p| p[..c].to_vec()).collect();
                let it = self.timed(prompts, &params)?;
                rates.push((c, it.decode_tok_s));
                table.row(vec![
                    b.to_string(),
                    c.to_string(),
                    format!("{:.1}", it.decode_tok_s),
                    format!("{:.2}", it.decode_tok_s / rates[0].1),
                ]);
                figures.push(json!({"batch": b, "context": c, "decode_tok_s": it.decode_tok_s}));
            }
            knees.push((b, report::knee(&rates)));
        }
        if figures.is_empty() {
            bail!("no context fits the KV cache: {}", skipped.join("; "));
        }
        let found: Vec<String> = knees
            .iter()
            .map(|(b, k)| match k {
                Some(c) => format!("batch {b}: knee at context {c}"),
                None => format!("batch {b}: no knee up to {}", contexts.last().unwrap_or(&0)),
            })
            .collect();
        let mut finding = found.join("; ");
        if !skipped.is_empty() {
            finding.push_str(&format!("; skipped {}", skipped.join(", ")));
        }
        Ok(Section::new(
            "decode tok/s from context 512 up to max_model_len; the knee is the first context more than 20 % slower than the shortest. PASS without a knee, WARN with one (a property of the model and device to know, not an error); FAIL if a run fails.".into(),
            if knees.iter().any(|k| k.1.is_some()) { Status::Warn } else { Status::Pass },
            finding,
            table,
            json!(figures),
        ))
    }

    pub fn memory(&mut self) -> Result<Section> {
        let total = Duration::from_secs_f64(self.plan.minutes * 60.0);
        let warmup = total / 5;
        let start = Instant::now();
        let base_rss = rss()?;
        let mut warm_rss = None;
        let (mut rounds, mut requests, mut peak_blocks) = (0usize, 0usize, 0usize);
        let mut samples = vec![];
        let max_prompt = (self.engine.max_model_len() / 4).clamp(4, 512);
        while start.elapsed() < total {
            let k = self.rng.random_range(1..=8);
            for _ in 0..k {
                let len = self.rng.random_range(1..=max_prompt);
                let prompt = self.prompt(len);
                let params = SamplingParams {
                    temperature: if self.rng.random_bool(0.5) { 0.0 } else { 0.8 },
                    top_p: 0.95,
                    seed: Some(self.next_id),
                    n: if self.rng.random_bool(0.2) { 2 } else { 1 },
                    ..SamplingParams::greedy(self.rng.random_range(1..=64))
                };
                self.engine.add_request(self.next_id, prompt, params)?;
                self.next_id += 1;
            }
            let mut steps = 0;
            while self.engine.has_work() {
                self.engine.step()?;
                steps += 1;
                if steps % 16 == 0 {
                    let s = self.engine.stats();
                    peak_blocks = peak_blocks.max(s.total_blocks - s.free_blocks);
                }
            }
            rounds += 1;
            requests += k;
            // Idle to idle: every request has finished when the sample is taken.
            let now = rss()?;
            samples.push(
                json!({"s": start.elapsed().as_secs_f64(), "rss_mib": now as f64 / 1048576.0}),
            );
            if warm_rss.is_none() && start.elapsed() >= warmup {
                warm_rss = Some(now);
            }
        }
        let end_rss = rss()?;
        let warm_rss = warm_rss.unwrap_or(end_rss);
        let s = self.engine.stats();
        let blocks_left = s.total_blocks - s.free_blocks;
        let (status, growth) = report::memory(warm_rss, end_rss, blocks_left);
        let mib = |b: u64| format!("{:.1}", b as f64 / 1048576.0);
        let mut table = Table::new(&["point", "RSS MiB"]);
        table.row(vec!["start".into(), mib(base_rss)]);
        table.row(vec![
            format!("after warm-up ({:.0} s)", warmup.as_secs_f64()),
            mib(warm_rss),
        ]);
        table.row(vec![
            format!("end ({:.0} s)", start.elapsed().as_secs_f64()),
            mib(end_rss),
        ]);
        Ok(Section::new(
            "resident memory after the warm-up (the first fifth) against the end of the load, both taken with the engine idle: PASS at ≤ 2 % growth, WARN at ≤ 5 %, FAIL above or if any KV block is still held once every request has finished.".into(),
            status,
            format!("{requests} requests in {rounds} rounds over {:.1} min (random lengths, greedy and sampled, n 1 or 2): RSS {:+.2} % after warm-up, peak {peak_blocks} of {} KV blocks in use, {blocks_left} left at the end", start.elapsed().as_secs_f64() / 60.0, growth * 100.0, s.total_blocks),
            table,
            json!({"requests": requests, "rounds": rounds, "growth": growth, "base_rss": base_rss, "warm_rss": warm_rss, "end_rss": end_rss, "peak_blocks": peak_blocks, "blocks_left": blocks_left, "total_blocks": s.total_blocks, "samples": samples}),
        ))
    }

    pub fn batch_edges(&mut self) -> Result<Section> {
        let lens = [1, 1, 2, 3, 5, 8, 13, 17, 31, 33, 64, 100, 127, 200, 255];
        let largest = self.plan.edge_batches.iter().max().copied().unwrap_or(1);
        let max_prompt = self.room();
        let prompts: Vec<Vec<u32>> = lens
            .iter()
            .cycle()
            .take(largest)
            .map(|&l| self.prompt(l.min(max_prompt)))
            .collect();
        let params = greedy(self.plan.decode_len);
        let mut alone = vec![];
        for p in &prompts {
            alone.push(
                self.run(std::slice::from_ref(p), std::slice::from_ref(&params))?
                    .remove(0),
            );
        }
        let mut table = Table::new(&[
            "batch",
            "prompt lengths",
            "differ from alone",
            "first difference at token",
        ]);
        let mut mismatches = 0;
        let mut figures = vec![];
        for &b in &self.plan.edge_batches {
            // A different mix in every batch: rotate the pool.
            let order: Vec<usize> = (0..b).map(|i| (i * 7 + b) % prompts.len()).collect();
            let batch: Vec<Vec<u32>> = order.iter().map(|&i| prompts[i].clone()).collect();
            let out = self.run(&batch, &vec![params.clone(); b])?;
            let diffs: Vec<(usize, usize)> = order
                .iter()
                .zip(&out)
                .filter_map(|(&i, o)| report::first_difference(&alone[i], o).map(|d| (i, d)))
                .collect();
            mismatches += diffs.len();
            table.row(vec![
                b.to_string(),
                order
                    .iter()
                    .map(|&i| prompts[i].len().to_string())
                    .collect::<Vec<_>>()
                    .join(" "),
                format!("{} of {b}", diffs.len()),
                diffs
                    .iter()
                    .map(|d| d.1.to_string())
                    .collect::<Vec<_>>()
                    .join(" "),
            ]);
            figures.push(json!({"batch": b, "differ": diffs.len()}));
        }
        let total: usize = self.plan.edge_batches.iter().sum();
        Ok(Section::new(
            format!("every request of batches {:?} (mixed prompt lengths, single-token prompts included, greedy, {} tokens) gives the tokens it gives alone: FAIL on a difference where ingot promises batch invariance (f32 weights on the CPU, whose rows are computed the same whatever the batch); WARN otherwise (quantized weights take other kernels for few and many rows; GPU GEMMs pick kernels by batch size).", self.plan.edge_batches, self.plan.decode_len),
            report::equal_outputs(mismatches, self.exact),
            format!("{} of {total} batched requests equal their run alone", total - mismatches),
            table,
            json!(figures),
        ))
    }

    pub fn determinism(&mut self) -> Result<Section> {
        let n = 8;
        let prompts: Vec<Vec<u32>> = (0..n).map(|_| self.prompt(32)).collect();
        let greedy_params = greedy(32);
        let seeded = |i: usize| SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            seed: Some(1000 + i as u64),
            ..greedy(32)
        };
        let mut table = Table::new(&[
            "sampling",
            "batch",
            "runs",
            "identical runs",
            "request 0 equals batch 1",
        ]);
        let mut repeat_mismatch = 0;
        let mut batch_mismatch = 0;
        let mut figures = vec![];
        for (name, params) in [
            ("greedy", vec![greedy_params.clone(); n]),
            (
                "seeded T=0.8 top-p 0.95",
                (0..n).map(seeded).collect::<Vec<_>>(),
            ),
        ] {
            let mut single = vec![];
            for b in [1, n] {
                let runs: Vec<Vec<Vec<u32>>> = (0..self.plan.repeats)
                    .map(|_| self.run(&prompts[..b], &params[..b]))
                    .collect::<Result<_>>()?;
                let same = runs.iter().filter(|r| *r == &runs[0]).count();
                repeat_mismatch += self.plan.repeats - same;
                if b == 1 {
                    single = runs[0][0].clone();
                }
                let matches_single = runs[0][0] == single;
                if !matches_single {
                    batch_mismatch += 1;
                }
                table.row(vec![
                    name.into(),
                    b.to_string(),
                    self.plan.repeats.to_string(),
                    format!("{same} of {}", self.plan.repeats),
                    if b == 1 {
                        "—".into()
                    } else {
                        matches_single.to_string()
                    },
                ]);
                figures.push(json!({"sampling": name, "batch": b, "identical": same, "matches_batch1": matches_single}));
            }
        }
        let status = if repeat_mismatch > 0 {
            Status::Fail
        } else {
            report::equal_outputs(batch_mismatch, self.exact)
        };
        Ok(Section::new(
            format!("greedy and seeded sampling, each run {} times at batch 1 and batch {n} (32-token prompts, 32 tokens): FAIL if repeated runs differ; request 0 must also give the same tokens at batch {n} as alone (FAIL where ingot promises batch invariance, f32 on the CPU; WARN elsewhere).", self.plan.repeats),
            status,
            format!("{repeat_mismatch} repeated runs differed from the first; {batch_mismatch} of 2 batch-{n} runs differ from batch 1 on request 0"),
            table,
            json!(figures),
        ))
    }
}

/// Resident memory of this process in bytes.
fn rss() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")
        .context("the memory test reads /proc/self/status")?;
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .context("no VmRSS in /proc/self/status")?;
    Ok(kib * 1024)
}

/// One transformers fixture case.
struct Case {
    name: String,
    prompt: Vec<u32>,
    greedy: Vec<u32>,
}

/// The fixtures to use: `explicit`, else a tests/fixtures/*/logits.json (from the working
/// directory or `INGOT_FIXTURES`) whose `meta.model` is this model's file name.
pub fn find_fixtures(explicit: Option<&Path>, model: &Path) -> Result<Option<PathBuf>> {
    if let Some(p) = explicit {
        if !p.is_file() {
            bail!("--fixtures {}: no such file", p.display());
        }
        return Ok(Some(p.to_path_buf()));
    }
    let name = model
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut dirs = vec![];
    if let Some(d) = std::env::var_os("INGOT_FIXTURES") {
        dirs.push(PathBuf::from(d));
    }
    if let Ok(entries) = std::fs::read_dir("tests/fixtures") {
        dirs.extend(entries.flatten().map(|e| e.path()));
    }
    for d in dirs {
        let file = d.join("logits.json");
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        let Ok(v) = serde_json::from_str::<Value>(&text) else {
            continue;
        };
        if v["meta"]["model"].as_str() == Some(name.as_str()) {
            return Ok(Some(file));
        }
    }
    Ok(None)
}

pub fn no_fixtures(model: &Path) -> Section {
    Section::new(
        String::new(),
        Status::Skip,
        format!("no transformers fixtures for {} (looked for tests/fixtures/*/logits.json naming it; make them with tools/reference/make_fixtures.py and pass --fixtures)", model.display()),
        Table::default(),
        Value::Null,
    )
}

fn read_cases(path: &Path) -> Result<Vec<Case>> {
    let v: Value = serde_json::from_str(
        &std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
    )
    .with_context(|| format!("{} is not JSON", path.display()))?;
    let ids = |x: &Value| -> Vec<u32> {
        x.as_array()
            .into_iter()
            .flatten()
            .filter_map(|i| i.as_u64())
            .map(|i| i as u32)
            .collect()
    };
    let cases: Vec<Case> = v["cases"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| Case {
            name: c["name"].as_str().unwrap_or("?").to_string(),
            prompt: ids(&c["prompt_ids"]),
            greedy: ids(&c["greedy_ids"]),
        })
        .collect();
    if cases.is_empty()
        || cases
            .iter()
            .any(|c| c.prompt.is_empty() || c.greedy.is_empty())
    {
        bail!(
            "{}: no cases, or a case without prompt_ids or greedy_ids",
            path.display()
        );
    }
    Ok(cases)
}

/// Greedy tokens of the model at f32, each case alone, against transformers'.
pub fn numerics<B: Backend>(mut engine: Engine<B>, fixtures: &Path) -> Result<Section> {
    let cases = read_cases(fixtures)?;
    let mut table = Table::new(&["case", "prompt tokens", "tokens equal to transformers"]);
    let mut differ = vec![];
    let mut figures = vec![];
    for c in &cases {
        let out = engine.generate(vec![c.prompt.clone()], &[greedy(c.greedy.len())])?;
        let got = &out[0].completions[0].token_ids;
        let equal = report::first_difference(&c.greedy, got).unwrap_or(c.greedy.len());
        if equal < c.greedy.len() {
            differ.push(c.name.clone());
        }
        table.row(vec![
            c.name.clone(),
            c.prompt.len().to_string(),
            format!("{equal} of {}", c.greedy.len()),
        ]);
        figures.push(json!({"case": c.name, "prompt_tokens": c.prompt.len(), "equal_tokens": equal, "tokens": c.greedy.len()}));
    }
    Ok(Section::new(
        format!("greedy tokens of the model loaded at f32 (as the fixtures were made), each case alone, equal to HF transformers' from {}: PASS when every token of every case is equal, else FAIL.", fixtures.display()),
        if differ.is_empty() { Status::Pass } else { Status::Fail },
        if differ.is_empty() {
            format!("all {} cases equal transformers token for token", cases.len())
        } else {
            format!("{} of {} cases differ: {}", differ.len(), cases.len(), differ.join(", "))
        },
        table,
        json!(figures),
    ))
}
