//! The OpenAI-compatible HTTP API: completions and chat completions (plain and streamed as
//! server-sent events), models, health, version, metrics, tokenize and detokenize; and a
//! chat page at `/`.

mod chat_page;
pub mod error;
pub mod metrics;
pub mod protocol;
pub mod tools;

use crate::error::ApiError;
use crate::metrics::{Metrics, SequenceEnd};
use crate::protocol::{ChatRequest, CompletionRequest, Content, Prompt};
use crate::tools::{AutoStream, ToolMode, ToolParser};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use ingot_core::{AdmissionError, FinishReason, InvalidParam, SamplingParams};
use ingot_engine::{EngineHandle, Events, Failure, SeqDelta, SubmitError, TokenLogprobs};
use ingot_model::chat::Message;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub struct ServerConfig {
    pub served_model_name: String,
    pub api_key: Option<String>,
    /// Most samples (`n`) one request may ask for.
    pub max_n: usize,
    /// Most prompts in one completions request.
    pub max_prompts_per_request: usize,
    /// Request bodies larger than this are refused with 413.
    pub max_body_bytes: usize,
    /// How the model writes tool calls, where `tool_choice` `auto` is on
    /// (`--enable-auto-tool-choice`).
    pub tool_parser: Option<ToolParser>,
}

pub struct AppState {
    /// Set once the model has loaded; until then the API answers 503.
    pub engine: OnceLock<EngineHandle>,
    pub config: ServerConfig,
    pub metrics: Arc<Metrics>,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(config: ServerConfig) -> Arc<AppState> {
        Arc::new(AppState {
            engine: OnceLock::new(),
            config,
            metrics: Arc::new(Metrics::default()),
            next_id: AtomicU64::new(0),
        })
    }

    fn engine(&self) -> Result<&EngineHandle, ApiError> {
        self.engine.get().ok_or_else(|| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the model is still loading",
            )
        })
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    Router::new()
        .merge(v1)
        .merge(chat_page::routes())
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics_endpoint))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .with_state(state)
}

async fn require_api_key(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    req: Request,
    next: Next,
) -> Response {
    if let Some(key) = &state.config.api_key {
        let given = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(key.as_str()) {
            return ApiError::new(StatusCode::UNAUTHORIZED, "invalid or missing API key")
                .into_response();
        }
    }
    next.run(req).await
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.engine.get() {
        Some(_) => StatusCode::OK.into_response(),
        None => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the model is still loading",
        )
        .into_response(),
    }
}

async fn version() -> Json<Value> {
    Json(json!({ "version": env!("CARGO_PKG_VERSION") }))
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn models(State(state): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let engine = state.engine()?;
    Ok(Json(json!({
        "object": "list",
        "data": [{
            "id": state.config.served_model_name,
            "object": "model",
            "created": now(),
            "owned_by": "ingot",
            "max_model_len": engine.max_model_len(),
        }]
    })))
}

async fn metrics_endpoint(State(state): State<Arc<AppState>>) -> Response {
    let stats = state.engine.get().map(|e| e.stats()).unwrap_or_default();
    (
        [("content-type", metrics::CONTENT_TYPE)],
        state.metrics.render(&stats),
    )
        .into_response()
}

async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let engine = state.engine()?;
    let v = protocol::parse_json(&body)?;
    let prompt = v
        .get("prompt")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request("`prompt` must be a string").with_param("prompt"))?;
    let add_special = v
        .get("add_special_tokens")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let tokens = engine
        .tokenizer()
        .encode(prompt, add_special)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(Json(
        json!({ "tokens": tokens, "count": tokens.len(), "max_model_len": engine.max_model_len() }),
    ))
}

