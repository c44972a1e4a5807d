//! Admission: a request's prompts submitted to the engine all or none, and the client's
//! errors for what the engine refuses or fails.

use crate::error::ApiError;
use crate::timing::*;
use crate::{AppState, ServerConfig};
use axum::http::StatusCode;
use ingot_core::{AdmissionError, InvalidParam, SamplingParams};
use ingot_engine::{EngineHandle, Events, Failure, SubmitError};

pub(crate) fn check_model(state: &AppState, model: &Option<String>) -> Result<(), ApiError> {
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

/// Refuses text generation on a server that runs an embedding model.
pub(crate) fn check_generates(engine: &EngineHandle, endpoint: &str) -> Result<(), ApiError> {
    match engine.pooling() {
        Some(_) => Err(ApiError::bad_request(format!(
            "this server runs an embedding model (--task embed): {endpoint} needs a generating model; use /v1/embeddings"
        ))),
        None => Ok(()),
    }
}

pub(crate) fn context_error(max_model_len: usize, prompt: usize) -> ApiError {
    ApiError::bad_request(format!(
        "This model's maximum context length is {max_model_len} tokens. However, your request has {prompt} input tokens. Please reduce the length of the input."
    ))
}

/// One submitted prompt: its index among the request's prompts and its output channel.
pub(crate) struct Submitted {
    pub(crate) prompt_index: usize,
    pub(crate) prompt: Vec<u32>,
    pub(crate) events: Events,
    /// Started when the prompt was submitted.
    pub(crate) timing: Timing,
}

/// The client's error for a request the engine did not take.
pub(crate) fn submit_error(e: SubmitError) -> ApiError {
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

pub(crate) fn failure_error(f: Failure) -> ApiError {
    let status = match f {
        Failure::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
        Failure::Step(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    ApiError::new(status, f.to_string())
}

/// Bounds what one request may multiply: its samples and its prompts.
pub(crate) fn check_request_size(
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
pub(crate) async fn submit(
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
