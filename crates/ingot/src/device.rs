//! Which backend runs the model (`--device`) and how the model is read (`--load-format`),
//! shared by every command that loads one.

use anyhow::{bail, Result};
use ingot_backend::cpu::CpuBackend;
use ingot_backend::Backend;
use ingot_model::{Checkpoint, Model, Tokenizer, WeightDType};
use std::path::PathBuf;
use std::str::FromStr;

/// `--device`: `auto` takes the first CUDA GPU when one is found, else the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Auto,
    Cpu,
    Cuda(usize),
}

impl FromStr for Device {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => Device::Auto,
            "cpu" => Device::Cpu,
            "cuda" => Device::Cuda(0),
            _ => match s.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(n)) => Device::Cuda(n),
                _ => bail!("unknown device `{s}` (expected auto, cpu, cuda or cuda:N)"),
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

/// The flags that say which model to load, where, and how.
#[derive(clap::Args, Clone)]
pub struct ModelArgs {
    /// An HF model directory or a .gguf file.
    #[arg(long)]
    pub model: PathBuf,
    /// auto keeps the checkpoint's dtype (GGUF stays quantized on the CPU); f32, f16 or
    /// bf16 convert.
    #[arg(long, default_value = "auto")]
    pub dtype: WeightDType,
    /// cpu, cuda[:N], or auto (a CUDA GPU when one is found, else the CPU).
    #[arg(long, default_value = "auto")]
    pub device: Device,
    /// CPU worker threads (default: one per physical core).
    #[arg(long)]
    pub threads: Option<usize>,
    #[arg(long, value_enum, default_value = "auto")]
    pub load_format: LoadFormat,
}

/// Work that runs on whichever backend `--device` picked.
pub trait OnBackend {
    type Output;
    fn run<B: Backend + 'static>(self, backend: B) -> Result<Self::Output>;
}

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
        match device {
            Device::Cuda(n) => self.on_cuda(n, job),
            _ => job.run(CpuBackend::new(self.threads)?),
        }
    }

    #[cfg(feature = "cuda")]
    fn on_cuda<J: OnBackend>(&self, ordinal: usize, job: J) -> Result<J::Output> {
        job.run(ingot_backend::cuda::CudaBackend::new(ordinal)?)
    }

    #[cfg(not(feature = "cuda"))]
    fn on_cuda<J: OnBackend>(&self, _ordinal: usize, _job: J) -> Result<J::Output> {
        bail!("this ingot was built without the `cuda` feature")
    }

    /// Loads the model onto `backend`.
    pub fn load<B: Backend>(&self, backend: &B) -> Result<(Model<B>, Tokenizer)> {
        let ckpt = match self.load_format {
            LoadFormat::Auto => Checkpoint::open(&self.model)?,
            LoadFormat::Dummy => Checkpoint::dummy(&self.model)?,
        };
        ingot_model::load_checkpoint(backend, &ckpt, self.dtype)
    }
}
