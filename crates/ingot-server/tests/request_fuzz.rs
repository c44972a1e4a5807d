//! Random chat request bodies through the request parser and the tool and constraint
//! checks: each either passes or is a 400, never a panic. The bodies mix well-formed and
//! malformed `response_format`, `structured_outputs`, `guided_*`, `tools`, `tool_choice`
//! and sampling fields, and raw bytes that are not JSON at all.

use ingot_server::error::ApiError;
use ingot_server::protocol::{self, ChatRequest};
use ingot_server::tools::{self, ToolParser};
use proptest::prelude::*;
use serde_json::{json, Value};

/// Any small JSON value.
fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i32>().prop_map(Value::from),
        (-1e3f64..1e3).prop_map(Value::from),
        "[a-z_\"{}\\[\\]:, ]{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// A value for one of the fields under test: mostly of the field's own shape, sometimes
/// anything.
fn field(name: &'static str) -> BoxedStrategy<(String, Value)> {
    let shaped: BoxedStrategy<Value> = match name {
        "response_format" => prop_oneof![
            Just(json!({"type": "json_object"})),
            Just(json!({"type": "text"})),
            value().prop_map(|s| json!({"type": "json_schema", "json_schema": {"name": "x", "schema": s}})),
            value().prop_map(|t| json!({"type": t})),
        ]
        .boxed(),
        "structured_outputs" => prop_oneof![
            value().prop_map(|s| json!({"json": s})),
            "[a-z()|*+?\\[\\]{}]{0,10}".prop_map(|r| json!({"regex": r})),
            prop::collection::vec("[a-z]{0,4}", 0..3).prop_map(|c| json!({"choice": c})),
            "[a-z: \"|]{0,20}".prop_map(|g| json!({"grammar": g})),
            any::<bool>().prop_map(|b| json!({"json_object": b})),
        ]
        .boxed(),
        "guided_json" | "guided_regex" | "guided_choice" | "guided_grammar" => value().boxed(),
        "tools" => prop::collection::vec(
            ("[a-c]{0,2}", value(), prop_oneof![Just("function"), Just("code")]).prop_map(
                |(name, params, kind)| {
                    json!({"type": kind, "function": {"name": name, "parameters": params}})
                },
            ),
            0..3,
        )
        .prop_map(Value::from)
        .boxed(),
        "tool_choice" => prop_oneof![
            prop_oneof![Just("none"), Just("auto"), Just("required"), Just("any")]
                .prop_map(Value::from),
            "[a-c]{0,2}".prop_map(|n| json!({"type": "function", "function": {"name": n}})),
        ]
        .boxed(),
        "temperature" | "top_p" | "min_p" => (-1.0f64..3.0).prop_map(Value::from).boxed(),
        "logit_bias" => value().boxed(),
        _ => value().boxed(),
    };
    prop_oneof![4 => shaped, 1 => value()]
        .prop_map(move |v| (name.to_string(), v))
        .boxed()
}

fn body() -> impl Strategy<Value = Value> {
    let names = [
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "temperature",
        "top_p",
        "min_p",
        "logit_bias",
        "n",
        "stop",
    ];
    let fields: Vec<BoxedStrategy<Option<(String, Value)>>> = names
        .into_iter()
        .map(|n| prop::option::weighted(0.3, field(n)).boxed())
        .collect();
    fields.prop_map(|fields| {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in fields.into_iter().flatten() {
            body[k] = v;
        }
        body
    })
}

fn is_400(e: &ApiError) -> bool {
    e.status == 400 && !e.message.is_empty()
}

/// The checks a chat request passes through before it reaches the engine.
fn check(bytes: &[u8]) -> Result<(), ApiError> {
    let req: ChatRequest = protocol::parse(bytes, protocol::CHAT_FIELDS)?;
    let tool_list = req.tools.as_deref().unwrap_or_default();
    let mode = tools::mode(
        tool_list,
        req.tool_choice.as_ref(),
        Some(ToolParser::Hermes),
    )?;
    req.sampling.to_params(None)?;
    tools::constraint(tool_list, &mode, req.parallel_tool_calls.unwrap_or(true));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn chat_bodies_pass_or_are_400s(b in body()) {
        if let Err(e) = check(b.to_string().as_bytes()) {
            prop_assert!(is_400(&e), "{b}: {e:?}");
        }
    }

    #[test]
    fn bytes_that_are_not_a_request_are_400s(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        if let Err(e) = check(&bytes) {
            prop_assert!(is_400(&e), "{bytes:?}: {e:?}");
        }
    }
}
