//! Text ↔ token ids: HF `tokenizer.json`, or a byte-level BPE rebuilt from GGUF metadata.
//! Special tokens and the chat template travel with it.

use crate::chat::ChatTemplate;
use crate::checkpoint::Checkpoint;
use crate::gguf::{GgufFile, Value};
use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashMap;
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::whitespace::Whitespace;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Ids that end generation (the EOS token and any listed in generation_config.json).
    pub eos_token_ids: Vec<u32>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub chat_template: Option<ChatTemplate>,
}

impl Tokenizer {
    fn new(
        inner: tokenizers::Tokenizer,
        eos_token_ids: Vec<u32>,
        bos_token: Option<String>,
        eos_token: Option<String>,
        chat_template: Option<String>,
    ) -> Result<Tokenizer> {
        let chat_template = chat_template.map(ChatTemplate::new).transpose()?;
        Ok(Tokenizer {
            inner,
            eos_token_ids,
            bos_token,
            eos_token,
            chat_template,
        })
    }

    /// Ids of a `vocab_size` vocabulary decoded as placeholder words, for checkpoints
    /// without a vocabulary of their own.
    fn ids_only(vocab_size: usize) -> Result<Tokenizer> {
        Tokenizer::new(word_level(vocab_size)?, vec![], None, None, None)
    }

    pub fn from_checkpoint(ckpt: &Checkpoint) -> Result<Tokenizer> {
        match ckpt {
            Checkpoint::Safetensors { dir, .. } => from_hf_dir(dir),
            Checkpoint::Dummy { dir, .. } if dir.join("tokenizer.json").exists() => {
                from_hf_dir(dir)
            }
            // Dummy weights make no text worth reading; ids still need a decoder.
            Checkpoint::Dummy { config, .. } => Tokenizer::ids_only(config.vocab_size),
            // llama.cpp's mark of a file without a vocabulary (its random benchmark files).
            Checkpoint::Gguf { file, .. }
                if file.get("tokenizer.ggml.model").and_then(Value::as_str) == Some("none") =>
            {
                Tokenizer::ids_only(ckpt.config()?.vocab_size)
            }
            Checkpoint::Gguf { file, .. } => from_gguf(file),
        }
    }

    /// The tokenizer of another model (`--tokenizer`): an HF directory's `tokenizer.json`
    /// with its config files, or a GGUF file's vocabulary.
    pub fn open(path: &Path) -> Result<Tokenizer> {
        if path.is_dir() {
            from_hf_dir(path)
        } else {
            from_gguf(&GgufFile::open(path)?)
        }
        .with_context(|| format!("cannot read a tokenizer from {}", path.display()))
    }

    /// Token ids of `text`; `add_special_tokens` applies the model's BOS rule.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| anyhow!("tokenization failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| anyhow!("detokenization failed: {e}"))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The tokenizer as HF's `tokenizer.json` text, for libraries that build their own.
    pub fn to_json(&self) -> Result<String> {
        self.inner
            .to_string(false)
            .map_err(|e| anyhow!("cannot serialize the tokenizer: {e}"))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Renders messages (and tools, where given) through the chat template with the
    /// generation prompt.
    pub fn apply_chat_template(
        &self,
        messages: &[crate::chat::Message],
        tools: Option<&serde_json::Value>,
    ) -> Result<String> {
        let t = self
            .chat_template
            .as_ref()
            .context("this model has no chat template")?;
        t.render(
            messages,
            tools,
            true,
            self.bos_token.as_deref(),
            self.eos_token.as_deref(),
        )
    }
}

/// A whitespace word-level tokenizer of `vocab_size` words: `<unk>`, `</s>`, `w2`, `w3`, ….
pub fn word_level(vocab_size: usize) -> Result<tokenizers::Tokenizer> {
    let vocab: HashMap<String, u32> = (0..vocab_size as u32)
        .map(|i| {
            let word = match i {
                0 => "<unk>".to_string(),
                1 => "</s>".to_string(),
                i => format!("w{i}"),
            };
            (word, i)
        })
        .collect();
    let model = WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token("<unk>".into())
        .build()
        .map_err(|e| anyhow!("{e}"))?;
    let mut tok = tokenizers::Tokenizer::new(model);
    tok.with_pre_tokenizer(Some(Whitespace {}));
    Ok(tok)
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text)
        .map(Some)
        .with_context(|| format!("{} is not valid JSON", path.display()))
}

/// A special token given as a string or as `{"content": ...}`.
fn token_string(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        o => o.get("content")?.as_str().map(String::from),
    }
}

fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
    let path = dir.join("tokenizer.json");
    let inner =
        tokenizers::Tokenizer::from_file(&path).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let cfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or_default();
    let bos_token = token_string(cfg.get("bos_token"));
    let eos_token = token_string(cfg.get("eos_token"));
    let template_file = dir.join("chat_template.jinja");
    let template = match cfg.get("chat_template") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        // A list of named templates: the default one is what a chat request uses.
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(String::from)),
        _ if template_file.exists() => Some(std::fs::read_to_string(&template_file)?),
        _ => None,
    };
    let mut eos_token_ids: Vec<u32> = eos_token
        .as_deref()
        .and_then(|t| inner.token_to_id(t))
        .into_iter()
        .collect();
    let gen = read_json(&dir.join("generation_config.json"))?.unwrap_or_default();
    match gen.get("eos_token_id") {
        Some(serde_json::Value::Array(a)) => {
            eos_token_ids.extend(a.iter().filter_map(|v| v.as_u64()).map(|v| v as u32))
        }
        Some(v) => eos_token_ids.extend(v.as_u64().map(|v| v as u32)),
        None => {}
    }
    eos_token_ids.sort_unstable();
    eos_token_ids.dedup();
    Tokenizer::new(inner, eos_token_ids, bos_token, eos_token, template)
}

/// The pre-tokenizer regexes of llama.cpp's `tokenizer.ggml.pre` names.
fn gguf_pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper> {
    let byte_level = |regex: bool| ByteLevel::new(false, true, regex);
    let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
        Ok(Split::new(
            SplitPattern::Regex(pattern.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| anyhow!("bad pre-tokenizer regex: {e}"))?
        .into())
    };
    Ok(match pre {
        // GPT-2's regex with every digit its own token (SmolLM, StarCoder).
        "smollm" | "starcoder" | "refact" => Sequence::new(vec![Digits::new(true).into(), byte_level(true).into()]).into(),
        "gpt-2" | "default" => byte_level(true).into(),
        "llama-bpe" | "llama3" => Sequence::new(vec![
            split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")?,
            byte_level(false).into(),
        ])
        .into(),
        "qwen2" => Sequence::new(vec![
            split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")?,
            byte_level(false).into(),
        ])
        .into(),
        other => bail!("GGUF pre-tokenizer `{other}` is not supported (supported: smollm, gpt-2, llama-bpe, qwen2)"),
    })
}

fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
    let get = |k: &str| file.get(k);
    let model = get("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .context("GGUF has no tokenizer.ggml.model")?;
    if model != "gpt2" {
        bail!("GGUF tokenizer model `{model}` is not supported (supported: gpt2 byte-level BPE)");
    }
    let strings = |k: &str| -> Result<Vec<String>> {
        get(k)
            .and_then(Value::as_array)
            .with_context(|| format!("GGUF has no {k}"))?
            .iter()
            .map(|v| {
                v.as_str()
                    .map(String::from)
                    .with_context(|| format!("{k} holds a non-string"))
            })
            .collect()
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .with_context(|| format!("malformed merge `{m}`"))
        })
        .collect::<Result<Vec<_>>>()?;
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| anyhow!("cannot build BPE: {e}"))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let pre = get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    inner.with_pre_tokenizer(Some(gguf_pre_tokenizer(pre)?));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    // Control (3) and user-defined (4) tokens are matched whole before BPE runs.
    let types = get("tokenizer.ggml.token_type")
        .and_then(Value::as_array)
        .unwrap_or(&[]);
    let added: Vec<AddedToken> = types
        .iter()
        .zip(&tokens)
        .filter_map(|(t, tok)| match t.as_u64() {
            Some(3) => Some(AddedToken::from(tok.clone(), true)),
            Some(4) => Some(AddedToken::from(tok.clone(), false)),
            _ => None,
        })
        .collect();
    inner.add_special_tokens(&added);
    let id_token = |k: &str| {
        get(k)
            .and_then(Value::as_u64)
            .and_then(|id| tokens.get(id as usize).cloned())
    };
    let bos_token = id_token("tokenizer.ggml.bos_token_id");
    let eos_token = id_token("tokenizer.ggml.eos_token_id");
    if get("tokenizer.ggml.add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or(false)
    {
        let bos = bos_token
            .clone()
            .context("add_bos_token is set but there is no BOS token")?;
        let id = vocab_id(&tokens, &bos);
        let post = TemplateProcessing::builder()
            .try_single(format!("{bos} $A"))
            .and_then(|b| b.try_pair(format!("{bos} $A {bos} $B")))
            .map_err(|e| anyhow!("{e}"))?
            .special_tokens(vec![(bos.clone(), id)])
            .build()
            .map_err(|e| anyhow!("cannot build BOS post-processor: {e}"))?;
        inner.with_post_processor(Some(post));
    }
    let eos_token_ids = get("tokenizer.ggml.eos_token_id")
        .and_then(Value::as_u64)
        .map(|v| v as u32)
        .into_iter()
        .collect();
    let template = get("tokenizer.chat_template")
        .and_then(Value::as_str)
        .map(String::from);
    Tokenizer::new(inner, eos_token_ids, bos_token, eos_token, template)
}

fn vocab_id(tokens: &[String], t: &str) -> u32 {
    tokens.iter().position(|x| x == t).unwrap_or(0) as u32
}
