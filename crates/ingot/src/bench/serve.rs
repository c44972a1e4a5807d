//! `ingot bench serve`: a load generator for any OpenAI-compatible server (ingot,
//! llama.cpp's llama-server, vLLM). Random prompts of the asked token counts are built
//! with the model's tokenizer, sent as streaming requests at a Poisson rate or under a
//! concurrency cap, and timed on arrival of each streamed chunk: TTFT (send → first text),
//! ITL (between texts), TPOT ((end − first text) / (output tokens − 1)) and E2EL. Token
//! counts are the server's `usage`; a server that reports none is counted by text chunks
//! and the report says so.

use super::{ms, percentile, RandomDataset};
use crate::generate::Format;
use anyhow::{bail, ensure, Context, Result};
use futures_util::StreamExt;
use indicatif::ProgressBar;
use ingot_model::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// The server, e.g. http://127.0.0.1:8000 (plain HTTP).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    base_url: String,
    /// /v1/completions, or /v1/chat/completions (the prompt becomes one user message).
    #[arg(long, default_value = "/v1/completions")]
    endpoint: String,
    /// Model name sent in requests (default: the first of the server's GET /v1/models).
    #[arg(long)]
    model: Option<String>,
    /// The model's tokenizer, to build prompts of --input-len tokens: an HF directory or
    /// a .gguf file.
    #[arg(long)]
    tokenizer: PathBuf,
    #[arg(long)]
    api_key: Option<String>,
    /// Prompts are random token ids decoded to text; outputs are `max_tokens` with
    /// `ignore_eos`.
    #[command(flatten)]
    dataset: RandomDataset,
    /// Requests per second, arrivals drawn from a Poisson process; inf sends all at once.
    #[arg(long, default_value = "inf")]
    request_rate: f64,
    /// At most this many requests in flight (default: no cap).
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// 0 is greedy; above it every token is drawn.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Seeds the prompts, their lengths and the arrival times.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Seconds after which one request is given up and counted as failed.
    #[arg(long, default_value_t = 600.0)]
    request_timeout: f64,
    /// Also write the report (with every request's timings) to this JSON file.
    #[arg(long)]
    save_result: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
    /// Every request asks for JSON valid under the JSON schema in this file (OpenAI's
    /// `response_format`). Requests end where the schema's JSON is complete.
    #[arg(long, conflicts_with = "structured")]
    json_schema: Option<PathBuf>,
    /// Every request carries this constraint as vLLM's `structured_outputs`:
    /// `regex:RX`, `choice:A|B|…`, `grammar:FILE` (Lark) or `json_object`.
    #[arg(long)]
    structured: Option<String>,
}

