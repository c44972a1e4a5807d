//! Structured output: a request's constraint (JSON schema, regex, choice or Lark grammar)
//! compiled by llguidance, and one matcher per sequence that gives the tokens allowed next
//! as a bitmask and advances with every token the sequence accepts.

use anyhow::{anyhow, Result};
use ingot_core::{InvalidParam, StructuredOutput};
use ingot_model::Tokenizer;
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::earley::SlicedBiasComputer;
use llguidance::toktrie::{InferenceCapabilities, SimpleVob};
use llguidance::{Matcher, ParserFactory, TokenParser};
use lru::LruCache;
use serde_json::json;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Bounds on what one constraint may cost, so that a request can neither hang a step nor
/// take the server's memory. A grammar past the build limits is refused at admission; a
/// token mask past its fuel ends the sequence with an error.
fn limits() -> ParserLimits {
    ParserLimits {
        // llguidance's defaults for the grammar size (a few MB of JSON schema), the
        // lexer-building fuel (~20 ms) and a mask's lexer fuel (~15 ms) and Earley items
        // (~2.5 ms).
        // Lexer states cost 1–2 kB each: 50,000 bound a request to ~100 MB where the
        // default 250,000 would allow ~500 MB.
        max_lexer_states: 50_000,
        // A grammar's text is part of the request, not something to echo in errors.
        verbose_errors: false,
        ..ParserLimits::default()
    }
}

