//! Tool calling. A request's tools reach the model through its chat template, or through
//! a system prompt where the template has no tool support. A named or `required` tool
//! choice is guaranteed by a JSON-schema constraint built from the tools' parameters, so
//! the answer is always a parseable call with valid arguments; `auto` parses the model's
//! own format with the server's `--tool-call-parser`.

use crate::error::ApiError;
use crate::protocol::{CalledFunctionOut, MessageToolCall, Tool, ToolChoice};
use ingot_core::StructuredOutput;
use ingot_model::chat::Message;
use rand::distr::{Alphanumeric, SampleString};
use serde_json::{json, Value};
use std::str::FromStr;

/// How a model writes its tool calls, by the names vLLM's `--tool-call-parser` uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolParser {
    /// `<tool_call>{"name": …, "arguments": {…}}</tool_call>` blocks (Hermes, Qwen 2.5).
    Hermes,
    /// Qwen3 writes Hermes blocks.
    Qwen3,
    /// Llama 3.x: a JSON object `{"name": …, "parameters": {…}}`, several joined by `;`,
    /// optionally after `<|python_tag|>`.
    Llama3Json,
    /// Mistral: `[TOOL_CALLS]` then a JSON array of `{"name": …, "arguments": {…}}`.
    Mistral,
}

impl FromStr for ToolParser {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "hermes" => ToolParser::Hermes,
            "qwen3" => ToolParser::Qwen3,
            "llama3_json" => ToolParser::Llama3Json,
            "mistral" => ToolParser::Mistral,
            _ => {
                return Err(format!(
                    "unknown tool-call parser `{s}` (hermes, qwen3, llama3_json, mistral)"
                ))
            }
        })
    }
}

/// What a request's tool choice makes of its answer.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolMode {
    /// Plain text (no tools, `none`, or tools without `--enable-auto-tool-choice`).
    Text,
    /// The answer is the arguments of this function, constrained by its schema.
    Named(String),
    /// The answer is one or more calls (one where `parallel_tool_calls` is false),
    /// constrained by the tools' schemas.
    Required,
    /// The model decides; its text is parsed for calls.
    Auto(ToolParser),
}

/// One call the answer makes.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// Checks the tools and the tool choice of a request and decides how its answer is made.
/// `auto_parser` is the server's parser where `--enable-auto-tool-choice` is on.
pub fn mode(
    tools: &[Tool],
    choice: Option<&ToolChoice>,
    auto_parser: Option<ToolParser>,
) -> Result<ToolMode, ApiError> {
    let bad = |msg: String, param: &str| ApiError::bad_request(msg).with_param(param);
    for (i, t) in tools.iter().enumerate() {
        if t.kind != "function" {
            return Err(bad(
                format!(
                    "tool {i} has type `{}`: only `function` tools are supported",
                    t.kind
                ),
                "tools",
            ));
        }
        let f = &t.function;
        if f.name.is_empty() || tools[..i].iter().any(|o| o.function.name == f.name) {
            return Err(bad(
                format!(
                    "tool {i}: function names must be non-empty and unique, got `{}`",
                    f.name
                ),
                "tools",
            ));
        }
        if f.parameters.as_ref().is_some_and(|p| !p.is_object()) {
            return Err(bad(
                format!(
                    "tool `{}`: `parameters` must be a JSON schema object",
                    f.name
                ),
                "tools",
            ));
        }
    }
    let choice = match choice {
        None if tools.is_empty() => return Ok(ToolMode::Text),
        // OpenAI's default with tools is `auto`; vLLM's is `none` unless the server
        // parses calls.
        None => return Ok(auto_parser.map_or(ToolMode::Text, ToolMode::Auto)),
        Some(c) => c,
    };
    let name = match choice {
        ToolChoice::Mode(m) => match m.as_str() {
            "none" => return Ok(ToolMode::Text),
            "auto" => {
                return auto_parser.map(ToolMode::Auto).ok_or_else(|| {
                    bad(
                        "`tool_choice` `auto` needs the server started with --enable-auto-tool-choice and --tool-call-parser".into(),
                        "tool_choice",
                    )
                })
            }
            "required" if tools.is_empty() => {
                return Err(bad(
                    "`tool_choice` `required` needs `tools`".into(),
                    "tool_choice",
                ))
            }
            "required" => return Ok(ToolMode::Required),
            other => {
                return Err(bad(
                    format!("`tool_choice` must be none, auto, required or a named function, got `{other}`"),
                    "tool_choice",
                ))
            }
        },
        ToolChoice::Named(n) => &n.function.name,
    };
    if !tools.iter().any(|t| &t.function.name == name) {
        return Err(bad(
            format!("`tool_choice` names the function `{name}`, which is not in `tools`"),
            "tool_choice",
        ));
    }
    Ok(ToolMode::Named(name.clone()))
}

