//! The GGUF tokenizer and chat template reproduce HF transformers exactly.

use ingot_model::chat::Message;
use ingot_model::testing::{fixtures_dir, test_model_path};
use ingot_model::{Checkpoint, Tokenizer};
use serde_json::Value;

fn fixture(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures_dir().join(name)).unwrap()).unwrap()
}

fn tokenizer() -> Option<Tokenizer> {
    let path = test_model_path()?;
    Some(Tokenizer::from_checkpoint(&Checkpoint::open(&path).unwrap()).unwrap())
}

#[test]
fn token_ids_match_transformers() {
    let Some(tok) = tokenizer() else { return };
    let cases = fixture("tokenizer.json");
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 30);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want: Vec<u32> = c["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tok.encode(text, true).unwrap(), want, "ids of {text:?}");
        // Decoding gives the text back (byte-level BPE is lossless).
        assert_eq!(
            tok.decode(&want, false).unwrap(),
            text,
            "decode of {text:?}"
        );
    }
}

#[test]
fn chat_template_matches_transformers() {
    let Some(tok) = tokenizer() else { return };
    let cases = fixture("chat.json");
    for c in cases["cases"].as_array().unwrap() {
        let messages: Vec<Message> = serde_json::from_value(c["messages"].clone()).unwrap();
        assert_eq!(
            tok.apply_chat_template(&messages, None).unwrap(),
            c["rendered"].as_str().unwrap()
        );
    }
}