/// The token slices llguidance precomputes, each the tokens a regex of JSON string contents
/// matches whole: its defaults (whitespace; up to 10 and 30 characters; any length) and,
/// beside them, up to 15 and 20 characters. A mask inside a string takes the largest slice
/// that fits what the string still allows at once and walks the token trie only for the
/// rest, so under a `maxLength` of 24 (the default slices past 10 ruled out) the walk went
/// from 4,191 to 1,139 trie nodes a mask and a mask from 24 to 12 µs (the records schema of
/// `bench/structured.sh`, 400 tokens, 2-core VM), the masks the same. Each slice costs
/// ~15 ms once, when the first constraint builds the trie.
fn slices() -> Vec<String> {
    let mut slices = SlicedBiasComputer::general_slices();
    slices.extend([15, 20].map(|n| format!(r#"[^"\\\x00-\x1F\x7F]{{1,{n}}}"#)));
    slices
}

/// How many distinct constraints stay compiled. Clients send the same few schemas (an app's
/// response type, an agent's tools) over and over; a compile costs 0.6–1.5 ms of CPU
/// against ~20 µs for a copy of the compiled parser. Each entry is an unstarted parser (its
/// grammar and an empty lexer cache), so 64 of them stay small beside the schemas' text.
const CACHED_GRAMMARS: usize = 64;

/// Compiles constraints against one tokenizer. The tokenizer's trie is built on the first
/// constraint, so a server that never sees one never pays for it.
#[derive(Clone)]
pub struct Grammars {
    tokenizer: Arc<Tokenizer>,
    vocab_size: usize,
    factory: Arc<OnceLock<Result<ParserFactory, String>>>,
    /// The last constraints compiled, by their request text (the serialized spec).
    compiled: Arc<Mutex<LruCache<String, Grammar>>>,
}

/// A compiled constraint, not yet started: each sequence starts its own copy of it.
#[derive(Clone)]
pub struct Grammar(Arc<TokenParser>);

impl Grammars {
    /// `vocab_size` is the model's (its logits rows), which may exceed the tokenizer's.
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize) -> Grammars {
        Grammars {
            tokenizer,
            vocab_size,
            factory: Arc::new(OnceLock::new()),
            compiled: Arc::new(Mutex::new(LruCache::new(
                NonZeroUsize::new(CACHED_GRAMMARS).expect("a non-zero capacity"),
            ))),
        }
    }

    fn factory(&self) -> Result<&ParserFactory> {
        self.factory
            .get_or_init(|| {
                let start = Instant::now();
                let f = self.build_factory(&slices()).map_err(|e| format!("{e:#}"));
                if f.is_ok() {
                    tracing::info!(
                        "structured output: token trie of {} tokens built in {:.0} ms",
                        self.vocab_size,
                        start.elapsed().as_secs_f64() * 1e3
                    );
                }
                f
            })
            .as_ref()
            .map_err(|e| anyhow!("structured output is not available for this tokenizer: {e}"))
    }

    fn build_factory(&self, slices: &[String]) -> Result<ParserFactory> {
        let json = self.tokenizer.to_json()?;
        let mut bytes = toktrie_hf_tokenizers::ByteTokenizer::from_json_bytes(json.as_bytes())?;
        let eos: Vec<u32> = self
            .tokenizer
            .eos_token_ids
            .iter()
            .copied()
            .filter(|&t| (t as usize) < self.tokenizer.vocab_size())
            .collect();
        if !eos.is_empty() {
            bytes.set_eos_tokens(&eos);
        }
        let env = bytes.into_tok_env(Some(self.vocab_size))?;
        let mut factory = ParserFactory::new(&env, InferenceCapabilities::default(), slices)?;
        factory.quiet();
        *factory.limits_mut() = limits();
        Ok(factory)
    }

    /// Compiles `spec`, or finds it compiled already; a constraint that does not compile is
    /// an error naming the request field it came from (and is compiled again if sent again,
    /// within the same limits).
    pub fn compile(&self, spec: &StructuredOutput) -> Result<Grammar> {
        let key = serde_json::to_string(spec)?;
        if let Some(g) = self.cache().get(&key) {
            return Ok(g.clone());
        }
        // Compiled outside the lock: a miss must not hold up the hits of other requests. Two
        // requests that miss at once both compile, and the second's copy replaces the first.
        let grammar = self.compile_new(spec)?;
        self.cache().put(key, grammar.clone());
        Ok(grammar)
    }

    /// How many distinct constraints are compiled and kept.
    pub fn num_cached(&self) -> usize {
        self.cache().len()
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, LruCache<String, Grammar>> {
        // The cache holds no invariant a panicking holder could break.
        self.compiled.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn compile_new(&self, spec: &StructuredOutput) -> Result<Grammar> {
        let invalid = |message: String| InvalidParam {
            field: spec.field(),
            message,
        };
        let top = match spec {
            StructuredOutput::JsonSchema(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(invalid("the JSON schema must be an object".into()).into());
                }
                TopLevelGrammar::from_json_schema(schema.clone())
            }
            StructuredOutput::JsonObject => {
                TopLevelGrammar::from_json_schema(json!({"type": "object"}))
            }
            StructuredOutput::Regex(rx) => TopLevelGrammar::from_regex(rx),
            StructuredOutput::Choice(choices) if choices.is_empty() => {
                return Err(invalid("`choice` must list at least one string".into()).into());
            }
            StructuredOutput::Choice(choices) => {
                let alternatives: Vec<String> = choices
                    .iter()
                    .map(|c| serde_json::Value::from(c.as_str()).to_string())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
            StructuredOutput::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        let parser = self
            .factory()?
            .create_parser(top)
            .map_err(|e| invalid(format!("the constraint does not compile: {e}")))?;
        Ok(Grammar(Arc::new(parser)))
    }

    /// The grammar `params` ask for, if any.
    pub fn compile_for(&self, spec: Option<&StructuredOutput>) -> Result<Option<Grammar>> {
        spec.map(|s| self.compile(s)).transpose()
    }
}

/// One sequence's constraint: where its output stands in the grammar, and the mask of the
/// tokens allowed next once computed.
pub struct Constraint {
    /// Boxed: constraints move to the worker threads and back every step, and a matcher is
    /// 1.5 kB, which hundreds of rows would copy each time.
    matcher: Box<Matcher>,
    /// The next token's allowed set, or why it could not be computed.
    mask: Option<Result<SimpleVob, String>>,
    /// While the model reasons: the end marker's token ids, and the output's last tokens
    /// to match them against. The grammar starts after the marker.
    reasoning: Option<(Vec<u32>, Vec<u32>)>,
}

impl Constraint {
    pub fn new(grammar: &Grammar) -> Constraint {
        Constraint {
            // A deep copy: a plain clone shares the lexer's cache behind one mutex with every
            // other clone, and sequences of one schema would then take their masks in turn.
            matcher: Box::new(Matcher::new(Ok(grammar.0.deep_clone()))),
            mask: None,
            reasoning: None,
        }
    }

    /// A constraint that starts once the output has the tokens `end` (the end of a
    /// reasoning section); before, every token is allowed.
    pub fn after(grammar: &Grammar, end: Vec<u32>) -> Constraint {
        Constraint {
            reasoning: (!end.is_empty()).then_some((end, vec![])),
            ..Constraint::new(grammar)
        }
    }

    /// Whether the grammar constrains the next token (the reasoning, if any, is over).
    pub fn is_active(&self) -> bool {
        self.reasoning.is_none()
    }

    /// Whether the next token's mask is computed (or failed).
    pub fn has_mask(&self) -> bool {
        self.mask.is_some()
    }

    /// Computes the mask of the next token; returns the time it took.
    pub fn compute_mask(&mut self) -> Duration {
        if !self.is_active() {
            return Duration::ZERO;
        }
        let start = Instant::now();
        self.mask = Some(self.matcher.compute_mask().map_err(|e| e.to_string()));
        start.elapsed()
    }

    /// The next token's bitmask (bit `t % 32` of word `t / 32` allows token `t`), or `None`
    /// while the model reasons and every token is allowed. Errors if the mask failed (a
    /// grammar past its fuel, or in an error state) or was not computed.
    pub fn allowed(&self) -> Result<Option<&[u32]>> {
        if !self.is_active() {
            return Ok(None);
        }
        match &self.mask {
            Some(Ok(m)) => Ok(Some(m.as_slice())),
            Some(Err(e)) => Err(anyhow!("structured output failed: {e}")),
            None => Err(anyhow!("structured output: no mask for this step")),
        }
    }

    /// Copies the next token's bitmask into `row` (zero past the mask's end) where it is
    /// computed; returns whether it was.
    pub fn write_mask(&self, row: &mut [u32]) -> bool {
        let Ok(Some(mask)) = self.allowed() else {
            return false;
        };
        let n = mask.len().min(row.len());
        row[..n].copy_from_slice(&mask[..n]);
        row[n..].fill(0);
        true
    }

    /// Sets the logits of forbidden tokens to −∞; errors as [`allowed`](Self::allowed).
    pub fn apply(&self, logits: &mut [f32]) -> Result<()> {
        if let Some(mask) = self.allowed()? {
            ingot_backend::sampling::apply_mask(logits, mask);
        }
        Ok(())
    }

    /// Advances past an accepted token; `Ok(true)` when the grammar is complete and allows
    /// nothing more.
    pub fn accept(&mut self, token: u32) -> Result<bool> {
        if let Some((end, tail)) = &mut self.reasoning {
            tail.push(token);
            if tail.len() > end.len() {
                tail.remove(0);
            }
            if tail == end {
                self.reasoning = None;
            }
            return Ok(false);
        }
        self.mask = None;
        self.matcher
            .consume_token(token)
            .map_err(|e| anyhow!("structured output rejected token {token}: {e}"))?;
        Ok(self.matcher.is_stopped())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ingot_model::testing::test_model_path;

    /// The slices beside llguidance's defaults change how a mask is computed, not the mask:
    /// along a JSON text under a schema with bounded strings, every mask equals the one
    /// computed with the default slices alone.
    #[test]
    fn extra_slices_give_the_default_slices_masks() {
        let Some(path) = test_model_path() else {
            return;
        };
        let g = Grammars::new(Arc::new(Tokenizer::open(&path).unwrap()), 49152);
        let schema = json!({
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 24},
                               "note": {"type": "string", "minLength": 3, "maxLength": 100}},
                "required": ["name", "note"]
            }
        });
        let text = r#"[{"name": "The quick brown fox jump", "note": "a longer note, of words and 42 digits \"quoted\" and more words to fill"}, {"name": "x", "note": "abc"}]"#;
        let tokens = g.tokenizer.encode(text, false).unwrap();
        let mut walks: Vec<Matcher> = [slices(), SlicedBiasComputer::general_slices()]
            .iter()
            .map(|s| {
                let f = g.build_factory(s).unwrap();
                let top = TopLevelGrammar::from_json_schema(schema.clone());
                Matcher::new(Ok(f.create_parser(top).unwrap()))
            })
            .collect();
        for &t in &tokens {
            let masks: Vec<SimpleVob> = walks
                .iter_mut()
                .map(|m| m.compute_mask().unwrap())
                .collect();
            assert!(
                masks[0].as_slice() == masks[1].as_slice(),
                "the masks before token {t} differ"
            );
            for m in &mut walks {
                m.consume_token(t).unwrap();
            }
        }
    }
}
