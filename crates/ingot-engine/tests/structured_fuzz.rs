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
