//! Structured output: a request's constraint (JSON schema, regex, choice or Lark grammar)
//! compiled by llguidance, and one parser per sequence that gives the tokens allowed next
//! as a bitmask and advances with every token the sequence accepts.

use anyhow::{anyhow, ensure, Result};
use ingot_core::{InvalidParam, StructuredOutput};
use ingot_model::Tokenizer;
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::earley::SlicedBiasComputer;
use llguidance::toktrie::{InferenceCapabilities, SimpleVob};
use llguidance::{panic_utils, ParserFactory, TokenParser};
use lru::LruCache;
use serde_json::json;
use std::num::NonZeroUsize;
use std::panic::AssertUnwindSafe;
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
/// grammar and an empty lexer cache) and, once a sequence of it has finished, a warm one
/// of at most [`WARM_LEXER_STATES`] lexer states (410 kB for the records schema).
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

/// The most lexer states a grammar's warm parser may hold (see [`Grammar`]). A state takes
/// 1–2 kB and every sequence of the grammar starts with a copy of them: the records schema
/// of `bench/structured.sh` meets 234 (410 kB), and 2,000 bound a copy to a few MB, far
/// inside the 50,000 of a sequence's own lexer, and the warm parsers of the cache's
/// [`CACHED_GRAMMARS`] to a few hundred MB at worst.
const WARM_LEXER_STATES: usize = 2_000;

/// A compiled constraint: each sequence starts its own copy of it.
///
/// llguidance's lexer is a DFA built lazily, state by state, as the masks' walks of the
/// token trie meet new states, and each sequence's parser has its own (shared, it would be
/// one lock for every sequence of the grammar). A fresh copy rebuilds what every earlier
/// sequence built, so the grammar keeps the lexer of the sequence that met the most states
/// so far, rewound to the grammar's start (`TokenParser::reset`), and new sequences copy
/// that. Over 128 tokens of the records schema a mask took 16.5 µs from the compiled parser
/// and 7.1 µs from a warm one on one thread of an H200 host; a CPU server's masks went from
/// 29–34 to 22–23 µs (docs/benchmarks.md, 2026-12-02).
#[derive(Clone)]
pub struct Grammar(Arc<Compiled>);

struct Compiled {
    /// The parser as compiled, not started.
    parser: TokenParser,
    /// A finished sequence's parser rewound to the start, and its lexer's states.
    warm: Mutex<Option<(usize, Arc<TokenParser>)>>,
}

impl Grammar {
    fn new(parser: TokenParser) -> Grammar {
        Grammar(Arc::new(Compiled {
            parser,
            warm: Mutex::new(None),
        }))
    }

    fn warm(&self) -> std::sync::MutexGuard<'_, Option<(usize, Arc<TokenParser>)>> {
        // A panicking holder leaves either the old parser or the new one, both whole.
        self.0.warm.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A parser at the grammar's start for one sequence: a deep copy (a plain clone shares
    /// the lexer behind one mutex with every other clone), of the warm parser if there is one.
    fn start(&self) -> TokenParser {
        let warm = self.warm().as_ref().map(|(_, p)| Arc::clone(p));
        let mut parser = match warm {
            Some(p) => p.deep_clone(),
            None => self.0.parser.deep_clone(),
        };
        if parser.is_fresh() {
            parser.start_without_prompt();
        }
        parser
    }

    /// Keeps a finished sequence's parser, rewound, as the warm one where its lexer has more
    /// states than the warm one's (it started from a copy of it, so it holds them all) and no
    /// more than [`WARM_LEXER_STATES`].
    fn offer(&self, mut parser: Box<TokenParser>) {
        let states = parser.parser.lexer_stats().num_states;
        let kept = self.warm().as_ref().map_or(0, |(n, _)| *n);
        if states <= kept || states > WARM_LEXER_STATES || parser.reset().is_err() {
            return;
        }
        let mut warm = self.warm();
        if warm.as_ref().is_none_or(|(n, _)| *n < states) {
            *warm = Some((states, Arc::from(parser)));
        }
    }
}

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
        Ok(Grammar::new(parser))
    }

    /// The grammar `params` ask for, if any.
    pub fn compile_for(&self, spec: Option<&StructuredOutput>) -> Result<Option<Grammar>> {
        spec.map(|s| self.compile(s)).transpose()
    }
}

/// One sequence's constraint: where its output stands in the grammar, and the mask of the
/// tokens allowed next once computed. Its parser hands its lexer back to the grammar when
/// the constraint is dropped ([`Grammar`]).
pub struct Constraint {
    grammar: Grammar,
    /// The sequence's parser, started with its first mask, on a worker thread (a copy of a
    /// warm lexer takes ~80 µs). Boxed: constraints move to the worker threads and back every
    /// step, and a parser is over 1 kB, which hundreds of rows would copy each time.
    parser: Option<Box<TokenParser>>,
    /// Why the parser failed, once it has: llguidance's parser is not to be used after an
    /// error.
    failed: Option<String>,
    /// The next token's allowed set, or why it could not be computed.
    mask: Option<Result<SimpleVob, String>>,
    /// While the model reasons: the end marker's token ids, and the output's last tokens
    /// to match them against. The grammar starts after the marker.
    reasoning: Option<(Vec<u32>, Vec<u32>)>,
}

