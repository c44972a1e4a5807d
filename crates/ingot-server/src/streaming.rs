//! Streamed responses: each sample's deltas as server-sent event chunks, tool calls
//! streamed as OpenAI's clients put them together, ending in `data: [DONE]`.

use crate::admission::*;
use crate::reasoning::ReasoningSplit;
use crate::response::*;
use crate::tools::{self, AutoStream, ToolMode};
use crate::{now, AppState};
use axum::response::sse::{Event as SseEvent, Sse};
use futures_util::stream::{self, Stream, StreamExt};
use ingot_core::FinishReason;
use ingot_engine::SeqDelta;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A streamed chunk of `job` carrying `choices`.
fn envelope(job: &Job, choices: Value) -> Value {
    json!({"id": job.id, "object": job.kind.object(true), "created": now(), "model": job.model, "choices": choices})
}

/// One streamed chunk for one sample's delta.
pub(crate) fn chunk(
    state: &AppState,
    job: &Job,
    prompt_index: usize,
    d: &SeqDelta,
    first: bool,
) -> Value {
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
            envelope(
                job,
                json!([{"index": index, "text": format!("{echo}{}", d.text), "logprobs": logprobs, "finish_reason": finish}]),
            )
        }
        Kind::Chat => {
            let delta = if first {
                json!({"role": "assistant", "content": d.text})
            } else {
                json!({"content": d.text})
            };
            envelope(
                job,
                json!([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]),
            )
        }
    }
}

/// Per-prompt state while streaming.
pub(crate) struct Streaming {
    state: Arc<AppState>,
    job: Arc<Job>,
    sub: Submitted,
    /// Samples whose first chunk went out.
    started: Vec<bool>,
    /// Per sample: the text held back to be parsed for tool calls (all of it for
    /// `required`, from a possible call on for `auto`).
    held: Vec<AutoStream>,
    /// Per sample: its thinking told from its answer, with a reasoning parser.
    thinking: Vec<Option<ReasoningSplit>>,
    completion_tokens: Arc<AtomicU64>,
}

/// The next chunk to send, if any (text held back for tool-call parsing sends none).
pub(crate) async fn next_chunk(mut s: Streaming) -> Option<(Option<Value>, Streaming)> {
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
            let mut v = match &s.job.tools {
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
            if !reasoning.is_empty() {
                let v = v.get_or_insert_with(|| {
                    envelope(
                        &s.job,
                        json!([{"index": index, "delta": {}, "logprobs": null, "finish_reason": null}]),
                    )
                });
                let delta = &mut v["choices"][0]["delta"];
                delta["reasoning_content"] = json!(reasoning);
                if !std::mem::replace(&mut s.started[d.index], true) {
                    delta["role"] = json!("assistant");
                }
            }
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
pub(crate) fn held_chunk(s: &mut Streaming, d: &SeqDelta, index: usize) -> Option<Value> {
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
    let finish = tools::finish_reason(
        &s.job.tools,
        !calls.is_empty(),
        d.finish_reason.map(FinishReason::as_str),
    );
    let mut delta = json!({"content": content});
    if finish == Some("tool_calls") {
        let mut calls = tools::calls_json(calls);
        for (i, c) in calls.iter_mut().enumerate() {
            c["index"] = json!(i);
        }
        delta["tool_calls"] = Value::from(calls);
    }
    if !std::mem::replace(&mut s.started[d.index], true) {
        delta["role"] = json!("assistant");
    }
    let logprobs = logprobs_json(&s.state, s.job.kind, &d.logprobs);
    Some(envelope(
        &s.job,
        json!([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]),
    ))
}

/// A streamed delta of a named function's arguments: the call's id and name come with the
/// first, argument text with each.
pub(crate) fn named_call_chunk(s: &Streaming, d: &SeqDelta, name: &str, first: bool) -> Value {
    let job = &s.job;
    let call = if first {
        json!({"index": 0, "id": tools::call_id(), "type": "function", "function": {"name": name, "arguments": d.text}})
    } else {
        json!({"index": 0, "function": {"arguments": d.text}})
    };
    let mut delta = json!({"tool_calls": [call]});
    if first {
        delta["role"] = json!("assistant");
    }
    envelope(
        job,
        json!([{
            "index": s.sub.prompt_index * job.n + d.index,
            "delta": delta,
            "logprobs": logprobs_json(&s.state, job.kind, &d.logprobs),
            "finish_reason": d.finish_reason.map(FinishReason::as_str),
        }]),
    )
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
            held: (0..job.n).map(|_| AutoStream::default()).collect(),
            thinking: (0..job.n)
                .map(|_| job.reasoning.map(ReasoningSplit::new))
                .collect(),
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
            let usage = usage(
                prompt_tokens,
                completion_tokens.load(Ordering::Relaxed) as usize,
            );
            let mut v = envelope(&job, json!([]));
            v["usage"] = usage;
            events.push(Ok(SseEvent::default().data(v.to_string())));
        }
        events.push(Ok(SseEvent::default().data("[DONE]")));
        stream::iter(events)
    })
    .flatten();
    Sse::new(body.chain(tail))
}
