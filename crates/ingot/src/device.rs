//! Which backend runs the model (`--device`) and how the model is read (`--load-format`),
//! shared by every command that loads one.

use anyhow::{bail, Context, Result};
use ingot_backend::cpu::CpuBackend;
use ingot_backend::Backend;
use ingot_model::{Checkpoint, Model, Pooling, Tokenizer, WeightDType};
use std::path::PathBuf;
use std::str::FromStr;

/// `--device`: `auto` takes the first CUDA GPU when one is found, else the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Auto,
    Cpu,
    Cuda(usize),
    /// Adapter N of wgpu's, most preferred first (discrete, integrated, virtual, CPU).
    Wgpu(usize),
}

impl FromStr for Device {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => Device::Auto,
            "cpu" => Device::Cpu,
            "cuda" => Device::Cuda(0),
            "wgpu" => Device::Wgpu(0),
            _ => match (
                s.strip_prefix("cuda:").map(str::parse),
                s.strip_prefix("wgpu:").map(str::parse),
            ) {
                (Some(Ok(n)), _) => Device::Cuda(n),
                (_, Some(Ok(n))) => Device::Wgpu(n),
                _ => {
                    bail!("unknown device `{s}` (expected auto, cpu, cuda, cuda:N, wgpu or wgpu:N)")
                }
            },
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LoadFormat {
    /// A .gguf file or an HF safetensors directory.
    Auto,
    /// Random weights at the shapes of the directory's config.json (benchmarks).
    Dummy,
}

/// `--task`: what the model serves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Task {
    /// Embeddings where the model's files declare a pooling (sentence-transformers'
    /// modules.json, a GGUF's pooling_type), else text generation.
    #[default]
    Auto,
    Generate,
    /// Embeddings (`/v1/embeddings`), with the pooling the model's files declare or else
    /// the last token's hidden state, L2-normalized.
    Embed,
}

/// The flags that say whether and how the model embeds.
#[derive(clap::Args, Clone, Debug)]
pub struct TaskArgs {
    /// auto (embeddings where the model's files declare a pooling, else generation),
    /// generate, or embed (/v1/embeddings; the chat and completions endpoints refuse).
    #[arg(long, value_enum, default_value = "auto")]
    pub task: Task,
    /// JSON that overrides the model's config.json, as vLLM's flag; ingot takes
    /// `is_matryoshka` and `matryoshka_dimensions` (which `dimensions` an embedding
    /// request may ask for) and refuses other keys.
    #[arg(long)]
    pub hf_overrides: Option<String>,
}

/// The flags that say which model to load, where, and how.
#[derive(clap::Args, Clone)]
pub struct ModelArgs {
    /// An HF model directory or a .gguf file.
    #[arg(long)]
    pub model: PathBuf,
    /// auto keeps the checkpoint's dtype (GGUF blocks stay quantized where the device has
    /// kernels for them, else become the device's activation dtype); f32, f16 or bf16
    /// convert.
    #[arg(long, default_value = "auto")]
    pub dtype: WeightDType,
    /// fp8: quantize a 16- or 32-bit checkpoint's projections at load to FP8 (e4m3, a scale
    /// per 128 values), as vLLM's flag; the embedding table, output projection and routers
    /// stay as they are. On CUDA and the CPU; activations are the device's (f16 on CUDA).
    #[arg(long, value_enum)]
    pub quantization: Option<Quantization>,
    /// cpu, cuda[:N], wgpu[:N] (Metal on macOS, Vulkan elsewhere), or auto (a CUDA GPU
    /// when one is found, else the CPU).
    #[arg(long, default_value = "auto")]
    pub device: Device,
    /// CPU worker threads (default: one per physical core).
    #[arg(long)]
    pub threads: Option<usize>,
    #[arg(long, value_enum, default_value = "auto")]
    pub load_format: LoadFormat,
    /// Take the tokenizer (and chat template) from this HF directory or .gguf file instead
    /// of the model's: with `--load-format dummy`, real text at a model's shapes.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Split the model's heads and MLP over this many devices, `cuda:N` and the ones after
    /// it; on the CPU the ranks share the threads, which tests the split without GPUs.
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: usize,
}

