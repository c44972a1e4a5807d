//! Tool calls while an answer streams. An `auto` answer's text goes out as content until
//! the parser's call marker could begin; from there (and from the start of a `required`
//! answer) each call's id and name go out once its name is read, then its arguments in
//! fragments as they arrive, as OpenAI's clients put them together. When the answer ends
//! it is parsed whole ([`tools::parse`]), and calls the fragments missed go out whole.

use crate::tools::{self, ParsedCall, ToolMode, ToolParser};

/// One streamed piece of a call: its id and name first (`header`), then argument text.
#[derive(Clone, Debug, PartialEq)]
pub struct CallDelta {
    /// The call's position among the answer's calls.
    pub index: usize,
    /// `(id, name)`, in the call's first delta only.
    pub header: Option<(String, String)>,
    pub arguments: String,
}

/// A tool-call answer (`auto` or `required`) while it streams.
#[derive(Default)]
pub struct ToolStream {
    /// Text not sent: a possible start of the marker, or everything from the marker on.
    held: String,
    /// The marker (or, for Llama 3 JSON, a call's first character) was seen.
    calling: bool,
    /// Text went out (then a Llama 3 JSON answer is text to its end).
    sent_text: bool,
    scanner: CallScanner,
}

/// What opens a call in `parser`'s format, for text that streams before it.
fn markers(parser: ToolParser) -> &'static [&'static str] {
    match parser {
        ToolParser::Hermes | ToolParser::Qwen3 => &["<tool_call>"],
        ToolParser::Mistral => &["[TOOL_CALLS]"],
        ToolParser::Llama3Json => &["<|python_tag|>", "{"],
    }
}

impl ToolStream {
    /// Adds new text; returns the part that can go out as content now, and the calls'
    /// new pieces.
    pub fn push(&mut self, mode: &ToolMode, text: &str) -> (String, Vec<CallDelta>) {
        self.held.push_str(text);
        let sent = match mode {
            ToolMode::Auto(parser) if !self.calling => {
                let sent = self.scan(*parser);
                self.sent_text |= !sent.is_empty();
                sent
            }
            _ => {
                self.calling = true;
                String::new()
            }
        };
        let calls = if self.calling {
            self.scanner.push(&self.held)
        } else {
            vec![]
        };
        (sent, calls)
    }

    fn scan(&mut self, parser: ToolParser) -> String {
        if parser == ToolParser::Llama3Json && self.sent_text {
            return std::mem::take(&mut self.held);
        }
        // Llama 3 JSON calls are the whole answer: only its start can open one.
        let scan = if parser == ToolParser::Llama3Json {
            let lead = self.held.len() - self.held.trim_start().len();
            if lead < self.held.len()
                && !markers(parser).iter().any(|m| {
                    let rest = &self.held[lead..];
                    m.starts_with(rest) || rest.starts_with(m)
                })
            {
                // Plain text: nothing in it can become a call.
                return std::mem::take(&mut self.held);
            }
            lead
        } else {
            0
        };
        let found = markers(parser)
            .iter()
            .filter_map(|m| self.held[scan..].find(m).map(|i| i + scan))
            .min();
        if let Some(at) = found {
            self.calling = true;
            if parser == ToolParser::Llama3Json {
                // The whole answer is the call, leading blanks included.
                return String::new();
            }
            let sent = self.held[..at].to_string();
            self.held.drain(..at);
            return sent;
        }
        // Hold back the longest tail that could still grow into a marker.
        let keep = markers(parser)
            .iter()
            .flat_map(|m| (1..m.len()).filter(|&k| self.held.ends_with(&m[..k])))
            .max()
            .unwrap_or(0);
        let mut cut = self.held.len() - keep;
        if parser == ToolParser::Llama3Json {
            cut = cut.min(scan);
        }
        while !self.held.is_char_boundary(cut) {
            cut -= 1;
        }
        let sent = self.held[..cut].to_string();
        self.held.drain(..cut);
        sent
    }

