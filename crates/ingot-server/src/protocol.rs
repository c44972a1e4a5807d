//! The OpenAI wire protocol: request bodies with vLLM's extra sampling fields (unknown
//! fields are rejected by name; fields ingot knows but does not implement are rejected in
//! `validate`), and the response bodies and streamed chunks the server sends back.

use ingot_core::{SamplingParams, StructuredOutput};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};

use crate::error::ApiError;

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

impl Prompt {
    /// The token ids of each prompt: texts encoded with the tokenizer's special tokens,
    /// ids as given.
    pub fn into_token_ids(self, tok: &ingot_model::Tokenizer) -> Result<Vec<Vec<u32>>, ApiError> {
        let encode = |t: &str| {
            tok.encode(t, true)
                .map_err(|e| ApiError::bad_request(e.to_string()))
        };
        match self {
            Prompt::Text(t) => Ok(vec![encode(&t)?]),
            Prompt::Texts(ts) => ts.iter().map(|t| encode(t)).collect(),
            Prompt::Tokens(ids) => Ok(vec![ids]),
            Prompt::TokenLists(lists) => Ok(lists),
        }
    }
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
    /// OpenAI's output format: `text`, `json_object` or `json_schema`.
    pub response_format: Option<ResponseFormat>,
    /// vLLM's constraints: one of `json`, `regex`, `choice`, `grammar`, `json_object`.
    pub structured_outputs: Option<StructuredOutputs>,
    /// vLLM's older names of the same constraints.
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
    pub json_schema: Option<JsonSchemaFormat>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    pub name: Option<String>,
    pub description: Option<String>,
    pub schema: Option<Value>,
    /// OpenAI's promise that the output follows the schema exactly; ingot always
    /// enforces it.
    pub strict: Option<bool>,
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct StructuredOutputs {
    /// A JSON schema, as an object or as its JSON text.
    pub json: Option<Value>,
    pub regex: Option<String>,
    pub choice: Option<Vec<String>>,
    /// A grammar in llguidance's Lark syntax.
    pub grammar: Option<String>,
    pub json_object: Option<bool>,
}

/// A JSON schema given as an object, or as a string holding one (its shape is checked where
/// it compiles).
fn schema(value: &Value, field: &str) -> Result<Value, ApiError> {
    let schema = match value {
        Value::String(text) => serde_json::from_str(text).map_err(|e| {
            ApiError::bad_request(format!("`{field}` is not valid JSON: {e}")).with_param(field)
        })?,
        v => v.clone(),
    };
    Ok(schema)
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
    /// Read from the same body by [`parse`].
    #[serde(skip)]
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
    /// An assistant message's calls.
    pub tool_calls: Option<Vec<ToolCall>>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct ToolCall {
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub function: CalledFunction,
}

#[derive(Deserialize, Debug)]
pub struct CalledFunction {
    pub name: String,
    /// JSON text, as OpenAI sends it.
    pub arguments: String,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDef,
}

#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct FunctionDef {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `none`, `auto`, `required`, or `{"type": "function", "function": {"name"}}`.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    Named(NamedToolChoice),
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct NamedToolChoice {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: NamedFunction,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct NamedFunction {
    pub name: String,
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
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<ToolChoice>,
    pub parallel_tool_calls: Option<bool>,
    pub user: Option<String>,
    /// Read from the same body by [`parse`].
    #[serde(skip)]
    pub sampling: Sampling,
}

impl Sampling {
    /// The output constraint the request asks for, in any of its spellings (at most one),
    /// with the field that gave it.
    pub fn structured(&self) -> Result<Option<(&'static str, StructuredOutput)>, ApiError> {
        let mut found: Vec<(&'static str, StructuredOutput)> = vec![];
        if let Some(f) = &self.response_format {
            match f.kind.as_str() {
                "text" => {}
                "json_object" => found.push(("response_format", StructuredOutput::JsonObject)),
                "json_schema" => {
                    let s = f.json_schema.as_ref().and_then(|j| j.schema.as_ref()).ok_or_else(|| {
                        ApiError::bad_request("response_format `json_schema` needs `json_schema.schema`")
                            .with_param("response_format")
                    })?;
                    let s = schema(s, "response_format")?;
                    found.push(("response_format", StructuredOutput::JsonSchema(s)));
                }
                other => {
                    return Err(ApiError::bad_request(format!(
                        "response_format `{other}` is not supported (`text`, `json_object` or `json_schema`)"
                    ))
                    .with_param("response_format"))
                }
            }
        }
        if let Some(so) = &self.structured_outputs {
            let f = "structured_outputs";
            if let Some(j) = &so.json {
                found.push((f, StructuredOutput::JsonSchema(schema(j, f)?)));
            }
            if let Some(r) = &so.regex {
                found.push((f, StructuredOutput::Regex(r.clone())));
            }
            if let Some(c) = &so.choice {
                found.push((f, StructuredOutput::Choice(c.clone())));
            }
            if let Some(g) = &so.grammar {
                found.push((f, StructuredOutput::Grammar(g.clone())));
            }
            if so.json_object == Some(true) {
                found.push((f, StructuredOutput::JsonObject));
            }
        }
        if let Some(j) = &self.guided_json {
            found.push((
                "guided_json",
                StructuredOutput::JsonSchema(schema(j, "guided_json")?),
            ));
        }
        if let Some(r) = &self.guided_regex {
            found.push(("guided_regex", StructuredOutput::Regex(r.clone())));
        }
        if let Some(c) = &self.guided_choice {
            found.push(("guided_choice", StructuredOutput::Choice(c.clone())));
        }
        if let Some(g) = &self.guided_grammar {
            found.push(("guided_grammar", StructuredOutput::Grammar(g.clone())));
        }
        if found.len() > 1 {
            let names: Vec<&str> = found.iter().map(|(f, _)| *f).collect();
            return Err(ApiError::bad_request(format!(
                "a request takes one output constraint, got several: {}",
                names.join(", ")
            ))
            .with_param(found[1].0));
        }
        Ok(found.pop())
    }

    /// Engine parameters, and the field their output constraint came from (for errors
    /// about it); `max_tokens` is filled in by the caller.
    pub fn to_params(
        &self,
        logprobs: Option<usize>,
    ) -> Result<(SamplingParams, Option<&'static str>), ApiError> {
        let (constraint_field, structured) = self.structured()?.unzip();
        let d = SamplingParams::default();
        let mut logit_bias = HashMap::new();
        for (k, v) in self.logit_bias.iter().flatten() {
            let id: u32 = k.parse().map_err(|_| {
                ApiError::bad_request(format!("logit_bias key `{k}` is not a token id"))
                    .with_param("logit_bias")
            })?;
            logit_bias.insert(id, *v);
        }
        let params = SamplingParams {
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
            structured,
            ..d
        };
        Ok((params, constraint_field))
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
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
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
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "user",
];

/// Parses any JSON body; malformed JSON is a 400.
pub fn parse_json(body: &[u8]) -> Result<serde_json::Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))
}

/// A request type that carries the shared sampling fields of its body.
pub trait WithSampling: for<'de> Deserialize<'de> {
    fn sampling_mut(&mut self) -> &mut Sampling;
}

impl WithSampling for CompletionRequest {
    fn sampling_mut(&mut self) -> &mut Sampling {
        &mut self.sampling
    }
}

impl WithSampling for ChatRequest {
    fn sampling_mut(&mut self) -> &mut Sampling {
        &mut self.sampling
    }
}

/// Deserializes `value`; an error is a 400 naming the offending value by its path
/// (`response_format.json_schema.schema`), as OpenAI names nested params.
fn from_value<T: for<'de> Deserialize<'de>>(value: &serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let msg = e.inner().to_string();
        let param = if path != "." {
            Some(path)
        } else {
            msg.split('`').nth(1).map(String::from)
        };
        let mut err = ApiError::bad_request(format!("invalid request body: {msg}"));
        err.param = param;
        err
    })
}

