//! `POST /v1/completions`.

use crate::admission::*;
use crate::error::ApiError;
use crate::protocol::CompletionRequest;
use crate::response::*;
use crate::streaming::*;
use crate::tools::ToolMode;
use crate::{protocol, AppState};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use std::sync::atomic::Ordering;
use std::sync::Arc;

pub(crate) async fn completions(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = protocol::parse(&body, protocol::COMPLETION_FIELDS)?;
    check_model(&state, &req.model)?;
    let engine = state.engine()?;
    check_generates(engine, "/v1/completions")?;
    if req.best_of.is_some_and(|b| b > 1) {
        return Err(ApiError::bad_request("`best_of` is not supported").with_param("best_of"));
    }
    if req.suffix.is_some() {
        return Err(ApiError::bad_request("`suffix` is not supported").with_param("suffix"));
    }
    let tok = engine.tokenizer();
    let prompts = req.prompt.into_token_ids(tok)?;
    if prompts.is_empty() {
        return Err(ApiError::bad_request("`prompt` is empty").with_param("prompt"));
    }
    let (mut params, constraint_field) = req.sampling.to_params(req.logprobs)?;
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
        reasoning: None,
    };
    let subs = submit(&state, prompts, &params, constraint_field).await?;
    if req.stream.unwrap_or(false) {
        Ok(stream_job(state, job, subs).into_response())
    } else {
        Ok(collect(state, job, subs).await?.into_response())
    }
}
