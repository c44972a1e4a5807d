//! Whole responses: a job run to completion and rendered in OpenAI's completion or chat
//! completion shape, with logprobs and usage.

use crate::admission::*;
use crate::error::ApiError;
use crate::protocol::{
    AssistantMessage, ChatChoice, ChatLogprobs, CompletionChoice, CompletionLogprobs, Response,
    TokenLogprob, TopLogprob, Usage,
};
use crate::reasoning::{ReasoningParser, ReasoningSplit};
use crate::tools::{self, ToolMode};
use crate::{now, AppState};
use axum::response::IntoResponse;
use axum::Json;
use ingot_engine::TokenLogprobs;
use std::sync::Arc;

/// Which OpenAI response shape a generation is rendered in.
#[derive(Clone, Copy, PartialEq, Eq)]
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

/// Completions' logprobs of `lps` (none where no token has them).
pub(crate) fn completion_logprobs(
    state: &AppState,
    lps: &[TokenLogprobs],
) -> Option<CompletionLogprobs> {
    (!lps.is_empty()).then(|| CompletionLogprobs {
        tokens: lps.iter().map(|l| token_text(state, l.token)).collect(),
        token_logprobs: lps.iter().map(|l| l.logprob).collect(),
        top_logprobs: lps
            .iter()
            .map(|l| {
                l.top
                    .iter()
                    .map(|&(t, p)| (token_text(state, t), p))
                    .collect()
            })
            .collect(),
    })
}

/// Chat logprobs of `lps` (none where no token has them).
pub(crate) fn chat_logprobs(state: &AppState, lps: &[TokenLogprobs]) -> Option<ChatLogprobs> {
    let top = |t: u32, logprob: f32| {
        let token = token_text(state, t);
        TopLogprob {
            bytes: token.as_bytes().to_vec(),
            token,
            logprob,
        }
    };
    (!lps.is_empty()).then(|| ChatLogprobs {
        content: lps
            .iter()
            .map(|l| {
                let TopLogprob {
                    token,
                    logprob,
                    bytes,
                } = top(l.token, l.logprob);
                TokenLogprob {
                    token,
                    logprob,
                    bytes,
                    top_logprobs: l.top.iter().map(|&(t, p)| top(t, p)).collect(),
                }
            })
            .collect(),
    })
}

impl Job {
    /// A response or chunk of this job with `choices`.
    pub(crate) fn response<C>(&self, chunk: bool, choices: Vec<C>) -> Response<C> {
        Response {
            id: self.id.clone(),
            object: self.kind.object(chunk),
            created: now(),
            model: self.model.clone(),
            choices,
            usage: None,
        }
    }
}

/// Runs a job to completion and renders one response.
pub(crate) async fn collect(
    state: Arc<AppState>,
    job: Job,
    subs: Vec<Submitted>,
) -> Result<axum::response::Response, ApiError> {
    let mut completions = vec![];
    let mut chats = vec![];
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
            match job.kind {
                Kind::Completion => {
                    let echo = job.echo.get(sub.prompt_index).map_or("", String::as_str);
                    completions.push(CompletionChoice {
                        index,
                        text: format!("{echo}{text}"),
                        logprobs: completion_logprobs(&state, &lps),
                        finish_reason: finish,
                    });
                }
                Kind::Chat => {
                    let (message, finish_reason) = chat_message(&job, text, finish);
                    chats.push(ChatChoice {
                        index,
                        message,
                        logprobs: chat_logprobs(&state, &lps),
                        finish_reason,
                    });
                }
            }
        }
    }
    let usage = Some(Usage::new(prompt_tokens, completion_tokens));
    Ok(match job.kind {
        Kind::Completion => Json(Response {
            usage,
            ..job.response(false, completions)
        })
        .into_response(),
        Kind::Chat => Json(Response {
            usage,
            ..job.response(false, chats)
        })
        .into_response(),
    })
}

/// A chat answer as OpenAI's message, its tool calls parsed out, and its finish reason
/// (`tool_calls` where the model chose to call; a length cut stays `length`).
pub(crate) fn chat_message(
    job: &Job,
    text: String,
    finish: Option<&'static str>,
) -> (AssistantMessage, Option<&'static str>) {
    let (reasoning, text) = match job.reasoning {
        Some(parser) => ReasoningSplit::split(parser, &text),
        None => (None, text),
    };
    let mode = &job.tools;
    let (content, tool_calls, finish) = if *mode == ToolMode::Text || finish == Some("length") {
        (Some(text), vec![], finish)
    } else {
        let (content, calls) = tools::parse(mode, &text);
        let calls = tools::message_calls(calls);
        let finish = tools::finish_reason(mode, !calls.is_empty(), finish);
        (content, calls, finish)
    };
    let message = AssistantMessage {
        role: "assistant",
        content,
        reasoning_content: job.reasoning.is_some().then_some(reasoning),
        tool_calls,
    };
    (message, finish)
}
