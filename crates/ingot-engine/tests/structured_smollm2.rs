//! Structured output on the real test model: every constrained answer satisfies its
//! constraint (JSON schema, JSON object, regex, choice, Lark grammar), greedy and sampled;
//! a constraint that does not compile is refused naming its field; constrained rows do not
//! change the tokens of the unconstrained rows they share a step with.

use ingot_backend::cpu::CpuBackend;
use ingot_core::{FinishReason, InvalidParam, ReasoningMarkers, SamplingParams, StructuredOutput};
use ingot_engine::{Engine, EngineConfig, RequestOutput};
use ingot_model::chat::Message;
use ingot_model::testing::test_model_path;
use ingot_model::WeightDType;
use serde_json::{json, Value};
use std::sync::Arc;

fn engine(dtype: WeightDType) -> Option<Engine<CpuBackend>> {
    let path = test_model_path()?;
    let backend = CpuBackend::new(None).unwrap();
    let (model, tokenizer) = ingot_model::load(&backend, &path, dtype).unwrap();
    let config = EngineConfig {
        max_num_seqs: Some(16),
        max_model_len: Some(1024),
        kv_cache_memory: Some(64 << 20),
        ..EngineConfig::default()
    };
    Some(Engine::new(backend, model, Arc::new(tokenizer), config).unwrap())
}

fn chat(e: &Engine<CpuBackend>, question: &str) -> Vec<u32> {
    let tok = e.tokenizer();
    let text = tok
        .apply_chat_template(&[Message::new("user", question)], None)
        .unwrap();
    tok.encode(&text, false).unwrap()
}

fn constrained(spec: StructuredOutput, max_tokens: usize) -> SamplingParams {
    SamplingParams {
        structured: Some(spec),
        ..SamplingParams::greedy(max_tokens)
    }
}

fn run(e: &mut Engine<CpuBackend>, prompt: Vec<u32>, params: SamplingParams) -> RequestOutput {
    let out = e.generate(vec![prompt], &[params]).unwrap().remove(0);
    let s = e.stats();
    assert_eq!(s.free_blocks, s.total_blocks, "KV blocks still in use");
    out
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "city": {"type": "string", "maxLength": 24}
        },
        "required": ["name", "age", "city"],
        "additionalProperties": false
    })
}

fn assert_person(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("`{text}`: {e}"));
    let o = v.as_object().expect("an object");
    assert_eq!(o.len(), 3, "{text}");
    assert!(o["name"].as_str().is_some_and(|s| s.chars().count() <= 24));
    assert!(o["age"].as_u64().is_some_and(|a| a <= 150));
    assert!(o["city"].as_str().is_some_and(|s| s.chars().count() <= 24));
}

#[test]
fn json_schema_answers_parse_and_satisfy_the_schema() {
    let Some(mut e) = engine(WeightDType::F16) else {
        return;
    };
    let prompt = chat(&e, "Describe a person: their name, age and city.");
    let greedy = run(
        &mut e,
        prompt.clone(),
        constrained(StructuredOutput::JsonSchema(person_schema()), 200),
    );
    let c = &greedy.completions[0];
    assert_eq!(c.finish_reason, Some(FinishReason::Stop), "{}", c.text);
    assert_person(&c.text);
    // Sampled, several samples of one request, seeded.
    let sampled = SamplingParams {
        temperature: 1.0,
        top_p: 0.95,
        n: 4,
        seed: Some(7),
        ..constrained(StructuredOutput::JsonSchema(person_schema()), 200)
    };
    let out = run(&mut e, prompt, sampled);
    for c in &out.completions {
        assert_eq!(c.finish_reason, Some(FinishReason::Stop), "{}", c.text);
        assert_person(&c.text);
    }
}

#[test]
fn json_object_regex_choice_and_grammar_hold() {
    let Some(mut e) = engine(WeightDType::F16) else {
        return;
    };
    let prompt = chat(&e, "Give me a JSON object describing the weather.");
    let out = run(
        &mut e,
        prompt,
        constrained(StructuredOutput::JsonObject, 300),
    );
    let c = &out.completions[0];
    assert_eq!(c.finish_reason, Some(FinishReason::Stop), "{}", c.text);
    let v: Value = serde_json::from_str(&c.text).unwrap();
    assert!(v.is_object(), "{}", c.text);

    let prompt = chat(&e, "What is a phone number in the format 555-0123?");
    let out = run(
        &mut e,
        prompt,
        constrained(StructuredOutput::Regex(r"[0-9]{3}-[0-9]{4}".into()), 20),
    );
    let text = &out.completions[0].text;
    assert_eq!(text.len(), 8, "{text}");
    assert!(text.chars().enumerate().all(|(i, ch)| if i == 3 {
        ch == '-'
    } else {
        ch.is_ascii_digit()
    }));

    let choices = vec!["positive".to_string(), "negative".into(), "neutral".into()];
    let prompt = chat(
        &e,
        "Is the sentiment of 'I love this' positive or negative?",
    );
    for temperature in [0.0, 1.0] {
        let params = SamplingParams {
            temperature,
            seed: Some(1),
            ..constrained(StructuredOutput::Choice(choices.clone()), 20)
        };
        let c = &run(&mut e, prompt.clone(), params).completions[0];
        assert!(choices.contains(&c.text), "{}", c.text);
        assert_eq!(c.finish_reason, Some(FinishReason::Stop));
    }

    let lark = r#"start: "The answer is " NUMBER "."
NUMBER: /[1-9][0-9]?/"#;
    let prompt = chat(&e, "How many legs does a spider have?");
    let c = &run(
        &mut e,
        prompt,
        constrained(StructuredOutput::Grammar(lark.into()), 20),
    )
    .completions[0];
    let n = c
        .text
        .strip_prefix("The answer is ")
        .and_then(|r| r.strip_suffix('.'))
        .unwrap_or_else(|| panic!("{}", c.text));
    assert!(
        n.parse::<u32>().is_ok_and(|n| (1..100).contains(&n)),
        "{}",
        c.text
    );
}

