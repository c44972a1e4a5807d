//! OpenAI request bodies with vLLM's extra sampling fields. Unknown fields are rejected
//! by name; fields ingot knows but does not implement are rejected in `validate`.

use ingot_core::SamplingParams;
use serde::Deserialize;
use std::collections::HashMap;

use crate::error::ApiError;

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    #[serde(default)]
    pub continuous_usage_stats: bool,
}

/// Sampling fields shared by both endpoints.
#[derive(Deserialize, Debug, Default)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub n: Option<usize>,
    pub stop: Option<Stop>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub seed: Option<u64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<usize>,
    pub skip_special_tokens: Option<bool>,
}

#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub max_tokens: Option<usize>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<usize>,
    pub echo: Option<bool>,
    pub best_of: Option<usize>,
    pub suffix: Option<String>,
    /// An end-user id for the caller's own tracking; ingot does not use it.
    pub user: Option<String>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Content>,
    pub name: Option<String>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
}

#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<usize>,
    pub response_format: Option<ResponseFormat>,
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
    pub user: Option<String>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

impl Sampling {
    /// Engine parameters; `max_tokens` is filled in by the caller.
    pub fn to_params(&self, logprobs: Option<usize>) -> Result<SamplingParams, ApiError> {
        let d = SamplingParams::default();
        let mut logit_bias = HashMap::new();
        for (k, v) in self.logit_bias.iter().flatten() {
            let id: u32 = k.parse().map_err(|_| {
                ApiError::bad_request(format!("logit_bias key `{k}` is not a token id"))
                    .with_param("logit_bias")
            })?;
            logit_bias.insert(id, *v);
        }
        Ok(SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_p: self.top_p.unwrap_or(d.top_p),
            top_k: self.top_k.unwrap_or(d.top_k),
            min_p: self.min_p.unwrap_or(d.min_p),
            n: self.n.unwrap_or(1),
            stop: match &self.stop {
                None => vec![],
                Some(Stop::One(s)) => vec![s.clone()],
                Some(Stop::Many(v)) => v.clone(),
            },
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            seed: self.seed,
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            logit_bias,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            min_tokens: self.min_tokens.unwrap_or(0),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            logprobs,
            ..d
        })
    }
}

const SAMPLING_FIELDS: &[&str] = &[
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "stop_token_ids",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
];
pub const COMPLETION_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "max_tokens",
    "stream",
    "stream_options",
    "logprobs",
    "echo",
    "best_of",
    "suffix",
    "user",
];
pub const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "user",
];

/// Parses any JSON body; malformed JSON is a 400.
pub fn parse_json(body: &[u8]) -> Result<serde_json::Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))
}

/// Parses a JSON object body whose fields must be in `fields` or the sampling fields;
/// errors are 400s that name the field.
pub fn parse<T: for<'de> Deserialize<'de>>(body: &[u8], fields: &[&str]) -> Result<T, ApiError> {
    let value = parse_json(body)?;
    let obj = value
        .as_object()
        .ok_or_else(|| ApiError::bad_request("the body must be a JSON object"))?;
    if let Some(k) = obj
        .keys()
        .find(|k| !fields.contains(&k.as_str()) && !SAMPLING_FIELDS.contains(&k.as_str()))
    {
        return Err(ApiError::bad_request(format!(
            "unknown field `{k}`: ingot does not support it"
        ))
        .with_param(k));
    }
    serde_json::from_value(value).map_err(|e| {
        let msg = e.to_string();
        let param = msg.split('`').nth(1).map(String::from);
        let mut err = ApiError::bad_request(format!("invalid request body: {msg}"));
        err.param = param;
        err
    })
}