async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let engine = state.engine()?;
    let v = protocol::parse_json(&body)?;
    let tokens: Vec<u32> = v
        .get("tokens")
        .and_then(|t| serde_json::from_value(t.clone()).ok())
        .ok_or_else(|| {
            ApiError::bad_request("`tokens` must be a list of token ids").with_param("tokens")
        })?;
    let vocab = engine.tokenizer().vocab_size() as u32;
    if let Some(t) = tokens.iter().find(|&&t| t >= vocab) {
        return Err(ApiError::bad_request(format!(
            "token id {t} is outside the vocabulary of {vocab}"
        ))
        .with_param("tokens"));
    }
    let text = engine
        .tokenizer()
        .decode(&tokens, false)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(Json(json!({ "prompt": text })))
}

fn check_model(state: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if *m != state.config.served_model_name => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "The model `{m}` does not exist. This server serves `{}`.",
                state.config.served_model_name
            ),
        )
        .with_param("model")),
        _ => Ok(()),
    }
}

fn context_error(max_model_len: usize, prompt: usize) -> ApiError {
    ApiError::bad_request(format!(
        "This model's maximum context length is {max_model_len} tokens. However, your request has {prompt} input tokens. Please reduce the length of the input."
    ))
}

/// One submitted prompt: its index among the request's prompts and its output channel.
struct Submitted {
    prompt_index: usize,
    prompt: Vec<u32>,
    events: Events,
    /// Started when the prompt was submitted.
    timing: Timing,
}

/// The client's error for a request the engine did not take.
fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::Rejected(e) => {
            let param = if let Some(p) = e.downcast_ref::<InvalidParam>() {
                Some(p.field)
            } else if let Some(AdmissionError::TooManySamples { .. }) = e.downcast_ref() {
                Some("n")
            } else {
                None
            };
            let err = ApiError::bad_request(format!("{e:#}"));
            match param {
                Some(p) => err.with_param(p),
                None => err,
            }
        }
        SubmitError::AtCapacity(_) | SubmitError::ShuttingDown | SubmitError::Stopped => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
        }
    }
}