fn parameters(tool: &Tool) -> Value {
    tool.function
        .parameters
        .clone()
        .unwrap_or_else(|| json!({"type": "object", "properties": {}}))
}

/// The constraint that guarantees a named or required choice.
pub fn constraint(tools: &[Tool], mode: &ToolMode, parallel: bool) -> Option<StructuredOutput> {
    match mode {
        ToolMode::Named(name) => {
            let tool = tools.iter().find(|t| &t.function.name == name)?;
            Some(StructuredOutput::JsonSchema(parameters(tool)))
        }
        ToolMode::Required => {
            let calls: Vec<Value> = tools
                .iter()
                .map(|t| {
                    json!({
                        "type": "object",
                        "properties": {
                            "name": {"const": t.function.name},
                            "parameters": parameters(t),
                        },
                        "required": ["name", "parameters"],
                        "additionalProperties": false,
                    })
                })
                .collect();
            let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
            if !parallel {
                schema["maxItems"] = json!(1);
            }
            Some(StructuredOutput::JsonSchema(schema))
        }
        ToolMode::Text | ToolMode::Auto(_) => None,
    }
}

/// The tools as the chat template reads them (OpenAI's shape, as transformers passes it).
pub fn template_tools(tools: &[Tool]) -> Value {
    tools
        .iter()
        .map(|t| json!({"type": "function", "function": t.function}))
        .collect()
}

/// Where the template has no tool support: the tools and the call format described in a
/// system message, and past calls and their results written as the model would write them.
pub fn fallback(messages: &mut Vec<Message>, tools: &[Tool], parser: ToolParser) {
    let lines: Vec<String> = template_tools(tools)
        .as_array()
        .into_iter()
        .flatten()
        .map(Value::to_string)
        .collect();
    let format = match parser {
        ToolParser::Hermes | ToolParser::Qwen3 => {
            "To call a function, answer with one block per call:\n<tool_call>\n{\"name\": \"<function name>\", \"arguments\": <arguments as a JSON object>}\n</tool_call>"
        }
        ToolParser::Llama3Json => {
            "To call a function, answer with only a JSON object:\n{\"name\": \"<function name>\", \"parameters\": <arguments as a JSON object>}"
        }
        ToolParser::Mistral => {
            "To call functions, answer with [TOOL_CALLS] followed by a JSON array:\n[TOOL_CALLS] [{\"name\": \"<function name>\", \"arguments\": <arguments as a JSON object>}]"
        }
    };
    let prompt = format!(
        "You can call these functions, described as JSON:\n{}\n\n{format}\nOtherwise answer in plain text.",
        lines.join("\n")
    );
    for m in messages.iter_mut() {
        if let Some(calls) = m.tool_calls.take() {
            let calls: Vec<(String, Value)> = calls
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| {
                    (
                        c["function"]["name"].as_str().unwrap_or("").to_string(),
                        c["function"]["arguments"].clone(),
                    )
                })
                .collect();
            m.content.push_str(&write_calls(&calls, parser));
        }
        if m.role == "tool" {
            m.role = "user".into();
            m.content = format!("<tool_response>\n{}\n</tool_response>", m.content);
            m.tool_call_id = None;
        }
    }
    match messages.first_mut() {
        Some(m) if m.role == "system" => m.content = format!("{}\n\n{prompt}", m.content),
        _ => messages.insert(0, Message::new("system", prompt)),
    }
}

