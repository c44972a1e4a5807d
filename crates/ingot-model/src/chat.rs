//! Chat templates: the model's own Jinja template rendered with minijinja.

use anyhow::{anyhow, Result};
use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

pub struct ChatTemplate {
    env: Environment<'static>,
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
        env.add_template_owned("chat", source)
            .map_err(|e| anyhow!("invalid chat template: {e}"))?;
        Ok(ChatTemplate { env })
    }

    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<String> {
        let t = self.env.get_template("chat").expect("added in new");
        t.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token.unwrap_or(""),
            eos_token => eos_token.unwrap_or(""),
        })
        .map_err(|e| anyhow!("chat template failed: {e}"))
    }
}
