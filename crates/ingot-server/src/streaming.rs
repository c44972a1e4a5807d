//! Streamed responses: each sample's deltas as server-sent event chunks, tool calls
//! streamed as OpenAI's clients put them together, ending in `data: [DONE]`.

use crate::admission::*;
use crate::protocol::{
    ChunkChoice, CompletionChoice, Delta, DeltaFunction, DeltaToolCall, Response, Usage,
};
use crate::reasoning::ReasoningSplit;
use crate::response::*;
use crate::tool_stream::{CallDelta, ToolStream};
use crate::tools::{self, ToolMode};
use crate::AppState;
use axum::response::sse::{Event as SseEvent, Sse};
use futures_util::stream::{self, Stream, StreamExt};
use ingot_core::FinishReason;
use ingot_engine::SeqDelta;
use serde::Serialize;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The event data of a chunk of `job` carrying `choices`.
fn data<C: Serialize>(job: &Job, choices: Vec<C>) -> String {
    serde_json::to_string(&job.response(true, choices)).expect("chunks serialize")
}

/// One streamed completions chunk for one sample's delta (the prompt's echo first).
fn completion_chunk(
    state: &AppState,
    job: &Job,
    prompt_index: usize,
    d: &SeqDelta,
    first: bool,
) -> String {
    let echo = if first {
        job.echo.get(prompt_index).map_or("", String::as_str)
    } else {
        ""
    };
    data(
        job,
        vec![CompletionChoice {
            index: prompt_index * job.n + d.index,
            text: format!("{echo}{}", d.text),
            logprobs: completion_logprobs(state, &d.logprobs),
            finish_reason: d.finish_reason.map(FinishReason::as_str),
        }],
    )
}

/// Per-prompt state while streaming.
pub(crate) struct Streaming {
    state: Arc<AppState>,
    job: Arc<Job>,
    sub: Submitted,
    /// Samples whose first chunk went out.
    started: Vec<bool>,
    /// Per sample: its answer read for tool calls (`auto` and `required`).
    calls: Vec<ToolStream>,
    /// Per sample: its thinking told from its answer, with a reasoning parser.
    thinking: Vec<Option<ReasoningSplit>>,
    completion_tokens: Arc<AtomicU64>,
}

/// The next chunk to send, if any (text held back for tool-call parsing sends none).
pub(crate) async fn next_chunk(mut s: Streaming) -> Option<(Option<String>, Streaming)> {
    match s.sub.events.recv().await {
        Some(Ok(d)) => {
            s.sub.timing.token(&d);
            s.completion_tokens
                .fetch_add(d.token_ids.len() as u64, Ordering::Relaxed);
            let index = s.sub.prompt_index * s.job.n + d.index;
            // The thinking goes out as `reasoning_content`; the answer goes on as the text.
            let (d, reasoning) = match &mut s.thinking[d.index] {
                Some(split) => {
                    let mut parts = split.push(&d.text);
                    if d.finish_reason.is_some() {
                        let rest = split.finish();
                        parts.reasoning += &rest.reasoning;
                        parts.content += &rest.content;
                    }
                    (
                        SeqDelta {
                            text: parts.content,
                            ..d
                        },
                        parts.reasoning,
                    )
                }
                None => (d, String::new()),
            };
            if s.job.kind == Kind::Completion {
                let first = !std::mem::replace(&mut s.started[d.index], true);
                let v = completion_chunk(&s.state, &s.job, s.sub.prompt_index, &d, first);
                return Some((Some(v), s));
            }
            let mut choice = match &s.job.tools {
                ToolMode::Named(name) => Some(named_call_choice(&s, &d, name, index)),
                ToolMode::Required | ToolMode::Auto(_) => call_choice(&mut s, &d, index),
                ToolMode::Text => Some(ChunkChoice {
                    index,
                    delta: Delta {
                        content: Some(d.text.clone()),
                        ..Delta::default()
                    },
                    logprobs: chat_logprobs(&s.state, &d.logprobs),
                    finish_reason: d.finish_reason.map(FinishReason::as_str),
                }),
            };
            if !reasoning.is_empty() {
                let c = choice.get_or_insert_with(|| ChunkChoice {
                    index,
                    delta: Delta::default(),
                    logprobs: None,
                    finish_reason: None,
                });
                c.delta.reasoning_content = Some(reasoning);
            }
            let v = choice.map(|mut c| {
                if !std::mem::replace(&mut s.started[d.index], true) {
                    c.delta.role = Some("assistant");
                }
                data(&s.job, vec![c])
            });
            Some((v, s))
        }
        Some(Err(f)) => {
            let body = failure_error(f).body();
            let v = serde_json::to_string(&body).expect("errors serialize");
            Some((Some(v), s))
        }
        None => {
            s.sub.timing.finish(&s.job.id);
            None
        }
    }
}

