//! Reasoning models think between `<think>` and `</think>` before they answer: with
//! `--reasoning-parser`, that text goes to `reasoning_content` (whole and streamed) and the
//! answer to `content`; a structured-output constraint starts where the thinking ends.

use ingot_core::ReasoningMarkers;
use std::str::FromStr;

const START: &str = "<think>";
const END: &str = "</think>";

/// Where a model's output starts, by the names vLLM's `--reasoning-parser` uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningParser {
    /// Qwen3: the output thinks only where it opens with `<think>`.
    Qwen3,
    /// DeepSeek-R1 and its distills: the template opens the thinking, so the output starts
    /// in it (a leading `<think>` is dropped) and an output without `</think>` is all
    /// thinking.
    DeepSeekR1,
}

impl FromStr for ReasoningParser {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "qwen3" => Ok(ReasoningParser::Qwen3),
            "deepseek_r1" => Ok(ReasoningParser::DeepSeekR1),
            _ => Err(format!(
                "unknown reasoning parser `{s}` (qwen3, deepseek_r1)"
            )),
        }
    }
}

impl ReasoningParser {
    /// The markers the engine watches for, to start a constraint after the thinking.
    pub fn markers(self) -> ReasoningMarkers {
        ReasoningMarkers {
            start: START.into(),
            end: END.into(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Part {
    /// Not known yet: whether the output opens with `<think>`.
    Opening,
    Thinking,
    Answer,
}

/// Splits an output into thinking and answer as it streams; the whole output goes the
/// same way, so streamed and whole responses agree.
#[derive(Clone, Debug)]
pub struct ReasoningSplit {
    parser: ReasoningParser,
    part: Part,
    /// Text not yet assigned: a possible start of a marker.
    held: String,
    /// Any thinking was seen (then `reasoning_content` is given, even empty).
    thought: bool,
    /// The answer has begun (its leading line breaks are dropped until then).
    answering: bool,
}

/// New text of each part.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Parts {
    pub reasoning: String,
    pub content: String,
}

impl ReasoningSplit {
    pub fn new(parser: ReasoningParser) -> ReasoningSplit {
        ReasoningSplit {
            parser,
            part: Part::Opening,
            held: String::new(),
            thought: false,
            answering: false,
        }
    }

    /// Whether the output had a thinking part (so far).
    pub fn thought(&self) -> bool {
        self.thought
    }

    /// Adds text; returns what of it is known to be thinking or answer.
    pub fn push(&mut self, text: &str) -> Parts {
        self.held.push_str(text);
        let mut out = Parts::default();
        loop {
            match self.part {
                Part::Opening => {
                    let t = self.held.trim_start();
                    if t.is_empty() || (START.starts_with(t) && t.len() < START.len()) {
                        return out;
                    }
                    if let Some(rest) = t.strip_prefix(START) {
                        self.held = rest.to_string();
                        self.part = Part::Thinking;
                    } else {
                        self.part = match self.parser {
                            ReasoningParser::Qwen3 => Part::Answer,
                            ReasoningParser::DeepSeekR1 => Part::Thinking,
                        };
                    }
                    if self.part == Part::Thinking {
                        self.thought = true;
                    }
                }
                Part::Thinking => {
                    if let Some(at) = self.held.find(END) {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at + END.len());
                        self.part = Part::Answer;
                        continue;
                    }
                    let keep = (1..END.len())
                        .filter(|&k| self.held.ends_with(&END[..k]))
                        .max()
                        .unwrap_or(0);
                    let cut = self.held.len() - keep;
                    out.reasoning.push_str(&self.held[..cut]);
                    self.held.drain(..cut);
                    return out;
                }
                Part::Answer => {
                    let text = std::mem::take(&mut self.held);
                    let text = if self.answering {
                        text.as_str()
                    } else {
                        text.trim_start_matches(['\n', '\r'])
                    };
                    self.answering |= !text.is_empty();
                    out.content.push_str(text);
                    return out;
                }
            }
        }
    }

    /// The output ended: what was held goes to the part it was in (text that only looked
    /// like the start of a marker is the answer's, or the thinking's).
    pub fn finish(&mut self) -> Parts {
        let held = std::mem::take(&mut self.held);
        let mut out = Parts::default();
        match self.part {
            Part::Thinking => out.reasoning = held,
            Part::Opening if self.parser == ReasoningParser::DeepSeekR1 && !held.is_empty() => {
                self.thought = true;
                out.reasoning = held;
            }
            _ => out.content = held,
        }
        out
    }

    /// A whole output as (thinking, answer).
    pub fn split(parser: ReasoningParser, text: &str) -> (Option<String>, String) {
        let mut s = ReasoningSplit::new(parser);
        let a = s.push(text);
        let b = s.finish();
        let reasoning = s.thought.then(|| a.reasoning + &b.reasoning);
        (reasoning, a.content + &b.content)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(parser: ReasoningParser, pieces: &[&str]) -> (Option<String>, String) {
        let mut s = ReasoningSplit::new(parser);
        let (mut r, mut c) = (String::new(), String::new());
        for p in pieces {
            let o = s.push(p);
            r += &o.reasoning;
            c += &o.content;
        }
        let o = s.finish();
        (s.thought().then(|| r + &o.reasoning), c + &o.content)
    }

    #[test]
    fn thinking_and_answer_split_alike_whole_and_streamed() {
        use ReasoningParser::*;
        let cases: [(ReasoningParser, &str, Option<&str>, &str); 7] = [
            (
                Qwen3,
                "<think>\nLet me see.\n</think>\n\nParis.",
                Some("\nLet me see.\n"),
                "Paris.",
            ),
            (Qwen3, "Paris.", None, "Paris."),
            (Qwen3, "<thing>", None, "<thing>"),
            (
                DeepSeekR1,
                "Hmm, France.</think>Paris.",
                Some("Hmm, France."),
                "Paris.",
            ),
            (
                DeepSeekR1,
                "<think>Hmm</think>\nParis.",
                Some("Hmm"),
                "Paris.",
            ),
            (
                DeepSeekR1,
                "still thinking </thi",
                Some("still thinking </thi"),
                "",
            ),
            (
                Qwen3,
                "<think>a</think>b </think> c",
                Some("a"),
                "b </think> c",
            ),
        ];
        for (parser, text, reasoning, content) in cases {
            let whole = ReasoningSplit::split(parser, text);
            assert_eq!(
                whole,
                (reasoning.map(String::from), content.to_string()),
                "{text}"
            );
            // Every split point, one character at a time.
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
            assert_eq!(streamed(parser, &pieces), whole, "{text} streamed");
        }
    }
}
