//! Incremental detokenization on the real tokenizer: no delta carries a broken character,
//! and the deltas add up to the full decode.

use ingot_engine::detokenizer::Detokenizer;
use ingot_model::testing::test_model_path;
use ingot_model::{Checkpoint, Tokenizer};

#[test]
fn deltas_never_split_characters_and_add_up_to_the_decode() {
    let Some(path) = test_model_path() else {
        return;
    };
    let tok = Tokenizer::from_checkpoint(&Checkpoint::open(&path).unwrap()).unwrap();
    let prompt = tok.encode("Translate:", false).unwrap();
    for text in [
        "日本語のテキストです。",
        "emoji: 😀🎉👍🏽 and 🇫🇷 flags",
        "Grüße, naïve café — ok",
        "👨‍👩‍👧‍👦 family<|im_end|>",
    ] {
        let ids = tok.encode(text, false).unwrap();
        let mut d = Detokenizer::new(&prompt, true);
        let mut out = String::new();
        for &id in &ids {
            let delta = d.push(&tok, id).unwrap();
            assert!(
                !delta.contains('\u{FFFD}'),
                "{text:?}: a delta holds a broken character"
            );
            out.push_str(&delta);
        }
        out.push_str(&d.flush(&tok).unwrap());
        assert_eq!(out, tok.decode(&ids, true).unwrap(), "{text:?}");
    }
}