/// Parses a JSON object body whose fields must be in `fields` or the sampling fields;
/// errors are 400s that name the field. The sampling fields are read on their own (not
/// flattened into `T`) so that errors inside them keep their path.
pub fn parse<T: WithSampling>(body: &[u8], fields: &[&str]) -> Result<T, ApiError> {
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
    let mut req: T = from_value(&value)?;
    *req.sampling_mut() = from_value(&value)?;
    Ok(req)
}

/// Token counts of a response (or, streamed, of the whole request).
#[derive(Serialize, Debug, Clone, Copy)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// A whole response or a streamed chunk: `choices` of the endpoint's kind.
#[derive(Serialize, Debug)]
pub struct Response<C> {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<C>,
    /// Always in a whole response; in a stream, only in the last chunk and where asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// A `/v1/completions` choice, whole or streamed.
#[derive(Serialize, Debug)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// Completions' logprobs: per token its text, its logprob and the most likely tokens'.
#[derive(Serialize, Debug)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<BTreeMap<String, f32>>,
}

/// A whole `/v1/chat/completions` choice.
#[derive(Serialize, Debug)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// The answer of a whole chat response.
#[derive(Serialize, Debug)]
pub struct AssistantMessage {
    pub role: &'static str,
    pub content: Option<String>,
    /// With a reasoning parser: the thinking (`null` where there was none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<Option<String>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<MessageToolCall>,
}