fn failure_error(f: Failure) -> ApiError {
    let status = match f {
        Failure::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
        Failure::Step(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    ApiError::new(status, f.to_string())
}

/// Bounds what one request may multiply: its samples and its prompts.
fn check_request_size(
    config: &ServerConfig,
    params: &SamplingParams,
    prompts: usize,
) -> Result<(), ApiError> {
    if params.n > config.max_n {
        return Err(ApiError::bad_request(format!(
            "invalid `n`: at most {} samples per request (--max-n), got {}",
            config.max_n, params.n
        ))
        .with_param("n"));
    }
    if prompts > config.max_prompts_per_request {
        return Err(ApiError::bad_request(format!(
            "invalid `prompt`: at most {} prompts per request (--max-prompts-per-request), got {prompts}",
            config.max_prompts_per_request
        ))
        .with_param("prompt"));
    }
    Ok(())
}

/// Submits every prompt or none: on a rejection the ones already queued are aborted. An
/// error about the output constraint names `constraint_field`, where the request gave it.
async fn submit(
    state: &AppState,
    prompts: Vec<Vec<u32>>,
    params: &SamplingParams,
    constraint_field: Option<&'static str>,
) -> Result<Vec<Submitted>, ApiError> {
    let engine = state.engine()?;
    check_request_size(&state.config, params, prompts.len())?;
    let mut out = vec![];
    let mut ids = vec![];
    for (prompt_index, prompt) in prompts.into_iter().enumerate() {
        match engine
            .add_request_async(prompt.clone(), params.clone())
            .await
        {
            Ok((id, events)) => {
                ids.push(id);
                state.metrics.admitted(prompt.len());
                out.push(Submitted {
                    prompt_index,
                    timing: Timing::new(state.metrics.clone(), prompt.len(), params.n),
                    prompt,
                    events,
                });
            }
            Err(e) => {
                ids.iter().for_each(|&id| engine.abort(id));
                let mut err = submit_error(e);
                let about_constraint = params.structured.as_ref().map(|s| s.field());
                if err.param.is_some() && err.param.as_deref() == about_constraint {
                    err.param = constraint_field.map(String::from);
                }
                return Err(err);
            }
        }
    }
    Ok(out)
}

/// One sample's progress, for the metrics.
#[derive(Clone, Default)]
struct SampleClock {
    tokens: usize,
    queue: Duration,
    first: Option<Instant>,
    last: Option<Instant>,
    ended: bool,
}

/// Latency and length bookkeeping of one submitted prompt and its samples, for the metrics
/// and the request log. Samples that have not ended when it is dropped (the client left
/// and the engine aborts them) count as aborted.
struct Timing {
    metrics: Arc<Metrics>,
    start: Instant,
    prompt_tokens: usize,
    samples: Vec<SampleClock>,
}

impl Timing {
    fn new(metrics: Arc<Metrics>, prompt_tokens: usize, n: usize) -> Timing {
        Timing {
            metrics,
            start: Instant::now(),
            prompt_tokens,
            samples: vec![SampleClock::default(); n],
        }
    }

    fn token(&mut self, d: &SeqDelta) {
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

    fn finish(&self, id: &str) {
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

/// Which OpenAI response shape a generation is rendered in.
#[derive(Clone, Copy)]
enum Kind {
    Completion,
    Chat,
}

impl Kind {
    /// The `object` field of a response, or of a streamed chunk.
    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }
}

struct Job {
    id: String,
    kind: Kind,
    model: String,
    n: usize,
    /// Completions with `echo`: the prompt text comes first.
    echo: Vec<String>,
    include_usage: bool,
    /// How a chat answer becomes tool calls.
    tools: ToolMode,
}

fn token_text(state: &AppState, id: u32) -> String {
    state
        .engine
        .get()
        .and_then(|e| e.tokenizer().decode(&[id], false).ok())
        .unwrap_or_default()
}

fn logprobs_json(state: &AppState, kind: Kind, lps: &[TokenLogprobs]) -> Value {
    if lps.is_empty() {
        return Value::Null;
    }
    match kind {
        Kind::Completion => json!({
            "tokens": lps.iter().map(|l| token_text(state, l.token)).collect::<Vec<_>>(),
            "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
            "top_logprobs": lps.iter().map(|l| l.top.iter().map(|(t, p)| (token_text(state, *t), json!(p))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
        }),
        Kind::Chat => json!({
            "content": lps.iter().map(|l| {
                let tok = token_text(state, l.token);
                json!({
                    "token": tok,
                    "logprob": l.logprob,
                    "bytes": tok.as_bytes(),
                    "top_logprobs": l.top.iter().map(|(t, p)| {
                        let s = token_text(state, *t);
                        json!({"token": s, "logprob": p, "bytes": s.as_bytes()})
                    }).collect::<Vec<_>>(),
                })
            }).collect::<Vec<_>>()
        }),
    }
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// Runs a job to completion and renders one response.
async fn collect(
    state: Arc<AppState>,
    job: Job,
    subs: Vec<Submitted>,
) -> Result<Json<Value>, ApiError> {
    let mut choices = vec![];
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    for mut sub in subs {
        prompt_tokens += sub.prompt.len();
        let mut samples: Vec<(String, Vec<TokenLogprobs>, Option<&str>)> =
            vec![(String::new(), vec![], None); job.n];
        while let Some(event) = sub.events.recv().await {
            let d = event.map_err(failure_error)?;
            sub.timing.token(&d);
            completion_tokens += d.token_ids.len();
            let s = &mut samples[d.index];
            s.0.push_str(&d.text);
            s.1.extend(d.logprobs);
            if let Some(f) = d.finish_reason {
                s.2 = Some(f.as_str());
            }
        }
        sub.timing.finish(&job.id);
        for (i, (text, lps, finish)) in samples.into_iter().enumerate() {
            let index = sub.prompt_index * job.n + i;
            let logprobs = logprobs_json(&state, job.kind, &lps);
            choices.push(match job.kind {
                Kind::Completion => {
                    let text = format!("{}{text}", job.echo.get(sub.prompt_index).map_or("", String::as_str));
                    json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
                }
                Kind::Chat => {
                    let (message, finish) = chat_message(&job.tools, text, finish);
                    json!({
                        "index": index,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    })
                }
            });
        }
    }
    Ok(Json(json!({
        "id": job.id,
        "object": job.kind.object(false),
        "created": now(),
        "model": job.model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    })))
}

/// A chat answer as OpenAI's message, its tool calls parsed out, and its finish reason
/// (`tool_calls` where the model chose to call; a length cut stays `length`).
fn chat_message<'a>(
    mode: &ToolMode,
    text: String,
    finish: Option<&'a str>,
) -> (Value, Option<&'a str>) {
    if *mode == ToolMode::Text || finish == Some("length") {
        return (json!({"role": "assistant", "content": text}), finish);
    }
    let (content, calls) = tools::parse(mode, &text);
    let calls: Vec<Value> = calls
        .into_iter()
        .map(|c| {
            json!({"id": tools::call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
        })
        .collect();
    // OpenAI ends a named choice with `stop`, and a call the model chose with `tool_calls`.
    let finish = match (mode, calls.is_empty()) {
        (ToolMode::Named(_), _) | (_, true) => finish,
        _ => Some("tool_calls"),
    };
    let mut message = json!({"role": "assistant", "content": content});
    if !calls.is_empty() {
        message["tool_calls"] = Value::from(calls);
    }
    (message, finish)
}

/// One streamed chunk for one sample's delta.
fn chunk(state: &AppState, job: &Job, prompt_index: usize, d: &SeqDelta, first: bool) -> Value {
    let index = prompt_index * job.n + d.index;
    let logprobs = logprobs_json(state, job.kind, &d.logprobs);
    let finish = d.finish_reason.map(FinishReason::as_str);
    match job.kind {
        Kind::Completion => {
            let echo = if first {
                job.echo.get(prompt_index).map_or("", String::as_str)
            } else {
                ""
            };
            json!({
                "id": job.id, "object": job.kind.object(true), "created": now(), "model": job.model,
                "choices": [{"index": index, "text": format!("{echo}{}", d.text), "logprobs": logprobs, "finish_reason": finish}],
            })
        }
        Kind::Chat => {
            let delta = if first {
                json!({"role": "assistant", "content": d.text})
            } else {
                json!({"content": d.text})
            };
            json!({
                "id": job.id, "object": job.kind.object(true), "created": now(), "model": job.model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            })
        }
    }
}

/// Per-prompt state while streaming.
struct Streaming {
    state: Arc<AppState>,
    job: Arc<Job>,
    sub: Submitted,
    /// Samples whose first chunk went out.
    started: Vec<bool>,
    /// Per sample: the text held back to be parsed for tool calls (all of it for
    /// `required`, from a possible call on for `auto`).
    held: Vec<AutoStream>,
    /// Per sample: the id of its call, where `tool_choice` names a function.
    call_ids: Vec<String>,
    completion_tokens: Arc<AtomicU64>,
}

/// The next chunk to send, if any (text held back for tool-call parsing sends none).
async fn next_chunk(mut s: Streaming) -> Option<(Option<Value>, Streaming)> {
    match s.sub.events.recv().await {
        Some(Ok(d)) => {
            s.sub.timing.token(&d);
            s.completion_tokens
                .fetch_add(d.token_ids.len() as u64, Ordering::Relaxed);
            let index = s.sub.prompt_index * s.job.n + d.index;
            let v = match &s.job.tools {
                ToolMode::Named(name) => {
                    let first = !std::mem::replace(&mut s.started[d.index], true);
                    Some(named_call_chunk(&s, &d, name, first))
                }
                ToolMode::Required | ToolMode::Auto(_) => held_chunk(&mut s, &d, index),
                ToolMode::Text => {
                    let first = !std::mem::replace(&mut s.started[d.index], true);
                    Some(chunk(&s.state, &s.job, s.sub.prompt_index, &d, first))
                }
            };
            Some((v, s))
        }
        Some(Err(f)) => {
            let e = failure_error(f);
            let v = json!({"error": {"message": e.message, "type": e.kind(), "param": null, "code": e.status.as_u16()}});
            Some((Some(v), s))
        }
        None => {
            s.sub.timing.finish(&s.job.id);
            None
        }
    }
}

/// A streamed delta of an answer parsed for tool calls: `auto` text goes out as content
/// until a call could begin; the calls go out, whole and with their ids, when it ends.
fn held_chunk(s: &mut Streaming, d: &SeqDelta, index: usize) -> Option<Value> {
    let held = &mut s.held[d.index];
    let (mut content, calls) = match s.job.tools {
        ToolMode::Auto(parser) => {
            let sent = held.push(parser, &d.text);
            match d.finish_reason {
                Some(_) => {
                    let (rest, calls) = held.finish(parser);
                    (Some(sent + rest.as_deref().unwrap_or("")), calls)
                }
                None => (Some(sent), vec![]),
            }
        }
        _ => {
            held.hold(&d.text);
            match d.finish_reason {
                Some(_) => held.finish_required(),
                None => (None, vec![]),
            }
        }
    };
    content = content.filter(|c| !c.is_empty());
    if content.is_none() && d.finish_reason.is_none() {
        return None;
    }
    let mut finish = d.finish_reason.map(FinishReason::as_str);
    let mut delta = json!({"content": content});
    if !calls.is_empty() && finish != Some("length") {
        finish = Some("tool_calls");
        delta["tool_calls"] = calls
            .into_iter()
            .enumerate()
            .map(|(i, c)| json!({"index": i, "id": tools::call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
            .collect();
    }
    if !std::mem::replace(&mut s.started[d.index], true) {
        delta["role"] = json!("assistant");
    }
    let job = &s.job;
    Some(json!({
        "id": job.id, "object": job.kind.object(true), "created": now(), "model": job.model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs_json(&s.state, job.kind, &d.logprobs), "finish_reason": finish}],
    }))
}

/// A streamed delta of a named function's arguments: the call's id and name come with the
/// first, argument text with each.
fn named_call_chunk(s: &Streaming, d: &SeqDelta, name: &str, first: bool) -> Value {
    let job = &s.job;
    let call = if first {
        json!({"index": 0, "id": s.call_ids[d.index], "type": "function", "function": {"name": name, "arguments": d.text}})
    } else {
        json!({"index": 0, "function": {"arguments": d.text}})
    };
    let mut delta = json!({"tool_calls": [call]});
    if first {
        delta["role"] = json!("assistant");
    }
    json!({
        "id": job.id, "object": job.kind.object(true), "created": now(), "model": job.model,
        "choices": [{
            "index": s.sub.prompt_index * job.n + d.index,
            "delta": delta,
            "logprobs": logprobs_json(&s.state, job.kind, &d.logprobs),
            "finish_reason": d.finish_reason.map(FinishReason::as_str),
        }],
    })
}

/// Streams a job as server-sent events ending in `data: [DONE]`. Dropping the stream (a
/// client that disconnects) drops the receivers, and the engine aborts the requests.
fn stream_job(
    state: Arc<AppState>,
    job: Job,
    subs: Vec<Submitted>,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let prompt_tokens: usize = subs.iter().map(|s| s.prompt.len()).sum();
    let job = Arc::new(job);
    let completion_tokens = Arc::new(AtomicU64::new(0));
    let per_prompt = subs.into_iter().map(|sub| {
        let s = Streaming {
            state: state.clone(),
            job: job.clone(),
            sub,
            started: vec![false; job.n],
            held: (0..job.n).map(|_| AutoStream::default()).collect(),
            call_ids: (0..job.n).map(|_| tools::call_id()).collect(),
            completion_tokens: completion_tokens.clone(),
        };
        stream::unfold(s, next_chunk).boxed()
    });
    let body = stream::select_all(per_prompt)
        .filter_map(|v| async move { v })
        .map(|v| Ok(SseEvent::default().data(v.to_string())));
    let tail = stream::once(async move {
        let mut events = vec![];
        if job.include_usage {
            let usage = usage(prompt_tokens, completion_tokens.load(Ordering::Relaxed) as usize);
            let v = json!({"id": job.id, "object": job.kind.object(true), "created": now(), "model": job.model, "choices": [], "usage": usage});
            events.push(Ok(SseEvent::default().data(v.to_string())));
        }
        events.push(Ok(SseEvent::default().data("[DONE]")));
        stream::iter(events)
    })
    .flatten();
    Sse::new(body.chain(tail))
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = protocol::parse(&body, protocol::COMPLETION_FIELDS)?;
    check_model(&state, &req.model)?;
    let engine = state.engine()?;
    if req.best_of.is_some_and(|b| b > 1) {
        return Err(ApiError::bad_request("`best_of` is not supported").with_param("best_of"));
    }
    if req.suffix.is_some() {
        return Err(ApiError::bad_request("`suffix` is not supported").with_param("suffix"));
    }
    let tok = engine.tokenizer();
    let prompts: Vec<Vec<u32>> = match &req.prompt {
        Prompt::Text(t) => vec![tok
            .encode(t, true)
            .map_err(|e| ApiError::bad_request(e.to_string()))?],
        Prompt::Texts(ts) => ts
            .iter()
            .map(|t| tok.encode(t, true))
            .collect::<anyhow::Result<_>>()
            .map_err(|e| ApiError::bad_request(e.to_string()))?,
        Prompt::Tokens(ids) => vec![ids.clone()],
        Prompt::TokenLists(lists) => lists.clone(),
    };
    if prompts.is_empty() {
        return Err(ApiError::bad_request("`prompt` is empty").with_param("prompt"));
    }
    let mut params = req.sampling.to_params(req.logprobs)?;
    params.max_tokens = req.max_tokens.unwrap_or(16);
    let echo = if req.echo.unwrap_or(false) {
        prompts
            .iter()
            .map(|p| tok.decode(p, false))
            .collect::<anyhow::Result<_>>()
            .map_err(|e| ApiError::bad_request(e.to_string()))?
    } else {
        vec![]
    };
    let job = Job {
        id: format!("cmpl-{}", state.next_id.fetch_add(1, Ordering::Relaxed)),
        kind: Kind::Completion,
        model: state.config.served_model_name.clone(),
        n: params.n,
        echo,
        include_usage: req.stream_options.as_ref().is_some_and(|o| o.include_usage),
        tools: ToolMode::Text,
    };
    let subs = submit(&state, prompts, &params, req.sampling.constraint_field()).await?;
    if req.stream.unwrap_or(false) {
        Ok(stream_job(state, job, subs).into_response())
    } else {
        Ok(collect(state, job, subs).await?.into_response())
    }
}

fn message_text(content: &Option<Content>) -> Result<String, ApiError> {
    match content {
        None => Ok(String::new()),
        Some(Content::Text(t)) => Ok(t.clone()),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for p in parts {
                if p.kind != "text" {
                    return Err(ApiError::bad_request(format!(
                        "content parts of type `{}` are not supported",
                        p.kind
                    ))
                    .with_param("messages"));
                }
                text.push_str(p.text.as_deref().unwrap_or(""));
            }
            Ok(text)
        }
    }
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: ChatRequest = protocol::parse(&body, protocol::CHAT_FIELDS)?;
    check_model(&state, &req.model)?;
    let engine = state.engine()?;
    if req.messages.is_empty() {
        return Err(ApiError::bad_request("`messages` is empty").with_param("messages"));
    }
    let tools = req.tools.as_deref().unwrap_or_default();
    let tool_mode = tools::mode(tools, req.tool_choice.as_ref(), state.config.tool_parser)?;
    let mut messages = vec![];
    for m in &req.messages {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool") {
            return Err(ApiError::bad_request(format!(
                "message role `{}` is not supported",
                m.role
            ))
            .with_param("messages"));
        }
        let mut msg = Message::new(m.role.clone(), message_text(&m.content)?);
        msg.name = m.name.clone();
        msg.tool_call_id = m.tool_call_id.clone();
        if let Some(calls) = &m.tool_calls {
            // Templates read a call's arguments as an object, as transformers gives them.
            msg.tool_calls = Some(
                calls
                    .iter()
                    .map(|c| {
                        let args = serde_json::from_str::<Value>(&c.function.arguments)
                            .unwrap_or_else(|_| Value::String(c.function.arguments.clone()));
                        json!({
                            "id": c.id,
                            "type": c.kind.as_deref().unwrap_or("function"),
                            "function": {"name": c.function.name, "arguments": args},
                        })
                    })
                    .collect(),
            );
        }
        messages.push(msg);
    }
    let tok = engine.tokenizer();
    let native_tools = tok
        .chat_template
        .as_ref()
        .is_some_and(|t| t.supports_tools());
    let template_tools = match (tools.is_empty(), native_tools) {
        (true, _) => None,
        (false, true) => Some(tools::template_tools(tools)),
        (false, false) => {
            let parser = match tool_mode {
                ToolMode::Auto(p) => p,
                _ => ToolParser::Hermes,
            };
            tools::fallback(&mut messages, tools, parser);
            None
        }
    };
    let rendered = tok
        .apply_chat_template(&messages, template_tools.as_ref())
        .map_err(|e| ApiError::bad_request(format!("{e:#}")))?;
    let prompt = tok
        .encode(&rendered, false)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let max_len = engine.max_model_len();
    if prompt.len() >= max_len {
        return Err(context_error(max_len, prompt.len()));
    }
    let top = if req.logprobs.unwrap_or(false) {
        Some(req.top_logprobs.unwrap_or(0))
    } else {
        None
    };
    let mut params = req.sampling.to_params(top)?;
    let mut constraint_field = req.sampling.constraint_field();
    if let Some(c) = tools::constraint(tools, &tool_mode, req.parallel_tool_calls.unwrap_or(true)) {
        if let Some(f) = constraint_field {
            return Err(ApiError::bad_request(format!(
                "`tool_choice` {} and `{f}` both constrain the answer; give one",
                if matches!(tool_mode, ToolMode::Required) {
                    "required"
                } else {
                    "naming a function"
                }
            ))
            .with_param("tool_choice"));
        }
        params.structured = Some(c);
        constraint_field = Some("tools");
    }
    if let ToolMode::Auto(ToolParser::Mistral) = tool_mode {
        // Mistral's call marker is a special token.
        params.skip_special_tokens = false;
    }
    params.max_tokens = req
        .max_completion_tokens
        .or(req.max_tokens)
        .unwrap_or(max_len - prompt.len());
    let job = Job {
        id: format!("chatcmpl-{}", state.next_id.fetch_add(1, Ordering::Relaxed)),
        kind: Kind::Chat,
        model: state.config.served_model_name.clone(),
        n: params.n,
        echo: vec![],
        include_usage: req.stream_options.as_ref().is_some_and(|o| o.include_usage),
        tools: tool_mode,
    };
    let subs = submit(&state, vec![prompt], &params, constraint_field).await?;
    if req.stream.unwrap_or(false) {
        Ok(stream_job(state, job, subs).into_response())
    } else {
        Ok(collect(state, job, subs).await?.into_response())
    }
}
