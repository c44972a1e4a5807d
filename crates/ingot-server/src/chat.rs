//! `POST /v1/chat/completions`: messages through the chat template, tools and their
//! choice, structured output.

use crate::admission::*;
use crate::error::ApiError;
use crate::protocol::{ChatRequest, Content};
use crate::response::*;
use crate::streaming::*;
use crate::tools::{self, ToolMode, ToolParser};
use crate::{protocol, AppState};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use ingot_model::chat::Message;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;

pub(crate) fn message_text(content: &Option<Content>) -> Result<String, ApiError> {
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

pub(crate) async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: ChatRequest = protocol::parse(&body, protocol::CHAT_FIELDS)?;
    check_model(&state, &req.model)?;
    let engine = state.engine()?;
    check_generates(engine, "/v1/chat/completions")?;
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
    let (mut params, mut constraint_field) = req.sampling.to_params(top)?;
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
    // A constraint starts where the thinking ends.
    params.reasoning = state.config.reasoning_parser.map(|p| p.markers());
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
        reasoning: state.config.reasoning_parser,
    };
    let subs = submit(&state, vec![prompt], &params, constraint_field).await?;
    if req.stream.unwrap_or(false) {
        Ok(stream_job(state, job, subs).into_response())
    } else {
        Ok(collect(state, job, subs).await?.into_response())
    }
}