#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct MessageToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: CalledFunctionOut,
}

/// A call's function: its name and its arguments as JSON text.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct CalledFunctionOut {
    pub name: String,
    pub arguments: String,
}

/// Chat logprobs: per token its text, bytes, logprob and the most likely tokens'.
#[derive(Serialize, Debug)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

#[derive(Serialize, Debug)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Serialize, Debug)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// A streamed chat choice: what its answer gained.
#[derive(Serialize, Debug)]
pub struct ChunkChoice {
    pub index: usize,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// What a streamed chunk adds to a chat answer; the role comes with the first.
#[derive(Serialize, Debug, Default)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<DeltaToolCall>,
}

/// A streamed piece of a call: the id, type and name in its first, then arguments text.
#[derive(Serialize, Debug)]
pub struct DeltaToolCall {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: DeltaFunction,
}

#[derive(Serialize, Debug)]
pub struct DeltaFunction {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// `/v1/models`: the one model this server serves.
#[derive(Serialize, Debug)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Serialize, Debug)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: usize,
}

/// `/tokenize`'s answer.
#[derive(Serialize, Debug)]
pub struct Tokenized {
    pub tokens: Vec<u32>,
    pub count: usize,
    pub max_model_len: usize,
}

/// `/detokenize`'s answer.
#[derive(Serialize, Debug)]
pub struct Detokenized {
    pub prompt: String,
}

/// `/version`'s answer.
#[derive(Serialize, Debug)]
pub struct Version {
    pub version: &'static str,
}

/// An error in OpenAI's shape, as a response body or a streamed event.
#[derive(Serialize, Debug)]
pub struct ErrorResponse {
    pub error: ErrorBody,
}

#[derive(Serialize, Debug)]
pub struct ErrorBody {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: u16,
}

/// `POST /v1/embeddings`: OpenAI's body (`user` is accepted and not used).
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingRequest {
    pub model: Option<String>,
    pub input: Prompt,
    #[serde(default)]
    pub encoding_format: EncodingFormat,
    pub dimensions: Option<usize>,
    pub user: Option<String>,
}

#[derive(Deserialize, Debug, Default, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum EncodingFormat {
    #[default]
    Float,
    /// The little-endian f32 bytes, base64-encoded.
    Base64,
}

#[derive(Serialize, Debug)]
pub struct EmbeddingResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub data: Vec<EmbeddingData>,
    pub usage: EmbeddingUsage,
}

#[derive(Serialize, Debug)]
pub struct EmbeddingData {
    pub object: &'static str,
    pub index: usize,
    pub embedding: EmbeddingVector,
}

#[derive(Serialize, Debug)]
#[serde(untagged)]
pub enum EmbeddingVector {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Serialize, Debug)]
pub struct EmbeddingUsage {
    pub prompt_tokens: usize,
    pub total_tokens: usize,
}

/// Parses a JSON body into `T`, whose own `deny_unknown_fields` refuses unknown fields;
/// errors are 400s that name the field.
pub fn parse_body<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    let value = parse_json(body)?;
    if !value.is_object() {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    from_value(&value)
}
