//! `POST /v1/embeddings`: each input runs through the model to its last token and comes
//! back as its pooled vector.

use crate::admission::*;
use crate::error::ApiError;
use crate::protocol::{
    self, EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage, EmbeddingVector,
    EncodingFormat,
};
use crate::timing::Timing;
use crate::AppState;
use axum::body::Bytes;
use axum::extract::State;
use axum::Json;
use base64::Engine as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;

pub(crate) async fn embeddings(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<EmbeddingResponse>, ApiError> {
    let req: EmbeddingRequest = protocol::parse_body(&body)?;
    check_model(&state, &req.model)?;
    let engine = state.engine()?;
    if engine.pooling().is_none() {
        return Err(ApiError::bad_request(
            "this server generates text: /v1/embeddings needs an embedding model, served with --task embed",
        ));
    }
    let inputs = req.input.into_token_ids(engine.tokenizer())?;
    let bad_input = |msg: String| ApiError::bad_request(msg).with_param("input");
    if inputs.is_empty() {
        return Err(bad_input("`input` is empty".into()));
    }
    let limit = state.config.max_prompts_per_request;
    if inputs.len() > limit {
        return Err(bad_input(format!(
            "invalid `input`: at most {limit} inputs per request (--max-prompts-per-request), got {}",
            inputs.len()
        )));
    }
    for (i, input) in inputs.iter().enumerate() {
        if input.is_empty() {
            return Err(bad_input(format!("input {i} is empty")));
        }
        if input.len() > engine.max_model_len() {
            return Err(context_error(engine.max_model_len(), input.len()).with_param("input"));
        }
    }
    if let (Some(d), Some(pooling)) = (req.dimensions, engine.pooling()) {
        pooling
            .check_dimensions(d, engine.hidden_size())
            .map_err(|e| ApiError::bad_request(e.to_string()).with_param("dimensions"))?;
    }
    let id = format!("embd-{}", state.next_id.fetch_add(1, Ordering::Relaxed));
    let lens: Vec<usize> = inputs.iter().map(Vec::len).collect();
    let prompt_tokens = lens.iter().sum();
    let (_, mut events) = engine
        .embed_async(inputs, req.dimensions)
        .await
        .map_err(submit_error)?;
    let mut timings: Vec<Timing> = lens
        .iter()
        .map(|&n| {
            state.metrics.admitted(n);
            Timing::new(state.metrics.clone(), n, 1)
        })
        .collect();
    let mut vectors: Vec<Option<Vec<f32>>> = vec![None; lens.len()];
    while let Some(event) = events.recv().await {
        let mut d = event.map_err(failure_error)?;
        let i = d.index;
        vectors[i] = d.embedding.take();
        // Each input has its own clock, of one sample.
        d.index = 0;
        timings[i].token(&d);
    }
    let data = vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| {
            let v = v.ok_or_else(|| {
                ApiError::new(
                    axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                    format!("input {index} ended without its embedding"),
                )
            })?;
            let embedding = match req.encoding_format {
                EncodingFormat::Float => EmbeddingVector::Float(v),
                EncodingFormat::Base64 => EmbeddingVector::Base64(
                    base64::engine::general_purpose::STANDARD.encode(bytemuck::cast_slice(&v)),
                ),
            };
            Ok(EmbeddingData {
                object: "embedding",
                index,
                embedding,
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    tracing::info!(
        request = id,
        inputs = data.len(),
        prompt_tokens,
        "embeddings finished"
    );
    Ok(Json(EmbeddingResponse {
        id,
        object: "list",
        created: crate::now(),
        model: state.config.served_model_name.clone(),
        data,
        usage: EmbeddingUsage {
            prompt_tokens,
            total_tokens: prompt_tokens,
        },
    }))
}
