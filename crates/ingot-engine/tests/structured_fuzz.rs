//! Random regexes, JSON schemas and grammars through the constraint path, with the test
//! model's tokenizer: compiling either succeeds or names the request field, and a compiled
//! constraint then runs token by token (mask, pick an allowed token, accept) without a
//! panic and with every mask in bounded time.

use ingot_core::{InvalidParam, StructuredOutput};
use ingot_engine::structured::{Constraint, Grammars};
use ingot_model::testing::test_model_path;
use ingot_model::Tokenizer;
use proptest::prelude::*;
use serde_json::{json, Value};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// The test model's vocabulary.
const VOCAB: usize = 49152;

fn grammars() -> Option<&'static Grammars> {
    static G: OnceLock<Option<Grammars>> = OnceLock::new();
    G.get_or_init(|| {
        let tok = Tokenizer::open(&test_model_path()?).expect("the test model's tokenizer");
        Some(Grammars::new(Arc::new(tok), VOCAB))
    })
    .as_ref()
}

/// Compiles `spec` and, where it compiles, generates up to 24 tokens under it.
fn exercise(spec: StructuredOutput) -> Result<(), TestCaseError> {
    let Some(g) = grammars() else {
        return Ok(());
    };
    let grammar = match g.compile(&spec) {
        Ok(grammar) => grammar,
        Err(e) => {
            let p = e.downcast_ref::<InvalidParam>();
            prop_assert!(p.is_some(), "{spec:?}: an error that names no field: {e:#}");
            return Ok(());
        }
    };
    let mut c = Constraint::new(&grammar);
    for step in 0..24 {
        let took = c.compute_mask();
        prop_assert!(
            took < Duration::from_secs(1),
            "{spec:?}: a mask took {took:?}"
        );
        let mut logits = vec![0.0f32; VOCAB];
        if c.apply(&mut logits).is_err() {
            return Ok(());
        }
        // A different allowed token at each step, so that runs wander the grammar.
        let allowed: Vec<usize> = (0..VOCAB).filter(|&t| logits[t].is_finite()).collect();
        let Some(&token) = allowed.get((step * 7919) % allowed.len().max(1)) else {
            return Ok(());
        };
        match c.accept(token as u32) {
            Ok(true) | Err(_) => return Ok(()),
            Ok(false) => {}
        }
    }
    Ok(())
}

fn schema() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(json!({"type": "string"})),
        (0i64..40).prop_map(|n| json!({"type": "string", "maxLength": n})),
        (-5i64..5, -5i64..500)
            .prop_map(|(a, b)| json!({"type": "integer", "minimum": a, "maximum": b})),
        Just(json!({"type": "number"})),
        Just(json!({"type": "boolean"})),
        Just(json!({"type": "null"})),
        "[a-z|()*+?\\[\\]{}.\\\\^$0-9-]{0,12}"
            .prop_map(|p| json!({"type": "string", "pattern": p})),
        prop::collection::vec("[a-z ]{0,6}", 0..4).prop_map(|e| json!({"enum": e})),
        Just(json!({"type": "nonsense"})),
        Just(json!({"$ref": "#/definitions/missing"})),
        Just(json!(true)),
        Just(json!(false)),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            (
                prop::collection::vec(("[a-z]{1,5}", inner.clone()), 0..4),
                any::<bool>()
            )
                .prop_map(|(props, closed)| {
                    let names: Vec<String> = props.iter().map(|(n, _)| n.clone()).collect();
                    json!({
                        "type": "object",
                        "properties": props.into_iter().collect::<serde_json::Map<_, _>>(),
                        "required": names,
                        "additionalProperties": !closed,
                    })
                }),
            (inner.clone(), -2i64..4, -2i64..6).prop_map(|(items, lo, hi)| json!({
                "type": "array", "items": items, "minItems": lo, "maxItems": hi
            })),
            prop::collection::vec(inner.clone(), 1..3).prop_map(|v| json!({"anyOf": v})),
            prop::collection::vec(inner, 1..3).prop_map(|v| json!({"allOf": v})),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_regexes(rx in "[a-c0-9|()*+?\\[\\]{}.\\\\^$,-]{0,20}") {
        exercise(StructuredOutput::Regex(rx))?;
    }

    #[test]
    fn random_json_schemas(s in schema()) {
        exercise(StructuredOutput::JsonSchema(s))?;
    }

    #[test]
    fn random_grammars(body in "[a-z\"|()*+?: /\\[\\]0-9\n]{0,40}") {
        exercise(StructuredOutput::Grammar(format!("start: {body}")))?;
    }

    #[test]
    fn random_choices(choices in prop::collection::vec("[\\PC]{0,8}", 0..5)) {
        exercise(StructuredOutput::Choice(choices))?;
    }
}

#[test]
fn a_huge_grammar_compiles_or_is_refused_in_bounded_time() {
    let Some(g) = grammars() else {
        return;
    };
    // 2,000 alternatives of a regex with a bounded repeat: a lexer near its limits.
    let alts: Vec<String> = (0..2000).map(|i| format!("/x{i}[a-z]{{0,60}}y/")).collect();
    let start = Instant::now();
    let r = g.compile(&StructuredOutput::Grammar(format!(
        "start: {}",
        alts.join(" | ")
    )));
    assert!(start.elapsed() < Duration::from_secs(30));
    if let Ok(grammar) = r {
        let mut c = Constraint::new(&grammar);
        let took = c.compute_mask();
        assert!(took < Duration::from_secs(1), "{took:?}");
    }
}

/// The allowed tokens of `c`'s next mask.
fn mask_of(c: &mut Constraint) -> Vec<u32> {
    c.compute_mask();
    c.allowed().unwrap().unwrap().to_vec()
}

#[test]
fn a_compiled_constraint_is_kept_and_each_sequence_walks_its_own_copy() {
    let Some(path) = test_model_path() else {
        return;
    };
    let tok = Arc::new(Tokenizer::open(&path).unwrap());
    let (kept, fresh) = (
        Grammars::new(tok.clone(), VOCAB),
        Grammars::new(tok.clone(), VOCAB),
    );
    let spec = StructuredOutput::JsonSchema(json!({
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "tags"]
    }));
    let grammar = kept.compile(&spec).unwrap();
    kept.compile(&spec).unwrap();
    assert_eq!(
        kept.num_cached(),
        1,
        "the same spec compiled twice is kept once"
    );
    kept.compile(&StructuredOutput::Regex("[0-9]+".into()))
        .unwrap();
    assert_eq!(kept.num_cached(), 2);

    // One copy walks a path through the grammar; another copy of the same kept grammar
    // still sees the mask of a start, and the walker's masks are those of a constraint
    // compiled by a `Grammars` of its own and walked the same way.
    let (mut walker, mut idle) = (Constraint::new(&grammar), Constraint::new(&grammar));
    let compiled_apart = fresh.compile(&spec).unwrap();
    let start = mask_of(&mut Constraint::new(&compiled_apart));
    let text = tok
        .encode(r#"{"name": "Ada", "tags": ["x", "#, false)
        .unwrap();
    let mut reference = Constraint::new(&compiled_apart);
    for &t in &text {
        assert_eq!(mask_of(&mut walker), mask_of(&mut reference));
        assert!(!walker.accept(t).unwrap());
        assert!(!reference.accept(t).unwrap());
    }
    assert_eq!(mask_of(&mut walker), mask_of(&mut reference));
    assert_eq!(
        mask_of(&mut idle),
        start,
        "a copy kept its own place in the grammar"
    );
    assert_ne!(mask_of(&mut walker), start);
}