    /// The answer ended: content still to send (text held in case it opened a marker, or
    /// text after the calls), the calls the whole answer holds beyond those already
    /// streamed, and whether it made any call at all.
    pub fn finish(&mut self, mode: &ToolMode) -> (Option<String>, Vec<CallDelta>, bool) {
        let held = std::mem::take(&mut self.held);
        let (content, calls) = tools::parse(mode, &held);
        let streamed = self.scanner.announced();
        let content = if calls.is_empty() && streamed == 0 {
            // Text held only because it might have opened a marker goes out untrimmed.
            match mode {
                ToolMode::Auto(_) => (!held.is_empty()).then_some(held),
                _ => content,
            }
        } else if calls.is_empty() {
            // Calls went out that the whole answer does not parse into: their text is
            // not repeated as content.
            None
        } else {
            content
        };
        let rest: Vec<CallDelta> = calls
            .into_iter()
            .enumerate()
            .skip(streamed)
            .map(|(index, ParsedCall { name, arguments })| CallDelta {
                index,
                header: Some((tools::call_id(), name)),
                arguments,
            })
            .collect();
        let has_calls = streamed > 0 || !rest.is_empty();
        (content, rest, has_calls)
    }
}

/// Reads calls out of JSON text as it grows: each outermost object is a call, its `name` a
/// string member, and its `arguments` (or `parameters`) a member whose raw text is passed
/// on as it arrives (arguments written as a JSON string go out whole once read).
#[derive(Default)]
struct CallScanner {
    /// Bytes of the call text already read.
    read: usize,
    /// Nesting inside the current call object (0: between calls).
    depth: usize,
    in_string: bool,
    escaped: bool,
    member: Member,
    calls: Vec<ScannedCall>,
}

/// Where the scanner stands among a call object's members.
#[derive(Default)]
enum Member {
    #[default]
    Between,
    Key(String),
    AfterKey(String),
    Value {
        key: String,
        text: String,
    },
}

struct ScannedCall {
    id: String,
    name: Option<String>,
    /// The id and name went out.
    announced: bool,
    /// Argument text not sent yet.
    pending: String,
}

fn is_arguments(key: &str) -> bool {
    key == "arguments" || key == "parameters"
}

impl CallScanner {
    /// Reads the call text `all` past what it read before and returns the calls' new
    /// pieces.
    fn push(&mut self, all: &str) -> Vec<CallDelta> {
        for c in all[self.read..].chars() {
            self.read_char(c);
        }
        self.read = all.len();
        let mut out = vec![];
        for (index, call) in self.calls.iter_mut().enumerate() {
            let Some(name) = &call.name else { continue };
            let header = (!call.announced).then(|| (call.id.clone(), name.clone()));
            if header.is_some() || !call.pending.is_empty() {
                call.announced = true;
                out.push(CallDelta {
                    index,
                    header,
                    arguments: std::mem::take(&mut call.pending),
                });
            }
        }
        out
    }

    /// Calls whose id and name went out.
    fn announced(&self) -> usize {
        self.calls.iter().filter(|c| c.announced).count()
    }