#[test]
fn a_length_cut_stays_length_and_logprobs_come_back() {
    let Some(mut e) = engine(WeightDType::F16) else {
        return;
    };
    let prompt = chat(&e, "Describe a person.");
    let params = SamplingParams {
        logprobs: Some(2),
        ..constrained(StructuredOutput::JsonSchema(person_schema()), 5)
    };
    let c = &run(&mut e, prompt, params).completions[0];
    assert_eq!(c.finish_reason, Some(FinishReason::Length));
    assert_eq!(c.token_ids.len(), 5);
    assert_eq!(c.logprobs.len(), 5);
    assert!(c.text.starts_with('{'), "{}", c.text);
}

#[test]
fn constraints_that_do_not_compile_name_their_field() {
    let Some(mut e) = engine(WeightDType::F16) else {
        return;
    };
    let bad = [
        (
            StructuredOutput::JsonSchema(json!({"type": "no-such-type"})),
            "response_format",
        ),
        (
            StructuredOutput::JsonSchema(json!([1, 2])),
            "response_format",
        ),
        (StructuredOutput::Regex("[0-9".into()), "structured_outputs"),
        (
            StructuredOutput::Grammar("start: undefined_rule".into()),
            "structured_outputs",
        ),
        (StructuredOutput::Choice(vec![]), "structured_outputs"),
    ];
    for (spec, field) in bad {
        let err = e
            .add_request(1, vec![1, 2, 3], constrained(spec.clone(), 10))
            .expect_err(&format!("{spec:?} compiled"));
        let p = err
            .downcast_ref::<InvalidParam>()
            .unwrap_or_else(|| panic!("{err:#}"));
        assert_eq!(p.field, field, "{spec:?}: {err:#}");
    }
    assert!(!e.has_work());
}

#[test]
fn constrained_rows_leave_their_neighbours_tokens_unchanged() {
    let Some(mut e) = engine(WeightDType::F32) else {
        return;
    };
    let free = chat(&e, "Write a sentence about the sea.");
    let alone = run(&mut e, free.clone(), SamplingParams::greedy(24));
    let json = chat(&e, "Describe a person.");
    let outs = e
        .generate(
            vec![free, json],
            &[
                SamplingParams::greedy(24),
                constrained(StructuredOutput::JsonSchema(person_schema()), 200),
            ],
        )
        .unwrap();
    assert_eq!(
        outs[0].completions[0].token_ids,
        alone.completions[0].token_ids
    );
    assert_person(&outs[1].completions[0].text);
}

#[test]
fn a_constraint_starts_after_the_reasoning_ends() {
    let Some(mut e) = engine(WeightDType::F32) else {
        return;
    };
    let prompt = chat(&e, "What is the capital of France?");
    let free = run(&mut e, prompt.clone(), SamplingParams::greedy(8));
    let free = &free.completions[0].token_ids;
    // One of the model's own tokens, absent from the prompt, stands in for the end of its
    // thinking.
    let tok = e.tokenizer().clone();
    let k = (1..free.len())
        .find(|&k| {
            !prompt.contains(&free[k])
                && tok
                    .encode(&tok.decode(&free[k..=k], false).unwrap(), false)
                    .unwrap()
                    == free[k..=k]
        })
        .expect("a marker token");
    let end = tok.decode(&free[k..=k], false).unwrap();
    let params = SamplingParams {
        reasoning: Some(ReasoningMarkers {
            start: "<think>".into(),
            end,
        }),
        ..constrained(StructuredOutput::Regex("[0-9]{3}".into()), 20)
    };
    let c = &run(&mut e, prompt.clone(), params.clone()).completions[0];
    assert_eq!(c.token_ids[..=k], free[..=k], "free until the marker");
    let after = e.tokenizer().decode(&c.token_ids[k + 1..], false).unwrap();
    assert!(
        after.len() == 3 && after.chars().all(|ch| ch.is_ascii_digit()),
        "{after}"
    );
    assert_eq!(c.finish_reason, Some(FinishReason::Stop));
    // A prompt that already closed the section constrains from the first token.
    let mut closed = prompt;
    closed.extend(e.tokenizer().encode("<think>", false).unwrap());
    closed.extend(&free[k..=k]);
    let c = &run(&mut e, closed, params).completions[0];
    assert!(
        c.text.len() == 3 && c.text.chars().all(|ch| ch.is_ascii_digit()),
        "{}",
        c.text
    );
}
