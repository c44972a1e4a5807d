//! Incremental detokenization: text deltas that never split a UTF-8 character and whose
//! concatenation equals the decode of all output tokens.

use anyhow::Result;
use ingot_model::Tokenizer;

/// Prompt tokens decoded as left context, so that tokenizers whose pieces depend on what
/// precedes them (leading spaces) produce the right first delta.
const CONTEXT: usize = 5;

pub struct Detokenizer {
    ids: Vec<u32>,
    /// `ids[prefix..read]` is the text already emitted (kept as decode context).
    prefix: usize,
    read: usize,
    skip_special_tokens: bool,
}

impl Detokenizer {
    pub fn new(prompt: &[u32], skip_special_tokens: bool) -> Detokenizer {
        let ctx = prompt[prompt.len().saturating_sub(CONTEXT)..].to_vec();
        let n = ctx.len();
        Detokenizer {
            ids: ctx,
            prefix: 0,
            read: n,
            skip_special_tokens,
        }
    }

    /// Adds a token and returns the text it completes (possibly empty while a multi-byte
    /// character is still incomplete).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let now = tok.decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        if now.len() > before.len()
            && !now.ends_with('\u{FFFD}')
            && now.is_char_boundary(before.len())
            && now.starts_with(&before)
        {
            let delta = now[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            return Ok(delta);
        }
        Ok(String::new())
    }

    /// Text still held back at the end of the sequence (an incomplete character).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        let before = tok.decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let now = tok.decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(now.get(before.len()..).unwrap_or_default().to_string())
    }
}