impl Constraint {
    pub fn new(grammar: &Grammar) -> Constraint {
        Constraint {
            grammar: grammar.clone(),
            parser: None,
            failed: None,
            mask: None,
            reasoning: None,
        }
    }

    /// A constraint that starts once the output has the tokens `end` (the end of a
    /// reasoning section); before, every token is allowed.
    pub fn after(grammar: &Grammar, end: Vec<u32>) -> Constraint {
        let mut c = Constraint::new(grammar);
        c.reasoning = (!end.is_empty()).then_some((end, vec![]));
        c
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
        self.mask = Some(self.run(|p| p.compute_mask()));
        start.elapsed()
    }

    /// Runs `f` on the parser, started if it is not yet; an error or a panic in llguidance
    /// fails the constraint for good (as llguidance's `Matcher` does).
    fn run<T>(
        &mut self,
        f: impl FnOnce(&mut TokenParser) -> Result<T>,
    ) -> std::result::Result<T, String> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let parser = self
            .parser
            .get_or_insert_with(|| Box::new(self.grammar.start()));
        panic_utils::catch_unwind(AssertUnwindSafe(|| f(parser))).map_err(|e| {
            let e = parser.augment_err(e);
            self.failed = Some(e.clone());
            e
        })
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
        self.run(|p| {
            let backtrack = p.consume_token(token)?;
            ensure!(backtrack == 0, "the grammar backtracked");
            p.check_stop()?;
            Ok(p.stopped())
        })
        .map_err(|e| anyhow!("structured output rejected token {token}: {e}"))
    }
}

impl Drop for Constraint {
    fn drop(&mut self) {
        if self.failed.is_none() {
            if let Some(parser) = self.parser.take() {
                self.grammar.offer(parser);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ingot_model::testing::test_model_path;
    use llguidance::Matcher;

    /// The masks along `text` under `c`, and whether each token completed the grammar.
    fn walk(c: &mut Constraint, tokenizer: &Tokenizer, text: &str) -> Vec<(Vec<u32>, bool)> {
        let tokens = tokenizer.encode(text, false).unwrap();
        tokens
            .iter()
            .map(|&t| {
                c.compute_mask();
                let mask = c.allowed().unwrap().unwrap().to_vec();
                (mask, c.accept(t).unwrap())
            })
            .collect()
    }

    /// A sequence that starts from the lexer a finished one handed back gets the masks of a
    /// sequence that starts from the compiled parser, to the grammar's end.
    #[test]
    fn a_warm_parser_gives_the_masks_of_a_fresh_one() {
        let Some(path) = test_model_path() else {
            return;
        };
        let tokenizer = Arc::new(Tokenizer::open(&path).unwrap());
        let schema = StructuredOutput::JsonSchema(json!({
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                               "name": {"type": "string", "maxLength": 24},
                               "score": {"type": "number"}},
                "required": ["id", "name", "score"],
                "additionalProperties": false
            },
            "maxItems": 3
        }));
        let (warmed, fresh) = (
            Grammars::new(tokenizer.clone(), 49152),
            Grammars::new(tokenizer.clone(), 49152),
        );
        let grammar = warmed.compile(&schema).unwrap();
        let first = r#"[{"id": 41, "name": "Ada Lovelace", "score": 3.5}, {"id": 7, "name": "x", "score": -1e3}]"#;
        walk(&mut Constraint::new(&grammar), &tokenizer, first);
        let states = grammar.warm().as_ref().map(|(n, _)| *n);
        let cold = grammar.0.parser.parser.lexer_stats().num_states;
        assert!(
            states.is_some_and(|n| n > cold),
            "the finished sequence's lexer ({states:?} states) was not kept over the compiled one's {cold}"
        );
        let second = r#"[{"id": 99999, "name": "The quick brown fox jump", "score": 0}, {"id": 0, "name": "", "score": 12.25}, {"id": 5, "name": "tab\tquote\"", "score": 1}]"#;
        let from_warm = walk(&mut Constraint::new(&grammar), &tokenizer, second);
        let from_fresh = walk(
            &mut Constraint::new(&fresh.compile(&schema).unwrap()),
            &tokenizer,
            second,
        );
        assert_eq!(from_warm.len(), from_fresh.len());
        for (i, (w, f)) in from_warm.iter().zip(&from_fresh).enumerate() {
            assert!(w == f, "token {i}: the masks or the ends differ");
        }
        assert!(
            from_warm.last().unwrap().1,
            "the text completes the grammar"
        );
    }

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
