//! Models: configs, checkpoints (HF safetensors directories, GGUF files), tokenizers and
//! chat templates, and the forward pass as a sequence of backend ops.

pub mod chat;
pub mod checkpoint;
pub mod config;
mod dummy;
pub mod forward;
pub mod gguf;
pub mod moe;
pub mod pooling;
pub mod reference;
pub mod rope;
pub mod synthetic;
pub mod testing;
pub mod tokenizer;
pub mod weights;

pub use checkpoint::Checkpoint;
pub use config::{Arch, ModelConfig};
pub use forward::{Activations, Head, KvCache, Model, StepBuffers};
pub use pooling::{Pooling, PoolingType};
pub use tokenizer::Tokenizer;
pub use weights::WeightDType;

use anyhow::Result;
use ingot_backend::Backend;
use std::path::Path;

/// Loads the model at `path` (HF directory or `.gguf`) onto `backend`, with its tokenizer.
pub fn load<B: Backend>(
    backend: &B,
    path: &Path,
    dtype: WeightDType,
) -> Result<(Model<B>, Tokenizer)> {
    load_checkpoint(backend, &Checkpoint::open(path)?, dtype)
}

/// Loads an opened checkpoint (a file, a directory or dummy weights) onto `backend`.
pub fn load_checkpoint<B: Backend>(
    backend: &B,
    ckpt: &Checkpoint,
    dtype: WeightDType,
) -> Result<(Model<B>, Tokenizer)> {
    // The weights first: a checkpoint's config errors (an unsupported architecture) say
    // more than a missing tokenizer would.
    let model = load_model(backend, ckpt, dtype)?;
    Ok((model, Tokenizer::from_checkpoint(ckpt)?))
}

/// Loads a checkpoint's weights onto `backend`, without its tokenizer.
pub fn load_model<B: Backend>(
    backend: &B,
    ckpt: &Checkpoint,
    dtype: WeightDType,
) -> Result<Model<B>> {
    let path = ckpt.path();
    let config = ckpt.config()?;
    let weights = weights::Weights::load(backend, ckpt, &config, dtype)?;
    tracing::info!(
        "loaded {:?} from {}: {} layers, hidden {}, {} heads / {} kv heads, vocab {}, weights {:.1} MiB",
        config.arch,
        path.display(),
        config.num_layers,
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.vocab_size,
        weights.bytes as f64 / (1 << 20) as f64
    );
    Ok(Model { config, weights })
}