/// Calls written in the parser's format, for the history of a template without tools.
fn write_calls(calls: &[(String, Value)], parser: ToolParser) -> String {
    match parser {
        ToolParser::Hermes | ToolParser::Qwen3 => calls
            .iter()
            .map(|(name, args)| {
                format!(
                    "<tool_call>\n{}\n</tool_call>",
                    json!({"name": name, "arguments": args})
                )
            })
            .collect::<Vec<_>>()
            .join("\n"),
        ToolParser::Llama3Json => calls
            .iter()
            .map(|(name, args)| json!({"name": name, "parameters": args}).to_string())
            .collect::<Vec<_>>()
            .join("; "),
        ToolParser::Mistral => {
            let list: Vec<Value> = calls
                .iter()
                .map(|(name, args)| json!({"name": name, "arguments": args}))
                .collect();
            format!("[TOOL_CALLS] {}", Value::from(list))
        }
    }
}

/// A call's arguments as JSON text: an object stays as written, a string holding JSON is
/// kept as that string.
fn arguments_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "{}".into(),
        v => v.to_string(),
    }
}

/// A `{"name", "arguments" | "parameters"}` object as a call.
fn call_of(v: &Value) -> Option<ParsedCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments").or_else(|| v.get("parameters"));
    Some(ParsedCall {
        name,
        arguments: args.map_or_else(|| "{}".into(), arguments_text),
    })
}

/// Splits an answer into its text and its calls. Text the format does not parse stays
/// text: a model that writes a malformed call gets its words back, not an error.
pub fn parse(mode: &ToolMode, text: &str) -> (Option<String>, Vec<ParsedCall>) {
    let content = |t: &str| {
        let t = t.trim();
        (!t.is_empty()).then(|| t.to_string())
    };
    match mode {
        ToolMode::Text => (Some(text.to_string()), vec![]),
        ToolMode::Named(name) => (
            None,
            vec![ParsedCall {
                name: name.clone(),
                arguments: text.trim().to_string(),
            }],
        ),
        ToolMode::Required => match serde_json::from_str::<Value>(text) {
            Ok(Value::Array(items)) => {
                let calls: Vec<ParsedCall> = items.iter().filter_map(call_of).collect();
                (None, calls)
            }
            _ => (content(text), vec![]),
        },
        ToolMode::Auto(ToolParser::Hermes | ToolParser::Qwen3) => {
            let mut calls = vec![];
            let mut rest = String::new();
            let mut s = text;
            while let Some(start) = s.find("<tool_call>") {
                rest.push_str(&s[..start]);
                let after = &s[start + "<tool_call>".len()..];
                let (body, next) = match after.find("</tool_call>") {
                    Some(end) => (&after[..end], &after[end + "</tool_call>".len()..]),
                    None => (after, ""),
                };
                match serde_json::from_str::<Value>(body.trim())
                    .ok()
                    .as_ref()
                    .and_then(call_of)
                {
                    Some(c) => calls.push(c),
                    None => rest.push_str(&s[start..s.len() - next.len()]),
                }
                s = next;
            }
            rest.push_str(s);
            (content(&rest), calls)
        }
        ToolMode::Auto(ToolParser::Llama3Json) => {
            let body = text.trim();
            let body = body.strip_prefix("<|python_tag|>").unwrap_or(body).trim();
            if !body.starts_with('{') {
                return (content(text), vec![]);
            }
            match llama3_calls(body) {
                Some(calls) if !calls.is_empty() => (None, calls),
                _ => (content(text), vec![]),
            }
        }
        ToolMode::Auto(ToolParser::Mistral) => {
            let Some(at) = text.find("[TOOL_CALLS]") else {
                return (content(text), vec![]);
            };
            let list = text[at + "[TOOL_CALLS]".len()..].trim();
            match serde_json::from_str::<Value>(list) {
                Ok(Value::Array(items)) => {
                    let calls: Vec<ParsedCall> = items.iter().filter_map(call_of).collect();
                    (content(&text[..at]), calls)
                }
                _ => (content(text), vec![]),
            }
        }
    }
}

/// Llama 3 JSON calls: objects joined by `;` (a `;` inside a string joins nothing).
fn llama3_calls(mut body: &str) -> Option<Vec<ParsedCall>> {
    let mut calls = vec![];
    loop {
        let mut values = serde_json::Deserializer::from_str(body).into_iter::<Value>();
        calls.push(call_of(&values.next()?.ok()?)?);
        body = body[values.byte_offset()..].trim_start();
        if body.is_empty() {
            return Some(calls);
        }
        body = body.strip_prefix(';')?.trim_start();
    }
}

