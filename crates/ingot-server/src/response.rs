//! Whole responses: a job run to completion and rendered in OpenAI's completion or chat
//! completion shape, with logprobs and usage.

use crate::admission::*;
use crate::error::ApiError;
use crate::reasoning::{ReasoningParser, ReasoningSplit};
use crate::tools::{self, ToolMode};
use crate::{now, AppState};
use axum::Json;
use ingot_engine::TokenLogprobs;
use serde_json::{json, Value};
use std::sync::Arc;

/// Which OpenAI response shape a generation is rendered in.
#[derive(Clone, Copy)]
pub(crate) enum Kind {
    Completion,
    Chat,
}

impl Kind {
    /// The `object` field of a response, or of a streamed chunk.
    pub(crate) fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }
}

pub(crate) struct Job {
    pub(crate) id: String,
    pub(crate) kind: Kind,
    pub(crate) model: String,
    pub(crate) n: usize,
    /// Completions with `echo`: the prompt text comes first.
    pub(crate) echo: Vec<String>,
    pub(crate) include_usage: bool,
    /// How a chat answer becomes tool calls.
    pub(crate) tools: ToolMode,
    /// How a chat answer's thinking is told from its answer.
    pub(crate) reasoning: Option<ReasoningParser>,
}

pub(crate) fn token_text(state: &AppState, id: u32) -> String {
    state
        .engine
        .get()
        .and_then(|e| e.tokenizer().decode(&[id], false).ok())
        .unwrap_or_default()
}

pub(crate) fn logprobs_json(state: &AppState, kind: Kind, lps: &[TokenLogprobs]) -> Value {
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

pub(crate) fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// Runs a job to completion and renders one response.
pub(crate) async fn collect(
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
                    let (message, finish) = chat_message(&job, text, finish);
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
pub(crate) fn chat_message<'a>(
    job: &Job,
    text: String,
    finish: Option<&'a str>,
) -> (Value, Option<&'a str>) {
    let (reasoning, text) = match job.reasoning {
        Some(parser) => ReasoningSplit::split(parser, &text),
        None => (None, text),
    };
    let mode = &job.tools;
    let (mut message, finish) = if *mode == ToolMode::Text || finish == Some("length") {
        (json!({"role": "assistant", "content": text}), finish)
    } else {
        tool_message(mode, &text, finish)
    };
    if job.reasoning.is_some() {
        message["reasoning_content"] = json!(reasoning);
    }
    (message, finish)
}

/// An answer parsed for tool calls, as OpenAI's message.
fn tool_message<'a>(
    mode: &ToolMode,
    text: &str,
    finish: Option<&'a str>,
) -> (Value, Option<&'a str>) {
    let (content, calls) = tools::parse(mode, text);
    let calls = tools::calls_json(calls);
    let finish = tools::finish_reason(mode, !calls.is_empty(), finish);
    let mut message = json!({"role": "assistant", "content": content});
    if !calls.is_empty() {
        message["tool_calls"] = Value::from(calls);
    }
    (message, finish)
}