/// `--quantization`: the methods a checkpoint is quantized by at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Quantization {
    Fp8,
}

/// Work that runs on whichever backend `--device` picked: on `devices`, one device or a
/// tensor-parallel group's in rank order.
pub trait OnBackend {
    type Output;
    fn run<B: Backend + 'static>(self, devices: Vec<B>) -> Result<Self::Output>;
}

/// What the run is on: the device's name, and the group's size where the model is split.
pub fn devices_name<B: Backend>(devices: &[B]) -> String {
    match devices {
        [one] => one.name(),
        _ => format!(
            "{} x {} (tensor parallel)",
            devices[0].name(),
            devices.len()
        ),
    }
}

/// A model loaded on its devices: each rank's backend and share, the first rank's first.
pub type Ranks<B> = Vec<(B, Model<B>)>;

#[cfg(feature = "cuda")]
fn cuda_count() -> usize {
    ingot_backend::cuda::device_count()
}

#[cfg(not(feature = "cuda"))]
fn cuda_count() -> usize {
    0
}

impl ModelArgs {
    /// Opens the device and runs `job` on it.
    pub fn on_backend<J: OnBackend>(&self, job: J) -> Result<J::Output> {
        let device = match self.device {
            Device::Auto if cuda_count() > 0 => Device::Cuda(0),
            Device::Auto => Device::Cpu,
            d => d,
        };
        tracing::info!("device: {device:?} (asked for {:?})", self.device);
        let size = self.tensor_parallel_size;
        if size == 0 {
            bail!("--tensor-parallel-size must be at least 1");
        }
        match device {
            Device::Cuda(n) => self.on_cuda(n, job),
            Device::Wgpu(_) if size > 1 => {
                bail!("--tensor-parallel-size {size}: tensor parallelism runs on CUDA and the CPU, not on wgpu")
            }
            Device::Wgpu(n) => self.on_wgpu(n, job),
            _ => {
                // Ranks run at once, so they split the cores rather than each taking all.
                let threads = self
                    .threads
                    .unwrap_or_else(ingot_backend::cpu::default_threads)
                    .div_ceil(size);
                let devices = (0..size)
                    .map(|_| CpuBackend::new(Some(threads)))
                    .collect::<Result<_>>()?;
                job.run(devices)
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn on_cuda<J: OnBackend>(&self, first: usize, job: J) -> Result<J::Output> {
        let devices = (first..first + self.tensor_parallel_size)
            .map(ingot_backend::cuda::CudaBackend::new)
            .collect::<Result<_>>()?;
        job.run(devices)
    }

    #[cfg(not(feature = "cuda"))]
    fn on_cuda<J: OnBackend>(&self, _ordinal: usize, _job: J) -> Result<J::Output> {
        bail!("this ingot was built without the `cuda` feature")
    }

    #[cfg(feature = "wgpu")]
    fn on_wgpu<J: OnBackend>(&self, ordinal: usize, job: J) -> Result<J::Output> {
        use ingot_backend::wgpu::{Options, WgpuBackend};
        job.run(vec![WgpuBackend::new(ordinal, Options::from_env()?)?])
    }

    #[cfg(not(feature = "wgpu"))]
    fn on_wgpu<J: OnBackend>(&self, _ordinal: usize, _job: J) -> Result<J::Output> {
        bail!("this ingot was built without the `wgpu` feature")
    }

    fn checkpoint(&self) -> Result<Checkpoint> {
        match self.load_format {
            LoadFormat::Auto => Checkpoint::open(&self.model),
            LoadFormat::Dummy => Checkpoint::dummy(&self.model),
        }
    }

    /// The pooling `--task` gives the model: `None` where it generates text.
    pub fn pooling(&self, args: &TaskArgs) -> Result<Option<Pooling>> {
        let overrides: serde_json::Map<String, serde_json::Value> = match &args.hf_overrides {
            Some(text) => {
                serde_json::from_str(text).context("--hf-overrides must be a JSON object")?
            }
            None => Default::default(),
        };
        if let Some(k) = overrides
            .keys()
            .find(|k| !["is_matryoshka", "matryoshka_dimensions"].contains(&k.as_str()))
        {
            bail!("--hf-overrides: `{k}` is not supported (is_matryoshka and matryoshka_dimensions are)");
        }
        let task = args.task;
        if task == Task::Generate {
            if !overrides.is_empty() {
                bail!("--hf-overrides sets embedding options, but --task is generate");
            }
            return Ok(None);
        }
        let declared = Pooling::declared(&self.checkpoint()?)?;
        let pooling = match (task, declared) {
            (Task::Auto, None) => return Ok(None),
            (_, Some(p)) => {
                tracing::info!("task embed ({:?}): the model's files declare it", task);
                p
            }
            (_, None) => {
                tracing::info!("task embed: the model's files declare no pooling; last token");
                Pooling::last_token()
            }
        };
        let mut pooling = pooling;
        if let Some(dims) = overrides.get("matryoshka_dimensions") {
            let dims: Vec<usize> = serde_json::from_value(dims.clone())
                .context("--hf-overrides: matryoshka_dimensions must be a list of sizes")?;
            pooling.matryoshka = Some(dims);
        } else if let Some(on) = overrides.get("is_matryoshka") {
            let on = on
                .as_bool()
                .context("--hf-overrides: is_matryoshka must be true or false")?;
            pooling.matryoshka = on.then(Vec::new);
        }
        tracing::info!(
            "embeddings: {} pooling{}{}",
            pooling.kind.as_str(),
            if pooling.normalize {
                ", L2-normalized"
            } else {
                ""
            },
            if pooling.matryoshka.is_some() {
                ", Matryoshka dimensions"
            } else {
                ""
            }
        );
        Ok(Some(pooling))
    }

    /// What the matrices are converted to: `--dtype`, or `--quantization`'s format.
    pub fn weight_dtype(&self) -> Result<WeightDType> {
        match (self.quantization, self.dtype) {
            (Some(Quantization::Fp8), WeightDType::Auto) => Ok(WeightDType::Fp8),
            (Some(Quantization::Fp8), other) => bail!(
                "--dtype {} with --quantization fp8: the FP8 matrices take the device's \
                 activations (f16 on CUDA, f32 on the CPU and wgpu); leave --dtype auto",
                format!("{other:?}").to_lowercase()
            ),
            (None, WeightDType::Fp8) => bail!("--dtype fp8: FP8 matrices are --quantization fp8"),
            (None, dtype) => Ok(dtype),
        }
    }

    /// Loads the model onto `devices` (a tensor-parallel group's, each rank's share).
    pub fn load<B: Backend + 'static>(&self, devices: Vec<B>) -> Result<(Ranks<B>, Tokenizer)> {
        let ckpt = self.checkpoint()?;
        // The weights first: a checkpoint's config errors (an unsupported architecture)
        // say more than a missing tokenizer would.
        let ranks = ingot_model::load_tensor_parallel(devices, &ckpt, self.weight_dtype()?)?;
        let Some(path) = &self.tokenizer else {
            return Ok((ranks, Tokenizer::from_checkpoint(&ckpt)?));
        };
        let tokenizer = Tokenizer::open(path)?;
        let vocab = ranks[0].1.config.vocab_size;
        if tokenizer.vocab_size() > vocab {
            bail!(
                "the tokenizer of {} has {} tokens, more than the model's vocabulary of {}",
                path.display(),
                tokenizer.vocab_size(),
                vocab
            );
        }
        tracing::info!("tokenizer from {}", path.display());
        Ok((ranks, tokenizer))
    }
}
