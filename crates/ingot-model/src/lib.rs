//! Models: configs, checkpoints (HF safetensors directories, GGUF files), tokenizers and
//! chat templates, and the forward pass as a sequence of backend ops.

pub mod chat;
pub mod checkpoint;
pub mod config;
mod dummy;
pub mod forward;
pub mod fp8_checkpoint;
pub mod gguf;
pub mod moe;
pub mod pooling;
pub mod reference;
pub mod rope;
pub mod synthetic;
pub mod tensor_parallel;
pub mod testing;
pub mod tokenizer;
pub mod weights;

pub use checkpoint::Checkpoint;
pub use config::{Arch, ModelConfig};
pub use forward::{Activations, Head, KvCache, Model, StepBuffers};
pub use pooling::{Pooling, PoolingType};
pub use tensor_parallel::TpRank;
pub use tokenizer::Tokenizer;
pub use weights::WeightDType;

use anyhow::Result;
use ingot_backend::{Backend, Collective};
use std::path::Path;
use std::sync::Arc;

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
    Ok(Model {
        config,
        weights,
        collective: None,
    })
}

/// Loads a checkpoint over a tensor-parallel group of `devices` (`devices[r]` is rank
/// `r`): every rank's backend with its share of the weights, in rank order. One device
/// loads the whole model.
pub fn load_tensor_parallel<B: Backend + 'static>(
    devices: Vec<B>,
    ckpt: &Checkpoint,
    dtype: WeightDType,
) -> Result<Vec<(B, Model<B>)>> {
    let devices = match <[B; 1]>::try_from(devices) {
        Ok([device]) => {
            let model = load_model(&device, ckpt, dtype)?;
            return Ok(vec![(device, model)]);
        }
        Err(devices) => devices,
    };
    let group = B::tensor_parallel_group(&devices)?;
    // Ranks load at once: each converts and uploads only its share.
    std::thread::scope(|s| {
        let loading: Vec<_> = devices
            .into_iter()
            .zip(group)
            .map(|(d, c)| {
                s.spawn(move || {
                    let model = load_model_shard(&d, ckpt, dtype, c)?;
                    Ok((d, model))
                })
            })
            .collect();
        loading
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a rank panicked while loading")))
            })
            .collect()
    })
}

/// Loads the share of a checkpoint's weights that `collective`'s rank holds onto
/// `backend` ([`tensor_parallel`]), as a model that adds its partial sums across the group.
pub fn load_model_shard<B: Backend>(
    backend: &B,
    ckpt: &Checkpoint,
    dtype: WeightDType,
    collective: Arc<dyn Collective<B>>,
) -> Result<Model<B>> {
    let full = ckpt.config()?;
    let tp = TpRank {
        rank: collective.rank(),
        size: collective.world_size(),
    };
    let weights = weights::Weights::load_shard(backend, ckpt, &full, tp, dtype)?;
    let config = tp.shard_config(&full)?;
    tracing::info!(
        "rank {} of {}: {} heads / {} kv heads, MLP width {}, weights {:.1} MiB",
        tp.rank,
        tp.size,
        config.num_heads,
        config.num_kv_heads,
        config.intermediate_size,
        weights.bytes as f64 / (1 << 20) as f64
    );
    Ok(Model {
        config,
        weights,
        collective: Some(collective),
    })
}