/// Parsed calls in OpenAI's shape, each with a fresh id.
pub fn message_calls(calls: Vec<ParsedCall>) -> Vec<MessageToolCall> {
    calls
        .into_iter()
        .map(|c| MessageToolCall {
            id: call_id(),
            kind: "function",
            function: CalledFunctionOut {
                name: c.name,
                arguments: c.arguments,
            },
        })
        .collect()
}

/// An answer's finish reason once its calls are parsed: `tool_calls` where the model made
/// calls (OpenAI ends a named choice with `stop`, and a `length` cut stays `length`).
pub fn finish_reason<'a>(
    mode: &ToolMode,
    has_calls: bool,
    finish: Option<&'a str>,
) -> Option<&'a str> {
    if matches!(mode, ToolMode::Named(_)) || !has_calls || finish == Some("length") {
        finish
    } else {
        Some("tool_calls")
    }
}

/// A fresh call id in OpenAI's style.
pub fn call_id() -> String {
    format!("call_{}", Alphanumeric.sample_string(&mut rand::rng(), 24))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: &str) -> ParsedCall {
        ParsedCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    #[test]
    fn parsers_split_text_and_calls() {
        let hermes = ToolMode::Auto(ToolParser::Hermes);
        let (text, calls) = parse(
            &hermes,
            "Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>{\"name\": \"time\", \"arguments\": {}}</tool_call>",
        );
        assert_eq!(text.as_deref(), Some("Let me look."));
        assert_eq!(
            calls,
            [call("weather", r#"{"city":"Oslo"}"#), call("time", "{}")]
        );
        // A malformed block stays text.
        let (text, calls) = parse(&hermes, "<tool_call>{not json}</tool_call>");
        assert_eq!(text.as_deref(), Some("<tool_call>{not json}</tool_call>"));
        assert!(calls.is_empty());

        let llama = ToolMode::Auto(ToolParser::Llama3Json);
        let (text, calls) = parse(
            &llama,
            "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", \"parameters\": {}}",
        );
        assert_eq!(text, None);
        assert_eq!(calls, [call("a", r#"{"x":1}"#), call("b", "{}")]);
        assert_eq!(
            parse(&llama, "Hello there").0.as_deref(),
            Some("Hello there")
        );

        let mistral = ToolMode::Auto(ToolParser::Mistral);
        let (text, calls) = parse(
            &mistral,
            "[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {\"q\": \"x\"}}]",
        );
        assert_eq!(text, None);
        assert_eq!(calls, [call("a", r#"{"q":"x"}"#)]);

        let (text, calls) = parse(
            &ToolMode::Required,
            r#"[{"name": "a", "parameters": {"q": 1}}]"#,
        );
        assert_eq!((text, calls), (None, vec![call("a", r#"{"q":1}"#)]));
    }

    #[test]
    fn tool_choice_is_checked_against_the_tools() {
        let tools: Vec<Tool> = serde_json::from_value(json!([
            {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "b"}}
        ]))
        .unwrap();
        let named: ToolChoice =
            serde_json::from_value(json!({"type": "function", "function": {"name": "b"}})).unwrap();
        assert_eq!(
            mode(&tools, Some(&named), None).unwrap(),
            ToolMode::Named("b".into())
        );
        let missing: ToolChoice =
            serde_json::from_value(json!({"type": "function", "function": {"name": "c"}})).unwrap();
        let e = mode(&tools, Some(&missing), None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let auto = ToolChoice::Mode("auto".into());
        assert!(mode(&tools, Some(&auto), None).is_err());
        assert_eq!(
            mode(&tools, Some(&auto), Some(ToolParser::Hermes)).unwrap(),
            ToolMode::Auto(ToolParser::Hermes)
        );
        assert_eq!(mode(&tools, None, None).unwrap(), ToolMode::Text);
        let dup: Vec<Tool> = serde_json::from_value(json!([
            {"type": "function", "function": {"name": "a"}},
            {"type": "function", "function": {"name": "a"}}
        ]))
        .unwrap();
        assert_eq!(
            mode(&dup, None, None).unwrap_err().param.as_deref(),
            Some("tools")
        );
    }
}