/// A streamed delta of an answer read for tool calls: `auto` text goes out as content
/// until a call could begin; each call's id and name, then its argument fragments, as
/// they are read; calls only the whole answer parses into when it ends.
fn call_choice(s: &mut Streaming, d: &SeqDelta, index: usize) -> Option<ChunkChoice> {
    let mode = &s.job.tools;
    let stream = &mut s.calls[d.index];
    let (sent, mut calls) = stream.push(mode, &d.text);
    let mut content = Some(sent);
    let mut finish = d.finish_reason.map(FinishReason::as_str);
    if d.finish_reason.is_some() {
        let (rest, more, has_calls) = stream.finish(mode);
        if let Some(rest) = rest {
            content.get_or_insert_default().push_str(&rest);
        }
        calls.extend(more);
        finish = tools::finish_reason(mode, has_calls, finish);
    }
    content = content.filter(|c| !c.is_empty());
    if content.is_none() && calls.is_empty() && d.finish_reason.is_none() {
        return None;
    }
    Some(ChunkChoice {
        index,
        delta: Delta {
            content,
            tool_calls: calls.into_iter().map(delta_tool_call).collect(),
            ..Delta::default()
        },
        logprobs: chat_logprobs(&s.state, &d.logprobs),
        finish_reason: finish,
    })
}

/// One call's streamed piece in OpenAI's shape: the id, type and name in its first.
fn delta_tool_call(c: CallDelta) -> DeltaToolCall {
    let (id, name) = c.header.unzip();
    DeltaToolCall {
        index: c.index,
        kind: id.as_ref().map(|_| "function"),
        id,
        function: DeltaFunction {
            name,
            arguments: c.arguments,
        },
    }
}

/// A streamed delta of a named function's arguments: the call's id and name come with the
/// first, argument text with each.
fn named_call_choice(s: &Streaming, d: &SeqDelta, name: &str, index: usize) -> ChunkChoice {
    let first = !s.started[d.index];
    ChunkChoice {
        index,
        delta: Delta {
            tool_calls: vec![delta_tool_call(CallDelta {
                index: 0,
                header: first.then(|| (tools::call_id(), name.to_string())),
                arguments: d.text.clone(),
            })],
            ..Delta::default()
        },
        logprobs: chat_logprobs(&s.state, &d.logprobs),
        finish_reason: d.finish_reason.map(FinishReason::as_str),
    }
}

/// Streams a job as server-sent events ending in `data: [DONE]`. Dropping the stream (a
/// client that disconnects) drops the receivers, and the engine aborts the requests.
pub(crate) fn stream_job(
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
            calls: (0..job.n).map(|_| ToolStream::default()).collect(),
            thinking: (0..job.n)
                .map(|_| job.reasoning.map(ReasoningSplit::new))
                .collect(),
            completion_tokens: completion_tokens.clone(),
        };
        stream::unfold(s, next_chunk).boxed()
    });
    let body = stream::select_all(per_prompt)
        .filter_map(|v| async move { v })
        .map(|v| Ok(SseEvent::default().data(v)));
    let tail = stream::once(async move {
        let mut events = vec![];
        if job.include_usage {
            let completion_tokens = completion_tokens.load(Ordering::Relaxed) as usize;
            let last = Response::<ChunkChoice> {
                usage: Some(Usage::new(prompt_tokens, completion_tokens)),
                ..job.response(true, vec![])
            };
            let v = serde_json::to_string(&last).expect("chunks serialize");
            events.push(Ok(SseEvent::default().data(v)));
        }
        events.push(Ok(SseEvent::default().data("[DONE]")));
        stream::iter(events)
    })
    .flatten();
    Sse::new(body.chain(tail))
}
