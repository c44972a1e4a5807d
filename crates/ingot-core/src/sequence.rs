//! One sequence being generated: its tokens, how many have their KV in the cache, and the
//! blocks that hold them.

use crate::block_pool::{BlockHash, BlockId};

pub type SeqId = u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    Abort,
    /// The request could not go on (its structured-output constraint failed).
    Error,
}

impl FinishReason {
    /// The name OpenAI's `finish_reason` and the metrics' label use.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Sequence {
    pub id: SeqId,
    /// Prompt followed by the generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_tokens: usize,
    /// Leading tokens whose keys and values are in the cache.
    pub num_computed: usize,
    /// Physical block of each logical block.
    pub block_table: Vec<BlockId>,
    /// Hashes of the leading full, computed blocks (registered in the prefix cache).
    pub block_hashes: Vec<BlockHash>,
}

impl Sequence {
    pub fn new(id: SeqId, prompt: Vec<u32>, max_tokens: usize) -> Sequence {
        Sequence {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            max_tokens,
            num_computed: 0,
            block_table: vec![],
            block_hashes: vec![],
        }
    }

    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    pub fn num_output(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to run through the model before the next token can be sampled.
    pub fn num_uncomputed(&self) -> usize {
        self.tokens.len() - self.num_computed
    }
}