    fn read_char(&mut self, c: char) {
        if self.depth == 0 {
            // Between calls only an object opens one.
            if c == '{' {
                self.depth = 1;
                self.member = Member::Between;
                self.calls.push(ScannedCall {
                    id: tools::call_id(),
                    name: None,
                    announced: false,
                    pending: String::new(),
                });
            }
            return;
        }
        if self.in_string {
            match &mut self.member {
                Member::Key(k) if c != '"' || self.escaped => k.push(c),
                Member::Value { .. } => self.value_push(c),
                _ => {}
            }
            if self.escaped {
                self.escaped = false;
            } else if c == '\\' {
                self.escaped = true;
            } else if c == '"' {
                self.in_string = false;
                match std::mem::take(&mut self.member) {
                    Member::Key(k) => self.member = Member::AfterKey(k),
                    Member::Value { key, text } if self.depth == 1 => self.end_value(key, text),
                    other => self.member = other,
                }
            }
            return;
        }
        match c {
            '"' => {
                self.in_string = true;
                match &self.member {
                    Member::Between if self.depth == 1 => self.member = Member::Key(String::new()),
                    Member::Value { .. } => self.value_push(c),
                    _ => {}
                }
            }
            '{' | '[' => {
                self.value_push(c);
                self.depth += 1;
            }
            '}' | ']' => {
                self.depth -= 1;
                if self.depth == 0 {
                    self.end_member();
                    return;
                }
                self.value_push(c);
                if self.depth == 1 {
                    self.end_member();
                }
            }
            ',' if self.depth == 1 => self.end_member(),
            ':' if self.depth == 1 => {
                if let Member::AfterKey(key) = std::mem::take(&mut self.member) {
                    self.member = Member::Value {
                        key,
                        text: String::new(),
                    };
                }
            }
            c => self.value_push(c),
        }
    }

    /// Adds a character to the member value being read; argument text also goes to the
    /// call's pending fragment, unless it is a JSON string (sent whole once read).
    fn value_push(&mut self, c: char) {
        let Member::Value { key, text } = &mut self.member else {
            return;
        };
        if text.is_empty() && c.is_whitespace() {
            return;
        }
        text.push(c);
        if is_arguments(key) && !text.starts_with('"') {
            if let Some(call) = self.calls.last_mut() {
                call.pending.push(c);
            }
        }
    }

    fn end_member(&mut self) {
        if let Member::Value { key, text } = std::mem::take(&mut self.member) {
            self.end_value(key, text);
        }
    }