/// The fields `--json-schema` or `--structured` add to every request body.
fn constraint(args: &ServeArgs) -> Result<Option<(&'static str, Value)>> {
    let read = |path: &std::path::Path| {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
    };
    if let Some(path) = &args.json_schema {
        let schema: Value = serde_json::from_str(&read(path)?)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        let format =
            json!({"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}});
        return Ok(Some(("response_format", format)));
    }
    let Some(spec) = &args.structured else {
        return Ok(None);
    };
    let (kind, value) = spec.split_once(':').unwrap_or((spec.as_str(), ""));
    let so = match kind {
        "regex" => json!({"regex": value}),
        "choice" => json!({"choice": value.split('|').collect::<Vec<_>>()}),
        "grammar" => json!({"grammar": read(std::path::Path::new(value))?}),
        "json_object" => json!({"json_object": true}),
        _ => bail!(
            "--structured takes regex:RX, choice:A|B|…, grammar:FILE or json_object, got `{spec}`"
        ),
    };
    Ok(Some(("structured_outputs", so)))
}

/// One request to send.
struct Request {
    prompt: String,
    max_tokens: usize,
}

/// What one request measured.
#[derive(Default)]
pub(crate) struct Outcome {
    pub error: Option<String>,
    pub prompt_tokens: Option<usize>,
    pub output_tokens: Option<usize>,
    pub text_chunks: usize,
    pub ttft: Option<Duration>,
    pub itl: Vec<Duration>,
    pub e2el: Duration,
}

impl Outcome {
    /// Output tokens as the server counted them, else the chunks that carried text.
    pub fn tokens(&self) -> usize {
        self.output_tokens.unwrap_or(self.text_chunks)
    }

    pub fn tpot(&self) -> Option<Duration> {
        let ttft = self.ttft?;
        let n = self.tokens();
        (n > 1).then(|| (self.e2el - ttft) / (n as u32 - 1))
    }
}

pub fn run(args: ServeArgs) -> Result<()> {
    args.dataset.check()?;
    ensure!(
        args.request_rate > 0.0,
        "--request-rate must be above 0 (inf sends all at once)"
    );
    ensure!(
        args.max_concurrency != Some(0),
        "--max-concurrency must be at least 1"
    );
    ensure!(
        args.base_url.starts_with("http://"),
        "--base-url must be a plain http:// URL (this build has no TLS), got {}",
        args.base_url
    );
    let tokenizer = Tokenizer::open(&args.tokenizer)?;
    let pool = round_trip_ids(&tokenizer)?;
    let mut rng = StdRng::seed_from_u64(args.seed);
    let requests = (0..args.dataset.num_prompts)
        .map(|_| {
            let (input, output) = args.dataset.lengths(&mut rng);
            Ok(Request {
                prompt: random_prompt(&tokenizer, &pool, &mut rng, input)?,
                max_tokens: output,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let delays = arrivals(&mut rng, args.dataset.num_prompts, args.request_rate);
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(bench(args, requests, delays))
}

/// Token ids that decode to text which encodes back to the same single id: prompts drawn
/// from them keep their length through the text round trip far more often (an id such as
/// `<unk>` or a byte fragment decodes to text of several other tokens).
pub(crate) fn round_trip_ids(tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    let mut ids = vec![];
    for id in 0..tokenizer.vocab_size() as u32 {
        let text = tokenizer.decode(&[id], true)?;
        if !text.trim().is_empty() && tokenizer.encode(&text, false)? == [id] {
            ids.push(id);
        }
    }
    ensure!(
        !ids.is_empty(),
        "no token of the tokenizer survives decoding and encoding alone"
    );
    Ok(ids)
}

/// Text of `len` tokens when re-encoded, where the tokenizer allows: ids drawn from `pool`
/// are decoded, re-encoded, and cut or topped up until the count holds. Where it never
/// does (merges across the joins), the last text is kept; the server's usage counts it.
pub(crate) fn random_prompt(
    tokenizer: &Tokenizer,
    pool: &[u32],
    rng: &mut StdRng,
    len: usize,
) -> Result<String> {
    let draw = |rng: &mut StdRng| pool[rng.random_range(0..pool.len())];
    let mut ids: Vec<u32> = (0..len).map(|_| draw(rng)).collect();
    let mut text = String::new();
    for _ in 0..16 {
        text = tokenizer.decode(&ids, true)?;
        let encoded = tokenizer.encode(&text, false)?;
        if encoded.len() == len {
            break;
        }
        ids = encoded;
        ids.truncate(len);
        while ids.len() < len {
            ids.push(draw(rng));
        }
    }
    Ok(text)
}

/// The send time of each request from the start of the run.
fn arrivals(rng: &mut StdRng, n: usize, rate: f64) -> Vec<Duration> {
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            if rate.is_finite() {
                t += -(1.0 - rng.random::<f64>()).ln() / rate;
            }
            Duration::from_secs_f64(t)
        })
        .collect()
}

/// The body of one streaming request.
pub(crate) fn request_body(
    model: &str,
    prompt: &str,
    max_tokens: usize,
    temperature: f32,
    chat: bool,
) -> Value {
    let mut body = json!({
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if chat {
        body["messages"] = json!([{"role": "user", "content": prompt}]);
    } else {
        body["prompt"] = json!(prompt);
    }
    body
}

/// Sends `bodies` to `url`, each at its delay from the start and at most `max_concurrency`
/// in flight, and returns what each measured, in order.
pub(crate) async fn load(
    client: &reqwest::Client,
    url: &str,
    api_key: Option<&str>,
    bodies: Vec<Value>,
    delays: Vec<Duration>,
    max_concurrency: Option<usize>,
    progress: &ProgressBar,
) -> Result<Vec<Outcome>> {
    let limit = Arc::new(Semaphore::new(
        max_concurrency.unwrap_or(Semaphore::MAX_PERMITS),
    ));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(bodies.len());
    for (body, delay) in bodies.into_iter().zip(delays) {
        tokio::time::sleep_until((start + delay).into()).await;
        let permit = limit.clone().acquire_owned().await?;
        let chat = body.get("messages").is_some();
        let mut post = client.post(url).json(&body);
        if let Some(key) = api_key {
            post = post.bearer_auth(key);
        }
        let progress = progress.clone();
        tasks.push(tokio::spawn(async move {
            let outcome = send(post, chat).await;
            drop(permit);
            progress.inc(1);
            outcome
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for t in tasks {
        outcomes.push(t.await?);
    }
    Ok(outcomes)
}

async fn bench(args: ServeArgs, requests: Vec<Request>, delays: Vec<Duration>) -> Result<()> {
    let base = args.base_url.trim_end_matches('/').to_string();
    // A fresh connection per request: a pooled keep-alive connection that the server
    // closes just as a request goes out fails that request (seen with llama-server).
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs_f64(args.request_timeout))
        .pool_max_idle_per_host(0)
        .build()?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => first_model(&client, &base, args.api_key.as_deref()).await?,
    };
    let progress = super::progress(requests.len(), "requests", args.format);
    let chat = args.endpoint.contains("chat");
    let constraint = constraint(&args)?;
    let bodies = requests
        .iter()
        .map(|r| {
            let mut body = request_body(&model, &r.prompt, r.max_tokens, args.temperature, chat);
            if let Some((key, value)) = &constraint {
                body[*key] = value.clone();
            }
            body
        })
        .collect();
    let url = format!("{base}{}", args.endpoint);
    let counters_before = engine_counters(&client, &base).await;
    let start = Instant::now();
    let outcomes = load(
        &client,
        &url,
        args.api_key.as_deref(),
        bodies,
        delays,
        args.max_concurrency,
        &progress,
    )
    .await?;
    let duration = start.elapsed().as_secs_f64();
    progress.finish_and_clear();
    let mut report = report(&args, &model, &outcomes, duration);
    report["constraint"] = json!(constraint.map(|(k, v)| json!({k: v})));
    if let (Some(a), Some(b)) = (counters_before, engine_counters(&client, &base).await) {
        report["structured_output"] = mask_report(&a, &b);
        report["engine_steps"] = phase_report(&a, &b);
    }
    if let Some(path) = &args.save_result {
        let mut saved = report.clone();
        saved["requests"] = outcomes
            .iter()
            .map(|o| {
                json!({
                    "error": o.error,
                    "prompt_tokens": o.prompt_tokens,
                    "output_tokens": o.tokens(),
                    "ttft_ms": o.ttft.map(|t| t.as_secs_f64() * 1e3),
                    "itl_ms": ms(&o.itl),
                    "e2el_ms": o.e2el.as_secs_f64() * 1e3,
                })
            })
            .collect();
        std::fs::write(path, serde_json::to_string_pretty(&saved)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    match args.format {
        Format::Json => println!("{report}"),
        Format::Text => print_report(&report),
    }
    Ok(())
}

async fn first_model(client: &reqwest::Client, base: &str, key: Option<&str>) -> Result<String> {
    let mut get = client.get(format!("{base}/v1/models"));
    if let Some(key) = key {
        get = get.bearer_auth(key);
    }
    let models: Value = get
        .send()
        .await
        .with_context(|| format!("GET {base}/v1/models"))?
        .error_for_status()?
        .json()
        .await?;
    match models["data"][0]["id"].as_str() {
        Some(id) => Ok(id.to_string()),
        None => bail!("{base}/v1/models lists no model; name one with --model"),
    }
}

/// Sends one streaming request and times its chunks.
async fn send(post: reqwest::RequestBuilder, chat: bool) -> Outcome {
    let sent = Instant::now();
    let mut out = Outcome::default();
    if let Err(e) = stream(post, chat, sent, &mut out).await {
        out.error = Some(format!("{e:#}"));
    }
    out.e2el = sent.elapsed();
    out
}

async fn stream(
    post: reqwest::RequestBuilder,
    chat: bool,
    sent: Instant,
    out: &mut Outcome,
) -> Result<()> {
    let response = post.send().await?;
    let status = response.status();
    if !status.is_success() {
        let body = response.text().await.unwrap_or_default();
        bail!(
            "HTTP {status}: {}",
            body.chars().take(300).collect::<String>()
        );
    }
    let mut bytes = response.bytes_stream();
    let mut buf = Vec::new();
    let mut last = sent;
    let mut done = false;
    while let Some(piece) = bytes.next().await {
        buf.extend_from_slice(&piece?);
        while let Some(end) = event_end(&buf) {
            let event: Vec<u8> = buf.drain(..end).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let chunk: Value =
                    serde_json::from_str(data).with_context(|| format!("bad chunk: {data}"))?;
                if let Some(e) = chunk.get("error") {
                    bail!("error in stream: {e}");
                }
                if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
                    out.prompt_tokens = usage["prompt_tokens"].as_u64().map(|n| n as usize);
                    out.output_tokens = usage["completion_tokens"].as_u64().map(|n| n as usize);
                }
                let choice = &chunk["choices"][0];
                let text = if chat {
                    &choice["delta"]["content"]
                } else {
                    &choice["text"]
                };
                if text.as_str().is_some_and(|t| !t.is_empty()) {
                    let now = Instant::now();
                    match out.ttft {
                        None => out.ttft = Some(now - sent),
                        Some(_) => out.itl.push(now - last),
                    }
                    last = now;
                    out.text_chunks += 1;
                }
            }
        }
    }
    ensure!(done, "the stream ended without [DONE]");
    ensure!(out.ttft.is_some(), "no text was streamed");
    Ok(())
}

/// The end (exclusive) of the first complete SSE event in `buf`.
fn event_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The engine phases whose times `/metrics` serves (`ingot:engine_step_phase_seconds`).
const PHASES: [&str; 9] = ingot_engine::StepPhases::NAMES;

/// ingot's counters from `/metrics`, where the server has them: the structured-output
/// counters, the engine's steps, then the time of each of its [`PHASES`].
async fn engine_counters(client: &reqwest::Client, base: &str) -> Option<Vec<f64>> {
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    let value = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
    };
    let mut names: Vec<String> = [
        "ingot:structured_output_masks_total",
        "ingot:structured_output_mask_steps_total",
        "ingot:structured_output_mask_seconds_total",
        "ingot:structured_output_mask_step_seconds_total",
        "ingot:structured_output_accept_seconds_total",
        "ingot:engine_steps_total",
    ]
    .map(String::from)
    .into();
    names.extend(PHASES.map(|p| format!("ingot:engine_step_phase_seconds_total{{phase=\"{p}\"}}")));
    names.iter().map(|n| value(n)).collect()
}

/// The masks a run computed and their time per token and per step, and the grammars'
/// advances' time per step (summed over sequences), from the counters before and after it.
fn mask_report(before: &[f64], after: &[f64]) -> Value {
    let d: Vec<f64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
    let per = |t: f64, n: f64| {
        if n > 0.0 {
            json!(t / n * 1e6)
        } else {
            Value::Null
        }
    };
    json!({
        "masks": d[0],
        "steps": d[1],
        "mask_us_per_token": per(d[2], d[0]),
        "mask_us_per_step": per(d[3], d[1]),
        "accept_us_per_step": per(d[4], d[1]),
    })
}

/// The engine's steps in a run and the time of each phase per step (µs), from the counters
/// before and after it.
fn phase_report(before: &[f64], after: &[f64]) -> Value {
    let steps = after[5] - before[5];
    let mut phases = serde_json::Map::new();
    for (k, p) in PHASES.iter().enumerate() {
        let t = after[6 + k] - before[6 + k];
        phases.insert((*p).into(), json!((steps > 0.0).then(|| t / steps * 1e6)));
    }
    json!({"steps": steps, "us_per_step": phases})
}

/// Mean, median, p90 and p99 in ms; null when nothing was measured.
pub(crate) fn stats(values: &[f64]) -> Value {
    if values.is_empty() {
        return Value::Null;
    }
    json!({
        "mean": values.iter().sum::<f64>() / values.len() as f64,
        "median": percentile(values, 50.0),
        "p90": percentile(values, 90.0),
        "p99": percentile(values, 99.0),
    })
}

fn report(args: &ServeArgs, model: &str, outcomes: &[Outcome], duration: f64) -> Value {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
    let mut errors: Vec<&str> = outcomes.iter().filter_map(|o| o.error.as_deref()).collect();
    errors.sort_unstable();
    errors.dedup();
    let input_tokens: usize = ok.iter().filter_map(|o| o.prompt_tokens).sum();
    let output_tokens: usize = ok.iter().map(|o| o.tokens()).sum();
    let collect = |f: &dyn Fn(&Outcome) -> Vec<Duration>| -> Vec<f64> {
        ms(&ok.iter().flat_map(|o| f(o)).collect::<Vec<_>>())
    };
    json!({
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "num_prompts": outcomes.len(),
        "input_len": args.dataset.input_len,
        "output_len": args.dataset.output_len,
        "range_ratio": args.dataset.range_ratio,
        "request_rate": if args.request_rate.is_finite() { json!(args.request_rate) } else { json!("inf") },
        "max_concurrency": args.max_concurrency,
        "completed": ok.len(),
        "failed": outcomes.len() - ok.len(),
        "errors": errors.iter().take(5).collect::<Vec<_>>(),
        "usage_reported": ok.iter().all(|o| o.output_tokens.is_some()),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": ok.len() as f64 / duration,
        "output_throughput": output_tokens as f64 / duration,
        "total_token_throughput": (input_tokens + output_tokens) as f64 / duration,
        "ttft_ms": stats(&collect(&|o| o.ttft.into_iter().collect())),
        "tpot_ms": stats(&collect(&|o| o.tpot().into_iter().collect())),
        "itl_ms": stats(&collect(&|o| o.itl.clone())),
        "e2el_ms": stats(&collect(&|o| vec![o.e2el])),
    })
}

fn print_report(r: &Value) {
    let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
    println!(
        "{} at {}: {} of {} requests completed, {} failed, in {:.2} s",
        r["model"].as_str().unwrap_or(""),
        r["base_url"].as_str().unwrap_or(""),
        r["completed"],
        r["num_prompts"],
        r["failed"],
        f("duration_s")
    );
    for e in r["errors"].as_array().into_iter().flatten() {
        println!("  error: {}", e.as_str().unwrap_or(""));
    }
    if r["usage_reported"] == false {
        println!("  (the server reported no usage: output tokens counted as text chunks)");
    }
    println!(
        "  {} input and {} output tokens; {:.2} requests/s, {:.1} output tok/s, {:.1} total tok/s",
        r["total_input_tokens"],
        r["total_output_tokens"],
        f("request_throughput"),
        f("output_throughput"),
        f("total_token_throughput")
    );
    println!(
        "  {:<10} {:>10} {:>10} {:>10} {:>10}",
        "ms", "mean", "median", "p90", "p99"
    );
    for (name, key) in [
        ("TTFT", "ttft_ms"),
        ("TPOT", "tpot_ms"),
        ("ITL", "itl_ms"),
        ("E2EL", "e2el_ms"),
    ] {
        let s = &r[key];
        let g = |k: &str| s[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "  {name:<10} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
            g("mean"),
            g("median"),
            g("p90"),
            g("p99")
        );
    }
    if !r["constraint"].is_null() {
        println!("  constraint: {}", r["constraint"]);
    }
    let so = &r["structured_output"];
    if !so.is_null() {
        let g = |k: &str| so[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "  structured output: {} masks in {} steps, {:.1} µs per mask, {:.1} µs per step; grammar advances {:.1} µs per step (summed)",
            g("masks"),
            g("steps"),
            g("mask_us_per_token"),
            g("mask_us_per_step"),
            g("accept_us_per_step")
        );
    }
    let steps = &r["engine_steps"];
    if !steps.is_null() {
        let phases: Vec<String> = PHASES
            .iter()
            .filter_map(|p| Some(format!("{p} {:.0}", steps["us_per_step"][p].as_f64()?)))
            .collect();
        println!(
            "  engine: {} steps, µs per step: {}",
            steps["steps"],
            phases.join(", ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phase_report_gives_each_phase_per_step_of_the_run() {
        let mut before = vec![0.0; 6 + PHASES.len()];
        before[5] = 10.0;
        let mut after = before.clone();
        after[5] = 14.0;
        // 2 ms of waiting for the device and 0.4 ms of masks over the run's 4 steps.
        after[6] = 0.002;
        let masks = PHASES.iter().position(|&p| p == "wait_masks").unwrap();
        after[6 + masks] = 0.0004;
        let r = phase_report(&before, &after);
        assert_eq!(r["steps"], 4.0);
        let us = |p: &str| r["us_per_step"][p].as_f64().unwrap();
        assert!((us("wait_device") - 500.0).abs() < 1e-6);
        assert!((us("wait_masks") - 100.0).abs() < 1e-6);
        assert_eq!(us("commit"), 0.0);
        let idle = phase_report(&before, &before);
        assert!(idle["us_per_step"]["wait_device"].is_null());
    }

    #[test]
    fn sse_events_end_at_a_blank_line_of_either_kind() {
        assert_eq!(event_end(b"data: 1\n\ndata: 2\n\n"), Some(9));
        assert_eq!(event_end(b"data: 1\r\n\r\ndata: 2"), Some(11));
        assert_eq!(event_end(b"data: partial"), None);
    }

    #[test]
    fn poisson_arrivals_average_the_rate() {
        let mut rng = StdRng::seed_from_u64(3);
        let times = arrivals(&mut rng, 20_000, 50.0);
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
        let mean_gap = times.last().unwrap().as_secs_f64() / 20_000.0;
        assert!((mean_gap - 0.02).abs() < 0.001, "mean gap {mean_gap}");
        let all_at_once = arrivals(&mut rng, 5, f64::INFINITY);
        assert!(all_at_once.iter().all(|t| t.is_zero()));
    }

    #[test]
    fn tpot_spreads_the_time_after_the_first_token() {
        let o = Outcome {
            output_tokens: Some(5),
            ttft: Some(Duration::from_millis(100)),
            e2el: Duration::from_millis(500),
            ..Outcome::default()
        };
        assert_eq!(o.tpot(), Some(Duration::from_millis(100)));
        let one = Outcome {
            output_tokens: Some(1),
            ..o
        };
        assert_eq!(one.tpot(), None);
    }
}
