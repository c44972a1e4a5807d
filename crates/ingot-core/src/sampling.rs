//! Per-request sampling parameters, validated on admission: an invalid value is an error
//! that names its field.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 is greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 or -1 keeps all.
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    /// HF-style: logits of tokens already in the prompt or output are divided (if positive)
    /// or multiplied (if negative) by this.
    pub repetition_penalty: f32,
    /// OpenAI-style, over output tokens: subtract `presence_penalty` once and
    /// `frequency_penalty` per occurrence.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub logit_bias: HashMap<u32, f32>,
    /// Seeds this request's own random stream: the same seed gives the same tokens whatever
    /// else is batched.
    pub seed: Option<u64>,
    pub max_tokens: usize,
    pub min_tokens: usize,
    /// Generation ends before the first occurrence of any of these (not included in the text).
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Return this many most likely tokens' logprobs per step (with the chosen one's).
    pub logprobs: Option<usize>,
    /// Independent samples of the prompt, sharing its cached blocks.
    pub n: usize,
    pub skip_special_tokens: bool,
    /// A constraint every generated token must keep satisfiable (JSON schema, regex,
    /// choice or grammar); the engine masks what it forbids.
    pub structured: Option<StructuredOutput>,
    /// The model reasons between these markers first: `structured` applies only once the
    /// reasoning has ended.
    pub reasoning: Option<ReasoningMarkers>,
}

/// A reasoning section's markers, as text (`<think>`, `</think>`). The section is over once
/// the output has the end marker, or from the start where the prompt's last end marker
/// comes after its last start marker (a template that closed it, as Qwen3's with thinking
/// off).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReasoningMarkers {
    pub start: String,
    pub end: String,
}

/// What the output must match, as a request states it; compiled by the engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StructuredOutput {
    /// A JSON value valid under this JSON schema.
    JsonSchema(serde_json::Value),
    /// Any JSON object.
    JsonObject,
    /// Text the whole of which matches this regular expression.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A context-free grammar in llguidance's Lark syntax.
    Grammar(String),
}

impl StructuredOutput {
    /// The request field a problem with this constraint is reported against.
    pub fn field(&self) -> &'static str {
        match self {
            StructuredOutput::JsonSchema(_) | StructuredOutput::JsonObject => "response_format",
            _ => "structured_outputs",
        }
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: HashMap::new(),
            seed: None,
            max_tokens: 16,
            min_tokens: 0,
            stop: vec![],
            stop_token_ids: vec![],
            ignore_eos: false,
            logprobs: None,
            n: 1,
            skip_special_tokens: true,
            structured: None,
            reasoning: None,
        }
    }
}

/// Most logprobs one step may return.
pub const MAX_LOGPROBS: usize = 20;
/// Stop strings one request may give: each is searched for after every token.
pub const MAX_STOP_STRINGS: usize = 64;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;
/// Most `stop_token_ids` entries.
pub const MAX_STOP_TOKEN_IDS: usize = 1024;
/// Most `logit_bias` entries: each is applied to every sampled row.
pub const MAX_LOGIT_BIAS: usize = 1024;

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("invalid `{field}`: {message}")]
pub struct InvalidParam {
    pub field: &'static str,
    pub message: String,
}