    /// A member's value is read: a name names the call; arguments written as a JSON string
    /// are that string's text.
    fn end_value(&mut self, key: String, text: String) {
        self.member = Member::Between;
        let Some(call) = self.calls.last_mut() else {
            return;
        };
        let string = || serde_json::from_str::<String>(&text).ok();
        if key == "name" && call.name.is_none() {
            call.name = string();
        } else if is_arguments(&key) && text.starts_with('"') {
            call.pending.push_str(&string().unwrap_or_default());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// A streamed answer put together as OpenAI's clients do: content, and per call its
    /// id, name and the concatenation of its argument fragments.
    #[derive(Debug, Default, PartialEq)]
    struct Assembled {
        content: String,
        calls: Vec<(String, String)>,
        ids: Vec<String>,
        has_calls: bool,
    }

    fn stream(mode: &ToolMode, pieces: &[&str]) -> Assembled {
        let mut s = ToolStream::default();
        let mut a = Assembled::default();
        let take = |a: &mut Assembled, deltas: Vec<CallDelta>| {
            for d in deltas {
                if let Some((id, name)) = d.header {
                    assert_eq!(d.index, a.calls.len(), "headers come in order");
                    a.ids.push(id);
                    a.calls.push((name, String::new()));
                }
                a.calls[d.index].1 += &d.arguments;
            }
        };
        for p in pieces {
            let (sent, deltas) = s.push(mode, p);
            a.content += &sent;
            take(&mut a, deltas);
        }
        let (rest, deltas, has_calls) = s.finish(mode);
        a.content += rest.as_deref().unwrap_or("");
        take(&mut a, deltas);
        a.has_calls = has_calls;
        a
    }

    /// `text` cut into pieces of every length from 1 to 7 characters.
    fn cuts(text: &str) -> Vec<Vec<String>> {
        let chars: Vec<char> = text.chars().collect();
        (1..=7)
            .map(|n| chars.chunks(n).map(|c| c.iter().collect()).collect())
            .collect()
    }

    /// Streamed in any cut, the calls are those of the whole answer (arguments equal as
    /// JSON), with the same text around them.
    fn streams_as_parsed(mode: &ToolMode, text: &str) -> Assembled {
        let (content, calls) = tools::parse(mode, text);
        let mut last = None;
        for pieces in cuts(text) {
            let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let a = stream(mode, &pieces);
            assert_eq!(a.calls.len(), calls.len(), "{text:?} in {pieces:?}: {a:?}");
            for ((name, args), want) in a.calls.iter().zip(&calls) {
                assert_eq!(name, &want.name);
                let got: Value =
                    serde_json::from_str(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
                let want: Value = serde_json::from_str(&want.arguments).unwrap();
                assert_eq!(got, want, "{text:?} in {pieces:?}");
            }
            if calls.is_empty() {
                assert_eq!(a.content, text);
            } else {
                assert_eq!(a.content.trim(), content.as_deref().unwrap_or(""));
            }
            a.ids.iter().for_each(|id| assert!(id.starts_with("call_")));
            last = Some(a);
        }
        last.unwrap()
    }

    #[test]
    fn calls_stream_as_their_whole_answer_parses() {
        let hermes = ToolMode::Auto(ToolParser::Hermes);
        let a = streams_as_parsed(
            &hermes,
            "Let me look. <tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo \\\"}{\", \"days\": [1, 2]}}\n</tool_call>\n<tool_call>{\"arguments\": {}, \"name\": \"time\"}</tool_call>",
        );
        assert_eq!(a.content, "Let me look. ");
        assert!(a.has_calls);
        streams_as_parsed(
            &ToolMode::Required,
            r#"[{"name": "a", "parameters": {"q": {"r": [1, {"s": null}]}}}, {"name": "b", "parameters": {}}]"#,
        );
        streams_as_parsed(
            &ToolMode::Auto(ToolParser::Llama3Json),
            r#"<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "; {"}}"#,
        );
        streams_as_parsed(
            &ToolMode::Auto(ToolParser::Mistral),
            r#"Sure. [TOOL_CALLS] [{"name": "a", "arguments": "{\"q\": \"x\"}"}]"#,
        );
        // Text that opens no call streams as it is.
        let a = streams_as_parsed(&hermes, "a <b> c {\"name\": 1}");
        assert!(!a.has_calls);
    }

    #[test]
    fn a_call_goes_out_name_first_then_argument_fragments() {
        let mode = ToolMode::Required;
        let mut s = ToolStream::default();
        let (_, d) = s.push(&mode, r#"[{"name": "weather", "para"#);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].header.as_ref().map(|h| h.1.as_str()), Some("weather"));
        assert_eq!(d[0].arguments, "");
        let (_, d) = s.push(&mode, r#"meters": {"city": "Os"#);
        assert_eq!(
            (d[0].header.is_none(), d[0].arguments.as_str()),
            (true, r#"{"city": "Os"#)
        );
        let (_, d) = s.push(&mode, r#"lo"}}]"#);
        assert_eq!(d[0].arguments, r#"lo"}"#);
        let (content, rest, has_calls) = s.finish(&mode);
        assert_eq!((content, rest, has_calls), (None, vec![], true));
    }

    #[test]
    fn auto_answers_stream_their_text_up_to_a_call() {
        let hermes = ToolMode::Auto(ToolParser::Hermes);
        let a = stream(&hermes, &["a <", "b> c"]);
        assert_eq!((a.content.as_str(), a.has_calls), ("a <b> c", false));
        let a = stream(&hermes, &["ends with <tool"]);
        assert_eq!(a.content, "ends with <tool");
        let llama = ToolMode::Auto(ToolParser::Llama3Json);
        let a = stream(&llama, &["Hello", " {there}"]);
        assert_eq!((a.content.as_str(), a.has_calls), ("Hello {there}", false));
        let a = stream(
            &llama,
            &[
                " {\"name\": \"weather\",",
                " \"parameters\": {\"city\": \"Oslo\"}}",
            ],
        );
        assert_eq!(a.content, "");
        assert_eq!(a.calls, [("weather".into(), r#"{"city": "Oslo"}"#.into())]);
    }
}
