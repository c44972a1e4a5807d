//! Chat templates: the model's own Jinja template rendered with minijinja.

use anyhow::{anyhow, Result};
use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

/// One chat message as templates read it (transformers' shape): an assistant's tool calls
/// carry their `arguments` as an object, and a `tool` message names the call it answers.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template reads `tools` (else tools reach the model some other way).
    supports_tools: bool,
}

fn raise_exception(msg: String) -> std::result::Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    pub fn new(source: String) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        // As transformers compiles chat templates.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // HF templates call Python string methods (`.strip()`, `.startswith()`, ...).
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        let supports_tools = source.contains("tools");
        env.add_template_owned("chat", source)
            .map_err(|e| anyhow!("invalid chat template: {e}"))?;
        Ok(ChatTemplate {
            env,
            supports_tools,
        })
    }

    pub fn supports_tools(&self) -> bool {
        self.supports_tools
    }

    /// Renders `messages`, with `tools` (OpenAI's tool list, as transformers passes it)
    /// where given.
    pub fn render(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<String> {
        let t = self.env.get_template("chat").expect("added in new");
        t.render(context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token.unwrap_or(""),
            eos_token => eos_token.unwrap_or(""),
        })
        .map_err(|e| anyhow!("chat template failed: {e}"))
    }
}