fn check(
    ok: bool,
    field: &'static str,
    message: impl FnOnce() -> String,
) -> Result<(), InvalidParam> {
    if ok {
        Ok(())
    } else {
        Err(InvalidParam {
            field,
            message: message(),
        })
    }
}

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            max_tokens,
            ..Default::default()
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    pub fn validate(&self, vocab_size: usize) -> Result<(), InvalidParam> {
        let t = self.temperature;
        check(t.is_finite() && t >= 0.0, "temperature", || {
            format!("must be a finite number >= 0, got {t}")
        })?;
        check(self.top_k >= -1, "top_k", || {
            format!(
                "must be -1, 0 (all) or a positive count, got {}",
                self.top_k
            )
        })?;
        check(self.top_p > 0.0 && self.top_p <= 1.0, "top_p", || {
            format!("must be in (0, 1], got {}", self.top_p)
        })?;
        check((0.0..=1.0).contains(&self.min_p), "min_p", || {
            format!("must be in [0, 1], got {}", self.min_p)
        })?;
        check(
            self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0,
            "repetition_penalty",
            || format!("must be > 0, got {}", self.repetition_penalty),
        )?;
        check(
            (-2.0..=2.0).contains(&self.presence_penalty),
            "presence_penalty",
            || format!("must be in [-2, 2], got {}", self.presence_penalty),
        )?;
        check(
            (-2.0..=2.0).contains(&self.frequency_penalty),
            "frequency_penalty",
            || format!("must be in [-2, 2], got {}", self.frequency_penalty),
        )?;
        check(
            self.logit_bias.len() <= MAX_LOGIT_BIAS,
            "logit_bias",
            || {
                format!(
                    "at most {MAX_LOGIT_BIAS} entries, got {}",
                    self.logit_bias.len()
                )
            },
        )?;
        for (&id, &bias) in &self.logit_bias {
            check((id as usize) < vocab_size, "logit_bias", || {
                format!("token id {id} is outside the vocabulary of {vocab_size}")
            })?;
            check((-100.0..=100.0).contains(&bias), "logit_bias", || {
                format!("bias {bias} for token {id} is outside [-100, 100]")
            })?;
        }
        check(self.max_tokens >= 1, "max_tokens", || {
            "must be at least 1".into()
        })?;
        check(self.min_tokens <= self.max_tokens, "min_tokens", || {
            format!("{} exceeds max_tokens {}", self.min_tokens, self.max_tokens)
        })?;
        check(self.stop.len() <= MAX_STOP_STRINGS, "stop", || {
            format!(
                "at most {MAX_STOP_STRINGS} stop strings, got {}",
                self.stop.len()
            )
        })?;
        check(self.stop.iter().all(|s| !s.is_empty()), "stop", || {
            "stop strings must not be empty".into()
        })?;
        let longest = self.stop.iter().map(String::len).max().unwrap_or(0);
        check(longest <= MAX_STOP_BYTES, "stop", || {
            format!("a stop string is at most {MAX_STOP_BYTES} bytes, got {longest}")
        })?;
        check(
            self.stop_token_ids.len() <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            || {
                format!(
                    "at most {MAX_STOP_TOKEN_IDS} entries, got {}",
                    self.stop_token_ids.len()
                )
            },
        )?;
        for &id in &self.stop_token_ids {
            check((id as usize) < vocab_size, "stop_token_ids", || {
                format!("token id {id} is outside the vocabulary of {vocab_size}")
            })?;
        }
        if let Some(k) = self.logprobs {
            check(k <= MAX_LOGPROBS, "logprobs", || {
                format!("at most {MAX_LOGPROBS}, got {k}")
            })?;
        }
        check(self.n >= 1, "n", || "must be at least 1".into())?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_values_name_their_field() {
        let bad = [
            SamplingParams {
                temperature: -0.5,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                top_k: -2,
                ..Default::default()
            },
            SamplingParams {
                min_p: 1.5,
                ..Default::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            SamplingParams {
                presence_penalty: 3.0,
                ..Default::default()
            },
            SamplingParams {
                frequency_penalty: -3.0,
                ..Default::default()
            },
            SamplingParams {
                logit_bias: [(5000, 1.0)].into(),
                ..Default::default()
            },
            SamplingParams {
                logit_bias: (0..=MAX_LOGIT_BIAS as u32).map(|t| (t, 1.0)).collect(),
                ..Default::default()
            },
            SamplingParams {
                max_tokens: 0,
                ..Default::default()
            },
            SamplingParams {
                min_tokens: 20,
                max_tokens: 10,
                ..Default::default()
            },
            SamplingParams {
                stop: vec!["".into()],
                ..Default::default()
            },
            SamplingParams {
                stop: vec!["x".into(); MAX_STOP_STRINGS + 1],
                ..Default::default()
            },
            SamplingParams {
                stop: vec!["x".repeat(MAX_STOP_BYTES + 1)],
                ..Default::default()
            },
            SamplingParams {
                stop_token_ids: vec![5000],
                ..Default::default()
            },
            SamplingParams {
                stop_token_ids: vec![1; MAX_STOP_TOKEN_IDS + 1],
                ..Default::default()
            },
            SamplingParams {
                logprobs: Some(21),
                ..Default::default()
            },
            SamplingParams {
                n: 0,
                ..Default::default()
            },
        ];
        let fields = [
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "logit_bias",
            "max_tokens",
            "min_tokens",
            "stop",
            "stop",
            "stop",
            "stop_token_ids",
            "stop_token_ids",
            "logprobs",
            "n",
        ];
        for (p, f) in bad.iter().zip(fields) {
            let e = p.validate(2000).unwrap_err();
            assert_eq!(e.field, f, "{e}");
            assert!(e.to_string().contains(f));
        }
        assert!(SamplingParams::default().validate(100).is_ok());
    }
}
