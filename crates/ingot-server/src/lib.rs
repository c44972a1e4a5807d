//! The OpenAI-compatible HTTP API: completions and chat completions (plain and streamed as
//! server-sent events), embeddings, models, health, version, metrics, tokenize and
//! detokenize; and a chat page at `/`.
//!
//! A request goes: `protocol` (the body, typed) → `completions` or `chat` (prompts and
//! sampling parameters; `tools` for tool calls) → `admission` (into the engine) → `response`
//! (a whole answer) or `streaming` (server-sent events), with `timing` feeding `metrics`.

mod admission;
mod chat;
mod chat_page;
mod completions;
mod embeddings;
pub mod error;
pub mod metrics;
pub mod protocol;
pub mod reasoning;
mod response;
mod streaming;
mod timing;
pub mod tool_stream;
pub mod tools;

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::protocol::{Detokenized, ModelCard, ModelList, Tokenized, Version};
use crate::tools::ToolParser;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ingot_engine::EngineHandle;
use serde_json::Value;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

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
    /// How a reasoning model's thinking is told from its answer (`--reasoning-parser`).
    pub reasoning_parser: Option<reasoning::ReasoningParser>,
}

pub struct AppState {
    /// Set once the model has loaded; until then the API answers 503.
    pub engine: OnceLock<EngineHandle>,
    pub config: ServerConfig,
    pub metrics: Arc<Metrics>,
    pub(crate) next_id: AtomicU64,
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
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/embeddings", post(embeddings::embeddings))
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

async fn version() -> Json<Version> {
    Json(Version {
        version: env!("CARGO_PKG_VERSION"),
    })
}

pub(crate) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn models(State(state): State<Arc<AppState>>) -> Result<Json<ModelList>, ApiError> {
    let engine = state.engine()?;
    Ok(Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: state.config.served_model_name.clone(),
            object: "model",
            created: now(),
            owned_by: "ingot",
            max_model_len: engine.max_model_len(),
        }],
    }))
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
) -> Result<Json<Tokenized>, ApiError> {
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
    Ok(Json(Tokenized {
        count: tokens.len(),
        tokens,
        max_model_len: engine.max_model_len(),
    }))
}

async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Detokenized>, ApiError> {
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
    Ok(Json(Detokenized { prompt: text }))
}
